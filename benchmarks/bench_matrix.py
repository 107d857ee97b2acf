"""Similarity matrix over N checkpoints: one process against a local Dask cluster (not run in CI).

    python benchmarks/bench_matrix.py                 # N = 128 checkpoints, block 32, 3 rounds
    python benchmarks/bench_matrix.py --n 1000        # the issue's size (slow with today's engine)
    python benchmarks/bench_matrix.py --n 200 --workers 2 --block-size 50 --rounds 1

Checkpoints: ``BilinearNet(d_in=64, d_out=10, d_model=64, d_hidden=256, n_layers=1)`` (embed
64 -> 64, one bilinear layer with H = 256, head 10) with random weights (seed i), saved as
checkpoint folders. Each configuration runs in its own Python process (so its peak memory is
its own), one BLAS/torch thread per process, and the rounds interleave the configurations; the
table shows medians:

* ``engine``     — ``ta.similarity_matrix`` on all N models loaded at once (the reference);
* ``blocks``     — ``tensoralg.blocks.similarity_matrix(paths, block_size=B)`` in one process
                   (lazy loading, at most 2B models in memory);
* ``dask-W``     — the same on a ``LocalCluster`` of W single-threaded worker processes, timed
                   without the cluster start-up (reported separately); peak memory is given per
                   worker (``ru_maxrss``) and for the driver.

Peak memory includes the interpreter with numpy/torch imported (the ``baseline`` column:
``ru_maxrss`` right after the imports). The time for N = 1000 is extrapolated by the number of
pairs, ``N (N + 1) / 2``: the work per pair is fixed for one architecture. The largest
difference of every similarity matrix from ``engine``'s is printed too (``max |dS|``: relative to
``||f_i|| ||f_j||``, the scale of each entry; elementwise relative differences are larger on
near-orthogonal pairs, as between any two float64 summation orders).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THREAD_ENV = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def make_checkpoints(folder: Path, n: int) -> list[str]:
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.nn import BilinearNet

    paths = []
    for i in range(n):
        p = folder / f"ckpt{i:05d}"
        if not (p / "cfg.json").is_file():
            save_checkpoint(p, BilinearNet(64, 10, d_model=64, d_hidden=256, seed=i), step=i)
        paths.append(str(p))
    return paths


def child(mode: str, paths: list[str], block_size: int, workers: int, result: str) -> None:
    """One configuration in this (fresh) process; writes its numbers and matrix to ``result``."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import tensoralg as ta
    from tensoralg import blocks
    from tensoralg.checkpoint import load_network

    base = _rss_mb()
    out = {"mode": mode, "baseline_mb": base}
    t = time.perf_counter()
    if mode == "engine":
        S = np.asarray(ta.similarity_matrix([load_network(p) for p in paths]))
    elif mode == "blocks":
        S = blocks.similarity_matrix(paths, block_size=block_size)
    else:
        import distributed

        with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                         dashboard_address=":0",
                                         env=THREAD_ENV) as cluster, \
                distributed.Client(cluster) as client:
            client.run(lambda: __import__("tensoralg.checkpoint"))  # imports on every worker
            client.run(lambda: __import__("torch").set_num_threads(1))
            out["startup_s"] = time.perf_counter() - t
            t = time.perf_counter()
            S = blocks.similarity_matrix(paths, block_size=block_size, client=client)
            out["seconds"] = time.perf_counter() - t
            out["worker_peak_mb"] = sorted(client.run(_rss_mb).values())
    out.setdefault("seconds", time.perf_counter() - t)
    out["peak_mb"] = _rss_mb()
    np.save(result + ".npy", S)
    Path(result).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=128, help="checkpoints (default 128)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--ckpt-dir", default=None, help="keep/reuse the checkpoints here")
    ap.add_argument("--skip-engine", action="store_true",
                    help="skip the all-in-memory reference (large N)")
    ap.add_argument("--_child", nargs=3, metavar=("MODE", "PATHS_JSON", "RESULT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        mode, paths_file, result = args._child
        child(mode, json.loads(Path(paths_file).read_text()), args.block_size, args.workers,
              result)
        return
    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.ckpt_dir or tmp.name) / "ckpts"
    folder.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    paths = make_checkpoints(folder, args.n)
    print(f"{args.n} checkpoints (64 -> 64 embed, H = 256, head 10) in {folder} "
          f"({time.perf_counter() - t:.1f} s); block size {args.block_size}; "
          f"{-(-args.n // args.block_size)} row blocks")
    paths_file = Path(tmp.name) / "paths.json"
    paths_file.write_text(json.dumps(paths))
    modes = (["engine"] if not args.skip_engine else []) + ["blocks", f"dask-{args.workers}"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    mats = {}
    env = {**os.environ, **THREAD_ENV}
    for r in range(args.rounds):
        for mode in modes:
            res = str(Path(tmp.name) / f"{mode}-{r}.json")
            subprocess.run([sys.executable, __file__, "--block-size", str(args.block_size),
                            "--workers", str(args.workers), "--_child", mode, str(paths_file),
                            res], check=True, env=env)
            runs[mode].append(json.loads(Path(res).read_text()))
            import numpy as np

            mats[mode] = np.load(res + ".npy")
            print(f"  round {r + 1}: {mode:<8} {runs[mode][-1]['seconds']:8.1f} s", flush=True)
    import numpy as np

    ref = mats.get("engine", mats["blocks"])
    pairs = args.n * (args.n + 1) / 2
    scale = 1000 * 1001 / 2 / pairs
    med = {m: statistics.median(x["seconds"] for x in runs[m]) for m in modes}
    print(f"\nmedians over {args.rounds} interleaved rounds (machine: {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f} at the end)")
    print(f"{'mode':<10}{'time [s]':>10}{'N=1000 [s]':>12}  {'peak MB':<28}{'baseline MB':>12}"
          f"{'max |dS|':>14}")
    for m in modes:
        last = runs[m][-1]
        peak = (f"workers {'/'.join(f'{v:.0f}' for v in last['worker_peak_mb'])}, "
                f"driver {last['peak_mb']:.0f}" if "worker_peak_mb" in last
                else f"{last['peak_mb']:.0f}")
        diff = float(np.max(np.abs(mats[m] - ref)))
        print(f"{m:<10}{med[m]:>10.1f}{med[m] * scale:>12.0f}  {peak:<28}"
              f"{last['baseline_mb']:>12.0f}{diff:>14.1e}")
    dm = f"dask-{args.workers}"
    startup = statistics.median(x["startup_s"] for x in runs[dm])
    print(f"\nratios (medians): blocks / {dm} = {med['blocks'] / med[dm]:.2f}"
          + (f"; engine / blocks = {med['engine'] / med['blocks']:.2f}" if "engine" in med else "")
          + f"; cluster start-up (not in the times above) {startup:.1f} s")
    print(f"seconds per pair: blocks {med['blocks'] / pairs * 1e3:.2f} ms, {dm} "
          f"{med[dm] / pairs * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
