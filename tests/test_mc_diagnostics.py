"""Monte Carlo that knows when it fails (issue 21 item 4c, docs/mathematics.md §3.9): every
scalar estimate carries independent replicates, the largest single-direction share of its sums
and a verdict; where the verdict is False the value is not an answer, and the certified lower
bounds on the norms must still hold. Truths: exact Wick sums (checked against verify elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest

import tensoralg as ta
from tensoralg.strategies import montecarlo as mc


def _bilinear(rng, d=3, h=4, o=2):
    return ta.Bilinear(rng.normal(size=(h, d)), rng.normal(size=(h, d)), rng.normal(size=(o, h)))


def test_estimates_carry_replicates_and_a_verdict():
    rng = np.random.default_rng(0)
    a, b = _bilinear(rng), _bilinear(rng)
    for est, exact in ((ta.inner(a, b, method="montecarlo", n_samples=3000), ta.inner(a, b)),
                       (ta.similarity(a, b, method="montecarlo", n_samples=3000),
                        ta.similarity(a, b)),
                       (ta.norm(a, method="montecarlo", n_samples=3000), ta.norm(a))):
        d = est.diagnostics
        assert isinstance(d, mc.Diagnostics) and len(d.replicates) == mc.MC_REPLICATES
        assert est.reliable and d.reason == "" and 0 < d.max_share < mc.MC_MAX_SHARE
        assert abs(float(est) - exact) <= 4 * est.stderr
    # the replicates are the disjoint thirds of the same directions: for a mean, their
    # size-weighted average is the estimate itself
    est = ta.inner(a, b, method="montecarlo", n_samples=3000)
    sizes = [len(x) for x in np.array_split(np.arange(3000), mc.MC_REPLICATES)]
    pooled = sum(s * v for s, (v, _) in zip(sizes, est.diagnostics.replicates)) / 3000
    assert pooled == pytest.approx(float(est), rel=1e-12)
    # a squared norm gets its certified lower bound; it lies below the exact value
    sq = ta.inner(a, a, method="montecarlo", n_samples=3000)
    assert 0 < sq.diagnostics.lower_bounds["<a,a>"] <= ta.inner(a, a)


def _needle(d=48, depth=3, seed=0):
    """f(x) = (v . x)^(2^depth): a degree-8 needle along v in d dimensions. A direction u
    sees p(u) proportional to (u . v)^16, so the squared norm sits in the few directions near
    +-v: sampling directions misses it at any affordable n."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=d)
    v /= np.linalg.norm(v)
    layers = [ta.Bilinear(v[None], v[None], np.ones((1, 1)))]
    for _ in range(depth - 1):
        layers.append(ta.Bilinear(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1))))
    return ta.Sequential(layers)


def test_a_needle_is_flagged_never_a_confident_wrong_number():
    """Over 20 seeds: every estimate of the needle's squared norm is either flagged
    (reliable=False) or within 4 standard errors of the exact value, and its certified lower
    bound never exceeds the exact value."""
    f = _needle()
    exact = 2027025.0      # E[(v . x)^16] = E[g^16] = 15!! for a unit v (g standard normal)
    # the construction is the needle: at d = 2 the exact engine gives the same 15!!
    assert ta.inner(_needle(d=2), _needle(d=2)) == pytest.approx(exact, rel=1e-10)
    flagged = 0
    for seed in range(20):
        est = ta.inner(f, f, method="montecarlo", n_samples=600, seed=seed)
        if est.reliable:
            assert abs(float(est) - exact) <= 4 * est.stderr, (seed, est)
        else:
            flagged += 1
            assert est.diagnostics.reason
        assert est.diagnostics.lower_bounds["<a,a>"] <= exact
    assert flagged >= 15, flagged     # the sample mean is off by orders of magnitude here


def test_disagreeing_replicates_are_flagged():
    reps = [(1.0, 0.01), (1.0, 0.01), (2.0, 0.01)]
    d = mc.verdict(reps, 0.001, {})
    assert not d.reliable and "disagree" in d.reason and d.max_z > 3
    assert mc.verdict(reps[:2], 0.001, {}).reliable
    assert not mc.verdict(reps[:2], 0.2, {}).reliable


def test_the_certified_lower_bound_holds_over_many_seeds():
    """Exponential samples (mean 1, heavy enough): the 99.9 % bound stays below the mean in all
    of 300 seeds and is not vacuous (above 0.3 at n = 2000)."""
    bounds = [mc.certified_lower_bound(np.random.default_rng(s).exponential(size=2000))
              for s in range(300)]
    assert max(bounds) <= 1.0 and min(bounds) > 0.3


def test_sequence_estimates_carry_diagnostics():
    rng = np.random.default_rng(3)
    W = lambda *s: rng.normal(size=s)  # noqa: E731
    a = ta.Residual(ta.BilinearAttention(W(1, 2, 2), W(1, 2, 2), W(1, 2, 2), W(1, 2, 2),
                                         W(1, 1, 2), W(2, 1, 1)))
    b = ta.Residual(ta.BilinearAttention(W(1, 2, 2), W(1, 2, 2), W(1, 2, 2), W(1, 2, 2),
                                         W(1, 1, 2), W(2, 1, 1)))
    for est, exact in ((ta.inner(a, b, n_ctx=2, method="montecarlo", n_samples=900),
                        ta.inner(a, b, n_ctx=2)),
                       (ta.similarity(a, b, n_ctx=2, method="montecarlo", n_samples=900),
                        ta.similarity(a, b, n_ctx=2))):
        assert est.diagnostics is not None and len(est.diagnostics.replicates) == 3
        if est.reliable:
            assert abs(float(est) - exact) <= 4 * est.stderr


def test_too_few_directions_for_the_replicates_is_refused():
    rng = np.random.default_rng(4)
    a = _bilinear(rng)
    with pytest.raises(ValueError, match="n_samples: expected an integer >= 6 .*3 independent "
                                         "replicates"):
        ta.inner(a, a, method="montecarlo", n_samples=5)


def test_the_compare_table_prints_no_number_for_an_unreliable_estimate():
    from tensoralg.audit.compare import compare_table

    result = {"a": {"path": "A"}, "b": {"path": "B"}, "depth": 2, "skipped": [],
              "results": [{"metric": "gaussian", "method": "montecarlo", "global": 0.123456,
                           "global_stderr": 0.001, "reliable": False,
                           "diagnostics": {"reason": "one direction carries 90% of a sum"}},
                          {"metric": "gaussian", "method": "exact", "global": 0.5,
                           "each": [0.5, 0.4]}]}
    text = compare_table(result)
    assert "no reliable estimate" in text and "0.1235" not in text
    assert "one direction carries 90% of a sum" in text and "0.5000" in text


def test_an_unreliable_estimate_never_formats_as_a_number():
    """Fresh-eyes tester: ``f"{est:.4f}"`` of an estimate failing its diagnostics printed the
    number. Every numeric format spec (and ``print``) now gives the refusal with its reason;
    ``float`` and arithmetic still see the value. The estimate is the needle's (flagged at
    seed 0: one direction carries most of the sum)."""
    f = _needle()
    est = ta.inner(f, f, method="montecarlo", n_samples=600, seed=0)
    assert est.reliable is False
    refusal = f"no reliable estimate ({est.diagnostics.reason})"
    for spec in ("", ".4f", ".6g", "e", ".2%", "+08.3f", ",.1f", "10.2f", "=12.1f"):
        assert format(est, spec) == refusal, spec
    assert str(est) == f"{est}" == refusal and "NOT reliable" in repr(est)
    assert format(est, ">90.2f") == refusal.rjust(90)       # fill, alignment and width kept
    assert format(est, "*<90") == refusal.ljust(90, "*")
    value = float(est)
    assert type(value) is float and est + 1 == value + 1 and 2 * est == 2 * value
    assert f"{est + 0:.4f}" == f"{value:.4f}"               # arithmetic gives plain floats
    # a reliable (or undiagnosed) estimate formats as before
    rng = np.random.default_rng(0)
    a = _bilinear(rng)
    good = ta.inner(a, a, method="montecarlo", n_samples=600)
    assert good.reliable and f"{good:.4f}" == f"{float(good):.4f}"
    assert str(good) == repr(good) == f"{good}"
    plain = mc.MonteCarloEstimate(0.5, 0.1, 10)
    assert f"{plain:.2f}" == "0.50" and str(plain) == repr(plain)


def test_audit_pair_similarity_keeps_the_verdict():
    """Fresh-eyes tester: the audits' Monte Carlo similarity (audit.common.pair_similarity)
    dropped the verdict, so the backdoor and forgetting tables printed an unreliable global
    similarity as a number. It now carries ``global_reliable`` and the table cell (``pm``)
    says "no reliable estimate"; a reliable one prints as before."""
    from tensoralg.audit.common import pair_similarity, pm

    f = _needle()
    g = _needle(seed=1)
    r = pair_similarity(f, g, "montecarlo", n_samples=600, seed=0)
    assert r["global_reliable"] is False and r["global_reason"]
    cell = pm(r["global"], r["global_stderr"])
    assert cell.startswith("no reliable estimate (") and f"{float(r['global']):.4f}" not in cell
    r = pair_similarity(ta.Bilinear(np.eye(3), np.eye(3), np.ones((1, 3))),
                        ta.Bilinear(np.eye(3), np.eye(3), np.ones((1, 3))), "montecarlo",
                        n_samples=600, seed=0)
    assert r["global_reliable"] is True and pm(r["global"], r["global_stderr"]).startswith("1.0000 ±")


def test_per_output_slices_carry_each_its_verdict():
    """``output="each"`` gives one verdict per slice (they carried none; issue 21 item 4c): the
    verdict of slice k equals that of the scalar estimate with ``output=k`` from the same
    samples, and a needle in one output is flagged in that slice only."""
    rng = np.random.default_rng(1)
    a, b = _bilinear(rng, o=3), _bilinear(rng, o=3)
    kw = dict(method="montecarlo", n_samples=3000, seed=4)
    for fn in (ta.similarity, ta.inner, ta.diff_norm):
        each = fn(a, b, output="each", **kw)
        assert isinstance(each, mc.MonteCarloArray) and each.reliable.shape == (3,)
        for k in range(3):
            one = fn(a, b, output=k, **kw)
            assert float(each[k]) == pytest.approx(float(one), rel=1e-12)
            assert each.diagnostics[k].reliable == one.reliable
            assert each.diagnostics[k].max_share == pytest.approx(one.diagnostics.max_share,
                                                                  rel=1e-12)
    # output 0 the needle (v . x)^8, output 1 the constant 1: only slice 0 is flagged
    d = 48
    v = rng.normal(size=d)
    v /= np.linalg.norm(v)
    rows = np.stack([v, np.zeros(d)])
    first = ta.Bilinear(rows, rows, np.eye(2), left_bias=np.array([0.0, 1.0]),
                        right_bias=np.array([0.0, 1.0]))
    sq = ta.Bilinear(np.eye(2), np.eye(2), np.eye(2))
    f = ta.Sequential([first, sq, sq])
    each = ta.inner(f, f, output="each", method="montecarlo", n_samples=600, seed=0)
    assert each.reliable.tolist() == [False, True], [x.reason for x in each.diagnostics]
    # arithmetic and slicing give other arrays: the verdicts stay with the estimate
    assert (each * 2).diagnostics is None and each[:1].reliable is None


def test_an_absurd_sample_count_is_refused_before_sampling():
    """Fresh-eyes tester: ``n_samples=10**15`` ran for ten minutes until killed. Every Monte
    Carlo path (radial and guided, vector and sequence models, inner / similarity / diffs /
    gram) refuses forward passes beyond ``MC_MAX_FLOPS`` before drawing a sample."""
    rng = np.random.default_rng(0)
    a, b = _bilinear(rng, o=3), _bilinear(rng, o=3)
    t = ta.BilinearTransformer(7, 6, 1, 2, 2, n_ctx=3, seed=0)
    huge = dict(method="montecarlo", n_samples=10 ** 15)
    calls = [lambda: ta.inner(a, b, **huge), lambda: ta.similarity(a, b, **huge),
             lambda: ta.similarity(a, b, proposal="modes", **huge),
             lambda: ta.diff_norm(a, b, **huge), lambda: ta.gram([a, b], **huge),
             lambda: ta.inner_diff(a, a, b, **huge),
             lambda: ta.similarity_matrix([a, b], **huge),   # (a MemoryError before)
             lambda: ta.similarity_matrix([t, t], n_ctx=3, **huge),
             lambda: ta.gram([t, t], n_ctx=3, **huge),
             lambda: ta.similarity(t, t, n_ctx=3, **huge),
             lambda: ta.inner(t, t, n_ctx=3, proposal="modes", **huge)]
    for call in calls:
        with pytest.raises(ta.CostTooHigh, match=r"^n_samples=1000000000000000: about .* FLOPs "
                                                 r"of forward passes .* over the Monte Carlo "
                                                 r"budget of 1e\+14"):
            call()
    # an ordinary count is far below the budget (2 * 53 weights x 4 points x 1e5 directions)
    assert mc.forward_flops(a) * 4 * 100_000 < mc.MC_MAX_FLOPS


def test_a_monte_carlo_similarity_matrix_carries_errors_and_verdicts_per_entry(pair_without_cross_check):
    """Fresh-eyes tester: a Monte Carlo similarity_matrix was a bare array that looked exact.
    Each entry now carries the standard error and the verdict of the pair's own estimate from
    the same directions (ta.similarity with the same seed: equal to rounding), the diagonal is
    1 ± 0, and a needle model is flagged in its row."""
    from tensoralg.results import gram_to_similarity

    rng = np.random.default_rng(2)
    nets = [ta.Sequential([_bilinear(rng, d=4, h=5, o=3), _bilinear(rng, d=3, h=5, o=3)])
            for _ in range(3)]
    kw = dict(method="montecarlo", n_samples=3000, seed=1)
    S = ta.similarity_matrix(nets, **kw)
    assert isinstance(S, mc.MonteCarloArray) and S.reliable.shape == (3, 3)
    # the same sums in another order: float64 rounding (atol for the 0-diagonal differences)
    np.testing.assert_allclose(S, gram_to_similarity(np.asarray(ta.gram(nets, **kw))),
                               rtol=1e-12, atol=1e-15)
    for i in range(3):
        assert S[i, i] == 1.0 and S.stderr[i, i] == 0.0
        for j in range(3):
            if i == j:
                continue
            one = ta.similarity(nets[i], nets[j], **kw)
            assert float(S[i, j]) == pytest.approx(float(one), rel=1e-12)
            # the standard errors come from one-pass variances (mean of squares minus square
            # of the mean) summed in another order: that cancellation loses about
            # eps * mean^2 / variance, ~1e-13 here; 1e-9 bounds it with room, not tuned
            assert S.stderr[i, j] == pytest.approx(one.stderr, rel=1e-9)
            d = S.diagnostics[3 * i + j]
            assert d.reliable == one.reliable
            assert d.max_share == pytest.approx(one.diagnostics.max_share, rel=1e-9)
            for (x, sx), (y, sy) in zip(d.replicates, one.diagnostics.replicates):
                assert x == pytest.approx(y, rel=1e-12) and sx == pytest.approx(sy, rel=1e-9)
    each = ta.similarity_matrix(nets, output="each", **kw)
    assert each.shape == each.stderr.shape == each.reliable.shape == (3, 3, 3)
    one = ta.similarity(nets[0], nets[1], output="each", **kw)
    np.testing.assert_allclose(each[0, 1], one, rtol=1e-12)
    np.testing.assert_allclose(each.stderr[0, 1], one.stderr, rtol=1e-9)
    # a needle among other models: every entry of its row and column is flagged (the needle's
    # norm, in every such entry's ratio, sits in a few directions)
    f = _needle(d=4, depth=3)
    others = [ta.Sequential([ta.Bilinear(rng.normal(size=(1, 4)), rng.normal(size=(1, 4)),
                                         np.ones((1, 1)))] + [ta.Bilinear(np.ones((1, 1)),
                                                                          np.ones((1, 1)),
                                                                          np.ones((1, 1)))] * 2)
              for _ in range(2)]
    R = ta.similarity_matrix([f] + others, method="montecarlo", n_samples=600, seed=0)
    assert not R.reliable[0, 1:].any() and not R.reliable[1:, 0].any()


def test_a_monte_carlo_similarity_matrix_with_a_zero_model_is_refused():
    """Bad input for the per-entry estimator: a model whose sampled norm is zero is named."""
    rng = np.random.default_rng(5)
    zero = ta.Bilinear(np.zeros((4, 3)), np.ones((4, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"^similarity_matrix: models \[1\] have sampled norm "
                                         r"zero; similarity is undefined$"):
        ta.similarity_matrix([_bilinear(rng), zero, _bilinear(rng)], method="montecarlo",
                             n_samples=600, seed=0)


def test_degree_similarity_refuses_an_absurd_sample_count_and_warns_of_a_long_run(monkeypatch):
    """degree_similarity's Monte Carlo (S<=9 of two attention layers) is held against the same
    budget as every other Monte Carlo path, and a run above MC_WARN_FLOPS says how long it is
    before it starts (fresh-eyes tester: a (64, 256) context ran for minutes in silence)."""
    t = ta.BilinearTransformer(5, 4, 2, 1, 2, n_ctx=3, seed=0)
    with pytest.raises(ta.CostTooHigh, match=r"^n_samples=1000000000000000: about"):
        ta.degree_similarity(t, t, n_ctx=3, max_degree=9, n_samples=10 ** 15)
    monkeypatch.setattr(mc, "MC_WARN_FLOPS", 1.0)
    with pytest.warns(RuntimeWarning, match=r"^Monte Carlo: about .* FLOPs of forward passes "
                                            r"\(300 directions"):
        ta.degree_similarity(t, t, n_ctx=3, max_degree=9, n_samples=300)
