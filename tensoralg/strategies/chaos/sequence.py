"""Exact chaos on terms with position-carrying legs: the default way of the exact path of
sequence models (docs/mathematics.md §3.1 and §3.7; the Wick sum over the joined term pair,
`tensoralg.strategies.wick.terms`, gives equal values and tests cross-check them).

* `TermSide` + `chaos_pair` (``strategy="chaos"``, the default): per term the
  chaos (Wiener-Ito) coefficients ``R[S]``, the sums over partial matchings of the legs outside
  each open set ``S``; two Wick products have expectation the sum over bijections of their
  open legs (orthogonality of Gaussian chaoses), so a pair of terms is a sum over
  ``(S_a, S_b, bijection)``.

Two reductions keep the sum and drop terms that are zero or one: a cross item whose bridges
identify the two key positions sums over the (query, key) pairs where both masks are nonzero
only (one packed label; a causal mask keeps ``n(n+1)/2`` of ``n^2``), and the all-ones selector
of a sum over every query position is left out where another operand carries its label.

The position-free chaos strategy is `.position_free`.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import opt_einsum as oe

from ...canonical import OUTPUT, QUERY, Leg, Term
from ..wick.matchings import partial_matchings, parts
from ..wick.terms import (
    OverBudget,
    Shape,
    UnionFind,
    compile_sum,
    entry_dtype,
    position_variables,
    run_sum,
    side_network,
    spec_operands,
    sum_flops,
    sum_peak,
)

__all__ = ["TermSide", "chaos_pair", "stored_entries"]


class TermSide:
    """One term of one model in chaos (Wiener-Ito) form: for every set ``S`` of open legs, the
    sum ``R[S]`` over partial matchings of the *other* legs (pairs bridged by ``delta P``,
    caps ``e0``). Then ``f = sum_S R[S] :prod_{leg in S} (w_leg . xi):`` (Wick products of
    the open legs), and two Wick products have expectation ``sum over bijections of the
    pairs' bridges`` (orthogonality of Gaussian chaoses)."""

    def __init__(self, term, side: str, ein, n_ctx: int, exact: bool, dry: bool = False):
        self.side, self.ein = side, ein
        self.static, self.legs, can_cap, can_pair = side_network(term, side)
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
        #: largest of their sums (`sum_peak`) and ``flops`` their path costs
        #: (`sum_flops`); the compiled paths are cached for the run.
        self.dry, self.stored, self.work, self.flops = dry, 0, 0, 0.0
        self._compute(n)

    def relabeled(self, term, side: str) -> TermSide:
        """This side's chaos form as the `TermSide` of ``term`` (the term this side was
        built from) on ``side``: the same ``R[S]`` arrays (shared, not copied) under that side's
        labels. The two sides of one term differ only in their labels' suffixes (same shapes,
        same contraction paths), so this is what ``TermSide(term, side, ...)`` computes, without
        the contractions."""
        new = object.__new__(TermSide)
        new.__dict__.update(self.__dict__)
        new.side = side
        new.static, new.legs, can_cap, can_pair = side_network(term, side)
        if len(new.static) != len(self.static) or len(new.legs) != len(self.legs):
            raise ValueError("relabeled: term is not the term of this side")
        new.outer = [x for x in new.static if OUTPUT in x[1]]
        new.inner = [x for x in new.static if OUTPUT not in x[1]]
        new.can_cap, new.can_pair_leg = list(can_cap), list(can_pair)
        new._gram = {}
        rename = {}
        for (_, la), (_, lb) in zip(self.static, new.static):
            rename.update(zip(la, lb))
        for La, Lb in zip(self.legs, new.legs):
            rename.update(zip(La.labels, Lb.labels))
            rename[La.pos] = Lb.pos
        new.R = {S: (arr, tuple(rename.get(x, x) for x in lab))
                 for S, (arr, lab) in self.R.items()}
        return new

    def gram(self, i, j):
        if (i, j) not in self._gram:
            self._gram[(i, j)] = _gram(self.legs[i], self.legs[j], self.ein)
        return self._gram[(i, j)]

    def _delta(self):
        one, zero = (Fraction(1), Fraction(0)) if self.exact else (1.0, 0.0)
        I = np.full((self.n_ctx, self.n_ctx), zero, dtype=entry_dtype(self.exact))
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
                self._grams_read.update(k for specs, _ in compiled
                                        for k, _ in spec_operands(specs) if k[0] == "gram")
                continue
            self.R[S] = (np.asarray(run_sum(compiled, self.fetch, self.ein),
                                    dtype=entry_dtype(self.exact)), out)
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
    """`TermSide._layout` of a side given by its parts."""
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
    for x in position_variables(legs):
        size[x] = n_ctx
    return size


def stored_entries(term: Term, side: str, n_ctx: int) -> int:
    """Entries of the chaos tensors ``R[S]`` a `TermSide` of ``term`` stores when its
    positions take ``n_ctx`` values, from shapes and zero patterns alone: no path search,
    nothing allocated, and ``term`` may come from a tree built for a shorter context (its
    feature sizes do not depend on it). A lower bound on the chaos strategy's peak memory (the
    leg grams and the working set of a sum come on top)."""
    static, legs, can_cap, can_pair = side_network(term, side)
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
    """``w_A . P w_B`` over the non-constant features, labels as `_gram_labels`."""
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
    dry sides (`TermSide` ``dry=True``) nothing is contracted and the value is
    ``(elements live at the peak of that sum (`sum_peak`), its FLOPs
    (`sum_flops`))``.

    An item whose bridges identify the two key positions sums over the (query, key) pairs
    where both masks are nonzero only (`_pack_plan`; a causal mask: ``n(n+1)/2`` of
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
    positions = position_variables(la + lb)
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
            uf = UnionFind(positions)
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

    try:
        compiled = compile_sum(key, build)
        if sa.dry or sb.dry:  # the cross grams and packed copies stay alive through the sum
            return (sum_peak(compiled, fetch) + _gram_entries(compiled, fetch, "g") +
                    _gram_entries(compiled, fetch, "pk"), sum_flops(compiled)), len(items)
        return run_sum(compiled, fetch, ein), len(items)
    finally:
        # ``fetch`` calls itself (packed operands), a reference cycle that would keep the
        # packed copies and cross grams alive until the garbage collector runs: the next
        # inner product's peak would stack on this one's
        packs.clear()
        grams.clear()
        fetch = None  # the cell the cycle runs through: frees both sides too



def _gram_entries(compiled, fetch, kind: str) -> int:
    """Entries of the distinct gram operands (key kind ``kind``) that ``compiled`` reads."""
    keys = {key for specs, _ in compiled for key, _ in spec_operands(specs) if key[0] == kind}
    return sum(math.prod(fetch(key).shape) for key in keys)
