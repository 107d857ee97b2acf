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
