"""Measure the sequence closure (tensoralg.strategies.closure.closure_inner, APPROXIMATE at depth >= 2)
against Monte Carlo on random two-layer attention-only models; numbers for docs/results/attention.md.

    python benchmarks/attention_closure_error.py [weight_scale=0.3] [bias]

Models: Residual(attn) -> Residual(attn) -> Linear(2, 3); d = 3, n_ctx = 3, 1 head, d_head = 2,
causal; weights N(0, scale^2), unembedding N(0, 1); seeds 100..103. Monte Carlo: 400 000
samples, seed 0, batch-means standard error. Runs single-threaded; slow (minutes).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
import math
import sys
import time

import numpy as np

import tensoralg as ta
from tensoralg.strategies import closure as C
from tensoralg.strategies import montecarlo as MC


def model(rng, d=3, H=1, dh=2, bias=False):
    def g(*s):
        return rng.standard_normal(s) * SCALE
    def at():
        kw = {}
        if bias:
            kw = dict(q1_bias=g(H, dh), k1_bias=g(H, dh), q2_bias=g(H, dh), k2_bias=g(H, dh),
                      v_bias=g(H, dh))
        return ta.BilinearAttention(g(H, dh, d), g(H, dh, d), g(H, dh, d), g(H, dh, d),
                                    g(H, dh, d), g(d, H, dh), mask="causal", **kw)
    return ta.Sequential([ta.Residual(at()), ta.Residual(at()), ta.Linear(rng.standard_normal((2, d)))])

SCALE = float(sys.argv[1]) if len(sys.argv) > 1 else 0.3
bias = len(sys.argv) > 2
for seed in range(4):
    rng = np.random.default_rng(100 + seed)
    a, b = model(rng, bias=bias), model(rng, bias=bias)
    t = time.time()
    aa, ab, bb = C.closure_triple(a, b, n_ctx=3)
    tc = time.time() - t
    kw = dict(n_ctx=3, n_samples=400_000, seed=0)
    maa, mab, mbb = (MC.montecarlo_inner(x, y, **kw) for x, y in ((a, a), (a, b), (b, b)))
    cs = ab / math.sqrt(aa * bb)
    ms = float(mab) / math.sqrt(float(maa) * float(mbb))
    print(f"seed {seed} bias={bias}: closure sim {cs:.4f}  MC sim {ms:.4f}  |err| {abs(cs-ms):.4f} | "
          f"<a,a> closure {aa:.4f} MC {float(maa):.4f}+-{maa.stderr:.4f} ratio {aa/float(maa):.3f} | "
          f"<a,b> closure {ab:.4f} MC {float(mab):.4f}+-{mab.stderr:.4f} | closure {tc:.1f}s", flush=True)
