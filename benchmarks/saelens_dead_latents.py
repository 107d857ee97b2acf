"""Dead latents of SAELens's own TopK / AbsTopK training SAEs on rows dumped by
``benchmarks/sae_downstream.py --dump D`` — run in an environment WITH SAELens (not a
dependency of tensoralg; tests/fixtures/saelens/README.md):

    OMP_NUM_THREADS=1 python benchmarks/saelens_dead_latents.py D [--steps 2000] [--m 256]

The loop is SAELens 6.54's ``SAETrainer._train_step`` (sae_lens/training/sae_trainer.py):
``training_forward_pass`` with the dead-neuron mask ``n_forward_passes_since_fired >
dead_feature_window``, backward, ``clip_grad_norm_(…, 1.0)``, Adam (β 0.9, 0.999), constant lr;
SAELens's training classes with their defaults (``rescale_acts_by_decoder_norm=True``,
``decoder_init_norm=0.1``, ``aux_loss_coefficient=1``), batches of 256 rows in a seeded shuffled
order. Reports the latents that are zero on every held-out row, like sae_downstream.py.
"""

import argparse

import numpy as np
import torch
from sae_lens.saes.abstopk_sae import AbsTopKTrainingSAE, AbsTopKTrainingSAEConfig
from sae_lens.saes.sae import TrainStepInput
from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig


def run(cls, cfg_cls, x, x_eval, steps, m, k, lr, window, seed=0):
    torch.manual_seed(seed)
    sae = cls(cfg_cls(d_in=x.shape[1], d_sae=m, k=k))
    opt = torch.optim.Adam(sae.parameters(), lr=lr, betas=(0.9, 0.999))
    since = torch.zeros(m)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=gen)
    pos = 0
    for step in range(steps):
        if pos + 256 > len(x):
            order, pos = torch.randperm(len(x), generator=gen), 0
        batch = x[order[pos:pos + 256]]
        pos += 256
        sae.train()
        out = sae.training_forward_pass(TrainStepInput(
            sae_in=batch, coefficients={},      # TopK/AbsTopK have no coefficients
            dead_neuron_mask=(since > window), n_training_steps=step, is_logging_step=False))
        with torch.no_grad():
            fired = out.feature_acts.bool().any(0)
            since += 1
            since[fired] = 0
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(sae.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    sae.eval()
    with torch.no_grad():
        z = sae.encode(x_eval)
        x_hat = sae.decode(z)
    fvu = float(((x_eval - x_hat) ** 2).sum() / ((x_eval - x_eval.mean(0)) ** 2).sum())
    return int((~(z != 0).any(0)).sum()), fvu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--window", type=int, nargs="+", default=[1000, 39])
    a = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.from_numpy(np.load(f"{a.dump}_train.npy"))
    x_eval = torch.from_numpy(np.load(f"{a.dump}_eval.npy"))
    for window in a.window:
        for name, cls, cfg in (("topk", TopKTrainingSAE, TopKTrainingSAEConfig),
                               ("abstopk", AbsTopKTrainingSAE, AbsTopKTrainingSAEConfig)):
            dead, fvu = run(cls, cfg, x, x_eval, a.steps, a.m, a.k, a.lr, window)
            print(f"SAELens {name:8s} dead_feature_window {window:5d} steps: fvu {fvu:.4f} "
                  f"dead {dead}", flush=True)


if __name__ == "__main__":
    main()
