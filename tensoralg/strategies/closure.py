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
"""

from __future__ import annotations

import numpy as np
from fractions import Fraction

from ..canonical import Canonical
from ..wick import partial_matchings

__all__ = ["cross"]


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
    """Gaussian closure (docs/mathematics.md §3.2) cross Gram ``(N_a, N_b[, K])``; see :func:`triple`."""
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
    step through the partial-matching sum of :func:`_cross_step` instead, for tests)."""
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
    """The same through the partial-matching sum of :func:`_cross_step` (each model paired with
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


