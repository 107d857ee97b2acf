"""Exact Gaussian inner products of terms that feed terms: two-node trees of a sequence model
(docs/mathematics.md §3.10, "Terms that feed terms"; docs/decompose.md, "Transformer paths").

A *two-node term* is one leg of an outer attention term reading the output of an inner term
instead of the lifted input: `compose` writes it as one `tensoralg.canonical.Term`
whose legs all read the lifted input ``x~_p = (1, x_p)`` again — the outer term's other legs, the
inner term's legs (its query position identified with the outer leg's position, its key
position a new summed position variable), and a core ``W_leg[..., 1:] (x) O_inner`` joining the
two (the outer leg's non-constant columns applied to the inner output: the leg's constant
column reads the lifted 1 of the first-order path, not the composition). A term of an
attention head composed into a leg of a later head has ``4 + 5 = 9`` legs.

Inner products (`FeatureChaos`, `feature_inner`): the chaos (Hermite) expansion over the
``N = n_ctx * d`` input variables ``xi = (position, feature)`` (docs/mathematics.md §3.6, here
with positions). Every leg is an affine form ``c + sum_xi w_xi x_xi`` of those variables (its
lifted constant is the same 1 at every position), so one einsum of the term's cores and its
legs gives the dense *lifted* coefficient tensor ``T[t, o, phi_1..phi_L]`` (``phi`` in
``0..N``, 0 the constant); summing the entries of each multiset of non-constant indices gives
the monomial coefficients ``c[t, o, alpha]`` (``|alpha| <= L``), and per variable
``x^n = sum_m n! / (m! (n - 2m)! 2^m) He_{n-2m}(x)`` turns them into tensor Hermite
coefficients ``a[t, o, beta]``. Hermite polynomials are orthogonal under the Gaussian with
``E[He_beta^2] = beta!``, so

    <g_a, g_b> = sum_{t, o} sum_beta a[t, o, beta] b[t, o, beta] beta!

No Wick matchings and no sum over leg bijections (a pair of 9-leg terms would need
``sum_k C(9,k)^2 k!`` = 1.8e7 of them in leg space, `chaos_pair`), at the price of a dense
tensor of ``d_out (N + 1)^L`` entries per query position: the cost is polynomial in ``N`` and
exponential in the degree (``L = 9`` for two attention heads), like the position-free chaos.
Measured and modelled in docs/decompose.md ("Transformer paths"). `estimate` gives memory and
FLOPs from shapes before any work; `check` refuses over budget (`CostTooHigh`, naming the
alternatives).
"""

from __future__ import annotations

import functools
import itertools
import math
from fractions import Fraction
from typing import Any

import numpy as np
import opt_einsum as oe

from ...canonical import KEY, OUTPUT, QUERY, Leg, Term
from ...errors import CostTooHigh

__all__ = ["compose", "FeatureChaos", "feature_inner", "estimate", "check", "LEG_POSITION",
           "ALTERNATIVES"]

#: The position variable each attention leg reads (docs/mathematics.md §3.7).
LEG_POSITION = {"Q1": QUERY, "Q2": QUERY, "K1": KEY, "K2": KEY, "V": KEY}

#: What to use when a two-node inner product is over budget.
ALTERNATIVES = ("Alternatives: Monte Carlo on the path networks (tensoralg.inner / "
                "diff_norm with method='montecarlo': an estimate with its standard error and "
                "verdict), the exact first-order paths (paths(..., order=1)), a shorter n_ctx "
                "or a narrower slice of the model, or raise max_flops / max_memory")

_INNER = "i"    # prefix of the inner term's labels inside a composed term
_WIRE = "iw"    # the label joining the outer leg's core and the inner term's output


def _inner_label(x: str, p: str) -> str:
    """The inner term's label ``x`` inside the composed term: its query position becomes the
    outer leg's position ``p``; every other label gets the prefix ``i`` (its key position a new
    summed position variable ``is``), its output the wire."""
    if x == QUERY:
        return p
    if x == OUTPUT:
        return _WIRE
    return _INNER + x


def compose(outer: Term, leg: str, inner: Term, pre: np.ndarray | None = None) -> Term:
    """The two-node term ``outer[leg <- inner]`` as one `Term` whose legs all read the lifted
    input.

    Args:
        outer: an attention term (legs ``Q1, K1, Q2, K2, V``, `tensoralg.canonical`) whose legs
            read the lifted residual stream ``(1, h)`` (width ``m + 1``).
        leg: the outer leg that reads the inner term (``"Q1"``, ``"K1"``, ``"Q2"``, ``"K2"``,
            ``"V"``).
        inner: a term of a sequence node whose legs read the lifted input ``(1, x)`` and whose
            output (label ``o``, size ``m``) is written to the stream; its query position
            becomes the outer leg's position.
        pre: ``(m + 1, d + 1)`` lifted map of the stream from the lifted input (the
            embedding), applied to the outer term's other legs; None when the stream is the
            input.

    Returns:
        a `Term` of degree ``outer.degree - 1 + inner.degree``, output ``(t, o)`` as ``outer``.

    Raises:
        ValueError: an unknown leg, or shapes that do not chain (``inner``'s output size is
            not the stream width the outer legs read).
    """
    names = [x.name for x in outer.legs]
    if leg not in names:
        raise ValueError(f"leg: expected one of {names}, got {leg!r}")
    L = outer.legs[names.index(leg)]
    p = L.pos or QUERY
    m = L.weight.shape[-1] - 1
    where = [k for k, (_, lab) in enumerate(inner.cores) if OUTPUT in lab]
    out_size = (inner.cores[where[0]][0].shape[inner.cores[where[0]][1].index(OUTPUT)]
                if where else next(x.weight.shape[x.labels.index(OUTPUT)
                                                   + (1 if x.positional else 0)]
                                   for x in inner.legs if OUTPUT in x.labels))
    if out_size != m:
        raise ValueError(f"inner: writes {out_size} features, the outer leg {leg} reads a stream "
                         f"of {m}")
    legs = []
    for x in outer.legs:
        if x is L:
            continue
        w = x.weight if pre is None else x.weight @ pre
        legs.append(Leg(x.name, w, x.labels, x.pos, x.positional))
    for x in inner.legs:
        legs.append(Leg(_INNER + x.name, x.weight, tuple(_inner_label(y, p) for y in x.labels),
                        _inner_label(x.pos or QUERY, p), x.positional))
    cores = list(outer.cores)
    cores += [(arr, tuple(_inner_label(y, p) for y in lab)) for arr, lab in inner.cores]
    core_lab = ((p,) if L.positional else ()) + L.labels + (_WIRE,)
    cores.append((L.weight[..., 1:], core_lab))
    return Term("composed", tuple(legs), tuple(cores), outer.out)


# ----------------------------------------------------------------------------------------
# feature-space chaos
# ----------------------------------------------------------------------------------------

def _lifted_leg(leg: Leg, n: int, d: int, exact: bool) -> tuple:
    """``(F, labels)``: the leg as an affine form of the ``N = n d`` input variables,
    ``F[p, *labels, 0]`` its constant (the lifted 1, the same at every position) and
    ``F[p, *labels, 1 + p' d + i] = delta(p, p') w[(p), *labels, 1 + i]``; labels
    ``(pos, *leg.labels)`` and one axis of size ``N + 1``."""
    w = leg.weight
    lab_shape = w.shape[1 if leg.positional else 0:-1]
    F = np.zeros((n,) + lab_shape + (n * d + 1,), dtype=object if exact else np.float64)
    if exact:
        F.fill(Fraction(0))
    for p in range(n):
        wp = w[p] if leg.positional else w
        F[p, ..., 0] = wp[..., 0]
        F[p, ..., 1 + p * d:1 + (p + 1) * d] = wp[..., 1:]
    return F, ((leg.pos or QUERY),) + leg.labels


def _lifted_expression(term: Term, n: int, d: int, exact: bool, t: int):
    """``(subscripts, operands)`` of the dense lifted coefficient tensor
    ``T[o, phi_1..phi_L]`` of one term at query position ``t`` (``phi`` in ``0..N``, 0 the
    constant): one query position at a time bounds the memory by ``d_out (N + 1)^L``."""
    one, zero = (Fraction(1), Fraction(0)) if exact else (1.0, 0.0)
    sel = np.full(n, zero, dtype=object if exact else np.float64)
    sel[t] = one
    ops = [sel]
    labs = [(QUERY,)]
    for arr, lb in term.cores:
        ops.append(arr)
        labs.append(lb)
    for j, leg in enumerate(term.legs):
        F, lb = _lifted_leg(leg, n, d, exact)
        ops.append(F)
        labs.append(lb + (f"#phi{j}",))
    out = (OUTPUT,) + tuple(f"#phi{j}" for j in range(len(term.legs)))
    syms: dict = {}
    for lb in labs + [out]:
        for x in lb:
            syms.setdefault(x, oe.get_symbol(len(syms)))
    ops2, subs = [], []
    for arr, lb in zip(ops, labs):
        u = tuple(dict.fromkeys(lb))
        if len(u) != len(lb):   # a repeated label: its diagonal
            arr = np.einsum("".join(syms[x] for x in lb) + "->" + "".join(syms[x] for x in u),
                            arr)
        ops2.append(arr)
        subs.append("".join(syms[x] for x in u))
    expr = ",".join(subs) + "->" + "".join(syms[x] for x in out if x in syms)
    return expr, ops2


@functools.lru_cache(maxsize=8)
def _monomials(N: int, K: int):
    """The exponent vectors ``alpha`` (``|alpha| <= K``) of ``N`` variables: ``(exps (M, N)
    int, index {tuple: row})``, graded by degree."""
    rows = [np.zeros(N, dtype=np.int64)]
    for k in range(1, K + 1):
        for c in itertools.combinations_with_replacement(range(N), k):
            a = np.zeros(N, dtype=np.int64)
            for v in c:
                a[v] += 1
            rows.append(a)
    E = np.array(rows)
    return E, {tuple(r): i for i, r in enumerate(E.tolist())}


@functools.lru_cache(maxsize=8)
def _slot_ids(N: int, L: int, K: int) -> np.ndarray:
    """For every index tuple of ``range(N + 1)**L`` (row-major; 0 the constant slot) the row
    of its monomial (the multiset of its non-zero entries) in `_monomials` ``(N, K)``."""
    E, _ = _monomials(N, K)
    # each exponent vector as one integer in base K + 1: additive over the slots, so the code
    # of every index tuple is a broadcast sum of one vector per slot
    if (K + 1) ** N >= 2 ** 62:
        raise ValueError(f"_slot_ids: {N} variables at degree {K} overflow the int64 codes")
    slot = np.array([0] + [(K + 1) ** v for v in range(N)], dtype=np.int64)
    code = np.zeros((1,) * 0, dtype=np.int64)
    for _ in range(L):
        code = np.add.outer(code, slot)
    code = code.reshape(-1)
    ecode = E @ np.array(slot[1:], dtype=np.int64)
    if (K + 1) ** N <= 10 ** 8:   # a lookup table of every code
        table = np.zeros((K + 1) ** N, dtype=np.int64)
        table[ecode] = np.arange(len(ecode))
        ids = table[code]
    else:
        order = np.argsort(ecode)
        ids = order[np.searchsorted(ecode[order], code)]
    ids.setflags(write=False)
    return ids


@functools.lru_cache(maxsize=8)
def _hermite(N: int, K: int):
    """``(H, norms)``: ``x^alpha = sum_beta H[alpha, beta] He_beta(x)`` (per variable
    ``x^n = sum_m n! / (m! (n - 2m)! 2^m) He_{n-2m}``, Abramowitz & Stegun 22.3.11) as a
    sparse ``(M, M)`` matrix of Python ints, and ``beta! = E[He_beta^2]`` per row."""
    E, index = _monomials(N, K)
    entries = []
    for a, alpha in enumerate(E.tolist()):
        parts = [[(alpha[v] - 2 * m, math.factorial(alpha[v]) //
                   (math.factorial(m) * math.factorial(alpha[v] - 2 * m) * 2 ** m))
                  for m in range(alpha[v] // 2 + 1)] for v in range(N)]
        for combo in itertools.product(*parts):
            beta = tuple(x for x, _ in combo)
            entries.append((a, index[beta], math.prod(c for _, c in combo)))
    norms = [math.prod(math.factorial(int(x)) for x in row) for row in E.tolist()]
    return entries, norms


class FeatureChaos:
    """The chaos (Hermite) coefficients of a sum of terms of one model over its ``N = n_ctx
    d`` input variables: ``coef[t * d_out + o, beta]`` with
    ``g[t, o] = sum_beta coef[., beta] He_beta(X)`` (``beta`` an exponent vector,
    ``|beta| <= K``).

    Built per term as the dense lifted coefficient tensor ``T[t, o, phi_1..phi_L]`` (one
    einsum of its cores and legs, every leg an affine form of the ``N`` variables), summed
    into monomial coefficients (the multiset of each index tuple's non-constant entries), then
    turned into Hermite coefficients variable by variable (`_hermite`).

    Args:
        terms: `Term` s of one sequence model over the same lifted input (width ``d + 1``),
            each with output ``(t, o)``.
        n_ctx: positions.
        exact: Fractions (object arrays) instead of float64.
        max_degree: ``K``, at least the largest term degree (all chaos of a Gram share it).
        backend, device: ``"numpy"`` (default) or ``"torch"`` on ``device`` (CUDA when
            available and ``device`` is None; float64): the dense lifted tensors and their
            packing into monomials run there, the (small) Hermite change of basis in NumPy.
            The same values up to rounding (summation order).

    Raises:
        ValueError: ``backend`` other than ``"numpy"``/``"torch"``, or ``"torch"`` with
            ``exact``.
    """

    def __init__(self, terms: list, n_ctx: int, exact: bool = False,
                 max_degree: int | None = None, backend: str = "numpy", device=None):
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend: expected 'numpy' or 'torch', got {backend!r}")
        if backend == "torch" and exact:
            raise ValueError("backend: 'torch' computes in float64; exact (rationals) runs on "
                             "'numpy'")
        tdev = None
        if backend == "torch":
            import torch

            tdev = torch.device(device if device is not None else
                                ("cuda" if torch.cuda.is_available() else "cpu"))
        self.n_ctx, self.exact = n_ctx, exact
        d = terms[0].legs[0].weight.shape[-1] - 1
        self.d, self.N = d, n_ctx * d
        K = max(len(t.legs) for t in terms) if max_degree is None else int(max_degree)
        self.K = K
        E, _ = _monomials(self.N, K)
        mono = None
        for term in terms:
            L = len(term.legs)
            ids = _slot_ids(self.N, L, K)
            S = None
            if tdev is not None:
                import torch

                tids = torch.from_numpy(np.array(ids)).to(tdev)   # ids is read-only
            elif not exact:
                from scipy.sparse import csr_matrix

                S = csr_matrix((np.ones(ids.size), (np.arange(ids.size), ids)),
                               shape=(ids.size, len(E))).T.tocsr()
            rows = []
            for t in range(n_ctx):
                expr, ops = _lifted_expression(term, n_ctx, d, exact, t)
                if tdev is not None:
                    tops = [torch.as_tensor(np.ascontiguousarray(o, dtype=np.float64),
                                            device=tdev) for o in ops]
                    T = oe.contract(expr, *tops, backend="torch")
                    flat = T.reshape(T.shape[0], -1)
                    part = torch.zeros((flat.shape[0], len(E)), dtype=torch.float64,
                                       device=tdev).index_add_(1, tids, flat)
                    rows.append(part.cpu().numpy())
                    del T, flat, part
                    continue
                T = np.asarray(oe.contract(expr, *ops))
                flat = T.reshape(T.shape[0], -1)
                if exact:
                    part = np.full((flat.shape[0], len(E)), Fraction(0), dtype=object)
                    for c in range(flat.shape[1]):
                        part[:, ids[c]] = part[:, ids[c]] + flat[:, c]
                else:
                    part = np.asarray((S @ flat.T).T)
                rows.append(part)
            part = np.concatenate(rows, axis=0)   # rows t * d_out + o
            mono = part if mono is None else mono + part
            self.d_out = part.shape[0] // n_ctx
        entries, norms = _hermite(self.N, K)
        if exact:
            coef = np.full(mono.shape, Fraction(0), dtype=object)
            for a, b, c in entries:
                coef[:, b] = coef[:, b] + mono[:, a] * c
            self.norms = [Fraction(v) for v in norms]
        else:
            from scipy.sparse import csr_matrix

            a, b, c = (np.array(x) for x in zip(*entries))
            H = csr_matrix((c.astype(np.float64), (a, b)), shape=(len(E), len(E)))
            coef = np.asarray((H.T @ mono.T).T)
            self.norms = np.array(norms, dtype=np.float64)
        self.coef = coef


def feature_inner(a: FeatureChaos, b: FeatureChaos):
    """``<g_a, g_b> = sum_{t, o, beta} a[., beta] b[., beta] beta!`` (summed over positions
    and outputs; tensor Hermite polynomials are orthogonal with ``E[He_beta^2] = beta!``) of
    two `FeatureChaos` of models over the same input and ``max_degree``."""
    if (a.N, a.n_ctx, a.K) != (b.N, b.n_ctx, b.K):
        raise ValueError(f"feature_inner: different inputs or degrees (N {a.N} vs {b.N}, n_ctx "
                         f"{a.n_ctx} vs {b.n_ctx}, max_degree {a.K} vs {b.K})")
    if a.exact:
        total = Fraction(0)
        for r in range(a.coef.shape[0]):
            for c in range(a.coef.shape[1]):
                if a.coef[r, c] != 0 and b.coef[r, c] != 0:
                    total += a.coef[r, c] * b.coef[r, c] * a.norms[c]
        return total
    return float(np.einsum("rc,rc,c->", a.coef, b.coef, a.norms))


# ----------------------------------------------------------------------------------------
# cost, before any work
# ----------------------------------------------------------------------------------------

def estimate(terms: list, n_ctx: int) -> dict:
    """``{"bytes", "flops", "max_order", "N"}`` of `FeatureChaos` on ``terms`` from shapes
    alone (nothing allocated): the dense lifted tensor of the largest term at one query
    position, ``d_out (N + 1)^L`` entries, counted three times (it, its flat copy and the contraction's last
    intermediate) plus its slot map (``(N + 1)^L`` int64), and the FLOPs of every term's
    einsum (the opt_einsum path cost) and packing."""
    d = terms[0].legs[0].weight.shape[-1] - 1
    N = n_ctx * d
    need, flops, K = 0.0, 0.0, 0
    for t in terms:
        L = len(t.legs)
        K = max(K, L)
        shapes = [(n_ctx,)] + [a.shape for a, _ in t.cores]
        for leg in t.legs:
            lab_shape = leg.weight.shape[1 if leg.positional else 0:-1]
            shapes.append((n_ctx,) + lab_shape + (N + 1,))
        d_out = 1
        for arr, lab in t.cores:
            if OUTPUT in lab:
                d_out = arr.shape[arr.ndim - len(lab) + lab.index(OUTPUT)]
        for leg in t.legs:
            if OUTPUT in leg.labels:
                d_out = leg.weight.shape[leg.weight.ndim - 1 - len(leg.labels)
                                         + leg.labels.index(OUTPUT)]
        entries = d_out * float(N + 1) ** L     # one query position at a time
        need = max(need, 8.0 * (3 * entries + float(N + 1) ** L))
        flops += 4.0 * entries * n_ctx
        if entries < 1e15:   # the path of the lifted einsum, from shapes
            expr = _shape_expression(t)
            try:
                _, info = oe.contract_path(expr, *shapes, shapes=True)
                flops += float(info.opt_cost) * n_ctx
            except (ValueError, TypeError):   # pragma: no cover - repeated labels
                flops += entries * 64 * n_ctx
        else:
            flops += entries * 64 * n_ctx
    M = math.comb(N + K, K)
    need += 8.0 * 2 * M * n_ctx * 4
    return {"bytes": need, "flops": flops, "max_order": K, "N": N}


def _shape_expression(term: Term) -> str:
    labs = [(QUERY,)] + [lb for _, lb in term.cores]
    labs += [((leg.pos or QUERY),) + leg.labels + (f"#phi{j}",)
             for j, leg in enumerate(term.legs)]
    out = (OUTPUT,) + tuple(f"#phi{j}" for j in range(len(term.legs)))
    syms: dict = {}
    for lb in labs + [out]:
        for x in lb:
            syms.setdefault(x, oe.get_symbol(len(syms)))
    subs = ["".join(syms[x] for x in dict.fromkeys(lb)) for lb in labs]
    return ",".join(subs) + "->" + "".join(syms[x] for x in out)


def check(terms_lists: list, n_ctx: int, what: str, max_flops: Any = None,
          max_memory: Any = None, backend: str = "numpy") -> dict:
    """`estimate` of every list of terms; CostTooHigh naming ``what``, the estimates and the
    alternatives when the largest memory or the summed FLOPs are over budget. Returns the
    summed estimate."""
    from ...backends import available_memory
    from ...request import DEFAULT_MAX_FLOPS

    need, flops, K, N = 0.0, 0.0, 0, 0
    for terms in terms_lists:
        e = estimate(terms, n_ctx)
        need, K, N = max(need, e["bytes"]), max(K, e["max_order"]), e["N"]
        flops += e["flops"]
    budget_f = float(DEFAULT_MAX_FLOPS if max_flops is None else max_flops)
    budget_m = float(available_memory(backend) if max_memory is None else max_memory)
    if need > budget_m:
        raise CostTooHigh(f"{what}: the exact inner product of two-node terms needs dense "
                          f"lifted tensors of order {K} over N = n_ctx*d = {N} input variables, "
                          f"about {need / 2**30:.3g} GiB, over max_memory="
                          f"{budget_m / 2**30:.3g} GiB. {ALTERNATIVES}")
    if flops > budget_f:
        raise CostTooHigh(f"{what}: the exact inner product of two-node terms is estimated at "
                          f"{flops:.3g} FLOPs (order {K}, N = n_ctx*d = {N} input "
                          f"variables), over max_flops={budget_f:.3g}. {ALTERNATIVES}")
    return {"bytes": need, "flops": flops, "max_order": K, "N": N}
