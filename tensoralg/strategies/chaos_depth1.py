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
``C0`` needs no trace of ``M2`` (``tr M2 = sum_h Du[k,h] <L1_h, R1_h>``). Per output the
product runs on a small reused buffer, so no array of ``K H r`` elements is allocated.
"""

from __future__ import annotations

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


def _features(can: Canonical, U: np.ndarray) -> list[np.ndarray]:
    st = can.stages[0]
    L, R, D = st.L, st.R, st.D
    N, H1, n = L.shape
    r = n - 1
    K = U.shape[0]
    Du = U[None] @ D[:, 1:, :]  # (N, K, H+1)
    l0, r0 = L[:, :, 0], R[:, :, 0]
    L1, R1 = L[:, :, 1:], R[:, :, 1:]
    tr = np.einsum("nhi,nhi->nh", L1, R1)  # <L1_h, R1_h>: tr M2 = Du tr
    C0 = Du @ (l0 * r0 + tr)[:, :, None]  # (N, K, 1)
    C1 = Du @ (l0[:, :, None] * R1 + r0[:, :, None] * L1)  # (N, K, r)
    C2 = np.empty((N, K, r, r))
    half = 0.5 * Du  # C2 = sym M2 = M2' + M2'^T with M2' = L1^T diag(Du/2) R1
    buf = np.empty((r, H1))
    for i in range(N):
        L1T = np.ascontiguousarray(L1[i].T)  # (r, H+1)
        R1i = np.ascontiguousarray(R1[i])
        for k in range(K):
            np.multiply(L1T, half[i, k], out=buf)
            m = buf @ R1i
            np.add(m, m.T, out=C2[i, k])
    jj, ii = np.tril_indices(r)  # packed (colexicographic) order of the pairs i <= j
    return [C0, C1, np.ascontiguousarray(C2[:, :, ii, jj])]
