"""Exact Gaussian inner products of attention models against independent computations:
verify's brute-force polynomial expansion (rationals), sympy, and Monte Carlo."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensoralg.verify.attention import expand_sequence, sequence_inner_exact

import tensoralg as ta
from tensoralg.strategies import montecarlo as MC
from tensoralg.strategies import sequence_exact as A
from tensoralg.strategies.chaos import sequence as chaos_sequence
from tensoralg.strategies.wick import terms


def attn(rng, H=1, dh=2, d=2, dv=1, d_out=None, bias=True, residual=False, **kw):
    d_out = d if d_out is None else d_out
    W = lambda *s: rng.normal(size=s)  # noqa: E731
    b = dict(q1_bias=W(H, dh), k1_bias=W(H, dh), q2_bias=W(H, dh), k2_bias=W(H, dh),
             v_bias=W(H, dv), o_bias=W(d_out)) if bias else {}
    layer = ta.BilinearAttention(W(H, dh, d), W(H, dh, d), W(H, dh, d), W(H, dh, d), W(H, dv, d),
                                 W(d_out, H, dv), **b, **kw)
    return ta.Residual(layer) if residual else layer


def rel(x, y):
    return abs(float(x) - float(y)) / max(abs(float(y)), 1e-300)


# ---- verify's brute force is itself checked ---------------------------------------------

def test_brute_force_agrees_with_sympy_integration():
    """n_ctx = 2, d = 1, one head with biases: f expanded by evaluating the layer on sympy
    symbols; E[f_t^2] by integrating against the Gaussian density variable by variable."""
    rng = np.random.default_rng(0)
    q = lambda *s: np.vectorize(lambda v: Fraction(int(v), 2), otypes=[object])(  # noqa: E731
        rng.integers(-3, 4, s))
    layer = ta.BilinearAttention(q(1, 1, 1), q(1, 1, 1), q(1, 1, 1), q(1, 1, 1), q(1, 1, 1),
                                 q(1, 1, 1), q1_bias=q(1, 1), k2_bias=q(1, 1), v_bias=q(1, 1),
                                 o_bias=q(1), mask="none")
    x0, x1 = sp.symbols("x0 x1")
    X = np.array([[[x0], [x1]]], dtype=object)
    f = layer(X)[0]
    gauss = lambda expr, v: sp.integrate(sp.expand(expr) * sp.exp(-v**2 / 2) / sp.sqrt(2 * sp.pi),  # noqa: E731
                                         (v, -sp.oo, sp.oo))
    total = sum(gauss(gauss(sp.expand(f[t, 0] ** 2), x0), x1) for t in range(2))
    brute = sequence_inner_exact(layer, layer, 2)
    assert sp.nsimplify(total) == sp.Rational(brute.numerator, brute.denominator)
    # and the expansion itself equals the sympy polynomial
    polys = expand_sequence(layer, 2)
    for t in range(2):
        p = sp.Poly(sp.expand(f[t, 0]), x0, x1)
        assert {m: Fraction(int(c.p), int(c.q)) for m, c in p.terms()} == polys[t][0]


def test_brute_force_agrees_with_monte_carlo():
    rng = np.random.default_rng(1)
    a = attn(rng, rope=10.0, residual=True)
    b = attn(rng, H=2, residual=True)
    exact = float(sequence_inner_exact(a, b, 2))
    mc = MC.montecarlo_inner(a, b, n_ctx=2, n_samples=200_000, seed=3)
    assert abs(float(mc) - exact) <= 4 * mc.stderr


# ---- exact = brute force ----------------------------------------------------------------

def test_exact_rationals_equal_brute_force_full_model():
    """Embedding with bias, residual attention with every bias, RoPE, a mask array, an
    unembedding with bias; b with two heads and no RoPE. Equal as rationals."""
    rng = np.random.default_rng(2)
    emb = ta.Linear(rng.normal(size=(2, 1)), rng.normal(size=2))
    a = ta.Sequential([emb, attn(rng, rope=10.0, residual=True, mask=rng.normal(size=(2, 2))),
                       ta.Linear(rng.normal(size=(2, 2)), rng.normal(size=2))])
    b = ta.Sequential([ta.Linear(rng.normal(size=(2, 1))), attn(rng, H=2, mask="none"),
                       ta.Linear(rng.normal(size=(2, 2)))])
    exact = A.exact_inner(a, b, backend="exact")
    assert isinstance(exact, Fraction)
    assert exact == sequence_inner_exact(a, b, 2)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), heads=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       mask=st.sampled_from(["causal", "none", "array"]), bias=st.booleans(),
       rope=st.sampled_from([None, 10.0]), residual=st.booleans(),
       n_ctx=st.integers(1, 2), d=st.integers(1, 2))
def test_exact_float_equals_brute_force(seed, heads, mask, bias, rope, residual, n_ctx, d):
    _check_against_brute_force(seed, heads, mask, bias, rope, residual, n_ctx, d)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), heads=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       mask=st.sampled_from(["causal", "none", "array"]), bias=st.booleans(),
       rope=st.sampled_from([None, 10.0]), residual=st.booleans(),
       n_ctx=st.integers(1, 3), d=st.integers(1, 3))
def test_exact_float_equals_brute_force_many(seed, heads, mask, bias, rope, residual, n_ctx, d):
    if n_ctx * d > 6 and bias:
        n_ctx = 2  # keeps the brute-force expansion (degree 10) small
    _check_against_brute_force(seed, heads, mask, bias, rope, residual, n_ctx, d)


def _check_against_brute_force(seed, heads, mask, bias, rope, residual, n_ctx, d):
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(n_ctx, n_ctx)) if mask == "array" else mask
    a = attn(rng, H=heads[0], d=d, bias=bias, rope=rope, residual=residual, mask=m)
    b = attn(rng, H=heads[1], d=d, bias=not bias, rope=None, residual=not residual, mask="causal")
    want = sequence_inner_exact(a, b, n_ctx)
    got = A.exact_inner(a, b, n_ctx=n_ctx)
    # float64 sum of a few thousand terms of mixed sign: agreement to 1e-10 relative to the
    # largest of |<a,b>| and sqrt(<a,a><b,b>) (the scale of the summands)
    scale = max(abs(float(want)), float(sequence_inner_exact(a, a, n_ctx)) ** 0.5 *
                float(sequence_inner_exact(b, b, n_ctx)) ** 0.5)
    assert abs(got - float(want)) <= 1e-10 * scale


@pytest.mark.parametrize("rope", [None, 10.0])
def test_packed_query_key_pairs_equal_brute_force(monkeypatch, rope):
    """Cross items that bridge the two key positions sum over the (query, key) pairs where
    both masks are nonzero only: a causal mask against a mask array with other zeros, in
    rationals, equal to verify's brute force; the packing is checked to have run (with RoPE
    the positional grams read the key position too: those items are not packed)."""
    rng = np.random.default_rng(11)
    mask = np.array([[1.0, 0.0, 2.0], [0.0, -1.5, 0.0], [0.5, 1.0, 0.0]])
    a = attn(rng, H=2, d=2, mask="causal", rope=rope)
    b = attn(rng, H=1, d=2, mask=mask)
    packed = []
    real = chaos_sequence._packed

    def spy(arr, *args):
        out = real(arr, *args)
        if not isinstance(arr, chaos_sequence.Shape):
            packed.append(out[0].shape)
        return out

    monkeypatch.setattr(chaos_sequence, "_packed", spy)
    terms._COMPILED.clear()
    assert A.exact_inner(a, b, n_ctx=3, backend="exact") == sequence_inner_exact(a, b, 3)
    # causal & mask: 4 of the 9 (query, key) pairs are nonzero in both
    assert packed and all(shape[0] == 4 for shape in packed)
    assert A.exact_inner(a, a, n_ctx=3, backend="exact") == sequence_inner_exact(a, a, 3)


def test_slices_equal_brute_force():
    rng = np.random.default_rng(4)
    a = attn(rng, residual=True, H=2, bias=False)
    b = attn(rng, residual=True, bias=False, rope=10.0)
    u = rng.normal(size=2)
    for position in (None, 0, 1, -1):
        for output in (None, 1, u):
            want = sequence_inner_exact(a, b, 2, output=output,
                                        position=None if position is None else position % 2)
            assert rel(A.exact_inner(a, b, n_ctx=2, output=output, position=position), want) < 1e-10
    each = A.exact_inner(a, b, n_ctx=2, output="each", position="each")
    assert each.shape == (2, 2)
    for t in range(2):
        for o in range(2):
            assert rel(each[t, o], sequence_inner_exact(a, b, 2, output=o, position=t)) < 1e-10


def test_matchings_strategy_equals_chaos_strategy():
    """The two groupings of the same Wick sum (one contraction per partial matching, or per
    chaos component pair) agree; both equal the brute force."""
    rng = np.random.default_rng(11)
    a = attn(rng, d=1, bias=False, residual=True, rope=10.0)
    b = attn(rng, d=1, bias=False, H=2)
    want = sequence_inner_exact(a, b, 2)
    for strategy in ("chaos", "matchings"):
        assert rel(A.exact_inner(a, b, n_ctx=2, strategy=strategy), want) < 1e-10
    with pytest.raises(ValueError, match="strategy"):
        A.exact_inner(a, b, n_ctx=2, strategy="fast")


def test_position_free_model_against_attention_model():
    """A per-position affine model (no attention) against an attention model."""
    rng = np.random.default_rng(5)
    a = ta.Linear(rng.normal(size=(2, 2)), rng.normal(size=2))
    b = attn(rng, residual=True)
    assert rel(A.exact_inner(a, b, n_ctx=2), sequence_inner_exact(a, b, 2)) < 1e-10


# ---- properties ---------------------------------------------------------------------------

def _sim(a, b, **kw):
    return A.exact_similarity(a, b, n_ctx=2, **kw)


def test_symmetric_and_bounded():
    rng = np.random.default_rng(6)
    a, b = attn(rng, H=2, rope=10.0, residual=True, bias=False), attn(rng, residual=True)
    ab, ba = _sim(a, b), _sim(b, a)
    assert abs(ab - ba) <= 4 * np.finfo(float).eps and abs(ab) <= 1
    assert abs(_sim(a, a) - 1) <= 1e-14


def _variant(layer, **changes):
    kw = {k: getattr(layer, k) for k in ("q1", "k1", "q2", "k2", "v", "o", "q1_bias", "k1_bias",
                                         "q2_bias", "k2_bias", "v_bias", "o_bias")}
    kw.update(changes)
    return ta.BilinearAttention(**kw, mask=layer.mask, scale=layer.scale, rope=layer.rope)


def test_invariances_give_similarity_one():
    rng = np.random.default_rng(7)
    a = attn(rng, H=2, d=2, dh=2, dv=2, bias=True)
    perm = [1, 0]
    head_perm = _variant(a, **{k: getattr(a, k)[perm] for k in
                               ("q1", "k1", "q2", "k2", "v", "q1_bias", "k1_bias", "q2_bias",
                                "k2_bias", "v_bias")}, o=a.o[:, perm])
    swap = _variant(a, q1=a.q2, k1=a.k2, q2=a.q1, k2=a.k1, q1_bias=a.q2_bias, k1_bias=a.k2_bias,
                    q2_bias=a.q1_bias, k2_bias=a.k1_bias)
    al, be = np.array([2.0, -0.5]), np.array([3.0, 0.25])
    resc = _variant(a, q1=a.q1 * al[:, None, None], q1_bias=a.q1_bias * al[:, None],
                    k1=a.k1 / al[:, None, None], k1_bias=a.k1_bias / al[:, None],
                    v=a.v * be[:, None, None], v_bias=a.v_bias * be[:, None],
                    o=a.o / be[None, :, None])
    th = 0.7
    Rot = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    rot = _variant(a, q2=np.einsum("ef,hfd->hed", Rot, a.q2), k2=np.einsum("ef,hfd->hed", Rot, a.k2),
                   q2_bias=a.q2_bias @ Rot.T, k2_bias=a.k2_bias @ Rot.T)
    X = rng.normal(size=(3, 2, 2))
    for b in (head_perm, swap, resc, rot):
        assert np.allclose(b(X), a(X), rtol=1e-12)  # the same function ...
        assert abs(_sim(a, b) - 1) <= 1e-12  # ... gets similarity 1
    # the swap is not an automorphism of the tensor network: the exact value still matches
    assert rel(A.exact_inner(a, swap, n_ctx=2), sequence_inner_exact(a, swap, 2)) < 1e-10


def test_monte_carlo_within_four_standard_errors():
    rng = np.random.default_rng(8)
    a = attn(rng, H=2, residual=True, rope=10.0)
    b = attn(rng, residual=True, mask="none")
    exact = A.exact_inner(a, b, n_ctx=2)
    mc = MC.montecarlo_inner(a, b, n_ctx=2, n_samples=100_000, seed=1)
    assert mc.stderr > 0 and abs(float(mc) - exact) <= 4 * mc.stderr


# ---- errors -------------------------------------------------------------------------------

def test_errors_before_any_contraction():
    rng = np.random.default_rng(9)
    a = attn(rng, residual=True)
    deep = ta.Sequential([a, attn(rng, residual=True)])
    with pytest.raises(A.AttentionNotSupported, match="layer 1 is a second attention layer.*"
                                                      "method='montecarlo'"):
        A.exact_inner(a, deep, n_ctx=2)
    mlp = ta.Sequential([a, ta.Residual(ta.Bilinear(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2))))])
    with pytest.raises(A.AttentionNotSupported, match="layer 1 is Residual"):
        A.exact_inner(mlp, a, n_ctx=2)
    # the refusal says why, in numbers: a block of degree 10 = 5 * 2 unrolled joins 20 legs,
    # 19!! = 654,729,075 configurations; two attention layers (degree 25) 50 legs, 49!!
    with pytest.raises(A.AttentionNotSupported, match=r"join 20 legs \(about 6\.5e\+08 Wick"):
        A.exact_inner(mlp, a, n_ctx=2)
    with pytest.raises(A.AttentionNotSupported, match=r"join 50 legs \(about 5\.8e\+31 Wick"):
        A.exact_inner(a, deep, n_ctx=2)
    with pytest.raises(ValueError, match="neither model holds attention"):
        A.exact_inner(ta.Linear(np.ones((2, 2))), ta.Linear(np.ones((2, 2))), n_ctx=2)
    with pytest.raises(ValueError, match="n_ctx: required"):
        A.exact_inner(a, a)
    fixed = attn(rng, mask=np.ones((3, 3)))
    with pytest.raises(ValueError, match=r"n_ctx=2 differs from a's attention mask of shape \(3, 3\)"):
        A.exact_inner(fixed, a, n_ctx=2)
    # the size message of every entry point (prepare.check_pair; it said "in_features" here)
    with pytest.raises(ValueError, match="^input dimensions differ: a takes 2 inputs, b takes 3"):
        A.exact_inner(a, attn(rng, d=3, d_out=2), n_ctx=2)
    with pytest.raises(ValueError, match="output: class index 5 out of range for 2 outputs"):
        A.exact_inner(a, a, n_ctx=2, output=5)
    with pytest.raises(ValueError, match=r"position: expected None, 'each' or an int in \[-2, 2\)"):
        A.exact_inner(a, a, n_ctx=2, position=2)
    with pytest.raises(ValueError, match="max_configurations=10"):
        A.exact_inner(a, a, n_ctx=2, max_configurations=10)
    with pytest.raises(ValueError, match="backend"):
        A.exact_inner(a, a, n_ctx=2, backend="torch-ish")
    with pytest.raises(ValueError, match="n_samples"):
        MC.montecarlo_inner(a, a, n_ctx=2, n_samples=3)


def test_head_gram_sums_to_the_attention_term_and_matches_brute_force():
    rng = np.random.default_rng(10)
    a = attn(rng, H=2, bias=True, residual=True, rope=10.0)
    b = attn(rng, H=1, bias=False)
    G = A.head_gram(a, b, n_ctx=2)
    assert G.shape == (2, 1)
    inner_a = a.inner
    no_ob = _variant(inner_a, o_bias=None)
    # sum over heads = the attention terms alone (no residual, no o_bias)
    assert rel(G.sum(), sequence_inner_exact(no_ob, b, 2)) < 1e-10
    one_head = _variant(no_ob, **{k: getattr(no_ob, k)[1:] for k in
                                  ("q1", "k1", "q2", "k2", "v", "q1_bias", "k1_bias", "q2_bias",
                                   "k2_bias", "v_bias")}, o=no_ob.o[:, 1:])
    assert rel(G[1, 0], sequence_inner_exact(one_head, b, 2)) < 1e-10
