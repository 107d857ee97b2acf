"""Exact strategy for sequence models: the exact path of sequence models (`exact_inner`,
`exact_similarity`, `exact_gram`, `head_gram`; sums over query positions
``t`` and output ``o`` of ``E[f_a(X)[t, o] f_b(X)[t, o]]``, ``position=`` / ``output=``
slicing them as in ``tensoralg.inner``) reads both models in the folded canonical tree
(`canonicalize`): one node of linear and attention terms. Supported exactly: models of the form
``[Linear...] -> attention or Residual(attention) -> [Linear...]`` (an embedding applied per
position, one attention layer with or without a residual, biases, any mask, RoPE, an unembedding; a
residual block may hold Linear layers around the attention), and per-position affine models.
Deeper stacks: `tensoralg.strategies.montecarlo.montecarlo_inner` (unbiased, with a
standard error) and `tensoralg.strategies.closure.closure_inner` (the second-moment
closure over (position, feature); exact at depth 1, APPROXIMATE deeper).

Cost: before any contraction, the configurations are counted against ``max_configurations``
and a dry run of the chaos sums (paths found and cached for the real run) estimates the peak
memory and the FLOPs (the path cost of every contraction the run executes), held against
``max_memory`` and ``max_flops`` (`chaos_cost_req`; ``tensoralg.plan`` reports both).

The two ways to sum a pair of terms (equal values; tests cross-check them):
`JoinedTermPair` (``strategy="matchings"``) and
`TermSide` +
`chaos_pair` (``strategy="chaos"``, the default).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import replace
from fractions import Fraction
from typing import Any

import numpy as np

from ..backends import available_memory
from ..canonical import QUERY, Node, Tree, flatten_layers, sequence_tree
from ..errors import AttentionNotSupported, CostTooHigh
from ..layers import BilinearAttention, Layer, Residual, Sequential, as_network
from ..prepare import (
    IN_SEQUENCE_GRAM,
    check_sequence_models,
    check_sequence_pair,
    check_slices,
    position_selector,
)
from ..request import (
    DEFAULT_MAX_CONFIGURATIONS,
    DEFAULT_MAX_FLOPS,
    DEFAULT_MAX_FLOPS_EXACT_SEQUENCE,
    Request,
    make_request,
)
from ..results import gram_to_similarity, similarity_from, swap_order
from .chaos.sequence import TermSide, chaos_pair, stored_entries
from .executor import torch_backend
from .wick import terms as _terms
from .wick.terms import JoinedTermPair, entry_dtype

__all__ = ["exact_inner", "exact_similarity", "exact_gram", "head_gram", "count_configurations",
           "chaos_memory_bytes", "canonicalize", "AttentionNotSupported", "ALTERNATIVES",
           "SHAPE_CTX", "exact_inner_req", "exact_similarity_req", "exact_gram_req",
           "count_configurations_req", "chaos_memory_bytes_req", "chaos_cost_req",
           "early_memory_refusal", "memory_refusal", "flops_refusal", "max_flops_of",
           "tree_inner_req", "check_cost", "configurations_bound", "check_configurations_bound",
           "tree_gram", "tree_cross_gram", "tree_block_cost", "tree_triple",
           "sum_term_values"]


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
        inner = flatten_layers(net.inner)
        if len(inner) == 1 and isinstance(inner[0], BilinearAttention):
            return inner[0], True
    return None


def _unsupported(name: str, i: int, what: str, degree: int | None = None
                 ) -> AttentionNotSupported:
    """The refusal of a model outside the exact path; ``degree``: the model's polynomial
    degree when it composes non-linear layers, whose unrolled one-node form (every leg
    reading the residual stream or an earlier layer's term, `tensoralg.degree`) has a
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
    """The model as the folded canonical `Tree` the exact path
    contracts (`tensoralg.canonical.sequence_tree` with ``fold=True``), for ``n_ctx``
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
    layers = flatten_layers(net)
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
                what += f"({', '.join(type(x).__name__ for x in flatten_layers(layers[i].inner))})"
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
    (`project_output` by ``u[None]``: output size 1)."""
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
    """The checks of `exact_inner` on the pair and slices, then `_prepared_pair`:
    ``(tree of a, tree of b, n_ctx)``."""
    a, b, n_ctx = check_sequence_pair(a, b, req.n_ctx)
    check_slices(req, a.out_features, n_ctx)
    return (*_prepared_pair(a, b, n_ctx, req.output, req.exact), n_ctx)


def count_configurations(a: Any, b: Any, n_ctx: Any = None, *, output: Any = None,
                         backend: str = "numpy") -> int:
    """Number of Wick configurations (partial matchings after zero-pattern pruning) that
    `exact_inner` contracts for the pair with the same ``output`` slice and ``backend``
    (the slice and the rounding decide which legs can be capped). Cheap: no contraction.

    Raises:
        AttentionNotSupported, ValueError: as `exact_inner`, before any work.
    """
    return count_configurations_req(make_request(n_ctx=n_ctx, output=output, backend=backend),
                                    a, b)


def count_configurations_req(req: Request, a: Any, b: Any) -> int:
    """`count_configurations` of a validated request (``position`` ignored)."""
    pa, pb, n_ctx = _checked_trees(req, a, b)
    return sum(JoinedTermPair(x, y, np.ones(n_ctx), (), np.einsum).count()
               for x, y in _term_pairs(pa, pb))


def _dry_cost(pa: Tree, pb: Tree, n_ctx: int, exact: bool, sel, out_mode) -> tuple[int, float]:
    """``(bytes, FLOPs)`` of the chaos strategy, from a dry run (paths found and cached for
    the real run; nothing contracted). Bytes: the estimated peak, every stored ``R[S]`` of
    both models plus the largest working set of one sum (its cached diagonal copies and one
    contraction's live intermediates and step copies, `sum_peak`); 8 bytes per entry
    (float64; one pointer per Fraction in rationals, so low there). FLOPs: the path costs of
    every contraction of the per-model sums and of the cross sums (`sum_flops`; the leg
    grams ``w . P w'``, a few matrix products, come on top)."""
    key = (_shape_signature(pa), _shape_signature(pb), n_ctx, exact, sel.shape, out_mode,
           _terms.GROUPED)   # the grouped and the ungrouped sums differ in FLOPs and memory
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
    """The refusal message when ``need`` bytes (`chaos_memory_bytes`) exceed
    ``max_memory`` (default: `tensoralg.backends.available_memory`), else None."""
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
    """Estimated peak memory (bytes) of `exact_inner` with ``strategy="chaos"`` and the
    same options: the per-model chaos tensors (for each term and each set ``S`` of its open
    legs, the sum ``R[S]`` over matchings of the other legs) plus the largest working set of
    one of its sums (cached diagonal copies, and the intermediates alive along one
    contraction path with one step's transposed copies). From a dry run: paths are found
    (and cached for the real run), nothing is contracted. An estimate, checked against
    tracemalloc peaks in the tests (1.01-1.15x the measured peak); rationals count 8 bytes per
    entry (low: a Fraction takes more).

    Raises:
        AttentionNotSupported, ValueError: as `exact_inner`, before any work.
    """
    return chaos_memory_bytes_req(make_request(n_ctx=n_ctx, output=output, position=position,
                                               backend=backend), a, b)


def chaos_memory_bytes_req(req: Request, a: Any, b: Any) -> int:
    """`chaos_memory_bytes` of a validated request."""
    return chaos_cost_req(req, a, b)[0]


def chaos_cost_req(req: Request, a: Any, b: Any) -> tuple[int, float]:
    """``(estimated peak bytes, estimated FLOPs)`` of `exact_inner` with the chaos
    strategy for a validated request: one dry run (`_dry_cost`), nothing contracted."""
    pa, pb, n_ctx = _checked_trees(req, a, b)
    out_mode = ((QUERY,) if isinstance(req.position, str) else ()) + \
        (("o",) if isinstance(req.output, str) else ())
    return _dry_cost(pa, pb, n_ctx, req.exact, position_selector(n_ctx, req.position, req.exact),
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
    ``req`` (`max_flops_of`), else None."""
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
    their folded canonical trees (`canonicalize`).

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
            [`tensoralg.layers.rope_rotations`][tensoralg.layers.rope_rotations], taken exactly).
        strategy: ``"chaos"`` (default: per-model sums over internal matchings, then
            bijections of the open legs) or ``"matchings"`` (one contraction per partial
            matching of the joined network; slower, kept as a cross-check).
        max_configurations: refuse (before contracting) above this many Wick configurations.
        max_memory: bytes; with ``strategy="chaos"``, refuse (before contracting) when the
            per-model chaos tensors alone (`chaos_memory_bytes`, a lower bound of the peak)
            exceed it. Default: half the available memory of the computing device
            (`tensoralg.backends.available_memory`).

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
    """The checks of `exact_inner` on the pair and slices, before any contraction:
    ``(tree of a, tree of b, n_ctx, out_mode, selector)``."""
    pa, pb, n_ctx = _checked_trees(req, a, b)
    out_mode = (("t",) if isinstance(req.position, str) else ()) + \
        (("o",) if isinstance(req.output, str) else ())
    return pa, pb, n_ctx, out_mode, position_selector(n_ctx, req.position, req.exact)


def check_cost(req: Request, pa: Tree, pb: Tree, n_ctx: int, out_mode, sel,
                strategy: str) -> None:
    """CostTooHigh over ``max_configurations`` or (chaos) the memory estimate over
    ``max_memory`` or the FLOP estimate over ``max_flops`` (`flops_refusal`); nothing
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
    at ``req.n_ctx`` (`stored_entries` on trees built
    for ``SHAPE_CTX`` positions: feature sizes and zero patterns do not depend on the context),
    exceed ``max_memory``; else None. Milliseconds, nothing ``n_ctx``-sized allocated, so an
    absurd ``n_ctx`` is refused before the trees (their ``n_ctx x n_ctx`` masks) are built.
    Only when the models leave ``n_ctx`` free (no mask array) and the configurations are
    within budget (then `exact_inner` refuses on them first, with their message)."""
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
    """`exact_inner` of a validated request."""
    if strategy == "chaos":
        _refuse_early(req, a, b)
    pa, pb, n_ctx, out_mode, sel = _exact_trees(req, a, b)
    check_cost(req, pa, pb, n_ctx, out_mode, sel, strategy)
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
        return np.full(shape, zero, dtype=entry_dtype(exact)) if shape else zero
    if isinstance(total, np.ndarray) and total.ndim == 0:
        total = total.item()
    if not exact and not isinstance(total, np.ndarray):
        total = float(total)
    return total


def tree_inner_req(req: Request, pa: Tree, pb: Tree, n_ctx: int):
    """Exact inner product (sum over query positions and outputs) of two float64 one-node
    trees of linear and attention terms built directly, e.g. the truncations of
    `tensoralg.degree`; the cost is checked first (CostTooHigh over the budget)."""
    sel = position_selector(n_ctx, None, False)
    check_cost(req, pa, pb, n_ctx, (), sel, "chaos")
    return _exact_value(req, pa, pb, n_ctx, (), sel, "chaos")


def _floatify(tree: Tree) -> Tree:
    """An exact tree in float64 (`map`)."""
    if not tree.exact:
        return tree
    return replace(tree.map(lambda x: np.asarray(x, dtype=np.float64)), exact=False)


def exact_similarity(a: Any, b: Any, *, strategy: str = "chaos", **kw):
    """``<a,b> / sqrt(<a,a> <b,b>)`` with `exact_inner` (same arguments), clipped to
    [-1, 1] in float; with ``backend="exact"`` an `ExactSimilarity`
    (as for position-free networks). The cross term is computed in the pair's canonical order
    (`tensoralg.results.swap_order`), so ``sim(a, b)`` and ``sim(b, a)`` agree bit for
    bit. Raises ValueError when a norm is zero or (float) an inner product overflowed
    float64."""
    if strategy not in ("chaos", "matchings"):
        raise ValueError(f"strategy: expected 'chaos' or 'matchings', got {strategy!r}")
    return exact_similarity_req(make_request(**kw), a, b, strategy)


def exact_similarity_req(req: Request, a: Any, b: Any, strategy: str = "chaos"):
    """`exact_similarity` of a validated request."""
    if strategy == "chaos":
        _refuse_early(req, a, b)
    pa, pb, n_ctx, out_mode, sel = _exact_trees(req, a, b)
    args = (n_ctx, out_mode, sel, strategy)
    for what, x, y in (("<a, b>", pa, pb), ("<a, a>", pa, pa), ("<b, b>", pb, pb)):
        try:
            check_cost(req, x, y, *args)
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
    layers = flatten_layers(net)
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
                                     scale=at.scale, **at.position_kwargs))
    return Sequential(out)


def head_gram(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None, position: Any = None,
              backend: str = "numpy") -> np.ndarray:
    """Exact ``G[h, k] = <head h of a, head k of b>`` (``(n_heads_a, n_heads_b)``).

    Head ``h`` of a model is its attention term restricted to that head (embedding and
    unembedding kept; the residual branch and ``o_bias`` dropped). By bilinearity, ``G.sum()``
    is the inner product of the two attention terms; ``G[h, k] / sqrt(G_aa[h, h] G_bb[k, k])``
    is a per-head similarity. One `exact_inner` per head pair (same arguments).

    Raises:
        ValueError / AttentionNotSupported: as `exact_inner`; a model without attention.
    """
    a, b, n_ctx = check_sequence_pair(a, b, n_ctx)
    cores = []
    for name, net in (("a", a), ("b", b)):
        found = [c for c in map(_attention_core, flatten_layers(net)) if c is not None]
        if len(found) != 1:
            raise AttentionNotSupported(f"{name}: head_gram needs exactly one attention layer, "
                                        f"found {len(found)}")
        cores.append(found[0][0])
    G = np.empty((cores[0].n_heads, cores[1].n_heads), dtype=entry_dtype(backend == "exact"))
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
    one attention layer each: `exact_inner` once per unordered pair, the self terms once
    per model (float64; ``kw`` as `exact_inner`, backend ``"numpy"`` or ``"torch"``).

    Raises:
        AttentionNotSupported: a model the exact path does not handle (``models[i]`` named),
            before any contraction. ValueError: as `exact_inner`."""
    if kw.get("backend", "numpy") not in ("numpy", "torch"):
        raise ValueError("exact_gram: backend='numpy' or 'torch' (float64; use exact_inner "
                         "per pair for rationals)")
    req = make_request(n_ctx=n_ctx, output=output, position=position, **kw)
    return exact_gram_req(req, models, similarity)


def exact_gram_req(req: Request, models, similarity: bool = False) -> np.ndarray:
    """`exact_gram` of a validated request (float64: numpy or torch backend)."""
    nets, n_ctx = check_sequence_models(models, req.n_ctx)
    req = req.replace(n_ctx=n_ctx)
    for net in nets:   # each model's own pair bounds the matrix's memory from below
        if net.is_sequence_model:
            _refuse_early(req, net, net)
    for i, net in enumerate(nets):  # every model's support checked before any contraction
        canonicalize(net, n_ctx, f"models[{i}]")
    vals = {}
    token = IN_SEQUENCE_GRAM.set(True)
    try:
        for i in range(len(nets)):
            for j in range(i, len(nets)):
                vals[(i, j)] = np.asarray(exact_inner_req(req, nets[i], nets[j]),
                                          dtype=np.float64)
    finally:
        IN_SEQUENCE_GRAM.reset(token)
    G = np.empty((len(nets), len(nets)) + vals[(0, 0)].shape)
    for (i, j), v in vals.items():
        G[i, j] = v
        G[j, i] = v
    return gram_to_similarity(G) if similarity else G


# ----------------------------------------------------------------------------------------
# bias-free one-node trees (the truncations of tensoralg.degree)
# ----------------------------------------------------------------------------------------

def configurations_bound(pa: Tree, pb: Tree) -> int:
    """The Wick configurations of the exact path on two bias-free one-node trees: the perfect
    matchings ``(n - 1)!!`` of each term pair's ``n`` joined legs (no leg can be capped), a
    cheap upper bound that is reached for generic weights (pruning only removes legs whose
    weights vanish)."""
    total = 0
    for x in pa.nodes[0].terms:
        for y in pb.nodes[0].terms:
            n = x.degree + y.degree
            if n % 2 == 0:
                total += math.prod(range(n - 1, 0, -2))
    return total


def check_configurations_bound(pa: Tree, pb: Tree) -> None:
    """CostTooHigh when `configurations_bound` of two bias-free one-node trees is over
    the default ``max_configurations``."""
    n = configurations_bound(pa, pb)
    if n > DEFAULT_MAX_CONFIGURATIONS:
        legs = max(x.degree for x in pa.nodes[0].terms) + max(y.degree for y in pb.nodes[0].terms)
        raise CostTooHigh(f"the exact path would contract about {n:.3g} Wick configurations "
                          f"(up to {legs} legs joined), over max_configurations="
                          f"{DEFAULT_MAX_CONFIGURATIONS:,}")


def tree_triple(pa: Tree, pb: Tree, n_ctx: int, term_values: dict | None = None
                ) -> tuple[float, float, float]:
    """``(<a, b>, <a, a>, <b, b>)`` of two bias-free one-node float64 trees (the values of
    `tree_inner_req` on each pair, bit for bit): the pair's configurations and cost
    checked first (CostTooHigh), then `tree_gram` of ``[pa, pb]`` (each tree's chaos
    form once, not once per product). ``term_values``: as `tree_gram`'s."""
    check_configurations_bound(pa, pb)
    check_cost(make_request(n_ctx=n_ctx), pa, pb, n_ctx, (),
               position_selector(n_ctx, None, False), "chaos")
    G = tree_gram([pa, pb], n_ctx, term_values=term_values)
    return float(G[0, 1]), float(G[0, 0]), float(G[1, 1])


def _tree_sides(trees: list, n_ctx: int) -> list[dict]:
    """Each one-node tree's chaos form (`TermSide`) once: ``{"a": sides, "b": the same arrays
    relabeled}`` (`relabeled`), so a model's chaos coefficients are contracted once."""
    sides = []
    for t in trees:
        own = [TermSide(x, "a", np.einsum, n_ctx, False) for x in t.nodes[0].terms]
        sides.append({"a": own, "b": [s.relabeled(x, "b") for s, x in zip(own, t.nodes[0].terms)]})
    return sides


def _sides_pair(sa: dict, ta: Tree, sb: dict, tb: Tree, sel, max_configurations,
                term_values: dict | None) -> float:
    """``<ta, tb>`` from their sides (`_tree_sides`): ``ta``'s "a" side against ``tb``'s "b"
    side, term pair by term pair, summed in order."""
    total = 0.0
    for x, tx in zip(sa["a"], ta.nodes[0].terms):
        for y, ty in zip(sb["b"], tb.nodes[0].terms):
            val, _ = chaos_pair(x, y, sel, (), np.einsum, max_configurations)
            if term_values is not None:
                term_values[(id(tx), id(ty))] = val
            if val is not None:
                total += float(val)
    return total


def _check_own_pairs(trees: list, n_ctx: int, req: Request, sel) -> None:
    for t in trees:
        check_configurations_bound(t, t)
        check_cost(req, t, t, n_ctx, (), sel, "chaos")


def tree_gram(trees: list, n_ctx: int, backend: str = "numpy", device: Any = None,
              term_values: dict | None = None) -> np.ndarray:
    """The exact Gram matrix of one-node float64 trees (linear and attention terms), each
    model's chaos form (`TermSide`) built once per
    side, then every unordered pair (`chaos_pair`);
    the cost of each model's own pair is checked first (CostTooHigh). A model's ``"b"`` side
    is its ``"a"`` side relabeled (`relabeled`:
    the same arrays), so each model's chaos coefficients are contracted once per call.
    ``term_values``: a dict that receives, for every term pair contracted, ``(id(term of
    trees[i]), id(term of trees[j]))`` -> its value (the raw sum of
    `chaos_pair`; None for an empty pair), so that
    a product over a subset of the terms (`sum_term_values`) costs no contraction."""
    req = make_request(n_ctx=n_ctx)
    sel = position_selector(n_ctx, None, False)
    _check_own_pairs(trees, n_ctx, req, sel)
    N = len(trees)
    G = np.zeros((N, N))
    with torch_backend(backend, device, "degree_similarity_matrix"):
        sides = _tree_sides(trees, n_ctx)
        for i in range(N):
            for j in range(i, N):
                G[i, j] = G[j, i] = _sides_pair(sides[i], trees[i], sides[j], trees[j], sel,
                                                req.max_configurations, term_values)
    return G


def tree_cross_gram(rows: list, cols: list, n_ctx: int, backend: str = "numpy",
                    device: Any = None) -> np.ndarray:
    """``G[i, j] = <rows[i], cols[j]>`` (float64 ``(len(rows), len(cols))``) of one-node
    float64 trees: each tree's chaos form once, then every pair, ``rows[i]``'s ``"a"`` side
    against ``cols[j]``'s ``"b"`` side — the operations of `tree_gram`'s entry ``(i, j)``
    for ``i < j`` over ``rows + cols``, so an off-diagonal block of a blocked matrix equals
    that part of the unblocked one bit for bit. Each model's own pair is checked first
    (CostTooHigh)."""
    req = make_request(n_ctx=n_ctx)
    sel = position_selector(n_ctx, None, False)
    _check_own_pairs(list(rows) + list(cols), n_ctx, req, sel)
    G = np.zeros((len(rows), len(cols)))
    with torch_backend(backend, device, "degree_similarity_matrix"):
        sa, sb = _tree_sides(rows, n_ctx), _tree_sides(cols, n_ctx)
        for i, (x, tx) in enumerate(zip(sa, rows)):
            for j, (y, ty) in enumerate(zip(sb, cols)):
                G[i, j] = _sides_pair(x, tx, y, ty, sel, req.max_configurations, None)
    return G


def tree_block_cost(tree: Tree, n_ctx: int, n_models: int, n_pairs: int) -> tuple[int, float]:
    """``(estimated peak bytes, estimated FLOPs)`` of a block of `tree_gram` /
    `tree_cross_gram` over ``n_models`` trees shaped like ``tree`` (their chaos forms held
    together) and ``n_pairs`` pairs, from one dry run (nothing contracted): bytes, every
    model's stored chaos tensors plus the largest working set of one sum; FLOPs, each model's
    chaos form once plus every pair's cross sums (the path costs, as `chaos_cost_req`)."""
    sel = position_selector(n_ctx, None, False)
    sides = [TermSide(t, side, np.einsum, n_ctx, False, dry=True)
             for side in ("a", "b") for t in tree.nodes[0].terms]
    own = sides[:len(sides) // 2]
    cross = [chaos_pair(x, y, sel, (), np.einsum, 1 << 62)[0]
             for x in own for y in sides[len(sides) // 2:]]
    stored = sum(x.stored for x in own)
    work = max([x.work for x in own] + [c[0] for c in cross])
    flops = n_models * sum(x.flops for x in own) + n_pairs * sum(c[1] for c in cross)
    return 8 * (n_models * stored + work), float(flops)


def sum_term_values(pa: Tree, pb: Tree, term_values: dict) -> float | None:
    """``<pa, pb>`` summed from the term pairs' values recorded by `tree_gram`
    (``term_values``), in the order and with the arithmetic of `tree_inner_req` (bit for
    bit its value); None when a term pair of ``pa`` x ``pb`` was not recorded."""
    total = None
    for x in pa.nodes[0].terms:
        for y in pb.nodes[0].terms:
            key = (id(x), id(y))
            if key not in term_values:
                return None
            val = term_values[key]
            if val is not None:
                total = val if total is None else total + val
    if total is None:
        return 0.0
    if isinstance(total, np.ndarray) and total.ndim == 0:
        total = total.item()
    return float(total)
