"""Cost of exact ``S<=9`` of two attention layers (not run in CI):
`python benchmarks/bench_degree_nine.py [d n_ctx heads d_head] ...`.

Bias-free two-layer attention stacks (embedding, two residual attention layers, unembedding
to ``d`` outputs): ``tensoralg.degree_similarity(a, b, max_degree=9)`` (the feature-space chaos
of the unrolled paths: one linear term, one attention term holding both layers' heads, and one
two-node term per leg of the later layer with the heads side by side) against the estimate of
`tensoralg.strategies.chaos.composed.check` (FLOPs, bytes), one thread. Prints one JSON line
per size; a size over budget prints the refusal's estimate.
"""

from __future__ import annotations

import json
import sys
import time


def _model(d, n_heads, dh, seed):
    import numpy as np

    from tensoralg.layers import BilinearAttention, Linear, Residual, Sequential

    rng = np.random.default_rng(seed)

    def att():
        kw = {k: rng.normal(size=(n_heads, dh, d)) * 0.5 for k in ("q1", "k1", "q2", "k2", "v")}
        return BilinearAttention(**kw, o=rng.normal(size=(d, n_heads, dh)), mask="causal")
    return Sequential([Linear(rng.normal(size=(d, d))), Residual(att()), Residual(att()),
                       Linear(rng.normal(size=(d, d)))])


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    import tensoralg as ta
    from tensoralg import homogeneous
    from tensoralg.errors import CostTooHigh
    from tensoralg.strategies.chaos import composed

    nums = [int(x) for x in argv] or [2, 2, 1, 1, 2, 2, 2, 2]
    for i in range(0, len(nums), 4):
        d, n_ctx, H, dh = nums[i:i + 4]
        a, b = _model(d, H, dh, 0), _model(d, H, dh, 1)
        terms = [list(homogeneous.unrolled(m, n_ctx, 9)[0].tree(set(range(10))).nodes[0].terms)
                 for m in (a, b)]
        est = composed.estimate(terms[0], n_ctx)
        row = {"d": d, "n_ctx": n_ctx, "heads": H, "d_head": dh, "N": n_ctx * d,
               "terms_per_model": len(terms[0]), "estimated_flops": est["flops"],
               "estimated_bytes": est["bytes"]}
        try:
            composed.check(terms, n_ctx, "S<=9")
        except CostTooHigh as exc:
            row["refused"] = str(exc)[:160]
            print(json.dumps(row), flush=True)
            continue
        t = time.perf_counter()
        r = ta.degree_similarity(a, b, n_ctx=n_ctx, max_degree=9)
        row.update(seconds=round(time.perf_counter() - t, 2), S9=float(r[9]),
                   method=r.method[9])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
