"""Exact certificates of functional equivalence for polynomial (multilinear) networks.

[`certify`][verify.certify.certify] expands both networks into explicit polynomials in ``x`` with
rational coefficients (floats are converted exactly with ``Fraction(float)``), subtracts them, and
computes the exact Gaussian distance

    ``distance2 = ||f_a - f_b||^2 = sum_o E_{x ~ N(0, I_d)}[(f_a(x)_o - f_b(x)_o)^2]``

monomial by monomial with ``E[x^alpha] = prod_i (alpha_i - 1)!!`` (Isserlis).  Two networks
are certified equal iff every coefficient of the difference is zero, which (the Gaussian
metric being positive definite on polynomials) is the same as ``distance2 == 0``.

This route is independent of ``tensoralg.inner``: it never builds a tensor network, never
sums Wick matchings and never uses the closure; it only reads the layers' weights.
The price is the size of the expansion: a depth-``L`` bilinear stack on ``d`` inputs has up
to ``C(d + 2^L, d)`` monomials per output.  The expansion is refused, with
[`ExpansionTooLarge`][verify._poly.ExpansionTooLarge] (a ``ValueError``), before any heavy work when
that dense bound exceeds ``max_monomials`` (default 200 000), and stopped, never hung, when the
coefficient products actually performed would pass ``max_work`` (default 10 000 000: at the measured
1-3 microseconds per product of exact rationals, at most about half a minute).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from ._poly import (
    Budget,
    ExpansionTooLarge,
    Poly,
    add_scaled,
    dense_monomial_count,
    gaussian_inner,
    linear_combination,
    mul,
    variable,
)

__all__ = ["certify", "Certificate", "expand", "gaussian_inner_exact", "ExpansionTooLarge",
           "DEFAULT_MAX_MONOMIALS", "DEFAULT_MAX_WORK"]

DEFAULT_MAX_MONOMIALS = 200_000
DEFAULT_MAX_WORK = 10_000_000


def _frac(v: Any) -> Fraction:
    if isinstance(v, Fraction):
        return v
    if isinstance(v, (int, np.integer)):
        return Fraction(int(v))
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"weights must be finite, got {f!r}")
    return Fraction(f)  # exact binary value of the float


def _fracs(a: np.ndarray | None) -> list | None:
    if a is None:
        return None
    arr = np.asarray(a, dtype=object)
    return np.vectorize(_frac, otypes=[object])(arr).tolist()


def _network(net: Any, name: str):
    from tensoralg.layers import as_network

    try:
        return as_network(net, name)
    except TypeError as exc:
        raise TypeError(str(exc)) from None


def _degree_and_check(layer, d: int, deg_in: int, name: str, max_monomials: int) -> int:
    """Degree bound of ``layer``'s output given inputs of degree ``deg_in``; refuses early."""
    from tensoralg.layers import Bilinear, Linear, Residual, Sequential

    if isinstance(layer, Sequential):
        for sub in layer.layers:
            deg_in = _degree_and_check(sub, d, deg_in, name, max_monomials)
        return deg_in
    if isinstance(layer, Linear):
        deg = deg_in
    elif isinstance(layer, Bilinear):
        deg = 2 * deg_in
    elif isinstance(layer, Residual):
        deg = max(deg_in, _degree_and_check(layer.inner, d, deg_in, name, max_monomials))
    else:
        raise TypeError(f"{name}: cannot expand a layer of type {type(layer).__name__}; "
                        f"expected Linear, Bilinear, Residual or Sequential")
    bound = dense_monomial_count(d, deg)
    if bound > max_monomials:
        raise ExpansionTooLarge(
            f"{name}: expanding this network into monomials could need up to C(d+deg, d) = "
            f"C({d}+{deg}, {d}) = {bound:,} monomials per output (d={d} inputs, degree {deg}), "
            f"over the limit max_monomials={max_monomials:,}; certify is meant for small "
            f"networks: use tensoralg.verify.montecarlo, or tensoralg.inner for exact values")
    return deg


def _expand(layer, inputs: list[Poly], d: int, budget: Budget) -> list[Poly]:
    from tensoralg.layers import Bilinear, Linear, Residual, Sequential

    if isinstance(layer, Sequential):
        for sub in layer.layers:
            inputs = _expand(sub, inputs, d, budget)
        return inputs

    def combine(W, b, polys):
        outs = []
        for o, row in enumerate(W):
            terms = [(w, polys[i]) for i, w in enumerate(row) if w]
            budget.charge(sum(len(p) for _, p in terms))
            outs.append(linear_combination(terms, b[o] if b is not None else 0, d))
        return outs

    if isinstance(layer, Linear):
        return combine(_fracs(layer.weight), _fracs(layer.bias), inputs)
    if isinstance(layer, Bilinear):
        left = combine(_fracs(layer.left), _fracs(layer.left_bias), inputs)
        right = combine(_fracs(layer.right), _fracs(layer.right_bias), inputs)
        hidden = [mul(lp, rp, budget) for lp, rp in zip(left, right)]
        return combine(_fracs(layer.down), _fracs(layer.down_bias), hidden)
    if isinstance(layer, Residual):
        inner = _expand(layer.inner, inputs, d, budget)
        return [linear_combination([(1, x), (1, y)]) for x, y in zip(inputs, inner)]
    raise TypeError(f"cannot expand a layer of type {type(layer).__name__}")


def expand(net: Any, *, max_monomials: int = DEFAULT_MAX_MONOMIALS,
           max_work: int = DEFAULT_MAX_WORK, name: str = "net") -> list[Poly]:
    """Expand a network into exact polynomials, one per output coordinate.

    Args:
        net: a tensoralg layer / ``Sequential``, a list of layers, or a layer spec (the JSON
            format of ``docs/spec.md``).
        max_monomials: refuse (before expanding) when the dense bound ``C(d + degree, d)`` on
            the monomials of one output exceeds this.
        max_work: stop when the coefficient products performed would exceed this.

    Returns:
        a list of ``out_features`` dicts ``{exponent tuple (length d): Fraction}``.

    Raises:
        ExpansionTooLarge: over either limit (a ``ValueError``; the message gives the size).
        TypeError: not a network.
    """
    net = _network(net, name)
    d = net.in_features
    _degree_and_check(net, d, 1, name, max_monomials)
    budget = Budget(max_work, f"{name}: expansion")
    return _expand(net, [variable(i, d) for i in range(d)], d, budget)


def _check_pair(a, b) -> tuple[Any, Any]:
    a, b = _network(a, "a"), _network(b, "b")
    if a.in_features != b.in_features:
        raise ValueError(f"a and b must read the same input: a has in_features={a.in_features}, "
                         f"b has in_features={b.in_features}")
    if a.out_features != b.out_features:
        raise ValueError(f"a and b must have the same number of outputs: a has "
                         f"out_features={a.out_features}, b has out_features={b.out_features}")
    return a, b


def _select_output(polys: list[Poly], output: Any, n_out: int) -> list[Poly]:
    """The polynomials for one output slice (see
    [`gaussian_inner_exact`][verify.certify.gaussian_inner_exact])."""
    if output is None or (isinstance(output, str) and output == "each"):
        return polys
    if isinstance(output, (int, np.integer)) and not isinstance(output, bool):
        if int(output) < 0:   # as tensoralg: a negative index does not count from the end
            raise ValueError(f"output: class index {output} is negative; expected 0..{n_out - 1}")
        if int(output) >= n_out:
            raise ValueError(f"output: class index {output} out of range for {n_out} outputs")
        return [polys[int(output)]]
    if isinstance(output, str):
        raise ValueError(f"output: expected None, an int, 'each' or a vector, got {output!r}")
    u = np.asarray(output, dtype=object).reshape(-1) if not hasattr(output, "detach") else \
        np.asarray(output.detach().cpu().double().numpy(), dtype=object).reshape(-1)
    if u.shape != (n_out,):
        raise ValueError(f"output: a direction vector must have shape ({n_out},), got {u.shape}")
    p: Poly = {}
    for w, q in zip(u, polys):
        add_scaled(p, q, _frac(w))
    return [p]


def gaussian_inner_exact(a: Any, b: Any, *, output: Any = None,
                         max_monomials: int = DEFAULT_MAX_MONOMIALS,
                         max_work: int = DEFAULT_MAX_WORK):
    """``<a, b>_G = sum_o E_{x~N(0,I)}[f_a(x)_o f_b(x)_o]`` exactly, by polynomial expansion.

    The independent (slow, exact) counterpart of ``tensoralg.inner(a, b, method="exact")``.

    Args:
        output: ``None`` (sum over outputs), an int ``c`` (``E[f_a,c f_b,c]``), ``"each"``
            (a list of per-output values) or a vector ``u`` of length ``out_features``
            (``E[(u.f_a)(u.f_b)]``; floats converted exactly).

    Returns:
        a ``Fraction`` (a list of Fractions for ``output="each"``).

    Raises:
        ValueError: different input or output sizes, a bad ``output``;
            ExpansionTooLarge over the limits.
    """
    a, b = _check_pair(a, b)
    n_out = a.out_features
    _select_output([{}] * n_out, output, n_out)  # validate before the expansion
    pa = expand(a, max_monomials=max_monomials, max_work=max_work, name="a")
    pb = pa if b is a else expand(b, max_monomials=max_monomials, max_work=max_work, name="b")
    pa, pb = _select_output(pa, output, n_out), _select_output(pb, output, n_out)
    budget = Budget(max_work, "inner product")
    vals = [gaussian_inner(p, q, budget) for p, q in zip(pa, pb)]
    if isinstance(output, str) and output == "each":
        return vals
    return sum(vals, Fraction(0))


@dataclass
class Certificate:
    """Result of [`certify`][verify.certify.certify].

    Attributes:
        equal: True iff ``f_a`` and ``f_b`` are the same polynomial map (every output).
        distance2: exact ``||f_a - f_b||^2`` under the Gaussian metric (a ``Fraction``).
        inner, norm2_a, norm2_b: exact ``<a,b>``, ``<a,a>``, ``<b,b>`` (Fractions).
        similarity: ``inner / sqrt(norm2_a * norm2_b)`` as a float (None when a norm is 0).
        witness: for unequal networks, one differing coefficient
            ``(output, exponent tuple, coef_a, coef_b)``; None when equal.
        d, n_outputs, n_monomials_a, n_monomials_b, seconds: sizes and wall time.
    """

    equal: bool
    distance2: Fraction
    inner: Fraction
    norm2_a: Fraction
    norm2_b: Fraction
    similarity: float | None
    witness: tuple | None
    d: int
    n_outputs: int
    n_monomials_a: int
    n_monomials_b: int
    seconds: float = field(default=0.0)

    def __bool__(self) -> bool:
        return self.equal

    def to_dict(self) -> dict:
        """JSON-friendly form (rationals as strings)."""
        w = self.witness
        return {"equal": self.equal, "distance2": str(self.distance2), "inner": str(self.inner),
                "norm2_a": str(self.norm2_a), "norm2_b": str(self.norm2_b),
                "similarity": self.similarity,
                "witness": None if w is None else [w[0], list(w[1]), str(w[2]), str(w[3])],
                "d": self.d, "n_outputs": self.n_outputs, "n_monomials_a": self.n_monomials_a,
                "n_monomials_b": self.n_monomials_b, "seconds": self.seconds}

    def __str__(self) -> str:
        verdict = "EQUAL (certified)" if self.equal else "NOT equal"
        return (f"{verdict}: ||f_a - f_b||^2 = {self.distance2} (exact, Gaussian metric); "
                f"<a,b> = {self.inner}, ||a||^2 = {self.norm2_a}, ||b||^2 = {self.norm2_b}")


def certify(a: Any, b: Any, *, max_monomials: int = DEFAULT_MAX_MONOMIALS,
            max_work: int = DEFAULT_MAX_WORK) -> Certificate:
    """Exact certificate that two polynomial networks compute the same function (or do not).

    Both networks are expanded into polynomials with rational coefficients (float weights are
    converted exactly, ``Fraction(float)``; a float network is certified for the binary numbers
    it stores).  ``equal`` is the polynomial identity ``f_a == f_b``; ``distance2`` is
    ``sum_o E[(f_a - f_b)_o^2]`` for ``x ~ N(0, I_d)``, computed from the difference polynomial
    with ``E[x^alpha] = prod (alpha_i - 1)!!`` (Isserlis).  Because the Gaussian metric is
    positive definite on polynomials, ``equal`` iff ``distance2 == 0`` (checked).

    Args:
        a, b: networks (tensoralg layers, lists of layers, or layer specs) with the same
            ``in_features`` ``d`` and ``out_features``.
        max_monomials: refuse up front when a network could expand to more than this many
            monomials per output (dense bound ``C(d + degree, d)``). Default 200 000.
        max_work: stop when the coefficient products would exceed this. Default 10 000 000.

    Raises:
        ValueError: different input/output sizes.
        ExpansionTooLarge (ValueError): over a size limit; raised before the expensive step.
        TypeError: an argument that is not a network.
    """
    t0 = time.perf_counter()
    a, b = _check_pair(a, b)
    pa = expand(a, max_monomials=max_monomials, max_work=max_work, name="a")
    pb = expand(b, max_monomials=max_monomials, max_work=max_work, name="b")
    budget = Budget(max_work, "certificate")
    diff: list[Poly] = []
    witness = None
    for o, (p, q) in enumerate(zip(pa, pb)):
        r = dict(p)
        add_scaled(r, q, Fraction(-1))
        diff.append(r)
        if witness is None and r:
            m = min(r)
            witness = (o, m, p.get(m, Fraction(0)), q.get(m, Fraction(0)))
    distance2 = sum((gaussian_inner(r, r, budget) for r in diff), Fraction(0))
    aa = sum((gaussian_inner(p, p, budget) for p in pa), Fraction(0))
    bb = sum((gaussian_inner(q, q, budget) for q in pb), Fraction(0))
    ab = sum((gaussian_inner(p, q, budget) for p, q in zip(pa, pb)), Fraction(0))
    equal = witness is None
    if equal != (distance2 == 0):  # pragma: no cover - would be a bug in the moments
        raise AssertionError("internal error: polynomial identity and Gaussian distance disagree")
    sim = float(ab) / math.sqrt(float(aa) * float(bb)) if aa > 0 and bb > 0 else None
    return Certificate(equal=equal, distance2=distance2, inner=ab, norm2_a=aa, norm2_b=bb,
                       similarity=sim, witness=witness, d=a.in_features,
                       n_outputs=a.out_features, n_monomials_a=sum(map(len, pa)),
                       n_monomials_b=sum(map(len, pb)), seconds=time.perf_counter() - t0)
