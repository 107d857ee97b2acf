"""`tensoralg sae` fixes: one-line errors, the audits' output-folder rules for `sae bench --out`,
`sae train --resume` without --d-sae/--k, help texts that state defaults, the train summary,
dead latents in `sae stability`."""

import argparse
import json

import numpy as np
import pytest

from tensoralg.cli import main
from tensoralg.sae import cli as sae_cli


def _parser():
    parser = argparse.ArgumentParser(prog="tensoralg")
    sae_cli.add_parsers(parser.add_subparsers(dest="command"))
    return parser


def test_every_sae_option_states_its_default():
    sae = _parser()._subparsers._group_actions[0].choices["sae"]
    subs = sae._subparsers._group_actions[0].choices
    assert set(subs) == {"train", "stability", "bench", "activations", "evaluate"}
    for name, sub in subs.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            text = action.help or ""
            assert "default" in text or "required" in text, (name, action.dest, text)


def test_activations_without_the_extra_is_one_line(capsys, monkeypatch, tmp_path):
    from tensoralg.sae import activations
    monkeypatch.setattr(activations, "real_extra_available",
                        lambda: (False, "transformers is not importable (ImportError: x); "
                                        "install the optional extra: pip install 'tensoralg[real]'"))
    assert main(["sae", "activations", "--out", str(tmp_path / "a.npy")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'tensoralg[real]'" in err[0], err
    assert not (tmp_path / "a.npy").exists()


BENCH = ["sae", "bench", "--quick", "--presets", "topk", "--seeds", "2", "--d", "6", "--m", "8",
         "--k", "2", "--steps", "4", "--n-train", "256", "--quiet", "--threads", "1"]


def test_bench_out_follows_the_audit_rules(tmp_path, capsys, monkeypatch):
    from tensoralg.sae import bench
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "backdoor.json").write_text("{}")
    (tmp_path / "f").write_text("x")
    real = bench.run_bench
    for out, words in ((audit, "holds no bench.json"), (tmp_path / "f", "exists and is not a folder"),
                       (tmp_path / "f" / "sub", "is a file, not a folder")):
        monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("ran despite --out"))
        assert main([*BENCH, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--out" in err[0] and words in err[0], err
    assert sorted(p.name for p in audit.iterdir()) == ["backdoor.json"]
    monkeypatch.setattr(bench, "run_bench", real)
    # new, then a rerun into the earlier output (replaced as a whole: a stray file goes away)
    assert main([*BENCH, "--out", str(tmp_path / "b")]) == 0
    (tmp_path / "b" / "stray.txt").write_text("old run")
    assert main([*BENCH, "--out", str(tmp_path / "b"), "--seed", "3"]) == 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["bench.json", "bench.md", "bench.png"]
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["config"]["seed"] == 3
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name or ".old-" in p.name]


def test_bench_results_carry_spread_and_plateau():
    from tensoralg.sae.bench import plateau_change, run_bench
    r = run_bench(["topk"], quick=True, seeds=3, d=6, m=8, k=2, steps=8, n_train=256, batch_size=32,
                  log=lambda *a: None)
    assert r["config"]["batch_size"] == 32
    for key in ("fvu_std", "code_iou_std", "gt_code_iou_std", "rip_delta_std", "plateau_change"):
        assert r["topk"][key] is not None and np.isfinite(r["topk"][key]), key
    assert "topk_fvu_plateau" in r["findings"]
    hist = [{"step": 50, "fvu": 0.5}, {"step": 80, "fvu": 0.44}, {"step": 100, "fvu": 0.4}]
    assert plateau_change(hist, 100) == pytest.approx((0.44 - 0.4) / 0.4, rel=1e-12)
    with pytest.raises(ValueError, match="eval_fraction"):
        run_bench(["topk"], quick=True, seeds=2, data=np.ones((20, 4)), eval_fraction=1.0)


def test_resume_takes_the_sae_config_from_the_run(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((256, 6)).astype(np.float32))
    data = ["--data", str(tmp_path / "x.npy"), "--batch-size", "32", "--no-progress"]
    assert main(["sae", "train", *data, "--preset", "topk", "--d-sae", "10", "--k", "3",
                 "--steps", "4", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "summary:" in out and "dead latents" in out and "train_log.jsonl" in out
    # no --preset / --d-sae / --k: all from the run
    assert main(["sae", "train", *data, "--steps", "6", "--out", str(tmp_path / "r"),
                 "--resume", str(tmp_path / "r")]) == 0
    cfg = json.loads((tmp_path / "r" / "cfg.json").read_text())
    assert (cfg["train_step"], cfg["d_sae"], cfg["k"], cfg["architecture"]) == (6, 10, 3, "topk")
    capsys.readouterr()
    for extra, flag in ((["--k", "4"], "--k"), (["--preset", "isae"], "--preset")):
        assert main(["sae", "train", *data, "--steps", "8", *extra, "--out", str(tmp_path / "r"),
                     "--resume", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0] and "resumed run" in err[0], err


def test_stability_reports_dead_latents(tmp_path, capsys):
    rng = np.random.default_rng(1)
    np.save(tmp_path / "x.npy", rng.standard_normal((256, 6)).astype(np.float32))
    for run in ("a", "b"):
        assert main(["sae", "train", "--data", str(tmp_path / "x.npy"), "--preset", "topk",
                     "--d-sae", "10", "--k", "2", "--steps", "4", "--batch-size", "32",
                     "--no-progress", "--seed", str(ord(run)), "--out", str(tmp_path / run)]) == 0
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "b"), "--data",
                 str(tmp_path / "x.npy"), "--json", str(tmp_path / "s.json")]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    import torch

    from tensoralg.sae.formats import load_sae
    x = torch.tensor(np.load(tmp_path / "x.npy"))
    for tag in ("a", "b"):
        with torch.no_grad():
            z = load_sae(tmp_path / tag).encode(x)
        assert s[f"dead_on_data_{tag}"] == int((~(z != 0).any(0)).sum())
        assert s[f"train_dead_tokens_{tag}"] == 256            # min(10M, n)
        assert 0 <= s[f"train_dead_latents_{tag}"] <= 10
