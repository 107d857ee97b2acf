"""Run-to-run stability of sparse decompositions: are two dictionaries / codes the same?

Two decompositions ``x ≈ z_a @ D_a ≈ z_b @ D_b`` (dictionaries with atoms as rows, shape
``(m, d)``; codes ``(n, m)``) are identified up to a permutation ``π`` and signs ``s`` of the
atoms. The metrics (as in the identifiable-SAE literature; Hungarian matching as in
Kuhn 1955 via ``scipy.optimize.linear_sum_assignment``):

* [`match_atoms`][verify.identifiability.match_atoms]: the assignment ``π`` maximizing
  ``Σ_i |cos(a_i, b_π(i))|`` and the signs ``s_i = sign cos(a_i, b_π(i))``;
* DCS (dictionary cosine similarity) = mean over matched pairs of ``|cos|`` (1 iff every atom of
  the smaller dictionary has an exact ±copy in the other);
* code IoU = mean over samples of ``|S_a ∩ π(S_b)| / |S_a ∪ π(S_b)|`` (supports = non-zeros);
* code relative ℓ2 = ``‖Z_a - Z_b'‖_F / ‖Z_a‖_F`` with ``Z_b'`` the permuted, sign-flipped codes.

This module recomputes everything from the definitions with numpy / scipy; it imports nothing
from `tensoralg`. Zero (dead) atoms have cosine 0 with everything — never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = ["Matching", "match_atoms", "dictionary_cosine_similarity", "align_codes", "code_iou",
           "code_l2", "compare", "random_baseline", "resolve_ties"]


def _as_array(a, name: str, ndim: int = 2) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().to("cpu").double().numpy()
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: contains NaN or inf")
    return arr


def _unit_rows(D: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(D, axis=1, keepdims=True)
    return np.divide(D, norms, out=np.zeros_like(D), where=norms > 0)


@dataclass
class Matching:
    """Atom ``rows_a[i]`` of ``D_a`` matches atom ``rows_b[i]`` of ``D_b`` with ``signs[i]``.

    ``cos[i]`` is the signed cosine of the pair; ``perm`` maps every atom of ``D_a`` to its
    partner in ``D_b`` (``-1`` when ``D_a`` has more atoms than ``D_b`` and it is unmatched).
    """

    rows_a: np.ndarray
    rows_b: np.ndarray
    signs: np.ndarray
    cos: np.ndarray
    perm: np.ndarray
    shape: tuple

    @property
    def dcs(self) -> float:
        return float(np.mean(np.abs(self.cos))) if self.cos.size else 0.0


def match_atoms(D_a, D_b) -> Matching:
    """Hungarian matching of the atoms (rows) of ``D_a (m_a, d)`` and ``D_b (m_b, d)`` on |cos|.

    Raises:
        ValueError: not 2-d, different ``d``, or non-finite entries.
    """
    A = _as_array(D_a, "D_a")
    B = _as_array(D_b, "D_b")
    if A.shape[1] != B.shape[1]:
        raise ValueError(f"D_a, D_b: atoms must have the same dimension, got shapes {A.shape} "
                         f"and {B.shape}")
    C = _unit_rows(A) @ _unit_rows(B).T
    ra, rb = linear_sum_assignment(-np.abs(C))
    cos = C[ra, rb]
    signs = np.where(cos < 0, -1.0, 1.0)
    perm = np.full(A.shape[0], -1, dtype=np.int64)
    perm[ra] = rb
    return Matching(ra, rb, signs, cos, perm, (A.shape[0], B.shape[0]))


def dictionary_cosine_similarity(D_a, D_b) -> float:
    """DCS: mean ``|cos|`` over the Hungarian-matched atom pairs, in ``[0, 1]``."""
    return match_atoms(D_a, D_b).dcs


def align_codes(z_b, matching: Matching) -> tuple[np.ndarray, np.ndarray]:
    """Express codes ``z_b (n, m_b)`` in ``D_a``'s atom order and signs.

    Returns ``(z_b_aligned (n, m_a), leftover (n, m_b))``: ``leftover`` holds the entries on
    atoms of ``D_b`` that no atom of ``D_a`` matched (they count as mismatches).
    """
    Zb = _as_array(z_b, "z_b")
    m_a, m_b = matching.shape
    if Zb.shape[1] != m_b:
        raise ValueError(f"z_b: expected (n, m_b={m_b}) codes, got shape {Zb.shape}")
    aligned = np.zeros((Zb.shape[0], m_a))
    aligned[:, matching.rows_a] = Zb[:, matching.rows_b] * matching.signs
    leftover = Zb.copy()
    leftover[:, matching.rows_b] = 0.0
    return aligned, leftover


def _codes_pair(z_a, z_b, matching: Matching):
    Za = _as_array(z_a, "z_a")
    m_a, _ = matching.shape
    if Za.shape[1] != m_a:
        raise ValueError(f"z_a: expected (n, m_a={m_a}) codes, got shape {Za.shape}")
    Zb, left = align_codes(z_b, matching)
    if Zb.shape[0] != Za.shape[0]:
        raise ValueError(f"z_a, z_b: different numbers of samples, {Za.shape[0]} and {Zb.shape[0]}")
    return Za, Zb, left


def code_iou(z_a, z_b, matching: Matching, tol: float = 0.0) -> float:
    """Mean over samples of ``|S_a ∩ π(S_b)| / |S_a ∪ π(S_b)|`` (supports: ``|z| > tol``).

    A sample where both codes are empty counts as 1 (identical supports); active entries of
    ``z_b`` on unmatched atoms enlarge the union only.
    """
    Za, Zb, left = _codes_pair(z_a, z_b, matching)
    Sa, Sb = np.abs(Za) > tol, np.abs(Zb) > tol
    inter = (Sa & Sb).sum(axis=1)
    union = (Sa | Sb).sum(axis=1) + (np.abs(left) > tol).sum(axis=1)
    iou = np.divide(inter, union, out=np.ones(len(inter)), where=union > 0)
    return float(iou.mean()) if iou.size else 1.0


def code_l2(z_a, z_b, matching: Matching) -> float:
    """Relative error ``‖Z_a - Z_b'‖_F / ‖Z_a‖_F`` after permutation and sign (0 if both are 0).

    ``Z_a`` is the reference (the ground truth, when comparing against it); energy of ``z_b``
    on unmatched atoms adds to the error. If ``Z_a = 0`` but ``Z_b ≠ 0`` the result is ``inf``.
    """
    Za, Zb, left = _codes_pair(z_a, z_b, matching)
    err = np.sqrt(np.sum((Za - Zb) ** 2) + np.sum(left ** 2))
    ref = np.sqrt(np.sum(Za ** 2))
    if ref == 0:
        return 0.0 if err == 0 else float("inf")
    return float(err / ref)


def _duplicate_classes(U: np.ndarray, tol: float) -> list[np.ndarray]:
    """Classes (size >= 2) of rows of the unit-row matrix ``U`` equal up to sign: ``|cos| >= 1 - tol``."""
    if U.shape[0] < 2:
        return []
    same = np.abs(U @ U.T) >= 1.0 - tol
    same &= np.linalg.norm(U, axis=1)[:, None] > 0          # zero atoms are never duplicates
    seen = np.zeros(U.shape[0], dtype=bool)
    classes = []
    for i in range(U.shape[0]):
        if seen[i] or not same[i].any():
            continue
        members = np.flatnonzero(same[i])
        seen[members] = True
        if members.size > 1:
            classes.append(members)
    return classes


def resolve_ties(matching: Matching, D_a, D_b, z_a, z_b, tol: float = 1e-12) -> Matching:
    """Re-pair atoms inside groups of duplicate atoms by their codes.

    When ``D_b`` (or ``D_a``) holds several atoms equal up to sign (``|cos| >= 1 - tol``), every
    assignment of them to their partners has the same ``Σ |cos|``, so the Hungarian matching
    picks one arbitrarily and the code metrics would depend on that choice (swapping two
    identical atoms together with their codes changed code IoU from 0.71 to 1.00). Inside each
    such group the partners are re-assigned to maximize, per pair, the number of samples where
    both codes are active plus half the cosine of the sign-aligned code columns (a tie-break in
    ``[-0.5, 0.5]`` below one shared sample). ``Σ |cos|`` and the DCS are unchanged.
    """
    A = _unit_rows(_as_array(D_a, "D_a"))
    B = _unit_rows(_as_array(D_b, "D_b"))
    Za, Zb = _as_array(z_a, "z_a"), _as_array(z_b, "z_b")
    C = A @ B.T
    perm = matching.perm.copy()
    for side, classes in (("b", _duplicate_classes(B, tol)), ("a", _duplicate_classes(A, tol))):
        for cls in classes:
            if side == "b":      # atoms of A matched into this class of B
                rows = np.flatnonzero(np.isin(perm, cls))
                cols = perm[rows]
            else:                # this class of A and their partners in B
                rows = cls[perm[cls] >= 0]
                cols = perm[rows]
            if rows.size < 2:
                continue
            sa = np.abs(Za[:, rows]) > 0
            sb = np.abs(Zb[:, cols]) > 0
            both = sa.T.astype(np.float64) @ sb.astype(np.float64)
            sign = np.where(C[np.ix_(rows, cols)] < 0, -1.0, 1.0)
            na = np.linalg.norm(Za[:, rows], axis=0)
            nb = np.linalg.norm(Zb[:, cols], axis=0)
            denom = np.outer(na, nb)
            corr = np.divide(Za[:, rows].T @ Zb[:, cols], denom, out=np.zeros_like(denom),
                             where=denom > 0) * sign
            r, c = linear_sum_assignment(-(both + 0.5 * corr))
            perm[rows[r]] = cols[c]
    ra = np.flatnonzero(perm >= 0)
    rb = perm[ra]
    cos = C[ra, rb]
    return Matching(ra, rb, np.where(cos < 0, -1.0, 1.0), cos, perm, matching.shape)


def compare(D_a, D_b, z_a=None, z_b=None) -> dict:
    """All stability metrics of decomposition a against b.

    Returns ``{"dcs", "code_iou", "code_l2"}`` (the code entries only when both codes are
    given), plus ``"perm"`` and ``"signs"`` as lists. With codes, duplicate atoms are paired
    by their codes ([`resolve_ties`][verify.identifiability.resolve_ties]), so the score does not
    depend on how the matching breaks ties.
    """
    m = match_atoms(D_a, D_b)
    if z_a is not None and z_b is not None:
        m = resolve_ties(m, D_a, D_b, z_a, z_b)
    out = {"dcs": m.dcs}
    if z_a is not None and z_b is not None:
        out["code_iou"] = code_iou(z_a, z_b, m)
        out["code_l2"] = code_l2(z_a, z_b, m)
    out["perm"] = m.perm.tolist()
    out["signs"] = [float(s) for s in m.signs]
    return out


def random_baseline(m_a: int, m_b: int, d: int, n_draws: int = 5, seed: int = 0) -> dict:
    """DCS of two independent random unit dictionaries (``(m_a, d)`` vs ``(m_b, d)``).

    The floor a learned DCS must clear to mean anything: Hungarian matching alone gives a
    positive DCS to unrelated dictionaries (larger for small ``d`` and many atoms). Returns
    ``{"dcs_mean", "dcs_std", "n_draws"}``.
    """
    rng = np.random.default_rng(seed)
    vals = [dictionary_cosine_similarity(rng.standard_normal((m_a, d)), rng.standard_normal((m_b, d)))
            for _ in range(n_draws)]
    return {"dcs_mean": float(np.mean(vals)), "dcs_std": float(np.std(vals)), "n_draws": n_draws}
