"""`tensoralg sae` fixes: an interrupted `sae train` (Ctrl-C or SIGTERM) leaves no half-written
--out (docs/cli.md: "130 ... staged outputs are removed"), and zero-variance activations (all
rows equal, e.g. all zeros: FVU 0/0) are refused before training instead of being reported as
a perfect fit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tensoralg.cli import main
from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.sae.training import TrainConfig, train

FAST = ["--batch-size", "32", "--no-progress"]
ROOT = Path(__file__).resolve().parents[1]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _interrupt_after(monkeypatch, n_calls: int) -> None:
    """SparseAutoencoder.loss raises KeyboardInterrupt (as Ctrl-C, or SIGTERM through the
    CLI's handler) on its ``n_calls``-th call."""
    real = SparseAutoencoder.loss
    calls = {"n": 0}

    def interrupted(self, x, dead_mask=None, **kw):
        calls["n"] += 1
        if calls["n"] >= n_calls:
            raise KeyboardInterrupt
        return real(self, x, dead_mask, **kw)

    monkeypatch.setattr(SparseAutoencoder, "loss", interrupted)


@pytest.mark.parametrize("existing", ["missing", "empty"])
def test_interrupted_run_leaves_out_as_it_was(tmp_path, monkeypatch, capsys, existing):
    """The tester's case: interrupted after some log records, before any checkpoint; --out was
    missing (it is removed again) or empty (it stays empty), and the same command then runs."""
    out = tmp_path / "new"
    if existing == "empty":
        out.mkdir()
    cmd = ["sae", "train", "--synthetic", "6,8,2,128", *FAST, "--log-every", "2", "--out", str(out)]
    _interrupt_after(monkeypatch, 20)
    assert main([*cmd, "--steps", "1000"]) == 130
    assert "interrupted" in capsys.readouterr().err
    if existing == "missing":
        assert _names(tmp_path) == []
    else:
        assert _names(tmp_path) == ["new"] and _names(out) == []
    monkeypatch.undo()
    assert main([*cmd, "--steps", "3"]) == 0       # was refused: "is not empty and is not an SAE"
    assert json.loads((out / "cfg.json").read_text())["train_step"] == 3


def test_interrupted_run_keeps_its_last_checkpoint(tmp_path, monkeypatch, capsys):
    """With --ckpt-every the documented rule stands: the last checkpoint stays for --resume."""
    out = tmp_path / "new"
    cmd = ["sae", "train", "--synthetic", "6,8,2,128", *FAST, "--out", str(out)]
    _interrupt_after(monkeypatch, 7)
    assert main([*cmd, "--steps", "1000", "--ckpt-every", "4"]) == 130
    assert json.loads((out / "cfg.json").read_text())["train_step"] == 4
    monkeypatch.undo()
    assert main([*cmd, "--steps", "6", "--resume", str(out)]) == 0
    assert json.loads((out / "cfg.json").read_text())["train_step"] == 6


def test_interrupted_api_run_removes_what_it_wrote(tmp_path, monkeypatch):
    out = tmp_path / "a" / "new"
    x = torch.randn(64, 6, dtype=torch.float64)
    _interrupt_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        train(x, SAEConfig(d_in=6, d_sae=8, k=2), TrainConfig(steps=100, batch_size=16,
                                                              log_every=2), out=out)
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_training_leaves_no_out(tmp_path, sig):
    """The real command in a subprocess, signalled once its log shows training has started."""
    out = tmp_path / "NEW"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "tensoralg", "sae", "train", "--synthetic",
                          "16,32,3,2000", "--steps", "200000", "--log-every", "5", "--no-progress",
                          "--out", str(out)], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        log = out / "train_log.jsonl"
        while time.time() < deadline and p.poll() is None:
            if log.exists() and log.stat().st_size > 0:
                break
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()
        assert log.stat().st_size > 0, "training did not start"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert b"interrupted" in err
    assert not out.exists(), _names(out)
    assert _names(tmp_path) == []


# ---------------------------------------------------------------- zero-variance activations

@pytest.mark.parametrize("value", [0.0, 1.5])
def test_train_refuses_zero_variance_data(tmp_path, capsys, value):
    path = tmp_path / "acts.npy"
    np.save(path, np.full((512, 8), value, dtype=np.float32))
    out = tmp_path / "z"
    rc = main(["sae", "train", "--data", str(path), "--d-sae", "16", "--k", "2", "--steps", "20",
               *FAST, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "--data:" in err and "zero variance" in err, err
    assert "FVU" in err and "undefined" in err, err
    assert not out.exists()


def test_train_api_refuses_zero_variance_data(tmp_path):
    x = torch.ones(40, 6, dtype=torch.float64) * 3.0
    with pytest.raises(ValueError, match=r"^data: .*zero variance"):
        train(x, SAEConfig(d_in=6, d_sae=8, k=2), TrainConfig(steps=2, batch_size=8),
              out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
    # one differing entry is enough (the data has variance; batches may still be constant)
    x[7, 2] = 0.0
    train(x, SAEConfig(d_in=6, d_sae=8, k=2), TrainConfig(steps=2, batch_size=8, progress=False))


def test_zero_variance_memmap_checked_in_chunks(tmp_path):
    from tensoralg.sae.training import as_activations, check_variance

    path = tmp_path / "big.npy"
    a = np.zeros((70000, 3), dtype=np.float32)
    np.save(path, a)
    arr = as_activations(path, "--data")
    with pytest.raises(ValueError, match="--data: .*zero variance"):
        check_variance(arr, "--data")
    a[69999, 0] = 1.0                                 # past the first 65,536-row chunk
    np.save(path, a)
    check_variance(as_activations(path, "--data"), "--data")


def test_bench_refuses_zero_variance_held_out_rows(tmp_path):
    from tensoralg.sae.bench import run_bench

    x = np.random.default_rng(0).standard_normal((200, 6)).astype(np.float32)
    x[160:] = 0.0                                     # the held-out last 20 %: all zeros
    path = tmp_path / "x.npy"
    np.save(path, x)
    with pytest.raises(ValueError, match=r"^data \(its last 40 rows, held out\): .*zero variance"):
        run_bench(["topk"], quick=True, seeds=2, data=str(path), steps=2, k=2, m=8,
                  progress=False, log=lambda *a: None)


@pytest.mark.parametrize("value", [0.0, 0.37])
def test_evaluate_fvu_undefined_on_zero_variance_activations(tmp_path, capsys, value):
    """Held-out activations that are all equal (embedding rows all `value`): FVU None, not
    0/0 = 0 or a number made of float64 cancellation in x2 - n mean^2; `sae evaluate`
    prints it as undefined."""
    import argparse

    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.corpus import VOCAB
    from tensoralg.sae.cli import add_evaluate_parser
    from tensoralg.sae.evaluation import evaluate_transformer
    from tensoralg.sae.formats import save_sae
    from tensoralg.transformer import BilinearTransformer

    model = BilinearTransformer(len(VOCAB), 8, 2, 2, 4, 12, n_ctx=6, seed=1).eval()
    with torch.no_grad():
        model.embed.fill_(value)
    sae = SparseAutoencoder(SAEConfig(8, 16, 3, activation="topk"), seed=0)
    tokens = torch.randint(0, len(VOCAB), (7, 6), generator=torch.Generator().manual_seed(0))
    res = evaluate_transformer(model, sae, 0, tokens, batch_size=3)
    assert res["fvu"] is None, res["fvu"]
    assert evaluate_transformer(BilinearTransformer(len(VOCAB), 8, 2, 2, 4, 12, n_ctx=6,
                                                    seed=1).eval(), sae, 0, tokens)["fvu"] > 0
    save_checkpoint(tmp_path / "ck", model, step=0)
    save_sae(tmp_path / "sae", sae, metadata={"hook_name": "hook_resid.0"})
    top = argparse.ArgumentParser()
    add_evaluate_parser(top.add_subparsers(dest="sae_command"))
    args = top.parse_args(["evaluate", "--sae", str(tmp_path / "sae"), "--checkpoint",
                           str(tmp_path / "ck"), "--chars", "30000", "--no-progress"])
    assert args.func(args) == 0
    assert "fvu undefined (zero-variance activations)" in capsys.readouterr().out
