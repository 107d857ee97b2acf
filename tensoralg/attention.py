"""Gaussian inner products of sequence models with bilinear attention (docs/mathematics.md §3.7).

A sequence model maps ``X`` of shape ``(n_ctx, d)`` to ``(n_ctx, d_out)``. Under the Gaussian
metric every entry ``X[s, i]`` is an independent ``N(0, 1)`` and the lifted input is
``x~_s = (1, x_s)`` with the *same* constant 1 at every position. The inner product is

    <a, b> = sum_t sum_o E[ f_a(X)[t, o] * f_b(X)[t, o] ]          (t: query positions)

with ``position=t`` keeping one ``t`` and ``output=`` slicing ``o`` as in ``tensoralg.inner``.

Exact (:func:`exact_inner`). Both models are read in the canonical form of
:mod:`tensoralg.canonical` (:func:`~tensoralg.canonical.sequence_tree` with ``fold=True``: a
tree of lifted multilinear nodes whose legs carry a position variable), which for a supported
model is one node, a sum of terms whose open legs are copies of the lifted input at some
position: a residual / linear term has one leg at ``t``; a
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
(an exact zero pattern). The joined network and both ways of summing it (per matching; by
chaos) are :mod:`tensoralg.strategies.wick_terms`; the contractions run through
:mod:`tensoralg.strategies.executor`.

Supported exactly: models of the form ``[Linear...] -> attention or Residual(attention) ->
[Linear...]`` (an embedding applied per position, one attention layer with or without a
residual, biases, any mask, RoPE, an unembedding; a residual block may hold Linear layers
around the attention), and per-position affine models: those whose folded tree is one node of
linear and attention terms. Deeper
stacks: :func:`montecarlo_inner` (unbiased, with a standard error) and :func:`closure_inner`
(the second-moment closure over (position, feature); exact at depth 1, APPROXIMATE deeper).
"""

from __future__ import annotations

import contextvars
import itertools
import math
import numbers
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
import opt_einsum as oe

from .canonical import QUERY, Node, Term, Tree, resolve_n_ctx, sequence_tree
from .backends import available_memory
from .errors import CostTooHigh
from .request import Request, make_request
from .results import similarity_from, swap_order
from .strategies.montecarlo import (MonteCarloEstimate, _radial_rule, inner_diagnostics,
                                    ratio_diagnostics, ratio_estimate)
from .layers import (BilinearAttention, Bilinear, Layer, Linear, Residual, Sequential,
                     as_array, as_network)
from .strategies.executor import TORCH as _TORCH  # noqa: F401  (tests reset/inspect it)
from .strategies.executor import ein as _ein
from .strategies.executor import TORCH_CPU_FLOPS, torch_backend
from .strategies.wick_terms import JoinedTermPair, TermSide, chaos_pair, stored_entries
from .strategies.wick_terms import partial_matchings as _partial_matchings

__all__ = ["exact_inner", "exact_similarity", "exact_gram", "closure_inner", "closure_similarity",
           "closure_triple", "closure_gram", "closure_cross_gram", "head_gram",
           "montecarlo_similarity_pairs",
           "count_configurations", "chaos_memory_bytes", "canonicalize",
           "montecarlo_inner", "montecarlo_similarity", "AttentionNotSupported",
           "DEFAULT_MAX_CONFIGURATIONS"]

DEFAULT_MAX_CONFIGURATIONS = 200_000

#: The alternatives named when the exact attention path refuses (docs/mathematics.md §3.7).
ALTERNATIVES = ("Alternatives: method='montecarlo' (an estimate with a standard error and a "
                "reliability verdict) or method='closure' (the moment-closure similarity: "
                "APPROXIMATE from the second non-linear layer on, the exact similarity of a "
                "surrogate whose layers read Gaussians with the true second moments over "
                "(position, feature); equal to the exact value for one attention layer; on "
                "trained two-layer checkpoints not an estimate of the tensor similarity)")


class AttentionNotSupported(ValueError):
    """The exact attention path does not handle this model (raised before any contraction)."""


# with backend="torch" on a CPU, contractions from this path cost on run in torch (read at
# each call: tests lower it to run every contraction in torch)
_TORCH_CPU_FLOPS = TORCH_CPU_FLOPS


def _torch_backend(backend: str, device: Any, name: str) -> torch_backend:
    """The torch execution context of one call (:class:`~tensoralg.strategies.executor.
    torch_backend`) with this module's CPU threshold."""
    return torch_backend(backend, device, name, cpu_min_flops=_TORCH_CPU_FLOPS)


# ----------------------------------------------------------------------------------------
# the canonical form: tensoralg.canonical's tree, checked for what the exact path contracts
# ----------------------------------------------------------------------------------------

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


def _unsupported(name: str, i: int, what: str) -> AttentionNotSupported:
    return AttentionNotSupported(
        f"{name}: the exact attention inner product handles one attention layer (with or "
        f"without a residual) between per-position Linear layers; layer {i} is {what}. "
        f"Use method='montecarlo' or method='closure' (approximate) for deeper stacks")


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
        if not kinds <= {"linear", "attention"}:
            raise _unsupported(name, i, type(layers[i]).__name__)
        if seen:
            raise _unsupported(name, i, "a second attention layer")
        seen = True
    tree = tree.folded()
    if len(tree.nodes) != 1 or any(t.kind not in ("linear", "attention")
                                   for t in tree.nodes[0].terms):
        raise AttentionNotSupported(
            f"{name}: the exact attention inner product needs one node of linear and attention "
            f"terms after folding the affine layers, got {len(tree.nodes)} nodes; use "
            f"method='montecarlo' or method='closure' (approximate)")
    return tree


# ----------------------------------------------------------------------------------------
# argument checking shared by every method
# ----------------------------------------------------------------------------------------

def _resolve_n_ctx(a: Layer, b: Layer, n_ctx: Any) -> int:
    return resolve_n_ctx([("a", a), ("b", b)], n_ctx)


#: Set inside a Gram matrix of sequence models, whose per-position affine members are paired
#: with themselves on the diagonal (a pair without attention, valid there).
_IN_SEQUENCE_GRAM = contextvars.ContextVar("in_sequence_gram", default=False)


def _check_pair(a: Any, b: Any, n_ctx: Any):
    a, b = as_network(a, "a"), as_network(b, "b")
    if not (a.is_sequence_model or b.is_sequence_model or _IN_SEQUENCE_GRAM.get()):
        raise ValueError("a and b: neither model holds attention; these are position-free networks: "
                         "use tensoralg.inner")
    if a.in_features != b.in_features:
        raise ValueError(f"a and b must read the same input: a has in_features={a.in_features}, "
                         f"b has in_features={b.in_features}")
    if a.out_features != b.out_features:
        raise ValueError(f"a and b must have the same number of outputs: a has "
                         f"out_features={a.out_features}, b has out_features={b.out_features}")
    return a, b, _resolve_n_ctx(a, b, n_ctx)


def _check_slices(req: Request, d_out: int, n_ctx: int) -> None:
    """The request's ``output`` and ``position`` against the models' output size and
    ``n_ctx`` (their form was checked by :func:`tensoralg.request.make_request`)."""
    req.output_matrix(d_out)
    req.check_position(n_ctx)


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
    a, b, n_ctx = _check_pair(a, b, req.n_ctx)
    _check_slices(req, a.out_features, n_ctx)
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


def _stored_bytes(pa: Tree, pb: Tree, n_ctx: int, exact: bool, sel, out_mode) -> int:
    """Estimated peak bytes of the chaos strategy, from a dry run (paths found and cached for
    the real run; nothing contracted): every stored ``R[S]`` of both models plus the largest
    working set of one sum (its cached diagonal copies and one contraction's live
    intermediates and step copies, :func:`~tensoralg.strategies.wick_terms.sum_peak`);
    8 bytes per entry (float64; one pointer per Fraction in rationals, so low there)."""
    key = (_shape_signature(pa), _shape_signature(pb), n_ctx, exact, sel.shape, out_mode)
    hit = _STORED_BYTES.get(key)
    if hit is not None:
        return hit
    sides = {side: [TermSide(t, side, np.einsum, n_ctx, exact, dry=True) for t in p.nodes[0].terms]
             for side, p in (("a", pa), ("b", pb))}
    stored = sum(x.stored for v in sides.values() for x in v)
    work = max([x.work for v in sides.values() for x in v] +
               [chaos_pair(x, y, sel, out_mode, np.einsum, 1 << 62)[0]
                for x in sides["a"] for y in sides["b"]])
    if len(_STORED_BYTES) > 256:
        _STORED_BYTES.clear()
    _STORED_BYTES[key] = 8 * (stored + work)
    return _STORED_BYTES[key]


#: The estimate depends on shapes and zero patterns only (what the compiled paths depend on).
_STORED_BYTES: dict = {}


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
    pa, pb, n_ctx = _checked_trees(req, a, b)
    out_mode = ((QUERY,) if isinstance(req.position, str) else ()) + \
        (("o",) if isinstance(req.output, str) else ())
    return _stored_bytes(pa, pb, n_ctx, req.exact, _selector(n_ctx, req.position, req.exact),
                         out_mode)


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
    ``max_memory``; nothing contracted."""
    n_conf = sum(JoinedTermPair(x, y, sel, out_mode, np.einsum).count()
                 for x, y in _term_pairs(pa, pb))
    if n_conf > req.max_configurations:
        raise CostTooHigh(f"exact attention inner product: {n_conf:,} Wick configurations, "
                          f"over max_configurations={req.max_configurations:,}. "
                          f"{ALTERNATIVES}, or raise max_configurations")
    if strategy == "chaos":
        msg = memory_refusal(_stored_bytes(pa, pb, n_ctx, req.exact, sel, out_mode),
                             req.max_memory, req.backend, req.device)
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
    a, b, n_ctx = _check_pair(a, b, req.n_ctx)
    if n_ctx <= SHAPE_CTX or a.n_ctx is not None or b.n_ctx is not None:
        return None   # (a mask array fixes the context: the trees are the models' own size)
    _check_slices(req, a.out_features, n_ctx)
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
    ctx = _torch_backend("torch" if req.backend == "torch" else "numpy", req.device,
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
    _check_cost(req, pa, pb, *args)
    _check_cost(req, pa, pa, *args)
    _check_cost(req, pb, pb, *args)
    x, y = (pb, pa) if swap_order(as_network(a, "a"), as_network(b, "b")) else (pa, pb)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        ab = _exact_value(req, x, y, *args)
        aa = _exact_value(req, pa, pa, *args)
        bb = _exact_value(req, pb, pb, *args)
    return similarity_from(ab, aa, bb, req.exact)


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


def _mc_draws(req: Request, a: Any, b: Any, n_batches: Any, caller: str):
    """The request checked against the pair (before any sampling); returns a generator of
    ``(f_a(X), f_b(X), w)`` over ``n_batches`` equal batches of directions (numpy
    ``default_rng(seed)``), and the number of directions.

    ``size`` directions ``u`` uniform on the sphere of ``R^(n_ctx d)`` per batch, each
    evaluated at the ``Q`` points ``±r_q u`` of the Gauss rule for the chi radius
    (:func:`tensoralg.strategies.montecarlo._radial_rule`, exact for polynomials of degree
    ``<= 2 max(degree)``): ``X`` ``(size Q, n_ctx, d)`` and ``w`` ``(Q,)`` the weights (sum 1),
    so ``sum_q w_q g(X_q)`` is the exact radial average of a product of the two outputs."""
    a, b, n_ctx = _check_pair(a, b, req.n_ctx)
    if isinstance(req.output, str) or isinstance(req.position, str):
        raise ValueError(f"{caller}: output='each' / position='each' are not supported; "
                         f"loop over the slices")
    _check_slices(req, a.out_features, n_ctx)
    if isinstance(n_batches, bool) or not isinstance(n_batches, numbers.Integral) or n_batches < 2:
        raise ValueError(f"n_batches: expected an int >= 2, got {n_batches!r}")
    if req.n_samples < 2 * n_batches:
        raise ValueError(f"n_samples: expected an int >= 2 * n_batches = {2 * n_batches}, got "
                         f"{req.n_samples!r}")
    a, b = a.astype_float(), b.astype_float()
    points, n = _mc_points(req.seed, req.n_samples, n_batches, n_ctx, a.in_features,
                           max(a.degree, b.degree))

    def draws():
        for X, wq in points:
            yield a(X), b(X), wq

    return draws(), n


def _mc_points(seed, n_samples, n_batches, n_ctx, d, degree, chunk=None):
    """The radial Monte Carlo points of :func:`_mc_draws`: a generator of ``(X, wq)`` over
    ``n_batches`` batches of ``n_samples // n_batches`` directions (numpy
    ``default_rng(seed)``), ``X`` ``(m Q, n_ctx, d)`` and ``wq`` ``(Q,)``; with ``chunk`` each
    batch is cut into pieces of at most ``chunk`` directions (the same directions, in order),
    and the number of directions."""
    size = int(n_samples) // int(n_batches)
    r, w = _radial_rule(n_ctx * d, 2 * degree)
    pts = np.concatenate([r, -r])
    wq = np.concatenate([w, w]) / 2
    Q = pts.size
    step = size if chunk is None else max(1, int(chunk))

    def points():
        rng = np.random.default_rng(int(seed))
        for _ in range(int(n_batches)):
            u = rng.standard_normal((size, n_ctx * d))
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            for lo in range(0, size, step):
                v = u[lo:lo + step]
                yield (v[:, None, :] * pts[None, :, None]).reshape(len(v) * Q, n_ctx, d), wq

    return points(), size * int(n_batches)


def _mc_request(n_ctx, n_samples, seed, output, position) -> Request:
    return make_request(method="montecarlo", n_ctx=n_ctx, n_samples=n_samples, seed=seed,
                        output=output, position=position)


def montecarlo_inner(a: Any, b: Any, *, n_ctx: Any = None, n_samples: int = 20_000,
                     seed: int = 0, output: Any = None, position: Any = None,
                     n_batches: int = 20):
    """Monte Carlo estimate (approximate) of ``sum_t sum_o E[f_a(X)[t,o] f_b(X)[t,o]]`` for
    sequence models of any depth, with its standard error: the radial estimator of the
    position-free path (docs/mathematics.md §3.4).

    Samples ``n_samples`` directions ``u`` uniform on the sphere of ``R^(n_ctx d)`` (numpy
    ``default_rng(seed)``) and integrates the radius exactly (the Gauss rule for the chi
    distribution): per direction ``p(u) = E_r[sum_{t,o} f_a(r u)[t,o] f_b(r u)[t,o]]``
    (sliced by ``output`` / ``position``), each model evaluated at ``Q = 2 m`` points
    (``m = max degree // 2 + 1``). ``p(u)`` is iid over directions with mean the inner
    product; the estimate is its sample mean and the standard error
    ``std(p, ddof=1) / sqrt(n)``. Plain samples ``X ~ N(0, I)`` (the estimator before) give a
    heavy-tailed degree-10 integrand at one layer whose standard error did not cover (truth
    beyond 3 SE in 23 of 200 seeds at 2 000 samples); the radial one is tested for coverage in
    tests/test_mc_coverage.py. ``n_batches`` only fixes the draw order.

    Args:
        output: None, an int or a direction vector (no ``"each"``); position: None or an int.

    Returns:
        ``tensoralg.MonteCarloEstimate`` (a float with ``.stderr`` and ``.n_samples`` =
        directions).

    Raises:
        ValueError: as :func:`exact_inner` for the pair and slices; ``n_samples`` below
            ``2 * n_batches``; ``n_batches < 2``; a negative ``seed``.
    """
    return montecarlo_inner_req(_mc_request(n_ctx, n_samples, seed, output, position), a, b,
                                n_batches)


def montecarlo_inner_req(req: Request, a: Any, b: Any, n_batches: int = 20):
    """:func:`montecarlo_inner` of a validated request."""
    draws, n = _mc_draws(req, a, b, n_batches, "montecarlo_inner")
    s1 = s2 = 0.0
    kept = []
    for fa, fb, w in draws:
        p = _per_sample(fa, fb, req.output, req.position).reshape(-1, w.size) @ w
        s1, s2 = s1 + p.sum(), s2 + p @ p
        kept.append(p)
    mean = s1 / n
    var = max(s2 / n - mean * mean, 0.0) * n / (n - 1)
    diag = inner_diagnostics(np.concatenate(kept), "<a,a>" if b is a else None)
    return MonteCarloEstimate(float(mean), math.sqrt(var / n), n, diag)


def montecarlo_similarity(a: Any, b: Any, *, n_ctx: Any = None, n_samples: int = 20_000,
                          seed: int = 0, output: Any = None, position: Any = None,
                          n_batches: int = 20):
    """Monte Carlo estimate (approximate) of ``<a,b> / sqrt(<a,a> <b,b>)`` for sequence models of
    any depth, with a delta-method standard error.

    The directions and radial rule of :func:`montecarlo_inner`: per direction ``p_ab``,
    ``p_aa``, ``p_bb`` from the same evaluations. The estimate is the ratio
    ``r = mean(p_ab) / sqrt(mean(p_aa) mean(p_bb))`` (consistent, bias O(1/n)) and its standard
    error ``sqrt(g^T C g / n)``, ``C`` the sample covariance of ``(p_ab, p_aa, p_bb)`` over the
    ``n`` directions and ``g`` the gradient of ``r``
    (``tensoralg.strategies.montecarlo.ratio_estimate``, the position-free path's formula).

    Measured (tests/test_mc_coverage.py): on three one-layer pairs with 300 directions the
    exact value lay beyond 3 standard errors in 3 of 300 runs (plain sampling at 2 000
    samples: 12). Deeper stacks have high degree (25 for two attention layers, ``Q = 26``):
    their standard error is less reliable; check it across seeds.

    Returns:
        ``tensoralg.MonteCarloEstimate`` (``.stderr``, ``.n_samples`` = directions).

    Raises:
        ValueError: as :func:`montecarlo_inner`; a sampled norm that is zero.
    """
    return montecarlo_similarity_req(_mc_request(n_ctx, n_samples, seed, output, position),
                                     a, b, n_batches)


def montecarlo_similarity_req(req: Request, a: Any, b: Any, n_batches: int = 20):
    """:func:`montecarlo_similarity` of a validated request."""
    draws, n = _mc_draws(req, a, b, n_batches, "montecarlo_similarity")
    s1 = np.zeros(3)
    s2 = np.zeros((3, 3))
    kept = []
    for fa, fb, w in draws:
        P = np.stack([_per_sample(x, y, req.output, req.position).reshape(-1, w.size) @ w
                      for x, y in ((fa, fb), (fa, fa), (fb, fb))])          # (3, size)
        s1 += P.sum(axis=1)
        s2 += P @ P.T
        kept.append(P)
    est = ratio_estimate(s1, s2, n)
    return MonteCarloEstimate(float(est), est.stderr, n,
                              ratio_diagnostics(np.concatenate(kept, axis=1)))


def montecarlo_similarity_pairs(models: Sequence[Any], *, n_ctx: Any = None,
                                n_samples: int = 20_000, seed: int = 0, n_batches: int = 20,
                                chunk: int = 25, progress: Any = None) -> dict:
    """Monte Carlo similarity (APPROXIMATE: an estimate) of every pair of ``N`` sequence models
    from ONE shared set of directions, each pair with its :class:`~tensoralg.strategies.montecarlo.Diagnostics` verdict.

    The estimator of :func:`montecarlo_similarity` (directions uniform on the sphere of
    ``R^(n_ctx d)`` drawn from numpy ``default_rng(seed)`` in ``n_batches`` batches, the radius
    integrated exactly by the Gauss rule for the chi distribution; docs/mathematics.md §3.4,
    §3.9), with the same directions for every pair: entry ``(i, j)`` equals
    ``montecarlo_similarity(models[i], models[j], n_ctx=n_ctx, n_samples=n_samples,
    seed=seed)`` up to rounding (the sums are grouped differently), including its diagnostics,
    as long as the models share one degree (the Gauss rule is chosen for the largest degree of
    all ``N``; it is exact for every smaller one too). Cost: each model is evaluated once per
    point (``N`` forward passes, not ``N^2``), ``chunk`` directions at a time; memory
    ``O(N^2 n_samples)`` for the per-direction products the diagnostics need.

    Args:
        models: ``N >= 2`` sequence models reading the same input, with the same outputs.
        progress: None, or a callable wrapping an iterable (e.g. tqdm) over the chunks.

    Returns:
        ``{(i, j): MonteCarloEstimate}`` for ``i < j`` (``.stderr``, ``.n_samples``,
        ``.diagnostics``; a value whose ``.reliable`` is False is not an answer).

    Raises:
        ValueError: fewer than two models; a pair :func:`montecarlo_similarity` refuses (other
            input size or outputs, ``n_ctx``, ``n_samples`` below ``2 n_batches``); a sampled
            norm that is zero.
    """
    nets = list(models)
    if len(nets) < 2:
        raise ValueError(f"models: expected at least two sequence models, got {len(nets)}")
    req = _mc_request(n_ctx, n_samples, seed, None, None)
    checked = [_check_pair(nets[0], m, req.n_ctx) for m in nets[1:]]
    n_ctx = checked[0][2]
    if any(c[2] != n_ctx for c in checked):
        raise ValueError(f"n_ctx: the models resolve to different contexts "
                         f"{sorted({c[2] for c in checked})}; give n_ctx")
    _mc_draws(req, nets[0], nets[1], n_batches, "montecarlo_similarity_pairs")  # the checks
    nets = [checked[0][0].astype_float()] + [c[1].astype_float() for c in checked]
    points, n = _mc_points(req.seed, req.n_samples, n_batches, n_ctx, nets[0].in_features,
                           max(m.degree for m in nets), chunk)
    N = len(nets)
    kept = []
    for X, wq in (points if progress is None else progress(points)):
        m = X.shape[0] // wq.size
        F = np.stack([np.asarray(f(X), dtype=np.float64).reshape(m, wq.size, -1)
                      for f in nets], axis=1)                    # (m, N, Q, K)
        F *= np.sqrt(wq)[None, None, :, None]                    # Gauss weights are positive
        F = F.reshape(m, N, -1)
        kept.append(np.matmul(F, F.transpose(0, 2, 1)))          # (m, N, N): p_ij per direction
    P = np.concatenate(kept, axis=0)                              # (n, N, N)
    out = {}
    for i in range(N):
        for j in range(i + 1, N):
            T = np.stack([P[:, i, j], P[:, i, i], P[:, j, j]])   # (3, n)
            est = ratio_estimate(T.sum(axis=1), T @ T.T, n)
            out[(i, j)] = MonteCarloEstimate(float(est), est.stderr, n, ratio_diagnostics(T))
    return out


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


# ----------------------------------------------------------------------------------------
# Gaussian closure over (position, feature) second moments (APPROXIMATE at depth >= 2)
# ----------------------------------------------------------------------------------------
#
# A node maps the (non-lifted) activations z[t, i] of its input to y[t, o] as a sum of terms;
# a term is a product of linear *forms* of the lifted input z~_s = (1, z_s), each form a
# tensor W[s, ..., i] whose first axis is the position it reads (the form's value is
# sum_i W[s, ..., i] z~[s, i]), contracted with constant *core* tensors (mask, output maps).
# Labels: a term's indices are letters; its output is (position label, output label).
# The nodes are those of tensoralg.canonical.sequence_tree(fold=False), one per layer: a leg
# becomes a form broadcast to a leading position axis (_closure_term).

@dataclass
class _Form:
    W: np.ndarray   # (n_ctx, ..., D_in + 1), column 0 multiplies the constant 1
    labels: str     # one letter per axis except the last; labels[0] is the position read


@dataclass
class _Term:
    forms: list
    cores: list     # [(array, labels)]
    out: str        # two letters: (query position, output feature)


def _upper(labels: str) -> str:
    return labels.upper()


def _lin_term(W: np.ndarray, n_ctx: int) -> _Term:
    """``y[t, o] = W[o] . z~_t`` (W of shape ``(d_out, D_in + 1)``)."""
    return _Term([_Form(np.broadcast_to(W, (n_ctx,) + W.shape), "to")], [], "to")


def _closure_term(term: Term, n_ctx: int) -> _Term:
    """A :class:`~tensoralg.canonical.Term` as the closure's :class:`_Term`: every leg a form
    broadcast to a leading position axis ``(n_ctx, ..., D)`` (RoPE legs have one already),
    labelled by its position variable then its labels; the cores without the output label
    (the mask) first."""
    forms = []
    for leg in term.legs:
        W = leg.weight if leg.positional else \
            np.broadcast_to(leg.weight, (n_ctx,) + leg.weight.shape)
        forms.append(_Form(W, (leg.pos or QUERY) + "".join(leg.labels)))
    cores = [(a, "".join(lab)) for a, lab in term.cores]
    cores = [c for c in cores if "o" not in c[1]] + [c for c in cores if "o" in c[1]]
    return _Term(forms, cores, "".join(term.out))


def _closure_nodes(net: Layer, n_ctx: int, name: str):
    """``[(terms, d_out)]``, one closure node per layer: the nodes of
    :func:`tensoralg.canonical.sequence_tree` (``fold=False``, float64) as :class:`_Term` s."""
    net = as_network(net, name)
    for i, x in enumerate(_flatten_layers(net)):
        inner = _flatten_layers(x.inner) if isinstance(x, Residual) else [x]
        for y in inner:
            if not isinstance(y, (Linear, Bilinear, BilinearAttention)):
                raise ValueError(f"{name}: layer {i}: the closure handles Linear, Bilinear, "
                                 f"BilinearAttention, Residual and Sequential layers, got "
                                 f"{type(y).__name__}")
    if net.is_exact:
        net = net.astype_float()
    tree = sequence_tree(net, n_ctx, name, exact=False, fold=False)
    return [([_closure_term(t, n_ctx) for t in node.terms], node.d_out) for node in tree.nodes]


def _unique(labels: str) -> str:
    return "".join(dict.fromkeys(labels))


def _diag(arr, labels: str):
    """``(array, unique labels)``: the diagonal over repeated labels."""
    u = _unique(labels)
    return (arr, labels) if u == labels else (np.einsum(f"{labels}->{u}", arr), u)


def _linear_W(terms):
    """The lifted ``(d_out, D_in + 1)`` matrix of an affine node, or None for a non-linear one."""
    if len(terms) == 1 and len(terms[0].forms) == 1 and not terms[0].cores:
        return terms[0].forms[0].W[0]
    return None


def _schedule(nodes):
    """``(stages, tail)``: each stage is (affine matrices before it, a non-linear node)."""
    stages, pending = [], []
    for terms, _ in nodes:
        W = _linear_W(terms)
        if W is None:
            stages.append((pending, terms))
            pending = []
        else:
            pending.append(W)
    return stages, pending


def _pos_diagonal(C) -> bool:
    """Whether ``C`` ``(n, d, n, d')`` vanishes between different positions (the Gaussian input
    of a first stage: iid positions)."""
    n = C.shape[0]
    return not np.any(C * (1.0 - np.eye(n))[:, None, :, None])


def _form_cov_merged(Wi, li: str, Wj, lj: str, C, diag: bool):
    """:func:`_form_cov` reduced over repeated labels, as ``(array, labels, merge)``: with a
    position-diagonal ``C`` (``diag``) and different position labels the covariance is taken
    at equal positions, over ``li + lj[1:]``, and ``merge = (li[0], lj[0])`` says the
    contraction must identify the two position labels; else ``merge`` is None."""
    if diag and li[0] != lj[0]:
        c, lab = _diag(*_form_cov(Wi, li, Wj, li[0] + lj[1:], C))
        return c, lab, (li[0], lj[0])
    c, lab = _diag(*_form_cov(Wi, li, Wj, lj, C))
    return c, lab, None


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

# stacked operands of one batched contraction (and its largest intermediate) stay under this
_BATCH_BYTES = 64 * 2 ** 20


_CANON: dict = {}


def _label_classes(merges, out: str):
    """``find``: each label to the representative of its class after identifying the position
    labels of ``merges`` (pairs); a class holding output labels is represented by its
    earliest output label."""
    parent = {}

    def find(x):
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for p, q in merges:
        rp, rq = find(p), find(q)
        if rp == rq:
            continue
        ip, iq = out.find(rp), out.find(rq)
        if iq != -1 and (ip == -1 or iq < ip):
            rp, rq = rq, rp
        parent[rq] = rp
    return find


def _restore(val, out_m: str, out: str, restore):
    """``val`` over ``out_m`` expanded to ``out``: each label of ``restore`` equal to its root
    (a Kronecker delta)."""
    if not restore:
        return val
    eops, esubs = [val], [out_m]
    for r, x in restore:
        eops.append(np.eye(val.shape[out_m.index(r)]))
        esubs.append(r + x)
    return np.einsum(",".join(esubs) + "->" + out, *eops)


class _SumOfContractions:
    """``sum_j einsum(subs_j -> out, *ops_j)`` over many small contractions, run as few large
    ones: contractions whose subscripts agree up to a renaming of the summed labels, with
    operands of equal shapes, are stacked along a new summed label (one batched ``einsum`` per
    group instead of one call each; the per-call overhead dominated the closure at small
    widths). The same terms are added, in another order (float rounding only)."""

    def __init__(self, out: str):
        self.out = out
        self.groups: dict = {}

    def add(self, ops, subs, merges=()) -> None:
        key0 = (self.out, tuple(subs), tuple(merges), tuple(o.shape for o in ops))
        how = _CANON.get(key0)
        if how is None:
            how = _CANON[key0] = self._canonical(ops, subs, merges)
        diag, order, key = how
        ops = [o if d is None else np.einsum(d, o) for o, d in zip(ops, diag)]
        self.groups.setdefault(key, []).append([ops[p] for p in order])

    def _canonical(self, ops, subs, merges):
        """``(diagonals, order, key)`` of one contraction, from its labels and shapes only:
        per operand the ``einsum`` taking its diagonal over merged or repeated labels (or
        None); a canonical operand order; the group key (canonical subscripts, merged output,
        restore pairs, shapes). The order and naming are a heuristic: contractions equal up to
        the order of their operands and the names of summed labels mostly get the same key;
        any key is correct, a better one only groups more."""
        shapes = [o.shape for o in ops]
        find = _label_classes(merges, self.out)
        msubs = ["".join(find(x) for x in s_) for s_ in subs]
        out_m = _unique("".join(find(x) for x in self.out))
        restore = tuple((find(x), x) for x in self.out if find(x) != x)
        diag, usubs, ushapes = [], [], []
        for s_, m_, sh in zip(subs, msubs, shapes):
            u = _unique(m_)
            diag.append(None if u == m_ else f"{m_}->{u}")
            usubs.append(u)
            size = dict(zip(m_, sh))
            ushapes.append(tuple(size[x] for x in u))
        order = sorted(range(len(usubs)), key=lambda p: (
            ushapes[p], "".join(x if x in out_m else "_" for x in usubs[p])))
        for _ in range(3):
            canon = self._rename([usubs[p] for p in order], out_m)
            order = [order[q] for q in sorted(range(len(order)),
                                              key=lambda q: (ushapes[order[q]], canon[q]))]
        canon = self._rename([usubs[p] for p in order], out_m)
        key = (tuple(canon), out_m, restore, tuple(ushapes[p] for p in order))
        return diag, order, key

    @staticmethod
    def _rename(subs, keep: str):
        free = iter(x for x in _LETTERS if x not in keep)
        ren = {x: x for x in keep}
        canon = []
        for s_ in subs:
            for x in s_:
                if x not in ren:
                    ren[x] = next(free)
            canon.append("".join(ren[x] for x in s_))
        return canon

    def result(self):
        total = None
        for (canon, out_m, restore, shapes), jobs in self.groups.items():
            val = self._group(canon, out_m, shapes, jobs)
            val = _restore(val, out_m, self.out, restore)
            total = val if total is None else total + val
        return total

    @staticmethod
    def _group(canon, out_m, shapes, jobs):
        if len(jobs) == 1:
            return _ein(",".join(canon) + "->" + out_m, *jobs[0])
        used = set("".join(canon))
        z = next(x for x in _LETTERS if x not in used)
        # operands shared by every job (the same array) are not stacked
        shared = [all(job[p] is jobs[0][p] for job in jobs) for p in range(len(canon))]
        subs = [s_ if sh else z + s_ for s_, sh in zip(canon, shared)]
        if all(shared):   # the same contraction len(jobs) times
            return len(jobs) * _ein(",".join(canon) + "->" + out_m, *jobs[0])
        # jobs per batch: the stacked operands and the largest intermediate of one job,
        # times the batch, stay under _BATCH_BYTES
        per_job = sum(int(np.prod(s)) for s, sh in zip(shapes, shared) if not sh)
        big = _largest_intermediate(",".join(canon) + "->" + out_m, shapes)
        chunk = max(1, _BATCH_BYTES // (8 * max(per_job, big, 1)))
        total = None
        sub = ",".join(subs) + "->" + out_m
        for c0 in range(0, len(jobs), chunk):
            part = jobs[c0:c0 + chunk]
            ops = [jobs[0][p] if sh else np.stack([job[p] for job in part])
                   for p, sh in enumerate(shared)]
            val = _ein(sub, *ops, keep=shared)
            total = val if total is None else total + val
        return total


_BIG: dict = {}


def _largest_intermediate(sub: str, shapes) -> int:
    key = (sub, shapes)
    if key not in _BIG:
        _BIG[key] = int(oe.contract_path(sub, *shapes, shapes=True,
                                         optimize="greedy")[1].largest_intermediate) \
            if len(shapes) > 1 else 0
    return _BIG[key]


def _form_cov(Wi, li: str, Wj, lj: str, C):
    """``cov(form i, form j)`` of two forms read against inputs with cross covariance ``C``
    ``(n, d_i, n, d_j)``: an array over ``li + lj`` (position labels first in each), or over
    ``li + lj[1:]`` when both forms read the same position label (equal positions). Repeated
    labels are not yet reduced (see :func:`_diag`)."""
    n = Wi.shape[0]
    A = Wi[..., 1:].reshape(n, -1, Wi.shape[-1] - 1)
    B = Wj[..., 1:].reshape(n, -1, Wj.shape[-1] - 1)
    ri, rj = Wi.shape[1:-1], Wj.shape[1:-1]
    if li[0] == lj[0]:
        Cd = np.einsum("titj->tij", C)
        return (A @ Cd @ B.transpose(0, 2, 1)).reshape((n,) + ri + rj), li + lj[1:]
    tmp = (A @ C.reshape(n, C.shape[1], -1)).reshape(n, A.shape[1], n, C.shape[3])
    tmp = tmp.transpose(2, 0, 1, 3).reshape(n, -1, C.shape[3]) @ B.transpose(0, 2, 1)
    out = tmp.reshape((n, n) + ri + rj)  # (s, t, ri, rj)
    out = np.moveaxis(out, 0, 1 + len(ri))  # (t, ri, s, rj)
    return out, li + lj


class _ChaosSide:
    """One term of one closure node in Wiener chaos form with respect to the Gaussian input
    ``(mu, C)`` of the node: the term's forms ``g_i`` (centred: ``form_i = m_i + g_i``) and,
    for every set ``S`` of open forms, ``R[S]`` = the sum over partial matchings of the other
    forms (pairs: ``cov``, singletons: the mean ``m``) contracted with the term's inner cores,
    so that ``term = sum_S R[S] :prod_{i in S} g_i:`` (Wick products; Isserlis 1918). Labels are
    the term's (lower case); the output cores (those holding ``o``) are kept apart."""

    def __init__(self, term, mu, C):
        diag = _pos_diagonal(C)
        self.forms = [(f.W, f.labels) for f in term.forms]
        self.outer = [(a, lab) for a, lab in term.cores if "o" in lab]
        self.inner = [(a, lab) for a, lab in term.cores if "o" not in lab]
        self.carry = _unique("".join(lab for _, lab in self.outer)).replace("o", "") \
            if self.outer else "o"
        n = len(self.forms)
        self.means = []
        for W, lab in self.forms:
            m = np.einsum(f"{lab}i,{lab[0]}i->{lab}", W[..., 1:], mu) + W[..., 0]
            self.means.append(m if np.any(m != 0) else None)
        self.cov = {}
        for i in range(n):
            for j in range(i + 1, n):
                c, lab, mg = _form_cov_merged(self.forms[i][0], self.forms[i][1],
                                              self.forms[j][0], self.forms[j][1], C, diag)
                self.cov[(i, j)] = (c, lab, mg) if np.any(c != 0) else None
        self.R = {}
        for S in range(1 << n):
            self._chaos(S)

    def _chaos(self, S: int):
        n = len(self.forms)
        opened = [i for i in range(n) if S >> i & 1]
        closed = [i for i in range(n) if not S >> i & 1]
        present = set("".join(lab for _, lab in self.inner))
        for i in closed:
            present |= set(self.forms[i][1])
        want = "t" + self.carry + "".join(self.forms[i][1] for i in opened)
        out = "".join(x for x in _unique(want) if x in present)
        can_cap = [self.means[i] is not None for i in closed]
        can_pair = [[self.cov.get((min(i, j), max(i, j))) is not None for j in closed]
                    for i in closed]
        acc = _SumOfContractions(out)
        any_matching = False
        for m in _partial_matchings(len(closed), can_cap, can_pair):
            any_matching = True
            ops = [a for a, _ in self.inner]
            subs = [lab for _, lab in self.inner]
            merges = []
            for part in m:
                if len(part) == 1:
                    i = closed[part[0]]
                    ops.append(self.means[i])
                    subs.append(self.forms[i][1])
                else:
                    i, j = sorted((closed[part[0]], closed[part[1]]))
                    c, lab, mg = self.cov[(i, j)]
                    ops.append(c)
                    subs.append(lab)
                    if mg is not None:
                        merges.append(mg)
            if not ops:
                break
            acc.add(ops, subs, merges)
        total = acc.result() if acc.groups else None
        if any_matching:
            self.R[S] = (total, out if total is not None else "")


def _relabel(labels: str, upper: bool, readout: bool) -> str:
    """Side ``b``'s labels in upper case; in a readout its query position ``T`` is ``t``."""
    if not upper:
        return labels
    lab = labels.upper()
    return lab.replace("T", "t") if readout else lab


def _chaos_cross(x: _ChaosSide, y: _ChaosSide, C, readout: bool, K=None, mirror=False):
    """``sum over (S_a, S_b, bijections)`` of ``R_a[S_a] R_b[S_b] prod cov(cross pairs)`` with
    the cross covariance ``C`` of the two inputs: ``E[term_x[t, carry] term_y[T, carry']]``
    before the output cores, as ``(array, labels)``; labels ``t + x.carry + T + Y.carry``
    (``T`` identified with ``t`` for a readout). With ``K`` ``(k, d_o, d_O)`` (a readout) the
    output cores and ``K`` are folded into one operand of every contraction and the result is
    ``sum K[k] E[y_x[t] y_y[t]]`` over labels ``tk``.

    ``mirror`` (a self readout: ``x is y``, ``C`` the model's own covariance, ``K[k]``
    symmetric): the configuration pairing forms ``i -> j`` and its mirror ``j -> i`` give the
    same value (the transpose of the same expectation), so only one of each mirror pair is
    contracted, counted twice; self-mirrored ones once."""
    ra = lambda lab: lab  # noqa: E731
    rb = lambda lab: _relabel(lab, True, readout)  # noqa: E731
    out = "t" + x.carry + ("" if readout else "T") + rb(y.carry)
    fold = None
    if K is not None:
        ops, subs = _outer_operands([K], ["koO"], x, y, readout)
        flab = "k" + x.carry + rb(y.carry)
        fold = (_ein(",".join(subs) + "->" + flab, *ops) if len(ops) > 1 else K, flab)
        out = "tk"
    covs = {}
    diag = _pos_diagonal(C)

    def cross(i, j):
        if (i, j) not in covs:
            c, lab, mg = _form_cov_merged(x.forms[i][0], ra(x.forms[i][1]), y.forms[j][0],
                                          rb(y.forms[j][1]), C, diag)
            covs[(i, j)] = (c, lab, mg) if np.any(c != 0) else None
        return covs[(i, j)]

    acc = _SumOfContractions(out)
    twice = _SumOfContractions(out)
    nx, ny = len(x.forms), len(y.forms)
    for Sa, (Ra, la) in x.R.items():
        open_a = [i for i in range(nx) if Sa >> i & 1]
        for Sb, (Rb, lb) in y.R.items():
            open_b = [j for j in range(ny) if Sb >> j & 1]
            if len(open_a) != len(open_b):
                continue
            for perm in itertools.permutations(open_b):
                target = acc
                if mirror:
                    key = sorted(zip(open_a, perm))
                    back = sorted((j, i) for i, j in key)
                    if key > back:
                        continue
                    target = twice if key < back else acc
                pairs = [cross(i, j) for i, j in zip(open_a, perm)]
                if any(p is None for p in pairs):
                    continue
                ops, subs = [], []
                if Ra is not None:
                    ops.append(Ra)
                    subs.append(la)
                if Rb is not None:
                    ops.append(Rb)
                    subs.append(rb(lb))
                merges = []
                for c, lab, mg in pairs:
                    ops.append(c)
                    subs.append(lab)
                    if mg is not None:
                        merges.append(mg)
                if fold is not None:
                    ops.append(fold[0])
                    subs.append(fold[1])
                target.add(ops, subs, merges)
    total = acc.result() if acc.groups else None
    if twice.groups:
        val = 2 * twice.result()
        total = val if total is None else total + val
    return total, out


def _ident_terms(d: int, n_ctx: int):
    return [_lin_term(np.concatenate([np.zeros((d, 1)), np.eye(d)], 1), n_ctx)]


def _side_mean(side: _ChaosSide):
    """``E[term[t, o]]`` ``(n_ctx, d_out)``: ``R[{}]`` through the output cores."""
    if 0 not in side.R:
        return None
    R, lab = side.R[0]
    ops, subs = [R], [lab]
    for a, l_ in side.outer:
        ops.append(a)
        subs.append(l_)
    return _ein(",".join(subs) + "->to", *ops)


def _outer_operands(ops, subs, x, y, readout: bool):
    """``ops``/``subs`` followed by the output cores of side ``x`` and of side ``y`` (the latter
    relabelled as side b's)."""
    ops, subs = list(ops), list(subs)
    for a, l_ in x.outer:
        ops.append(a)
        subs.append(l_)
    for a, l_ in y.outer:
        ops.append(a)
        subs.append(_relabel(l_, True, readout))
    return ops, subs


def _outer_apply(X, lab: str, x: _ChaosSide, y: _ChaosSide, readout: bool, K=None):
    """The output cores of both sides applied to a cross sum ``X``: ``(t, o, T, O)`` moments,
    or for a readout (``K``: ``(k, d_o, d_O)``) the ``(t, k)`` values ``sum K[k] E[...]``."""
    ops, subs = _outer_operands([X], [lab], x, y, readout)
    if readout:
        ops.append(K)
        subs.append("koO")
        return _ein(",".join(subs) + "->tk", *ops)
    return _ein(",".join(subs) + "->toTO", *ops)


class _ClosureModel:
    """The per-model part of the closure (everything that does not depend on the other model):
    for every stage, the Gaussian input ``(mu, C)`` of the non-linear node (after the affine
    nodes before it), the node's terms in chaos form (:class:`_ChaosSide`) and the node's
    mean; the composed lifted tail ``A`` (the affine nodes after the last non-linear node)."""

    def __init__(self, net: Layer, n_ctx: int, name: str, n_stages: int | None = None):
        stages, tail = _schedule(_closure_nodes(net, n_ctx, name))
        n_stages = len(stages) if n_stages is None else n_stages
        stages = stages + [([], None)] * (n_stages - len(stages))
        d = self.d_in = net.in_features
        mu = np.zeros((n_ctx, d))
        C = np.eye(n_ctx)[:, None, :, None] * np.eye(d)[None, :, None, :]
        self.n_ctx, self.pre, self.sides, self.means = n_ctx, [], [], []
        for k, (pre, terms) in enumerate(stages):
            for W in pre:
                mu, C = _affine_self(W, mu, C)
            self.pre.append(pre)
            terms = _ident_terms(mu.shape[1], n_ctx) if terms is None else terms
            sides = [_ChaosSide(t, mu, C) for t in terms]
            mean = _node_mean_sides(sides, n_ctx)
            self.sides.append(sides)
            self.means.append(mean)
            self.last_C = C
            if k < n_stages - 1:
                C = _node_cross(sides, sides, C) - np.einsum("ti,uj->tiuj", mean, mean)
                mu = mean
        d_last = self.means[-1].shape[1]
        A = np.eye(d_last + 1)
        for W in tail:
            L = np.zeros((W.shape[0] + 1, W.shape[1]))
            L[0, 0] = 1.0
            L[1:] = W
            A = L @ A
        self.tail = A  # (d_out + 1, d_last + 1), row 0 = e0


def _affine_self(W, mu, C):
    return mu @ W[:, 1:].T + W[:, 0], np.einsum("oi,tiuj,pj->toup", W[:, 1:], C, W[:, 1:])


def _node_mean_sides(sides, n_ctx):
    total = None
    for s in sides:
        m = _side_mean(s)
        if m is not None:
            total = m if total is None else total + m
    d = _term_dout_side(sides[0])
    return np.zeros((n_ctx, d)) if total is None else total


def _term_dout_side(side: _ChaosSide) -> int:
    for a, lab in side.outer:
        return a.shape[lab.index("o")]
    W, lab = side.forms[0]
    return W.shape[lab.index("o")]


def _node_cross(sides_a, sides_b, C):
    """Raw second moments ``E[y_a[t, o] y_b[T, O]]`` ``(n, d_a, n, d_b)`` of two nodes."""
    total = None
    for x in sides_a:
        for y in sides_b:
            X, lab = _chaos_cross(x, y, C, False)
            if X is None:
                continue
            v = _outer_apply(X, lab, x, y, False)
            total = v if total is None else total + v
    if total is None:
        n = C.shape[0]
        total = np.zeros((n, _term_dout_side(sides_a[0]), n, _term_dout_side(sides_b[0])))
    return total


def _closure_pair_value(ma: _ClosureModel, mb: _ClosureModel, U, keep: bool, sel, each_t: bool,
                        Cab=None):
    """The closure readout ``sum_t sel[t] sum_k (U f_a[t])_k (U f_b[t])_k`` of two models
    (``ma is mb`` for a self term: the per-model covariance is the cross one)."""
    n = ma.n_ctx
    last = len(ma.sides) - 1
    if ma is mb:
        C = ma.last_C
    else:
        d = ma.d_in
        C = np.eye(n)[:, None, :, None] * np.eye(d)[None, :, None, :] if Cab is None else Cab
        for k in range(last + 1):
            for W in ma.pre[k]:
                C = np.einsum("oi,tiuj->touj", W[:, 1:], C)
            for W in mb.pre[k]:
                C = np.einsum("tiuj,pj->tiup", C, W[:, 1:])
            if k < last:
                C = _node_cross(ma.sides[k], mb.sides[k], C) - \
                    np.einsum("ti,uj->tiuj", ma.means[k], mb.means[k])
    # readout through the tails: K[k] = A_a^T u_k u_k^T A_b over the lifted last activations
    Ua, Ub = U @ ma.tail[1:], U @ mb.tail[1:]
    K = np.einsum("ki,kj->kij", Ua, Ub)
    if not keep:  # one readout matrix sum_k u_k u_k^T: no output axis in the contractions
        K = K.sum(axis=0, keepdims=True)
    mu_a, mu_b = ma.means[last], mb.means[last]
    val = (K[:, 0, 0][None, :] + np.einsum("kj,tj->tk", K[:, 0, 1:], mu_b)
           + np.einsum("ki,ti->tk", K[:, 1:, 0], mu_a))
    Kin = np.ascontiguousarray(K[:, 1:, 1:])
    sides_a, sides_b = ma.sides[last], mb.sides[last]
    for i, x in enumerate(sides_a):
        for j, y in enumerate(sides_b):
            if ma is mb and j < i:
                continue    # a self readout: the pair (j, i) is the transpose of (i, j)
            X, _ = _chaos_cross(x, y, C, True, Kin, mirror=ma is mb and i == j)
            if X is not None:
                val = val + (2 * X if ma is mb and j > i else X)
    val = val * sel[:, None]
    if not each_t:
        val = val.sum(axis=0)
    if not keep:
        val = val.sum(axis=-1)
    return val


def _closure_output(output: Any, d_out: int):
    if output is None or isinstance(output, str):
        return np.eye(d_out), isinstance(output, str)
    if isinstance(output, numbers.Integral):
        return np.eye(d_out)[[int(output)]], False
    u = np.asarray(output.detach().cpu().double().numpy() if hasattr(output, "detach")
                   else output, dtype=np.float64)
    return u[None], False


def _n_stages(net: Layer, n_ctx: int, name: str) -> int:
    return len(_schedule(_closure_nodes(net, n_ctx, name))[0])


def _closure_triple(req: Request, a, b, need_self=True):
    with _torch_backend(req.backend, req.device, "the closure"):
        return _closure_triple_run(req, a, b, need_self)


def _closure_triple_run(req: Request, a, b, need_self):
    a, b, n_ctx = _check_pair(a, b, req.n_ctx)
    _check_slices(req, a.out_features, n_ctx)
    swap = need_self and swap_order(a, b)   # a similarity: the pair's canonical order
    a, b = a.astype_float(), b.astype_float()
    U, keep = _closure_output(req.output, a.out_features)
    sel = _selector(n_ctx, req.position, False)
    each_t = isinstance(req.position, str)
    depth = max(_n_stages(a, n_ctx, "a"), _n_stages(b, n_ctx, "b"))
    ma = _ClosureModel(a, n_ctx, "a", depth)
    mb = _ClosureModel(b, n_ctx, "b", depth)
    # (so closure_similarity(a, b) and (b, a) agree bit for bit)
    ab = _closure_pair_value(*((mb, ma) if swap else (ma, mb)), U, keep, sel, each_t)
    if not need_self:
        return None, ab, None
    return (_closure_pair_value(ma, ma, U, keep, sel, each_t), ab,
            _closure_pair_value(mb, mb, U, keep, sel, each_t))


def closure_inner(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None,
                  position: Any = None, backend: str = "numpy", device: Any = None):
    """The moment-closure inner product (APPROXIMATE at depth >= 2; exact at depth 1) of two
    sequence models of any depth, in place of ``sum_t sum_o E[f_a(X)[t,o] f_b(X)[t,o]]``.

    What it is (docs/mathematics.md §3.9): the exact Gaussian inner product of a surrogate in
    which each layer reads a Gaussian with the true joint second moments of the layer before's
    outputs. On exact low-dimensional slices of trained two-layer checkpoints the true
    similarities were 0.175 and -0.246 where this gave 0.936 and +0.944 (the wrong sign on the
    second): it tracks the low-degree part of the function, not the full similarity, and is
    not an estimate of it there.

    What it computes (docs/mathematics.md §3.2 and §3.7). The state is the joint second moments
    of the two models' activations over (position, feature): means ``mu[t, i]`` and covariances
    ``C_aa, C_ab, C_bb`` of shape ``(n_ctx, d, n_ctx, d')``, i.e. ``M[t,i,t',j] = E[y~_{t,i}
    y~_{t',j}]`` for the lifted activations ``y~_t = (1, y_t)``. The lifted constant is kept
    apart as a deterministic coordinate: exactly 1 at every position, variance 0, so it is
    fully correlated across positions (never an independent constant per position). Each
    layer (a node) maps its input to a sum of terms, each a product of linear forms of the
    lifted input contracted with constant tensors: a per-position Linear (1 form), Bilinear
    (2 forms at ``t``), BilinearAttention (5 forms: ``Q1, Q2`` at the query position ``t``,
    ``K1, K2, V`` at key positions ``s`` summed against ``scale * mask[t, s]``; RoPE rotates
    the forms per position), a Residual adds the identity term. The new moments are computed
    exactly *as if* the node's input were jointly Gaussian with the current moments:
    ``E[prod of the forms of a term of side a x prod of the forms of a term of side b]`` by the
    non-centred Isserlis sum over all partial matchings of those forms (up to 10 for two
    attention terms), pairs bridged by the covariance of the two forms (any two positions),
    singletons by their mean (Isserlis 1918). No rescaling is applied anywhere.

    Exactness. At depth 1 (an embedding, one attention layer with or without a residual, an
    unembedding) the input of the only non-linear node is exactly Gaussian, so the value equals
    :func:`exact_inner` (tested to 1e-10 relative). From the second non-linear node on the
    input is a polynomial of a Gaussian, not Gaussian, and the value is that of a different,
    tree-restricted form, **not** ``E[f_a . f_b]``.

    Measured error (4 random two-layer attention-only pairs ``Residual(attn) ->
    Residual(attn) -> Linear``, d=3, n_ctx=3, 1 head, d_head=2, causal, no biases, weights
    N(0, 0.3^2); against :func:`montecarlo_inner` with 400 000 samples;
    ``benchmarks/attention_closure_error.py``, table in ``docs/attention.md``): similarity
    error 0.0012, 0.0138, 0.0268, 0.0040; raw ``<a,a>`` closure / Monte Carlo 0.995
    (5.7727 vs 5.8028 +- 0.0158), 1.000 (39.385 vs 39.401 +- 0.039), 1.012 (4.5021 vs
    4.4506 +- 0.0187), and one pair where Monte Carlo is unreliable (12.04 vs 72 +- 33, a
    heavy tail). At weights N(0, 0.5^2) Monte Carlo did not converge, so the closure is
    unchecked there. On trained checkpoints it fails badly: for the language audit's
    two-layer transformer (d_model 16, n_ctx 8, 2 heads of 4, RoPE; docs/language.md) the
    closure's raw norms lie below Markov lower bounds on the true norms (99.9 %, 3 x 5 000
    Monte Carlo directions) by factors of 89 to 6.7e5, and the audit's Monte Carlo check
    disagrees with its similarities at z = 20 and 24 (the polynomial's heavy tails, which a
    Gaussian with matched second moments does not have). Use it for a quick look or where
    exact is refused, never as a certificate.

    How (same value as summing every partial matching, to 1e-10 relative in the tests): the
    sum is grouped by Wiener chaos. Per model and stage each term's chaos coefficients ``R[S]``
    (sums over the internal matchings of the forms outside the open set ``S``) are computed
    once and reused by the self and cross moments; a cross moment is a sum over ``(S_a, S_b,
    bijection)`` of one contraction (745 per attention-attention term pair without means, 1 546
    with, instead of 945 / 9 496 matchings). At the first stage the input is iid over positions
    and forms at different position labels identify them. At the last stage only the readout is
    contracted, with the output maps, unembedding and output slice folded into one operand.

    Cost (one thread, shared 2-core machine at load ~2; tables in ``docs/attention.md``):
    contractions are grouped and stacked, each step a batched matrix product, the symbolic
    work cached per architecture, self readouts halved by symmetry. A two-layer attention-only
    ``closure_similarity`` (a new pair of an architecture seen before): 0.24 s at d_model=3,
    n_ctx=3, 1 head of 2; 0.68 s at d_model=16, n_ctx=8, 2 heads of 4 (2.8x the previous
    code); 5.0 s at d_model=32, n_ctx=8, 4 heads of 8 (2.8x). At d_model=64, n_ctx=8, 4 heads
    of 16 it is bound by flops (``closure_inner`` executes 9.2e10): 34 s (1.3x); the 1 s target
    is NOT met on a CPU.
    ``backend="torch"`` runs the contractions on a GPU (not yet measured on one).

    Args:
        a, b: sequence models (Sequential of Linear, Bilinear, BilinearAttention and Residual
            blocks; a Residual may hold ``[Linear...] layer [Linear...]``) with the same input
            and output sizes.
        n_ctx, output, position: as :func:`exact_inner`.
        backend: ``"numpy"`` or ``"torch"`` (float64 both: the contractions above a size run
            in torch on ``device``, default CUDA when available; the same sums, equal to
            numpy's up to rounding, tested on the CPU).
        device: a torch device (``backend="torch"`` only).

    Returns:
        float (or an array for ``"each"``), float64.

    Raises:
        ValueError: as :func:`exact_inner` for the pair and slices; a layer type the closure
            does not handle, or a Residual holding more than one non-linear layer; an unknown
            backend, a device without ``backend="torch"``, CUDA asked for where it is absent.
    """
    return closure_inner_req(_closure_request(n_ctx, output, position, backend, device), a, b)


def _closure_request(n_ctx, output, position, backend, device) -> Request:
    if backend not in ("numpy", "torch"):
        raise ValueError(f"backend: the closure runs in float64: expected 'numpy' or 'torch', "
                         f"got {backend!r}")
    return make_request(method="closure", n_ctx=n_ctx, output=output, position=position,
                        backend=backend, device=device)


def closure_inner_req(req: Request, a: Any, b: Any):
    """:func:`closure_inner` of a validated request."""
    return _closure_triple(req, a, b, need_self=False)[1]


def closure_similarity(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None,
                       position: Any = None, backend: str = "numpy", device: Any = None):
    """The moment-closure similarity: ``<a,b> / sqrt(<a,a> <b,b>)`` with the closure moments of
    one propagation (APPROXIMATE at depth >= 2; see :func:`closure_inner` for what it is, its
    measured error,
    ``backend`` and ``device``). Raises ValueError when a closure norm is zero or an inner
    product overflowed float64."""
    return closure_similarity_req(_closure_request(n_ctx, output, position, backend, device),
                                  a, b)


def closure_triple(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None,
                   position: Any = None, backend: str = "numpy", device: Any = None):
    """``(<a,a>, <a,b>, <b,b>)`` of the closure from one propagation (APPROXIMATE at depth
    >= 2; see :func:`closure_inner`); the cross term in the pair's canonical order."""
    return _closure_triple(_closure_request(n_ctx, output, position, backend, device), a, b)


def closure_similarity_req(req: Request, a: Any, b: Any):
    """:func:`closure_similarity` of a validated request."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        aa, ab, bb = _closure_triple(req, a, b)
    return similarity_from(ab, aa, bb, False, " (closure)")


# ----------------------------------------------------------------------------------------
# Gram / similarity matrices over many sequence models
# ----------------------------------------------------------------------------------------

def _check_models(models, n_ctx):
    nets = [as_network(m, f"models[{i}]") for i, m in enumerate(models)]
    if len(nets) < 1:
        raise ValueError("models: expected at least one model")
    # one sequence length for all of them (every mask that fixes one, named models[i]) before
    # the pairwise size checks, which then run at that length
    n_ctx = resolve_n_ctx([(f"models[{i}]", net) for i, net in enumerate(nets)], n_ctx)
    for i, net in enumerate(nets[1:], 1):
        _check_pair(nets[0], net, n_ctx)
    return nets, _check_pair(nets[0], nets[-1], n_ctx)[2]


def _gram_to_similarity(G):
    dg = np.einsum("ii...->i...", G)
    if np.any(dg <= 0):
        zero = np.flatnonzero(np.atleast_1d(dg <= 0).reshape(len(dg), -1).any(1)).tolist()
        raise ValueError(f"similarity_matrix: models {zero} have norm zero; similarity is "
                         f"undefined")
    return np.clip(G / np.sqrt(np.einsum("i...,j...->ij...", dg, dg)), -1.0, 1.0)


def _closure_setup(nets, n_ctx, output, position, names):
    U, keep = _closure_output(output, nets[0].out_features)
    sel = _selector(n_ctx, position, False)
    each_t = isinstance(position, str)
    depth = max(_n_stages(m, n_ctx, nm) for m, nm in zip(nets, names))
    cm = [_ClosureModel(m, n_ctx, nm, depth) for m, nm in zip(nets, names)]
    return cm, (U, keep, sel, each_t)


def closure_gram(models, *, n_ctx: Any = None, output: Any = None, position: Any = None,
                 similarity: bool = False, backend: str = "numpy",
                 device: Any = None) -> np.ndarray:
    """Closure Gram matrix ``G[i, j] = closure_inner(models[i], models[j])`` (APPROXIMATE at
    depth >= 2, exact at depth 1; see :func:`closure_inner`), shape ``(N, N)`` (plus the
    position / output axes for ``"each"``); with ``similarity=True`` the matrix
    ``G_ij / sqrt(G_ii G_jj)`` (clipped to [-1, 1]).

    Everything that depends on one model only -- its moments ``(mu, C_aa)`` at every stage,
    its terms in chaos form and its self readout ``G_ii`` -- is computed once per model; a pair
    only propagates its cross covariance and reads it out. Models of different depths are
    padded with identity stages, as in :func:`closure_inner`, so ``G[i, j]`` equals
    ``closure_inner(models[i], models[j])`` exactly (same operations). ``backend``,
    ``device``: as :func:`closure_inner`.

    Raises:
        ValueError: as :func:`closure_inner` for any pair; an empty list; a zero closure norm
            with ``similarity=True``.
    """
    return closure_gram_req(_closure_request(n_ctx, output, position, backend, device), models,
                            similarity)


def closure_gram_req(req: Request, models, similarity: bool = False) -> np.ndarray:
    """:func:`closure_gram` of a validated request."""
    nets, n_ctx = _check_models(models, req.n_ctx)
    _check_slices(req, nets[0].out_features, n_ctx)
    nets = [m.astype_float() for m in nets]
    vals = {}
    with _torch_backend(req.backend, req.device, "closure_gram"):
        cm, args = _closure_setup(nets, n_ctx, req.output, req.position,
                                  [f"models[{i}]" for i in range(len(nets))])
        for i in range(len(cm)):
            for j in range(i, len(cm)):
                vals[(i, j)] = _closure_pair_value(cm[i], cm[j] if i != j else cm[i], *args)
    shape = np.shape(vals[(0, 0)])
    G = np.empty((len(cm), len(cm)) + shape)
    for (i, j), v in vals.items():
        G[i, j] = v
        G[j, i] = v
    return _gram_to_similarity(G) if similarity else G


def closure_cross_gram(models_a, models_b, *, n_ctx: Any = None, output: Any = None,
                       position: Any = None, backend: str = "numpy",
                       device: Any = None) -> np.ndarray:
    """Closure cross Gram matrix ``G[i, j] = closure_inner(models_a[i], models_b[j])``
    (APPROXIMATE at depth >= 2, exact at depth 1; see :func:`closure_inner`), shape
    ``(N_a, N_b)`` (plus the position / output axes for ``"each"``): one off-diagonal block of
    :func:`closure_gram` of ``models_a + models_b``, computing only the cross pairs (per-model
    moments once per model). Equal to that block entry by entry (same operations).
    ``backend``, ``device``: as :func:`closure_inner`.

    Raises:
        ValueError: as :func:`closure_inner` for any pair; an empty list.
    """
    models_a, models_b = list(models_a), list(models_b)
    na = len(models_a)
    if na == 0 or not models_b:
        raise ValueError(f"closure_cross_gram: models_a and models_b must both be non-empty, "
                         f"got {na} and {len(models_b)} models")
    req = _closure_request(n_ctx, output, position, backend, device)
    nets, n_ctx = _check_models(models_a + models_b, req.n_ctx)
    _check_slices(req, nets[0].out_features, n_ctx)
    nets = [m.astype_float() for m in nets]
    names = [f"models_a[{i}]" for i in range(na)] + \
        [f"models_b[{j}]" for j in range(len(nets) - na)]
    with _torch_backend(req.backend, req.device, "closure_cross_gram"):
        cm, args = _closure_setup(nets, n_ctx, req.output, req.position, names)
        vals = [[_closure_pair_value(cm[i], cm[j], *args) for j in range(na, len(cm))]
                for i in range(na)]
    return np.asarray(vals, dtype=np.float64)


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
    nets, n_ctx = _check_models(models, req.n_ctx)
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
    return _gram_to_similarity(G) if similarity else G
