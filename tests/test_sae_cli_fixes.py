"""`tensoralg sae` fixes: a new run never mixes with an earlier run's files in --out, the
resume-past---steps message names the run's real step, the shared options in docs/cli.md match
the parsers, NaN/inf errors name the first bad row, TrainConfig errors name the CLI flags."""

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tensoralg.cli import build_parser, main
from tensoralg.sae.training import as_activations

FAST = ["--batch-size", "32", "--no-progress"]


def test_resume_past_steps_reports_the_runs_step(tmp_path, capsys):
    out = tmp_path / "s0"
    common = ["sae", "train", "--synthetic", "6,8,2,128", *FAST]
    assert main([*common, "--steps", "7", "--out", str(out)]) == 0
    capsys.readouterr()
    for steps in ("4", "0"):
        assert main([*common, "--steps", steps, "--resume", str(out), "--out", str(out)]) == 0
        line = capsys.readouterr().out.strip().splitlines()[0]
        assert "already at step 7" in line and ": step 7," in line, line
        assert f"--steps {steps}" in line and "initialized" not in line, line
    assert json.loads((out / "cfg.json").read_text())["train_step"] == 7


def _leaves(parser, name=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(name), parser
    for action in subs:
        for child_name, child in action.choices.items():
            yield from _leaves(child, (*name, child_name))


def test_shared_options_in_the_docs_match_every_command():
    """docs/cli.md's table of --seed / --no-progress per command, against the real parsers;
    --threads and --json are stated for every command."""
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    section = text.split("## Options every command takes", 1)[1].split("\n## ", 1)[0]
    leaves = dict(_leaves(build_parser()))
    claimed = {}
    for row in re.findall(r"^\| (`.*?) \| (.*?) \| (.*?) \|$", section, re.M):
        for cmd in re.findall(r"`([^`]+)`", row[0]):
            names = [n for n in leaves if n.startswith(cmd[:-1])] if cmd.endswith("*") else [cmd]
            for n in names:
                claimed[n] = (row[1].startswith("yes"), row[2].startswith("yes"))
    assert set(claimed) == set(leaves), set(leaves) ^ set(claimed)
    for name, parser in leaves.items():
        opts = {o for a in parser._actions for o in a.option_strings}
        assert {"--threads", "--json"} <= opts, name
        assert ("--seed" in opts, "--no-progress" in opts) == claimed[name], name
    with pytest.raises(SystemExit):   # what the tester ran: refused, as the docs now say
        build_parser().parse_args(["sae", "activations", "--out", "a.npy", "--no-progress"])


def test_nan_error_names_the_first_bad_row(tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((200, 5)).astype(np.float32)
    x[3, 2], x[150, 0] = np.nan, np.inf
    np.save(tmp_path / "bad.npy", x)
    assert main(["sae", "train", "--data", str(tmp_path / "bad.npy"), "--d-sae", "8", "--k", "2",
                 *FAST, "--out", str(tmp_path / "r")]) == 2
    assert "--data: contains NaN or inf (first in row 3)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert main(["sae", "train", "--synthetic", "5,8,2,128", "--steps", "2", *FAST,
                 "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "a"),
                 "--data", str(tmp_path / "bad.npy")]) == 2
    assert "--data: contains NaN or inf (first in row 3)" in capsys.readouterr().err
    # a later chunk of a memmap (rows are checked 65,536 at a time), and a tensor
    big = np.zeros((70_000, 2), dtype=np.float32)
    big[66_000, 1] = np.nan
    np.save(tmp_path / "big.npy", big)
    with pytest.raises(ValueError, match=r"first in row 66000\)"):
        as_activations(str(tmp_path / "big.npy"), "--data")
    x[3, 2] = 0.0                                       # now only the inf in row 150
    with pytest.raises(ValueError, match=r"first in row 150\)"):
        as_activations(torch.from_numpy(x), "x")


def test_train_config_errors_name_the_flags(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32))
    data = ["sae", "train", "--data", str(tmp_path / "x.npy"), "--d-sae", "8", "--k", "2",
            "--no-progress", "--out", str(tmp_path / "r")]
    for extra, want in ((["--batch-size", "0"], "--batch-size: expected an int >= 1, got 0"),
                        (["--log-every", "0"], "--log-every: expected an int >= 1, got 0"),
                        (["--lr", "0"], "--lr: expected a finite number > 0, got 0.0"),
                        (["--lr", "nan"], "--lr: expected a finite number > 0"),
                        (["--lr-end", "1"], "--lr-end: expected 0 <= lr_end"),
                        (["--batch-size", "100"], "--batch-size: 100 exceeds the number of "
                                                  "samples 64")):
        assert main([*data, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], (extra, err)
    assert not (tmp_path / "r").exists()
