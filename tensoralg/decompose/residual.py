"""A residual network expanded into the path networks that sum to it
([`paths`][tensoralg.decompose.residual.paths],
[`path_similarity`][tensoralg.decompose.residual.path_similarity]; docs/mathematics.md §3.8)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from typing import Any

import numpy as np

from ..layers import Bilinear, Layer, Linear, Residual, Sequential, as_network
from ._common import (
    as_array,
    bilinear_depth,
    gram_mixed,
    identity_matrix,
    split_stack,
    vector_network,
    zeros_array,
)
from .sequence_paths import (
    SequencePathDecomposition,
    sequence_path_similarity,
    sequence_paths,
)
from .sums import DecompositionCheck, check_decomposition


def _valid_order(order: Any) -> None:
    if isinstance(order, bool) or not isinstance(order, numbers.Integral) or order not in (1, 2):
        raise ValueError(f"order: expected 1 (first-order paths) or 2 (second-order paths), "
                         f"got {order!r}")


def _flat_layers(net: Layer) -> list[Layer]:
    if isinstance(net, Sequential):
        return [x for l in net.layers for x in _flat_layers(l)]
    return [net]


def _split_residual(net: Layer) -> tuple[list[Linear], list[Residual], list[Linear]]:
    pre, blocks, post = split_stack(_flat_layers(net))
    for k, b in enumerate(blocks):
        if not isinstance(b.inner, (Linear, Bilinear)):
            raise ValueError(f"model: paths needs residual blocks around one Linear or Bilinear "
                             f"layer; block {k + 1} wraps a {type(b.inner).__name__}")
    bad = [type(l).__name__ for l in post if not isinstance(l, Linear)]
    if bad:
        raise ValueError(f"model: paths expects [Linear ...] Residual blocks [Linear ...] "
                         f"(embedding, residual blocks, head); found a {bad[0]} outside the "
                         f"residual stream")
    return pre, blocks, post


def _path_name(T: tuple[int, ...]) -> str:
    return "direct" if not T else "+".join(str(k + 1) for k in T)


def _subsets(s: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [c for r in range(len(s) + 1) for c in combinations(s, r)]


def _path_network(pre, blocks, post, T: tuple[int, ...], exact: bool) -> Layer:
    """The path network of subset ``T``: ``y_{U + k} = sum_{P | Q = U} B_k(y_P, y_Q)`` with the
    block's biases on the direct leg (``P`` or ``Q`` empty) and its output bias on ``U`` empty,
    so that ``sum_T y_T`` is the residual stream (bilinear expansion of each block)."""
    strip = [Linear(l.weight, None) for l in post]
    if not T:
        return Sequential(pre + post) if pre + post else Linear(identity_matrix(blocks[0].in_features, exact))
    m = blocks[0].in_features
    avail: list[tuple[int, ...]] = [()]
    stages: list[Layer] = []
    one = Fraction(1) if exact else 1.0
    for pos, k in enumerate(T):
        last = pos == len(T) - 1
        inner = blocks[k].inner
        col = {S: i * m for i, S in enumerate(avail)}
        carry = [] if last else list(avail)
        new = [tuple(sorted(S + (k,))) for S in avail]
        if last:
            new = [T]
        outs = carry + new
        row = {S: i * m for i, S in enumerate(outs)}
        n_in, n_out = len(avail) * m, len(outs) * m
        if isinstance(inner, Linear):
            W = zeros_array((n_out, n_in), exact)
            b = zeros_array((n_out,), exact)
            for S in carry:
                W[row[S]:row[S] + m, col[S]:col[S] + m] = identity_matrix(m, exact)
            for Tn in new:
                U = tuple(x for x in Tn if x != k)
                W[row[Tn]:row[Tn] + m, col[U]:col[U] + m] = as_array(inner.weight, exact)
                if not U and inner.bias is not None:
                    b[row[Tn]:row[Tn] + m] = as_array(inner.bias, exact)
            stages.append(Linear(W, b))
            avail = outs
            continue
        H = inner.hidden_features
        units = [(None, S) for S in carry]
        for Tn in new:
            U = tuple(x for x in Tn if x != k)
            for P in _subsets(U):
                for Q in _subsets(U):
                    if tuple(sorted(set(P) | set(Q))) == U:
                        units.append(((P, Q), Tn))
        n_h = sum(m if pq is None else H for pq, _ in units)
        L, R = zeros_array((n_h, n_in), exact), zeros_array((n_h, n_in), exact)
        lb, rb = zeros_array((n_h,), exact), zeros_array((n_h,), exact)
        D, db = zeros_array((n_out, n_h), exact), zeros_array((n_out,), exact)
        h = 0
        for pq, S in units:
            if pq is None:   # carry y_S: (e_i . z) * 1
                L[h:h + m, col[S]:col[S] + m] = identity_matrix(m, exact)
                rb[h:h + m] = one
                D[row[S]:row[S] + m, h:h + m] = identity_matrix(m, exact)
                h += m
                continue
            P, Q = pq
            L[h:h + H, col[P]:col[P] + m] = as_array(inner.left, exact)
            R[h:h + H, col[Q]:col[Q] + m] = as_array(inner.right, exact)
            if not P and inner.left_bias is not None:
                lb[h:h + H] = as_array(inner.left_bias, exact)
            if not Q and inner.right_bias is not None:
                rb[h:h + H] = as_array(inner.right_bias, exact)
            D[row[S]:row[S] + m, h:h + H] = as_array(inner.down, exact)
            h += H
        for Tn in new:
            if Tn == (k,) and inner.down_bias is not None:
                db[row[Tn]:row[Tn] + m] = as_array(inner.down_bias, exact)
        stages.append(Bilinear(L, R, D, lb, rb, db))
        avail = outs
    return Sequential(pre + stages + strip)


@dataclass
class PathDecomposition:
    """Result of [`paths`][tensoralg.decompose.residual.paths]. ``names[i]`` is ``"direct"`` or the
    blocks passed (``"1+2"``).

    Attributes:
        names, networks: the ``2^n`` path networks (they sum to the model exactly).
        depths: bilinear depth of each path network.
        cost: ``tensoralg.plan`` summary of each path's exact norm (``"REFUSED ..."`` over the
            planner's budget); over_budget: names of the refused paths.
        gram: ``(2^n, 2^n)`` Gaussian Gram matrix of the paths (NaN where refused): the exact
            attribution. share: ``gram[i, i] / ||f||^2``. norm2: ``||f||^2`` (NaN if refused).
        check: [`check_decomposition`][tensoralg.decompose.sums.check_decomposition] of the model
            against the paths (``None`` when a path is over budget).
    """

    names: list[str]
    networks: list[Layer]
    depths: list[int]
    cost: list[str]
    over_budget: list[str]
    gram: np.ndarray
    share: np.ndarray
    norm2: Any
    check: DecompositionCheck | None

    def to_dict(self) -> dict:
        g = np.asarray(self.gram, dtype=float)
        return {"names": self.names, "depths": self.depths, "cost": self.cost,
                "over_budget": self.over_budget,
                "gram": [[None if not np.isfinite(v) else float(v) for v in r] for r in g],
                "share": [None if not np.isfinite(v) else float(v) for v in self.share],
                "norm2": None if not np.isfinite(float(self.norm2)) else float(self.norm2),
                "check": None if self.check is None else self.check.to_dict()}


def _path_networks(model: Any, name: str = "model", exact: bool | None = None):
    net = vector_network(model, name)
    pre, blocks, post = _split_residual(net)
    if len(blocks) > 8:
        raise ValueError(f"{name}: {len(blocks)} residual blocks give {2 ** len(blocks)} paths; "
                         f"paths supports at most 8 blocks")
    exact = net.is_exact if exact is None else exact
    if not blocks:
        return net, ["direct"], [net]
    Ts = [T for r in range(len(blocks) + 1) for T in combinations(range(len(blocks)), r)]
    return net, [_path_name(T) for T in Ts], [_path_network(pre, blocks, post, T, exact)
                                              for T in Ts]


def paths(model: Any, *, backend: str = "numpy", check: bool = True, n_ctx: Any = None,
          order: Any = None, rest_samples: Any = 0, seed: int = 0, device: Any = None
          ) -> PathDecomposition | SequencePathDecomposition:
    """Expand a residual network into path networks that sum to it exactly (docs/mathematics.md
    §3.8 for vector networks, §3.10 for transformers).

    **Sequence models** (a residual stack of bilinear attention and bilinear MLP blocks, e.g. a
    `BilinearTransformer`): the first-order paths
    (``order=1``, the default there) — ``"direct"`` (``U X``), one per head ``"L{l}.H{h}"``
    (``U A_{l,h}(X)``: the head reading the embedded input on all five legs), one per MLP
    ``"L{l}.MLP"``, ``"L{l}.bias"`` for an attention block's output bias — and the remainder
    ``rest = f - sum of the listed paths`` (every tree with a composition;
    `sequence_paths`). ``order=2`` adds the second-order paths ``"L{l}.H{h}.{LEG}\u2190L{l'}.H{h'}"``
    (``U A_{l,h}[LEG <- A_{l',h'}(X)]``: one leg Q1, K1, Q2, K2 or V of a later head reading an
    earlier head, the virtual heads; its bias stays with the first-order path) with the exact
    Gram of all listed paths by the feature-space chaos of two-node terms
    (`tensoralg.strategies.chaos.composed`; polynomial in ``N = n_ctx * d``, exponential in
    the degree: small models and short contexts only, refused with its estimate elsewhere);
    compositions with MLP blocks or block biases, and trees of two or more compositions, stay
    in the remainder. Returns a
    `SequencePathDecomposition`: the path networks,
    their exact Gram matrix (the exact sequence engine; never sampled), each path's share of
    ``||sum of the listed paths||^2`` (exact; for a bias-free stack of attention blocks this is
    ``||f_{<=5}||^2``, the norm behind S<=5), and the remainder's norm ``||rest||``: exactly 0
    for a one-block stack, else a Monte Carlo estimate with its diagnostics
    (``rest_samples`` directions, ``seed``; ``rest_samples=0``: not assessed); ``methods`` says
    which method produced each number. ``n_ctx``: the sequence length (optional when a mask
    array fixes it); ``backend``: ``"numpy"``, ``"torch"`` (on ``device``) or ``"exact"``
    (rationals).

    **Vector networks:**

    ``model = head o (1 + B_n) o ... o (1 + B_1) o embed`` (``embed``/``head``: zero or more
    Linear layers; ``B_k``: one Bilinear or Linear layer). A bilinear block reads the stream
    ``y = sum_S y_S`` twice, so ``B_k(y) = sum_{P, Q} B_k(y_P, y_Q)``; grouping the terms by
    ``T = P | Q | {k}`` (the blocks a signal passed through) gives ``2^n`` path networks, e.g.
    ``direct``, ``1``, ``2``, ``1+2`` for two blocks. Biases go with the direct legs, the head's
    bias with ``direct``. The Gram matrix of the paths (Gaussian metric, batched per
    architecture) is the exact attribution of ``||f||^2``;
    [`check_decomposition`][tensoralg.decompose.sums.check_decomposition] confirms the sum (in
    rationals with ``backend="exact"``). A path whose exact norm is over the planner's budget
    (``tensoralg.plan(...).refused``, e.g. depth 3) is listed with its cost, and its Gram entries
    are NaN (as are the model's, ``norm2``, when the model itself is over budget); the check then
    needs ``tensoralg.verify.decompose.check_decomposition_exact``.

    Raises:
        ValueError: a model that is not embed / residual blocks / head, more than 8 blocks;
            ``order`` other than 1 or 2; ``n_ctx`` or ``order`` for a vector network; a
            sequence model without ``n_ctx`` (and no mask array fixing it); a sequence model
            that is not a residual stack (e.g. attention without a residual).
        CostTooHigh: a sequence model's path pair over the exact engine's budget (before any
            contraction; ``order=2``: the dense order-9 tensors of the two-node terms, about
            ``n_ctx * d_out * (n_ctx * d + 1)^9`` entries, are over ``max_memory``, or their
            FLOPs over the default budget).
    """
    import tensoralg as ta

    if order is not None:
        _valid_order(order)
    if as_network(model, "model").is_sequence_model:
        return sequence_paths(model, n_ctx=n_ctx, order=1 if order is None else order,
                              backend=backend, device=device, rest_samples=rest_samples,
                              seed=seed)
    if n_ctx is not None or order is not None:
        raise ValueError(f"{'n_ctx' if n_ctx is not None else 'order'}: only for sequence "
                         f"models (with attention); the paths of a vector network are every "
                         f"subset of its blocks")
    net, names, nets = _path_networks(model)
    cost, over = [], []
    for n, p in zip(names, nets):
        pl = ta.plan(p)
        cost.append(pl.summary())
        if pl.refused:
            over.append(n)
    # only networks within budget enter the Gram (a refused one would still pay its cross terms)
    keep = ([0] if not ta.plan(net).refused else []) + [i for i, n in enumerate(names, start=1)
                                                         if n not in over]
    allnets = [net] + nets
    sub = gram_mixed([allnets[i] for i in keep], "gaussian", backend, None, on_cost="nan")
    G = np.full((len(allnets),) * 2, np.nan, dtype=object if backend == "exact" else float)
    G[np.ix_(keep, keep)] = sub
    chk = None
    if check and len(keep) == len(allnets):
        chk = check_decomposition(net, nets, backend=backend, frobenius=False, _gram=G)
    norm2 = G[0, 0]
    G = G[1:, 1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.diag(np.asarray(G, dtype=float)) / float(norm2)
    return PathDecomposition(names, nets, [bilinear_depth(p) for p in nets], cost, over, G,
                             share, norm2, chk)


def path_similarity(a: Any, b: Any, *, output: Any = None, n_ctx: Any = None,
                    match: bool = False, names: Any = None, backend: str = "numpy",
                    device: Any = None) -> dict[str, float | None]:
    """Similarity of the same path in two models with the same block structure (e.g. two
    checkpoints): ``{path name: sim(path_a, path_b)}`` (``None`` where exact is over budget or
    a path is zero).

    Sequence models (two transformers with the same layers and heads; `paths`): the
    first-order paths, exactly (the exact sequence engine), as a
    `PathSimilarity` (a dict with ``partner``,
    ``matching`` and ``method``). ``match=True``: heads are first matched per layer by
    `match_heads` (the exact cross-similarity of
    their first-order paths, `linear_sum_assignment`), and
    ``"L{l}.H{h}"`` is compared with its partner in ``b``. ``names``: a path name or a list
    of them (default: every listed path). ``n_ctx``: the sequence length (optional when a
    mask array fixes it); ``backend``: ``"numpy"``, ``"torch"`` or ``"exact"``.

    Raises:
        ValueError: models with different numbers of residual blocks or sizes (sequence
            models: different layers or heads per layer), a path name in ``names`` that does
            not exist, a vector network beside a sequence model, ``n_ctx`` / ``match`` /
            ``names`` for vector networks.
    """
    import tensoralg as ta

    xa, xb = as_network(a, "a"), as_network(b, "b")
    if xa.is_sequence_model and xb.is_sequence_model:
        if output is not None:
            raise ValueError("output: not supported for sequence models' paths (the "
                             "similarity sums over outputs and query positions)")
        return sequence_path_similarity(xa, xb, n_ctx=n_ctx, match=match, names=names,
                                        backend=backend, device=device)
    for v, nm in ((n_ctx, "n_ctx"), (names, "names")):
        if v is not None and not (xa.is_sequence_model or xb.is_sequence_model):
            raise ValueError(f"{nm}: only for sequence models (with attention)")
    if match and not (xa.is_sequence_model or xb.is_sequence_model):
        raise ValueError("match: head matching is for sequence models (with attention)")
    _, na, pa = _path_networks(a, "a")
    _, nb, pb = _path_networks(b, "b")
    if na != nb:
        raise ValueError(f"a and b have different residual structures: paths {na} vs {nb}")
    out = {}
    for n, x, y in zip(na, pa, pb):
        try:
            out[n] = float(ta.similarity(x, y, output=output))
        except ta.CostTooHigh:
            out[n] = None
        except ValueError as exc:
            if "norm zero" not in str(exc):
                raise
            out[n] = None
    return out
