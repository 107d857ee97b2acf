"""Guided Monte Carlo (``proposal="modes"``, tensoralg.strategies.guided).

The truth is independent of the code under test: the exact engine at depth 1 and on vector
models, and the Gauss-Hermite oracle (tensoralg.verify.quadrature) on planted two-layer attention models
whose norm sits in rare inputs, where the radial estimator fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from tensoralg.verify.planted import planted_attention
from tensoralg.verify.quadrature import quadrature_inner, quadrature_similarity

import tensoralg as ta
from tensoralg.strategies import guided


def _z(est, truth):
    return (float(est) - float(truth)) / est.stderr


def _bilinear(seed, depth=1):
    r = np.random.default_rng(seed)
    layers = [ta.Bilinear(r.normal(size=(6, 5)), r.normal(size=(6, 5)), r.normal(size=(2, 6)))]
    if depth == 2:
        layers.append(ta.Residual(ta.Bilinear(r.normal(size=(4, 2)), r.normal(size=(4, 2)),
                                              r.normal(size=(2, 4)))))
    return ta.Sequential(layers)


@pytest.mark.parametrize("depth", [1, 2])
def test_vector_models_agree_with_exact(depth):
    a, b = _bilinear(1, depth), _bilinear(2, depth)
    s = ta.similarity(a, b, method="montecarlo", proposal="modes", n_samples=1000, seed=0)
    assert s.reliable and abs(_z(s, ta.similarity(a, b))) < 4
    i = ta.inner(a, b, method="montecarlo", proposal="modes", n_samples=1000, seed=0)
    assert abs(_z(i, ta.inner(a, b))) < 4


@pytest.mark.parametrize("depth", [1, 2])
def test_diff_norm_agrees_with_exact(depth):
    """``diff_norm`` takes ``proposal="modes"`` as ``inner`` / ``similarity`` do (it refused;
    fresh-eyes tester): the guided estimate of ``||b - c||`` within 4 SE of the exact engine's,
    with the diagnostics of a squared norm (its certified lower bound below the exact
    ``||b - c||^2``)."""
    b, c = _bilinear(1, depth), _bilinear(2, depth)
    exact = ta.diff_norm(b, c)
    d = ta.diff_norm(b, c, method="montecarlo", proposal="modes", n_samples=1000, seed=0)
    assert isinstance(d, ta.MonteCarloEstimate) and d.n_samples == 1000
    assert d.reliable and abs(_z(d, exact)) < 4, (d, exact)
    assert 0 < d.diagnostics.lower_bounds["||b - c||^2"] <= exact ** 2


@pytest.mark.parametrize("proposal", ["radial", "modes"])
def test_the_distance_of_a_model_to_itself_is_a_reliable_zero(proposal):
    """``||b - b||``: the integrand is zero on every sample, so the estimate is 0 ± 0 and
    reliable (a non-zero polynomial vanishes on a null set only); it was reported NOT reliable
    ("one direction carries 100 % of a sum") with an infinite standard error (fresh-eyes
    tester). A model whose norm is zero still makes a similarity undefined."""
    b = _bilinear(1, 2)
    d = ta.diff_norm(b, b, method="montecarlo", proposal=proposal, n_samples=400, seed=0)
    assert float(d) == 0.0 and d.stderr == 0.0 and d.reliable, repr(d)
    assert f"{d:.3f}" == "0.000"
    zero = ta.Sequential([ta.Bilinear(np.zeros((6, 5)), np.ones((6, 5)), np.ones((2, 6)))])
    with pytest.raises(ValueError, match="sampled norm is zero"):
        ta.similarity(_bilinear(1), zero, method="montecarlo", proposal=proposal,
                      n_samples=400, seed=0)


def test_the_distance_of_a_sequence_model_to_itself_is_a_reliable_zero():
    m = ta.BilinearTransformer(7, 6, 2, 2, 2, n_ctx=3, seed=1)
    d = ta.diff_norm(m, m, method="montecarlo", proposal="modes", n_samples=400, seed=0,
                     n_ctx=3)
    assert float(d) == 0.0 and d.stderr == 0.0 and d.reliable, repr(d)


def test_diff_norm_of_planted_sequence_models_agrees_with_quadrature(planted):
    """Two planted attention models (norms in rare inputs): guided ``||a - b||`` against the
    Gauss-Hermite oracle's ``sqrt(<a,a> - 2<a,b> + <b,b>)`` (the models read the same
    direction, so one slice carries all three)."""
    a, b, truth = planted
    sl = a.slice()
    d2 = float(quadrature_inner(a.network, a.network, sl)) - 2 * float(
        quadrature_inner(a.network, b.network, sl)) + float(truth["bb"])
    d = ta.diff_norm(a.network, b.network, method="montecarlo", proposal="modes",
                     n_samples=2000, seed=0, n_ctx=2)
    assert d.reliable and abs(_z(d, np.sqrt(d2))) < 4, (d, np.sqrt(d2))
    # radial sampling of a difference takes sequences too; here the norms sit in rare inputs,
    # which its diagnostics see: no reliable estimate (a direction carries the whole sum)
    r = ta.diff_norm(a.network, b.network, method="montecarlo", n_samples=600, n_ctx=2)
    assert not r.diagnostics.reliable and "one direction carries" in r.diagnostics.reason


def test_mixture_weights_are_bounded_and_unbiased():
    """uniform/q <= 1/(1-beta), E_q[uniform/q] = 1, and E_q[w h] = E_uniform[h] for a known
    function on the sphere, h(u) = (u . e)^8 with E = 7!! / (D (D+2) (D+4) (D+6)) (the moments of
    a uniform direction): the sampler and the density ratio describe the same mixture, with
    concentrations from nearly uniform to sharp and the direction of e among the components."""
    D = 6
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(4, D))
    mu[0] = np.eye(D)[0]
    mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    kappa = np.array([40.0, 3.0, 200.0, 1.5])
    U = np.concatenate([u for u, _ in guided.direction_draws(mu, kappa, D, 200_000, seed=1)])
    w = np.concatenate([w for _, w in guided.direction_draws(mu, kappa, D, 200_000, seed=1)])
    assert w.max() <= 1 / (1 - guided.BETA) + 1e-12
    assert abs(w.mean() - 1) < 4 * w.std(ddof=1) / np.sqrt(w.size)
    p = w * U[:, 0] ** 8
    truth = 105 / (D * (D + 2) * (D + 4) * (D + 6))
    assert abs(p.mean() - truth) < 4 * p.std(ddof=1) / np.sqrt(p.size)


def test_uniform_variance_estimates_the_variance_over_uniform_directions():
    """guided.uniform_variance from mixture draws estimates Var_uniform(h) for a known h on the
    sphere, h(u) = (u . e)^4: E[h^2] - E[h]^2 = 105 / (D (D+2) (D+4) (D+6)) - (3 / (D (D+2)))^2
    (moments of a uniform direction), within 4 standard errors of its summand; and for a
    linear combination g . h of two functions, the variance of the combination."""
    D = 6
    rng = np.random.default_rng(3)
    mu = rng.normal(size=(3, D))
    mu[0] = np.eye(D)[0]
    mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    kappa = np.array([60.0, 2.0, 15.0])
    draws = list(guided.direction_draws(mu, kappa, D, 200_000, seed=2))
    U = np.concatenate([u for u, _ in draws])
    w = np.concatenate([w for _, w in draws])
    h = U[:, 0] ** 4
    m4, m8 = 3 / (D * (D + 2)), 105 / (D * (D + 2) * (D + 4) * (D + 6))
    est = guided.uniform_variance((w * h)[None, :], w)
    y = w * h * h
    assert abs(est - (m8 - m4 * m4)) < 4 * y.std(ddof=1) / np.sqrt(y.size)
    # g . h with h = ((u.e1)^4, (u.e2)^2): Var = Var(h1) + 4 Var(h2) - 4 Cov(h1, h2) at g = (1, -2)
    h2 = U[:, 1] ** 2
    m2, m42 = 1 / D, 3 / (D * (D + 2) * (D + 4))          # E[u1^4 u2^2]
    var_h2 = m4 - m2 * m2
    cov = m42 - m4 * m2
    truth = (m8 - m4 * m4) + 4 * var_h2 - 4 * cov
    P = np.stack([w * (h - m4), w * (h2 - m2)])
    est2 = guided.uniform_variance(P, w, np.array([1.0, -2.0]))
    y2 = w * (h - m4 - 2 * (h2 - m2)) ** 2
    assert abs(est2 - truth) < 4 * y2.std(ddof=1) / np.sqrt(y2.size)


def test_log_bessel_is_stable_where_scipy_underflows():
    """log I_nu(kappa) from the series where ive underflows (large nu: the spheres of sequence
    models), equal to scipy where both are representable."""
    from scipy.special import ive

    k = np.array([0.5, 3.0, 40.0, 900.0])
    for nu in (0.0, 2.5, 30.0):
        ref = np.log(ive(nu, k)) + k
        # both are float64 evaluations of log I_nu (|log I| <= ~900 here): 1e-12 is a few
        # hundred ulps of the larger values, rounding of the series' terms and of ive
        assert np.allclose(guided._log_bessel_iv(nu, k), ref, rtol=1e-12, atol=1e-12)
    big = guided._log_bessel_iv(600.0, np.array([50.0]))[0]     # ive(600, 50) underflows
    # log I_600(50) = -1309.9108031793 (mpmath, 30 digits: log(besseli(600, 50)))
    assert big == pytest.approx(-1309.9108031793, rel=1e-12)


@pytest.fixture(scope="module")
def planted():
    """Planted two-layer attention (n_ctx 2, d 16) at input scale 0.35: the norm of b sits in
    one large token along v (7 standard deviations out) at either position."""
    a = planted_attention(16, 2, scale=0.35, seed=1)
    b = planted_attention(16, 2, scale=0.35, seed=2)
    truth = {"bb": quadrature_inner(b.network, b.network, b.slice()),
             "sim": quadrature_similarity(a.network, b.network, a.slice())}
    return a, b, truth


def test_planted_radial_fails_guided_covers(planted):
    a, b, truth = planted
    radial = ta.inner(b.network, b.network, method="montecarlo", n_samples=1000, seed=0, n_ctx=2)
    assert not radial.reliable          # the test bed: plain directions miss the peaks
    answered = 0
    for seed in range(2):
        bb = ta.inner(b.network, b.network, method="montecarlo", proposal="modes",
                      n_samples=2000, seed=seed, n_ctx=2)
        s = ta.similarity(a.network, b.network, method="montecarlo", proposal="modes",
                          n_samples=2000, seed=seed, n_ctx=2)
        for est, t in ((bb, truth["bb"]), (s, truth["sim"])):
            if est.reliable:             # never a confident wrong number
                assert abs(_z(est, t)) < 4, (seed, est, float(t))
                answered += 1
    assert answered >= 3                 # and it does answer


def test_input_distribution_is_folded_in(planted):
    """The scale-1 planted model under cov = 0.35^2 is the scale-0.35 model (f_s(X) = f_1(sX))."""
    _, _, truth = planted
    b1 = planted_attention(16, 2, scale=1.0, seed=2)
    bb = ta.inner(b1.network, b1.network, method="montecarlo", proposal="modes", n_samples=1000,
                  seed=0, n_ctx=2, cov=0.35 ** 2)
    assert bb.reliable and abs(_z(bb, truth["bb"])) < 4


def test_bad_input():
    a = _bilinear(1)
    with pytest.raises(ValueError, match="proposal: unknown proposal 'wide'"):
        ta.inner(a, a, method="montecarlo", proposal="wide")
    with pytest.raises(ValueError, match="needs method='montecarlo'"):
        ta.similarity(a, a, proposal="modes")
    with pytest.raises(ValueError, match="output: proposal='modes' estimates one number"):
        ta.inner(a, a, method="montecarlo", proposal="modes", output="each")
    with pytest.raises(ValueError, match="gram samples with proposal='radial'"):
        ta.gram([a, a], method="montecarlo", proposal="modes")
    with pytest.raises(ValueError, match="implemented for inner, similarity and diff_norm; "
                                         "inner_diff samples with proposal='radial'"):
        ta.inner_diff(a, a, a, method="montecarlo", proposal="modes")
    with pytest.raises(ValueError, match="output: proposal='modes' estimates one number"):
        ta.diff_norm(a, a, method="montecarlo", proposal="modes", output="each")
    with pytest.raises(ValueError, match="n_ctx / position: only for sequence models"):
        ta.diff_norm(a, a, method="montecarlo", proposal="modes", n_ctx=2)


def test_torch_backend_runs_the_search_and_the_forwards_on_the_device(planted, monkeypatch):
    """backend='torch' (here torch's CPU device): the same modes and samples, the forward
    passes in torch float64 on the device — the estimate agrees with numpy's to rounding;
    backend='exact' is refused (sampling is floating point)."""
    a, b, _ = planted
    kw = dict(method="montecarlo", proposal="modes", n_samples=600, seed=3, n_ctx=2)
    ref = ta.similarity(a.network, b.network, **kw)
    calls = []
    orig = guided._forward
    monkeypatch.setattr(guided, "_forward", lambda net, x, dev: calls.append(dev) or
                        orig(net, x, dev))
    tor = ta.similarity(a.network, b.network, backend="torch", device="cpu", **kw)
    assert calls and all(str(d) == "cpu" for d in calls)
    assert float(tor) == pytest.approx(float(ref), rel=1e-10)
    assert tor.stderr == pytest.approx(ref.stderr, rel=1e-8)
    with pytest.raises(ValueError, match="method='montecarlo' samples in floating point"):
        ta.inner(a.network, a.network, backend="exact", **kw)


@pytest.mark.slow
def test_planted_coverage_over_seeds(planted):
    """Over 40 seeds, the reliable guided estimates of <b,b> fall beyond 3 SE in at most 5 %."""
    _, b, truth = planted
    z = []
    for seed in range(40):
        bb = ta.inner(b.network, b.network, method="montecarlo", proposal="modes",
                      n_samples=1000, seed=seed, n_ctx=2)
        if bb.reliable:
            z.append(_z(bb, truth["bb"]))
    assert len(z) >= 30 and np.mean(np.abs(z) > 3) <= 0.05


def test_adam_step_is_torch_adam_bit_for_bit():
    """The mode search's hand-written Adam (no torch.optim: its first use imports
    torch._dynamo) gives the iterates of torch.optim.Adam exactly, tempered objective and all."""
    import torch

    r = np.random.default_rng(3)
    A = torch.tensor(r.normal(size=(5, 5)))
    x0 = r.normal(size=(4, 5)) * 3

    def loss(x, step):
        y = x @ A.T
        return -(torch.log((y * y).sum(dim=1) + 1e-300)
                 - 0.5 * (0.1 ** max(0.0, 1 - step / 20)) * (x * x).sum(dim=1)).sum()

    xa = torch.tensor(x0, requires_grad=True)
    opt = torch.optim.Adam([xa], lr=guided.ADAM_LR)
    xb = torch.tensor(x0, requires_grad=True)
    m1, m2 = torch.zeros_like(xb), torch.zeros_like(xb)
    for step in range(60):
        opt.zero_grad()
        loss(xa, step).backward()
        opt.step()
        (g,) = torch.autograd.grad(loss(xb, step), xb)
        with torch.no_grad():
            guided.adam_step(xb, g, m1, m2, step + 1, guided.ADAM_LR)
        assert torch.equal(xa.detach(), xb.detach()), step
    assert not torch.equal(xb.detach(), torch.tensor(x0))


@pytest.mark.parametrize("dim", [2, 3, 4, 7, 40])
def test_vmf_draws_are_scipys_bit_for_bit(dim):
    """The written-out von Mises-Fisher sampler (no scipy.stats import inside a guided call)
    draws what scipy.stats.vonmises_fisher draws from the same generator, bit for bit, and
    leaves the generator in the same state: small, moderate and huge concentrations (the last
    takes scipy's expansion of the envelope parameter when D >= 4)."""
    from scipy.stats import vonmises_fisher

    r = np.random.default_rng(dim)
    mu = r.normal(size=dim)
    mu /= np.linalg.norm(mu)
    for kappa, n in ((0.7, 5), (12.0, 200), (3e9, 17)):
        a, b = np.random.default_rng(11), np.random.default_rng(11)
        want = vonmises_fisher(mu, np.float64(kappa)).rvs(n, random_state=a)
        got = guided.vmf_draws(mu, np.float64(kappa), n, b)
        np.testing.assert_array_equal(got, want.reshape(n, dim))
        assert a.random() == b.random()
    # the mean direction's sign is kept (QR may flip it)
    assert guided.vmf_draws(-np.eye(dim)[0], 50.0, 400, r).mean(axis=0)[0] < -0.5


def test_clopper_pearson_bound_is_scipy_stats_beta_ppf():
    """certified_lower_bound's quantile (scipy.special.betaincinv) is scipy.stats.beta.ppf,
    equal on a grid of sample sizes, counts and levels."""
    from scipy.special import betaincinv
    from scipy.stats import beta

    for n in (6, 300, 20_000):
        for k in range(1, n + 1, max(1, n // 37)):
            for a in (1e-3 / 16, 0.05 / 16, 0.3):
                assert betaincinv(k, n - k + 1, a) == beta.ppf(a, k, n - k + 1)


def test_a_guided_call_imports_no_library():
    """After `import tensoralg` and torch, a guided similarity imports nothing (scipy.stats
    took about a second of CPU inside the first call): checked in a fresh process."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, tensoralg as ta, torch, scipy.special, scipy.linalg\n"
        "r = np.random.default_rng(0)\n"
        "g = lambda *s: r.standard_normal(s) * 0.5\n"
        "m = lambda: ta.Sequential([ta.Residual(ta.BilinearAttention("
        "*(g(1, 2, 3) for _ in range(5)), g(3, 1, 2))) for _ in range(2)])\n"
        "a, b = m(), m()\n"
        "before = set(sys.modules)\n"
        "ta.similarity(a, b, method='montecarlo', proposal='modes', n_samples=300, seed=0,"
        " n_ctx=2)\n"
        "print(sorted(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=600, check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", out
