"""Chaos coefficients of depth-1 networks in closed form (a kernel of the chaos strategy,
`tensoralg.strategies.chaos.position_free`, docs/mathematics.md §3.6).

A folded lifted stage ``y~ = D ((L z~) * (R z~))`` with ``z~ = (1, z)``, ``z ~ N(0, I_r)``,
projected by ``U (K, O)`` (``Du = U D[1:]``, ``(K, H+1)``), is, per output ``k``, the quadratic
polynomial ``M0 + <M1, z> + z^T M2 z`` with

    M0 = sum_h Du[k,h] l0_h r0_h,   M1 = sum_h Du[k,h] (l0_h R1_h + r0_h L1_h),
    M2 = L1^T diag(Du[k]) R1,

(``l0 = L[:, 0]``, ``L1 = L[:, 1:]``, the same for ``R``). Its chaos (Hermite) coefficients are
``C0 = M0 + tr M2``, ``C1 = M1`` and ``C2 = sym M2`` (``E[z^T M z] = tr M`` and
``z^T M z - tr M = <sym M, He_2(z)>``), so ``<f, g> = C0 C0' + <C1, C1'> + 2 <C2, C2'>``, the
formula of `tensoralg.strategies.chaos.position_free.features` at degree 2.

All three come from one product over the lifted coordinates: with
``M~ = L~^T diag(Du[k]/2) R~`` and ``S = M~ + M~^T`` (``(r+1, r+1)``), ``S[0,0] = M0``,
``S[0,1:] = M1 / 2`` and ``S[1:,1:] = sym M2``, so ``C0 = tr S``, ``C1 = 2 S[0,1:]`` and ``C2``
is the lower right block. The work is one ``(r+1 x H) @ (H x r+1)`` product per output and
model, about ``2 K H (r+1)^2`` FLOPs, run as one matrix product per chunk of outputs on a
reused work vector (`WORK_ELEMENTS`), with ``C2`` gathered straight into the packed
layout.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from ...canonical import Canonical

__all__ = ["applies", "features"]


def applies(can: Canonical) -> bool:
    """A float64 NumPy stack of one folded bilinear stage (no kept embedding)."""
    return (not can.exact and can.embed is None and len(can.stages) == 1
            and isinstance(can.stages[0].L, np.ndarray) and can.stages[0].L.dtype == np.float64)


def features(can: Canonical, U: np.ndarray) -> list[np.ndarray]:
    """``[C0 (N, K, 1), C1 (N, K, r), C2 (N, K, r(r+1)/2)]``: the chaos coefficients of every model
    of a depth-1 stack for the outputs projected by ``U (K, O)``, in the packed layout of
    `tensoralg.strategies.chaos.position_free.packed_features` (``C2`` of shape
    ``(N, K, r(r+1)/2)``).

    On a stack from `tensoralg.prepare`'s cache (read-only, ``memo`` set) the result is
    kept in its memo per ``U`` (up to ``MEMO_BYTES`` each; read-only arrays)."""
    key = None
    if can.memo is not None:
        key = ("chaos_depth1", U.shape, np.ascontiguousarray(U, dtype=np.float64).tobytes())
        hit = can.memo.get(key)
        if hit is not None:
            return list(hit)
    out = _features(can, U)
    if key is not None and sum(x.nbytes for x in out) <= MEMO_BYTES and len(can.memo) < 4:
        for x in out:
            x.flags.writeable = False
        can.memo[key] = tuple(out)
    return out


#: Largest set of coefficients kept in a cached stack's memo (bytes).
MEMO_BYTES = 16 * 2**20


#: Elements of the work vector (a copy of ``R~^T (r+1, H)`` and, per chunk of outputs,
#: ``(outputs, r+1, H)`` and two ``(outputs, r+1, r+1)``): 16 MB in float64 unless one output
#: needs more, kept per thread between calls (fresh pages cost more than the products at the
#: widths of a single model).
WORK_ELEMENTS = 1 << 21

_local = threading.local()


def _work(n: int) -> np.ndarray:
    """A float64 scratch vector of ``n`` elements, reused by the calling thread (kept only up
    to `WORK_ELEMENTS`)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = np.empty(n)
        if n <= WORK_ELEMENTS:
            _local.buf = buf
    return buf[:n]


def work_elements(H: int, r: int, K: int) -> int:
    """Elements of the work vector of `features` for one model (``H`` hidden units
    at most, input width ``r``, ``K`` outputs): an upper bound."""
    n = r + 1
    kc = max(1, min(K, (WORK_ELEMENTS - n * H) // max(1, n * H + 2 * n * n)))
    return max(WORK_ELEMENTS, n * H + kc * (n * H + 2 * n * n))


@lru_cache(maxsize=8)
def _pack_index(n: int, k: int) -> np.ndarray:
    """Flat positions in a ``(k, n, n)`` array of the pairs ``1 <= i <= j < n`` of each of the
    ``k`` matrices (the lower right ``(n-1, n-1)`` block), in packed (colexicographic) order:
    ``(k * r(r+1)/2,)`` with ``r = n - 1``, read-only."""
    jj, ii = np.tril_indices(n - 1)
    idx = (np.arange(k)[:, None] * (n * n) + ((ii + 1) * n + jj + 1)[None]).ravel()
    idx.flags.writeable = False
    return idx


def _features(can: Canonical, U: np.ndarray) -> list[np.ndarray]:
    st = can.stages[0]
    L, R, D = st.L, st.R, st.D
    N, _H1, n = L.shape
    r = n - 1
    K = U.shape[0]
    Du = U[None] @ D[:, 1:, :]  # (N, K, H+1)
    C0 = np.empty((N, K, 1))
    C1 = np.empty((N, K, r))
    C2 = np.empty((N, K, r * (r + 1) // 2))
    for i in range(N):
        Li, Ri, Dui = L[i], R[i], Du[i]
        # a hidden unit whose L and R rows vanish off the constant column (unit 0, the constant
        # unit, always: its factors are e0) adds only Du[k,h] l0_h r0_h to M0: kept out of the
        # products when it leads
        h0 = 0 if (Li[0, 1:].any() or Ri[0, 1:].any()) else 1
        _chaos012(Li[h0:], Ri[h0:], Dui[:, h0:], C0[i, :, 0], C1[i], C2[i])
        if h0:
            C0[i, :, 0] += Dui[:, 0] * (Li[0, 0] * Ri[0, 0])
    return [C0, C1, C2]


def _chaos012(L: np.ndarray, R: np.ndarray, Du: np.ndarray, c0: np.ndarray, c1: np.ndarray,
              c2: np.ndarray) -> None:
    """Chaos coefficients of ``sum_h Du[k,h] (L~_h . z~)(R~_h . z~)`` for lifted factors
    ``L, R (H, r+1)`` and ``Du (K, H)``, written to ``c0 (K,)``, ``c1 (K, r)`` and
    ``c2 (K, r(r+1)/2)`` (packed).

    One product per chunk of outputs gives ``S_k = M~_k + M~_k^T`` with
    ``M~_k = L~^T diag(Du[k]/2) R~`` over the lifted coordinates, and then
    ``S_k[0,0] = M0``, ``S_k[0,1:] = M1 / 2``, ``S_k[1:,1:] = sym M2``, so that
    ``C0 = M0 + tr M2 = tr S_k``, ``C1 = 2 S_k[0,1:]`` and ``C2`` is the lower right block.
    Work on the thread's work vector."""
    H, n = L.shape
    K = Du.shape[0]
    kc = max(1, min(K, (WORK_ELEMENTS - n * H) // max(1, n * H + 2 * n * n)))
    w = _work(n * H + kc * (n * H + 2 * n * n))
    RT = w[:n * H].reshape(n, H)
    np.copyto(RT, R.T)  # contiguous rows for the scaling below
    Lc = L if L.flags.c_contiguous else np.ascontiguousarray(L)
    rest = w[n * H:]
    for k0 in range(0, K, kc):
        k1 = min(K, k0 + kc)
        kk = k1 - k0
        b = rest[:kk * n * H].reshape(kk, n, H)
        m = rest[kk * n * H:kk * (n * H + n * n)].reshape(kk * n, n)
        s = rest[kk * (n * H + n * n):kk * (n * H + 2 * n * n)].reshape(kk, n, n)
        # b_k = R~^T diag(Du[k] / 2); (kk n, H) @ (H, n) gives the transposes of M~_k
        np.multiply(RT[None], (0.5 * Du[k0:k1])[:, None, :], out=b)
        np.matmul(b.reshape(kk * n, H), Lc, out=m)
        m3 = m.reshape(kk, n, n)
        np.add(m3, m3.transpose(0, 2, 1), out=s)
        np.einsum("kii->k", s, out=c0[k0:k1])
        np.multiply(s[:, 0, 1:], 2.0, out=c1[k0:k1])
        np.take(s, _pack_index(n, kk), out=c2[k0:k1].reshape(-1), mode="clip")
