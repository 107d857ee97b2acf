"""Homogeneous parts of a network and the networks of its truncations (docs/mathematics.md
§3.9, "Homogeneous parts"): tree transformations beside the canonical tree
(`tensoralg.canonical`), read by `tensoralg.degree`.

A multilinear network is a polynomial ``f = sum_k P_k`` with ``P_k`` homogeneous of degree
``k`` (unique: a property of the function, not of the weights). For ``m`` larger than the
degree of ``f`` and ``omega = exp(2 pi i / m)``,

    P_k(X) = (1/m) sum_{j<m} omega^{-jk} f(omega^j X)                           (DFT)

(``f(omega^j X) = sum_k omega^{jk} P_k(X)``; the discrete Fourier transform is unitary, so
unlike a real Vandermonde fit it does not amplify rounding): `homogeneous_parts`,
`dft_parts`; the affine part ``P_0 + J X`` of any model, ``J`` read column by column on
the basis inputs: `affine_part`.

* `graded` — position-free networks: the *graded network* of the canonical chain
  (`tensoralg.canonical.canonicalize`): each lifted bilinear stage ``D((L y~)(R y~))`` of
  an input ``y = sum_i y_i`` has degree-``k`` part ``D sum_{i+j=k} (L y~)_i (R y~)_j``
  (``(L y~)_0 = L_0 + L y_0`` the constant), one bilinear layer whose hidden units are the pairs
  ``(h, i, j)`` and whose outputs are the parts ``y_1 .. y_K`` side by side (parts above ``K``
  are dropped: degrees only grow); `Graded.part` is the network of a sum of parts.
* `unrolled` — sequence models without biases (no lifted constant anywhere): on the
  folded canonical tree (`tensoralg.canonical.sequence_tree`) every term is homogeneous,
  and the terms of degree ``< K*`` are the *first-order* paths ``Lambda_{>l} T_l(Lambda_{<l}
  X)`` (``Lambda`` the products of the nodes' linear terms, the residual stream); ``K*`` is the
  smallest ``n_2 - 1 + n_1`` over a term of degree ``n_1`` feeding one leg of a later term of
  degree ``n_2`` (9 for two attention layers). For ``h = X + A1(X)``, ``f = U(h + A2(h))``:
  ``f_{<=5} = U(X + A1(X) + A2(X))``, one node holding both layers' heads
  (`Unrolled.tree`), which the exact attention path computes.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .canonical import (
    KEY,
    OUTPUT,
    QUERY,
    Leg,
    Node,
    Term,
    Tree,
    canonicalize,
    lift_rows,
    sequence_tree,
)
from .layers import Bilinear, Layer, Linear, Sequential, as_network

__all__ = ["DFT_SCALES", "dft_parts", "homogeneous_parts", "affine_part", "affine_inner",
           "Graded", "graded", "Unrolled", "unrolled", "truncation_trees"]


#: Input scales of the DFT (`dft_parts`): each part is read at the scale with the
#: smallest rounding bound.
DFT_SCALES = (4.0, 1.0, 0.25, 0.0625, 0.015625)


def _dft_once(net: Layer, X: np.ndarray, m: int):
    w = np.exp(2j * np.pi * np.arange(m) / m)
    Z = (w.reshape((m,) + (1,) * X.ndim) * X[None]).reshape((m * X.shape[0],) + X.shape[1:])
    F = np.asarray(net(Z))
    F = F.reshape((m, X.shape[0]) + F.shape[1:])
    size = np.abs(F).reshape(m, X.shape[0], -1).max(axis=(0, 2))        # (n,)
    return (np.fft.fft(F, axis=0) / m).real, size


def dft_parts(net: Layer, X: np.ndarray, m: int, scales=DFT_SCALES,
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
    `DFT_SCALES` with the smallest rounding bound (``P_k(X) = lam^{-k} P_k(lam X)``), so
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
    return dft_parts(net, np.asarray(X, dtype=np.float64), int(m))


def affine_part(net: Layer, n_ctx: int | None):
    """``(P_0, J)``: ``P_0`` the constant ``(n_ctx, out)`` (``(1, out)`` position-free) and
    ``J`` ``(n_ctx * d, n_ctx, out)`` the degree-1 part on the basis inputs (DFT)."""
    d = net.in_features
    if n_ctx is None:
        E = np.eye(d)
        c = np.asarray(net(np.zeros((1, d))), dtype=np.float64)
        J = dft_parts(net, E, net.degree + 1)[1]
        return c, J[:, None, :]
    E = np.eye(n_ctx * d).reshape(n_ctx * d, n_ctx, d)
    c = np.asarray(net(np.zeros((1, n_ctx, d))), dtype=np.float64)[0]
    P, bound = dft_parts(net, E, net.degree + 1, with_bound=True)
    J = P[1]
    # below the DFT's rounding (eps times the largest value it summed, times m): an exact
    # zero of the function cannot be told from it, and is not reported as a linear part
    noise = 4 * (net.degree + 1) * np.finfo(np.float64).eps * bound[1]
    J[np.abs(J).reshape(len(J), -1).max(axis=1) <= noise] = 0.0
    return c, J


def affine_inner(pa, pb) -> float:
    return float(np.sum(pa[0] * pb[0]) + np.sum(pa[1] * pb[1]))


@dataclass
class Graded:
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


def graded(net: Layer, K: int) -> Graded:
    """The graded network of ``net`` up to degree ``K`` (module docstring)."""
    can = canonicalize(net.astype_float() if net.is_exact else net, keep_embed=False)
    if not can.stages:
        lin = np.asarray(can.linear, dtype=np.float64)
        return Graded([Linear(lin[1:, 1:])], [1], lin[1:, 0].copy(), can.out)
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
    return Graded(layers, blocks, y0, can.out)


@dataclass
class Unrolled:
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
        M = {lab: a for a, lab in t.cores}[(QUERY, KEY)]
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
        vsize = max({lab: a for a, lab in t.cores}[(OUTPUT, "h", "v")].shape[2]
                    for t, _ in members)
        Os = [c * _pad({lab: a for a, lab in t.cores}[(OUTPUT, "h", "v")], 2, vsize)
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


def unrolled(net: Layer, n_ctx: int, cap: int) -> tuple[Unrolled | None, str]:
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
        lifted = lift_rows(lam, False)
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
    return Unrolled(terms, set(terms), tree.d_in, tree.d_out, n_ctx), ""


def truncation_trees(nets: list, n_ctx: int, K: int, names: list[str]) -> list[Tree]:
    """``f_{<=K}`` of each bias-free sequence model as the one-node float64 tree the exact
    attention path contracts (its degree-<=K paths unrolled into one node, `unrolled`, as
    `tensoralg.degree_similarity_matrix` builds them): the per-model work of a blocked ``S<=K`` matrix
    (`tensoralg.blocks`).

    Raises:
        ValueError: a model that is not a sequence model, a ``K`` above its degree, a model
            whose ``S<=K`` is not exact (biases; naming it and why), or a truncation that
            vanishes (norm zero); ``names[i]`` names ``nets[i]``.
    """
    trees = []
    for x, name in zip(nets, names):
        if not x.is_sequence_model:
            raise ValueError(f"{name}: not a sequence model (with attention); the blocked "
                             f"S<={K} matrix is for sequence models, "
                             f"tensoralg.degree_similarity_matrix computes position-free ones")
        x = x.astype_float() if x.is_exact else x
        if x.degree < K:
            raise ValueError(f"degree: {K} is above the degree {x.degree} of {name}")
        f, why = unrolled(x, n_ctx, K)
        if f is None:
            raise ValueError(f"degree: S<={K} is not exact for {name} ({why}); "
                             f"degree_similarity(a, b) estimates it by Monte Carlo per pair")
        t = f.tree(set(range(K + 1)))
        if t is None:
            raise ValueError(f"{name}: the degree-<={K} truncation has no terms (norm zero), "
                             f"so S<={K} is undefined")
        trees.append(t)
    return trees
