"""Gaussian inner products of sequence models with bilinear attention (DESIGN.md section 3.7).

A sequence model maps ``X`` of shape ``(n_ctx, d)`` to ``(n_ctx, d_out)``. Under the Gaussian
metric every entry ``X[s, i]`` is an independent ``N(0, 1)`` and the lifted input is
``x~_s = (1, x_s)`` with the *same* constant 1 at every position. The inner product is

    <a, b> = sum_t sum_o E[ f_a(X)[t, o] * f_b(X)[t, o] ]          (t: query positions)

with ``position=t`` keeping one ``t`` and ``output=`` slicing ``o`` as in ``tensoralg.inner``.

Exact (:func:`exact_inner`). Write both models as tensor networks whose open legs are copies
of the lifted input at some position: a residual / linear term has one leg at ``t``; a
:class:`~tensoralg.layers.BilinearAttention` term has five (``Q1, Q2`` at ``t``;
``K1, K2, V`` at a key position ``s`` summed against the mask). Isserlis' theorem applied to
the non-constant entries (Isserlis 1918; Wick 1950) gives

    E[prod_legs (w_leg . x~_{pos(leg)})] = sum over partial matchings of the legs of
        prod_pairs  delta(pos, pos') * (w . P w')      (P = diag(0, 1, ..., 1))
        prod_single w[0]                               (the cap e0, at any position)

because ``x_s`` and ``x_s'`` are independent for ``s != s'`` and the constant coordinate is
exactly 1 at every position. Each matching is one ``opt_einsum`` contraction of the joined
network over head, head-dimension, value and position indices (Gram matrices ``w . P w'`` of
the matched weight rows replace the feature index; the full coefficient tensor is never
formed); paths are found once per topology and cached. No symmetry reduction is applied: the
swap ``(Q1, K1) <-> (Q2, K2)`` leaves the *function* unchanged but not the tensor network
unless ``q1 = q2`` and ``k1 = k2``, so every matching is contracted (the research code's
deduplication under that swap was wrong). Legs whose constant column is zero are never capped
(an exact zero pattern).

Supported exactly: models of the form ``[Linear...] -> attention or Residual(attention) ->
[Linear...]`` (an embedding applied per position, one attention layer with or without a
residual, biases, any mask, RoPE, an unembedding), and per-position affine models. Deeper
stacks: :func:`montecarlo_inner` (the second-moment closure over (position, feature) is not
implemented yet).
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import opt_einsum as oe

from .layers import (BilinearAttention, Bilinear, Layer, Linear, Residual, Sequential,
                     as_network)

__all__ = ["exact_inner", "exact_similarity", "head_gram", "count_configurations", "canonicalize",
           "montecarlo_inner", "montecarlo_similarity", "AttentionNotSupported",
           "DEFAULT_MAX_CONFIGURATIONS"]

DEFAULT_MAX_CONFIGURATIONS = 200_000


class AttentionNotSupported(ValueError):
    """The exact attention path does not handle this model (raised before any contraction)."""


# ----------------------------------------------------------------------------------------
# canonical form: a sum of terms, each a lifted multilinear map with position-carrying legs
# ----------------------------------------------------------------------------------------

@dataclass
class LinTerm:
    """``y[t, o] = sum_i W[o, i] x~_t[i]`` (constant outputs in column 0)."""

    W: np.ndarray  # (d_out, D)


@dataclass
class AttnTerm:
    """``y[t, o] = sum_{s,h,e1,e2,v} M[t,s] O[o,h,v] (Q1_t x~_t)[h,e1] (K1_s x~_s)[h,e1]
    (Q2_t x~_t)[h,e2] (K2_s x~_s)[h,e2] (V x~_s)[h,v]`` with ``M = scale * mask``.

    ``Q1, K1, Q2, K2`` are ``(n_ctx, H, d_head, D)`` with RoPE (rotated per position) and
    ``(H, d_head, D)`` without; ``V`` is ``(H, d_v, D)``; ``O`` is ``(d_out, H, d_v)``.
    """

    Q1: np.ndarray
    K1: np.ndarray
    Q2: np.ndarray
    K2: np.ndarray
    V: np.ndarray
    O: np.ndarray
    M: np.ndarray
    rope: bool


@dataclass
class SequencePolynomial:
    """A model as a sum of terms over the lifted input of size ``D = d_in + 1``."""

    terms: list
    d_in: int
    d_out: int
    exact: bool


def _dtype(exact: bool):
    return object if exact else np.float64


def _arr(a: np.ndarray, exact: bool) -> np.ndarray:
    if exact:
        if a.dtype == object:
            return np.vectorize(lambda v: v if isinstance(v, Fraction) else Fraction(v),
                                otypes=[object])(a) if a.size else a
        return np.vectorize(lambda v: Fraction(float(v)), otypes=[object])(a) if a.size else \
            a.astype(object)
    return np.asarray(a, dtype=np.float64)


def _lifted_linear(layer: Linear, exact: bool) -> np.ndarray:
    """``(out + 1, in + 1)`` lifted affine map with row 0 = e0 (the constant stays 1)."""
    W = _arr(layer.weight, exact)
    out, inp = W.shape
    zero, one = (Fraction(0), Fraction(1)) if exact else (0.0, 1.0)
    A = np.full((out + 1, inp + 1), zero, dtype=_dtype(exact))
    A[0, 0] = one
    A[1:, 1:] = W
    if layer.bias is not None:
        A[1:, 0] = _arr(layer.bias, exact)
    return A


def _identity(n: int, exact: bool) -> np.ndarray:
    if exact:
        I = np.full((n, n), Fraction(0), dtype=object)
        for i in range(n):
            I[i, i] = Fraction(1)
        return I
    return np.eye(n)


def _flatten_layers(net: Layer) -> list:
    if isinstance(net, Sequential):
        return [x for layer in net.layers for x in _flatten_layers(layer)]
    return [net]


def _attention_core(net: Layer):
    """``(attention layer, residual?)`` for a middle block, or None for a Linear."""
    if isinstance(net, BilinearAttention):
        return net, False
    if isinstance(net, Residual):
        inner = _flatten_layers(net.inner)
        if len(inner) == 1 and isinstance(inner[0], BilinearAttention):
            return inner[0], True
    return None


def canonicalize(net: Any, n_ctx: int, name: str = "a", exact: bool = False) -> SequencePolynomial:
    """The model as a :class:`SequencePolynomial` (lifted terms), for ``n_ctx`` positions.

    Raises:
        AttentionNotSupported: a model outside ``[Linear...] (Residual)(attention) [Linear...]``
            (e.g. two attention layers or a bilinear MLP block), naming the alternatives.
    """
    net = as_network(net, name)
    layers = _flatten_layers(net)
    exact = exact or net.is_exact
    pre, post, core = [], [], None
    for i, layer in enumerate(layers):
        if isinstance(layer, Linear):
            (post if core is not None else pre).append(layer)
            continue
        c = _attention_core(layer)
        if c is None or core is not None:
            what = type(layer).__name__ if c is None else "a second attention layer"
            raise AttentionNotSupported(
                f"{name}: the exact attention inner product handles one attention layer (with or "
                f"without a residual) between per-position Linear layers; layer {i} is {what}. "
                f"Use montecarlo_inner for deeper stacks (a closure method is planned)")
        core = c
    D = net.in_features + 1
    E = _identity(D, exact)
    for layer in pre:
        E = _lifted_linear(layer, exact) @ E
    U = _identity(E.shape[0], exact) if core is None else _identity(core[0].out_features + 1, exact)
    for layer in post:
        U = _lifted_linear(layer, exact) @ U
    terms = []
    if core is None:
        terms.append(LinTerm((U @ E)[1:]))
        return SequencePolynomial(terms, net.in_features, net.out_features, exact)
    attn, residual = core
    L = {k: (None if v is None else _arr(v, exact)) for k, v in attn.lifted().items()}
    zero = Fraction(0) if exact else 0.0
    # constant and residual parts: U[:, 0] + U[1:] o_bias (+ U[1:] E x~ with a residual)
    W = np.full((U.shape[0] - 1, D), zero, dtype=_dtype(exact))
    W[:, 0] = U[1:, 0]
    if L["o_bias"] is not None:
        W[:, 0] = W[:, 0] + U[1:, 1:] @ L["o_bias"]
    if residual:
        W = W + U[1:, 1:] @ E[1:]
    if any(v != 0 for v in W.reshape(-1)):
        terms.append(LinTerm(W))
    mask = _arr(attn.mask_matrix(n_ctx), exact)
    scale = Fraction(attn.scale) if exact else float(attn.scale)
    M = mask * scale
    proj = {k: np.einsum("hef,fi->hei", L[k], E) for k in ("q1", "k1", "q2", "k2", "v")}
    rope = attn.rope is not None
    if rope:
        R = _arr(attn.rotations(n_ctx), exact)
        for k in ("q1", "k1", "q2", "k2"):
            proj[k] = np.einsum("tef,hfi->thei", R, proj[k])
    O = np.einsum("op,phv->ohv", U[1:, 1:], L["o"])
    terms.append(AttnTerm(proj["q1"], proj["k1"], proj["q2"], proj["k2"], proj["v"], O, M, rope))
    return SequencePolynomial(terms, net.in_features, U.shape[0] - 1, exact)


# ----------------------------------------------------------------------------------------
# the joined network of one term pair
# ----------------------------------------------------------------------------------------

@dataclass
class Leg:
    """An open leg: ``weight[(p), *internal, i]`` read against ``x~`` at position ``pos``."""

    name: str
    weight: np.ndarray
    pos: str  # position variable: "t", "sa", "sb"
    labels: tuple  # internal labels (without the position)
    positional: bool  # weight has a leading position axis

    @property
    def can_cap(self) -> bool:
        return bool(np.any(self.weight[..., 0] != 0))

    @property
    def can_pair(self) -> bool:
        return bool(np.any(self.weight[..., 1:] != 0))


def _term_network(term, side: str, o_label: str):
    """``(static operands [(array, labels)], legs)`` of one term; labels are strings."""
    if isinstance(term, LinTerm):
        return [], [Leg(f"lin_{side}", term.W, "t", (o_label,), False)]
    s = "s" + side
    h, e1, e2, v = (f"h{side}", f"e1{side}", f"e2{side}", f"v{side}")
    static = [(term.O, (o_label, h, v)), (term.M, ("t", s))]
    legs = [Leg(f"Q1{side}", term.Q1, "t", (h, e1), term.rope),
            Leg(f"K1{side}", term.K1, s, (h, e1), term.rope),
            Leg(f"Q2{side}", term.Q2, "t", (h, e2), term.rope),
            Leg(f"K2{side}", term.K2, s, (h, e2), term.rope),
            Leg(f"V{side}", term.V, s, (h, v), False)]
    return static, legs


def _partial_matchings(n: int, can_cap, can_pair):
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
            # keep "t" as the representative so query-position selectors stay valid
            if rb == "t":
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


@dataclass
class _Config:
    subscripts: str
    operands: list  # keys into the operand table, with label-diagonal specs
    expr: Any = field(default=None, repr=False)


class JoinedTermPair:
    """The joined tensor network of one term of ``a`` and one term of ``b``, with the Gram
    matrices ``w . P w'`` of every leg pair and the caps ``w[..., 0]`` precomputed."""

    def __init__(self, ta, tb, sel_t, out_mode, ein):
        self.ein = ein
        sa, la = _term_network(ta, "a", "o")
        sb, lb = _term_network(tb, "b", "o")
        self.static = sa + sb + [(sel_t, ("t",))]
        self.legs = la + lb
        self.out_mode = out_mode  # output labels of the whole contraction: () / ("o",) / ...
        n = len(self.legs)
        self.can_cap = [leg.can_cap for leg in self.legs]
        pairable = [leg.can_pair for leg in self.legs]
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
        return _partial_matchings(len(self.legs), self.can_cap, self.can_pair)

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
            uf = _UnionFind(["t", "sa", "sb"])
            for part in matching:
                if len(part) == 2:
                    uf.union(self.legs[part[0]].pos, self.legs[part[1]].pos)
            pos = {p: uf.find(p) for p in ("t", "sa", "sb")}
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
            raise _OverBudget()
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


def _compile_sum(key, build):
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
        else:
            expr = oe.contract_expression(sub, *ushapes,
                                          optimize="greedy")
        compiled.append((specs, expr))
    _COMPILED[key] = compiled
    return compiled


def _run_sum(compiled, fetch, ein):
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


class _Side:
    """One term of one model in chaos (Wiener-Ito) form: for every set ``S`` of open legs, the
    sum ``R[S]`` over partial matchings of the *other* legs (pairs bridged by ``delta P``,
    caps ``e0``). Then ``f = sum_S R[S] :prod_{leg in S} (w_leg . xi):`` (Wick products of
    the open legs), and two Wick products have expectation ``sum over bijections of the
    pairs' bridges`` (orthogonality of Gaussian chaoses)."""

    def __init__(self, term, side: str, ein, n_ctx: int, exact: bool):
        self.side, self.ein = side, ein
        self.static, self.legs = _term_network(term, side, "o")
        # O (the output map) is kept for the cross stage; M stays inside R
        self.outer = [x for x in self.static if x[1][0] == "o"]
        self.inner = [x for x in self.static if x[1][0] != "o"]
        n = len(self.legs)
        self.can_cap = [L.can_cap for L in self.legs]
        self.can_pair_leg = [L.can_pair for L in self.legs]
        self.n_ctx = n_ctx
        self.exact = exact
        self._gram = {}
        self.R = {}
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

    def _compute(self, n):
        legs = self.legs
        pos_s = "s" + self.side
        for S in range(1 << n):
            opened = [i for i in range(n) if S >> i & 1]
            closed = [i for i in range(n) if not S >> i & 1]
            present = set(x for _, lab in self.inner for x in lab)
            for i in closed:
                present |= set(_leg_labels(legs[i], legs[i].pos))
            wanted = ["t", "o"] + [legs[i].pos for i in opened] + \
                [x for i in opened for x in legs[i].labels]
            wanted += [x for _, lab in self.outer for x in lab]
            out = tuple(x for x in dict.fromkeys(wanted) if x in present)
            sub_cap = [self.can_cap[i] for i in closed]
            sub_pair = [[self.can_pair_leg[i] and self.can_pair_leg[j] for j in closed]
                        for i in closed]
            matchings = list(_partial_matchings(len(closed), sub_cap, sub_pair))
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

            compiled = _compile_sum(key, build)
            self.R[S] = (np.asarray(_run_sum(compiled, self.fetch, self.ein),
                                    dtype=_dtype(self.exact)), out)

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


def _chaos_pair(sa: _Side, sb: _Side, sel, out_mode, ein, budget: int):
    """``sum_{S_a, S_b} sum_{bijections} <R_a[S_a], R_b[S_b]>`` with cross bridges."""
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

    pairable = [[A.can_pair and B.can_pair for B in lb] for A in la]
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
        raise _OverBudget()
    key = ("cross", sa.signature(), sb.signature(),
           tuple(sorted((k, v[1]) for k, v in sa.R.items())),
           tuple(sorted((k, v[1]) for k, v in sb.R.items())), out_mode, sel.shape)

    def build():
        for S_a, S_b, pairs in items:
            uf = _UnionFind(["t", "sa", "sb"])
            for i, j in pairs:
                uf.union(la[i].pos, lb[j].pos)
            rel = lambda lab: tuple(uf.find(x) if x in ("t", "sa", "sb") else x for x in lab)  # noqa: E731
            specs = [(("sel",), ("t",))]
            if sa.R[S_a][0] is not None:
                specs.append((("Ra", S_a), rel(sa.R[S_a][1])))
            if sb.R[S_b][0] is not None:
                specs.append((("Rb", S_b), rel(sb.R[S_b][1])))
            specs += [(("Oa", k), lab) for k, (_, lab) in enumerate(sa.outer)]
            specs += [(("Ob", k), lab) for k, (_, lab) in enumerate(sb.outer)]
            for i, j in pairs:
                specs.append((("g", i, j), _gram_labels(la[i], lb[j], uf.find(la[i].pos))))
            yield specs, out_mode, [fetch(k).shape for k, _ in specs]

    compiled = _compile_sum(key, build)
    return _run_sum(compiled, fetch, ein), len(items)


class _OverBudget(Exception):
    pass


# ----------------------------------------------------------------------------------------
# argument checking shared by every method
# ----------------------------------------------------------------------------------------

def _resolve_n_ctx(a: Layer, b: Layer, n_ctx: Any) -> int:
    fixed = {name: m.n_ctx for name, m in (("a", a), ("b", b)) if m.n_ctx is not None}
    if len(set(fixed.values())) > 1:
        raise ValueError(f"a and b: attention masks fix different sequence lengths "
                         f"(a: n_ctx={fixed['a']}, b: n_ctx={fixed['b']})")
    if n_ctx is None:
        if not fixed:
            raise ValueError("n_ctx: required (the masks of a and b are 'causal'/'none' and fix "
                             "no sequence length)")
        return next(iter(fixed.values()))
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) or n_ctx < 1:
        raise ValueError(f"n_ctx: expected a positive int, got {n_ctx!r}")
    for name, n in fixed.items():
        if n != n_ctx:
            raise ValueError(f"n_ctx={n_ctx} differs from {name}'s attention mask of shape "
                             f"({n}, {n})")
    return int(n_ctx)


def _check_pair(a: Any, b: Any, n_ctx: Any):
    a, b = as_network(a, "a"), as_network(b, "b")
    if not (a.is_sequence_model or b.is_sequence_model):
        raise ValueError("a and b: neither model holds attention; these are position-free networks: "
                         "use tensoralg.inner")
    if a.in_features != b.in_features:
        raise ValueError(f"a and b must read the same input: a has in_features={a.in_features}, "
                         f"b has in_features={b.in_features}")
    if a.out_features != b.out_features:
        raise ValueError(f"a and b must have the same number of outputs: a has "
                         f"out_features={a.out_features}, b has out_features={b.out_features}")
    return a, b, _resolve_n_ctx(a, b, n_ctx)


def _check_slices(output: Any, position: Any, d_out: int, n_ctx: int):
    if output is not None and not (isinstance(output, str) and output == "each"):
        if isinstance(output, str):
            raise ValueError(f"output: expected None, an int, 'each' or a vector, got {output!r}")
        if isinstance(output, numbers.Integral) and not isinstance(output, bool):
            if not -d_out <= int(output) < d_out:
                raise ValueError(f"output: class index {output} out of range for {d_out} outputs")
        else:
            u = np.asarray(output, dtype=object)
            if u.shape != (d_out,):
                raise ValueError(f"output: a direction vector must have shape ({d_out},), got "
                                 f"{u.shape}")
    if position is not None and not (isinstance(position, str) and position == "each"):
        if isinstance(position, bool) or not isinstance(position, numbers.Integral) or \
                not -n_ctx <= int(position) < n_ctx:
            raise ValueError(f"position: expected None, 'each' or an int in [-{n_ctx}, {n_ctx}), "
                             f"got {position!r}")


def _slice_output(poly: SequencePolynomial, output: Any) -> SequencePolynomial:
    """Apply an ``output=`` int / vector slice to every term (output size becomes 1)."""
    if output is None or isinstance(output, str):
        return poly
    exact = poly.exact
    if isinstance(output, numbers.Integral):
        u = np.zeros(poly.d_out, dtype=object)
        u[:] = Fraction(0)
        u[int(output)] = Fraction(1)
        u = _arr(u, exact)
    else:
        u = _arr(np.asarray(output.detach().cpu().double().numpy() if hasattr(output, "detach")
                            else output, dtype=object if exact else np.float64), exact)
    terms = []
    for term in poly.terms:
        if isinstance(term, LinTerm):
            terms.append(LinTerm((u @ term.W)[None]))
        else:
            terms.append(AttnTerm(term.Q1, term.K1, term.Q2, term.K2, term.V,
                                  np.einsum("o,ohv->hv", u, term.O)[None], term.M, term.rope))
    return SequencePolynomial(terms, poly.d_in, 1, exact)


def _selector(n_ctx: int, position: Any, exact: bool) -> np.ndarray:
    sel = np.zeros(n_ctx, dtype=_dtype(exact))
    one, zero = (Fraction(1), Fraction(0)) if exact else (1.0, 0.0)
    sel[:] = zero
    if position is None or isinstance(position, str):
        sel[:] = one
    else:
        sel[int(position)] = one
    return sel


# ----------------------------------------------------------------------------------------
# exact
# ----------------------------------------------------------------------------------------

def _term_pairs(pa: SequencePolynomial, pb: SequencePolynomial):
    return [(x, y) for x in pa.terms for y in pb.terms]


def count_configurations(a: Any, b: Any, n_ctx: Any = None) -> int:
    """Number of Wick configurations (partial matchings after zero-pattern pruning) that
    :func:`exact_inner` contracts for the pair. Cheap: no contraction is done."""
    a, b, n_ctx = _check_pair(a, b, n_ctx)
    pa, pb = canonicalize(a, n_ctx, "a"), canonicalize(b, n_ctx, "b")
    total = 0
    for ta_, tb_ in _term_pairs(pa, pb):
        net = JoinedTermPair(ta_, tb_, np.ones(n_ctx), (), np.einsum)
        total += net.count()
    return total


def exact_inner(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None, position: Any = None,
                backend: str = "numpy", strategy: str = "chaos",
                max_configurations: int = DEFAULT_MAX_CONFIGURATIONS):
    """Exact Gaussian inner product ``sum_t sum_o E[f_a(X)[t,o] f_b(X)[t,o]]`` of two sequence
    models with at most one bilinear attention layer each (module docstring; DESIGN 3.7).

    Args:
        a, b: sequence models ``[Linear...] -> BilinearAttention or Residual(BilinearAttention)
            -> [Linear...]`` (or per-position affine models) with the same input size ``d`` and
            output size; the two may have different head counts, head sizes, masks and RoPE.
        n_ctx: the sequence length; may be omitted when a mask array fixes it.
        output: None (sum over outputs), an int ``o``, a direction vector ``u`` (``u . f``) or
            ``"each"`` (an array over outputs).
        position: None (sum over query positions ``t``), an int ``t``, or ``"each"`` (an array
            over positions; with ``output="each"`` an array ``(n_ctx, d_out)``).
        backend: ``"numpy"`` (float64) or ``"exact"`` (rationals: floats are taken exactly,
            ``Fraction(float)``; RoPE rotations are the float64 values of
            :func:`tensoralg.layers.rope_rotations`, taken exactly).
        strategy: ``"chaos"`` (default: per-model sums over internal matchings, then
            bijections of the open legs) or ``"matchings"`` (one contraction per partial
            matching of the joined network; slower, kept as a cross-check).
        max_configurations: refuse (before contracting) above this many Wick configurations.

    Returns:
        a float (numpy) or ``Fraction`` (exact); an array for ``"each"``.

    Raises:
        AttentionNotSupported: a model the exact path does not handle (names the alternatives).
        ValueError: different input/output sizes, neither model a sequence model, an ``n_ctx``
            that disagrees with a mask, a bad ``output``/``position``, over
            ``max_configurations``; all before any contraction.
    """
    if backend not in ("numpy", "exact"):
        raise ValueError(f"backend: expected 'numpy' or 'exact', got {backend!r}")
    if strategy not in ("chaos", "matchings"):
        raise ValueError(f"strategy: expected 'chaos' or 'matchings', got {strategy!r}")
    a, b, n_ctx = _check_pair(a, b, n_ctx)
    _check_slices(output, position, a.out_features, n_ctx)
    exact = backend == "exact"
    pa = _slice_output(canonicalize(a, n_ctx, "a", exact), output)
    pb = _slice_output(canonicalize(b, n_ctx, "b", exact), output)
    if not exact:
        pa = _floatify(pa)
        pb = _floatify(pb)
    out_mode = (("t",) if isinstance(position, str) else ()) + \
        (("o",) if isinstance(output, str) else ())
    sel = _selector(n_ctx, position, exact)
    nets = [JoinedTermPair(x, y, sel, out_mode, np.einsum) for x, y in _term_pairs(pa, pb)]
    n_conf = sum(net.count() for net in nets)
    if n_conf > max_configurations:
        raise ValueError(f"exact attention inner product: {n_conf:,} Wick configurations, over "
                         f"max_configurations={max_configurations:,}; use montecarlo_inner "
                         f"(approximate, with a standard error)")
    total = None
    if strategy == "matchings":
        for net in nets:
            val, _ = net.contract_all(max_configurations)
            if val is not None:
                total = val if total is None else total + val
    else:
        sides_a = [_Side(x, "a", np.einsum, n_ctx, exact) for x in pa.terms]
        sides_b = [_Side(y, "b", np.einsum, n_ctx, exact) for y in pb.terms]
        for x in sides_a:
            for y in sides_b:
                val, _ = _chaos_pair(x, y, sel, out_mode, np.einsum, max_configurations)
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


def _floatify(p: SequencePolynomial) -> SequencePolynomial:
    if not p.exact:
        return p
    f = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    terms = [LinTerm(f(t.W)) if isinstance(t, LinTerm) else
             AttnTerm(f(t.Q1), f(t.K1), f(t.Q2), f(t.K2), f(t.V), f(t.O), f(t.M), t.rope)
             for t in p.terms]
    return SequencePolynomial(terms, p.d_in, p.d_out, False)


def exact_similarity(a: Any, b: Any, **kw):
    """``<a,b> / sqrt(<a,a> <b,b>)`` with :func:`exact_inner` (same arguments). Exact backend:
    a sympy number. Raises ValueError when a norm is zero."""
    ab = exact_inner(a, b, **kw)
    aa = exact_inner(a, a, **kw)
    bb = exact_inner(b, b, **kw)
    if isinstance(ab, np.ndarray):
        return ab / np.sqrt(np.asarray(aa, dtype=np.float64) * np.asarray(bb, dtype=np.float64))
    if aa == 0 or bb == 0:
        raise ValueError("similarity: a model with zero norm has no direction")
    if kw.get("backend") == "exact":
        import sympy as sp
        return sp.Rational(ab.numerator, ab.denominator) / sp.sqrt(
            sp.Rational(aa.numerator, aa.denominator) * sp.Rational(bb.numerator, bb.denominator))
    return ab / math.sqrt(aa * bb)


# ----------------------------------------------------------------------------------------
# Monte Carlo (any depth)
# ----------------------------------------------------------------------------------------

def _per_sample(fa, fb, output, position):
    if position is not None:
        fa, fb = fa[:, int(position)][:, None], fb[:, int(position)][:, None]
    if output is None:
        return (fa * fb).sum(axis=(1, 2))
    if isinstance(output, numbers.Integral):
        return (fa[..., int(output)] * fb[..., int(output)]).sum(axis=1)
    u = np.asarray(output, dtype=np.float64)
    return ((fa @ u) * (fb @ u)).sum(axis=1)


def montecarlo_inner(a: Any, b: Any, *, n_ctx: Any = None, n_samples: int = 20_000,
                     seed: int = 0, output: Any = None, position: Any = None,
                     n_batches: int = 20):
    """Monte Carlo estimate (approximate) of ``sum_t sum_o E[f_a(X)[t,o] f_b(X)[t,o]]`` for
    sequence models of any depth, with its standard error.

    ``X`` of shape ``(n_ctx, d)`` has iid ``N(0, 1)`` entries (numpy ``default_rng(seed)``);
    both models are evaluated in float64 on the same samples. The ``n_samples`` draws are
    split into ``n_batches`` equal batches; the standard error is the batch-means one,
    ``std(batch means, ddof=1) / sqrt(n_batches)`` (central limit theorem; the samples are iid,
    so it estimates the same error as the plain one).

    Args:
        output: None, an int or a direction vector (no ``"each"``); position: None or an int.

    Returns:
        ``tensoralg.MonteCarloEstimate`` (a float with ``.stderr`` and ``.n_samples``).

    Raises:
        ValueError: as :func:`exact_inner` for the pair and slices; ``n_samples`` below
            ``2 * n_batches``; ``n_batches < 2``; a negative ``seed``.
    """
    from .products import MonteCarloEstimate

    a, b, n_ctx = _check_pair(a, b, n_ctx)
    if isinstance(output, str) or isinstance(position, str):
        raise ValueError("montecarlo_inner: output='each' / position='each' are not supported; "
                         "loop over the slices")
    _check_slices(output, position, a.out_features, n_ctx)
    if isinstance(n_batches, bool) or not isinstance(n_batches, numbers.Integral) or n_batches < 2:
        raise ValueError(f"n_batches: expected an int >= 2, got {n_batches!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or \
            n_samples < 2 * n_batches:
        raise ValueError(f"n_samples: expected an int >= 2 * n_batches = {2 * n_batches}, got "
                         f"{n_samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    a, b = a.astype_float(), b.astype_float()
    rng = np.random.default_rng(int(seed))
    size = int(n_samples) // int(n_batches)
    means = np.empty(int(n_batches))
    for k in range(int(n_batches)):
        X = rng.standard_normal((size, n_ctx, a.in_features))
        means[k] = _per_sample(a(X), b(X), output, position).mean()
    se = float(np.std(means, ddof=1) / math.sqrt(len(means)))
    return MonteCarloEstimate(float(means.mean()), se, size * int(n_batches))


def montecarlo_similarity(a: Any, b: Any, **kw):
    """``<a,b> / sqrt(<a,a> <b,b>)`` from one set of samples (approximate; ratio of Monte Carlo
    means, consistent with bias O(1/n)); same arguments as :func:`montecarlo_inner`."""
    ab = montecarlo_inner(a, b, **kw)
    aa = montecarlo_inner(a, a, **kw)
    bb = montecarlo_inner(b, b, **kw)
    return float(ab) / math.sqrt(float(aa) * float(bb))


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
    a, b, n_ctx = _check_pair(a, b, n_ctx)
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
