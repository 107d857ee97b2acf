"""Dead latents of tensoralg's TopK / AbsTopK at 2,000 steps, one change at a time, on rows
dumped by ``benchmarks/sae_downstream.py --dump D`` (docs/results/sae.md, "Dead latents"):

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/sae_dead_latents.py D [--m 256] [--k 8]

Each arm is the preset with one or two settings changed; dead = latents zero on every held-out
row. Compare with SAELens's trainer on the same rows: benchmarks/saelens_dead_latents.py.
"""

import argparse

import numpy as np
import torch

from tensoralg.sae.presets import make_config
from tensoralg.sae.training import TrainConfig, train

ARMS = {
    "preset": ({}, {}),
    "auxk_alpha=1": ({"auxk_alpha": 1.0}, {}),
    "AuxK window 1000 steps": ({"dead_tokens": 256_000}, {}),
    "b_dec zeros": ({"b_dec_init": "zeros"}, {}),
    "grad_clip=1": ({}, {"grad_clip": 1.0}),
    "decoder from samples": ({}, {"decoder_init": "data"}),
    "resample every 250": ({}, {"resample_every": 250, "resample_until": 1400}),
    "AuxK window 250 steps": ({"dead_tokens": 64_000}, {}),
    "AuxK window 1000 + a=1": ({"dead_tokens": 256_000, "auxk_alpha": 1.0}, {}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--presets", nargs="+", default=["abstopk", "topk"])
    ap.add_argument("--arms", nargs="+", default=list(ARMS))
    a = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.from_numpy(np.load(f"{a.dump}_train.npy"))
    x_eval = torch.from_numpy(np.load(f"{a.dump}_eval.npy"))
    var = float(((x_eval - x_eval.mean(0)) ** 2).sum())
    for preset in a.presets:
        for arm in a.arms:
            sae_over, train_over = ARMS[arm]
            tc = TrainConfig(steps=a.steps, batch_size=256, lr=a.lr, seed=0, log_every=100,
                             **train_over)
            sae, _ = train(x, make_config(preset, x.shape[1], a.m, a.k, **sae_over), tc)
            with torch.no_grad():
                z = sae.encode(x_eval)
                fvu = float(((x_eval - sae.decode(z)) ** 2).sum()) / var
            print(f"tensoralg {preset:8s} {arm:24s} fvu {fvu:.4f} dead "
                  f"{int((~(z != 0).any(0)).sum())}", flush=True)


if __name__ == "__main__":
    main()
