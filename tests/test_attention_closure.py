"""Gaussian closure over (position, feature) second moments for sequence models
(tensoralg.closure.closure_inner): exact at depth 1 (checked against the exact strategy,
itself checked against verify's brute force in test_attention_exact.py), approximate deeper."""

from __future__ import annotations

import numpy as np
import pytest

import tensoralg as ta
from tensoralg.strategies import closure, executor, sequence_exact

_ALL_BIASES = ("q1_bias", "k1_bias", "q2_bias", "k2_bias", "v_bias")


def _attn(rng, d, heads=1, d_head=2, bias=False, rope=None, mask="causal", scale=0.5):
    """``bias``: False, True (every bias) or a tuple of bias names (o_bias always with True)."""
    g = lambda *s: rng.standard_normal(s) * scale  # noqa: E731
    names = _ALL_BIASES if bias is True else (bias or ())
    kw = {k: g(heads, d_head) for k in names}
    if bias is True:
        kw["o_bias"] = g(d)
    return ta.BilinearAttention(g(heads, d_head, d), g(heads, d_head, d), g(heads, d_head, d),
                                g(heads, d_head, d), g(heads, d_head, d), g(d, heads, d_head),
                                mask=mask, rope=rope, **kw)


def _rel(x, y):
    return abs(x - y) / max(abs(y), 1e-300)


def test_closure_equals_exact_at_depth_one_without_biases():
    rng = np.random.default_rng(0)
    d = 3
    a = ta.Sequential([ta.Linear(rng.standard_normal((d, d))), ta.Residual(_attn(rng, d, 2)),
                       ta.Linear(rng.standard_normal((2, d)))])
    b = ta.Sequential([_attn(rng, d, 1, mask="none"), ta.Linear(rng.standard_normal((2, d)))])
    for x, y in ((a, b), (a, a), (b, b), (b, a)):
        want = sequence_exact.exact_inner(x, y, n_ctx=3)
        assert _rel(closure.closure_inner(x, y, n_ctx=3), want) <= 1e-10
    s = closure.closure_similarity(a, b, n_ctx=3)
    assert _rel(s, sequence_exact.exact_similarity(a, b, n_ctx=3)) <= 1e-10
    assert abs(closure.closure_similarity(b, a, n_ctx=3) - s) <= 1e-14


# Every bias (and an embedding bias) makes every leg cappable: 9 496 matchings per attention
# pair, ~30 s on the loaded 2-core machine; the default suite caps two legs per model.
@pytest.mark.parametrize("biases", [
    pytest.param("all", marks=pytest.mark.slow), ("q1_bias", "v_bias")])
def test_closure_equals_exact_at_depth_one_with_biases_rope_mask_and_slices(biases):
    rng = np.random.default_rng(1)
    d, n = 2, 3
    every = biases == "all"
    mask = rng.standard_normal((n, n))
    a = ta.Sequential([ta.Linear(rng.standard_normal((d, d)),
                                 rng.standard_normal(d) if every else None),
                       ta.Residual(_attn(rng, d, 1, bias=True if every else biases, rope=100.0,
                                         mask=mask)),
                       ta.Linear(rng.standard_normal((2, d)), rng.standard_normal(2))])
    b = ta.Sequential([ta.Residual(_attn(rng, d, 1, bias=True if every else biases[::-1])),
                       ta.Linear(rng.standard_normal((2, d)))])
    for kw in (dict(position=1, output=[0.5, -2.0]), dict(position="each", output="each")):
        want = np.asarray(sequence_exact.exact_inner(a, b, n_ctx=n, **kw), dtype=np.float64)
        got = np.asarray(closure.closure_inner(a, b, n_ctx=n, **kw))
        assert got.shape == want.shape
        assert np.all(np.abs(got - want) <= 1e-10 * np.abs(want).max())


def test_a_second_layer_that_writes_nothing_keeps_the_depth_one_value():
    # Residual(attn2) with o = 0 is the identity: the closure must carry the depth-1 moments
    # (the constant, the residual stream's mean -- nonzero through o_bias -- and covariance
    # over positions) through a second attention node unchanged.
    rng = np.random.default_rng(2)
    d = 2
    at1, at2 = _attn(rng, d, bias=("k1_bias",)), _attn(rng, d)
    at1 = ta.BilinearAttention(at1.q1, at1.k1, at1.q2, at1.k2, at1.v, at1.o,
                               k1_bias=at1.k1_bias, o_bias=rng.standard_normal(d))
    silent = ta.BilinearAttention(at2.q1, at2.k1, at2.q2, at2.k2, at2.v, np.zeros_like(at2.o))
    U = ta.Linear(rng.standard_normal((2, d)), rng.standard_normal(2))
    one = ta.Sequential([ta.Residual(at1), U])
    deep = ta.Sequential([ta.Residual(at1), ta.Residual(silent), U])
    want = sequence_exact.exact_inner(one, one, n_ctx=3)
    assert _rel(closure.closure_inner(deep, one, n_ctx=3), want) <= 1e-10


def test_closure_through_the_public_api_at_depth_two():
    rng = np.random.default_rng(3)
    d = 2
    a = ta.Sequential([ta.Residual(_attn(rng, d)), ta.Residual(_attn(rng, d)),
                       ta.Linear(rng.standard_normal((2, d)))])
    b = ta.Sequential([ta.Residual(_attn(rng, d)), ta.Linear(rng.standard_normal((2, d)))])
    with pytest.raises(ta.CostTooHigh,
                       match="method='closure' \\(the moment-closure similarity: APPROXIMATE"):
        ta.similarity(a, b, n_ctx=2)
    s = ta.similarity(a, b, n_ctx=2, method="closure")
    assert s == closure.closure_similarity(a, b, n_ctx=2)
    assert abs(ta.similarity(b, a, n_ctx=2, method="closure") - s) <= 1e-14
    assert abs(s) <= 1 + 1e-12
    assert ta.similarity(a, a, n_ctx=2, method="closure") == pytest.approx(1.0, abs=1e-12)
    assert ta.inner(a, b, n_ctx=2, method="closure") == closure.closure_inner(a, b, n_ctx=2)
    # b is depth 1: its closure norm is exact
    assert _rel(ta.inner(b, b, n_ctx=2, method="closure"),
                sequence_exact.exact_inner(b, b, n_ctx=2)) <= 1e-10


def test_closure_bad_input_is_refused_before_work():
    rng = np.random.default_rng(4)
    d = 2
    at = _attn(rng, d)
    bil = ta.Bilinear(rng.standard_normal((3, d)), rng.standard_normal((3, d)),
                      rng.standard_normal((d, 3)))
    a = ta.Sequential([ta.Residual(at), ta.Linear(rng.standard_normal((2, d)))])
    two = ta.Sequential([ta.Residual(ta.Sequential([at, bil])),
                         ta.Linear(rng.standard_normal((2, d)))])
    with pytest.raises(ValueError, match="Residual block holding 2 non-linear layers"):
        closure.closure_inner(two, a, n_ctx=2)
    with pytest.raises(ValueError, match="closure' for sequence models runs in float64"):
        ta.similarity(a, a, n_ctx=2, method="closure", backend="exact")
    with pytest.raises(ValueError, match="position: expected"):
        closure.closure_inner(a, a, n_ctx=2, position=5)
    with pytest.raises(ValueError, match="n_ctx: required"):
        closure.closure_inner(a, a)


# ---- the fast closure (chaos form, readout at the last stage) against the previous
# implementation (tests/_closure_oracle.py: every partial matching of all forms contracted
# separately, full moments at every stage), both computed in this run ----

def _bilinear(rng, d, hidden=3, bias=False):
    g = lambda *s: rng.standard_normal(s) * 0.5  # noqa: E731
    return ta.Bilinear(g(hidden, d), g(hidden, d), g(d, hidden),
                       *((g(hidden), g(hidden), g(d)) if bias else ()))


def _depth_two_cases():
    rng = np.random.default_rng(7)
    d, n = 3, 3
    g = lambda *s: rng.standard_normal(s) * 0.6  # noqa: E731
    two = lambda **kw: ta.Sequential([  # noqa: E731
        ta.Linear(g(d, 2)), ta.Residual(_attn(rng, d, **kw)), ta.Residual(_attn(rng, d, **kw)),
        ta.Linear(g(2, d))])
    yield "attention-only, 2 heads", two(heads=2), two(heads=2), {}, n
    yield "different heads, mask, rope", two(heads=1, rope=50.0), ta.Sequential([
        ta.Linear(g(d, 2)), ta.Residual(_attn(rng, d, 2, mask="none")),
        ta.Residual(_attn(rng, d, 1, mask=g(n, n))), ta.Linear(g(2, d), g(2))]), \
        dict(position="each", output="each"), n
    yield "attention + bilinear MLP blocks", ta.Sequential([
        ta.Linear(g(d, 2)), ta.Residual(_attn(rng, d)), ta.Residual(_bilinear(rng, d, bias=True)),
        ta.Linear(g(2, d))]), ta.Sequential([
            ta.Linear(g(d, 2)), ta.Residual(_attn(rng, d)), ta.Residual(_bilinear(rng, d)),
            ta.Linear(g(2, d))]), dict(position=1, output=[0.3, -1.0]), n
    yield "depth 2 vs depth 1", two(heads=1), ta.Sequential([
        ta.Linear(g(d, 2)), ta.Residual(_attn(rng, d)), ta.Linear(g(2, d))]), dict(output=0), n
    d = 2
    yield "some biases (nonzero means, odd chaoses)", ta.Sequential([
        ta.Residual(_attn(rng, d, d_head=1, bias=("k1_bias", "v_bias"))),
        ta.Residual(_attn(rng, d, d_head=1, bias=("q2_bias",))), ta.Linear(g(2, d))]), \
        ta.Sequential([ta.Linear(g(d, 2), g(d)), ta.Residual(_attn(rng, d, d_head=1)),
                       ta.Residual(_attn(rng, d, d_head=1)), ta.Linear(g(2, d))]), {}, 2
    # every leg cappable: 9 496 matchings per attention pair in the old code (~80 s loaded)
    yield "biases (every leg cappable)", ta.Sequential([
        ta.Linear(g(d, 2), g(d)), ta.Residual(_attn(rng, d, d_head=1, bias=True)),
        ta.Residual(_attn(rng, d, d_head=1, bias=("q1_bias", "k2_bias", "v_bias"))),
        ta.Linear(g(2, d))]), ta.Sequential([
            ta.Residual(_attn(rng, d, d_head=1, bias=("k1_bias",))),
            ta.Residual(_attn(rng, d, d_head=1, bias=True)), ta.Linear(g(2, d))]), {}, 2


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.slow) if c[0].startswith("biases (every") else c
    for c in _depth_two_cases()], ids=lambda c: c[0])
def test_fast_closure_equals_the_previous_implementation_at_depth_two(case):
    from _closure_oracle import _closure_triple as old_triple

    _, a, b, kw, n = case
    new = closure.closure_triple(a, b, n_ctx=n, output=kw.get("output"),
                                   position=kw.get("position"))
    old = old_triple(a, b, n, kw.get("output"), kw.get("position"))
    for x, y in zip(new, old):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        assert x.shape == y.shape
        assert np.all(np.abs(x - y) <= 1e-10 * np.abs(y).max()), (x, y)


def test_gram_and_similarity_matrix_of_sequence_models():
    # closure_gram reuses each model's moments; every entry must be the pair's closure value
    rng = np.random.default_rng(11)
    d = 2
    g = lambda *s: rng.standard_normal(s) * 0.6  # noqa: E731
    two = lambda: ta.Sequential([ta.Residual(_attn(rng, d)), ta.Residual(_attn(rng, d)),  # noqa: E731
                                 ta.Linear(g(2, d))])
    models = [two(), two(), ta.Sequential([ta.Residual(_attn(rng, d, 2)), ta.Linear(g(2, d))])]
    G = ta.gram(models, n_ctx=2, method="closure")
    S = ta.similarity_matrix(models, n_ctx=2, method="closure")
    assert G.shape == S.shape == (3, 3)
    for i, x in enumerate(models):
        for j, y in enumerate(models):
            assert _rel(G[i, j], closure.closure_inner(x, y, n_ctx=2)) <= 1e-12
            assert abs(S[i, j] - closure.closure_similarity(x, y, n_ctx=2)) <= 1e-12
    each = closure.closure_gram(models, n_ctx=2, position="each", output="each")
    assert each.shape == (3, 3, 2, 2)
    # same terms summed in another order: float64 rounding only (the 1e-12 used above)
    assert np.allclose(each.sum(axis=(2, 3)), G, rtol=1e-12, atol=0)
    # exact at depth 1: the self terms once per model, the same values as exact_inner
    one = [models[2], ta.Sequential([ta.Residual(_attn(rng, d)), ta.Linear(g(2, d))])]
    E = ta.gram(one, n_ctx=2)
    assert _rel(E[0, 1], sequence_exact.exact_inner(one[0], one[1], n_ctx=2)) <= 1e-12
    assert _rel(ta.similarity_matrix(one, n_ctx=2)[0, 1],
                sequence_exact.exact_similarity(one[0], one[1], n_ctx=2)) <= 1e-12
    # Monte Carlo: an estimate per entry (tests/test_sequence_mc_matrix.py), covering exact
    M = ta.gram(one, n_ctx=2, method="montecarlo", n_samples=4000, seed=0)
    assert np.all(np.abs(M - E) <= 4 * M.stderr)
    with pytest.raises(ValueError, match="at least one model"):
        closure.closure_gram([], n_ctx=2)
    # the cross Gram is the off-diagonal block of the Gram of both lists (same operations)
    X = closure.closure_cross_gram(models[:1], iter(models[1:]), n_ctx=2)
    assert X.shape == (1, 2)
    assert np.array_equal(X, G[:1, 1:])
    with pytest.raises(ValueError, match="both be non-empty"):
        closure.closure_cross_gram(models, [], n_ctx=2)


# ---- backend="torch": the larger contractions in torch float64 (on the CPU here; CUDA when
# available), the same sums as numpy up to float64 rounding ----

def test_closure_and_exact_on_the_torch_backend_equal_numpy(monkeypatch):
    pytest.importorskip("torch")
    # every contraction on torch (the default threshold would leave these small ones to numpy)
    monkeypatch.setattr(executor, "TORCH_CPU_FLOPS", 0.0)
    _name, a, b, kw, n = next(c for c in _depth_two_cases() if c[0].startswith("different"))
    want = closure.closure_inner(a, b, n_ctx=n, **kw)
    got = closure.closure_inner(a, b, n_ctx=n, backend="torch", device="cpu", **kw)
    assert got.shape == want.shape
    # sums of the same products in another grouping: a few ulps of the largest term
    assert np.all(np.abs(got - want) <= 1e-12 * np.abs(want).max())
    models = [a, b]
    G = closure.closure_gram(models, n_ctx=n, backend="torch", device="cpu")
    # the same sums, grouped differently by torch's matmul: rounding only, as for the inner
    assert np.allclose(G, closure.closure_gram(models, n_ctx=n), rtol=1e-12, atol=0)
    X = closure.closure_cross_gram([a], [b], n_ctx=n, backend="torch", device="cpu")
    assert _rel(X[0, 0], G[0, 1]) <= 1e-12
    rng = np.random.default_rng(3)
    one = [ta.Sequential([ta.Residual(_attn(rng, 2, 2, bias=True)),
                          ta.Linear(rng.standard_normal((2, 2)))]) for _ in range(2)]
    e_np = sequence_exact.exact_inner(one[0], one[1], n_ctx=3)
    e_t = sequence_exact.exact_inner(one[0], one[1], n_ctx=3, backend="torch", device="cpu")
    assert _rel(e_t, e_np) <= 1e-12
    # the context is per call: numpy again afterwards
    assert getattr(executor.TORCH, "exec", None) is None


def test_closure_backend_and_device_are_checked_before_any_work():
    rng = np.random.default_rng(4)
    a = ta.Sequential([ta.Residual(_attn(rng, 2)), ta.Linear(rng.standard_normal((2, 2)))])
    with pytest.raises(ValueError, match="backend: .*'numpy' or 'torch', got 'jax'"):
        closure.closure_inner(a, a, n_ctx=2, backend="jax")
    with pytest.raises(ValueError, match="device: only backend='torch'"):
        closure.closure_similarity(a, a, n_ctx=2, device="cpu")
    with pytest.raises(ValueError, match="device: only backend='torch'"):
        sequence_exact.exact_inner(a, a, n_ctx=2, backend="exact", device="cpu")
    with pytest.raises(ValueError, match="device: unknown torch device"):
        closure.closure_gram([a], n_ctx=2, backend="torch", device="tpu:7")
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            closure.closure_inner(a, a, n_ctx=2, backend="torch", device="cuda")
