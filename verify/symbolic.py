"""Symbolic (sympy) proofs of tensoralg's identities on small cases.

Each ``prove_*`` function checks one identity of ``docs/gaussian_inner_product.md`` with fully symbolic tensors /
weights (so a pass is a proof for *every* value of the entries at that size) and returns a
[`ProofResult`][verify.symbolic.ProofResult] ``(name, sizes, passed, seconds, checked, detail)``.
Nothing here calls
tensoralg: expectations come from sympy integration of the standard normal density, matchings
from a recursive enumeration written here.

Gaussian expectations: ``E[x^alpha]`` for ``x ~ N(0, I_d)`` is the iterated integral
``int x^alpha (2 pi)^{-d/2} exp(-|x|^2/2) dx``; the density factorizes, so by Fubini it is the
product of the one-dimensional integrals ``int t^k exp(-t^2/2) dt / sqrt(2 pi)``, each done by
``sympy.integrate`` (and cached).

Run them all with ``python -m tensoralg.verify`` (``--quick`` for the small sizes).

Sources: Isserlis, "On a formula for the product-moment coefficient of any order of a normal
frequency distribution in any number of variables", Biometrika 12 (1918) (Wick's theorem in
physics); the polarization identity for symmetric multilinear forms (e.g. E. Thomas, "A
polarization identity for multilinear maps", Indag. Math. 25 (2014)); the lifted partial-matching
rule, the single-layer Gram closed form and the invariances are in docs/gaussian_inner_product.md.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import cache

import sympy as sp

__all__ = [
    "ProofResult", "perfect_matchings", "partial_matchings", "gaussian_moment_1d",
    "expectation", "prove_polarization", "prove_isserlis", "prove_isserlis_covariance",
    "prove_lifted_isserlis", "prove_noncentred_isserlis", "prove_one_plus_x_squared",
    "prove_gram_closed_form", "prove_hidden_permutation", "prove_left_right_swap",
    "prove_rescaling", "prove_bond_gauge", "run_all", "format_table",
]


@dataclass
class ProofResult:
    """Outcome of one symbolic check.

    Attributes:
        name: identity checked.
        sizes: the small case, e.g. ``{"n": 4, "d": 3}``.
        passed: True iff every instance of the identity held exactly.
        seconds: wall time.
        checked: number of exact equalities verified.
        detail: a one-line summary (the first failure when ``passed`` is False).
    """

    name: str
    sizes: dict[str, int]
    passed: bool
    seconds: float
    checked: int = 0
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class _Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


# ----------------------------------------------------------------------------------------
# matchings (enumerated from the definition; independent of tensoralg.strategies.wick)
# ----------------------------------------------------------------------------------------

def perfect_matchings(items: Sequence) -> Iterator[list[tuple]]:
    """All perfect matchings of ``items`` (lists of pairs); none when ``len(items)`` is odd.

    There are ``(n - 1)!!`` of them for even ``n``.
    """
    items = list(items)
    if not items:
        yield []
        return
    if len(items) % 2:
        return
    first, rest = items[0], items[1:]
    for j in range(len(rest)):
        pair = (first, rest[j])
        for m in perfect_matchings(rest[:j] + rest[j + 1:]):
            yield [pair] + m


def partial_matchings(items: Sequence) -> Iterator[tuple[list[tuple], list]]:
    """All partial matchings of ``items`` as ``(pairs, singletons)``.

    Their number is the telephone number ``T(n)``: 1, 1, 2, 4, 10, 26, 76, ...
    """
    items = list(items)
    if not items:
        yield [], []
        return
    first, rest = items[0], items[1:]
    for pairs, singles in partial_matchings(rest):  # ``first`` unmatched
        yield pairs, [first] + singles
    for j in range(len(rest)):
        for pairs, singles in partial_matchings(rest[:j] + rest[j + 1:]):
            yield [(first, rest[j])] + pairs, singles


# ----------------------------------------------------------------------------------------
# Gaussian expectations by integration
# ----------------------------------------------------------------------------------------

_t = sp.Symbol("t", real=True)


@cache
def gaussian_moment_1d(k: int) -> sp.Expr:
    """``E[t^k]`` for ``t ~ N(0, 1)`` by ``sympy.integrate`` of ``t^k exp(-t^2/2)/sqrt(2 pi)``."""
    val = sp.integrate(_t ** k * sp.exp(-_t ** 2 / 2), (_t, -sp.oo, sp.oo)) / sp.sqrt(2 * sp.pi)
    return sp.nsimplify(sp.simplify(val))


def _moment(alpha: Sequence[int]) -> sp.Expr:
    out = sp.Integer(1)
    for k in alpha:
        out *= gaussian_moment_1d(int(k))
        if out == 0:
            return out
    return out


def expectation(expr: sp.Expr, xs: Sequence[sp.Symbol]) -> sp.Expr:
    """``E[expr]`` over ``xs ~ N(0, I)`` (independent standard normals), other symbols held fixed.

    ``expr`` is expanded as a polynomial in ``xs``; each monomial's expectation is the product
    of one-dimensional Gaussian integrals (Fubini on the product density).
    """
    poly = sp.Poly(sp.expand(expr), *xs)
    return sp.expand(sum((c * _moment(m) for m, c in poly.terms()), sp.Integer(0)))


def _ok(expr) -> bool:
    return sp.expand(expr) == 0


# ----------------------------------------------------------------------------------------
# 1. polarization
# ----------------------------------------------------------------------------------------

def prove_polarization(n: int = 3, d: int = 2) -> ProofResult:
    """Polarization for a fully symbolic order-``n`` tensor ``T`` on ``R^d``.

    Checks, for ``p_T(x) = sum_i T[i] x_{i1}...x_{in}``:

    (a) ``p_T == p_{Sym T}``: the polynomial sees only the symmetrization;
    (b) the polarization formula ``Sym(T)[i] = 1/(n! 2^n) sum_{eps in {+-1}^n} eps_1..eps_n
        p_T(eps_1 e_{i1} + ... + eps_n e_{in})`` recovers every entry of ``Sym T`` from ``p_T``;
    (c) the coefficient of ``x^alpha`` in ``p_T`` is ``multinomial(alpha) * Sym(T)[i(alpha)]``,
        so ``T -> p_T`` has kernel exactly ``ker Sym``: two tensors give the same polynomial iff
        their symmetrizations agree (shown also on a transposed copy ``S != T`` with
        ``p_S == p_T``).
    """
    with _Timer() as tm:
        xs = sp.symbols(f"x1:{d + 1}")
        idx = list(itertools.product(range(d), repeat=n))
        T = {i: sp.Symbol("t_" + "".join(map(str, i))) for i in idx}
        perms = list(itertools.permutations(range(n)))
        sym = {i: sp.Add(*[T[tuple(i[p] for p in s)] for s in perms]) / math.factorial(n)
               for i in idx}

        def poly_of(ten):
            return sp.expand(sp.Add(*[ten[i] * sp.Mul(*[xs[k] for k in i]) for i in idx]))

        pT = poly_of(T)
        checked, fail = 0, ""
        # (a)
        checked += 1
        if not _ok(pT - poly_of(sym)):
            fail = fail or "(a) p_T != p_SymT"
        # (b) polarization formula at sums of signed basis vectors
        P = sp.Poly(pT, *xs)
        cache: dict[tuple[int, ...], sp.Expr] = {}

        def p_at(v):
            if v not in cache:
                cache[v] = P.eval(dict(zip(xs, v))) if d > 1 else P.eval(v[0])
            return cache[v]

        for i in idx:
            total = sp.Integer(0)
            for eps in itertools.product((1, -1), repeat=n):
                v = [0] * d
                for e, k in zip(eps, i):
                    v[k] += e
                total += math.prod(eps) * p_at(tuple(v))
            checked += 1
            if not _ok(total / (math.factorial(n) * 2 ** n) - sym[i]):
                fail = fail or f"(b) polarization fails at index {i}"
        # (c) coefficients = multinomial * Sym(T)
        for alpha, c in P.terms():
            i = tuple(k for k, a in enumerate(alpha) for _ in range(a))
            multinom = math.factorial(n) // math.prod(math.factorial(a) for a in alpha)
            checked += 1
            if not _ok(c - multinom * sym[i]):
                fail = fail or f"(c) coefficient of x^{alpha} != multinomial * Sym(T)"
        # a non-symmetric S (T with its first two legs swapped) with the same polynomial
        if n >= 2:
            S = {i: T[(i[1], i[0]) + i[2:]] for i in idx}
            checked += 1
            if not _ok(poly_of(S) - pT):
                fail = fail or "(c) transposed tensor changes the polynomial"
    return ProofResult("polarization", {"n": n, "d": d}, not fail, tm.seconds, checked,
                       fail or f"p_T = p_SymT; polarization recovers all {len(idx)} entries")


# ----------------------------------------------------------------------------------------
# 2. Isserlis, centred
# ----------------------------------------------------------------------------------------

def prove_isserlis(max_order: int = 6, d: int = 3) -> ProofResult:
    """Isserlis / Wick for ``x ~ N(0, I_d)``: for every index tuple ``i`` of length 1..max_order,
    ``E[x_{i1}...x_{in}]`` (integration) ``== sum over perfect matchings of prod delta``
    (zero for odd ``n``)."""
    with _Timer() as tm:
        checked, fail = 0, ""
        for n in range(1, max_order + 1):
            n_match = sum(1 for _ in perfect_matchings(range(n)))
            expect_count = 0 if n % 2 else math.prod(range(n - 1, 0, -2))
            if n_match != expect_count:
                fail = fail or f"{n_match} perfect matchings of {n} legs, expected (n-1)!!"
            for i in itertools.product(range(d), repeat=n):
                alpha = [i.count(k) for k in range(d)]
                lhs = _moment(alpha)
                rhs = sum(all(i[a] == i[b] for a, b in m) for m in perfect_matchings(range(n)))
                checked += 1
                if lhs != rhs:
                    fail = fail or f"index {i}: integral {lhs} != matching sum {rhs}"
    return ProofResult("isserlis_centred", {"max_order": max_order, "d": d}, not fail, tm.seconds,
                       checked, fail or f"all {checked} index tuples agree")


def _cholesky_symbols(d: int, name: str = "c"):
    """Lower-triangular symbolic ``C`` (positive diagonal): every covariance is ``C C^T``."""
    C = sp.zeros(d, d)
    for i in range(d):
        for j in range(i + 1):
            C[i, j] = sp.Symbol(f"{name}{i}{j}", positive=(i == j), real=True)
    return C


def prove_isserlis_covariance(order: int = 4, d: int = 2) -> ProofResult:
    """Isserlis with a general covariance: ``x = C z``, ``z ~ N(0, I)``, ``Sigma = C C^T`` with
    symbolic ``C`` (Cholesky: every positive definite ``Sigma`` is of this form, so the entries of
    ``Sigma`` are as general as free symbols, with positivity built in).  For every index tuple
    of length ``order`` (and 2), ``E[x_{i1}...x_{in}] == sum_matchings prod Sigma[i_a, i_b]``."""
    with _Timer() as tm:
        zs = sp.symbols(f"z1:{d + 1}")
        C = _cholesky_symbols(d)
        x = C * sp.Matrix(zs)
        Sigma = C * C.T
        checked, fail = 0, ""
        for n in sorted({2, order}):
            for i in itertools.product(range(d), repeat=n):
                lhs = expectation(sp.Mul(*[x[k] for k in i]), zs)
                rhs = sp.Add(*[sp.Mul(*[Sigma[i[a], i[b]] for a, b in m])
                               for m in perfect_matchings(range(n))])
                checked += 1
                if not _ok(lhs - rhs):
                    fail = fail or f"index {i}"
    return ProofResult("isserlis_covariance", {"order": order, "d": d}, not fail, tm.seconds,
                       checked, fail or "pairs bridged by Sigma (symbolic Sigma = C C^T)")


# ----------------------------------------------------------------------------------------
# 3. lifted and non-centred Isserlis
# ----------------------------------------------------------------------------------------

def _lifted_moment(i: Sequence[int], d: int) -> sp.Expr:
    """``E[x~_{i1} ... x~_{in}]`` for ``x~ = (1, x)``: the constant index 0 contributes 1."""
    return _moment([list(i).count(k + 1) for k in range(d)])


def prove_lifted_isserlis(max_order: int = 4, d: int = 2) -> ProofResult:
    """docs/mathematics.md §3.1: for ``x~ = (1, x)``, ``x ~ N(0, I_d)``, every index tuple over ``{0..d}`` of
    length 1..max_order satisfies ``E[prod x~_i] == sum over partial matchings of
    prod_pairs P[i_a, i_b] * prod_singletons e0[i_c]`` with ``P = diag(0, 1, ..., 1)``.

    Also counts the tuples where the naive perfect-matching rule with bridge
    ``E[x~ x~^T] = I`` fails (it must fail somewhere, e.g. ``(0, 0, 0, 0)``: 1 vs 3).
    """
    with _Timer() as tm:
        checked, fail, naive_wrong = 0, "", 0
        for n in range(1, max_order + 1):
            for i in itertools.product(range(d + 1), repeat=n):
                lhs = _lifted_moment(i, d)
                rhs = 0
                for pairs, singles in partial_matchings(range(n)):
                    if all(i[c] == 0 for c in singles) and all(
                            i[a] == i[b] != 0 for a, b in pairs):
                        rhs += 1
                naive = sum(all(i[a] == i[b] for a, b in m) for m in perfect_matchings(range(n)))
                naive_wrong += naive != lhs
                checked += 1
                if lhs != rhs:
                    fail = fail or f"index {i}: integral {lhs} != partial-matching sum {rhs}"
        if not naive_wrong:
            fail = fail or "the naive perfect-matching rule never failed (it should)"
    return ProofResult("isserlis_lifted", {"max_order": max_order, "d": d}, not fail, tm.seconds,
                       checked, fail or f"all {checked} tuples agree; naive rule wrong on "
                                         f"{naive_wrong}")


def prove_noncentred_isserlis(max_order: int = 4, d: int = 2) -> ProofResult:
    """``z ~ N(mu, Sigma)`` with symbolic ``mu`` and ``Sigma = C C^T``: for every index tuple of
    length 1..max_order, ``E[prod z_i] == sum over partial matchings of prod_pairs Sigma *
    prod_singletons mu`` (pairs bridged by the covariance, single legs capped by the mean)."""
    with _Timer() as tm:
        ws = sp.symbols(f"w1:{d + 1}")
        C = _cholesky_symbols(d)
        mu = sp.Matrix(sp.symbols(f"mu1:{d + 1}", real=True))
        z = mu + C * sp.Matrix(ws)
        Sigma = C * C.T
        checked, fail = 0, ""
        for n in range(1, max_order + 1):
            for i in itertools.product(range(d), repeat=n):
                lhs = expectation(sp.Mul(*[z[k] for k in i]), ws)
                rhs = sp.Add(*[sp.Mul(*[Sigma[i[a], i[b]] for a, b in pairs],
                                      *[mu[i[c]] for c in singles])
                               for pairs, singles in partial_matchings(range(n))])
                checked += 1
                if not _ok(lhs - rhs):
                    fail = fail or f"index {i}"
    return ProofResult("isserlis_noncentred", {"max_order": max_order, "d": d}, not fail,
                       tm.seconds, checked, fail or "pairs by Sigma, singletons by mu")


def one_plus_x_squared_values() -> dict[str, sp.Expr]:
    """``f(x) = (1 + x)^2``, ``x ~ N(0, 1)``: ``E[f^2]`` by integration, by the partial-matching
    rule (P bridges, e0 caps) and by the naive perfect-matching rule (bridge ``I``) on the four
    legs of ``f^2 = prod_{k=1..4} (v . x~)``, ``v = (1, 1)``."""
    x = sp.Symbol("x", real=True)
    integral = sp.integrate((1 + x) ** 4 * sp.exp(-x ** 2 / 2), (x, -sp.oo, sp.oo)) / sp.sqrt(
        2 * sp.pi)
    v = sp.Matrix([1, 1])
    P, e0, I2 = sp.diag(0, 1), sp.Matrix([1, 0]), sp.eye(2)
    vPv, ve0, vIv = (v.T * P * v)[0], (v.T * e0)[0], (v.T * I2 * v)[0]
    partial = sum(vPv ** len(p) * ve0 ** len(s) for p, s in partial_matchings(range(4)))
    naive = sum(vIv ** len(m) for m in perfect_matchings(range(4)))
    return {"integral": sp.simplify(integral), "partial_matchings": sp.Integer(partial),
            "naive_perfect_matchings": sp.Integer(naive)}


def prove_one_plus_x_squared() -> ProofResult:
    """The (1 + x)^2 trap: E[f^2] = 10 by integration and by the lifted rule; the naive
    perfect-matching sum that treats the constant as Gaussian gives 12."""
    with _Timer() as tm:
        v = one_plus_x_squared_values()
        ok = v["integral"] == 10 and v["partial_matchings"] == 10 and v[
            "naive_perfect_matchings"] == 12
    return ProofResult("one_plus_x_squared", {"d": 1}, ok, tm.seconds, 3,
                       f"integral {v['integral']}, partial matchings {v['partial_matchings']}, "
                       f"naive perfect matchings {v['naive_perfect_matchings']}")


# ----------------------------------------------------------------------------------------
# 4. single-layer Gram closed form
# ----------------------------------------------------------------------------------------

def _symbolic_bilinear(name: str, d: int, hidden: int, out: int):
    L = sp.Matrix(hidden, d + 1, lambda h, i: sp.Symbol(f"{name}L{h}{i}"))
    R = sp.Matrix(hidden, d + 1, lambda h, i: sp.Symbol(f"{name}R{h}{i}"))
    D = sp.Matrix(out, hidden, lambda o, h: sp.Symbol(f"{name}D{o}{h}"))
    return L, R, D


def _bilinear_poly(L, R, D, xt):
    """Outputs of the lifted bilinear layer ``D((L x~) * (R x~))`` as expressions."""
    lx, rx = L * xt, R * xt
    return [sp.Add(*[D[o, h] * lx[h] * rx[h] for h in range(L.rows)]) for o in range(D.rows)]


def gram_closed_form(La, Ra, Da, Lb, Rb, Db) -> sp.Expr:
    """docs/mathematics.md §3.1 closed form ``sum_{h,k} (Da^T Db)[h,k] E_hk`` for lifted factor rows
    (column 0 = constant entry)."""
    DtD = Da.T * Db
    total = sp.Integer(0)
    for h in range(La.rows):
        l0, r0 = La[h, 0], Ra[h, 0]
        lv, rv = La[h, 1:], Ra[h, 1:]
        for k in range(Lb.rows):
            m0, s0 = Lb[k, 0], Rb[k, 0]
            mv, sv = Lb[k, 1:], Rb[k, 1:]
            dot = lambda u, w: (u * w.T)[0]  # noqa: E731
            E = (l0 * r0 * m0 * s0
                 + dot(lv, rv) * m0 * s0 + l0 * r0 * dot(mv, sv)
                 + dot(lv, mv) * r0 * s0 + dot(lv, sv) * r0 * m0
                 + dot(rv, mv) * l0 * s0 + dot(rv, sv) * l0 * m0
                 + dot(lv, rv) * dot(mv, sv) + dot(lv, mv) * dot(rv, sv)
                 + dot(lv, sv) * dot(rv, mv))
            total += DtD[h, k] * E
    return total


def prove_gram_closed_form(d: int = 2, hidden_a: int = 2, hidden_b: int = 1, out: int = 1,
                           closed_form: Callable | None = None) -> ProofResult:
    """The single-layer Gram closed form of docs/mathematics.md §3.1 with fully symbolic ``L, R, D`` of both
    layers equals ``sum_o E[f_a(x)_o f_b(x)_o]`` computed by Gaussian integration.

    ``closed_form``: the formula under test, ``(La, Ra, Da, Lb, Rb, Db) -> expr`` (default
    [`gram_closed_form`][verify.symbolic.gram_closed_form]); pass another one to check it the same
    way."""
    closed_form = closed_form or gram_closed_form
    with _Timer() as tm:
        xs = sp.symbols(f"x1:{d + 1}")
        xt = sp.Matrix([1, *xs])
        La, Ra, Da = _symbolic_bilinear("a", d, hidden_a, out)
        Lb, Rb, Db = _symbolic_bilinear("b", d, hidden_b, out)
        fa, fb = _bilinear_poly(La, Ra, Da, xt), _bilinear_poly(Lb, Rb, Db, xt)
        direct = sum((expectation(p * q, xs) for p, q in zip(fa, fb)), sp.Integer(0))
        ok = _ok(direct - closed_form(La, Ra, Da, Lb, Rb, Db))
    return ProofResult("gram_closed_form",
                       {"d": d, "hidden_a": hidden_a, "hidden_b": hidden_b, "out": out}, ok,
                       tm.seconds, 1, "closed form == E[f_a f_b]" if ok else "mismatch")


# ----------------------------------------------------------------------------------------
# 5. invariances as polynomial identities
# ----------------------------------------------------------------------------------------

def prove_hidden_permutation(d: int = 2, hidden: int = 3, out: int = 1) -> ProofResult:
    """Permuting the hidden units (rows of L and R, columns of D) leaves ``f`` unchanged."""
    with _Timer() as tm:
        xt = sp.Matrix([1, *sp.symbols(f"x1:{d + 1}")])
        L, R, D = _symbolic_bilinear("", d, hidden, out)
        f = _bilinear_poly(L, R, D, xt)
        checked, fail = 0, ""
        for perm in itertools.permutations(range(hidden)):
            p = list(perm)
            g = _bilinear_poly(L.extract(p, list(range(d + 1))), R.extract(p, list(range(d + 1))),
                               D.extract(list(range(out)), p), xt)
            checked += 1
            if not all(_ok(u - v) for u, v in zip(f, g)):
                fail = fail or f"permutation {perm}"
    return ProofResult("inv_hidden_permutation", {"d": d, "hidden": hidden, "out": out},
                       not fail, tm.seconds, checked, fail or "f unchanged by all permutations")


def prove_left_right_swap(d: int = 2, hidden: int = 2, out: int = 1) -> ProofResult:
    """Swapping ``L_h`` and ``R_h`` for any subset of hidden units leaves ``f`` unchanged."""
    with _Timer() as tm:
        xt = sp.Matrix([1, *sp.symbols(f"x1:{d + 1}")])
        L, R, D = _symbolic_bilinear("", d, hidden, out)
        f = _bilinear_poly(L, R, D, xt)
        checked, fail = 0, ""
        for mask in itertools.product((False, True), repeat=hidden):
            L2, R2 = L.copy(), R.copy()
            for h, swap in enumerate(mask):
                if swap:
                    L2[h, :], R2[h, :] = R[h, :], L[h, :]
            checked += 1
            if not all(_ok(u - v) for u, v in zip(f, _bilinear_poly(L2, R2, D, xt))):
                fail = fail or f"swap mask {mask}"
    return ProofResult("inv_left_right_swap", {"d": d, "hidden": hidden, "out": out}, not fail,
                       tm.seconds, checked, fail or "f unchanged by every swap pattern")


def prove_rescaling(d: int = 2, hidden: int = 2, out: int = 1) -> ProofResult:
    """``L_h -> a_h L_h``, ``R_h -> b_h R_h``, ``D[:, h] -> D[:, h] / (a_h b_h)`` (symbolic nonzero
    ``a_h, b_h``) leaves ``f`` unchanged."""
    with _Timer() as tm:
        xt = sp.Matrix([1, *sp.symbols(f"x1:{d + 1}")])
        L, R, D = _symbolic_bilinear("", d, hidden, out)
        a = sp.symbols(f"alpha0:{hidden}", nonzero=True)
        b = sp.symbols(f"beta0:{hidden}", nonzero=True)
        L2 = sp.Matrix(hidden, d + 1, lambda h, i: a[h] * L[h, i])
        R2 = sp.Matrix(hidden, d + 1, lambda h, i: b[h] * R[h, i])
        D2 = sp.Matrix(out, hidden, lambda o, h: D[o, h] / (a[h] * b[h]))
        f, g = _bilinear_poly(L, R, D, xt), _bilinear_poly(L2, R2, D2, xt)
        ok = all(sp.cancel(sp.expand(u - v)) == 0 for u, v in zip(f, g))
    return ProofResult("inv_rescaling", {"d": d, "hidden": hidden, "out": out}, ok, tm.seconds,
                       out, "f unchanged" if ok else "mismatch")


def prove_bond_gauge(d: int = 1, bond: int = 2, hidden1: int = 2, hidden2: int = 1) -> ProofResult:
    """Gauge on the bond between two bilinear layers: with a symbolic invertible ``G``
    (``bond x bond``), ``D1 -> G D1``, ``d1 -> G d1``, ``L2 -> L2 G^-1``, ``R2 -> R2 G^-1``
    leaves the depth-2 function unchanged (biases of layer 2 untouched).  Also the linear case
    ``W2 W1 = (W2 G^-1)(G W1)``."""
    with _Timer() as tm:
        xs = sp.symbols(f"x1:{d + 1}")
        xt = sp.Matrix([1, *xs])
        G = sp.Matrix(bond, bond, lambda i, j: sp.Symbol(f"g{i}{j}"))
        Ginv = G.inv()
        L1, R1, D1 = _symbolic_bilinear("p", d, hidden1, bond)
        d1 = sp.Matrix(bond, 1, lambda i, _: sp.Symbol(f"pd{i}"))
        L2, R2, D2 = _symbolic_bilinear("q", bond, hidden2, 1)

        def net(D1_, d1_, L2_, R2_):
            y = sp.Matrix(_bilinear_poly(L1, R1, D1_, xt)) + d1_
            return _bilinear_poly(L2_, R2_, D2, sp.Matrix([1, *y]))

        def bond_map(M):  # lifted rows: column 0 (bias) unchanged, the rest times G^-1
            return sp.Matrix.hstack(M[:, 0], M[:, 1:] * Ginv)

        f = net(D1, d1, L2, R2)
        g = net(G * D1, G * d1, bond_map(L2), bond_map(R2))
        ok = all(sp.cancel(sp.together(u - v)) == 0 for u, v in zip(f, g))
        W1 = sp.Matrix(bond, d, lambda i, j: sp.Symbol(f"w{i}{j}"))
        W2 = sp.Matrix(1, bond, lambda i, j: sp.Symbol(f"v{i}{j}"))
        x = sp.Matrix(xs)
        ok_lin = sp.simplify(W2 * W1 * x - (W2 * Ginv) * (G * W1) * x) == sp.zeros(1, 1)
    return ProofResult("inv_bond_gauge",
                       {"d": d, "bond": bond, "hidden1": hidden1, "hidden2": hidden2},
                       bool(ok and ok_lin), tm.seconds, 2,
                       "depth-2 bilinear and linear bonds gauge invariant" if ok and ok_lin
                       else f"bilinear ok={ok}, linear ok={ok_lin}")


# ----------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------

def _suite(quick: bool) -> list[tuple[str, Callable[[], ProofResult]]]:
    pol = [(n, d) for n in range(1, 5) for d in range(1, 4)]
    if quick:
        pol = [(2, 3), (3, 2), (4, 2)]
    suite: list[tuple[str, Callable[[], ProofResult]]] = [
        (f"polarization n={n} d={d}", (lambda n=n, d=d: prove_polarization(n, d))) for n, d in pol]
    suite += [
        ("isserlis", lambda: prove_isserlis(4 if quick else 6, 2 if quick else 3)),
        ("isserlis_covariance", lambda: prove_isserlis_covariance(4, 2 if quick else 3)),
        ("isserlis_lifted", lambda: prove_lifted_isserlis(4 if quick else 6, 2 if quick else 3)),
        ("isserlis_noncentred", lambda: prove_noncentred_isserlis(4, 2 if quick else 3)),
        ("one_plus_x_squared", prove_one_plus_x_squared),
    ]
    gram = [(1, 1), (2, 1)] if quick else [(1, 1), (2, 1), (2, 2)]
    suite += [(f"gram {ha}x{hb}", (lambda ha=ha, hb=hb: prove_gram_closed_form(2, ha, hb, 1)))
              for ha, hb in gram]
    if not quick:
        suite.append(("gram 2x2 out=2", lambda: prove_gram_closed_form(2, 2, 2, 2)))
    suite += [
        ("hidden_permutation", lambda: prove_hidden_permutation(2, 3, 1)),
        ("left_right_swap", lambda: prove_left_right_swap(2, 2, 1)),
        ("rescaling", lambda: prove_rescaling(2, 2, 1)),
        ("bond_gauge", lambda: prove_bond_gauge(1 if quick else 2, 2, 2, 1)),
    ]
    return suite


def run_all(quick: bool = False, only: str | None = None,
            progress: Callable[[ProofResult], None] | None = None) -> list[ProofResult]:
    """Run every proof at the default small sizes (``quick``: smaller sizes, under a minute).

    ``only``: run the checks whose label contains this substring.  A check that raises is
    reported as failed with the exception in ``detail``.
    """
    results = []
    for label, fn in _suite(quick):
        if only and only not in label:
            continue
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as exc:  # report, never crash the table
            r = ProofResult(label, {}, False, time.perf_counter() - t0, 0,
                            f"raised {type(exc).__name__}: {exc}")
        results.append(r)
        if progress is not None:
            progress(r)
    return results


def format_table(results: Sequence[ProofResult]) -> str:
    """A plain-text table of results."""
    rows = [("identity", "sizes", "result", "checked", "seconds", "detail")]
    for r in results:
        sizes = " ".join(f"{k}={v}" for k, v in r.sizes.items())
        rows.append((r.name, sizes, "PASS" if r.passed else "FAIL", str(r.checked),
                     f"{r.seconds:.2f}", r.detail))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    lines = ["  ".join(row[c].ljust(widths[c]) for c in range(5)) + "  " + row[5] for row in rows]
    lines.insert(1, "-" * (sum(widths) + 2 * 5 + 6))
    return "\n".join(lines)
