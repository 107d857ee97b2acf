"""A transformer (a residual stack of bilinear attention and bilinear MLP blocks) taken apart
into its first-order paths (docs/mathematics.md §3.10; docs/decompose.md, "Transformer paths").

A residual stack ``h_k = h_{k-1} + B_k(h_{k-1})`` (``h_0 = X``, the embedded input; an attention
block ``B = sum_h A_h`` a sum of heads) is multilinear in the legs of each head (Q1, K1, Q2, K2,
V; an MLP's L, R). Substituting ``h_{k-1} = X + (what earlier blocks wrote)`` into every leg
and expanding groups the terms by tree; the trees of order at most one are

* ``"direct"``: ``U X`` (the embedding's and the unembedding's biases with it),
* ``"L{l}.H{h}"``: ``U A_{l,h}(X)``, head ``h`` of attention layer ``l`` reading the embedded
  input on all five legs (its query/key/value biases with it: they go with the lifted constant
  of the legs that read ``X``, as in the vector `paths`),
* ``"L{l}.MLP"``: ``U M_l(X)`` (its biases, the output bias included, with it),
* ``"L{l}.bias"``: ``U c_l`` where the attention block of layer ``l`` writes a constant ``c_l``
  (its output bias): a constant path, listed only for blocks that have one,

with ``order=2`` also the second-order paths (two-node trees)

* ``"L{l}.H{h}.{LEG}\u2190L{l'}.H{h'}"``: ``U A_{l,h}[LEG <- A_{l',h'}(X)]``, leg ``LEG`` (Q1,
  K1, Q2, K2 or V) of head ``h`` of attention layer ``l`` reading the output of head ``h'`` of an
  earlier attention layer (the virtual heads), every other leg reading the embedded input; the
  leg's bias stays with the first-order path (a composition reads ``(0, A(X))``),

and the remainder ``rest = f - sum of the listed paths``: every tree with a composition not
listed (order 1: all of them; order 2: two or more compositions, and compositions with an MLP
block or a block bias). A layer is an attention block and the MLP block after it (an MLP block
with no attention block before it in its layer opens a layer).

The Gram matrix of the listed paths is exact: order 1 by the exact sequence engine (Wick/chaos
with position-carrying legs, each path one node of one term), order 2 by the feature-space
chaos of two-node terms (`tensoralg.strategies.chaos.composed`, polynomial in ``n_ctx * d``
and exponential in the degree: small models only, refused with its estimate elsewhere); the
remainder's norm is a Monte Carlo estimate with its diagnostics
(``tensoralg.diff_norm(model, listed, method="montecarlo")``) or "not assessed".
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import numpy as np

from ..canonical import flatten_layers, resolve_n_ctx, sequence_tree, zeros_array
from ..errors import CostTooHigh
from ..layers import Bilinear, BilinearAttention, Layer, Linear, Residual, Sequential, as_network
from ._common import split_stack

__all__ = ["SequencePathDecomposition", "PathSimilarity", "sequence_paths",
           "sequence_path_similarity", "match_heads", "check_order", "ORDER2_MESSAGE"]

#: What ``order=2`` covers, and what exists beyond it.
ORDER2_MESSAGE = (
    "order=2: second-order paths (a leg of a later head reading an earlier head, the virtual "
    "heads) are exact through the feature-space chaos of two-node terms "
    "(tensoralg.strategies.chaos.composed), whose cost is polynomial in n_ctx*d and "
    "exponential in the degree (small models only); elsewhere: order=1 (exact first-order "
    "paths) and Monte Carlo on the path networks")

_ATT = ("q1", "k1", "q2", "k2", "v")


def check_order(order: Any) -> int:
    """``order`` checked: 1 or 2, or a one-line ValueError."""
    if isinstance(order, bool) or not isinstance(order, numbers.Integral) or order not in (1, 2):
        raise ValueError(f"order: expected 1 (first-order paths) or 2 (second-order paths), "
                         f"got {order!r}")
    return int(order)


# ----------------------------------------------------------------------------------------
# the structure: [Linear...] Residual blocks [Linear...]
# ----------------------------------------------------------------------------------------

@dataclass
class _Block:
    """One residual block: ``prefix`` Linear layers, the ``core`` (attention, bilinear or
    None for an affine block) and ``suffix`` Linear layers, as written inside the Residual."""

    prefix: list
    core: Layer | None
    suffix: list

    @property
    def kind(self) -> str:
        if isinstance(self.core, BilinearAttention):
            return "attention"
        return "mlp" if isinstance(self.core, Bilinear) else "linear"


def _split(net: Layer, name: str) -> tuple[list, list, list]:
    """``(pre, blocks, post)`` of ``[Linear...] Residual blocks [Linear...]``, or a one-line
    ValueError naming the layer that breaks the pattern."""
    layers = flatten_layers(net)
    pre, res, post = split_stack(layers)
    i, j = len(pre), len(pre) + len(res)   # layer indices for the messages
    shape = ("paths of a sequence model need a residual stack [Linear...] Residual blocks "
             "[Linear...] (embedding, residual blocks of one attention, bilinear or linear "
             "layer, unembedding)")
    for k, x in enumerate(post):
        if not isinstance(x, Linear):
            what = type(x).__name__
            if isinstance(x, BilinearAttention):
                what = "a BilinearAttention without a residual (attention outside the stream)"
            raise ValueError(f"{name}: {shape}; layer {j + k} is {what}")
    if not res:
        raise ValueError(f"{name}: {shape}; it has no residual block")
    blocks = []
    for k, r in enumerate(res):
        inner = flatten_layers(r.inner)
        cores = [x for x in inner if not isinstance(x, Linear)]
        bad = [type(x).__name__ for x in cores
               if not isinstance(x, (Bilinear, BilinearAttention))]
        if bad or len(cores) > 1:
            raise ValueError(f"{name}: {shape}; residual block {k} (layer {i + k}) holds "
                             f"{', '.join(type(x).__name__ for x in inner)} (expected one "
                             f"BilinearAttention, Bilinear or Linear, with Linear layers around "
                             f"it)")
        if not cores:
            blocks.append(_Block(inner, None, []))
            continue
        c = inner.index(cores[0])
        blocks.append(_Block(inner[:c], cores[0], inner[c + 1:]))
    return pre, blocks, post


def _names(blocks: list) -> list:
    """Per block: ``(layer index, [path names])`` (module docstring: a layer is an attention
    block and the MLP block after it)."""
    out, layer, slot_taken = [], -1, True
    for b in blocks:
        if b.kind == "attention":
            layer, slot_taken = layer + 1, False
            names = [f"L{layer}.H{h}" for h in range(b.core.n_heads)]
            if b.core.o_bias is not None or any(x.bias is not None for x in b.suffix):
                names.append(f"L{layer}.bias")
        else:
            if slot_taken:
                layer += 1
            slot_taken = True
            names = [f"L{layer}.{'MLP' if b.kind == 'mlp' else 'linear'}"]
        out.append((layer, names))
    return out


# ----------------------------------------------------------------------------------------
# path networks
# ----------------------------------------------------------------------------------------

def _arr(a, exact: bool) -> np.ndarray:
    if exact:
        a = np.asarray(a, dtype=object)
        return np.vectorize(lambda v: v if isinstance(v, Fraction) else Fraction(v),
                            otypes=[object])(a) if a.size else a
    return np.asarray(a, dtype=np.float64)


def _strip(layers: list) -> list:
    """The Linear layers without their biases (the linear part of the affine chain)."""
    return [Linear(x.weight, None) for x in layers]


def _chain(layers: list, exact: bool, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(W, c)`` of an affine chain of Linear layers (identity when empty)."""
    one = Fraction(1) if exact else 1.0
    W = zeros_array((width, width), exact)
    for i in range(width):
        W[i, i] = one
    c = zeros_array((width,), exact)
    for x in layers:
        w = _arr(x.weight, exact)
        b = zeros_array((w.shape[0],), exact) if x.bias is None else _arr(x.bias, exact)
        W, c = w @ W, w @ c + b
    return W, c


def _head_layer(b: _Block, h: int, exact: bool) -> BilinearAttention:
    """Head ``h`` of the block's attention, reading the block's input (the prefix folded into
    its legs, its biases going with the lifted constant) and writing the block's output (the
    suffix's linear part folded into ``o``); no output bias."""
    at = b.core
    m = b.prefix[0].in_features if b.prefix else at.in_features
    E, e = _chain(b.prefix, exact, m)           # x_core = E x + e
    P, _ = _chain(_strip(b.suffix), exact, at.out_features)
    lw = at.lifted()
    kw = {}
    for k in _ATT:
        w = _arr(lw[k][h:h + 1], exact)             # (1, d_head, m' + 1)
        W = np.einsum("hei,ij->hej", w[:, :, 1:], E)
        c = w[:, :, 0] + np.einsum("hei,i->he", w[:, :, 1:], e)
        kw[k] = W
        kw[k + "_bias"] = c if any(v != 0 for v in c.reshape(-1)) else None
    o = np.einsum("pq,qhv->phv", P, _arr(at.o[:, h:h + 1], exact))
    return BilinearAttention(**kw, o=o, mask=at.mask, scale=at.scale, **at.position_kwargs)


def _block_constant(b: _Block, exact: bool) -> np.ndarray:
    """The constant an attention block writes: the suffix applied to the output bias."""
    at = b.core
    P, c = _chain(b.suffix, exact, at.out_features)
    if at.o_bias is not None:
        c = c + P @ _arr(at.o_bias, exact)
    return c


def _identity(n: int, exact: bool) -> np.ndarray:
    W = zeros_array((n, n), exact)
    for i in range(n):
        W[i, i] = Fraction(1) if exact else 1.0
    return W


def _first_order_network(pre: list, blocks: list, post: list, m: int, exact: bool) -> Layer:
    """``sum of the first-order paths`` as one network: the stream doubled to ``[x; X]``
    (``X`` the embedded input, kept), every residual block reading the copy ``X`` and adding
    into ``x``, then the unembedding of ``x``: ``U (X + sum_k B_k(X)) + b_U``."""
    I = _identity(m, exact)
    Z = zeros_array((m, m), exact)
    dup = Linear(np.concatenate([I, I], axis=0))
    read = Linear(np.concatenate([Z, I], axis=1))
    write = Linear(np.concatenate([I, Z], axis=0))
    take = Linear(np.concatenate([I, Z], axis=1))
    mid = [Residual(Sequential([read] + b.prefix + ([b.core] if b.core is not None else [])
                               + b.suffix + [write])) for b in blocks]
    return Sequential(pre + [dup] + mid + [take] + post)


def _path_networks(net: Layer, name: str) -> tuple[list, list, list, dict, Layer]:
    """``(names, networks, kinds, layout, first_order)``; ``layout``: ``{layer: {"heads":
    [names], ...}}`` (the heads of each attention layer, for matching)."""
    pre, blocks, post = _split(net, name)
    exact = net.is_exact
    m = pre[-1].out_features if pre else net.in_features     # the residual stream's width
    tail = _strip(post)
    names, nets, kinds = ["direct"], [], ["direct"]
    nets.append(Sequential(pre + post) if pre + post else Linear(_identity(m, exact)))
    layout: dict = {}
    for b, (layer, bnames) in zip(blocks, _names(blocks)):
        if b.kind == "attention":
            layout.setdefault(layer, {})["heads"] = bnames[:b.core.n_heads]
            for h in range(b.core.n_heads):
                nets.append(Sequential(pre + [_head_layer(b, h, exact)] + tail))
                kinds.append("head")
            if len(bnames) > b.core.n_heads:
                c = _block_constant(b, exact)
                nets.append(Sequential([Linear(zeros_array((m, net.in_features), exact), c)]
                                       + tail))
                kinds.append("bias")
        else:
            nets.append(Sequential(pre + b.prefix + ([b.core] if b.core is not None else [])
                                   + b.suffix + tail))
            kinds.append(b.kind)
        names.extend(bnames)
    return names, nets, kinds, layout, _first_order_network(pre, blocks, post, m, exact)


# ----------------------------------------------------------------------------------------
# second-order paths: one leg of a later head reading an earlier head (two-node trees)
# ----------------------------------------------------------------------------------------

_LEG = {"q1": "Q1", "k1": "K1", "q2": "Q2", "k2": "K2", "v": "V"}
ARROW = "\u2190"   # the arrow of the path names: "L1.H0.K1<-L0.H1" with a left arrow


def _block_heads(blocks: list, exact: bool) -> list:
    """Per attention block: ``(layer, block index, [head layers reading the stream])``."""
    out = []
    for k, (b, (layer, _)) in enumerate(zip(blocks, _names(blocks))):
        if b.kind == "attention":
            out.append((layer, k, [_head_layer(b, h, exact) for h in range(b.core.n_heads)]))
    return out


def _pad(w: np.ndarray, m: int, slot: int, n_slots: int, exact: bool) -> np.ndarray:
    """``w`` (``(..., m)``) reading slot ``slot`` of a stream of ``n_slots`` copies of width
    ``m`` (zeros elsewhere)."""
    parts = [w if k == slot else zeros_array(w.shape[:-1] + (m,), exact) for k in range(n_slots)]
    return np.concatenate(parts, axis=-1)


def _head_copy(hd: BilinearAttention, m: int, n_slots: int, exact: bool, read: int,
               leg: str | None = None, leg_slot: int | None = None,
               o: np.ndarray | None = None) -> dict:
    """The weights of one head reading a stream of ``n_slots`` copies: every leg reads slot
    ``read`` with its bias, except ``leg``, which reads slot ``leg_slot`` without its bias (a
    composition reads the earlier head's output; the bias stays with the first-order path)."""
    kw = {}
    for k in _ATT:
        w = _arr(getattr(hd, k), exact)
        b = getattr(hd, k + "_bias")
        if k == leg:
            kw[k], kw[k + "_bias"] = _pad(w, m, leg_slot, n_slots, exact), None
        else:
            kw[k] = _pad(w, m, read, n_slots, exact)
            kw[k + "_bias"] = None if b is None else _arr(b, exact)
    kw["o"] = _arr(hd.o, exact) if o is None else o
    return kw


def _stack_heads(kws: list, mask, scale, rope, o_bias=None) -> BilinearAttention:
    """One attention layer holding the heads ``kws`` (each one head's weights)."""
    exact = kws[0]["q1"].dtype == object
    out = {}
    for k in _ATT:
        out[k] = np.concatenate([kw[k] for kw in kws], axis=0)
        bs = [kw[k + "_bias"] for kw in kws]
        if all(b is None for b in bs):
            out[k + "_bias"] = None
        else:
            out[k + "_bias"] = np.concatenate(
                [zeros_array(kw[k].shape[:2], exact) if b is None else b
                 for kw, b in zip(kws, bs)], axis=0)
    out["o"] = np.concatenate([kw["o"] for kw in kws], axis=1)
    return BilinearAttention(**out, o_bias=o_bias, mask=mask, scale=scale, rope=rope)


def _embed_copies(pre: list, m: int, n_slots: int, filled: tuple, exact: bool) -> list:
    """``pre`` then the stream copied into the slots ``filled`` of ``n_slots`` (zeros
    elsewhere)."""
    I, Z = _identity(m, exact), zeros_array((m, m), exact)
    return pre + [Linear(np.concatenate([I if k in filled else Z for k in range(n_slots)],
                                        axis=0))]


def _composition_network(pre: list, post: list, outer: BilinearAttention, leg: str,
                         inner: BilinearAttention, m: int, exact: bool) -> Layer:
    """``U outer[leg <- inner(X)]`` as a network: the stream doubled to ``[X; 0]``, the inner
    head writing ``inner(X)`` into the second copy, the outer head reading it on ``leg`` and
    ``X`` on its other legs, then the unembedding's linear part."""
    I, Z = _identity(m, exact), zeros_array((m, m), exact)
    write = Residual(Sequential([Linear(np.concatenate([I, Z], axis=1)), inner,
                                 Linear(np.concatenate([Z, I], axis=0))]))
    head = _stack_heads([_head_copy(outer, m, 2, exact, 0, leg, 1)], outer.mask, outer.scale,
                        outer.rope)
    return Sequential(_embed_copies(pre, m, 2, (0,), exact) + [write, head] + _strip(post))


def _listed_network(pre: list, blocks: list, post: list, m: int, exact: bool) -> Layer:
    """The sum of the first- and second-order paths as one network: the stream
    ``[acc; X; Y]`` (``X`` the embedded input, kept; ``Y`` the sum of the attention heads'
    outputs on ``X`` so far); every block reads ``X`` and adds into ``acc``, every attention
    head also into ``Y``, and every later head's copy with one leg reading ``Y`` (five per
    head) into ``acc``; then the unembedding of ``acc``."""
    I, Z = _identity(m, exact), zeros_array((m, m), exact)
    mid, seen_attention = [], False
    for b in blocks:
        if b.kind != "attention":
            read = Linear(np.concatenate([Z, I, Z], axis=1))
            write = Linear(np.concatenate([I, Z, Z], axis=0))
            mid.append(Residual(Sequential([read] + b.prefix + ([b.core] if b.core is not None
                                                                 else []) + b.suffix + [write])))
            continue
        kws = []
        for h in range(b.core.n_heads):
            hd = _head_layer(b, h, exact)
            o = _arr(hd.o, exact)
            zo = zeros_array(o.shape, exact)
            kws.append(_head_copy(hd, m, 3, exact, 1, o=np.concatenate([o, zo, o], axis=0)))
            if seen_attention:
                for k in _ATT:
                    kws.append(_head_copy(hd, m, 3, exact, 1, k, 2,
                                          o=np.concatenate([o, zo, zo], axis=0)))
        c = _block_constant(b, exact)
        o_bias = None
        if any(v != 0 for v in c.reshape(-1)):
            o_bias = np.concatenate([c, zeros_array((2 * m,), exact)])
        mid.append(Residual(_stack_heads(kws, b.core.mask, b.core.scale, b.core.rope, o_bias)))
        seen_attention = True
    take = Linear(np.concatenate([I, Z, Z], axis=1))
    return Sequential(_embed_copies(pre, m, 3, (0, 1), exact) + mid + [take] + post)


def _second_order(pre: list, blocks: list, post: list, m: int, exact: bool):
    """``(names, networks, specs)`` of the second-order paths ``"L{l}.H{h}.{LEG}<-L{l'}.H{h'}"``
    (every leg of every head of a later attention block reading every head of an earlier
    one); ``specs``: ``(outer head, leg, inner head)`` per path."""
    heads = _block_heads(blocks, exact)
    names, nets, specs = [], [], []
    for i, (layer, _, outs) in enumerate(heads):
        for h, outer in enumerate(outs):
            for k in _ATT:
                for layer2, _, ins in heads[:i]:
                    for h2, inner in enumerate(ins):
                        names.append(f"L{layer}.H{h}.{_LEG[k]}{ARROW}L{layer2}.H{h2}")
                        nets.append(_composition_network(pre, post, outer, k, inner, m, exact))
                        specs.append((outer, k, inner))
    return names, nets, specs


def _lifted_chain(layers: list, exact: bool, width: int) -> np.ndarray | None:
    """The lifted ``(m + 1, width + 1)`` matrix of an affine chain, or None when empty."""
    if not layers:
        return None
    W, c = _chain(layers, exact, width)
    A = zeros_array((W.shape[0] + 1, width + 1), exact)
    A[0, 0] = Fraction(1) if exact else 1.0
    A[1:, 0] = c
    A[1:, 1:] = W
    return A


def _composed_terms(spec, pre: list, post: list, n_ctx: int, exact: bool, d: int) -> list:
    """The two-node `Term` of a second-order path (`tensoralg.strategies.chaos.composed`)."""
    from ..strategies.chaos.composed import compose

    outer, k, inner = spec
    ot = sequence_tree(Sequential([outer] + _strip(post)), n_ctx, "outer", exact=exact,
                       fold=True).nodes[0].terms
    it = sequence_tree(Sequential(pre + [inner]), n_ctx, "inner", exact=exact,
                       fold=True).nodes[0].terms
    att_o = [t for t in ot if t.kind == "attention"]
    if len(att_o) != 1 or len(ot) != 1:   # pragma: no cover - one head, no bias, no residual
        raise AssertionError("a second-order path's outer head folded into other terms")
    pre_lift = _lifted_chain(pre, exact, d)
    terms = [compose(att_o[0], _LEG[k], t, pre_lift) for t in it]
    if not exact:
        terms = [t.map(lambda a: np.asarray(a, dtype=np.float64)) for t in terms]
    return terms


# ----------------------------------------------------------------------------------------
# exact inner products of one-node path trees
# ----------------------------------------------------------------------------------------

def _trees(nets: list, n_ctx: int, exact: bool, name: str) -> list:
    trees = []
    for p in nets:
        t = sequence_tree(p, n_ctx, name, exact=exact, fold=True)
        if len(t.nodes) != 1:   # pragma: no cover - every path network is one non-affine layer
            raise AssertionError(f"{name}: a path network folded into {len(t.nodes)} nodes")
        if not exact and t.exact:
            t = replace(t.map(lambda a: np.asarray(a, dtype=np.float64)), exact=False)
        trees.append(t)
    return trees


class _Engine:
    """Exact inner products of one-node trees, each tree's chaos form built once per side
    (`TermSide`), every pair by
    `chaos_pair`; costs checked before any
    contraction (`check_cost`)."""

    def __init__(self, n_ctx: int, backend: str, device: Any = None):
        from ..prepare import position_selector
        from ..request import make_request

        self.n_ctx, self.backend, self.device = n_ctx, backend, device
        self.exact = backend == "exact"
        self.req = make_request(n_ctx=n_ctx, backend=backend, device=device)
        self.sel = position_selector(n_ctx, None, self.exact)
        self._sides: dict = {}
        self._memo: dict = {}

    def check(self, pairs, what: str) -> None:
        from ..strategies import sequence_exact

        for x, y in pairs:
            try:
                sequence_exact.check_cost(self.req, x, y, self.n_ctx, (), self.sel, "chaos")
            except CostTooHigh as exc:
                raise CostTooHigh(f"{what}: {exc}") from None

    def _side(self, tree, side):
        from ..strategies.chaos.sequence import TermSide

        key = (id(tree), side)
        if key not in self._sides:
            self._sides[key] = (tree, [TermSide(t, side, np.einsum, self.n_ctx, self.exact)
                                       for t in tree.nodes[0].terms])
        return self._sides[key][1]

    def inner(self, x, y):
        """``<x, y>`` (memoized per pair of trees: a norm is asked for by several pairs)."""
        key = (id(x), id(y))
        if key not in self._memo:
            self._memo[key] = self._inner(x, y)
        return self._memo[key]

    def _inner(self, x, y):
        from ..strategies.chaos.sequence import chaos_pair

        zero = Fraction(0) if self.exact else 0.0
        total = zero
        for sa in self._side(x, "a"):
            for sb in self._side(y, "b"):
                val, _ = chaos_pair(sa, sb, self.sel, (), np.einsum,
                                    self.req.max_configurations)
                if val is not None:
                    v = val.item() if isinstance(val, np.ndarray) else val
                    total = total + (Fraction(v) if self.exact else float(v))
        return total

    def run(self, fn):
        from ..strategies.executor import torch_backend

        with torch_backend("torch" if self.backend == "torch" else "numpy", self.device,
                           "paths"):
            return fn()


def _feature_gram(terms: list, n_ctx: int, exact: bool, backend: str = "numpy",
                  device: Any = None) -> np.ndarray:
    """The exact Gram matrix of sums of terms (one list per path) by the feature-space chaos
    of `tensoralg.strategies.chaos.composed` (each path's chaos built once; ``backend="torch"``:
    the dense lifted tensors in float64 torch on ``device``)."""
    from ..strategies.chaos.composed import FeatureChaos, feature_inner

    K = max(len(x.legs) for t in terms for x in t)
    bk = "torch" if backend == "torch" else "numpy"
    fc = [FeatureChaos(t, n_ctx, exact, max_degree=K, backend=bk, device=device)
          for t in terms]
    n = len(fc)
    G = np.empty((n, n), dtype=object) if exact else np.zeros((n, n))
    for i in range(n):
        for j in range(i, n):
            G[i, j] = G[j, i] = feature_inner(fc[i], fc[j])
    return G


def _gram(engine: _Engine, trees: list) -> np.ndarray:
    n = len(trees)
    G = np.empty((n, n), dtype=object) if engine.exact else np.zeros((n, n))

    def fill():
        for i in range(n):
            for j in range(i, n):
                G[i, j] = G[j, i] = engine.inner(trees[i], trees[j])
    engine.run(fill)
    return G


# ----------------------------------------------------------------------------------------
# the decomposition
# ----------------------------------------------------------------------------------------

@dataclass
class SequencePathDecomposition:
    """Result of `paths` for a sequence model (module docstring of
    `sequence_paths`; docs/mathematics.md §3.10).

    Attributes:
        names: ``"direct"``, ``"L{l}.H{h}"``, ``"L{l}.MLP"``, ``"L{l}.bias"``, ... (``P`` listed
            paths; the remainder ``"rest"`` is not listed: it is ``f - sum of the listed``).
        networks: the ``P`` path networks (tensoralg networks on the model's input ``(n,
            n_ctx, d)``; they and ``rest`` sum to the model).
        kinds: ``"direct"``, ``"head"``, ``"mlp"``, ``"linear"``, ``"bias"`` or
            ``"composition"`` (a second-order path) per path.
        order: 1 or 2. n_ctx: the sequence length of every number.
        gram: ``(P, P)`` exact Gaussian Gram matrix of the listed paths (sums over query
            positions and outputs; float64, or Fractions with ``backend="exact"``).
        norm2_listed: ``||sum of the listed paths||^2 = gram.sum()`` (exact). For a bias-free
            stack of attention blocks only this is ``||f_{<=5}||^2`` (the degree-<=5 truncation
            of S<=5; docs/mathematics.md §3.9); otherwise the squared norm of the first-order
            part as defined here.
        share: ``gram[i, i] / norm2_listed`` (``(P,)`` float): each path's share of
            ``||sum of the listed paths||^2``; the off-diagonal of ``gram`` (``interference``)
            makes up the rest of it (shares need not sum to 1).
        rest_norm: ``||f - sum of the listed paths||``: ``0.0`` exactly when the stack has one
            block (every path is listed), else a Monte Carlo estimate
            (`MonteCarloEstimate` with ``stderr``,
            ``reliable`` and ``diagnostics``) or None ("not assessed").
        methods: ``{"gram", "share", "norm2_listed", "rest_norm"}`` -> how each was computed.
        first_order: the sum of the listed paths as one network (``model(X) -
            first_order(X)`` is the remainder; with ``order=2`` it holds the second-order
            paths too).
        model: the model (as a tensoralg network).
    """

    names: list
    networks: list
    kinds: list
    order: int
    n_ctx: int
    gram: np.ndarray
    norm2_listed: Any
    share: np.ndarray
    rest_norm: Any
    methods: dict
    first_order: Layer = field(repr=False)
    model: Layer = field(repr=False)

    @property
    def interference(self) -> float:
        """``sum_{i != j} gram[i, j]`` (float)."""
        g = np.asarray(self.gram, dtype=float)
        return float(g.sum() - np.trace(g))

    def rest(self, X: Any) -> np.ndarray:
        """The remainder at inputs ``X`` ``(n, n_ctx, d)``: ``model(X) - first_order(X)``."""
        return self.model(X) - self.first_order(X)

    def network(self, name: str) -> Layer:
        """The path network called ``name`` (KeyError naming the listed paths)."""
        if name not in self.names:
            raise KeyError(f"{name!r}: no such path; listed: {self.names}")
        return self.networks[self.names.index(name)]

    def to_dict(self) -> dict:
        g = np.asarray(self.gram, dtype=float)
        rn = self.rest_norm
        rest = None
        if rn is not None:
            rest = {"value": float(rn)}
            if hasattr(rn, "stderr"):
                rest.update(stderr=float(rn.stderr), n_samples=int(rn.n_samples),
                            reliable=rn.reliable,
                            diagnostics=None if rn.diagnostics is None
                            else rn.diagnostics.summary())
        return {"names": list(self.names), "kinds": list(self.kinds), "order": self.order,
                "n_ctx": self.n_ctx, "gram": g.tolist(),
                "norm2_listed": float(self.norm2_listed),
                "share": [float(v) for v in self.share], "interference": self.interference,
                "rest_norm": rest, "methods": dict(self.methods)}

    def table(self) -> str:
        from ..audit.common import format_table

        rows = [[n, k, float(self.gram[i, i]), float(self.share[i])]
                for i, (n, k) in enumerate(zip(self.names, self.kinds))]
        lines = [format_table(["path", "kind", "||path||^2", "share"], rows),
                 f"||sum of listed paths||^2 = {float(self.norm2_listed):.6g} "
                 f"({self.methods['norm2_listed']}); interference {self.interference:.4g}",
                 f"rest = f - sum of listed paths: {_show_rest(self.rest_norm)} "
                 f"({self.methods['rest_norm']})"]
        return "\n".join(lines)

    __str__ = table


def _show_rest(rn) -> str:
    if rn is None:
        return "not assessed"
    if hasattr(rn, "stderr"):
        if rn.reliable is False:
            return f"||rest|| {format(rn)}"
        return f"||rest|| = {float(rn):.6g} ± {rn.stderr:.2g}"
    return f"||rest|| = {float(rn):.6g}"


def _n_ctx(net: Layer, n_ctx: Any, name: str) -> int:
    return resolve_n_ctx([(name, net)], n_ctx)


def sequence_paths(model: Any, *, n_ctx: Any = None, order: Any = 1, backend: str = "numpy",
                   device: Any = None, rest_samples: Any = 0, seed: int = 0,
                   name: str = "model") -> SequencePathDecomposition:
    """`paths` of a sequence model (its docstring)."""
    check_order(order)
    if backend not in ("numpy", "torch", "exact"):
        raise ValueError(f"backend: expected 'numpy', 'torch' or 'exact', got {backend!r}")
    if isinstance(rest_samples, bool) or not isinstance(rest_samples, numbers.Integral) or \
            rest_samples < 0:
        raise ValueError(f"rest_samples: expected an int >= 0 (0: the remainder is not "
                         f"assessed), got {rest_samples!r}")
    net = as_network(model, name)
    n_ctx = _n_ctx(net, n_ctx, name)
    names, nets, kinds, _, first = _path_networks(net, name)
    exact = backend == "exact"
    trees = _trees(nets, n_ctx, exact, name)
    pre, blocks, post = _split(net, name)
    one_block = len(blocks) == 1
    if order == 2:
        from ..strategies.chaos import composed

        m = pre[-1].out_features if pre else net.in_features
        names2, nets2, specs = _second_order(pre, blocks, post, m, exact)
        terms = [list(t.nodes[0].terms) for t in trees]
        terms += [_composed_terms(sp, pre, post, n_ctx, exact, net.in_features) for sp in specs]
        composed.check(terms, n_ctx, "paths(order=2): the exact Gram of the listed paths",
                       backend="torch" if backend == "torch" else "numpy")
        names, nets = names + names2, nets + nets2
        kinds = kinds + ["composition"] * len(names2)
        first = _listed_network(pre, blocks, post, m, exact)
    else:
        eng = _Engine(n_ctx, backend, device)
        eng.check([(t, t) for t in trees], "paths: the exact Gram of the first-order paths")
    if not one_block and rest_samples:   # the Monte Carlo request checked before the Gram
        from ..request import make_request

        make_request(method="montecarlo", n_ctx=n_ctx, n_samples=int(rest_samples),
                     seed=seed)
    if order == 2:
        G = _feature_gram(terms, n_ctx, exact, backend, device)
    else:
        G = _gram(eng, trees)
    total = sum(G[i, j] for i in range(len(G)) for j in range(len(G)))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.array([float(G[i, i]) for i in range(len(G))]) / float(total)
    if order == 2:
        how = ("exact (feature-space chaos of one- and two-node terms, "
               + ("rationals)" if exact else f"float64, {backend})"))
    else:
        how = ("exact (chaos sums of the exact sequence engine, rationals)" if exact else
               f"exact (chaos sums of the exact sequence engine, float64, {backend})")
    methods = {"gram": how, "norm2_listed": how + ": the sum of the Gram matrix",
               "share": "exact: gram[i, i] / norm2_listed"}
    if one_block:
        rest = Fraction(0) if exact else 0.0
        methods["rest_norm"] = "exact: zero (a one-block stack: every path is listed)"
    elif not rest_samples:
        rest = None
        methods["rest_norm"] = ("not assessed (rest_samples=0; rest_samples=N estimates it by "
                                "Monte Carlo with its verdict)")
    else:
        import tensoralg as ta

        fnet = net.astype_float() if net.is_exact else net
        fo = first.astype_float() if first.is_exact else first
        try:
            rest = ta.diff_norm(fnet, fo, method="montecarlo", n_ctx=n_ctx,
                                n_samples=int(rest_samples), seed=seed)
            verdict = "reliable" if rest.reliable else "NOT reliable: not an answer"
            methods["rest_norm"] = (f"Monte Carlo (APPROXIMATE): ta.diff_norm(model, "
                                    f"listed, method='montecarlo'), {int(rest_samples)} "
                                    f"directions, seed {seed}; {verdict}")
        except (ValueError, CostTooHigh) as exc:
            rest = None
            methods["rest_norm"] = f"not assessed ({str(exc).splitlines()[0][:160]})"
    return SequencePathDecomposition(names, nets, kinds, int(order), n_ctx, G, total, share,
                                     rest, methods, first, net)


# ----------------------------------------------------------------------------------------
# two models: the same path, head matching
# ----------------------------------------------------------------------------------------

class PathSimilarity(dict):
    """``{path name of a: similarity}`` of `path_similarity` for
    sequence models (a dict; ``None`` where a path is zero in either model), exact.

    Attributes:
        matching: ``{layer: [b's head for each of a's heads]}`` when heads were matched
            (``match=True``), else None; ``partner``: ``{a's path name: b's path name}``.
        method: how the numbers were computed.
    """

    matching: dict | None
    partner: dict
    method: str


def _prepare_pair(a: Any, b: Any, n_ctx: Any, backend: str):
    if backend not in ("numpy", "torch", "exact"):
        raise ValueError(f"backend: expected 'numpy', 'torch' or 'exact', got {backend!r}")
    na, nb = as_network(a, "a"), as_network(b, "b")
    for x, nm in ((na, "a"), (nb, "b")):
        if not x.is_sequence_model:
            raise ValueError(f"{nm}: a position-free network beside a "
                             f"sequence model; path_similarity compares two sequence models "
                             f"(or two vector networks)")
    if (na.in_features, na.out_features) != (nb.in_features, nb.out_features):
        raise ValueError(f"a and b: different sizes (a: {na.in_features} -> "
                         f"{na.out_features}, b: {nb.in_features} -> {nb.out_features})")
    n_ctx = resolve_n_ctx([("a", na), ("b", nb)], n_ctx)
    pa = _path_networks(na, "a")
    pb = _path_networks(nb, "b")
    if pa[0] != pb[0]:
        la = {ly: len(v["heads"]) for ly, v in pa[3].items()}
        lb = {ly: len(v["heads"]) for ly, v in pb[3].items()}
        raise ValueError(f"a and b: different structures, paths {pa[0]} vs {pb[0]} (heads per "
                         f"attention layer: a {la}, b {lb}); path_similarity compares models "
                         f"with the same layers and heads")
    return n_ctx, pa, pb


def _pair_trees(pa, pb, n_ctx: int, backend: str):
    exact = backend == "exact"
    return _trees(pa[1], n_ctx, exact, "a"), _trees(pb[1], n_ctx, exact, "b")


def _sim(ab, aa, bb) -> float | None:
    if float(aa) == 0 or float(bb) == 0:
        return None
    if isinstance(ab, Fraction):
        from ..results import similarity_from

        return float(similarity_from(ab, aa, bb, True))
    return float(np.clip(float(ab) / np.sqrt(float(aa) * float(bb)), -1.0, 1.0))


def _match(eng: _Engine, pa, pb, ta_, tb_) -> tuple[dict, dict]:
    """Per attention layer: the cross-similarity of the heads' paths and the assignment that
    maximizes its sum (`linear_sum_assignment`)."""
    from scipy.optimize import linear_sum_assignment

    names = pa[0]
    perms, sims = {}, {}
    for layer, v in pa[3].items():
        idx = [names.index(n) for n in v["heads"]]
        na = [eng.inner(ta_[i], ta_[i]) for i in idx]
        nb = [eng.inner(tb_[i], tb_[i]) for i in idx]
        S = np.zeros((len(idx), len(idx)))
        for p, i in enumerate(idx):
            for q, j in enumerate(idx):
                s = _sim(eng.inner(ta_[i], tb_[j]), na[p], nb[q])
                S[p, q] = 0.0 if s is None else s
        rows, cols = linear_sum_assignment(-S)
        perms[layer] = [int(c) for c in cols[np.argsort(rows)]]
        sims[layer] = S
    return perms, sims


def match_heads(a: Any, b: Any, *, n_ctx: Any = None, backend: str = "numpy",
                device: Any = None) -> dict:
    """Match the heads of two transformers layer by layer by function: the exact
    cross-similarity ``S[h, k] = sim(U_a A^a_{l,h}(X), U_b A^b_{l,k}(X))`` of their first-order
    paths, and the assignment maximizing ``sum_h S[h, perm[h]]``
    (`linear_sum_assignment`; Kuhn 1955, the Hungarian method).
    Heads are indexed arbitrarily by training, so two models are compared head by head only
    after matching (docs/mathematics.md §3.10).

    Args:
        a, b: sequence models with the same residual structure (layers and heads per layer).
        n_ctx: the sequence length (optional when a mask array fixes it).
        backend: ``"numpy"`` / ``"torch"`` (float64) or ``"exact"`` (rationals).

    Returns:
        ``{layer: {"perm": [b's head matched to a's head h, for h = 0..H-1], "similarity":
        (H, H) float array S}}`` for every attention layer.

    Raises:
        ValueError: models that are not residual stacks, of different structures (layers,
            heads), sizes, or an ``n_ctx`` missing or disagreeing with a mask; CostTooHigh: a
            path pair over the exact engine's budget (before any contraction).
    """
    n_ctx, pa, pb = _prepare_pair(a, b, n_ctx, backend)
    ta_, tb_ = _pair_trees(pa, pb, n_ctx, backend)
    eng = _Engine(n_ctx, backend, device)
    heads = [pa[0].index(n) for v in pa[3].values() for n in v["heads"]]
    eng.check([(ta_[i], tb_[j]) for i in heads for j in heads], "match_heads")
    perms, sims = eng.run(lambda: _match(eng, pa, pb, ta_, tb_))
    return {layer: {"perm": perms[layer], "similarity": sims[layer]} for layer in perms}


def sequence_path_similarity(a: Any, b: Any, *, n_ctx: Any = None, match: bool = False,
                             names: Any = None, backend: str = "numpy",
                             device: Any = None) -> PathSimilarity:
    """`path_similarity` of two sequence models (its docstring)."""
    if not isinstance(match, (bool, np.bool_)):
        raise ValueError(f"match: expected True or False, got {match!r}")
    n_ctx, pa, pb = _prepare_pair(a, b, n_ctx, backend)
    all_names = pa[0]
    if names is not None:
        if isinstance(names, str):
            names = [names]
        names = list(names)
        unknown = [n for n in names if n not in all_names]
        if unknown:
            raise ValueError(f"names: no path {unknown[0]!r} in these models; paths: "
                             f"{all_names}")
    else:
        names = all_names
    ta_, tb_ = _pair_trees(pa, pb, n_ctx, backend)
    eng = _Engine(n_ctx, backend, device)
    partner = {n: n for n in all_names}
    heads = [all_names.index(n) for v in pa[3].values() for n in v["heads"]]
    if match:
        eng.check([(ta_[i], tb_[j]) for i in heads for j in heads], "path_similarity")
    idx = [all_names.index(n) for n in names]
    eng.check([(ta_[i], tb_[i]) for i in idx], "path_similarity")

    def work():
        matching = None
        if match:
            matching, _ = _match(eng, pa, pb, ta_, tb_)
            for layer, perm in matching.items():
                hs = pa[3][layer]["heads"]
                for h, k in enumerate(perm):
                    partner[hs[h]] = hs[k]
        out = PathSimilarity()
        for n in names:
            i, j = all_names.index(n), all_names.index(partner[n])
            out[n] = _sim(eng.inner(ta_[i], tb_[j]), eng.inner(ta_[i], ta_[i]),
                          eng.inner(tb_[j], tb_[j]))
        out.matching = matching
        return out

    out = eng.run(work)
    out.partner = {n: partner[n] for n in names}
    out.method = ("exact (chaos sums of the exact sequence engine, " +
                  ("rationals" if backend == "exact" else f"float64, {backend}") + ")" +
                  ("; heads matched per layer by linear_sum_assignment on the exact "
                   "cross-similarity of their first-order paths" if match else ""))
    return out
