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
from tensoralg.sae.models import SparseAutoencoder
from tensoralg.sae.training import as_activations

FAST = ["--batch-size", "32", "--no-progress"]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_new_run_into_an_earlier_run_replaces_it_as_a_whole(tmp_path, capsys):
    """The tester's case: a synthetic run (with ground_truth/) then a --data run into the same
    --out; the second run must not leave the first's ground_truth next to its own SAE."""
    out = tmp_path / "s0"
    assert main(["sae", "train", "--synthetic", "6,8,2,128", "--steps", "3", *FAST,
                 "--out", str(out)]) == 0
    assert (out / "ground_truth").is_dir()
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((128, 5)).astype(np.float32))
    assert main(["sae", "train", "--data", str(tmp_path / "x.npy"), "--d-sae", "10", "--k", "3",
                 "--steps", "2", *FAST, "--out", str(out)]) == 0
    cfg = json.loads((out / "cfg.json").read_text())
    assert (cfg["d_in"], cfg["d_sae"], cfg["train_step"]) == (5, 10, 2)
    assert "ground_truth" not in _names(out)
    assert _names(tmp_path) == ["s0", "x.npy"]            # no staging folder left behind
    # --resume R --out O (O another earlier run) replaces O as a whole too, and keeps R
    r = tmp_path / "r"
    assert main(["sae", "train", "--synthetic", "5,7,2,128", "--steps", "2", *FAST,
                 "--out", str(r)]) == 0
    assert main(["sae", "train", "--data", str(tmp_path / "x.npy"), "--steps", "4", *FAST,
                 "--resume", str(out), "--out", str(r)]) == 0
    assert "ground_truth" not in _names(r)
    assert json.loads((r / "cfg.json").read_text())["train_step"] == 4
    assert json.loads((out / "cfg.json").read_text())["train_step"] == 2
    # the --resume folder itself is continued in place: its ground truth stays
    assert main(["sae", "train", "--synthetic", "6,8,2,128", "--steps", "3", *FAST,
                 "--out", str(out)]) == 0
    assert main(["sae", "train", "--synthetic", "6,8,2,128", "--steps", "5", *FAST,
                 "--resume", str(out), "--out", str(out)]) == 0
    assert (out / "ground_truth").is_dir()
    assert json.loads((out / "cfg.json").read_text())["train_step"] == 5


def test_diverged_run_leaves_the_earlier_run_unchanged(tmp_path, monkeypatch, capsys):
    out = tmp_path / "s0"
    common = ["sae", "train", "--synthetic", "6,8,2,128", *FAST, "--out", str(out)]
    assert main([*common, "--steps", "3"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    real = SparseAutoencoder.loss
    calls = {"n": 0}

    def flaky(self, x, dead_mask=None, **kw):
        res = real(self, x, dead_mask, **kw)
        calls["n"] += 1
        if calls["n"] > 4:
            res["loss"] = res["loss"] * float("nan")
        return res

    monkeypatch.setattr(SparseAutoencoder, "loss", flaky)
    capsys.readouterr()
    # checkpoints at steps 2 and 4 are written into the staging folder before step 5 diverges
    assert main([*common, "--steps", "10", "--ckpt-every", "2"]) == 1
    err = capsys.readouterr().err
    assert f"{out} still holds the earlier run, unchanged" in err and ".partial" not in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert _names(tmp_path) == ["s0"]


def test_refuses_replacing_the_current_folder(tmp_path, monkeypatch, capsys):
    out = tmp_path / "s0"
    common = ["sae", "train", "--synthetic", "6,8,2,128", "--steps", "2", *FAST]
    assert main([*common, "--out", str(out)]) == 0
    monkeypatch.chdir(out)
    assert main([*common, "--out", "."]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "current folder" in err, err


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
