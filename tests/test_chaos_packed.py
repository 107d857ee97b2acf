"""The chaos strategy's packed symmetric expansion: its building blocks against dense NumPy
symmetrizations, both stage forms and every chunking against the Wick strategy and verify's
brute force, and the planner's memory estimate against the measured peak."""

from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from netgen import KINDS, brute_inner, rand_bilinear, rand_linear, rand_network

import tensoralg as ta
from tensoralg.prepare import output_matrix, stack_for
from tensoralg.strategies.chaos import position_free as chaos


def _dense_sym(T: np.ndarray) -> np.ndarray:
    """Average over all permutations of the axes (independent of the packed code)."""
    perms = list(itertools.permutations(range(T.ndim)))
    return sum(np.transpose(T, p) for p in perms) / len(perms)


def _pack(T: np.ndarray, r: int) -> np.ndarray:
    """Values of a (symmetric) dense tensor at the sorted tuples in packed order."""
    n = T.ndim
    alpha = np.concatenate([a for _, a in chaos._multiset_blocks(r, n)])
    return np.array([T[tuple(a)] for a in alpha]) if n else T.reshape(1)


@pytest.mark.parametrize("r,n", [(1, 3), (2, 0), (3, 1), (3, 4), (5, 3), (4, 6)])
def test_multisets_in_packed_order_with_their_weights(r, n):
    alpha = np.concatenate([a for _, a in chaos._multiset_blocks(r, n)])
    want = sorted(itertools.combinations_with_replacement(range(r), n))
    assert len(alpha) == chaos.n_packed(r, n) == len(want)
    assert sorted(map(tuple, alpha)) == want
    assert np.array_equal(chaos._rank(alpha, r), np.arange(len(alpha)))  # rank = position
    w = chaos.multiset_weights(r, n)
    # n!/prod(mult!) index tuples per multiset: they count all r**n tuples once
    assert w.sum() == r ** n
    for a, wa in zip(alpha, w):
        assert wa == len(set(itertools.permutations(a)))


def test_gather_blocks_cover_large_orders_in_several_blocks(monkeypatch):
    monkeypatch.setattr(chaos, "BLOCK_ROWS", 7)
    r, n = 4, 4
    blocks = list(chaos._multiset_blocks(r, n))
    assert len(blocks) > 2
    starts = [s for s, _ in blocks]
    sizes = [len(a) for _, a in blocks]
    assert starts == list(np.cumsum([0] + sizes[:-1]))
    assert max(sizes) <= chaos._max_block(r, n)


@pytest.mark.parametrize("i,j", [(0, 2), (2, 0), (1, 1), (1, 2), (2, 2), (1, 3), (3, 2)])
@pytest.mark.parametrize("block_rows", [3, 1 << 16])
def test_sym_product_equals_dense_symmetrization(i, j, block_rows, monkeypatch):
    # Tolerance: entries are O(1) (products of standard normals), each a mean of at most
    # C(5, 2) = 10 such products in both computations, so the two differ by a few ulps (~1e-15);
    # rtol 1e-13 / atol 1e-14 leave a margin of ~100 ulps and still catch any wrong index set.
    monkeypatch.setattr(chaos, "BLOCK_ROWS", block_rows)
    r = 3
    rng = np.random.default_rng(10 * i + j)
    A = _dense_sym(rng.standard_normal((r,) * i)) if i else rng.standard_normal(())
    B = _dense_sym(rng.standard_normal((r,) * j)) if j else rng.standard_normal(())
    want = _pack(_dense_sym(np.multiply.outer(A, B)), r)
    Y = np.multiply.outer(_pack(A, r), _pack(B, r))[None]  # (1, pk_i, pk_j)
    out = np.zeros((1, chaos.n_packed(r, i + j)))
    sets = math.comb(i + j, i)
    chaos._sym_product(Y, chaos._gather_index(r, i, j, False), 1.0 / sets, out)
    assert np.allclose(out[0], want, rtol=1e-13, atol=1e-14)
    if i == j:  # a symmetric block: half of the index sets, read window by window
        Ys = (Y + Y.swapaxes(1, 2)) / 2
        out = np.zeros_like(out)
        idx = chaos._gather_index(r, i, j, True)
        assert idx[0][1].shape[0] == (sets // 2 if i else 1)
        assert [b[2] for b in idx] == (chaos._windows(r, i + j, i) if i else [None])
        for blk in idx:
            W = Ys
            if blk[2] is not None:
                row0, rows, cols = blk[2]
                W = Ys[:, row0:row0 + rows, :cols]
            chaos._sym_product(W, [blk], 1.0 / idx[0][1].shape[0], out)
        assert np.allclose(out[0], want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_packed_trace_equals_dense_trace(n):
    # Tolerance as above: a trace sums r = 3 O(1) entries, a few ulps of rounding.
    r = 3
    M = _dense_sym(np.random.default_rng(n).standard_normal((r,) * n))
    want = _pack(np.trace(M, axis1=-2, axis2=-1), r)
    got = chaos._trace_packed(_pack(M, r)[None, None], n, r)[0, 0]
    assert np.allclose(got, want, rtol=1e-13, atol=1e-14)


def _pair_features(a, b, out=2):
    ca, _ = stack_for([a], "numpy", "a")
    cb, _ = stack_for([b], "numpy", "b")
    U, _ = output_matrix(None, out, False)
    cans, r = chaos.whiten([ca, cb], False)
    return cans, U, r


def _close(x, want, scale):
    return abs(float(x) - float(want)) <= 1e-10 * scale


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(KINDS), form=st.sampled_from("HT"),
       small=st.booleans())
def test_both_stage_forms_and_all_chunkings_equal_brute_force_and_wick(seed, kind, form,
                                                                         small):
    """H-form and T-form, with and without chunks of one output / tiny gather blocks, against
    the Wick strategy (floats) and verify's rational expansion (floats and exact Fractions)."""
    rng = np.random.default_rng(seed)
    a = rand_network(rng, kind, d=3, out=2, hidden=3, width=3, log_scale=(-1, 1))
    b = rand_network(rng, kind, d=3, out=2, hidden=2, width=3, log_scale=(-1, 1))
    want = brute_inner(a, b)
    scale = math.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(chaos, "_FORCE_FORM", form)
        if small:
            mp.setattr(chaos, "WORK_ELEMENTS", 1)
            mp.setattr(chaos, "FEATURE_ELEMENTS", 1)
            mp.setattr(chaos, "BLOCK_ROWS", 2)
        got = ta.inner(a, b, strategy="chaos")
        assert _close(got, want, scale)
        assert _close(got, ta.inner(a, b, strategy="wick"), scale)
        assert ta.inner(a, b, backend="exact", strategy="chaos") == want
        each = ta.inner(a, b, strategy="chaos", output="each")
        each_w = ta.inner(a, b, strategy="wick", output="each")
        assert np.all(np.abs(each - each_w) <= 1e-10 * scale)
    finally:
        mp.undo()


def test_T_form_is_chosen_behind_a_residual_and_matches_brute_force():
    """Second stage input (width + 1 = 4 units) narrower than its hidden layer (H = 12 plus the
    carried residual units): the planner picks the T-form there."""
    rng = np.random.default_rng(3)
    mk = lambda: ta.Sequential([rand_linear(rng, 3, 3, bias=False),  # noqa: E731
                                ta.Residual(rand_bilinear(rng, 3, 12, 3)),
                                ta.Residual(rand_bilinear(rng, 3, 12, 3)),
                                rand_linear(rng, 3, 2)])
    a, b = mk(), mk()
    cans, _U, r = _pair_features(a, b)
    st2 = cans[0].stages[1]
    plan = chaos._stage_plan(1, st2.L.shape[1], st2.L.shape[2], 2, [0, 1, 2], r, False)
    assert plan.form == "T" and st2.L.shape[2] < st2.L.shape[1]
    want = brute_inner(a, b)
    scale = math.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    assert _close(ta.inner(a, b, strategy="chaos"), want, scale)
    assert ta.inner(a, b, backend="exact", strategy="chaos") == want


def test_depth3_packed_against_brute_force_and_exact():
    rng = np.random.default_rng(4)
    a = ta.Sequential([ta.Residual(rand_bilinear(rng, 2, 2, 2)) for _ in range(3)])
    b = ta.Sequential([rand_bilinear(rng, 2, 3, 2) for _ in range(3)])
    want = brute_inner(a, b)
    scale = math.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    assert _close(ta.inner(a, b, strategy="chaos"), want, scale)
    assert ta.inner(a, b, backend="exact", strategy="chaos") == want


def test_torch_backend_through_packed_chaos():
    pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    a, b = (rand_network(rng, "depth2_residual_embed_head", d=3, log_scale=(-1, 1))
            for _ in range(2))
    want = ta.inner(a, b, strategy="wick")
    got = ta.inner(a, b, strategy="chaos", backend="torch")
    assert abs(got - want) <= 1e-10 * math.sqrt(ta.inner(a, a) * ta.inner(b, b))
    s = ta.similarity(a, b, strategy="chaos", backend="torch")
    assert abs(s - ta.similarity(a, b, strategy="wick")) <= 1e-10


def _depth2_residual(rng, d, m, H, out):
    g = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])  # noqa: E731
    bil = lambda: ta.Bilinear(g(H, m), g(H, m), g(m, H), g(H), g(H), g(m))  # noqa: E731
    return ta.Sequential([ta.Linear(g(m, d)), ta.Residual(bil()), ta.Residual(bil()),
                          ta.Linear(g(out, m))])


@pytest.mark.parametrize("m,H,small", [(6, 10, False), (8, 12, True), (9, 7, False)])
def test_memory_estimate_bounds_the_measured_peak_at_width(m, H, small, monkeypatch):
    """The planner's chaos memory estimate is an upper bound of tracemalloc's peak of the
    packed path (similarity: three pair products), with chunks and blocks at their defaults
    and forced small (several output chunks, product chunks and gather blocks)."""
    if small:
        monkeypatch.setattr(chaos, "WORK_ELEMENTS", 5000)
        monkeypatch.setattr(chaos, "FEATURE_ELEMENTS", 3000)
        monkeypatch.setattr(chaos, "BLOCK_ROWS", 50)
    rng = np.random.default_rng(m)
    a, b = _depth2_residual(rng, m, m, H, 4), _depth2_residual(rng, m, m, H, 4)
    p = ta.plan(a, b, strategy="chaos")
    ta.similarity(a, b, strategy="chaos")  # caches (binomial tables, combinations) warm
    tracemalloc.start()
    ta.similarity(a, b, strategy="chaos")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    weights = 8 * sum(x.size for n in (a, b) for x in n.arrays()) * 4
    assert peak <= p.memory_bytes + weights + 64 * 1024, (peak, p.memory_bytes)
    # and the estimate is not wildly loose (within 8x of the measured peak)
    assert p.memory_bytes <= 8 * (peak + weights + 64 * 1024)


def test_plan_for_exact_depth2_at_realistic_width_fits_the_targets():
    """(d_model, H) = (64, 256): the chaos estimate (from shapes alone) is under 2 GB and
    3e10 FLOPs (dense storage needed 6.3 GB and 2.3e11 FLOPs)."""
    rng = np.random.default_rng(6)
    a, b = _depth2_residual(rng, 64, 64, 256, 10), _depth2_residual(rng, 64, 64, 256, 10)
    ca, _ = stack_for([a], "numpy", "a")
    cb, _ = stack_for([b], "numpy", "b")
    est = chaos.estimate(ca, cb, 10, False, False, False)
    assert est.memory_elements * 8 < 2 * 2**30
    assert est.flops < 3e10
    assert est.n_features == 10 * sum(math.comb(64 + k - 1, k) for k in range(5))
