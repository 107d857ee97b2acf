"""Exact strategy 2: Gaussian chaos (Hermite) coefficients (DESIGN §3.6).

Every polynomial ``f`` of degree ``<= n`` in ``z ~ N(0, I_r)`` has a unique expansion
``f(z) = sum_k <C_k, He_k(z)>`` with symmetric order-``k`` tensors ``C_k``, and the chaos spaces
are orthogonal (Wiener 1938; Itô 1951; e.g. Janson, *Gaussian Hilbert Spaces*, 1997, ch. 2–3):

    E[f g] = sum_k k! <C_k^f, C_k^g>_F.

So the Gaussian inner product is the Euclidean inner product of per-model feature vectors
``phi(f) = (sqrt(k!) C_k)_k`` and the Gram matrix of ``N`` models is one matrix product. The
``C_k`` come from the symmetric monomial coefficients ``M_j`` of ``f = sum_j <M_j, z^{(x)j}>`` by

    C_k = sum_{m >= 0} (k+2m)! / (k! m! 2^m) tr^m(M_{k+2m})

(``tr`` contracts one pair of indices; the coefficient counts the ways to pair ``2m`` of the
``k+2m`` indices, since ``z^{(x)n}`` has Hermite expansion over partial pairings).

The monomial coefficients are built from the weights by propagating each lifted activation as a
polynomial (lists of coefficient arrays ``(N, units, r**j)``, unsymmetrized) through the bilinear
stages; only the output is symmetrized. Never sampled.

Inputs behind embeddings: the joint input ``(E_a x, E_b x, ...)`` of all models is Gaussian with
covariance ``G = [E_a; E_b; ...][E_a; E_b; ...]^T`` of rank ``r <= min(d, sum m)``; writing
``G = K K^T`` (eigendecomposition) the models' embeddings ``E_i`` are replaced by the rows ``K_i``
of ``K`` and every network is expanded in ``z ~ N(0, I_r)``: the joint law, hence every inner
product, is unchanged. Whitening needs square roots, so the exact (rational) backend expands in
``x`` itself (``r = d``).

Costs (dense storage; symmetric tensors are stored in full, ``r**k`` entries):
depth 1: ``O(K H r^2)`` per model, ``O(K r^2)`` per pair; depth 2: ``O(K H r^4)`` per model.
The planner compares them with the Wick strategy (polynomial in the hidden widths instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..canonical import Canonical, Stage
from . import chaos_depth1

__all__ = ["ChaosEstimate", "estimate", "whiten", "features", "inner_from_features",
           "cross"]


@dataclass
class ChaosEstimate:
    """Cost of the chaos strategy for stacks of ``N_a`` and ``N_b`` models.

    Attributes:
        r: dimension of the (whitened) Gaussian input the expansion lives in.
        degree: the highest chaos order (``2**depth``).
        n_features: coefficients per model (all outputs, dense symmetric storage).
        flops: floating-point operations (features of every model plus all pair products).
        memory_elements: upper bound on the elements alive at once.
        whitened: whether the joint input covariance was whitened (``r < d``).
        metric: whether each model is expanded in its own embedded coordinates and the pair
            through the cross covariance ``E_a E_b^T`` (one model per side).
    """

    r: int
    degree: int
    n_features: int
    flops: float
    memory_elements: int
    whitened: bool
    refused: str | None = None
    metric: bool = False

    def summary(self) -> str:
        if self.refused:
            return f"chaos: REFUSED ({self.refused})"
        w = f"whitened joint input, r = {self.r}" if self.whitened else f"r = {self.r}"
        if self.metric:
            w = (f"each model in its embedded coordinates (m = {self.r}), paired through "
                 f"E_a E_b^T")
        return (f"chaos: degree {self.degree}, {w}, {self.n_features:,} coefficients per model, "
                f"{self.flops:.3g} FLOPs, peak about {self.memory_elements:,} elements")


# ----------------------------------------------------------------------------------------
# input geometry
# ----------------------------------------------------------------------------------------

def _joint_rank_bound(cans: list[Canonical]) -> tuple[int, bool]:
    """``(r, whitened)``: the expansion dimension that :func:`whiten` will use."""
    d = cans[0].d
    if any(c.embed is None for c in cans):
        return d, False
    m = sum(c.embed.shape[0] * (c.embed.shape[-2] - 1) for c in cans)
    return (m, True) if m < d else (d, False)


def whiten(cans: list[Canonical], exact: bool) -> tuple[list[Canonical], int]:
    """Express every stack in one Gaussian input ``z ~ N(0, I_r)`` with the same joint law.

    With embeddings on every stack and ``sum m < d`` (floating point only): the joint
    covariance of the embedded inputs is factored ``G = K K^T`` (symmetric eigendecomposition,
    eigenvalues below ``len(G) * eps * max`` dropped as zero) and each embedding becomes its
    rows of ``K``. Otherwise embeddings are folded into the first stage (``r = d``).
    Returns the folded stacks (no ``embed``) and ``r``.
    """
    d = cans[0].d
    r, whitened = _joint_rank_bound(cans)
    if exact or not whitened:
        return [c.folded() for c in cans], d
    rows = np.concatenate([c.embed[:, 1:, 1:].reshape(-1, d) for c in cans], axis=0)
    G = rows @ rows.T
    lam, V = np.linalg.eigh(G)
    tol = max(lam.max(), 0.0) * len(G) * np.finfo(np.float64).eps
    keep = lam > tol
    K = V[:, keep] * np.sqrt(lam[keep])
    r = K.shape[1]
    out, start = [], 0
    for c in cans:
        N, m1, _ = c.embed.shape
        m = m1 - 1
        Kc = K[start:start + N * m].reshape(N, m, r)
        start += N * m
        E = np.zeros((N, m1, r + 1))
        E[:, 0, 0] = c.embed[:, 0, 0]
        E[:, 1:, 0] = c.embed[:, 1:, 0]
        E[:, 1:, 1:] = Kc
        out.append(replace(c, embed=E, d=r).folded())
    return out, r


# ----------------------------------------------------------------------------------------
# polynomial propagation
# ----------------------------------------------------------------------------------------

def _zeros_like_kind(shape, exact: bool):
    if exact:
        from fractions import Fraction

        z = np.empty(shape, dtype=object)
        z.fill(Fraction(0))
        return z
    return np.zeros(shape)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _perm(T, p):
    return T.permute(p) if _is_torch(T) else np.transpose(T, p)


def _copy(T):
    return T.clone() if _is_torch(T) else T.copy()


def _apply_forms(F, P: list) -> list:
    """Linear forms ``F (N, H, u)`` of the lifted polynomial vector ``P`` (``P[j]: (N, u, r^j)``)."""
    return [None if Pj is None else F @ Pj for Pj in P]


def _stage_poly(st: Stage, P: list[np.ndarray] | None, r: int) -> tuple[list, list]:
    """Coefficients of the left and right forms of a stage, ``[(N, H, r^j)]_j``."""
    if P is None:  # the lifted input z~ = (1, z): the forms read their columns directly
        return [st.L[..., :1], st.L[..., 1:]], [st.R[..., :1], st.R[..., 1:]]
    return _apply_forms(st.L, P), _apply_forms(st.R, P)


def _poly_products(pl: list, pr: list, D: np.ndarray, exact: bool) -> list[np.ndarray]:
    """``D (N, u, H)`` applied to the per-unit products of ``pl`` and ``pr``: the next lifted
    polynomial vector ``[(N, u, r^n)]_n`` (unsymmetrized coefficients)."""
    N, u, H = D.shape
    out: dict[int, Any] = {}
    for i, A in enumerate(pl):
        if not _any(A):
            continue
        # (N, u, I, H) with D folded in, then one batched BLAS matmul per right degree
        # (operands made contiguous: strided operands send numpy's matmul off BLAS)
        DA = A.swapaxes(1, 2)[:, None, :, :] * D[:, :, None, :]
        for j, B in enumerate(pr):
            if not _any(B):
                continue
            if not _is_torch(B) and B.dtype != object:
                B = np.ascontiguousarray(B)
            term = (DA @ B[:, None, :, :]).reshape(N, u, -1)  # (N, u, I*J)
            out[i + j] = term if (i + j) not in out else out[i + j] + term
    deg = max(out) if out else 0
    res = []
    for n in range(deg + 1):
        res.append(out[n] if n in out else None)
    return res


def _any(a) -> bool:
    """A coefficient block that is present (exact zero blocks are never built: None)."""
    return a is not None


def _symmetrize(M, n: int, r: int, exact: bool):
    """Average of ``M (N, K, r^n)`` over the ``n!`` permutations of its ``n`` input axes, in
    ``n(n+1)/2 - 1`` transposes: if ``T`` is symmetric in its first ``k-1`` axes, then
    ``(1/k) sum_{i<k} swap(i, k-1) T`` is symmetric in its first ``k`` (coset decomposition of
    the symmetric group ``S_k`` over ``S_{k-1}``)."""
    if n < 2:
        return M
    N, K = M.shape[:2]
    T = M.reshape((N, K) + (r,) * n)
    for k in range(2, n + 1):
        acc = _copy(T)
        for i in range(k - 1):
            perm = list(range(n + 2))
            perm[2 + i], perm[2 + k - 1] = perm[2 + k - 1], perm[2 + i]
            acc = acc + _perm(T, tuple(perm))
        if exact:
            from fractions import Fraction

            T = acc * Fraction(1, k)
        else:
            T = acc / k
    return T.reshape(N, K, -1)


def _trace(M: np.ndarray, n: int, r: int, S=None) -> np.ndarray:
    """Contract the last two of the ``n`` input axes of ``M (N, K, r^n)`` (with the covariance
    ``S (N, r, r)`` of the input when it is not the identity)."""
    N, K = M.shape[:2]
    T = M.reshape(N, K, r ** (n - 2), r, r)
    if S is not None:
        if _is_torch(T):
            import torch

            return torch.einsum("nkIij,nij->nkI", T, S)
        return np.einsum("nkIij,nij->nkI", T, S)
    if _is_torch(T):
        import torch

        return torch.diagonal(T, dim1=-2, dim2=-1).sum(-1)
    return np.trace(T, axis1=-2, axis2=-1)


def features(can: Canonical, U, r: int) -> list:
    """Chaos coefficients ``[C_0, ..., C_n]`` of every model of a stack, each ``(N, K, r^k)``
    (dense, symmetric), for the outputs projected by ``U (K, O)``; ``None`` for an order that
    vanishes identically.

    A folded stack is expanded in its input ``x ~ N(0, I_r)``. A stack that keeps its
    embedding is expanded in the embedded coordinates ``v = E x`` (``r = m``), whose covariance
    ``S = E E^T`` then replaces the identity in the traces; pair its coefficients with
    :func:`inner_metric` (the metric ``E_a E_b^T``).

    Source: DESIGN §3.6 (``C_k`` from the monomial coefficients by iterated traces; for
    ``v ~ N(0, S)`` the traces contract with ``S``, since ``f(x) = g(E x)`` has ``x``-space
    coefficients ``C_k^g o E^{(x)k}`` and ``tr(M o E (x) E) = <M, E E^T>``).
    """
    exact = can.exact
    Ucast = U if not exact else np.asarray(U, dtype=object)
    if not can.stages:
        W = Ucast[None] @ can.linear[:, 1:, :]
        return [W[..., :1], W[..., 1:]]
    S = None
    P = None
    for s, st in enumerate(can.stages):
        D = st.D
        if s == len(can.stages) - 1:
            D = Ucast[None] @ D[:, 1:, :]
        if s == 0 and can.embed is not None:
            E = can.embed
            Enc = E[:, 1:, 1:]
            S = Enc @ Enc.swapaxes(1, 2) if not _is_torch(Enc) else Enc @ Enc.transpose(1, 2)
            c = E[:, :, :1]  # the embedded constant (1, bias)
            pl, pr = [st.L @ c, st.L[..., 1:]], [st.R @ c, st.R[..., 1:]]
        else:
            pl, pr = _stage_poly(st, P, r)
        P = _poly_products(pl, pr, D, exact)
    n_max = len(P) - 1
    M = [None if P[n] is None else _symmetrize(P[n], n, r, exact) for n in range(n_max + 1)]
    C: list = []
    for k in range(n_max + 1):
        acc = None
        for m in range((n_max - k) // 2 + 1):
            Mk = M[k + 2 * m]
            if not _any(Mk):
                continue
            t = Mk
            for step in range(m):
                t = _trace(t, k + 2 * (m - step), r, S)
            coef = math.factorial(k + 2 * m) // (math.factorial(k) * math.factorial(m) * 2 ** m)
            t = t * coef
            acc = t if acc is None else acc + t
        C.append(acc)
    return C


def inner_from_features(Ca: list, Cb: list, keep: bool, exact: bool):
    """``sum_k k! <C_k^a, C_k^b>`` for every pair of models: ``(N_a, N_b)`` or
    ``(N_a, N_b, K)`` with ``keep``."""
    total = None
    for k in range(min(len(Ca), len(Cb))):
        A, B = Ca[k], Cb[k]
        if A is None or B is None:
            continue
        if keep:
            if _is_torch(A):
                import torch

                t = torch.einsum("akI,bkI->abk", A, B)
            else:
                t = np.einsum("akI,bkI->abk", A, B)
        else:
            Na, Nb = A.shape[0], B.shape[0]
            t = A.reshape(Na, -1) @ B.reshape(Nb, -1).T
        t = t * math.factorial(k)
        total = t if total is None else total + t
    return total


def inner_metric(Ca: list, Cb: list, G, keep: bool):
    """``sum_k k! <C_k^a, C_k^b>_G`` for one model per side, each index contracted through the
    cross covariance ``G = E_a E_b^T (m_a, m_b)`` of the two embedded inputs: ``()`` or ``(K,)``."""
    total = None
    for k in range(min(len(Ca), len(Cb))):
        A, B = Ca[k], Cb[k]
        if A is None or B is None:
            continue
        K = B.shape[1]
        mb = G.shape[1]
        T = B[0].reshape((K,) + (mb,) * k)
        for ax in range(k):  # contract index ax of B with G: (.., m_b, ..) -> (.., m_a, ..)
            T = T.swapaxes(1 + ax, k) @ G.T
            T = T.swapaxes(1 + ax, k)
        Af = A[0].reshape(K, -1)
        Tf = T.reshape(K, -1)
        t = (Af * Tf).sum(-1)
        if not keep:
            t = t.sum()
        t = t * math.factorial(k)
        total = t if total is None else total + t
    return total


def metric_applies(ca: Canonical, cb: Canonical) -> bool:
    """One model per side, both behind embeddings whose joint width is below the input's:
    expand each in its own embedded coordinates and pair them through ``E_a E_b^T`` (cheaper
    than whitening, and exact in rationals)."""
    return (ca.embed is not None and cb.embed is not None and ca.embed.shape[0] == 1
            and cb.embed.shape[0] == 1
            and (ca.embed.shape[1] - 1) + (cb.embed.shape[1] - 1) < ca.d)


def _metric_triple(ca: Canonical, cb: Canonical, U, keep: bool, conv, want_self: bool):
    if conv is not None:
        ca, cb, U = ca.map(conv), cb.map(conv), conv(U)
    Ca = features(ca, U, ca.embed.shape[-2] - 1)
    Cb = features(cb, U, cb.embed.shape[-2] - 1)
    Ea, Eb = ca.embed[0, 1:, 1:], cb.embed[0, 1:, 1:]
    out = [None, inner_metric(Ca, Cb, Ea @ Eb.T, keep), None]
    if want_self:
        out[0] = inner_metric(Ca, Ca, Ea @ Ea.T, keep)
        out[2] = inner_metric(Cb, Cb, Eb @ Eb.T, keep)
    K = (U.shape[0],) if keep else ()
    exact = ca.exact

    def fin(x):
        x = _result(x, K, exact)
        arr = np.asarray(x, dtype=object) if exact else np.asarray(x, dtype=np.float64)
        return arr.reshape((1, 1) + K)
    return [None if x is None else fin(x) for x in out]


#: Models expanded together: the work arrays of one chunk stay at a few hundred MB at the
#: widths of real checkpoints, while the features of all models are kept.
FEATURE_CHUNK = 32


def _features_on(cans: list[Canonical], U: np.ndarray, r: int, conv) -> list[list]:
    out = []
    for c in cans:
        if conv is None and chaos_depth1.applies(c):  # closed form, no work arrays
            out.append(chaos_depth1.features(c, U))
            continue
        N = c.arrays()[0].shape[0]
        parts = []
        for i0 in range(0, N, FEATURE_CHUNK):
            sub = c.sub(slice(i0, min(N, i0 + FEATURE_CHUNK))) if N > FEATURE_CHUNK else c
            parts.append(features(sub, U, r) if conv is None else
                         features(sub.map(conv), conv(U), r))
        if len(parts) == 1:
            out.append(parts[0])
            continue
        cat = (lambda xs: np.concatenate(xs, axis=0)) if conv is None else (
            lambda xs: __import__("torch").cat(xs, dim=0))
        out.append([None if parts[0][k] is None else cat([p[k] for p in parts])
                    for k in range(len(parts[0]))])
    return out


def _result(X, shape, exact):
    if X is None:
        return _zeros_like_kind(shape, exact)
    if _is_torch(X):
        return X.detach().to("cpu").double().numpy()
    return X


def cross(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, same: bool = False,
          conv=None):
    """Exact cross Gram ``<a_i, b_j>`` ``(N_a, N_b[, K])`` of two stacks through their chaos
    coefficients (numpy float64, or Fractions on exact stacks). ``conv``: maps NumPy arrays to
    another backend's (torch) for the expansion; the result comes back as NumPy float64."""
    exact = ca.exact
    if not same and metric_applies(ca, cb):
        return _metric_triple(ca, cb, U, keep, conv, False)[1]
    cans, r = whiten([ca] if same else [ca, cb], exact)
    F = _features_on(cans, U, r, conv)
    Ca = F[0]
    Cb = Ca if same else F[1]
    shape = (ca.arrays()[0].shape[0], cb.arrays()[0].shape[0]) + ((U.shape[0],) if keep else ())
    return _result(inner_from_features(Ca, Cb, keep, exact), shape, exact)


def triple(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, conv=None):
    """``(<a,a>, <a,b>, <b,b>)`` of two stacks from one expansion of each (one joint
    whitening), for similarities."""
    exact = ca.exact
    if metric_applies(ca, cb):
        return tuple(_metric_triple(ca, cb, U, keep, conv, True))
    cans, r = whiten([ca, cb], exact)
    Ca, Cb = _features_on(cans, U, r, conv)
    Na, Nb = ca.arrays()[0].shape[0], cb.arrays()[0].shape[0]
    K = (U.shape[0],) if keep else ()
    return (_result(inner_from_features(Ca, Ca, keep, exact), (Na, Na) + K, exact),
            _result(inner_from_features(Ca, Cb, keep, exact), (Na, Nb) + K, exact),
            _result(inner_from_features(Cb, Cb, keep, exact), (Nb, Nb) + K, exact))


# ----------------------------------------------------------------------------------------
# cost estimate (from shapes alone)
# ----------------------------------------------------------------------------------------

def estimate(ca: Canonical, cb: Canonical, K: int, keep: bool, same: bool,
             exact: bool) -> ChaosEstimate:
    """FLOPs and peak memory of :func:`cross`, from the shapes alone (nothing allocated)."""
    cans = [ca] if same else [ca, cb]
    metric = not same and metric_applies(ca, cb)
    r, whitened = _joint_rank_bound(cans)
    if exact:
        r, whitened = ca.d, False
    if metric:
        whitened = False
    flops = 0.0
    peak = 0
    feats_total = 0
    n_features = 0
    for c in cans:
        N = c.arrays()[0].shape[0]
        Nw = min(N, FEATURE_CHUNK)  # models expanded together (work arrays)
        if metric:
            r = c.embed.shape[-2] - 1
        if c.embed is not None and not metric:
            flops += 2.0 * N * c.embed.shape[-2] * (r + 1) * max(c.stages[0].L.shape[1], 1) * 2
        if not c.stages:
            feats = K * (r + 1)
            flops += 2.0 * N * K * c.linear.shape[1] * (r + 1)
        else:
            degs = [0, 1]  # degrees present in the stage's input polynomial vector
            n_in = 1
            for s, st in enumerate(c.stages):
                H = st.L.shape[1]
                u = K if s == len(c.stages) - 1 else st.D.shape[1]
                w = st.L.shape[2]
                if s > 0:  # forms applied to the previous polynomial vector
                    for j in range(n_in + 1):
                        flops += 2 * 2.0 * N * H * w * r ** j
                        peak = max(peak, 2 * Nw * H * sum(r ** jj for jj in range(n_in + 1)))
                for i in range(n_in + 1):
                    for j in range(n_in + 1):
                        flops += 2.0 * N * u * H * r ** (i + j) + N * u * H * r ** i
                        peak = max(peak, Nw * u * H * r ** i + Nw * u * r ** (i + j)
                                   + 2 * Nw * H * sum(r ** jj for jj in range(n_in + 1)))
                n_in *= 2
                degs = list(range(n_in + 1))
            out_elems = Nw * K * sum(r ** n for n in degs)
            flops += sum(n * (n + 1) // 2 * N * K * r ** n for n in degs)
            peak = max(peak, 2 * out_elems + Nw * K * r ** n_in)
            feats = K * sum(r ** n for n in degs)
        feats_total += N * feats
        n_features = max(n_features, feats)
    Na = ca.arrays()[0].shape[0]
    Nb = cb.arrays()[0].shape[0]
    if metric:  # three pairs (aa, ab, bb), each index of order k contracted through E_a E_b^T
        m = max(c.embed.shape[-2] - 1 for c in cans)
        deg = 2 ** max(ca.depth, cb.depth)
        flops += 3 * sum(2.0 * K * k * m ** (k + 1) + 2.0 * K * m ** k for k in range(deg + 1))
        r = max(c.embed.shape[-2] - 1 for c in cans)
    else:
        flops += 2.0 * Na * Nb * n_features
    memory = peak + feats_total + Na * Nb * (K if keep else 1)
    return ChaosEstimate(r=r, degree=2 ** max(ca.depth, cb.depth), n_features=n_features,
                         flops=flops, memory_elements=int(memory), whitened=whitened,
                         metric=metric)
