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


def test_untrained_same_seed_run_is_not_the_ground_truth(tmp_path, capsys):
    """Regression: `train --steps 0 --seed 0` on `--synthetic` (data seed 0) gave gt_dcs 1.0."""
    common = ["--synthetic", "16,24,3,512", "--steps", "0", "--no-progress"]
    assert _run(["sae", "train", *common, "--seed", "0", "--data-seed", "0", "--out", str(tmp_path / "s0"),
                 "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "untrained" in out and "nan" not in out
    t = json.loads((tmp_path / "t.json").read_text())
    assert t["history"] == [] and 0 < t["fvu"] < 10 and t["fvu_on"] == "first 512 samples"
    assert json.loads((tmp_path / "s0" / "cfg.json").read_text())["train_step"] == 0
    assert _run(["sae", "train", *common, "--seed", "1", "--out", str(tmp_path / "s1")]) == 0
    assert _run(["sae", "stability", str(tmp_path / "s0"), str(tmp_path / "s1"), "--ground-truth",
                 str(tmp_path / "s0" / "ground_truth"), "--seed", "3", "--json", str(tmp_path / "s.json")]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    from tensoralg.verify.identifiability import random_baseline
    rb = random_baseline(24, 24, 16, n_draws=20, seed=0)
    for key in ("gt_dcs_a", "gt_dcs_b", "dcs", "random_dcs"):
        assert abs(s[key] - rb["dcs_mean"]) < 5 * rb["dcs_std"] + 0.01, (key, s[key], rb)


def test_steps_zero_fvu_matches_the_training_loss_definition(tmp_path, capsys):
    from tensoralg.sae.synthetic import make_synthetic
    from tensoralg.sae.training import load_sae

    x = make_synthetic(200, 6, 8, 2, seed=4).x
    np.save(tmp_path / "x.npy", x.numpy())
    assert _run(["sae", "train", "--data", str(tmp_path / "x.npy"), "--d-sae", "8", "--k", "2",
                 "--steps", "0", "--batch-size", "64", "--no-progress", "--out", str(tmp_path / "r"),
                 "--json", str(tmp_path / "r.json")]) == 0
    model = load_sae(tmp_path / "r")
    with torch.no_grad():
        ref = float(((x - model(x)) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
    assert json.loads((tmp_path / "r.json").read_text())["fvu"] == pytest.approx(ref, rel=1e-5)


def test_train_argument_errors_name_the_right_flag(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((64, 6), dtype=np.float32))
    data = ["--data", str(tmp_path / "x.npy"), "--out", str(tmp_path / "r")]
    with pytest.raises(ValueError, match=r"--k: expected 1 <= k <= d_sae=8, got 0"):
        _run(["sae", "train", *data, "--d-sae", "8", "--k", "0"])
    with pytest.raises(ValueError, match=r"--k: expected 1 <= k <= d_sae=8, got 9"):
        _run(["sae", "train", *data, "--d-sae", "8", "--k", "9"])
    with pytest.raises(ValueError, match=r"--k: expected 1 <= k"):     # not silently the spec's k
        _run(["sae", "train", "--synthetic", "6,8,2,64", "--k", "0", "--out", str(tmp_path / "r")])
    with pytest.raises(ValueError, match=r"^--k: required"):
        _run(["sae", "train", *data, "--d-sae", "8"])
    with pytest.raises(ValueError, match=r"^--d-sae and --k: required"):
        _run(["sae", "train", *data])
    with pytest.raises(ValueError, match=r"--steps: expected an int >= 0"):
        _run(["sae", "train", *data, "--d-sae", "8", "--k", "2", "--steps", "-1"])
    with pytest.raises(ValueError, match=r"--data-seed"):
        _run(["sae", "train", "--synthetic", "6,8,2,64", "--data-seed", "-1", "--out", str(tmp_path / "r")])
    (tmp_path / "obj.npy").write_bytes(b"\x80\x04\x95 not an array")
    with pytest.raises(ValueError, match=r"not a numeric \.npy array of shape \(n, d_in\)") as e:
        _run(["sae", "train", "--data", str(tmp_path / "obj.npy"), "--d-sae", "8", "--k", "2",
              "--out", str(tmp_path / "r")])
    assert "allow_pickle" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_data_run_prints_no_warning(tmp_path):
    """torch warns once per process, so check a fresh process: no "not writable" warning."""
    import subprocess
    import sys

    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((128, 6)).astype(np.float32))
    r = subprocess.run([sys.executable, "-W", "default", "-m", "tensoralg.cli", "sae", "train",
                        "--data", str(tmp_path / "x.npy"), "--d-sae", "8", "--k", "2", "--steps", "3",
                        "--batch-size", "32", "--threads", "1", "--no-progress", "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and "step 3" in r.stdout, r.stderr


def test_bench_accepts_no_progress_and_seed(tmp_path, capsys):
    args = ["sae", "bench", "--quick", "--presets", "topk", "--seeds", "2", "--d", "6", "--m", "8",
            "--k", "2", "--steps", "5", "--n-train", "256", "--no-progress"]
    assert _run([*args, "--seed", "5", "--data-seed", "7", "--json", str(tmp_path / "b.json")]) == 0
    r = json.loads((tmp_path / "b.json").read_text())
    assert [p["seed"] for p in r["topk"]["per_seed"]] == [5, 6]
    assert r["config"]["seed"] == 5 and r["config"]["data_seed"] == 7
    assert "it/s" not in capsys.readouterr().err                 # no tqdm bar
    with pytest.raises(ValueError, match="--seed"):
        _run([*args, "--seed", "-1"])
    with pytest.raises(ValueError, match="--seed"):
        _run(["sae", "stability", "a", "b", "--seed", "-2"])


def test_train_out_must_be_new_empty_or_an_sae_folder(tmp_path, capsys, monkeypatch):
    """`sae train --out` never writes into a folder of other files (which a later audit run could
    then replace, deleting the SAE), and an existing file is named as such — before any work."""
    import tensoralg.sae.training as training
    from tensoralg.cli import main

    common = ["sae", "train", "--synthetic", "6,8,2,128", "--steps", "3", "--batch-size", "32",
              "--no-progress"]
    real_train = training.train
    monkeypatch.setattr(training, "train", lambda *a, **k: pytest.fail("trained despite a bad --out"))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "backdoor.json").write_text("{}")
    (tmp_path / "s1.py").write_text("print(1)")
    for out, words in ((notes, "not an SAE checkpoint folder"), (audit, "not an SAE checkpoint folder"),
                       (tmp_path / "s1.py", "is a file; expected a folder"),
                       (tmp_path / "s1.py" / "sub", "is a file")):
        assert main([*common, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and words in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in notes.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in audit.iterdir()) == ["backdoor.json"]
    monkeypatch.setattr(training, "train", real_train)
    # new, empty, and an earlier SAE folder (rerun and --resume) are accepted
    (tmp_path / "empty").mkdir()
    for out in ("new", "empty", "new"):
        assert main([*common, "--out", str(tmp_path / out)]) == 0
    assert main([*common[:4], "--steps", "5", "--batch-size", "32", "--no-progress",
                 "--out", str(tmp_path / "new"), "--resume", str(tmp_path / "new")]) == 0
    assert json.loads((tmp_path / "new" / "cfg.json").read_text())["train_step"] == 5


def test_train_progress_bar_hidden_when_stderr_is_not_a_terminal(tmp_path, capsys):
    """Without --no-progress the bar is still not drawn into a non-terminal stderr (tqdm
    disable=None); pytest's captured stderr is not a terminal."""
    assert _run(["sae", "train", "--synthetic", "6,8,2,128", "--steps", "3", "--batch-size", "32",
                 "--out", str(tmp_path / "r")]) == 0
    assert _run(["sae", "bench", "--quick", "--presets", "topk", "--seeds", "2", "--d", "6",
                 "--m", "8", "--k", "2", "--steps", "3", "--n-train", "256", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "sae train" not in err and "it/s" not in err and "step/s" not in err, err
