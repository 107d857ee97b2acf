"""Batched orthogonal matching pursuit (OMP) in torch — the sparse-coding oracle.

OMP (Pati, Rezaiifar & Krishnaprasad 1993): start from the residual ``r = x``; ``k`` times, add
the atom with the largest ``|⟨r, d_j⟩|`` to the support (first index on ties, as
``numpy.argmax``) and re-fit all coefficients on the support by least squares. This is the
algorithm of scikit-learn's ``OrthogonalMatchingPursuit`` (``orthogonal_mp``), run here on a
whole batch at once.
"""

from __future__ import annotations

import torch

__all__ = ["omp"]


@torch.no_grad()
def omp(x: torch.Tensor, W_dec: torch.Tensor, k: int, b_dec: torch.Tensor | None = None,
        normalize: bool = True) -> torch.Tensor:
    """k-sparse codes of ``x`` over the dictionary ``W_dec`` by orthogonal matching pursuit.

    Args:
        x: ``(n, d_in)`` signals.
        W_dec: ``(d_sae, d_in)`` dictionary (atoms are rows).
        k: number of atoms per signal (``1 <= k <= min(d_sae, d_in)``).
        b_dec: optional ``(d_in,)`` offset subtracted from ``x`` first.
        normalize: select atoms by correlation with the *normalized* atoms (the coefficients
            are always those of the atoms as given). With unit-norm atoms it makes no
            difference; scikit-learn assumes normalized columns.
    Returns:
        ``(n, d_sae)`` codes ``z`` with ``x - b_dec ≈ z @ W_dec``, computed in float64 and
        returned in ``x``'s dtype.
    Raises:
        ValueError: shapes that do not match or a ``k`` out of range.
    """
    if x.ndim != 2 or W_dec.ndim != 2 or x.shape[1] != W_dec.shape[1]:
        raise ValueError(f"x, W_dec: expected (n, d_in) and (d_sae, d_in), got {tuple(x.shape)} "
                         f"and {tuple(W_dec.shape)}")
    m, d = W_dec.shape
    if not isinstance(k, int) or not 1 <= k <= min(m, d):
        raise ValueError(f"k: expected an int in [1, min(d_sae, d_in)={min(m, d)}], got {k!r}")
    out_dtype = x.dtype
    X = x.detach().double()
    if b_dec is not None:
        X = X - b_dec.detach().double().to(X.device)
    D = W_dec.detach().double().to(X.device)
    norms = D.norm(dim=1)
    Dsel = D / norms.clamp_min(1e-300)[:, None] if normalize else D
    n = X.shape[0]
    support = torch.zeros(n, 0, dtype=torch.long, device=X.device)
    chosen = torch.zeros(n, m, dtype=torch.bool, device=X.device)
    resid = X
    coef = torch.zeros(n, 0, dtype=X.dtype, device=X.device)
    rows = torch.arange(n, device=X.device)
    for _ in range(k):
        corr = (resid @ Dsel.T).abs().masked_fill(chosen, -1.0)
        corr = corr.masked_fill(norms[None, :] == 0, -1.0)
        j = torch.argmax(corr, dim=1)                 # first maximum on ties
        chosen[rows, j] = True
        support = torch.cat([support, j[:, None]], dim=1)
        A = D[support].transpose(1, 2)                # (n, d, t)
        coef = torch.linalg.lstsq(A, X[:, :, None]).solution[:, :, 0]
        resid = X - (A @ coef[:, :, None])[:, :, 0]
    z = torch.zeros(n, m, dtype=X.dtype, device=X.device).scatter(1, support, coef)
    return z.to(out_dtype)
