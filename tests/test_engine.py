"""Engine v2: the chaos strategy against the Wick strategy and an independent brute force
(verify's rational polynomial expansion), the planner's estimates, budgets and refusals."""

from __future__ import annotations

import math
import time
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from netgen import brute_inner, rand_bilinear, rand_linear, rand_network, to_fractions

import tensoralg as ta


def _embedded(rng, d, m, hidden, out, residual=False, depth=1, bias=True):
    """embed (d -> m, narrower when m < d) -> bilinear block(s) -> head."""
    layers = [rand_linear(rng, d, m, bias=bias)]
    for _ in range(depth):
        blk = rand_bilinear(rng, m, hidden, m, biases=bias)
        layers.append(ta.Residual(blk) if residual else blk)
    layers.append(rand_linear(rng, m, out, bias=bias))
    return ta.Sequential(layers)


def _close(x, want, scale):
    return abs(float(x) - float(want)) <= 1e-10 * scale


# ------------------------------------------------------------ chaos = wick = brute force

@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(
    ["linear", "bilinear", "bilinear_nobias", "embed_bilinear_head", "residual", "depth2",
     "depth2_residual_embed_head"]))
def test_chaos_equals_wick_equals_brute_force(seed, kind):
    rng = np.random.default_rng(seed)
    a = rand_network(rng, kind, d=2, out=2, hidden=2, width=2, log_scale=(-1, 1))
    b = rand_network(rng, kind, d=2, out=2, hidden=2, width=2, log_scale=(-1, 1))
    want = brute_inner(a, b)
    scale = math.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    for strategy in ("chaos", "wick"):
        assert _close(ta.inner(a, b, strategy=strategy), want, scale), strategy
    # the exact backend: the same Fraction from both strategies and the brute force (Wick in
    # rationals at depth 2 is 764 object-array contractions: checked once, below)
    assert ta.inner(a, b, backend="exact", strategy="chaos") == want
    if not kind.startswith("depth2"):
        assert ta.inner(a, b, backend="exact", strategy="wick") == want


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), ma=st.integers(1, 3), mb=st.integers(1, 3),
       residual=st.booleans(), depth=st.sampled_from([1, 1, 2]))
def test_embeddings_of_different_widths_whitened_and_bridged(seed, ma, mb, residual, depth):
    """Embeddings narrower than the input (kept apart: Wick bridges legs through E_a E_b^T,
    chaos whitens the joint covariance) against the brute force in x."""
    rng = np.random.default_rng(seed)
    d = 7
    a = _embedded(rng, d, ma, 2, 2, residual, depth)
    b = _embedded(rng, d, mb, 3, 2, residual, depth)
    want = brute_inner(a, b)
    scale = math.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    for strategy in ("chaos", "wick"):
        assert _close(ta.inner(a, b, strategy=strategy), want, scale), strategy
    assert ta.inner(a, b, backend="exact", strategy="chaos") == want  # folded, r = d
    if depth == 1:
        assert ta.inner(a, b, backend="exact", strategy="wick") == want
    s = ta.similarity(a, b, strategy="chaos")
    assert abs(s - ta.similarity(a, b, strategy="wick")) <= 1e-10


def test_narrow_embeddings_metric_pairs_and_whitened_grams():
    """A pair behind narrow embeddings is expanded in each model's embedded coordinates and
    paired through E_a E_b^T (exact in rationals too); a Gram matrix of several such models
    whitens the joint input covariance (rank r = sum of widths)."""
    from tensoralg.prepare import output_matrix, stack_for
    from tensoralg.strategies.chaos import position_free as chaos

    rng = np.random.default_rng(1)
    a, b = _embedded(rng, 30, 3, 4, 2), _embedded(rng, 30, 2, 4, 2)
    p = ta.plan(a, b)
    assert p.chaos.metric and not p.chaos.whitened and p.chaos.r == 3
    want = brute_inner(a, b)
    scale = math.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    assert _close(ta.inner(a, b, strategy="chaos"), want, scale)
    assert ta.inner(a, b, backend="exact", strategy="chaos") == want
    c = _embedded(rng, 30, 3, 4, 2)
    ca, _ = stack_for([a, c], "numpy", "models")
    _U, _ = output_matrix(None, 2, False)
    est = chaos.estimate(ca, ca, 2, False, True, False)
    assert est.whitened and est.r == 6  # two models of width 3 in 30 dimensions
    G = ta.gram([a, c], strategy="chaos")
    Gw = ta.gram([a, c], strategy="wick")
    dg = np.sqrt(np.diag(Gw))
    assert np.all(np.abs(G - Gw) <= 1e-12 * np.outer(dg, dg))
    assert _close(G[0, 1], brute_inner(a, c), math.sqrt(float(brute_inner(c, c)) * float(brute_inner(a, a))))


@pytest.mark.parametrize("output", [0, 1, "each", np.array([0.5, -2.0])])
def test_slices_directions_each_and_diffs_through_chaos(output):
    rng = np.random.default_rng(2)
    a, b, c = (rand_network(rng, "depth2_residual_embed_head", d=2, out=2, log_scale=(-1, 1))
               for _ in range(3))
    for x, y in ((a, b), (b, c)):
        wick = ta.inner(x, y, output=output, strategy="wick")
        chaos = ta.inner(x, y, output=output, strategy="chaos")
        nx = np.sqrt(np.abs(ta.inner(x, x, output=output, strategy="wick")))
        ny = np.sqrt(np.abs(ta.inner(y, y, output=output, strategy="wick")))
        assert np.all(np.abs(np.asarray(chaos) - np.asarray(wick)) <= 1e-10 * nx * ny)
    got = ta.inner_diff(a, b, c, strategy="chaos", output=output)
    want = ta.inner_diff(a, b, c, strategy="wick", output=output)
    na = np.sqrt(np.abs(ta.inner(a, a, output=output)))
    nbc = (np.sqrt(np.abs(ta.inner(b, b, output=output)))
           + np.sqrt(np.abs(ta.inner(c, c, output=output))))
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= 1e-10 * na * nbc)


def test_depth3_goes_through_chaos_at_small_width_and_matches_brute_force():
    rng = np.random.default_rng(3)
    net = ta.Sequential([rand_bilinear(rng, 2, 2, 2) for _ in range(3)])
    other = ta.Sequential([rand_bilinear(rng, 2, 2, 2) for _ in range(3)])
    p = ta.plan(net, other)
    assert p.strategy == "chaos" and p.wick is None  # 46 206 736 Wick configurations
    assert ta.inner(net, other, backend="exact") == brute_inner(net, other)


def test_gram_through_chaos_matches_wick_and_accepts_checkpoint_folders(tmp_path):
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.nn import BilinearNet

    models = [BilinearNet(5, 3, d_model=3, d_hidden=4, residual=True, bias=True, seed=s)
              for s in range(4)]
    G_chaos = ta.gram(models, strategy="chaos")
    G_wick = ta.gram(models, strategy="wick")
    dg = np.sqrt(np.diag(G_wick))
    assert np.all(np.abs(G_chaos - G_wick) <= 1e-12 * np.outer(dg, dg))
    paths = []
    for i, m in enumerate(models):
        save_checkpoint(tmp_path / f"c{i}", m, step=i)
        paths.append(str(tmp_path / f"c{i}"))
    G_files = ta.gram(iter(paths))  # any iterable; folders loaded one at a time
    assert np.all(np.abs(G_files - G_chaos) <= 1e-12 * np.outer(dg, dg))
    S = ta.similarity_matrix(paths, output="each")
    assert S.shape == (4, 4, 3)


# ------------------------------------------------------------ planner

def test_plan_shows_both_strategies_and_refused_matches_inner():
    rng = np.random.default_rng(4)
    a, b = rand_network(rng, "depth2", d=3), rand_network(rng, "depth2", d=3)
    p = ta.plan(a, b)
    assert p.wick is not None and p.chaos is not None and p.strategy in ("wick", "chaos")
    text = p.summary()
    assert "wick:" in text and "chaos:" in text and "choice:" in text
    for kw in (dict(max_flops=10), dict(max_memory=100), dict(max_flops=10, strategy="wick"),
               dict(strategy="chaos", max_memory=10)):
        p = ta.plan(a, b, **kw)
        assert p.refused and p.flops == float("inf")
        with pytest.raises(ta.CostTooHigh) as err:
            ta.inner(a, b, **kw)
        assert str(err.value) == p.refused
        assert "method='closure'" in p.refused and "method='montecarlo'" in p.refused
    p = ta.plan(a, b, max_flops=1e12)
    assert not p.refused
    ta.inner(a, b, max_flops=1e12)


def _no_full_wick_plan(monkeypatch):
    """Make building the Wick plan (joined network and every orbit's path) an error."""
    from tensoralg.strategies import wick
    from tensoralg.strategies.wick import joined as network

    def boom(*args, **kw):
        raise AssertionError("Wick planned in full")

    monkeypatch.setattr(wick, "build", boom)
    monkeypatch.setattr(network, "_find_paths", boom)


def test_auto_and_plan_take_chaos_without_planning_wick_when_a_bound_exceeds_it(monkeypatch):
    """Depth 2 (embed, two residual bilinear layers, head): chaos is cheaper; the planner sees
    it from a lower bound on Wick's FLOPs (paths of a few orbits) without the full plan."""
    from tensoralg import planner

    rng = np.random.default_rng(14)
    a, b = (_embedded(rng, 4, 4, 6, 3, residual=True, depth=2) for _ in range(2))
    full = ta.plan(a, b, strategy="wick").wick  # before the mocks: the full Wick plan
    want = ta.similarity(a, b, strategy="wick")
    monkeypatch.setattr(planner, "CHAOS_SHORTCUT_FLOPS", 0.0)  # no shortcut: use the bound
    monkeypatch.setattr(planner, "BOUND_MIN_FLOPS", 0.0)  # (a small case)
    _no_full_wick_plan(monkeypatch)
    p = ta.plan(a, b)
    assert p.strategy == "chaos" and p.wick is None
    assert p.chaos.flops < p.wick_lower_bound <= full.flops
    assert "lower bound" in p.summary() and "against at least" in p.reason
    assert abs(ta.similarity(a, b) - want) < 1e-12


def test_wick_refused_over_max_flops_from_the_bound_without_planning(monkeypatch):
    rng = np.random.default_rng(15)
    a, b = (_embedded(rng, 4, 4, 6, 3, residual=True, depth=2) for _ in range(2))
    _no_full_wick_plan(monkeypatch)
    for kw in (dict(strategy="wick", max_flops=1e4), dict(max_flops=1e4)):
        p = ta.plan(a, b, **kw)
        assert p.refused and p.wick is None and p.wick_lower_bound > 1e4
        assert "wick: at least" in p.refused
        with pytest.raises(ta.CostTooHigh) as err:
            ta.inner(a, b, **kw)
        assert str(err.value) == p.refused


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(
    ["bilinear", "bilinear_nobias", "embed_bilinear_head", "residual", "depth2",
     "depth2_residual_embed_head"]), output=st.sampled_from([None, "each", 1]),
    same=st.booleans(), frac=st.floats(0.0, 1.0))
def test_wick_lower_bounds_never_exceed_the_planned_flops(seed, kind, output, same, frac):
    """Both bounds (closed form; paths of some orbits) are at most the full plan's FLOPs, and
    the orbit-by-orbit sum over all orbits is the plan's FLOPs."""
    from tensoralg.prepare import output_matrix, stack_for
    from tensoralg.strategies import wick
    from tensoralg.strategies.wick import JoinedNetwork, wick_flops_lower_bound

    rng = np.random.default_rng(seed)
    a = rand_network(rng, kind, d=3, out=2)
    b = a if same else rand_network(rng, kind, d=3, out=2)
    U, keep = output_matrix(output, 2, False)
    ca, _ = stack_for([a], "numpy", "a")
    cb = ca if same else stack_for([b], "numpy", "b")[0]
    _, wp = wick.build(ca, cb, U, keep, "gaussian", 10**6)
    lb = wick_flops_lower_bound(ca, cb, U)
    assert lb is None or lb <= wp.flops
    part, n, n_orbits = JoinedNetwork(ca, cb, U, keep).flops_at_least(frac * wp.flops)
    assert part <= wp.flops * (1 + 1e-12) and n_orbits == wp.n_orbits
    total, n, _ = JoinedNetwork(ca, cb, U, keep).flops_at_least(math.inf)
    # the same terms summed in another order: equal to a few ulps of the sum
    assert n == wp.n_orbits and abs(total - wp.flops) <= 1e-12 * wp.flops


def test_depth3_at_realistic_width_is_refused_in_milliseconds_allocating_nothing():
    rng = np.random.default_rng(5)
    net = ta.Sequential([rand_linear(rng, 64, 32)] +
                        [ta.Residual(rand_bilinear(rng, 32, 64, 32)) for _ in range(3)] +
                        [rand_linear(rng, 32, 10)])
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(ta.CostTooHigh, match=r"46,206,736 Wick configurations.*chaos"):
        ta.inner(net, net)
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 * 2**20  # the canonical forms only (~1 MB of weights), no work arrays
    assert elapsed < 2.0  # generous on a loaded 2-core machine; typically a few ms


@pytest.mark.parametrize("strategy,kind", [
    (s, k) for s in ("wick", "chaos") for k in ("bilinear", "embed_bilinear_head", "depth2")
] + [("chaos", "depth2_residual_embed_head")])
def test_memory_estimate_bounds_the_measured_peak(strategy, kind):
    rng = np.random.default_rng(6)
    a = rand_network(rng, kind, d=4, out=3, hidden=6, width=5)
    b = rand_network(rng, kind, d=4, out=3, hidden=5, width=5)
    p = ta.plan(a, b, strategy=strategy)
    ta.inner(a, b, strategy=strategy)  # paths cached: the measured run does only the work
    tracemalloc.start()
    ta.inner(a, b, strategy=strategy)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # the estimate covers the work arrays; the canonical forms of the two models (their
    # weights, a few KB here) are outside it
    weights = 8 * sum(x.size for n in (a, b) for x in n.arrays()) * 4
    assert peak <= p.memory_bytes + weights + 64 * 1024, (peak, p.memory_bytes)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "1e9", True])
def test_budgets_must_be_positive_numbers(bad):
    rng = np.random.default_rng(7)
    a = rand_network(rng, "bilinear")
    for name in ("max_flops", "max_memory"):
        with pytest.raises(ValueError, match=f"{name}: expected a positive number"):
            ta.inner(a, a, **{name: bad})
        with pytest.raises(ValueError, match=f"{name}: expected a positive number"):
            ta.plan(a, **{name: bad})


def test_strategy_errors_name_the_alternatives():
    rng = np.random.default_rng(8)
    a = rand_network(rng, "bilinear")
    with pytest.raises(ValueError, match=r"strategy: unknown strategy 'hermite'.*'wick'.*'chaos'"):
        ta.inner(a, a, strategy="hermite")
    with pytest.raises(ValueError, match="strategy='chaos' computes the Gaussian metric"):
        ta.inner(a, a, metric="frobenius", strategy="chaos")
    with pytest.raises(ValueError, match="needs method='exact'"):
        ta.inner(a, a, method="closure", strategy="wick")
    with pytest.raises(ta.CostTooHigh, match=r"chaos: estimated .* FLOPs over max_flops"):
        ta.inner(a, a, strategy="chaos", max_flops=1)


def test_closure_triple_equals_separate_calls():
    rng = np.random.default_rng(9)
    a, b = (rand_network(rng, "depth2_residual_embed_head", d=3, log_scale=(-1, 1))
            for _ in range(2))
    s = ta.similarity(a, b, method="closure")
    ab = ta.inner(a, b, method="closure")
    aa, bb = ta.inner(a, a, method="closure"), ta.inner(b, b, method="closure")
    assert s == pytest.approx(ab / math.sqrt(aa * bb), rel=1e-12)


def test_fraction_weights_exact_through_chaos():
    rng = np.random.default_rng(10)
    a = to_fractions(rand_network(rng, "depth2", d=2))
    b = to_fractions(rand_network(rng, "residual", d=2))
    assert ta.inner(a, b, backend="exact", strategy="chaos") == brute_inner(a, b)
    assert isinstance(ta.inner(a, b, backend="exact", strategy="chaos"), Fraction)


def test_chaos_gram_expands_models_in_chunks_and_matches_wick():
    from tensoralg.nn import BilinearNet
    from tensoralg.strategies.chaos import position_free as chaos

    n = chaos.FEATURE_CHUNK * 2 + 3  # three chunks
    models = [BilinearNet(5, 3, d_model=3, d_hidden=4, seed=s) for s in range(n)]
    G = ta.gram(models, strategy="chaos")
    W = ta.gram(models, strategy="wick")
    dg = np.sqrt(np.diag(W))
    assert np.all(np.abs(G - W) <= 1e-12 * np.outer(dg, dg))


def test_similarity_that_overflows_float64_is_an_error_not_nan():
    rng = np.random.default_rng(12)
    R = rng.standard_normal
    net = ta.Sequential([ta.Linear(R((2, 3))), ta.Linear(R((2, 2)) * 1e200),
                         ta.Residual(ta.Bilinear(R((3, 2)), R((3, 2)), R((2, 3)) * 1e200))])
    with np.errstate(all="ignore"), pytest.raises(ValueError, match="overflowed float64"):
        ta.similarity(net, net)
