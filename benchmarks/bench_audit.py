"""Audit-size timings, side by side (not run in CI): `python benchmarks/bench_audit.py`.

* tensor similarity of two digit classifiers (64 -> 32 -> bilinear 64 -> 10, residual, biases):
  exact vs closure vs Monte Carlo (100k samples), global and per-class;
* N checkpoints: one batched similarity_matrix call vs N^2 pairwise similarity calls;
* the data baselines (CKA, output cosine, JS on 450 test digits) for scale.

`python benchmarks/bench_audit.py language RUN [--directions 5000] [--seeds 1,2,3] [i:j ...]`:
the closure against Monte Carlo on the checkpoints of a `tensoralg audit language` run (default
pairs: those of the run's own Monte Carlo check, `--method montecarlo` runs; give them
otherwise). Per pair, the closure's raw moments ``<a,a>, <a,b>, <b,b>`` and similarity, and per
seed the radial Monte Carlo estimate (``tensoralg.strategies.montecarlo.montecarlo_similarity``'s
estimator: directions uniform on the sphere, the radius integrated by a Gauss rule exact for the
degree) of the same moments, with the share of each self moment carried by its single largest
direction (heavy tails) and a Markov lower bound on each self moment. The bound needs only that the
per-direction ``p_aa`` is nonnegative and unbiased: with ``k`` independent seeds,
``P(min_s mean_s >= m) <= (<a,a> / m)^k``, so ``<a,a> >= min_s mean_s * alpha^(1/k)`` at
confidence ``1 - alpha`` (alpha = 1e-3). A bound above the closure's ``<a,a>`` refutes the
closure's norm without trusting any standard error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _timing import best_of


def main() -> None:
    torch.set_num_threads(1)
    import tensoralg as ta
    from tensoralg.baselines import all_baselines
    from tensoralg.data import load_digits_data
    from tensoralg.nn import BilinearNet

    def model(seed):
        return BilinearNet(64, 10, d_model=32, d_hidden=64, residual=True, bias=True, seed=seed)

    a, b = model(0), model(1)
    na, nb = a.to_network(), b.to_network()
    rows = []
    for method in ("exact", "closure", "montecarlo"):
        t_g, _ = best_of(lambda: ta.similarity(na, nb, method=method), 1 if method == "montecarlo" else 3)
        t_e, _ = best_of(lambda: ta.similarity(na, nb, method=method, output="each"),
                       1 if method == "montecarlo" else 3)
        rows.append((method, t_g, t_e))
    base = rows[0][1]
    print("similarity of two digit classifiers (depth 1):")
    print(f"{'method':>11} {'global s':>10} {'each s':>10} {'global/exact':>13}")
    for m, tg, te in rows:
        print(f"{m:>11} {tg:10.4f} {te:10.4f} {tg / base:13.1f}")

    for n in (8, 24):
        nets = [model(s).to_network() for s in range(n)]
        t_batch, _mat = best_of(lambda: ta.similarity_matrix(nets), 1)
        t_pair, _ = best_of(lambda: [[ta.similarity(x, y) for y in nets] for x in nets], 1)
        print(f"N={n:3d} checkpoints: batched matrix {t_batch:.3f} s, N^2 pairwise {t_pair:.3f} s, "
              f"ratio {t_pair / t_batch:.1f}x")

    d = load_digits_data()
    t_base, _ = best_of(lambda: all_baselines(a, b, d.X_test))
    print(f"all data baselines on {len(d.X_test)} test digits: {t_base:.4f} s "
          f"({t_base / base:.1f}x the exact global similarity)")


def language(argv: list[str]) -> None:
    """Closure vs radial Monte Carlo on a language audit's checkpoints (see the module doc)."""
    from tensoralg.checkpoint import load_checkpoint
    from tensoralg.strategies import closure as C
    from tensoralg.strategies import montecarlo as MC
    from tensoralg.strategies.montecarlo import ratio_estimate

    ap = argparse.ArgumentParser(prog="bench_audit.py language")
    ap.add_argument("run", help="folder of a `tensoralg audit language` run")
    ap.add_argument("pairs", nargs="*", help="i:j checkpoint indices (default: the run's check)")
    ap.add_argument("--directions", type=int, default=5000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--alpha", type=float, default=1e-3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    run = Path(args.run)
    js = json.loads((run / "language.json").read_text())
    names = [c["name"] for c in js["checkpoints"]]
    steps = [c["step"] for c in js["checkpoints"]]
    n_ctx = js["config"]["n_ctx"]
    seeds = [int(x) for x in args.seeds.split(",")]
    pairs = [tuple(int(v) for v in p.split(":")) for p in args.pairs] or \
        [(r["i"], r["j"]) for r in js.get("montecarlo_check") or []]
    if not pairs:
        ap.error(f"{run}: no pairs given and the run has no Monte Carlo check (a degree-report "
                 f"run): pass them as i:j")
    print(f"{run}: {js['config']['n_layers']} layer(s), d_model {js['config']['d_model']}, "
          f"n_ctx {n_ctx}; {args.directions} directions per seed, seeds {seeds}")
    for i, j in pairs:
        a = load_checkpoint(run / "checkpoints" / names[i])[0].to_network()
        b = load_checkpoint(run / "checkpoints" / names[j])[0].to_network()
        t = time.perf_counter()
        aa, ab, bb = (float(v) for v in C.closure_triple(a, b, n_ctx=n_ctx))
        print(f"steps {steps[i]} vs {steps[j]}: closure sim {ab / np.sqrt(aa * bb):.4f}, "
              f"<a,a> {aa:.4g}, <b,b> {bb:.4g}, <a,b> {ab:.4g} ({time.perf_counter() - t:.1f} s)")
        means = []
        for seed in seeds:
            t = time.perf_counter()
            n = args.directions
            _, _, p = MC.moments([a, b], [a, b], np.eye(a.out_features), False, n, seed,
                                 "numpy", None, None, samples=True, n_ctx=n_ctx)
            P = np.stack([p[:, 0, 1], p[:, 0, 0], p[:, 1, 1]])   # (3, n): ab, aa, bb
            e = ratio_estimate(P.sum(1), P @ P.T, n)
            m, se = P.mean(1), P.std(1, ddof=1) / np.sqrt(n)
            means.append(m)
            print(f"  seed {seed}: MC sim {float(e):.4f} ± {e.stderr:.4f}; <a,a> {m[1]:.4g} ± "
                  f"{se[1]:.2g} (largest direction {P[1].max() / P[1].sum():.2f} of the sum), "
                  f"<b,b> {m[2]:.4g} ± {se[2]:.2g} ({P[2].max() / P[2].sum():.2f}), <a,b> "
                  f"{m[0]:.4g} ({time.perf_counter() - t:.1f} s)")
        lo = np.min(means, axis=0) * args.alpha ** (1 / len(seeds))
        print(f"  Markov lower bounds ({1 - args.alpha:.1%}): <a,a> >= {lo[1]:.3g} "
              f"({lo[1] / aa:.3g} x closure), <b,b> >= {lo[2]:.3g} ({lo[2] / bb:.3g} x closure)")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["language"]:
        language(sys.argv[2:])
    else:
        main()
