"""The engine: one `Request` and the models in, numbers out.

The public functions of `tensoralg.products` build the request (every option validated
once, `tensoralg.request`) and call the function of the same name here; so does the
blocked matrix (`tensoralg.blocks`). Nothing here checks an option again. The flow is
prepare (pair checks, canonical stacks: `tensoralg.prepare`) -> plan
(`tensoralg.planner`) -> strategy (`tensoralg.strategies`); sequence models (with
bilinear attention) go through the same strategy modules (their sequence functions). Units:
inner products have the units of output squared; similarities are dimensionless in [-1, 1].
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from .backends import converter
from .canonical import Canonical, resolve_n_ctx
from .distribution import STANDARD
from .errors import CostTooHigh
from .layers import Layer, as_network, check_finite_weights
from .planner import (
    Plan,
    SequencePlan,
    make_plan,
    plan_sequence,
    refuse_exact_early,
    refuse_if_needed,
)
from .prepare import (
    check_pair,
    check_sequence_models,
    check_slices,
    model_list,
    networks,
    scaled,
    stack_for,
)
from .request import Request
from .results import ExactNorm, check_overflow, gram_to_similarity, similarity_from, swap_order
from .strategies import chaos, closure, guided, montecarlo, sequence_exact, wick
from .strategies.montecarlo import MonteCarloArray, MonteCarloEstimate

_MAX_INTERMEDIATE = 1 << 27  # elements; Wick gram blocks are split to stay under it


def _plan(req: Request, ca: Canonical, cb: Canonical, U, keep, same=False, strategy=None,
          full=False) -> Plan:
    """The planner's decision for two prepared stacks under the request's budgets."""
    return make_plan(ca, cb, U, keep, req.metric, req.backend, req.device, req.dtype,
                     req.strategy if strategy is None else strategy, *req.budget, same=same,
                     full=full)


def _engine(req: Request, ca: Canonical, cb: Canonical, U, keep, same=False):
    """Cross Gram ``(Na, Nb[, K])`` of two prepared stacks (normalized gauge)."""
    if req.method == "closure":
        X = closure.cross(ca, cb, U, keep, req.backend)
        if req.backend == "torch":  # closure is cheap: computed in NumPy float64, then as asked
            from .backends import to_numpy

            X = to_numpy(converter("torch", req.device, req.dtype)(X)).astype(np.float64)
        return X
    p = _plan(req, ca, cb, U, keep, same=same)
    refuse_if_needed(p)
    return _run(req, p, ca, cb, U, keep, same)


def _run(req: Request, p: Plan, ca, cb, U, keep, same):
    """The cross Gram of two prepared stacks by the strategy of their (not refused) plan."""
    if p.strategy == "chaos":
        conv = converter(req.backend, req.device, req.dtype) if req.backend == "torch" else None
        return chaos.cross(ca, cb, U, keep, same=same, conv=conv)
    return wick.compute(p._joined, req.backend, req.device, req.dtype, shared=p.wick_shared)


def _is_sequence(*nets) -> bool:
    return any(getattr(n, "is_sequence_model", False) for n in nets)


def _sequence(kind: str, req: Request, na: Layer, nb: Layer):
    """Sequence models (bilinear attention, docs/mathematics.md §3.7): exact for one attention
    layer (`sequence_exact`), Monte Carlo and the (approximate) closure
    at any depth; refusals name the alternatives."""
    if not (na.is_sequence_model and nb.is_sequence_model) and not all(
            getattr(n, "is_sequence_model", False) or n.degree <= 1 for n in (na, nb)):
        raise ValueError("a and b: a sequence model (with attention) compared with a "
                         "position-free network of degree > 1; compare two sequence models (a "
                         "per-position affine map is accepted)")
    if req.metric != "gaussian":
        raise ValueError("sequence models: only metric='gaussian' is implemented")
    if req.method == "closure":  # APPROXIMATE at depth >= 2 (strategies.closure.closure_inner)
        if req.backend not in ("numpy", "torch"):
            raise ValueError(f"method='closure' for sequence models runs in float64: use "
                             f"backend='numpy' or 'torch', got {req.backend!r}")
        if kind == "inner":
            return _checked_inner(closure.closure_inner_req, req, na, nb)
        return closure.closure_similarity_req(req, na, nb)
    if req.method == "montecarlo":
        if req.proposal == "modes":
            return _guided(kind, req, na, nb)
        fn = montecarlo.montecarlo_inner_req if kind == "inner" else \
            montecarlo.montecarlo_similarity_req
        return _mode_checked(fn(req, na, nb), max(na.degree, nb.degree),
                             lambda: _guided(kind, req, na, nb))
    try:
        if kind == "inner":
            return _checked_inner(sequence_exact.exact_inner_req, req, na, nb)
        return sequence_exact.exact_similarity_req(req, na, nb)
    except sequence_exact.AttentionNotSupported as exc:
        raise CostTooHigh(f"exact inner product of sequence models: {exc}. "
                          f"{sequence_exact.ALTERNATIVES}") from None


def _checked_inner(fn, req: Request, na: Layer, nb: Layer):
    """``fn(req, na, nb)`` (a float inner product of sequence models), ValueError when it
    overflowed float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        X = fn(req, na, nb)
    check_overflow(X, "inner")
    return X


_POSITION_FREE = object()


def _fold(req: Request, net: Layer, name: str) -> Layer:
    """``net ∘ K`` for the request's input distribution ``N(0, K Kᵀ)`` (docs/mathematics.md
    §3.9; the network itself for ``N(0, I)``), every network of a request passing here under
    its argument's name. Its weights are checked finite here unless the float exact way takes
    them (`stack_for` checks them there, where a cached network is
    compared with its copies anyway: the warm path pays nothing)."""
    if req.method in ("montecarlo", "closure") or req.exact or net.is_sequence_model:
        check_finite_weights(net, name)
    return req.distribution.apply(net, name, req.exact)


def _checked_pair(kind: str, req: Request, a, b):
    """The pair checked (and composed with the input distribution's factor); sequence models
    answered through `_sequence` (returned as the third item), else
    ``_POSITION_FREE``."""
    na, nb = as_network(a, "a"), as_network(b, "b")
    check_pair(na, nb)
    na, nb = _fold(req, na, "a"), (None if b is a else _fold(req, nb, "b"))
    nb = na if nb is None else nb
    if _is_sequence(na, nb):
        return na, nb, _sequence(kind, req, na, nb)
    if req.n_ctx is not None or req.position is not None:
        raise ValueError("n_ctx / position: only for sequence models (with attention)")
    return na, nb, _POSITION_FREE


def _guided(kind: str, req: Request, na: Layer, nb: Layer, n_ctx: int | None = None):
    """Guided importance sampling (`tensoralg.strategies.guided`, APPROXIMATE), for
    vectors and sequences alike."""
    from .canonical import resolve_n_ctx

    U, keep = req.output_matrix(na.out_features)
    if _is_sequence(na, nb):
        n_ctx = resolve_n_ctx([("a", na), ("b", nb)], req.n_ctx)
        if isinstance(req.position, str):
            raise ValueError("position: proposal='modes' estimates one number; pass None or "
                             "an int (got 'each')")
        req.check_position(n_ctx)
    device = None
    if req.backend == "torch":
        from .backends import torch_device

        device = torch_device(req.device)
    fn = {"inner": guided.inner, "similarity": guided.similarity,
          "diff_sq": guided.diff_sq}[kind]
    return fn(na, nb, U, keep, req.n_samples, req.seed, n_ctx, req.position, device)


def _mode_checked(est, degree: int, make_ref):
    """A plain (radial) scalar Monte Carlo estimate with its verdict cross-checked against the
    guided estimate of the same quantity, ``make_ref()`` (`montecarlo.cross_checked`; the
    mode search finds where rare directions carry the integrand, which plain directions can miss
    while their own diagnostics pass) when the models' largest degree is at least
    ``MC_CROSS_DEGREE``; arrays and lower degrees unchanged. Every cross-check of the engine
    goes through here."""
    if not isinstance(est, MonteCarloEstimate) or est.diagnostics is None or \
            degree < montecarlo.MC_CROSS_DEGREE:
        return est
    try:
        ref = make_ref()
    except CostTooHigh as exc:   # no cross-check, so no promise
        return montecarlo.unchecked(est, f"its guided cross-check could not run ({exc})")
    return montecarlo.cross_checked(est, ref)


def inner(req: Request, a: Any, b: Any):
    na, nb, seq = _checked_pair("inner", req, a, b)
    if seq is not _POSITION_FREE:
        return seq
    if req.method == "montecarlo" and req.proposal == "modes":
        return _guided("inner", req, na, nb)
    U, keep = req.output_matrix(na.out_features)
    if req.method == "montecarlo":
        mean, se, p = montecarlo.moments([na], [nb], U, keep, req.n_samples, req.seed,
                                         req.backend, req.device, req.dtype, samples=True)
        name = "<a,a>" if b is a else None
        if keep:   # one verdict per output slice
            return MonteCarloArray(mean[0, 0], se[0, 0], req.n_samples,
                                   [montecarlo.inner_diagnostics(p[:, 0, 0, k], name)
                                    for k in range(p.shape[-1])])
        diag = montecarlo.inner_diagnostics(p[:, 0, 0], name)
        return _mode_checked(MonteCarloEstimate(float(mean[0, 0]), float(se[0, 0]),
                                                req.n_samples, diag),
                             max(na.degree, nb.degree), lambda: _guided("inner", req, na, nb))
    same = b is a
    if req.exact and req.method == "exact":  # refuse before any rational work
        refuse_if_needed(refuse_exact_early([na], None if same else [nb], U, keep, req.metric,
                                            req.strategy, *req.budget, same=same))
    ca, ka = stack_for([na], req.backend, "a")
    cb, kb = (ca, ka) if same else stack_for([nb], req.backend, "b")
    X = scaled(_engine(req, ca, cb, U, keep, same=same), ka, kb, req.backend)[0, 0]
    check_overflow(X, "inner")   # (no errstate here: it costs 2 us a warm call)
    if req.exact:
        return np.vectorize(Fraction, otypes=[object])(X) if keep else Fraction(X)
    return X if keep else float(X)


def norm(req: Request, a: Any):
    """``||f_a|| = sqrt(<f_a, f_a>)``: an `ExactNorm` (a list of them
    per output) with the exact backend, a delta-method standard error with Monte Carlo."""
    val = inner(req, a, a)
    if req.exact:
        if isinstance(val, np.ndarray):
            return [ExactNorm.from_square(v) for v in val]
        return ExactNorm.from_square(val)
    if isinstance(val, MonteCarloEstimate):
        r = math.sqrt(max(float(val), 0.0))
        return MonteCarloEstimate(r, val.stderr / (2 * r) if r > 0 else float("inf"),
                                  val.n_samples, val.diagnostics)
    return np.sqrt(np.maximum(val, 0.0)) if isinstance(val, np.ndarray) else math.sqrt(max(val, 0.0))


def similarity(req: Request, a: Any, b: Any):
    na, nb, seq = _checked_pair("similarity", req, a, b)
    if seq is not _POSITION_FREE:
        return seq
    if req.method == "montecarlo" and req.proposal == "modes":
        return _guided("similarity", req, na, nb)
    U, keep = req.output_matrix(na.out_features)
    backend = req.backend
    if req.method == "montecarlo":
        return _mode_checked(montecarlo.similarity(na, nb, U, keep, req.n_samples, req.seed,
                                                   backend, req.device, req.dtype),
                             max(na.degree, nb.degree),
                             lambda: _guided("similarity", req, na, nb))
    if req.exact and req.method == "exact":  # refuse before any rational work
        # the pair's plan is the first one the rational path makes (and refuses on)
        refuse_if_needed(refuse_exact_early([na], None if b is a else [nb], U, keep,
                                            req.metric, req.strategy, *req.budget,
                                            same=b is a))
    ca, _ = stack_for([na], backend, "a")
    cb = ca if b is a else stack_for([nb], backend, "b")[0]
    names = ("a", "b")
    if b is not a and swap_order(na, nb):
        ca, cb = cb, ca   # one canonical order: sim(a, b) and sim(b, a) are the same floats
        names = ("b", "a")
    if req.method == "closure":  # one propagation gives all three
        taa, tab, tbb = closure.triple(ca, cb, U, keep, backend)
        Xaa, Xab, Xbb = taa[0], tab[0, 0], tbb[0]
    elif b is a:
        Xaa = _engine(req, ca, ca, U, keep, same=True)[0, 0]
        Xab = Xbb = Xaa
    else:
        p = _plan(req, ca, cb, U, keep)
        refuse_if_needed(p)
        if p.strategy == "chaos":
            conv = converter(backend, req.device, req.dtype) if backend == "torch" else None
            Xaa, Xab, Xbb = (x[0, 0] for x in chaos.triple(ca, cb, U, keep, conv=conv))
        else:
            Xaa = _engine(req, ca, ca, U, keep, same=True)[0, 0]
            Xab = wick.compute(p._joined, backend, req.device, req.dtype,
                               shared=p.wick_shared)[0, 0]
            Xbb = _engine(req, cb, cb, U, keep, same=True)[0, 0]
    return similarity_from(Xab, Xaa, Xbb, req.exact, names=names)


def _gram_plans(req: Request, ca, cb, U, keep, same):
    """The exact cross Gram's plans in the order `_gram_blocks` makes and checks them:
    ``(plan, ia, sa, sb)``: ``ia`` the rows of a Wick block and ``sa``, ``sb`` its stacks, or
    ``(plan, None, ca, cb)`` when the plan computes the whole matrix at once. A refused plan
    is the last one (the computation raises on it). Shared with the exact backend's early
    refusal (`tensoralg.planner.refuse_exact_early`, on float copies of the stacks), so
    both decide alike."""
    Na, Nb = ca.arrays()[0].shape[0], cb.arrays()[0].shape[0]
    strategy = req.strategy
    p = _plan(req, ca, cb, U, keep, same=same)
    if Na * Nb == 1 or p.strategy == "chaos" or strategy == "chaos":
        yield p, None, ca, cb  # (a forced chaos over budget is refused as chaos, never Wick)
        return
    # Wick: keep the largest intermediate of one block under _MAX_INTERMEDIATE
    one = _plan(req, ca.sub([0]), cb.sub([0]), U, keep, strategy="wick")
    if one.refused:
        if strategy == "auto":  # name every strategy's estimate, as inner() does
            both = _plan(req, ca.sub([0]), cb.sub([0]), U, keep, strategy="auto")
            one = both if both.refused else one
        yield one, [0], None, None
        return
    per_pair = max(1, one.largest_intermediate)
    block = max(1, int(math.isqrt(max(1, _MAX_INTERMEDIATE // per_pair))))
    if block >= max(Na, Nb):
        yield p, None, ca, cb
        return
    for i0 in range(0, Na, block):
        for j0 in range(0, Nb, block):
            ia, jb = list(range(i0, min(Na, i0 + block))), list(range(j0, min(Nb, j0 + block)))
            sa, sb = ca.sub(ia), cb.sub(jb)
            pb = _plan(req, sa, sb, U, keep, strategy="wick")
            yield pb, ia, sa, sb
            if pb.refused:
                return


def _gram_blocks(req: Request, ca, cb, U, keep, same):
    """Cross Gram (Na, Nb[, K]) in normalized gauge; the Wick strategy runs in blocks when its
    intermediates are large (the chaos strategy expands each model once)."""
    if req.method != "exact":
        return _engine(req, ca, cb, U, keep, same=same)
    rows: dict[int, list] = {}
    for p, ia, sa, sb in _gram_plans(req, ca, cb, U, keep, same):
        refuse_if_needed(p)
        if ia is None:
            return _run(req, p, sa, sb, U, keep, same)
        rows.setdefault(ia[0], []).append(_run(req, p, sa, sb, U, keep, False))
    return np.concatenate([np.concatenate(rows[i], axis=1) for i in sorted(rows)], axis=0)


def _architecture(net: Layer) -> tuple:
    """Layer types and weight shapes, no values: models with equal keys stack into one batch
    (`tensoralg.canonical.stack`)."""
    from .layers import Residual, Sequential

    if isinstance(net, Sequential):
        return ("Sequential",) + tuple(_architecture(x) for x in net.layers)
    if isinstance(net, Residual):
        return ("Residual", _architecture(net.inner))
    return (type(net).__name__,) + tuple(np.shape(x) for x in net.arrays())


def _architecture_groups(nets: list) -> list[list[int]]:
    """The indices of ``nets`` grouped by `_architecture`, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(nets):
        groups.setdefault(_architecture(n), []).append(i)
    return list(groups.values())


def _grouped_gram(req: Request, nets_a, nets_b, U, keep, same, name_a, name_b, scale=True):
    """Cross Gram ``(Na, Nb[, K])`` of models of several architectures: the models grouped by
    architecture, one batched contraction per pair of groups (rows of one group against
    columns of another are a cross Gram of two same-architecture stacks); the symmetric
    ``same`` case computes each pair of groups once and fills the transposed block. ``scale``:
    undo the normalizing gauge (False leaves each model in its own gauge: fine for
    similarities, which do not see a model's scale). Each entry is the pair's ``inner``, the
    same contraction batched (equal to rounding)."""
    for name, nets in ((name_a, nets_a), (name_b, nets_b)):   # named by their own index
        for i, n in enumerate(nets):
            check_finite_weights(n, f"{name}[{i}]")
    ga = _architecture_groups(nets_a)
    gb = ga if same else _architecture_groups(nets_b)
    if req.exact and req.method == "exact":  # refuse before any rational work, every block
        for x, ia in enumerate(ga):
            for y, jb in enumerate(gb):
                if not (same and y < x):
                    _refuse_gram_early(req, [nets_a[i] for i in ia], [nets_b[j] for j in jb],
                                       U, keep, same and x == y, name_a, name_b)
    sa = [stack_for([nets_a[i] for i in g], req.backend, name_a) for g in ga]
    sb = sa if same else [stack_for([nets_b[j] for j in g], req.backend, name_b) for g in gb]
    G = None
    for x, (ia, (ca, ka)) in enumerate(zip(ga, sa)):
        for y, (jb, (cb, kb)) in enumerate(zip(gb, sb)):
            if same and y < x:
                continue
            with np.errstate(over="ignore", invalid="ignore"):
                X = _gram_blocks(req, ca, cb, U, keep, same and x == y)
                X = scaled(X, ka, kb, req.backend) if scale else X
            X = np.asarray(X)
            if G is None:
                G = np.empty((len(nets_a), len(nets_b)) + X.shape[2:], dtype=X.dtype)
            G[np.ix_(ia, jb)] = X
            if same and x != y:
                G[np.ix_(jb, ia)] = np.swapaxes(X, 0, 1)
    return G


def _refuse_gram_early(req: Request, nets_a, nets_b, U, keep, same, name_a, name_b):
    """The exact backend's Gram refusal before any rational conversion: the plans of
    `_gram_plans` made on certified float copies of the stacks
    (`tensoralg.planner.refuse_exact_early`); raises CostTooHigh with the message the
    rational path would give, else returns (and the rational path decides)."""
    def plans(ca, cb, Uf, same_):
        return _gram_plans(req.replace(device=None, dtype=None), ca, cb, Uf, keep, same_)

    refuse_if_needed(refuse_exact_early(nets_a, None if same else nets_b, U, keep, req.metric,
                                        req.strategy, *req.budget, same=same, name_a=name_a,
                                        name_b=name_b, plans=plans))


def _check_sequence_free(name: str, nets: list) -> None:
    seq = [i for i, n in enumerate(nets) if getattr(n, "is_sequence_model", False)]
    if seq:
        raise ValueError(f"{name}[{seq[0]}]: a sequence model (with attention); cross_gram "
                         f"takes position-free networks. For sequence models use "
                         f"ta.gram(models_a + models_b, n_ctx=...) (exact: one attention "
                         f"layer) and read its off-diagonal block, or "
                         f"tensoralg.strategies.closure.closure_cross_gram (APPROXIMATE beyond "
                         f"one attention layer)")


def radial_only(req: Request, what: str) -> None:
    """Raises ValueError when ``proposal="modes"`` reaches an entry point without guided
    sampling (it searches the modes of one integrand: `inner`, `similarity`,
    `diff_norm`)."""
    if req.proposal != "radial":
        raise ValueError(f"proposal={req.proposal!r}: guided sampling (the modes of one "
                         f"integrand, one number per call) is implemented for inner, similarity "
                         f"and diff_norm; {what} samples with proposal='radial'")


def cross_gram(req: Request, models_a, models_b):
    radial_only(req, "cross_gram")
    same = models_a is models_b
    name_a, name_b = ("models", "models") if same else ("models_a", "models_b")
    nets_a = networks(models_a, name_a)
    nets_b = nets_a if same else networks(models_b, name_b)
    for name, nets in ((name_a, nets_a), (name_b, nets_b)):
        _check_sequence_free(name, nets)
    check_pair(nets_a[0], nets_b[0])
    U, keep = req.output_matrix(nets_a[0].out_features)
    for n in nets_a[1:] + nets_b:
        check_pair(nets_a[0], n)
    nets_a = [_fold(req, n, f"{name_a}[{i}]") for i, n in enumerate(nets_a)]
    nets_b = nets_a if same else [_fold(req, n, f"{name_b}[{i}]") for i, n in enumerate(nets_b)]
    if req.method == "montecarlo":
        mean, se = montecarlo.moments(nets_a, nets_b, U, keep, req.n_samples, req.seed,
                                      req.backend, req.device, req.dtype)
        return MonteCarloArray(mean, se, req.n_samples)
    if len(_architecture_groups(nets_a)) > 1 or len(_architecture_groups(nets_b)) > 1:
        G = _grouped_gram(req, nets_a, nets_b, U, keep, same, name_a, name_b)
        check_overflow(G, "gram" if same else "cross_gram")
        return G
    if req.exact and req.method == "exact":  # refuse before any rational work
        _refuse_gram_early(req, nets_a, nets_b, U, keep, same, name_a, name_b)
    ca, ka = stack_for(nets_a, req.backend, name_a)
    cb, kb = (ca, ka) if same else stack_for(nets_b, req.backend, name_b)
    with np.errstate(over="ignore", invalid="ignore"):   # an overflow is raised just below
        G = scaled(_gram_blocks(req, ca, cb, U, keep, same), ka, kb, req.backend)
    check_overflow(G, "gram" if same else "cross_gram")
    return G


def _exported(models: list) -> list:
    """The models with every module that exports itself (``to_network()``: a
    ``BilinearTransformer``, a ``BilinearNet``, a compiled module) replaced by its network, so
    that a transformer module is recognised as a sequence model (``gram([module, module])``
    went the position-free way and failed); specs and checkpoint folders stay as they are (a
    folder is loaded when its turn comes)."""
    return [as_network(m, f"models[{i}]") if not isinstance(m, Layer) and
            callable(getattr(m, "to_network", None)) else m for i, m in enumerate(models)]


def _sequence_matrix(kind: str, req: Request, models: list):
    """Gram / similarity matrices of sequence models (with attention) through
    `tensoralg.strategies.sequence_exact` / `closure` (per-model
    work once); None for position-free models."""
    if not any(getattr(m, "is_sequence_model", False) for m in models):
        return None  # (specs and folders go the position-free way, unchanged)
    for i, m in enumerate(models):  # as inner: a sequence model is not compared with an MLP
        if isinstance(m, Layer) and not m.is_sequence_model and m.degree > 1:
            raise ValueError(f"models[{i}]: a position-free network of degree {m.degree} among "
                             f"sequence models (with attention); compare sequence models (a "
                             f"per-position affine map is accepted)")
    if req.metric != "gaussian":
        raise ValueError("sequence models: only metric='gaussian' is implemented")
    if req.backend not in ("numpy", "torch"):
        raise ValueError(f"gram / similarity_matrix of sequence models: backend='numpy' or "
                         f"'torch' (float64), got {req.backend!r}")
    # (a checkpoint folder is loaded, and checked, when its turn comes)
    models = [_fold(req, as_network(m, f"models[{i}]"), f"models[{i}]")
              if isinstance(m, Layer) or req.distribution is not STANDARD else m
              for i, m in enumerate(models)]
    if req.method == "montecarlo":
        nets, n_ctx = check_sequence_models(models, req.n_ctx)
        return _sequence_mc_matrix(kind, req, nets, n_ctx)
    fn = closure.closure_gram_req if req.method == "closure" else sequence_exact.exact_gram_req
    if kind == "similarity_matrix":   # (gram_to_similarity checks for an overflow)
        return fn(req, models, similarity=True)
    with np.errstate(over="ignore", invalid="ignore"):
        G = fn(req, models, similarity=False)
    check_overflow(G, "gram")
    return G


def _sequence_mc_args(req: Request, what: str, d_out: int, n_ctx: int) -> dict:
    """The sampler's arguments for sequence models (`montecarlo.moments` and
    relatives): the slices checked, ``"each"`` refused (the products are summed over
    positions and outputs per direction)."""
    if isinstance(req.output, str) or isinstance(req.position, str):
        raise ValueError(f"{what} of sequence models by Monte Carlo: output='each' / "
                         f"position='each' are not supported; loop over the slices")
    check_slices(req, d_out, n_ctx)
    return dict(n_ctx=n_ctx, position=req.position)


def _sequence_mc_matrix(kind: str, req: Request, nets: list, n_ctx: int):
    """Monte Carlo Gram or similarity matrix of sequence models: the position-free estimator
    with directions on the sphere of ``R^(n_ctx d)`` (``montecarlo.similarity_matrix``: an
    error and a verdict per entry, each equal to ``similarity`` of its pair with the same
    ``n_samples`` and ``seed``)."""
    kw = _sequence_mc_args(req, kind, nets[0].out_features, n_ctx)
    nets = [n.astype_float() for n in nets]
    U, _ = req.output_matrix(nets[0].out_features)
    args = (U, False, req.n_samples, req.seed, "numpy", None, None)
    if kind == "similarity_matrix":
        return montecarlo.similarity_matrix(nets, *args, **kw)
    mean, se = montecarlo.moments(nets, nets, *args, **kw)
    return MonteCarloArray(mean, se, req.n_samples)


def models_list(models: Any) -> list:
    models = model_list(models, "models")
    if not models:
        raise ValueError("models: empty sequence of models")
    return models


def gram(req: Request, models):
    """``G[i, j] = <m_i, m_j>`` of a list of models (not blocked)."""
    radial_only(req, "gram")
    models = _exported(models_list(models))
    seq = _sequence_matrix("gram", req, models)
    if seq is not None:
        return seq
    return cross_gram(req, models, models)


def similarity_matrix(req: Request, models):
    """``S[i, j] = G_ij / sqrt(G_ii G_jj)`` of a list of models (not blocked)."""
    radial_only(req, "similarity_matrix")
    models = _exported(models_list(models))
    seq = _sequence_matrix("similarity_matrix", req, models)
    if seq is not None:
        return seq
    nets = networks(models, "models")
    for n in nets[1:]:
        check_pair(nets[0], n)
    nets = [_fold(req, n, f"models[{i}]") for i, n in enumerate(nets)]
    U, keep = req.output_matrix(nets[0].out_features)
    if req.method == "montecarlo":   # per entry: a standard error and a verdict
        return montecarlo.similarity_matrix(nets, U, keep, req.n_samples, req.seed,
                                            req.backend, req.device, req.dtype)
    if len(_architecture_groups(nets)) > 1:   # per model gauge: the similarity ignores it
        X = _grouped_gram(req, nets, nets, U, keep, True, "models", "models", scale=False)
    else:
        if req.exact and req.method == "exact":  # refuse before any rational work
            _refuse_gram_early(req, nets, nets, U, keep, True, "models", "models")
        c, _ = stack_for(nets, req.backend, "models")
        X = _gram_blocks(req, c, c, U, keep, True)
    Xf = np.vectorize(float, otypes=[float])(X) if req.exact else X
    return gram_to_similarity(Xf)


def _mc_combination(req: Request, left, right):
    """Monte Carlo ``<sum_i alpha_i f_i, sum_j beta_j g_j>`` from one set of samples, as one
    per-direction integrand, so the standard error includes the covariance of the terms.
    ``left``/``right``: lists of ``(model, coefficient, argument name)``; sequence models
    sample directions of ``R^(n_ctx d)`` (`montecarlo.moments`)."""
    if req.metric != "gaussian":
        raise ValueError("metric='frobenius' has no Monte Carlo estimate; use method='exact'")
    named = {}   # each argument once, under its name (diff_norm's b and c sit on both sides)
    for m, _, name in left + right:
        named.setdefault(name, as_network(m, name))
    nets = list(named.values())
    for n in nets[1:]:
        check_pair(nets[0], n)
    kw = {}
    if _is_sequence(*nets):
        for name, n in named.items():   # as inner: a sequence model is not compared with an MLP
            if not n.is_sequence_model and n.degree > 1:
                raise ValueError(f"{name}: a position-free network of degree {n.degree} among "
                                 f"sequence models (with attention); compare sequence models (a "
                                 f"per-position affine map is accepted)")
        n_ctx = resolve_n_ctx(list(named.items()), req.n_ctx)
        kw = _sequence_mc_args(req, "a difference", nets[0].out_features, n_ctx)
    elif req.n_ctx is not None or req.position is not None:
        raise ValueError("n_ctx / position: only for sequence models (with attention)")
    folded = {name: _fold(req, n, name) for name, n in named.items()}
    if kw:   # as the sequence pair estimators: float weights
        folded = {name: n.astype_float() for name, n in folded.items()}
    nets = [folded[name] for _, _, name in left + right]
    U, keep = req.output_matrix(nets[0].out_features)
    n_samples = req.n_samples
    montecarlo.warn_few(n_samples)
    alpha = np.array([c for _, c, _ in left], dtype=np.float64)
    beta = np.array([c for _, c, _ in right], dtype=np.float64)
    nl = len(left)
    s1 = s2 = 0.0
    kept = []
    for F, w in montecarlo.features(nets, np.asarray(U, dtype=np.float64), n_samples, req.seed,
                                    req.backend, req.device, req.dtype, **kw):
        fl = np.einsum("i,isqK->sqK", alpha, F[:nl])
        fr = np.einsum("j,jsqK->sqK", beta, F[nl:])
        P = np.einsum(f"sqK,sqK,q->{'sK' if keep else 's'}", fl, fr, w)
        s1 = s1 + P.sum(axis=0)
        s2 = s2 + (P * P).sum(axis=0)
        kept.append(P)
    mean = s1 / n_samples
    var = np.maximum(s2 / n_samples - mean * mean, 0.0) * n_samples / (n_samples - 1)
    se = np.sqrt(var / n_samples)
    name = "||b - c||^2" if left == right else None
    P = np.concatenate(kept)
    if keep:   # one verdict per output slice
        return MonteCarloArray(mean, se, n_samples,
                               [montecarlo.inner_diagnostics(P[:, k], name)
                                for k in range(P.shape[-1])])
    diag = montecarlo.inner_diagnostics(P, name)
    return MonteCarloEstimate(float(mean), float(se), n_samples, diag)


def inner_diff(req: Request, a: Any, b: Any, c: Any):
    """``<a, b - c> = <a, b> - <a, c>``; Monte Carlo: one integrand ``f_a . (f_b - f_c)``."""
    radial_only(req, "inner_diff")
    if req.method == "montecarlo":
        est = _mc_combination(req, [(a, 1.0, "a")], [(b, 1.0, "b"), (c, -1.0, "c")])
        return _inner_diff_checked(req, a, b, c, est)
    try:
        row = cross_gram(req, [a], [b, c])
        return row[0, 0] - row[0, 1]
    except ValueError as exc:
        if "architecture differs" not in str(exc) or isinstance(exc, CostTooHigh):
            raise
    return inner(req, a, b) - inner(req, a, c)


def _inner_diff_checked(req: Request, a: Any, b: Any, c: Any, est):
    """The plain estimate of ``<a, b - c>`` cross-checked (`_mode_checked`) against the
    guided estimate of ``<f_a, f_b - f_c>`` (modes of ``f_a`` and ``f_b - f_c``)."""
    nets = {k: as_network(m, k) for k, m in (("a", a), ("b", b), ("c", c))}

    def ref():
        from .canonical import resolve_n_ctx

        na, nb, nc = (_fold(req, n, k) for k, n in nets.items())
        n_ctx = resolve_n_ctx([("a", na), ("b", nb), ("c", nc)], req.n_ctx) \
            if _is_sequence(na, nb, nc) else None
        U, _ = req.output_matrix(na.out_features)
        device = None
        if req.backend == "torch":
            from .backends import torch_device

            device = torch_device(req.device)
        return guided.inner(na, guided.Difference(nb, nc), U, False, req.n_samples, req.seed,
                            n_ctx, req.position, device)

    return _mode_checked(est, max(n.degree for n in nets.values()), ref)


def _guided_diff_sq(req: Request, b: Any, c: Any):
    """``||b - c||^2`` by guided importance sampling (`guided.diff_sq`), for vectors and
    sequences alike (as `_guided`)."""
    if req.metric != "gaussian":
        raise ValueError("metric='frobenius' has no Monte Carlo estimate; use method='exact'")
    nb, nc = as_network(b, "b"), as_network(c, "c")
    check_pair(nb, nc)
    nb, nc = _fold(req, nb, "b"), (None if c is b else _fold(req, nc, "c"))
    nc = nb if nc is None else nc
    if not _is_sequence(nb, nc) and (req.n_ctx is not None or req.position is not None):
        raise ValueError("n_ctx / position: only for sequence models (with attention)")
    return _guided("diff_sq", req, nb, nc)


def diff_norm(req: Request, b: Any, c: Any):
    """``||b - c||`` from the Gram matrix of ``[b, c]``; Monte Carlo: the integrand
    ``|f_b - f_c|^2`` per sample, the delta-method standard error of its root."""
    if req.method == "montecarlo":
        terms = [(b, 1.0, "b"), (c, -1.0, "c")]
        if req.proposal == "modes":
            d2 = _guided_diff_sq(req, b, c)
        else:
            d2 = _mode_checked(_mc_combination(req, terms, terms),
                               max(as_network(b, "b").degree, as_network(c, "c").degree),
                               lambda: _guided_diff_sq(req.replace(proposal="modes"), b, c))
        d = np.sqrt(np.maximum(np.asarray(d2, dtype=np.float64), 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            # d = 0 with se(d^2) = 0: the integrand vanished on every sample (so, with
            # probability 1, identically: a polynomial); otherwise the delta method
            se2 = np.asarray(d2.stderr)
            se = np.where(d > 0, se2 / (2 * d), np.where(se2 == 0, 0.0, np.inf))
        if isinstance(d2, MonteCarloArray):
            return MonteCarloArray(d, se, d2.n_samples, d2.diagnostics)
        return MonteCarloEstimate(float(d), float(se), d2.n_samples, d2.diagnostics)
    try:
        G = gram(req, [b, c])
        bb, bc, cc = G[0, 0], G[0, 1], G[1, 1]
    except ValueError as exc:
        if "architecture differs" not in str(exc) or isinstance(exc, CostTooHigh):
            raise
        bb, bc, cc = inner(req, b, b), inner(req, b, c), inner(req, c, c)
    d2 = bb - 2 * bc + cc
    if req.exact:   # as the exact similarity: a float with the exact number beside it
        return [ExactNorm.from_square(v) for v in d2] if np.ndim(d2) else ExactNorm.from_square(d2)
    if np.ndim(d2):
        return np.sqrt(np.maximum(np.asarray(d2, dtype=np.float64), 0.0))
    return math.sqrt(max(float(d2), 0.0))


def plan(req: Request, a: Any, b: Any = None) -> Plan | SequencePlan:
    """The planner's decision for ``<a, b>`` (``<a, a>`` when ``b`` is None)."""
    radial_only(req, "plan")
    na = as_network(a, "a")
    nb = na if b is None else as_network(b, "b")
    check_pair(na, nb)
    check_finite_weights(na, "a")
    check_finite_weights(nb, "b")
    na = _fold(req, na, "a")
    nb = na if b is None or b is a else _fold(req, nb, "b")
    if _is_sequence(na, nb):
        p = plan_sequence(req, na, nb)
        p.input_distribution = req.distribution.describe()
        return p
    if req.n_ctx is not None or req.position is not None:
        raise ValueError("n_ctx / position: only for sequence models (with attention)")
    U, keep = req.output_matrix(na.out_features)
    same = b is None or b is a
    if req.exact:  # decided before any rational work when it is a refusal
        early = refuse_exact_early([na], None if same else [nb], U, keep, req.metric,
                                   req.strategy, *req.budget, same=same, full=True)
        if early is not None:
            early.input_distribution = req.distribution.describe()
            return early
    ca, _ = stack_for([na], req.backend, "a")
    cb = ca if same else stack_for([nb], req.backend, "b")[0]
    p = _plan(req, ca, cb, U, keep, same=same, full=True)
    p.input_distribution = req.distribution.describe()
    return p
