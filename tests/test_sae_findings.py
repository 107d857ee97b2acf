"""Left-over findings of issue 13: `sae bench --steps 0` refuses, a diverged `sae train`
leaves OUT as it was, a device that does not exist here is a clear error."""

import pytest
import torch

from tensoralg.cli import main
from tensoralg.sae import bench
from tensoralg.sae.formats import check_device
from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.sae.synthetic import make_synthetic
from tensoralg.sae.training import TrainConfig, TrainingDiverged, load_sae, save_sae, train


def test_bench_with_zero_steps_refuses_before_any_work(capsys, monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("trained although --steps 0 was refused")
    monkeypatch.setattr(bench, "train_many", no_training, raising=False)
    assert main(["sae", "bench", "--quick", "--steps", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--steps" in err and "0" in err and "finding" not in err.lower()
    with pytest.raises(ValueError, match="steps: expected an int >= 1"):
        bench.run_bench(quick=True, steps=0, progress=False)


def _nan_after(monkeypatch, n_ok):
    real = SparseAutoencoder.loss
    calls = {"n": 0}

    def flaky(self, x, dead_mask=None, **kw):
        out = real(self, x, dead_mask, **kw)
        calls["n"] += 1
        if calls["n"] > n_ok:
            out["loss"] = out["loss"] * float("nan")
        return out
    monkeypatch.setattr(SparseAutoencoder, "loss", flaky)


@pytest.mark.parametrize("existing", [False, True])
def test_diverged_train_without_checkpoint_leaves_out_as_it_was(tmp_path, monkeypatch, existing):
    out = tmp_path / "run"
    if existing:
        out.mkdir()
    syn = make_synthetic(256, 8, 12, 2, seed=0)
    _nan_after(monkeypatch, 5)
    with pytest.raises(TrainingDiverged, match="nothing was kept") as info:
        train(syn.x, SAEConfig(8, 12, 2), TrainConfig(steps=20, batch_size=64, log_every=2),
              out=out)
    assert info.value.last_checkpoint is None
    assert "step 4, fvu" in str(info.value)          # the last record (steps 3-4) before step 5
    if existing:
        assert out.is_dir() and list(out.iterdir()) == []
    else:
        assert not out.exists()


def test_diverged_cli_train_can_rerun_into_the_same_out(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["sae", "train", "--synthetic", "8,12,2,256", "--steps", "10", "--batch-size", "64",
            "--out", str(out), "--no-progress", "--preset", "abstopk"]
    _nan_after(monkeypatch, 3)
    assert main(args) == 1
    assert "nothing was kept" in capsys.readouterr().err and not out.exists()
    monkeypatch.undo()
    assert main(args) == 0                          # OUT was not left half-written
    assert load_sae(out).cfg.d_sae == 12


def test_device_that_does_not_exist_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    save_sae(tmp_path / "sae", SparseAutoencoder(SAEConfig(4, 6, 2), seed=0))
    with pytest.raises(ValueError, match=r"device: 'cuda' requested but CUDA is not available"):
        load_sae(tmp_path / "sae", device="cuda")
    with pytest.raises(ValueError, match="device: 'cuda:0' requested but CUDA"):
        TrainConfig(device="cuda:0")
    with pytest.raises(ValueError, match="device: not a torch device: 'gpu'"):
        check_device("gpu")
    assert check_device("cpu") == torch.device("cpu")
    assert load_sae(tmp_path / "sae").W_dec.device.type == "cpu"
