"""Sequence models through the public API (ta.inner / ta.similarity dispatch to
tensoralg.strategies), checked against verify's independent brute-force expansion."""

from __future__ import annotations

import numpy as np
import pytest

import tensoralg as ta
from tensoralg.strategies import montecarlo as MC
from tensoralg.strategies import sequence_exact


def _attn_model(rng, d=2, heads=1, d_head=2, out=2, residual=True):
    g = lambda *s: rng.standard_normal(s) / 2  # noqa: E731
    attn = ta.BilinearAttention(g(heads, d_head, d), g(heads, d_head, d), g(heads, d_head, d),
                                g(heads, d_head, d), g(heads, d_head, d), g(d, heads, d_head),
                                mask="causal")
    return ta.Sequential([ta.Residual(attn) if residual else attn,
                          ta.Linear(rng.standard_normal((out, d)))])


def test_inner_and_similarity_dispatch_to_the_attention_module():
    from tensoralg.verify.attention import sequence_inner_exact as brute

    rng = np.random.default_rng(0)
    a, b = _attn_model(rng), _attn_model(rng, heads=2)
    want = brute(a, b, n_ctx=2)
    got = ta.inner(a, b, n_ctx=2, backend="exact")
    assert got == want
    assert abs(ta.inner(a, b, n_ctx=2) - float(want)) <= 1e-10 * abs(float(want))
    s = ta.similarity(a, b, n_ctx=2)
    assert s == pytest.approx(sequence_exact.exact_similarity(a, b, n_ctx=2), rel=1e-12)
    assert abs(ta.similarity(b, a, n_ctx=2) - s) <= 1e-14
    each = ta.inner(a, b, n_ctx=2, position="each")
    assert np.asarray(each).shape == (2,) and float(np.sum(each)) == pytest.approx(float(want))
    mc = ta.inner(a, b, n_ctx=2, method="montecarlo", n_samples=20_000, seed=1)
    assert abs(float(mc) - float(want)) <= 4 * mc.stderr


def test_sequence_model_errors_are_clear():
    rng = np.random.default_rng(1)
    a = _attn_model(rng)
    flat = ta.Sequential([ta.Bilinear(rng.standard_normal((3, 2)), rng.standard_normal((3, 2)),
                                      rng.standard_normal((2, 3)))])
    with pytest.raises(ValueError, match="position-free network of degree > 1"):
        ta.inner(a, flat, n_ctx=2)
    with pytest.raises(ValueError, match="n_ctx / position: only for sequence models"):
        ta.inner(flat, flat, n_ctx=2)
    with pytest.raises(ValueError, match="closure' for sequence models runs in float64"):
        ta.similarity(a, a, n_ctx=2, method="closure", backend="exact")
    with pytest.raises(ValueError, match="n_ctx: required"):
        ta.inner(a, a)
    deep = ta.Sequential([ta.Residual(a.layers[0].inner), ta.Residual(a.layers[0].inner),
                          a.layers[1]])
    with pytest.raises(ta.CostTooHigh, match="method='montecarlo'"):
        ta.inner(deep, deep, n_ctx=2)


def test_torch_backend_through_the_public_api_equals_brute_force():
    # exact (one layer) and closure on backend="torch" (torch's CPU here), against verify's
    # independent rational expansion; float64 sums in another grouping: 1e-10 relative
    pytest.importorskip("torch")
    from tensoralg.verify.attention import sequence_inner_exact as brute

    rng = np.random.default_rng(5)
    a, b = _attn_model(rng), _attn_model(rng, heads=2)
    want = float(brute(a, b, n_ctx=2))
    for method in ("exact", "closure"):
        got = ta.inner(a, b, n_ctx=2, method=method, backend="torch", device="cpu")
        assert abs(got - want) <= 1e-10 * abs(want), method
    G = ta.gram([a, b], n_ctx=2, method="closure", backend="torch", device="cpu")
    assert abs(G[0, 1] - want) <= 1e-10 * abs(want)
    E = ta.gram([a, b], n_ctx=2, backend="torch", device="cpu")
    assert abs(E[0, 1] - want) <= 1e-10 * abs(want)
    with pytest.raises(ValueError, match="backend='numpy' or 'torch'"):
        ta.inner(a, b, n_ctx=2, method="closure", backend="exact")
    with pytest.raises(ValueError, match="device: only backend='torch'"):
        ta.similarity(a, b, n_ctx=2, method="closure", device="cpu")


def test_float64_overflow_and_underflow_give_clear_errors():
    # weights x1e30 (six factors per attention term: squared norms ~1e360, beyond float64) and
    # x1e-60 (~1e-720, below the smallest float64): a clear error naming the way out, never a
    # NaN or a silent "zero network"; the exact backend decides the tiny case in rationals
    rng = np.random.default_rng(8)
    g = lambda s, *sh: rng.standard_normal(sh) * s  # noqa: E731

    def model(s, residual):
        attn = ta.BilinearAttention(g(s, 1, 2, 2), g(s, 1, 2, 2), g(s, 1, 2, 2), g(s, 1, 2, 2),
                                    g(s, 1, 2, 2), g(s, 2, 1, 2))
        return ta.Sequential([ta.Residual(attn) if residual else attn, ta.Linear(g(1, 2, 2))])

    big = model(1e30, True)
    for method in ("exact", "closure"):
        with pytest.raises(ValueError, match="overflowed float64"):
            ta.similarity(big, big, n_ctx=2, method=method)
    tiny = model(1e-60, False)
    with pytest.raises(ValueError, match="underflowed"):
        ta.similarity(tiny, tiny, n_ctx=2)
    with pytest.raises(ValueError, match="underflowed"):
        ta.similarity(tiny, tiny, n_ctx=2, method="closure")
    assert ta.similarity(tiny, tiny, n_ctx=2, backend="exact") == 1
    with pytest.raises(ValueError, match="empty sequence of models"):
        ta.gram([], n_ctx=2, method="closure")
    with pytest.raises(ValueError, match="empty sequence of models"):
        ta.similarity_matrix([], n_ctx=2)


def test_montecarlo_similarity_pairs_equals_the_per_pair_estimator():
    """montecarlo_similarity_pairs (one shared set of directions, every pair with
    its verdict) gives each pair what montecarlo_similarity gives it with the same seed and
    n_samples (the same directions; sums grouped differently, so rounding only), on two-layer
    models (degree 25) and one-layer ones; refuses fewer than two models."""
    rng = np.random.default_rng(5)
    one = [_attn_model(rng, d=2, heads=h) for h in (1, 2, 1)]
    two = [ta.Sequential([ta.Residual(m.layers[0].inner), ta.Residual(m.layers[0].inner),
                          m.layers[1]]) for m in one]
    for models in (one, two):
        got = MC.montecarlo_similarity_pairs(models, n_ctx=2, n_samples=400, seed=7,
                                                    chunk=7)
        assert sorted(got) == [(0, 1), (0, 2), (1, 2)]
        for (i, j), e in got.items():
            want = MC.montecarlo_similarity(models[i], models[j], n_ctx=2,
                                                   n_samples=400, seed=7)
            assert float(e) == pytest.approx(float(want), rel=1e-10)
            assert e.stderr == pytest.approx(want.stderr, rel=1e-10)
            assert e.n_samples == want.n_samples == 400
            assert e.reliable == want.reliable and e.diagnostics.reason == want.diagnostics.reason
            assert e.diagnostics.max_share == pytest.approx(want.diagnostics.max_share,
                                                            rel=1e-10)
            for k, v in want.diagnostics.lower_bounds.items():
                assert e.diagnostics.lower_bounds[k] == pytest.approx(v, rel=1e-10)
    with pytest.raises(ValueError, match="models: expected at least two"):
        MC.montecarlo_similarity_pairs(one[:1], n_ctx=2)
