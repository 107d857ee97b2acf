"""gram, cross_gram and similarity_matrix on the exact backend refuse an over-budget request
from float64 copies of the canonical forms, before any rational conversion, with the message the
rational path gives; within budget they compute the same Fractions as before. The certification
of the float stacks holds for every part of a stack (the Gram's plans read blocks of models)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from netgen import rand_linear, rand_network
from test_engine_exact_refusal import _deep, _no_rationals

import tensoralg as ta
import tensoralg.engine as engine
from tensoralg import planner
from tensoralg.prepare import float_stacks_for_exact, output_matrix, stack_for


def _rational_message(monkeypatch, fn, exc_type=ta.CostTooHigh):
    """The error the rational path gives (the early check switched off)."""
    with monkeypatch.context() as m:
        m.setattr(engine, "refuse_exact_early", lambda *args, **kwargs: None)
        with pytest.raises(exc_type) as exc:
            fn()
    return str(exc.value)


CALLS = {
    "gram": lambda ms, kw: ta.gram(ms, backend="exact", **kw),
    "gram_pair": lambda ms, kw: ta.gram(ms[:2], backend="exact", **kw),
    "cross_gram": lambda ms, kw: ta.cross_gram(ms[:2], ms[2:], backend="exact", **kw),
    "cross_gram_1x1": lambda ms, kw: ta.cross_gram(ms[:1], ms[1:2], backend="exact", **kw),
    "similarity_matrix": lambda ms, kw: ta.similarity_matrix(ms, backend="exact", **kw),
}

# depth 3: 16 legs, T(16) Wick configurations over the default max_configurations, chaos over
# max_flops=1e3; depth 2: the Wick lower bound and chaos over max_flops=1e3
CASES = [(3, {"max_flops": 1e3}), (3, {"strategy": "wick"}),
         (3, {"max_flops": 1e3, "output": 1}), (2, {"max_flops": 1e3}),
         (2, {"max_flops": 1e3, "strategy": "chaos"})]


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("depth,kw", CASES)
def test_gram_refused_without_rational_conversion(monkeypatch, call, depth, kw):
    rng = np.random.default_rng(10 + depth)
    ms = [_deep(rng, depth) for _ in range(3)]
    want = _rational_message(monkeypatch, lambda: CALLS[call](ms, kw))
    calls = _no_rationals(monkeypatch)
    with pytest.raises(ta.CostTooHigh) as exc:
        CALLS[call](ms, kw)
    assert str(exc.value) == want
    assert calls == []


def test_depth3_gram_message_is_the_rational_pair_plan(monkeypatch):
    """The reference, from the plans themselves: a depth-3 Gram of several models is refused at
    its first pair (``_gram_blocks`` sizes its Wick blocks from that pair's Wick plan, and then
    reports the pair's plan under strategy='auto', which names every estimate), made
    here with make_plan on the rational stacks. Width 8, hidden 16: chaos is over the default
    max_flops too."""
    rng = np.random.default_rng(3)
    ms = [_deep(rng, 3, d=8, hidden=16) for _ in range(2)]
    U, keep = output_matrix(None, 2, True)
    ca, _ = stack_for(ms, "exact", "models")
    whole = planner.make_plan(ca, ca, U, keep, "gaussian", "exact", same=True)
    one = planner.make_plan(ca.sub([0]), ca.sub([0]), U, keep, "gaussian", "exact",
                            strategy="wick")
    assert whole.refused and one.refused
    # the message is the first pair's plan under strategy='auto' (naming every strategy)
    both = planner.make_plan(ca.sub([0]), ca.sub([0]), U, keep, "gaussian", "exact")
    assert both.refused and "wick" in both.refused and "chaos" in both.refused
    calls = _no_rationals(monkeypatch)
    for fn in (lambda: ta.gram(ms, backend="exact"),
               lambda: ta.similarity_matrix(ms, backend="exact"),
               lambda: ta.cross_gram(ms, [ms[1], ms[0]], backend="exact")):
        with pytest.raises(ta.CostTooHigh) as exc:
            fn()
        assert str(exc.value) == both.refused
    assert calls == []


def test_block_refusal_without_rational_conversion(monkeypatch):
    """Wick in blocks (small _MAX_INTERMEDIATE: blocks of 2 models): the first pair fits
    max_flops, a 2x2 block does not; the rational path refuses at that block (after computing
    nothing), the early check with the same message."""
    rng = np.random.default_rng(7)
    ms = [_deep(rng, 1) for _ in range(3)]
    monkeypatch.setattr(engine, "_MAX_INTERMEDIATE", 200)
    U, keep = output_matrix(None, 2, True)
    ca, _ = stack_for(ms, "exact", "models")
    kw = dict(strategy="wick", max_flops=4000)
    one = planner.make_plan(ca.sub([0]), ca.sub([0]), U, keep, "gaussian", "exact", **kw)
    block = planner.make_plan(ca.sub([0, 1]), ca.sub([0, 1]), U, keep, "gaussian", "exact",
                              **kw)
    # the case this test is for: one pair within budget, blocks of 2 (200 // 48 -> 2), a block
    # over it
    assert not one.refused and block.refused
    assert int(np.sqrt(200 // one.largest_intermediate)) == 2
    want = _rational_message(monkeypatch, lambda: ta.gram(ms, backend="exact", **kw))
    assert want == block.refused
    calls = _no_rationals(monkeypatch)
    with pytest.raises(ta.CostTooHigh) as exc:
        ta.gram(ms, backend="exact", **kw)
    assert str(exc.value) == want
    assert calls == []


def test_within_budget_unchanged(monkeypatch):
    """Within budget: the rational path runs, and gives the Fractions of inner()."""
    rng = np.random.default_rng(5)
    ms = [_deep(rng, 1) for _ in range(3)]
    G = ta.gram(ms, backend="exact")
    X = ta.cross_gram(ms[:2], ms[1:], backend="exact")
    S = ta.similarity_matrix(ms, backend="exact")
    for i in range(3):
        for j in range(3):
            v = ta.inner(ms[i], ms[j], backend="exact")
            assert isinstance(G[i, j], Fraction) and G[i, j] == v
            if i < 2 and j >= 1:
                assert X[i, j - 1] == v
    with monkeypatch.context() as m:  # the same floats without the early check
        m.setattr(engine, "refuse_exact_early", lambda *args, **kwargs: None)
        assert np.array_equal(ta.similarity_matrix(ms, backend="exact"), S)
    # blocks: the same matrix (and the early check lets it through)
    monkeypatch.setattr(engine, "_MAX_INTERMEDIATE", 200)
    assert np.array_equal(ta.gram(ms, backend="exact", strategy="wick"), G)
    calls = _no_rationals(monkeypatch)
    with pytest.raises(AssertionError, match="rational stacks"):
        ta.gram(ms, backend="exact")
    assert len(calls) == 1


def test_errors_before_rational_conversion(monkeypatch):
    """Bad input on the exact backend: the same ValueError as the rational path, before it."""
    rng = np.random.default_rng(6)
    mixed = [_deep(rng, 2), _deep(rng, 1)]
    # (models of different architectures are no error: grouped, every pair computed)
    cases = [lambda: ta.gram(mixed, backend="exact", output=7),
             lambda: ta.similarity_matrix(mixed, backend="exact", output=7),
             lambda: ta.gram(mixed[:1] * 2, backend="exact", max_flops=-1.0)]
    want = [_rational_message(monkeypatch, f, ValueError) for f in cases]
    assert "output: class index 7 out of range" in want[0]
    assert "max_flops" in want[2]
    calls = _no_rationals(monkeypatch)
    for f, w in zip(cases, want):
        with pytest.raises(ValueError) as exc:
            f()
        assert str(exc.value) == w
    assert calls == []


# --- the certification of float stacks ------------------------------------------------------

def test_float_zero_with_nonzero_terms_not_certified():
    """(1 + 2**-30)**2 - (1 + 2**-29) = 2**-60 in rationals; in float64 the square rounds to
    1 + 2**-29 and the entry to 0 (checked below against the rational canonical form): a zero
    pattern the float stack gets wrong, so it is not trusted."""
    a = 1 + 2.0 ** -30
    net = ta.Sequential([ta.Linear(np.array([[a], [1.0]])),
                         ta.Bilinear(np.array([[a, -(1 + 2.0 ** -29)]]), np.ones((1, 2)),
                                     np.ones((1, 1)))])
    val, mag, rtol = float_stacks_for_exact([net], "a")
    ex, _ = stack_for([net], "exact", "a")
    f, r = val.stages[0].L[0, 1, 1], ex.stages[0].L[0, 1, 1]
    assert r == Fraction(1, 2 ** 60)
    if f == 0:  # the rounding this test is about (a fused multiply-add would keep 2**-60)
        assert not planner._certified(val, mag, rtol, np.eye(1))
        assert planner.refuse_exact_early([net], None, np.eye(1), False, "gaussian",
                                          max_flops=1.0) is None
    else:
        assert f == 2.0 ** -60


def test_near_equal_factors_of_one_model_in_a_stack():
    """One model whose left and right factors are one ulp apart (they might be equal exactly:
    a symmetry), stacked with a model whose factors differ widely: the stack as a whole is
    not near-symmetric, but the Gram's plans read single models, so it is not certified."""
    rng = np.random.default_rng(1)
    Lw = rng.standard_normal((3, 2))
    Rw = Lw.copy()
    Rw[0, 0] = np.nextafter(Lw[0, 0], np.inf)
    near = ta.Sequential([ta.Bilinear(Lw, Rw, rng.standard_normal((1, 3)))])
    far = ta.Sequential([ta.Bilinear(rng.standard_normal((3, 2)), rng.standard_normal((3, 2)),
                                     rng.standard_normal((1, 3)))])
    val, mag, rtol = float_stacks_for_exact([far, near], "models")
    L, R = val.stages[0].L, val.stages[0].R
    assert np.max(np.abs(L[0] - R[0])) > 1e-3  # the first model alone decides nothing
    assert planner._certified(*float_stacks_for_exact([far], "m"), np.eye(1))
    assert not planner._certified(val, mag, rtol, np.eye(1))


def test_near_equal_models_across_sides():
    """cross_gram([m0, m1], [m0', m2]) with m0' one ulp from m0: the stacks differ widely, but
    the pair plan (m0, m0') would find the Wick symmetry of equal sides if they were equal
    exactly, so the float stacks are not trusted; m0' equal to m0 (bit for bit) is."""
    rng = np.random.default_rng(2)
    m0, m1, m2 = (_deep(rng, 1) for _ in range(3))
    m0p = _deep(np.random.default_rng(0), 1)
    for x, y in zip(m0p.arrays(), m0.arrays()):
        x[...] = y
    U = np.eye(2)
    kw = dict(max_flops=1.0, strategy="wick")
    assert planner.refuse_exact_early([m0, m1], [m0p, m2], U, False, "gaussian", **kw) \
        is not None
    m0p.arrays()[0][0, 0] = np.nextafter(m0.arrays()[0][0, 0], np.inf)
    fa, fb = float_stacks_for_exact([m0, m1], "a"), float_stacks_for_exact([m0p, m2], "b")
    assert planner._certified(*fa, U) and planner._certified(*fb, U)
    assert planner._near_pair(fa[0], fa[1], fb[0], fb[1], max(fa[2], fb[2]))
    assert planner.refuse_exact_early([m0, m1], [m0p, m2], U, False, "gaussian", **kw) is None
    # within one collection (gram: off-diagonal blocks compare different models) likewise
    assert planner.refuse_exact_early([m0, m1, m0p], None, U, False, "gaussian", **kw) is None


def test_underflow_not_certified():
    """Weights whose products may underflow (a zero of the magnitude stack would not be an
    exact zero): no float stacks."""
    rng = np.random.default_rng(4)
    net = _deep(rng, 1)
    net.arrays()[0][0, 0] = 1e-300
    assert float_stacks_for_exact([net], "a") is None
    net.arrays()[0][0, 0] = 1e-3
    assert float_stacks_for_exact([net], "a") is not None


def _absorbing(left_small, right_small):
    """One hidden unit reading x through W = [[1], [1]]: its canonical factors' entries are
    1e16 + left_small and 1e16 + right_small, which for 0.25 or 0.5 both round to 1e16 in
    float64 (the spacing of doubles there is 2)."""
    return ta.Sequential([ta.Linear(np.array([[1.0], [1.0]])),
                          ta.Bilinear(np.array([[1e16, left_small]]),
                                      np.array([[1e16, right_small]]), np.ones((1, 1)))])


def test_float_equal_factors_from_unequal_weights_not_certified():
    """L == R in floats but not in rationals (unequal weights rounded to the same canonical
    entries): the Wick symmetry the float plan would find is not there, so not certified;
    equal left and right weights (bit for bit) are."""
    net = _absorbing(0.25, 0.5)
    val, mag, rtol = float_stacks_for_exact([net], "a")
    ex, _ = stack_for([net], "exact", "a")
    assert np.array_equal(val.stages[0].L, val.stages[0].R)
    assert ex.stages[0].L[0, 1, 1] != ex.stages[0].R[0, 1, 1]
    assert not planner._certified(val, mag, rtol, np.eye(1), [net])
    sym = _absorbing(0.25, 0.25)
    assert planner._certified(*float_stacks_for_exact([sym], "a"), np.eye(1), [sym])
    # without the networks, float-equal factors are not trusted
    assert not planner._certified(*float_stacks_for_exact([sym], "a"), np.eye(1))


def test_float_equal_models_from_unequal_weights_not_certified():
    """Two models whose canonical forms are equal in floats but not in rationals: the plans'
    same-stack test might differ, so not trusted; the same model (or a bit-identical copy) on
    both sides is."""
    a, b = _absorbing(0.25, 0.25), _absorbing(0.5, 0.5)
    fa, fb = float_stacks_for_exact([a], "a"), float_stacks_for_exact([b], "b")
    assert all(np.array_equal(x, y) for x, y in zip(fa[0].arrays(), fb[0].arrays()))
    ea, eb = stack_for([a], "exact", "a")[0], stack_for([b], "exact", "b")[0]
    assert not all(np.array_equal(x, y) for x, y in zip(ea.arrays(), eb.arrays()))
    U = np.eye(1)
    assert planner._near_pair(fa[0], fa[1], fb[0], fb[1], fa[2], [a], [b])
    assert planner.refuse_exact_early([a], [b], U, False, "gaussian", max_flops=1.0) is None
    assert planner.refuse_exact_early([a, b], None, U, False, "gaussian", max_flops=1.0) is None
    assert planner.refuse_exact_early([a], [a], U, False, "gaussian", max_flops=1.0) is not None
    a2 = _absorbing(0.25, 0.25)
    assert planner.refuse_exact_early([a, a2], None, U, False, "gaussian",
                                      max_flops=1.0) is not None


def test_symmetric_network_still_refused_early(monkeypatch):
    """A depth-3 network whose bilinear layers have equal left and right weights (L == R, a
    Wick symmetry) is still refused before any rational conversion, with the rational
    message."""
    rng = np.random.default_rng(8)

    def sym(d, h):
        W = rng.standard_normal((h, d))
        return ta.Bilinear(W, W.copy(), rng.standard_normal((d, h)))

    ms = [ta.Sequential([rand_linear(rng, 3, 3), sym(3, 4), sym(3, 4), sym(3, 4),
                         rand_linear(rng, 3, 2)]) for _ in range(2)]
    kw = {"max_flops": 1e3}
    want = _rational_message(monkeypatch, lambda: ta.gram(ms, backend="exact", **kw))
    calls = _no_rationals(monkeypatch)
    with pytest.raises(ta.CostTooHigh) as exc:
        ta.gram(ms, backend="exact", **kw)
    assert str(exc.value) == want
    assert calls == []


def test_forced_chaos_gram_over_budget_is_refused_as_chaos_not_computed_with_wick():
    """A Gram with strategy='chaos' over its budget used to fall through to Wick blocks."""
    rng = np.random.default_rng(11)
    nets = [rand_network(rng, "depth2", d=8, hidden=16, width=8) for _ in range(3)]
    ref = ta.plan(nets[0], nets[1], strategy="chaos", max_flops=1e4)
    assert ref.refused and "chaos" in ref.refused
    for backend in ("numpy", "exact"):
        with pytest.raises(ta.CostTooHigh) as err:
            ta.gram(nets, strategy="chaos", max_flops=1e4, backend=backend)
        assert "chaos: estimated" in str(err.value) and "wick" not in str(err.value)


def test_gram_refusal_names_every_strategy_like_inner():
    rng = np.random.default_rng(12)
    nets = [rand_network(rng, "depth2", d=8, hidden=16, width=8) for _ in range(3)]
    for backend in ("numpy", "exact"):
        with pytest.raises(ta.CostTooHigh) as err:
            ta.gram(nets, max_flops=1e4, backend=backend)
        assert "wick: at least" in str(err.value) and "chaos: estimated" in str(err.value)
