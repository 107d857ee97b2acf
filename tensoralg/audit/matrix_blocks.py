"""``tensoralg matrix`` in blocks: ``--block-size``, ``--resume``, ``--workers N``,
``--scheduler ADDRESS`` (any of them selects this path; see `tensoralg.blocks`).

Output folder ``--out`` (default ``runs/matrix``):

* ``blocks/`` — the store: ``manifest.json`` (checkpoints with the SHA-256 of their files, sizes,
  options) and one ``G_<I>_<J>.npy`` per finished block, each written atomically;
* when every block is done: ``matrix.npy`` (float64 similarities), ``matrix.csv``,
  ``matrix.png`` and ``matrix.json`` (written last: its presence marks a complete run).

Unlike the single-process ``matrix`` (whose output folder is replaced as a whole), this output is
built in place so that an interrupted run can continue: ``--out`` must be new, empty, or hold a
store; an existing store needs ``--resume`` and must have been made from the same checkpoints
(same file contents, in the same order) and options. Ctrl-C (exit 130) keeps every finished
block; rerun the same command with ``--resume``.

Bilinear-transformer checkpoints are accepted with ``--n-ctx`` as in the unblocked ``matrix``
(exact for one layer; beyond, ``--method auto`` is refused and the moment-closure similarity,
APPROXIMATE, runs only with ``--method closure``; see `run_matrix_blocked`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._cliutil import (
    apply_threads,
    check_checkpoints,
    check_paths,
    local_workers,
    positive_int,
    report,
    run,
)
from .common import (
    MC_SAMPLES,
    check_file_writable,
    check_folder_path,
    choose_method,
    format_table,
    matrix_uncertainty,
    method_label,
    stamp,
    write_csv,
    write_json,
)

STORE = "blocks"
BLOCK_OPTIONS = ("block_size", "resume", "scheduler", "workers", "degree")
_TABLE_MAX = 12  # print the whole matrix up to this size, a summary beyond


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of the blocked path, added to the ``matrix`` parser."""
    from ..blocks import DEFAULT_BLOCK_SIZE

    g = p.add_argument_group("blocked / distributed (any of these selects the blocked path; "
                             "see docs/distributed.md)")
    g.add_argument("--block-size", type=positive_int, default=None, metavar="B",
                   help=f"checkpoints per block side (default {DEFAULT_BLOCK_SIZE}); a worker "
                        f"holds at most 2*B models")
    g.add_argument("--resume", action="store_true",
                   help="continue from the finished blocks stored under OUT/blocks (refused if "
                        "they were made from other checkpoints or options; default: off, an "
                        "existing store is an error)")
    g.add_argument("--degree", type=positive_int, default=None, metavar="K",
                   help="the exact S<=K matrix instead: the similarity of the degree-<=K "
                        "truncations f_<=K (a different question from the full similarity, "
                        "not an approximation of it), for bias-free bilinear-transformer "
                        "checkpoints below the first composition degree (5 for two layers); "
                        "computed in blocks, resumable (default: none, the models themselves)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDRESS", default=None,
                       help="run the blocks on this Dask scheduler (e.g. tcp://host:8786); the "
                            "workers must see the checkpoint paths (default: none)")
    where.add_argument("--workers", type=local_workers, default=None, metavar="N",
                       help="run the blocks on a local Dask cluster of N worker processes, at most "
                            "os.cpu_count() (default: none, blocks run in this process)")


def wants_blocks(args) -> bool:
    return any(getattr(args, k, None) not in (None, False) for k in BLOCK_OPTIONS)


def _check_out(out: Path) -> Path:
    out = check_folder_path(out, "--out")
    here = Path.cwd().resolve()
    if out.exists() and (out.resolve() == here or out.resolve() in here.parents):
        raise ValueError(f"--out: {out} is the current folder or holds it; choose a subfolder "
                         f"(e.g. {out / 'run'})")
    if out.is_dir() and any(out.iterdir()) and not (out / STORE / "manifest.json").is_file():
        raise ValueError(f"--out: {out} is not empty and holds no {STORE}/manifest.json (not a "
                         f"blocked matrix run); choose a new or empty folder")
    return out


def run_matrix_blocked(paths: Sequence[str], out: str | Path, *, method: str = "auto",
                       output: int | None = None, seed: int = 0, n_samples: int | None = None,
                       block_size: int | None = None, resume: bool = False,
                       scheduler: str | None = None, workers: int | None = None,
                       threads: int = 1, show_progress: bool = False,
                       json_copy: str | Path | None = None, n_ctx: int | None = None,
                       degree: int | None = None) -> dict:
    """Similarity matrix of the checkpoints at ``paths`` in blocks (see the module docstring).

    Every argument and every checkpoint header is checked before any block runs.

    ``degree=K`` (``--degree``): the exact ``S<=K`` matrix of bias-free bilinear-transformer
    checkpoints (`tensoralg.degree_similarity_matrix`, each block's models once); ``method``
    must be auto or exact, ``output`` is refused.

    Bilinear-transformer checkpoints (as in the unblocked ``tensoralg matrix``): residual stream
    -> logits maps over ``n_ctx`` positions (default the shortest trained context, longer
    refused), summed over all logits; ``method="auto"`` is exact for one layer and refused
    beyond, as unblocked (``method="closure"``: the moment-closure similarity, APPROXIMATE,
    only when asked for); Monte Carlo and ``output`` are refused.

    Raises:
        ValueError: fewer than two checkpoints, a corrupt checkpoint (named), mismatched
            architectures, a bad ``output``/``out``/``json_copy``, an existing store without
            ``resume`` or one made from other checkpoints, an unreachable ``scheduler``;
            transformer checkpoints with different vocabularies, ``n_ctx`` beyond a trained
            context, ``--method montecarlo`` or ``--output``; ``n_ctx`` for classifiers;
        FileNotFoundError: a missing checkpoint; ImportError: dask not installed;
        tensoralg.CostTooHigh: ``method="exact"`` over the exact budget (before any block).
    """
    from .. import blocks
    from ..checkpoint import load_network

    if len(paths) < 2:
        raise ValueError(f"checkpoints: need at least two, got {len(paths)}")
    out = _check_out(Path(out))
    if json_copy is not None:
        check_file_writable(json_copy, "--json")
    n_samples = MC_SAMPLES if n_samples is None else n_samples
    if n_samples < 2:
        raise ValueError(f"--n-samples: expected an integer >= 2, got {n_samples}")
    if workers is not None and blocks.too_many_workers(workers):
        raise ValueError(f"--workers: {blocks.too_many_workers(workers)}")
    if scheduler is not None or workers is not None:
        blocks.need_distributed()
    prints = blocks.validate_checkpoints(paths)
    from ..io import read_config

    cfg0 = read_config(paths[0])
    depth = int(cfg0["n_layers"])
    if degree is not None:
        if "n_ctx_trained" not in prints[0]:
            raise ValueError(f"--degree {degree}: the S<={degree} matrix is for bilinear-"
                             f"transformer (sequence) checkpoints; {paths[0]} is a classifier")
        if method not in ("auto", "exact"):
            raise ValueError(f"--method {method}: --degree {degree} computes the exact S<={degree}"
                             f" matrix; use --method auto or exact")
        if output is not None:
            raise ValueError(f"--output: not supported with --degree (the S<={degree} matrix "
                             f"sums over all logits)")
        used = "exact"
        n_ctx = blocks.sequence_n_ctx(prints, n_ctx)
    elif "n_ctx_trained" in prints[0]:      # bilinear transformers (the unblocked rules)
        if output is not None:
            raise ValueError("--output: not supported for bilinear-transformer checkpoints "
                             "(the matrix sums over all logits)")
        if method == "montecarlo":
            raise ValueError("--method montecarlo: the blocked path of bilinear-transformer "
                             "checkpoints is exact (one layer) or closure; drop the block "
                             "options for the shared-sample Monte Carlo matrix")
        from .compare import sequence_matrix_method

        used = sequence_matrix_method(method, depth)   # auto beyond one layer: refused
        n_ctx = blocks.sequence_n_ctx(prints, n_ctx)
    else:
        if n_ctx is not None:
            raise ValueError("--n-ctx: only for bilinear-transformer (sequence) checkpoints")
        d_out = int(cfg0["d_out"])
        if output is not None:
            from ..request import check_class_index

            check_class_index(output, d_out, "--output")
        used = choose_method(method, depth, load_network(paths[0]))
    kw = dict(block_size=block_size or blocks.DEFAULT_BLOCK_SIZE, resume=resume, method=used,
              output=output, n_samples=n_samples, seed=seed, threads=threads,
              show_progress=show_progress, n_ctx=n_ctx, degree=degree)
    t = time.perf_counter()
    if scheduler is not None:
        import distributed

        try:
            client = distributed.Client(scheduler, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise ValueError(f"--scheduler: cannot connect to {scheduler} ({exc})") from None
        with client:
            G, summary = blocks.gram_of_validated(paths, prints, out / STORE, client=client, **kw)
    else:
        G, summary = blocks.gram_of_validated(paths, prints, out / STORE, workers=workers, **kw)
    seconds = time.perf_counter() - t
    S = blocks.similarity_from_gram(G, paths)
    labels = [Path(p).name or str(p) for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(p) for p in paths]
    n = len(paths)
    result = {
        **stamp("matrix", {"checkpoints": [str(p) for p in paths], "method": method,
                           "output": output, "seed": seed, "n_samples": n_samples,
                           "block_size": kw["block_size"], "resume": resume,
                           "scheduler": scheduler, "workers": workers, "n_ctx": n_ctx,
                           "degree": degree}),
        "labels": labels, "steps": [p.get("step") for p in prints], "method": used,
        "method_label": method_label(used), "approximate": used != "exact",
        "metric": "gaussian", "output": output, "n_ctx": n_ctx, "degree": degree,
        "similarity_matrix": S.tolist() if n <= 1000 else None,
        "similarity_matrix_file": "matrix.npy",
        "uncertainty": matrix_uncertainty(used, n_samples, seed, per_entry=False),
        "seconds": seconds, "blocks": summary | {"store": STORE},
        "files": ["matrix.json", "matrix.npy", "matrix.csv", "matrix.png", f"{STORE}/"],
        "paths": "files: relative to the output folder; checkpoints: as given on the command line",
    }
    _write_outputs(out, S, labels, used, output, result, degree)
    result["out"] = str(out)
    if json_copy is not None:
        write_json(json_copy, result)
    return result


def _write_outputs(out: Path, S: np.ndarray, labels: list[str], used: str, output, result,
                   degree: int | None = None) -> None:
    """matrix.npy, .csv, .png, then matrix.json last (each atomic)."""
    import io

    from ..io import atomic_write_bytes
    from .plotting import heatmaps

    buf = io.BytesIO()
    np.save(buf, S, allow_pickle=False)
    atomic_write_bytes(out / "matrix.npy", buf.getvalue())
    write_csv(out / "matrix.csv", ["checkpoint"] + labels,
              ([lab] + [float(v) for v in row] for lab, row in zip(labels, S)))
    what = "all outputs" if output is None else f"output {output}"
    title = (f"{method_label(used)} similarity ({what}): not the tensor similarity at depth >= 2"
             if used == "closure" else f"tensor similarity ({used}, {what})")
    if degree is not None:
        title = f"S<={degree}: similarity of the degree-<={degree} truncations (exact)"
    if len(labels) <= 60:
        heatmaps(out / "matrix.png", {title: S}, labels, "checkpoint x checkpoint similarity")
    else:
        _plain_heatmap(out / "matrix.png", S, title)
    write_json(out / "matrix.json", result)


def _plain_heatmap(path: Path, S: np.ndarray, title: str) -> None:
    """A heatmap without per-checkpoint tick labels (too many to read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    im = ax.imshow(S, cmap="viridis", vmax=1.0, interpolation="nearest")
    ax.set_xlabel("checkpoint index")
    ax.set_ylabel("checkpoint index")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    save_figure(fig, path)


def blocked_table(result: dict) -> str:
    from .compare import matrix_table

    b = result["blocks"]
    head = (f"{b['blocks']} blocks of up to {b['block_size']} checkpoints per side: "
            f"{b['resumed_blocks']} resumed, {b['computed_blocks']} computed "
            f"({', '.join(f'{k}: {v}' for k, v in b['devices'].items()) or 'none'}), "
            f"{result['seconds']:.1f} s")
    if result.get("degree") is not None:
        K = result["degree"]
        head += (f"\nS<={K} (exact): the similarity of the degree-<={K} truncations, a different "
                 f"question from the full similarity, not an approximation of it")
    n = len(result["labels"])
    if n <= _TABLE_MAX and result["similarity_matrix"] is not None:
        return head + "\n" + matrix_table(result)
    S = np.load(Path(result["out"]) / "matrix.npy")
    off = S[~np.eye(n, dtype=bool)]
    return "\n".join([head, f"similarity matrix {n} x {n} ({method_label(result['method'])}): "
                            f"off-diagonal "
                            f"min {off.min():.4f}, median {np.median(off):.4f}, max "
                            f"{off.max():.4f} (full matrix in matrix.npy / matrix.csv)",
                      format_table(["", "min", "max"], [["off-diagonal", float(off.min()),
                                                          float(off.max())]])])


def cmd_matrix_blocked(args) -> int:
    """Handler of ``tensoralg matrix`` with a blocked option. Ctrl-C: exit 130, store kept."""
    check_paths(args)
    check_checkpoints(args.checkpoints)   # before torch is imported (by apply_threads)
    apply_threads(args)
    out = Path(args.out or "runs/matrix")

    def go():
        try:
            return run_matrix_blocked(args.checkpoints, out, method=args.method,
                                      output=args.output, seed=args.seed,
                                      n_samples=args.n_samples, block_size=args.block_size,
                                      resume=args.resume, scheduler=args.scheduler,
                                      workers=args.workers, threads=args.threads,
                                      show_progress=not args.no_progress, json_copy=args.json,
                                      n_ctx=args.n_ctx, degree=args.degree)
        except KeyboardInterrupt:
            store = out / STORE
            done = len(list(store.glob("G_*_*.npy"))) if store.is_dir() else 0
            print(f"tensoralg matrix: interrupted; {done} finished blocks are kept in {store}; "
                  f"rerun the same command with --resume to continue", file=sys.stderr)
            return 130

    result = run(args, "matrix", go)
    return report(args, result, blocked_table, json_written=True)
