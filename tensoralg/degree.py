"""Degree-resolved similarity: homogeneous parts and truncations (docs/mathematics.md §3.9,
"Homogeneous parts").

A multilinear network is a polynomial ``f = sum_k P_k`` with ``P_k`` homogeneous of degree
``k`` (unique: a property of the function, not of the weights). For ``m`` larger than the
degree of ``f`` and ``omega = exp(2 pi i / m)``,

    P_k(X) = (1/m) sum_{j<m} omega^{-jk} f(omega^j X)                           (DFT)

(``f(omega^j X) = sum_k omega^{jk} P_k(X)``; the discrete Fourier transform is unitary, so
unlike a real Vandermonde fit it does not amplify rounding). The truncation is
``f_{<=K} = sum_{k<=K} P_k`` and ``S<=K`` the similarity of the two truncations.

``S<=K`` is a DIFFERENT QUESTION from the full similarity, not an approximation of it: it asks
whether two models agree on typical inputs through their low-order paths (the direct path, each
head on its own; from degree 9 the compositions of one layer-2 leg with one layer-1 head).

Exact where the truncation is a network the exact engines compute:

* ``S<=1`` for every model: ``f_{<=1}(X) = P_0 + J X`` with ``P_0 = f(0)`` and the Jacobian
  ``J`` read column by column by the DFT on the basis inputs (rounding only), so
  ``<f_{<=1}^a, f_{<=1}^b> = sum P_0^a P_0^b + sum J^a J^b``.
* position-free networks (bilinear MLPs, residual stacks, biases or not), every ``K``: the
  *graded network* of the canonical chain (:func:`tensoralg.canonical.canonicalize`): each
  lifted bilinear stage ``D((L y~)(R y~))`` of an input ``y = sum_i y_i`` has degree-``k``
  part ``D sum_{i+j=k} (L y~)_i (R y~)_j`` (``(L y~)_0 = L_0 + L y_0`` the constant), one
  bilinear layer whose hidden units are the pairs ``(h, i, j)`` and whose outputs are the
  parts ``y_1 .. y_K`` side by side (parts above ``K`` are dropped: degrees only grow); the
  exact engine of :mod:`tensoralg.engine` computes its inner products.
* sequence models without biases (no lifted constant anywhere) whose ``K`` is below the first
  composition degree: on the folded canonical tree (:func:`tensoralg.canonical.sequence_tree`)
  every term is homogeneous, and the terms of degree ``< K*`` are the *first-order* paths
  ``Lambda_{>l} T_l(Lambda_{<l} X)`` (``Lambda`` the products of the nodes' linear terms, the
  residual stream); ``K*`` is the smallest ``n_2 - 1 + n_1`` over a term of degree ``n_1``
  feeding one leg of a later term of degree ``n_2`` (9 for two attention layers). For
  ``h = X + A1(X)``, ``f = U(h + A2(h))``: ``f_{<=5} = U(X + A1(X) + A2(X))``, one node holding
  both layers' heads, which the exact attention path computes.

Everything else by Monte Carlo (approximate; :func:`_mc`): the radial estimator of
:mod:`tensoralg.strategies.montecarlo` on the truncation. Per direction ``theta`` the parts
``P_k(rho theta)`` come from the DFT (``m`` complex forward passes per input scale, each part
read at the scale of smallest rounding bound) at the typical radius ``rho = sqrt(D)``, and ``f_{<=K}(r theta) = sum_k (r/rho)^k P_k(rho theta)``, so the radial
integral is exact given the chi moments ``E[r^n]`` (antithetic ``±theta``: odd ``k + l``
cancel). The largest exact lower truncation is the control variate (its exact inner products
replace its sample means). Diagnostics as :mod:`tensoralg.strategies.montecarlo` (three
replicates, their agreement, the largest single-direction share — here of the sampled
remainder against the whole sum, so that the exact block does not dilute a heavy tail): an
estimate whose ``reliable`` is False is not an answer.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import engine
from .prepare import _selector
from .strategies import chaos, sequence_exact
from .strategies.executor import torch_backend
from .canonical import (KEY, OUTPUT, QUERY, Leg, Node, Term, Tree, _lift_rows, canonicalize,
                        resolve_n_ctx, sequence_tree)
from .errors import CostTooHigh
from .layers import Bilinear, Layer, Linear, Sequential, as_network
from .prepare import check_pair, check_sizes
from .request import make_request
from .results import similarity_from
from .strategies.montecarlo import (MC_CHUNK_ELEMENTS, MonteCarloEstimate, _verdict,
                                    check_sampling_cost, inner_diagnostics, ratio_diagnostics,
                                    ratio_estimate, warn_few)

__all__ = ["degree_similarity", "degree_similarity_matrix", "homogeneous_parts",
           "DegreeSimilarity", "DegreeSimilarityMatrix", "DEGREE_DEFAULT_SAMPLES"]

#: Default number of Monte Carlo directions of :func:`degree_similarity` (each costs
#: ``3 m`` complex forward passes per model, ``m = degree + 1``).
DEGREE_DEFAULT_SAMPLES = 3_000

_DISCLAIMER = ("S<=K is the similarity of the degree-<=K truncations f_<=K = sum_{k<=K} P_k: a "
               "different question (similarity on typical inputs through the low-order paths), "
               "not an approximation of the full similarity")


# ----------------------------------------------------------------------------------------
# homogeneous parts by the DFT (evaluation)
# ----------------------------------------------------------------------------------------

#: Input scales of the DFT (:func:`_dft_parts`): each part is read at the scale with the
#: smallest rounding bound.
DFT_SCALES = (4.0, 1.0, 0.25, 0.0625, 0.015625)


def _dft_once(net: Layer, X: np.ndarray, m: int):
    w = np.exp(2j * np.pi * np.arange(m) / m)
    Z = (w.reshape((m,) + (1,) * X.ndim) * X[None]).reshape((m * X.shape[0],) + X.shape[1:])
    F = np.asarray(net(Z))
    F = F.reshape((m, X.shape[0]) + F.shape[1:])
    size = np.abs(F).reshape(m, X.shape[0], -1).max(axis=(0, 2))        # (n,)
    return (np.fft.fft(F, axis=0) / m).real, size


def _dft_parts(net: Layer, X: np.ndarray, m: int, scales=DFT_SCALES,
               with_bound: bool = False):
    """``(m, n, ...)``: ``P_k(X)`` for ``k < m`` (``m`` > degree), the real part of the DFT.

    Homogeneity, ``P_k(X) = lam^{-k} P_k(lam X)``: each part is read at the scale ``lam`` of
    ``scales`` with the smallest rounding bound ``lam^{-k} max_j |f(omega^j lam X)|`` (the DFT's
    absolute error is about ``eps`` times that), per input: a part far below the dominant one
    at ``X`` is read where it is not."""
    best = err = None
    k = np.arange(m, dtype=np.float64)
    for lam in scales:
        P, size = _dft_once(net, lam * X, m)
        inv = lam ** -k                                            # (m,)
        e = inv[:, None] * size[None, :]                           # (m, n)
        P = P * inv.reshape((m,) + (1,) * (P.ndim - 1))
        if best is None:
            best, err = P, e
            continue
        take = e < err
        best = np.where(take.reshape(take.shape + (1,) * (P.ndim - 2)), P, best)
        err = np.minimum(e, err)
    return (best, err) if with_bound else best


def homogeneous_parts(net: Any, X: Any, *, m: int | None = None) -> np.ndarray:
    """The homogeneous parts ``P_k(X)``, ``k = 0 .. m - 1``, of a network at inputs ``X``
    (docs/mathematics.md §3.9): ``P_k(X) = (1/m) sum_{j<m} omega^{-jk} f(omega^j X)``,
    ``omega = e^{2 pi i/m}``, from ``m`` complex forward passes per input scale (float64
    rounding only; the DFT is unitary). Each part is read at the scale ``lam`` of
    :data:`DFT_SCALES` with the smallest rounding bound (``P_k(X) = lam^{-k} P_k(lam X)``), so
    a low-degree part under a dominant high-degree one keeps its digits.

    Args:
        net: a network (position-free or a sequence model).
        X: ``(n, d)`` (or ``(n, n_ctx, d)`` for a sequence model), real.
        m: number of DFT points, ``> net.degree`` (default ``net.degree + 1``).

    Returns:
        float64 array ``(m, n, d_out)`` (``(m, n, n_ctx, d_out)``); ``sum_k P_k = f(X)``.

    Raises:
        ValueError: ``m`` not an int above the degree; complex ``X``.
    """
    net = as_network(net, "net")
    if net.is_exact:
        net = net.astype_float()
    deg = net.degree
    if m is None:
        m = deg + 1
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m <= deg:
        raise ValueError(f"m: expected an int > the degree {deg} (else degrees alias), got {m!r}")
    X = np.asarray(X)
    if np.iscomplexobj(X):
        raise ValueError("X: expected real inputs (the parts of complex inputs are not real)")
    return _dft_parts(net, np.asarray(X, dtype=np.float64), int(m))


# ----------------------------------------------------------------------------------------
# S<=1: the affine part of any model
# ----------------------------------------------------------------------------------------

def _affine_part(net: Layer, n_ctx: int | None):
    """``(P_0, J)``: ``P_0`` the constant ``(n_ctx, out)`` (``(1, out)`` position-free) and
    ``J`` ``(n_ctx * d, n_ctx, out)`` the degree-1 part on the basis inputs (DFT)."""
    d = net.in_features
    if n_ctx is None:
        E = np.eye(d)
        c = np.asarray(net(np.zeros((1, d))), dtype=np.float64)
        J = _dft_parts(net, E, net.degree + 1)[1]
        return c, J[:, None, :]
    E = np.eye(n_ctx * d).reshape(n_ctx * d, n_ctx, d)
    c = np.asarray(net(np.zeros((1, n_ctx, d))), dtype=np.float64)[0]
    P, bound = _dft_parts(net, E, net.degree + 1, with_bound=True)
    J = P[1]
    # below the DFT's rounding (eps times the largest value it summed, times m): an exact
    # zero of the function cannot be told from it, and is not reported as a linear part
    noise = 4 * (net.degree + 1) * np.finfo(np.float64).eps * bound[1]
    J[np.abs(J).reshape(len(J), -1).max(axis=1) <= noise] = 0.0
    return c, J


def _affine_inner(pa, pb) -> float:
    return float(np.sum(pa[0] * pb[0]) + np.sum(pa[1] * pb[1]))


# ----------------------------------------------------------------------------------------
# position-free: the graded network of the canonical chain
# ----------------------------------------------------------------------------------------

@dataclass
class _Graded:
    """Stages whose output holds the parts ``y_k`` (``k`` in ``blocks``) side by side, the
    constant part ``y0`` and the output width ``out``."""

    layers: list
    blocks: list
    y0: np.ndarray
    out: int

    def part(self, ks) -> Layer:
        """``sum_{k in ks} P_k`` (the constant ``P_0`` when 0 is in ``ks``) as a network."""
        nb = len(self.blocks)
        W = np.zeros((self.out, nb * self.out))
        for b, k in enumerate(self.blocks):
            if k in ks:
                W[:, b * self.out:(b + 1) * self.out] = np.eye(self.out)
        head = Linear(W, self.y0 if 0 in ks else None)
        return Sequential(self.layers + [head]) if self.layers else head


def _graded(net: Layer, K: int) -> _Graded:
    """The graded network of ``net`` up to degree ``K`` (module docstring)."""
    can = canonicalize(net.astype_float() if net.is_exact else net, keep_embed=False)
    if not can.stages:
        lin = np.asarray(can.linear, dtype=np.float64)
        return _Graded([Linear(lin[1:, 1:])], [1], lin[1:, 0].copy(), can.out)
    n = can.d
    blocks, y0 = [1], np.zeros(n)
    layers = []
    for st in can.stages:
        L, R, D = (np.asarray(a, dtype=np.float64) for a in (st.L, st.R, st.D))
        H1 = L.shape[0]
        out = D.shape[0] - 1
        l0, r0 = L[:, 0] + L[:, 1:] @ y0, R[:, 0] + R[:, 1:] @ y0
        degs = [0] + blocks
        pairs = [(i, j) for i in degs for j in degs if 1 <= i + j <= K]
        new = sorted({i + j for i, j in pairs})
        nb = len(blocks)
        left = np.zeros((len(pairs) * H1, nb * n))
        right = np.zeros_like(left)
        lb = np.zeros(len(pairs) * H1)
        rb = np.zeros_like(lb)
        down = np.zeros((len(new) * out, len(pairs) * H1))
        for p, (i, j) in enumerate(pairs):
            rows = slice(p * H1, (p + 1) * H1)
            for M, b, deg, w0 in ((left, lb, i, l0), (right, rb, j, r0)):
                if deg == 0:
                    b[rows] = w0
                else:
                    c = blocks.index(deg)
                    M[rows, c * n:(c + 1) * n] = (L if M is left else R)[:, 1:]
            o = new.index(i + j)
            down[o * out:(o + 1) * out, rows] = D[1:, :]
        layers.append(Bilinear(left, right, down, lb, rb))
        y0 = D[1:, :] @ (l0 * r0)
        blocks, n = new, out
    return _Graded(layers, blocks, y0, can.out)


# ----------------------------------------------------------------------------------------
# sequence models: first-order paths of a bias-free canonical tree
# ----------------------------------------------------------------------------------------

@dataclass
class _Unrolled:
    """The unrolled paths of a bias-free tree: ``terms[k]`` the one-node terms of degree ``k``
    (``k = 1``: the linear path), every path of degree at most the cap; ``degrees``: the
    degrees up to the cap that a part can have (the others vanish exactly)."""

    terms: dict
    degrees: set
    d_in: int
    d_out: int
    n_ctx: int

    def tree(self, ks) -> Tree | None:
        terms = [t for k in sorted(self.terms) if k in ks for t in self.terms[k]]
        if not terms:
            return None
        return Tree([Node(terms, self.d_in, self.d_out)], self.d_in, self.d_out, self.n_ctx,
                    False, False)


def _linear_W(node: Node, D: int, d_out: int) -> np.ndarray:
    """The sum of a node's linear terms (plain legs at ``t``): ``(d_out, D)``."""
    W = np.zeros((d_out, D))
    for t in node.terms:
        if t.kind == "linear":
            W = W + t.legs[0].weight
    return W


def _pad(a: np.ndarray, axis: int, size: int) -> np.ndarray:
    if a.shape[axis] == size:
        return a
    width = [(0, 0)] * a.ndim
    width[axis] = (0, size - a.shape[axis])
    return np.pad(a, width)


def _merge_attention(terms: list, n_ctx: int) -> list:
    """Attention terms whose mask cores are proportional, merged into one term with their
    heads side by side (the ratio folded into the output core ``O``; head, value sizes padded
    with zeros; a RoPE leg beside a plain one makes both positional): one attention layer
    holding every layer's heads (docs/mathematics.md §3.9). Others are kept as they are."""
    att = [t for t in terms if t.kind == "attention"]
    rest = [t for t in terms if t.kind != "attention"]
    groups: list = []
    for t in att:
        M = dict((lab, a) for a, lab in t.cores)[(QUERY, KEY)]
        for g in groups:
            R = g[0]
            nz = R != 0
            if np.array_equal(nz, M != 0) and nz.any():
                ratio = M[nz] / R[nz]
                if np.allclose(ratio, ratio[0], rtol=1e-14, atol=0):
                    g[1].append((t, float(ratio[0])))
                    break
        else:
            groups.append((M, [(t, 1.0)]))
    out = list(rest)
    for M, members in groups:
        if len(members) == 1:
            out.append(members[0][0])
            continue
        names = [leg.name for leg in members[0][0].legs]
        legs = []
        for k, name in enumerate(names):
            ls = [t.legs[k] for t, _ in members]
            positional = any(leg.positional for leg in ls)
            size = max(leg.weight.shape[-2] for leg in ls)
            ws = []
            for leg in ls:
                w = _pad(leg.weight, -2, size)
                if positional and not leg.positional:
                    w = np.broadcast_to(w, (n_ctx,) + w.shape).copy()
                ws.append(w)
            legs.append(Leg(name, np.concatenate(ws, axis=-3), ls[0].labels, ls[0].pos,
                            positional))
        vsize = max(dict((lab, a) for a, lab in t.cores)[(OUTPUT, "h", "v")].shape[2]
                    for t, _ in members)
        Os = [c * _pad(dict((lab, a) for a, lab in t.cores)[(OUTPUT, "h", "v")], 2, vsize)
              for t, c in members]
        cores = ((np.concatenate(Os, axis=1), (OUTPUT, "h", "v")), (M, (QUERY, KEY)))
        out.append(Term("attention", tuple(legs), cores, members[0][0].out))
    return out


def _renamed(term: Term, j: int, pos: str, link: str) -> Term:
    """``term`` (an element of the expansion, over the network input) substituted into leg
    ``j`` of a later term: its query position becomes the leg's position ``pos``, its output
    label the link label ``link``, every other label (internal indices, key positions) gets
    the suffix ``_j`` so that it stays apart from the outer term's."""
    def ren(x):
        if x == QUERY:
            return pos
        if x == OUTPUT:
            return link
        return f"{x}_{j}"
    legs = tuple(Leg(leg.name, leg.weight, tuple(ren(x) for x in leg.labels), ren(leg.pos),
                     leg.positional) for leg in term.legs)
    cores = tuple((a, tuple(ren(x) for x in lab)) for a, lab in term.cores)
    return Term(term.kind, legs, cores, term.out)


def _symmetrized(t: Term) -> Term:
    """A bilinear term ``D((L y)(R y))`` as the same function with ``L' = [L; R]``,
    ``R' = [R; L]`` and ``D' = [D, D] / 2`` (hidden label ``h``), symmetric in its two legs."""
    (L, R), (D, lab) = [leg.weight for leg in t.legs], t.cores[0]
    ax = lab.index("h")
    legs = (t.legs[0].with_weight(np.concatenate([L, R], axis=0)),
            t.legs[1].with_weight(np.concatenate([R, L], axis=0)))
    return Term(t.kind, legs, ((np.concatenate([D, D], axis=ax) / 2, lab),), t.out)


def _compose(t: Term, choice: tuple, lam: np.ndarray) -> Term:
    """Term ``t`` of a node with each leg ``j`` reading either the linear part of the node's
    input (``choice[j]`` None: the leg's weight times the lifted linear map ``lam``) or one
    non-linear element of the expansion (``choice[j]`` a Term over the network input: its
    output contracted with the leg's non-constant columns, a new core)."""
    if all(c is None for c in choice):
        return Term(t.kind, tuple(leg.with_weight(leg.weight @ lam) for leg in t.legs),
                    t.cores, t.out)
    legs, cores = [], list(t.cores)
    for j, (leg, c) in enumerate(zip(t.legs, choice)):
        if c is None:
            legs.append(leg.with_weight(leg.weight @ lam))
            continue
        link = f"c_{j}"
        w = leg.weight[..., 1:]
        cores.append((w, ((leg.pos,) if leg.positional else ()) + leg.labels + (link,)))
        inner = _renamed(c, j, leg.pos, link)
        legs.extend(inner.legs)
        cores.extend(inner.cores)
    return Term("composed", tuple(legs), tuple(cores), t.out)


def _unrolled(net: Layer, n_ctx: int, cap: int) -> tuple[_Unrolled | None, str]:
    """Every homogeneous path of ``net`` of degree at most ``cap`` as terms of one node
    (module docstring), or ``(None, why not)``: the folded canonical tree of a bias-free
    model unrolled node by node — each leg of each term reads either the linear part of its
    input (the residual stream) or one non-linear term of the expansion so far, and a term
    whose legs read terms of degrees ``n_j`` has degree ``sum n_j`` (homogeneous: no lifted
    constant anywhere)."""
    tree = sequence_tree(net, n_ctx, "net", fold=True)
    tree = tree.map(lambda a: np.asarray(a, dtype=np.float64)) if tree.exact else tree
    for node in tree.nodes:
        for t in node.terms:
            if t.kind == "linear" and (len(t.legs) != 1 or t.legs[0].positional
                                        or t.legs[0].pos != QUERY):
                return None, "a linear term outside the canonical form"
            if any(leg.can_cap for leg in t.legs):
                return None, ("biases (a lifted constant) make the truncation a sum over "
                              "lower-degree compositions, not one attention layer")
    lam = np.eye(tree.d_in + 1)[1:]   # the linear part of the expansion: (d, D_0)
    nonlin: list = []                 # (degree, Term over the network input)
    for node in tree.nodes:
        lifted = _lift_rows(lam, False)
        W = _linear_W(node, node.d_in + 1, node.d_out)
        new = [(k, c.project_output(W[:, 1:])) for k, c in nonlin]
        options = [(0, None)] + nonlin   # degree 0 stands for the linear part (degree 1)
        for t in node.terms:
            if t.kind == "linear":
                continue
            if t.kind == "bilinear" and nonlin:
                # symmetrized, (L h)(R h) = (L' h)(R' h) with L' = [L; R], R' = [R; L] and half
                # of D twice: the legs read the same input, so a pair of choices and its swap
                # are one term, counted twice (a quarter of the joined pairs to contract)
                t = _symmetrized(t)
                for c1, c2 in itertools.combinations_with_replacement(range(len(options)), 2):
                    k = max(1, options[c1][0]) + max(1, options[c2][0])
                    if k <= cap:
                        term = _compose(t, (options[c1][1], options[c2][1]), lifted)
                        if c1 != c2:
                            term = term.project_output(2.0 * np.eye(node.d_out))
                        new.append((k, term))
                continue
            for choice in itertools.product(options, repeat=t.degree):
                k = sum(max(1, c[0]) for c in choice)
                if k <= cap:
                    new.append((k, _compose(t, tuple(c[1] for c in choice), lifted)))
        lam = W @ lifted
        nonlin = new
    terms = {1: [Term("linear", (Leg("W", lam, (OUTPUT,), QUERY),), (), (QUERY, OUTPUT))]}
    for k, t in nonlin:
        terms.setdefault(k, []).append(t)
    terms = {k: _merge_attention(v, n_ctx) for k, v in terms.items()}
    return _Unrolled(terms, set(terms), tree.d_in, tree.d_out, n_ctx), ""


def _configurations_bound(pa: Tree, pb: Tree) -> int:
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


def _check_bound(pa: Tree, pb: Tree) -> None:
    from .request import DEFAULT_MAX_CONFIGURATIONS

    n = _configurations_bound(pa, pb)
    if n > DEFAULT_MAX_CONFIGURATIONS:
        legs = max(x.degree for x in pa.nodes[0].terms) + max(y.degree for y in pb.nodes[0].terms)
        raise CostTooHigh(f"the exact path would contract about {n:.3g} Wick configurations "
                          f"(up to {legs} legs joined), over max_configurations="
                          f"{DEFAULT_MAX_CONFIGURATIONS:,}")


def _tree_inner(pa: Tree, pb: Tree, n_ctx: int) -> float:
    _check_bound(pa, pb)
    return float(sequence_exact.tree_inner_req(make_request(n_ctx=n_ctx), pa, pb, n_ctx))


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
            :class:`~tensoralg.strategies.montecarlo.MonteCarloEstimate` (APPROXIMATE, with
            ``stderr`` and ``reliable``) where estimated.
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

    def keys(self):
        return self.values.keys()

    def exact(self, K) -> bool:
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
# Monte Carlo on the truncations
# ----------------------------------------------------------------------------------------

def _chi_ratio(D: int, n: int, rho: float) -> float:
    """``E[r^n] / rho^n`` for ``r ~ chi_D``."""
    return math.exp(0.5 * n * math.log(2) + math.lgamma((D + n) / 2) - math.lgamma(D / 2)
                    - n * math.log(rho))


#: Input scales of the Monte Carlo DFT (fewer than :data:`DFT_SCALES`: 3 x (degree + 1)
#: forward passes per direction and model).
MC_SCALES = (1.0, 0.125, 0.015625)


def _mc(na, nb, n_ctx, Ks, exact_lower, n_samples, seed, kmax_profile, need=(None, None),
        chunk=4096):
    """Per-direction triples for each ``K`` in ``Ks`` and per-degree norms (radial estimator on
    the DFT parts). ``exact_lower[K] = (K0, (ab, aa, bb))``: the control variate; ``need``:
    per model the degrees whose norm is wanted (None: all up to ``kmax_profile``)."""
    d = na.in_features
    shape = (d,) if n_ctx is None else (n_ctx, d)
    D = int(np.prod(shape))
    rho = math.sqrt(D)
    ma, mb = na.degree + 1, nb.degree + 1
    kk = max(max(Ks), kmax_profile)
    ka, kb = min(kk, na.degree), min(kk, nb.degree)
    c = np.array([_chi_ratio(D, n, rho) if n % 2 == 0 else 0.0 for n in range(2 * kk + 1)])
    rng = np.random.default_rng(seed)
    out = (n_ctx or 1) * na.out_features
    # directions per chunk: at most ``chunk`` evaluations and about MC_CHUNK_ELEMENTS complex
    # entries of input or output per DFT (a (64, 256) context took 12 GB at 682 a chunk)
    size = max(1, min(chunk // max(ma, mb), MC_CHUNK_ELEMENTS // (max(ma, mb) * max(D, out))))
    trip = {K: [] for K in Ks}
    cv = {K: [] for K in exact_lower}
    prof = ([], [])
    done = 0
    while done < n_samples:
        s = min(size, n_samples - done)
        u = rng.standard_normal((s, D))
        u *= rho / np.linalg.norm(u, axis=1, keepdims=True)
        X = u.reshape((s,) + shape)
        Pa = _dft_parts(na, X, ma, MC_SCALES)[:ka + 1].reshape(ka + 1, s, -1)
        Pb = _dft_parts(nb, X, mb, MC_SCALES)[:kb + 1].reshape(kb + 1, s, -1)
        Gab = np.einsum("ksx,lsx->skl", Pa, Pb)
        Gaa = np.einsum("ksx,lsx->skl", Pa, Pa)
        Gbb = np.einsum("ksx,lsx->skl", Pb, Pb)

        def trunc(G, K):
            i = np.arange(min(K, G.shape[1] - 1) + 1)
            j = np.arange(min(K, G.shape[2] - 1) + 1)
            C = c[i[:, None] + j[None, :]]
            return np.einsum("skl,kl->s", G[:, :i.size, :j.size], C)

        for K in Ks:
            trip[K].append(np.stack([trunc(Gab, K), trunc(Gaa, K), trunc(Gbb, K)]))
        for K, (K0, _) in exact_lower.items():
            cv[K].append(np.stack([trunc(Gab, K0), trunc(Gaa, K0), trunc(Gbb, K0)]))
        for side, G, kx in ((0, Gaa, ka), (1, Gbb, kb)):
            k = np.arange(min(kx, kmax_profile) + 1)
            prof[side].append(G[:, k, k] * c[2 * k][None, :])
        done += s
    out = {}
    for K in Ks:
        P = np.concatenate(trip[K], axis=1)
        raw = P
        if K in exact_lower:
            rem = P - np.concatenate(cv[K], axis=1)      # the sampled remainder
            P = rem + np.asarray(exact_lower[K][1])[:, None]
        else:
            rem = P
        est = ratio_estimate(P.sum(axis=1), P @ P.T, P.shape[1])
        diag = ratio_diagnostics(P)
        # the largest share is one direction's remainder against the whole sum (the exact
        # block is not sampled, so it must not dilute a heavy-tailed remainder); the certified
        # lower bounds come from the raw (non-negative) per-direction norms
        tot = np.abs(raw).sum(axis=1)
        share = float(max(np.abs(rem[i]).max() / tot[i] if tot[i] > 0 else 1.0
                          for i in range(3)))
        diag = _verdict(list(diag.replicates), share, {"<a,a>": raw[1], "<b,b>": raw[2]})
        out[K] = MonteCarloEstimate(float(est), est.stderr, P.shape[1], diag)
    profs = []
    for side in (0, 1):
        Z = np.concatenate(prof[side], axis=0)
        ks = [k for k in range(Z.shape[1]) if need[side] is None or k in need[side]]
        profs.append({k: MonteCarloEstimate(float(Z[:, k].mean()),
                                            float(Z[:, k].std(ddof=1) / math.sqrt(Z.shape[0])),
                                            Z.shape[0], inner_diagnostics(Z[:, k], "<P,P>"))
                      for k in ks})
    return out, profs


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
    if any(b <= a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"max_degree: expected strictly increasing degrees, got {max_degree!r}")
    return tuple(int(k) for k in vals)


def degree_similarity(a: Any, b: Any, *, n_ctx: int | None = None,
                      max_degree: Any = None, cov: Any = None,
                      n_samples: int = DEGREE_DEFAULT_SAMPLES, seed: int = 0) -> DegreeSimilarity:
    """Degree-resolved similarity ``S<=K`` of two networks, for each ``K`` in ``max_degree``,
    and the profiles ``||P_k||^2`` (docs/mathematics.md §3.9, "Homogeneous parts").

    ``f = sum_k P_k`` with ``P_k`` the homogeneous degree-``k`` part (a property of the
    function); ``S<=K = <f_{<=K}^a, f_{<=K}^b> / (||f_{<=K}^a|| ||f_{<=K}^b||)`` with
    ``f_{<=K} = sum_{k<=K} P_k``, under the Gaussian metric (sums over outputs and query
    positions). ``S<=K`` is a DIFFERENT QUESTION from the full similarity — the similarity on
    typical inputs through the low-order paths — not an approximation of it; for ``K`` at or
    above both degrees it is the full similarity.

    Exact (float64): ``S<=1`` for every model; every ``K`` for position-free networks (the
    graded network of the canonical chain); for bias-free sequence models below the first
    composition degree (``S<=5`` of two attention layers: one node holding both layers'
    heads, by the exact attention path). Otherwise a Monte Carlo estimate (APPROXIMATE): the
    radial estimator on the DFT parts with the largest exact lower truncation as control
    variate, with ``stderr`` and reliability diagnostics (module docstring of
    :mod:`tensoralg.degree`).

    Args:
        a, b: networks with the same input and output sizes (sequence models: inputs
            ``(n, n_ctx, d)``).
        n_ctx: the sequence length (sequence models; optional when a mask array fixes it).
        max_degree: a positive int or a strictly increasing sequence of them, at most the
            models' degree (``S<=degree`` is the full similarity); None: those of
            :data:`DEFAULT_MAX_DEGREE` below the degree, and the degree itself when it is at
            most 9 (so that a shallow model's report ends with its full similarity).
        cov: the input distribution ``N(0, Σ)`` as in :func:`tensoralg.inner` (folded into the
            models: ``P_k ∘ K`` are the parts of ``f ∘ K``).
        n_samples: Monte Carlo directions (each ``3 (degree + 1)`` complex forward passes per
            model: the DFT at the scales :data:`MC_SCALES`).
        seed: the Monte Carlo seed (numpy ``default_rng``).

    Returns:
        :class:`DegreeSimilarity` (``r[K]``: a float or a ``MonteCarloEstimate``; ``r.method``,
        ``r.notes``, ``r.profile_a``, ``r.profile_b``; its ``repr`` says what is exact).

    Raises:
        ValueError: a bad ``max_degree`` (or one above both models' degree), ``n_ctx``,
            ``cov``, ``n_samples`` or ``seed``;
            models of different input/output sizes; a sequence model compared with a
            position-free network; (after the exact work) a truncation of norm zero.
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
    fo = [_unrolled(x, n_ctx, kprof) for x in (na, nb)] if seq else [(None, "")] * 2
    if fo[0][0] is not None and fo[1][0] is not None:
        # bias-free: P_0 = 0 and P_1 is the unrolled linear path, contracted exactly
        t1 = [f.tree({1}) for f, _ in fo]
        exact_ip[1] = (_tree_inner(t1[0], t1[1], n_ctx), _tree_inner(t1[0], t1[0], n_ctx),
                       _tree_inner(t1[1], t1[1], n_ctx))
        for side in (0, 1):
            prof[side][0], prof[side][1] = 0.0, float(exact_ip[1][1 + side])
    elif seq:   # with biases: the affine part read by the DFT (position-free: graded, below)
        aff = (_affine_part(na, n_ctx), _affine_part(nb, n_ctx))
        for side, p in enumerate(aff):
            prof[side][0] = float(np.sum(p[0] ** 2))
            prof[side][1] = float(np.sum(p[1] ** 2))
        exact_ip[1] = (_affine_inner(aff[0], aff[1]), _affine_inner(aff[0], aff[0]),
                       _affine_inner(aff[1], aff[1]))
    why = {}

    if not seq:
        Kmax = min(max(Ks), max(deg_a, deg_b))
        ga, gb = _graded(na, Kmax), _graded(nb, Kmax)
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
                ta = na if K >= deg_a else ga.part(set(range(K + 1)))
                tb = nb if K >= deg_b else gb.part(set(range(K + 1)))
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
        for K in Ks:
            if K == 1:
                continue
            if fo[0][0] is None or fo[1][0] is None:
                why[K] = (fo[0][1] or fo[1][1])
                continue
            f0, f1 = fo[0][0], fo[1][0]
            key = tuple(frozenset(k for k in f.degrees if k <= K) for f in (f0, f1))
            if key in done:
                exact_ip[K] = done[key]
                continue
            ks = set(range(K + 1))
            try:
                pa, pb = f0.tree(ks), f1.tree(ks)
                exact_ip[K] = done[key] = (_tree_inner(pa, pb, n_ctx), _tree_inner(pa, pa, n_ctx),
                                           _tree_inner(pb, pb, n_ctx))
            except (CostTooHigh, sequence_exact.AttentionNotSupported) as exc:
                why[K] = f"exact path refused: {exc}"
        for K in Ks:
            if K in exact_ip or K < max(deg_a, deg_b) or (fo[0][0] and fo[1][0]):
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
                else:
                    t = f.tree({k})
                    try:
                        prof[side][k] = _tree_inner(t, t, n_ctx)
                    except CostTooHigh:
                        pass        # estimated below

    for K in Ks:
        if K in exact_ip:
            ab, aa, bb = exact_ip[K]
            values[K] = similarity_from(ab, aa, bb, False, what=f"<={K}")
            method[K] = "exact"
            notes[K] = "exact: affine part (P_0 + J X)" if K == 1 else (
                "exact: the models themselves" if K >= max(deg_a, deg_b) else how)
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
        mc_vals, mc_prof = _mc(na, nb, n_ctx, todo or [min(Ks)], lower, n_samples, seed, kprof,
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
    it: :class:`DegreeSimilarity`).

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

    def keys(self):
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


def _tree_gram(trees: list, n_ctx: int, backend: str = "numpy", device: Any = None
               ) -> np.ndarray:
    """The exact Gram matrix of one-node float64 trees (linear and attention terms), each
    model's chaos form (:class:`~tensoralg.strategies.chaos.sequence.TermSide`) built once per
    side, then every unordered pair (:func:`~tensoralg.strategies.chaos.sequence.chaos_pair`);
    the cost of each model's own pair is checked first (CostTooHigh)."""
    req = make_request(n_ctx=n_ctx)
    sel = _selector(n_ctx, None, False)
    for t in trees:
        _check_bound(t, t)
        sequence_exact.check_cost(req, t, t, n_ctx, (), sel, "chaos")
    N = len(trees)
    G = np.zeros((N, N))
    with torch_backend(backend, device, "degree_similarity_matrix"):
        sides = [{s: [chaos.TermSide(x, s, np.einsum, n_ctx, False)
                      for x in t.nodes[0].terms] for s in ("a", "b")} for t in trees]
        for i in range(N):
            for j in range(i, N):
                total = 0.0
                for x in sides[i]["a"]:
                    for y in sides[j]["b"]:
                        val, _ = chaos.chaos_pair(x, y, sel, (), np.einsum,
                                                       req.max_configurations)
                        if val is not None:
                            total += float(val)
                G[i, j] = G[j, i] = total
    return G


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
                             backend: str = "numpy", device: Any = None
                             ) -> DegreeSimilarityMatrix:
    """The exact ``S<=K`` matrices of ``N`` models (e.g. the checkpoints of a training run),
    for each ``K`` in ``max_degree``: each model's truncation and chaos form once, then the
    ``N (N + 1) / 2`` pairs (docs/mathematics.md §3.9, "Homogeneous parts").

    Exact only, as :func:`degree_similarity` computes them: ``S<=1`` for every model (the
    affine part); every ``K`` of position-free networks (the graded network); for bias-free
    sequence models ``K`` below the first composition degree (``S<=5`` of two attention
    layers: one node holding both layers' heads), and the full similarity of one attention
    layer. A ``K`` outside these is refused (estimate it per pair with
    :func:`degree_similarity`, which samples it by Monte Carlo with its diagnostics).

    Args:
        models: a sequence of ``N >= 1`` networks of the same input and output sizes.
        n_ctx: the sequence length (sequence models; optional when a mask array fixes it).
        max_degree: a positive int or a strictly increasing sequence of them (default
            ``(1, 5)``), at most the models' largest degree.
        cov: the input distribution ``N(0, Σ)`` as in :func:`tensoralg.inner`.
        backend, device: ``"numpy"`` (default) or ``"torch"`` on ``device`` (CUDA when
            available and ``device`` is None): the larger contractions of the sequence
            models' pairs run there in float64 (the same values up to rounding).

    Returns:
        :class:`DegreeSimilarityMatrix` (``r[K]``: the ``(N, N)`` similarity matrix).

    Raises:
        ValueError: no models; a bad ``max_degree``, ``n_ctx`` or ``cov``; models of different
            sizes, or sequence models mixed with position-free networks of degree > 1; a ``K``
            that is not exact for some model (named, with why); a truncation of norm zero.
        CostTooHigh: a model's own pair over the exact path's budget (before the pairs).
    """
    Ks = _check_max_degree(max_degree)
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
    grams, notes = {}, {}
    rest = [K for K in Ks if K != 1]
    fos = [_unrolled(x, n_ctx, max(Ks)) for x in nets] if seq else []
    if 1 in Ks:
        if seq and all(f is not None for f, _ in fos):   # bias-free: the linear path, exactly
            grams[1] = _tree_gram([f.tree({1}) for f, _ in fos], n_ctx, req.backend, req.device)
        else:
            aff = [_affine_part(x, n_ctx) for x in nets]
            grams[1] = np.array([[_affine_inner(p, q) for q in aff] for p in aff])
        notes[1] = "exact: affine part (P_0 + J X)"
    if rest and not seq:
        graded = [_graded(x, max(rest)) for x in nets]
        plain = make_request()
        for K in rest:
            parts = [x if K >= dg else g.part(set(range(K + 1)))
                     for x, g, dg in zip(nets, graded, degs)]
            grams[K] = np.asarray(engine.gram(plain, parts), dtype=np.float64)
            notes[K] = "exact: graded network of the canonical chain"
    elif rest:
        for K in rest:
            if K >= top and all(dg == top for dg in degs) and any(f is None for f, _ in fos):
                try:    # with biases: the models themselves (one attention layer)
                    grams[K] = sequence_exact.exact_gram_req(make_request(n_ctx=n_ctx), nets)
                    notes[K] = "exact: the models themselves (one attention layer)"
                    continue
                except sequence_exact.AttentionNotSupported:
                    pass
            for i, (f, why) in enumerate(fos):
                if f is None:
                    raise ValueError(f"max_degree: S<={K} is not exact for models[{i}] ({why}); "
                                     f"degree_similarity(a, b) estimates it by Monte Carlo "
                                     f"per pair")
            try:
                grams[K] = _tree_gram([f.tree(set(range(K + 1))) for f, _ in fos], n_ctx,
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
