"""Figures for the audits (matplotlib, Agg backend; written atomically as PNG)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .common import method_label, save_figure


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def slice_bars(path: Path, slices: Sequence[float], target: int | None,
               baselines: Mapping[str, float], title: str, control: Sequence[float] | None = None,
               global_similarity: float | None = None,
               per_class: Mapping[str, tuple[Sequence[float], Mapping]] | None = None,
               tensor_localisation: Mapping | None = None) -> Path:
    """Per-class slice similarity (target class highlighted) with the global tensor similarity
    and the similarity-like baselines drawn as horizontal lines; the legend sits outside the
    axes so that it never covers a bar.

    ``per_class``: ``{name: (scores per class, its localisation dict)}``: a row of small bar
    panels under the main one, one per behavioural per-class score, each titled with the
    localisation rule's separation (``tensor_localisation``: the same for the main panel)."""
    plt = pyplot()
    if per_class:
        n = len(per_class)
        fig = plt.figure(figsize=(max(7.5, 2.9 * n), 8.2))
        gs = fig.add_gridspec(2, n, height_ratios=[1.25, 1.0], hspace=0.55, wspace=0.35)
        ax = fig.add_subplot(gs[0, :])
        small = [fig.add_subplot(gs[1, i]) for i in range(n)]
    else:
        fig, ax = plt.subplots(figsize=(7.5, 4))
        small = []
    k = len(slices)
    colors = ["tab:red" if c == target else "tab:blue" for c in range(k)]
    width = 0.4 if control is not None else 0.8
    ax.bar(np.arange(k) - (width / 2 if control is not None else 0), slices, width=width,
           color=colors, label="tensor similarity (class slice)")

    if control is not None:
        ax.bar(np.arange(k) + width / 2, control, width=width, color="tab:gray", alpha=0.6,
               label="control: clean fine-tune")
    if global_similarity is not None:
        ax.axhline(global_similarity, ls="-", color="black", lw=1.4,
                   label=f"global tensor similarity = {global_similarity:.3f}")
    styles = ["--", ":", "-.", (0, (5, 1)), (0, (1, 1))]
    for i, (name, value) in enumerate(baselines.items()):
        if value is None or name == "js_divergence":
            continue
        ax.axhline(value, ls=styles[i % len(styles)], color=f"C{i + 2}", lw=1.2,
                   label=f"{name} = {value:.3f}")
    lo = min(list(slices) + [v for v in baselines.values() if v is not None
                                    and not np.isnan(v)] + ([min(control)] if control else [])
             + ([global_similarity] if global_similarity is not None else []))
    ax.set_ylim(max(0.0, lo - 0.1), 1.01)
    ax.set_xticks(range(k))
    ax.set_xlabel("class (output slice)")
    ax.set_ylabel("similarity clean vs. audited")
    ax.set_title(title + ("" if tensor_localisation is None else
                          f"\nlocalisation separation {_sep_text(tensor_localisation)}"),
                 fontsize=10)
    for axs, (name, (vals, loc)) in zip(small, (per_class or {}).items()):
        import textwrap

        vals = np.asarray(vals, dtype=float)
        axs.bar(range(k), vals, color=colors)
        fin = vals[np.isfinite(vals)]
        if fin.size:
            lo_, hi_ = float(fin.min()), float(fin.max())
            pad = max(0.05 * (hi_ - lo_), 1e-3)
            axs.set_ylim(lo_ - pad, hi_ + pad)
        axs.set_xticks(range(k))
        axs.tick_params(labelsize=7)
        axs.set_title(textwrap.fill(name, 28) + f"\nseparation {_sep_text(loc)}", fontsize=8)
        axs.set_xlabel("class", fontsize=8)
    handles, names = ax.get_legend_handles_labels()
    if target is not None and 0 <= target < k:   # the red bar is named in the legend too
        from matplotlib.patches import Patch

        at = names.index("tensor similarity (class slice)") + 1
        handles.insert(at, Patch(color="tab:red"))
        names.insert(at, f"tensor similarity, target class {target}")
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    return save_figure(fig, path)


def _sep_text(loc: Mapping) -> str:
    """A localisation dict as "2.31 (localises)" for titles."""
    if not loc or not loc.get("assessed"):
        return "not assessed"
    x = loc["separation"]
    return (f"{'inf' if np.isinf(x) else f'{x:.2f}'} "
            f"({'localises' if loc['localises'] else 'does not localise'})")


def heatmaps(path: Path, mats: Mapping[str, np.ndarray], labels: Sequence[str], title: str,
             vmin: float | None = None, axis_label: str = "checkpoint") -> Path:
    """Matrices side by side with a shared colour scale, labelled rows and columns."""
    import textwrap

    plt = pyplot()
    n = len(mats)
    # constrained layout keeps each panel's axis label and title clear of its neighbours
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 0.8, 4.6), squeeze=False,
                             layout="constrained")
    n_ticks = max(np.asarray(m).shape[0] for m in mats.values())
    tick_size = 9 if n_ticks <= 12 else 8 if n_ticks <= 24 else 6   # readable while they fit
    vals = np.concatenate([np.asarray(m, dtype=float).ravel() for m in mats.values()])
    vals = vals[np.isfinite(vals)]
    lo = vmin if vmin is not None else (float(vals.min()) if vals.size else 0.0)
    im = None
    for ax, (name, mat) in zip(axes[0], mats.items()):
        mat = np.asarray(mat, dtype=float)
        im = ax.imshow(mat, vmin=lo, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_title(textwrap.fill(name, 34 if n > 1 else 60), fontsize=9)   # wrapped: no overlap
        ax.set_xticks(range(mat.shape[1]))
        ax.set_xticklabels(labels if mat.shape[1] == len(labels) else range(mat.shape[1]),
                           rotation=90, fontsize=tick_size)
        ax.set_yticks(range(mat.shape[0]))
        ax.set_yticklabels(labels if mat.shape[0] == len(labels) else range(mat.shape[0]),
                           fontsize=tick_size)
        ax.set_xlabel(axis_label)
        ax.set_ylabel(axis_label)
    cb = fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    cb.set_label("similarity")
    fig.suptitle(title)
    return save_figure(fig, path)


def class_heatmap(path: Path, values: np.ndarray, stage_labels: Sequence[str], title: str,
                  ylabel: str = "class", xlabel: str = "checkpoint",
                  extra: Mapping[str, np.ndarray] | None = None) -> Path:
    """Rows = classes, columns = checkpoints; the number written in each cell. ``extra``:
    more ``{panel title: (classes, checkpoints) values}`` drawn to the right of the first
    (``title`` is then the figure's title and the first panel is "tensor similarity")."""
    import textwrap

    plt = pyplot()
    panels = {"tensor similarity (class slice)" if extra else title: np.asarray(values, float)}
    panels.update({k: np.asarray(v, dtype=float) for k, v in (extra or {}).items()})
    shape = panels[next(iter(panels))].shape
    n = len(panels)
    w, h = 1.0 + 0.75 * shape[1], 0.45 * shape[0] + 1.5
    fig, axes = plt.subplots(1, n, figsize=(w * n, h + (0.5 if extra else 0)), squeeze=False,
                             layout="constrained")
    im = None
    for ax, (name, vals) in zip(axes[0], panels.items()):
        fin = vals[np.isfinite(vals)]
        im = ax.imshow(vals, cmap="viridis", vmin=min(0.0, float(fin.min()) if fin.size else 0),
                       vmax=1.0, aspect="auto")
        for i in range(vals.shape[0]):
            for j in range(vals.shape[1]):
                ax.text(j, i, f"{vals[i, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if vals[i, j] < 0.6 else "black")
        ax.set_xticks(range(vals.shape[1]))
        ax.set_xticklabels(stage_labels, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(vals.shape[0]))
        ax.set_ylabel(ylabel)
        ax.set_xlabel(xlabel)
        ax.set_title(textwrap.fill(name, 40), fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist()).set_label("similarity / accuracy")
    if extra:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def training_heatmaps(path: Path, panels: Mapping[str, np.ndarray],
                      bounds: Sequence[tuple[int, str]], title: str,
                      highlight: int | None = None) -> Path:
    """Rows = classes, columns = checkpoints over training, one panel per entry of ``panels``
    (``{title: (classes, checkpoints) values}``) stacked vertically on one colour scale;
    ``bounds``: ``(first column, stage label)`` of each stage, drawn as white lines with the
    label centred under its columns; ``highlight``: a class whose row label is marked."""
    import textwrap

    plt = pyplot()
    n = len(panels)
    first = np.asarray(next(iter(panels.values())), dtype=float)
    k, m = first.shape
    fig, axes = plt.subplots(n, 1, figsize=(max(8.0, 0.16 * m + 2.5), n * (0.28 * k + 1.3) + 0.8),
                             squeeze=False, layout="constrained")
    lo = min(0.0, *(float(np.nanmin(v)) for v in panels.values() if np.isfinite(v).any()))
    edges = [b for b, _ in bounds] + [m]
    im = None
    for ax, (name, vals) in zip(axes[:, 0], panels.items()):
        im = ax.imshow(np.asarray(vals, dtype=float), cmap="viridis", vmin=lo, vmax=1.0,
                       aspect="auto", interpolation="nearest")
        for b in edges[1:-1]:
            ax.axvline(b - 0.5, color="white", lw=1.2)
        ax.set_xticks([(edges[i] + edges[i + 1] - 1) / 2 for i in range(len(bounds))])
        ax.set_xticklabels([lab for _, lab in bounds], fontsize=8)
        ax.set_yticks(range(k))
        ax.set_yticklabels([f"{c} *" if c == highlight else str(c) for c in range(k)],
                           fontsize=7)
        ax.set_ylabel("class")
        ax.set_title(textwrap.fill(name, 90), fontsize=9)
    axes[-1, 0].set_xlabel("checkpoint (grouped by curriculum stage; * = the removed class)")
    fig.colorbar(im, ax=axes[:, 0].tolist()).set_label("similarity / accuracy")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def walkthrough_figure(path: Path, rec: Mapping, target: int, title: str) -> Path:
    """The backdoor walk-through: one column per run (``rec["runs"]``: backdoored, control),
    per-class tensor similarity to the clean model over the fine-tune steps (the target in red,
    the other classes grey) above the attack success rate, clean accuracy, global tensor
    similarity and output cosine."""
    plt = pyplot()
    runs = rec["runs"]
    steps = np.asarray(rec["step"], dtype=float)
    fig, axes = plt.subplots(2, len(runs), figsize=(5.2 * len(runs), 7.0), squeeze=False,
                             sharex=True, layout="constrained")
    # one similarity scale for both runs, so that the control reads next to the backdoor
    lo = min(min(float(np.nanmin(np.asarray(r["slice_similarity"], dtype=float))),
                 float(np.nanmin(np.asarray(r["output_slice_cosine"], dtype=float)[:, target])))
             for r in runs.values())
    for col, (name, r) in enumerate(runs.items()):
        ax = axes[0, col]
        ax.set_ylim(lo - 0.03 * (1 - lo) - 0.01, 1.01)
        sl = np.asarray(r["slice_similarity"], dtype=float)
        for c in range(sl.shape[1]):
            if c != target:
                ax.plot(steps, sl[:, c], color="0.6", lw=0.9,
                        label="other classes" if c == (0 if target else 1) else None)
        ax.plot(steps, sl[:, target], color="tab:red", lw=2, marker="o", ms=3,
                label=f"class {target} (target)")
        osc = np.asarray(r["output_slice_cosine"], dtype=float)
        ax.plot(steps, osc[:, target], color="tab:orange", ls="--", lw=1.2,
                label=f"class {target}: output-slice cosine (clean test images)")
        ax.set_title(f"{name}: per-class tensor similarity to the clean model", fontsize=9)
        ax.set_ylabel("similarity")
        ax = axes[1, col]
        ax.plot(steps, r["attack_success_rate"], color="tab:purple", marker="o", ms=3,
                label="attack success rate (triggered test images)")
        ax.plot(steps, r["clean_accuracy"], color="tab:green", label="clean test accuracy")
        g = [float(v) if getattr(v, "reliable", True) is not False else np.nan
             for v in r["global_similarity"]]
        ax.plot(steps, g, color="black", label="global tensor similarity")
        ax.plot(steps, r["output_cosine"], color="tab:blue", ls=":",
                label="output cosine (clean test images)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("fine-tune step")
        ax.set_title(f"{name}: behaviour and global similarity", fontsize=9)
    # the legends below the panels (matplotlib >= 3.7 "outside"): they never cover a line
    handles = [h for ax in axes[:, 0] for h in ax.get_legend_handles_labels()[0]]
    labels = [lab for ax in axes[:, 0] for lab in ax.get_legend_handles_labels()[1]]
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def grokking_figure(path: Path, steps: Sequence[int], train_acc: Sequence[float],
                    val_acc: Sequence[float], sim: np.ndarray, sim_to_final: Sequence[float],
                    method: str, metric: str = "gaussian") -> Path:
    """Accuracy curves and similarity to the final checkpoint (log steps) next to the
    checkpoint x checkpoint similarity heatmap; ``metric`` is named in the labels."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = np.maximum(np.asarray(steps, dtype=float), 1.0)
    ax1.plot(x, train_acc, "o-", ms=3, label="train accuracy")
    ax1.plot(x, val_acc, "o-", ms=3, label="validation accuracy")
    ax1.plot(x, sim_to_final, "s-", ms=3, color="tab:red",
             label=f"tensor similarity to final ({method_label(method)}, {metric})")
    ax1.set_xscale("log")
    ax1.set_xlabel("training step (step 0 drawn at 1)")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_ylabel("accuracy / similarity")
    ax1.legend(fontsize=8)
    ax1.set_title("accuracy and similarity to the final checkpoint")
    im = ax2.imshow(np.asarray(sim, dtype=float), cmap="viridis",
                    vmin=min(0.0, float(np.nanmin(sim))),
                    vmax=1.0)
    ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
    ax2.set_xticks(ticks)
    ax2.set_xticklabels([str(steps[i]) for i in ticks], rotation=90, fontsize=7)
    ax2.set_yticks(ticks)
    ax2.set_yticklabels([str(steps[i]) for i in ticks], fontsize=7)
    ax2.set_xlabel("training step")
    ax2.set_ylabel("training step")
    ax2.set_title(f"checkpoint x checkpoint tensor similarity ({metric})")
    fig.colorbar(im, ax=ax2).set_label("similarity")
    return save_figure(fig, path)
