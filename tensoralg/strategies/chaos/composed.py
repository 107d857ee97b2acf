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

Inner products (`FeatureChaos`, `feature_inner`): the chaos (Wiener-Ito) expansion in
*feature space*. Per term, `tensoralg.strategies.chaos.sequence.TermSide` gives for every set
``S`` of open legs the sum ``R[S]`` over partial matchings of the other legs (Isserlis/Wick on
the lifted input: pairs bridged by ``delta(p, p') P``, caps by the shared lifted constant);
contracting the open legs' non-constant rows with a one-hot of their position gives the
coefficient tensor ``A_k[t, o, xi_1..xi_k]`` of the Wick product ``:xi_1 ... xi_k:`` over the
``N = n_ctx * d`` input variables ``xi = (position, feature)``. Wick products of distinct
multisets are orthogonal and ``E[:xi^alpha: :xi^alpha:] = alpha!``, so with ``A`` summed over
the index tuples of one multiset ``alpha`` (packing)

    <g_a, g_b> = sum_k sum_{t, o} sum_{|alpha| = k} A^a_k[t, o, alpha] A^b_k[t, o, alpha] alpha!

— no sum over leg bijections (a pair of 9-leg terms would need ``sum_k C(9,k)^2 k!`` =
1.8e7 of them in leg space, `chaos_pair`), at the price of dense feature-space tensors: the
cost is polynomial in ``N`` and exponential in the degree, ``O(n_ctx d_out N^K)`` memory for
the largest chaos order ``K`` (9 for two attention heads), like the position-free chaos
(docs/mathematics.md §3.6). `estimate` gives memory and FLOPs from shapes before any work;
`check` refuses over budget (`CostTooHigh`, naming the alternatives).
"""

from __future__ import annotations

import functools
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

@functools.lru_cache(maxsize=16)
def _packing(N: int, k: int):
    """``(ids, weights)``: for every index tuple of ``range(N)**k`` (row-major) the number of
    its multiset, and per multiset ``alpha!`` (the product of the factorials of its
    multiplicities), as float64 (cached: read-only arrays)."""
    if k == 0:
        ids, w = np.zeros(1, dtype=np.int64), np.ones(1)
    else:
        srt = np.sort(np.indices((N,) * k, dtype=np.int64).reshape(k, -1), axis=0)
        code = np.zeros(srt.shape[1], dtype=np.int64)
        for r in range(k):   # the sorted tuple in base N (N**k < 2**63, checked by `check`)
            code = code * N + srt[r]
        uniq, first, ids = np.unique(code, return_index=True, return_inverse=True)
        w = np.ones(len(uniq))
        rows = srt[:, first]
        for c in range(N):
            cnt = (rows == c).sum(axis=0)
            w *= np.array([math.factorial(int(v)) for v in cnt], dtype=np.float64)
    ids.setflags(write=False)
    w.setflags(write=False)
    return ids.reshape(-1), w


class FeatureChaos:
    """The feature-space chaos tensors of a sum of terms of one model: per order ``k``, the
    packed coefficients ``A_k[t, o, alpha]`` (``alpha`` a multiset of ``k`` input variables
    ``(position, feature)``) of the module docstring.

    Args:
        terms: `Term` s of one sequence model over the same lifted input (width ``d + 1``),
            each with output ``(t, o)``.
        n_ctx: positions.
        exact: Fractions (object arrays) instead of float64.

    ``self.orders``: ``{k: (n_ctx * d_out, n_multisets) array}``.
    """

    def __init__(self, terms: list, n_ctx: int, exact: bool = False):
        from .sequence import TermSide

        self.n_ctx, self.exact = n_ctx, exact
        d = terms[0].legs[0].weight.shape[-1] - 1
        self.N = n_ctx * d
        self.d = d
        dense: dict = {}
        for term in terms:
            side = TermSide(term, "a", np.einsum, n_ctx, exact)
            for S, (R, lab) in side.R.items():
                opened = [j for j in range(len(side.legs)) if S >> j & 1]
                val = self._project(side, R, lab, opened)
                k = len(opened)
                dense[k] = val if k not in dense else dense[k] + val
        self.d_out = next(iter(dense.values())).shape[1]
        self.orders = {k: self._pack(v, k) for k, v in dense.items()}

    def _project(self, side, R, lab, opened):
        """``sum`` over the term's labels of ``R[S]``, the output cores and the open legs'
        non-constant rows placed at their position: shape ``(n_ctx, d_out, N, ..., N)``."""
        n, exact = self.n_ctx, self.exact
        one = Fraction(1) if exact else 1.0
        ops, labs = [], []
        ones = np.full(n, one, dtype=object if exact else np.float64)
        ops.append(ones)
        labs.append((QUERY,))
        if R is not None:
            ops.append(R)
            labs.append(lab)
        for arr, lb in side.outer:
            ops.append(arr)
            labs.append(lb)
        for r, j in enumerate(opened):
            leg = side.legs[j]
            w = leg.weight[..., 1:]
            pos = leg.pos
            # F[p, *labels, p', i] = delta(p, p') w[(p), *labels, i]
            eye = np.eye(n, dtype=object if exact else np.float64)
            if exact:
                eye = np.where(eye == 1, Fraction(1), Fraction(0))
            if leg.positional:
                ops += [w, eye]
                labs += [(pos,) + leg.labels + (f"#i{r}",), (pos, f"#p{r}")]
            else:
                ops += [w, eye]
                labs += [leg.labels + (f"#i{r}",), (pos, f"#p{r}")]
        out = (QUERY, OUTPUT) + tuple(x for r in range(len(opened))
                                      for x in (f"#p{r}", f"#i{r}"))
        syms: dict = {}
        for lb in labs + [out]:
            for x in lb:
                if x not in syms:
                    syms[x] = oe.get_symbol(len(syms))
        ops2, subs = [], []
        for arr, lb in zip(ops, labs):
            u = tuple(dict.fromkeys(lb))
            if len(u) != len(lb):   # a repeated label: its diagonal
                s = "".join(syms[x] for x in lb) + "->" + "".join(syms[x] for x in u)
                arr = np.einsum(s, arr)
            ops2.append(arr)
            subs.append("".join(syms[x] for x in u))
        expr = ",".join(subs) + "->" + "".join(syms[x] for x in out)
        val = oe.contract(expr, *ops2)
        k = len(opened)
        return np.asarray(val).reshape((n, -1) + (self.N,) * k)

    def _pack(self, A, k):
        n, do = A.shape[:2]
        flat = A.reshape(n * do, -1)
        ids, _ = _packing(self.N, k)
        n_alpha = int(ids.max()) + 1 if ids.size else 1
        if self.exact:
            out = np.full((n * do, n_alpha), Fraction(0), dtype=object)
            for c in range(flat.shape[1]):
                out[:, ids[c]] = out[:, ids[c]] + flat[:, c]
            return out
        from scipy.sparse import csr_matrix

        S = csr_matrix((np.ones(ids.size), (np.arange(ids.size), ids)),
                       shape=(ids.size, n_alpha))
        return np.asarray((S.T @ flat.T).T)


def feature_inner(a: FeatureChaos, b: FeatureChaos):
    """``<g_a, g_b>`` (summed over positions and outputs) of two `FeatureChaos` of models
    over the same input (module docstring)."""
    if (a.N, a.n_ctx) != (b.N, b.n_ctx):
        raise ValueError(f"feature_inner: different inputs (N {a.N} vs {b.N}, n_ctx "
                         f"{a.n_ctx} vs {b.n_ctx})")
    exact = a.exact
    total = Fraction(0) if exact else 0.0
    for k in sorted(set(a.orders) & set(b.orders)):
        _, w = _packing(a.N, k)
        A, B = a.orders[k], b.orders[k]
        if exact:
            wf = [Fraction(int(v)) for v in w]
            for r in range(A.shape[0]):
                for c in range(A.shape[1]):
                    if A[r, c] != 0 and B[r, c] != 0:
                        total += A[r, c] * B[r, c] * wf[c]
        else:
            total += float(np.einsum("rc,rc,c->", A, B, w))
    return total


# ----------------------------------------------------------------------------------------
# cost, before any work
# ----------------------------------------------------------------------------------------

def estimate(terms: list, n_ctx: int) -> dict:
    """``{"bytes", "flops", "max_order", "N"}`` of `FeatureChaos` on ``terms`` from shapes
    alone: the dense order-``K`` tensor (``n_ctx * d_out * N^K`` entries, twice: dense and
    packed), the packing map (``N^K`` int64) and the projections (per open set ``S`` of each
    term, ``n_ctx d_out N^|S|`` times the contracted head labels)."""
    d = terms[0].legs[0].weight.shape[-1] - 1
    N = n_ctx * d
    d_out = 1
    for t in terms:
        for arr, lab in t.cores:
            if OUTPUT in lab:
                d_out = max(d_out, arr.shape[arr.ndim - len(lab) + lab.index(OUTPUT)])
        for leg in t.legs:
            if OUTPUT in leg.labels:
                d_out = max(d_out, leg.weight.shape[leg.weight.ndim - 1 - len(leg.labels)
                                                    + leg.labels.index(OUTPUT)])
    K = max(len(t.legs) for t in terms)
    flops = 0.0
    for t in terms:
        L = len(t.legs)
        hsz = max(1, max((math.prod(leg.weight.shape[:-1]) for leg in t.legs), default=1))
        for k in range(L + 1):
            # the projection of each open set and the partial matchings of the closed legs
            flops += math.comb(L, k) * 2.0 * n_ctx * d_out * float(N) ** k * hsz
            flops += math.comb(L, k) * _matchings(L - k) * 2.0 * n_ctx ** 3 * hsz ** 2
    entries = n_ctx * d_out * float(N) ** K
    need = 8.0 * (3 * entries + float(N) ** K)
    return {"bytes": need, "flops": flops, "max_order": K, "N": N}


def _matchings(n: int) -> int:
    """Partial matchings of ``n`` legs (telephone numbers): an upper bound on the Wick sums of
    the closed legs of one open set."""
    a, b = 1, 1
    for k in range(1, n):
        a, b = b, b + k * a
    return b if n else 1


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
                          f"chaos tensors of order {K} over N = n_ctx*d = {N} input variables, "
                          f"about {need / 2**30:.3g} GiB, over max_memory="
                          f"{budget_m / 2**30:.3g} GiB. {ALTERNATIVES}")
    if flops > budget_f:
        raise CostTooHigh(f"{what}: the exact inner product of two-node terms is estimated at "
                          f"{flops:.3g} FLOPs (chaos order {K}, N = n_ctx*d = {N} input "
                          f"variables), over max_flops={budget_f:.3g}. {ALTERNATIVES}")
    return {"bytes": need, "flops": flops, "max_order": K, "N": N}

