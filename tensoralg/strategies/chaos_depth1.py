"""Chaos coefficients of depth-1 networks in closed form (a kernel of the chaos strategy,
:mod:`tensoralg.strategies.chaos`, DESIGN §3.6).

A folded lifted stage ``y~ = D ((L z~) * (R z~))`` with ``z~ = (1, z)``, ``z ~ N(0, I_r)``,
projected by ``U (K, O)`` (``Du = U D[1:]``, ``(K, H+1)``), is, per output ``k``, the quadratic
polynomial ``M0 + <M1, z> + z^T M2 z`` with

    M0 = sum_h Du[k,h] l0_h r0_h,   M1 = sum_h Du[k,h] (l0_h R1_h + r0_h L1_h),
    M2 = L1^T diag(Du[k]) R1,

(``l0 = L[:, 0]``, ``L1 = L[:, 1:]``, the same for ``R``). Its chaos (Hermite) coefficients are
``C0 = M0 + tr M2``, ``C1 = M1`` and ``C2 = sym M2`` (``E[z^T M z] = tr M`` and
``z^T M z - tr M = <sym M, He_2(z)>``), so ``<f, g> = C0 C0' + <C1, C1'> + 2 <C2, C2'>``, the
formula of :func:`tensoralg.strategies.chaos.features` at degree 2.

The work is one ``(r x H) @ (H x r)`` product per output and model, about ``2 K H r^2`` FLOPs;
``C0`` needs no trace of ``M2`` (``tr M2 = sum_h Du[k,h] <L1_h, R1_h>``). The products run as
one batched matrix product per chunk of outputs, on a reused buffer of at most
:data:`WORK_ELEMENTS` elements, and ``C2`` is gathered straight into the packed layout.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from ..canonical import Canonical

__all__ = ["applies", "features"]


def applies(can: Canonical) -> bool:
    """A float64 NumPy stack of one folded bilinear stage (no kept embedding)."""
    return (not can.exact and can.embed is None and len(can.stages) == 1
            and isinstance(can.stages[0].L, np.ndarray) and can.stages[0].L.dtype == np.float64)


def features(can: Canonical, U: np.ndarray) -> list[np.ndarray]:
    """``[C0 (N, K, 1), C1 (N, K, r), C2 (N, K, r(r+1)/2)]``: the chaos coefficients of every model
    of a depth-1 stack for the outputs projected by ``U (K, O)``, in the packed layout of
    :func:`tensoralg.strategies.chaos.packed_features` (``C2`` of shape ``(N, K, r(r+1)/2)``).

    On a stack from :mod:`tensoralg.prepare`'s cache (read-only, ``memo`` set) the result is
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


#: Elements of the work vector (copies of ``L1 (H, r)`` and ``R1^T`` and, per chunk of outputs,
#: ``(outputs, r, H)`` and two ``(outputs, r, r)``): 16 MB in float64 unless one output needs
#: more, kept per thread between calls (fresh pages cost more than the products at the widths
#: of a single model).
WORK_ELEMENTS = 1 << 21

_local = threading.local()


def _work(n: int) -> np.ndarray:
    """A float64 scratch vector of ``n`` elements, reused by the calling thread (kept only up
    to :data:`WORK_ELEMENTS`)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = np.empty(n)
        if n <= WORK_ELEMENTS:
            _local.buf = buf
    return buf[:n]


def work_elements(H: int, r: int, K: int) -> int:
    """Elements of the work vector of :func:`features` for one model (``H`` hidden units
    with nonzero factors at most, input width ``r``, ``K`` outputs): an upper bound."""
    kc = max(1, min(K, (WORK_ELEMENTS - 2 * H * r) // max(1, r * H + 2 * r * r)))
    return max(WORK_ELEMENTS, 2 * H * r + kc * (r * H + 2 * r * r))


@lru_cache(maxsize=8)
def _pack_index(r: int, k: int) -> np.ndarray:
    """Flat positions in a ``(k, r, r)`` array of the pairs ``i <= j`` of each of the ``k``
    matrices, in packed (colexicographic) order: ``(k * r(r+1)/2,)``, read-only."""
    jj, ii = np.tril_indices(r)
    idx = (np.arange(k)[:, None] * (r * r) + (ii * r + jj)[None]).ravel()
    idx.flags.writeable = False
    return idx


def _features(can: Canonical, U: np.ndarray) -> list[np.ndarray]:
    st = can.stages[0]
    L, R, D = st.L, st.R, st.D
    N, H1, n = L.shape
    r = n - 1
    K = U.shape[0]
    Du = U[None] @ D[:, 1:, :]  # (N, K, H+1)
    C0 = np.empty((N, K, 1))
    C1 = np.empty((N, K, r))
    C2 = np.empty((N, K, r * (r + 1) // 2))
    for i in range(N):
        Li, Ri, Dui = L[i], R[i], Du[i]
        l0, r0 = Li[:, 0], Ri[:, 0]
        # C0 = M0 + tr M2 with M0 = sum_h Du[k,h] l0_h r0_h (every unit, the constant one too)
        C0[i, :, 0] = Dui @ (l0 * r0)
        # hidden units whose L1 and R1 rows both vanish add nothing to M1 and M2 (unit 0, the
        # constant unit, always: its factors are e0); the products skip a leading one
        h0 = 0 if (Li[0, 1:].any() or Ri[0, 1:].any()) else 1
        _c12(Li[h0:], Ri[h0:], Dui[:, h0:], C0[i, :, 0], C1[i], C2[i])
    return [C0, C1, C2]


def _c12(L: np.ndarray, R: np.ndarray, Du: np.ndarray, c0: np.ndarray, c1: np.ndarray,
         c2: np.ndarray) -> None:
    """For lifted factors ``L, R (H, r+1)`` and ``Du (K, H)``: adds ``tr M2`` to ``c0 (K,)``
    and writes ``c1 (K, r) = M1`` and ``c2 (K, r(r+1)/2)`` = packed ``M2'_k + M2'_k^T`` with
    ``M2'_k = L1^T diag(Du[k]/2) R1``, in chunks of outputs on the thread's work vector."""
    H, r = L.shape[0], L.shape[1] - 1
    K = Du.shape[0]
    kc = max(1, min(K, (WORK_ELEMENTS - 2 * H * r) // max(1, r * H + 2 * r * r)))
    w = _work(2 * H * r + kc * (r * H + 2 * r * r))
    Lc, RT = w[:H * r].reshape(H, r), w[H * r:2 * H * r].reshape(r, H)
    np.copyto(Lc, L[:, 1:])  # contiguous operands for the products
    np.copyto(RT, R[:, 1:].T)
    # tr M2 = sum_h Du[k,h] <L1_h, R1_h>;  M1 = sum_h Du[k,h] (l0_h R1_h + r0_h L1_h)
    c0 += Du @ np.einsum("hi,ih->h", Lc, RT)
    np.matmul(Du * L[:, 0], RT.T, out=c1)
    c1 += (Du * R[:, 0]) @ Lc
    rest = w[2 * H * r:]
    for k0 in range(0, K, kc):
        k1 = min(K, k0 + kc)
        kk = k1 - k0
        b = rest[:kk * r * H].reshape(kk, r, H)
        m = rest[kk * r * H:kk * (r * H + r * r)].reshape(kk * r, r)
        s = rest[kk * (r * H + r * r):kk * (r * H + 2 * r * r)].reshape(kk, r, r)
        # b_k = R1^T diag(Du[k] / 2); one product (kk r, H) @ (H, r) gives the transposes of
        # M2'_k for the chunk; C2 = M2' + M2'^T
        np.multiply(RT[None], (0.5 * Du[k0:k1])[:, None, :], out=b)
        np.matmul(b.reshape(kk * r, H), Lc, out=m)
        m3 = m.reshape(kk, r, r)
        np.add(m3, m3.transpose(0, 2, 1), out=s)
        np.take(s, _pack_index(r, kk), out=c2[k0:k1].reshape(-1), mode="clip")
