"""First-order path Gram of one transformer (not run in CI): `python benchmarks/bench_paths.py`.

Times ``tensoralg.decompose.paths(model)`` (the exact Gram matrix of the direct path and of
every head's first-order path; the remainder not assessed) on one thread, best of
``--repeat``, for

* the language audit's default model: two bias-free bilinear-attention layers, d_model 16,
  n_ctx 8, 2 heads of 4, RoPE 10000, a 97-token unembedding (target: under 2 s);
* d_model 64, n_ctx 8, 4 heads of 16, two layers (target: under 20 s).

``--match`` also times ``path_similarity(a, b, match=True)`` of two such models (the
per-layer cross-Gram of the heads, the assignment, then every path's similarity).
"""

from __future__ import annotations

import argparse
import json

from _timing import best_of

SIZES = {"audit": dict(d_model=16, n_heads=2, d_head=4), "d64": dict(d_model=64, n_heads=4,
                                                                     d_head=16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="audit,d64", help="comma-separated of " + ", ".join(SIZES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--match", action="store_true")
    args = ap.parse_args()
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
        t, pd = best_of(lambda a=a: dc.paths(a), args.repeat)
        row = {"model": key, **kw, "n_ctx": 8, "n_layers": 2, "paths": len(pd.names),
               "gram_seconds": round(t, 3), "share": [round(float(s), 4) for s in pd.share]}
        if args.match:
            tm, _ = best_of(lambda a=a, b=b: dc.path_similarity(a, b, match=True), 1)
            row["match_seconds"] = round(tm, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
