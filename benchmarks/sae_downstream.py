"""Downstream evaluation of SAEs on the bilinear transformer's residual stream, and their dead
latents: what docs/results/sae.md reports ("CE loss recovered", dead latents at 2,000 steps).

    OMP_NUM_THREADS=1 python benchmarks/sae_downstream.py [--steps 2000] [--layer 1] [--out r.json]

A small BilinearTransformer is trained here (tensoralg.sae.transformer_acts.QUICK_MODEL, ~25 s),
its held-out windows are put in a seeded order and split 80/20 by window; SAEs (presets, one seed
each) are trained on the residual stream h_layer of the first 80 % and evaluated on the last 20 %:
FVU, dead latents (zero on every held-out row), and the spliced model's next-token loss, zero
ablation, CE loss recovered and KL (tensoralg.sae.evaluation). One thread; never gates CI.
"""

import argparse
import json
import time

import numpy as np
import torch

from tensoralg.audit.language import eval_windows
from tensoralg.corpus import load_corpus
from tensoralg.sae.evaluation import evaluate_transformer
from tensoralg.sae.presets import PRESETS, make_config, schedule
from tensoralg.sae.training import TrainConfig, train
from tensoralg.sae.transformer_acts import (
    DEFAULT_CHARS,
    residual_stream_at,
    train_quick_transformer,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--presets", nargs="+", default=["topk", "abstopk", "isae-me"])
    ap.add_argument("--auxk-alpha", type=float, default=None,
                    help="AuxK weight for every preset (default: the presets' 1/32)")
    ap.add_argument("--no-eval", action="store_true", help="FVU and dead latents only")
    ap.add_argument("--dump", default=None,
                    help="save the train / held-out rows as DUMP_train.npy, DUMP_eval.npy")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    corpus = load_corpus(DEFAULT_CHARS)
    model, tinfo = train_quick_transformer(corpus.train, seed=0)
    n_ctx = model.hparams["n_ctx"]
    count = len(corpus.held_out) // n_ctx
    W = torch.as_tensor(eval_windows(corpus.held_out, n_ctx, count)[
        np.random.default_rng(0).permutation(count)])
    n_train = int(0.8 * count)
    x = residual_stream_at(model, W[:n_train], a.layer).reshape(-1, model.hparams["d_model"])
    x_eval = residual_stream_at(model, W[n_train:], a.layer).reshape(-1, model.hparams["d_model"])
    print(f"model trained in {time.time() - t0:.0f}s (train loss {tinfo['final_train_loss']:.3f});"
          f" {n_train} + {count - n_train} windows, rows {tuple(x.shape)} / {tuple(x_eval.shape)}")
    if a.dump:
        np.save(f"{a.dump}_train.npy", x.float().numpy())
        np.save(f"{a.dump}_eval.npy", x_eval.float().numpy())
    res = {"steps": a.steps, "layer": a.layer, "m": a.m, "k": a.k, "lr": a.lr, "presets": {}}
    for name in a.presets:
        ts = time.time()
        tc = TrainConfig(steps=a.steps, batch_size=256, lr=a.lr, seed=0, log_every=100)
        if name in PRESETS:
            from dataclasses import replace
            tc = replace(tc, **schedule(name, tc.steps))
        over = {} if a.auxk_alpha is None else {"auxk_alpha": a.auxk_alpha}
        sae, hist = train(x, make_config(name, x.shape[1], a.m, a.k, **over), tc)
        secs = time.time() - ts
        with torch.no_grad():
            z = sae.encode(x_eval)
        dead = int((~(z != 0).any(0)).sum())
        if a.no_eval:
            with torch.no_grad():
                fvu = float(((x_eval - sae(x_eval)) ** 2).sum()
                            / ((x_eval - x_eval.mean(0)) ** 2).sum())
            print(f"{name:8s} auxk {sae.cfg.auxk_alpha:.4g}  fvu {fvu:.4f}  dead {dead:3d}  "
                  f"(train log: {hist[-1]['dead_latents']})  ({secs:.0f}s)", flush=True)
            res["presets"][name] = {"fvu": fvu, "dead_latents_eval": dead,
                                    "auxk_alpha": sae.cfg.auxk_alpha, "train_seconds": secs}
            continue
        ev = evaluate_transformer(model, sae, a.layer, W[n_train:])
        res["presets"][name] = {**ev, "dead_latents_eval": dead,
                                "dead_latents_train_log": hist[-1]["dead_latents"],
                                "train_seconds": secs}
        print(f"{name:8s} fvu {ev['fvu']:.4f}  dead {dead:3d}  loss clean {ev['loss_clean']:.4f} "
              f"spliced {ev['loss_spliced']:.4f} zero {ev['loss_zero']:.4f}  CE recovered "
              f"{ev['ce_loss_recovered']:.4f}  KL {ev['kl_spliced']:.4f}  ({secs:.0f}s)",
              flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
