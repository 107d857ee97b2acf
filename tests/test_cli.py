"""The audit command line: registration, the demo, and errors for bad paths and options."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensoralg.cli import build_parser, main


def test_commands_are_registered():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for cmd in ("demo", "audit", "compare", "matrix"):
        assert cmd in sub.choices
    audit = sub.choices["audit"]
    asub = next(a for a in audit._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(asub.choices) == {"backdoor", "forgetting", "grokking", "language"}


def test_demo_prints_a_readable_table(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "tensor sim (slice)" in text and "<- target" in text
    assert "attack success rate" in text and "clean test accuracy" in text
    for name in ("cka_logits", "output_cosine", "js_divergence", "weight_cosine"):
        assert name in text
    res = json.loads((tmp_path / "backdoor.json").read_text())
    assert res["command"] == "audit backdoor" and res["config"]["steps"] == 500
    assert res["finding"]["target_slice_is_lowest"]


def test_help_is_fast_and_lists_commands():
    out = subprocess.run([sys.executable, "-m", "tensoralg", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for cmd in ("demo", "audit", "compare", "matrix"):
        assert cmd in out.stdout


@pytest.mark.parametrize("argv", [
    ["audit"],                                   # missing audit name
    ["audit", "poisoning"],                      # unknown audit
    ["audit", "backdoor", "--method", "fast"],   # unknown method
    ["audit", "backdoor", "--steps", "0"],       # non-positive size
    ["audit", "forgetting", "--stage-steps", "x"],
    ["matrix"],                                  # no checkpoints
    ["compare", "only-one"],
    ["demo", "--frobnicate"],
])
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_an_unknown_option_is_reported_with_the_commands_own_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "a", "b", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tensoralg compare") and "unrecognized arguments: --bogus" in err


def test_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("not a folder")
    assert main(["demo", "--out", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a folder" in err


# ---------------------------------------------------------------------------------------------
# paths checked up front, shared options, output folders replaced only by complete runs
# ---------------------------------------------------------------------------------------------

def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _no_staging_left(parent):
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


GROK = ["audit", "grokking", "--quick", "--steps", "30", "--no-progress"]


def test_json_that_is_a_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import tensoralg.nn

    monkeypatch.setattr(tensoralg.nn, "train_classifier",
                        lambda *a, **k: pytest.fail("trained despite a bad --json"))
    (tmp_path / "folder").mkdir()
    assert main(["demo", "--out", str(tmp_path / "o"), "--json", str(tmp_path / "folder")]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "is a folder" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    (tmp_path / "f").write_text("x")
    assert main([*GROK, "--out", str(tmp_path / "o"), "--json", str(tmp_path / "f" / "r.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_out_below_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main([*GROK, "--out", str(tmp_path / "f" / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [
    ["demo"], ["audit", "backdoor"], ["audit", "forgetting"], ["audit", "grokking"],
    ["compare", "a", "b"], ["matrix", "a", "b"],
])
def test_common_options_are_accepted_everywhere(argv):
    args = build_parser().parse_args([*argv, "--seed", "1", "--no-progress", "--threads", "1",
                                      "--json", "r.json"])
    assert (args.seed, args.no_progress, args.threads, args.json) == (1, True, 1, "r.json")


def test_rerun_replaces_the_previous_run_as_a_whole(tmp_path):
    out = tmp_path / "g"
    assert main([*GROK, "--checkpoints", "6", "--out", str(out)]) == 0
    (out / "checkpoints" / "stray-from-user").mkdir()
    assert main([*GROK, "--checkpoints", "3", "--out", str(out)]) == 0
    res = json.loads((out / "grokking.json").read_text())
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    # only the second run's checkpoints: no stale step* from the first (6-checkpoint) run
    assert ["checkpoints/" + n for n in names] == res["checkpoints"] and len(names) == 3
    assert _no_staging_left(tmp_path)


def test_interrupt_and_failures_leave_the_previous_run_untouched(tmp_path, capsys, monkeypatch):
    import tensoralg.nn
    from tensoralg.nn import TrainingDiverged

    out = tmp_path / "g"
    assert main([*GROK, "--checkpoints", "4", "--out", str(out)]) == 0
    before = _snapshot(out)
    real = tensoralg.nn.train_classifier

    def interrupted(*a, eval_at=(), callback=None, **k):
        callback(0, a[0])      # a checkpoint is written (into the staging folder) ...
        raise KeyboardInterrupt  # ... then Ctrl-C

    monkeypatch.setattr(tensoralg.nn, "train_classifier", interrupted)
    assert main([*GROK, "--checkpoints", "4", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert _snapshot(out) == before and _no_staging_left(tmp_path)

    def diverged(*a, **k):
        raise TrainingDiverged("training diverged: the loss is nan at step 3", 3)

    monkeypatch.setattr(tensoralg.nn, "train_classifier", diverged)
    assert main([*GROK, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "diverged" in err and "Traceback" not in err
    assert _snapshot(out) == before and _no_staging_left(tmp_path)
    monkeypatch.setattr(tensoralg.nn, "train_classifier", real)


def test_exact_cost_refused_before_training(tmp_path, capsys, monkeypatch):
    """Depth 3 has 46,206,736 Wick configurations (T(16)), over the core's 200,000 limit: the
    audit must say so before training, in CLI words, and leave the previous run alone."""
    import tensoralg.nn

    out = tmp_path / "b"
    out.mkdir()
    (out / "backdoor.json").write_text("{}")   # an earlier run (its marker file)
    before = _snapshot(out)
    monkeypatch.setattr(tensoralg.nn, "train_classifier",
                        lambda *a, **k: pytest.fail("trained before the cost check"))
    assert main(["audit", "backdoor", "--quick", "--layers", "3", "--method", "exact",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--method closure" in err and "--method montecarlo" in err
    assert "method='" not in err and "Traceback" not in err
    assert _snapshot(out) == before and _no_staging_left(tmp_path)


def test_foreign_non_empty_out_is_refused(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    assert main([*GROK, "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "precious" and len(list(out.iterdir())) == 1


def test_progress_bars_hidden_when_stderr_is_not_a_terminal(capsys):
    from tensoralg.audit.common import progress

    assert progress(range(3), "x", True).disable       # pytest's captured stderr: not a tty
    assert progress(range(3), "x", False).disable


def test_out_that_is_the_working_folder_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "grokking.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    for out in (".", str(tmp_path), ".."):
        assert main([*GROK, "--out", out]) == 2
        assert "current folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grokking.json"]


# ---------------------------------------------------------------------------------------------
# late failures, --json writability, folder mode
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_unwritable_json_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """/proc passes every permission check (and root passes os.access everywhere), yet no file
    can be created there: the probe file says so before training, the previous run is kept."""
    import tensoralg.nn

    out = tmp_path / "g"
    assert main([*GROK, "--checkpoints", "3", "--out", str(out)]) == 0
    before = _snapshot(out)
    monkeypatch.setattr(tensoralg.nn, "train_classifier",
                        lambda *a, **k: pytest.fail("trained despite an unwritable --json"))
    for argv in ([*GROK, "--out", str(out)], ["demo", "--out", str(out / "d")],
                 ["matrix", "a", "b", "--out", str(tmp_path / "m")], ["compare", "a", "b"]):
        assert main([*argv, "--json", "/proc/r.json"]) == 2
        err = capsys.readouterr().err
        assert "--json" in err and "/proc" in err and len(err.strip().splitlines()) == 1, err
    assert _snapshot(out) == before and _no_staging_left(tmp_path)


def test_json_copy_is_written_before_the_swap(tmp_path, capsys, monkeypatch):
    """A failure writing --json (after the up-front probe passed) leaves the previous run whole:
    the copy is written while the new run is still staged."""
    import tensoralg.audit.common as common

    out = tmp_path / "g"
    assert main([*GROK, "--checkpoints", "3", "--out", str(out)]) == 0
    before = _snapshot(out)

    def failing(*a, **k):
        raise FileNotFoundError("simulated: the --json folder vanished")

    monkeypatch.setattr(common, "write_json_copy", failing)
    assert main([*GROK, "--checkpoints", "4", "--out", str(out),
                 "--json", str(tmp_path / "r.json")]) == 2
    assert "vanished" in capsys.readouterr().err
    assert _snapshot(out) == before and _no_staging_left(tmp_path)
    assert not (tmp_path / "r.json").exists()
    monkeypatch.undo()
    # a --json path inside --out becomes part of the new run
    assert main([*GROK, "--checkpoints", "4", "--out", str(out), "--json", str(out / "c.json")]) == 0
    res = json.loads((out / "grokking.json").read_text())
    assert json.loads((out / "c.json").read_text())["steps"] == res["steps"]


def test_output_folder_gets_the_usual_mode(tmp_path):
    import os
    import stat

    old = os.umask(0o027)
    try:
        assert main([*GROK, "--checkpoints", "2", "--out", str(tmp_path / "g")]) == 0
        assert main([*GROK, "--checkpoints", "2", "--out", str(tmp_path / "g")]) == 0  # replaced
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "g").stat().st_mode)
    assert mode == 0o777 & ~0o027, oct(mode)     # not mkdtemp's 0o700


_NO_TORCH = """
import sys
from tensoralg.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:     # argparse's errors (usage line + one error line)
    rc = exc.code
print(rc, 'torch' in sys.modules)
"""

# argv, the error, and whether it is an argparse error (the command's usage line first)
_BAD_INPUT = [
    (["compare", "missing_a", "missing_b"], "missing_a: no such checkpoint folder", False),
    (["matrix", "missing_a", "missing_b"], "missing_a: no such checkpoint folder", False),
    (["decompose", "missing_a"], "CKPT: missing_a is not a checkpoint folder", False),
    (["compare", "missing_a", "missing_b", "--n-samples", "3"],
     "tensoralg compare: error: argument --n-samples: expected an integer >= 6", True),
    (["compare", "missing_a", "missing_b", "--methods", "exact,bogus"],
     "tensoralg compare: error: argument --methods: expected a comma-separated subset of "
     "['exact', 'closure', 'montecarlo'], got 'exact,bogus'", True),
    (["compare", "missing_a", "missing_b", "--metrics", ","],
     "tensoralg compare: error: argument --metrics: expected a comma-separated subset", True),
    (["matrix", "missing_a", "missing_b", "--n-samples", "0"],
     "tensoralg matrix: error: argument --n-samples: expected an integer >= 6", True),
    (["audit", "backdoor", "--n-samples", "5"],
     "tensoralg audit backdoor: error: argument --n-samples: expected an integer >= 6", True),
    (["import", "m:f", "w.pt", "--out", "a_file", "--input-shape", "1,2"],
     "--out: a_file is an existing file", False),
    # the sae commands check their paths and options before importing torch too (they took
    # ~9 s to refuse a missing folder; fresh-eyes tester)
    (["sae", "train", "--synthetic", "4,8,2", "--out", "a_file"], "--out: a_file is a file", False),
    (["sae", "train", "--data", "missing.npy", "--d-sae", "8", "--k", "2", "--out", "o"],
     "--data: missing.npy: no such file", False),
    (["sae", "train", "--synthetic", "4,8,2", "--out", "o", "--resume", "missing"],
     "--resume: missing: no such checkpoint folder", False),
    (["sae", "train", "--synthetic", "4,8,2", "--preset", "topk", "--n-steps", "3", "--out",
      "o"], "--n-steps: preset 'topk' has a single-step encoder", False),
    (["sae", "stability", "missing_a", "missing_b"], "RUN_A: missing_a: no such checkpoint folder",
     False),
    (["sae", "bench", "--out", "a_file"], "--out: a_file exists and is not a folder", False),
    (["sae", "bench", "--data", "missing.npy"], "--data: missing.npy: no such file", False),
    (["sae", "activations", "--out", "x.txt"], "--out: expected a .npy file path", False),
    (["sae", "activations", "--source", "transformer", "--out", "a_file/x.npy"],
     "--out: a_file/x.npy cannot be created: a_file is a file", False),
    (["sae", "activations", "--source", "transformer", "--checkpoint", "missing", "--out",
      "x.npy"], "--checkpoint: missing: no such checkpoint folder", False),
    (["sae", "evaluate", "--sae", "missing", "--checkpoint", "missing"],
     "--sae: missing: no such checkpoint folder", False),
]


@pytest.mark.parametrize("argv, msg, usage", _BAD_INPUT)
def test_bad_input_is_answered_before_torch_is_imported(argv, msg, usage, tmp_path):
    # torch costs seconds to import; a bad path or option is refused before (tester item 9)
    (tmp_path / "a_file").write_text("x")
    root = str(Path(__file__).resolve().parents[1])   # this checkout's tensoralg
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    if usage:   # like every argparse error: the command's usage, then one error line
        leaf = msg.split(":")[0]
        assert lines[0].startswith(f"usage: {leaf} ") and msg in lines[-1], out.stderr
        assert sum("error" in line for line in lines) == 1, out.stderr
    else:
        assert msg in out.stderr and len(lines) == 1, out.stderr


# every command that takes --json, with arguments that reach its --json check ("ck" holds a
# cfg.json, enough for the checks made before --json)
_JSON_ARGV = {
    ("demo",): [], ("audit", "backdoor"): [], ("audit", "forgetting"): [],
    ("audit", "grokking"): [], ("audit", "language"): [], ("compare",): ["ck", "ck"],
    ("matrix",): ["ck", "ck"], ("decompose",): ["ck"],
    ("import",): ["m:f", "w.pt", "--out", "o", "--input-shape", "1,2"],
    ("sae", "train"): ["--synthetic", "4,8,2", "--out", "o"], ("sae", "stability"): ["ck", "ck"],
    ("sae", "bench"): [], ("sae", "activations"): ["--out", "x.npy"],
    ("sae", "evaluate"): ["--sae", "ck", "--checkpoint", "ck"],
}

_JSON_LOOP = """
import json, sys
from tensoralg.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    print(json.dumps([argv[:2], rc, 'torch' in sys.modules]))
"""


def _leaf_commands(parser, path=()):
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in dict(action.choices).items():
            yield from _leaf_commands(child, path + (name,))


def test_every_json_option_is_checked_before_any_work_the_same_way(tmp_path):
    """One rule for --json PATH in every command (fresh-eyes tester: it silently created missing
    folders): like --out, missing folders on the way are created, the help says so, and a path
    that cannot be written (below a file, a folder) is refused before any work, without
    importing torch."""
    with_json = {path for path, p in _leaf_commands(build_parser())
                 if any("--json" in a.option_strings for a in p._actions)}
    assert with_json == set(_JSON_ARGV)        # a new command with --json is added here
    for path, p in _leaf_commands(build_parser()):
        if path in with_json:
            (act,) = [a for a in p._actions if "--json" in a.option_strings]
            assert act.metavar == "PATH" and "missing folders on the way are created, as for " \
                "--out" in " ".join(act.help.split()), path
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "cfg.json").write_text('{"d_sae": 8}')
    (tmp_path / "a_dir").mkdir()
    root = str(Path(__file__).resolve().parents[1])
    for bad, msg in (("a_file/r.json", "--json: a_file/r.json cannot be created: a_file is a "
                                       "file, not a folder"),
                     ("a_dir", "--json: a_dir is a folder; expected a file path")):
        argvs = [[*path, *args, "--json", bad] for path, args in _JSON_ARGV.items()]
        out = subprocess.run([sys.executable, "-c", _JSON_LOOP, json.dumps(argvs)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": root})
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(rows) == len(argvs), out.stderr
        assert all(rc == 2 and not torch for _, rc, torch in rows), rows
        errs = out.stderr.strip().splitlines()
        assert len(errs) == len(argvs) and all(msg in e for e in errs), errs


def test_json_creates_missing_folders_like_out(tmp_path, capsys):
    target = tmp_path / "new" / "deeper" / "train.json"
    assert main(["sae", "train", "--synthetic", "4,8,2,64", "--steps", "0", "--batch-size",
                 "16", "--no-progress", "--out", str(tmp_path / "new" / "sae"),
                 "--json", str(target)]) == 0
    assert json.loads(target.read_text())["command"] == "sae train"
