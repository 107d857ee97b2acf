"""Grouped execution of the exact sequence sums (`tensoralg.strategies.wick.terms.compile_sum`):
same-shape contractions summed once (one differing operand) or stacked along a summed label
(several) give the value of running every contraction on its own: floats within 1e-12,
rationals equal, and the torch backend (float64, CPU) equal to numpy within 1e-12."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

import tensoralg as ta
from tensoralg.strategies import executor
from tensoralg.strategies.sequence_exact import exact_inner
from tensoralg.strategies.wick import terms

_KEYS = itertools.count()


def _random_sum(rng, exact: bool = False):
    """A random `compile_sum` input: several groups of contractions of one shape each, their
    operands drawn from a small pool (so that some are shared by every member, some differ),
    some with a repeated label (a diagonal); returns ``(key, build, fetch)``."""
    sizes = {x: int(rng.integers(1, 5)) for x in "pqrst"}
    pool: dict = {}

    def arr(shape):
        a = rng.integers(-3, 4, size=shape)
        if exact:
            return np.vectorize(lambda v: Fraction(int(v), 3), otypes=[object])(a)
        return a + rng.standard_normal(shape) * 0.1

    items = []
    out = tuple(x for x in "pq" if rng.random() < 0.4)   # the output labels of every member
    for _ in range(int(rng.integers(2, 5))):          # groups: one subscript pattern each
        n_ops = int(rng.integers(1, 5))
        labs = [tuple(rng.choice(list("pqrst"), size=int(rng.integers(1, 4)))) for _ in
                range(n_ops)]
        if n_ops > 1 and rng.random() < 0.5:
            labs[0] = labs[0] + (labs[0][0],)          # a repeated label: a diagonal
        labs[-1] = labs[-1] + tuple(x for x in out if not any(x in lab for lab in labs))
        n_var = int(rng.integers(0, n_ops + 1))
        shared = [("op", next(_KEYS)) for _ in range(n_ops)]
        for _ in range(int(rng.integers(1, 7))):      # members of the group
            specs = []
            for k, lab in enumerate(labs):
                key = ("op", next(_KEYS)) if k < n_var else shared[k]
                specs.append((key, lab))
            items.append((specs, out))
    for specs, _ in items:
        for key, lab in specs:
            if key not in pool:
                pool[key] = arr(tuple(sizes[x] for x in lab))
    fetch = pool.__getitem__

    def build():
        for specs, out in items:
            yield specs, out, [pool[k].shape for k, _ in specs]
    return ("test", next(_KEYS)), build, fetch


@pytest.mark.parametrize("seed", range(12))
def test_grouped_sum_equals_each_contraction_on_its_own(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    # small chunks too, so that a group runs in several stacked contractions
    monkeypatch.setattr(terms, "GROUP_ENTRIES", int(rng.choice([8, 64, 1 << 21])))
    key, build, fetch = _random_sum(rng)
    grouped = terms.compile_sum(key, build, group=True)
    alone = terms.compile_sum(key, build, group=False)
    assert len(grouped) <= len(alone)
    ref = terms.run_sum(alone, fetch, executor.ein)
    got = terms.run_sum(grouped, fetch, executor.ein)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.max(np.abs(ref)))
    # the dry-run FLOPs are those of the contractions that run: a group summed first counts
    # one contraction, a stacked one its stacked path
    assert terms.sum_flops(grouped) == sum(getattr(e, "flops", 0.0) for _, e in grouped)
    with executor.torch_backend("torch", "cpu", "test", cpu_min_flops=0):
        on_torch = terms.run_sum(grouped, fetch, executor.ein)
    np.testing.assert_allclose(on_torch, ref, rtol=1e-12, atol=1e-12 * np.max(np.abs(ref)))


@pytest.mark.parametrize("seed", range(6))
def test_grouped_sum_is_exact_on_rationals(seed):
    rng = np.random.default_rng(100 + seed)
    key, build, fetch = _random_sum(rng, exact=True)
    got = terms.run_sum(terms.compile_sum(key, build, group=True), fetch, executor.ein)
    ref = terms.run_sum(terms.compile_sum(key, build, group=False), fetch, executor.ein)
    assert np.asarray(got).dtype == object
    assert np.array_equal(np.asarray(got), np.asarray(ref))


def test_grouping_does_fewer_contractions_and_flops():
    """A group differing in one operand is summed first: one contraction, its FLOPs once."""
    rng = np.random.default_rng(7)
    B = rng.standard_normal((6, 5))
    As = [rng.standard_normal((4, 6)) for _ in range(9)]
    pool = {("B",): B} | {("A", k): a for k, a in enumerate(As)}

    def build():
        for k in range(len(As)):
            yield [(("A", k), ("i", "j")), (("B",), ("j", "o"))], ("o",), [(4, 6), (6, 5)]
    grouped = terms.compile_sum(("one-differs",), build, group=True)
    alone = terms.compile_sum(("one-differs",), build, group=False)
    assert len(grouped) == 1 and len(alone) == 9
    assert terms.sum_flops(grouped) * 9 == terms.sum_flops(alone)
    np.testing.assert_allclose(terms.run_sum(grouped, pool.__getitem__, executor.ein),
                               sum(a.sum(0) @ B for a in As), rtol=1e-12)


def _attention(rng, d=6, heads=2, dh=3, n_ctx=4):
    w = [rng.standard_normal((heads, dh, d)) / np.sqrt(d) for _ in range(5)]
    o = rng.standard_normal((d, heads, dh)) / np.sqrt(heads * dh)
    return ta.Sequential([ta.Residual(ta.BilinearAttention(*w, o)),
                          ta.Linear(rng.standard_normal((d, d)) / np.sqrt(d))])


@pytest.mark.parametrize("backend", ["numpy", "exact", "torch"])
def test_exact_attention_grouped_equals_ungrouped(backend, monkeypatch):
    rng = np.random.default_rng(3)
    size = {"d": 3, "heads": 1, "dh": 2} if backend == "exact" else {}   # rationals are slow
    a, b = _attention(rng, **size), _attention(rng, **size)
    kw = {"n_ctx": 4, "backend": backend} | ({"device": "cpu"} if backend == "torch" else {})
    got = exact_inner(a, b, **kw)
    monkeypatch.setattr(terms, "GROUPED", False)
    ref = exact_inner(a, b, n_ctx=4, backend="exact" if backend == "exact" else "numpy")
    if backend == "exact":
        assert isinstance(got, Fraction) and got == ref
    else:
        assert abs(got - ref) <= 1e-12 * abs(ref)


def test_dry_run_flops_are_the_grouped_flops_executed(monkeypatch):
    """The dry-run FLOP estimate (`chaos_cost_req`) is the path cost of the contractions the
    grouped execution runs (counted at every `Plan` call), not of the ungrouped ones."""
    from tensoralg.request import make_request
    from tensoralg.strategies.sequence_exact import chaos_cost_req

    rng = np.random.default_rng(5)
    a, b = _attention(rng), _attention(rng)
    req = make_request(n_ctx=4)
    _, est = chaos_cost_req(req, a, b)
    ran = [0.0]
    call = executor.Plan.__call__

    def counted(self, *ops, **kw):
        ran[0] += self.flops
        return call(self, *ops, **kw)
    monkeypatch.setattr(executor.Plan, "__call__", counted)
    exact_inner(a, b, n_ctx=4)
    assert ran[0] > 0 and ran[0] == est, (ran[0], est)
