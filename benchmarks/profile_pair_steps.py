"""Where one exact S<=5 pair spends its contraction time (not run in CI): the pairwise steps
(`tensoralg.strategies.executor.PairStep`, each a batched matrix product after transposed
copies) of one cross pair of bench_deep's two-layer bias-free models, grouped by their matmul
shape ``(batch, m, k, n)``, with the thread CPU time of each group (``time.thread_time``:
little inflated by other processes on a shared machine) and its GFLOP/s.

    python benchmarks/profile_pair_steps.py                 # (d_model 64, n_ctx 8, 4 heads x 16)
    python benchmarks/profile_pair_steps.py --size 64,4,8,8 --top 10

The pair is `sequence_exact.tree_cross_gram` of two models' S<=5 trees (both models' chaos
forms, then the cross sums), after a first pair that compiles the paths.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64,8,4,16", help="d_model,n_ctx,heads,d_head")
    ap.add_argument("--top", type=int, default=8, help="shape groups listed (8)")
    args = ap.parse_args()
    import numpy as np
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    threadpool_limits(1)
    import tensoralg as ta
    from tensoralg.homogeneous import truncation_trees
    from tensoralg.strategies import executor, sequence_exact

    d, n_ctx, heads, dh = (int(x) for x in args.size.split(","))
    rng = np.random.default_rng(0)
    names = ("q1", "k1", "q2", "k2", "v")

    def model():
        w = {k: rng.standard_normal((2, heads, dh, d)) / np.sqrt(d) for k in names}
        w["o"] = rng.standard_normal((2, d, heads, dh)) / np.sqrt(heads * dh)
        return ta.Sequential([ta.Residual(ta.BilinearAttention(*(w[k][j] for k in names),
                                                               w["o"][j])) for j in range(2)]
                             + [ta.Linear(rng.standard_normal((d, d)) / np.sqrt(d))])

    trees = truncation_trees([model() for _ in range(3)], n_ctx, 5, ["a", "b", "c"])
    sequence_exact.tree_cross_gram(trees[:1], trees[1:2], n_ctx)   # compiles the paths
    stats = defaultdict(lambda: [0, 0.0, 0.0, 0])
    call = executor.PairStep.__call__

    def timed(self, A, B):
        t = time.thread_time()
        out = call(self, A, B)
        b, m, k = self.shape_a
        s = stats[(b, m, k, self.shape_b[2])]
        s[0] += 1
        s[1] += time.thread_time() - t
        s[2] += 2.0 * b * m * k * self.shape_b[2]
        s[3] += not (A.flags.c_contiguous and B.flags.c_contiguous)
        return out

    executor.PairStep.__call__ = timed
    t = time.thread_time()
    sequence_exact.tree_cross_gram(trees[:1], trees[2:3], n_ctx)
    total = time.thread_time() - t
    executor.PairStep.__call__ = call
    steps = sum(v[1] for v in stats.values())
    flops = sum(v[2] for v in stats.values())
    print(f"one S<=5 pair at (d_model {d}, n_ctx {n_ctx}, {heads} heads of {dh}): {total:.2f} "
          f"thread CPU-s; {sum(v[0] for v in stats.values())} pairwise steps, {steps:.2f} s "
          f"({steps / total:.0%}), {flops:.3g} FLOPs, {flops / steps / 1e9:.1f} GFLOP/s in them")
    for key, (n, sec, f, strided) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  (batch, m, k, n) = {key}: {n} steps, {sec:.3f} s ({sec / steps:.0%}), "
              f"{f / sec / 1e9 if sec else 0:.1f} GFLOP/s, {strided} with a strided operand")


if __name__ == "__main__":
    main()
