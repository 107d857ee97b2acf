"""The research group's language figure at its own size (not run in CI): the exact ``S<=5``
matrix of 102 checkpoints of a two-layer attention-only bilinear transformer at n_ctx 4,
d_model 64, 128 or 256 with 8 heads of d_model / 8, through the blocked path
(`tensoralg.blocks.gram(..., degree=5)`, what ``tensoralg matrix --degree 5`` runs), on one
thread and on a local Dask cluster of ``--workers`` single-threaded processes.

    python benchmarks/bench_paper_size.py --d-model 64                 # measure, extrapolate
    python benchmarks/bench_paper_size.py --d-model 128 --block-size 2 --workers 0
    python benchmarks/bench_paper_size.py --d-model 64 --qk-bias       # biases: refused

Checkpoints: ``BilinearTransformer(vocab, d_model, 2, 8, d_model // 8, n_ctx=4, rope=10000)``
with random weights (seed ``i``; the exact path's cost does not depend on the values), saved to
a temporary folder. The whole matrix (``N (N + 1) / 2`` pairs) is too long to run here, so the
benchmark MEASURES the first ``2 B`` checkpoints' blocks (two diagonal blocks and one
off-diagonal block at block size ``B``), counts the FLOPs they executed (the path cost of every
contraction, as the dry-run estimate counts them) and EXTRAPOLATES the full matrix by its FLOP
estimate (`tensoralg.strategies.sequence_exact.tree_block_cost` summed over every block) at the
measured rate; each extrapolated number is labelled so. With ``--workers N`` the same three
blocks run on a local cluster (its start-up timed apart) and the full matrix is extrapolated at
the measured wall-time ratio to the one-process run. The machine's load (``os.getloadavg``) is printed: CPU seconds
on a shared machine are inflated by it.

``--qk-bias``: the models get query/key biases, and the script shows what the library says: with
a lifted constant the degree-<=5 truncation is a sum over lower-degree compositions, not one
attention layer, so ``S<=5`` is not exact for them (refused before any work; its Monte Carlo
estimate per pair is `tensoralg.degree_similarity`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def _hms(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=64, help="residual width (64, 128, 256)")
    ap.add_argument("--checkpoints", type=int, default=102, help="checkpoints in the matrix (102)")
    ap.add_argument("--n-ctx", type=int, default=4, help="context length (4)")
    ap.add_argument("--heads", type=int, default=8, help="heads, each of d_model / heads (8)")
    ap.add_argument("--vocab", type=int, default=64, help="vocabulary (logits; 64)")
    ap.add_argument("--block-size", type=int, default=2,
                    help="B: the measured blocks are those of the first 2 B checkpoints (2)")
    ap.add_argument("--full-block-size", type=int, default=16,
                    help="the block size of the extrapolated full run (16)")
    ap.add_argument("--workers", type=int, default=2, help="local Dask workers (2; 0: skip)")
    ap.add_argument("--qk-bias", action="store_true", help="query/key biases: show the refusal")
    args = ap.parse_args()

    import numpy as np
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    threadpool_limits(1)
    import tensoralg as ta
    from tensoralg import blocks
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.strategies import executor, sequence_exact
    from tensoralg.transformer import BilinearTransformer

    d, H, T, N = args.d_model, args.heads, args.n_ctx, args.checkpoints
    dh = d // H
    print(f"S<=5 matrix of {N} two-layer attention-only checkpoints at (d_model {d}, n_ctx {T}, "
          f"{H} heads of {dh}), one thread per process; {_load()}")
    if args.qk_bias:
        r = np.random.default_rng(0)
        g = lambda *s: r.standard_normal(s) / np.sqrt(s[-1])  # noqa: E731

        def biased():
            return ta.Sequential([ta.Residual(ta.BilinearAttention(
                *(g(H, dh, d) for _ in range(5)), g(d, H, dh),
                **{f"{k}_bias": g(H, dh) for k in ("q1", "k1", "q2", "k2")}))
                for _ in range(2)] + [ta.Linear(g(args.vocab, d))])
        try:
            ta.degree_similarity_matrix([biased(), biased()], n_ctx=T, max_degree=5)
        except ValueError as exc:
            print(f"with query/key biases: refused before any work: {exc}")
        return

    tmp = Path(tempfile.mkdtemp(prefix="paper_size_"))
    t0 = time.perf_counter()
    paths = []
    for i in range(N):
        p = tmp / f"ckpt{i:03d}"
        save_checkpoint(p, BilinearTransformer(args.vocab, d, 2, H, dh, n_ctx=T, rope=10000.0,
                                               seed=i, dtype="float64"), step=i)
        paths.append(str(p))
    print(f"  {N} checkpoints written in {time.perf_counter() - t0:.1f} s")

    # the FLOP estimate of every block of the full run, and of the measured blocks
    opts = {"n_ctx": T, "degree": 5}
    tree = blocks._degree_trees(paths[:1], opts)[0]
    cost = lambda m, p: sequence_exact.tree_block_cost(tree, T, m, p)[1]  # noqa: E731

    def run_flops(n: int, b: int) -> float:
        nb = -(-n // b)
        sizes = [min(b, n - i * b) for i in range(nb)]
        total = 0.0
        for i in range(nb):
            total += cost(sizes[i], sizes[i] * (sizes[i] + 1) // 2)
            for j in range(i + 1, nb):
                total += cost(sizes[i] + sizes[j], sizes[i] * sizes[j])
        return total

    B = args.block_size
    n_meas = min(N, 2 * B)
    pairs_meas, pairs_all = n_meas * (n_meas + 1) // 2, N * (N + 1) // 2
    f_meas = run_flops(n_meas, B)
    f_full = run_flops(N, args.full_block_size)
    f_one = cost(2, 1)
    print(f"  estimate: {f_one:.3g} FLOPs for one lone pair (both models' chaos forms and the "
          f"pair); the full matrix in blocks of {args.full_block_size}: {f_full:.3g} FLOPs "
          f"({f_full / pairs_all:.3g} a pair, each block building its models' chaos forms once)")

    flops = [0.0]
    call = executor.Plan.__call__

    def counted(self, *ops, **kw):
        flops[0] += self.flops
        return call(self, *ops, **kw)

    executor.Plan.__call__ = counted
    c0, w0 = time.process_time(), time.perf_counter()
    G = blocks.gram(paths[:n_meas], block_size=B, degree=5)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    executor.Plan.__call__ = call
    rate = flops[0] / cpu
    print(f"  MEASURED, one thread: the first {n_meas} checkpoints in blocks of {B} "
          f"({pairs_meas} pairs): {cpu:.1f} CPU-s ({wall:.1f} s wall), {cpu / pairs_meas:.2f} "
          f"CPU-s a pair, {flops[0]:.3g} FLOPs executed (estimate {f_meas:.3g}), "
          f"{rate / 1e9:.1f} GFLOP/s; {_load()}")
    full_cpu = f_full / rate
    print(f"  EXTRAPOLATED, one thread: the {N}-checkpoint matrix ({pairs_all} pairs) "
          f"{_hms(full_cpu)} ({full_cpu / pairs_all:.2f} s a pair), from its FLOP estimate at the "
          f"measured rate")
    if args.workers:
        import distributed

        w0 = time.perf_counter()
        with distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1,
                                      processes=True, dashboard_address=":0") as cluster, \
                distributed.Client(cluster) as client:
            client.run(lambda: __import__("tensoralg.blocks") and None)   # warm the workers
            start = time.perf_counter() - w0
            c_before = client.run(time.process_time)
            w0 = time.perf_counter()
            G2 = blocks.gram(paths[:n_meas], block_size=B, degree=5, client=client)
            wall2 = time.perf_counter() - w0
            c_after = client.run(time.process_time)
            cpu2 = sum(c_after[w] - c_before[w] for w in c_after)
        assert np.array_equal(G, G2), "the Dask blocks differ from the one-process blocks"
        print(f"  MEASURED, --workers {args.workers}: cluster start-up {start:.1f} s, then the "
              f"same {pairs_meas} pairs in {wall2:.1f} s wall, {cpu2:.1f} CPU-s in the workers "
              f"(equal entries; one process: {wall:.1f} s wall, {cpu:.1f} CPU-s); {_load()}")
        print(f"  EXTRAPOLATED, --workers {args.workers}: the {N}-checkpoint matrix "
              f"{_hms(full_cpu * wall2 / wall)} wall plus the start-up (the one-thread "
              f"extrapolation times the measured wall-time ratio {wall2 / wall:.2f}; on an idle "
              f"{os.cpu_count()}-core machine the ratio tends to 1/{args.workers} for many "
              f"equal blocks)")

if __name__ == "__main__":
    main()
