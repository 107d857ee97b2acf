"""Exact strategy 2: Gaussian chaos (Hermite) coefficients (docs/mathematics.md §3.6).

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
polynomial through the bilinear stages, never sampled. Every coefficient is stored in packed
symmetric form (its values at sorted index tuples, ``C(r+k-1, k)`` of them instead of ``r**k``)
and symmetrized as it is formed: a stage's output unit ``o`` is ``sum_h D[o,h] (L P)_h (R P)_h``,
whose order-``(i+j)`` coefficient is ``Sym`` of a product block ``Y_o (pk_i, pk_j)``, gathered at
the packed positions (`_gather_index`). A later stage whose input (width ``u``) is narrower
than its hidden layer (``H``, e.g. behind a residual) forms ``Y_o = P_i^T T_o P_j`` with the
``u x u`` matrix ``T_o = Sym(L^T diag(D_o) R)`` instead of a sum over ``H`` hidden units.

Inputs behind embeddings: the joint input ``(E_a x, E_b x, ...)`` of all models is Gaussian with
covariance ``G = [E_a; E_b; ...][E_a; E_b; ...]^T`` of rank ``r <= min(d, sum m)``; writing
``G = K K^T`` (eigendecomposition) the models' embeddings ``E_i`` are replaced by the rows ``K_i``
of ``K`` and every network is expanded in ``z ~ N(0, I_r)``: the joint law, hence every inner
product, is unchanged. Whitening needs square roots, so the exact (rational) backend expands in
``x`` itself (``r = d``). One model per side behind narrow embeddings is expanded densely in its
own embedded coordinates and paired through ``E_a E_b^T`` (`features`,
`inner_metric`).

Costs (packed): depth 1 ``O(K H r^2)`` per model and ``O(K r^2 / 2)`` per pair; depth 2 (input
width ``u`` of the second stage) ``O(K u r^4 / 4)`` per model (the ``pk(2) x pk(2)`` product
block, ``pk(2) = r(r+1)/2``) and ``O(K r^4 / 24)`` per pair. Outputs are expanded in chunks, so
a pair never holds more than a few hundred MB of coefficients (`FEATURE_ELEMENTS`,
`WORK_ELEMENTS`). The planner compares this with the Wick strategy (polynomial in the
hidden widths instead) from the same cost model (`_stage_plan`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache
from typing import Any

import numpy as np

from ...canonical import Canonical, Stage
from . import depth1

__all__ = ["ChaosEstimate", "estimate", "whiten", "features", "packed_features",
           "inner_packed", "inner_metric", "n_packed", "multiset_weights", "cross", "triple"]


@dataclass
class ChaosEstimate:
    """Cost of the chaos strategy for stacks of ``N_a`` and ``N_b`` models.

    Attributes:
        r: dimension of the (whitened) Gaussian input the expansion lives in.
        degree: the highest chaos order (``2**depth``).
        n_features: coefficients per model (all outputs; packed symmetric storage, dense
            ``m**k`` per order on the metric path).
        flops: floating-point operations (features of every model plus all pair products).
        memory_elements: upper bound on the elements alive at once.
        whitened: whether the joint input covariance was whitened (``r < d``).
        metric: whether each model is expanded in its own embedded coordinates and the pair
            through the cross covariance ``E_a E_b^T`` (one model per side).
        angles: whether each model is expanded in its own whitened embedded coordinates,
            rotated to the principal (canonical) angles between the two embeddings, so that
            the pair is a weighted sum over packed coefficients (one model per side, float).
    """

    r: int
    degree: int
    n_features: int
    flops: float
    memory_elements: int
    whitened: bool
    refused: str | None = None
    metric: bool = False
    angles: bool = False

    def summary(self) -> str:
        if self.refused:
            return f"chaos: REFUSED ({self.refused})"
        w = f"whitened joint input, r = {self.r}" if self.whitened else f"r = {self.r}"
        if self.metric:
            w = (f"each model in its embedded coordinates (m = {self.r}), paired through "
                 f"E_a E_b^T")
        if self.angles:
            w = (f"each model in its own whitened embedded coordinates (r = {self.r}), rotated "
                 f"to the principal angles between the embeddings")
        kind = "dense" if self.metric else "packed"
        return (f"chaos: degree {self.degree}, {w}, {self.n_features:,} {kind} coefficients per "
                f"model, "
                f"{self.flops:.3g} FLOPs, at most {self.memory_elements:,} elements alive "
                f"(a bound, with a fixed work buffer)")


# ----------------------------------------------------------------------------------------
# input geometry
# ----------------------------------------------------------------------------------------

def _joint_rank_bound(cans: list[Canonical]) -> tuple[int, bool]:
    """``(r, whitened)``: the expansion dimension that `whiten` will use."""
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


#: Whether the planner may use `rotate_to_angles` (False: the expansions before it; for
#: tests and benchmarks that compare the two).
ALLOW_ANGLES = True


def angles_apply(ca: Canonical, cb: Canonical, same: bool, exact: bool) -> bool:
    """Whether `rotate_to_angles` may serve a pair (from shapes): one float model per
    side, both behind embeddings, at depth 2 or more (at depth 1 the other expansions are
    already at the cost of their input)."""
    return (ALLOW_ANGLES and not same and not exact and ca.embed is not None and cb.embed is not None
            and ca.embed.shape[0] == 1 and cb.embed.shape[0] == 1
            and max(ca.depth, cb.depth) >= 2)


def _angles_rank_bound(ca: Canonical, cb: Canonical) -> int:
    return max(ca.embed.shape[-2] - 1, cb.embed.shape[-2] - 1, 1)


def _eig_rows(E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(W, lam)`` with ``E E^T = W diag(lam) W^T`` over the eigenvalues above
    ``len * eps * max`` (as `whiten`)."""
    lam, W = np.linalg.eigh(E @ E.T)
    keep = lam > max(lam.max(), 0.0) * len(lam) * np.finfo(np.float64).eps
    return W[:, keep], lam[keep]


def rotate_to_angles(ca: Canonical, cb: Canonical) -> tuple[list[Canonical], np.ndarray, int]:
    """Each model of a pair in its own whitened embedded input, rotated so that the two
    inputs are correlated coordinate by coordinate (float64; one model per side).

    With ``E_a = K_a Q_a`` (``Q_a`` orthonormal rows, from the eigendecomposition of
    ``E_a E_a^T``) and likewise for ``b``, the singular value decomposition
    ``Q_a Q_b^T = V_a diag(s) V_b^T`` gives coordinates ``z_a = V_a^T Q_a x`` and
    ``z_b = V_b^T Q_b x``, each ``N(0, I)``, with ``E[z_a z_b^T] = diag(s)``: the cosines of
    the principal angles between the row spaces of the embeddings (Björck & Golub 1973). Each
    network is expanded in its own ``z`` (width ``r = max(rank E_a, rank E_b)``, the shorter
    padded with unused coordinates) and Mehler's formula
    ``E[He_alpha(z_a) He_beta(z_b)] = delta_{alpha beta} alpha! s^alpha`` pairs the chaos
    coefficients index by index (`inner_angles`; docs/mathematics.md §3.6). Embedding
    biases stay in the lifted constant. Returns ``([a, b] folded, s (r,), r)``.
    """
    Ea, Eb = ca.embed[0, 1:, 1:], cb.embed[0, 1:, 1:]
    Wa, la = _eig_rows(Ea)
    Wb, lb = _eig_rows(Eb)
    M = (Wa.T @ (Ea @ Eb.T) @ Wb) / np.sqrt(la)[:, None] / np.sqrt(lb)[None, :]
    Va, s, VbT = np.linalg.svd(M)
    r = max(len(la), len(lb), 1)
    cos = np.zeros(r)
    cos[:len(s)] = s

    def rotated(c: Canonical, K: np.ndarray) -> Canonical:
        E = np.zeros((1, c.embed.shape[-2], r + 1))
        E[0, 0, 0] = c.embed[0, 0, 0]
        E[0, 1:, 0] = c.embed[0, 1:, 0]
        E[0, 1:, 1:K.shape[1] + 1] = K
        return replace(c, embed=E, d=r).folded()

    a = rotated(ca, (Wa * np.sqrt(la)) @ Va)
    b = rotated(cb, (Wb * np.sqrt(lb)) @ VbT.T)
    return [a, b], cos, r


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
    N, u, _H = D.shape
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
        res.append(out.get(n))
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
    `inner_metric` (the metric ``E_a E_b^T``).

    Source: docs/mathematics.md §3.6 (``C_k`` from the monomial coefficients by iterated traces; for
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


# ----------------------------------------------------------------------------------------
# packed symmetric storage
# ----------------------------------------------------------------------------------------
#
# A symmetric order-n tensor over r coordinates is stored by its values at the sorted index
# tuples a_0 <= a_1 <= ... <= a_{n-1} (multisets), C(r+n-1, n) of them instead of r**n. The
# multisets are ordered by the combinatorial number system: a multiset maps to the strictly
# increasing b_t = a_t + t, whose colexicographic rank is sum_t C(b_t, t+1) (Knuth, TAOCP
# 7.2.1.3, Theorem L). Frobenius products of symmetric tensors weight each stored value by the
# number of index tuples it stands for, n! / prod(multiplicity!).

def n_packed(r: int, n: int) -> int:
    """Number of multisets of size ``n`` over ``r`` coordinates, ``C(r+n-1, n)``."""
    return math.comb(r + n - 1, n)


@lru_cache(maxsize=16)
def _binom_table(M: int, s: int) -> np.ndarray:
    """``C(x, t)`` for ``0 <= x < M``, ``0 <= t <= s`` (int64)."""
    T = np.zeros((M, s + 1), dtype=np.int64)
    for x in range(M):
        for t in range(min(x, s) + 1):
            T[x, t] = math.comb(x, t)
    return T


def _rank(alpha: np.ndarray, r: int) -> np.ndarray:
    """Packed index of each sorted row of ``alpha (rows, s)`` over ``r`` coordinates (int64)."""
    rows, s = alpha.shape
    if s == 0:
        return np.zeros(rows, dtype=np.int64)
    T = _binom_table(r + s, s)
    out = T[alpha[:, 0], 1].copy()
    for t in range(1, s):
        out += T[alpha[:, t] + t, t + 1]
    return out


@lru_cache(maxsize=32)
def _combos(M: int, s: int) -> np.ndarray:
    """All ``b_0 < ... < b_{s-1}`` in ``[0, M)`` in colexicographic order, ``(C(M, s), s)``.

    The combinations with largest element ``m`` are the ``C(m, s-1)`` first combinations of
    size ``s-1`` followed by ``m``."""
    if s == 0:
        return np.zeros((1, 0), dtype=np.int32)
    prev = _combos(M, s - 1)
    ms = np.arange(s - 1, M)
    counts = np.array([math.comb(int(m), s - 1) for m in ms], dtype=np.int64)
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    rows = np.arange(total, dtype=np.int64) - starts
    out = np.empty((total, s), dtype=np.int32)
    out[:, :s - 1] = prev[rows]
    out[:, s - 1] = np.repeat(ms, counts)
    return out


#: Multisets handled per gather block (bounds the index arrays of a symmetrization).
BLOCK_ROWS = 1 << 16


def _block_bounds(r: int, n: int):
    """Yield ``(lo, hi)``: the blocks of `_multiset_blocks` hold the multisets whose
    largest element lies in ``[lo, hi)`` (about `BLOCK_ROWS` multisets, at least one
    value of the largest element per block)."""
    if n == 0:
        yield 0, r
        return
    lo = 0
    while lo < r:
        hi, rows = lo, 0
        while hi < r and (rows == 0 or rows + math.comb(hi + n - 1, n - 1) <= BLOCK_ROWS):
            rows += math.comb(hi + n - 1, n - 1)  # multisets whose largest element is hi
            hi += 1
        yield lo, hi
        lo = hi


def _multiset_blocks(r: int, n: int):
    """Yield ``(start, alpha)``: the sorted multisets of size ``n`` over ``r`` coordinates in
    packed order, in the blocks of `_block_bounds` (``alpha (rows, n)`` int32).

    In colexicographic order the multisets whose largest element is ``m`` are the
    ``C(m+n-1, n-1)`` first multisets of size ``n-1``, followed by ``m``."""
    if n == 0:
        yield 0, np.zeros((1, 0), dtype=np.int32)
        return
    prev = _combos(r + n - 2, n - 1) if n > 1 else np.zeros((1, 0), dtype=np.int32)
    shift = np.arange(n, dtype=np.int32)
    for lo, hi in _block_bounds(r, n):
        parts = []
        for m in range(lo, hi):
            c = math.comb(m + n - 1, n - 1)
            blk = np.empty((c, n), dtype=np.int32)
            blk[:, :n - 1] = prev[:c]
            blk[:, n - 1] = m + n - 1
            parts.append(blk)
        b = np.concatenate(parts) if len(parts) > 1 else parts[0]
        yield n_packed(lo, n), b - shift


def multiset_weights(r: int, n: int) -> np.ndarray:
    """``n! / prod(multiplicity!)`` for every multiset of size ``n`` (packed order, int64):
    the number of index tuples a packed value stands for."""
    out = np.empty(n_packed(r, n), dtype=np.int64)
    for start, a in _multiset_blocks(r, n):
        denom = np.ones(len(a), dtype=np.int64)
        run = np.ones(len(a), dtype=np.int64)
        for t in range(1, n):
            run = np.where(a[:, t] == a[:, t - 1], run + 1, 1)
            denom *= run
        out[start:start + len(a)] = math.factorial(n) // denom
    return out


def _take(X, idx):
    """``X[..., idx]`` on NumPy or torch."""
    if _is_torch(X):
        import torch

        return X[..., torch.as_tensor(idx, device=X.device)]
    return np.take(X, idx, axis=-1)


#: Gather indices kept between calls (bytes, all entries together): the products of every
#: stage and model of a call, and of later calls at the same width, reuse them.
INDEX_CACHE_BYTES = 64 << 20
_index_cache: dict = {}


def _gather_index(r: int, i: int, j: int, half: bool) -> list:
    """`_build_gather_index`, kept in a small cache (`INDEX_CACHE_BYTES`)."""
    key = (r, i, j, bool(half), BLOCK_ROWS)
    hit = _index_cache.get(key)
    if hit is not None:
        return hit
    idx = _build_gather_index(r, i, j, half)
    size = sum(f.nbytes for _, f, _ in idx)
    if size <= INDEX_CACHE_BYTES:
        while _index_cache and size + sum(sum(f.nbytes for _, f, _ in v)
                                          for v in _index_cache.values()) > INDEX_CACHE_BYTES:
            _index_cache.pop(next(iter(_index_cache)))  # oldest first
        _index_cache[key] = idx
    return idx


def _build_gather_index(r: int, i: int, j: int, half: bool) -> list:
    """Where the symmetrization of a product block reads: ``[(start, flat, window)]`` per
    block of multisets ``alpha`` of size ``n = i + j``, ``flat (n_sets, rows)`` the flattened
    positions ``(alpha_S, alpha_{S^c})`` of a ``(pk(i), pk(j))`` block for each set ``S`` of
    ``i`` positions.

    ``Sym(A (x) B)`` at a sorted multiset ``alpha`` is the mean over the ``C(n, i)`` sets ``S``
    of ``A[alpha_S] B[alpha_{S^c}]`` (each permutation of the ``n`` positions gives one split,
    ``i! j!`` times), and sub-multisets of a sorted tuple are sorted.

    ``half`` (a symmetric block, ``i == j``): only the sets that contain the last position are
    read, so ``alpha_S`` holds the largest element of ``alpha``; a block of multisets whose
    largest element lies in ``[lo, hi)`` then reads only the rows of ``window = (row0, rows,
    cols)``: ``alpha_S`` with largest element in ``[lo, hi)``, ``alpha_{S^c}`` below ``hi``,
    and ``flat`` indexes that window. ``window`` is None otherwise (the whole block)."""
    n = i + j
    pj = n_packed(r, j)
    half = half and n > 0
    subsets = [S for S in itertools.combinations(range(n), i) if not half or (n - 1) in S]
    dt = np.int32 if n_packed(r, i) * pj < 2 ** 31 else np.int64
    out = []
    bounds = list(_block_bounds(r, n))
    for (start, a), (lo, hi) in zip(_multiset_blocks(r, n), bounds):
        flat = np.empty((len(subsets), len(a)), dtype=dt)
        window = None
        if half:
            row0 = n_packed(lo, i)
            window = (row0, n_packed(hi, i) - row0, n_packed(hi, j))
        for q, S in enumerate(subsets):
            Sc = [p for p in range(n) if p not in S]
            if half:
                flat[q] = (_rank(a[:, list(S)], r) - window[0]) * window[2] + _rank(a[:, Sc], r)
            else:
                flat[q] = _rank(a[:, list(S)], r) * pj + _rank(a[:, Sc], r)
        out.append((start, flat, window))
    return out


def _windows(r: int, n: int, i: int) -> list[tuple[int, int, int]]:
    """The ``window``s of `_gather_index` with ``half`` (from the sizes alone)."""
    return [(n_packed(lo, i), n_packed(hi, i) - n_packed(lo, i), n_packed(hi, n - i))
            for lo, hi in _block_bounds(r, n)]


def _sym_product(Y, index: list, scale, out) -> None:
    """Add ``scale`` times the sum over the index sets of `_gather_index` of the product
    block ``Y (..., pk(i), pk(j))`` to the packed ``out (..., pk(i+j))``, in place (``scale``
    ``1/n_sets`` gives the symmetrization)."""
    Yf = Y.reshape(Y.shape[:-2] + (-1,))
    for start, flat, _ in index:
        acc = None
        for q in range(len(flat)):
            v = _take(Yf, flat[q])
            acc = v if acc is None else acc + v
        out[..., start:start + flat.shape[1]] += acc * scale


def _trace_packed(M, n: int, r: int):
    """Contract one pair of indices of the packed symmetric ``M (..., pk(n))``:
    ``(..., pk(n-2))`` with ``tr(M)[beta] = sum_t M[sort(beta + (t, t))]``."""
    out = None
    for start, beta in _multiset_blocks(r, n - 2):
        acc = None
        for t in range(r):
            tt = np.full((len(beta), 2), t, dtype=np.int32)
            g = np.sort(np.concatenate([beta, tt], axis=1), axis=1)
            v = _take(M, _rank(g, r))
            acc = v if acc is None else acc + v
        if out is None:
            if start == 0 and len(beta) == n_packed(r, n - 2):
                out = acc
                continue
            out = _alloc_like(M, M.shape[:-1] + (n_packed(r, n - 2),))
        out[..., start:start + len(beta)] = acc
    return out


def _alloc_like(X, shape):
    if _is_torch(X):
        import torch

        return torch.zeros(shape, dtype=X.dtype, device=X.device)
    if X.dtype == object:
        z = np.empty(shape, dtype=object)
        z.fill(Fraction(0))
        return z
    return np.zeros(shape, dtype=X.dtype)


#: Elements of one product block ``(N, outputs, pk(i), pk(j))``: outputs are taken in chunks
#: that keep it near this size (64 MB in float64), one output at a time at least.
WORK_ELEMENTS = 1 << 23


@dataclass
class _StagePlan:
    """How one bilinear stage is expanded in packed form, and what it costs."""

    form: str          # "H": products over hidden units; "T": over pairs of input units
    pairs: list        # (i, j) degree pairs whose product blocks are formed
    chunk: int         # outputs per product block
    flops: float
    peak: int          # elements alive at once during the stage (its input excluded)
    out_elems: int     # elements of its output polynomial vector


#: Force the form of every later stage ("H" or "T"; tests of both code paths). None: cheaper.
_FORCE_FORM: str | None = None


def _n_sets(i: int, j: int, half: bool) -> int:
    n = i + j
    return math.comb(n, i) // 2 if half and n > 0 else math.comb(n, i)


def _max_block(r: int, n: int) -> int:
    """Rows of the largest block of `_multiset_blocks`."""
    if n == 0:
        return 1
    return min(n_packed(r, n), max(BLOCK_ROWS, math.comb(r + n - 2, n - 1)))


def _block_elems(r: int, i: int, j: int, largest: bool = False) -> int:
    """Elements of the T-form product block ``(i, j)``, ``i <= j``: all of it, or its windows
    for ``i = j`` (the largest window with ``largest``)."""
    if i != j or i == 0:
        return n_packed(r, i) * n_packed(r, j)
    sizes = [rows * cols for _, rows, cols in _windows(r, i + j, i)]
    return max(sizes) if largest else sum(sizes)


def _stage_plan(N: int, H: int, u_in: int, u_out: int, degs_in: list[int], r: int,
                first: bool) -> _StagePlan:
    """Cost model of `_packed_stage` (the computation follows it; the planner sums it).

    Output unit ``o`` of the stage is ``sum_h D[o,h] (L P)_h (R P)_h``, whose order-``(i+j)``
    coefficient is the symmetrization of a product block ``Y_o (pk_i, pk_j)``.
    H-form: apply the forms, ``A_i = L P_i``, ``B_j = R P_j`` ``(H, pk)``, and
    ``Y_o = A_i^T diag(D_o) B_j`` (``2 H pk_i pk_j`` per output and ordered pair).
    T-form (a later stage whose input is narrower than its hidden layer):
    ``T_o = Sym(L^T diag(D_o) R)`` ``(u_in, u_in)`` and ``Y_o = P_i^T T_o P_j``
    (``2 u_in pk_i pk_j`` per output); with ``T_o`` symmetric the blocks ``(i, j)`` and
    ``(j, i)`` symmetrize to the same tensor and ``Y_o`` is symmetric for ``i = j``, so only
    ``i <= j`` is formed, and for ``i = j`` only the windows of `_gather_index` (about
    half of the block, a few rows at a time)."""
    pk = {i: n_packed(r, i) for i in degs_in}
    degs_out = sorted({i + j for i in degs_in for j in degs_in})
    out_elems = N * u_out * sum(n_packed(r, n) for n in degs_out)
    all_pairs = [(i, j) for i in degs_in for j in degs_in]
    half_pairs = [(i, j) for i, j in all_pairs if i <= j]

    def gathers(pairs, half):
        return sum(_n_sets(i, j, half and i == j) * n_packed(r, i + j) for i, j in pairs)

    fl_H = (0.0 if first else 2 * 2.0 * N * H * u_in * sum(pk.values()))
    fl_H += sum(N * u_out * (H * min(pk[i], pk[j]) + 2.0 * H * pk[i] * pk[j])
                for i, j in all_pairs)
    fl_H += 2.0 * N * u_out * gathers(all_pairs, False)
    fl_T = float("inf")
    if not first:
        fl_T = 2.0 * N * u_out * H * u_in ** 2 + N * u_out * H * u_in + N * u_out * u_in ** 2
        fl_T += sum(2.0 * N * u_out * u_in ** 2 * pk[j] for j in degs_in)
        fl_T += sum(2.0 * N * u_out * u_in * _block_elems(r, i, j) for i, j in half_pairs)
        fl_T += 2.0 * N * u_out * gathers(half_pairs, True)
    form = "T" if fl_T < fl_H else "H"
    if _FORCE_FORM is not None and not first:
        form = _FORCE_FORM
    pairs = half_pairs if form == "T" else all_pairs
    if form == "H":
        per_out = N * max(pk[i] * pk[j] + H * min(pk[i], pk[j]) for i, j in pairs)
        forms = 0 if first else 2 * N * H * sum(pk.values())
    else:
        per_out = N * (max(_block_elems(r, i, j, largest=True) for i, j in pairs)
                       + u_in * H + 2 * u_in ** 2 + u_in * sum(pk.values()))
        forms = 0
    chunk = max(1, min(u_out, WORK_ELEMENTS // max(1, per_out)))
    index = sum(_n_sets(i, j, form == "T" and i == j) * n_packed(r, i + j)
                for i, j in pairs)  # int32 or int64: counted as 8 bytes each
    blk = max(_max_block(r, n) for n in degs_out)
    gather = 4 * N * chunk * blk + 4 * blk * max(degs_out)
    peak = forms + chunk * per_out + gather + index + out_elems
    # building the gather indices (ranks of every index set; cached between calls when small)
    build = sum(8.0 * (i + j) * _n_sets(i, j, form == "T" and i == j) * n_packed(r, i + j)
                for i, j in pairs)
    return _StagePlan(form, pairs, chunk, (fl_T if form == "T" else fl_H) + build, peak,
                      out_elems)


def _mm(X, Y):
    return X @ Y


def _tr(X):
    """Swap the last two axes (NumPy or torch)."""
    return X.transpose(-1, -2) if _is_torch(X) else X.swapaxes(-1, -2)


def _packed_stage(st: Stage, P, D, r: int, exact: bool, n_in: int):
    """One bilinear stage on a packed polynomial vector ``P = [(N, u_in, pk(i))]_i`` (None: the
    lifted input ``(1, z)``) of degree at most ``n_in``; ``D (N, u_out, H)``. Returns
    ``[(N, u_out, pk(n))]_n`` (None: a coefficient that vanishes identically), following
    `_stage_plan` (planned for every degree up to ``n_in``, as the planner does)."""
    N, u_out, H = D.shape
    first = P is None
    u_in = st.L.shape[2]
    plan = _stage_plan(N, H, u_in, u_out, list(range(n_in + 1)), r, first)
    degs = [0, 1] if first else [i for i, Pi in enumerate(P) if Pi is not None]
    pairs = [(i, j) for i, j in plan.pairs if i in degs and j in degs]
    plan.pairs = pairs
    out: list = [None] * (2 * max(degs) + 1)
    for i, j in plan.pairs:
        if out[i + j] is None:
            out[i + j] = _alloc_like(st.L, (N, u_out, n_packed(r, i + j)))
    if plan.form == "H":
        if first:
            A = {0: st.L[..., :1], 1: st.L[..., 1:]}
            B = {0: st.R[..., :1], 1: st.R[..., 1:]}
        else:
            A = {i: _mm(st.L, P[i]) for i in degs}
            B = {i: _mm(st.R, P[i]) for i in degs}
    half = plan.form == "T"
    index = {(i, j): _gather_index(r, i, j, half and i == j) for i, j in plan.pairs}
    if _is_torch(st.L):
        import torch

        index = {k: [(s0, torch.as_tensor(f.astype(np.int64), device=st.L.device), w)
                     for s0, f, w in v] for k, v in index.items()}
    one = Fraction(1) if exact else 1.0
    for o0 in range(0, u_out, plan.chunk):
        Dc = D[:, o0:o0 + plan.chunk, :]  # (N, c, H)
        if plan.form == "T":
            T = _mm(_tr(st.L)[:, None, :, :] * Dc[:, :, None, :], st.R[:, None, :, :])
            T = (T + _tr(T)) * (one / 2)                         # (N, c, u_in, u_in)
            TP = {j: _mm(T, P[j][:, None, :, :]) for j in degs}  # (N, c, u_in, pk_j)
            del T
        for i, j in plan.pairs:
            n_sets = index[(i, j)][0][1].shape[0]
            scale = one * (2 if half and i != j else 1) / n_sets
            if index[(i, j)][0][2] is not None:  # symmetric block: window by window
                Pt = _tr(P[i])[:, None, :, :]
                for blk in index[(i, j)]:
                    row0, rows, cols = blk[2]
                    Y = _mm(Pt[:, :, row0:row0 + rows, :], TP[j][..., :cols])
                    _sym_product(Y, [blk], scale, out[i + j][:, o0:o0 + Y.shape[1]])
                    del Y
                continue
            if plan.form == "T":
                Y = _mm(_tr(P[i])[:, None, :, :], TP[j])
            else:
                Ai = _tr(A[i])[:, None, :, :]  # (N, 1, pk_i, H)
                Bj = B[j][:, None, :, :]       # (N, 1, H, pk_j)
                if A[i].shape[-1] <= B[j].shape[-1]:
                    Y = _mm(Ai * Dc[:, :, None, :], Bj)
                else:
                    Y = _mm(Ai, Bj * Dc[:, :, :, None])
            _sym_product(Y, index[(i, j)], scale, out[i + j][:, o0:o0 + Y.shape[1]])
            del Y
        if plan.form == "T":
            del TP
    return out


def packed_features(can: Canonical, U, r: int) -> list:
    """Chaos coefficients ``[C_0, ..., C_n]`` of every model of a (folded) stack in packed
    symmetric storage, each ``(N, K, C(r+k-1, k))``, for the outputs projected by ``U (K, O)``;
    ``None`` for an order that vanishes identically. Pair them with `inner_packed`.

    The lifted polynomial vector is propagated stage by stage with every coefficient
    symmetrized as it is formed (`_packed_stage`), so nothing of size ``r**n`` is built;
    then ``C_k = sum_m (k+2m)!/(k! m! 2^m) tr^m(M_{k+2m})`` (docs/mathematics.md §3.6) with packed traces.
    Source: as `features`.
    """
    exact = can.exact
    Ucast = U if not exact else np.asarray(U, dtype=object)
    if not can.stages:
        W = Ucast[None] @ can.linear[:, 1:, :]
        return [W[..., :1], W[..., 1:]]
    if can.embed is not None:
        raise ValueError("packed_features expands a folded stack (call whiten first)")
    P = None
    for s, st in enumerate(can.stages):
        D = st.D
        if s == len(can.stages) - 1:
            D = Ucast[None] @ D[:, 1:, :]
        P = _packed_stage(st, P, D, r, exact, 2 ** s)
    n_max = len(P) - 1
    C: list = []
    for k in range(n_max + 1):
        acc = None
        for m in range((n_max - k) // 2 + 1):
            t = P[k + 2 * m]
            if t is None:
                continue
            for step in range(m):
                t = _trace_packed(t, k + 2 * (m - step), r)
            coef = math.factorial(k + 2 * m) // (math.factorial(k) * math.factorial(m) * 2 ** m)
            if coef != 1:
                t = t * coef
            acc = t if acc is None else acc + t
        C.append(acc)
    return C


#: Float weights kept between calls up to this many packed coefficients per order (8 MB).
WEIGHTS_CACHE_ELEMENTS = 1 << 20


@lru_cache(maxsize=32)
def _float_weights_cached(r: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    w = (multiset_weights(r, k) * math.factorial(k)).astype(np.float64)
    sw = np.sqrt(w)
    w.flags.writeable = sw.flags.writeable = False
    return w, sw


def _float_weights(r: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(w, sqrt(w))`` in float64 with ``w = k! * k!/prod(mult!)`` per packed coefficient of
    order ``k`` (read-only; cached while small: `WEIGHTS_CACHE_ELEMENTS`)."""
    if n_packed(r, k) <= WEIGHTS_CACHE_ELEMENTS:
        return _float_weights_cached(r, k)
    w = (multiset_weights(r, k) * math.factorial(k)).astype(np.float64)
    return w, np.sqrt(w)


def _weights_like(X, r: int, k: int):
    """``k! * k!/prod(mult!)`` per packed coefficient of order ``k``, as ``X``'s kind."""
    if not _is_torch(X) and X.dtype != object:
        return _float_weights(r, k)[0]
    w = multiset_weights(r, k) * math.factorial(k)
    if _is_torch(X):
        import torch

        return torch.as_tensor(w, dtype=X.dtype, device=X.device)
    if X.dtype == object:
        return np.array([int(v) for v in w], dtype=object)
    return w.astype(np.float64)


def inner_packed(Ca: list, Cb: list, r: int, keep: bool):
    """``sum_k k! <C_k^a, C_k^b>_F`` from packed coefficients: ``(N_a, N_b)`` or
    ``(N_a, N_b, K)`` with ``keep`` (each packed value weighted by the index tuples it stands
    for)."""
    total = None
    for k in range(min(len(Ca), len(Cb))):
        A, B = Ca[k], Cb[k]
        if A is None or B is None:
            continue
        if not keep and not _is_torch(A) and A.dtype != object:
            # weights split as sqrt(w) on both sides: A's Gram with itself is then one X X^T
            # product, which NumPy computes exactly symmetric (syrk)
            sw = _float_weights(r, k)[1]
            Aw = A * sw
            Bw = Aw if B is A else B * sw
            Na, Nb = A.shape[0], B.shape[0]
            X = Aw.reshape(Na, -1)
            t = X @ (X if B is A else Bw.reshape(Nb, -1)).T
        elif keep:
            Aw = A * _weights_like(A, r, k)
            if _is_torch(A):
                import torch

                t = torch.einsum("akI,bkI->abk", Aw, B)
            else:
                t = np.einsum("akI,bkI->abk", Aw, B)
        else:
            Na, Nb = A.shape[0], B.shape[0]
            t = (A * _weights_like(A, r, k)).reshape(Na, -1) @ B.reshape(Nb, -1).T
        total = t if total is None else total + t
    return total


def _angle_weights(s: np.ndarray, r: int, k: int) -> np.ndarray:
    """``k! * k!/prod(mult!) * prod_j s[alpha_j]`` per packed multiset ``alpha`` of order
    ``k`` (float64): the weights of `inner_angles`."""
    w = _float_weights(r, k)[0].copy()
    for start, a in _multiset_blocks(r, k):
        w[start:start + len(a)] *= np.prod(s[a], axis=1)
    return w


def inner_angles(Ca: list, Cb: list, s: np.ndarray, r: int, keep: bool):
    """``sum_k k! sum_alpha s^alpha C_k^a[alpha] C_k^b[alpha]`` (packed, each value weighted
    by the index tuples it stands for): ``E[f_a f_b]`` for chaos coefficients in two inputs
    with ``E[z_a z_b^T] = diag(s)`` (`rotate_to_angles`). ``(N_a, N_b)`` or
    ``(N_a, N_b, K)`` with ``keep``."""
    total = None
    for k in range(min(len(Ca), len(Cb))):
        A, B = Ca[k], Cb[k]
        if A is None or B is None:
            continue
        w = _angle_weights(s, r, k)
        if _is_torch(A):
            import torch

            w = torch.as_tensor(w, dtype=A.dtype, device=A.device)
            t = (torch.einsum("akI,bkI->abk", A * w, B) if keep
                 else (A * w).reshape(A.shape[0], -1) @ B.reshape(B.shape[0], -1).T)
        else:
            t = (np.einsum("akI,bkI->abk", A * w, B) if keep
                 else (A * w).reshape(A.shape[0], -1) @ B.reshape(B.shape[0], -1).T)
        total = t if total is None else total + t
    return total


def _sqrt_weighted(C: list, r: int, n: int) -> np.ndarray:
    """Float64 packed coefficients ``C_k (N, K, n_k)`` (orders ``k < n``; None: zero) times
    ``sqrt(w_k)`` (the weights of `inner_packed`), side by side in one ``(N, F)`` array
    with ``F = K sum_{k<n} n_packed(r, k)``: the model's feature vector phi."""
    N, K = next(A.shape[:2] for A in C if A is not None)
    sizes = [K * n_packed(r, k) for k in range(n)]
    out = np.empty((N, sum(sizes)))
    start = 0
    for k, size in enumerate(sizes):
        A = C[k] if k < len(C) else None
        dst = out[:, start:start + size]
        if A is None:
            dst[...] = 0.0
        else:
            np.multiply(A, _float_weights(r, k)[1], out=dst.reshape(A.shape))
        start += size
    return out


def _weighted_gram(Wa: np.ndarray, Wb: np.ndarray) -> np.ndarray:
    """``(N_a, N_b)`` sums of `inner_packed` from `_sqrt_weighted` features
    (``X X^T`` when both sides are the same array, which NumPy computes exactly symmetric)."""
    return Wa @ Wa.T if Wb is Wa else Wa @ Wb.T


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

#: Stored chaos coefficients of all models of one call (elements): outputs are expanded in
#: chunks that keep them under this (256 MB in float64), one output at a time at least, and
#: the pair products are summed over the chunks.
FEATURE_ELEMENTS = 1 << 25


def _degrees(c: Canonical) -> int:
    return 2 ** c.depth if c.stages else 1


def _output_chunk(cans: list[Canonical], K: int, r: int) -> int:
    """Outputs expanded together (`FEATURE_ELEMENTS`)."""
    per = sum(c.arrays()[0].shape[0] * sum(n_packed(r, k) for k in range(_degrees(c) + 1))
              for c in cans)
    return max(1, min(K, FEATURE_ELEMENTS // max(1, per)))


def _features_on(cans: list[Canonical], U, r: int, conv) -> list[list]:
    """Packed chaos coefficients of every model of every (folded) stack for the outputs
    ``U``, expanded `FEATURE_CHUNK` models at a time into preallocated arrays."""
    out = []
    for c in cans:
        if conv is None and depth1.applies(c):  # closed form, no work arrays
            out.append(depth1.features(c, U))
            continue
        N = c.arrays()[0].shape[0]
        if N <= FEATURE_CHUNK:
            out.append(packed_features(c if conv is None else c.map(conv),
                                       U if conv is None else conv(U), r))
            continue
        full: list = []
        for i0 in range(0, N, FEATURE_CHUNK):
            sub = c.sub(slice(i0, min(N, i0 + FEATURE_CHUNK)))
            part = packed_features(sub if conv is None else sub.map(conv),
                                   U if conv is None else conv(U), r)
            if not full:
                full = [None if x is None else _alloc_like(x, (N,) + tuple(x.shape[1:]))
                        for x in part]
            for k, x in enumerate(part):
                if x is not None:
                    full[k][i0:i0 + x.shape[0]] = x
        out.append(full)
    return out


def _result(X, shape, exact):
    if X is None:
        return _zeros_like_kind(shape, exact)
    if _is_torch(X):
        return X.detach().to("cpu").double().numpy()
    return X


def _chunked(cans: list[Canonical], U, keep: bool, r: int, conv, pairs: list,
             cross_s: np.ndarray | None = None):
    """``sum_k k! <C_k^x, C_k^y>`` for each pair ``(x, y)`` of stack indices in ``pairs``,
    with the outputs expanded in chunks (`_output_chunk`): summed over the chunks, or
    joined along the output axis with ``keep``. With ``cross_s`` (the cosines of the
    principal angles, `rotate_to_angles`), a pair ``x != y`` is `inner_angles`."""
    K = U.shape[0]
    kc = _output_chunk(cans, K, r)
    exact = cans[0].exact
    res: list = [[] for _ in pairs]
    for k0 in range(0, K, kc):
        F = _features_on(cans, U[k0:k0 + kc], r, conv)
        if not keep and conv is None and not exact and len(pairs) > 1 and cross_s is None and all(
                c.arrays()[0].shape[0] == 1 and any(A is not None for A in f)
                for c, f in zip(cans, F)):
            # one model per side, float64 sums over outputs: each model's features weighted
            # once (sqrt(w) per packed value) into one vector, and each pair is a dot product
            n = max(len(f) for f in F)
            W = [_sqrt_weighted(f, r, n) for f in F]
            for q, (x, y) in enumerate(pairs):
                res[q].append(_weighted_gram(W[x], W[y]))
            del F, W
            continue
        for q, (x, y) in enumerate(pairs):
            shape = (cans[x].arrays()[0].shape[0], cans[y].arrays()[0].shape[0]) + (
                (min(K, k0 + kc) - k0,) if keep else ())
            if cross_s is not None and x != y:
                res[q].append(_result(inner_angles(F[x], F[y], cross_s, r, keep), shape, exact))
                continue
            res[q].append(_result(inner_packed(F[x], F[y], r, keep), shape, exact))
        del F
    if keep:
        return [np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
                for parts in res]
    return [sum(parts[1:], parts[0]) for parts in res]


def _route(ca: Canonical, cb: Canonical, U, keep: bool, same: bool) -> str:
    """Which expansion `estimate` costed for this pair: ``"angles"``, ``"metric"`` or
    ``"whiten"`` (so that the computation follows the plan)."""
    est = estimate(ca, cb, U.shape[0], keep, same, ca.exact)
    return "angles" if est.angles else ("metric" if est.metric else "whiten")


def cross(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, same: bool = False,
          conv=None):
    """Exact cross Gram ``<a_i, b_j>`` ``(N_a, N_b[, K])`` of two stacks through their chaos
    coefficients (numpy float64, or Fractions on exact stacks). ``conv``: maps NumPy arrays to
    another backend's (torch) for the expansion; the result comes back as NumPy float64."""
    exact = ca.exact
    if _route(ca, cb, U, keep, same) == "angles":
        cans, s, r = rotate_to_angles(ca, cb)
        return _chunked(cans, U, keep, r, conv, [(0, 1)], cross_s=s)[0]
    if not same and metric_applies(ca, cb):
        return _metric_triple(ca, cb, U, keep, conv, False)[1]
    cans, r = whiten([ca] if same else [ca, cb], exact)
    return _chunked(cans, U, keep, r, conv, [(0, 0)] if same else [(0, 1)])[0]


def triple(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, conv=None):
    """``(<a,a>, <a,b>, <b,b>)`` of two stacks from one expansion of each (one joint
    whitening), for similarities."""
    if _route(ca, cb, U, keep, False) == "angles":
        cans, s, r = rotate_to_angles(ca, cb)
        return tuple(_chunked(cans, U, keep, r, conv, [(0, 0), (0, 1), (1, 1)], cross_s=s))
    if metric_applies(ca, cb):
        return tuple(_metric_triple(ca, cb, U, keep, conv, True))
    cans, r = whiten([ca, cb], ca.exact)
    return tuple(_chunked(cans, U, keep, r, conv, [(0, 0), (0, 1), (1, 1)]))


# ----------------------------------------------------------------------------------------
# cost estimate (from shapes alone)
# ----------------------------------------------------------------------------------------

def _packed_cost(c: Canonical, K: int, r: int) -> tuple[float, int, int]:
    """``(flops, peak, coefficients per model)`` of `packed_features` on the folded
    stack ``c`` (all models, in chunks of `FEATURE_CHUNK`) for ``K`` outputs; ``peak``
    in elements for one chunk of models, the features it returns included."""
    N = c.arrays()[0].shape[0]
    Nw = min(N, FEATURE_CHUNK)
    if not c.stages:
        feats = K * (r + 1)
        return 2.0 * N * K * c.linear.shape[1] * (r + 1), 2 * Nw * feats, feats
    flops, peak, P_in = 0.0, 0, 0
    for s, st in enumerate(c.stages):
        last = s == len(c.stages) - 1
        H, u_in = st.L.shape[-2], st.L.shape[-1]
        if c.embed is not None and s == 0:  # folded by whiten: the first stage reads r + 1
            u_in = r + 1
        u_out = K if last else st.D.shape[-2]
        if last:
            flops += 2.0 * N * K * st.D.shape[-2] * H
        sp = _stage_plan(Nw, H, u_in, u_out, list(range(2 ** s + 1)), r, s == 0)
        flops += sp.flops * (N / Nw)
        peak = max(peak, P_in + sp.peak + (Nw * K * H if last else 0))
        P_in = sp.out_elems
    n = 2 ** len(c.stages)
    feats = K * sum(n_packed(r, k) for k in range(n + 1))
    trace = sum(r * n_packed(r, k) for k in range(n - 1))
    flops += 2.0 * N * K * n * trace + 16.0 * n * n * trace  # sums, and sorted-index ranks
    # chaos coefficients next to the monomial ones, trace temporaries, sorted-index scratch
    peak = max(peak, P_in + Nw * feats + 4 * Nw * K * n_packed(r, max(n - 2, 0))
               + 8 * n * _max_block(r, max(n - 2, 0)))
    return flops, peak, feats


def estimate(ca: Canonical, cb: Canonical, K: int, keep: bool, same: bool,
             exact: bool) -> ChaosEstimate:
    """FLOPs and peak memory of `cross` (and `triple`), from the shapes alone
    (nothing allocated). A function of the shapes only, so kept per shapes (a fresh copy is
    returned: the planner marks refusals on it)."""
    key = (_shape_key(ca), _shape_key(cb), int(K), bool(keep), bool(same), bool(exact),
           ALLOW_ANGLES)
    return replace(_estimate_cached(key, ca, cb))


def _shape_key(c: Canonical) -> tuple:
    return (c.d, c.out, c.depth, c.embed is None, c.shapes())


_ESTIMATES: dict = {}


def _estimate_cached(key: tuple, ca: Canonical, cb: Canonical) -> ChaosEstimate:
    est = _ESTIMATES.get(key)
    if est is None:
        est = _estimate(ca, cb, *key[2:6])
        if len(_ESTIMATES) >= 256:
            _ESTIMATES.clear()
        _ESTIMATES[key] = est
    return est


def _estimate(ca: Canonical, cb: Canonical, K: int, keep: bool, same: bool,
              exact: bool) -> ChaosEstimate:
    if not same and metric_applies(ca, cb):
        est = _estimate_metric(ca, cb, K, keep)
    else:
        cans = [ca] if same else [ca, cb]
        r, whitened = _joint_rank_bound(cans)
        if exact:
            r, whitened = ca.d, False
        est = _estimate_packed(ca, cb, K, keep, same, exact, r, whitened)
    if angles_apply(ca, cb, same, exact):
        alt = _estimate_packed(ca, cb, K, keep, same, exact, _angles_rank_bound(ca, cb), False)
        d, m_a, m_b = ca.d, ca.embed.shape[-2] - 1, cb.embed.shape[-2] - 1
        alt.flops += 2.0 * m_a * m_b * d + 2.0 * (m_a ** 3 + m_b ** 3) + 24.0 * m_a * m_b ** 2
        alt.angles = True
        if alt.flops < est.flops:
            return alt
    return est


def _estimate_packed(ca: Canonical, cb: Canonical, K: int, keep: bool, same: bool,
                     exact: bool, r: int, whitened: bool) -> ChaosEstimate:
    """The packed expansion of every model in ``z ~ N(0, I_r)`` and its pair products."""
    cans = [ca] if same else [ca, cb]
    Na = ca.arrays()[0].shape[0]
    Nb = cb.arrays()[0].shape[0]
    deg = 2 ** max(ca.depth, cb.depth)
    kc = max(1, min(K, FEATURE_ELEMENTS // max(1, sum(
        c.arrays()[0].shape[0] * sum(n_packed(r, k) for k in range(_degrees(c) + 1))
        for c in cans))))
    n_chunks = -(-K // kc)
    flops, peak, n_features, stored = 0.0, 0, 0, 0
    for c in cans:
        N = c.arrays()[0].shape[0]
        if c.embed is not None:  # whitening / folding the embedding
            flops += 2.0 * N * c.embed.shape[-2] * (r + 1) * max(c.stages[0].L.shape[-2], 1) * 2
        f, p, feats = _packed_cost(c, kc, r)
        if c.depth == 1 and not exact:  # the closed-form kernel's work vector, and Du
            H = c.stages[0].L.shape[-2]
            p = max(p, depth1.work_elements(H, r, kc) + N * kc * H + N * feats)
        flops += f * n_chunks
        peak = max(peak, p)
        stored += N * feats
        n_features = max(n_features, feats * K // kc)
    n_max = max(_degrees(c) for c in cans)
    # pair products (three with a similarity's triple), per chunk of outputs
    pair = sum(2.0 * Na * Nb * kc * n_packed(r, k) for k in range(n_max + 1))
    flops += 3 * pair * n_chunks
    weights = 3 * n_packed(r, n_max) + (Na + Nb) * kc * n_packed(r, n_max)
    result = 3 * Na * Nb * (K if keep else 1) * (2 if n_chunks > 1 else 1)
    memory = stored + peak + weights + result
    return ChaosEstimate(r=r, degree=deg, n_features=n_features, flops=flops,
                         memory_elements=int(memory), whitened=whitened)


def _estimate_metric(ca: Canonical, cb: Canonical, K: int, keep: bool) -> ChaosEstimate:
    """The dense expansion in each model's embedded coordinates, paired through
    ``E_a E_b^T`` (one model per side)."""
    cans = [ca, cb]
    metric = True
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
