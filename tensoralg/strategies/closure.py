"""Gaussian closure (docs/mathematics.md §3.2): fast, exact at depth 1, APPROXIMATE at depth >= 2.

Propagates the joint second moments ``(M_aa, M_ab, M_bb)`` of the two networks' lifted
activations layer by layer, each step computed exactly *as if* the layer's input were Gaussian
with those moments (non-centred Isserlis: pairs bridged by the covariance, singletons capped by
the mean). This is what the original research code computes for deep networks.

At depth >= 2 it is the exact value of a different, tree-restricted bilinear form, **not**
``E[f_a . f_b]``: two functionally identical networks can score far below 1 (x1^2 x2^2 built as
(x1 x2)^2 and as x1^2 . x2^2: closure 1/sqrt(27) ~ 0.19 where exact gives 1). Measured error
(docs/mathematics.md §3.2; random depth-2 pairs against the exact strategy): similarity error median 0.03,
max 0.17, with one sign flip in 20 pairs; 6-18 % on pairs whose embedding weights are scaled by
5. Use it for a quick look or where exact is refused, never as a certificate.

Sequence models (docs/mathematics.md §3.7, §3.9): `closure_inner` and its relatives
propagate the moments over (position, feature), with the constant 1 of the lifted input
shared by every position; exact at depth 1, APPROXIMATE deeper (measured error in
`closure_inner`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import opt_einsum as oe

from ..canonical import QUERY, Canonical, Term, flatten_layers, sequence_tree
from ..layers import Bilinear, BilinearAttention, Layer, Linear, Residual, as_network
from ..prepare import check_sequence_models, check_sequence_pair, check_slices, position_selector
from ..request import Request, make_request
from ..results import gram_to_similarity, similarity_from, swap_order
from .executor import ein as _ein
from .executor import torch_backend
from .wick.matchings import partial_matchings, parts

__all__ = ["cross", "closure_inner", "closure_similarity", "closure_triple", "closure_gram",
           "closure_cross_gram", "closure_inner_req", "closure_similarity_req",
           "closure_gram_req"]


def _closure_ops(can: Canonical) -> list:
    if not can.stages:
        return [("lin", can.linear)]
    return [("bil", s) for s in can.stages]


_PATHS: dict = {}


def _einsum_cached(subscripts: str, *ops):
    """``np.einsum`` with its contraction path found once per (subscripts, shapes)."""
    key = (subscripts,) + tuple(o.shape for o in ops)
    path = _PATHS.get(key)
    if path is None:
        path = np.einsum_path(subscripts, *ops, optimize="greedy")[0]
        _PATHS[key] = path
    return np.einsum(subscripts, *ops, optimize=path)


def cross(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, backend: str):
    """Gaussian closure (docs/mathematics.md §3.2) cross Gram ``(N_a, N_b[, K])``; see `triple`."""
    return triple(ca, cb, U, keep, backend)[1]


def _lifted_identity(n: int, exact: bool) -> np.ndarray:
    I = np.eye(n)
    return np.vectorize(Fraction, otypes=[object])(I) if exact else I


def _T(x):
    return x.swapaxes(-1, -2)


class _Side:
    """One side's bilinear op in a closure step, at an input with mean ``mu`` and covariance
    ``C``: the means ``m1 = L mu``, ``m2 = R mu`` ``(N, H)``, ``p = E[(L x)(R x)]`` per unit
    and the output map ``D`` with its columns scaled by ``p``, ``m1``, ``m2``.

    ``white``: the input is the lifted standard Gaussian ``x~ = (1, x)`` (mean ``e0``,
    covariance ``I - e0 e0^T``): means are the constant columns and covariances Grams of the
    remaining ones (no ``n x n`` covariance is formed)."""

    def __init__(self, st, mu, C, white: bool):
        L, R, D = st.L, st.R, st.D
        if white:
            self.m1, self.m2 = L[:, :, 0], R[:, :, 0]
            self.L, self.R = L[:, :, 1:], R[:, :, 1:]
            self.LC, self.RC = self.L, self.R  # C = I on these coordinates
        else:
            self.m1, self.m2 = (L @ mu[:, :, None])[:, :, 0], (R @ mu[:, :, None])[:, :, 0]
            self.L, self.R = L, R
            self.LC, self.RC = L @ C, R @ C
        p = self.m1 * self.m2 + (self.LC * self.R).sum(-1)
        self.D = D
        self.Dp = D @ p[:, :, None]  # (N, O, 1)
        self.Dm1, self.Dm2 = D * self.m1[:, None, :], D * self.m2[:, None, :]
        self.white = white

    def self_moment(self):
        """``E[y~ y~^T]`` of this side's output ``(N, O+1, O+1)`` (closure step, docs/mathematics.md §3.2)."""
        c13 = self.LC @ _T(self.L)  # l_h C l_k (A @ A^T at a white input: syrk)
        c14 = self.LC @ _T(self.R)
        c24 = self.RC @ _T(self.R)
        return _moment(self, self, c13, c14, _T(c14), c24, lambda x: x)


def _moment(sa: _Side, sb: _Side, c13, c14, c23, c24, bt):
    """``D_a E D_b^T`` for the non-centred Isserlis expectation of the four forms
    ``(l_a, r_a, l_b, r_b)`` of unit pairs ``(h, k)`` (means ``m1, m2 | n1, n2``, covariances
    ``c_ij``; the ten partial matchings of four legs):

        E = p_a p_b + c13 m2 n2 + c14 m2 n1 + c23 m1 n2 + c24 m1 n1 + c13 c24 + c14 c23.

    Terms with a mean on each side are matrix products with column-scaled ``D``s (rank one
    for ``p_a p_b``); only ``c13 c24 + c14 c23`` is elementwise. ``bt``: moves side ``b``'s
    arrays to the pair layout (identity for a self moment)."""
    DbT = lambda X: _T(bt(X))  # noqa: E731
    M = sa.Dp @ DbT(sb.Dp)
    M = M + sa.Dm2 @ (c13 @ DbT(sb.Dm2) + c14 @ DbT(sb.Dm1))
    M = M + sa.Dm1 @ (c23 @ DbT(sb.Dm2) + c24 @ DbT(sb.Dm1))
    if c13.dtype == object:
        Y = c13 * c24 + c14 * c23
    else:  # in place in c13 and c24 (no longer needed): a fresh large temporary costs a page
        Y = c13  # fault per 4 KiB on first touch, more than this arithmetic
        Y *= c24
        np.multiply(c14, c23, out=c24)
        Y += c24
    return M + (sa.D @ Y) @ DbT(sb.D)


def _cross_bil(sa: _Side, sb: _Side, Cab):
    """``E[y~_a' y~_b'^T]`` ``(N_a, N_b, O_a+1, O_b+1)`` for bilinear ops on both sides; ``Cab``
    the cross covariance ``(N_a, N_b, n_a, n_b)`` of the inputs (unused at a white input)."""
    Na, Nb = sa.D.shape[0], sb.D.shape[0]

    def cov(A, B):  # A C_ab B^T for every pair: (N_a, N_b, H, K)
        if sa.white:  # C_ab = I on the non-constant coordinates: one product for all pairs
            if Na == 1 and Nb == 1:
                return (A[0] @ _T(B[0]))[None, None]
            H, K = A.shape[1], B.shape[1]
            X = A.reshape(Na * H, -1) @ _T(B.reshape(Nb * K, -1))
            return X.reshape(Na, H, Nb, K).transpose(0, 2, 1, 3)
        return (A[:, None] @ Cab) @ _T(B)[None]

    c13, c14 = cov(sa.L, sb.L), cov(sa.L, sb.R)
    c23, c24 = cov(sa.R, sb.L), cov(sa.R, sb.R)
    wrap = _PairView(sa, Na)
    return _moment(wrap, _PairView(sb, None), c13, c14, c23, c24, lambda x: x[None])


class _PairView:
    """A side's arrays with the pair axes ``(N_a, N_b)``: side a gets a new axis 1 (side b's
    are added by ``_moment``'s ``bt``)."""

    def __init__(self, s: _Side, Na):
        if Na is None:
            self.D, self.Dp, self.Dm1, self.Dm2 = s.D, s.Dp, s.Dm1, s.Dm2
        else:
            self.D, self.Dp, self.Dm1, self.Dm2 = (x[:, None] for x in (s.D, s.Dp, s.Dm1, s.Dm2))


def _project(M, U, keep: bool):
    """``sum_k U_k M[1:, 1:] U_k^T`` over the last two axes (per ``k`` with ``keep``)."""
    v = ((U @ M[..., 1:, 1:]) * U).sum(-1)
    return v if keep else v.sum(-1)


def triple(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, backend: str,
           _general: bool = False):
    """Gaussian closure (docs/mathematics.md §3.2): propagate the joint second moments of the lifted
    activations as if each layer's input were Gaussian; exact at depth 1 (an embedding in front
    is a linear op, exact too). APPROXIMATE at depth >= 2; see the module docstring for its
    measured error. Returns ``(<a_i,a_i>, <a_i,b_j>, <b_j,b_j>)`` of shapes ``(N_a[, K])``,
    ``(N_a, N_b[, K])``, ``(N_b[, K])`` from one propagation (the self moments are propagated
    anyway).

    A step with bilinear ops on both sides is a handful of batched matrix products: the
    covariances of the forms (Grams of the weights at a standard Gaussian input, one product
    for all pairs of a Gram), and the Isserlis terms with a mean on each side as products with
    column-scaled output maps; only the pair-pair terms are elementwise. (``_general``: every
    step through the partial-matching sum of `_cross_step` instead, for tests)."""
    exact = backend == "exact"
    Na, Nb = ca.arrays()[0].shape[0], cb.arrays()[0].shape[0]
    if ca.embed is not None and cb.embed is not None:
        # the embedded inputs u~ = E~ x~ are Gaussian: their moments E~ E~^T are exact
        Ea, Eb = ca.embed, cb.embed
        Maa, Mbb = Ea @ _T(Ea), Eb @ _T(Eb)
        Mab = Ea[:, None] @ _T(Eb)[None]
        white = False
    else:
        ca, cb = ca.folded(), cb.folded()
        white = True
        Maa = Mbb = Mab = None
    ops_a, ops_b = _closure_ops(ca), _closure_ops(cb)
    depth = max(len(ops_a), len(ops_b))

    def stats(M):
        mu = M[:, :, 0]
        return mu, M - mu[:, :, None] * mu[:, None, :]

    def explicit():  # the standard lifted input as moment arrays (for the general step)
        I = _lifted_identity(ca.d + 1, exact)
        return (np.broadcast_to(I, (Na,) + I.shape), np.broadcast_to(I, (Nb,) + I.shape),
                np.broadcast_to(I, (Na, Nb) + I.shape))

    mua = Caa = mub = Cbb = Cab = None
    if not white:
        (mua, Caa), (mub, Cbb) = stats(Maa), stats(Mbb)
        Cab = Mab - mua[:, None, :, None] * mub[None, :, None, :]
    for t in range(depth):
        op_a = ops_a[t] if t < len(ops_a) else None
        op_b = ops_b[t] if t < len(ops_b) else None
        if not _general and op_a is not None and op_b is not None and op_a[0] == op_b[0] == "bil":
            sa = _Side(op_a[1], mua, Caa, white)
            sb = _Side(op_b[1], mub, Cbb, white)
            Mab = _cross_bil(sa, sb, Cab)
            Maa, Mbb = sa.self_moment(), sb.self_moment()
        else:  # a linear op, or one side already at its output: the general Isserlis step
            if white:
                Maa, Mbb, Mab = explicit()
                (mua, Caa), (mub, Cbb) = stats(Maa), stats(Mbb)
                Cab = Mab - mua[:, None, :, None] * mub[None, :, None, :]
            es = (lambda *args: np.einsum(*args)) if exact else _einsum_cached
            Mab = _cross_step(op_a, op_b, Mab, mua, mub, Caa, Cbb, Cab, es)
            adv = _advance_self_general if _general else _advance_self
            if op_a is not None:
                Maa = adv(op_a, Maa, mua, Caa, es)
            if op_b is not None:
                Mbb = adv(op_b, Mbb, mub, Cbb, es)
        white = False
        (mua, Caa), (mub, Cbb) = stats(Maa), stats(Mbb)
        if t + 1 < depth:
            Cab = Mab - mua[:, None, :, None] * mub[None, :, None, :]
    return _project(Maa, U, keep), _project(Mab, U, keep), _project(Mbb, U, keep)


def _advance_self(op, M, mu, C, es=None):
    """One closure step of a side's own second moment (general op)."""
    kind, val = op
    if kind == "lin":
        return val @ M @ _T(val)
    return _Side(val, mu, C, False).self_moment()


def _advance_self_general(op, M, mu, C, es):
    """The same through the partial-matching sum of `_cross_step` (each model paired with
    itself; for tests)."""
    kind, val = op
    out = []
    for i in range(M.shape[0]):
        s = slice(i, i + 1)
        opi = (kind, val[s] if kind == "lin" else type(val)(val.L[s], val.R[s], val.D[s]))
        out.append(_cross_step(opi, opi, M[s][:, None], mu[s], mu[s], C[s], C[s], C[s][:, None],
                               es)[0, 0])
    return np.stack(out)


def _forms(op):
    if op is None:
        return None
    kind, val = op
    return [val] if kind == "lin" else [val.L, val.R]


def _cross_step(op_a, op_b, Mab, mua, mub, Caa, Cbb, Cab, es):
    """One closure step of the cross moment ``E[y~_a' y~_b'^T]``.

    Each side's new unit is a product of its linear forms of the (jointly Gaussian) input: one
    form for a linear op, two (left, right) for a bilinear op, and the identity (the activation
    itself) for a side with no op left. The expectation of the product of all forms is the
    non-centred Isserlis sum: pairs bridged by the covariance, singletons by the mean.
    """
    Na, Nb = Mab.shape[0], Mab.shape[1]
    fa = _forms(op_a)
    fb = _forms(op_b)
    if fa is None:
        fa = [np.broadcast_to(np.eye(Mab.shape[2], dtype=Mab.dtype), (Na,) + Mab.shape[2:3] * 2)]
    if fb is None:
        fb = [np.broadcast_to(np.eye(Mab.shape[3], dtype=Mab.dtype), (Nb,) + Mab.shape[3:4] * 2)]
    forms = [("a", f) for f in fa] + [("b", f) for f in fb]
    mus = [es("nhi,ni->nh", f, mua if s == "a" else mub) for s, f in forms]
    n = len(forms)

    # broadcast every quantity to (Na, Nb, Ha, Hb): side-a forms index h, side-b forms k
    def bmean(i):
        s = forms[i][0]
        return mus[i][:, None, :, None] if s == "a" else mus[i][None, :, None, :]

    def bcov(i, j):
        si, fi = forms[i]
        sj, fj = forms[j]
        if si == "a" and sj == "a":
            return es("nhi,nij,nhj->nh", fi, Caa, fj)[:, None, :, None]
        if si == "b" and sj == "b":
            return es("nhi,nij,nhj->nh", fi, Cbb, fj)[None, :, None, :]
        if si == "a":
            return es("ahi,abij,bkj->abhk", fi, Cab, fj)
        return es("ahi,abij,bkj->abhk", fj, Cab, fi)

    E = 0
    for pairs, singles in partial_matchings(n):
        term = 1
        for i in singles:
            term = term * bmean(i)
        for i, j in pairs:
            term = term * bcov(i, j)
        E = E + term
    Da = op_a[1].D if op_a is not None and op_a[0] == "bil" else None
    Db = op_b[1].D if op_b is not None and op_b[0] == "bil" else None
    E = np.broadcast_to(E, (Na, Nb, fa[0].shape[1], fb[0].shape[1]))
    if Da is not None:
        E = es("aoh,abhk->abok", Da, E)
    if Db is not None:
        E = es("abok,bpk->abop", E, Db)
    return E


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
    """A `Term` as the closure's `_Term`: every leg a form
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
    `tensoralg.canonical.sequence_tree` (``fold=False``, float64) as `_Term` s."""
    net = as_network(net, name)
    for i, x in enumerate(flatten_layers(net)):
        inner = flatten_layers(x.inner) if isinstance(x, Residual) else [x]
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
    """`_form_cov` reduced over repeated labels, as ``(array, labels, merge)``: with a
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
        for m_, sh in zip(msubs, shapes):
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
    labels are not yet reduced (see `_diag`)."""
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
        for m in map(parts, partial_matchings(len(closed), can_cap, pairable=can_pair)):
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
    nodes before it), the node's terms in chaos form (`_ChaosSide`) and the node's
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


def _n_stages(net: Layer, n_ctx: int, name: str) -> int:
    return len(_schedule(_closure_nodes(net, n_ctx, name))[0])


def _closure_triple(req: Request, a, b, need_self=True):
    with torch_backend(req.backend, req.device, "the closure"):
        return _closure_triple_run(req, a, b, need_self)


def _closure_triple_run(req: Request, a, b, need_self):
    a, b, n_ctx = check_sequence_pair(a, b, req.n_ctx)
    check_slices(req, a.out_features, n_ctx)
    swap = need_self and swap_order(a, b)   # a similarity: the pair's canonical order
    a, b = a.astype_float(), b.astype_float()
    U, keep = req.output_matrix(a.out_features)
    sel = position_selector(n_ctx, req.position, False)
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
    `exact_inner` (tested to 1e-10 relative). From the second non-linear node on the
    input is a polynomial of a Gaussian, not Gaussian, and the value is that of a different,
    tree-restricted form, **not** ``E[f_a . f_b]``.

    Measured error (4 random two-layer attention-only pairs ``Residual(attn) ->
    Residual(attn) -> Linear``, d=3, n_ctx=3, 1 head, d_head=2, causal, no biases, weights
    N(0, 0.3^2); against `montecarlo_inner` with 400 000 samples;
    ``benchmarks/attention_closure_error.py``, table in ``docs/results/attention.md``): similarity
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

    Cost (one thread, shared 2-core machine at load ~2; tables in ``docs/results/attention.md``):
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
        n_ctx, output, position: as `exact_inner`.
        backend: ``"numpy"`` or ``"torch"`` (float64 both: the contractions above a size run
            in torch on ``device``, default CUDA when available; the same sums, equal to
            numpy's up to rounding, tested on the CPU).
        device: a torch device (``backend="torch"`` only).

    Returns:
        float (or an array for ``"each"``), float64.

    Raises:
        ValueError: as `exact_inner` for the pair and slices; a layer type the closure
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
    """`closure_inner` of a validated request."""
    return _closure_triple(req, a, b, need_self=False)[1]


def closure_similarity(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None,
                       position: Any = None, backend: str = "numpy", device: Any = None):
    """The moment-closure similarity: ``<a,b> / sqrt(<a,a> <b,b>)`` with the closure moments of
    one propagation (APPROXIMATE at depth >= 2; see `closure_inner` for what it is, its
    measured error,
    ``backend`` and ``device``). Raises ValueError when a closure norm is zero or an inner
    product overflowed float64."""
    return closure_similarity_req(_closure_request(n_ctx, output, position, backend, device),
                                  a, b)


def closure_triple(a: Any, b: Any, *, n_ctx: Any = None, output: Any = None,
                   position: Any = None, backend: str = "numpy", device: Any = None):
    """``(<a,a>, <a,b>, <b,b>)`` of the closure from one propagation (APPROXIMATE at depth
    >= 2; see `closure_inner`); the cross term in the pair's canonical order."""
    return _closure_triple(_closure_request(n_ctx, output, position, backend, device), a, b)


def closure_similarity_req(req: Request, a: Any, b: Any):
    """`closure_similarity` of a validated request."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        aa, ab, bb = _closure_triple(req, a, b)
    return similarity_from(ab, aa, bb, False, " (closure)")



def _closure_setup(req: Request, nets, n_ctx, names):
    U, keep = req.output_matrix(nets[0].out_features)
    sel = position_selector(n_ctx, req.position, False)
    each_t = isinstance(req.position, str)
    depth = max(_n_stages(m, n_ctx, nm) for m, nm in zip(nets, names))
    cm = [_ClosureModel(m, n_ctx, nm, depth) for m, nm in zip(nets, names)]
    return cm, (U, keep, sel, each_t)


def closure_gram(models, *, n_ctx: Any = None, output: Any = None, position: Any = None,
                 similarity: bool = False, backend: str = "numpy",
                 device: Any = None) -> np.ndarray:
    """Closure Gram matrix ``G[i, j] = closure_inner(models[i], models[j])`` (APPROXIMATE at
    depth >= 2, exact at depth 1; see `closure_inner`), shape ``(N, N)`` (plus the
    position / output axes for ``"each"``); with ``similarity=True`` the matrix
    ``G_ij / sqrt(G_ii G_jj)`` (clipped to [-1, 1]).

    Everything that depends on one model only -- its moments ``(mu, C_aa)`` at every stage,
    its terms in chaos form and its self readout ``G_ii`` -- is computed once per model; a pair
    only propagates its cross covariance and reads it out. Models of different depths are
    padded with identity stages, as in `closure_inner`, so ``G[i, j]`` equals
    ``closure_inner(models[i], models[j])`` exactly (same operations). ``backend``,
    ``device``: as `closure_inner`.

    Raises:
        ValueError: as `closure_inner` for any pair; an empty list; a zero closure norm
            with ``similarity=True``.
    """
    return closure_gram_req(_closure_request(n_ctx, output, position, backend, device), models,
                            similarity)


def closure_gram_req(req: Request, models, similarity: bool = False) -> np.ndarray:
    """`closure_gram` of a validated request."""
    nets, n_ctx = check_sequence_models(models, req.n_ctx)
    check_slices(req, nets[0].out_features, n_ctx)
    nets = [m.astype_float() for m in nets]
    vals = {}
    with torch_backend(req.backend, req.device, "closure_gram"):
        cm, args = _closure_setup(req, nets, n_ctx, [f"models[{i}]" for i in range(len(nets))])
        for i in range(len(cm)):
            for j in range(i, len(cm)):
                vals[(i, j)] = _closure_pair_value(cm[i], cm[j] if i != j else cm[i], *args)
    shape = np.shape(vals[(0, 0)])
    G = np.empty((len(cm), len(cm)) + shape)
    for (i, j), v in vals.items():
        G[i, j] = v
        G[j, i] = v
    return gram_to_similarity(G) if similarity else G


def closure_cross_gram(models_a, models_b, *, n_ctx: Any = None, output: Any = None,
                       position: Any = None, backend: str = "numpy",
                       device: Any = None) -> np.ndarray:
    """Closure cross Gram matrix ``G[i, j] = closure_inner(models_a[i], models_b[j])``
    (APPROXIMATE at depth >= 2, exact at depth 1; see `closure_inner`), shape
    ``(N_a, N_b)`` (plus the position / output axes for ``"each"``): one off-diagonal block of
    `closure_gram` of ``models_a + models_b``, computing only the cross pairs (per-model
    moments once per model). Equal to that block entry by entry (same operations).
    ``backend``, ``device``: as `closure_inner`.

    Raises:
        ValueError: as `closure_inner` for any pair; an empty list.
    """
    models_a, models_b = list(models_a), list(models_b)
    na = len(models_a)
    if na == 0 or not models_b:
        raise ValueError(f"closure_cross_gram: models_a and models_b must both be non-empty, "
                         f"got {na} and {len(models_b)} models")
    req = _closure_request(n_ctx, output, position, backend, device)
    nets, n_ctx = check_sequence_models(models_a + models_b, req.n_ctx)
    check_slices(req, nets[0].out_features, n_ctx)
    nets = [m.astype_float() for m in nets]
    names = [f"models_a[{i}]" for i in range(na)] + \
        [f"models_b[{j}]" for j in range(len(nets) - na)]
    with torch_backend(req.backend, req.device, "closure_cross_gram"):
        cm, args = _closure_setup(req, nets, n_ctx, names)
        vals = [[_closure_pair_value(cm[i], cm[j], *args) for j in range(na, len(cm))]
                for i in range(na)]
    return np.asarray(vals, dtype=np.float64)
