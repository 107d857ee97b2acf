"""SAE folders in SAELens's layout: reading SAELens-written TopK / AbsTopK folders (fixtures in
``tests/fixtures/saelens``, written by ``make_fixtures.py`` with the safetensors library, not by
tensoralg), writing folders SAELens can read, and errors for what is not supported."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as np_load, save_file as np_save

from tensoralg.sae.formats import (ENCODER_STEPS_FILE, SAE_WEIGHTS_FILE, load_sae, save_sae)
from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.sae.presets import make_config

FIX = Path(__file__).parent / "fixtures" / "saelens"

# SAELens 6.54 TopKSAEConfig / AbsTopKSAEConfig fields and their types (sae_lens/saes/sae.py
# SAEConfig and sae_lens/saes/topk_sae.py TopKSAEConfig); its loader keeps only these keys.
SAELENS_FIELDS = {"d_in": int, "d_sae": int, "dtype": str, "device": str,
                  "apply_b_dec_to_input": bool, "normalize_activations": str,
                  "reshape_activations": str, "k": int, "rescale_acts_by_decoder_norm": bool,
                  "architecture": str}
SAELENS_ARCHITECTURES = {"topk", "abstopk"}        # both registered by SAELens 6.54


def _saelens_codes(folder: Path, x: np.ndarray) -> np.ndarray:
    """SAELens's TopK / AbsTopK ``encode`` written out in numpy float64 from its definition:
    ``h = (x - b_dec) @ W_enc + b_enc``; TopK keeps the k largest h and applies ReLU, AbsTopK
    keeps the k largest |h| with their sign."""
    w = {k: v.astype(np.float64) for k, v in np_load(str(folder / SAE_WEIGHTS_FILE)).items()}
    cfg = json.loads((folder / "cfg.json").read_text())
    h = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    score = np.abs(h) if cfg["architecture"] == "abstopk" else h
    idx = np.argsort(-score, axis=1, kind="stable")[:, :cfg["k"]]
    z = np.zeros_like(h)
    np.put_along_axis(z, idx, np.take_along_axis(h, idx, axis=1), axis=1)
    return z if cfg["architecture"] == "abstopk" else np.maximum(z, 0.0)


@pytest.mark.parametrize("arch", ["topk", "abstopk"])
def test_reads_saelens_folders_with_their_architecture(arch):
    model = load_sae(FIX / arch)
    assert model.cfg.activation == arch and model.cfg.k == 3
    x = np.random.default_rng(0).standard_normal((200, 6))
    want = _saelens_codes(FIX / arch, x)
    with torch.no_grad():
        got = model.encode(torch.tensor(x, dtype=torch.float32)).double().numpy()
    assert np.array_equal(got != 0, want != 0)           # 100 % of supports agree
    # float32 model vs float64 definition: relative error of a float32 affine map
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    if arch == "topk":
        assert (got >= 0).all()
    else:
        assert (got < 0).any()
    # the decoder is taken as stored (rows not renormalized)
    w = np_load(str(FIX / arch / SAE_WEIGHTS_FILE))
    assert np.array_equal(model.W_dec.detach().numpy(), w["W_dec"])


def _copy(tmp_path, arch="topk", **cfg_changes):
    dst = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
    shutil.copytree(FIX / arch, dst)
    cfg = json.loads((dst / "cfg.json").read_text())
    for k, v in cfg_changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (dst / "cfg.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"architecture": "jumprelu"}, r"architecture 'jumprelu' is not supported"),
    ({"architecture": "standard"}, r"architecture 'standard' is not supported"),
    ({"architecture": None}, r"no 'architecture' field"),
    ({"activation": "abstopk"}, r"'activation' 'abstopk' contradicts architecture 'topk'"),
    ({"rescale_acts_by_decoder_norm": True}, r"rescale_acts_by_decoder_norm=True"),
    ({"apply_b_dec_to_input": False}, r"apply_b_dec_to_input=False"),
    ({"normalize_activations": "expected_average_only_in"}, r"normalize_activations="),
    ({"reshape_activations": "hook_z"}, r"reshape_activations='hook_z'"),
    ({"dtype": "int8"}, r"dtype 'int8' is not supported"),
    ({"k": None}, r"missing required SAE fields \['k'\]"),
])
def test_unsupported_saelens_options_are_errors(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        load_sae(_copy(tmp_path, **changes))


def test_weight_file_errors(tmp_path):
    extra = _copy(tmp_path)
    w = np_load(str(extra / SAE_WEIGHTS_FILE))
    np_save({**w, "threshold": np.zeros(10, np.float32)}, str(extra / SAE_WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"unexpected tensors \['threshold'\]"):
        load_sae(extra)
    gone = _copy(tmp_path)
    (gone / SAE_WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="sae_weights.safetensors"):
        load_sae(gone)
    half = _copy(tmp_path, dtype="bfloat16")
    assert load_sae(half).cfg.dtype == "float32"        # upcast (exact)


@pytest.mark.parametrize("preset", ["topk", "abstopk", "isae", "isae-me"])
def test_written_folders_are_in_saelens_layout_and_round_trip(tmp_path, preset):
    model = SparseAutoencoder(make_config(preset, 5, 9, 2), seed=1)
    with torch.no_grad():
        model.b_enc.normal_()
        model.b_dec.normal_()
    save_sae(tmp_path / "s", model, {"train_step": 3})
    w = np_load(str(tmp_path / "s" / SAE_WEIGHTS_FILE))
    # SAELens loads this file with a strict load_state_dict: exactly its four tensors
    assert {k: v.shape for k, v in w.items()} == {"W_enc": (5, 9), "b_enc": (9,),
                                                   "W_dec": (9, 5), "b_dec": (5,)}
    cfg = json.loads((tmp_path / "s" / "cfg.json").read_text())
    for field, typ in SAELENS_FIELDS.items():
        assert isinstance(cfg[field], typ), field
    assert cfg["architecture"] in SAELENS_ARCHITECTURES
    assert cfg["architecture"] == model.cfg.activation
    assert (cfg["apply_b_dec_to_input"], cfg["rescale_acts_by_decoder_norm"]) == (True, False)
    assert (cfg["normalize_activations"], cfg["reshape_activations"]) == ("none", "none")
    assert (tmp_path / "s" / ENCODER_STEPS_FILE).exists() == (preset == "isae-me")
    # what SAELens computes from these two files is its encode on the single-step part
    x = torch.randn(30, 5, generator=torch.Generator().manual_seed(0))
    if preset != "isae-me":
        z_saelens = _saelens_codes(tmp_path / "s", x.double().numpy())
        with torch.no_grad():
            assert np.array_equal(model.encode(x).numpy() != 0, z_saelens != 0)
    back = load_sae(tmp_path / "s")
    assert back.cfg == model.cfg
    with torch.no_grad():
        assert torch.equal(back.encode(x), model.encode(x))
        assert torch.equal(back(x), model(x))


def test_earlier_tensoralg_layout_still_loads(tmp_path):
    from tensoralg.io import save_folder
    model = SparseAutoencoder(make_config("isae-me", 4, 6, 2), seed=0)
    cfg = {**model.cfg.to_dict(), "architecture": "isae", "activation_fn": "abstopk"}
    cfg.pop("normalize_activations")
    save_folder(tmp_path / "old", {n: p.detach() for n, p in model.named_parameters()}, cfg)
    back = load_sae(tmp_path / "old")
    x = torch.randn(10, 4)
    with torch.no_grad():
        assert torch.equal(back.encode(x), model.encode(x))
    # saving again over it converts the folder and removes the old weights file
    save_sae(tmp_path / "old", back)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == [
        "cfg.json", "encoder_steps.safetensors", "sae_weights.safetensors"]
    bad = dict(cfg, activation="relu")
    save_folder(tmp_path / "bad", {n: p.detach() for n, p in model.named_parameters()}, bad)
    with pytest.raises(ValueError, match="needs an 'activation' field"):
        load_sae(tmp_path / "bad")


def test_layer_norm_matches_saelens_definition():
    cfg = SAEConfig(6, 10, 3, activation="topk", normalize_activations="layer_norm",
                    dtype="float64")
    model = SparseAutoencoder(cfg, seed=0)
    x = torch.randn(20, 6, dtype=torch.float64) * 3 + 1
    # SAELens run_time_activation_ln_in / _out: (x - mu) / (std + 1e-5), then * std + mu
    mu = x.mean(1, keepdim=True)
    std = (x - mu).std(1, keepdim=True)
    xn = (x - mu) / (std + 1e-5)
    plain = SparseAutoencoder(SAEConfig(6, 10, 3, activation="topk", dtype="float64"), seed=0)
    with torch.no_grad():
        assert torch.equal(model.encode(x), plain.encode(xn))
        torch.testing.assert_close(model(x), plain(xn) * std + mu, rtol=1e-12, atol=1e-12)
