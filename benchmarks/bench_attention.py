"""Benchmarks of the exact one-layer bilinear-attention inner product (not run in CI).

    python benchmarks/bench_attention.py            # small (seconds) and large (minutes)
    python benchmarks/bench_attention.py --only small

1. small: d_model = 8, n_ctx = 2, 2 heads, d_head = 4 (the research code's test transformer
   size; 1.45 s per warm pair there, target < 0.5 s): cold and warm (median of 5) exact inner
   product and similarity of a pair of residual attention models, with and without biases, and
   the Monte Carlo time to reach a standard error of 1e-2 relative (extrapolated by 1/sqrt(n)
   from 100 000 samples timed in the same run);
2. large: d_model = 64, n_ctx = 8, 4 heads, d_head = 16: the number of Wick configurations and
   the wall time of one exact inner product (no biases).
3. closure (``--only closure``): ``closure_similarity`` of a pair of two-layer attention-only
   models ``[Linear embed, Residual(attn), Residual(attn), Linear unembed]`` (no biases), this
   checkout against the implementation at commit 942dfb0 (one contraction per partial matching,
   full moments at every stage), each run in its own subprocess, interleaved, medians of cold
   and warm times and their ratio; the values must agree to 1e-10. The old code is imported from
   a ``git worktree`` at ``BASE`` (default /tmp/attn-base; created with ``git worktree add
   --detach /tmp/attn-base 942dfb0`` when missing). Then, for this checkout only: a 12 x 12
   closure similarity matrix (``ta.similarity_matrix(..., method="closure")``) and the
   contraction flop count (opt_einsum's path cost, nothing contracted) at the issue's target
   size d_model = 64, n_ctx = 8, 4 heads, d_head = 16.

4. mc (``--only mc``): radial Monte Carlo of sequence models, this checkout against ``--base``
   (interleaved subprocesses, medians): ``montecarlo_similarity`` of a one-layer pair (d_model
   8, n_ctx 4, 2 heads of 4, 20 000 directions) and ``montecarlo_inner`` of a two-layer pair
   (5 000 directions); the values must agree to 1e-12.

BLAS and torch run on one thread.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import tensoralg as ta  # noqa: E402

try:  # (an older checkout's child imports model() from here: its exact path is wick_terms)
    from tensoralg.strategies import sequence_exact as A
except ImportError:
    from tensoralg.strategies import wick_terms as A
from tensoralg.strategies import closure as C  # noqa: E402
from tensoralg.strategies import montecarlo as MC  # noqa: E402


def model(rng, d, H, dh, bias, residual=True):
    g = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])  # noqa: E731
    b = dict(q1_bias=g(H, dh), k1_bias=g(H, dh), q2_bias=g(H, dh), k2_bias=g(H, dh),
             v_bias=g(H, dh), o_bias=g(d)) if bias else {}
    layer = ta.BilinearAttention(g(H, dh, d), g(H, dh, d), g(H, dh, d), g(H, dh, d), g(H, dh, d),
                                 g(d, H, dh), **b)
    return ta.Residual(layer) if residual else layer


def timed(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def bench_small():
    print("== 1. d_model=8, n_ctx=2, 2 heads, d_head=4 (target: warm pair < 0.5 s) ==")
    rng = np.random.default_rng(0)
    for bias in (False, True):
        a, b = model(rng, 8, 2, 4, bias), model(rng, 8, 2, 4, bias)
        n_conf = A.count_configurations(a, b, 2)
        cold, val = timed(lambda: A.exact_inner(a, b, n_ctx=2), 1)
        warm, _ = timed(lambda: A.exact_inner(a, b, n_ctx=2), 5)
        warm_sim, sim = timed(lambda: A.exact_similarity(a, b, n_ctx=2), 3)
        t = time.perf_counter()
        mc = MC.montecarlo_inner(a, b, n_ctx=2, n_samples=100_000, seed=1)
        # time to reach a standard error of 1e-2 |value|, from the measured SE (1/sqrt(n))
        t_mc = (time.perf_counter() - t) * (mc.stderr / (1e-2 * abs(val))) ** 2
        print(f"biases={bias!s:5}  Wick configurations (matchings) {n_conf:6d}  inner {val:.6g}  "
              f"sim {sim:.4f}")
        print(f"   exact inner: cold {cold[0]:.2f} s, warm median {statistics.median(warm):.3f} s "
              f"(min {min(warm):.3f});  exact similarity (3 inner products) warm median "
              f"{statistics.median(warm_sim):.3f} s")
        print(f"   Monte Carlo to 1e-2 relative SE (extrapolated from n={mc.n_samples}): {t_mc:.1f} s ("
              f"z = {(float(mc) - val) / mc.stderr:+.2f});  ratio MC / exact warm = "
              f"{t_mc / statistics.median(warm):.1f}")


_CHILD_EXACT = r"""
import os, sys, json, time, statistics
for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
torch.set_num_threads(1)
try:  # this checkout, or an older one with the exact path in wick_terms or tensoralg.attention
    from tensoralg.strategies import sequence_exact as A
    A.exact_inner
except (ImportError, AttributeError):
    try:
        from tensoralg.strategies import wick_terms as A
    except ImportError:
        from tensoralg import attention as A
sys.path.insert(0, sys.argv[2])
from bench_attention import model
rng = np.random.default_rng(0)
a, b = model(rng, 8, 2, 4, False), model(rng, 8, 2, 4, False)
v = A.exact_inner(a, b, n_ctx=2)
ts = []
for _ in range(5):
    t = time.perf_counter(); A.exact_inner(a, b, n_ctx=2); ts.append(time.perf_counter() - t)
print(json.dumps(dict(value=float(v), warm=statistics.median(ts))))
"""


def _interleaved(child: str, base: str, repeat: int, rev: str) -> tuple[list, list]:
    """``child`` run ``repeat`` times in fresh subprocesses on this checkout and on ``rev``
    (a git worktree at ``base``, made when missing), interleaved: the JSON of their last lines,
    ``(new, old)``. The child gets the checkout's root and this folder as arguments."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if not os.path.isdir(base):
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", base, rev],
                       check=True)
    new, old = [], []
    for _ in range(repeat):
        for r, acc in ((base, old), (root, new)):
            out = subprocess.run([sys.executable, "-c", child, r, here], check=True,
                                 capture_output=True, text=True).stdout
            acc.append(json.loads(out.strip().splitlines()[-1]))
    return new, old


def bench_small_vs_base(base, repeat, rev="942dfb0"):
    """Warm exact pair (d_model=8, n_ctx=2, 2 heads, no biases), this checkout vs ``rev`` (checked
    out at ``base``), each in its own subprocess, interleaved; medians."""
    new, old = _interleaved(_CHILD_EXACT, base, repeat, rev)
    mn = statistics.median(x["warm"] for x in new)
    mo = statistics.median(x["warm"] for x in old)
    print(f"   exact warm pair, new vs {rev} (interleaved subprocesses, median of {repeat}): "
          f"{mn:.3f} s vs {mo:.3f} s, ratio old/new {mo / mn:.1f}; values agree to 1e-10: "
          f"{abs(new[0]['value'] - old[0]['value']) <= 1e-10 * abs(old[0]['value'])}")


_CHILD_MC = r"""
import os, sys, json, time, statistics
for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"
sys.path.insert(0, sys.argv[1])
import numpy as np
import tensoralg as ta
from tensoralg.strategies import montecarlo as MC  # noqa: E402
rng = np.random.default_rng(0)
def m(layers):
    g = lambda *s: rng.standard_normal(s) / np.sqrt(8)
    return ta.Sequential([ta.Residual(ta.BilinearAttention(*(g(2, 4, 8) for _ in range(5)),
                                                           g(8, 2, 4), mask="causal"))
                          for _ in range(layers)] + [ta.Linear(rng.standard_normal((4, 8)))])
a, b, c, e = m(1), m(1), m(2), m(2)
out = {}
for name, fn in (("similarity_1layer",
                  lambda: MC.montecarlo_similarity(a, b, n_ctx=4, n_samples=20_000, seed=1)),
                 ("inner_2layer",
                  lambda: MC.montecarlo_inner(c, e, n_ctx=4, n_samples=5_000, seed=1))):
    v = fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    out[name] = dict(value=float(v), stderr=float(v.stderr), seconds=statistics.median(ts))
print(json.dumps(out))
"""


def bench_mc_vs_base(base, repeat, rev):
    """Sequence Monte Carlo, this checkout vs ``rev`` at ``base`` (interleaved subprocesses)."""
    new, old = _interleaved(_CHILD_MC, base, repeat, rev)
    for name in new[0]:
        mn = statistics.median(x[name]["seconds"] for x in new)
        mo = statistics.median(x[name]["seconds"] for x in old)
        vn, vo = new[0][name]["value"], old[0][name]["value"]
        print(f"   Monte Carlo {name}: {mn:.3f} s vs {mo:.3f} s at {rev} (median of {repeat}), "
              f"ratio old/new {mo / mn:.2f}; values agree to 1e-12: "
              f"{abs(vn - vo) <= 1e-12 * abs(vo)}")


def bench_large():
    print("== 2. d_model=64, n_ctx=8, 4 heads, d_head=16 (report) ==")
    rng = np.random.default_rng(1)
    a, b = model(rng, 64, 4, 16, False), model(rng, 64, 4, 16, False)
    n_conf = A.count_configurations(a, b, 8)
    t = time.perf_counter()
    val = A.exact_inner(a, b, n_ctx=8)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    A.exact_inner(a, b, n_ctx=8)
    warm = time.perf_counter() - t
    print(f"no biases: {n_conf} matchings; exact inner {val:.6g}: cold {cold:.1f} s, warm {warm:.1f} s")


def two_layer(rng, d, H, dh):
    g = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])  # noqa: E731
    return ta.Sequential([ta.Linear(g(d, d)), model(rng, d, H, dh, False),
                          model(rng, d, H, dh, False), ta.Linear(g(d, d))])


# run in a subprocess: sys.argv = [root, d, n_ctx, H, d_head]; prints one JSON line
_CHILD = r"""
import os, sys, json, time
for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
torch.set_num_threads(1)
import tensoralg as ta
try:  # this checkout, or an older one with the closure in tensoralg.attention
    from tensoralg.strategies import closure as C
    C.closure_similarity
except (ImportError, AttributeError):
    from tensoralg import attention as C
    from tensoralg.strategies import montecarlo as MC
sys.path.insert(0, sys.argv[6])
from bench_attention import two_layer
d, n, H, dh = map(int, sys.argv[2:6])
rng = np.random.default_rng(0)
a, b = two_layer(rng, d, H, dh), two_layer(rng, d, H, dh)
c = two_layer(rng, d, H, dh)
t = time.perf_counter(); s = C.closure_similarity(a, b, n_ctx=n); cold = time.perf_counter() - t
# warm: a second, new pair of the same architecture (per-structure caches warm, no moments)
t = time.perf_counter(); C.closure_similarity(a, c, n_ctx=n); warm = time.perf_counter() - t
print(json.dumps(dict(sim=s, cold=cold, warm=warm)))
"""


def _child(root, size, timeout):
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, root, *map(str, size), here],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_closure(base, repeat, timeout, rev="942dfb0",
                  sizes=((3, 3, 1, 2), (4, 3, 2, 2), (8, 4, 2, 4))):
    print(f"== 3. closure_similarity, two-layer attention-only pair, new vs {rev} "
          f"(subprocesses, interleaved) ==")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(base):
        subprocess.run(["git", "-C", here, "worktree", "add", "--detach", base, rev],
                       check=True)
    for size in sizes:
        new, old = [], []
        for _ in range(repeat):
            old.append(_child(base, size, timeout))
            new.append(_child(here, size, timeout))
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        line = (f"d={size[0]} n_ctx={size[1]} heads={size[2]} d_head={size[3]}: new cold "
                f"{med(new, 'cold'):.2f} s, warm {med(new, 'warm'):.2f} s")
        if any(x is None for x in old):
            print(line + f"; old: did not finish within {timeout} s")
            continue
        agree = abs(new[0]["sim"] - old[0]["sim"]) <= 1e-10 * abs(old[0]["sim"])
        print(line + f"; old cold {med(old, 'cold'):.2f} s, warm {med(old, 'warm'):.2f} s; "
              f"ratio old/new cold {med(old, 'cold') / med(new, 'cold'):.1f}, warm "
              f"{med(old, 'warm') / med(new, 'warm'):.1f}; values agree to 1e-10: {agree}")


def bench_closure_matrix(size=(8, 4, 2, 4), n_models=12):
    import torch
    torch.set_num_threads(1)
    d, n, H, dh = size
    print(f"== 3b. closure similarity matrix of {n_models} two-layer models, d={d} n_ctx={n} "
          f"heads={H} d_head={dh} ==")
    rng = np.random.default_rng(2)
    models = [two_layer(rng, d, H, dh) for _ in range(n_models)]
    t = time.perf_counter()
    S = ta.similarity_matrix(models, n_ctx=n, method="closure")
    total = time.perf_counter() - t
    t = time.perf_counter()
    C.closure_similarity(models[0], models[1], n_ctx=n)
    pair = time.perf_counter() - t
    print(f"{n_models}x{n_models} matrix {total:.1f} s ({n_models * (n_models + 1) // 2} entries; "
          f"one closure_similarity pair {pair:.2f} s, i.e. {pair * n_models * (n_models - 1) / 2:.0f}"
          f" s for the pairs one by one); S[0, 1] = {S[0, 1]:.6f}")


def closure_flops(size=(64, 8, 4, 16), contract=False):
    """Sum of opt_einsum's path costs (flops) of the contractions ``closure_similarity`` does
    at ``size`` and their number. ``contract=False``: nothing is contracted; each result is an
    array of ones of the right shape, except the node means (output ``to``), which are zeros as
    they are exactly without biases -- so the same contractions are enumerated as in a real run
    (the covariances are products of the weights with these stand-in moments)."""
    import opt_einsum as oe
    d, n, H, dh = size
    rng = np.random.default_rng(0)
    a, b = two_layer(rng, d, H, dh), two_layer(rng, d, H, dh)
    total, count = [0], [0]
    real = C._ein

    def counting(sub, *ops, keep=None):
        if len(ops) > 1:
            total[0] += int(oe.contract_path(sub, *ops, optimize="greedy",
                                             shapes=False)[1].opt_cost)
            count[0] += 1
        if contract:
            return real(sub, *ops, keep=keep)
        lhs, out = sub.split("->")
        size = {}
        for lab, o in zip(lhs.split(","), ops):
            size.update(zip(lab, o.shape))
        return (np.zeros if out == "to" else np.ones)(tuple(size[x] for x in out))
    C._ein = counting
    try:
        t = time.perf_counter()
        C.closure_similarity(a, b, n_ctx=n)
        wall = time.perf_counter() - t
    finally:
        C._ein = real
    return total[0], count[0], wall


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["small", "large", "closure", "mc"])
    p.add_argument("--base", default="/tmp/attn-base",
                   help="checkout of the commit compared against (created with git worktree "
                        "from --rev when missing)")
    p.add_argument("--rev", default="942dfb0", help="commit compared against (default 942dfb0; "
                   "7fa40e8 for the session-3 executor)")
    p.add_argument("--sizes", default="3,3,1,2;4,3,2,2;8,4,2,4",
                   help="closure sizes d_model,n_ctx,heads,d_head separated by ';'")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds per subprocess (the old closure is slow)")
    args = p.parse_args()
    if args.only in (None, "small"):
        bench_small()
        bench_small_vs_base(args.base, args.repeat, args.rev)
    if args.only in (None, "mc"):
        bench_mc_vs_base(args.base, args.repeat, args.rev)
    if args.only in (None, "large"):
        bench_large()
    if args.only in (None, "closure"):
        sizes = tuple(tuple(int(x) for x in z.split(",")) for z in args.sizes.split(";"))
        bench_closure(args.base, args.repeat, args.timeout, args.rev, sizes)
        bench_closure_matrix()
        for size in ((8, 4, 2, 4), (64, 8, 4, 16)):
            if size[0] < 64:
                fl, cnt, wall = closure_flops(size, contract=True)
                print(f"d={size[0]} n_ctx={size[1]} heads={size[2]} d_head={size[3]}: {cnt} "
                      f"contractions, {fl / 1e9:.2f} GFlop (path cost), {wall:.1f} s measured")
            fl, cnt, wall = closure_flops(size)
            print(f"d={size[0]} n_ctx={size[1]} heads={size[2]} d_head={size[3]}: {cnt} "
                  f"contractions, {fl / 1e9:.1f} GFlop (path cost; counted without contracting "
                  f"in {wall:.0f} s)")


if __name__ == "__main__":
    main()
