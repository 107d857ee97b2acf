"""Benchmarks of the exact core (not run in CI). Prints measured ratios side by side.

    python benchmarks/bench_core.py            # all three, a few minutes on 2 CPU cores
    python benchmarks/bench_core.py --only mc  # one of: mc, gram, depth2

1. exact vs Monte Carlo at equal accuracy: time for Monte Carlo to reach the exact value within
   1e-3 relative (its standard error at 1e-3 of the value) against one exact call;
2. the batched Gram path against N^2 separate inner() calls for N = 50 checkpoints;
3. the cost of exact depth-2 stacks against d and H (plan FLOPs and wall time).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _timing import best_of

import tensoralg as ta


def bilinear(rng, d, H, O, scale=1.0):
    g = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])  # noqa: E731
    return ta.Bilinear(g(H, d), g(H, d), scale * g(O, H), g(H), g(H), g(O))


def bench_mc(rng):
    print("== 1. exact vs Monte Carlo at equal accuracy (1e-3 relative) ==")
    print(f"{'network':<34}{'exact [s]':>11}{'MC n needed':>14}{'MC time [s]':>13}{'MC/exact':>10}")
    cases = {
        "bilinear d=64 H=256 O=10": (bilinear(rng, 64, 256, 10), bilinear(rng, 64, 256, 10)),
        "depth-2 d=8 H=16 (embed,res,head)": None,
    }
    deep = lambda: ta.Sequential([ta.Linear(rng.standard_normal((8, 8)) / 3),  # noqa: E731
                                  ta.Residual(bilinear(rng, 8, 16, 8)),
                                  ta.Residual(bilinear(rng, 8, 16, 8)),
                                  ta.Linear(rng.standard_normal((10, 8)) / 3)])
    cases["depth-2 d=8 H=16 (embed,res,head)"] = (deep(), deep())
    for name, (a, _b) in cases.items():
        ta.inner(a, a)  # paths found once per topology (cached), as in real use
        t_exact, exact = best_of(lambda: ta.inner(a, a))
        n0 = 20_000
        t0 = time.perf_counter()
        est = ta.inner(a, a, method="montecarlo", n_samples=n0, seed=1)
        t_mc0 = time.perf_counter() - t0
        rel_se = est.stderr / abs(exact)
        n_need = int(np.ceil(n0 * (rel_se / 1e-3) ** 2))
        if n_need <= 2_000_000:
            t0 = time.perf_counter()
            est = ta.inner(a, a, method="montecarlo", n_samples=n_need, seed=2)
            t_mc = time.perf_counter() - t0
            note = ""
        else:
            t_mc = t_mc0 * n_need / n0
            note = " (extrapolated)"
        print(f"{name:<34}{t_exact:>11.4f}{n_need:>14,}{t_mc:>13.2f}{t_mc / t_exact:>10.0f}x{note}")


def bench_gram(rng, N=50):
    print(f"\n== 2. batched Gram matrix vs N^2 separate calls (N = {N} checkpoints) ==")
    print(f"{'model':<34}{'gram [s]':>10}{'N^2 calls [s]':>15}{'ratio':>8}{'max |diff|/norm':>17}")
    base = [ta.Linear(rng.standard_normal((32, 64)) / 8), bilinear(rng, 32, 64, 32),
            ta.Linear(rng.standard_normal((10, 32)) / 6)]
    models = []
    for k in range(N):  # a training-like trajectory: small drifts of one base model
        drift = lambda arr: arr + 0.05 * k / N * rng.standard_normal(arr.shape)  # noqa: E731
        models.append(ta.Sequential([ta.layers.map_arrays(layer, drift) for layer in base]))
    ta.gram(models[:2])
    t_gram, G = best_of(lambda: ta.gram(models), repeat=1)
    ta.inner(models[0], models[1])
    t0 = time.perf_counter()
    P = np.array([[ta.inner(a, b) for b in models] for a in models])
    t_pairs = time.perf_counter() - t0
    nrm = np.sqrt(np.outer(np.diag(G), np.diag(G)))
    print(f"{'embed 64->32, bilinear H=64, head 10':<34}{t_gram:>10.2f}{t_pairs:>15.2f}"
          f"{t_pairs / t_gram:>7.1f}x{np.max(np.abs(G - P) / nrm):>17.1e}")


def bench_depth2(rng):
    print("\n== 3. exact depth-2 bilinear stacks: cost against d and H ==")
    print(f"{'d':>4}{'H':>5}{'configs':>9}{'orbits':>8}{'plan FLOPs':>13}{'largest':>11}"
          f"{'time [s]':>10}")
    for d, H in [(4, 8), (8, 8), (8, 16), (16, 16), (16, 32), (32, 32), (32, 64)]:
        a = ta.Sequential([bilinear(rng, d, H, d), bilinear(rng, d, H, 10)])
        b = ta.Sequential([bilinear(rng, d, H, d), bilinear(rng, d, H, 10)])
        # the Wick plan in full (under auto the planner may stop at a lower bound once chaos
        # is cheaper, and then reports no orbits); the time is auto's
        p = ta.plan(a, b, strategy="wick")
        try:
            t, _ = best_of(lambda: ta.inner(a, b), repeat=1)
            ts = f"{t:>10.2f}"
        except ta.CostTooHigh:
            ts = f"{'refused':>10}"
        print(f"{d:>4}{H:>5}{p.n_configurations:>9}{p.n_orbits:>8}{p.flops:>13.3g}"
              f"{p.largest_intermediate:>11}{ts}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", choices=["mc", "gram", "depth2"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.only in (None, "mc"):
        bench_mc(rng)
    if args.only in (None, "gram"):
        bench_gram(rng)
    if args.only in (None, "depth2"):
        bench_depth2(rng)


if __name__ == "__main__":
    main()
