"""Deep transformers (issue 21's targets; not run in CI): the exact S<=5 similarity matrix of
checkpoints of a two-layer bilinear-attention model, and a guided Monte Carlo pair, at
(d_model 64, n_ctx 8, 4 heads of 16), one thread (torch and BLAS).

    python benchmarks/bench_deep.py                    # 32 models: the S<=5 matrix, one guided pair
    python benchmarks/bench_deep.py --models 8 --guided-samples 4000

Models: ``Sequential([Residual(BilinearAttention) x 2, Linear(d -> d)])`` without biases, random
weights scaled ``1/sqrt(fan_in)`` and a checkpoint-like drift: model ``i`` is the first plus
``0.1 * i / n`` times an independent perturbation. S<=5 of a bias-free pair is exact: each
model's degree-<=5 part is one attention layer holding both layers' heads side by side
(``tensoralg.degree``), built once per model with its chaos form; then one exact inner product
per pair (``ta.degree_similarity_matrix``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=32, help="checkpoints in the matrix (32)")
    ap.add_argument("--size", default="64,8,4,16", help="d_model,n_ctx,heads,d_head")
    ap.add_argument("--guided-samples", type=int, default=4000,
                    help="samples of the guided pair (0: skip it)")
    args = ap.parse_args()
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    threadpool_limits(1)
    import tensoralg as ta

    d, n_ctx, heads, dh = (int(x) for x in args.size.split(","))
    rng = np.random.default_rng(0)
    names = ("q1", "k1", "q2", "k2", "v")

    def draw():
        w = {k: rng.standard_normal((2, heads, dh, d)) / np.sqrt(d) for k in names}
        w["o"] = rng.standard_normal((2, d, heads, dh)) / np.sqrt(heads * dh)
        w["u"] = rng.standard_normal((d, d)) / np.sqrt(d)
        return w

    base, drift = draw(), draw()

    def model(i):
        t = 0.1 * i / args.models
        w = {k: base[k] + t * drift[k] for k in base}
        layers = [ta.Residual(ta.BilinearAttention(*(w[k][j] for k in names), w["o"][j]))
                  for j in range(2)]
        return ta.Sequential(layers + [ta.Linear(w["u"])])

    models = [model(i) for i in range(args.models)]
    t0 = time.perf_counter()
    M = ta.degree_similarity_matrix(models, n_ctx=n_ctx, max_degree=5)
    t_matrix = time.perf_counter() - t0
    S = M[5]
    n_pairs = len(models) * (len(models) + 1) // 2
    print(f"S<=5 matrix of {len(models)} two-layer models at (d_model {d}, n_ctx {n_ctx}, "
          f"{heads} heads of {dh}), exact (degree_similarity_matrix: each model's part once, "
          f"then {n_pairs} pairs): {t_matrix:.1f} s ({t_matrix / n_pairs * 1e3:.0f} ms a pair)")
    print(f"  S<=5[0, -1] = {S[0, -1]:.6f}, S<=5[0, 1] = {S[0, 1]:.6f}")
    r = ta.degree_similarity(models[0], models[-1], n_ctx=n_ctx, max_degree=5)
    print(f"  check: degree_similarity(models[0], models[-1])[5] = {float(r[5]):.6f}")
    if args.guided_samples:
        t0, c0 = time.perf_counter(), time.process_time()
        g = ta.similarity(models[0], models[-1], method="montecarlo", proposal="modes",
                          n_samples=args.guided_samples, seed=0, n_ctx=n_ctx)
        print(f"guided full similarity of models 0 and {len(models) - 1}: {g!r} in "
              f"{time.perf_counter() - t0:.1f} s ({time.process_time() - c0:.1f} s of CPU, "
              f"the process's first guided call)")
        print(f"  {g.diagnostics.summary()}")


if __name__ == "__main__":
    main()
