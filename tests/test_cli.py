"""The audit command line: registration, the demo, and errors for bad paths and options."""

import json
import subprocess
import sys

import pytest

from tensoralg.cli import build_parser, main


def test_commands_are_registered():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for cmd in ("demo", "audit", "compare", "matrix"):
        assert cmd in sub.choices
    audit = sub.choices["audit"]
    asub = next(a for a in audit._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(asub.choices) == {"backdoor", "forgetting", "grokking"}


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


def test_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("not a folder")
    assert main(["demo", "--out", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a folder" in err
