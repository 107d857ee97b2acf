"""tensoralg.sae.training: end-to-end, determinism, resume, NaN stop, checkpoints, data input."""

import json

import numpy as np
import pytest
import torch

from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.sae.presets import make_config
from tensoralg.sae.synthetic import make_synthetic
from tensoralg.sae.training import TrainConfig, TrainingDiverged, load_sae, save_sae, train


@pytest.fixture(scope="module")
def syn():
    return make_synthetic(1024, 8, 12, 2, seed=0)


def _fvu(model, x):
    with torch.no_grad():
        return float(((x - model(x)) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())


def test_tiny_end_to_end(syn):
    cfg = make_config("abstopk", 8, 12, 2)
    untrained = SparseAutoencoder(cfg, seed=0)
    untrained.init_b_dec(syn.x)
    model, hist = train(syn.x, cfg, TrainConfig(steps=150, batch_size=128, lr=5e-3, log_every=1))
    assert [h["step"] for h in hist] == list(range(1, 151))
    # the training loss is the batch FVU (+ small aRIP/AuxK terms): it must go down, and the
    # held-out FVU must be well below the untrained SAE's
    assert np.mean([h["recon"] for h in hist[-10:]]) < 0.5 * hist[0]["recon"]
    ev = make_synthetic(512, 8, 12, 2, seed=1, dictionary=syn.W_dec)
    assert _fvu(model, ev.x) < 0.5 * _fvu(untrained, ev.x)
    assert torch.allclose(model.W_dec.norm(dim=1), torch.ones(12), atol=1e-5)


def test_deterministic_under_seed(syn):
    cfg = make_config("isae", 8, 12, 2)
    a, _ = train(syn.x, cfg, TrainConfig(steps=20, batch_size=64, seed=3))
    b, _ = train(syn.x, cfg, TrainConfig(steps=20, batch_size=64, seed=3))
    c, _ = train(syn.x, cfg, TrainConfig(steps=20, batch_size=64, seed=4))
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.W_dec, c.W_dec)


def test_resume_is_bit_identical(syn, tmp_path):
    # AuxK with a small dead window so the dead-latent counters are part of the resumed state
    cfg = make_config("isae-me", 8, 12, 2, dead_tokens=64, n_steps=2)
    full, _ = train(syn.x, cfg, TrainConfig(steps=24, batch_size=100, seed=1), out=tmp_path / "full")
    _half, _ = train(syn.x, cfg, TrainConfig(steps=12, batch_size=100, seed=1), out=tmp_path / "half")
    assert json.loads((tmp_path / "half" / "cfg.json").read_text())["train_step"] == 12
    resumed, _ = train(syn.x, cfg, TrainConfig(steps=24, batch_size=100, seed=1),
                       out=tmp_path / "half", resume=tmp_path / "half")
    for k, v in full.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    with pytest.raises(ValueError, match="different SAE config"):
        train(syn.x, make_config("isae", 8, 12, 2), TrainConfig(steps=30), resume=tmp_path / "half")


def test_checkpoint_layout_and_roundtrip(syn, tmp_path):
    cfg = make_config("isae-me", 8, 12, 2, gamma="diag")
    model, _ = train(syn.x, cfg, TrainConfig(steps=5, batch_size=64, ckpt_every=2), out=tmp_path / "run")
    from safetensors.torch import load_file
    w = load_file(str(tmp_path / "run" / "sae_weights.safetensors"))
    assert set(w) == {"W_enc", "b_enc", "W_dec", "b_dec", "step_scale"}
    assert not (tmp_path / "run" / "encoder_steps.safetensors").exists()
    assert w["W_enc"].shape == (8, 12) and w["W_dec"].shape == (12, 8)
    c = json.loads((tmp_path / "run" / "cfg.json").read_text())
    assert (c["d_in"], c["d_sae"], c["k"], c["architecture"]) == (8, 12, 2, "tensoralg_multistep_abstopk")
    assert c["train_step"] == 5 and "tensoralg_version" in c
    loaded = load_sae(tmp_path / "run")
    assert torch.equal(loaded.encode(syn.x[:50]), model.encode(syn.x[:50]))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(syn, tmp_path, monkeypatch):
    cfg = SAEConfig(8, 12, 2)
    calls = {"n": 0}
    real_loss = SparseAutoencoder.loss

    def flaky(self, x, dead_mask=None):
        out = real_loss(self, x, dead_mask)
        calls["n"] += 1
        if calls["n"] > 7:
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(SparseAutoencoder, "loss", flaky)
    with pytest.raises(TrainingDiverged, match="step 7") as info:
        train(syn.x, cfg, TrainConfig(steps=20, batch_size=64, ckpt_every=3), out=tmp_path / "run")
    assert info.value.last_checkpoint == str(tmp_path / "run")
    assert "last good checkpoint" in str(info.value)
    monkeypatch.undo()
    saved = json.loads((tmp_path / "run" / "cfg.json").read_text())
    assert saved["train_step"] == 6
    assert torch.isfinite(load_sae(tmp_path / "run").W_dec).all()


def test_memmapped_npy_gives_same_result(syn, tmp_path):
    path = tmp_path / "acts.npy"
    np.save(path, syn.x.numpy())
    cfg = SAEConfig(8, 12, 2)
    a, _ = train(path, cfg, TrainConfig(steps=10, batch_size=64))
    b, _ = train(syn.x, cfg, TrainConfig(steps=10, batch_size=64))
    assert torch.equal(a.W_dec, b.W_dec)


def test_bad_data_and_files(syn, tmp_path):
    cfg = SAEConfig(8, 12, 2)
    with pytest.raises(ValueError, match="d_in=8"):
        train(torch.zeros(100, 9), cfg, TrainConfig(steps=1))
    bad = syn.x.clone()
    bad[5, 2] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        train(bad, cfg, TrainConfig(steps=1))
    with pytest.raises(ValueError, match="batch_size"):
        train(syn.x[:10], cfg, TrainConfig(steps=1, batch_size=64))
    with pytest.raises(FileNotFoundError):
        train(tmp_path / "missing.npy", cfg, TrainConfig(steps=1))
    (tmp_path / "corrupt.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match="corrupt"):
        train(tmp_path / "corrupt.npy", cfg, TrainConfig(steps=1))
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="ckpt_every"):
        train(syn.x, cfg, TrainConfig(steps=1, ckpt_every=1))


def test_load_sae_rejects_bad_checkpoints(tmp_path):
    model = SparseAutoencoder(SAEConfig(4, 6, 2), seed=0)
    save_sae(tmp_path / "ok", model)
    with pytest.raises(FileNotFoundError):
        load_sae(tmp_path / "nope")
    with torch.no_grad():
        model.W_dec[0, 0] = float("nan")
    save_sae(tmp_path / "nan", model)
    with pytest.raises(ValueError, match="NaN"):
        load_sae(tmp_path / "nan")
    (tmp_path / "ok" / "sae_weights.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        load_sae(tmp_path / "ok")
    from tensoralg.io import save_folder
    save_folder(tmp_path / "shape", {"W_enc": torch.zeros(4, 6), "b_enc": torch.zeros(6),
                                     "W_dec": torch.zeros(5, 4), "b_dec": torch.zeros(4)},
                {"d_in": 4, "d_sae": 6, "k": 2, "architecture": "topk"})
    with pytest.raises(ValueError, match="W_dec"):
        load_sae(tmp_path / "shape")


def test_synthetic_data_properties():
    s = make_synthetic(300, 10, 20, 3, seed=5, min_abs=0.5, max_abs=1.5)
    assert torch.allclose(s.W_dec.norm(dim=1), torch.ones(20), atol=1e-6)
    assert ((s.z != 0).sum(1) == 3).all()
    nz = s.z[s.z != 0].abs()
    assert nz.min() >= 0.5 and nz.max() <= 1.5
    assert (s.z < 0).any() and (s.z > 0).any()
    assert torch.allclose(s.x, s.z @ s.W_dec, atol=1e-6)
    assert torch.equal(make_synthetic(300, 10, 20, 3, seed=5).x, s.x)
    assert (make_synthetic(50, 10, 20, 3, signed=False, seed=1).z >= 0).all()
    assert s.supports.shape == (300, 3)
    with pytest.raises(ValueError, match="k"):
        make_synthetic(10, 4, 3, 5)
    with pytest.raises(ValueError, match="min_abs"):
        make_synthetic(10, 4, 8, 2, min_abs=0.0)
    with pytest.raises(ValueError, match="dictionary"):
        make_synthetic(10, 4, 8, 2, dictionary=torch.zeros(8, 5))


def test_memmap_and_read_only_arrays_are_not_wrapped_in_tensors(syn, tmp_path):
    """A memmap passed again (the CLI loads it, then calls train) used to be turned into a
    tensor over read-only memory (torch's "NumPy array is not writable" warning)."""
    from tensoralg.sae.training import as_activations

    path = tmp_path / "acts.npy"
    np.save(path, syn.x.numpy())
    mm = as_activations(path)
    assert isinstance(mm, np.memmap)
    assert isinstance(as_activations(mm), np.memmap)           # second pass keeps the memmap
    ro = syn.x.numpy().copy()
    ro.flags.writeable = False
    assert isinstance(as_activations(ro), np.ndarray)
    assert isinstance(as_activations(syn.x.numpy().copy()), torch.Tensor)
    cfg = SAEConfig(8, 12, 2)
    a, _ = train(mm, cfg, TrainConfig(steps=5, batch_size=64))
    b, _ = train(ro, cfg, TrainConfig(steps=5, batch_size=64))
    c, _ = train(syn.x, cfg, TrainConfig(steps=5, batch_size=64))
    assert torch.equal(a.W_dec, c.W_dec) and torch.equal(b.W_dec, c.W_dec)
    assert not mm.flags.writeable                               # nothing was written to the file


@pytest.mark.parametrize("kind", ["pickle", "object", "text", "garbage", "strings"])
def test_non_numeric_npy_never_suggests_unsafe_loading(tmp_path, kind):
    import pickle

    path = tmp_path / f"{kind}.npy"
    if kind == "pickle":
        path.write_bytes(pickle.dumps([1, 2, 3]))
    elif kind == "object":
        np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    elif kind == "text":
        path.write_text("1,2,3\n4,5,6\n")
    elif kind == "garbage":
        path.write_bytes(b"\x93NUMPY\x01\x00garbage")
    else:
        np.save(path, np.array([["a", "b"], ["c", "d"]]))
    with pytest.raises(ValueError, match=r"not a numeric \.npy array of shape \(n, d_in\)") as e:
        train(path, SAEConfig(2, 4, 1), TrainConfig(steps=1, batch_size=1))
    assert "pickle=" not in str(e.value) and e.value.__cause__ is None


def test_steps_zero_is_initialization_only(syn, tmp_path):
    cfg = make_config("isae", 8, 12, 2)
    model, hist = train(syn.x, cfg, TrainConfig(steps=0, seed=2), out=tmp_path / "r")
    assert hist == []
    init = SparseAutoencoder(cfg, seed=2)
    assert torch.equal(model.W_dec, init.W_dec)
    assert json.loads((tmp_path / "r" / "cfg.json").read_text())["train_step"] == 0
