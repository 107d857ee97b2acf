"""BilinearAttention as a layer: forward (numpy, torch, rationals), per-position layers on
sequences, specs, and input validation."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

import tensoralg as ta
from tensoralg.layers import rope_rotations


def _attn(rng, H=2, dh=2, d=3, dv=2, d_out=None, bias=True, **kw):
    d_out = d if d_out is None else d_out
    W = lambda *s: rng.normal(size=s)  # noqa: E731
    b = dict(q1_bias=W(H, dh), k1_bias=W(H, dh), q2_bias=W(H, dh), k2_bias=W(H, dh),
             v_bias=W(H, dv), o_bias=W(d_out)) if bias else {}
    return ta.BilinearAttention(W(H, dh, d), W(H, dh, d), W(H, dh, d), W(H, dh, d), W(H, dv, d),
                                W(d_out, H, dv), **b, **kw)


def _loop_reference(layer, X):
    """Forward by explicit loops over samples, positions, heads (the definition, docs/mathematics.md §3.7)."""
    n, T, _d = X.shape
    mask = np.asarray(layer.mask_matrix(T), dtype=float)
    R = layer.rotations(T)
    L = {k: np.asarray(v, dtype=float) for k, v in layer.lifted().items() if v is not None}
    out = np.zeros((n, T, layer.out_features))
    for i in range(n):
        xt = np.concatenate([np.ones((T, 1)), X[i]], 1)
        for t in range(T):
            for s in range(T):
                for h in range(layer.n_heads):
                    rot = (lambda p, v: v) if R is None else (lambda p, v: R[p] @ v)
                    q1, k1 = rot(t, L["q1"][h] @ xt[t]), rot(s, L["k1"][h] @ xt[s])
                    q2, k2 = rot(t, L["q2"][h] @ xt[t]), rot(s, L["k2"][h] @ xt[s])
                    pat = mask[t, s] * float(layer.scale) * (q1 @ k1) * (q2 @ k2)
                    out[i, t] += pat * (L["o"][:, h, :] @ (L["v"][h] @ xt[s]))
            if layer.o_bias is not None:
                out[i, t] += L["o_bias"]
    return out


@pytest.mark.parametrize("mask", ["causal", "none", "array"])
@pytest.mark.parametrize("rope", [None, 100.0])
def test_forward_matches_loop_definition_numpy_and_torch(mask, rope):
    rng = np.random.default_rng(0)
    m = rng.normal(size=(4, 4)) if mask == "array" else mask
    layer = _attn(rng, mask=m, rope=rope)
    X = rng.normal(size=(3, 4, 3))
    y = layer(X)
    ref = _loop_reference(layer, X)
    # same float64 operations summed in another order: agreement to a few ulps of the scale
    assert np.allclose(y, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    yt = layer(torch.tensor(X))
    assert isinstance(yt, torch.Tensor) and yt.dtype == torch.float64
    assert np.allclose(yt.numpy(), y, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


def test_causal_mask_output_at_t_ignores_later_positions():
    rng = np.random.default_rng(1)
    layer = _attn(rng)
    X = rng.normal(size=(2, 3, 3))
    X2 = X.copy()
    X2[:, 2] += 5.0
    assert np.array_equal(layer(X)[:, :2], layer(X2)[:, :2])


def test_default_scale_and_rationals():
    fr = lambda x: np.array(x, dtype=object)  # noqa: E731  (object arrays: kept rational)
    layer = ta.BilinearAttention(fr([[[1, 0]]]), fr([[[0, 1]]]), fr([[["1/2", 0]]]),
                                 fr([[[1, 1]]]), fr([[[1, 2]]]), fr([[[3]]]), mask="none")
    assert layer.is_exact and layer.scale == Fraction(1, 1)  # d_head = 1
    X = np.array([[[Fraction(1), Fraction(2)], [Fraction(-1), Fraction(1, 3)]]], dtype=object)
    y = layer(X)
    assert y.dtype == object and isinstance(y[0, 0, 0], Fraction)
    # hand computation, position 0, keys s = 0, 1 (mask "none"):
    # q1 = x0[0] = 1, q2 = x0[0]/2 = 1/2; k1_s = x_s[1]; k2_s = x_s[0] + x_s[1]; v_s = x_s[0] + 2 x_s[1]
    # s=0: k1 = 2, k2 = 3, v = 5 -> (1*2)(1/2*3)*5 = 15 ; s=1: k1 = 1/3, k2 = -2/3, v = -1/3
    #      -> (1/3)(-1/3)(-1/3) = 1/27 ; out = 3 * (15 + 1/27) = 1218/27 = 406/9
    assert y[0, 0, 0] == Fraction(406, 9)
    assert ta.BilinearAttention(*[np.ones((1, 4, 2))] * 5, np.ones((2, 1, 4))).scale == 0.25


def test_rope_rotations_are_rotations_and_relative():
    R = rope_rotations(5, 4, 10.0)
    for t in range(5):
        assert np.allclose(R[t] @ R[t].T, np.eye(4), atol=1e-15)
    # R_t^T R_s depends on s - t only (RoFormer): compare (0, 2) with (1, 3)
    assert np.allclose(R[0].T @ R[2], R[1].T @ R[3], atol=1e-14)


def test_position_free_layers_act_per_position():
    rng = np.random.default_rng(2)
    net = ta.Sequential([ta.Linear(rng.normal(size=(3, 2)), rng.normal(size=3)),
                         ta.Residual(ta.Bilinear(rng.normal(size=(4, 3)), rng.normal(size=(4, 3)),
                                                 rng.normal(size=(3, 4))))])
    X = rng.normal(size=(5, 4, 2))
    Y = net(X)
    assert Y.shape == (5, 4, 3)
    for t in range(4):
        assert np.array_equal(Y[:, t], net(X[:, t]))
    assert not net.is_sequence_model


def test_sequence_model_composition_and_spec_roundtrip(tmp_path):
    rng = np.random.default_rng(3)
    net = ta.Sequential([ta.Linear(rng.normal(size=(3, 2))),
                         ta.Residual(_attn(rng, rope=50.0, mask=np.tril(rng.normal(size=(4, 4))))),
                         ta.Linear(rng.normal(size=(2, 3)))])
    assert net.is_sequence_model and net.n_ctx == 4 and net.degree == 5
    spec = json.loads(json.dumps(net.to_spec()))  # JSON-serializable
    back = ta.Sequential.from_spec(spec)
    assert back.is_exact
    X = rng.normal(size=(2, 4, 2))
    # from_spec keeps the floats exactly (Fraction(float)); evaluating in float64 rounds again
    assert np.allclose(np.asarray(back(X), dtype=float), net(X), rtol=1e-12, atol=1e-12)
    assert back.astype_float().to_spec() == net.to_spec()
    assert repr(back[1].inner).startswith("BilinearAttention(3 -> 3, heads=2")


def test_scaled_output():
    rng = np.random.default_rng(4)
    layer = _attn(rng)
    X = rng.normal(size=(2, 3, 3))
    assert np.allclose(layer.scaled_output(2.5)(X), 2.5 * layer(X), rtol=1e-13)


# ---- validation -------------------------------------------------------------------------

def test_shape_errors_name_the_argument():
    rng = np.random.default_rng(5)
    W = lambda *s: rng.normal(size=s)  # noqa: E731
    with pytest.raises(ValueError, match=r"k1: expected shape .*\(2, 3, 4\).*got \(2, 2, 4\)"):
        ta.BilinearAttention(W(2, 3, 4), W(2, 2, 4), W(2, 3, 4), W(2, 3, 4), W(2, 2, 4), W(4, 2, 2))
    with pytest.raises(ValueError, match=r"q2: expected shape"):
        ta.BilinearAttention(W(2, 3, 4), W(2, 3, 4), W(1, 3, 4), W(2, 3, 4), W(2, 2, 4), W(4, 2, 2))
    with pytest.raises(ValueError, match=r"v: expected shape \(2, d_v, 4\)"):
        ta.BilinearAttention(W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 2, 5), W(4, 2, 2))
    with pytest.raises(ValueError, match=r"o: expected shape \(d_out, 2, 2\)"):
        ta.BilinearAttention(W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 2, 4), W(4, 2, 3))
    with pytest.raises(ValueError, match=r"q1_bias: expected a 2-d array, got shape \(3,\)"):
        ta.BilinearAttention(W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 2, 4), W(4, 2, 2),
                             q1_bias=W(3))
    with pytest.raises(ValueError, match=r"k2_bias: expected shape \(2, 3\), got \(2, 2\)"):
        ta.BilinearAttention(W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 2, 4), W(4, 2, 2),
                             k2_bias=W(2, 2))
    with pytest.raises(ValueError, match=r"o_bias: expected shape \(4,\)"):
        ta.BilinearAttention(W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 2, 4), W(4, 2, 2),
                             o_bias=W(2))
    with pytest.raises(ValueError, match="q1: expected a 3-d array"):
        ta.BilinearAttention(W(3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 3, 4), W(2, 2, 4), W(4, 2, 2))


def test_mask_scale_rope_errors():
    rng = np.random.default_rng(6)
    args = [rng.normal(size=(1, 2, 2))] * 5 + [rng.normal(size=(2, 1, 2))]
    with pytest.raises(ValueError, match=r"mask: expected a square \(n_ctx, n_ctx\) array, got "
                                         r"shape \(2, 3\)"):
        ta.BilinearAttention(*args, mask=np.ones((2, 3)))
    with pytest.raises(ValueError, match="mask: 1 non-finite"):
        ta.BilinearAttention(*args, mask=np.array([[1.0, np.nan], [1.0, 1.0]]))
    with pytest.raises(ValueError, match="mask: expected 'causal', 'none'"):
        ta.BilinearAttention(*args, mask="full")
    with pytest.raises(ValueError, match="rope: expected None or a positive finite"):
        ta.BilinearAttention(*args, rope=-1.0)
    with pytest.raises(ValueError, match="rope: expected None or a positive finite"):
        ta.BilinearAttention(*args, rope=float("inf"))
    odd = [rng.normal(size=(1, 3, 2))] * 4 + [rng.normal(size=(1, 2, 2)), rng.normal(size=(2, 1, 2))]
    with pytest.raises(ValueError, match="rope: .*even d_head, got d_head=3"):
        ta.BilinearAttention(*odd, rope=10.0)
    with pytest.raises(ValueError, match="scale: non-finite"):
        ta.BilinearAttention(*args, scale=float("nan"))


def test_input_errors():
    rng = np.random.default_rng(7)
    layer = _attn(rng, mask=np.ones((3, 3)))
    with pytest.raises(ValueError, match=r"x: has n_ctx=4 positions \(shape \(2, 4, 3\)\) but the "
                                         r"attention mask is \(3, 3\)"):
        layer(np.ones((2, 4, 3)))
    with pytest.raises(ValueError, match=r"x: a network with attention expects a batch of "
                                         r"sequences of shape \(n, n_ctx, 3\), got \(2, 3\)"):
        layer(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"got \(2, 3, 2\)"):
        layer(np.ones((2, 3, 2)))
    with pytest.raises(ValueError, match=r"layers\[1\]: attention mask fixes n_ctx=4 but "
                                         r"layers\[0\] fixes n_ctx=3"):
        ta.Sequential([layer, ta.Residual(_attn(rng, mask=np.ones((4, 4))))])


def test_spec_errors():
    rng = np.random.default_rng(8)
    spec = _attn(rng).to_spec()
    bad = dict(spec, extra=1)
    with pytest.raises(ValueError, match=r"unknown fields \['extra'\]"):
        ta.Sequential.from_spec([bad])
    missing = {k: v for k, v in spec.items() if k != "v"}
    with pytest.raises(ValueError, match=r"missing \['v'\]"):
        ta.Sequential.from_spec([missing])


@pytest.mark.parametrize("rope", [None, 10000.0])
@pytest.mark.parametrize("bias", [False, True])
def test_float_forward_by_matrix_products_is_the_definition(rope, bias):
    """The float forward pass (numpy, complex and torch) is written as batched matrix products
    for BLAS; it equals the definition's einsums (the path exact inputs take) to rounding,
    with biases, RoPE and the causal mask."""
    g = np.random.default_rng(3).standard_normal
    kw = {k: g((3, 4, 6)) for k in ("q1", "k1", "q2", "k2")}
    kw["v"], kw["o"] = g((3, 5, 6)), g((7, 3, 5))
    if bias:
        kw.update({k + "_bias": g((3, 4)) for k in ("q1", "k1", "q2", "k2")})
        kw["v_bias"], kw["o_bias"] = g((3, 5)), g(7)
    layer = ta.BilinearAttention(**kw, rope=rope)
    x = g((11, 5, 6))
    ref = layer._forward_einsum(x)
    scale = np.abs(ref).max()
    assert np.abs(layer._forward(x) - ref).max() <= 1e-13 * scale
    assert np.abs(layer._forward(torch.tensor(x)).numpy() - ref).max() <= 1e-13 * scale
    xc = x + 1j * g(x.shape)
    refc = layer._forward_einsum(xc)
    assert np.abs(layer._forward(xc) - refc).max() <= 1e-13 * np.abs(refc).max()
