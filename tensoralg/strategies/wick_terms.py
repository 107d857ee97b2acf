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

No symmetry reduction is applied: the swap ``(Q1, K1) <-> (Q2, K2)`` of an attention term
leaves the function unchanged but not the tensor network unless ``q1 = q2`` and ``k1 = k2``
(docs/mathematics.md §3.7), so every matching is contracted.

Labels: a term's labels are suffixed by its side (``"a"``, ``"b"``) except the shared output
``o`` and query position ``t``; a key position ``s`` becomes ``sa`` / ``sb``
(:func:`term_network`). Contractions run through :mod:`tensoralg.strategies.executor`.
"""

from __future__ import annotations

import itertools
import math
import weakref
from fractions import Fraction

import numpy as np
import opt_einsum as oe

from ..canonical import OUTPUT, QUERY, Leg, Term
from .executor import Plan

__all__ = ["term_network", "partial_matchings", "JoinedTermPair", "TermSide", "chaos_pair",
           "compile_sum", "run_sum", "OverBudget"]


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


_NETWORKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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


def partial_matchings(n: int, can_cap, can_pair):
    """All partial matchings of ``range(n)`` as tuples of pairs and singletons (caps)."""
    def rec(rest):
        if not rest:
            yield ()
            return
        i, others = rest[0], rest[1:]
        if can_cap[i]:
            for m in rec(others):
                yield ((i,),) + m
        for k, j in enumerate(others):
            if can_pair[i][j]:
                for m in rec(others[:k] + others[k + 1:]):
                    yield ((i, j),) + m
    yield from rec(tuple(range(n)))


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
        return partial_matchings(len(self.legs), self.can_cap, self.can_pair)

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
            for k, (arr, labels) in enumerate(self.static):
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
            for kind, labels, uniq in specs:
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
        #: of entries the R[S] would take and ``work`` the elements live at the peak of the
        #: largest of their sums (:func:`sum_peak`); the compiled paths are cached for the run.
        self.dry, self.stored, self.work = dry, 0, 0
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
        present = set(x for _, lab in inner for x in lab)
        for i in closed:
            present |= set(_leg_labels(legs[i], legs[i].pos))
        wanted = [QUERY, OUTPUT] + [legs[i].pos for i in opened] + \
            [x for i in opened for x in legs[i].labels]
        wanted += [x for _, lab in outer for x in lab]
        out = tuple(x for x in dict.fromkeys(wanted) if x in present)
        sub_cap = [can_cap[i] for i in closed]
        sub_pair = [[can_pair_leg[i] and can_pair_leg[j] for j in closed] for i in closed]
        yield S, closed, out, partial_matchings(len(closed), sub_cap, sub_pair)


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


def chaos_pair(sa: TermSide, sb: TermSide, sel, out_mode, ein, budget: int):
    """``sum_{S_a, S_b} sum_{bijections} <R_a[S_a], R_b[S_b]>`` with cross bridges; with two
    dry sides (:class:`TermSide` ``dry=True``) nothing is contracted and the value is the
    number of elements live at the peak of that sum (:func:`sum_peak`)."""
    la, lb = sa.legs, sb.legs
    grams = {}

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
        if key not in grams:
            grams[key] = _gram(la[key[1]], lb[key[2]], ein)
        return grams[key]

    pairable = [[x and y for y in sb.can_pair_leg] for x in sa.can_pair_leg]
    positions = _positions(la + lb)
    items = []
    for S_a, (Ra, laba) in sa.R.items():
        open_a = [i for i in range(len(la)) if S_a >> i & 1]
        for S_b, (Rb, labb) in sb.R.items():
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
           tuple(sorted((k, v[1]) for k, v in sb.R.items())), out_mode, sel.shape)

    def build():
        for S_a, S_b, pairs in items:
            uf = _UnionFind(positions)
            for i, j in pairs:
                uf.union(la[i].pos, lb[j].pos)
            rel = lambda lab: tuple(uf.find(x) if x in positions else x for x in lab)  # noqa: E731
            specs = [(("sel",), (QUERY,))]
            if sa.R[S_a][0] is not None:
                specs.append((("Ra", S_a), rel(sa.R[S_a][1])))
            if sb.R[S_b][0] is not None:
                specs.append((("Rb", S_b), rel(sb.R[S_b][1])))
            specs += [(("Oa", k), lab) for k, (_, lab) in enumerate(sa.outer)]
            specs += [(("Ob", k), lab) for k, (_, lab) in enumerate(sb.outer)]
            for i, j in pairs:
                specs.append((("g", i, j), _gram_labels(la[i], lb[j], uf.find(la[i].pos))))
            yield specs, out_mode, [fetch(k).shape for k, _ in specs]

    compiled = compile_sum(key, build)
    if sa.dry or sb.dry:  # the cross grams stay alive through the sum
        return sum_peak(compiled, fetch) + _gram_entries(compiled, fetch, "g"), len(items)
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
