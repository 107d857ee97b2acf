"""Cost of the exact second-order paths (not run in CI): `python benchmarks/bench_second_order_paths.py`.

For a few sizes (d, n_ctx, heads, d_head) of a two-layer attention stack with query/key/value
biases: the estimate of `tensoralg.strategies.chaos.composed.estimate` for one two-node term
(FLOPs, bytes), the measured seconds of its `FeatureChaos` (one thread, caches warm: the slot
map and the Hermite matrix of its (N, 9) are built once per process and timed apart), and for
the smaller sizes the whole ``dc.paths(order=2)`` (every virtual head and the exact Gram).
Prints one JSON line per size.
"""

from __future__ import annotations

import json
import time


def _model(d, n_heads, dh, seed=0):
    import numpy as np

    from tensoralg.layers import BilinearAttention, Linear, Residual, Sequential

    rng = np.random.default_rng(seed)

    def att():
        kw = {k: rng.normal(size=(n_heads, dh, d)) for k in ("q1", "k1", "q2", "k2", "v")}
        kw.update({k + "_bias": rng.normal(size=(n_heads, dh)) for k in ("q1", "k1", "v")})
        return BilinearAttention(**kw, o=rng.normal(size=(d, n_heads, dh)), mask="causal")
    return Sequential([Linear(rng.normal(size=(d, d)), rng.normal(size=d)), Residual(att()),
                       Residual(att()), Linear(rng.normal(size=(d, d)))])


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from tensoralg import decompose as dc
    from tensoralg.decompose import sequence_paths as sp
    from tensoralg.strategies.chaos import composed

    sizes = [(1, 2, 1, 1), (2, 2, 1, 1), (2, 2, 2, 2), (1, 4, 1, 1), (1, 5, 1, 1), (3, 2, 1, 1),
             (2, 3, 1, 1), (1, 6, 1, 1), (2, 4, 1, 1), (16, 8, 2, 4)]
    for d, n_ctx, H, dh in sizes:
        model = _model(d, H, dh)
        pre, blocks, post = sp._split(model, "model")
        names, _nets, specs = sp._second_order(pre, blocks, post, d, False)
        terms = sp._composed_terms(specs[0], pre, post, n_ctx, False, d)
        est = composed.estimate(terms, n_ctx)
        row = {"d": d, "n_ctx": n_ctx, "heads": H, "d_head": dh, "N": n_ctx * d,
               "n_second_order": len(names), "est_flops": est["flops"],
               "est_GiB": est["bytes"] / 2 ** 30}
        try:
            composed.check([terms], n_ctx, "bench")
        except composed.CostTooHigh as exc:
            row["refused"] = str(exc)[:120]
            print(json.dumps(row), flush=True)
            continue
        t = time.perf_counter()
        composed._slot_ids(n_ctx * d, 9, 9)
        composed._hermite(n_ctx * d, 9)
        row["setup_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        composed.FeatureChaos(terms, n_ctx, max_degree=9)
        row["term_s"] = round(time.perf_counter() - t, 3)
        if row["term_s"] * (len(names) + 5) < 120:
            t = time.perf_counter()
            pd = dc.paths(model, n_ctx=n_ctx, order=2)
            row["paths_s"] = round(time.perf_counter() - t, 2)
            row["n_paths"] = len(pd.names)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
