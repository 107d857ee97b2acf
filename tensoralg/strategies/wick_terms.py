"""Exact Wick on terms with position-carrying legs (docs/mathematics.md §3.1 and §3.7).

A term of :mod:`tensoralg.canonical`'s tree (:class:`~tensoralg.canonical.Term`) is a lifted
multilinear map: ``cores`` contracted with ``legs``, each leg a row tensor ``w[(p), ..., i]``
read against the lifted input ``x~_p = (1, x_p)`` at a *position variable* ``p`` (the query
position ``t``, a key position ``s`` summed against the mask). Under the Gaussian metric of
sequences every entry ``x_p[i]`` is an independent ``N(0, 1)`` and the lifted constant is the
*same* 1 at every position. Isserlis' theorem applied to the non-constant entries (Isserlis
1918; Wick 1950) gives, for the legs of two joined terms (one of model ``a``, one of ``b``),

    E[prod_legs (w_leg . x~_{pos(leg)})] = sum over partial matchings of the legs of
        prod_pairs  delta(pos, pos') * (w . P w')      (P = diag(0, 1, ..., 1))
        prod_single w[0]                               (the cap e0, at any position)

because ``x_p`` and ``x_p'`` are independent for ``p != p'`` (a pair bridges its two position
variables by a Kronecker delta: they are identified, union-find over the position variables of
the legs) and the constant coordinate is exactly 1 at every position (a cap ``e0`` may sit at
any position: it carries no delta). Legs whose constant column is zero are never capped and
legs whose other columns are zero never paired (an exact zero pattern, pruned).

Two ways to sum (equal values; tests cross-check them):

* :class:`JoinedTermPair` (``strategy="matchings"``): one contraction per partial matching of
  the joined network; Gram matrices ``w . P w'`` of the matched rows replace the feature index,
  the full coefficient tensor is never formed; paths found once per topology and cached.
* :class:`TermSide` + :func:`chaos_pair` (``strategy="chaos"``, the default): per term the
  chaos (Wiener-Ito) coefficients ``R[S]``, the sums over partial matchings of the legs outside
  each open set ``S``; two Wick products have expectation the sum over bijections of their
  open legs (orthogonality of Gaussian chaoses), so a pair of terms is a sum over
  ``(S_a, S_b, bijection)``.

Two reductions keep the sum and drop terms that are zero or one: a cross item whose bridges
identify the two key positions sums over the (query, key) pairs where both masks are nonzero
only (one packed label; a causal mask keeps ``n(n+1)/2`` of ``n^2``), and the all-ones selector
of a sum over every query position is left out where another operand carries its label.

Cost: before any contraction, the configurations are counted against ``max_configurations``
and a dry run of the chaos sums (paths found and cached for the real run) estimates the peak
memory and the FLOPs (the path cost of every contraction the run executes), held against
``max_memory`` and ``max_flops`` (:func:`chaos_cost_req`; ``tensoralg.plan`` reports both).

No symmetry reduction is applied: the swap ``(Q1, K1) <-> (Q2, K2)`` of an attention term
leaves the function unchanged but not the tensor network unless ``q1 = q2`` and ``k1 = k2``
(docs/mathematics.md §3.7), so every matching is contracted.

Labels: a term's labels are suffixed by its side (``"a"``, ``"b"``) except the shared output
``o`` and query position ``t``; a key position ``s`` becomes ``sa`` / ``sb``
(:func:`term_network`). Contractions run through :mod:`tensoralg.strategies.executor`.

The exact path of sequence models (:func:`exact_inner`, :func:`exact_similarity`,
:func:`exact_gram`, :func:`head_gram`; sums over query positions ``t`` and output ``o`` of
``E[f_a(X)[t, o] f_b(X)[t, o]]``, ``position=`` / ``output=`` slicing them as in
``tensoralg.inner``) reads both models in the folded canonical tree (:func:`canonicalize`):
one node of linear and attention terms. Supported exactly: models of the form ``[Linear...]
-> attention or Residual(attention) -> [Linear...]`` (an embedding applied per position, one
attention layer with or without a residual, biases, any mask, RoPE, an unembedding; a
residual block may hold Linear layers around the attention), and per-position affine models.
Deeper stacks: :func:`tensoralg.strategies.montecarlo.montecarlo_inner` (unbiased, with a
standard error) and :func:`tensoralg.strategies.closure.closure_inner` (the second-moment
closure over (position, feature); exact at depth 1, APPROXIMATE deeper).
"""

from __future__ import annotations

import itertools
import math
import numbers
import weakref
from dataclasses import replace
from fractions import Fraction
from typing import Any

import numpy as np
import opt_einsum as oe

from ..backends import available_memory
from ..canonical import OUTPUT, QUERY, Leg, Node, Term, Tree, sequence_tree
from ..canonical import _flatten as _flatten_layers
from ..errors import AttentionNotSupported, CostTooHigh
from ..layers import BilinearAttention, Layer, Residual, Sequential, as_network
from ..prepare import (
    _IN_SEQUENCE_GRAM,
    _selector,
    check_sequence_models,
    check_sequence_pair,
    check_slices,
)
from ..request import (
    DEFAULT_MAX_CONFIGURATIONS,
    DEFAULT_MAX_FLOPS,
    DEFAULT_MAX_FLOPS_EXACT_SEQUENCE,
    Request,
    make_request,
)
from ..results import gram_to_similarity, similarity_from, swap_order
from ..wick import partial_matchings, parts
from .executor import Plan, torch_backend

__all__ = ["term_network", "JoinedTermPair", "TermSide", "chaos_pair",
           "compile_sum", "run_sum", "OverBudget", "exact_inner", "exact_similarity",
           "exact_gram", "head_gram", "count_configurations", "chaos_memory_bytes",
           "canonicalize", "AttentionNotSupported", "DEFAULT_MAX_CONFIGURATIONS"]


def _dtype(exact: bool):
    return object if exact else np.float64


def _side_label(x: str, side: str) -> str:
    """A term's label on one side of the joined network: the output ``o`` and the query
    position ``t`` are shared, every other label (a key position ``s``, internal ``h``, ...)
    gets the side's suffix."""
    return x if x in (OUTPUT, QUERY) else x + side


def term_network(term: Term, side: str):
    """``(static operands [(array, labels)], legs)`` of one :class:`~tensoralg.canonical.Term`
    on side ``side`` of a joined network: its cores and legs with labels (tuples of strings)
    and position variables relabelled by :func:`_side_label`."""
    static = [(arr, tuple(_side_label(x, side) for x in lab)) for arr, lab in term.cores]
    legs = [Leg(leg.name + side, leg.weight, tuple(_side_label(x, side) for x in leg.labels),
                _side_label(leg.pos or QUERY, side), leg.positional) for leg in term.legs]
    return static, legs


_NETWORKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _network(term: Term, side: str):
    """:func:`term_network` with the legs' zero pattern ``(can_cap, can_pair)`` per leg,
    memoized per ``(term, side)`` while the term lives (a term meets every term of the other
    model, and its chaos side, within one inner product)."""
    per = _NETWORKS.get(term)
    if per is None:
        per = _NETWORKS[term] = {}
    hit = per.get(side)
    if hit is None:
        static, legs = term_network(term, side)
        hit = per[side] = (static, legs, [leg.can_cap for leg in legs],
                           [leg.can_pair for leg in legs])
    return hit


def _positions(legs) -> list:
    """The position variables the legs read, the query position first (always present: the
    output's)."""
    return list(dict.fromkeys([QUERY] + [leg.pos for leg in legs]))


class _UnionFind:
    def __init__(self, items):
        self.parent = {x: x for x in items}

    def find(self, x):
        while self.parent[x] != x:
            x = self.parent[x]
        return x

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # keep the query position as the representative: its selector stays valid
            if rb == QUERY:
                ra, rb = rb, ra
            self.parent[rb] = ra


def _diagonal(arr, labels, ein):
    """Take diagonals for repeated labels: returns ``(array, unique labels)``."""
    uniq = tuple(dict.fromkeys(labels))
    if len(uniq) == len(labels):
        return arr, labels
    syms = {lab: oe.get_symbol(i) for i, lab in enumerate(uniq)}
    sub = "".join(syms[lab] for lab in labels) + "->" + "".join(syms[lab] for lab in uniq)
    return ein(sub, arr), uniq


class JoinedTermPair:
    """The joined tensor network of one term of ``a`` and one term of ``b``, with the Gram
    matrices ``w . P w'`` of every leg pair and the caps ``w[..., 0]`` precomputed."""

    def __init__(self, ta, tb, sel_t, out_mode, ein):
        self.ein = ein
        sa, la, cap_a, pair_a = _network(ta, "a")
        sb, lb, cap_b, pair_b = _network(tb, "b")
        self.static = sa + sb + [(sel_t, (QUERY,))]
        self.legs = la + lb
        self.out_mode = out_mode  # output labels of the whole contraction: () / ("o",) / ...
        self.positions = _positions(self.legs)
        n = len(self.legs)
        self.can_cap = cap_a + cap_b
        pairable = pair_a + pair_b
        self.pairable = pairable
        self.can_pair = [[pairable[i] and pairable[j] for j in range(n)] for i in range(n)]
        self._gram = {}
        self._cap = {}

    def gram(self, i, j):
        """``(array, labels-with-'@'-for-the-position)`` of ``w_i . P w_j``."""
        key = (i, j)
        if key not in self._gram:
            A, B = self.legs[i], self.legs[j]
            la = (("@",) if A.positional else ()) + A.labels
            lb = (("@",) if B.positional else ()) + B.labels
            out = tuple(dict.fromkeys(la + lb))
            syms = {lab: oe.get_symbol(k) for k, lab in enumerate(dict.fromkeys(la + lb + ("#",)))}
            sub = ("".join(syms[x] for x in la + ("#",)) + "," + "".join(syms[x] for x in lb + ("#",))
                   + "->" + "".join(syms[x] for x in out))
            self._gram[key] = (self.ein(sub, A.weight[..., 1:], B.weight[..., 1:]), out)
        return self._gram[key]

    def cap(self, i):
        if i not in self._cap:
            L = self.legs[i]
            self._cap[i] = (L.weight[..., 0], (("@",) if L.positional else ()) + L.labels)
        return self._cap[i]

    def configurations(self):
        return map(parts, partial_matchings(len(self.legs), self.can_cap, self.pairable))

    def count(self) -> int:
        """Number of partial matchings after zero-pattern pruning (memoized on the leg set)."""
        n = len(self.legs)
        memo = {}

        def rec(rest):
            if not rest:
                return 1
            if rest in memo:
                return memo[rest]
            i = (rest & -rest).bit_length() - 1
            r = rest & ~(1 << i)
            c = rec(r) if self.can_cap[i] else 0
            for j in range(n):
                if r >> j & 1 and self.can_pair[i][j]:
                    c += rec(r & ~(1 << j))
            memo[rest] = c
            return c
        return rec((1 << n) - 1)

    def signature(self):
        """Everything the compiled contractions depend on (not the weight values)."""
        return (tuple((lab, a.shape) for a, lab in self.static),
                tuple((L.pos, L.labels, L.positional, L.weight.shape) for L in self.legs),
                tuple(self.can_cap), tuple(map(tuple, self.can_pair)), self.out_mode)

    def _compile(self):
        """One ``(operand specs, contract expression)`` per partial matching (cached per
        signature: the same architecture and zero pattern reuse the paths)."""
        key = self.signature()
        hit = _COMPILED.get(key)
        if hit is not None:
            return hit
        compiled = []
        for matching in self.configurations():
            uf = _UnionFind(self.positions)
            for part in matching:
                if len(part) == 2:
                    uf.union(self.legs[part[0]].pos, self.legs[part[1]].pos)
            pos = {p: uf.find(p) for p in self.positions}
            specs = []
            for k, (_arr, labels) in enumerate(self.static):
                specs.append((("static", k), tuple(pos.get(x, x) for x in labels)))
            for part in matching:
                p = pos[self.legs[part[0]].pos]
                labels = self._gram_labels(*part) if len(part) == 2 else self._cap_labels(part[0])
                kind = ("gram",) + part if len(part) == 2 else ("cap", part[0])
                specs.append((kind, tuple(p if x == "@" else x for x in labels)))
            specs = [(kind, labels, tuple(dict.fromkeys(labels))) for kind, labels in specs]
            allabs = list(dict.fromkeys(x for _, _, lab in specs for x in lab))
            syms = {lab: oe.get_symbol(k) for k, lab in enumerate(allabs)}
            out = "".join(syms[x] for x in self.out_mode if x in syms)
            sub = ",".join("".join(syms[x] for x in lab) for _, _, lab in specs) + "->" + out
            shapes = [self._shape(kind, labels) for kind, labels, _ in specs]
            expr = oe.contract_expression(sub, *shapes, optimize="greedy")
            compiled.append((specs, expr))
        _COMPILED[key] = compiled
        return compiled

    def _raw(self, kind):
        if kind[0] == "static":
            return self.static[kind[1]][0]
        if kind[0] == "gram":
            return self.gram(kind[1], kind[2])[0]
        return self.cap(kind[1])[0]

    def _shape(self, kind, labels):
        raw = self._raw(kind).shape
        size = dict(zip(labels, raw))
        return tuple(size[x] for x in dict.fromkeys(labels))

    def _gram_labels(self, i, j):
        A, B = self.legs[i], self.legs[j]
        la = (("@",) if A.positional else ()) + A.labels
        lb = (("@",) if B.positional else ()) + B.labels
        return tuple(dict.fromkeys(la + lb))

    def _cap_labels(self, i):
        L = self.legs[i]
        return (("@",) if L.positional else ()) + L.labels

    def contract_all(self, budget_left: int):
        """Sum over every partial matching; returns ``(value, number of configurations)``."""
        compiled = self._compile()
        if len(compiled) > budget_left:
            raise OverBudget()
        cache = {}
        total = None
        for specs, expr in compiled:
            ops = []
            for kind, labels, _uniq in specs:
                key = (kind, labels)
                arr = cache.get(key)
                if arr is None:
                    arr = cache[key] = _diagonal(self._raw(kind), labels, self.ein)[0]
                ops.append(arr)
            val = expr(*ops)
            total = val if total is None else total + val
        return total, len(compiled)


_COMPILED: dict = {}
_PLANS: dict = {}


def compile_sum(key, build):
    """Cached list of ``(operand specs, contract expression)``: ``build()`` returns a list of
    ``(specs, out_labels, shapes)`` with ``specs = [(operand key, labels)]``."""
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    compiled = []
    for specs, out_labels, shapes in build():
        uniq = [tuple(dict.fromkeys(lab)) for _, lab in specs]
        allabs = list(dict.fromkeys(x for lab in uniq for x in lab))
        syms = {lab: oe.get_symbol(k) for k, lab in enumerate(allabs)}
        out = "".join(syms[x] for x in out_labels if x in syms)
        sub = ",".join("".join(syms[x] for x in lab) for lab in uniq) + "->" + out
        ushapes = []
        for (_, lab), shp in zip(specs, shapes):
            size = dict(zip(lab, shp))
            ushapes.append(tuple(size[x] for x in dict.fromkeys(lab)))
        if len(specs) == 1:
            expr = (lambda sub_: (lambda x: oe.contract(sub_, x)))(sub)
        else:   # contractions of one shape up to the names of their labels share a path
            expr = _PLANS.get((sub, tuple(ushapes)))
            if expr is None:
                expr = _PLANS[(sub, tuple(ushapes))] = Plan(sub, ushapes)
        compiled.append((specs, expr))
    _COMPILED[key] = compiled
    return compiled


def run_sum(compiled, fetch, ein):
    cache = {}
    total = None
    for specs, expr in compiled:
        ops = []
        for key, labels in specs:
            arr = cache.get((key, labels))
            if arr is None:
                arr = cache[(key, labels)] = _diagonal(fetch(key), labels, ein)[0]
            ops.append(arr)
        val = expr(*ops)
        total = val if total is None else total + val
    return total


class TermSide:
    """One term of one model in chaos (Wiener-Ito) form: for every set ``S`` of open legs, the
    sum ``R[S]`` over partial matchings of the *other* legs (pairs bridged by ``delta P``,
    caps ``e0``). Then ``f = sum_S R[S] :prod_{leg in S} (w_leg . xi):`` (Wick products of
    the open legs), and two Wick products have expectation ``sum over bijections of the
    pairs' bridges`` (orthogonality of Gaussian chaoses)."""

    def __init__(self, term, side: str, ein, n_ctx: int, exact: bool, dry: bool = False):
        self.side, self.ein = side, ein
        self.static, self.legs, can_cap, can_pair = _network(term, side)
        # the output cores (holding the output label) are kept for the cross stage; the
        # others (the mask) stay inside R
        self.outer = [x for x in self.static if OUTPUT in x[1]]
        self.inner = [x for x in self.static if OUTPUT not in x[1]]
        n = len(self.legs)
        self.can_cap = list(can_cap)
        self.can_pair_leg = list(can_pair)
        self.n_ctx = n_ctx
        self.exact = exact
        self._gram = {}
        self.R = {}
        #: dry: nothing is contracted; R[S] holds shape-only placeholders, ``stored`` the number
        #: of entries the R[S] would take, ``work`` the elements live at the peak of the
        #: largest of their sums (:func:`sum_peak`) and ``flops`` their path costs
        #: (:func:`sum_flops`); the compiled paths are cached for the run.
        self.dry, self.stored, self.work, self.flops = dry, 0, 0, 0.0
        self._compute(n)

    def gram(self, i, j):
        if (i, j) not in self._gram:
            self._gram[(i, j)] = _gram(self.legs[i], self.legs[j], self.ein)
        return self._gram[(i, j)]

    def _delta(self):
        one, zero = (Fraction(1), Fraction(0)) if self.exact else (1.0, 0.0)
        I = np.full((self.n_ctx, self.n_ctx), zero, dtype=_dtype(self.exact))
        for k in range(self.n_ctx):
            I[k, k] = one
        return I

    def _layout(self):
        """For every set ``S`` of open legs: ``(S, closed legs, labels of R[S], the partial
        matchings of the closed legs (a generator))``; nothing is contracted."""
        return _side_layout(self.inner, self.outer, self.legs, self.can_cap, self.can_pair_leg)

    def _sizes(self) -> dict:
        """Size of every label of this side (positions: ``n_ctx``)."""
        return _side_sizes(self.static, self.legs, self.n_ctx)

    def _compute(self, n):
        legs = self.legs
        self._grams_read: set = set()
        for S, closed, out, matchings in self._layout():
            matchings = list(matchings)
            if not matchings:
                continue
            if not closed and not self.inner:
                self.R[S] = (None, ())  # the number 1
                continue
            key = ("side", self.signature(), S)

            def build(closed=closed, matchings=matchings, out=out):
                for m in matchings:
                    specs = [(("static", k), lab) for k, (_, lab) in enumerate(self.inner)]
                    for part in m:
                        if len(part) == 2:
                            i, j = closed[part[0]], closed[part[1]]
                            p = legs[i].pos
                            specs.append((("gram", i, j), _gram_labels(legs[i], legs[j], p)))
                            if legs[j].pos != p:
                                specs.append((("delta",), (p, legs[j].pos)))
                        else:
                            i = closed[part[0]]
                            specs.append((("cap", i), _leg_labels(legs[i], legs[i].pos)))
                    yield specs, out, [self.fetch(k).shape for k, _ in specs]

            compiled = compile_sum(key, build)
            if self.dry:
                shape = tuple(self._sizes()[x] for x in out)
                self.R[S] = (Shape(shape), out)
                self.stored += math.prod(shape)
                self.work = max(self.work, sum_peak(compiled, self.fetch))
                self.flops += sum_flops(compiled)
                self._grams_read.update(k for specs, _ in compiled for k, _ in specs
                                        if k[0] == "gram")
                continue
            self.R[S] = (np.asarray(run_sum(compiled, self.fetch, self.ein),
                                    dtype=_dtype(self.exact)), out)
        if self.dry:  # the side's own leg grams stay alive with it
            self.stored += sum(math.prod(self.fetch(k).shape) for k in self._grams_read)

    def fetch(self, key):
        if key[0] == "static":
            return self.inner[key[1]][0]
        if key[0] == "gram":
            return self.gram(key[1], key[2])
        if key[0] == "delta":
            return self._delta()
        return self.legs[key[1]].weight[..., 0]

    def signature(self):
        return (tuple((lab, a.shape) for a, lab in self.static),
                tuple((L.pos, L.labels, L.positional, L.weight.shape) for L in self.legs),
                tuple(self.can_cap), tuple(self.can_pair_leg), self.n_ctx)


def _side_layout(inner, outer, legs, can_cap, can_pair_leg):
    """:meth:`TermSide._layout` of a side given by its parts."""
    n = len(legs)
    for S in range(1 << n):
        opened = [i for i in range(n) if S >> i & 1]
        closed = [i for i in range(n) if not S >> i & 1]
        present = {x for _, lab in inner for x in lab}
        for i in closed:
            present |= set(_leg_labels(legs[i], legs[i].pos))
        wanted = [QUERY, OUTPUT] + [legs[i].pos for i in opened] + \
            [x for i in opened for x in legs[i].labels]
        wanted += [x for _, lab in outer for x in lab]
        out = tuple(x for x in dict.fromkeys(wanted) if x in present)
        sub_cap = [can_cap[i] for i in closed]
        sub_pair = [can_pair_leg[i] for i in closed]
        yield S, closed, out, map(parts, partial_matchings(len(closed), sub_cap, sub_pair))


def _side_sizes(static, legs, n_ctx: int) -> dict:
    """Size of every label of a side; every position variable has ``n_ctx`` values (whatever
    context its arrays were built for)."""
    size = {QUERY: n_ctx}
    for arr, lab in static:
        size.update(zip(lab, arr.shape[arr.ndim - len(lab):]))
    for leg in legs:
        dims = leg.weight.shape[:-1]
        size.update(zip(leg.labels, dims[len(dims) - len(leg.labels):]))
    for x in _positions(legs):
        size[x] = n_ctx
    return size


def stored_entries(term: Term, side: str, n_ctx: int) -> int:
    """Entries of the chaos tensors ``R[S]`` a :class:`TermSide` of ``term`` stores when its
    positions take ``n_ctx`` values, from shapes and zero patterns alone: no path search,
    nothing allocated, and ``term`` may come from a tree built for a shorter context (its
    feature sizes do not depend on it). A lower bound on the chaos strategy's peak memory (the
    leg grams and the working set of a sum come on top)."""
    static, legs, can_cap, can_pair = _network(term, side)
    inner = [x for x in static if OUTPUT not in x[1]]
    outer = [x for x in static if OUTPUT in x[1]]
    size = _side_sizes(static, legs, n_ctx)
    total = 0
    for _, closed, out, matchings in _side_layout(inner, outer, legs, can_cap, can_pair):
        if next(iter(matchings), None) is None or (not closed and not inner):
            continue
        total += math.prod(size[x] for x in out)
    return total


def _leg_labels(leg: Leg, pos: str):
    return ((pos,) if leg.positional else ()) + leg.labels


def _gram_labels(A: Leg, B: Leg, pos: str):
    return tuple(dict.fromkeys(_leg_labels(A, pos) + _leg_labels(B, pos)))


def _gram(A: Leg, B: Leg, ein):
    """``w_A . P w_B`` over the non-constant features, labels as :func:`_gram_labels`."""
    la, lb = _leg_labels(A, "@"), _leg_labels(B, "@")
    out = tuple(dict.fromkeys(la + lb))
    syms = {lab: oe.get_symbol(k) for k, lab in enumerate(dict.fromkeys(la + lb + ("#",)))}
    sub = ("".join(syms[x] for x in la + ("#",)) + "," + "".join(syms[x] for x in lb + ("#",))
           + "->" + "".join(syms[x] for x in out))
    return ein(sub, A.weight[..., 1:], B.weight[..., 1:])


def _mask_pattern(side: TermSide):
    """``(key position label, nonzero pattern (t, s))`` of a side's mask core (the one inner
    static operand over the query and one key position), or None."""
    hits = [(lab, arr) for arr, lab in side.inner
            if len(lab) == 2 and lab[0] == QUERY and lab[1] != QUERY]
    if len(hits) != 1 or isinstance(hits[0][1], Shape):
        return None
    return hits[0][0][1], np.asarray(hits[0][1] != 0)


def _pack_plan(sa: TermSide, sb: TermSide, out_mode):
    """``(s_a, s_b, rows t, cols s)`` of the (query, key) pairs where both masks are nonzero,
    when a cross item that bridges the two key positions can sum over those pairs only (one
    packed label instead of two): both sides carry a mask, at most 2/3 of the pairs are nonzero
    in both (a causal mask from n_ctx 3 on; about half at n_ctx 8), and the query position is
    summed. Else None."""
    if QUERY in out_mode:
        return None
    ma, mb = _mask_pattern(sa), _mask_pattern(sb)
    if ma is None or mb is None or ma[1].shape != mb[1].shape:
        return None
    nz = ma[1] & mb[1]
    if nz.mean() > 2 / 3:   # (indexing copies outweigh a small saving: causal n_ctx <= 2)
        return None
    ti, si = np.nonzero(nz)
    return ma[0], mb[0], ti, si


_PACKED = "#ts"   # the label of a packed (query, key) pair


def _packed(arr, labels, t_lab, s_lab, ti, si):
    """``arr`` (labels unique) with its query axis ``t_lab`` and key axis ``s_lab`` (either
    may be absent) replaced by one leading axis over the pairs ``(ti, si)``."""
    axes = [labels.index(x) for x in (t_lab, s_lab) if x in labels]
    idx = [ix for x, ix in ((t_lab, ti), (s_lab, si)) if x in labels]
    rest = tuple(x for x in labels if x not in (t_lab, s_lab))
    if isinstance(arr, Shape):
        return Shape((len(ti),) + tuple(arr.shape[k] for k, x in enumerate(labels)
                                        if x not in (t_lab, s_lab))), (_PACKED,) + rest
    moved = np.moveaxis(arr, axes, list(range(len(axes))))
    return moved[tuple(idx)], (_PACKED,) + rest


def chaos_pair(sa: TermSide, sb: TermSide, sel, out_mode, ein, budget: int):
    """``sum_{S_a, S_b} sum_{bijections} <R_a[S_a], R_b[S_b]>`` with cross bridges; with two
    dry sides (:class:`TermSide` ``dry=True``) nothing is contracted and the value is
    ``(elements live at the peak of that sum (:func:`sum_peak`), its FLOPs
    (:func:`sum_flops`))``.

    An item whose bridges identify the two key positions sums over the (query, key) pairs
    where both masks are nonzero only (:func:`_pack_plan`; a causal mask: ``n(n+1)/2`` of
    ``n^2``): ``R_a``, ``R_b`` and the selector are read on those pairs (one packed label), the
    entries left out being zero in ``R_a`` (its mask factor). The same sum, fewer terms."""
    la, lb = sa.legs, sb.legs
    grams = {}
    pack = _pack_plan(sa, sb, out_mode)
    packs: dict = {}
    # an all-ones selector (every query position summed) multiplies by 1: an item leaves it out
    # when another operand carries its label (else it stands for the factor n_ctx)
    ones = bool(np.all(sel == 1))

    def fetch(key):
        kind = key[0]
        if kind == "Ra":
            return sa.R[key[1]][0]
        if kind == "Rb":
            return sb.R[key[1]][0]
        if kind == "Oa":
            return sa.outer[key[1]][0]
        if kind == "Ob":
            return sb.outer[key[1]][0]
        if kind == "sel":
            return sel
        if kind == "pk":    # ("pk", inner key, its labels, query label, key label)
            if key not in packs:
                packs[key] = _packed(fetch(key[1]), key[2], key[3], key[4], pack[2],
                                     pack[3])[0]
            return packs[key]
        if key not in grams:
            grams[key] = _gram(la[key[1]], lb[key[2]], ein)
        return grams[key]

    pairable = [[x and y for y in sb.can_pair_leg] for x in sa.can_pair_leg]
    positions = _positions(la + lb)
    items = []
    for S_a, (_Ra, _laba) in sa.R.items():
        open_a = [i for i in range(len(la)) if S_a >> i & 1]
        for S_b, (_Rb, _labb) in sb.R.items():
            open_b = [j for j in range(len(lb)) if S_b >> j & 1]
            if len(open_a) != len(open_b):
                continue
            for perm in itertools.permutations(open_b):
                if all(pairable[i][j] for i, j in zip(open_a, perm)):
                    items.append((S_a, S_b, tuple(zip(open_a, perm))))
    if len(items) > budget:
        raise OverBudget()
    key = ("cross", sa.signature(), sb.signature(),
           tuple(sorted((k, v[1]) for k, v in sa.R.items())),
           tuple(sorted((k, v[1]) for k, v in sb.R.items())), out_mode, sel.shape,
           None if pack is None else (pack[0], pack[1], pack[2].tobytes(), pack[3].tobytes()),
           ones)

    def packable(specs, s_lab):
        """Whether the packed pairs may replace (query, ``s_lab``) in these operands: both
        ``R`` carry the query and the bridged key position, nothing else but the selector reads
        either."""
        has = {k[0]: lab for k, lab in specs if k[0] in ("Ra", "Rb")}
        if len(has) != 2 or not all(QUERY in lab and s_lab in lab for lab in has.values()):
            return False
        return all(k[0] in ("Ra", "Rb", "sel") or not ({QUERY, s_lab} & set(lab))
                   for k, lab in specs)

    def build():
        for S_a, S_b, pairs in items:
            uf = _UnionFind(positions)
            for i, j in pairs:
                uf.union(la[i].pos, lb[j].pos)
            rel = lambda lab, uf=uf: tuple(uf.find(x) if x in positions else x for x in lab)  # noqa: E731
            specs = [(("sel",), (QUERY,))]
            if sa.R[S_a][0] is not None:
                specs.append((("Ra", S_a), rel(sa.R[S_a][1])))
            if sb.R[S_b][0] is not None:
                specs.append((("Rb", S_b), rel(sb.R[S_b][1])))
            specs += [(("Oa", k), lab) for k, (_, lab) in enumerate(sa.outer)]
            specs += [(("Ob", k), lab) for k, (_, lab) in enumerate(sb.outer)]
            for i, j in pairs:
                specs.append((("g", i, j), _gram_labels(la[i], lb[j], uf.find(la[i].pos))))
            if pack is not None:
                s_lab = uf.find(pack[0])
                if s_lab == uf.find(pack[1]) and s_lab != uf.find(QUERY) and \
                        packable(specs, s_lab) and \
                        all(len(set(lab)) == len(lab) for _, lab in specs):
                    specs = [(("pk", k, lab, QUERY, s_lab),
                              _packed(Shape([1] * len(lab)), lab, QUERY, s_lab, pack[2],
                                      pack[3])[1])
                             if k[0] in ("Ra", "Rb", "sel") else (k, lab) for k, lab in specs]
            if ones and any(lab == specs[0][1][0] for _, rest in specs[1:] for lab in rest):
                specs = specs[1:]
            yield specs, out_mode, [fetch(k).shape for k, _ in specs]

    compiled = compile_sum(key, build)
    if sa.dry or sb.dry:  # the cross grams and packed copies stay alive through the sum
        return (sum_peak(compiled, fetch) + _gram_entries(compiled, fetch, "g") +
                _gram_entries(compiled, fetch, "pk"), sum_flops(compiled)), len(items)
    return run_sum(compiled, fetch, ein), len(items)


class Shape:
    """A shape-only stand-in for an array (dry runs: paths are found, nothing contracted)."""

    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = tuple(shape)


def _gram_entries(compiled, fetch, kind: str) -> int:
    """Entries of the distinct gram operands (key kind ``kind``) that ``compiled`` reads."""
    keys = {key for specs, _ in compiled for key, _ in specs if key[0] == kind}
    return sum(math.prod(fetch(key).shape) for key in keys)


def sum_flops(compiled) -> float:
    """FLOPs of :func:`run_sum` over ``compiled``: the ``opt_einsum`` path cost of each of its
    contractions (:attr:`Plan.flops`; a single-operand reduction, which reads each entry once,
    is not counted), from shapes alone."""
    return float(sum(getattr(expr, "flops", 0.0) for _, expr in compiled))


def sum_peak(compiled, fetch) -> int:
    """Elements live at the peak of :func:`run_sum` over ``compiled`` beyond its stored
    operands (an estimate, not a bound): the distinct diagonal copies it caches (operands whose
    labels repeat) plus the largest working set of one contraction (:attr:`Plan.peak`:
    intermediates alive along its path and one step's copies; checked against tracemalloc
    peaks in tests/test_attention_memory.py)."""
    copies: dict = {}
    largest = 0
    for specs, expr in compiled:
        for key, labels in specs:
            if len(set(labels)) < len(labels) and (key, labels) not in copies:
                size = dict(zip(labels, fetch(key).shape))
                copies[(key, labels)] = math.prod(size[x] for x in dict.fromkeys(labels))
        largest = max(largest, getattr(expr, "peak", 0))
    return sum(copies.values()) + largest


class OverBudget(Exception):
    pass


# ----------------------------------------------------------------------------------------
# the exact path of sequence models: trees of terms checked, counted, costed and summed
# ----------------------------------------------------------------------------------------

#: The alternatives named when the exact attention path refuses (docs/mathematics.md §3.7).
ALTERNATIVES = ("Alternatives: method='montecarlo' (an estimate with a standard error and a "
                "reliability verdict) or method='closure' (the moment-closure similarity: "
                "APPROXIMATE from the second non-linear layer on, the exact similarity of a "
                "surrogate whose layers read Gaussians with the true second moments over "
                "(position, feature); equal to the exact value for one attention layer; on "
                "trained two-layer checkpoints not an estimate of the tensor similarity)")


# ----------------------------------------------------------------------------------------
# the canonical form: tensoralg.canonical's tree, checked for what the exact path contracts
# ----------------------------------------------------------------------------------------

def _arr(a: np.ndarray, exact: bool) -> np.ndarray:
    if exact:
        if a.dtype == object:
            return np.vectorize(lambda v: v if isinstance(v, Fraction) else Fraction(v),
                                otypes=[object])(a) if a.size else a
        return np.vectorize(lambda v: Fraction(float(v)), otypes=[object])(a) if a.size else \
            a.astype(object)
    return np.asarray(a, dtype=np.float64)


def _attention_core(net: Layer):
    """``(attention layer, residual?)`` for a middle block, or None for a Linear."""
    if isinstance(net, BilinearAttention):
        return net, False
    if isinstance(net, Residual):
        inner = _flatten_layers(net.inner)
        if len(inner) == 1 and isinstance(inner[0], BilinearAttention):
            return inner[0], True
    return None


def _unsupported(name: str, i: int, what: str, degree: int | None = None
                 ) -> AttentionNotSupported:
    """The refusal of a model outside the exact path; ``degree``: the model's polynomial
    degree when it composes non-linear layers, whose unrolled one-node form (every leg
    reading the residual stream or an earlier layer's term, :mod:`tensoralg.degree`) has a
    term of that degree: its pair with itself joins ``2 degree`` legs, ``(2 degree - 1)!!``
    Wick configurations."""
    unrolled = ""
    if degree is not None:
        n = 2 * degree
        count = float(math.prod(range(n - 1, 0, -2)))
        unrolled = (f" Unrolled into one node, its top-degree term paired with itself would "
                    f"join {n} legs (about {count:.2g} Wick configurations, against "
                    f"max_configurations={DEFAULT_MAX_CONFIGURATIONS:,}): out of reach; "
                    f"ta.degree_similarity(a, b, n_ctx=...) computes the lower-degree parts "
                    f"exactly where they fit (S<=5 of two attention layers, S<=9 of an "
                    f"attention + MLP block).")
    return AttentionNotSupported(
        f"{name}: the exact attention inner product handles one attention layer (with or "
        f"without a residual) between per-position Linear layers; layer {i} is {what}."
        f"{unrolled} Use method='montecarlo' or method='closure' (approximate) for deeper "
        f"stacks")


def canonicalize(net: Any, n_ctx: int, name: str = "a", exact: bool = False) -> Tree:
    """The model as the folded canonical :class:`~tensoralg.canonical.Tree` the exact path
    contracts (:func:`tensoralg.canonical.sequence_tree` with ``fold=True``), for ``n_ctx``
    positions: one node, a sum of terms of kind linear (the residual, biases and constants,
    one leg at the query position ``t``) and attention (legs ``Q1, Q2`` at ``t``, ``K1, K2, V``
    at the key position ``s``; cores ``O[o, h, v]`` and ``scale * mask[t, s]``), the embedding
    and unembedding folded into the legs and the output core. Rationals when ``exact`` or the
    model is exact, else float64.

    Raises:
        AttentionNotSupported: a model outside ``[Linear...] (Residual)(attention) [Linear...]``
            (e.g. two attention layers or a bilinear MLP block), naming the layer and the
            alternatives; raised before the tree is folded (no contraction is done).
        ValueError: ``n_ctx`` not a positive int.
    """
    net = as_network(net, name)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) or n_ctx < 1:
        raise ValueError(f"n_ctx: expected a positive int, got {n_ctx!r}")
    layers = _flatten_layers(net)
    try:
        tree = sequence_tree(net, n_ctx, name, exact=exact, fold=False)
    except ValueError as e:   # e.g. a Residual block holding several non-linear layers
        raise AttentionNotSupported(f"{e}. The exact attention inner product handles one "
                                    f"attention layer; montecarlo_inner handles this model as "
                                    f"written, closure_inner once it is written as consecutive "
                                    f"Residual blocks") from e
    seen = False
    for i, node in enumerate(tree.nodes):   # one node per layer, before folding
        kinds = {t.kind for t in node.terms}
        if kinds <= {"linear"}:
            continue
        deep = net.degree if seen else None   # a second non-linear layer composes
        if not kinds <= {"linear", "attention"}:
            what = type(layers[i]).__name__
            if isinstance(layers[i], Residual):   # e.g. Residual(Bilinear): a bilinear MLP
                what += f"({', '.join(type(x).__name__ for x in _flatten_layers(layers[i].inner))})"
            raise _unsupported(name, i, what, deep)
        if seen:
            raise _unsupported(name, i, "a second attention layer", deep)
        seen = True
    tree = tree.folded()
    if len(tree.nodes) != 1 or any(t.kind not in ("linear", "attention")
                                   for t in tree.nodes[0].terms):
        raise AttentionNotSupported(
            f"{name}: the exact attention inner product needs one node of linear and attention "
            f"terms after folding the affine layers, got {len(tree.nodes)} nodes; use "
            f"method='montecarlo' or method='closure' (approximate)")
    return tree


def _slice_output(tree: Tree, output: Any) -> Tree:
    """Apply an ``output=`` int / vector ``u`` to every term of the last node
    (:meth:`~tensoralg.canonical.Term.project_output` by ``u[None]``: output size 1)."""
    if output is None or isinstance(output, str):
        return tree
    exact = tree.exact
    if isinstance(output, numbers.Integral):
        u = np.zeros(tree.d_out, dtype=object)
        u[:] = Fraction(0)
        u[int(output)] = Fraction(1)
        u = _arr(u, exact)
    else:
        u = _arr(np.asarray(output.detach().cpu().double().numpy() if hasattr(output, "detach")
                            else output, dtype=object if exact else np.float64), exact)
    last = tree.nodes[-1]
    node = Node([t.project_output(u[None]) for t in last.terms], last.d_in, 1)
    return replace(tree, nodes=tree.nodes[:-1] + [node], d_out=1)


# ----------------------------------------------------------------------------------------
# exact
# ----------------------------------------------------------------------------------------

def _term_pairs(pa: Tree, pb: Tree):
    """Every (term of a, term of b): the exact path's trees have one node (canonicalize)."""
    return [(x, y) for x in pa.nodes[0].terms for y in pb.nodes[0].terms]


def _prepared_pair(a: Layer, b: Layer, n_ctx: int, output: Any, exact: bool):
    """The folded trees of ``a`` and ``b`` with the ``output`` slice applied, in rationals when
    ``exact`` else float64: what the exact path joins (and counts)."""
    pa = _slice_output(canonicalize(a, n_ctx, "a", exact), output)
    pb = _slice_output(canonicalize(b, n_ctx, "b", exact), output)
    if not exact:
        pa, pb = _floatify(pa), _floatify(pb)
    return pa, pb


def _checked_trees(req: Request, a: Any, b: Any):
    """The checks of :func:`exact_inner` on the pair and slices, then :func:`_prepared_pair`:
    ``(tree of a, tree of b, n_ctx)``."""
    a, b, n_ctx = check_sequence_pair(a, b, req.n_ctx)
    check_slices(req, a.out_features, n_ctx)
    return (*_prepared_pair(a, b, n_ctx, req.output, req.exact), n_ctx)


def count_configurations(a: Any, b: Any, n_ctx: Any = None, *, output: Any = None,
                         backend: str = "numpy") -> int:
    """Number of Wick configurations (partial matchings after zero-pattern pruning) that
    :func:`exact_inner` contracts for the pair with the same ``output`` slice and ``backend``
    (the slice and the rounding decide which legs can be capped). Cheap: no contraction.

    Raises:
        AttentionNotSupported, ValueError: as :func:`exact_inner`, before any work.
    """
    return count_configurations_req(make_request(n_ctx=n_ctx, output=output, backend=backend),
                                    a, b)


def count_configurations_req(req: Request, a: Any, b: Any) -> int:
    """:func:`count_configurations` of a validated request (``position`` ignored)."""
    pa, pb, n_ctx = _checked_trees(req, a, b)
    return sum(JoinedTermPair(x, y, np.ones(n_ctx), (), np.einsum).count()
               for x, y in _term_pairs(pa, pb))


def _dry_cost(pa: Tree, pb: Tree, n_ctx: int, exact: bool, sel, out_mode) -> tuple[int, float]:
    """``(bytes, FLOPs)`` of the chaos strategy, from a dry run (paths found and cached for
    the real run; nothing contracted). Bytes: the estimated peak, every stored ``R[S]`` of
    both models plus the largest working set of one sum (its cached diagonal copies and one
    contraction's live intermediates and step copies, :func:`sum_peak`); 8 bytes per entry
    (float64; one pointer per Fraction in rationals, so low there). FLOPs: the path costs of
    every contraction of the per-model sums and of the cross sums (:func:`sum_flops`; the leg
    grams ``w . P w'``, a few matrix products, come on top)."""
    key = (_shape_signature(pa), _shape_signature(pb), n_ctx, exact, sel.shape, out_mode)
    hit = _DRY_COST.get(key)
    if hit is not None:
        return hit
    sides = {side: [TermSide(t, side, np.einsum, n_ctx, exact, dry=True) for t in p.nodes[0].terms]
             for side, p in (("a", pa), ("b", pb))}
    stored = sum(x.stored for v in sides.values() for x in v)
    cross = [chaos_pair(x, y, sel, out_mode, np.einsum, 1 << 62)[0]
             for x in sides["a"] for y in sides["b"]]
    work = max([x.work for v in sides.values() for x in v] + [c[0] for c in cross])
    flops = sum(x.flops for v in sides.values() for x in v) + sum(c[1] for c in cross)
    if len(_DRY_COST) > 256:
        _DRY_COST.clear()
    _DRY_COST[key] = (8 * (stored + work), float(flops))
    return _DRY_COST[key]


#: The estimates depend on shapes and zero patterns only (what the compiled paths depend on).
_DRY_COST: dict = {}


def _shape_signature(p: Tree) -> tuple:
    return tuple((t.kind, tuple((g.name, g.pos, g.labels, g.positional, g.weight.shape,
                                 g.can_cap, g.can_pair) for g in t.legs),
                  tuple((lab, a.shape) for a, lab in t.cores)) for t in p.nodes[0].terms)


def memory_refusal(need: int, max_memory, backend: str = "numpy", device: Any = None):
    """The refusal message when ``need`` bytes (:func:`chaos_memory_bytes`) exceed
    ``max_memory`` (default: :func:`tensoralg.backends.available_memory`), else None."""
    if max_memory is None:
        max_memory = available_memory(backend, device)
    if need <= max_memory:
        return None
    return (f"exact attention inner product: estimated peak memory {need / 2**30:.3g} GiB (the "
            f"per-model chaos tensors and the largest working set of one sum), over "
            f"max_memory={float(max_memory) / 2**30:.3g} GiB. {ALTERNATIVES}, or raise "
            f"max_memory")


def chaos_memory_bytes(a: Any, b: Any, n_ctx: Any = None, *, output: Any = None,
                       position: Any = None, backend: str = "numpy") -> int:
    """Estimated peak memory (bytes) of :func:`exact_inner` with ``strategy="chaos"`` and the
    same options: the per-model chaos tensors (for each term and each set ``S`` of its open
    legs, the sum ``R[S]`` over matchings of the other legs) plus the largest working set of
    one of its sums (cached diagonal copies, and the intermediates alive along one
    contraction path with one step's transposed copies). From a dry run: paths are found
    (and cached for the real run), nothing is contracted. An estimate, checked against
    tracemalloc peaks in the tests (1.01-1.15x the measured peak); rationals count 8 bytes per
    entry (low: a Fraction takes more).

    Raises:
        AttentionNotSupported, ValueError: as :func:`exact_inner`, before any work.
    """
    return chaos_memory_bytes_req(make_request(n_ctx=n_ctx, output=output, position=position,
                                               backend=backend), a, b)


def chaos_memory_bytes_req(req: Request, a: Any, b: Any) -> int:
    """:func:`chaos_memory_bytes` of a validated request."""
    return chaos_cost_req(req, a, b)[0]


def chaos_cost_req(req: Request, a: Any, b: Any) -> tuple[int, float]:
    """``(estimated peak bytes, estimated FLOPs)`` of :func:`exact_inner` with the chaos
    strategy for a validated request: one dry run (:func:`_dry_cost`), nothing contracted."""
    pa, pb, n_ctx = _checked_trees(req, a, b)
    out_mode = ((QUERY,) if isinstance(req.position, str) else ()) + \
        (("o",) if isinstance(req.output, str) else ())
    return _dry_cost(pa, pb, n_ctx, req.exact, _selector(n_ctx, req.position, req.exact),
                     out_mode)


def max_flops_of(req: Request) -> float:
    """The FLOP budget of ``req``: ``max_flops``, or its default (``DEFAULT_MAX_FLOPS``;
    ``DEFAULT_MAX_FLOPS_EXACT_SEQUENCE`` on the exact backend, where each operation is on
    Fractions)."""
    if req.max_flops is not None:
        return float(req.max_flops)
    return DEFAULT_MAX_FLOPS_EXACT_SEQUENCE if req.exact else DEFAULT_MAX_FLOPS


def flops_refusal(flops: float, req: Request) -> str | None:
    """The refusal message when the chaos strategy's estimated FLOPs exceed the budget of
    ``req`` (:func:`max_flops_of`), else None."""
    budget = max_flops_of(req)
    if flops <= budget:
        return None
    return (f"exact attention inner product: estimated {flops:.3g} FLOPs (the path costs of "
            f"its contractions, from a dry run), over max_flops={budget:.3g}. {ALTERNATIVES}, "
            f"or raise max_flops")


def exact_inner(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None, position: Any = None,
                backend: str = "numpy", strategy: str = "chaos",
                max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, device: Any = None,
                max_memory: float | None = None):
    """Exact Gaussian inner product ``sum_t sum_o E[f_a(X)[t,o] f_b(X)[t,o]]`` of two sequence
    models with at most one bilinear attention layer each (module docstring; docs/mathematics.md §3.7), on
    their folded canonical trees (:func:`canonicalize`).

    Args:
        a, b: sequence models ``[Linear...] -> BilinearAttention or Residual(BilinearAttention)
            -> [Linear...]`` (a Residual may hold Linear layers around the attention; or
            per-position affine models) with the same input size ``d`` and
            output size; the two may have different head counts, head sizes, masks and RoPE.
        n_ctx: the sequence length; may be omitted when a mask array fixes it.
        output: None (sum over outputs), an int ``o``, a direction vector ``u`` (``u . f``) or
            ``"each"`` (an array over outputs).
        position: None (sum over query positions ``t``), an int ``t``, or ``"each"`` (an array
            over positions; with ``output="each"`` an array ``(n_ctx, d_out)``).
        backend: ``"numpy"`` (float64), ``"torch"`` (float64; the larger contractions run in
            torch on ``device``, default CUDA when available) or ``"exact"`` (rationals: floats
            are taken exactly, ``Fraction(float)``; RoPE rotations are the float64 values of
            :func:`tensoralg.layers.rope_rotations`, taken exactly).
        strategy: ``"chaos"`` (default: per-model sums over internal matchings, then
            bijections of the open legs) or ``"matchings"`` (one contraction per partial
            matching of the joined network; slower, kept as a cross-check).
        max_configurations: refuse (before contracting) above this many Wick configurations.
        max_memory: bytes; with ``strategy="chaos"``, refuse (before contracting) when the
            per-model chaos tensors alone (:func:`chaos_memory_bytes`, a lower bound of the peak)
            exceed it. Default: half the available memory of the computing device
            (:func:`tensoralg.backends.available_memory`).

    Returns:
        a float (numpy) or ``Fraction`` (exact); an array for ``"each"``.

    Raises:
        AttentionNotSupported: a model the exact path does not handle (names the alternatives).
        CostTooHigh: over ``max_configurations``, or over ``max_memory`` (names the
            alternatives).
        ValueError: different input/output sizes, neither model a sequence model, an ``n_ctx``
            that disagrees with a mask, a bad ``output``/``position``; all of these before any
            contraction.
    """
    if strategy not in ("chaos", "matchings"):
        raise ValueError(f"strategy: expected 'chaos' or 'matchings', got {strategy!r}")
    req = make_request(n_ctx=n_ctx, output=output, position=position, backend=backend,
                       max_configurations=max_configurations, device=device,
                       max_memory=max_memory)
    return exact_inner_req(req, a, b, strategy=strategy)


def _exact_trees(req: Request, a: Any, b: Any):
    """The checks of :func:`exact_inner` on the pair and slices, before any contraction:
    ``(tree of a, tree of b, n_ctx, out_mode, selector)``."""
    pa, pb, n_ctx = _checked_trees(req, a, b)
    out_mode = (("t",) if isinstance(req.position, str) else ()) + \
        (("o",) if isinstance(req.output, str) else ())
    return pa, pb, n_ctx, out_mode, _selector(n_ctx, req.position, req.exact)


def _check_cost(req: Request, pa: Tree, pb: Tree, n_ctx: int, out_mode, sel,
                strategy: str) -> None:
    """CostTooHigh over ``max_configurations`` or (chaos) the memory estimate over
    ``max_memory`` or the FLOP estimate over ``max_flops`` (:func:`flops_refusal`); nothing
    contracted."""
    n_conf = sum(JoinedTermPair(x, y, sel, out_mode, np.einsum).count()
                 for x, y in _term_pairs(pa, pb))
    if n_conf > req.max_configurations:
        raise CostTooHigh(f"exact attention inner product: {n_conf:,} Wick configurations, "
                          f"over max_configurations={req.max_configurations:,}. "
                          f"{ALTERNATIVES}, or raise max_configurations")
    if strategy == "chaos":
        need, flops = _dry_cost(pa, pb, n_ctx, req.exact, sel, out_mode)
        msg = memory_refusal(need, req.max_memory, req.backend, req.device) or \
            flops_refusal(flops, req)
        if msg is not None:
            raise CostTooHigh(msg)


#: Context length of the small trees that bound a long context's cost from shapes alone.
SHAPE_CTX = 4


def early_memory_refusal(req: Request, a: Any, b: Any) -> tuple[str, int] | None:
    """``(message, bytes)`` when the chaos strategy's stored tensors alone, counted from shapes
    at ``req.n_ctx`` (:func:`~tensoralg.strategies.wick_terms.stored_entries` on trees built
    for ``SHAPE_CTX`` positions: feature sizes and zero patterns do not depend on the context),
    exceed ``max_memory``; else None. Milliseconds, nothing ``n_ctx``-sized allocated, so an
    absurd ``n_ctx`` is refused before the trees (their ``n_ctx x n_ctx`` masks) are built.
    Only when the models leave ``n_ctx`` free (no mask array) and the configurations are
    within budget (then :func:`exact_inner` refuses on them first, with their message)."""
    a, b, n_ctx = check_sequence_pair(a, b, req.n_ctx)
    if n_ctx <= SHAPE_CTX or a.n_ctx is not None or b.n_ctx is not None:
        return None   # (a mask array fixes the context: the trees are the models' own size)
    check_slices(req, a.out_features, n_ctx)
    small = req.replace(n_ctx=SHAPE_CTX, position=None)
    try:
        pa, pb, _, out_mode, sel = _exact_trees(small, a, b)
    except AttentionNotSupported:
        return None   # outside the exact path: refused as such, by the callers' own check
    if sum(JoinedTermPair(x, y, sel, out_mode, np.einsum).count()
           for x, y in _term_pairs(pa, pb)) > req.max_configurations:
        return None
    need = 8 * sum(stored_entries(t, side, n_ctx) for side, p in (("a", pa), ("b", pb))
                   for t in p.nodes[0].terms)
    max_memory = available_memory(req.backend, req.device) if req.max_memory is None \
        else req.max_memory
    if need <= max_memory:
        return None
    return (f"exact attention inner product: at n_ctx={n_ctx:,} the per-model chaos tensors "
            f"alone take at least {need / 2**30:.3g} GiB (from shapes), over "
            f"max_memory={float(max_memory) / 2**30:.3g} GiB. {ALTERNATIVES}, a shorter "
            f"n_ctx, or raise max_memory"), need


def _refuse_early(req: Request, a: Any, b: Any) -> None:
    hit = early_memory_refusal(req, a, b)
    if hit is not None:
        raise CostTooHigh(hit[0])


def exact_inner_req(req: Request, a: Any, b: Any, strategy: str = "chaos"):
    """:func:`exact_inner` of a validated request."""
    if strategy == "chaos":
        _refuse_early(req, a, b)
    pa, pb, n_ctx, out_mode, sel = _exact_trees(req, a, b)
    _check_cost(req, pa, pb, n_ctx, out_mode, sel, strategy)
    return _exact_value(req, pa, pb, n_ctx, out_mode, sel, strategy)


def _exact_value(req: Request, pa: Tree, pb: Tree, n_ctx: int, out_mode, sel,
                 strategy: str = "chaos"):
    """The exact inner product of two prepared (checked) trees."""
    exact, max_configurations = req.exact, req.max_configurations
    ctx = torch_backend("torch" if req.backend == "torch" else "numpy", req.device,
                         "exact_inner")
    total = None
    if strategy == "matchings":
        nets = [JoinedTermPair(x, y, sel, out_mode, np.einsum) for x, y in _term_pairs(pa, pb)]
        for net in nets:
            val, _ = net.contract_all(max_configurations)
            if val is not None:
                total = val if total is None else total + val
    else:
        with ctx:
            sides_a = [TermSide(x, "a", np.einsum, n_ctx, exact) for x in pa.nodes[0].terms]
            sides_b = [TermSide(y, "b", np.einsum, n_ctx, exact) for y in pb.nodes[0].terms]
            for x in sides_a:
                for y in sides_b:
                    val, _ = chaos_pair(x, y, sel, out_mode, np.einsum, max_configurations)
                    if val is not None:
                        total = val if total is None else total + val
    if total is None:
        zero = Fraction(0) if exact else 0.0
        shape = tuple(n_ctx if x == "t" else pa.d_out for x in out_mode)
        return np.full(shape, zero, dtype=_dtype(exact)) if shape else zero
    if isinstance(total, np.ndarray) and total.ndim == 0:
        total = total.item()
    if not exact and not isinstance(total, np.ndarray):
        total = float(total)
    return total


def tree_inner_req(req: Request, pa: Tree, pb: Tree, n_ctx: int):
    """Exact inner product (sum over query positions and outputs) of two float64 one-node
    trees of linear and attention terms built directly, e.g. the truncations of
    :mod:`tensoralg.degree`; the cost is checked first (CostTooHigh over the budget)."""
    sel = _selector(n_ctx, None, False)
    _check_cost(req, pa, pb, n_ctx, (), sel, "chaos")
    return _exact_value(req, pa, pb, n_ctx, (), sel, "chaos")


def _floatify(tree: Tree) -> Tree:
    """An exact tree in float64 (:meth:`~tensoralg.canonical.Tree.map`)."""
    if not tree.exact:
        return tree
    return replace(tree.map(lambda x: np.asarray(x, dtype=np.float64)), exact=False)


def exact_similarity(a: Any, b: Any, *, strategy: str = "chaos", **kw):
    """``<a,b> / sqrt(<a,a> <b,b>)`` with :func:`exact_inner` (same arguments), clipped to
    [-1, 1] in float; with ``backend="exact"`` an :class:`~tensoralg.results.ExactSimilarity`
    (as for position-free networks). The cross term is computed in the pair's canonical order
    (:func:`tensoralg.results.swap_order`), so ``sim(a, b)`` and ``sim(b, a)`` agree bit for
    bit. Raises ValueError when a norm is zero or (float) an inner product overflowed
    float64."""
    if strategy not in ("chaos", "matchings"):
        raise ValueError(f"strategy: expected 'chaos' or 'matchings', got {strategy!r}")
    return exact_similarity_req(make_request(**kw), a, b, strategy)


def exact_similarity_req(req: Request, a: Any, b: Any, strategy: str = "chaos"):
    """:func:`exact_similarity` of a validated request."""
    if strategy == "chaos":
        _refuse_early(req, a, b)
    pa, pb, n_ctx, out_mode, sel = _exact_trees(req, a, b)
    args = (n_ctx, out_mode, sel, strategy)
    for what, x, y in (("<a, b>", pa, pb), ("<a, a>", pa, pa), ("<b, b>", pb, pb)):
        try:
            _check_cost(req, x, y, *args)
        except CostTooHigh as exc:   # ta.plan(a, b) costs <a, b>: say which product refused
            raise CostTooHigh(f"{what} (similarity needs <a, b>, <a, a> and <b, b>; "
                              f"ta.plan(x, y) gives each): {exc}") from None
    x, y = (pb, pa) if swap_order(as_network(a, "a"), as_network(b, "b")) else (pa, pb)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        ab = _exact_value(req, x, y, *args)
        aa = _exact_value(req, pa, pa, *args)
        bb = _exact_value(req, pb, pb, *args)
    return similarity_from(ab, aa, bb, req.exact)


# ----------------------------------------------------------------------------------------
# per head
# ----------------------------------------------------------------------------------------

def _head_model(net: Layer, head: int) -> Layer:
    """The model with its attention layer cut to one head, without o_bias and without the
    residual branch (the attention term of that head, embedding and unembedding kept)."""
    layers = _flatten_layers(net)
    out = []
    for layer in layers:
        core = _attention_core(layer)
        if core is None:
            out.append(layer)
            continue
        at = core[0]
        kw = {k: None if getattr(at, k) is None else getattr(at, k)[head:head + 1]
              for k in ("q1", "k1", "q2", "k2", "v", "q1_bias", "k1_bias", "q2_bias", "k2_bias",
                        "v_bias")}
        out.append(BilinearAttention(**kw, o=at.o[:, head:head + 1], mask=at.mask,
                                     scale=at.scale, rope=at.rope))
    return Sequential(out)


def head_gram(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None, position: Any = None,
              backend: str = "numpy") -> np.ndarray:
    """Exact ``G[h, k] = <head h of a, head k of b>`` (``(n_heads_a, n_heads_b)``).

    Head ``h`` of a model is its attention term restricted to that head (embedding and
    unembedding kept; the residual branch and ``o_bias`` dropped). By bilinearity, ``G.sum()``
    is the inner product of the two attention terms; ``G[h, k] / sqrt(G_aa[h, h] G_bb[k, k])``
    is a per-head similarity. One :func:`exact_inner` per head pair (same arguments).

    Raises:
        ValueError / AttentionNotSupported: as :func:`exact_inner`; a model without attention.
    """
    a, b, n_ctx = check_sequence_pair(a, b, n_ctx)
    cores = []
    for name, net in (("a", a), ("b", b)):
        found = [c for c in map(_attention_core, _flatten_layers(net)) if c is not None]
        if len(found) != 1:
            raise AttentionNotSupported(f"{name}: head_gram needs exactly one attention layer, "
                                        f"found {len(found)}")
        cores.append(found[0][0])
    G = np.empty((cores[0].n_heads, cores[1].n_heads), dtype=_dtype(backend == "exact"))
    for h in range(G.shape[0]):
        ah = _head_model(a, h)
        for k in range(G.shape[1]):
            G[h, k] = exact_inner(ah, _head_model(b, k), n_ctx=n_ctx, output=output,
                                  position=position, backend=backend)
    return G


# ----------------------------------------------------------------------------------------
# Gram matrices over many sequence models
# ----------------------------------------------------------------------------------------


def exact_gram(models, *, n_ctx: Any = None, output: Any = None, position: Any = None,
               similarity: bool = False, **kw) -> np.ndarray:
    """Exact Gram (or similarity, ``similarity=True``) matrix of sequence models with at most
    one attention layer each: :func:`exact_inner` once per unordered pair, the self terms once
    per model (float64; ``kw`` as :func:`exact_inner`, backend ``"numpy"`` or ``"torch"``).

    Raises:
        AttentionNotSupported: a model the exact path does not handle (``models[i]`` named),
            before any contraction. ValueError: as :func:`exact_inner`."""
    if kw.get("backend", "numpy") not in ("numpy", "torch"):
        raise ValueError("exact_gram: backend='numpy' or 'torch' (float64; use exact_inner "
                         "per pair for rationals)")
    req = make_request(n_ctx=n_ctx, output=output, position=position, **kw)
    return exact_gram_req(req, models, similarity)


def exact_gram_req(req: Request, models, similarity: bool = False) -> np.ndarray:
    """:func:`exact_gram` of a validated request (float64: numpy or torch backend)."""
    nets, n_ctx = check_sequence_models(models, req.n_ctx)
    req = req.replace(n_ctx=n_ctx)
    for net in nets:   # each model's own pair bounds the matrix's memory from below
        if net.is_sequence_model:
            _refuse_early(req, net, net)
    for i, net in enumerate(nets):  # every model's support checked before any contraction
        canonicalize(net, n_ctx, f"models[{i}]")
    vals = {}
    token = _IN_SEQUENCE_GRAM.set(True)
    try:
        for i in range(len(nets)):
            for j in range(i, len(nets)):
                vals[(i, j)] = np.asarray(exact_inner_req(req, nets[i], nets[j]),
                                          dtype=np.float64)
    finally:
        _IN_SEQUENCE_GRAM.reset(token)
    G = np.empty((len(nets), len(nets)) + vals[(0, 0)].shape)
    for (i, j), v in vals.items():
        G[i, j] = v
        G[j, i] = v
    return gram_to_similarity(G) if similarity else G
