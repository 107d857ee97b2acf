"""`tensoralg sae` defects: `stability` on runs that share randomness, `bench` with one seed
pair, flags a preset ignores, `--resume` against its recorded config, `evaluate --layer`
against the SAE's recorded hook."""

import json

import pytest

from tensoralg.cli import main

SYN = ["--synthetic", "6,8,2,512", "--threads", "1", "--no-progress"]


def _train(out, *extra):
    assert main(["sae", "train", *SYN, "--out", str(out), *extra]) == 0


def test_stability_warns_and_records_shared_seeds(tmp_path, capsys):
    _train(tmp_path / "a", "--steps", "3", "--seed", "0", "--preset", "topk")
    _train(tmp_path / "b", "--steps", "3", "--seed", "0", "--preset", "topk", "--lr", "2e-3")
    _train(tmp_path / "c", "--steps", "3", "--seed", "1", "--preset", "topk")
    capsys.readouterr()
    js = tmp_path / "s.json"
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--json", str(js)]) == 0
    err = capsys.readouterr().err
    assert "warning: RUN_A and RUN_B share the initialization seed 0" in err
    assert "share the batch order (seed 0, batch size 256, same data)" in err
    rec = json.loads(js.read_text())["warnings"]
    assert len(rec) == 2 and "initialization seed 0" in rec[0] and "batch order" in rec[1]
    # the same folder twice: identical decoders
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "a"),
                 "--json", str(js)]) == 0
    assert "identical decoders" in capsys.readouterr().err
    # independent seeds: no warning
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "c"),
                 "--json", str(js)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert json.loads(js.read_text())["warnings"] == []


def test_bench_with_one_seed_pair_reports_no_spread_and_draws_no_bar(tmp_path, monkeypatch):
    import matplotlib.axes
    import numpy as np

    from tensoralg.sae.bench import plot_bench, run_bench
    r = run_bench(["topk"], quick=True, seeds=2, d=6, m=8, k=2, steps=4, n_train=256,
                  batch_size=32, log=lambda *a: None)
    t = r["topk"]
    # two seeds: one pair, so the cross-seed numbers have no spread (None, not 0.0) ...
    for key in ("code_iou_std", "dcs_std", "code_l2_std"):
        assert t[key] is None, key
        assert t["omp"][key] is None and t["random_init"][key] is None, key
    # ... while the per-seed numbers have two values
    for key in ("fvu_std", "gt_code_iou_std", "rip_delta_std"):
        assert t[key] is not None and np.isfinite(t[key]), key
    drawn = []

    def record(name):
        real = getattr(matplotlib.axes.Axes, name)

        def fn(self, *a, **k):
            if k.get("yerr") is not None:
                drawn.append((self.get_title() or "?", list(np.ravel(k["yerr"]))))
            return real(self, *a, **k)
        return fn
    for name in ("bar", "errorbar"):
        monkeypatch.setattr(matplotlib.axes.Axes, name, record(name))
    plot_bench(r, tmp_path / "b.png")
    # error bars: FVU, ground-truth IoU and δ (two seeds each); none of ±0 for the one pair
    assert [e for _, e in drawn] == [[t["fvu_std"]], [t["gt_code_iou_std"]],
                                     [t["rip_delta_std"]]], drawn
    assert (tmp_path / "b.png").stat().st_size > 0


@pytest.mark.parametrize("preset, flags, words", [
    ("topk", ["--n-steps", "3"], "--n-steps: preset 'topk' has a single-step encoder"),
    ("abstopk", ["--n-steps", "3"], "--n-steps: preset 'abstopk' has a single-step encoder"),
    ("isae", ["--n-steps", "3"], "--n-steps: preset 'isae' has a single-step encoder"),
    ("topk", ["--rip-beta", "0.5"], "--rip-beta: preset 'topk' has no aRIP penalty"),
    ("isae-me-dl", ["--rip-beta", "0.5"], "--rip-beta: preset 'isae-me-dl' has no aRIP"),
    ("abstopk", ["--rip-warmup-steps", "10"], "--rip-warmup-steps: preset 'abstopk' has no aRIP"),
])
def test_flags_a_preset_ignores_are_refused(tmp_path, capsys, preset, flags, words):
    out = tmp_path / "r"
    assert main(["sae", "train", *SYN, "--steps", "2", "--preset", preset, *flags,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()                         # nothing written, no cfg.json with n_steps


def test_flags_a_preset_uses_are_accepted(tmp_path):
    _train(tmp_path / "a", "--steps", "2", "--preset", "isae-me", "--n-steps", "2",
           "--rip-beta", "0.2", "--rip-warmup-steps", "1")
    cfg = json.loads((tmp_path / "a" / "cfg.json").read_text())
    assert (cfg["n_steps"], cfg["rip_beta"], cfg["train_rip_warmup_steps"]) == (2, 0.2, 1)


def test_resume_takes_the_recorded_training_config(tmp_path, capsys):
    run = tmp_path / "r"
    _train(run, "--steps", "2", "--preset", "topk", "--lr", "2e-3", "--seed", "3",
           "--batch-size", "32", "--data-seed", "5")
    capsys.readouterr()
    # no --lr / --seed / --batch-size / --data-seed: the run's, not the CLI defaults
    assert main(["sae", "train", *SYN, "--steps", "4", "--out", str(run), "--resume",
                 str(run)]) == 0
    cfg = json.loads((run / "cfg.json").read_text())
    assert (cfg["train_step"], cfg["train_lr"], cfg["train_seed"], cfg["train_batch_size"],
            cfg["data_seed"]) == (4, 2e-3, 3, 32, 5)
    # a conflicting flag is refused naming both values, before any work
    for flag, value, have in (("--lr", "1e-3", "0.002"), ("--data-seed", "0", "5"),
                              ("--seed", "0", "3"), ("--batch-size", "64", "32"),
                              ("--lr-decay", "cosine", "constant")):
        assert main(["sae", "train", *SYN, "--steps", "6", "--out", str(run), "--resume",
                     str(run), flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag}: {float(value) if flag == '--lr' else value} " \
            f"differs from the resumed run's {have}" in err[0] and "--override" in err[0], err
        assert json.loads((run / "cfg.json").read_text())["train_step"] == 4
    assert main(["sae", "train", "--synthetic", "6,8,2,256", "--threads", "1", "--no-progress",
                 "--steps", "6", "--out", str(run), "--resume", str(run)]) == 2
    assert "--synthetic: synthetic d=6 m=8 k=2 n=256" in capsys.readouterr().err
    # --override: the given value wins and is recorded
    assert main(["sae", "train", *SYN, "--steps", "6", "--out", str(run), "--resume", str(run),
                 "--lr", "1e-3", "--override"]) == 0
    assert "note: --lr 0.001 replaces the resumed run's 0.002 (--override)" in \
        capsys.readouterr().out
    cfg = json.loads((run / "cfg.json").read_text())
    assert (cfg["train_step"], cfg["train_lr"]) == (6, 1e-3)
    # --override without --resume
    assert main(["sae", "train", *SYN, "--steps", "1", "--out", str(tmp_path / "n"),
                 "--override"]) == 2
    assert "--override: only with --resume" in capsys.readouterr().err
    # a preset-ignored flag on a resumed single-step run
    assert main(["sae", "train", *SYN, "--steps", "8", "--out", str(run), "--resume", str(run),
                 "--n-steps", "2"]) == 2
    assert "--n-steps: the resumed run" in capsys.readouterr().err


def test_resume_without_lr_continues_bit_identically(tmp_path):
    """An interrupted run at a non-default lr, resumed without --lr, equals the uninterrupted
    run (was: it continued at the CLI default 1e-3)."""
    from safetensors.torch import load_file
    common = ["--preset", "abstopk", "--lr", "4e-3", "--batch-size", "32"]
    _train(tmp_path / "full", "--steps", "6", *common)
    _train(tmp_path / "part", "--steps", "3", *common)
    assert main(["sae", "train", *SYN, "--steps", "6", "--out", str(tmp_path / "part"),
                 "--resume", str(tmp_path / "part")]) == 0
    a = load_file(str(tmp_path / "full" / "sae_weights.safetensors"))
    b = load_file(str(tmp_path / "part" / "sae_weights.safetensors"))
    assert all(bool((a[n] == b[n]).all()) for n in a)


def test_device_autocast_and_tensorboard_flags(tmp_path, capsys):
    import importlib.util

    import torch
    if not torch.cuda.is_available():
        assert main(["sae", "train", *SYN, "--steps", "1", "--out", str(tmp_path / "c"),
                     "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--device: 'cuda' requested but CUDA is not available" in err[0]
        assert not (tmp_path / "c").exists()
    if importlib.util.find_spec("tensorboard") is None:
        assert main(["sae", "train", *SYN, "--steps", "1", "--out", str(tmp_path / "t"),
                     "--tensorboard"]) == 2
        assert "--tensorboard: the optional package is not installed" in capsys.readouterr().err
    # autocast is recorded, and a resumed run keeps it unless --override
    _train(tmp_path / "a", "--steps", "2", "--preset", "topk", "--autocast", "bfloat16",
           "--batch-size", "32")
    cfg = json.loads((tmp_path / "a" / "cfg.json").read_text())
    assert (cfg["train_autocast"], cfg["train_device"]) == ("bfloat16", "cpu")
    assert main(["sae", "train", *SYN, "--steps", "3", "--out", str(tmp_path / "a"),
                 "--resume", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "cfg.json").read_text())["train_autocast"] == "bfloat16"
    assert main(["sae", "train", *SYN, "--steps", "4", "--out", str(tmp_path / "a"),
                 "--resume", str(tmp_path / "a"), "--autocast", "float16"]) == 2
    assert "--autocast: float16 differs from the resumed run's bfloat16" in capsys.readouterr().err
