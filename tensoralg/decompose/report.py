"""Reports of eigen-components in input space: localization numbers and the eigenvector figure
(shared by ``tensoralg decompose`` and the backdoor / forgetting audits)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["change_eigen", "mask_mass", "eigenvector_figure", "path_share_figure"]


def mask_mass(v: np.ndarray, mask: np.ndarray) -> dict:
    """Share of ``|v|^2`` on the input coordinates in ``mask`` against the mask's share of
    coordinates (``ratio > 1``: the vector concentrates on the mask)."""
    v = np.asarray(v, dtype=float)
    mask = np.asarray(mask, dtype=bool).reshape(-1)
    if mask.shape != v.shape:
        raise ValueError(f"mask: expected shape {v.shape} to match the input, got {mask.shape}")
    total = float(v @ v)
    frac = float(v[mask] @ v[mask]) / total if total > 0 else float("nan")
    share = float(mask.mean())
    return {"mass_inside": frac, "pixel_share": share, "ratio": frac / share}


def change_eigen(before: Any, after: Any, output: int, k: int = 4,
                 mask: np.ndarray | None = None) -> tuple[Any, dict]:
    """Eigen-components of output ``output`` of the change ``after - before`` (one network,
    [`tensoralg.decompose.difference`][tensoralg.decompose.difference]) and a JSON summary: norm of
    the change, top ``k`` eigenvalues, their share of the change's ``||.||^2`` (chaos-2 part), the
    relative error of keeping ``k``, and (with ``mask``) the squared mass inside the mask of the top
    eigenvector, of each of the top ``k``, and of the linear (chaos-1) term ``C1``.

    Raises:
        ValueError: a network of depth >= 2 (see
            [`tensoralg.decompose.eigen`][tensoralg.decompose.eigen]).
    """
    from . import difference, eigen

    e = eigen(difference(before, after), output)
    k = min(k, e.d)
    fa = e.faithfulness()
    lam2 = e.eigenvalues ** 2
    summary = {"output": int(output), "change_norm2": e.norm2,
               "top_eigenvalues": e.eigenvalues[:k].tolist(),
               "top_k_share_of_quadratic": float(lam2[:k].sum() / lam2.sum()) if lam2.sum() > 0
               else None,
               "relative_error_keeping_top_k": float(fa["relative_error"][k]), "k": k}
    if mask is not None:
        summary["top_eigenvector_mask"] = mask_mass(e.eigenvectors[0], mask)
        summary["top_k_mask_mass"] = [mask_mass(v, mask)["mass_inside"] for v in e.eigenvectors[:k]]
        summary["linear_term_mask"] = (mask_mass(e.C1, mask) if np.any(e.C1) else None)
    return e, summary


def eigenvector_figure(path: str | Path, eig: Any, k: int, title: str,
                       mask: np.ndarray | None = None, mask_label: str = "trigger") -> Path:
    """The top ``k`` eigenvectors drawn as square images (``d`` a perfect square) or bar plots,
    with the mask (e.g. the trigger) as the first panel. PNG, written atomically."""
    from ..audit.common import save_figure
    from ..audit.plotting import pyplot

    plt = pyplot()
    k = min(k, eig.d)
    side = math.isqrt(eig.d)
    square = side * side == eig.d
    n = k + (mask is not None)
    fig, axes = plt.subplots(1, n, figsize=(2.2 * n + 0.4, 2.6), squeeze=False)
    axes = axes[0]
    j = 0
    if mask is not None:
        m = np.asarray(mask, dtype=float).reshape(-1)
        if square:
            axes[0].imshow(m.reshape(side, side), cmap="Greys", vmin=0, vmax=1)
        else:
            axes[0].bar(range(eig.d), m, color="k")
        axes[0].set_title(mask_label, fontsize=8)
        j = 1
    # one colour scale for every eigenvector panel, so that the one colour bar reads them all
    lim = float(max((np.abs(eig.eigenvectors[i]).max() for i in range(k)), default=0.0)) or 1.0
    for i in range(k):
        v = eig.eigenvectors[i]
        ax = axes[j + i]
        if square:
            im = ax.imshow(v.reshape(side, side), cmap="RdBu_r", vmin=-lim, vmax=lim)
        else:
            ax.bar(range(eig.d), v, color=np.where(v >= 0, "tab:red", "tab:blue"))
        ax.set_title(f"v{i + 1}, λ={eig.eigenvalues[i]:.3g}", fontsize=8)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    if square and k:
        fig.colorbar(im, ax=list(axes), shrink=0.7).set_label("eigenvector entry (unit norm)",
                                                              fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def path_share_figure(path: str | Path, paths: dict, title: str) -> Path:
    """Each listed path's exact share of ``||sum of the listed paths||^2`` (``paths``: the
    ``to_dict()`` of a transformer's path decomposition) as horizontal bars, the
    second-order paths (virtual heads) in their own colour. PNG, written atomically."""
    from ..audit.common import save_figure
    from ..audit.plotting import pyplot

    plt = pyplot()
    names, share, kinds = paths["names"], paths["share"], paths["kinds"]
    fig, ax = plt.subplots(figsize=(6.0, 0.8 + 0.22 * len(names)))
    colours = ["tab:orange" if k == "composition" else "tab:blue" for k in kinds]
    ax.barh(range(len(names)), share, color=colours)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("share of ||sum of the listed paths||^2 (exact; orange: second-order)",
                  fontsize=8)
    ax.set_title(f"{title}: paths at n_ctx={paths['n_ctx']}", fontsize=9)
    return save_figure(fig, path)
