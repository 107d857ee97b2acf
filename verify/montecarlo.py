"""Monte Carlo cross-checks of Gaussian inner products and similarities (approximate).

Everything here is an *approximation* with a stated standard error: samples
``x ~ N(0, I_d)`` are pushed through both networks (forward evaluation of tensoralg's layer
classes, float64) and the per-sample products are averaged.  The estimators are unbiased for
``<a, b>_G = sum_o E[f_a(x)_o f_b(x)_o]`` (docs/mathematics.md §3.1, 3.4); their standard error shrinks like
``1/sqrt(n)`` (central limit theorem), which [`convergence`][verify.montecarlo.convergence]
measures.  The similarity estimate is a ratio of means (consistent, bias O(1/n)) with a delta-method
standard error.

Radial integration (the default, ``radial=True``): write ``x = r u`` with ``u`` uniform on the
sphere and ``r ~ chi_d`` independent. Along one direction ``t -> f(t u)`` is a polynomial of
degree ``deg f``; it is recovered exactly from ``deg f + 1`` evaluations (Chebyshev nodes, a
Vandermonde solve), and ``E_r[f_a(r u) . f_b(r u)]`` follows from the chi moments
``E[r^k] = 2^(k/2) Gamma((d+k)/2) / Gamma(d/2)``. The estimate is the mean of that bounded
function of ``u`` (unbiased). Why: the plain per-sample product of two depth-2 networks is a
degree-8 polynomial of ``x`` with heavy tails, and its sample standard error under-covers at
practical ``n`` (random depth-2 pairs, n = 1000: the truth beyond 3 SE in ~10 % of seeds); the
radial estimate's error covers from a few hundred directions on (tests/test_verify_montecarlo.py
counts it). ``n_samples`` then counts directions; each costs ``deg + 1`` evaluations per network.
(tensoralg's own Monte Carlo uses a Gauss rule in the radius instead — a different computation
of the same integral.)

Variance reduction for the plain per-sample estimator (``radial=False``):

* ``antithetic=True``: pairs ``(x, -x)``; every odd-degree part of ``f_a . f_b`` cancels
  exactly in the pair average (still unbiased).
* ``control_variate=True``: regresses the samples on Hermite features of known mean zero
  (``x_i``, ``x_i x_j`` for ``i < j``, ``x_i^2 - 1``; only ``x_i`` and ``x_i^2 - 1`` when
  ``d > 30``) and subtracts the fit (the coefficients are estimated on the same samples, which
  adds an O(1/n) bias, negligible next to the standard error).

Sources: the central limit theorem for the standard error; the delta method for the ratio;
antithetic variates (Hammersley & Morton 1956) and control variates (e.g. Glasserman, *Monte
Carlo Methods in Financial Engineering*, 2003, ch. 4).

Nothing here calls tensoralg's inner products; exact reference values default to
[`tensoralg.verify.certify.gaussian_inner_exact`][verify.certify.gaussian_inner_exact] (rational
polynomial expansion).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MCEstimate", "Agreement", "ConvergenceReport", "estimate_inner",
           "estimate_similarity", "agreement", "convergence", "plot_convergence"]


@dataclass(frozen=True)
class MCEstimate:
    """A Monte Carlo estimate (approximate): ``value ± stderr`` from ``n_samples`` evaluations."""

    value: float
    stderr: float
    n_samples: int
    method: str = "plain"

    def __float__(self) -> float:
        return float(self.value)

    def z_score(self, exact: float) -> float:
        """``(value - exact) / stderr`` (``inf`` when the standard error is 0 and they differ)."""
        diff = self.value - float(exact)
        if self.stderr == 0:
            return 0.0 if diff == 0 else math.copysign(math.inf, diff)
        return diff / self.stderr

    def interval(self, z: float = 1.96) -> tuple:
        """``(value - z*stderr, value + z*stderr)`` (95% normal interval by default)."""
        return (self.value - z * self.stderr, self.value + z * self.stderr)

    def __str__(self) -> str:
        return f"{self.value:.6g} ± {self.stderr:.2g} (n={self.n_samples}, {self.method})"


@dataclass(frozen=True)
class Agreement:
    """Result of [`agreement`][verify.montecarlo.agreement]: ``passed`` iff ``|z| <= z_max``."""

    estimate: MCEstimate
    exact: float
    z: float
    z_max: float
    passed: bool

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        verdict = "agrees" if self.passed else "DISAGREES"
        return (f"Monte Carlo {self.estimate} {verdict} with exact {self.exact:.6g} "
                f"(z = {self.z:+.2f}, |z| <= {self.z_max})")


@dataclass
class ConvergenceReport:
    """Error of the Monte Carlo estimate against the sample count.

    Attributes:
        sample_sizes: ``n`` values, increasing.
        rms_error: root-mean-square error over ``repeats`` independent estimates, per ``n``.
        mean_stderr: average reported standard error, per ``n``.
        slope: least-squares slope of ``log(rms_error)`` on ``log(n)`` (theory: -1/2).
        exact: the reference value; ``repeats``; ``method``.
    """

    sample_sizes: list[int]
    rms_error: list[float]
    mean_stderr: list[float]
    slope: float
    exact: float
    repeats: int
    method: str = "plain"
    estimates: list[list[float]] = field(default_factory=list, repr=False)

    def table(self) -> str:
        lines = [f"{'n':>9}  {'rms error':>11}  {'mean stderr':>11}  {'err*sqrt(n)':>11}"]
        for n, e, s in zip(self.sample_sizes, self.rms_error, self.mean_stderr):
            lines.append(f"{n:>9}  {e:>11.4g}  {s:>11.4g}  {e * math.sqrt(n):>11.4g}")
        lines.append(f"fitted slope of log error vs log n: {self.slope:+.3f} (1/sqrt(n) rate: -0.5)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------

def _networks(a: Any, b: Any):
    from .certify import _check_pair

    a, b = _check_pair(a, a if b is None else b)
    fa = a.astype_float() if a.is_exact else a
    fb = b.astype_float() if b.is_exact else b
    return fa, fb


def _check_n(n_samples: Any, minimum: int, name: str = "n_samples") -> int:
    if isinstance(n_samples, bool) or not isinstance(n_samples, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(n_samples).__name__}")
    if n_samples < minimum:
        raise ValueError(f"{name}: need at least {minimum} samples, got {n_samples}")
    return int(n_samples)


def _samples(fa, fb, n: int, rng: np.random.Generator, antithetic: bool, batch_size: int,
             with_norms: bool):
    """Per-sample values ``g_ab`` (and ``g_aa, g_bb``) as an array of shape (k, m) and the
    inputs used (for control variates).  Antithetic: ``m = n // 2`` pair averages."""
    d = fa.in_features
    m = n // 2 if antithetic else n
    rows, xs = [], []
    for start in range(0, m, batch_size):
        x = rng.standard_normal((min(batch_size, m - start), d))
        ya, yb = fa(x), fb(x)
        g = [np.einsum("no,no->n", ya, yb)]
        if with_norms:
            g += [np.einsum("no,no->n", ya, ya), np.einsum("no,no->n", yb, yb)]
        if antithetic:
            za, zb = fa(-x), fb(-x)
            h = [np.einsum("no,no->n", za, zb)]
            if with_norms:
                h += [np.einsum("no,no->n", za, za), np.einsum("no,no->n", zb, zb)]
            g = [(u + v) / 2 for u, v in zip(g, h)]
        rows.append(np.stack(g))
        xs.append(x)
    return np.concatenate(rows, axis=1), np.concatenate(xs, axis=0)


def _chi_moments(d: int, kmax: int, scale: float) -> np.ndarray:
    """``E[(r / scale)^k]`` for ``k = 0..kmax``, ``r ~ chi_d`` (log-gamma: no overflow in d)."""
    k = np.arange(kmax + 1)
    logs = np.array([0.5 * kk * math.log(2.0) + math.lgamma((d + kk) / 2) - math.lgamma(d / 2)
                     for kk in k])
    return np.exp(logs - k * math.log(scale))


def _radial_samples(fa, fb, n: int, rng: np.random.Generator, batch_size: int,
                    with_norms: bool) -> np.ndarray:
    """Per-direction exact radial averages ``E_r[g(r u)]`` of ``g = f_a.f_b`` (and ``f_a.f_a``,
    ``f_b.f_b``): array (k, n)."""
    d = fa.in_features
    deg = max(int(fa.degree), int(fb.degree))
    scale = math.sqrt(d)                         # typical radius: keeps the Vandermonde tame
    tau = np.cos(np.pi * (np.arange(deg + 1) + 0.5) / (deg + 1))   # Chebyshev nodes in (-1, 1)
    Vinv = np.linalg.inv(np.vander(tau, deg + 1, increasing=True))  # values -> coefficients
    mu = _chi_moments(d, 2 * deg, scale)
    M = mu[np.add.outer(np.arange(deg + 1), np.arange(deg + 1))]    # M[j, k] = E[(r/s)^(j+k)]
    rows = []
    for start in range(0, n, max(1, batch_size // (deg + 1))):
        m = min(max(1, batch_size // (deg + 1)), n - start)
        u = rng.standard_normal((m, d))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        x = (tau[:, None, None] * scale * u[None]).reshape(-1, d)
        ya = np.einsum("jt,tno->jno", Vinv, np.asarray(fa(x)).reshape(deg + 1, m, -1))
        yb = np.einsum("jt,tno->jno", Vinv, np.asarray(fb(x)).reshape(deg + 1, m, -1))
        pairs = [(ya, yb)] + ([(ya, ya), (yb, yb)] if with_norms else [])
        rows.append(np.stack([np.einsum("jno,jk,kno->n", p, M, q) for p, q in pairs]))
    return np.concatenate(rows, axis=1)


def _hermite_controls(x: np.ndarray, antithetic: bool) -> np.ndarray:
    """Features of known mean zero under N(0, I): x_i, x_i x_j (i<j), x_i^2 - 1.
    Under antithetic pairing the odd features average to 0 exactly and are dropped."""
    _n, d = x.shape
    feats = [] if antithetic else [x]
    feats.append(x ** 2 - 1)
    if d <= 30:
        iu = np.triu_indices(d, k=1)
        if iu[0].size:
            feats.append(x[:, iu[0]] * x[:, iu[1]])
    return np.concatenate(feats, axis=1)


def _control_variate(g: np.ndarray, x: np.ndarray, antithetic: bool):
    C = _hermite_controls(x, antithetic)
    n, k = C.shape
    if n <= k + 2:
        raise ValueError(f"control_variate: needs more samples than the {k} controls "
                         f"(+2); got {n} (pairs when antithetic)")
    gc = g - g.mean()
    Cc = C - C.mean(axis=0)
    beta, *_ = np.linalg.lstsq(Cc, gc, rcond=None)
    resid = g - C @ beta  # E[C] = 0 exactly, so mean(resid) estimates E[g]
    value = float(resid.mean())
    dev = resid - value
    stderr = float(np.sqrt(dev @ dev / (n - k - 1) / n))
    return value, stderr


# ----------------------------------------------------------------------------------------
# estimators
# ----------------------------------------------------------------------------------------

def estimate_inner(a: Any, b: Any = None, n_samples: int = 100_000, seed: int = 0, *,
                   antithetic: bool = False, control_variate: bool = False,
                   radial: bool | None = None, batch_size: int = 65_536) -> MCEstimate:
    """Monte Carlo estimate (approximate) of ``<a, b>_G = sum_o E[f_a(x)_o f_b(x)_o]``.

    Args:
        a, b: networks (tensoralg layers, lists of layers or layer specs) with the same input
            size ``d`` and output size; ``b=None`` estimates ``<a, a>``.
        n_samples: number of directions (radial) or of ``x`` draws (plain; with ``antithetic``
            these are ``n_samples // 2`` pairs ``(x, -x)``).
        seed: seed of ``numpy.random.default_rng``.
        antithetic, control_variate: variance reduction of the plain estimator (see the
            module docstring).
        radial: integrate the radius exactly (default; covering standard error). ``None``:
            radial unless ``antithetic`` or ``control_variate`` asks for the plain estimator.
        batch_size: inputs evaluated at once (memory: ``batch_size * max width`` floats).

    Returns:
        [`MCEstimate`][verify.montecarlo.MCEstimate] with the standard error of the mean (unbiased
        estimator; the control-variate version has an O(1/n) bias).

    Raises:
        ValueError: mismatched networks, too few samples; TypeError: non-int ``n_samples``.
    """
    n = _check_n(n_samples, 4 if antithetic else 2)
    _check_n(batch_size, 1, "batch_size")
    radial = _radial_choice(radial, antithetic or control_variate)
    fa, fb = _networks(a, b)
    rng = np.random.default_rng(seed)
    if radial:
        g = _radial_samples(fa, fb, n, rng, batch_size, with_norms=False)[0]
        return MCEstimate(float(g.mean()), float(g.std(ddof=1) / math.sqrt(n)), n, "radial")
    g, x = _samples(fa, fb, n, rng, antithetic, batch_size, with_norms=False)
    g = g[0]
    method = "+".join([m for m, on in (("antithetic", antithetic),
                                        ("control_variate", control_variate)) if on]) or "plain"
    if control_variate:
        value, stderr = _control_variate(g, x, antithetic)
    else:
        value = float(g.mean())
        stderr = float(g.std(ddof=1) / math.sqrt(g.size))
    return MCEstimate(value, stderr, n, method)


def estimate_similarity(a: Any, b: Any, n_samples: int = 100_000, seed: int = 0, *,
                        antithetic: bool = False, radial: bool | None = None,
                        batch_size: int = 65_536) -> MCEstimate:
    """Monte Carlo estimate (approximate) of ``sim(a,b) = <a,b> / sqrt(<a,a><b,b>)``.

    The three inner products are estimated on the same samples; the ratio is consistent (bias
    O(1/n)); the standard error is the delta-method one from the sample covariance of the
    per-sample triple ``(f_a.f_b, f_a.f_a, f_b.f_b)`` (per direction when ``radial``, the
    default unless ``antithetic``; see [`estimate_inner`][verify.montecarlo.estimate_inner]).

    Raises:
        ValueError: mismatched networks, too few samples, or an estimated norm of zero.
    """
    n = _check_n(n_samples, 4 if antithetic else 2)
    _check_n(batch_size, 1, "batch_size")
    radial = _radial_choice(radial, antithetic)
    fa, fb = _networks(a, b)
    rng = np.random.default_rng(seed)
    if radial:
        g = _radial_samples(fa, fb, n, rng, batch_size, with_norms=True)
    else:
        g, _ = _samples(fa, fb, n, rng, antithetic, batch_size, with_norms=True)
    m_ab, m_aa, m_bb = g.mean(axis=1)
    if m_aa <= 0 or m_bb <= 0:
        raise ValueError("estimate_similarity: a network has zero estimated norm; the "
                         "similarity is undefined")
    sim = m_ab / math.sqrt(m_aa * m_bb)
    grad = np.array([1 / math.sqrt(m_aa * m_bb), -sim / (2 * m_aa), -sim / (2 * m_bb)])
    cov = np.cov(g) / g.shape[1]
    stderr = float(math.sqrt(max(grad @ cov @ grad, 0.0)))
    return MCEstimate(float(sim), stderr, n,
                      "radial" if radial else ("antithetic" if antithetic else "plain"))


def _radial_choice(radial: bool | None, plain_option: bool) -> bool:
    if radial is None:
        return not plain_option
    if radial and plain_option:
        raise ValueError("radial=True cannot be combined with antithetic/control_variate "
                         "(options of the plain estimator); pass radial=False")
    return bool(radial)


def agreement(estimate: MCEstimate, exact: Any, z_max: float = 4.0) -> Agreement:
    """Check an estimate against an exact value: ``passed`` iff ``|z| <= z_max`` where
    ``z = (estimate - exact) / stderr``.  ``z_max = 4`` fails a correct estimate with
    probability about 6e-5 (two-sided normal tail)."""
    if not isinstance(estimate, MCEstimate):
        raise TypeError(f"estimate: expected an MCEstimate, got {type(estimate).__name__}")
    if not z_max > 0:
        raise ValueError(f"z_max: expected a positive number, got {z_max!r}")
    exact = float(exact)
    z = estimate.z_score(exact)
    return Agreement(estimate, exact, z, float(z_max), bool(abs(z) <= z_max))


def convergence(a: Any, b: Any = None, exact: Any = None,
                sample_sizes: Sequence[int] = (100, 316, 1000, 3162, 10_000, 31_623),
                repeats: int = 20, seed: int = 0, *, antithetic: bool = False,
                control_variate: bool = False) -> ConvergenceReport:
    """Measure the Monte Carlo error against the sample count.

    For each ``n`` in ``sample_sizes`` draws ``repeats`` independent estimates (independent
    seeds from ``numpy.random.SeedSequence(seed)``) and records their RMS error against
    ``exact`` and their mean reported standard error, then fits the slope of
    ``log(rms error)`` on ``log(n)`` (the 1/sqrt(n) rate is slope -1/2).

    Args:
        exact: reference ``<a, b>``; default
            [`tensoralg.verify.certify.gaussian_inner_exact`][verify.certify.gaussian_inner_exact]
            (exact rational expansion, independent of tensoralg.inner).

    Raises:
        ValueError: fewer than 2 sample sizes, ``repeats < 2``, bad networks.
    """
    sizes = sorted(_check_n(int(n) if isinstance(n, float) else n, 4 if antithetic else 2,
                            "sample_sizes") for n in sample_sizes)
    if len(sizes) < 2:
        raise ValueError(f"sample_sizes: need at least 2 sizes to fit a rate, got {sizes}")
    repeats = _check_n(repeats, 2, "repeats")
    if exact is None:
        from .certify import gaussian_inner_exact

        exact = gaussian_inner_exact(a, a if b is None else b)
    exact = float(exact)
    seeds = np.random.SeedSequence(seed).spawn(len(sizes) * repeats)
    rms, mse, all_est = [], [], []
    method = "plain"
    for i, n in enumerate(sizes):
        ests = [estimate_inner(a, b, n, np.random.default_rng(seeds[i * repeats + r]),
                               antithetic=antithetic, control_variate=control_variate)
                for r in range(repeats)]
        method = ests[0].method
        vals = np.array([e.value for e in ests])
        rms.append(float(np.sqrt(np.mean((vals - exact) ** 2))))
        mse.append(float(np.mean([e.stderr for e in ests])))
        all_est.append(vals.tolist())
    slope = float(np.polyfit(np.log(sizes), np.log(rms), 1)[0]) if min(rms) > 0 else float("nan")
    return ConvergenceReport(sizes, rms, mse, slope, exact, repeats, method, all_est)


def plot_convergence(report: ConvergenceReport, ax=None, label: str | None = None):
    """Log-log plot of RMS error and mean standard error against ``n`` with a ``c/sqrt(n)``
    reference line through the first point.  Returns the matplotlib ``Axes``."""
    if not isinstance(report, ConvergenceReport):
        raise TypeError(f"report: expected a ConvergenceReport, got {type(report).__name__}")
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(5, 3.5))
    n = np.asarray(report.sample_sizes, dtype=float)
    tag = f"{label}: " if label else ""
    ax.loglog(n, report.rms_error, "o-", label=f"{tag}RMS error ({report.repeats} runs, "
                                               f"slope {report.slope:+.2f})")
    ax.loglog(n, report.mean_stderr, "s--", alpha=0.7, label=f"{tag}mean reported stderr")
    ax.loglog(n, report.rms_error[0] * np.sqrt(n[0] / n), "k:", label=r"$\propto 1/\sqrt{n}$")
    ax.set_xlabel("samples n")
    ax.set_ylabel(r"error of Monte Carlo $\langle a,b\rangle$")
    ax.legend(fontsize=8)
    return ax
