"""The exact attention path's speed (not run in CI): the ``S<=5`` similarity of two-layer
bilinear-attention checkpoints (the exact one-attention-layer path, ``tensoralg.degree``), one
lone pair (``ta.degree_similarity``) and a matrix (``ta.degree_similarity_matrix``), each in a
fresh interpreter on one thread, interleaved with the same measurement on an older checkout;
FLOPs executed (the path cost of every contraction run, as the dry-run estimate counts them),
GFLOP/s, and the machine's one-thread dgemm rate next to them.

    python benchmarks/bench_attention_exact.py                       # 4 checkpoints, vs 825e744
    python benchmarks/bench_attention_exact.py --models 32 --against none
    python benchmarks/bench_attention_exact.py --against /path/to/checkout --rounds 2

Models: bench_deep's (``Sequential([Residual(BilinearAttention) x 2, Linear])``, no biases,
random weights and a checkpoint-like drift) at ``--size`` (d_model, n_ctx, heads, d_head).
``--against REV``: a git revision extracted with ``git archive`` into a temporary folder (or
a checkout's path; ``none``: this checkout only). The machine's load (``os.getloadavg``) is
printed with every row: CPU seconds on a shared machine are inflated by its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_of, run_json

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, time, numpy as np, torch
from threadpoolctl import threadpool_limits
torch.set_num_threads(1); threadpool_limits(1)
import tensoralg as ta
from tensoralg.strategies import executor
d, n_ctx, heads, dh = {size}
N, what = {models}, {what!r}
rng = np.random.default_rng(0)
names = ("q1", "k1", "q2", "k2", "v")
def draw():
    w = {{k: rng.standard_normal((2, heads, dh, d)) / np.sqrt(d) for k in names}}
    w["o"] = rng.standard_normal((2, d, heads, dh)) / np.sqrt(heads * dh)
    w["u"] = rng.standard_normal((d, d)) / np.sqrt(d)
    return w
base, drift = draw(), draw()
def model(i):
    t = 0.1 * i / N
    w = {{k: base[k] + t * drift[k] for k in base}}
    layers = [ta.Residual(ta.BilinearAttention(*(w[k][j] for k in names), w["o"][j]))
              for j in range(2)]
    return ta.Sequential(layers + [ta.Linear(w["u"])])
models = [model(i) for i in range(N)]
flops = [0.0]
call = executor.Plan.__call__
def counted(self, *ops, **kw):
    flops[0] += self.flops
    return call(self, *ops, **kw)
executor.Plan.__call__ = counted
c0, w0 = time.process_time(), time.perf_counter()
if what == "pair":
    r = ta.degree_similarity(models[0], models[-1], n_ctx=n_ctx, max_degree=5)
    value = float(r[5])
else:
    value = float(ta.degree_similarity_matrix(models, n_ctx=n_ctx, max_degree=5)[5][0, -1])
print(json.dumps({{"cpu": time.process_time() - c0, "wall": time.perf_counter() - w0,
                   "flops": flops[0], "value": value}}))
"""


def dgemm_rate(n: int = 1000) -> float:
    """One-thread GFLOP/s of a float64 ``n x n`` matrix product (``2 n^3`` FLOPs; best of 5)."""
    from threadpoolctl import threadpool_limits

    a, b = np.random.default_rng(0).standard_normal((2, n, n))
    with threadpool_limits(1):
        t, _ = best_of(lambda: a @ b, 5)
    return 2 * n ** 3 / t / 1e9


def checkout(rev: str) -> Path | None:
    if rev == "none":
        return None
    if Path(rev).is_dir():
        return Path(rev)
    tmp = Path(tempfile.mkdtemp(prefix="tensoralg-"))
    data = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    tar = tmp / "src.tar"
    tar.write_bytes(data)
    with tarfile.open(tar) as t:
        t.extractall(tmp / "src", filter="data")
    return tmp / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=4, help="checkpoints in the matrix (4)")
    ap.add_argument("--size", default="64,8,4,16", help="d_model,n_ctx,heads,d_head")
    ap.add_argument("--against", default="825e744",
                    help="git revision or checkout to compare with ('none': skip)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (1)")
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.split(","))
    srcs = [("this checkout", ROOT)]
    old = checkout(args.against)
    if old is not None:
        srcs.insert(0, (args.against, old))
    rate = dgemm_rate()
    print(f"one-thread dgemm (1000 x 1000 float64): {rate:.1f} GFLOP/s; load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; size (d_model, n_ctx, heads, "
          f"d_head) = {size}")
    n_pairs = args.models * (args.models + 1) // 2
    for rnd in range(args.rounds):
        for what, m in (("pair", 2), ("matrix", args.models)):
            for name, src in srcs:
                load = os.getloadavg()[0]
                out = run_json(CHILD.format(size=size, models=m, what=what), src)
                if "error" in out:
                    print(f"  {what:6s} {name}: {out['error']}")
                    continue
                per = out["cpu"] if what == "pair" else out["cpu"] / n_pairs
                gfs = out["flops"] / out["cpu"] / 1e9
                label = "lone S<=5 pair" if what == "pair" else \
                    f"{args.models}-checkpoint matrix ({n_pairs} pairs)"
                print(f"  [{rnd}] {label:34s} {name:14s} {out['cpu']:8.2f} s CPU "
                      f"({per:.3f} s a pair) {out['flops'] / 1e9:7.2f} GFLOP "
                      f"{gfs:5.1f} GFLOP/s ({100 * gfs / rate:3.0f} % of dgemm) "
                      f"value {out['value']:.15f}  load {load:.1f}")
    print(json.dumps({"dgemm_gflops": rate}))


if __name__ == "__main__":
    main()
