"""Monte Carlo (docs/mathematics.md §3.4): unbiased estimates of Gaussian inner products and similarities
from samples ``x ~ N(0, I)``, with standard errors. The cross-check of the exact strategies, and
the only option where no exact method is affordable."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends import converter
from ..layers import Layer
from ..prepare import check_sequence_pair, check_slices
from ..request import MC_MIN_SAMPLES, MC_REPLICATES, Request, check_mc, make_request

__all__ = ["MonteCarloEstimate", "MonteCarloArray", "Diagnostics", "check_mc", "moments",
           "similarity", "features", "warn_few", "MC_MIN_DIRECTIONS", "ratio_estimate",
           "inner_diagnostics", "ratio_diagnostics", "certified_lower_bound", "verdict", "MC_REPLICATES",
           "MC_MIN_SAMPLES", "montecarlo_inner", "cross_checked", "agreement_z",
           "MC_CROSS_Z", "MC_CROSS_DEGREE", "MC_SPREAD_RATIO", "spread_ratio", "skew_widening", "MC_MAX_BYTES",
           "check_score_memory", "score_entries", "unchecked", "montecarlo_similarity",
           "montecarlo_similarity_pairs", "montecarlo_inner_req", "montecarlo_similarity_req"]


#: Diagnostics of every scalar Monte Carlo result (docs/mathematics.md §3.9): the directions
#: split into `MC_REPLICATES` independent replicates (disjoint,
#: consecutive sets of directions)...
#: ...reliable only when no single direction carries this share of any sum...
MC_MAX_SHARE = 0.05
#: ...and the replicates agree: every pairwise |z| at most this...
MC_AGREE_Z = 3.0
#: ...else only the certified lower bounds on the norms are reported, at this confidence.
MC_LOWER_BOUND_CONFIDENCE = 0.999


#: Agreement of plain (radial) sampling with the guided estimate of the same quantity
#: (`cross_checked`): plain is reliable only when the two differ by at most this many
#: combined standard errors (two: a plain estimate off by more than 3 of its own standard errors
#: is then caught unless the guided one errs the same way; measured in docs/montecarlo.md).
MC_CROSS_Z = 2.0
#: Plain sampling is cross-checked against the guided estimate (`cross_checked`) when a
#: model has at least this degree: the integrand then has degree >= 6, where rare directions
#: can carry the norm (docs/montecarlo.md); below it the radial integrand is a quartic on the
#: sphere, whose standard error was measured to cover.
MC_CROSS_DEGREE = 3
#: ...and only when the guided samples do not put the variance of plain sampling's summand over
#: uniform directions (``guided.uniform_variance``, a bounded-summand estimate that sees the rare
#: directions) above this many times the sample variance of the directions plain sampling drew:
#: more means plain's standard error understates its error (by about the square root) because
#: its own directions missed the tail. Measured: 0.5-6 on models whose plain standard error
#: covers, 500 and more where it did not (docs/montecarlo.md).
MC_SPREAD_RATIO = 10.0
#: Rounding floor of every agreement test: two values within this many units in the last place
#: of the larger (``|x - y| <= MC_ROUNDING_ULPS * eps * max(|x|, |y|)``) agree whatever their
#: standard errors (identical functions give estimates equal to rounding with standard error 0).
MC_ROUNDING_ULPS = 64


@dataclass(frozen=True)
class Diagnostics:
    """Whether a Monte Carlo estimate can be trusted (docs/montecarlo.md).

    Attributes:
        replicates: ``(estimate, stderr)`` of each of `MC_REPLICATES` independent
            replicates (disjoint sets of the directions, in draw order).
        max_share: the largest share one direction has of any of the sums behind the estimate
            (``max_i |p_i| / sum_i |p_i|``; for a similarity the largest over its three sums).
        max_z: the largest pairwise ``|e_i - e_j| / sqrt(se_i^2 + se_j^2)`` of the replicates
            (0 when they agree to rounding, `MC_ROUNDING_ULPS`).
        reliable: ``max_share < MC_MAX_SHARE``, ``max_z <= MC_AGREE_Z`` and, where there is one,
            the cross-check passed.
        reason: why not, when not reliable ("" when reliable).
        lower_bounds: certified lower bounds (confidence `MC_LOWER_BOUND_CONFIDENCE`) on
            the squared norms the samples saw, ``{"<a,a>": ..., "<b,b>": ...}`` (empty for a
            cross inner product): ``E[Z] >= t P(Z >= t)`` with a Clopper-Pearson lower bound on
            ``P(Z >= t)`` (Bonferroni over the thresholds tried), ``Z`` the per-direction
            radial average of ``|f|^2`` (non-negative, mean the squared norm).
        exact: the sampled per-direction quantity did not vary (standard error 0, every
            replicate equal to rounding): with probability 1 it is constant on the sphere (a
            polynomial), so the estimate is the value itself, not an approximation of it.
        cross_check: plain sampling of models of degree >= `MC_CROSS_DEGREE` only:
            ``(value, stderr, z, reliable)`` of the guided estimate of the same quantity
            (``proposal="modes"``, its own samples) and the plain estimate's ``|z|`` against it;
            None where no cross-check ran.
        spread_ratio: with ``cross_check``: the variance of the per-direction summand over
            uniform directions as the guided samples estimate it, over the sample variance of
            plain sampling's own directions (about 1 when plain's standard error is right; at
            most `MC_SPREAD_RATIO` for a reliable verdict; above 1 the reported standard
            error is the sample one times its square root); None where not computed.
        skew_factor: guided sampling only: the factor (>= 1) by which the reported standard
            error was widened for the skewness of the per-direction summand
            (`skew_widening`); the sample standard error is ``stderr / skew_factor``.
    """

    replicates: tuple
    max_share: float
    max_z: float
    reliable: bool
    reason: str
    lower_bounds: dict
    exact: bool = False
    cross_check: tuple | None = None
    spread_ratio: float | None = None
    skew_factor: float = 1.0

    def summary(self) -> str:
        reps = ", ".join(f"{v:.6g} ± {se:.2g}" for v, se in self.replicates)
        lb = "; ".join(f"{k} >= {v:.4g}" for k, v in self.lower_bounds.items())
        head = ("reliable" + (" (exact: the sampled quantity does not vary)" if self.exact
                              else "")) if self.reliable else f"NOT reliable ({self.reason})"
        cc = ""
        if self.cross_check is not None:
            v, se, z, ok = self.cross_check
            cc = (f"; guided cross-check {v:.6g} ± {se:.2g} (|z| = {z:.2f}"
                  f"{'' if ok else ', itself NOT reliable'})")
            if self.spread_ratio is not None:
                cc += (f"; variance over plain directions {self.spread_ratio:.3g}x that of "
                       f"the directions drawn")
        instead = "" if self.reliable else (
            "; what is exact instead: ta.degree_similarity (S<=1 of every model, S<=K of "
            "position-free networks, S<=5 of bias-free attention pairs) and the certified lower "
            "bounds")
        sk = (f"; standard error widened {self.skew_factor:.3g}x for the summand's skewness"
              if self.skew_factor > 1.0 else "")
        return (f"{head}; replicates {reps}; largest single-direction share "
                f"{self.max_share:.3g}; replicates' largest |z| {self.max_z:.2f}" + sk + cc
                + (f"; certified lower bounds {lb}" if lb else "") + instead)


def _rounding(x):
    """The rounding floor `MC_ROUNDING_ULPS` units in the last place of ``|x|`` (a float
    or an array)."""
    return MC_ROUNDING_ULPS * np.finfo(np.float64).eps * np.abs(x)


def agreement_z(x: float, sx: float, y: float, sy: float) -> float:
    """``|x - y| / sqrt(sx^2 + sy^2)``, 0 when ``x`` and ``y`` agree to rounding
    (`MC_ROUNDING_ULPS`), inf when they differ with both standard errors 0."""
    if abs(x - y) <= _rounding(max(abs(x), abs(y))):
        return 0.0
    den = math.sqrt(sx * sx + sy * sy)
    return abs(x - y) / den if den > 0 else math.inf


def skew_widening(v: np.ndarray, z: float = MC_AGREE_Z) -> float:
    """The factor (>= 1) by which the standard error of the mean of the per-direction values
    ``v`` ``(n,)`` is widened so that ``z`` standard errors either side cover Hall's
    skewness-corrected confidence interval for the mean.

    The mean of a skewed summand is not normal at finite ``n``: its studentized error
    ``T = (mean - mu) / se`` has a heavier tail on the side opposite the summand's skew (a sample
    that misses the long tail is low *and* has a small standard error). Hall's transformation
    ``g(T) = T + a T^2 + a^2 T^3 / 3 + b``, ``a = gamma / (3 sqrt(n))``, ``b = gamma / (6 sqrt(n))``
    with ``gamma`` the sample skewness, is normal to ``O(1/n)`` (P. Hall, "On the removal of
    skewness by transformation", J. R. Statist. Soc. B 54 (1992) 221-228; the Edgeworth term
    of Johnson 1978). It is increasing (``g'(t) = (1 + a t)^2``), so ``|g(T)| <= z`` is
    ``T`` in ``[g^-1(-z), g^-1(z)]``, ``g^-1(y) = (cbrt(1 + 3 a (y - b)) - 1) / a``; the factor is
    the larger end over ``z``. Measured: means of 1 000 lognormal(0, 1.5) values lie beyond 3
    sample standard errors in 1.6 % of 20 000 runs and beyond 3 widened ones in 0.46 %
    (lognormal(0, 1): 0.60 % and 0.20 %; normal: 0.22 % both; the normal rate is 0.27 %).
    1 when ``v`` does not vary or has fewer than 3 values."""
    v = np.asarray(v, dtype=np.float64)
    n = v.size
    if n < 3:
        return 1.0
    d = v - v.mean()
    sd = math.sqrt(float(np.mean(d * d)))
    if not sd > 0 or not math.isfinite(sd):
        return 1.0
    gamma = float(np.mean((d / sd) ** 3))
    if gamma == 0.0 or not math.isfinite(gamma):
        return 1.0
    a, b = gamma / (3 * math.sqrt(n)), gamma / (6 * math.sqrt(n))
    ends = [(np.cbrt(1 + 3 * a * (y - b)) - 1) / a for y in (-z, z)]
    return max(1.0, *(abs(float(t)) / z for t in ends))


def spread_ratio(est: MonteCarloEstimate, ref: MonteCarloEstimate) -> float | None:
    """``ref.uniform_variance / (n se^2)``: the variance over uniform directions of the
    summand behind the plain estimate ``est`` (``n`` directions, standard error ``se``), as
    the guided estimate ``ref`` of the same quantity measured it, over the variance ``est``
    saw (`MC_SPREAD_RATIO`), both floored at the rounding level of the value
    (`MC_ROUNDING_ULPS`): 1 when the guided variance is at rounding level. None when
    ``ref`` carries no such estimate."""
    uv = getattr(ref, "uniform_variance", None)
    if uv is None:
        return None
    floor = float(_rounding(float(est))) ** 2
    if uv <= floor:
        return 1.0
    return uv / max(est.n_samples * est.stderr * est.stderr, floor)


def unchecked(est: MonteCarloEstimate, why: str) -> MonteCarloEstimate:
    """``est`` (plain sampling) labelled not reliable because its cross-check
    (`cross_checked`) could not run, ``why``: without it, the verdict promises
    nothing on models of degree >= `MC_CROSS_DEGREE`."""
    d = est.diagnostics
    reason = "; ".join(([d.reason] if not d.reliable else []) + [why])
    new = Diagnostics(d.replicates, d.max_share, d.max_z, False, reason, d.lower_bounds,
                      d.exact)
    return MonteCarloEstimate(float(est), est.stderr, est.n_samples, new)


def cross_checked(est: MonteCarloEstimate, ref: MonteCarloEstimate) -> MonteCarloEstimate:
    """``est`` (plain sampling) with its verdict checked against ``ref`` (the guided estimate of
    the same quantity from its own samples): reliable only when ``est`` was, ``ref`` is, the
    guided samples see at most `MC_SPREAD_RATIO` times the variance plain sampling saw
    (`spread_ratio`), and the two agree within `MC_CROSS_Z` combined standard errors. The
    value is that of ``est``; its standard error the larger of its own and the one the guided
    samples imply for plain sampling, ``sqrt(ref.uniform_variance / n)`` (where a tail that plain
    directions missed makes the sample spread too small, this is the honest one), which the
    agreement test uses too."""
    d = est.diagnostics
    ratio = spread_ratio(est, ref)
    se = est.stderr * math.sqrt(ratio) if ratio is not None and 1.0 < ratio < math.inf \
        else est.stderr
    # the guided sample standard error: a skewness-widened one would loosen the agreement test
    ref_se = ref.stderr / ref.diagnostics.skew_factor
    z = agreement_z(float(est), se, float(ref), ref_se)
    if d.exact and ref.diagnostics.exact and z == 0.0:
        return est   # exact on plain directions and around the modes alike
    why = [d.reason] if not d.reliable else []
    if d.exact and not ref.diagnostics.exact:
        why.append("constant over plain directions but not around the modes of the integrand "
                   "(a rare region that plain directions do not see)")
    if not ref.reliable:
        why.append(f"its guided cross-check is not reliable ({ref.diagnostics.reason})")
    if not z <= MC_CROSS_Z:
        why.append(f"the guided estimate {float(ref):.6g} ± {ref.stderr:.2g} (proposal='modes', "
                   f"sampling around the modes of the integrand) disagrees (|z| = {z:.1f} > "
                   f"{MC_CROSS_Z:g}): plain directions missed where the norm sits")
    if ratio is not None and not ratio <= MC_SPREAD_RATIO:
        why.append(f"the guided samples put the variance over plain directions at {ratio:.3g}x "
                   f"the spread of the directions drawn (> {MC_SPREAD_RATIO:g}): rare directions "
                   f"that plain sampling missed dominate it, so its standard error understates "
                   f"the error")
    new = Diagnostics(d.replicates, d.max_share, d.max_z, not why, "; ".join(why),
                      d.lower_bounds, False,
                      (float(ref), ref.stderr, z, bool(ref.reliable)), ratio)
    return MonteCarloEstimate(float(est), se, est.n_samples, new)


#: A format spec (Python's format mini-language), its fill, alignment and width named.
_SPEC = re.compile(r"(?:(?P<fill>.)?(?P<align>[<>=^]))?[-+ ]?z?#?0?(?P<width>\d*)[,_]?"
                   r"(?:\.\d+)?[a-zA-Z%]?", re.DOTALL)


class MonteCarloEstimate(float):
    """A Monte Carlo estimate (APPROXIMATE): a float with its standard error ``stderr``,
    ``n_samples`` (directions) and, for scalar results, `Diagnostics` (``reliable``,
    ``diagnostics``). A value whose ``reliable`` is False is not an answer: it formats
    (``f"{x:.4f}"``, ``f"{x}"``, ``print(x)``) as ``no reliable estimate (<reason>)`` (its
    ``repr`` keeps the number, marked ``NOT reliable``, for debugging), while ``float(x)`` and
    arithmetic still give the number (arithmetic returns plain floats). printf-style
    ``"%.4f" % x`` converts to a float first and cannot be intercepted: use ``format``."""

    stderr: float
    n_samples: int
    diagnostics: Diagnostics | None

    def __new__(cls, value: float, stderr: float, n_samples: int,
                diagnostics: Diagnostics | None = None):
        obj = super().__new__(cls, value)
        # exact by construction (Diagnostics.exact): the spread is rounding, not sampling
        obj.stderr = 0.0 if diagnostics is not None and diagnostics.exact else float(stderr)
        obj.n_samples = int(n_samples)
        obj.diagnostics = diagnostics
        return obj

    @property
    def reliable(self) -> bool | None:
        """The diagnostics' verdict (None where none were computed)."""
        return None if self.diagnostics is None else self.diagnostics.reliable

    def _refusal(self) -> str:
        return f"no reliable estimate ({self.diagnostics.reason})"

    def __format__(self, spec: str) -> str:
        """A reliable (or undiagnosed) estimate formats as a float; an unreliable one, for any
        format spec, as ``no reliable estimate (<reason>)`` (a value failing its diagnostics is
        never printed as an answer), keeping the spec's fill, alignment and width."""
        if self.reliable is not False:
            return float.__format__(self, spec) if spec else str(self)
        m = _SPEC.fullmatch(spec)
        if m is None:
            return self._refusal()
        align = {"=": ">", None: ""}.get(m["align"], m["align"])
        return format(self._refusal(), f"{(m['fill'] or '') if align else ''}{align}"
                                       f"{m['width']}")

    def __str__(self) -> str:
        """``print(x)``: the refusal when unreliable, else `__repr__` (value ± stderr)."""
        return self._refusal() if self.reliable is False else repr(self)

    def __repr__(self) -> str:
        tail = "" if self.diagnostics is None else \
            (", reliable" + (" (exact: the sampled quantity does not vary between directions)"
                             if self.diagnostics.exact else "") if self.reliable
             else f", NOT reliable: {self.diagnostics.reason}")
        return (f"MonteCarloEstimate({float(self)!r} ± {self.stderr:.3g}, "
                f"n={self.n_samples}{tail})")


def _share(p: np.ndarray) -> float:
    """The largest single-sample share ``max |p_i| / sum |p_i|`` of a sum; 0 when every sample
    is exactly zero: the integrands are polynomials in the input, and a non-zero polynomial
    vanishes only on a set of measure zero, so a sum that is zero on every sample (of any
    proposal with a density) is zero with probability 1 (e.g. ``||b - b||``)."""
    a = np.abs(p)
    total = a.sum()
    return float(a.max() / total) if total > 0 else 0.0


def certified_lower_bound(z: np.ndarray, confidence: float = MC_LOWER_BOUND_CONFIDENCE,
                          n_thresholds: int = 16) -> float:
    """A lower bound on ``E[Z]`` for iid samples ``z >= 0`` that holds with probability at least
    ``confidence``: ``max_t t * p_lo(t)`` over ``n_thresholds`` sample quantiles ``t``, with
    ``p_lo`` the one-sided Clopper-Pearson lower bound on ``P(Z >= t)`` at level
    ``(1 - confidence) / n_thresholds`` (Markov's inequality ``E[Z] >= t P(Z >= t)``; Bonferroni
    over the thresholds). Unlike the sample mean it cannot be fooled upward by rare large
    values, only made loose. (The Clopper-Pearson bound is the ``alpha`` quantile of
    ``Beta(k, n - k + 1)``, ``scipy.special.betaincinv``: the function ``scipy.stats.beta.ppf``
    evaluates, equal to it in the tests, without importing ``scipy.stats`` in a call.)"""
    from scipy.special import betaincinv

    z = np.sort(np.asarray(z, dtype=np.float64))
    n = z.size
    if n == 0 or z[-1] <= 0:
        return 0.0
    alpha = (1 - confidence) / n_thresholds
    best = 0.0
    for q in np.linspace(0.0, 1.0, n_thresholds, endpoint=False):
        i = min(n - 1, int(q * n))
        t = z[i]
        if t <= 0:
            continue
        k = n - int(np.searchsorted(z, t, side="left"))    # samples >= t
        best = max(best, float(t * betaincinv(k, n - k + 1, alpha)))
    return best


def _agreement(reps: list) -> float:
    z = 0.0
    for i in range(len(reps)):
        for j in range(i + 1, len(reps)):
            (x, sx), (y, sy) = reps[i], reps[j]
            z = max(z, agreement_z(x, sx, y, sy))
    return z


def verdict(reps, share, norms: dict, exact: bool = False) -> Diagnostics:
    """The verdict of `Diagnostics`; ``exact``: the sampled quantity did not vary
    between directions (`_constant`, `_proportional`), so the estimate is the value
    whatever the directions drawn: reliable, and labelled exact, whatever its shares."""
    max_z = _agreement(reps)
    why = []
    if not exact and not share < MC_MAX_SHARE:
        why.append(f"one direction carries {share:.0%} of a sum (>= {MC_MAX_SHARE:.0%})")
    if not exact and not max_z <= MC_AGREE_Z:
        why.append(f"the {len(reps)} independent replicates disagree (|z| = {max_z:.1f} > "
                   f"{MC_AGREE_Z:g})")
    lbs = {k: certified_lower_bound(v) for k, v in norms.items()}
    return Diagnostics(tuple(reps), share, max_z, not why, "; ".join(why), lbs, bool(exact))


def _constant(p: np.ndarray) -> bool:
    """Every per-direction value equal to rounding (``p`` ``(n,)``): a polynomial on the sphere
    that takes one value at every sampled direction is constant with probability 1, so its
    sample mean is its mean exactly."""
    p = np.asarray(p, dtype=np.float64)
    return bool(np.all(np.abs(p - p.mean()) <= _rounding(np.abs(p).max())))


def _proportional(P: np.ndarray) -> bool:
    """The per-direction triples ``P`` ``(3, n)`` are multiples of one triple, each to rounding
    relative to itself (``P = t w^T``, e.g. ``f_b = c f_a``): the ratio ``<a,b> / sqrt(<a,a>
    <b,b>)`` of their means is then ``t_ab / sqrt(t_aa t_bb)`` whatever the directions drawn
    (as `_constant`). Relative to each direction, not to the largest: a direction that
    dominates every sum would otherwise make the others look proportional."""
    P = np.asarray(P, dtype=np.float64)
    if not np.all(np.isfinite(P)):
        return False
    norms = np.linalg.norm(P, axis=0)
    if not np.any(norms > 0):
        return False
    t = P[:, int(np.argmax(norms))] / norms.max()
    resid = np.linalg.norm(P - np.outer(t, t @ P), axis=0)
    return bool(np.all(resid <= _rounding(norms)))


def inner_diagnostics(p: np.ndarray, norm_name: str | None = None) -> Diagnostics:
    """Diagnostics of a mean ``p.mean()`` of per-direction values ``p`` ``(n,)``;
    ``norm_name`` (e.g. ``"<a,a>"``) when ``p`` estimates a squared norm (then its certified
    lower bound is given)."""
    reps = []
    for part in np.array_split(p, MC_REPLICATES):
        reps.append((float(part.mean()), float(part.std(ddof=1) / math.sqrt(part.size))))
    return verdict(reps, _share(p), {norm_name: p} if norm_name else {}, _constant(p))


def ratio_diagnostics(P: np.ndarray) -> Diagnostics:
    """Diagnostics of the similarity ratio of per-direction triples ``P`` ``(3, n)`` =
    ``(p_ab, p_aa, p_bb)``."""
    reps = []
    for part in np.array_split(P, MC_REPLICATES, axis=1):
        est = ratio_estimate(part.sum(axis=1), part @ part.T, part.shape[1])
        reps.append((float(est), est.stderr))
    share = max(_share(x) for x in P)
    return verdict(reps, share, {"<a,a>": P[1], "<b,b>": P[2]}, _proportional(P))


class MonteCarloArray(np.ndarray):
    """A NumPy array of Monte Carlo estimates (APPROXIMATE) with an array ``stderr`` of the
    same shape and, for the per-output slices of ``inner`` / ``similarity`` / ``inner_diff`` /
    ``diff_norm`` (``output="each"``), one `Diagnostics` per entry (``diagnostics``, a
    tuple in flattened order; ``reliable``: a bool array of the same shape, None where no
    diagnostics were computed, e.g. Gram matrices). An entry whose ``reliable`` is False is not
    an answer (the same tests as
    [`MonteCarloEstimate`][tensoralg.strategies.montecarlo.MonteCarloEstimate])."""

    def __new__(cls, values, stderr, n_samples: int, diagnostics=None):
        obj = np.asarray(values, dtype=np.float64).view(cls)
        obj.stderr = np.asarray(stderr, dtype=np.float64)
        obj.n_samples = int(n_samples)
        obj.diagnostics = None if diagnostics is None else tuple(diagnostics)
        if obj.diagnostics is not None and len(obj.diagnostics) != obj.size:
            raise ValueError(f"diagnostics: {len(obj.diagnostics)} for {obj.size} entries")
        return obj

    def __array_finalize__(self, obj):
        if obj is not None:
            self.stderr = getattr(obj, "stderr", None)
            self.n_samples = getattr(obj, "n_samples", 0)
            # a slice, a reshape or arithmetic is another array: the verdicts were of the
            # entries as estimated, so they stay with the original only
            self.diagnostics = None

    def __repr__(self) -> str:
        ok = self.reliable
        verdict = "" if ok is None else (
            f"; every one of its {ok.size} entries reliable" if ok.all() else
            f"; {int((~ok).sum())} of its {ok.size} entries NOT reliable (no answers: see "
            f".reliable and .diagnostics)")
        se = self.stderr
        se = "" if se is None or np.shape(se) != self.shape else \
            "\nstandard errors:\n" + repr(np.asarray(se))
        return (f"MonteCarloArray(APPROXIMATE: estimates from {self.n_samples} directions"
                f"{verdict}):\n{self.view(np.ndarray)!r}{se}")

    __str__ = __repr__   # print shows the standard errors and the verdicts too

    @property
    def reliable(self) -> np.ndarray | None:
        """Per entry, the diagnostics' verdict (None where none were computed)."""
        if self.diagnostics is None:
            return None
        return np.array([d.reliable for d in self.diagnostics], dtype=bool).reshape(self.shape)


# Monte Carlo over directions, radius integrated exactly (spherical-radial decomposition):
# x = r u with u uniform on the sphere and r ~ chi_d independent, so for a polynomial integrand
# g of degree <= D,  E[g(x)] = E_u[h(u)],  h(u) = E_r[(g(r u) + g(-r u)) / 2],  and h(u) is a
# polynomial of degree <= D/2 in s = r^2 / 2 ~ Gamma(d/2): an m-point Gauss rule for the
# weight s^(d/2-1) e^(-s) (generalized Laguerre) integrates it exactly once 2m - 1 >= D/2.
# Why: plain sampling of a degree-8 integrand (depth 2) is heavy-tailed and its sample
# standard error under-covers badly (n = 10 000: the truth beyond 3 SE in 2.9 % of runs,
# beyond 2 SE in 11 %); h is bounded on the sphere, its standard error covers from a few
# hundred directions on (measured: tests/test_mc_coverage.py), and at equal network
# evaluations its RMS error was 2-3x smaller on random depth-2 pairs.
MC_MIN_DIRECTIONS = 300


def _radial_nodes(degree: int) -> int:
    """Radii of `_radial_rule` for polynomials of degree ``<= degree`` on the ray (each
    evaluated at ``±r``: ``2 m`` points)."""
    return (degree // 2) // 2 + 1


def _radial_rule(d: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Radii and probability weights that integrate ``r^k`` (even k <= degree) exactly, r ~ chi_d.

    Golub-Welsch on the Jacobi matrix of the generalized Laguerre weight (alpha = d/2 - 1):
    nodes are its eigenvalues, weights the squared first eigenvector components — already
    normalized, so no Gamma(d/2) appears (scipy's roots_genlaguerre overflows for d > 340)."""
    from scipy.linalg import eigh_tridiagonal

    m = _radial_nodes(degree)
    alpha = d / 2 - 1
    k = np.arange(m, dtype=np.float64)
    diag = 2 * k + alpha + 1
    off = np.sqrt(k[1:] * (k[1:] + alpha))
    s, V = eigh_tridiagonal(diag, off)
    return np.sqrt(2 * s), V[0] ** 2


def _radial_points(d: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """The points ``±r_q`` ``(Q,)`` along a direction and their weights ``(Q,)`` (sum 1) of
    `_radial_rule`: the exact average over the radius of a polynomial of degree
    ``<= degree`` on the ray."""
    r, w = _radial_rule(d, degree)
    return np.concatenate([r, -r]), np.concatenate([w, w]) / 2


def _finite_outputs(F: np.ndarray) -> np.ndarray:
    """``F`` (``(N, s, Q, K)``), or ValueError when a forward pass overflowed (the weights were
    checked finite before: non-finite outputs mean activations beyond float64), or outputs so
    large (beyond 1e154) that their products would."""
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.isfinite(np.square(F)).reshape(F.shape[0], -1).all(axis=1)
    if not ok.all():
        raise ValueError(f"Monte Carlo: a forward pass overflowed float64 (non-finite outputs of "
                         f"network {np.flatnonzero(~ok).tolist()} of the request, in its "
                         f"argument order, or outputs beyond 1e154 whose products would); "
                         f"rescale the weights")
    return F


def _mc_features(nets: list[Layer], U: np.ndarray, n_samples: int, seed: int, backend: str,
                 device, dtype, chunk: int = 8192, n_ctx: int | None = None,
                 position: int | None = None):
    """Yield ``(F, w)`` per chunk of directions: projected outputs ``F (N, s, Q, K)`` (float64
    NumPy) at the ``Q`` quadrature points ``±r_q u`` of each direction ``u`` and the weights
    ``w (Q,)`` (sum 1) such that ``sum_q w_q g(x_q)`` is the exact radial average of any
    polynomial ``g`` of degree <= 2 * max degree of ``nets`` along the ray of ``u``.

    Sequence models (``n_ctx`` given; docs/mathematics.md §3.9): the directions lie on the
    sphere of ``R^(n_ctx d)`` (the draws of `_mc_points`, numpy whatever the backend, as
    `montecarlo_inner`), and the last axis of ``F`` runs over (position, output):
    ``K = n_ctx * U.shape[0]``, or ``U.shape[0]`` at one ``position``, so a product summed over
    it is the inner product summed over positions (no per-output axis is kept)."""
    d = nets[0].in_features
    pts, wq = _radial_points(d * (n_ctx or 1), 2 * max(n.degree for n in nets))
    Q = pts.size
    check_sampling_cost(nets, n_samples, Q, n_ctx)
    if n_ctx is not None:   # directions per chunk: about MC_CHUNK_ELEMENTS input entries
        width = max(d, max(n.out_features for n in nets))
        points = _mc_points(seed, n_samples, n_ctx, d, max(n.degree for n in nets),
                            score_chunk(nets, n_ctx, Q,
                                        max(1, MC_CHUNK_ELEMENTS // (Q * n_ctx * width))))
        for X, w in points:
            m = X.shape[0] // Q
            outs = [np.asarray(net(X), dtype=np.float64) for net in nets]   # (m Q, n_ctx, o)
            if position is not None:
                outs = [o[:, int(position)] for o in outs]
            yield _finite_outputs(np.stack([(o @ U.T).reshape(m, Q, -1) for o in outs])), w
        return
    chunk = max(1, chunk // Q)
    if backend == "torch":
        import torch

        conv = converter("torch", device, dtype)
        gen = torch.Generator(device=conv(np.zeros(1)).device).manual_seed(int(seed))
        Ut = conv(U)
        pt = conv(pts)
        done = 0
        while done < n_samples:
            s = min(chunk, n_samples - done)
            u = torch.randn(s, d, generator=gen, device=Ut.device, dtype=Ut.dtype)
            u = u / torch.linalg.vector_norm(u, dim=1, keepdim=True)
            x = (u[:, None, :] * pt[None, :, None]).reshape(s * Q, d)
            F = torch.stack([(net(x) @ Ut.T).reshape(s, Q, -1) for net in nets])
            yield _finite_outputs(F.detach().to("cpu").double().numpy()), wq
            done += s
        return
    rng = np.random.default_rng(seed)
    done = 0
    while done < n_samples:
        s = min(chunk, n_samples - done)
        u = rng.standard_normal((s, d))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        x = (u[:, None, :] * pts[None, :, None]).reshape(s * Q, d)
        F = np.stack([(np.asarray(net(x), dtype=np.float64) @ U.T).reshape(s, Q, -1)
                      for net in nets])
        yield _finite_outputs(F), wq
        done += s


#: Entries of one chunk's inputs (or outputs) in the sequence samplers (`_mc_features`;
#: the DFT inputs of `tensoralg.degree`, complex there: 16 MiB each).
MC_CHUNK_ELEMENTS = 1 << 20

#: FLOPs of forward passes above which a Monte Carlo request is refused before any sampling
#: (hours on one core: an n_samples with a few zeros too many, not a long run someone meant)
MC_MAX_FLOPS = 1e14
#: ... and above which it runs with a RuntimeWarning giving the estimate (minutes on one core)
MC_WARN_FLOPS = 1e12


#: Bytes that one chunk of Monte Carlo forward passes may hold in attention scores (sequence
#: models: ``n_heads n_ctx^2`` entries per attention layer and evaluation point): chunks are
#: cut to fit, and a request whose single evaluation point (or mode search) needs more is
#: refused before any work (a MemoryError an hour in is not an answer).
MC_MAX_BYTES = 4 << 30
#: Float64 arrays of the scores' size alive at once in one attention forward pass (the two
#: score matrices, their product, the mask; the mode search's autograd keeps more: x2).
_SCORE_ARRAYS = 4


#: Float64 values kept per direction for the diagnostics (a similarity's three products and a
#: guided weight), bounded by `MC_MAX_BYTES` in `check_sampling_cost`.
_KEPT_PER_DIRECTION = 4


def _attention_layers(net: Any):
    """The ``BilinearAttention`` layers inside ``net`` (through ``Sequential``, ``Residual``
    and the guided estimator's ``Difference``)."""
    from ..layers import BilinearAttention

    if isinstance(net, BilinearAttention):
        yield net
    for sub in (list(getattr(net, "layers", None) or [])
                + [getattr(net, k, None) for k in ("inner", "nb", "nc")]):
        if sub is not None:
            yield from _attention_layers(sub)


def score_entries(net: Any, n_ctx: int | None) -> int:
    """Entries of the attention scores of one forward evaluation of ``net`` at ``n_ctx``
    positions: ``sum over attention layers of n_heads n_ctx^2`` (0 for vector models)."""
    if not n_ctx:
        return 0
    return sum(int(a.n_heads) * int(n_ctx) ** 2 for a in _attention_layers(net))


def forward_flops(net: Any, n_ctx: int | None = None) -> float:
    """About the FLOPs of one forward evaluation of ``net``: two per stored weight entry, per
    position for a sequence model, plus for each attention layer its scores and their mixing,
    ``n_heads n_ctx^2 (4 d_head + 2 d_v + 1)``. An order of magnitude for refusing absurd sample
    counts, not a benchmark."""
    size = sum(int(np.size(a)) for a in net.arrays()) if hasattr(net, "arrays") else 0
    flops = 2.0 * max(size, 1) * (n_ctx or 1)
    if n_ctx:
        flops += sum(float(a.n_heads) * n_ctx ** 2 * (4 * a.d_head + 2 * a.d_v + 1)
                     for a in _attention_layers(net))
    return flops


def check_score_memory(nets, rows: int, n_ctx: int | None, what: str,
                       arrays: int = _SCORE_ARRAYS) -> None:
    """Refuse (CostTooHigh, before any work) ``rows`` evaluations at once whose attention
    scores (`score_entries`, ``arrays`` float64 arrays of that size) would exceed
    `MC_MAX_BYTES`; ``what`` says which step (named in the message)."""
    need = 8.0 * arrays * rows * max((score_entries(n, n_ctx) for n in nets), default=0)
    if need > MC_MAX_BYTES:
        from ..errors import CostTooHigh

        raise CostTooHigh(f"n_ctx={n_ctx}: {what} needs about {need / 2**30:.1f} GiB of "
                          f"attention scores ({rows} evaluation(s) at once, n_heads x n_ctx^2 "
                          f"entries per attention layer), over the Monte Carlo memory budget of "
                          f"{MC_MAX_BYTES / 2**30:.0f} GiB; use a shorter n_ctx")


def score_chunk(nets, n_ctx: int | None, points: int, default: int) -> int:
    """Directions per chunk (at most ``default``) such that their ``points`` evaluations each
    hold at most `MC_MAX_BYTES` of attention scores together (at least one)."""
    per = 8.0 * _SCORE_ARRAYS * points * max((score_entries(n, n_ctx) for n in nets), default=0)
    if per <= 0:
        return max(1, int(default))
    return max(1, min(int(default), int(MC_MAX_BYTES // per)))


def check_sampling_cost(nets, n_samples: int, points: int, n_ctx: int | None = None) -> None:
    """Refuse (CostTooHigh, before any sampling) ``n_samples`` directions at ``points``
    evaluations each whose forward passes would cost more than `MC_MAX_FLOPS`, or whose one
    direction's attention scores would not fit in `MC_MAX_BYTES` (`check_score_memory`), both
    before any warning; warn (RuntimeWarning, with the estimate) above `MC_WARN_FLOPS`."""
    check_score_memory(nets, points, n_ctx, "one direction's forward passes")
    per = sum(forward_flops(n, n_ctx) for n in nets)
    total = float(n_samples) * points * per
    if total > MC_MAX_FLOPS:
        from ..errors import CostTooHigh

        raise CostTooHigh(f"n_samples={n_samples}: about {total:.1e} FLOPs of forward passes "
                          f"({n_samples} directions x {points} evaluation points x about "
                          f"{per:.1e} FLOPs), over the Monte Carlo budget of {MC_MAX_FLOPS:.0e} "
                          f"(hours on one core); use fewer samples (the standard error "
                          f"shrinks like 1/sqrt(n_samples))")
    kept = 8.0 * _KEPT_PER_DIRECTION * float(n_samples)
    if kept > MC_MAX_BYTES:
        from ..errors import CostTooHigh

        raise CostTooHigh(f"n_samples={n_samples}: the per-direction values the diagnostics keep "
                          f"need about {kept / 2**30:.1f} GiB, over the Monte Carlo memory "
                          f"budget of {MC_MAX_BYTES / 2**30:.0f} GiB; use fewer samples (the "
                          f"standard error shrinks like 1/sqrt(n_samples))")
    if total > MC_WARN_FLOPS:
        from ..errors import warn_caller

        warn_caller(f"Monte Carlo: about {total:.1e} FLOPs of forward passes ({n_samples} "
                    f"directions x {points} evaluation points x about {per:.1e} FLOPs): "
                    f"minutes or more on one core; fewer n_samples is faster (the standard error "
                    f"grows like 1/sqrt(n_samples))", RuntimeWarning)


def warn_few(n_samples: int) -> None:
    if n_samples < MC_MIN_DIRECTIONS:
        from ..errors import warn_caller

        warn_caller(f"n_samples={n_samples} < {MC_MIN_DIRECTIONS}: the Monte Carlo standard "
                    f"error may under-cover (measured on depth-2 pairs: at 100 directions the "
                    f"truth lay beyond 3 SE in 1.3 % of runs instead of 0.27 %)", RuntimeWarning)


def moments(nets_a, nets_b, U, keep, n_samples, seed, backend, device, dtype,
            samples: bool = False, n_ctx: int | None = None, position: int | None = None):
    """Sample means and standard errors of <a_i, b_j> products (Na, Nb[, K]); with
    ``samples`` also the per-direction values ``(n, Na, Nb[, K])`` (for the diagnostics of a
    scalar result); ``n_ctx``, ``position``: sequence models (`_mc_features`)."""
    check_mc(n_samples, seed, backend)
    U = np.asarray(U, dtype=np.float64)
    nets = list(nets_a) + list(nets_b)
    Na = len(nets_a)
    warn_few(n_samples)
    s1 = s2 = 0.0
    kept = []
    for F, w in _mc_features(nets, U, n_samples, seed, backend, device, dtype,
                             n_ctx=n_ctx, position=position):
        Fa, Fb = F[:Na], F[Na:]
        if keep:
            P = np.einsum("asqK,bsqK,q->sabK", Fa, Fb, w)
        else:
            P = np.einsum("asqK,bsqK,q->sab", Fa, Fb, w)
        s1 = s1 + P.sum(axis=0)
        s2 = s2 + (P * P).sum(axis=0)
        if samples:
            kept.append(P)
    mean = s1 / n_samples
    var = np.maximum(s2 / n_samples - mean * mean, 0.0) * n_samples / (n_samples - 1)
    if samples:
        return mean, np.sqrt(var / n_samples), np.concatenate(kept)
    return mean, np.sqrt(var / n_samples)


def similarity(na: Layer, nb: Layer, U, keep, n_samples, seed, backend, device, dtype,
               n_ctx: int | None = None, position: int | None = None):
    """Ratio estimator ab / sqrt(aa bb) with a delta-method standard error; ``n_ctx``,
    ``position``: sequence models (`_mc_features`)."""
    check_mc(n_samples, seed, backend)
    U = np.asarray(U, dtype=np.float64)
    warn_few(n_samples)
    sums = None
    kept = []
    for F, w in _mc_features([na, nb], U, n_samples, seed, backend, device, dtype,
                             n_ctx=n_ctx, position=position):
        fa, fb = F[0], F[1]
        out = "sK" if keep else "s"
        pab, paa, pbb = (np.einsum(f"sqK,sqK,q->{out}", x, y, w)
                         for x, y in ((fa, fb), (fa, fa), (fb, fb)))
        Z = np.stack([pab, paa, pbb])  # (3, s[, K])
        part = (Z.sum(axis=1), np.einsum("is...,js...->ij...", Z, Z))
        sums = part if sums is None else (sums[0] + part[0], sums[1] + part[1])
        kept.append(Z)
    est = ratio_estimate(sums[0], sums[1], n_samples, keep)
    Z = np.concatenate(kept, axis=1)
    if keep:   # one verdict per output slice
        return MonteCarloArray(est, est.stderr, n_samples,
                               [ratio_diagnostics(Z[..., k]) for k in range(Z.shape[-1])])
    return MonteCarloEstimate(float(est), est.stderr, n_samples, ratio_diagnostics(Z))


def _ratio_se(n, sx, sy, sz, sxx, syy, szz, sxy, sxz, syz):
    """``(r, se)`` of ``r = x / sqrt(y z)`` from the sums over ``n`` samples of ``x, y, z`` and
    of their products (arrays of one shape): the delta method of `ratio_estimate`."""
    mx, my, mz = sx / n, sy / n, sz / n
    f = n / (n - 1)
    cxx, cyy, czz = (sxx / n - mx * mx) * f, (syy / n - my * my) * f, (szz / n - mz * mz) * f
    cxy, cxz, cyz = (sxy / n - mx * my) * f, (sxz / n - mx * mz) * f, (syz / n - my * mz) * f
    r = mx / np.sqrt(my * mz)
    gx, gy, gz = 1 / np.sqrt(my * mz), -r / (2 * my), -r / (2 * mz)
    var = (gx * gx * cxx + gy * gy * cyy + gz * gz * czz
           + 2 * (gx * gy * cxy + gx * gz * cxz + gy * gz * cyz)) / n
    return r, np.sqrt(np.maximum(var, 0.0))


def similarity_matrix(nets, U, keep, n_samples, seed, backend, device, dtype,
                      n_ctx: int | None = None, position: int | None = None
                      ) -> MonteCarloArray:
    """``S[i, j] = <i, j> / sqrt(<i, i> <j, j>)`` of ``N`` networks from one set of sampled
    directions (radial estimator), with, per entry, the delta-method standard error of the
    ratio (`ratio_estimate`: the covariance of ``(p_ij, p_ii, p_jj)`` over the
    directions) and the `Diagnostics` of the three sums behind it (largest
    single-direction share; `MC_REPLICATES` consecutive replicates; no certified lower
    bounds: those need every sample). Streams the directions: memory ``O(N^2 K)``.
    ``n_ctx``, ``position``: sequence models (`_mc_features`); an entry then equals
    `montecarlo_similarity` of its pair with the same ``n_samples`` and ``seed``.

    Raises:
        ValueError: a model with sampled norm zero (named by index)."""
    check_mc(n_samples, seed, backend)
    U = np.asarray(U, dtype=np.float64)
    warn_few(n_samples)
    N = len(nets)
    q, r = divmod(int(n_samples), MC_REPLICATES)   # np.array_split's sizes, nothing allocated
    bounds = np.cumsum([q + (i < r) for i in range(MC_REPLICATES)])
    names = ("x", "xx", "xd", "dx", "dd")   # p_ij, p_ij^2, p_ij p_ii, p_ij p_jj, p_ii p_jj
    sums = [dict.fromkeys(names, 0.0) for _ in range(MC_REPLICATES)]
    absum, absmax = 0.0, 0.0
    done = 0
    for F, w in _mc_features(nets, U, n_samples, seed, backend, device, dtype,
                             n_ctx=n_ctx, position=position):
        P = np.einsum(f"asqK,bsqK,q->sab{'K' if keep else ''}", F, F, w)
        dgl = np.einsum("sii...->si...", P)   # (s, N[, K])
        mag = np.abs(P)
        absum = absum + mag.sum(axis=0)
        absmax = np.maximum(absmax, mag.max(axis=0))
        lo = 0
        while lo < len(P):   # split the chunk at the replicates' boundaries
            g = int(np.searchsorted(bounds, done + lo, side="right"))
            hi = min(len(P), int(bounds[g]) - done)
            p, d = P[lo:hi], dgl[lo:hi]
            acc = sums[g]
            acc["x"] = acc["x"] + p.sum(axis=0)
            acc["xx"] = acc["xx"] + (p * p).sum(axis=0)
            acc["xd"] = acc["xd"] + (p * d[:, :, None]).sum(axis=0)
            acc["dx"] = acc["dx"] + (p * d[:, None, :]).sum(axis=0)
            acc["dd"] = acc["dd"] + (d[:, :, None] * d[:, None, :]).sum(axis=0)
            lo = hi
        done += len(P)

    def estimate(n, acc):
        x, xx = acc["x"], acc["xx"]
        y = np.einsum("ii...->i...", x)
        yy = np.einsum("ii...->i...", xx)
        if np.any(y <= 0):
            zero = np.flatnonzero(np.atleast_1d(y <= 0).reshape(N, -1).any(1)).tolist()
            raise ValueError(f"similarity_matrix: models {zero} have sampled norm zero; "
                             f"similarity is undefined")
        Y, Z = y[:, None], y[None, :]
        return _ratio_se(n, x, Y, Z, xx, yy[:, None], yy[None, :], acc["xd"], acc["dx"],
                         acc["dd"])

    total = {k: sum(acc[k] for acc in sums) for k in names}
    r, se = estimate(n_samples, total)
    sizes = np.diff(np.concatenate([[0], bounds]))
    reps = [estimate(int(m), acc) for m, acc in zip(sizes, sums)]
    share = np.where(absum > 0, absmax / np.where(absum > 0, absum, 1.0), 0.0)
    dshare = np.einsum("ii...->i...", share)
    share = np.maximum(share, np.maximum(dshare[:, None], dshare[None, :]))
    diags = [verdict([(float(rv[idx]), float(sv[idx])) for rv, sv in reps], float(share[idx]),
                      {}) for idx in np.ndindex(r.shape)]
    r = np.clip(r, -1.0, 1.0)
    for i in range(N):
        r[i, i], se[i, i] = 1.0, 0.0
    return MonteCarloArray(r, se, n_samples, diags)


def ratio_estimate(s1, s2, n_samples: int, keep: bool = False):
    """The similarity ``r = ab / sqrt(aa bb)`` of sample means and its delta-method standard error.

    ``s1`` ``(3, ...)``: sums over the ``n_samples`` samples of the per-sample products
    ``(p_ab, p_aa, p_bb)``, all from the same samples; ``s2`` ``(3, 3, ...)``: sums of their
    outer products. The standard error is ``sqrt(g^T C g / n)`` with ``C`` the sample covariance
    (``n - 1``) of the triple and ``g = (1/sqrt(aa bb), -r/(2 aa), -r/(2 bb))`` the gradient of
    ``r`` at the means (first order: the ratio's O(1/n) bias is not in it).

    Raises:
        ValueError: a sampled norm is zero or negative.
    """
    m = np.asarray(s1, dtype=np.float64) / n_samples
    cov = (np.asarray(s2, dtype=np.float64) / n_samples - np.einsum("i...,j...->ij...", m, m)) \
        * n_samples / (n_samples - 1)
    ab, aa, bb = m
    if np.any(aa <= 0) or np.any(bb <= 0):
        raise ValueError("similarity: a sampled norm is zero (a zero network?); similarity is "
                         "undefined")
    r = ab / np.sqrt(aa * bb)
    # gradient of r = ab / sqrt(aa bb) with respect to (ab, aa, bb)
    g = np.stack([1 / np.sqrt(aa * bb), -r / (2 * aa), -r / (2 * bb)])
    var = np.einsum("i...,ij...,j...->...", g, cov, g) / n_samples
    se = np.sqrt(np.maximum(var, 0.0))
    if keep:
        return MonteCarloArray(r, se, n_samples)
    return MonteCarloEstimate(float(r), float(se), n_samples)


features = _mc_features


# ----------------------------------------------------------------------------------------
# sequence models (any depth): directions on the sphere of R^(n_ctx d)
# ----------------------------------------------------------------------------------------

def _mc_checked(req: Request, a: Any, b: Any, n_batches: Any, caller: str):
    """The request checked against a pair of sequence models (before any sampling): the pair
    as float networks and its ``n_ctx``. The directions are those of `_mc_points` (``u``
    uniform on the sphere of ``R^(n_ctx d)``, each evaluated at the ``Q`` points ``±r_q u`` of
    the Gauss rule for the chi radius, `_radial_rule`, exact for polynomials of degree
    ``<= 2 max(degree)``), sampled by `_mc_features`."""
    a, b, n_ctx = check_sequence_pair(a, b, req.n_ctx)
    if isinstance(req.output, str) or isinstance(req.position, str):
        raise ValueError(f"{caller}: output='each' / position='each' are not supported; "
                         f"loop over the slices")
    check_slices(req, a.out_features, n_ctx)
    if isinstance(n_batches, bool) or not isinstance(n_batches, numbers.Integral) or n_batches < 2:
        raise ValueError(f"n_batches: expected an int >= 2, got {n_batches!r}")
    if req.n_samples < 2 * n_batches:
        raise ValueError(f"n_samples: expected an int >= 2 * n_batches = {2 * n_batches}, got "
                         f"{req.n_samples!r}")
    return a.astype_float(), b.astype_float(), n_ctx


def _mc_points(seed, n_samples, n_ctx, d, degree, chunk: int):
    """The radial Monte Carlo points of sequence models: a generator of ``(X, wq)``,
    ``n_samples`` directions ``u`` uniform on the sphere of ``R^(n_ctx d)`` (numpy
    ``default_rng(seed)``, drawn ``chunk`` at a time: the same directions in the same order
    for any ``chunk``), ``X`` ``(m Q, n_ctx, d)`` the points ``±r_q u`` of each direction and
    ``wq`` ``(Q,)`` their weights."""
    pts, wq = _radial_points(n_ctx * d, 2 * degree)
    Q = pts.size
    step = max(1, int(chunk))

    def points():
        rng = np.random.default_rng(int(seed))
        for lo in range(0, int(n_samples), step):
            u = rng.standard_normal((min(step, int(n_samples) - lo), n_ctx * d))
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            yield (u[:, None, :] * pts[None, :, None]).reshape(len(u) * Q, n_ctx, d), wq

    return points()


def _mc_request(n_ctx, n_samples, seed, output, position) -> Request:
    return make_request(method="montecarlo", n_ctx=n_ctx, n_samples=n_samples, seed=seed,
                        output=output, position=position)


def montecarlo_inner(a: Any, b: Any, *, n_ctx: Any = None, n_samples: int = 20_000,
                     seed: int = 0, output: Any = None, position: Any = None,
                     n_batches: int = 20):
    """Monte Carlo estimate (approximate) of ``sum_t sum_o E[f_a(X)[t,o] f_b(X)[t,o]]`` for
    sequence models of any depth, with its standard error: the radial estimator of the
    position-free path (docs/mathematics.md §3.4).

    Samples ``n_samples`` directions ``u`` uniform on the sphere of ``R^(n_ctx d)`` (numpy
    ``default_rng(seed)``) and integrates the radius exactly (the Gauss rule for the chi
    distribution): per direction ``p(u) = E_r[sum_{t,o} f_a(r u)[t,o] f_b(r u)[t,o]]``
    (sliced by ``output`` / ``position``), each model evaluated at ``Q = 2 m`` points
    (``m = max degree // 2 + 1``). ``p(u)`` is iid over directions with mean the inner
    product; the estimate is its sample mean and the standard error
    ``std(p, ddof=1) / sqrt(n)``. Plain samples ``X ~ N(0, I)`` (the estimator before) give a
    heavy-tailed degree-10 integrand at one layer whose standard error did not cover (truth
    beyond 3 SE in 23 of 200 seeds at 2 000 samples); the radial one is tested for coverage in
    tests/test_mc_coverage.py. ``n_batches`` only bounds ``n_samples`` from below (the
    directions are the same for any ``n_batches``).

    Args:
        output: None, an int or a direction vector (no ``"each"``); position: None or an int.

    Returns:
        ``tensoralg.MonteCarloEstimate`` (a float with ``.stderr`` and ``.n_samples`` =
        directions).

    Raises:
        ValueError: as `exact_inner` for the pair and slices; ``n_samples`` below
            ``2 * n_batches``; ``n_batches < 2``; a negative ``seed``.
    """
    return montecarlo_inner_req(_mc_request(n_ctx, n_samples, seed, output, position), a, b,
                                n_batches)


def montecarlo_inner_req(req: Request, a: Any, b: Any, n_batches: int = MC_REPLICATES):
    """`montecarlo_inner` of a validated request: `moments` of the pair. The
    default ``n_batches`` asks for no more directions than the diagnostics need
    (``MC_MIN_SAMPLES``, as for vector models): ``ta.inner`` of sequence models took at least
    40 for a parameter the caller cannot set."""
    na, nb, n_ctx = _mc_checked(req, a, b, n_batches, "montecarlo_inner")
    U, _ = req.output_matrix(na.out_features)
    mean, se, p = moments([na], [nb], U, False, req.n_samples, req.seed, "numpy", None, None,
                          samples=True, n_ctx=n_ctx, position=req.position)
    diag = inner_diagnostics(p[:, 0, 0], "<a,a>" if b is a else None)
    return MonteCarloEstimate(float(mean[0, 0]), float(se[0, 0]), req.n_samples, diag)


def montecarlo_similarity(a: Any, b: Any, *, n_ctx: Any = None, n_samples: int = 20_000,
                          seed: int = 0, output: Any = None, position: Any = None,
                          n_batches: int = 20):
    """Monte Carlo estimate (approximate) of ``<a,b> / sqrt(<a,a> <b,b>)`` for sequence models of
    any depth, with a delta-method standard error.

    The directions and radial rule of `montecarlo_inner`: per direction ``p_ab``,
    ``p_aa``, ``p_bb`` from the same evaluations. The estimate is the ratio
    ``r = mean(p_ab) / sqrt(mean(p_aa) mean(p_bb))`` (consistent, bias O(1/n)) and its standard
    error ``sqrt(g^T C g / n)``, ``C`` the sample covariance of ``(p_ab, p_aa, p_bb)`` over the
    ``n`` directions and ``g`` the gradient of ``r``
    (``tensoralg.strategies.montecarlo.ratio_estimate``, the position-free path's formula).

    Measured (tests/test_mc_coverage.py): on three one-layer pairs with 300 directions the
    exact value lay beyond 3 standard errors in 3 of 300 runs (plain sampling at 2 000
    samples: 12). Deeper stacks have high degree (25 for two attention layers, ``Q = 26``):
    their standard error is less reliable; check it across seeds.

    Returns:
        ``tensoralg.MonteCarloEstimate`` (``.stderr``, ``.n_samples`` = directions).

    Raises:
        ValueError: as `montecarlo_inner`; a sampled norm that is zero.
    """
    return montecarlo_similarity_req(_mc_request(n_ctx, n_samples, seed, output, position),
                                     a, b, n_batches)


def montecarlo_similarity_req(req: Request, a: Any, b: Any, n_batches: int = MC_REPLICATES):
    """`montecarlo_similarity` of a validated request: `similarity` of the pair."""
    na, nb, n_ctx = _mc_checked(req, a, b, n_batches, "montecarlo_similarity")
    U, _ = req.output_matrix(na.out_features)
    return similarity(na, nb, U, False, req.n_samples, req.seed, "numpy", None, None,
                      n_ctx=n_ctx, position=req.position)


def montecarlo_similarity_pairs(models: Sequence[Any], *, n_ctx: Any = None,
                                n_samples: int = 20_000, seed: int = 0, n_batches: int = 20,
                                chunk: int = 25, progress: Any = None) -> dict:
    """Monte Carlo similarity (APPROXIMATE: an estimate) of every pair of ``N`` sequence models
    from ONE shared set of directions, each pair with its `Diagnostics` verdict.

    The estimator of `montecarlo_similarity` (directions uniform on the sphere of
    ``R^(n_ctx d)`` drawn from numpy ``default_rng(seed)`` (``n_batches``: as there), the radius
    integrated exactly by the Gauss rule for the chi distribution; docs/mathematics.md §3.4,
    §3.9), with the same directions for every pair: entry ``(i, j)`` equals
    ``montecarlo_similarity(models[i], models[j], n_ctx=n_ctx, n_samples=n_samples,
    seed=seed)`` up to rounding (the sums are grouped differently), including its diagnostics,
    as long as the models share one degree (the Gauss rule is chosen for the largest degree of
    all ``N``; it is exact for every smaller one too). Cost: each model is evaluated once per
    point (``N`` forward passes, not ``N^2``), ``chunk`` directions at a time; memory
    ``O(N^2 n_samples)`` for the per-direction products the diagnostics need.

    Args:
        models: ``N >= 2`` sequence models reading the same input, with the same outputs.
        progress: None, or a callable wrapping an iterable (e.g. tqdm) over the chunks.

    Returns:
        ``{(i, j): MonteCarloEstimate}`` for ``i < j`` (``.stderr``, ``.n_samples``,
        ``.diagnostics``; a value whose ``.reliable`` is False is not an answer).

    Raises:
        ValueError: fewer than two models; a pair `montecarlo_similarity` refuses (other
            input size or outputs, ``n_ctx``, ``n_samples`` below ``2 n_batches``); a sampled
            norm that is zero.
    """
    nets = list(models)
    if len(nets) < 2:
        raise ValueError(f"models: expected at least two sequence models, got {len(nets)}")
    req = _mc_request(n_ctx, n_samples, seed, None, None)
    checked = [check_sequence_pair(nets[0], m, req.n_ctx) for m in nets[1:]]
    n_ctx = checked[0][2]
    if any(c[2] != n_ctx for c in checked):
        raise ValueError(f"n_ctx: the models resolve to different contexts "
                         f"{sorted({c[2] for c in checked})}; give n_ctx")
    _mc_checked(req, nets[0], nets[1], n_batches, "montecarlo_similarity_pairs")
    nets = [checked[0][0].astype_float()] + [c[1].astype_float() for c in checked]
    check_sampling_cost(nets, req.n_samples, 2 * _radial_nodes(2 * max(m.degree for m in nets)),
                        n_ctx)
    n = req.n_samples
    points = _mc_points(req.seed, n, n_ctx, nets[0].in_features, max(m.degree for m in nets),
                        chunk)
    N = len(nets)
    kept = []
    for X, wq in (points if progress is None else progress(points)):
        m = X.shape[0] // wq.size
        F = np.stack([np.asarray(f(X), dtype=np.float64).reshape(m, wq.size, -1)
                      for f in nets], axis=1)                    # (m, N, Q, K)
        F *= np.sqrt(wq)[None, None, :, None]                    # Gauss weights are positive
        F = F.reshape(m, N, -1)
        kept.append(np.matmul(F, F.transpose(0, 2, 1)))          # (m, N, N): p_ij per direction
    P = np.concatenate(kept, axis=0)                              # (n, N, N)
    out = {}
    for i in range(N):
        for j in range(i + 1, N):
            T = np.stack([P[:, i, j], P[:, i, i], P[:, j, j]])   # (3, n)
            est = ratio_estimate(T.sum(axis=1), T @ T.T, n)
            out[(i, j)] = MonteCarloEstimate(float(est), est.stderr, n, ratio_diagnostics(T))
    return out
