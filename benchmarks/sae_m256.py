"""Why does iSAE-ME fall short of the OMP oracle at d=64, m=256, k=8? (issue 13, item 6)

    python benchmarks/sae_m256.py [--steps 1500] [--n-train 65536] [--only NAME ...] [--diagnostics]

One seed per variant (CPU budget), one thread. Per variant: held-out FVU, ground-truth DCS,
the fraction of true atoms whose Hungarian-matched learned atom has |cos| > 0.95 (dictionary
recovery), code IoU of the SAE's own encoder, code IoU of OMP run with the *learned* dictionary
(if this is high while the encoder's is low, the encoder is the bottleneck; if both are low,
the dictionary is), dead latents, latents resampled, seconds; ``--then-encoder N`` also trains
a T=5 encoder for N steps on each learned dictionary, frozen. The OMP oracle (true dictionary)
is the ceiling. Variants with "resample" use ``TrainConfig.resample_every`` (every 250 steps,
until 80 % of the steps); "multistep from 50 %" ``TrainConfig.multistep_start``.
"""

import argparse
import json
import time

import torch
from tensoralg.verify.identifiability import compare, match_atoms

from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.sae.presets import make_config, schedule
from tensoralg.sae.pursuit import omp
from tensoralg.sae.synthetic import make_synthetic
from tensoralg.sae.training import TrainConfig, train

D, M, K = 64, 256, 8

_RS = {"resample_every": 250, "resample_until_frac": 0.8}
_RSD = {**_RS, "resample_duplicates": 0.9}
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
    # dictionary learning: data init, resampling (Bricken et al. 2023), duplicates, lr decay
    "abstopk data init": ("abstopk", {}, {"decoder_init": "data"}),
    "abstopk resample dead": ("abstopk", {}, _RS),
    "abstopk resample dead+dup": ("abstopk", {}, _RSD),
    "abstopk data init, resample dead+dup": ("abstopk", {}, {**_RSD, "decoder_init": "data"}),
    "abstopk resample dead+dup, cosine lr": ("abstopk", {}, {**_RSD, "lr_decay": "cosine",
                                                             "lr_end": 1e-4}),
    "isae-me resample dead+dup": ("isae-me", {}, _RSD),
    "isae-me resample dead+dup, cosine lr": ("isae-me", {}, {**_RSD, "lr_decay": "cosine",
                                                             "lr_end": 1e-4}),
    "isae-me rip_beta=0 resample dead+dup, cosine lr": ("isae-me", {"rip_beta": 0.0},
                                                        {**_RSD, "lr_decay": "cosine",
                                                         "lr_end": 1e-4}),
    "isae-me, multistep from 50 %, resample dead": (
        "isae-me", {}, {**_RS, "multistep_start_frac": 0.5}),
    "abstopk resample dead, lr 4e-3": ("abstopk", {}, {**_RS, "lr": 4e-3}),
    "isae-me-dl (preset and its schedule)": ("isae-me-dl", {}, {"preset_schedule": True}),
}


def atoms_recovered(D_true, W_dec, threshold=0.95):
    """Fraction of true atoms whose Hungarian-matched learned atom has |cos| > threshold."""
    cos = match_atoms(D_true, W_dec).cos
    return float((abs(cos) > threshold).mean())


def run(name, x_train, x_eval, D_true, Z_true, steps, lr, then_encoder=0):
    preset, sae_over, tr_over = VARIANTS[name]
    cfg = make_config(preset, D, M, K, **sae_over)
    tr_over = dict(tr_over)
    if "resample_until_frac" in tr_over:
        tr_over["resample_until"] = int(tr_over.pop("resample_until_frac") * steps)
    if tr_over.pop("preset_schedule", False):
        tr_over.update(schedule(preset, steps))
    if "multistep_start_frac" in tr_over:
        tr_over["multistep_start"] = int(tr_over.pop("multistep_start_frac") * steps)
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
            "atoms_recovered_095": atoms_recovered(D_true, model.W_dec),
            "resampled": hist[-1].get("resampled", 0),
            "dead_latents": hist[-1]["dead_latents"], "seconds": secs, "steps": tc["steps"],
            "batch_size": tc["batch_size"],
            "then_T5_encoder_iou": (encoder_on_frozen_dictionary(
                x_train, x_eval, model.W_dec.detach(), D_true, Z_true, 5, then_encoder)
                if then_encoder else None)}


def untrained_encoder_on_true_dictionary(x_eval, D_true, Z_true, T, eta):
    """Code IoU of the multi-step encoder with the TRUE dictionary and its initial parameters
    (W_enc = Dᵀ, Γ = η Dᵀ, no biases): iterative hard thresholding with T steps."""
    cfg = SAEConfig(D, M, K, activation="abstopk", encoder="multistep", n_steps=T, gamma="tied",
                    step_size=eta)
    m = SparseAutoencoder(cfg, seed=0)
    with torch.no_grad():
        m.W_dec.copy_(D_true)
        m.W_enc.copy_(D_true.T)
        m.b_dec.zero_()
        z = m.encode(x_eval)
    return compare(D_true, D_true, Z_true, z)["code_iou"]


def encoder_on_frozen_dictionary(x_train, x_eval, D_fixed, D_true, Z_true, T, steps, lr=1e-3,
                                 init=None):
    """Train only the encoder (W_enc, b_enc, free Γ) of a T-step iSAE-ME whose decoder is frozen
    at ``D_fixed``; code IoU against the truth."""
    cfg = SAEConfig(D, M, K, activation="abstopk", encoder="multistep", n_steps=T, gamma="free",
                    step_size=0.5)
    m = SparseAutoencoder(cfg, seed=0)
    with torch.no_grad():
        m.W_dec.copy_(D_fixed)
        m.W_enc.copy_(D_fixed.T if init is None else init.W_enc)
        m.W_step.copy_(0.5 * D_fixed.T)
        if init is not None:
            m.b_enc.copy_(init.b_enc)
            m.b_dec.copy_(init.b_dec)
        else:
            m.b_dec.zero_()
    m.W_dec.requires_grad_(False)
    m.b_dec.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = x_train[torch.randint(0, x_train.shape[0], (256,), generator=g)]
        loss = m.loss(x)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return compare(D_true, m.W_dec, Z_true, m.encode(x_eval))["code_iou"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--n-train", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS))
    ap.add_argument("--json")
    ap.add_argument("--data-seed", type=int, default=12345,
                    help="seed of the synthetic training data (held-out: this + 1)")
    ap.add_argument("--then-encoder", type=int, default=0,
                    help="also train a T=5 encoder for this many steps on each learned "
                         "dictionary, frozen (default 0: no)")
    ap.add_argument("--diagnostics", action="store_true",
                    help="also: the encoder alone on the true dictionary (untrained IHT for several "
                         "T, and trained for 600 steps)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tr = make_synthetic(args.n_train, D, M, K, seed=args.data_seed)
    ev = make_synthetic(4096, D, M, K, seed=args.data_seed + 1, dictionary=tr.W_dec)
    z_or = omp(ev.x, ev.W_dec, K)
    oracle = compare(ev.W_dec, ev.W_dec, ev.z, z_or)["code_iou"]
    print(f"d={D} m={M} k={K}, n_train={args.n_train}, data seed {args.data_seed}, "
          f"steps={args.steps}; OMP oracle code IoU "
          f"{oracle:.3f}", flush=True)
    print("| variant | FVU | gt DCS | atoms |cos|>0.95 | gt code IoU (encoder) | "
          "gt code IoU (OMP, learned D) | dead | resampled | s |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    if args.diagnostics:
        print("\nthe encoder alone, TRUE dictionary:")
        for T in (5, 10, 20, 50):
            print(f"  untrained T={T} (IHT, η=0.5): code IoU "
                  f"{untrained_encoder_on_true_dictionary(ev.x, ev.W_dec, ev.z, T, 0.5):.3f}", flush=True)
        print(f"  T=5, encoder trained 600 steps (decoder frozen): code IoU "
              f"{encoder_on_frozen_dictionary(tr.x, ev.x, ev.W_dec, ev.W_dec, ev.z, 5, 600):.3f}\n",
              flush=True)
    rows = []
    for name in args.only or VARIANTS:
        r = run(name, tr.x, ev.x, ev.W_dec, ev.z, args.steps, args.lr, args.then_encoder)
        rows.append(r)
        print(f"| {name} | {r['fvu']:.3f} | {r['gt_dcs']:.3f} | {r['atoms_recovered_095']:.3f} | "
              f"{r['gt_code_iou']:.3f} | {r['omp_learned_D_gt_iou']:.3f} | {r['dead_latents']} | "
              f"{r['resampled']} | {r['seconds']:.0f} |" +
              (f" then T=5 encoder on it: {r['then_T5_encoder_iou']:.3f}" if args.then_encoder else ""),
              flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"oracle_code_iou": oracle, "rows": rows, "args": vars(args)}, fh, indent=2)


if __name__ == "__main__":
    main()
