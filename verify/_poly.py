"""Exact sparse polynomials in ``x = (x_1, ..., x_d)`` with rational coefficients.

A polynomial is a ``dict`` mapping an exponent tuple ``alpha`` (length ``d``) to a nonzero
:class:`fractions.Fraction`.  This module is deliberately small and self-contained: it is the
independent route that :mod:`verify.certify` uses to check tensoralg's fast contractions, so it
recomputes everything from the definition of a polynomial and of a Gaussian moment, and shares
no code with ``tensoralg.network`` / ``tensoralg.wick``.

Gaussian moments (``x ~ N(0, I_d)``): the coordinates are independent and
``E[x_i^k] = (k-1)!!`` for even ``k`` and ``0`` for odd ``k``, so
``E[x^alpha] = prod_i E[x_i^{alpha_i}]`` (Isserlis 1918; the one-dimensional moments of the
standard normal).
"""

from __future__ import annotations

from fractions import Fraction
from math import comb
from typing import Dict, Iterable, List, Tuple

Monomial = Tuple[int, ...]
Poly = Dict[Monomial, Fraction]

__all__ = ["Poly", "ExpansionTooLarge", "Budget", "constant", "variable", "add_scaled", "mul",
           "gaussian_moment", "expectation", "gaussian_inner", "dense_monomial_count"]


class ExpansionTooLarge(ValueError):
    """An exact expansion would exceed its stated size limit (raised before the heavy work)."""


class Budget:
    """Counts coefficient multiplications and refuses to go past ``max_work``."""

    def __init__(self, max_work: int, what: str = "expansion"):
        self.max_work = int(max_work)
        self.work = 0
        self.what = what

    def charge(self, n: int) -> None:
        if self.work + n > self.max_work:
            raise ExpansionTooLarge(
                f"{self.what}: the next step needs {n:,} coefficient products on top of "
                f"{self.work:,} already done, over the limit max_work={self.max_work:,}; "
                f"use a smaller network, raise max_work, or use Monte Carlo "
                f"(verify.montecarlo) instead")
        self.work += n


def dense_monomial_count(d: int, degree: int) -> int:
    """Number of monomials of total degree <= ``degree`` in ``d`` variables: C(d + degree, d)."""
    return comb(d + degree, d)


def constant(c, d: int) -> Poly:
    c = Fraction(c)
    return {(0,) * d: c} if c else {}


def variable(i: int, d: int) -> Poly:
    e = [0] * d
    e[i] = 1
    return {tuple(e): Fraction(1)}


def add_scaled(acc: Poly, p: Poly, c: Fraction) -> None:
    """``acc += c * p`` in place (zero coefficients are dropped)."""
    if not c:
        return
    for m, v in p.items():
        s = acc.get(m, 0) + c * v
        if s:
            acc[m] = s
        else:
            acc.pop(m, None)


def mul(p: Poly, q: Poly, budget: Budget | None = None) -> Poly:
    """Product of two polynomials (schoolbook, exact)."""
    if budget is not None:
        budget.charge(len(p) * len(q))
    out: Poly = {}
    for a, u in p.items():
        for b, v in q.items():
            m = tuple(x + y for x, y in zip(a, b))
            s = out.get(m, 0) + u * v
            if s:
                out[m] = s
            else:
                out.pop(m, None)
    return out


_DF: List[int] = [1, 1]  # _DF[k] = k!! ; E[x^k] = (k-1)!! for even k


def _double_factorial(k: int) -> int:
    while len(_DF) <= k:
        n = len(_DF)
        _DF.append(n * _DF[n - 2])
    return _DF[k]


def gaussian_moment(alpha: Iterable[int]) -> int:
    """``E[x^alpha]`` for ``x ~ N(0, I)``: ``prod_i (alpha_i - 1)!!`` if every ``alpha_i`` is even, else 0."""
    out = 1
    for k in alpha:
        if k & 1:
            return 0
        if k:
            out *= _double_factorial(k - 1)
    return out


def expectation(p: Poly) -> Fraction:
    """``E[p(x)]`` for ``x ~ N(0, I_d)``, exact, monomial by monomial."""
    return sum((v * gaussian_moment(m) for m, v in p.items()), Fraction(0))


def _parity(m: Monomial) -> Tuple[int, ...]:
    return tuple(k & 1 for k in m)


def gaussian_inner(p: Poly, q: Poly, budget: Budget | None = None) -> Fraction:
    """``E[p(x) q(x)]`` for ``x ~ N(0, I_d)`` without forming the product polynomial.

    Only monomial pairs with the same parity pattern can have a nonzero moment, so ``q`` is
    bucketed by parity first.
    """
    buckets: Dict[Tuple[int, ...], List[Tuple[Monomial, Fraction]]] = {}
    for m, v in q.items():
        buckets.setdefault(_parity(m), []).append((m, v))
    if budget is not None:
        budget.charge(sum(len(buckets.get(_parity(m), ())) for m in p))
    total = Fraction(0)
    for a, u in p.items():
        acc = 0
        for b, v in buckets.get(_parity(a), ()):
            acc += v * gaussian_moment(x + y for x, y in zip(a, b))
        if acc:
            total += u * acc
    return total
