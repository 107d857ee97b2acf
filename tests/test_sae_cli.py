"""`tensoralg sae` commands: through our own argparse tree and through tensoralg.cli.main."""

import argparse
import json

import numpy as np
import pytest
import torch

from tensoralg.sae import cli as sae_cli


def _run(argv):
    parser = argparse.ArgumentParser(prog="tensoralg")
    sub = parser.add_subparsers(dest="command")
    sae_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_train_stability_and_resume(tmp_path, capsys):
    common = ["--synthetic", "8,12,2,512", "--steps", "30", "--batch-size", "64", "--lr", "5e-3",
              "--no-progress", "--preset", "isae"]
    assert _run(["sae", "train", *common, "--seed", "0", "--out", str(tmp_path / "a"),
                 "--json", str(tmp_path / "a.json")]) == 0
    assert _run(["sae", "train", *common, "--seed", "1", "--out", str(tmp_path / "b")]) == 0
    hist = json.loads((tmp_path / "a.json").read_text())
    assert hist["tensoralg_version"] and hist["sae_cfg"]["k"] == 2 and hist["history"]
    assert (tmp_path / "a" / "ground_truth" / "weights.safetensors").exists()
    from tensoralg.sae.synthetic import make_synthetic
    x = make_synthetic(300, 8, 12, 2, seed=9).x.numpy()
    np.save(tmp_path / "x.npy", x)
    assert _run(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "b"), "--data",
                 str(tmp_path / "x.npy"), "--ground-truth", str(tmp_path / "a" / "ground_truth"),
                 "--json", str(tmp_path / "s.json")]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    for key in ("dcs", "code_iou", "code_l2", "random_dcs", "gt_dcs_a", "rip_delta_a"):
        assert np.isfinite(s[key]), key
    # a run against itself is perfectly stable
    assert _run(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "a"), "--data",
                 str(tmp_path / "x.npy"), "--json", str(tmp_path / "self.json")]) == 0
    same = json.loads((tmp_path / "self.json").read_text())
    assert same["dcs"] == pytest.approx(1.0) and same["code_iou"] == 1.0 and same["code_l2"] == 0.0
    # resume the first run to 40 steps
    assert _run(["sae", "train", *common[:2], "--steps", "40", "--batch-size", "64", "--lr", "5e-3",
                 "--no-progress", "--preset", "isae", "--out", str(tmp_path / "a"),
                 "--resume", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "cfg.json").read_text())["train_step"] == 40


def test_bench_tiny(tmp_path):
    out = tmp_path / "bench"
    assert _run(["sae", "bench", "--quick", "--presets", "topk", "isae-me", "--seeds", "2",
                 "--d", "8", "--m", "12", "--k", "2", "--steps", "20", "--n-train", "512",
                 "--out", str(out), "--quiet"]) == 0
    r = json.loads((out / "bench.json").read_text())
    for preset in ("topk", "isae-me"):
        for key in ("fvu", "dcs", "code_iou", "code_l2", "gt_dcs", "gt_code_iou", "rip_delta"):
            assert np.isfinite(r[preset][key]), (preset, key)
        assert "random_init" in r[preset] and "omp" in r[preset]
    assert 0 <= r["oracle"]["gt_code_iou"] <= 1 and r["tensoralg_version"]
    assert (out / "bench.png").stat().st_size > 1000 and "| preset |" in (out / "bench.md").read_text()


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        _run(["sae", "train", "--out", str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError):
        _run(["sae", "train", "--data", str(tmp_path / "missing.npy"), "--d-sae", "8", "--k", "2",
              "--out", str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError):
        _run(["sae", "stability", str(tmp_path / "no_a"), str(tmp_path / "no_b")])
    with pytest.raises(SystemExit):
        _run(["sae", "train", "--preset", "relu", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit):
        _run(["sae", "train", "--synthetic", "8,12", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="seeds"):
        _run(["sae", "bench", "--quick", "--seeds", "1"])


def test_through_tensoralg_main(tmp_path, capsys):
    from tensoralg.cli import main

    assert main(["sae", "train", "--synthetic", "6,8,2,256", "--steps", "5", "--batch-size", "32",
                 "--no-progress", "--out", str(tmp_path / "r")]) == 0
    assert main(["sae", "stability", str(tmp_path / "r"), str(tmp_path / "r")]) == 0
    assert "dcs" in capsys.readouterr().out
    # bad input -> exit code 2 with a one-line message naming the command
    assert main(["sae", "stability", str(tmp_path / "r"), str(tmp_path / "missing")]) == 2
    assert "tensoralg sae stability: error:" in capsys.readouterr().err
