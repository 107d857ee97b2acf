"""Engine v2 benchmarks (not run in CI): the planner's choice against the Wick strategy, against
an earlier checkout of tensoralg (``--baseline DIR``, e.g. a ``git worktree`` of the commit
before engine v2), and against the FLOP estimate. One thread (torch and BLAS); each measurement
runs in a fresh subprocess, the implementations interleaved, and medians are quoted (wall
time, and the calling thread's CPU time, which a loaded machine inflates less).

    git worktree add /tmp/ta-baseline 15ea9a9
    python benchmarks/bench_engine.py --baseline /tmp/ta-baseline          # all cases
    python benchmarks/bench_engine.py --only first,matrix --reps 5
    python benchmarks/bench_engine.py --only matrix1000                     # N = 1000, new only

Cases (issue 8's targets): ``first`` — one bilinear layer (embed 64->64, H=256, head 10),
similarity of a warm pair (the same two model objects every call: from the second call on their
prepared stacks and chaos coefficients come from ``tensoralg.prepare.PREPARED``, validated
against the weights); ``first_cold`` — the same architecture, a new pair of models (new weights)
every call, so nothing is reused; ``image`` — behind an image embedding (784->128, H=512, head 10),
time and peak memory; ``matrix`` — 50x50 similarity matrix of the first model;
``matrix1000`` — 1000x1000; ``depth2`` — embed, two residual bilinear layers, head 10 at
(d_model, H) = (32, 64), (64, 128), (64, 256) (plan, then a run when the plan is under
``--max-seconds`` at 1 GFLOP/s), and (128, 512) planned only; ``closure`` — the first pair;
``closure_cold`` — a new pair every call. The depth-2 lines give the planner's time
(``plan_s``, paths not cached on disk only when ``TENSORALG_CACHE_DIR=""``) and, when Wick was
not planned in full, the lower bound on its FLOPs that decided it (``wick_flops_at_least``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

SETUP = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    import torch
    torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1)
    except ImportError:
        pass
    import tensoralg as ta

    def bil(rng, d, H, O):
        g = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])
        return ta.Bilinear(g(H, d), g(H, d), g(O, H), g(H), g(H), g(O))

    def one_layer(seed, din, dm, H, O):
        rng = np.random.default_rng(seed)
        return ta.Sequential([ta.Linear(rng.standard_normal((dm, din)) / np.sqrt(din)),
                              bil(rng, dm, H, dm),
                              ta.Linear(rng.standard_normal((O, dm)) / np.sqrt(dm))])

    def depth2(seed, dm, H, O=10):
        rng = np.random.default_rng(seed)
        return ta.Sequential([ta.Linear(rng.standard_normal((dm, dm)) / np.sqrt(dm)),
                              ta.Residual(bil(rng, dm, H, dm)), ta.Residual(bil(rng, dm, H, dm)),
                              ta.Linear(rng.standard_normal((O, dm)) / np.sqrt(dm))])

    CPU = []

    def timed(fn, reps):
        fn()  # warm: paths found once per topology, as in real use
        ts = []
        for _ in range(reps):
            c = time.thread_time()
            t = time.perf_counter(); out = fn(); ts.append(time.perf_counter() - t)
            CPU.append(time.thread_time() - c)
        return float(np.median(ts)), out
""")

CASES = {
    "first": """
        a, b = one_layer(1, 64, 64, 256, 10), one_layer(2, 64, 64, 256, 10)
        t, s = timed(lambda: ta.similarity(a, b, **KW), REPS)
    """,
    "first_cold": """
        pairs = [(one_layer(2 * i + 1, 64, 64, 256, 10), one_layer(2 * i + 2, 64, 64, 256, 10))
                 for i in range(REPS + 1)]
        it = iter(pairs)
        t, s = timed(lambda: (lambda p: ta.similarity(p[0], p[1], **KW))(next(it)), REPS)
    """,
    "closure_cold": """
        pairs = [(one_layer(2 * i + 1, 64, 64, 256, 10), one_layer(2 * i + 2, 64, 64, 256, 10))
                 for i in range(REPS + 1)]
        it = iter(pairs)
        t, s = timed(lambda: (lambda p: ta.similarity(p[0], p[1], method="closure"))(next(it)),
                     REPS)
    """,
    "image": """
        a, b = one_layer(1, 784, 128, 512, 10), one_layer(2, 784, 128, 512, 10)
        t, s = timed(lambda: ta.similarity(a, b, **KW), REPS)
    """,
    "matrix": """
        ms = [one_layer(i, 64, 64, 256, 10) for i in range(50)]
        t, S = timed(lambda: ta.similarity_matrix(ms, **KW), REPS)
        s = float(S[0, 1])
    """,
    "matrix1000": """
        ms = [one_layer(i, 64, 64, 256, 10) for i in range(1000)]
        t, S = timed(lambda: ta.similarity_matrix(ms, **KW), 1)
        s = float(S[0, 1])
    """,
    "closure": """
        a, b = one_layer(1, 64, 64, 256, 10), one_layer(2, 64, 64, 256, 10)
        t, s = timed(lambda: ta.similarity(a, b, method="closure"), REPS)
    """,
}


def run(src: Path, case: str, kw: str, reps: int) -> dict:
    code = SETUP + f"\nKW = {kw}\nREPS = {reps}\n" + textwrap.dedent(CASES[case]) + \
        "\nprint(json.dumps({'t': t, 's': float(s), 'cpu': float(np.median(CPU)), " \
        "'peak_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n"
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TENSORALG_CACHE_DIR="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=str(src))
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(case: str, baseline: Path | None, reps: int, rounds: int,
            before: Path | None = None) -> None:
    impls = [("auto", ROOT, "{}"), ("wick", ROOT, "{'strategy': 'wick'}")]
    if case in ("closure", "closure_cold"):
        impls = [("closure", ROOT, "{}")]
    if case == "matrix1000":
        impls = [("auto", ROOT, "{}")]
    if baseline is not None and case != "matrix1000":
        impls.append(("baseline", baseline, "{}"))
    if before is not None:  # another checkout run with this one's default options
        impls.append(("before", before, "{}"))
    res: dict[str, list] = {name: [] for name, _, _ in impls}
    for _ in range(rounds):  # interleaved
        for name, src, kw in impls:
            res[name].append(run(src, case, kw, reps))
    print(f"== {case} ==")
    med, cpu = {}, {}
    for name, rs in res.items():
        good = [r for r in rs if "error" not in r]
        if not good:
            print(f"  {name:<9} error: {rs[0]['error']}")
            continue
        med[name] = float(np.median([r["t"] for r in good]))
        cpu[name] = float(np.median([r["cpu"] for r in good]))
        peak = max(r["peak_mb"] for r in good)
        print(f"  {name:<9} {med[name] * 1e3:10.2f} ms  (thread CPU {cpu[name] * 1e3:9.2f} ms)   "
              f"peak RSS {peak:8.1f} MB   value {good[0]['s']:.15g}")
    def ratio(num, den):
        return (f"  {num} / {den}: {med[num] / med[den]:.1f}x wall, "
                f"{cpu[num] / cpu[den]:.1f}x thread CPU")

    if "baseline" in med:
        for name in med:
            if name != "baseline":
                print(ratio("baseline", name))
    if "before" in med:
        for name in med:
            if name not in ("before", "baseline"):
                print(ratio("before", name))
    if "wick" in med and "auto" in med:
        print(ratio("wick", "auto"))


def depth2(max_seconds: float) -> None:
    code = SETUP + textwrap.dedent("""
        for dm, H in [(32, 64), (64, 128), (64, 256), (128, 512)]:
            a, b = depth2(1, dm, H), depth2(2, dm, H)
            t0 = time.perf_counter()
            p = ta.plan(a, b, max_flops=1e16, max_memory=1e15)
            tp = time.perf_counter() - t0
            line = {"dm": dm, "H": H, "plan_s": tp, "choice": p.strategy,
                    "wick_flops": p.wick.flops if p.wick else None,
                    "wick_flops_at_least": p.wick_lower_bound,
                    "chaos_flops": p.chaos.flops, "chaos_mem_gb": p.chaos.memory_elements * 8 / 2**30,
                    "wick_mem_gb": (p.wick.memory_bytes(8) / 2**30) if p.wick else None}
            best = min(x for x in (line["wick_flops"], line["chaos_flops"]) if x)
            if best / 1e9 <= MAXS:
                t0 = time.perf_counter()
                s = ta.similarity(a, b, max_flops=1e16)
                line["similarity_s"] = time.perf_counter() - t0
                line["similarity"] = float(s)
            print(json.dumps(line), flush=True)
    """).replace("MAXS", str(max_seconds))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print("== depth 2 (embed, two residual bilinear layers, head 10) ==")
    subprocess.run([sys.executable, "-c", code], env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, default=None,
                    help="checkout of an earlier tensoralg to compare with (default: none)")
    ap.add_argument("--before", type=Path, default=None,
                    help="a second checkout measured alongside with default options (label "
                         "'before'; e.g. the commit before a change; default: none)")
    ap.add_argument("--only", default="first,first_cold,image,matrix,closure,closure_cold,depth2",
                    help="comma-separated cases (default: first,first_cold,image,matrix,closure,"
                         "closure_cold,depth2; also matrix1000)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per subprocess (default 5)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved subprocess rounds per implementation (default 3)")
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="run a depth-2 similarity only when its plan is under this many "
                         "seconds at 1 GFLOP/s (default 120)")
    args = ap.parse_args()
    for case in args.only.split(","):
        if case == "depth2":
            depth2(args.max_seconds)
        else:
            compare(case, args.baseline, args.reps, args.rounds, args.before)


if __name__ == "__main__":
    main()
