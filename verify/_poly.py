"""Exact sparse polynomials in ``x = (x_1, ..., x_d)`` with rational coefficients.

A polynomial is a ``dict`` mapping an exponent tuple ``alpha`` (length ``d``) to a nonzero
`fractions.Fraction`.  This module is deliberately small and self-contained: it is the
independent route that [`tensoralg.verify.certify`][verify.certify] uses to check tensoralg's fast
contractions, so it recomputes everything from the definition of a polynomial and of a Gaussian
moment, and shares no code with ``tensoralg.strategies.wick``.

Gaussian moments (``x ~ N(0, I_d)``): the coordinates are independent and
``E[x_i^k] = (k-1)!!`` for even ``k`` and ``0`` for odd ``k``, so
``E[x^alpha] = prod_i E[x_i^{alpha_i}]`` (Isserlis 1918; the one-dimensional moments of the
standard normal).
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from math import comb, lcm

Monomial = tuple[int, ...]
Poly = dict[Monomial, Fraction]

__all__ = ["Poly", "ExpansionTooLarge", "Budget", "constant", "variable", "add_scaled", "mul",
           "linear_combination", "gaussian_moment", "expectation", "gaussian_inner", "dense_monomial_count"]


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
                f"(tensoralg.verify.montecarlo) instead")
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


def _integer_form(p: Poly) -> tuple[dict[Monomial, int], int]:
    """``p = P / den`` with integer coefficients ``P`` (exact; makes the inner loops run on
    Python ints instead of Fractions)."""
    den = lcm(*(v.denominator for v in p.values())) if p else 1
    return {m: v.numerator * (den // v.denominator) for m, v in p.items()}, den


def linear_combination(terms: Iterable[tuple[Fraction, Poly]], const=0,
                       d: int | None = None) -> Poly:
    """``const + sum_k c_k p_k`` exactly, accumulated on integers over a common denominator."""
    items = []
    for c, p in terms:
        c = Fraction(c)
        if c and p:
            P, dp = _integer_form(p)
            items.append((c.numerator, c.denominator * dp, P))
    const = Fraction(const)
    den = lcm(const.denominator, *(dd for _, dd, _ in items))
    acc: dict[Monomial, int] = {}
    get = acc.get
    for cn, dd, P in items:
        f = cn * (den // dd)
        for m, v in P.items():
            acc[m] = get(m, 0) + f * v
    if const:
        if d is None:
            raise ValueError("linear_combination: d is needed for a constant term")
        zero = (0,) * d
        acc[zero] = get(zero, 0) + const.numerator * (den // const.denominator)
    return {m: Fraction(v, den) for m, v in acc.items() if v}


def _packing(p: Poly, q: Poly) -> int:
    """Bits per exponent so that every exponent of ``p * q`` fits in its field."""
    deg = max((sum(m) for m in p), default=0) + max((sum(m) for m in q), default=0)
    return max(deg.bit_length() + 1, 2)


def _pack(m: Monomial, bits: int) -> int:
    """Exponent tuple -> one int (field i holds ``m[i]``): monomial products become additions."""
    key = 0
    for i, k in enumerate(m):
        key |= k << (bits * i)
    return key


def _unpack(key: int, bits: int, d: int) -> Monomial:
    mask = (1 << bits) - 1
    return tuple((key >> (bits * i)) & mask for i in range(d))


def mul(p: Poly, q: Poly, budget: Budget | None = None) -> Poly:
    """Product of two polynomials (schoolbook, exact; integer coefficients and packed
    monomials in the inner loop)."""
    if budget is not None:
        budget.charge(len(p) * len(q))
    if not p or not q:
        return {}
    d = len(next(iter(p)))
    bits = _packing(p, q)
    P, dp = _integer_form(p)
    Q, dq = _integer_form(q)
    Pk = [(_pack(m, bits), v) for m, v in P.items()]
    Qk = [(_pack(m, bits), v) for m, v in Q.items()]
    acc: dict[int, int] = {}
    get = acc.get
    for a, u in Pk:
        for b, v in Qk:
            k = a + b
            acc[k] = get(k, 0) + u * v
    den = dp * dq
    return {_unpack(k, bits, d): Fraction(v, den) for k, v in acc.items() if v}


_DF: list[int] = [1, 1]  # _DF[k] = k!! ; E[x^k] = (k-1)!! for even k


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


def gaussian_inner(p: Poly, q: Poly, budget: Budget | None = None) -> Fraction:
    """``E[p(x) q(x)]`` for ``x ~ N(0, I_d)`` without forming the product polynomial.

    Only monomial pairs with the same parity pattern can have a nonzero moment, so ``q`` is
    bucketed by parity first; the sum runs on integers (common denominators) over packed
    monomials, with the moment of each exponent sum computed once.
    """
    if not p or not q:
        return Fraction(0)
    d = len(next(iter(p)))
    bits = _packing(p, q)
    odd = _pack((1,) * d, bits)  # lowest bit of every field: the parity pattern
    P, dp = _integer_form(p)
    Q, dq = _integer_form(q)
    buckets: dict[int, list[tuple[int, int]]] = {}
    for m, v in Q.items():
        k = _pack(m, bits)
        buckets.setdefault(k & odd, []).append((k, v))
    Pk = [(_pack(m, bits), u) for m, u in P.items()]
    if budget is not None:
        budget.charge(sum(len(buckets.get(a & odd, ())) for a, _ in Pk))
    moments: dict[int, int] = {}
    total = 0
    for a, u in Pk:
        acc = 0
        for b, v in buckets.get(a & odd, ()):
            k = a + b
            mom = moments.get(k)
            if mom is None:
                mom = moments[k] = gaussian_moment(_unpack(k, bits, d))
            acc += v * mom
        total += u * acc
    return Fraction(total, dp * dq)
