"""Benchmarks of the exact one-layer bilinear-attention inner product (not run in CI).

    python benchmarks/bench_attention.py            # small (seconds) and large (minutes)
    python benchmarks/bench_attention.py --only small

1. small: d_model = 8, n_ctx = 2, 2 heads, d_head = 4 (the research code's test transformer
   size; 1.45 s per warm pair there, target < 0.5 s): cold and warm (median of 5) exact inner
   product and similarity of a pair of residual attention models, with and without biases, and
   the Monte Carlo time to reach a standard error of 1e-2 relative (extrapolated by 1/sqrt(n)
   from 100 000 samples timed in the same run);
2. large: d_model = 64, n_ctx = 8, 4 heads, d_head = 16: the number of Wick configurations and
   the wall time of one exact inner product (no biases).

BLAS and torch run on one thread.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import tensoralg as ta  # noqa: E402
from tensoralg import attention as A  # noqa: E402


def model(rng, d, H, dh, bias, residual=True):
    g = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])  # noqa: E731
    b = dict(q1_bias=g(H, dh), k1_bias=g(H, dh), q2_bias=g(H, dh), k2_bias=g(H, dh),
             v_bias=g(H, dh), o_bias=g(d)) if bias else {}
    layer = ta.BilinearAttention(g(H, dh, d), g(H, dh, d), g(H, dh, d), g(H, dh, d), g(H, dh, d),
                                 g(d, H, dh), **b)
    return ta.Residual(layer) if residual else layer


def timed(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def bench_small():
    print("== 1. d_model=8, n_ctx=2, 2 heads, d_head=4 (target: warm pair < 0.5 s) ==")
    rng = np.random.default_rng(0)
    for bias in (False, True):
        a, b = model(rng, 8, 2, 4, bias), model(rng, 8, 2, 4, bias)
        n_conf = A.count_configurations(a, b, 2)
        cold, val = timed(lambda: A.exact_inner(a, b, n_ctx=2), 1)
        warm, _ = timed(lambda: A.exact_inner(a, b, n_ctx=2), 5)
        warm_sim, sim = timed(lambda: A.exact_similarity(a, b, n_ctx=2), 3)
        t = time.perf_counter()
        mc = A.montecarlo_inner(a, b, n_ctx=2, n_samples=100_000, seed=1)
        # time to reach a standard error of 1e-2 |value|, from the measured SE (1/sqrt(n))
        t_mc = (time.perf_counter() - t) * (mc.stderr / (1e-2 * abs(val))) ** 2
        print(f"biases={bias!s:5}  Wick configurations (matchings) {n_conf:6d}  inner {val:.6g}  "
              f"sim {sim:.4f}")
        print(f"   exact inner: cold {cold[0]:.2f} s, warm median {statistics.median(warm):.3f} s "
              f"(min {min(warm):.3f});  exact similarity (3 inner products) warm median "
              f"{statistics.median(warm_sim):.3f} s")
        print(f"   Monte Carlo to 1e-2 relative SE (extrapolated from n={mc.n_samples}): {t_mc:.1f} s ("
              f"z = {(float(mc) - val) / mc.stderr:+.2f});  ratio MC / exact warm = "
              f"{t_mc / statistics.median(warm):.1f}")


def bench_large():
    print("== 2. d_model=64, n_ctx=8, 4 heads, d_head=16 (report) ==")
    rng = np.random.default_rng(1)
    a, b = model(rng, 64, 4, 16, False), model(rng, 64, 4, 16, False)
    n_conf = A.count_configurations(a, b, 8)
    t = time.perf_counter()
    val = A.exact_inner(a, b, n_ctx=8)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    A.exact_inner(a, b, n_ctx=8)
    warm = time.perf_counter() - t
    print(f"no biases: {n_conf} matchings; exact inner {val:.6g}: cold {cold:.1f} s, warm {warm:.1f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["small", "large"])
    args = p.parse_args()
    if args.only in (None, "small"):
        bench_small()
    if args.only in (None, "large"):
        bench_large()
    print("(the closure for two-layer attention stacks is not implemented yet: no timing)")


if __name__ == "__main__":
    main()
