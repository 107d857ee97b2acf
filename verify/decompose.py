"""Independent checks of ``tensoralg.decompose`` by exact polynomial expansion.

Everything here starts from [`tensoralg.verify.certify.expand`][verify.certify.expand] (the network
written out as explicit polynomials with rational coefficients; floats taken exactly) and never
calls tensoralg's inner products, Gram matrices, chaos extraction or tensor networks:

* [`check_decomposition_exact`][verify.decompose.check_decomposition_exact] —
  ``||f - sum_i g_i||^2`` from the difference polynomial (Gaussian moments
  ``E[x^alpha] = prod (alpha_i - 1)!!``), the Gram matrix of ``(f, g_1, ...)`` monomial by monomial,
  and the symmetrized-Frobenius residual of the lifted coefficient tensors
  (``<Sym T_a, Sym T_b> = sum_beta m_a m_b beta! / n!`` over monomials ``x~^beta`` of the lifted
  degree ``n``, ``beta_0 = n - |alpha|``).
* [`hermite_expansion`][verify.decompose.hermite_expansion] — the coefficients of a polynomial in
  the multivariate Hermite basis ``He_beta(x) = prod_i He_{beta_i}(x_i)`` from
  ``x^n = sum_j n! / (j! (n-2j)! 2^j) He_{n-2j}(x)`` (the inverse Hermite expansion of a power), and
  [`chaos_coefficients`][verify.decompose.chaos_coefficients] — the tensors ``C0, C1, C2`` of
  docs/mathematics.md §3.6 for a degree-<=2 output (``C2[i,i] = h_{2e_i}``,
  ``C2[i,j] = h_{e_i+e_j} / 2``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import product
from typing import Any

from ._poly import Budget, Poly, add_scaled, gaussian_inner
from .certify import DEFAULT_MAX_MONOMIALS, DEFAULT_MAX_WORK, _network, _select_output, expand

__all__ = ["check_decomposition_exact", "ExactDecompositionCheck", "hermite_expansion",
           "chaos_coefficients"]


@dataclass
class ExactDecompositionCheck:
    """Result of [`check_decomposition_exact`][verify.decompose.check_decomposition_exact] (all
    numbers are Fractions).

    ``equal``: every coefficient of ``f - sum g_i`` is zero (a polynomial identity);
    ``residual``: ``||f - sum g_i||^2`` (Gaussian); ``residual_frobenius``: the same in the
    symmetrized Frobenius metric (``None`` when the lifted degrees differ); ``gram``: the
    Gaussian Gram matrix of ``(f, g_1, ..., g_n)`` as nested lists.
    """

    equal: bool
    residual: Fraction
    residual_frobenius: Fraction | None
    gram: list[list[Fraction]]


def _frobenius(p: Poly, q: Poly, n: int) -> Fraction:
    """``<Sym T_p, Sym T_q>_F`` for lifted coefficient tensors of order ``n``."""
    total = Fraction(0)
    for alpha, a in p.items():
        b = q.get(alpha)
        if b:
            beta = [n - sum(alpha)] + list(alpha)
            if beta[0] < 0:
                raise ValueError(f"a monomial of degree {sum(alpha)} above the lifted order {n}")
            total += a * b * math.prod(math.factorial(k) for k in beta) / math.factorial(n)
    return total


def check_decomposition_exact(model: Any, components: Sequence[Any], *, output: Any = None,
                              max_monomials: int = DEFAULT_MAX_MONOMIALS,
                              max_work: int = DEFAULT_MAX_WORK) -> ExactDecompositionCheck:
    """Exact residual and Gram matrix of a decomposition ``f = sum_i g_i`` by expansion.

    Args:
        model, components: networks with the same input and output sizes.
        output: ``None`` (all outputs), a class index or a direction vector.
        max_monomials, max_work: size limits of
            [`tensoralg.verify.certify.expand`][verify.certify.expand].

    Raises:
        ValueError: no components, differing sizes; ExpansionTooLarge over the limits.
    """
    f = _network(model, "model")
    comps = [_network(g, f"components[{i}]") for i, g in enumerate(components)]
    if not comps:
        raise ValueError("components: expected at least one component network")
    for i, g in enumerate(comps):
        if (g.in_features, g.out_features) != (f.in_features, f.out_features):
            raise ValueError(f"components[{i}]: sizes {g.in_features} -> {g.out_features} differ "
                             f"from the model's {f.in_features} -> {f.out_features}")
    nets = [f] + comps
    O = f.out_features
    _select_output([{}] * O, output, O)
    polys = [_select_output(expand(n, max_monomials=max_monomials, max_work=max_work,
                                   name=f"net{i}"), output, O) for i, n in enumerate(nets)]
    budget = Budget(max_work, "decomposition check")
    residual_polys = []
    for o in range(len(polys[0])):
        r = dict(polys[0][o])
        for p in polys[1:]:
            add_scaled(r, p[o], Fraction(-1))
        residual_polys.append(r)
    residual = sum((gaussian_inner(r, r, budget) for r in residual_polys), Fraction(0))
    gram = [[sum((gaussian_inner(p, q, budget) for p, q in zip(pi, pj)), Fraction(0))
             for pj in polys] for pi in polys]
    degrees = {n.degree for n in nets}
    res_f = None
    if len(degrees) == 1:
        n = degrees.pop()
        res_f = sum((_frobenius(r, r, n) for r in residual_polys), Fraction(0))
    equal = not any(residual_polys)
    if equal != (residual == 0):  # pragma: no cover - would be a bug in the moments
        raise AssertionError("internal error: polynomial identity and Gaussian residual disagree")
    return ExactDecompositionCheck(equal, residual, res_f, gram)


def _power_in_hermite(n: int) -> dict[int, Fraction]:
    """``x^n = sum_j n! / (j! (n-2j)! 2^j) He_{n-2j}(x)`` (probabilists' Hermite)."""
    return {n - 2 * j: Fraction(math.factorial(n),
                                math.factorial(j) * math.factorial(n - 2 * j) * 2 ** j)
            for j in range(n // 2 + 1)}


def hermite_expansion(p: Poly) -> Poly:
    """Coefficients ``h_beta`` of ``p = sum_beta h_beta He_beta(x)`` (exact)."""
    out: Poly = {}
    for alpha, c in p.items():
        parts = [list(_power_in_hermite(k).items()) for k in alpha]
        for choice in product(*parts):
            beta = tuple(b for b, _ in choice)
            add_scaled(out, {beta: math.prod((w for _, w in choice), start=Fraction(1))}, c)
    return out


def chaos_coefficients(net: Any, output: Any = 0, *, max_monomials: int = DEFAULT_MAX_MONOMIALS,
                       max_work: int = DEFAULT_MAX_WORK):
    """``(C0, C1, C2)`` of one output (class index or direction) of a degree-<=2 network, as a
    Fraction, a list of ``d`` Fractions and a ``d x d`` nested list, by expansion.

    Raises:
        ValueError: an output of degree above 2, a bad ``output``.
    """
    net = _network(net, "net")
    if output is None or (isinstance(output, str)):
        raise ValueError("output: expected a class index or a direction vector")
    d, O = net.in_features, net.out_features
    (poly,) = _select_output(expand(net, max_monomials=max_monomials, max_work=max_work),
                             output, O)
    h = hermite_expansion(poly)
    if any(sum(b) > 2 for b in h):
        raise ValueError("net: the output has degree above 2; chaos_coefficients covers degree "
                         "<= 2 (depth-1 networks)")
    zero = (0,) * d

    def e(*idx):
        b = [0] * d
        for i in idx:
            b[i] += 1
        return tuple(b)

    C0 = h.get(zero, Fraction(0))
    C1 = [h.get(e(i), Fraction(0)) for i in range(d)]
    C2 = [[h.get(e(i, j), Fraction(0)) * (1 if i == j else Fraction(1, 2)) for j in range(d)]
          for i in range(d)]
    return C0, C1, C2
