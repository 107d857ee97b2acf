"""The exact attention path's memory estimate (sequence_exact.chaos_memory_bytes, a dry run) against
tracemalloc's measured peak, and the refusal it drives in exact_inner and plan."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import tensoralg as ta
from tensoralg.strategies import sequence_exact as A
from tensoralg.strategies.chaos import sequence as chaos_sequence


def model(rng, H, dh, d, rope=10000.0, bias=False):
    g = lambda *s: rng.normal(size=s) / np.sqrt(s[-1])  # noqa: E731
    kw = dict(q1_bias=g(H, dh), k1_bias=g(H, dh), v_bias=g(H, dh), o_bias=g(d)) if bias else {}
    at = ta.BilinearAttention(g(H, dh, d), g(H, dh, d), g(H, dh, d), g(H, dh, d), g(H, dh, d),
                              g(d, H, dh), mask="causal", rope=rope, **kw)
    return ta.Sequential([ta.Linear(g(d, 8)), ta.Residual(at), ta.Linear(g(10, d))])


def measured_peak(a, b, **kw) -> int:
    """tracemalloc's peak of one exact_inner call (paths already cached), above its start."""
    A.exact_inner(a, b, **kw)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        A.exact_inner(a, b, **kw)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_estimate_covers_the_measured_peak():
    rng = np.random.default_rng(0)
    # Python objects of a call (dicts, compiled steps) are traced too: their size is the
    # peak of a case whose arrays are negligible, measured here rather than assumed.
    a, b = model(rng, 1, 4, 8), model(rng, 1, 4, 8)
    overhead = max(0, measured_peak(a, b, n_ctx=4) - A.chaos_memory_bytes(a, b, n_ctx=4))
    cases = [(dict(H=2, dh=8, d=16), dict(n_ctx=8)),
             (dict(H=2, dh=8, d=16), dict(n_ctx=12)),
             (dict(H=2, dh=8, d=16, rope=None, bias=True), dict(n_ctx=10, position="each")),
             (dict(H=2, dh=8, d=16, bias=True), dict(n_ctx=8, output="each"))]
    for arch, kw in cases:
        a, b = model(rng, **arch), model(rng, **arch)
        est = A.chaos_memory_bytes(a, b, **kw)
        peak = measured_peak(a, b, **kw)
        assert peak > 4 * overhead            # the arrays dominate what is measured
        assert est + overhead >= peak, (arch, kw, est, peak, overhead)
        assert est <= 2 * peak, (arch, kw, est, peak)   # and it is not vacuous


def test_over_max_memory_is_refused_before_any_contraction(monkeypatch):
    rng = np.random.default_rng(1)
    a, b = model(rng, 2, 4, 8), model(rng, 2, 4, 8)
    need = A.chaos_memory_bytes(a, b, n_ctx=6)

    def boom(*args, **kw):
        raise AssertionError("contracted before the refusal")

    monkeypatch.setattr(chaos_sequence, "run_sum", boom)
    with pytest.raises(ta.CostTooHigh, match="estimated peak memory .* over max_memory") as err:
        A.exact_inner(a, b, n_ctx=6, max_memory=need - 1)
    assert "method='closure'" in str(err.value) and "raise max_memory" in str(err.value)
    monkeypatch.undo()
    assert np.isfinite(A.exact_inner(a, b, n_ctx=6, max_memory=need))   # at the estimate: runs


def test_plan_refuses_exactly_when_inner_does_with_its_message():
    rng = np.random.default_rng(2)
    a, b = model(rng, 2, 4, 8), model(rng, 2, 4, 8)
    p = ta.plan(a, b, n_ctx=5)
    assert p.refused is None and p.memory_bytes == A.chaos_memory_bytes(a, b, n_ctx=5)
    assert "estimated peak memory" in str(p)
    at = ta.plan(a, b, n_ctx=5, max_memory=p.memory_bytes)
    assert at.refused is None
    ta.inner(a, b, n_ctx=5, max_memory=p.memory_bytes)
    over = ta.plan(a, b, n_ctx=5, max_memory=p.memory_bytes - 1)
    assert over.refused and over.strategy is None and "REFUSED" in str(over)
    with pytest.raises(ta.CostTooHigh) as err:
        ta.inner(a, b, n_ctx=5, max_memory=p.memory_bytes - 1)
    assert str(err.value) == over.refused


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1GB", True])
def test_bad_max_memory(bad):
    rng = np.random.default_rng(3)
    a = model(rng, 1, 2, 4)
    for fn in (lambda: A.exact_inner(a, a, n_ctx=3, max_memory=bad),
               lambda: ta.plan(a, a, n_ctx=3, max_memory=bad),
               lambda: ta.inner(a, a, n_ctx=3, max_memory=bad)):
        with pytest.raises(ValueError, match="max_memory: expected a positive number"):
            fn()


def test_gram_of_sequence_models_passes_max_memory_on():
    rng = np.random.default_rng(4)
    models = [model(rng, 2, 4, 8) for _ in range(2)]
    with pytest.raises(ta.CostTooHigh, match="over max_memory"):
        ta.gram(models, n_ctx=5, max_memory=1000)
    G = ta.gram(models, n_ctx=5)
    assert G[0, 1] == ta.inner(models[0], models[1], n_ctx=5)   # the same computation


def test_chaos_memory_bytes_bad_input_before_any_work():
    rng = np.random.default_rng(5)
    a = model(rng, 1, 2, 4)
    cases = [(dict(n_ctx=3, backend="jax"), "backend: unknown backend .jax."),
             (dict(n_ctx=0), "n_ctx: expected a positive int"),
             (dict(n_ctx=3, output=10), "output: class index 10 out of range"),
             (dict(n_ctx=3, output=[np.nan] * 10), "output"),
             (dict(n_ctx=3, position=3), "position: expected")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            A.chaos_memory_bytes(a, a, **kw)
    two_layers = ta.Sequential([a.layers[0], a.layers[1], a.layers[1], a.layers[2]])
    with pytest.raises(A.AttentionNotSupported, match="a second attention layer"):
        A.chaos_memory_bytes(a, two_layers, n_ctx=3)


# ---- an absurd n_ctx is refused from shapes alone (issue 22 item 6) -----------------------------

def test_stored_entries_from_small_trees_equal_the_dry_run_at_the_real_context():
    """The chaos tensors R[S] counted from shapes (trees built for SHAPE_CTX positions, the
    context substituted) equal the entries the dry run stores at that context."""
    rng = np.random.default_rng(11)
    for bias in (False, True):
        a = model(rng, 2, 4, 6, bias=bias)
        small = A.canonicalize(a, A.SHAPE_CTX, "a")
        for n in (5, 9):
            full = A.canonicalize(a, n, "a")
            for ts, tf in zip(small.nodes[0].terms, full.nodes[0].terms):
                side = chaos_sequence.TermSide(tf, "a", np.einsum, n, False, dry=True)
                dry = sum(int(np.prod(R[0].shape)) for R in side.R.values()
                          if R[0] is not None)
                assert chaos_sequence.stored_entries(ts, "a", n) == dry
                assert chaos_sequence.stored_entries(tf, "a", n) == dry


def test_an_absurd_context_is_refused_from_shapes_with_nothing_allocated():
    """n_ctx = 10 000 (a 10^8-entry mask per model) took a minute and gigabytes before it was
    refused; now plan and inner refuse with the same message, tracemalloc's peak staying
    below a megabyte-scale bound (no n_ctx x n_ctx array is built)."""
    rng = np.random.default_rng(12)
    a, b = model(rng, 2, 4, 8), model(rng, 2, 4, 8)
    tracemalloc.start()
    try:
        p = ta.plan(a, b, n_ctx=10_000)
        with pytest.raises(ta.CostTooHigh) as info:
            ta.inner(a, b, n_ctx=10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert p.refused and "at n_ctx=10,000 the per-model chaos tensors alone" in p.refused
    assert p.refused in str(info.value)
    assert peak < 50 * 2**20, peak      # one 10^4 x 10^4 float64 mask alone is 800 MB
    assert p.memory_bytes >= 8 * 10_000 ** 2      # at least one (t, s) tensor per model
    with pytest.raises(ta.CostTooHigh, match="from shapes"):
        ta.similarity(a, b, n_ctx=10_000)
    # within the budget the early bound is silent and the dry run decides, as before
    assert A.early_memory_refusal(A.make_request(n_ctx=6), a, b) is None


def test_a_two_layer_model_at_a_long_context_gets_a_refused_plan_not_an_error():
    """The shape-only bound builds small trees; a model outside the exact path is left to the
    plan's own refusal (was AttentionNotSupported raised by plan; found by a tester)."""
    rng = np.random.default_rng(13)
    g = lambda *s: rng.normal(size=s) / np.sqrt(s[-1])  # noqa: E731
    at = lambda: ta.Residual(ta.BilinearAttention(*(g(1, 2, 4) for _ in range(5)), g(4, 1, 2)))  # noqa: E731
    deep = ta.Sequential([at(), at(), ta.Linear(g(3, 4))])
    p = ta.plan(deep, deep, n_ctx=1_000)   # > SHAPE_CTX: the shape-only bound runs
    assert p.refused and "method='montecarlo' or method='closure'" in p.refused
    assert "montecarlo_inner" not in p.refused
    with pytest.raises(ta.CostTooHigh) as info:
        ta.inner(deep, deep, n_ctx=1_000)
    assert "montecarlo_inner" not in str(info.value)
