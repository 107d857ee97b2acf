"""First-order path Gram of one transformer (not run in CI): `python benchmarks/bench_paths.py`.

Times ``tensoralg.decompose.paths(model)`` (the exact Gram matrix of the direct path and of
every head's first-order path; the remainder not assessed) on one thread, best of
``--repeat``, for

* the language audit's default model: two bias-free bilinear-attention layers, d_model 16,
  n_ctx 8, 2 heads of 4, RoPE 10000, a 97-token unembedding (target: under 2 s);
* d_model 64, n_ctx 8, 4 heads of 16, two layers (target: under 20 s).

``--match`` also times ``path_similarity(a, b, match=True)`` of two such models (the
per-layer cross-Gram of the heads, the assignment, then every path's similarity).

``--over-training N`` also times ``paths_over_training`` of ``N`` checkpoints (independently
initialized models stand in for them: the work depends on the shapes, not the values; target
at the audit's size and N = 32: under 2 min), and ``--transition`` times ``transition_paths``
of two models on the residual stream and on a 32-wide input (the language audit's vocabulary-
space metrics: the pair's joint input span of at most 2 d_model columns), the audit's added
work per sharpest interval. Every time is reported as wall and CPU seconds (``process_time``:
the figure to quote on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import time

from _timing import best_of

SIZES = {"audit": dict(d_model=16, n_heads=2, d_head=4), "d64": dict(d_model=64, n_heads=4,
                                                                     d_head=16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="audit,d64", help="comma-separated of " + ", ".join(SIZES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--match", action="store_true")
    ap.add_argument("--over-training", type=int, default=0, metavar="N",
                    help="also time paths_over_training of N checkpoints (default 0: not run)")
    ap.add_argument("--transition", action="store_true",
                    help="also time transition_paths (residual stream, 32-wide input)")
    ap.add_argument("--no-gram", action="store_true", help="skip the one-model Gram timing")
    args = ap.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import tensoralg as ta
    from tensoralg import decompose as dc
    from tensoralg.transformer import BilinearTransformer

    ta.set_threads(1)
    rows = []
    for key in args.sizes.split(","):
        kw = SIZES[key]

        def model(seed, kw=kw):
            return BilinearTransformer(97, kw["d_model"], 2, kw["n_heads"], kw["d_head"],
                                       n_ctx=8, rope=10000.0, seed=seed).to_network()
        a, b = model(0), model(1)
        row = {"model": key, **kw, "n_ctx": 8, "n_layers": 2}
        if not args.no_gram:
            t, pd = best_of(lambda a=a: dc.paths(a), args.repeat)
            row.update(paths=len(pd.names), gram_seconds=round(t, 3),
                       share=[round(float(s), 4) for s in pd.share])
        if args.transition:
            from tensoralg.layers import Linear, Sequential

            wide = np.random.default_rng(0).standard_normal((kw["d_model"], 32)) / np.sqrt(32)
            for name, (x, y) in (("residual", (a, b)),
                                 ("input_32", (Sequential([Linear(wide), a]),
                                               Sequential([Linear(wide), b])))):
                c, w = time.process_time(), time.perf_counter()
                tr = dc.transition_paths(x, y, n_ctx=8)
                row[f"transition_{name}_seconds"] = round(time.perf_counter() - w, 3)
                row[f"transition_{name}_cpu_seconds"] = round(time.process_time() - c, 3)
                row[f"transition_{name}_verdict"] = tr.verdict
        if args.over_training:
            ms = [model(s) for s in range(args.over_training)]
            c, w = time.process_time(), time.perf_counter()
            r = dc.paths_over_training(ms)
            row.update(over_training_checkpoints=args.over_training,
                       over_training_seconds=round(time.perf_counter() - w, 3),
                       over_training_cpu_seconds=round(time.process_time() - c, 3),
                       over_training_paths=len(r.names))
        if args.match:
            tm, _ = best_of(lambda a=a, b=b: dc.path_similarity(a, b, match=True), 1)
            row["match_seconds"] = round(tm, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
