"""Weights & Biases logging of `sae train` (an optional extra): a one-line error without the
package, and, with it, an offline run (WANDB_MODE=offline) written under OUT/wandb/ holding the
trainer's records."""

import glob
import json
import sys
from pathlib import Path

import pytest

from tensoralg.cli import main
from tensoralg.sae import TrainConfig, make_config, make_synthetic, train


def test_missing_wandb_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)       # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"wandb: the optional package is not installed "
                                         r"\(pip install wandb\)"):
        TrainConfig(wandb=True)
    assert main(["sae", "train", "--synthetic", "6,8,2,128", "--steps", "2", "--wandb",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "tensoralg sae train: error: --wandb: the optional package is not installed"), err
    assert not (tmp_path / "run").exists()


def test_wandb_needs_an_out_folder():
    pytest.importorskip("wandb")
    syn = make_synthetic(256, 6, 8, 2, seed=0)
    with pytest.raises(ValueError, match=r"out: wandb=True writes OUT/wandb/"):
        train(syn.x, make_config("abstopk", 6, 8, 2), TrainConfig(steps=2, wandb=True))


@pytest.mark.slow      # the wandb service starts in 5-60 s (load)
def test_offline_run_is_written_locally(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    syn = make_synthetic(512, 8, 16, 2, seed=0)
    out = tmp_path / "run"
    _, hist = train(syn.x, make_config("abstopk", 8, 16, 2),
                    TrainConfig(steps=20, batch_size=64, log_every=5, wandb=True,
                                wandb_project="tests"), out=out)
    runs = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    data = Path(runs[0]).read_bytes()
    # the protobuf records hold the keys and the JSON of the values as plain bytes
    assert data.count(b"sae/fvu") >= len(hist) == 4
    assert json.dumps(hist[-1]["fvu"]).encode() in data
    assert b"tests" in data
    cfg = json.loads((out / "cfg.json").read_text())
    assert cfg["train_wandb"] is True and cfg["train_wandb_project"] == "tests"
