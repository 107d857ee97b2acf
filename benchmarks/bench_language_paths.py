"""Which first-order path carries each interval of the language audit's default run (not run
in CI): `python benchmarks/bench_language_paths.py [--metrics heldout,residual] [--quick]`.

Trains the audit's default model exactly as ``tensoralg audit language`` does (same corpus,
seed, configuration and log-spaced checkpoints; ``--quick``: the quick configuration), then for
every consecutive interval runs ``tensoralg.decompose.transition_paths`` on the pair's networks
under each metric (`tensoralg.audit.language_degree.pair_networks`, as the audit does on its
sharpest intervals): ``1 - S<=5`` of the interval (exact: the sum of the first-order paths of a
bias-free stack is ``f_<=5``), each path's similarity, shares and own change, and the verdict of
the declared rule. Prints one JSON line per interval, then the three sharpest intervals per
metric, and the CPU seconds per transition. Skips the audit's ``S<=5`` matrices over all pairs,
``S<=9`` and the guided Monte Carlo, so it runs in minutes where the default audit takes ~10 min
of CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", default="heldout,residual",
                    help="comma-separated of residual, vocab, heldout (default heldout,residual)")
    ap.add_argument("--quick", action="store_true", help="the audit's --quick configuration")
    args = ap.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import tensoralg as ta
    from tensoralg.audit.grokking import log_schedule
    from tensoralg.audit.language import LanguageConfig, make_model, train_language_model
    from tensoralg.audit.language_degree import heldout_factor, metric_factor, pair_networks
    from tensoralg.corpus import VOCAB, load_corpus
    from tensoralg.decompose import transition_paths

    ta.set_threads(1)
    cfg = LanguageConfig.quick() if args.quick else LanguageConfig()
    metrics = args.metrics.split(",")
    c0 = time.process_time()
    corpus = load_corpus(cfg.n_chars)
    V = len(VOCAB)
    snaps = []
    train_language_model(make_model(cfg, V), corpus.train, cfg,
                         log_schedule(cfg.steps, cfg.checkpoints),
                         lambda s, m: snaps.append((s, copy.deepcopy(m).double().eval())))
    print(json.dumps({"trained_cpu_seconds": round(time.process_time() - c0, 1)}), flush=True)
    K, _ = heldout_factor(corpus.held_out, V)
    rows = []
    for i in range(len(snaps) - 1):
        row = {"steps": [snaps[i][0], snaps[i + 1][0]]}
        for m in metrics:
            na, nb, _ = pair_networks(snaps[i][1], snaps[i + 1][1], m, metric_factor(m, V, K))
            c = time.process_time()
            tr = transition_paths(na, nb, n_ctx=cfg.n_ctx)
            row[m] = {**tr.to_dict(), "summary": tr.summary(),
                      "cpu_seconds": round(time.process_time() - c, 3)}
        rows.append(row)
        print(json.dumps({"steps": row["steps"], **{m: {"one_minus_S5": round(
            row[m]["one_minus_similarity_of_sum"], 4), "summary": row[m]["summary"]}
            for m in metrics}}), flush=True)
    for m in metrics:
        ch = np.array([r[m]["one_minus_similarity_of_sum"] for r in rows])
        for i in np.argsort(-ch, kind="stable")[:3]:
            r = rows[i][m]
            print(json.dumps({"metric": m, "sharpest": rows[i]["steps"],
                              "one_minus_S5": round(float(ch[i]), 4), "verdict": r["verdict"],
                              "carried_by": r["carried_by"], "paths": {
                                  n: {"similarity": round(s, 3), "share": [round(a, 3),
                                                                           round(b, 3)],
                                      "fraction": round(f, 3)}
                                  for n, s, a, b, f in zip(r["names"], r["similarity"],
                                                           r["share_before"], r["share_after"],
                                                           r["own_change_fraction"])}}))
        print(json.dumps({"metric": m, "cpu_seconds_per_transition": round(float(np.mean(
            [r[m]["cpu_seconds"] for r in rows])), 2)}))


if __name__ == "__main__":
    main()
