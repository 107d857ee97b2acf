"""The planner: estimate the cost of every applicable exact strategy before any work, choose the
cheapest within the budgets, or refuse with every estimate and the alternatives.

Strategies (see `tensoralg.strategies`): ``"wick"`` (tensor-network Wick sum; cost
polynomial in the hidden widths, exponential in the number of legs) and ``"chaos"`` (Gaussian
chaos coefficients; polynomial in the input width, exponential in the degree; Gaussian metric
only). Budgets: ``max_flops`` (default 2e11, 2e7 on the exact backend, 5e6 there for sequence
models), ``max_memory`` in bytes (default: half of the available RAM, or of the free memory of
the CUDA device for torch) and ``max_configurations`` (Wick configurations before reduction;
default 200 000). Estimates come from shapes alone: Wick counts configurations from the depths
(T(n)) before building anything, then finds opt_einsum paths (cached per topology); chaos
counts coefficients and products. Wick is not planned in full when a lower bound on its FLOPs
(`tensoralg.strategies.wick.lower_bound`: a closed form, then the paths of a few
configuration orbits) already exceeds ``max_flops`` or, with ``"auto"``, an affordable chaos
expansion; the plan then shows that bound, marked as one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends import available_memory, itemsize
from .canonical import Canonical
from .errors import CostTooHigh
from .prepare import check_slices, float_stacks_for_exact
from .request import DEFAULT_MAX_CONFIGURATIONS, DEFAULT_MAX_FLOPS, DEFAULT_MAX_FLOPS_EXACT
from .strategies import chaos, sequence_exact, wick
from .strategies.sequence_exact import ALTERNATIVES as SEQUENCE_ALTERNATIVES
from .strategies.wick import WickPlan, n_wick_configurations

__all__ = ["Plan", "SequencePlan", "make_plan", "plan_sequence", "refuse_exact_early",
           "CHAOS_SHORTCUT_FLOPS", "BOUND_MIN_FLOPS"]

#: Below this many FLOPs an affordable chaos expansion is taken without searching Wick paths
#: (the path search alone would cost more than the whole computation).
CHAOS_SHORTCUT_FLOPS = 1e9

#: Wick is compared with chaos through a lower bound (and then not planned in full) only when
#: chaos costs at least this much; for smaller problems the plan shows Wick in full (its
#: configurations, symmetries and paths).
BOUND_MIN_FLOPS = 1e8

ALTERNATIVES = ("Alternatives: method='montecarlo' (an estimate with a standard error and a "
                "reliability verdict), method='closure' (the moment-closure similarity: fast, "
                "APPROXIMATE beyond depth 1, not the tensor similarity there), or raise "
                "max_flops / max_memory")


@dataclass
class Plan:
    """The planner's decision for one exact inner product, made before any work.

    Attributes:
        strategy: ``"wick"`` or ``"chaos"`` (the choice), or None when refused.
        reason: why that strategy (or why none).
        refused: the refusal message (every estimate and the alternatives) exactly when the
            computation would raise [`CostTooHigh`][tensoralg.CostTooHigh]; None otherwise.
        flops, memory_bytes: the chosen strategy's estimates (``inf`` / 0 when refused).
        wick: the Wick strategy's `WickPlan` (None when it was not
            planned: not applicable, or skipped because chaos was cheap).
        wick_lower_bound, wick_bound: when Wick was not planned in full because a lower bound
            on its FLOPs already exceeded ``max_flops`` or an affordable chaos expansion: that
            bound and how it was obtained (`tensoralg.strategies.wick.lower_bound`).
        chaos: the chaos strategy's `ChaosEstimate` (None for
            the Frobenius metric).
        max_flops, max_memory, max_configurations: the budgets applied.

    The Wick fields of earlier versions (``n_legs``, ``n_configurations``, ``n_nonzero``,
    ``n_orbits``, ``group_order``, ``largest_intermediate``, ``symmetries``, ``expressions``)
    read through to `wick`.
    """

    metric: str
    strategy: str | None
    reason: str
    flops: float
    memory_bytes: int
    max_flops: float
    max_memory: float
    max_configurations: int
    n_legs: int
    n_configurations: int
    wick: WickPlan | None = None
    chaos: chaos.ChaosEstimate | None = None
    refused: str | None = None
    wick_shared: bool = True
    wick_lower_bound: float | None = None
    wick_bound: str = ""
    input_distribution: str = "N(0, I)"
    _joined: Any = field(default=None, repr=False)

    # read-through Wick fields
    @property
    def n_nonzero(self) -> int:
        return self.wick.n_nonzero if self.wick is not None else -1

    @property
    def n_orbits(self) -> int:
        return self.wick.n_orbits if self.wick is not None else -1

    @property
    def group_order(self) -> int:
        return self.wick.group_order if self.wick is not None else 0

    @property
    def largest_intermediate(self) -> int:
        return self.wick.largest_intermediate if self.wick is not None else -1

    @property
    def symmetries(self) -> list[str]:
        return self.wick.symmetries if self.wick is not None else []

    @property
    def expressions(self) -> list[str]:
        return self.wick.expressions if self.wick is not None else []

    def summary(self) -> str:
        lines = [f"input: {self.input_distribution}"]
        if self.wick is not None:
            lines.append("wick: " + self.wick.summary())
        elif self.wick_lower_bound is not None:
            lines.append(f"wick: {self.metric} metric: {self.n_legs} legs, "
                         f"{self.n_configurations:,} Wick configurations; at least "
                         f"{self.wick_lower_bound:.3g} FLOPs (a lower bound: {self.wick_bound}; "
                         f"not planned in full)")
        elif self.n_configurations:
            lines.append(f"wick: {self.metric} metric: {self.n_legs} legs, "
                         f"{self.n_configurations:,} Wick configurations (not planned)")
        if self.chaos is not None:
            lines.append(self.chaos.summary())
        if self.refused:
            lines.append(f"REFUSED: {self.refused}")
        else:
            lines.append(f"choice: {self.strategy} ({self.reason}); {self.flops:.3g} FLOPs, "
                         f"about {self.memory_bytes / 2**20:.3g} MiB")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _fits(flops: float, mem: float, max_flops: float, max_memory: float) -> str | None:
    if not flops <= max_flops:
        return f"estimated {flops:.3g} FLOPs over max_flops={max_flops:.3g}"
    if not mem <= max_memory:
        return (f"estimated {mem / 2**20:.4g} MiB over max_memory={max_memory / 2**20:.4g} "
                f"MiB")
    return None


def make_plan(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, metric: str,
              backend: str, device: Any = None, dtype: Any = None, strategy: str = "auto",
              max_flops: float | None = None, max_memory: float | None = None,
              max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, same: bool = False,
              full: bool = False) -> Plan:
    """Plan the exact inner products of two stacks (nothing contracted, nothing large
    allocated). ``full``: plan Wick even when chaos is cheap (for
    [`tensoralg.plan`][tensoralg.plan]).

    Raises:
        ValueError: ``strategy="chaos"`` with the Frobenius metric.
    """
    # (the budgets were validated with the request: tensoralg.request.make_request)
    if strategy == "chaos" and metric != "gaussian":
        raise ValueError("strategy='chaos' computes the Gaussian metric; metric='frobenius' "
                         "needs strategy='wick' (or 'auto')")
    if max_flops is None:
        max_flops = DEFAULT_MAX_FLOPS_EXACT if backend == "exact" else DEFAULT_MAX_FLOPS
    if max_memory is None:
        max_memory = available_memory(backend, device)
    size = itemsize(backend, dtype)
    n_legs, n_conf = n_wick_configurations(ca, cb, metric)
    plan = Plan(metric=metric, strategy=None, reason="", flops=float("inf"), memory_bytes=0,
                max_flops=float(max_flops), max_memory=float(max_memory),
                max_configurations=int(max_configurations), n_legs=n_legs,
                n_configurations=n_conf)
    why: dict[str, str] = {}
    ok: dict[str, tuple[float, int]] = {}
    # chaos: from shapes alone
    if metric == "gaussian":
        est = chaos.estimate(ca, cb, U.shape[0], keep, same, backend == "exact")
        plan.chaos = est
        mem = est.memory_elements * size
        bad = _fits(est.flops, mem, max_flops, max_memory)
        if bad:
            est.refused = bad
            why["chaos"] = bad
        else:
            ok["chaos"] = (est.flops, mem)
    else:
        why["chaos"] = "computes the Gaussian metric only"
    if strategy == "auto" and "chaos" in ok and ok["chaos"][0] <= CHAOS_SHORTCUT_FLOPS \
            and not full:
        plan.strategy, (plan.flops, plan.memory_bytes) = "chaos", ok["chaos"]
        plan.reason = (f"chaos fits the budgets at {ok['chaos'][0]:.3g} FLOPs (under "
                       f"{CHAOS_SHORTCUT_FLOPS:.0g}); Wick paths not searched")
        return plan
    # wick: count first, build and search paths only within the configuration budget
    if strategy != "chaos" or full:
        # a lower bound first: Wick is not planned in full when it is surely over max_flops or
        # (auto) surely dearer than an affordable chaos expansion
        cap = float(max_flops)
        if strategy == "auto" and "chaos" in ok and ok["chaos"][0] >= BOUND_MIN_FLOPS:
            cap = min(cap, ok["chaos"][0])
        bound = None
        if n_conf <= max_configurations:
            bound = wick.lower_bound(ca, cb, U, keep, metric, cap)
        if n_conf > max_configurations:
            why["wick"] = (f"the joined network has {n_legs} input legs, i.e. {n_conf:,} Wick "
                           f"configurations, over max_configurations={max_configurations:,}")
        elif bound is not None:
            plan.wick_lower_bound, plan.wick_bound = bound
            if bound[0] > max_flops:
                why["wick"] = (f"at least {bound[0]:.3g} FLOPs ({bound[1]}), over "
                               f"max_flops={max_flops:.3g}")
        else:
            joined, wp = wick.build(ca, cb, U, keep, metric, max_configurations)
            plan.wick, plan._joined = wp, joined
            mem_shared = wp.memory_bytes(size, shared=True)
            mem_seq = wp.memory_bytes(size, shared=False)
            bad = _fits(wp.flops, mem_shared, max_flops, max_memory)
            if bad is None:
                ok["wick"] = (wp.flops, mem_shared)
            elif _fits(wp.flops, mem_seq, max_flops, max_memory) is None:
                ok["wick"] = (wp.flops, mem_seq)
                plan.wick_shared = False
            else:
                why["wick"] = _fits(wp.flops, mem_seq, max_flops, max_memory)
    choices = ok if strategy == "auto" else {k: v for k, v in ok.items() if k == strategy}
    if choices:
        best = min(choices, key=lambda k: choices[k][0])
        plan.strategy = best
        plan.flops, plan.memory_bytes = choices[best]
        if strategy != "auto":
            plan.reason = f"forced by strategy={strategy!r}"
        elif plan.wick_lower_bound is not None and "wick" not in why:
            plan.reason = (f"fewer FLOPs than wick ({choices[best][0]:.3g} against at least "
                           f"{plan.wick_lower_bound:.3g}: {plan.wick_bound})")
        elif len(choices) == 2:
            other = "wick" if best == "chaos" else "chaos"
            plan.reason = (f"fewer FLOPs than {other} ({choices[best][0]:.3g} against "
                           f"{choices[other][0]:.3g})")
        else:
            other = "wick" if best == "chaos" else "chaos"
            plan.reason = f"the only exact strategy within budget ({other}: {why.get(other)})"
        return plan
    names = ["wick", "chaos"] if strategy == "auto" else [strategy]
    parts = [f"{n}: {why.get(n, 'not planned')}" for n in names]
    plan.refused = (f"exact {metric} inner product over budget — " + "; ".join(parts) + ". "
                    + ALTERNATIVES)
    plan.reason = "no exact strategy within budget"
    return plan


def refuse_if_needed(plan: Plan | None) -> None:
    """Raise [`CostTooHigh`][tensoralg.errors.CostTooHigh] with the plan's message when it was
    refused (None: no plan, nothing to refuse)."""
    if plan is not None and plan.refused:
        raise CostTooHigh(plan.refused)


def _uncertain(val: np.ndarray, mag: np.ndarray, rtol: float) -> bool:
    """An entry whose zero pattern the float stack may get wrong: nonzero but perhaps zero in
    exact arithmetic (within ``rtol`` times the magnitude of its terms), or zero although some
    of its terms are not (a cancellation that rounding may have made, or missed)."""
    return bool(np.any(((val != 0) & (np.abs(val) <= rtol * mag)) | ((val == 0) & (mag != 0))))


def _near_rows(x: np.ndarray, y: np.ndarray, mx: np.ndarray, my: np.ndarray,
               rtol: float) -> np.ndarray:
    """Per model (leading axis): unequal float arrays that might be equal in exact arithmetic."""
    n = x.shape[0]
    x, y, mx, my = (a.reshape(n, -1) for a in (x, y, mx, my))
    return ~np.all(x == y, axis=1) & np.all(np.abs(x - y) <= rtol * (mx + my), axis=1)


def _near_equal(x: np.ndarray, y: np.ndarray, mx: np.ndarray, my: np.ndarray,
                rtol: float) -> bool:
    """Unequal float arrays that might be equal in exact arithmetic, for the whole stack or any
    part of it (the plans of a Gram matrix read stacks of some of the models): per model."""
    if x.shape != y.shape:
        return False
    return bool(np.any(_near_rows(x, y, mx, my, rtol)))


def _bilinears(layer) -> list | None:
    """The bilinear layers of a position-free network in the order of its canonical stages
    (depth first: one stage per bilinear layer, a residual widening its inner stages); None
    for other layer types."""
    from .layers import Bilinear, Linear, Residual, Sequential

    if isinstance(layer, Bilinear):
        return [layer]
    if isinstance(layer, Linear):
        return []
    if isinstance(layer, Residual):
        return _bilinears(layer.inner)
    if isinstance(layer, Sequential):
        parts = [_bilinears(x) for x in layer.layers]
        return None if any(x is None for x in parts) else [b for x in parts for b in x]
    return None


def _same_array(x, y) -> bool:
    if x is None or y is None:
        return x is y
    return x.shape == y.shape and bool(np.array_equal(x, y))


def _symmetric_stage(net, s: int, depth: int) -> bool:
    """Stage ``s`` of ``net``'s canonical form has ``L == R`` exactly because its bilinear
    layer has equal left and right weights and biases (``L = left~ P``, ``R = right~ P`` with
    the same product ``P`` of the linear maps before it)."""
    bl = None if net is None else _bilinears(net)
    if bl is None or len(bl) != depth:
        return False
    b = bl[s]
    return _same_array(b.left, b.right) and _same_array(b.left_bias, b.right_bias)


def _same_weights(x, y) -> bool:
    """Two networks of the same structure and bit-identical weights (equal canonical forms in
    exact arithmetic)."""
    if x is y:
        return True
    from .prepare import layer_structure

    sx = layer_structure(x)
    if sx is None or sx != layer_structure(y):
        return False
    ax, ay = x.arrays(), y.arrays()
    return len(ax) == len(ay) and all(_same_array(p, q) for p, q in zip(ax, ay))


#: Model pairs checked for near-equality at most (rows times entries compared), else the
#: float stacks are not trusted.
MAX_PAIR_ELEMENTS = 50_000_000


def _near_pair(va: Canonical, ma: Canonical, vb: Canonical, mb: Canonical,
               rtol: float, nets_a: list | None = None, nets_b: list | None = None) -> bool:
    """Whether a model of ``va`` and a model of ``vb`` (of the same shapes) might be equal in
    exact arithmetic although their float forms differ, or might differ although their float
    forms are equal (unless they are networks ``nets_a[i]``, ``nets_b[j]`` of the same
    weights): the plans compare stacks of models (the Wick symmetry between the two sides
    holds when they are the same stack), and a Gram matrix's plans compare every block of
    ``va`` with blocks of ``vb``. Candidate pairs are found by sorting on one entry
    (near-equal models are near-equal there too); True also when there are too many
    candidates to compare."""
    if [x[1:] for x in va.shapes()] != [x[1:] for x in vb.shapes()]:
        return False
    A = np.concatenate([a.reshape(a.shape[0], -1) for a in va.arrays()], axis=1)
    MA = np.concatenate([a.reshape(a.shape[0], -1) for a in ma.arrays()], axis=1)
    if vb is va:
        B, MB = A, MA
    else:
        B = np.concatenate([a.reshape(a.shape[0], -1) for a in vb.arrays()], axis=1)
        MB = np.concatenate([a.reshape(a.shape[0], -1) for a in mb.arrays()], axis=1)
    both = np.concatenate([A, B])
    c = int(np.argmax(both.max(axis=0) - both.min(axis=0)))  # the most spread entry
    order = np.argsort(B[:, c], kind="stable")
    t = B[order, c]
    slack = rtol * (MA[:, c] + MB[:, c].max())
    lo = np.searchsorted(t, A[:, c] - slack, side="left")
    hi = np.searchsorted(t, A[:, c] + slack, side="right")
    n_cand = int((hi - lo).sum())
    if n_cand * A.shape[1] > MAX_PAIR_ELEMENTS:
        return True
    if n_cand == 0:
        return False
    ia = np.repeat(np.arange(A.shape[0]), hi - lo)
    jb = order[np.concatenate([np.arange(l, h) for l, h in zip(lo, hi)])]
    if np.any(_near_rows(A[ia], B[jb], MA[ia], MB[jb], rtol)):
        return True
    equal = np.flatnonzero(np.all(A[ia] == B[jb], axis=1))
    if vb is va:
        equal = equal[ia[equal] != jb[equal]]
    if equal.size and (nets_a is None or nets_b is None):
        return True
    return not all(_same_weights(nets_a[ia[k]], nets_b[jb[k]]) for k in equal)


def _certified(val: Canonical, mag: Canonical, rtol: float, U: np.ndarray,
               nets: list | None = None) -> bool:
    """The zero patterns and equalities the planner reads (whole arrays, the embedding folded
    into the first stage, its constant column, the output projection, left == right factors)
    are the same on the float stack as in exact arithmetic, for the stack and for every part of
    it (zero patterns entry by entry, equalities model by model). Left and right factors equal
    in floats count as equal exactly only when their bilinear layer of ``nets`` (the networks
    of the stack) has equal left and right weights (unequal weights may round to the same
    canonical floats)."""
    if not all(np.all(np.isfinite(a)) for a in val.arrays() + mag.arrays()):
        return False
    if np.any((U != 0) & (np.abs(U) < 2.0 ** -100)):  # projected terms might underflow
        return False
    pairs = list(zip(val.arrays(), mag.arrays()))
    if val.stages:
        absU = np.abs(U)
        pairs.append((wick.output_projection(U, val.stages[-1].D),
                      wick.output_projection(absU, mag.stages[-1].D)))
        if val.embed is not None:
            fv, fm = val.folded(), mag.folded()
            pairs += [(fv.stages[0].L, fm.stages[0].L), (fv.stages[0].R, fm.stages[0].R)]
            for F, MF in ((val.stages[0].L, mag.stages[0].L), (val.stages[0].R, mag.stages[0].R)):
                pairs.append((np.einsum("nhw,nw->nh", F, val.embed[:, :, 0]),
                              np.einsum("nhw,nw->nh", MF, mag.embed[:, :, 0])))
        for s, (sv, sm) in enumerate(zip(val.stages, mag.stages)):
            if _near_equal(sv.L, sv.R, sm.L, sm.R, rtol):
                return False
            n = sv.L.shape[0]
            for i in np.flatnonzero(np.all((sv.L == sv.R).reshape(n, -1), axis=1)):
                if not _symmetric_stage(None if nets is None else nets[i], s, val.depth):
                    return False
    return not any(_uncertain(v, m, rtol) for v, m in pairs)


def refuse_exact_early(nets_a: list, nets_b: list | None, U: np.ndarray, keep: bool,
                       metric: str, strategy: str = "auto", max_flops: float | None = None,
                       max_memory: float | None = None,
                       max_configurations: int = DEFAULT_MAX_CONFIGURATIONS,
                       same: bool = False, name_a: str = "a", name_b: str = "b",
                       full: bool = False, plans: Callable | None = None) -> Plan | None:
    """The exact backend's plan made on float64 copies of the canonical forms, before any
    rational conversion (which alone can take many seconds): returned when it is refused,
    else None (then the caller prepares the rational stacks and plans on them).

    The plan reads shapes, zero patterns and equalities of factors only. The float stacks are
    used only when these are certified equal to the exact ones (`_certified`, and no
    model of one side near-equal to a model of the other without being equal, nor equal in
    floats without equal weights: `_near_pair`); otherwise (or for networks given in
    Fractions) None, and the exact plan decides. ``nets_b`` None: the same networks on both
    sides.

    ``plans``: for a request that makes several plans (a Gram matrix: the whole stacks, one
    pair, blocks), ``plans(ca, cb, U, same)`` yields them (first items of tuples) in the order
    the rational path makes and checks them; the first refused one is returned (the one the
    rational path would raise on). Default: the single plan of ``(a, b)``."""
    with np.errstate(all="ignore"):  # overflow, underflow: not certified, no warning
        fa = float_stacks_for_exact(nets_a, name_a)
        fb = fa if nets_b is None else float_stacks_for_exact(nets_b, name_b)
        if fa is None or fb is None:
            return None
        Uf = np.asarray(U, dtype=np.float64)
        nb = nets_a if nets_b is None else nets_b
        if not (_certified(*fa, Uf, nets_a) and (fb is fa or _certified(*fb, Uf, nb))):
            return None
        (va, ma, ra), (vb, mb, rb) = fa, fb
        if _near_pair(va, ma, vb, mb, max(ra, rb), nets_a, nb):
            return None  # two models might be the same exactly, or differ
    same = same or nets_b is None
    if plans is None:
        p = make_plan(va, vb, Uf, keep, metric, "exact", None, None, strategy, max_flops,
                      max_memory, max_configurations, same=same, full=full)
        return p if p.refused else None
    for p, *_ in plans(va, vb, Uf, same):
        if p.refused:
            return p
    return None


# ----------------------------------------------------------------------------------------
# sequence models (bilinear attention, docs/mathematics.md §3.7): what ``inner`` does through
# tensoralg.strategies.sequence_exact
# ----------------------------------------------------------------------------------------

@dataclass
class SequencePlan:
    """What [`tensoralg.inner`][tensoralg.inner] does for a pair of sequence models (with
    [`BilinearAttention`][tensoralg.BilinearAttention]) with the same options, decided before any
    contraction: the exact one-attention-layer path of `tensoralg.strategies.sequence_exact`
    (`exact_inner`) with its number of Wick configurations, or the
    refusal and its alternatives.

    Attributes:
        strategy: ``"attention"`` (the exact attention path runs) or None when refused.
        reason: why.
        refused: the refusal message (naming the alternatives) exactly when ``inner`` with the
            same options refuses: with [`CostTooHigh`][tensoralg.CostTooHigh] for a model outside
            the exact path (``AttentionNotSupported``: e.g. two attention layers), or with the
            ValueError of `exact_inner` when the configurations
            exceed ``max_configurations``; None otherwise.
        supported: whether both models are within the exact path (at most one attention layer
            between per-position Linear layers).
        n_configurations: Wick configurations (partial matchings after zero-pattern pruning,
            summed over the term pairs) that the exact path contracts —
            `count_configurations` of the output-sliced models —
            or None for an unsupported model.
        max_configurations: the budget on the configurations (checked first, from counts
            alone; then the dry run's memory and FLOP estimates against ``max_memory`` and
            ``max_flops``).
        n_ctx, output, position: the sequence length and the slices.
        n_legs: legs of the joined network of the largest term pair (the degrees of the two
            canonical trees added; 10 for two attention layers of depth 1), or None when a
            model has no canonical tree.
        memory_bytes: the estimated peak memory of the exact path
            (`tensoralg.strategies.sequence_exact.chaos_memory_bytes`), None when it was not
            reached;
            max_memory: the budget it was held against (bytes).
        flops: the estimated FLOPs of the exact path (the path costs of its contractions, from
            the same dry run: `tensoralg.strategies.sequence_exact.chaos_cost_req`), None when it
            was not reached; max_flops: the budget it was held against (``max_flops`` or its
            default).
        similarity_memory_bytes, similarity_flops: what a similarity of the two models costs
            on the exact path: it also computes ``<a, a>`` and ``<b, b>`` (one after the
            other), so the larger of the three products' peaks and the sum of their FLOPs;
            None when ``a`` and ``b`` are one model or the inner product was refused.
        terms_a, terms_b: each model's canonical tree (`tensoralg.canonical.tree`), one
            line per node: its terms with their legs and the positions they read.
        alternatives: the other methods.
    """

    strategy: str | None
    reason: str
    n_ctx: int
    max_configurations: int
    n_configurations: int | None = None
    refused: str | None = None
    supported: bool = True
    output: Any = None
    position: Any = None
    n_legs: int | None = None
    memory_bytes: int | None = None
    max_memory: float | None = None
    flops: float | None = None
    max_flops: float | None = None
    similarity_memory_bytes: int | None = None
    similarity_flops: float | None = None
    terms_a: list = field(default_factory=list)
    terms_b: list = field(default_factory=list)
    alternatives: str = SEQUENCE_ALTERNATIVES
    metric: str = "gaussian"
    input_distribution: str = "N(0, I)"

    def summary(self) -> str:
        where = ("summed over query positions" if self.position is None else
                 "per query position" if isinstance(self.position, str) else
                 f"query position t={self.position}")
        if self.output is None:
            what = "summed over outputs"
        elif isinstance(self.output, str):
            what = "per output"
        elif isinstance(self.output, (int, np.integer)):
            what = f"output {self.output}"
        else:
            what = "output direction u . f"
        lines = [f"sequence models (bilinear attention), n_ctx={self.n_ctx}, {self.metric} "
                 f"metric, {where}, {what}", f"input: {self.input_distribution}"]
        for side, terms in (("a", self.terms_a), ("b", self.terms_b)):
            for line in terms:
                lines.append(f"  {side}: {line}")
        legs = "" if self.n_legs is None else f"{self.n_legs} legs joined"
        if self.supported:
            lines.append(f"exact one-attention-layer path (tensoralg.strategies.sequence_exact): "
                         f"{self.n_configurations:,} Wick configurations"
                         f"{', up to ' + legs if legs else ''} "
                         f"(max_configurations={self.max_configurations:,})")
            if self.memory_bytes is not None:
                lines.append(f"estimated peak memory (the attention path's chaos sums, dry run): "
                             f"{self.memory_bytes / 2**30:.3g} GiB (max_memory="
                             f"{self.max_memory / 2**30:.3g} GiB)")
            if self.flops is not None:
                lines.append(f"estimated FLOPs (the same dry run): {self.flops:.3g} "
                             f"(max_flops={self.max_flops:.3g})")
            if self.similarity_memory_bytes is not None:
                lines.append(f"a similarity also computes <a, a> and <b, b>: estimated peak "
                             f"{self.similarity_memory_bytes / 2**30:.3g} GiB (the largest of "
                             f"the three), {self.similarity_flops:.3g} FLOPs in all (each "
                             f"product is held to the budgets on its own)")
        else:
            lines.append("exact one-attention-layer path (tensoralg.strategies.sequence_exact): not available"
                         + (f" (the unrolled trees: {legs})" if legs else ""))
        if self.refused:
            lines.append(f"REFUSED: {self.refused}")
        else:
            lines.append(f"choice: {self.strategy} ({self.reason})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _describe_tree(tree) -> list:
    """One line per node of a canonical tree: its terms, their legs and positions."""
    lines = []
    for k, node in enumerate(tree.nodes):
        parts = []
        for term in node.terms:
            by_pos: dict = {}
            for leg in term.legs:
                by_pos.setdefault(leg.pos, []).append(leg.name + ("(RoPE)" if leg.positional
                                                                 else ""))
            where = "; ".join(f"{', '.join(v)} at {p}" for p, v in by_pos.items())
            n = term.degree
            parts.append(f"{term.kind} ({n} leg{'s' if n != 1 else ''}: {where})")
        lines.append(f"node {k}: " + " + ".join(parts))
    return lines


def plan_sequence(req, na, nb) -> SequencePlan:
    """The plan of ``inner(na, nb, ...)`` for sequence models (``na``, ``nb``: layers; the same
    object for ``<a, a>``; ``req``: the validated `Request`): the
    checks [`tensoralg.inner`][tensoralg.inner] makes, in its order, then the exact attention path's
    configuration count (cheap: nothing is contracted).

    The count is `tensoralg.strategies.sequence_exact.count_configurations` with the same ``output``
    slice and ``backend`` (the zero patterns of the sliced terms decide which legs can be
    capped); within ``max_configurations``, the estimated peak memory and FLOPs
    (`tensoralg.strategies.sequence_exact.chaos_cost_req`, a dry run: paths found and cached,
    nothing contracted) against ``max_memory`` and ``max_flops``. So ``refused`` is set exactly when ``inner`` refuses,
    with its message.

    Raises:
        ValueError: what ``inner`` raises before any work: a sequence model paired with a
            position-free network of degree > 1, a metric other than Gaussian, ``n_ctx``
            missing or in disagreement with a mask, an ``output`` or ``position`` out of range.
    """
    from . import canonical
    from .network import sequence_n_ctx

    if not (na.is_sequence_model and nb.is_sequence_model) and not all(
            n.is_sequence_model or n.degree <= 1 for n in (na, nb)):
        raise ValueError("a and b: a sequence model (with attention) compared with a "
                         "position-free network of degree > 1; compare two sequence models (a "
                         "per-position affine map is accepted)")
    if req.metric != "gaussian":
        raise ValueError("sequence models: only metric='gaussian' is implemented")
    max_configurations, max_memory = req.max_configurations, req.max_memory
    backend, device, output, position = req.backend, req.device, req.output, req.position
    n = sequence_n_ctx(na, nb, req.n_ctx)
    req = req.replace(n_ctx=n)
    check_slices(req, na.out_features, n)
    plan = SequencePlan(strategy=None, reason="", n_ctx=n,
                        max_configurations=int(max_configurations), output=output,
                        position=position)
    # refused from shapes alone, as inner refuses: then nothing n_ctx-sized is built, and the
    # trees below (count, description) are the small ones (neither depends on n_ctx)
    early = sequence_exact.early_memory_refusal(req, na, nb)
    count_req = req
    if early is not None:
        n = sequence_exact.SHAPE_CTX
        count_req = req.replace(n_ctx=n, position=None)
    try:
        plan.n_configurations = sequence_exact.count_configurations_req(count_req, na, nb)
    except sequence_exact.AttentionNotSupported as exc:
        plan.supported = False
        plan.refused = f"exact inner product of sequence models: {exc}. {SEQUENCE_ALTERNATIVES}"
        plan.reason = "a model outside the exact attention path"
    # the canonical trees, for the description (any depth; a model that has none is refused
    # above by the attention path's own check)
    degrees = []
    for side, net in (("a", na), ("b", nb)):
        try:
            tree = canonical.sequence_tree(net, n, side)
        except (TypeError, ValueError) as exc:
            lines = [f"(no canonical tree: {exc})"]
        else:
            lines = _describe_tree(tree)
            degrees.append(tree.degree)
        if side == "a":
            plan.terms_a = lines
        else:
            plan.terms_b = lines
    if len(degrees) == 2:
        plan.n_legs = sum(degrees)
    if plan.supported:
        if plan.n_configurations > max_configurations:
            plan.refused = (f"exact attention inner product: {plan.n_configurations:,} Wick "
                            f"configurations, over max_configurations={max_configurations:,}. "
                            f"{SEQUENCE_ALTERNATIVES}, or raise max_configurations")
            plan.reason = "over max_configurations"
        elif early is not None:
            plan.refused, plan.memory_bytes = early
            plan.max_memory = float(available_memory(backend, device) if max_memory is None
                                    else max_memory)
            plan.reason = "over max_memory (from shapes alone)"
        else:
            plan.memory_bytes, plan.flops = sequence_exact.chaos_cost_req(req, na, nb)
            plan.max_memory = float(available_memory(backend, device) if max_memory is None
                                    else max_memory)
            plan.max_flops = sequence_exact.max_flops_of(req)
            plan.refused = sequence_exact.memory_refusal(plan.memory_bytes, plan.max_memory)
            if plan.refused:
                plan.reason = "over max_memory"
            else:
                plan.refused = sequence_exact.flops_refusal(plan.flops, req)
                if plan.refused:
                    plan.reason = "over max_flops"
    if plan.supported and not plan.refused and na is not nb:
        costs = [(plan.memory_bytes, plan.flops)]
        try:
            costs += [sequence_exact.chaos_cost_req(req, x, x) for x in (na, nb)]
        except (ValueError, sequence_exact.AttentionNotSupported):
            pass   # similarity refuses these itself, with its own message
        else:
            plan.similarity_memory_bytes = max(c[0] for c in costs)
            plan.similarity_flops = float(sum(c[1] for c in costs))
    if plan.supported and not plan.refused:
        plan.strategy = "attention"
        plan.reason = (f"exact: at most one attention layer per model, "
                       f"{plan.n_configurations:,} Wick configurations within "
                       f"max_configurations={max_configurations:,}, estimated peak memory "
                       f"{plan.memory_bytes / 2**30:.3g} GiB within max_memory="
                       f"{plan.max_memory / 2**30:.3g} GiB, estimated {plan.flops:.3g} FLOPs "
                       f"within max_flops={plan.max_flops:.3g}")
    return plan
