"""The Gauss–Hermite oracle (tensoralg.verify.quadrature) on planted two-layer attention models (not CI).

    python benchmarks/bench_quadrature.py --only timing     # N = 4 (s) and N = 5 (minutes)
    python benchmarks/bench_quadrature.py --only mc         # oracle vs plain Monte Carlo

1. timing: a pair of planted two-layer bilinear-attention models (tensoralg.verify.planted, n_ctx = 8,
   d = 16, 2 heads, d_head 2, d_v 1, degree 25, m = 26 nodes), the slice ``v`` at positions
   ``0..N-1``: wall time of ``quadrature_inner(a, b)`` (``26^N`` forward evaluations per model)
   for N = 4, 5 and of ``chaos_profile(a, b)`` for N = 4 (one run each: minutes).
2. mc: n_ctx = 4, d = 16 (64 Gaussian inputs), the v-slice at every position (N = 4), which is
   the EXACT full inner product of the planted models; against plain Monte Carlo over the full
   input (3 seeds of ``--samples`` draws each) at input scales sigma: the estimate, its standard
   error, z against the truth and the largest single-sample share of each sum; and, as an
   independent check of the truth, importance sampling of <b,b> on the 4 variables Xv with a
   wide proposal N(0, 2.5^2 I) (200 000 draws).

BLAS on one thread.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensoralg.verify.planted import planted_attention  # noqa: E402
from tensoralg.verify.quadrature import chaos_profile, quadrature_inner  # noqa: E402


def timing(ns=(4, 5)):
    n_ctx, d = 8, 16
    pa = planted_attention(d, n_ctx, scale=0.3, seed=1)
    pb = planted_attention(d, n_ctx, scale=0.3, seed=2, direction=pa.direction)
    v = pa.direction[None, :]
    for N in ns:
        t = time.perf_counter()
        r = quadrature_inner(pa.network, pb.network, v, n_ctx=n_ctx, positions=range(N))
        print(f"N={N}: {r.n_points} points, quadrature_inner(a, b) {time.perf_counter() - t:.1f} s"
              f" = {r.value:.12g} (abs_sum {r.abs_sum:.3g})", flush=True)
        if N <= 4:
            t = time.perf_counter()
            c = chaos_profile(pa.network, pb.network, v, n_ctx=n_ctx, positions=range(N))
            print(f"N={N}: chaos_profile(a, b) {time.perf_counter() - t:.1f} s, orders sum "
                  f"{c.cross.sum():.12g}, total {c.total:.12g}", flush=True)


def mc(scales=(0.2, 0.3, 0.35, 0.4), samples=20_000):
    n_ctx, d = 4, 16
    for sigma in scales:
        pa = planted_attention(d, n_ctx, scale=sigma, seed=1)
        pb = planted_attention(d, n_ctx, scale=sigma, seed=2, direction=pa.direction)
        sl = pa.slice()
        truth = {"ab": quadrature_inner(pa.network, pb.network, sl).value,
                 "aa": quadrature_inner(pa.network, None, sl).value,
                 "bb": quadrature_inner(pb.network, None, sl).value}
        print(f"sigma={sigma}: exact <a,b> = {truth['ab']:.6g}, <a,a> = {truth['aa']:.6g}, "
              f"<b,b> = {truth['bb']:.6g}, similarity "
              f"{truth['ab'] / math.sqrt(truth['aa'] * truth['bb']):.4f}", flush=True)
        # independent check of the truth: importance sampling on the n_ctx variables Y = Xv
        # with the wide proposal N(0, 2.5^2 I) (the planted f depends on X only through Xv)
        s_q, n_is = 2.5, 200_000
        Y = s_q * np.random.default_rng(99).standard_normal((n_is, n_ctx))
        lw = n_ctx * math.log(s_q) - 0.5 * (Y ** 2).sum(1) * (1 - 1 / s_q ** 2)
        gb = pb.network(np.einsum("nt,d->ntd", Y, pa.direction)).reshape(n_is, -1)
        h = (gb * gb).sum(1) * np.exp(lw)
        print(f"  importance sampling on Xv: <b,b> = {h.mean():.5g} +- "
              f"{h.std(ddof=1) / math.sqrt(n_is):.2g}", flush=True)
        for seed in range(3):
            X = np.random.default_rng(seed).standard_normal((samples, n_ctx, d))
            ya, yb = pa.network(X), pb.network(X)
            row = []
            for key, s in (("ab", np.einsum("nto,nto->n", ya, yb)),
                           ("aa", np.einsum("nto,nto->n", ya, ya)),
                           ("bb", np.einsum("nto,nto->n", yb, yb))):
                se = s.std(ddof=1) / math.sqrt(samples)
                z = (s.mean() - truth[key]) / se
                row.append(f"{key} {s.mean():.4g} +- {se:.2g} (z {z:+.1f},"
                           f" max share {np.abs(s).max() / np.abs(s).sum():.3f})")
            print(f"  MC seed {seed}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["timing", "mc"])
    ap.add_argument("--samples", type=int, default=20_000)
    args = ap.parse_args()
    if args.only in (None, "mc"):
        mc(samples=args.samples)
    if args.only in (None, "timing"):
        timing()
