"""A researcher's digits/MNIST model, exact at depth 2 (issue 22 item 5; not run in CI).

Model: embedding Linear(784 -> 64), Bilinear(64, H = 256) twice, Linear head (64 -> 10); two
independent random draws. Each run is a fresh subprocess on one thread (torch and BLAS);
implementations are interleaved and medians quoted. Peak RSS is the child's ``ru_maxrss``
(the interpreter, numpy and torch included: about 0.2-0.3 GB before any work).

    python benchmarks/bench_digits.py                              # this checkout
    python benchmarks/bench_digits.py --baseline /tmp/ta-before    # and an earlier checkout
    python benchmarks/bench_digits.py --montecarlo 4000            # and a Monte Carlo check

An earlier checkout: ``mkdir /tmp/ta-before && git archive c64f062 | tar -x -C /tmp/ta-before``
(it refuses under the default budget; it is run with ``max_flops=1e16``: about a minute and
7 GB).
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import numpy as np
from _timing import run_json

ROOT = Path(__file__).resolve().parent.parent

CODE = textwrap.dedent("""
    import json, resource, time
    import numpy as np
    import torch
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)
    import tensoralg as ta

    def digits(seed, H=HH):
        r = np.random.default_rng(seed)
        return ta.Sequential([
            ta.Linear(r.normal(size=(64, 784)) / 28),
            ta.Bilinear(r.normal(size=(H, 64)) / 8, r.normal(size=(H, 64)) / 8,
                        r.normal(size=(64, H)) / np.sqrt(H)),
            ta.Bilinear(r.normal(size=(H, 64)) / 8, r.normal(size=(H, 64)) / 8,
                        r.normal(size=(64, H)) / np.sqrt(H)),
            ta.Linear(r.normal(size=(10, 64)) / 8)])

    a, b = digits(1), digits(2)
    kw = {} if DEFAULT else {"max_flops": 1e16, "max_memory": 1e15}
    t0 = time.perf_counter()
    p = ta.plan(a, b, **kw)
    out = {"plan_s": time.perf_counter() - t0, "refused": p.refused, "flops": p.flops,
           "mem_gb": p.memory_bytes / 2**30, "summary": p.summary().splitlines()[-1]}
    if not p.refused:
        t0 = time.perf_counter()
        out["s"] = float(ta.similarity(a, b, **kw))
        out["t"] = time.perf_counter() - t0
        out["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if MC:
        t0 = time.perf_counter()
        m = ta.similarity(a, b, method="montecarlo", n_samples=MC, seed=0)
        out["mc"] = [float(m), float(m.stderr), bool(m.diagnostics.reliable)]
        out["mc_t"] = time.perf_counter() - t0
    print(json.dumps(out))
""")


def run(src: Path, default: bool, mc: int, H: int) -> dict:
    code = (CODE.replace("DEFAULT", str(default)).replace("MC", str(mc))
            .replace("HH", str(H)))
    return run_json(code, src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, default=None,
                    help="checkout of an earlier tensoralg (run with the budget raised)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--hidden", type=int, default=256, help="H of both layers (default 256)")
    ap.add_argument("--montecarlo", type=int, default=0, metavar="N",
                    help="also estimate the similarity from N directions (first round)")
    args = ap.parse_args()
    impls = [("new", ROOT, True)] + ([("baseline", args.baseline, False)]
                                      if args.baseline else [])
    res: dict[str, list] = {name: [] for name, _, _ in impls}
    for k in range(args.rounds):
        for name, src, default in impls:
            res[name].append(run(src, default, args.montecarlo if k == 0 and name == "new"
                                 else 0, args.hidden))
    med = {}
    for name, _, default in impls:
        rs = res[name]
        bad = [r for r in rs if "error" in r]
        if bad:
            print(f"{name:<9} error: {bad[0]['error']}")
            continue
        r0 = rs[0]
        print(f"{name:<9} {'default budget' if default else 'budget raised'}: "
              f"{r0['summary']}")
        if r0["refused"]:
            continue
        med[name] = float(np.median([r["t"] for r in rs]))
        print(f"{'':<9} similarity {r0['s']:.15g} in {med[name]:.3g} s (median of {len(rs)}), "
              f"peak RSS {max(r['rss_gb'] for r in rs):.3g} GB")
        if "mc" in r0:
            v, se, ok = r0["mc"]
            print(f"{'':<9} Monte Carlo {v:.4f} +- {se:.4f} ({'reliable' if ok else 'NOT reliable'}"
                  f", {r0['mc_t']:.3g} s): z = {(v - r0['s']) / se:+.2f}")
    if len(med) == 2:
        print(f"baseline / new: {med['baseline'] / med['new']:.1f}x")


if __name__ == "__main__":
    main()
