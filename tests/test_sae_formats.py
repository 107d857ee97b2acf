"""SAE folders in SAELens's layout: reading folders written by SAELens 6.54 itself (fixtures in
``tests/fixtures/saelens``, written by ``make_fixtures.py`` with SAELens's own training classes
and ``save_inference_model``, together with SAELens's ``encode``/``decode``/``forward`` outputs
on a fixed input), writing folders SAELens can read, and errors for what is not supported.
SAELens is not needed to run these tests."""

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as np_load
from safetensors.numpy import save_file as np_save
from safetensors.torch import load_file as torch_load

from tensoralg.sae.formats import (
    ENCODER_STEPS_FILE,
    SAE_WEIGHTS_FILE,
    OldFormatWarning,
    UpcastWarning,
    fold_saelens_options,
    load_sae,
    save_sae,
)
from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.sae.presets import make_config

FIX = Path(__file__).parent / "fixtures" / "saelens"
OUTPUTS = "saelens_outputs.safetensors"
FIXTURES = sorted(p.name for p in FIX.iterdir() if (p / "cfg.json").is_file())
# what each fixture folder is (make_fixtures.py CASES): SAELens architecture in cfg.json and
# the tensoralg activation it must load as
WANT = {"standard": ("standard", "relu"), "standard_no_b_dec_in": ("standard", "relu"),
        "topk": ("topk", "topk"), "topk_no_rescale": ("topk", "topk"),
        "topk_layer_norm": ("topk", "topk"), "abstopk": ("abstopk", "abstopk"),
        "abstopk_no_rescale": ("abstopk", "abstopk"), "jumprelu": ("jumprelu", "jumprelu"),
        "jumprelu_no_b_dec_in": ("jumprelu", "jumprelu"), "batchtopk": ("jumprelu", "jumprelu"),
        "matryoshka_batchtopk": ("jumprelu", "jumprelu"),
        "topk_unfolded": ("topk", "topk"), "abstopk_unfolded": ("abstopk", "abstopk")}
# float32 weights, float32 SAELens outputs: the two compute the same affine map (d_in = 6 terms)
# in a different order (folded weights, fused bias), so they differ by a few float32 roundings;
# measured max 2.8e-7 relative to the largest output over all fixtures; 8 eps(float32) = 9.5e-7.
RTOL32 = 8 * float(np.finfo(np.float32).eps)

# SAELens 6.54 TopKSAEConfig / AbsTopKSAEConfig fields and their types (sae_lens/saes/sae.py
# SAEConfig and sae_lens/saes/topk_sae.py TopKSAEConfig); its loader keeps only these keys.
SAELENS_FIELDS = {"d_in": int, "d_sae": int, "dtype": str, "device": str,
                  "apply_b_dec_to_input": bool, "normalize_activations": str,
                  "reshape_activations": str, "k": int, "rescale_acts_by_decoder_norm": bool,
                  "architecture": str, "metadata": dict}
SAELENS_ARCHITECTURES = {"topk", "abstopk"}        # both registered by SAELens 6.54


def _saelens_codes(folder: Path, x: np.ndarray) -> np.ndarray:
    """SAELens's TopK / AbsTopK ``encode`` (no rescaling) written out in numpy float64 from its
    definition: ``h = (x - b_dec) @ W_enc + b_enc``; TopK keeps the k largest h and applies
    ReLU, AbsTopK keeps the k largest |h| with their sign."""
    w = {k: v.astype(np.float64) for k, v in np_load(str(folder / SAE_WEIGHTS_FILE)).items()}
    cfg = json.loads((folder / "cfg.json").read_text())
    h = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    score = np.abs(h) if cfg["architecture"] == "abstopk" else h
    idx = np.argsort(-score, axis=1, kind="stable")[:, :cfg["k"]]
    z = np.zeros_like(h)
    np.put_along_axis(z, idx, np.take_along_axis(h, idx, axis=1), axis=1)
    return z if cfg["architecture"] == "abstopk" else np.maximum(z, 0.0)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= RTOL32 * float(want.abs().max())


def test_fixtures_cover_every_saelens_trainer():
    assert sorted(FIXTURES) == sorted(WANT)
    assert (FIX / "VERSION").read_text().startswith("sae-lens 6.54.12")


@pytest.mark.parametrize("name", FIXTURES)
def test_saelens_folders_load_and_match_saelens_outputs(name):
    arch, act = WANT[name]
    cfg = json.loads((FIX / name / "cfg.json").read_text())
    assert cfg["architecture"] == arch
    model = load_sae(FIX / name)
    assert model.cfg.activation == act
    out = torch_load(str(FIX / name / OUTPUTS))
    x, acts = out["x"], out["feature_acts"]
    with torch.no_grad():
        z = model.encode(x)
        assert torch.equal(z != 0, acts != 0)            # the same latents fire on every row
        assert _close(z, acts)                            # with SAELens's values
        if cfg["normalize_activations"] == "none":
            assert _close(model.decode(acts), out["sae_out"])
        else:
            # SAELens's decode after encode(x) maps back through the layer norm of that encode:
            # here the statistics are given explicitly, and decoding without them is refused
            assert _close(model.decode(acts, stats=model.input_stats(x)), out["sae_out"])
            with pytest.raises(ValueError, match=r"normalizes each input row .*"
                                                 r"stats=sae.input_stats\(x\)"):
                model.decode(acts)
        # SAELens's decode after encode maps back through the layer norm of that encode
        assert _close(model(x), out["forward"])
        assert _close(model(x), out["sae_out"])
    if act in ("topk", "abstopk"):
        assert int((acts != 0).sum(1).max()) <= 3 == model.cfg.k
    assert model.metadata["model_name"] == "tiny-stories-1M"
    assert model.metadata["hook_name"] == "blocks.0.hook_resid_pre"


@pytest.mark.parametrize("name", ["topk", "abstopk"])
def test_rescale_flag_is_folded_into_unit_decoder_rows(name):
    """SAELens's TopK/AbsTopK trainers (``save_inference_model``) fold the decoder norms but keep
    rescale_acts_by_decoder_norm=True; its ``save_model`` keeps rows of any norm under the flag
    (the ``_unfolded`` fixtures). Loading folds the norms: W_dec rows become unit, W_enc columns
    and b_enc are multiplied by them."""
    trained = json.loads((FIX / name / "cfg.json").read_text())
    assert trained["rescale_acts_by_decoder_norm"] is True
    n_trained = torch_load(str(FIX / name / SAE_WEIGHTS_FILE))["W_dec"].norm(dim=1)
    torch.testing.assert_close(n_trained, torch.ones(10), rtol=0, atol=1e-6)
    unfolded = FIX / f"{name}_unfolded"
    assert json.loads((unfolded / "cfg.json").read_text())["rescale_acts_by_decoder_norm"]
    w = torch_load(str(unfolded / SAE_WEIGHTS_FILE))
    norms = w["W_dec"].norm(dim=1)
    assert float(norms.min()) < 0.9 and float(norms.max()) > 1.1      # not unit in the folder
    model = load_sae(unfolded)
    torch.testing.assert_close(model.W_dec.norm(dim=1), torch.ones(10), rtol=0, atol=1e-6)
    torch.testing.assert_close(model.W_enc, w["W_enc"] * norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.b_enc, w["b_enc"] * norms, rtol=1e-6, atol=0)
    saved_cfg = SAEConfig.from_dict({**model.cfg.to_dict()})
    assert saved_cfg == model.cfg


@pytest.mark.parametrize("b_dec_in, rescale", [(True, True), (False, False), (False, True)])
def test_fold_is_exact_in_float64(b_dec_in, rescale):
    """The folded affine map equals SAELens's definition written out in float64 to 1e-12."""
    g = torch.Generator().manual_seed(3)
    w = {"W_enc": torch.randn(5, 8, generator=g, dtype=torch.float64),
         "b_enc": torch.randn(8, generator=g, dtype=torch.float64),
         "W_dec": torch.randn(8, 5, generator=g, dtype=torch.float64) * 3,
         "b_dec": torch.randn(5, generator=g, dtype=torch.float64)}
    f = fold_saelens_options(w, b_dec_in, rescale)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    n = w["W_dec"].norm(dim=1) if rescale else torch.ones(8, dtype=torch.float64)
    pre = ((x - w["b_dec"] * b_dec_in) @ w["W_enc"] + w["b_enc"]) * n      # SAELens
    torch.testing.assert_close((x - f["b_dec"]) @ f["W_enc"] + f["b_enc"], pre,
                               rtol=1e-12, atol=1e-12)
    z = torch.randn(40, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(z @ f["W_dec"] + f["b_dec"], (z / n) @ w["W_dec"] + w["b_dec"],
                               rtol=1e-12, atol=1e-12)


def _copy(tmp_path, arch="topk_no_rescale", **cfg_changes):
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


@pytest.mark.parametrize("arch, changes, match", [
    ("topk_no_rescale", {"architecture": "gated"}, r"architecture 'gated' is not supported"),
    ("topk_no_rescale", {"architecture": "transcoder"}, r"architecture 'transcoder' is not"),
    ("topk_no_rescale", {"architecture": None}, r"no 'architecture' field"),
    ("topk_no_rescale", {"activation": "abstopk"},
     r"'activation' 'abstopk' contradicts architecture 'topk'"),
    ("standard", {"rescale_acts_by_decoder_norm": True},
     r"rescale_acts_by_decoder_norm=True is not supported for architecture 'standard'"),
    ("topk_no_rescale", {"apply_b_dec_to_input": "yes"}, r"apply_b_dec_to_input='yes'"),
    ("topk_no_rescale", {"normalize_activations": "expected_average_only_in"},
     r"normalize_activations='expected_average_only_in' is not supported"),
    ("topk_no_rescale", {"normalize_activations": "covariance_whitening"},
     r"normalize_activations='covariance_whitening' is not supported"),
    ("topk_no_rescale", {"reshape_activations": "hook_z"}, r"reshape_activations='hook_z'"),
    ("topk_no_rescale", {"finetuning_scaling_factor": True}, r"finetuning_scaling_factor=True"),
    ("topk_no_rescale", {"dtype": "int8"}, r"dtype 'int8' is not supported"),
    ("topk_no_rescale", {"k": None}, r"missing required SAE fields \['k'\]"),
    ("jumprelu", {"d_sae": None}, r"missing required SAE fields \['d_sae'\]"),
    ("topk_no_rescale", {"metadata": [1, 2]}, r"'metadata' must be a dict"),
    ("abstopk", {"architecture": "tensoralg_multistep_abstopk", "encoder": "single"},
     r"needs encoder='multistep'"),
])
def test_unsupported_saelens_options_are_errors(tmp_path, arch, changes, match):
    with pytest.raises(ValueError, match=match):
        load_sae(_copy(tmp_path, arch, **changes))


def test_weight_file_errors(tmp_path):
    extra = _copy(tmp_path)
    w = np_load(str(extra / SAE_WEIGHTS_FILE))
    np_save({**w, "threshold": np.zeros(10, np.float32)}, str(extra / SAE_WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"unexpected tensors \['threshold'\]"):
        load_sae(extra)
    lacking = _copy(tmp_path, "jumprelu")
    w = np_load(str(lacking / SAE_WEIGHTS_FILE))
    np_save({k: v for k, v in w.items() if k != "threshold"}, str(lacking / SAE_WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"lack tensors \['threshold'\]"):
        load_sae(lacking)
    gone = _copy(tmp_path)
    (gone / SAE_WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="sae_weights.safetensors"):
        load_sae(gone)
    zero = _copy(tmp_path, "topk")
    w = np_load(str(zero / SAE_WEIGHTS_FILE))
    w["W_dec"][4] = 0.0
    np_save(w, str(zero / SAE_WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"decoder rows \[4\] are zero"):
        load_sae(zero)
    nan = _copy(tmp_path, "jumprelu")
    w = np_load(str(nan / SAE_WEIGHTS_FILE))
    w["threshold"][0] = np.nan
    np_save(w, str(nan / SAE_WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"tensor threshold contains NaN"):
        load_sae(nan)
    half = _copy(tmp_path, dtype="bfloat16")
    with pytest.warns(UpcastWarning, match=r"bfloat16 weights were upcast to float32"):
        assert load_sae(half).cfg.dtype == "float32"        # upcast (exact)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_folders_are_upcast_and_say_so(tmp_path, half):
    from safetensors.torch import save_file
    src = _copy(tmp_path, "topk")
    w = torch_load(str(src / SAE_WEIGHTS_FILE))
    save_file({k: v.to(half) for k, v in w.items()}, str(src / SAE_WEIGHTS_FILE))
    name = str(half).replace("torch.", "")
    cfg = json.loads((src / "cfg.json").read_text())
    (src / "cfg.json").write_text(json.dumps({**cfg, "dtype": name}))
    with pytest.warns(UpcastWarning, match=rf"{src}: {name} weights were upcast to float32 "
                                           rf"\(exactly\) and the SAE computes in float32"):
        model = load_sae(src)
    assert model.upcast_from == name and model.W_dec.dtype == torch.float32
    # exact upcast: the float32 weights are the half-precision values (after the rescale fold,
    # computed in float64 from them)
    assert torch.equal(model.b_dec, w["b_dec"].to(half).float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # a float32 folder loads silently
        assert load_sae(FIX / "topk").upcast_from is None


def test_dense_saelens_saes_are_inference_only():
    model = load_sae(FIX / "jumprelu")
    with pytest.raises(ValueError, match="activation='jumprelu': SAEs read from SAELens"):
        model.loss(torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"expected k == d_sae=10"):
        SAEConfig(6, 10, 3, activation="relu")


@pytest.mark.parametrize("preset", ["topk", "abstopk", "isae", "isae-me"])
def test_written_folders_are_in_saelens_layout_and_round_trip(tmp_path, preset):
    model = SparseAutoencoder(make_config(preset, 5, 9, 2), seed=1)
    with torch.no_grad():
        model.b_enc.normal_()
        model.b_dec.normal_()
    meta = {"model_name": "m", "hook_name": "blocks.1", "dataset_path": "corpus"}
    save_sae(tmp_path / "s", model, {"train_step": 3}, metadata=meta)
    w = np_load(str(tmp_path / "s" / SAE_WEIGHTS_FILE))
    cfg = json.loads((tmp_path / "s" / "cfg.json").read_text())
    multistep = preset == "isae-me"
    core = {"W_enc": (5, 9), "b_enc": (9,), "W_dec": (9, 5), "b_dec": (5,)}
    if multistep:
        # an architecture SAELens does not know: its loader refuses the folder (never reads
        # it as the single-step AbsTopK of the first encoder pass)
        assert cfg["architecture"] == "tensoralg_multistep_abstopk"
        assert cfg["architecture"] not in SAELENS_ARCHITECTURES | {"standard", "jumprelu"}
        assert {k: v.shape for k, v in w.items()} == {**core, "W_step": (5, 9)}
    else:
        # SAELens loads this file with a strict load_state_dict: exactly its four tensors
        assert {k: v.shape for k, v in w.items()} == core
        assert cfg["architecture"] in SAELENS_ARCHITECTURES
        assert cfg["architecture"] == model.cfg.activation
    for field, typ in SAELENS_FIELDS.items():
        assert isinstance(cfg[field], typ), field
    assert cfg["metadata"] == {**meta, "sae_lens_version": "6.0.0"}   # the format version
    assert (cfg["apply_b_dec_to_input"], cfg["rescale_acts_by_decoder_norm"]) == (True, False)
    assert (cfg["normalize_activations"], cfg["reshape_activations"]) == ("none", "none")
    assert not (tmp_path / "s" / ENCODER_STEPS_FILE).exists()
    x = torch.randn(30, 5, generator=torch.Generator().manual_seed(0))
    if not multistep:
        z_saelens = _saelens_codes(tmp_path / "s", x.double().numpy())
        with torch.no_grad():
            assert np.array_equal(model.encode(x).numpy() != 0, z_saelens != 0)
    back = load_sae(tmp_path / "s")
    assert back.cfg == model.cfg and back.metadata == cfg["metadata"]
    with torch.no_grad():
        assert torch.equal(back.encode(x), model.encode(x))
        assert torch.equal(back(x), model(x))


@pytest.mark.parametrize("name", ["topk_no_rescale", "abstopk_no_rescale", "standard",
                                  "jumprelu", "batchtopk", "matryoshka_batchtopk"])
def test_saelens_folder_round_trips_bit_identically(tmp_path, name):
    """SAELens -> tensoralg -> folder: the same tensors, bit for bit, and the same metadata,
    for folders that need no folding."""
    model = load_sae(FIX / name)
    save_sae(tmp_path / "s", model)
    a = np_load(str(FIX / name / SAE_WEIGHTS_FILE))
    b = np_load(str(tmp_path / "s" / SAE_WEIGHTS_FILE))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    src = json.loads((FIX / name / "cfg.json").read_text())
    out = json.loads((tmp_path / "s" / "cfg.json").read_text())
    assert out["metadata"] == src["metadata"]
    for key in ("architecture", "d_in", "d_sae", "dtype", "apply_b_dec_to_input",
                "normalize_activations", "reshape_activations", "rescale_acts_by_decoder_norm",
                "k"):
        assert out.get(key) == src.get(key) or (key == "k" and "k" not in src), key


def test_earlier_multistep_layout_still_loads(tmp_path):
    """tensoralg before this layout wrote iSAE-ME folders as 'abstopk' with encoder
    'multistep' and the step tensors in encoder_steps.safetensors."""
    from safetensors.torch import save_file
    model = SparseAutoencoder(make_config("isae-me", 4, 6, 2), seed=0)
    t = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    (tmp_path / "old").mkdir()
    save_file({k: t[k] for k in ("W_enc", "b_enc", "W_dec", "b_dec")},
              str(tmp_path / "old" / SAE_WEIGHTS_FILE))
    save_file({"W_step": t["W_step"]}, str(tmp_path / "old" / ENCODER_STEPS_FILE))
    cfg = {**model.cfg.to_dict(), "architecture": "abstopk"}
    (tmp_path / "old" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.warns(OldFormatWarning, match=r"earlier folder format .* SAELens reads such a "
                                              r"folder as a single-step abstopk SAE .* Re-save "
                                              r"it .*save_sae\("):
        back = load_sae(tmp_path / "old")
    x = torch.randn(10, 4)
    with torch.no_grad():
        assert torch.equal(back.encode(x), model.encode(x))
    save_sae(tmp_path / "old", back)          # converted: one weights file, SAELens-refused name
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == [
        "cfg.json", "sae_weights.safetensors"]
    assert json.loads((tmp_path / "old" / "cfg.json").read_text())["architecture"] == \
        "tensoralg_multistep_abstopk"
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # re-saved: no warning any more
        assert torch.equal(load_sae(tmp_path / "old").encode(x), model.encode(x))


def test_save_refuses_bad_metadata_before_writing(tmp_path):
    model = SparseAutoencoder(make_config("topk", 4, 6, 2), seed=0)
    with pytest.raises(ValueError, match="metadata: expected a dict"):
        save_sae(tmp_path / "a", model, metadata=["x"])
    with pytest.raises(ValueError, match="not JSON-serializable"):
        save_sae(tmp_path / "a", model, metadata={"model": object()})
    with pytest.raises(ValueError, match="would overwrite"):
        save_sae(tmp_path / "a", model, {"metadata": 1})
    assert not (tmp_path / "a").exists()


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
        "cfg.json", "sae_weights.safetensors"]
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


def test_register_without_saelens_names_the_package():
    import importlib.util
    if importlib.util.find_spec("sae_lens") is not None:
        pytest.skip("SAELens is installed here: tests/test_sae_saelens_interop.py covers it")
    from tensoralg.sae.saelens_compat import register
    with pytest.raises(ImportError, match="SAELens is not installed"):
        register()
