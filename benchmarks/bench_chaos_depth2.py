"""Exact depth 2 through the chaos strategy (not run in CI): plan, time and peak RSS of one
similarity at realistic widths, each case in a fresh subprocess on one thread (torch and BLAS),
implementations interleaved, medians quoted.

    python benchmarks/bench_chaos_depth2.py                          # this checkout
    python benchmarks/bench_chaos_depth2.py --baseline /tmp/ta-base  # and an earlier one
    python benchmarks/bench_chaos_depth2.py --sizes 32x64,64x256 --rounds 3

Model: embed Linear(d_model -> d_model), Residual(Bilinear(d_model, H)) twice, Linear head
(d_model -> 10). A case runs only when its plan is within ``--max-gb`` (memory estimate) and
``--max-gflop``; otherwise only the plan is printed. Peak RSS is the child's ``ru_maxrss``
(includes the interpreter, numpy and torch: about 0.2-0.3 GB before any work).
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import numpy as np
from _timing import run_json

ROOT = Path(__file__).resolve().parent.parent

CODE = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1)
    except ImportError:
        pass
    import tensoralg as ta

    def bil(rng, d, H, O):
        g = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])
        return ta.Bilinear(g(H, d), g(H, d), g(O, H), g(H), g(H), g(O))

    def depth2(seed, dm, H, O=10):
        rng = np.random.default_rng(seed)
        return ta.Sequential([ta.Linear(rng.standard_normal((dm, dm)) / np.sqrt(dm)),
                              ta.Residual(bil(rng, dm, H, dm)), ta.Residual(bil(rng, dm, H, dm)),
                              ta.Linear(rng.standard_normal((O, dm)) / np.sqrt(dm))])

    dm, H, RUN, KW = DM, HH, RUNFLAG, KWARGS
    a, b = depth2(1, dm, H), depth2(2, dm, H)
    t0 = time.perf_counter()
    p = ta.plan(a, b, strategy="chaos", max_flops=1e16, max_memory=1e15)
    out = {"plan_s": time.perf_counter() - t0, "flops": p.chaos.flops,
           "mem_gb": p.memory_bytes / 2**30}
    if RUN:
        t0 = time.perf_counter()
        s = ta.similarity(a, b, strategy="chaos", max_flops=1e16, max_memory=1e15, **KW)
        out["t"] = time.perf_counter() - t0
        out["s"] = float(s)
        out["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(out))
""")


def run(src: Path, dm: int, H: int, do_run: bool, kw: str = "{}") -> dict:
    code = (CODE.replace("DM", str(dm)).replace("HH", str(H))
            .replace("RUNFLAG", str(do_run)).replace("KWARGS", kw))
    return run_json(code, src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, default=None,
                    help="checkout of an earlier tensoralg to compare with")
    ap.add_argument("--sizes", default="32x64,64x128,64x256,128x512",
                    help="comma-separated d_model x H (default 32x64,64x128,64x256,128x512)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--max-gb", type=float, default=8.0,
                    help="run only when the memory estimate is under this (default 8)")
    ap.add_argument("--max-gflop", type=float, default=2000.0,
                    help="run only when the FLOP estimate is under this many GFLOP "
                         "(default 2000)")
    args = ap.parse_args()
    impls = [("new", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    for size in args.sizes.split(","):
        dm, H = (int(x) for x in size.split("x"))
        plans = {name: run(src, dm, H, False) for name, src in impls}
        res: dict[str, list] = {name: [] for name, _ in impls}
        for _ in range(args.rounds):
            for name, src in impls:
                p = plans[name]
                ok = "error" not in p and p["mem_gb"] <= args.max_gb and \
                    p["flops"] <= args.max_gflop * 1e9
                if ok:
                    res[name].append(run(src, dm, H, True))
        print(f"== (d_model, H) = ({dm}, {H}) ==", flush=True)
        med = {}
        for name, _ in impls:
            p = plans[name]
            if "error" in p:
                print(f"  {name:<9} plan error: {p['error']}")
                continue
            line = (f"  {name:<9} plan {p['flops']:.3g} FLOPs, {p['mem_gb']:.3g} GB "
                    f"(planned in {p['plan_s'] * 1e3:.1f} ms)")
            good = [r for r in res[name] if "error" not in r]
            if good:
                med[name] = float(np.median([r["t"] for r in good]))
                line += (f"; similarity {med[name]:.3g} s (median of {len(good)}), peak RSS "
                         f"{max(r['rss_gb'] for r in good):.3g} GB, value {good[0]['s']:.15g}")
            elif res[name]:
                line += f"; error: {res[name][0]['error']}"
            else:
                line += "; not run (over --max-gb / --max-gflop)"
            print(line, flush=True)
        if len(med) == 2:
            print(f"  baseline / new: {med['baseline'] / med['new']:.1f}x", flush=True)


if __name__ == "__main__":
    main()
