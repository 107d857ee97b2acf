"""Exact Wick on terms with position-carrying legs (docs/mathematics.md §3.1 and §3.7).

A term of `tensoralg.canonical`'s tree (`Term`) is a lifted
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

* `JoinedTermPair` (``strategy="matchings"``): one contraction per partial matching of
  the joined network; Gram matrices ``w . P w'`` of the matched rows replace the feature index,
  the full coefficient tensor is never formed; paths found once per topology and cached.
* `TermSide` +
  `chaos_pair` (``strategy="chaos"``, the default,
  in `tensoralg.strategies.chaos.sequence`): per term the chaos (Wiener-Ito)
  coefficients ``R[S]``, the sums over partial matchings of the legs outside each open set
  ``S``; two Wick products have expectation the sum over bijections of their
  open legs (orthogonality of Gaussian chaoses), so a pair of terms is a sum over
  ``(S_a, S_b, bijection)``.

No symmetry reduction is applied: the swap ``(Q1, K1) <-> (Q2, K2)`` of an attention term
leaves the function unchanged but not the tensor network unless ``q1 = q2`` and ``k1 = k2``
(docs/mathematics.md §3.7), so every matching is contracted.

Labels: a term's labels are suffixed by its side (``"a"``, ``"b"``) except the shared output
``o`` and query position ``t``; a key position ``s`` becomes ``sa`` / ``sb``
(`term_network`). The sums of contractions of both ways (`compile_sum`,
`run_sum`) run through `tensoralg.strategies.executor`.

The exact path of sequence models, built on both ways, is
`tensoralg.strategies.sequence_exact`.
"""

from __future__ import annotations

import itertools
import math
import weakref

import numpy as np
import opt_einsum as oe

from ...canonical import OUTPUT, QUERY, Leg, Term
from ..executor import Plan
from .matchings import partial_matchings, parts

__all__ = ["term_network", "side_network", "position_variables", "UnionFind", "entry_dtype",
           "JoinedTermPair", "compile_sum", "run_sum", "spec_operands", "Shape", "sum_flops", "sum_peak",
           "OverBudget"]


def entry_dtype(exact: bool):
    return object if exact else np.float64


def _side_label(x: str, side: str) -> str:
    """A term's label on one side of the joined network: the output ``o`` and the query
    position ``t`` are shared, every other label (a key position ``s``, internal ``h``, ...)
    gets the side's suffix."""
    return x if x in (OUTPUT, QUERY) else x + side


def term_network(term: Term, side: str):
    """``(static operands [(array, labels)], legs)`` of one `Term`
    on side ``side`` of a joined network: its cores and legs with labels (tuples of strings)
    and position variables relabelled by `_side_label`."""
    static = [(arr, tuple(_side_label(x, side) for x in lab)) for arr, lab in term.cores]
    legs = [Leg(leg.name + side, leg.weight, tuple(_side_label(x, side) for x in leg.labels),
                _side_label(leg.pos or QUERY, side), leg.positional) for leg in term.legs]
    return static, legs


_NETWORKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def side_network(term: Term, side: str):
    """`term_network` with the legs' zero pattern ``(can_cap, can_pair)`` per leg,
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


def position_variables(legs) -> list:
    """The position variables the legs read, the query position first (always present: the
    output's)."""
    return list(dict.fromkeys([QUERY] + [leg.pos for leg in legs]))


class UnionFind:
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
        sa, la, cap_a, pair_a = side_network(ta, "a")
        sb, lb, cap_b, pair_b = side_network(tb, "b")
        self.static = sa + sb + [(sel_t, (QUERY,))]
        self.legs = la + lb
        self.out_mode = out_mode  # output labels of the whole contraction: () / ("o",) / ...
        self.positions = position_variables(self.legs)
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
        try:
            return rec((1 << n) - 1)
        finally:
            rec = None  # rec refers to itself: break the cycle that holds self

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
            uf = UnionFind(self.positions)
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


#: a group of same-shape contractions runs as one stacked contraction in chunks whose stacked
#: operands, and whose largest intermediate, hold at most about this many entries per member
#: times the chunk's size (`compile_sum`)
GROUP_ENTRIES = 1 << 21

#: whether `compile_sum` groups same-shape contractions (the default; False runs every
#: contraction on its own, the reference the grouped execution is tested against)
GROUPED = True


def _plan(sub: str, ushapes) -> Plan:
    """The cached `Plan` of ``sub`` on ``ushapes`` (contractions of one shape up to the names
    of their labels share a path)."""
    expr = _PLANS.get((sub, tuple(ushapes)))
    if expr is None:
        expr = _PLANS[(sub, tuple(ushapes))] = Plan(sub, ushapes)
    return expr


class _Reduce:
    """The single-operand contraction ``sub`` (``opt_einsum.contract``; not counted in
    `sum_flops`: it reads each entry once)."""

    def __init__(self, sub: str):
        self.sub = sub

    def __call__(self, x, keep=None):
        return oe.contract(self.sub, x)


def compile_sum(key, build, group: bool | None = None):
    """Cached list of ``(operand specs, contract expression)``: ``build()`` returns a list of
    ``(specs, out_labels, shapes)`` with ``specs = [(operand key, labels)]``; the value of the
    sum is the sum of the contractions (`run_sum`).

    ``group`` (default `GROUPED`): contractions with the same subscripts on the same shapes (up to the
    names of their labels) are summed together. Where they differ in one operand only, that
    operand is summed first and the contraction runs once (multilinearity: the same sum, one
    contraction's FLOPs); where they differ in several, those operands are stacked along one
    new label, summed by the contraction itself, and the group runs as one contraction in
    chunks of at most `GROUP_ENTRIES` entries (one batched matrix product per step instead of
    one per member). Such an entry's operand spec is ``(("sum" | "stack", ((key, labels), ...
    per member)), labels)`` (`spec_operands` lists the members)."""
    group = GROUPED if group is None else bool(group)
    key = (key, group)
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    groups: dict = {}
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
        gkey = (sub, tuple(ushapes)) if group else (sub, tuple(ushapes), len(groups))
        groups.setdefault(gkey, []).append(list(specs))
    compiled = []
    for (sub, ushapes, *_), members in groups.items():
        single = sub.count(",") == 0
        expr = _Reduce(sub) if single else _plan(sub, ushapes)
        if len(members) == 1:
            compiled.append((members[0], expr))
            continue
        n = len(members[0])
        varying = [p for p in range(n) if any(m[p] != members[0][p] for m in members[1:])]
        if len(varying) <= 1:   # one operand differs (or none): sum it, contract once
            p = varying[0] if varying else 0
            specs = list(members[0])
            specs[p] = (("sum", tuple(m[p] for m in members)), members[0][p][1])
            compiled.append((specs, expr))
            continue
        per = sum(math.prod(ushapes[p]) for p in varying)
        chunk = max(1, GROUP_ENTRIES // max(per, getattr(expr, "largest", 1), 1))
        lhs, rhs = sub.split("->")
        z = next(oe.get_symbol(k) for k in itertools.count() if oe.get_symbol(k) not in sub)
        for c0 in range(0, len(members), chunk):
            part = members[c0:c0 + chunk]
            if len(part) == 1:
                compiled.append((part[0], expr))
                continue
            terms_ = lhs.split(",")
            gshapes = list(ushapes)
            specs = list(part[0])
            for p in varying:
                terms_[p] = z + terms_[p]
                gshapes[p] = (len(part),) + tuple(ushapes[p])
                specs[p] = (("stack", tuple(m[p] for m in part)), part[0][p][1])
            compiled.append((specs, _plan(",".join(terms_) + "->" + rhs, gshapes)))
    _COMPILED[key] = compiled
    return compiled


def spec_operands(specs):
    """The ``(operand key, labels)`` an entry of `compile_sum` reads (the members of a summed
    or stacked operand)."""
    for key, labels in specs:
        if key[0] in ("sum", "stack"):
            yield from key[1]
        else:
            yield key, labels


def _operand(key, labels, cache, fetch, ein):
    """One operand of a `compile_sum` entry: diagonals taken (cached in ``cache``), a summed
    or stacked group built (not cached)."""
    if key[0] in ("sum", "stack"):
        arrs = [np.asarray(_operand(k, lab, cache, fetch, ein)) for k, lab in key[1]]
        if key[0] == "stack":
            return np.stack(arrs)
        total = arrs[0] + arrs[1]
        for a in arrs[2:]:
            total += a
        return total
    arr = cache.get((key, labels))
    if arr is None:
        arr = cache[(key, labels)] = _diagonal(fetch(key), labels, ein)[0]
    return arr


def run_sum(compiled, fetch, ein):
    """The sum of the contractions of ``compiled`` (`compile_sum`), operands fetched by key."""
    cache = {}
    total = None
    for specs, expr in compiled:
        ops = [_operand(key, labels, cache, fetch, ein) for key, labels in specs]
        keep = [key[0] not in ("sum", "stack") for key, _ in specs]
        val = expr(*ops, keep=keep)
        total = val if total is None else total + val
    return total


class Shape:
    """A shape-only stand-in for an array (dry runs: paths are found, nothing contracted)."""

    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = tuple(shape)


def sum_flops(compiled) -> float:
    """FLOPs of `run_sum` over ``compiled``: the ``opt_einsum`` path cost of each of its
    contractions (`Plan.flops`; a single-operand reduction, which reads each entry once,
    is not counted), from shapes alone."""
    return float(sum(getattr(expr, "flops", 0.0) for _, expr in compiled))


def sum_peak(compiled, fetch) -> int:
    """Elements live at the peak of `run_sum` over ``compiled`` beyond its stored
    operands (an estimate, not a bound): the distinct diagonal copies it caches (operands whose
    labels repeat) plus the largest working set of one contraction (`Plan.peak`:
    intermediates alive along its path and one step's copies; checked against tracemalloc
    peaks in tests/test_attention_memory.py)."""
    copies: dict = {}
    largest = 0
    for specs, expr in compiled:
        for key, labels in spec_operands(specs):
            if len(set(labels)) < len(labels) and (key, labels) not in copies:
                size = dict(zip(labels, fetch(key).shape))
                copies[(key, labels)] = math.prod(size[x] for x in dict.fromkeys(labels))
        temp = 0    # a summed or stacked operand, built for this contraction only
        for key, _labels in specs:
            if key[0] in ("sum", "stack"):
                k, lab = key[1][0]
                size = dict(zip(lab, fetch(k).shape))
                one = math.prod(size[x] for x in dict.fromkeys(lab))
                temp += one * (len(key[1]) if key[0] == "stack" else 1)
        largest = max(largest, getattr(expr, "peak", 0) + temp)
    return sum(copies.values()) + largest


class OverBudget(Exception):
    pass
