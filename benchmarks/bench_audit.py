"""Audit-size timings, side by side (not run in CI): `python benchmarks/bench_audit.py`.

* tensor similarity of two digit classifiers (64 -> 32 -> bilinear 64 -> 10, residual, biases):
  exact vs closure vs Monte Carlo (100k samples), global and per-class;
* N checkpoints: one batched similarity_matrix call vs N^2 pairwise similarity calls;
* the data baselines (CKA, output cosine, JS on 450 test digits) for scale.
"""

from __future__ import annotations

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
        t_batch, mat = best_of(lambda: ta.similarity_matrix(nets), 1)
        t_pair, _ = best_of(lambda: [[ta.similarity(x, y) for y in nets] for x in nets], 1)
        print(f"N={n:3d} checkpoints: batched matrix {t_batch:.3f} s, N^2 pairwise {t_pair:.3f} s, "
              f"ratio {t_pair / t_batch:.1f}x")

    d = load_digits_data()
    t_base, _ = best_of(lambda: all_baselines(a, b, d.X_test))
    print(f"all data baselines on {len(d.X_test)} test digits: {t_base:.4f} s "
          f"({t_base / base:.1f}x the exact global similarity)")


if __name__ == "__main__":
    main()
