"""What the engine returns: one type per kind of answer, for vector and sequence models alike.

* `ExactSimilarity` — every exact similarity (``backend="exact"``).
* `ExactNorm` — every exact norm and distance (``norm``, ``diff_norm``).
* [`MonteCarloEstimate`][tensoralg.strategies.montecarlo.MonteCarloEstimate] /
  `MonteCarloArray` — every Monte Carlo estimate.
* `similarity_from` — the one place where three inner products become a similarity.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from .strategies.montecarlo import MonteCarloArray, MonteCarloEstimate

__all__ = ["ExactSimilarity", "ExactNorm", "MomentClosureValue", "MomentClosureArray",
           "MonteCarloEstimate", "MonteCarloArray", "similarity_from", "gram_to_similarity",
           "swap_order"]


class ExactSimilarity(float):
    """An exact similarity (``backend="exact"``): the float nearest to it, plus ``.exact``.

    ``.exact`` is the sympy number ``sign(ab) * sqrt(R)`` with ``R = ab^2 / (aa bb)`` a reduced
    rational (square factors taken out by sympy; a plain Rational when ``R`` is a perfect
    square), and ``.squared`` is the signed Fraction ``sign(ab) * R``. Arithmetic and
    comparisons act on the float; use ``.exact`` / ``.squared`` for exact work."""

    exact: Any
    squared: Fraction

    @classmethod
    def from_products(cls, ab: Fraction, aa: Fraction, bb: Fraction) -> ExactSimilarity:
        import sympy

        R = ab * ab / (aa * bb)
        sign = 1 if ab >= 0 else -1
        exact = sign * sympy.sqrt(sympy.Rational(R.numerator, R.denominator))
        obj = super().__new__(cls, float(sympy.Float(exact.evalf(30), 30)))
        obj.exact, obj.squared = exact, sign * R
        return obj

    def __repr__(self) -> str:
        text = str(self.exact)
        if len(text) > 60:
            digits = len(str(self.squared.numerator)) + len(str(self.squared.denominator))
            text = f"sign * sqrt(p/q), {digits} digits: see .exact"
        return f"ExactSimilarity({float(self)!r}, exact={text})"


class ExactNorm(float):
    """An exact norm or distance (``norm`` / ``diff_norm`` with ``backend="exact"``): the float
    nearest to it, plus ``.exact``, as `ExactSimilarity`.

    ``.exact`` is the sympy number ``sqrt(R)`` with ``R`` the squared norm, a non-negative
    rational (square factors taken out by sympy; a plain Rational when ``R`` is a perfect
    square), and ``.squared`` is ``R`` as a Fraction. Arithmetic and comparisons act on the
    float; use ``.exact`` / ``.squared`` for exact work."""

    exact: Any
    squared: Fraction

    @classmethod
    def from_square(cls, squared: Any) -> ExactNorm:
        import sympy

        R = Fraction(squared)
        if R < 0:   # a sum of exact squares: negative only through a bug upstream
            raise ValueError(f"norm: a negative squared norm {R} (exact arithmetic)")
        exact = sympy.sqrt(sympy.Rational(R.numerator, R.denominator))
        obj = super().__new__(cls, float(sympy.Float(exact.evalf(30), 30)))
        obj.exact, obj.squared = exact, R
        return obj

    def __repr__(self) -> str:
        text = str(self.exact)
        if len(text) > 60:
            digits = len(str(self.squared.numerator)) + len(str(self.squared.denominator))
            text = f"sqrt(p/q), {digits} digits: see .exact"
        return f"ExactNorm({float(self)!r}, exact={text})"


class MomentClosureValue(float):
    """A value of ``method="closure"`` (the moment-closure inner product or similarity,
    docs/closure.md): a float whose ``repr`` says what it is. Exact at depth 1; from the
    second non-linear layer on, the exact value of a surrogate in which each layer reads a
    Gaussian with the true second moments of the layer before, APPROXIMATE as the tensor
    similarity (on trained two-layer transformers not an estimate of it: docs/mathematics.md
    §3.9). Arithmetic gives plain floats; ``print``, ``str`` and formatting give the number."""

    __str__ = float.__repr__   # print and f-strings: the number (tables label the method)

    def __repr__(self) -> str:
        return (f"MomentClosureValue({float(self)!r}: the moment-closure value, exact at "
                f"depth 1, APPROXIMATE from the second non-linear layer on)")


class MomentClosureArray(np.ndarray):
    """An array of ``method="closure"`` values (per output, a Gram or similarity matrix): a
    float64 NumPy array whose ``repr`` says what it is (see `MomentClosureValue`);
    slices and arithmetic keep the label."""

    def __repr__(self) -> str:
        return ("MomentClosureArray(the moment-closure values, exact at depth 1, APPROXIMATE "
                "from the second non-linear layer on):\n" + repr(self.view(np.ndarray)))


def mark_closure(req: Any, value: Any) -> Any:
    """``value`` as a `MomentClosureValue` (one float) or a `MomentClosureArray`
    (a float array) when ``req`` asked for the closure (exact results and anything else are
    returned as they are)."""
    if getattr(req, "method", None) != "closure":
        return value
    if type(value) in (float, np.float64):
        return MomentClosureValue(value)
    if type(value) is np.ndarray and value.dtype == np.float64:
        return value.view(MomentClosureArray)
    return value


def similarity_from(ab: Any, aa: Any, bb: Any, exact: bool, what: str = "",
                    names: tuple = ("a", "b")):
    """``ab / sqrt(aa bb)`` (Cauchy-Schwarz bounds it by 1; the last-ulp excess of rounding is
    clipped): an `ExactSimilarity` (a list of them per output) when ``exact``, else a
    float (an array for arrays of inner products). ``names``: the arguments ``aa`` and ``bb``
    belong to (the messages name them; the products may be in a normalized gauge, so their
    values are not quoted).

    Raises:
        ValueError: a norm is zero (a zero function; in float64 also one whose squared norm
            underflowed), or (float) an inner product overflowed float64.
    """
    def zero(ya, yb, where, tail):
        who = " and ".join(n for n, y in zip(names, (ya, yb)) if y)
        verb = "have" if ya and yb else "has"
        return ValueError(f"similarity{what}{where}: {who} {verb} norm zero{tail}")

    if exact:
        def one(x, y, z, where):
            if y == 0 or z == 0:
                raise zero(y == 0, z == 0, where, "; similarity is undefined")
            return ExactSimilarity.from_products(Fraction(x), Fraction(y), Fraction(z))
        if np.ndim(ab):
            ab, aa, bb = (np.asarray(v, dtype=object) for v in (ab, aa, bb))
            out = np.empty(ab.shape, dtype=object)
            for i in np.ndindex(ab.shape):
                out[i] = one(ab[i], aa[i], bb[i], f" (entry {i if len(i) > 1 else i[0]})")
            return out.tolist()   # a list per output (nested for position="each" too)
        return one(ab, aa, bb, "")
    if np.ndim(ab) == 0 and np.ndim(aa) == 0 and np.ndim(bb) == 0:
        x, y, z = float(ab), float(aa), float(bb)
        if math.isfinite(x) and math.isfinite(y) and math.isfinite(z) and y > 0 and z > 0:
            return min(1.0, max(-1.0, x / math.sqrt(y * z)))  # the same IEEE operations
    ab, aa, bb = (np.asarray(v, dtype=np.float64) for v in (ab, aa, bb))
    cross = tuple(sorted(names))
    bad = [f"<{x},{y}>" for (x, y), v in zip((cross, (names[0],) * 2, (names[1],) * 2),
                                              (ab, aa, bb)) if not np.all(np.isfinite(v))]
    if bad:
        raise ValueError(f"similarity{what}: an inner product overflowed float64 "
                         f"({', '.join(bad)} not finite); internal activations beyond 1e154 — "
                         f"rescale the weights or use backend='exact'")
    za, zb = aa <= 0, bb <= 0
    if np.any(za) or np.any(zb):
        where = "" if np.ndim(aa) == 0 else \
            f" (outputs {np.flatnonzero(za | zb).tolist()})"
        raise zero(bool(np.any(za)), bool(np.any(zb)), where,
                   " in float64: a zero function has no direction; if its weights are merely "
                   "tiny, the norm underflowed — rescale them or use backend='exact'")
    val = np.clip(ab / np.sqrt(aa * bb), -1.0, 1.0)
    return val if val.ndim else float(val)


def _first_difference(x: np.ndarray, y: np.ndarray) -> int:
    """-1, 0 or 1: the lexicographic order of two arrays' entries (then shapes), looking at a
    growing prefix first so that different weights decide after a few entries."""
    if x.shape != y.shape:
        return -1 if x.shape < y.shape else 1
    x, y = x.reshape(-1), y.reshape(-1)
    n, start, size = x.size, 0, 8
    while start < n:
        stop = min(n, start + size)
        diff = np.flatnonzero(x[start:stop] != y[start:stop])
        if diff.size:
            i = start + int(diff[0])
            return -1 if x[i] < y[i] else 1
        start, size = stop, size * 16
    return 0


def swap_order(a: Any, b: Any) -> bool:
    """Whether the pair's canonical order is ``(b, a)``: the lexicographic order of the two
    models' weights (layer types first). The similarity of a pair is computed in that order,
    so ``sim(a, b)`` and ``sim(b, a)`` run the same floating-point operations and agree bit for
    bit (summing the cross term in the other order can differ in the last bits: 1-45 ulp
    measured on attention pairs). Equal weights need no order: both orders are then the same
    computation. Cheap: different models decide within their first few entries. Called after
    every check, so error messages still name ``a`` and ``b`` as given."""
    try:
        xs, ys = a.arrays(), b.arrays()
    except (AttributeError, NotImplementedError):
        return False
    ta, tb = type(a).__name__, type(b).__name__
    if ta != tb:
        return tb < ta
    if len(xs) != len(ys):
        return len(ys) < len(xs)
    for x, y in zip(xs, ys):
        if x.shape == y.shape and x.size and x.dtype != object and y.dtype != object:
            x0, y0 = x.flat[0], y.flat[0]      # the usual answer, without array work
            if x0 != y0:
                return bool(y0 < x0)
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype == object or y.dtype == object:
            x, y = x.astype(np.float64), y.astype(np.float64)
        order = _first_difference(x, y)
        if order:
            return order > 0
    return False


def check_overflow(X: Any, what: str) -> None:
    """Raises ValueError when a float64 result holds a non-finite entry: an inner product that
    overflowed (finite weights were checked before; the entries are named by index)."""
    if type(X) in (float, np.float64) and math.isfinite(X):   # the warm scalar path: no array
        return
    X = np.asarray(X)
    if X.dtype == object or np.all(np.isfinite(X)):
        return
    where = "" if X.ndim == 0 else \
        f" (entries {[tuple(int(k) for k in i) for i in np.argwhere(~np.isfinite(X))[:4]]})"
    raise ValueError(f"{what}: an inner product overflowed float64{where}; internal "
                     f"activations beyond 1e154 — rescale the weights or use backend='exact'")


def gram_to_similarity(G: np.ndarray) -> np.ndarray:
    """``G_ij / sqrt(G_ii G_jj)`` clipped to [-1, 1] of a float Gram matrix ``(N, N, ...)``.

    Raises:
        ValueError: a model whose diagonal entry is ``<= 0`` (named by index); an entry that
            overflowed float64."""
    check_overflow(G, "similarity_matrix")
    dg = np.einsum("ii...->i...", G)
    if np.any(dg <= 0):
        zero = np.flatnonzero(np.atleast_1d(dg <= 0).reshape(len(dg), -1).any(1)).tolist()
        raise ValueError(f"similarity_matrix: models {zero} have norm zero; similarity is "
                         f"undefined")
    return np.clip(G / np.sqrt(np.einsum("i...,j...->ij...", dg, dg)), -1.0, 1.0)
