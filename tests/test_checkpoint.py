"""tensoralg.checkpoint: save/load folders, errors, wrapping a foreign state_dict."""

import json

import numpy as np
import pytest
import torch

from tensoralg.checkpoint import from_state_dict, load_checkpoint, load_network, save_checkpoint
from tensoralg.nn import BilinearNet


def _model(**kw):
    return BilinearNet(6, 3, d_model=4, d_hidden=5, n_layers=2, bias=True, residual=True,
                       head_bias=True, seed=kw.pop("seed", 1), **kw)


def test_roundtrip_weights_and_config(tmp_path):
    m = _model()
    save_checkpoint(tmp_path / "c", m, step=42, provenance={"data": "digits", "lr": 0.01})
    m2, cfg = load_checkpoint(tmp_path / "c")
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert cfg["step"] == 42 and cfg["data"] == "digits" and cfg["d_hidden"] == 5
    assert cfg["dtype"] == "float32" and "tensoralg_version" in cfg
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["cfg.json", "weights.safetensors"]
    x = np.random.default_rng(0).normal(size=(4, 6))
    assert np.allclose(load_network(tmp_path / "c")(x), m.to_network()(x), rtol=0, atol=0)


def test_missing_truncated_and_mismatched(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope")
    m = _model()
    save_checkpoint(tmp_path / "c", m)
    w = tmp_path / "c" / "weights.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_checkpoint(tmp_path / "c")
    w.unlink()
    with pytest.raises(FileNotFoundError, match="weights.safetensors"):
        load_checkpoint(tmp_path / "c")
    # weights of a different size than cfg.json claims
    save_checkpoint(tmp_path / "d", m)
    cfg_path = tmp_path / "d" / "cfg.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["d_hidden"] = 7
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        load_checkpoint(tmp_path / "d")
    cfg["d_hidden"], cfg["n_layers"] = 5, 1
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unexpected"):
        load_checkpoint(tmp_path / "d")
    cfg["architecture"] = "mlp"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture"):
        load_checkpoint(tmp_path / "d")
    cfg_path.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt JSON"):
        load_checkpoint(tmp_path / "d")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_weights_rejected(tmp_path, value):
    m = _model()
    with torch.no_grad():
        m.blocks[1].down.weight[0, 0] = value
    # saving refuses (naming the tensor) and writes nothing
    with pytest.raises(ValueError, match=r"'blocks\.1\.down\.weight'.*non-finite"):
        save_checkpoint(tmp_path / "c", m)
    assert not (tmp_path / "c").exists()
    # a folder written some other way is refused on load
    from tensoralg.io import save_folder

    save_folder(tmp_path / "d", m.state_dict(), {"format": "tensoralg.checkpoint/1",
                                                   **m.config(), "step": 0})
    with pytest.raises(ValueError, match=r"'blocks\.1\.down\.weight'.*non-finite"):
        load_checkpoint(tmp_path / "d")


def test_bad_save_arguments(tmp_path):
    with pytest.raises(TypeError, match="BilinearNet"):
        save_checkpoint(tmp_path / "c", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="overwrite"):
        save_checkpoint(tmp_path / "c", _model(), provenance={"d_in": 3})
    with pytest.raises(ValueError, match="flat"):
        save_checkpoint(tmp_path / "c", _model(), provenance={"run": {"a": 1}})


class TheirBilinear(torch.nn.Module):
    """Somebody else's residual bilinear model with their own parameter names."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.W_E = torch.nn.Parameter(torch.randn(4, 6, generator=g, dtype=torch.float64))
        self.W_l = torch.nn.Parameter(torch.randn(8, 4, generator=g, dtype=torch.float64))
        self.W_r = torch.nn.Parameter(torch.randn(8, 4, generator=g, dtype=torch.float64))
        self.W_d = torch.nn.Parameter(torch.randn(4, 8, generator=g, dtype=torch.float64))
        self.W_U = torch.nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64))

    def forward(self, x):
        h = x @ self.W_E.T
        h = h + ((h @ self.W_l.T) * (h @ self.W_r.T)) @ self.W_d.T
        return h @ self.W_U.T


def test_wrap_foreign_state_dict(tmp_path):
    theirs = TheirBilinear()
    names = {"embed.weight": "W_E", "blocks.0.left.weight": "W_l",
             "blocks.0.right.weight": "W_r", "blocks.0.down.weight": "W_d",
             "head.weight": "W_U"}
    with pytest.warns(UserWarning, match="stored transposed"):   # no check= given
        ours = from_state_dict(theirs.state_dict(), names, residual=True)
    assert ours.config()["dtype"] == "float64" and ours.config()["d_hidden"] == 8
    x = torch.randn(9, 6, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x), rtol=1e-13, atol=0)
    save_checkpoint(tmp_path / "w", ours, provenance={"source": "TheirBilinear"})
    assert load_checkpoint(tmp_path / "w")[1]["source"] == "TheirBilinear"
    with pytest.raises(ValueError, match="not in the state_dict"):
        from_state_dict(theirs.state_dict(), {**names, "head.weight": "W_out"}, residual=True)
    with pytest.raises(ValueError, match="head.weight"):
        from_state_dict(theirs.state_dict(), {k: v for k, v in names.items() if k != "head.weight"},
                        residual=True, ignore=["W_U"])
    bad = dict(theirs.state_dict())
    bad["W_d"] = torch.zeros(5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="shape"):
        from_state_dict(bad, names, residual=True)


@pytest.mark.parametrize("key, ours, shape", [
    ("W_l", "blocks.0.left.weight", (3, 4)),    # d_hidden cut in the first tensor read
    ("W_r", "blocks.0.right.weight", (8, 5)),   # d_model wrong in one block input
    ("W_d", "blocks.0.down.weight", (4, 7)),    # d_hidden wrong in the down matrix
    ("W_E", "embed.weight", (5, 6)),            # d_model wrong in the embedding
])
def test_shape_error_names_the_inconsistent_tensor(key, ours, shape):
    theirs = TheirBilinear()
    names = {"embed.weight": "W_E", "blocks.0.left.weight": "W_l",
             "blocks.0.right.weight": "W_r", "blocks.0.down.weight": "W_d",
             "head.weight": "W_U"}
    bad = dict(theirs.state_dict())
    bad[key] = torch.zeros(*shape, dtype=torch.float64)
    with pytest.raises(ValueError) as exc:
        from_state_dict(bad, names, residual=True)
    msg = str(exc.value)
    assert f"{ours!r} (their {key!r}) has shape {shape}" in msg
    # only the culprit is blamed: every consistent tensor stays out of the message
    for other, their in names.items():
        if other != ours:
            assert their not in msg.replace(f"their {key!r}", "")
    assert "d_model=4" in msg and "d_hidden=8" in msg


def test_foreign_nan_and_vector_weights_rejected():
    theirs = TheirBilinear()
    names = {"embed.weight": "W_E", "blocks.0.left.weight": "W_l",
             "blocks.0.right.weight": "W_r", "blocks.0.down.weight": "W_d",
             "head.weight": "W_U"}
    bad = dict(theirs.state_dict())
    bad["W_U"] = bad["W_U"].clone()
    bad["W_U"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="'head.weight'.*NaN"):
        from_state_dict(bad, names, residual=True)
    bad["W_U"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'head.weight'.*matrix"):
        from_state_dict(bad, names, residual=True)


class TheirLinearBilinear(torch.nn.Module):
    """A model built from nn.Linear with their default biases (the case that used to lose them)."""

    def __init__(self, residual=True, down_bias=True):
        super().__init__()
        torch.manual_seed(3)
        self.residual = residual
        self.emb = torch.nn.Linear(6, 4, dtype=torch.float64)
        self.l = torch.nn.Linear(4, 8, dtype=torch.float64)
        self.r = torch.nn.Linear(4, 8, dtype=torch.float64)
        self.d = torch.nn.Linear(8, 4, bias=down_bias, dtype=torch.float64)
        self.out = torch.nn.Linear(4, 3, dtype=torch.float64)
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x):
        h = self.emb(x)
        y = self.d(self.l(h) * self.r(h))
        return self.out(h + y if self.residual else y)


_WEIGHTS = {"embed.weight": "emb.weight", "blocks.0.left.weight": "l.weight",
            "blocks.0.right.weight": "r.weight", "blocks.0.down.weight": "d.weight",
            "head.weight": "out.weight"}
_BIASES = {"embed.bias": "emb.bias", "blocks.0.left.bias": "l.bias",
           "blocks.0.right.bias": "r.bias", "blocks.0.down.bias": "d.bias", "head.bias": "out.bias"}


def test_unmapped_tensors_are_an_error_not_dropped():
    theirs = TheirLinearBilinear()
    with pytest.raises(ValueError) as exc:
        from_state_dict(theirs.state_dict(), _WEIGHTS, residual=True)
    msg = str(exc.value)
    for name in ("emb.bias", "l.bias", "r.bias", "d.bias", "out.bias", "steps"):
        assert name in msg
    assert "ignore=" in msg
    with pytest.raises(ValueError, match="ignore.*not in the state_dict"):
        from_state_dict(theirs.state_dict(), {**_WEIGHTS, **_BIASES}, residual=True,
                        ignore=["nope"])
    x = torch.randn(16, 6, dtype=torch.float64)
    ours = from_state_dict(theirs.state_dict(), {**_WEIGHTS, **_BIASES}, residual=True,
                           ignore=["steps"], check=(theirs, x))
    with torch.no_grad():
        # float64 on both sides, same operations in another order: rounding only
        assert torch.allclose(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
    # ignoring the biases deliberately is allowed, and check= then catches the changed function
    with pytest.raises(ValueError, match="differs from module"):
        from_state_dict(theirs.state_dict(), _WEIGHTS, residual=True,
                        ignore=["steps"] + list(_BIASES.values()), check=(theirs, x))


def test_missing_down_bias_is_zero_and_exact():
    theirs = TheirLinearBilinear(down_bias=False)
    names = {**_WEIGHTS, **{k: v for k, v in _BIASES.items() if k != "blocks.0.down.bias"}}
    x = torch.randn(16, 6, dtype=torch.float64)
    ours = from_state_dict(theirs.state_dict(), names, residual=True, ignore="steps",
                           check=(theirs, x))
    assert torch.equal(ours.blocks[0].down.bias, torch.zeros(4, dtype=torch.float64))


def test_residual_has_no_default_and_check_catches_a_wrong_flag():
    theirs = TheirLinearBilinear(residual=True)
    names = {**_WEIGHTS, **_BIASES}
    with pytest.raises(TypeError, match="residual"):
        from_state_dict(theirs.state_dict(), names, ignore="steps")
    with pytest.raises(TypeError, match="residual"):
        from_state_dict(theirs.state_dict(), names, residual=None, ignore="steps")
    x = torch.randn(16, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="differs from module.*residual"):
        from_state_dict(theirs.state_dict(), names, residual=False, ignore="steps",
                        check=(theirs, x))
    with pytest.raises(ValueError, match=r"inputs must have shape \(n, 6\)"):
        from_state_dict(theirs.state_dict(), names, residual=True, ignore="steps",
                        check=(theirs, x[:, :5]))
    with pytest.raises(TypeError, match="module, inputs"):
        from_state_dict(theirs.state_dict(), names, residual=True, ignore="steps", check=theirs)
    # a float32 model is checked at float32 tolerance
    t32 = TheirLinearBilinear().float()
    from_state_dict(t32.state_dict(), names, residual=True, ignore="steps",
                    check=(t32, x.float()))


@pytest.mark.parametrize("edit", [{"residual": False}, {"bias": False}, {"head_bias": False}])
def test_forward_probe_refuses_an_edited_config(tmp_path, edit):
    m = _model()
    with torch.no_grad():  # non-zero biases, so that dropping them changes the function
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    save_checkpoint(tmp_path / "c", m)
    cfg_path = tmp_path / "c" / "cfg.json"
    cfg = json.loads(cfg_path.read_text())
    assert len(cfg["probe_output"]) == cfg["probe_rows"] * 3
    load_checkpoint(tmp_path / "c")  # untouched: loads
    key = next(iter(edit))
    assert cfg[key] != edit[key]
    cfg.update(edit)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError):  # bias flags also break the name check; residual only the probe
        load_checkpoint(tmp_path / "c")
    if key == "residual":
        with pytest.raises(ValueError, match="forward probe"):
            load_checkpoint(tmp_path / "c")


def test_checkpoint_without_probe_loads_with_a_warning(tmp_path):
    from tensoralg.io import save_folder

    m = _model()
    save_folder(tmp_path / "old", m.state_dict(), {"format": "tensoralg.checkpoint/1",
                                                     **m.config(), "step": 0})
    with pytest.warns(UserWarning, match="no forward probe"):
        load_checkpoint(tmp_path / "old")


def test_other_format_version_and_integer_weights_are_refused(tmp_path):
    from tensoralg.io import save_folder

    m = _model()
    save_checkpoint(tmp_path / "c", m)
    cfg = json.loads((tmp_path / "c" / "cfg.json").read_text())
    cfg["format"] = "tensoralg.checkpoint/99"
    (tmp_path / "c" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"format 'tensoralg.checkpoint/99' is not"):
        load_checkpoint(tmp_path / "c")
    ints = {k: v.to(torch.int32) if k == "head.weight" else v for k, v in m.state_dict().items()}
    save_folder(tmp_path / "i", ints, {"format": "tensoralg.checkpoint/1", **m.config(),
                                       "step": 0})
    with pytest.raises(ValueError, match=r"'head\.weight' has dtype torch\.int32"):
        load_checkpoint(tmp_path / "i")


def test_weights_too_large_to_evaluate_are_named(tmp_path):
    from tensoralg.io import save_folder

    m = _model()
    save_checkpoint(tmp_path / "c", m)
    cfg = json.loads((tmp_path / "c" / "cfg.json").read_text())
    big = {k: v.double() * 1e300 for k, v in m.state_dict().items()}
    save_folder(tmp_path / "b", big, dict(cfg.items()))
    with pytest.raises(ValueError, match="probe overflowed"):
        load_checkpoint(tmp_path / "b")


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_lower_precision_weights_named_by_dtype(tmp_path, low):
    from safetensors.torch import load_file, save_file

    save_checkpoint(tmp_path / "c", _model())
    w = tmp_path / "c" / "weights.safetensors"
    save_file({k: v.to(low) for k, v in load_file(w).items()}, w)
    with pytest.raises(ValueError, match=f"has dtype {low} but cfg.json records 'float32'"):
        load_checkpoint(tmp_path / "c")
