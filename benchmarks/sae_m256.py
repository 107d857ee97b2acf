"""Why does iSAE-ME fall short of the OMP oracle at d=64, m=256, k=8? (issue 13, item 6)

    python benchmarks/sae_m256.py [--steps 2000] [--n-train 65536] [--only NAME ...]

One seed per variant (CPU budget), one thread. Per variant: held-out FVU, ground-truth DCS and
code IoU of the SAE's own encoder, code IoU of OMP run with the *learned* dictionary (if this
is high while the encoder's is low, the encoder is the bottleneck; if both are low, the
dictionary is), dead latents, seconds. The OMP oracle (true dictionary) is the ceiling.
"""

import argparse
import json
import time

import torch

from tensoralg.sae.models import SparseAutoencoder
from tensoralg.sae.presets import make_config
from tensoralg.sae.pursuit import omp
from tensoralg.sae.synthetic import make_synthetic
from tensoralg.sae.training import TrainConfig, train
from verify.identifiability import compare

D, M, K = 64, 256, 8

VARIANTS = {
    # name: (preset, SAEConfig overrides, TrainConfig overrides)
    "abstopk": ("abstopk", {}, {}),
    "isae-me (T=5, free Γ)": ("isae-me", {}, {}),
    "isae-me T=10": ("isae-me", {"n_steps": 10}, {}),
    "isae-me Γ tied": ("isae-me", {"gamma": "tied"}, {}),
    "isae-me rip_beta=0": ("isae-me", {"rip_beta": 0.0}, {}),
    "isae-me cosine lr, warmup": ("isae-me", {}, {"lr_warmup_steps": 100, "lr_decay": "cosine",
                                                  "lr_end": 1e-4}),
    "isae-me batch 1024": ("isae-me", {}, {"batch_size": 1024}),
}


def run(name, x_train, x_eval, D_true, Z_true, steps, lr):
    preset, sae_over, tr_over = VARIANTS[name]
    cfg = make_config(preset, D, M, K, **sae_over)
    tc = {"steps": steps, "batch_size": 256, "lr": lr, "seed": 0, "log_every": max(1, steps // 10),
          **tr_over}
    t = time.perf_counter()
    model, hist = train(x_train, cfg, TrainConfig(**tc))
    secs = time.perf_counter() - t
    with torch.no_grad():
        z = model.encode(x_eval)
        fvu = float(((x_eval - model(x_eval)) ** 2).sum() / ((x_eval - x_eval.mean(0)) ** 2).sum())
        zo = omp(x_eval, model.W_dec.detach(), K, b_dec=model.b_dec)
    enc = compare(D_true, model.W_dec, Z_true, z)
    learned_omp = compare(D_true, model.W_dec, Z_true, zo)
    return {"variant": name, "fvu": fvu, "gt_dcs": enc["dcs"], "gt_code_iou": enc["code_iou"],
            "omp_learned_D_gt_iou": learned_omp["code_iou"],
            "dead_latents": hist[-1]["dead_latents"], "seconds": secs, "steps": tc["steps"],
            "batch_size": tc["batch_size"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--n-train", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS))
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tr = make_synthetic(args.n_train, D, M, K, seed=12345)
    ev = make_synthetic(4096, D, M, K, seed=12346, dictionary=tr.W_dec)
    z_or = omp(ev.x, ev.W_dec, K)
    oracle = compare(ev.W_dec, ev.W_dec, ev.z, z_or)["code_iou"]
    print(f"d={D} m={M} k={K}, n_train={args.n_train}, steps={args.steps}; OMP oracle code IoU "
          f"{oracle:.3f}", flush=True)
    print("| variant | FVU | gt DCS | gt code IoU (encoder) | gt code IoU (OMP, learned D) | dead | s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in args.only or VARIANTS:
        r = run(name, tr.x, ev.x, ev.W_dec, ev.z, args.steps, args.lr)
        rows.append(r)
        print(f"| {name} | {r['fvu']:.3f} | {r['gt_dcs']:.3f} | {r['gt_code_iou']:.3f} | "
              f"{r['omp_learned_D_gt_iou']:.3f} | {r['dead_latents']} | {r['seconds']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"oracle_code_iou": oracle, "rows": rows, "args": vars(args)}, fh, indent=2)


if __name__ == "__main__":
    main()
