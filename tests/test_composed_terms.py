"""Exact inner products of two-node terms (a leg of a later attention head reading an earlier
head: the virtual heads of docs/mathematics.md §3.10), against tensor-product Gauss–Hermite
quadrature of forward passes written here (N = n_ctx * d = 4 Gaussian variables, every
variable of the input: the quadrature is the full Gaussian inner product)."""

from __future__ import annotations

import numpy as np
import pytest
import tensoralg.verify.quadrature as vq
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoralg.canonical import Node, Tree, sequence_tree
from tensoralg.errors import CostTooHigh
from tensoralg.layers import BilinearAttention, Sequential
from tensoralg.strategies.chaos.composed import (
    FeatureChaos,
    check,
    compose,
    estimate,
    feature_inner,
)

N_CTX, D, DH = 2, 2, 1
LEGS = ("q1", "k1", "q2", "k2", "v")


def _head(rng, biases=()):
    kw = {k: rng.normal(size=(1, DH, D)) for k in LEGS}
    kw.update({k + "_bias": rng.normal(size=(1, DH)) for k in biases})
    return BilinearAttention(**kw, o=rng.normal(size=(D, 1, DH)), mask="causal")


def _forward(at, X, leg=None, Y=None):
    """Bilinear attention written out: ``out_t = sum_s M[t, s] (q1_t.k1_s)(q2_t.k2_s) O v_s``
    with every leg reading ``(1, X)`` except ``leg``, which reads ``(0, Y)`` (a composition reads
    the earlier head's output; the leg's bias stays with the first-order path)."""
    B = X.shape[0]
    Xl = np.concatenate([np.ones((B, N_CTX, 1)), X], 2)
    Yl = None if Y is None else np.concatenate([np.zeros((B, N_CTX, 1)), Y], 2)
    lw = at.lifted()
    r = {k: np.einsum("hei,bpi->bphe", lw[k], Yl if k == leg else Xl) for k in LEGS}
    M = at.mask_matrix(N_CTX) * at.scale
    pat = M[None, :, :, None] * np.einsum("bthe,bshe->btsh", r["q1"], r["k1"]) * \
        np.einsum("bthe,bshe->btsh", r["q2"], r["k2"])
    return np.einsum("btsh,bshv,ohv->bto", pat, r["v"], lw["o"])


def _quadrature(fa, fb):
    """``sum_{t,o} E[fa(X) fb(X)]`` over X ~ N(0, I) of shape (N_CTX, D): the tensor-product
    Gauss–Hermite rule with 10 nodes per variable (exact for degree <= 19 per variable)."""
    y, w = vq.gauss_hermite(10)
    n = N_CTX * D
    grid = np.stack(np.meshgrid(*[y] * n, indexing="ij")).reshape(n, -1).T
    wt = np.prod(np.stack(np.meshgrid(*[w] * n, indexing="ij")).reshape(n, -1), axis=0)
    X = grid.reshape(-1, N_CTX, D)
    return float(np.einsum("b,bto,bto->", wt, fa(X), fb(X)))


def _term(at):
    return next(t for t in sequence_tree(Sequential([at]), N_CTX).nodes[0].terms
            if t.kind == "attention")


def _composed(outer, leg, inner):
    return compose(_term(outer), leg.upper(), _term(inner))


@pytest.mark.parametrize("leg", ["k1", "v"])
def test_two_node_term_is_the_composition(leg):
    rng = np.random.default_rng(1)
    a0, a1 = _head(rng, LEGS), _head(rng, LEGS)
    ct = _composed(a1, leg, a0)
    assert len(ct.legs) == 9
    X = rng.normal(size=(6, N_CTX, D))
    got = Tree([Node([ct], D, D)], D, D, N_CTX).forward(X)
    want = _forward(a1, X, leg, _forward(a0, X))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("leg,biases", [
    ("k1", ()), ("q2", ("k1",)),
    pytest.param("q2", ("q1", "k1", "q2", "k2"), marks=pytest.mark.slow),   # ~75 s
    pytest.param("v", LEGS, marks=pytest.mark.slow)])
def test_two_node_inner_products_against_quadrature(leg, biases):
    rng = np.random.default_rng(2)
    a0, a1, b0, b1 = (_head(rng, biases) for _ in range(4))
    ga = _composed(a1, leg, a0)
    gb = _composed(b1, "v", b0)     # another leg of another pair of heads
    ca, cb = FeatureChaos([ga], N_CTX), FeatureChaos([gb], N_CTX)
    c1 = FeatureChaos([_term(b0)], N_CTX, max_degree=9)   # a first-order term

    def fa(X):
        return _forward(a1, X, leg, _forward(a0, X))

    def fb(X):
        return _forward(b1, X, "v", _forward(b0, X))

    for got, f, g in ((feature_inner(ca, ca), fa, fa), (feature_inner(ca, cb), fa, fb),
                      (feature_inner(cb, ca), fb, fa),
                      (feature_inner(ca, c1), fa, lambda X: _forward(b0, X))):
        want = _quadrature(f, g)
        assert got == pytest.approx(want, rel=1e-10, abs=0), (got, want)


def test_one_node_feature_chaos_equals_the_leg_space_engine():
    """On one-node terms the feature-space chaos and the existing exact engine agree."""
    import tensoralg as ta

    rng = np.random.default_rng(3)
    a, b = _head(rng, ("q1", "v")), _head(rng, ("k2",))
    got = feature_inner(FeatureChaos([_term(a)], N_CTX), FeatureChaos([_term(b)], N_CTX))
    want = ta.inner(a, b, n_ctx=N_CTX)
    assert got == pytest.approx(float(want), rel=1e-12)


def test_swapping_the_two_bilinear_factors_leaves_the_value():
    """(Q1, K1) <-> (Q2, K2) of the outer head leaves the function unchanged (not the tensor
    network): K1 <- inner before the swap is K2 <- inner after it, the same value exactly."""
    rng = np.random.default_rng(4)
    a0, a1 = _head(rng), _head(rng)
    s1 = BilinearAttention(q1=a1.q2, k1=a1.k2, q2=a1.q1, k2=a1.k1, v=a1.v, o=a1.o,
                           mask="causal")
    x = FeatureChaos([_composed(a1, "k1", a0)], N_CTX)
    y = FeatureChaos([_composed(s1, "k2", a0)], N_CTX)
    assert feature_inner(x, y) == pytest.approx(feature_inner(x, x), rel=1e-12)
    assert feature_inner(y, y) == pytest.approx(feature_inner(x, x), rel=1e-12)


def test_cost_estimate_and_refusal_before_any_work():
    rng = np.random.default_rng(5)
    ct = _composed(_head(rng), "k1", _head(rng))
    e = estimate([ct], N_CTX)
    assert e["max_order"] == 9 and e["N"] == N_CTX * D
    # at n_ctx 8 over d 2 the order-9 tensors alone are 16**9 entries: refused, with the
    # alternatives, in milliseconds
    with pytest.raises(CostTooHigh, match=r"order 9 over N = n_ctx\*d = 16.*Monte Carlo"):
        check([[ct]], 8, "paths")
    with pytest.raises(CostTooHigh, match="max_flops"):
        check([[ct]], N_CTX, "paths", max_flops=1e3)


def test_compose_rejects_an_unknown_leg_and_a_mismatched_stream():
    rng = np.random.default_rng(6)
    t = _term(_head(rng))
    with pytest.raises(ValueError, match="leg: expected one of"):
        compose(t, "K3", t)
    wide = BilinearAttention(**{k: rng.normal(size=(1, DH, D)) for k in LEGS},
                             o=rng.normal(size=(D + 1, 1, DH)))
    with pytest.raises(ValueError, match="inner: writes 3 features"):
        compose(t, "K1", _term(wide))


_SWAP = {"q1": "q2", "k1": "k2", "q2": "q1", "k2": "k1", "v": "v"}


@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10 ** 6), leg=st.sampled_from(LEGS),
       biased=st.booleans())
def test_property_swap_of_the_outer_head_keeps_every_inner_product(seed, leg, biased):
    """For any weights and any composed leg: the outer head with (Q1, K1) <-> (Q2, K2)
    swapped and the composed leg renamed accordingly is the same function, so its two-node
    term has the same inner product with a third term (a first-order one) and the same norm."""
    rng = np.random.default_rng(seed)
    biases = ("q1", "k2") if biased else ()
    a0, a1, b0 = _head(rng, biases), _head(rng, biases), _head(rng)
    sw = {_SWAP[k]: getattr(a1, k) for k in LEGS}
    sw.update({_SWAP[k] + "_bias": getattr(a1, k + "_bias") for k in LEGS})
    s1 = BilinearAttention(**sw, o=a1.o, mask="causal")
    x = FeatureChaos([_composed(a1, leg, a0)], N_CTX)
    y = FeatureChaos([_composed(s1, _SWAP[leg], a0)], N_CTX)
    z = FeatureChaos([_term(b0)], N_CTX, max_degree=9)
    nx = feature_inner(x, x)
    assert feature_inner(y, y) == pytest.approx(nx, rel=1e-12)
    assert feature_inner(x, y) == pytest.approx(nx, rel=1e-12)
    assert feature_inner(y, z) == pytest.approx(feature_inner(x, z), rel=1e-10,
                                                abs=1e-12 * nx ** 0.5)
