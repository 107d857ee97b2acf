"""Monte Carlo verdicts against exact truth: how often an estimate labelled reliable lies
beyond 3 standard errors, and how often one is labelled reliable at all (the power), for plain
radial sampling (``proposal="radial"``, cross-checked against the guided estimate) and guided
sampling (``proposal="modes"``), on held-out families of models built to fool them.

Truth comes from tensor-product Gauss-Hermite quadrature on the forward pass
(``tensoralg.verify.quadrature``, independent of the samplers): on the planted models
(every read and write along one direction, so the model depends on ``n_ctx`` Gaussian
variables) and on small models whose whole input has ``n_ctx * d <= 4`` variables.

    python benchmarks/mc_verdicts.py --seeds 200 --n-samples 1000 --workers 2 --out runs/mc_verdicts.jsonl
    python benchmarks/mc_verdicts.py --table runs/mc_verdicts.jsonl

The families (none of them tuned on: the rates are measured, not fitted):
  planted-attn-L2-s{0.3,0.5,0.8}: ``tensoralg.verify.planted.planted_attention(16, 2, scale=s)``, two
      residual bilinear-attention layers, d = 16, n_ctx = 2 (seeds 1 and 2 for a and b);
  planted-attn-L1-s1.0: the same with one layer;
  planted-mlp-D3-s0.6: ``planted_bilinear(32, depth=3)`` (a vector model of degree 8);
  random-attn-s{0.3,0.5,1.0,1.5}: two residual bilinear-attention layers with Gaussian weights
      times s, d = 2, n_ctx = 2 (the last with query/key biases);
  amplified-s0.5: random-attn at s = 0.5 behind an embedding that multiplies one token
      direction by 3 (a trained-like model: the norm sits where that direction is large);
  planted-attn-L2-ctx3-s0.3: the planted two-layer model at n_ctx = 3, small scale;
  twodir-attn-s0.3: a planted model with two directions (``_two_directions``; 4 variables);
  hidden-needle-s0.8: the planted two-layer needle beside a wide linear readout of the other
      15 directions (``tensoralg.verify.planted.hidden_needle``; truth: quadrature on v's
      slice plus the exact linear part).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

import numpy as np


def _random_attn(seed, d=2, scale=0.5, n_layers=2, bias=False, gain=None):
    import tensoralg as ta

    g = np.random.default_rng(seed).standard_normal
    layers = []
    if gain is not None:
        v = np.ones(d) / math.sqrt(d)
        layers.append(ta.Linear(np.eye(d) + (gain - 1) * np.outer(v, v)))
    for _ in range(n_layers):
        w = {k: scale * g((1, 1, d)) for k in ("q1", "k1", "q2", "k2")}
        w["v"] = scale * g((1, d, d))
        w["o"] = scale * g((d, 1, d))
        if bias:
            for k in ("q1", "k1", "q2", "k2"):
                w[k + "_bias"] = scale * g((1, 1))
        layers.append(ta.Residual(ta.BilinearAttention(**w)))
    layers.append(ta.Linear(g((1, d))))
    return ta.Sequential(layers)


def models():
    """``{name: (a, b, n_ctx, slice_basis_fn)}``."""
    from tensoralg.verify.planted import hidden_needle, planted_attention, planted_bilinear

    out = {}
    for s in (0.3, 0.5, 0.8):
        a, b = planted_attention(16, 2, scale=s, seed=1), planted_attention(16, 2, scale=s, seed=2)
        out[f"planted-attn-L2-s{s}"] = (a.network, b.network, 2, a.slice())
    a, b = (planted_attention(16, 2, scale=1.0, seed=k, n_layers=1) for k in (1, 2))
    out["planted-attn-L1-s1.0"] = (a.network, b.network, 2, a.slice())
    a, b = (planted_bilinear(32, depth=3, scale=0.6, seed=k) for k in (1, 2))
    out["planted-mlp-D3-s0.6"] = (a.network, b.network, None, a.slice())
    from tensoralg.verify.quadrature import GaussianSlice

    full = GaussianSlice.from_basis(np.eye(2), d=2, n_ctx=2)
    for s, bias in ((0.3, False), (0.5, False), (1.0, False), (1.5, True)):
        out[f"random-attn-s{s}"] = (_random_attn(11, scale=s, bias=bias),
                                    _random_attn(12, scale=s, bias=bias), 2, full)
    out["amplified-s0.5"] = (_random_attn(21, scale=0.5, gain=3.0),
                             _random_attn(22, scale=0.5, gain=3.0), 2, full)
    a, b = planted_attention(16, 3, scale=0.3, seed=1), planted_attention(16, 3, scale=0.3, seed=2)
    out["planted-attn-L2-ctx3-s0.3"] = (a.network, b.network, 3, a.slice())
    a, sl = _two_directions(1, 0.3)
    out["twodir-attn-s0.3"] = (a, _two_directions(2, 0.3)[0], 2, sl)
    ha, hb = hidden_needle(1), hidden_needle(2)
    out["hidden-needle-s0.8"] = (ha[0], hb[0], 2, (ha, hb))
    return out


def truth_hidden_needle(a, b):
    """Truth of the hidden-needle pair: quadrature on the v-slice plus the readouts' exact part
    orthogonal to v, ``n_ctx tr(W_a P W_b^T)`` (uncorrelated with the rest: linear and odd in
    Gaussian coordinates independent of v's)."""
    from tensoralg.verify.quadrature import quadrature_similarity

    (na, Wa, v, sl), (nb, Wb, _, _) = a, b
    P = np.eye(v.size) - np.outer(v, v)
    q = quadrature_similarity(na, nb, sl, n_ctx=2)
    aa, bb = q.aa + 2 * np.trace(Wa @ P @ Wa.T), q.bb + 2 * np.trace(Wb @ P @ Wb.T)
    ab = q.ab + 2 * np.trace(Wa @ P @ Wb.T)
    return {"sim": float(ab / np.sqrt(aa * bb)), "<a,a>": float(aa), "<b,b>": float(bb),
            "<a,b>": float(ab)}


def _two_directions(seed, s, d=16):
    """Two residual bilinear-attention layers with biases, d = 16, n_ctx = 2: layer 1 reads
    ``v1`` and writes ``v2``, layer 2 reads and writes ``v2``, the head reads both (so the
    model depends on 4 Gaussian variables, and its norm sits where one token is large along
    ``v2``'s chain: a planted model with two directions)."""
    from tensoralg.verify.quadrature import GaussianSlice

    import tensoralg as ta

    Q, _ = np.linalg.qr(np.random.default_rng(99).standard_normal((d, 2)))
    v1, v2 = Q[:, 0], Q[:, 1]
    g = np.random.default_rng(seed).standard_normal

    def attn(vin, vout):
        w = {k: s * g((2, 2, 1)) * vin for k in ("q1", "k1", "q2", "k2")}
        w["v"] = s * g((2, 1, 1)) * vin
        b = {f"{k}_bias": g((2, 2)) for k in ("q1", "k1", "q2", "k2")}
        b["v_bias"] = g((2, 1))
        w["o"] = vout[:, None, None] * g((1, 2, 1)) / s
        b["o_bias"] = g() * vout / s
        return ta.Residual(ta.BilinearAttention(**w, **b))

    l1 = attn(v1, v2)
    l2 = attn(v2, v2)
    head = s * (g() * v1 + g() * v2)[None, :]
    net = ta.Sequential([l1, l2, ta.Linear(head, g(1))])
    return net, GaussianSlice.from_basis(np.stack([v1, v2]), d=d, n_ctx=2)


def truth(name, a, b, n_ctx, sl):
    from tensoralg.verify.quadrature import quadrature_similarity

    if name.startswith("hidden-needle"):
        return truth_hidden_needle(*sl)

    q = quadrature_similarity(a, b, sl, n_ctx=n_ctx) if n_ctx else \
        quadrature_similarity(a, b, sl)
    return {"sim": float(q), "<a,a>": float(q.aa), "<b,b>": float(q.bb), "<a,b>": float(q.ab)}


def one(task):
    name, seed, n = task
    import torch

    import tensoralg as ta

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    a, b, n_ctx, _ = MODELS[name]
    kw = dict(method="montecarlo", n_samples=n, seed=seed)
    if n_ctx:
        kw["n_ctx"] = n_ctx
    rows = []
    t0 = time.process_time()
    ps = ta.similarity(a, b, **kw)
    pb = ta.inner(b, b, **kw)
    gs = ta.similarity(a, b, proposal="modes", **kw)
    for est, q, e in ((ps, "sim", "plain"), (pb, "<b,b>", "plain"), (gs, "sim", "guided")):
        rows.append((q, e, est))
    for k, v in gs.inner_products.items():
        rows.append((k, "guided", v))
    out = []
    for q, e, est in rows:
        t = TRUTH[name][q]
        d = est.diagnostics
        out.append({"model": name, "seed": seed, "n": n, "quantity": q, "estimator": e,
                    "value": float(est), "stderr": est.stderr, "reliable": bool(est.reliable),
                    "exact": bool(d.exact), "truth": t,
                    "z": (float(est) - t) / est.stderr if est.stderr > 0 else
                    (0.0 if float(est) == t else math.inf),
                    # the guided standard error's widening for skewness, so the sample
                    # standard error's rate can be tabulated from the same run
                    "skew_factor": d.skew_factor,
                    # the plain verdict's parts, so another MC_SPREAD_RATIO can be tabulated
                    "spread_ratio": d.spread_ratio,
                    "cross_z": None if d.cross_check is None else d.cross_check[2],
                    "reliable_but_spread": bool(d.reliable) or all(
                        x.startswith("the guided samples put the variance")
                        for x in d.reason.split("; "))})
    out[0]["cpu_s"] = time.process_time() - t0
    return out


def table(*paths):
    """The table of a run: per model, quantity and estimator, the seeds, the results labelled
    reliable (the power), those of them beyond 3 SE of the truth, and the mean z over ALL seeds
    with its standard error (the bias of the estimator, verdict or not)."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(x) for x in f]
    keys = sorted({(r["model"], r["quantity"], r["estimator"]) for r in rows})
    print("| model | quantity | estimator | seeds | reliable (power) | reliable beyond 3 SE | "
          "mean z, all seeds | mean relative error, all seeds |")
    print("|---|---|---|---|---|---|---|---|")
    tot = {"plain": [0, 0, 0], "guided": [0, 0, 0]}
    for m, q, e in keys:
        sel = [r for r in rows if (r["model"], r["quantity"], r["estimator"]) == (m, q, e)]
        rel = [r for r in sel if r["reliable"]]
        bad = [r for r in rel if abs(r["z"]) > 3]
        tot[e][0] += len(sel)
        tot[e][1] += len(rel)
        tot[e][2] += len(bad)
        z = np.array([r["z"] for r in sel if math.isfinite(r["z"])])
        mz = f"{z.mean():+.2f} ± {z.std(ddof=1) / math.sqrt(z.size):.2f}" if z.size > 1 else "-"
        # the bias of the value itself: a skewed but unbiased estimator has mean z < 0 (a
        # sample that misses the tail is low AND has a small standard error) and mean
        # relative error 0
        re = np.array([(r["value"] - r["truth"]) / abs(r["truth"]) for r in sel
                       if r["truth"] != 0 and math.isfinite(r["value"])])
        mre = f"{re.mean():+.4f} ± {re.std(ddof=1) / math.sqrt(re.size):.4f}" \
            if re.size > 1 else "-"
        print(f"| {m} | {q} | {e} | {len(sel)} | {len(rel)} ({len(rel) / len(sel):.0%}) | "
              f"{len(bad)} ({len(bad) / max(1, len(rel)):.1%}) | {mz} | {mre} |")
    for e, (n, r, b) in tot.items():
        print(f"{e}: {n} results, {r} labelled reliable ({r / max(1, n):.0%}), {b} of those "
              f"beyond 3 SE ({b / max(1, r):.2%})")
    raw = [r for r in rows if r["estimator"] == "guided" and r["reliable"]
           and "skew_factor" in r]
    if raw:
        b = sum(abs(r["z"]) * r["skew_factor"] > 3 for r in raw)
        print(f"guided with the sample standard error (not widened for skewness): {b} of "
              f"{len(raw)} beyond 3 SE ({b / len(raw):.2%}); widening factor median "
              f"{np.median([r['skew_factor'] for r in raw]):.3g}, largest "
              f"{max(r['skew_factor'] for r in raw):.3g}")
    print()
    print("Per family (every quantity of an estimator pooled; the bound is the one-sided 95 % "
          "Clopper-Pearson upper bound on the rate of reliable results beyond 3 SE):")
    print()
    print("| model | estimator | seeds | results | reliable (power) | reliable beyond 3 SE | "
          "95 % upper bound |")
    print("|---|---|---|---|---|---|---|")
    from scipy.stats import beta

    for m in sorted({r["model"] for r in rows}):
        for e in ("plain", "guided"):
            sel = [r for r in rows if r["model"] == m and r["estimator"] == e]
            if not sel:
                continue
            rel = [r for r in sel if r["reliable"]]
            bad = sum(abs(r["z"]) > 3 for r in rel)
            ub = "-" if not rel else f"{float(beta.ppf(0.95, bad + 1, len(rel) - bad)):.1%}" \
                if len(rel) > bad else "100%"
            print(f"| {m} | {e} | {len({r['seed'] for r in sel})} | {len(sel)} | "
                  f"{len(rel)} ({len(rel) / len(sel):.0%}) | {bad} "
                  f"({bad / max(1, len(rel)):.1%}) | {ub} |")


MODELS = None
TRUTH = None


def _init():
    global MODELS, TRUTH
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    MODELS = models()
    TRUTH = {k: truth(k, *v) for k, v in MODELS.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--n-samples", type=int, default=1000)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--only", default=None, help="comma-separated model names")
    p.add_argument("--out", default="runs/mc_verdicts.jsonl")
    p.add_argument("--table", default=None, nargs="+",
                   help="print the table of finished runs (their rows pooled)")
    args = p.parse_args(argv)
    if args.table:
        table(*args.table)
        return
    _init()
    names = list(MODELS) if args.only is None else args.only.split(",")
    for k in names:
        print(k, TRUTH[k], flush=True)
    tasks = [(k, s, args.n_samples) for s in range(args.first_seed, args.first_seed + args.seeds)
             for k in names]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        if args.workers > 1:
            import multiprocessing as mp

            with mp.get_context("fork").Pool(args.workers) as pool:
                for res in pool.imap_unordered(one, tasks):
                    f.write("".join(json.dumps(r) + "\n" for r in res))
                    f.flush()
        else:
            for t in tasks:
                f.write("".join(json.dumps(r) + "\n" for r in one(t)))
                f.flush()
    table(args.out)


if __name__ == "__main__":
    sys.exit(main())
