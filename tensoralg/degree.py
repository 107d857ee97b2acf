"""Degree-resolved similarity: the entry points
[`degree_similarity`][tensoralg.degree.degree_similarity] and
[`degree_similarity_matrix`][tensoralg.degree.degree_similarity_matrix] (docs/mathematics.md §3.9,
"Homogeneous parts").

A multilinear network is a polynomial ``f = sum_k P_k`` with ``P_k`` homogeneous of degree
``k`` (unique: a property of the function, not of the weights; read by the DFT,
`tensoralg.homogeneous.homogeneous_parts`). The truncation is
``f_{<=K} = sum_{k<=K} P_k`` and ``S<=K`` the similarity of the two truncations.

``S<=K`` is a DIFFERENT QUESTION from the full similarity, not an approximation of it: it asks
whether two models agree on typical inputs through their low-order paths (the direct path, each
head on its own; from degree 9 the compositions of one layer-2 leg with one layer-1 head).

Exact where the truncation is a network the exact engines compute:

* ``S<=1`` for every model: ``f_{<=1}(X) = P_0 + J X`` with ``P_0 = f(0)`` and the Jacobian
  ``J`` read column by column by the DFT on the basis inputs (rounding only;
  `tensoralg.homogeneous.affine_part`), so
  ``<f_{<=1}^a, f_{<=1}^b> = sum P_0^a P_0^b + sum J^a J^b``.
* position-free networks (bilinear MLPs, residual stacks, biases or not), every ``K``: the
  *graded network* of the canonical chain (`tensoralg.homogeneous.graded`), whose inner
  products the exact engine of `tensoralg.engine` computes.
* sequence models without biases (no lifted constant anywhere) whose ``K`` is below the first
  composition degree (9 for two attention layers): the *first-order* paths unrolled into one
  node (`tensoralg.homogeneous.unrolled`; ``f_{<=5}`` of two attention layers is one
  node holding both layers' heads), which the exact attention path computes
  (`tensoralg.strategies.sequence_exact`).
* bias-free sequence models whose truncation holds compositions (``f_{<=9}`` of two attention
  layers: the direct path, every head and every composition of one leg of a later head with
  an earlier head; an attention block followed by a bilinear MLP up to its full degree 10)
  where the leg-space engine is over budget: the feature-space chaos of the same unrolled
  terms (`tensoralg.strategies.chaos.composed`), polynomial in ``N = n_ctx * d`` and
  exponential in the number of legs, its cost from shapes before any work (small inputs:
  ``N <= 6`` at degree 9; docs/attention.md, "Exact S<=9"). The parts of different degree
  are not orthogonal (``E[x x^5] != 0``): every cross term is in the inner product.

Everything else by Monte Carlo (APPROXIMATE; `tensoralg.strategies.montecarlo_degree`):
the radial estimator on the DFT parts, the largest exact lower truncation as control variate,
with the diagnostics of `tensoralg.strategies.montecarlo`: an estimate whose ``reliable``
is False is not an answer.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
from collections.abc import KeysView
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import engine, homogeneous
from .canonical import Tree, resolve_n_ctx
from .errors import CostTooHigh
from .layers import Layer, as_network
from .prepare import check_pair, check_sizes, position_selector
from .request import make_request
from .results import similarity_from
from .strategies import sequence_exact
from .strategies.montecarlo import MonteCarloEstimate, check_sampling_cost, warn_few
from .strategies.montecarlo_degree import MC_SCALES, truncation_estimates

__all__ = ["degree_similarity", "degree_similarity_matrix",
           "DegreeSimilarity", "DegreeSimilarityMatrix", "DEGREE_DEFAULT_SAMPLES"]

#: Default number of Monte Carlo directions of `degree_similarity` (each costs
#: ``3 m`` complex forward passes per model, ``m = degree + 1``).
DEGREE_DEFAULT_SAMPLES = 3_000

_DISCLAIMER = ("S<=K is the similarity of the degree-<=K truncations f_<=K = sum_{k<=K} P_k: a "
               "different question (similarity on typical inputs through the low-order paths), "
               "not an approximation of the full similarity")


# ----------------------------------------------------------------------------------------
# exact inner products of the truncations' trees
# ----------------------------------------------------------------------------------------

def _tree_inner(pa: Tree, pb: Tree, n_ctx: int) -> float:
    sequence_exact.check_configurations_bound(pa, pb)
    return float(sequence_exact.tree_inner_req(make_request(n_ctx=n_ctx), pa, pb, n_ctx))


#: How an exact ``S<=K`` whose truncation holds compositions (two-node terms) is computed.
FEATURE_HOW = ("exact: the paths of degree <= K (direct, every head, every composition of one "
               "leg of a later head with an earlier head) by the feature-space chaos of one- and "
               "two-node terms (tensoralg.strategies.chaos.composed)")


def _not_exact_message(K: int, name: str, why: str, tail: bool = True) -> str:
    """The one-line refusal of an exact ``S<=K`` of a sequence model with biases (``tail``:
    with the Monte Carlo alternative)."""
    msg = f"max_degree: S<={K} is not exact for {name} ({why})"
    if K >= 9:
        msg += (f"; S<={K} with biases is not exact here (the lifted constant mixes the degrees "
                f"of every tree): dc.paths(model, n_ctx=..., order=2) gives the exact Gram of "
                f"the direct, first- and second-order paths with biases (grouped by tree, not "
                f"by degree)")
    return msg + ("; degree_similarity(a, b) estimates it by Monte Carlo per pair, with its "
                  "verdict" if tail else "")


class _FeatureParts:
    """Per model, the feature-space chaos of each homogeneous part of its unrolled paths
    (`tensoralg.homogeneous.unrolled`), each built once: the chaos is linear in the terms, so
    the chaos of a truncation ``f_{<=K}`` is the sum of its parts' coefficients, and every
    inner product ``sum_{t, o, beta} a b beta!`` a weighted dot product of them
    (`tensoralg.strategies.chaos.composed`, docs/mathematics.md §3.10). All parts share one
    ``max_degree`` (the largest term of the truncations asked for), so they add."""

    def __init__(self, unrolled: list, n_ctx: int, max_degree: int, backend: str = "numpy",
                 device: Any = None):
        self.unrolled, self.n_ctx, self.K = unrolled, n_ctx, max_degree
        self.backend, self.device = backend, device
        self._parts: dict = {}

    def check(self, K: int, what: str) -> None:
        """CostTooHigh from shapes alone (`composed.check`), before any work."""
        from .strategies.chaos import composed

        composed.check([list(f.tree(set(range(K + 1))).nodes[0].terms) for f in self.unrolled],
                       self.n_ctx, what)

    def part(self, side: int, k: int):
        """The `FeatureChaos` of side ``side``'s homogeneous part of degree ``k``."""
        from .strategies.chaos.composed import FeatureChaos

        if (side, k) not in self._parts:
            t = self.unrolled[side].tree({k})
            self._parts[side, k] = FeatureChaos(list(t.nodes[0].terms), self.n_ctx,
                                                max_degree=self.K, backend=self.backend,
                                                device=self.device)
        return self._parts[side, k]

    def coef(self, side: int, K: int) -> np.ndarray:
        """The chaos coefficients of ``f_{<=K}`` of side ``side``."""
        return sum(self.part(side, k).coef for k in sorted(self.unrolled[side].degrees)
                   if k <= K)

    def inner(self, u: np.ndarray, v: np.ndarray) -> float:
        norms = self.part(0, min(self.unrolled[0].degrees)).norms
        return float(np.einsum("rc,rc,c->", u, v, norms))

    def triple(self, K: int) -> tuple[float, float, float]:
        """``(<a, b>, <a, a>, <b, b>)`` of the two truncations ``f_{<=K}``."""
        ca, cb = self.coef(0, K), self.coef(1, K)
        return self.inner(ca, cb), self.inner(ca, ca), self.inner(cb, cb)


# ----------------------------------------------------------------------------------------
# the result
# ----------------------------------------------------------------------------------------

@dataclass
class DegreeSimilarity:
    """Degree-resolved similarity: ``r[K]`` is ``S<=K``, the similarity of the truncations
    ``f_{<=K} = sum_{k<=K} P_k`` (a different question from the full similarity, not an
    approximation of it: the similarity on typical inputs through the low-order paths).

    Attributes:
        values: ``{K: S<=K}``, a float where exact, a
            [`MonteCarloEstimate`][tensoralg.strategies.montecarlo.MonteCarloEstimate] (APPROXIMATE,
            with ``stderr`` and ``reliable``) where estimated.
        method: ``{K: "exact" | "montecarlo"}``; notes: ``{K: how, or why not exact}``.
        profile_a, profile_b: ``{k: ||P_k||^2}`` for ``k = 0 .. max K`` (capped at the degree),
            floats where exact (0.0 for parts that vanish structurally), estimates otherwise.
        degree_a, degree_b: the models' degree bounds; distribution: the input distribution.
    """

    values: dict
    method: dict
    notes: dict
    profile_a: dict
    profile_b: dict
    degree_a: int
    degree_b: int
    distribution: str
    n_samples: int | None = None
    disclaimer: str = field(default=_DISCLAIMER, repr=False)

    def __getitem__(self, K):
        if K not in self.values:
            raise KeyError(f"S<={K!r} was not computed; computed: {sorted(self.values)} "
                           f"(max_degree=)")
        return self.values[K]

    def keys(self) -> KeysView[int]:
        return self.values.keys()

    def exact(self, K: int) -> bool:
        """Whether ``S<=K`` is exact (else a Monte Carlo estimate)."""
        return self.method[K] == "exact"

    @staticmethod
    def _show(v) -> str:
        if isinstance(v, MonteCarloEstimate):
            if v.reliable is False:
                lb = "; ".join(f"{k} >= {x:.4g}" for k, x in v.diagnostics.lower_bounds.items())
                return f"no reliable estimate ({v.diagnostics.reason}" + \
                    (f"; certified lower bounds {lb})" if lb else ")")
            return f"{float(v):.6g} ± {v.stderr:.2g} (Monte Carlo, {v.n_samples} directions)"
        return f"{float(v):.12g} (exact)"

    def __repr__(self) -> str:
        lines = [f"DegreeSimilarity (degrees {self.degree_a}, {self.degree_b}; inputs "
                 f"{self.distribution})", f"  note: {self.disclaimer}"]
        for K in self.values:
            lines.append(f"  S<={K}: {self._show(self.values[K])}  [{self.notes[K]}]")
        for name, prof in (("a", self.profile_a), ("b", self.profile_b)):
            parts = ", ".join(f"{k}: {self._show(v)}" for k, v in prof.items()
                              if not (not isinstance(v, MonteCarloEstimate) and v == 0.0))
            lines.append(f"  ||P_k||^2 of {name} (zero parts omitted): {parts}")
        return "\n".join(lines)

    __str__ = __repr__


# ----------------------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------------------

#: The truncations reported when ``max_degree`` is not given (docs/mathematics.md §3.9): the
#: affine part, one attention layer's degree, and one composition of a layer-2 leg with a
#: layer-1 head (where induction heads live).
DEFAULT_MAX_DEGREE = (1, 5, 9)


def _check_max_degree(max_degree) -> tuple:
    vals = (max_degree,) if isinstance(max_degree, numbers.Integral) and \
        not isinstance(max_degree, bool) else max_degree
    try:
        vals = tuple(vals)
    except TypeError:
        vals = None
    if not vals or any(isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1
                       for k in vals):
        raise ValueError(f"max_degree: expected a positive int or an increasing sequence of "
                         f"positive ints, e.g. (1, 5, 9), got {max_degree!r}")
    if any(b <= a for a, b in itertools.pairwise(vals)):
        raise ValueError(f"max_degree: expected strictly increasing degrees, got {max_degree!r}")
    return tuple(int(k) for k in vals)


def degree_similarity(a: Any, b: Any, *, n_ctx: int | None = None,
                      max_degree: Any = None, cov: Any = None,
                      n_samples: int = DEGREE_DEFAULT_SAMPLES, seed: int = 0) -> DegreeSimilarity:
    r"""Degree-resolved similarity $S_{\le K}$ of two networks, for each $K$ in ``max_degree``,
    and the profiles $\|P_k\|^2$ (docs/mathematics.md §3.9, "Homogeneous parts").

    $f = \sum_k P_k$ with $P_k$ the homogeneous degree-$k$ part (a property of the
    function); $S_{\le K} = \langle f_{\le K}^a, f_{\le K}^b\rangle / (\|f_{\le K}^a\| \|f_{\le K}^b\|)$
    with $f_{\le K} = \sum_{k\le K} P_k$, under the Gaussian metric (sums over outputs and query
    positions). ``S<=K`` is a DIFFERENT QUESTION from the full similarity — the similarity on
    typical inputs through the low-order paths — not an approximation of it; for ``K`` at or
    above both degrees it is the full similarity.

    Exact (float64): ``S<=1`` for every model; every ``K`` for position-free networks (the
    graded network of the canonical chain); for bias-free sequence models below the first
    composition degree (``S<=5`` of two attention layers: one node holding both layers'
    heads, by the exact attention path); for bias-free sequence models whose truncation
    holds compositions (``S<=9`` of two attention layers) by the feature-space chaos of
    `tensoralg.strategies.chaos.composed` where its estimate (from shapes, before any work)
    fits the budget (``r.notes[K]`` says which). Otherwise a Monte Carlo estimate
    (APPROXIMATE; with biases ``S<=9`` is not exact here, and the note says so): the
    radial estimator on the DFT parts with the largest exact lower truncation as control
    variate, with ``stderr`` and reliability diagnostics (module docstring of
    `tensoralg.degree`).

    Args:
        a, b: networks with the same input and output sizes (sequence models: inputs
            ``(n, n_ctx, d)``).
        n_ctx: the sequence length (sequence models; optional when a mask array fixes it).
        max_degree: a positive int or a strictly increasing sequence of them, at most the
            models' degree (``S<=degree`` is the full similarity); None: those of
            `DEFAULT_MAX_DEGREE` below the degree, and the degree itself when it is at
            most 9 (so that a shallow model's report ends with its full similarity), leaving
            out a truncation that is zero for either model (``S<=1`` of a bias-free bilinear
            layer: undefined).
        cov: the input distribution ``N(0, Σ)`` as in [`tensoralg.inner`][tensoralg.inner] (folded
            into the
            models: ``P_k ∘ K`` are the parts of ``f ∘ K``).
        n_samples: Monte Carlo directions (each ``3 (degree + 1)`` complex forward passes per
            model: the DFT at the scales
            `tensoralg.strategies.montecarlo_degree.MC_SCALES`).
        seed: the Monte Carlo seed (numpy ``default_rng``).

    Returns:
        [`DegreeSimilarity`][tensoralg.degree.DegreeSimilarity] (``r[K]``: a float or a
        ``MonteCarloEstimate``; ``r.method``, ``r.notes``, ``r.profile_a``, ``r.profile_b``; its
        ``repr`` says what is exact).

    Raises:
        ValueError: a bad ``max_degree`` (or one above both models' degree), ``n_ctx``,
            ``cov``, ``n_samples`` or ``seed``;
            models of different input/output sizes; a sequence model compared with a
            position-free network; (after the exact work) a truncation of norm zero
            asked for in ``max_degree``.
    """
    Ks = None if max_degree is None else _check_max_degree(max_degree)
    req = make_request(method="montecarlo", n_ctx=n_ctx, n_samples=n_samples, seed=seed,
                       cov=cov)
    na, nb = as_network(a, "a"), as_network(b, "b")
    check_pair(na, nb, sliceable=False)
    seq = na.is_sequence_model or nb.is_sequence_model
    if seq and any(not x.is_sequence_model and x.degree > 1 for x in (na, nb)):
        raise ValueError("a and b: a sequence model (with attention) compared with a "
                         "position-free network of degree > 1; compare two sequence models (a "
                         "per-position affine map is accepted)")
    if seq:
        n_ctx = resolve_n_ctx([("a", na), ("b", nb)], req.n_ctx)
    elif req.n_ctx is not None:
        raise ValueError("n_ctx: only for sequence models (with attention)")
    na, nb = (x.astype_float() if x.is_exact else x for x in (na, nb))
    na = req.distribution.apply(na, "a", False)
    nb = req.distribution.apply(nb, "b", False)
    deg_a, deg_b = na.degree, nb.degree
    top = max(deg_a, deg_b)
    if Ks is None:
        Ks = tuple(k for k in DEFAULT_MAX_DEGREE if k < top) + (
            (top,) if top <= max(DEFAULT_MAX_DEGREE) else ())
    elif max(Ks) > top:
        raise ValueError(f"max_degree: {max(Ks)} is above the models' degree {top} (a: "
                         f"{deg_a}, b: {deg_b}); S<={top} is already the full similarity")
    kprof = min(max(Ks), max(deg_a, deg_b))

    values, method, notes = {}, {}, {}
    exact_ip: dict = {}                # K -> (ab, aa, bb), exact
    prof = [{}, {}]
    fo = [homogeneous.unrolled(x, n_ctx, kprof) for x in (na, nb)] if seq else [(None, "")] * 2
    if fo[0][0] is not None and fo[1][0] is not None:
        # bias-free: P_0 = 0 and P_1 is the unrolled linear path, contracted exactly
        t1 = [f.tree({1}) for f, _ in fo]
        exact_ip[1] = sequence_exact.tree_triple(t1[0], t1[1], n_ctx)
        for side in (0, 1):
            prof[side][0], prof[side][1] = 0.0, float(exact_ip[1][1 + side])
    elif seq:   # with biases: the affine part read by the DFT (position-free: graded, below)
        aff = (homogeneous.affine_part(na, n_ctx), homogeneous.affine_part(nb, n_ctx))
        for side, p in enumerate(aff):
            prof[side][0] = float(np.sum(p[0] ** 2))
            prof[side][1] = float(np.sum(p[1] ** 2))
        exact_ip[1] = (homogeneous.affine_inner(aff[0], aff[1]),
                       homogeneous.affine_inner(aff[0], aff[0]),
                       homogeneous.affine_inner(aff[1], aff[1]))
    why: dict = {}
    hows: dict = {}   # K -> how an exact S<=K was computed, where not `how`

    if not seq:
        Kmax = min(max(Ks), max(deg_a, deg_b))
        ga, gb = homogeneous.graded(na, Kmax), homogeneous.graded(nb, Kmax)
        plain = make_request()
        # the affine part exactly from the graded network (a zero linear part is an exact
        # zero, not the DFT's rounding noise)
        a1, b1 = ga.part({0, 1}), gb.part({0, 1})
        exact_ip[1] = (engine.inner(plain, a1, b1), engine.inner(plain, a1, a1),
                       engine.inner(plain, b1, b1))
        for side, g in ((0, ga), (1, gb)):
            p1 = g.part({1})
            prof[side][0] = float(np.sum(g.y0 ** 2))
            prof[side][1] = float(engine.inner(plain, p1, p1))
        try:
            for K in Ks:
                if K == 1:
                    continue
                ta = na if deg_a <= K else ga.part(set(range(K + 1)))
                tb = nb if deg_b <= K else gb.part(set(range(K + 1)))
                exact_ip[K] = (engine.inner(plain, ta, tb), engine.inner(plain, ta, ta),
                               engine.inner(plain, tb, tb))
            for side, g, dg in ((0, ga, deg_a), (1, gb, deg_b)):
                for k in range(2, kprof + 1):
                    if k > dg:
                        prof[side][k] = 0.0
                    elif k in g.blocks:
                        pk = g.part({k})
                        prof[side][k] = float(engine.inner(plain, pk, pk))
                    else:
                        prof[side][k] = 0.0
        except CostTooHigh as exc:
            for K in Ks:
                if K not in exact_ip:
                    why[K] = f"exact graded network over budget ({str(exc)[:80]}...)"
        how = "exact: graded network of the canonical chain"
    else:
        how = "exact: the paths of degree <= K unrolled into one node (exact attention path)"
        done: dict = {}   # the degrees present below K, per side -> the exact triple
        feats = None      # _FeatureParts once a truncation holds compositions
        done_how: dict = {}
        feature_ok = 0    # the largest K computed by the feature-space chaos
        term_values: dict = {}   # (id(term), id(term)) -> its pair's value (tree_gram)
        for K in Ks:
            if K == 1:
                continue
            if fo[0][0] is None or fo[1][0] is None:
                side = "a" if fo[0][0] is None else "b"
                why[K] = _not_exact_message(K, side, fo[0][1] or fo[1][1], False)[12:]
                continue
            f0, f1 = fo[0][0], fo[1][0]
            key = tuple(frozenset(k for k in f.degrees if k <= K) for f in (f0, f1))
            if key in done:
                exact_ip[K] = done[key]
                if key in done_how:
                    hows[K] = done_how[key]
                continue
            ks = set(range(K + 1))
            pa, pb = f0.tree(ks), f1.tree(ks)
            try:
                exact_ip[K] = done[key] = sequence_exact.tree_triple(pa, pb, n_ctx,
                                                                     term_values)
                continue
            except (CostTooHigh, sequence_exact.AttentionNotSupported) as exc:
                why[K] = f"exact path refused: {exc}"
            # over the leg-space engine's budget (compositions: a leg reading another term):
            # the feature-space chaos, its cost from shapes before any work
            try:
                if feats is None:
                    top_k = max(len(t.legs) for f in (f0, f1)
                                for t in f.tree(set(range(kprof + 1))).nodes[0].terms)
                    feats = _FeatureParts([f0, f1], n_ctx, top_k)
                feats.check(K, f"S<={K}")
                exact_ip[K] = done[key] = feats.triple(K)
                hows[K] = done_how[key] = FEATURE_HOW
                feature_ok = max(feature_ok, K)
                why.pop(K)
            except CostTooHigh as exc:
                why[K] += f"; exact feature-space chaos refused: {exc}"
        for K in Ks:
            if K in exact_ip or max(deg_a, deg_b) > K or (fo[0][0] and fo[1][0]):
                continue
            try:   # with biases, f_<=K is the model itself: the exact path of one attention layer
                plain = make_request(n_ctx=n_ctx)
                exact_ip[K] = (sequence_exact.exact_inner_req(plain, na, nb),
                               sequence_exact.exact_inner_req(plain, na, na),
                               sequence_exact.exact_inner_req(plain, nb, nb))
                why.pop(K, None)
            except (CostTooHigh, sequence_exact.AttentionNotSupported) as exc:
                why[K] = f"{why.get(K, '')}; the models themselves: {str(exc)[:100]}..."
        for side, (f, _) in enumerate(fo):
            if f is None:
                continue
            for k in range(2, kprof + 1):
                if k not in f.degrees:
                    prof[side][k] = 0.0     # vanishes structurally (bias-free)
                elif feats is not None and k <= feature_ok:
                    pk = feats.part(side, k).coef
                    prof[side][k] = feats.inner(pk, pk)
                else:
                    t = f.tree({k})
                    # a part inside an exact S<=K: its term pairs are already contracted
                    v = sequence_exact.sum_term_values(t, t, term_values)
                    if v is not None:
                        prof[side][k] = v
                        continue
                    with contextlib.suppress(CostTooHigh):   # too costly: estimated below
                        prof[side][k] = _tree_inner(t, t, n_ctx)

    for K in Ks:
        if K in exact_ip:
            ab, aa, bb = exact_ip[K]
            zero = [n for n, v in (("a", aa), ("b", bb)) if np.all(np.isfinite(v)) and
                    np.any(np.asarray(v) <= 0)]
            if zero and max_degree is None:
                continue    # the default degrees skip a truncation that is zero: undefined
            if zero:
                raise ValueError(
                    f"max_degree: S<={K} is undefined: the part of degree <= {K} of "
                    f"{' and '.join(zero)} is zero (a bias-free bilinear layer has only "
                    f"degree 2, a bias-free attention stack degrees 1, 5, 9, ...; or the weights "
                    f"are so small that the norm underflowed: rescale them); ask for degrees "
                    f"from the lowest nonzero one, or leave max_degree at its default")
            values[K] = similarity_from(ab, aa, bb, False, what=f"<={K}")
            method[K] = "exact"
            notes[K] = "exact: affine part (P_0 + J X)" if K == 1 else hows[K] if K in hows \
                else ("exact: the models themselves" if max(deg_a, deg_b) <= K else how)
    todo = [K for K in Ks if K not in exact_ip]
    need_prof = any(k not in prof[s] for s, dg in ((0, deg_a), (1, deg_b))
                    for k in range(min(kprof, dg) + 1))
    n_used = None
    if todo or need_prof:
        warn_few(n_samples)
        check_sampling_cost([na, nb], n_samples,
                            len(MC_SCALES) * (max(na.degree, nb.degree) + 1), n_ctx)
        lower = {}
        for K in todo:
            below = [k for k in exact_ip if k < K]
            if below:
                lower[K] = (max(below), exact_ip[max(below)])
        need = tuple({k for k in range(min(kprof, dg) + 1) if k not in prof[s]}
                     for s, dg in ((0, deg_a), (1, deg_b)))
        mc_vals, mc_prof = truncation_estimates(na, nb, n_ctx, todo or [min(Ks)], lower, n_samples, seed, kprof,
                               need)
        n_used = n_samples
        for K in todo:
            values[K] = mc_vals[K]
            method[K] = "montecarlo"
            cvn = f"; control variate: exact S<={lower[K][0]}" if K in lower else ""
            notes[K] = f"Monte Carlo (APPROXIMATE) on the DFT parts{cvn}; not exact: {why.get(K)}"
        for side in (0, 1):
            for k, v in mc_prof[side].items():
                prof[side].setdefault(k, v)
    order = lambda d: dict(sorted(d.items()))  # noqa: E731
    return DegreeSimilarity(dict(sorted(values.items())), method, notes, order(prof[0]),
                            order(prof[1]), deg_a, deg_b, req.distribution.describe(), n_used)


# ----------------------------------------------------------------------------------------
# the exact matrix: each model's part once, then the pairs
# ----------------------------------------------------------------------------------------

@dataclass
class DegreeSimilarityMatrix:
    """Exact degree-resolved similarity matrices of ``N`` models: ``r[K]`` is the ``(N, N)``
    matrix of ``S<=K`` (a DIFFERENT QUESTION from the full similarity, not an approximation of
    it: [`DegreeSimilarity`][tensoralg.degree.DegreeSimilarity]).

    Attributes:
        similarity: ``{K: (N, N) float64}``, symmetric, ones on the diagonal.
        gram: ``{K: (N, N) float64}``: the inner products ``<f_{<=K}^i, f_{<=K}^j>`` under the
            metric.
        notes: ``{K: how it was computed}``; distribution: the input distribution.
    """

    similarity: dict
    gram: dict
    notes: dict
    distribution: str
    disclaimer: str = field(default=_DISCLAIMER, repr=False)

    def __getitem__(self, K):
        if K not in self.similarity:
            raise KeyError(f"S<={K!r} was not computed; computed: {sorted(self.similarity)} "
                           f"(max_degree=)")
        return self.similarity[K]

    def keys(self) -> KeysView[int]:
        return self.similarity.keys()

    def __repr__(self) -> str:
        n = len(next(iter(self.gram.values())))
        lines = [f"DegreeSimilarityMatrix ({n} model{'s' if n != 1 else ''}; inputs "
                 f"{self.distribution}; exact)", f"  note: {self.disclaimer}"]
        for K, S in self.similarity.items():
            lines.append(f"  S<={K} ({self.notes[K]}):")
            body = np.array2string(S, precision=6, floatmode="fixed", max_line_width=96)
            lines += ["    " + line for line in body.splitlines()]
        return "\n".join(lines)


def _gram_similarity(G: np.ndarray, K: int) -> np.ndarray:
    d = np.diag(G)
    if np.any(d <= 0):
        i = int(np.argmin(d))
        raise ValueError(f"models[{i}]: the degree-<={K} truncation has norm zero, so S<={K} "
                         f"is undefined")
    S = G / np.sqrt(np.outer(d, d))
    S = np.clip(S, -1.0, 1.0)
    np.fill_diagonal(S, 1.0)
    return S


def degree_similarity_matrix(models: Any, *, n_ctx: int | None = None,
                             max_degree: Any = (1, 5), cov: Any = None,
                             backend: str = "numpy", device: Any = None, out: Any = None,
                             block_size: int | None = None, workers: int | None = None,
                             client: Any = None, resume: bool = False,
                             show_progress: bool = False) -> DegreeSimilarityMatrix:
    """The exact ``S<=K`` matrices of ``N`` models (e.g. the checkpoints of a training run),
    for each ``K`` in ``max_degree``: each model's truncation and chaos form once, then the
    ``N (N + 1) / 2`` pairs (docs/mathematics.md §3.9, "Homogeneous parts").

    Exact only, as [`degree_similarity`][tensoralg.degree.degree_similarity] computes them: ``S<=1``
    for every model (the affine part); every ``K`` of position-free networks (the graded network);
    for bias-free sequence models ``K`` below the first composition degree (``S<=5`` of two
    attention
    layers: one node holding both layers' heads), ``K`` whose truncation holds compositions
    (``S<=9`` of two attention layers) by the feature-space chaos of
    `tensoralg.strategies.chaos.composed` where its estimate fits the budget (each model's
    chaos once, then every pair a dot product; ``backend="torch"``: its dense tensors in
    torch), and the full
    similarity of one attention layer. A ``K`` outside these is refused (estimate it per pair with
    [`degree_similarity`][tensoralg.degree.degree_similarity], which samples it by Monte Carlo with
    its diagnostics).

    Args:
        models: a sequence of ``N >= 1`` networks of the same input and output sizes.
        n_ctx: the sequence length (sequence models; optional when a mask array fixes it).
        max_degree: a positive int or a strictly increasing sequence of them (default
            ``(1, 5)``), at most the models' largest degree.
        cov: the input distribution ``N(0, Σ)`` as in [`tensoralg.inner`][tensoralg.inner].
        backend, device: ``"numpy"`` (default) or ``"torch"`` on ``device`` (CUDA when
            available and ``device`` is None): the larger contractions of the sequence
            models' pairs run there in float64 (the same values up to rounding).
        out, block_size, workers, client, resume, show_progress: any of ``out``,
            ``block_size``, ``workers``, ``client`` selects the blocked path of
            `tensoralg.blocks` (bias-free sequence models, NumPy): the matrix of each ``K`` in
            blocks of ``block_size`` models per side, each block building its models'
            truncations and chaos forms once; with ``out``, the finished blocks of ``K`` are
            kept in ``out/degree_K`` and ``resume=True`` continues an interrupted run (bit for
            bit the same values); ``workers``/``client`` run the blocks on Dask. The entries
            equal the unblocked ones (the same operations per pair).

    Returns:
        [`DegreeSimilarityMatrix`][tensoralg.degree.DegreeSimilarityMatrix] (``r[K]``: the
        ``(N, N)`` similarity matrix).

    Raises:
        ValueError: no models; a bad ``max_degree``, ``n_ctx`` or ``cov``; models of different
            sizes, or sequence models mixed with position-free networks of degree > 1; a ``K``
            that is not exact for some model (named, with why: biases, or both exact engines
            over budget; before any work); a truncation of norm zero.
        CostTooHigh: a model's own pair over the exact path's budget (before the pairs).
    """
    Ks = _check_max_degree(max_degree)
    blocked = any(v is not None for v in (out, block_size, workers, client))
    if blocked and backend != "numpy":
        raise ValueError(f"backend: the blocked path (out=/block_size=/workers=/client=) "
                         f"computes in float64 NumPy, got backend={backend!r}")
    if not isinstance(backend, str) or backend not in ("numpy", "torch"):
        raise ValueError(f"backend: degree_similarity_matrix runs in float64 on 'numpy' or "
                         f"'torch', got {backend!r}")
    req = make_request(n_ctx=n_ctx, cov=cov, backend=backend, device=device)
    if isinstance(models, (Layer, str, bytes, dict)) or not hasattr(models, "__iter__"):
        raise ValueError(f"models: expected a non-empty sequence of networks, got "
                         f"{type(models).__name__}")
    models = list(models)
    if not models:
        raise ValueError("models: expected a non-empty sequence of networks, got an empty one")
    nets = [as_network(m, f"models[{i}]") for i, m in enumerate(models)]
    check_sizes(nets[0], nets[1:], "models", offset=1, ref_name="models[0]")
    seq = any(x.is_sequence_model for x in nets)
    if seq:
        bad = [i for i, x in enumerate(nets) if not x.is_sequence_model and x.degree > 1]
        if bad:
            raise ValueError(f"models[{bad[0]}]: a position-free network of degree > 1 among "
                             f"sequence models (with attention)")
        n_ctx = resolve_n_ctx([(f"models[{i}]", x) for i, x in enumerate(nets)], req.n_ctx)
    elif req.n_ctx is not None:
        raise ValueError("n_ctx: only for sequence models (with attention)")
    nets = [x.astype_float() if x.is_exact else x for x in nets]
    nets = [req.distribution.apply(x, f"models[{i}]", False) for i, x in enumerate(nets)]
    degs = [x.degree for x in nets]
    top = max(degs)
    if max(Ks) > top:
        raise ValueError(f"max_degree: {max(Ks)} is above the models' largest degree {top}")
    if blocked:
        return _blocked_matrix(nets, n_ctx, Ks, seq, req, out=out, block_size=block_size,
                               workers=workers, client=client, resume=resume,
                               show_progress=show_progress)
    grams, notes = {}, {}
    rest = [K for K in Ks if K != 1]
    fos = [homogeneous.unrolled(x, n_ctx, max(Ks)) for x in nets] if seq else []
    feats, feature_ks, first = None, [], {}
    if seq:   # refusals before any work
        for K in rest:
            if top <= K and all(dg == top for dg in degs):
                continue    # one attention layer: the models themselves, tried below
            for i, (f, why) in enumerate(fos):
                if f is None:
                    raise ValueError(_not_exact_message(K, f"models[{i}]", why))
        if all(f is not None for f, _ in fos):
            for K in rest:
                if top <= K and all(dg == top for dg in degs):
                    continue
                trees = [f.tree(set(range(K + 1))) for f, _ in fos]
                try:    # the leg-space engine's own cost check, from shapes
                    sequence_exact._check_own_pairs(trees, n_ctx, make_request(n_ctx=n_ctx),
                                                    position_selector(n_ctx, None, False))
                except CostTooHigh as exc:
                    feature_ks.append(K)
                    first[K] = str(exc)
        if feature_ks:
            unr = [f for f, _ in fos]
            feats = _FeatureParts(unr, n_ctx, max(
                len(t.legs) for f in unr for t in f.tree(set(range(max(feature_ks) + 1)))
                .nodes[0].terms), req.backend, req.device)
            for K in feature_ks:
                try:
                    feats.check(K, f"S<={K}")
                except CostTooHigh as exc:
                    raise ValueError(f"max_degree: S<={K} is not exact here (exact path: "
                                     f"{first[K]}; {exc}); degree_similarity(a, b) estimates "
                                     f"it by Monte Carlo per pair, with its verdict") from None
    if 1 in Ks:
        if seq and all(f is not None for f, _ in fos):   # bias-free: the linear path, exactly
            grams[1] = sequence_exact.tree_gram([f.tree({1}) for f, _ in fos], n_ctx, req.backend, req.device)
        else:
            aff = [homogeneous.affine_part(x, n_ctx) for x in nets]
            grams[1] = np.array([[homogeneous.affine_inner(p, q) for q in aff] for p in aff])
        notes[1] = "exact: affine part (P_0 + J X)"
    if rest and not seq:
        graded = [homogeneous.graded(x, max(rest)) for x in nets]
        plain = make_request()
        for K in rest:
            parts = [x if dg <= K else g.part(set(range(K + 1)))
                     for x, g, dg in zip(nets, graded, degs)]
            grams[K] = np.asarray(engine.gram(plain, parts), dtype=np.float64)
            notes[K] = "exact: graded network of the canonical chain"
    elif rest:
        for K in rest:
            if top <= K and all(dg == top for dg in degs) and any(f is None for f, _ in fos):
                try:    # with biases: the models themselves (one attention layer)
                    grams[K] = sequence_exact.exact_gram_req(make_request(n_ctx=n_ctx), nets)
                    notes[K] = "exact: the models themselves (one attention layer)"
                    continue
                except sequence_exact.AttentionNotSupported:
                    pass
            for i, (f, why) in enumerate(fos):
                if f is None:
                    raise ValueError(_not_exact_message(K, f"models[{i}]", why))
            if K in feature_ks:
                coefs = [feats.coef(i, K) for i in range(len(nets))]
                grams[K] = np.array([[feats.inner(u, v) for v in coefs] for u in coefs])
                notes[K] = FEATURE_HOW
                continue
            try:
                grams[K] = sequence_exact.tree_gram([f.tree(set(range(K + 1))) for f, _ in fos], n_ctx,
                                      req.backend, req.device)
            except CostTooHigh as exc:
                raise ValueError(f"max_degree: S<={K} is not exact here ({exc}); "
                                 f"degree_similarity(a, b) estimates it by Monte Carlo per "
                                 f"pair") from None
            notes[K] = ("exact: the paths of degree <= K unrolled into one node (exact "
                        "attention path)")
    sims = {K: _gram_similarity(grams[K], K) for K in Ks}
    return DegreeSimilarityMatrix(sims, {K: grams[K] for K in Ks}, {K: notes[K] for K in Ks},
                                  req.distribution.describe())


def _blocked_matrix(nets: list, n_ctx: int, Ks: tuple, seq: bool, req, *, out, block_size,
                    workers, client, resume, show_progress) -> DegreeSimilarityMatrix:
    """`degree_similarity_matrix` through `tensoralg.blocks` (one store per ``K``)."""
    from pathlib import Path

    from . import blocks

    if not seq:
        raise ValueError("out=/block_size=/workers=/client=: the blocked S<=K matrix is for "
                         "sequence models (with attention); position-free networks: drop them")
    kw = dict(block_size=blocks.DEFAULT_BLOCK_SIZE if block_size is None else block_size,
              workers=workers, client=client, resume=resume, n_ctx=n_ctx,
              show_progress=show_progress, device="cpu")
    grams = {K: blocks.gram(nets, None if out is None else Path(out) / f"degree_{K}", degree=K,
                            **kw) for K in Ks}
    note = ("exact: the paths of degree <= K unrolled into one node (exact attention path), "
            "in blocks")
    return DegreeSimilarityMatrix({K: _gram_similarity(grams[K], K) for K in Ks}, grams,
                                  dict.fromkeys(Ks, note), req.distribution.describe())

