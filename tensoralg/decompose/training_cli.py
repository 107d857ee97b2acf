"""``tensoralg decompose paths-over-training CKPT1 CKPT2 ... [--n-ctx N] [--out DIR] [--json
PATH]``: every first-order path of transformer checkpoints compared with the final checkpoint
and with the next one (`tensoralg.decompose.paths_over_training`), as a table, a JSON, a CSV and
a path x checkpoint heatmap. Bad input is refused in one line before any checkpoint is loaded
(exit 2): fewer than two checkpoints, a missing folder, a vector network, checkpoints of
different architectures (naming the first entry that differs), options of the one-checkpoint
form, ``--n-ctx`` beyond a trained context or missing where no checkpoint fixes one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: cfg.json entries that fix a transformer checkpoint's paths (any difference is refused).
_SHAPE_KEYS = {"bilinear_transformer": ("n_layers", "d_model", "n_heads", "d_head", "d_mlp",
                                        "vocab"),
               "tensoralg_network": ("d_in", "d_out", "nodes", "shapes")}


def check_over_training(args, over: str) -> tuple[list, int | None]:
    """``(checkpoint folders, n_ctx or None)`` checked from the command line and the cfg.json
    files alone (module docstring); one-line ValueErrors naming the flag or checkpoint."""
    from ..io import read_config

    paths = list(args.more)
    for flag, given in (("--diff", args.diff is not None), ("--match", args.match),
                        ("--output", args.output is not None), ("--k", args.k is not None),
                        ("--rest-samples", bool(args.rest_samples))):
        if given:
            raise ValueError(f"{flag}: not an option of tensoralg decompose {over} (its "
                             f"options: --n-ctx, --out, --json, --threads); {flag} is for "
                             f"tensoralg decompose CKPT")
    if len(paths) < 2:
        raise ValueError(f"CKPT: {over} needs two or more checkpoint folders, got "
                         f"{len(paths)}" + (f" ({paths[0]})" if paths else ""))
    for k, p in enumerate(paths, 1):
        if not Path(p).is_dir():
            raise FileNotFoundError(f"CKPT {k}: {p} is not a checkpoint folder")
    cfgs = [read_config(p) for p in paths]
    for k, (p, c) in enumerate(zip(paths, cfgs), 1):
        arch = c.get("architecture")
        if arch not in _SHAPE_KEYS or (arch == "tensoralg_network" and not c.get("sequence")):
            raise ValueError(f"CKPT {k}: {p} is a vector network ({arch}); {over} takes "
                             f"transformer checkpoints (sequence models); compare vector "
                             f"networks with tensoralg decompose CKPT --diff CKPT2 or "
                             f"tensoralg matrix")
    a0, p0 = cfgs[0].get("architecture"), paths[0]
    for k, (p, c) in enumerate(zip(paths[1:], cfgs[1:]), 2):
        if c.get("architecture") != a0:
            raise ValueError(f"CKPT {k}: {p} is a {c.get('architecture')} checkpoint, CKPT 1 "
                             f"({p0}) a {a0}; {over} compares checkpoints of one architecture")
        for key in _SHAPE_KEYS[a0]:
            if c.get(key) != cfgs[0].get(key):
                raise ValueError(f"CKPT {k}: {p} has {key} {c.get(key)!r}, CKPT 1 ({p0}) has "
                                 f"{cfgs[0].get(key)!r}; {over} compares checkpoints of one "
                                 f"architecture")
    trained = [c.get("n_ctx") for c in cfgs]
    n_ctx = args.n_ctx
    known = [t for t in trained if t is not None]
    if n_ctx is not None and known and n_ctx > min(known):
        k = trained.index(min(known)) + 1
        raise ValueError(f"--n-ctx: {n_ctx} is longer than the trained context {min(known)} of "
                         f"CKPT {k} ({paths[k - 1]})")
    if n_ctx is None:
        if not known:
            raise ValueError(f"--n-ctx: required ({over}: no checkpoint fixes a sequence "
                             f"length)")
        n_ctx = min(known)
    return paths, n_ctx


def run_over_training(paths: list, n_ctx: int) -> dict:
    """The JSON result (stamped) with the `PathsOverTraining` record."""
    from ..audit.common import stamp
    from ..checkpoint import load_checkpoint
    from .path_changes import paths_over_training

    nets, steps = [], []
    for p in paths:
        m, cfg = load_checkpoint(p)
        nets.append(m.to_network())
        steps.append(cfg.get("step"))
    labels = [Path(p).name for p in paths]
    try:
        r = paths_over_training(nets, n_ctx=n_ctx, labels=labels)
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("n_ctx"):
            raise ValueError(f"--n-ctx: {msg}") from None
        raise ValueError(f"CKPT: {msg}") from None
    result = stamp("decompose paths-over-training", {"checkpoints": list(paths),
                                                     "n_ctx": n_ctx})
    result.update(steps=steps, paths_over_training=r.to_dict(),
                  note="first-order paths only (direct, each head, each MLP); second-order "
                       "paths (virtual heads) are not implemented, so the remainder f - sum of "
                       "the listed paths is not attributed")
    return result, r


def heatmap(path: Path, r, title: str) -> Path:
    """Three panels, path x checkpoint: similarity to the final checkpoint, to the next one,
    and each path's share of ``||sum of the listed paths||^2`` (NaN, blank: a zero path)."""
    from ..audit.common import save_figure
    from ..audit.plotting import pyplot

    plt = pyplot()
    N, P = len(r.labels), len(r.names)
    nxt = np.full((N, P), np.nan)
    nxt[:-1] = r.to_next
    panels = [("similarity to the final checkpoint", r.to_final, -1, 1, "RdBu_r"),
              ("similarity to the next checkpoint", nxt, -1, 1, "RdBu_r"),
              ("share of ||sum of listed paths||^2", r.share, 0, None, "viridis")]
    fig, axes = plt.subplots(1, 3, figsize=(3 * max(4.0, 0.28 * N + 2.0), 0.35 * P + 2.6),
                             layout="constrained")
    ticks = np.arange(N) if N <= 16 else np.arange(0, N, max(1, N // 12))
    for ax, (name, M, lo, hi, cmap) in zip(axes, panels):
        im = ax.imshow(np.asarray(M, dtype=float).T, aspect="auto", cmap=cmap, vmin=lo,
                       vmax=hi, interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_yticks(range(P), r.names, fontsize=8)
        ax.set_xticks(ticks, [r.labels[i] for i in ticks], rotation=90, fontsize=7)
        ax.set_xlabel("checkpoint")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def cmd_paths_over_training(args, over: str, out_default: str, names: tuple) -> int:
    from ..audit._cliutil import apply_threads, check_paths
    from ..audit.common import staged_output, write_csv, write_json

    json_name, csv_name, fig_name = names
    paths, n_ctx = check_over_training(args, over)
    out = check_paths(args, out_default)
    apply_threads(args)
    result, r = run_over_training(paths, n_ctx)
    N, P = len(r.labels), len(r.names)
    with staged_output(out, json_name) as stage:
        heatmap(stage / fig_name, r, f"first-order paths over {N} checkpoints (exact, "
                                     f"n_ctx={n_ctx})")
        header = ["checkpoint", "step", "path", "share", "similarity_to_final",
                  "similarity_to_next", "own_change_to_next"]

        def val(v):
            return None if not np.isfinite(v) else float(v)
        rows = [[r.labels[k], result["steps"][k], n, float(r.share[k, p]),
                 val(r.to_final[k, p]), val(r.to_next[k, p]) if k + 1 < N else None,
                 val(r.change_to_next[k, p]) if k + 1 < N else None]
                for k in range(N) for p, n in enumerate(r.names)]
        write_csv(stage / csv_name, header, rows)
        result["files"] = [json_name, csv_name, fig_name]
        write_json(stage / json_name, result)
        if args.json is not None:
            write_json(args.json, result)
    print(f"first-order paths of {N} checkpoints at n_ctx={n_ctx} ({P} paths; {r.method})")
    print(r.table())
    print(f"wrote {', '.join(str(Path(out) / f) for f in result['files'])}")
    return 0
