"""The input distribution of the Gaussian metric (docs/mathematics.md §3.9): ``N(0, Σ)``.

``N(0, Σ)`` with ``Σ = K Kᵀ`` is the standard metric composed with the linear map ``K``:

    <f_a, f_b>_Σ = E_{x ~ N(0, Σ)}[f_a(x) · f_b(x)] = E_{z ~ N(0, I)}[f_a(K z) · f_b(K z)]

because ``K z ~ N(0, K Kᵀ)``. So every strategy (exact Wick and chaos, the closure, Monte Carlo)
runs unchanged on ``f ∘ K``: the factor is folded in as a first linear layer without bias (the
lifted constant ``x~_0 = 1`` is never scaled). For sequence models the same ``Σ`` holds at every
position (the factor is applied per position). In rationals a rational ``K`` keeps the value
exact. For a model of degree ``n`` the scale matters: inputs scaled by ``σ`` multiply the
degree-``k`` part by ``σ^k``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["CovarianceFactor", "InputDistribution", "input_distribution", "STANDARD"]

#: Symmetry and PSD tolerances for a float covariance (relative to its largest entry /
#: eigenvalue): rounding of a matrix built in float64 stays far below them.
_SYM_RTOL = 1e-10
_PSD_RTOL = 1e-10


class CovarianceFactor:
    """An explicit factor ``K`` (shape ``(d, r)``) of the input covariance ``Σ = K Kᵀ``: the
    inputs are ``x = K z`` with ``z ~ N(0, I_r)``. Rational entries (Fractions or strings such
    as ``"1/2"``) keep ``backend="exact"`` exact for any rational ``Σ = K Kᵀ``."""

    def __init__(self, K: Any):
        from .layers import as_array

        self.K = as_array(K, "cov (factor K)", 2, "the factor K")

    def __repr__(self) -> str:
        return f"CovarianceFactor(shape={self.K.shape})"


@dataclass(frozen=True, eq=False)
class InputDistribution:
    """``N(0, Σ)`` on the model's input (per position for sequence models).

    Attributes:
        kind: ``"standard"`` (``Σ = I``), ``"scalar"``, ``"diagonal"``, ``"full"``,
            ``"estimated"`` (from activations) or ``"factor"`` (an explicit ``K``).
        factor: ``K`` of shape ``(d, r)`` with ``K Kᵀ = Σ`` (None for the standard one); float64,
            or Fractions where the value is exact.
        d: the input dimension it applies to (None for the standard one).
        n_rows: rows of the activations it was estimated from (``"estimated"`` only).
    """

    kind: str = "standard"
    factor: Any = None
    d: int | None = None
    n_rows: int | None = None

    def describe(self) -> str:
        """A one-line record of the distribution (printed by plans and written to JSON)."""
        if self.kind == "standard":
            return "N(0, I)"
        if self.kind == "scalar":
            return f"N(0, sigma^2 I), sigma^2 = {self.factor[0] ** 2}"
        what = {"diagonal": "diagonal", "full": "full matrix",
                "factor": f"Sigma = K K^T, K of shape {tuple(self.factor.shape)}",
                "estimated": f"sample covariance of {self.n_rows} activation rows"}[self.kind]
        return f"N(0, Sigma), d = {self.d}: {what}"

    def record(self) -> dict:
        """The distribution for a JSON record: kind, ``d`` and ``Σ`` as nested float lists."""
        if self.kind == "standard":
            return {"kind": "standard"}
        if self.kind == "scalar":
            return {"kind": "scalar", "variance": float(self.factor[0]) ** 2}
        K = np.asarray(self.factor, dtype=np.float64)
        out = {"kind": self.kind, "d": self.d, "cov": (K @ K.T).tolist()}
        if self.n_rows is not None:
            out["n_rows"] = self.n_rows
        return out

    def apply(self, net: Any, name: str, exact: bool) -> Any:
        """``net ∘ K`` (the network itself for the standard distribution).

        Raises:
            ValueError: ``net`` reads another number of input features than ``Σ`` has.
        """
        if self.kind == "standard":
            return net
        from .layers import Linear, Sequential

        K = self.factor
        if self.kind == "scalar":   # sigma I_d, d read from the model
            K = _object_diag(np.repeat(K, net.in_features)) if exact else \
                float(K[0]) * np.eye(net.in_features)
        elif net.in_features != self.d:
            n = net.in_features
            given, want = {
                "diagonal": (f"a vector of {self.d} variances (a diagonal covariance)",
                             f"{n} variances"),
                "full": (f"a covariance matrix of shape ({self.d}, {self.d})", f"({n}, {n})"),
                "factor": (f"a factor K of shape {tuple(np.shape(self.factor))} (Sigma = K K^T "
                           f"of size {self.d} x {self.d})", f"K with {n} rows"),
                "estimated": (f"{self.n_rows} activation rows of {self.d} features",
                              f"rows of {n} features"),
            }.get(self.kind, (f"a covariance of size {self.d} x {self.d}", f"size {n} x {n}"))
            raise ValueError(f"cov: {given} for {name}, which reads {n} input features (per "
                             f"position); expected {want}")
        return Sequential([Linear(K), net])


STANDARD = InputDistribution()


def _is_rational(v: Any) -> bool:
    return isinstance(v, (Fraction, numbers.Integral, str)) and not isinstance(v, bool)


def _exact_sqrt(q: Fraction) -> Fraction | None:
    """The rational square root of ``q >= 0``, or None when it is irrational."""
    n, d = math.isqrt(q.numerator), math.isqrt(q.denominator)
    return Fraction(n, d) if n * n == q.numerator and d * d == q.denominator else None


def _sqrt_entries(vals: list, exact: bool, what: str) -> np.ndarray:
    """Square roots of positive variances: Fractions when ``exact`` (refused when
    irrational), else float64."""
    if not exact:
        return np.sqrt(np.asarray([float(v) for v in vals], dtype=np.float64))
    out = []
    for v in vals:
        r = _exact_sqrt(Fraction(v))
        if r is None:
            raise ValueError(f"cov: with backend='exact' the factor K (K K^T = Sigma) must be "
                             f"rational, but the {what} {Fraction(v)} has an irrational square "
                             f"root; pass cov=ta.CovarianceFactor(K) with a rational K")
        out.append(r)
    return np.array(out, dtype=object)


def _factor_of_matrix(S: np.ndarray, what: str, hint: str = "") -> np.ndarray:
    """A float64 factor ``K`` with ``K Kᵀ = S`` of a symmetric PSD matrix (eigen-decomposition,
    so singular ``S`` is fine), after the checks; ``hint`` ends their messages.

    Raises:
        ValueError: not symmetric or not positive semidefinite (to the tolerances above).
    """
    scale = float(np.max(np.abs(S)))
    if scale == 0:
        raise ValueError(f"cov: the {what} is zero; N(0, 0) is a point, not a distribution")
    asym = float(np.max(np.abs(S - S.T)))
    if asym > _SYM_RTOL * scale:
        raise ValueError(f"cov: the {what} of shape {S.shape} is not symmetric "
                         f"(max |S - S^T| = {asym:.3g}){hint}")
    lam, V = np.linalg.eigh((S + S.T) / 2)
    if lam[0] < -_PSD_RTOL * max(lam[-1], 0.0):
        raise ValueError(f"cov: the {what} of shape {S.shape} is not positive semidefinite "
                         f"(smallest eigenvalue {lam[0]:.3g}){hint}")
    return V * np.sqrt(np.clip(lam, 0.0, None))[None, :]


def input_distribution(cov: Any, exact: bool) -> InputDistribution:
    """The `InputDistribution` of ``cov`` (validated; no model needed).

    ``cov``: None (``N(0, I)``); a positive scalar ``σ²``; a 1-D array of ``d`` positive
    variances (a diagonal); a ``(d, d)`` symmetric PSD matrix; an ``(n, d)`` array of
    activations with ``n > d`` rows (their sample covariance, ``numpy.cov``, is used and the row
    count recorded); or a [`CovarianceFactor`][tensoralg.distribution.CovarianceFactor].

    Raises:
        ValueError: a non-finite or non-positive variance; a matrix that is not symmetric or
            not PSD; activations with ``n <= d`` rows; an irrational factor with
            ``backend="exact"``; anything else (named).
    """
    from .layers import as_array

    if cov is None:
        return STANDARD
    if isinstance(cov, CovarianceFactor):
        K = cov.K
        if not np.any(K != 0):
            raise ValueError(f"cov: the factor K of shape {K.shape} is zero; N(0, 0) is a "
                             f"point, not a distribution")
        if exact and K.dtype != object:
            K = np.vectorize(Fraction, otypes=[object])(K)
        elif not exact:
            K = np.asarray(K, dtype=np.float64)
        return InputDistribution("factor", K, K.shape[0])
    if isinstance(cov, (numbers.Real, str, Fraction)) and not isinstance(cov, bool):
        if not _is_rational(cov) and not math.isfinite(float(cov)):
            raise ValueError(f"cov: a scalar variance must be finite, got {cov!r}")
        try:
            value = Fraction(cov) if _is_rational(cov) or exact else float(cov)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"cov: cannot read {cov!r} as a variance") from None
        if value <= 0:
            raise ValueError(f"cov: a scalar variance must be positive, got {cov!r}")
        return InputDistribution("scalar", _sqrt_entries([value], exact, "variance"), None)
    if isinstance(cov, bool) or np.ndim(cov) not in (1, 2):
        raise ValueError(f"cov: expected None, a positive scalar, a vector of variances, a "
                         f"(d, d) covariance, (n, d) activations or a CovarianceFactor; got "
                         f"{type(cov).__name__} of {np.ndim(cov)} dimensions")
    try:
        arr = as_array(cov, "cov", np.ndim(cov), "a covariance (or activations)")
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    if arr.ndim == 1:
        if np.any(arr <= 0):
            raise ValueError(f"cov: a diagonal covariance needs positive variances; "
                             f"{int(np.sum(arr <= 0))} of {arr.size} are <= 0")
        root = _sqrt_entries(list(arr), exact, "variance")
        K = np.diag(root) if not exact else _object_diag(root)
        return InputDistribution("diagonal", K, arr.size)
    n, d = arr.shape
    if n == d:
        if exact:
            raise ValueError("cov: with backend='exact' a full covariance matrix needs a "
                             "rational factor; pass cov=ta.CovarianceFactor(K) with a rational "
                             "K (K K^T = Sigma)")
        hint = (f"; a square ({d}, {d}) array is read as a covariance matrix — activations "
                f"need more rows than features (n > d = {d})")
        return InputDistribution("full", _factor_of_matrix(np.asarray(arr, np.float64),
                                                           "covariance matrix", hint), d)
    if n < d:
        raise ValueError(f"cov: activations of shape {arr.shape} have fewer rows ({n}) than "
                         f"features ({d}); their sample covariance would be singular — give "
                         f"more than {d} rows, or a (d, d) covariance")
    if exact:
        raise ValueError("cov: an estimated covariance is a float; use a float backend "
                         "(backend='numpy' or 'torch')")
    S = np.cov(np.asarray(arr, dtype=np.float64), rowvar=False)
    return InputDistribution("estimated", _factor_of_matrix(np.atleast_2d(S),
                                                            "sample covariance"), d, n)


def _object_diag(root: np.ndarray) -> np.ndarray:
    K = np.empty((root.size, root.size), dtype=object)
    K[:] = Fraction(0)
    for i, r in enumerate(root):
        K[i, i] = r
    return K
