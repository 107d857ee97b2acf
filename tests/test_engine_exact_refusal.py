"""The exact backend refuses an over-budget request from float64 copies of the canonical forms,
before any rational conversion, with the same plan and message as the rational path; it falls
back to the rational path when the float zero patterns are not certified exact."""

from __future__ import annotations

import numpy as np
import pytest
from netgen import rand_bilinear, rand_linear

import tensoralg as ta
import tensoralg.engine as engine
import tensoralg.prepare as prepare
from tensoralg import planner
from tensoralg.prepare import float_stacks_for_exact


def _deep(rng, depth, d=3, hidden=4, out=2):
    layers = [rand_linear(rng, d, d)]
    layers += [ta.Residual(rand_bilinear(rng, d, hidden, d)) for _ in range(depth)]
    layers.append(rand_linear(rng, d, out))
    return ta.Sequential(layers)


def _no_rationals(monkeypatch):
    """Make the rational preparation (Fraction conversion + canonical form in rationals) fail."""
    calls = []

    def boom(*args, **kwargs):
        calls.append(args)
        raise AssertionError("rational stacks prepared before the refusal")

    monkeypatch.setattr(prepare, "_stack_for", boom)
    return calls


# depth 3: refused by its Wick configurations (T(16)) and a tiny FLOP budget for chaos;
# depth 2: by the Wick lower bound and chaos FLOPs under max_flops=1e3
CASES = [(3, {"max_flops": 1e3}), (2, {"max_flops": 1e3}),
         (2, {"max_flops": 1e3, "strategy": "wick"}), (2, {"max_flops": 1e3, "output": 1})]


@pytest.mark.parametrize("depth,kw", CASES)
def test_exact_refusal_without_rational_conversion(monkeypatch, depth, kw):
    rng = np.random.default_rng(depth)
    a, b = _deep(rng, depth), _deep(rng, depth)
    # the messages the rational path gives (early check switched off)
    with monkeypatch.context() as m:
        m.setattr(engine, "refuse_exact_early", lambda *args, **kwargs: None)
        want = {}
        for name, f in [("inner", lambda: ta.inner(a, b, backend="exact", **kw)),
                        ("self", lambda: ta.inner(a, a, backend="exact", **kw)),
                        ("sim", lambda: ta.similarity(a, b, backend="exact", **kw))]:
            with pytest.raises(ta.CostTooHigh) as exc:
                f()
            want[name] = str(exc.value)
        want_plan = ta.plan(a, b, backend="exact", **kw)
    assert want_plan.refused
    calls = _no_rationals(monkeypatch)
    with pytest.raises(ta.CostTooHigh) as exc:
        ta.inner(a, b, backend="exact", **kw)
    assert str(exc.value) == want["inner"]
    with pytest.raises(ta.CostTooHigh) as exc:
        ta.inner(a, a, backend="exact", **kw)
    assert str(exc.value) == want["self"]
    with pytest.raises(ta.CostTooHigh) as exc:
        ta.similarity(a, b, backend="exact", **kw)
    assert str(exc.value) == want["sim"]
    p = ta.plan(a, b, backend="exact", **kw)
    assert p.summary() == want_plan.summary()
    assert calls == []


def test_within_budget_still_exact(monkeypatch):
    """A request within budget goes on to the rational path (the early check refuses only)."""
    rng = np.random.default_rng(5)
    a, b = _deep(rng, 1), _deep(rng, 1)
    val = ta.inner(a, b, backend="exact")
    calls = _no_rationals(monkeypatch)
    with pytest.raises(AssertionError, match="rational stacks"):
        ta.inner(a, b, backend="exact")
    assert len(calls) == 1
    monkeypatch.undo()
    assert ta.inner(a, b, backend="exact") == val


def test_uncertain_zero_pattern_falls_back():
    """An L row that is zero in rationals but may round to nonzero in floats (1e16 + 1 - 1e16 - 1
    summed in some order): the float stack is not trusted, and the rational path decides."""
    left = np.array([[1e16, 1.0, -1e16, -1.0]])
    W1 = np.ones((4, 2))
    blk = ta.Bilinear(left, np.ones((1, 4)), np.ones((1, 1)))
    net = ta.Sequential([ta.Linear(W1), blk])
    val, mag, rtol = float_stacks_for_exact([net], "a")
    row = val.stages[0].L[0, 1]  # the hidden unit after the lifted constant row
    U = np.eye(1)
    if np.any(row != 0):  # rounding left a nonzero: must not be certified
        assert not planner._certified(val, mag, rtol, U)
        assert planner.refuse_exact_early([net], None, U, False, "gaussian", max_flops=1.0) \
            is None
    else:  # rounding gave the exact zero: certified
        assert planner._certified(val, mag, rtol, U)
    # either way the exact backend gives the exact value 0 for this unit (L row zero):
    # f(x) = 0, so <f, f> = 0
    assert ta.inner(net, net, backend="exact") == 0


def test_near_equal_factors_fall_back():
    """Left and right factors equal up to rounding might be equal exactly (a symmetry that
    makes Wick cheaper): not certified."""
    rng = np.random.default_rng(1)
    Lw = rng.standard_normal((3, 2))
    Rw = Lw.copy()
    Rw[0, 0] = np.nextafter(Lw[0, 0], np.inf)  # one ulp apart
    blk = ta.Bilinear(Lw, Rw, rng.standard_normal((1, 3)))
    net = ta.Sequential([blk])
    val, mag, rtol = float_stacks_for_exact([net], "a")
    assert not np.array_equal(val.stages[0].L, val.stages[0].R)
    assert not planner._certified(val, mag, rtol, np.eye(1))


def test_fraction_networks_not_prescreened():
    from netgen import to_fractions

    rng = np.random.default_rng(2)
    net = to_fractions(_deep(rng, 1))
    assert float_stacks_for_exact([net], "a") is None
