"""Canonical lifted forms of a multilinear network (docs/canonical.md).

The general form (bottom of this module) is a `Tree`: a chain of `Node` s, each
a sum of `Term` s (lifted multilinear maps: linear, bilinear or attention), whose
`Leg` s read the lifted input at a position variable; the chain unrolls into a tree.
The exact attention path and the closure read it (`sequence_tree`), as does the networkx
view. The position-free strategies (Wick, chaos) read its packed binary-chain specialization
`Canonical`, built directly by `canonicalize` and described next
(`Canonical.tree` turns it into nodes).

Every network of [`tensoralg.layers`][tensoralg.layers] is rewritten, exactly, as maps between
*lifted* spaces (``x~ = (1, x)``, constant at index 0, docs/mathematics.md §2):

* a linear layer becomes ``W~ = [[1, 0], [b, W]]`` of shape ``(out+1, in+1)``;
* a bilinear layer becomes ``(L~, R~, D~)`` with ``L~, R~ : (H+1, in+1)`` and ``D~ : (out+1, H+1)``;
  hidden unit 0 is the constant unit (``L~_0 = R~_0 = e0``) that carries the constant and the
  output bias;
* a residual block ``x + inner(x)`` widens every stage of ``inner`` with units that carry ``x``
  along (``x_i = (e_i . x~)(e0 . x~)`` through a bilinear stage) and adds it at the end;
* consecutive linear maps are folded into the neighbouring bilinear factors, except a leading
  *embedding* that narrows the input (``m < d``): it is kept apart as ``embed`` so that the
  legs of the tensor network stay at the model width ``m + 1`` (the Wick strategy bridges two
  legs through the embedding Gram ``E_a E_b^T``; the chaos strategy whitens the joint input
  covariance, docs/mathematics.md §3.6).

The result is a `Canonical`: an optional lifted ``embed`` followed by ``stages`` (lifted
bilinear stages, applied in order) or, for a network of degree 1, a single lifted matrix
``linear``. As a tensor network it is a full binary tree with ``2**len(stages)`` input legs
(docs/mathematics.md §2), each leg a copy of the lifted (embedded) input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import numpy as np
import opt_einsum as oe

from .layers import Bilinear, BilinearAttention, Layer, Linear, Residual, Sequential, as_network

__all__ = ["Stage", "Canonical", "canonicalize", "stack", "Leg", "Term", "Node", "Tree",
           "tree", "sequence_tree", "resolve_n_ctx", "flatten_layers", "lift_rows", "zeros_array"]


@dataclass
class Stage:
    """Lifted bilinear stage ``x~_out = D ((L x~_in) * (R x~_in))``; arrays may carry a leading
    batch axis (a stack of models)."""

    L: np.ndarray
    R: np.ndarray
    D: np.ndarray


@dataclass
class Canonical:
    """Canonical lifted form; ``stages`` empty means degree 1, given by ``linear``.

    ``embed`` (optional, only with stages): the lifted leading linear map ``(m+1, d+1)`` (or
    ``(N, m+1, d+1)`` for a stack), applied before the first stage, whose factors then have
    ``m + 1`` columns."""

    d: int
    out: int
    stages: list[Stage] = field(default_factory=list)
    linear: np.ndarray | None = None
    exact: bool = False
    embed: np.ndarray | None = None
    #: Results derived from this exact object (e.g. chaos coefficients per output projection),
    #: set only on the read-only stacks of `tensoralg.prepare`'s cache; ``replace``,
    #: ``map``, ``sub`` and ``folded`` start without one.
    memo: dict | None = field(default=None, init=False, repr=False, compare=False)

    def folded(self) -> Canonical:
        """The same network with its embedding folded into the first stage's factors."""
        if self.embed is None:
            return self
        s0 = self.stages[0]
        E = self.embed
        mm = (lambda x, y: np.matmul(x, y)) if not self.exact else (
            lambda x, y: np.einsum("...ij,...jk->...ik", x, y))
        first = Stage(mm(s0.L, E), mm(s0.R, E), s0.D)
        return replace(self, stages=[first] + list(self.stages[1:]), embed=None)

    def map(self, fn) -> Canonical:
        """A copy with ``fn`` applied to every array."""
        f = lambda a: None if a is None else fn(a)  # noqa: E731
        return replace(self, stages=[Stage(fn(s.L), fn(s.R), fn(s.D)) for s in self.stages],
                       linear=f(self.linear), embed=f(self.embed))

    def sub(self, idx) -> Canonical:
        """Models ``idx`` of a stack (leading batch axis)."""
        return self.map(lambda a: a[idx])

    @property
    def depth(self) -> int:
        return len(self.stages)

    @property
    def n_legs(self) -> int:
        return 2 ** self.depth

    def arrays(self) -> list[np.ndarray]:
        if not self.stages:
            return [self.linear]
        head = [] if self.embed is None else [self.embed]
        return head + [a for s in self.stages for a in (s.L, s.R, s.D)]

    def shapes(self) -> tuple:
        return tuple(a.shape for a in self.arrays())

    def tree(self) -> Tree:
        """This binary chain as a `Tree` of nodes (shares the arrays): the embedding (if
        kept) and a degree-0 network are linear nodes, every stage one bilinear term with legs
        ``L``, ``R`` (hidden label ``h``) and core ``D`` without its constant row.

        Raises:
            ValueError: a stage whose hidden unit 0 is not the constant unit
                (``L_0 = R_0 = D[0] = e0``, as `canonicalize` builds it), e.g. after
                rescaling; dropping its constant row would not be exact.
        """
        batched = self.arrays()[0].ndim == 3
        o = (OUTPUT,)
        if not self.stages:
            node = Node([Term("linear", (Leg("W", self.linear[..., 1:, :], o),))], self.d,
                        self.out)
            return Tree([node], self.d, self.out, None, self.exact, batched)
        nodes = []
        if self.embed is not None:
            E = self.embed
            nodes.append(Node([Term("linear", (Leg("E", E[..., 1:, :], o),))], self.d,
                              E.shape[-2] - 1))
        for k, st in enumerate(self.stages):
            if k < self.depth - 1:
                for name, a in (("L", st.L[..., 0, :]), ("R", st.R[..., 0, :]),
                                ("D", st.D[..., 0, :])):
                    if not (np.all(a[..., 0] == 1) and np.all(a[..., 1:] == 0)):
                        raise ValueError(f"stage {k + 1}: {name}[0] is not e0; not a canonical "
                                         f"chain (rescaled?)")
            term = Term("bilinear", (Leg(f"L{k + 1}", st.L, ("h",)),
                                     Leg(f"R{k + 1}", st.R, ("h",))),
                        ((st.D[..., 1:, :], (OUTPUT, "h")),))
            nodes.append(Node([term], st.L.shape[-1] - 1, st.D.shape[-2] - 1))
        return Tree(nodes, self.d, self.out, None, self.exact, batched)


def zeros_array(shape, exact: bool) -> np.ndarray:
    if exact:
        out = np.empty(shape, dtype=object)
        out.fill(Fraction(0))
        return out
    return np.zeros(shape)


def _one(exact: bool):
    return Fraction(1) if exact else 1.0


def _lift_linear(layer: Linear, exact: bool) -> np.ndarray:
    out, inp = layer.weight.shape
    W = zeros_array((out + 1, inp + 1), exact)
    W[0, 0] = _one(exact)
    W[1:, 1:] = layer.weight
    if layer.bias is not None:
        W[1:, 0] = layer.bias
    return W


def _lift_bilinear(layer: Bilinear, exact: bool) -> Stage:
    H, inp = layer.left.shape
    out = layer.down.shape[0]
    L = zeros_array((H + 1, inp + 1), exact)
    R = zeros_array((H + 1, inp + 1), exact)
    D = zeros_array((out + 1, H + 1), exact)
    L[0, 0] = R[0, 0] = D[0, 0] = _one(exact)
    L[1:, 1:] = layer.left
    R[1:, 1:] = layer.right
    D[1:, 1:] = layer.down
    if layer.left_bias is not None:
        L[1:, 0] = layer.left_bias
    if layer.right_bias is not None:
        R[1:, 0] = layer.right_bias
    if layer.down_bias is not None:
        D[1:, 0] = layer.down_bias
    return Stage(L, R, D)


def _ops(layer: Layer, exact: bool) -> list:
    """The layer as a list of lifted ops: np.ndarray (linear) or Stage (bilinear)."""
    if isinstance(layer, Linear):
        return [_lift_linear(layer, exact)]
    if isinstance(layer, Bilinear):
        return [_lift_bilinear(layer, exact)]
    if isinstance(layer, Sequential):
        return [op for sub in layer.layers for op in _ops(sub, exact)]
    if isinstance(layer, Residual):
        return _residual(_ops(layer.inner, exact), layer.in_features, exact)
    raise TypeError(f"unknown layer type {type(layer).__name__}; expected Linear, Bilinear, "
                    f"Residual or Sequential")


def _residual(ops: list, d: int, exact: bool) -> list:
    """Exact rewrite of ``x + f(x)`` where ``f`` is the chain ``ops`` (``d -> d``).

    Every intermediate lifted space ``(1, y)`` becomes ``(1, y, x)``: linear ops carry ``x`` by an
    identity block, bilinear ops by ``d`` extra hidden units ``x_i * 1``. The last op adds ``x`` to
    its output instead of carrying it.
    """
    one = _one(exact)
    new = []
    n_ops = len(ops)
    for idx, op in enumerate(ops):
        first, last = idx == 0, idx == n_ops - 1
        # columns of x inside this op's input space
        if isinstance(op, np.ndarray):
            m1, n1 = op.shape
        else:
            m1, n1 = op.D.shape[0], op.L.shape[1]
        n_in = n1 if first else n1 + d
        x_cols = list(range(1, d + 1)) if first else list(range(n1, n1 + d))
        m_out = m1 if last else m1 + d
        x_rows = list(range(1, d + 1)) if last else list(range(m1, m1 + d))
        if isinstance(op, np.ndarray):
            W = zeros_array((m_out, n_in), exact)
            W[:m1, :n1] = op
            for r, c in zip(x_rows, x_cols):
                W[r, c] = W[r, c] + one
            new.append(W)
        else:
            H1 = op.L.shape[0]
            L = zeros_array((H1 + d, n_in), exact)
            R = zeros_array((H1 + d, n_in), exact)
            D = zeros_array((m_out, H1 + d), exact)
            L[:H1, :n1] = op.L
            R[:H1, :n1] = op.R
            D[:m1, :H1] = op.D
            for i, (r, c) in enumerate(zip(x_rows, x_cols)):
                L[H1 + i, c] = one
                R[H1 + i, 0] = one
                D[r, H1 + i] = D[r, H1 + i] + one
            new.append(Stage(L, R, D))
    return new


def canonicalize(net: Layer, keep_embed: bool = True) -> Canonical:
    """Exact canonical lifted form of ``net`` (float64 arrays, or Fractions if ``net.is_exact``).

    ``keep_embed``: keep a leading linear map that narrows the input (``m < d``) apart as
    ``embed`` instead of folding it into the first stage's factors."""
    exact = net.is_exact
    ops = _ops(net, exact)
    stages: list[Stage] = []
    embed = None
    pending: np.ndarray | None = None  # product of linear maps not yet folded
    for op in ops:
        if isinstance(op, np.ndarray):
            pending = op if pending is None else op @ pending
        else:
            if pending is not None:
                if not stages and keep_embed and pending.shape[0] < pending.shape[1]:
                    embed = pending
                else:
                    op = Stage(op.L @ pending, op.R @ pending, op.D)
                pending = None
            stages.append(op)
    if stages and pending is not None:
        last = stages[-1]
        stages[-1] = Stage(last.L, last.R, pending @ last.D)
        pending = None
    if exact:
        for s in stages:
            for a in (s.L, s.R, s.D):
                a[...] = np.vectorize(Fraction, otypes=[object])(a)
        if pending is not None:
            pending = np.vectorize(Fraction, otypes=[object])(pending)
        if embed is not None:
            embed = np.vectorize(Fraction, otypes=[object])(embed)
    return Canonical(d=net.in_features, out=net.out_features, stages=stages, linear=pending,
                     exact=exact, embed=embed)


def stack(cans: list[Canonical], name: str = "models") -> Canonical:
    """Stack canonical forms of same-architecture models on a leading batch axis.

    Raises:
        ValueError: models whose canonical shapes differ (name the first mismatch).
    """
    ref = cans[0]
    if any((c.embed is None) != (ref.embed is None) for c in cans):
        cans = [c.folded() for c in cans]
        ref = cans[0]
    for i, c in enumerate(cans[1:], start=1):
        if c.depth != ref.depth or c.shapes() != ref.shapes():
            raise ValueError(f"{name}[{i}]: architecture differs from {name}[0] (canonical "
                             f"shapes {c.shapes()} vs {ref.shapes()}); a batched Gram matrix "
                             f"needs same-architecture models")
    exact = all(c.exact for c in cans)

    def st(arrs):
        if exact:
            return np.stack(arrs).astype(object)
        if len(arrs) == 1:  # one model: a view (canonical forms own their arrays)
            return np.asarray(arrs[0], dtype=np.float64)[None]
        return np.stack([np.asarray(a, dtype=np.float64) for a in arrs])

    if not ref.stages:
        return Canonical(ref.d, ref.out, [], st([c.linear for c in cans]), exact)
    stages = [Stage(st([c.stages[k].L for c in cans]), st([c.stages[k].R for c in cans]),
                    st([c.stages[k].D for c in cans])) for k in range(ref.depth)]
    embed = None if ref.embed is None else st([c.embed for c in cans])
    return Canonical(ref.d, ref.out, stages, None, exact, embed)


# ========================================================================================
# The general canonical form: a tree of lifted multilinear nodes with position-carrying legs
# ========================================================================================
#
# docs/mathematics.md §4 ("graph / canonical"): a network is a chain of *nodes* (one per non-linear layer,
# affine layers folded in), each node a *sum of terms* (a residual ``x + f(x)`` is two terms),
# each term a lifted multilinear map: ``cores`` (static tensors) contracted with ``legs``
# (factor rows read against the node's lifted input ``x~ = (1, y)`` of the previous node).
# The legs of node ``k + 1`` read copies of node ``k``'s output, so the chain unrolls into a
# tree of degree ``prod_k max_term degree``. A leg of a sequence model reads ``x~`` at a
# *position variable* (``"t"``: the query position, the output's; ``"s"``: a key position
# summed inside an attention term against the mask); a positional leg (RoPE, position maps) has a leading
# position axis. Kinds: linear (1 leg), bilinear (2 legs sharing the hidden index ``h``),
# attention (5 legs: ``Q1, Q2`` at ``t``; ``K1, K2, V`` at ``s``; docs/mathematics.md §3.7).
#
# Labels are one character each: ``o`` (output feature), ``t``/``s`` (positions), and
# per-term internal labels (``h``; ``e``, ``f``, ``v`` for attention). A term's open labels are
# ``out``: ``("o",)`` for position-free networks, ``("t", "o")`` for sequence models. Arrays
# of a *batched* tree carry one more leading axis (the model of a stack), not in the labels.
#
# The strategies read this form: exact attention (the joined network of two terms), the
# closure (node by node), the networkx view; the position-free Wick and chaos strategies read
# its packed binary-chain specialization `Canonical` (every node one bilinear term,
# residuals widened into it), which `Canonical.tree` turns into nodes.

QUERY, KEY, OUTPUT = "t", "s", "o"


@dataclass(frozen=True, eq=False)
class Leg:
    """An open input leg: rows ``weight[(p,) *labels, i]`` read against the lifted input
    ``x~`` of the node (``i = 0`` the constant 1) at position variable ``pos``.

    ``weight`` has shape ``([N,] [n_ctx,] *sizes(labels), D)``: a leading model axis when the
    tree is batched, a position axis when ``positional`` (e.g. RoPE-rotated queries/keys), one
    axis per internal label, and the lifted input width ``D`` last. ``pos`` is None for
    position-free networks."""

    name: str
    weight: np.ndarray
    labels: tuple
    pos: str | None = None
    positional: bool = False

    @property
    def can_cap(self) -> bool:
        """Whether the constant column is non-zero somewhere (the leg may be capped by e0)."""
        return bool(np.any(self.weight[..., 0] != 0))

    @property
    def can_pair(self) -> bool:
        """Whether a non-constant column is non-zero (the leg may pair with another)."""
        return bool(np.any(self.weight[..., 1:] != 0))

    def with_weight(self, weight: np.ndarray) -> Leg:
        return Leg(self.name, weight, self.labels, self.pos, self.positional)


@dataclass(frozen=True, eq=False)
class Term:
    """One lifted multilinear map of degree ``len(legs)``: the contraction of ``cores``
    (``(array, labels)``) and ``legs`` over every label except ``out``; labels repeated between
    legs and cores are summed (hyperedges: a bilinear hidden index ``h`` joins ``D``, ``L``, ``R``).
    Position variables other than the output's (``t``) are summed (``s`` against the mask)."""

    kind: str  # "linear" | "bilinear" | "attention"
    legs: tuple
    cores: tuple = ()
    out: tuple = (OUTPUT,)

    @property
    def degree(self) -> int:
        return len(self.legs)

    def map(self, fn) -> Term:
        """A copy with ``fn`` applied to every array."""
        return Term(self.kind, tuple(leg.with_weight(fn(leg.weight)) for leg in self.legs),
                    tuple((fn(a), lab) for a, lab in self.cores), self.out)

    def project_output(self, U: np.ndarray) -> Term:
        """``U @ term`` over the output label (``U``: ``(K, d_out)``; rationals or float64).
        The output label sits on exactly one core or leg (checked)."""
        where = [("c", k) for k, (_, lab) in enumerate(self.cores) if OUTPUT in lab] + \
            [("l", k) for k, leg in enumerate(self.legs) if OUTPUT in leg.labels]
        if len(where) != 1:
            raise ValueError(f"{self.kind} term: the output label sits on {len(where)} arrays, "
                             f"expected 1")
        kind, k = where[0]
        if kind == "c":
            arr, lab = self.cores[k]
            ax = lab.index(OUTPUT) + (arr.ndim - len(lab))
            new = np.moveaxis(np.tensordot(U, arr, axes=([1], [ax])), 0, ax)
            cores = self.cores[:k] + ((new, lab),) + self.cores[k + 1:]
            return Term(self.kind, self.legs, cores, self.out)
        leg = self.legs[k]
        extra = leg.weight.ndim - 1 - len(leg.labels)  # model / position axes
        ax = extra + leg.labels.index(OUTPUT)
        new = np.moveaxis(np.tensordot(U, leg.weight, axes=([1], [ax])), 0, ax)
        legs = self.legs[:k] + (leg.with_weight(new),) + self.legs[k + 1:]
        return Term(self.kind, legs, self.cores, self.out)


@dataclass
class Node:
    """One node of the tree: the sum of ``terms``, a map from the lifted ``d_in + 1`` input to
    ``d_out`` outputs (the constant output coordinate is implicit: the next node's ``x~[0]``)."""

    terms: list
    d_in: int
    d_out: int

    @property
    def degree(self) -> int:
        return max((t.degree for t in self.terms), default=0)

    @property
    def kind(self) -> str:
        kinds = [t.kind for t in self.terms]
        for k in ("attention", "bilinear"):
            if k in kinds:
                return k
        return "linear"

    def map(self, fn) -> Node:
        return Node([t.map(fn) for t in self.terms], self.d_in, self.d_out)


@dataclass
class Tree:
    """A network as a chain of `Node` s: the legs of node ``k + 1`` read (copies of) node
    ``k``'s lifted output; node 0 reads the lifted network input ``(1, x)`` (per position for a
    sequence model, ``n_ctx`` set). ``batched``: every array has a leading model axis."""

    nodes: list
    d_in: int
    d_out: int
    n_ctx: int | None = None
    exact: bool = False
    batched: bool = False

    @property
    def depth(self) -> int:
        """Number of non-affine nodes."""
        return sum(1 for n in self.nodes if n.degree > 1)

    @property
    def degree(self) -> int:
        """Polynomial degree bound: the product over nodes of the largest term degree (the
        most input legs one product of terms reads). Not the number of open legs of the
        unrolled tree, which sums the terms' degrees per node (a residual attention layer:
        degree 5, 6 open legs)."""
        return math.prod(max(1, n.degree) for n in self.nodes)

    @property
    def is_sequence(self) -> bool:
        return self.n_ctx is not None

    def map(self, fn) -> Tree:
        return replace(self, nodes=[n.map(fn) for n in self.nodes])

    def folded(self) -> Tree:
        """The tree with its affine nodes folded into their neighbours, exactly (what
        `sequence_tree` does with ``fold=True``).

        Raises:
            ValueError: a batched tree.
        """
        if self.batched:
            raise ValueError("Tree.folded: fold one model (an unbatched tree)")
        return replace(self, nodes=_fold(self.nodes, self.exact))

    def legs(self) -> list:
        """Every leg of every term, node by node (not unrolled)."""
        return [leg for n in self.nodes for t in n.terms for leg in t.legs]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Evaluate the tree (a reference implementation, for checks): ``x`` of shape
        ``(n, d_in)`` (or ``(n, n_ctx, d_in)`` for a sequence model) gives ``(n, d_out)``
        (``(n, n_ctx, d_out)``); float64 or object arrays of Fractions. Unbatched trees only.

        Raises:
            ValueError: a batched tree, or ``x`` of the wrong shape.
        """
        if self.batched:
            raise ValueError("Tree.forward: evaluate one model (an unbatched tree)")
        x = np.asarray(x)
        want = (self.n_ctx, self.d_in) if self.is_sequence else (self.d_in,)
        if x.ndim != len(want) + 1 or x.shape[1:] != want:
            raise ValueError(f"x: expected shape (n, {', '.join(map(str, want))}), got {x.shape}")
        y = x if self.is_sequence else x[:, None, :]   # one position for vector networks
        for node in self.nodes:
            y = _node_forward(node, y)
        return y if self.is_sequence else y[:, 0, :]


def _node_forward(node: Node, y: np.ndarray) -> np.ndarray:
    """``(n, n_pos, d_in) -> (n, n_pos, d_out)`` for one node (reference evaluation)."""
    one = np.ones(y.shape[:2] + (1,), dtype=y.dtype)
    if y.dtype == object:
        one[...] = Fraction(1)
    z = np.concatenate([one, y], axis=2)  # (n, n_pos, D)
    total = None
    for term in node.terms:
        ops, subs = [], []
        sym: dict = {}

        def s(lab, sym=sym):
            if lab not in sym:
                sym[lab] = oe.get_symbol(len(sym))
            return sym[lab]

        s("#i")  # the lifted input index, contracted leg by leg

        for arr, lab in term.cores:
            ops.append(arr)
            subs.append("".join(s(c) for c in lab))
        for leg in term.legs:
            p = leg.pos or QUERY
            # (n, p, *labels) = weight[(p), *labels, i] . z[n, p, i]
            wl = (s(p) if leg.positional else "") + "".join(s(c) for c in leg.labels) + s("#i")
            zl = s("#n") + s(p) + s("#i")
            ol = s("#n") + s(p) + "".join(s(c) for c in leg.labels)
            ops.append(np.einsum(f"{wl},{zl}->{ol}", leg.weight, z))
            subs.append(ol)
        out = s("#n") + s(QUERY) + s(OUTPUT)
        # a term whose legs never read the query position (a constant) is broadcast over it
        val = _broadcast_query(ops, subs, out, z.shape[1], y.dtype)
        total = val if total is None else total + val
    if total is None:
        raise ValueError("node without terms")
    return total


def _broadcast_query(ops, subs, out, n_pos, dtype):
    present = set("".join(subs))
    expr = ",".join(subs) + "->" + "".join(c for c in out if c in present)
    val = np.einsum(expr, *ops) if ops else None
    if out[1] not in present:
        val = np.repeat(np.expand_dims(val, 1), n_pos, axis=1)
    if out[0] not in present:  # no leg: a constant term (not produced by canonicalization)
        raise ValueError("a term without legs")
    return val


# ----------------------------------------------------------------------------------------
# sequence models: one node per layer (docs/mathematics.md §3.7), affine layers optionally folded
# ----------------------------------------------------------------------------------------

def _num(a: Any, exact: bool) -> np.ndarray:
    """float64, or an object array of Fractions (floats taken exactly)."""
    a = np.asarray(a, dtype=object if exact else None)
    if not exact:
        return np.asarray(a, dtype=np.float64)
    if a.size == 0:
        return a.astype(object)
    return np.vectorize(lambda v: v if isinstance(v, Fraction) else Fraction(v),
                        otypes=[object])(a)


def _eye(n: int, exact: bool) -> np.ndarray:
    if not exact:
        return np.eye(n)
    out = zeros_array((n, n), True)
    for i in range(n):
        out[i, i] = Fraction(1)
    return out


def flatten_layers(net: Layer) -> list:
    if isinstance(net, Sequential):
        return [x for layer in net.layers for x in flatten_layers(layer)]
    return [net]


def _lifted_affine(layer: Linear, exact: bool) -> np.ndarray:
    """``(out + 1, in + 1)``, row 0 = e0, in rationals when ``exact`` (floats taken exactly)."""
    return _num(_lift_linear(layer, exact), exact)


def _lin_term(W: np.ndarray) -> Term:
    """``y[t, o] = W[o] . x~_t`` (``W``: ``(d_out, D)``)."""
    return Term("linear", (Leg("W", W, (OUTPUT,), QUERY),), (), (QUERY, OUTPUT))


def _layer_node(layer: Layer, n_ctx: int, exact: bool, name: str, index: int) -> Node:
    """One layer of a sequence model as a node: a Linear (applied per position), a Bilinear
    (per position), a BilinearAttention, or a Residual around ``[Linear...] core [Linear...]``
    (affine maps inside the block folded into the core's legs and output)."""
    residual = isinstance(layer, Residual)
    inner = flatten_layers(layer.inner) if residual else [layer]
    for x in inner:
        if not isinstance(x, (Linear, Bilinear, BilinearAttention)):
            raise TypeError(f"{name}: layer {index}: unknown layer type {type(x).__name__}; "
                            f"expected Linear, Bilinear, BilinearAttention, Residual or "
                            f"Sequential")
    cores = [k for k, x in enumerate(inner) if not isinstance(x, Linear)]
    if len(cores) > 1:
        raise ValueError(f"{name}: layer {index}: a Residual block holding {len(cores)} "
                         f"non-linear layers; write the stack as consecutive Residual blocks")
    d_in = inner[0].in_features
    D = d_in + 1
    E = _eye(D, exact)          # lifted affine maps before the core
    U = None                    # lifted affine maps after it
    core = None
    for x in inner:
        if isinstance(x, Linear):
            A = _lifted_affine(x, exact)
            if core is None:
                E = A @ E
            else:
                U = A @ U
        else:
            core = x
            U = _eye(x.out_features + 1, exact)
    if core is None:  # an affine node
        W = E[1:].copy()
        if residual:
            W[:, 1:] = W[:, 1:] + _eye(d_in, exact)
        return Node([_lin_term(W)], d_in, W.shape[0])
    d_out = U.shape[0] - 1
    const = zeros_array((d_out, D), exact)
    const[:, 0] = U[1:, 0]
    P = U[1:, 1:]
    terms = []
    if isinstance(core, Bilinear):
        def lifted(w, b):  # the factor with its bias in column 0, after E
            w = _num(w, exact)
            col = zeros_array((w.shape[0], 1), exact) if b is None else _num(b, exact)[:, None]
            return np.concatenate([col, w], axis=1) @ E
        L = lifted(core.left, core.left_bias)
        R = lifted(core.right, core.right_bias)
        Dn = P @ _num(core.down, exact)
        if core.down_bias is not None:
            const[:, 0] = const[:, 0] + P @ _num(core.down_bias, exact)
        terms.append(Term("bilinear", (Leg("L", L, ("h",), QUERY), Leg("R", R, ("h",), QUERY)),
                          ((Dn, (OUTPUT, "h")),), (QUERY, OUTPUT)))
    else:
        lw = {k: (None if v is None else _num(v, exact)) for k, v in core.lifted().items()}
        if lw["o_bias"] is not None:
            const[:, 0] = const[:, 0] + P @ lw["o_bias"]
        proj = {k: np.einsum("hef,fi->hei", lw[k], E) for k in ("q1", "k1", "q2", "k2", "v")}
        rot = core.rotations(n_ctx)          # RoPE or position_maps: R_t on queries and keys
        rope = rot is not None
        if rope:
            rot = _num(rot, exact)
            for k in ("q1", "k1", "q2", "k2"):
                proj[k] = np.einsum("tef,hfi->thei", rot, proj[k])
        scale = Fraction(core.scale) if exact else float(core.scale)
        M = _num(core.mask_matrix(n_ctx), exact) * scale
        O = np.einsum("op,phv->ohv", P, lw["o"])
        legs = (Leg("Q1", proj["q1"], ("h", "e"), QUERY, rope),
                Leg("K1", proj["k1"], ("h", "e"), KEY, rope),
                Leg("Q2", proj["q2"], ("h", "f"), QUERY, rope),
                Leg("K2", proj["k2"], ("h", "f"), KEY, rope),
                Leg("V", proj["v"], ("h", "v"), KEY, False))
        terms.append(Term("attention", legs, ((O, (OUTPUT, "h", "v")), (M, (QUERY, KEY))),
                          (QUERY, OUTPUT)))
    if residual:
        const[:, 1:] = const[:, 1:] + _eye(d_in, exact)  # y = x + inner(x)
    if any(v != 0 for v in const.reshape(-1)):
        terms.insert(0, _lin_term(const))
    return Node(terms, d_in, d_out)


def _affine_W(node: Node):
    """The ``(d_out, D)`` matrix of an affine node (one linear term, one plain leg), or None."""
    if len(node.terms) != 1:
        return None
    t = node.terms[0]
    if t.kind != "linear" or t.cores or len(t.legs) != 1 or t.legs[0].positional:
        return None
    return t.legs[0].weight


def lift_rows(W: np.ndarray, exact: bool) -> np.ndarray:
    """``[[1, 0], W]``: the lifted map of an affine node's output."""
    A = zeros_array((W.shape[0] + 1, W.shape[1]), exact)
    A[0, 0] = _one(exact)
    A[1:] = W
    return A


def _fold(nodes: list, exact: bool) -> list:
    """Fold affine nodes into their neighbours (exactly): into the legs of the next non-affine
    node, or (after the last one) into its output, the constant part as a linear term."""
    out: list = []
    pending = None  # lifted product of the affine nodes since the last non-affine one
    for node in nodes:
        W = _affine_W(node)
        if W is not None:
            A = lift_rows(W, exact)
            pending = A if pending is None else A @ pending
            continue
        if pending is not None:
            terms = [Term(t.kind, tuple(leg.with_weight(leg.weight @ pending) for leg in t.legs),
                          t.cores, t.out) for t in node.terms]
            node = Node(terms, pending.shape[1] - 1, node.d_out)
            pending = None
        out.append(node)
    if pending is None:
        return out
    if not out:
        return [Node([_lin_term(pending[1:])], pending.shape[1] - 1, pending.shape[0] - 1)]
    last = out[-1]
    P, c = pending[1:, 1:], pending[1:, 0]
    terms = [t.project_output(P) for t in last.terms]
    if any(v != 0 for v in c.reshape(-1)):
        lin = [k for k, t in enumerate(terms) if _affine_W(Node([t], 0, 0)) is not None]
        if lin:
            W = terms[lin[0]].legs[0].weight.copy()
            W[:, 0] = W[:, 0] + c
            terms[lin[0]] = _lin_term(W)
        else:
            W = zeros_array((P.shape[0], last.d_in + 1), exact)
            W[:, 0] = c
            terms.insert(0, _lin_term(W))
    out[-1] = Node(terms, last.d_in, P.shape[0])
    return out


def sequence_tree(net: Any, n_ctx: int, name: str = "a", exact: bool = False,
                  fold: bool = True) -> Tree:
    """The sequence model ``net`` as a `Tree` over ``n_ctx`` positions (docs/mathematics.md §3.7).

    One node per layer: a Linear or Bilinear layer acts per position (legs at the query
    position ``t``); a BilinearAttention layer is one attention term (legs ``Q1, Q2`` at ``t``,
    ``K1, K2, V`` at the key position ``s``; the mask times the scale is the core
    ``M[t, s]``; RoPE or position maps make the query/key legs positional); a Residual block ``x + f(x)`` is
    ``f``'s terms plus a linear term carrying ``x``; biases and constants go into the linear
    term's column 0 (the lifted constant is the same 1 at every position). ``fold``: fold the
    affine nodes into their neighbours (the form the exact attention path contracts; the
    closure reads the unfolded, per-layer nodes). Rationals when ``exact`` or ``net.is_exact``
    (floats taken exactly), else float64.

    Raises:
        ValueError: ``n_ctx`` not a positive int, or a Residual block with several non-linear
            layers. TypeError: an unknown layer type.
    """
    net = as_network(net, name)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)) or n_ctx < 1:
        raise ValueError(f"n_ctx: expected a positive int, got {n_ctx!r}")
    if not isinstance(fold, (bool, np.bool_)):
        raise ValueError(f"fold: expected True or False, got {fold!r}")
    exact = bool(exact or net.is_exact)
    nodes = [_layer_node(layer, int(n_ctx), exact, name, i)
             for i, layer in enumerate(flatten_layers(net))]
    if fold:
        nodes = _fold(nodes, exact)
    return Tree(nodes, net.in_features, net.out_features, int(n_ctx), exact, False)


def _check_max_n_ctx(models: list, n_ctx: int) -> int:
    for name, m in models:
        cap = getattr(m, "max_n_ctx", None)
        if cap is not None and n_ctx > cap:
            raise ValueError(f"n_ctx={n_ctx} exceeds the {cap} positions {name}'s attention "
                             f"position_maps cover")
    return n_ctx


def resolve_n_ctx(models: list, n_ctx: Any) -> int | None:
    """The sequence length for ``models`` (``[(name, layer)]``): ``n_ctx`` when given (checked
    against the masks that fix one), else the length a mask array fixes; None when no model is
    a sequence model and ``n_ctx`` is None.

    Raises:
        ValueError: ``n_ctx`` not a positive int; masks fixing different lengths (unless
            ``n_ctx`` is given and every such mask is causal); ``n_ctx`` that differs from a
            mask, except a shorter one of a causal mask (the exact prefix model,
            [`mask_matrix`][tensoralg.layers.BilinearAttention.mask_matrix]); a sequence model
            without ``n_ctx`` and no mask fixing it; ``n_ctx`` beyond a model's
            ``position_maps`` (`max_n_ctx`).
    """
    fixed = {name: m.n_ctx for name, m in models if m.n_ctx is not None}
    if len(set(fixed.values())) > 1 and (n_ctx is None or not all(
            getattr(m, "prefix_ok", False) for name, m in models if name in fixed)):
        shown = ", ".join(f"{k}: n_ctx={v}" for k, v in fixed.items())
        raise ValueError(f"{' and '.join(fixed)}: attention masks fix different sequence "
                         f"lengths ({shown})")
    if n_ctx is None:
        if fixed:
            return _check_max_n_ctx(models, next(iter(fixed.values())))
        seq = [name for name, m in models if m.is_sequence_model]
        if seq:
            raise ValueError(f"n_ctx: required for {' and '.join(seq)} (sequence models whose "
                             f"attention masks are 'causal'/'none' and fix no sequence length)")
        return None
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)) or n_ctx < 1:
        raise ValueError(f"n_ctx: expected a positive int, got {n_ctx!r}")
    _check_max_n_ctx(models, n_ctx)
    notes = {name: getattr(m, "n_ctx_note", "") for name, m in models}
    prefix = {name: getattr(m, "prefix_ok", False) for name, m in models}
    for name, n in fixed.items():
        if n_ctx < n and prefix[name]:
            continue    # the exact prefix model: the masks' leading blocks (mask_matrix)
        if n != n_ctx:
            why = " (not causal: a shorter context is no prefix of it)" if n_ctx < n else ""
            raise ValueError(f"n_ctx={n_ctx} differs from {name}'s attention mask of shape "
                             f"({n}, {n}){notes[name] or why}")
    return int(n_ctx)


def tree(net: Any, n_ctx: int | None = None, name: str = "a", fold: bool = True) -> Tree:
    """The canonical `Tree` of ``net``: `sequence_tree` for a model with attention
    (or any model when ``n_ctx`` is given: applied per position), else the binary chain of
    `canonicalize` as nodes (`Canonical.tree`).

    Raises:
        ValueError: a sequence model without ``n_ctx`` and no mask fixing it.
    """
    net = as_network(net, name)
    n_ctx = resolve_n_ctx([(name, net)], n_ctx)
    if n_ctx is not None:
        return sequence_tree(net, n_ctx, name, fold=fold)
    return canonicalize(net).tree()
