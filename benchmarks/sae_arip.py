"""Does aRIP help the multi-step (iSAE-ME) encoder? ``sae bench`` with and without the penalty.

    python benchmarks/sae_arip.py [--size full|m256] [--seeds 3] [--steps 4000] [--json PATH]

Trains ``isae-me`` (AbsTopK + 5-step encoder + aRIP, rip_beta 0.1) and the same encoder without
aRIP (``isae-me-dl``, which ``run_bench`` trains without its schedule, so the pair differs in the
penalty only) with ``--seeds`` seeds over shared batches, one thread, and prints per arm: the
cross-seed code IoU (mean and spread over seed pairs), code IoU against the planted codes (mean
and spread over seeds) next to the OMP oracle's, the cross-seed and ground-truth code IoU of OMP
run with each learned dictionary, FVU and the aRIP constant δ.

Sizes: ``full`` is ``sae bench``'s default (d 64, m 128, k 6, 32,768 training rows, noise 0.05);
``m256`` is ``benchmarks/sae_m256.py``'s data (d 64, m 256, k 8, 65,536 rows, noise 0).
"""

import argparse
import json

import torch

from tensoralg.sae.bench import run_bench

SIZES = {
    "full": {},
    "m256": {"d": 64, "m": 256, "k": 8, "n_train": 65536, "noise": 0.0},
}


def _pm(mean, std):
    return "—" if mean is None else (f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=list(SIZES), default="full")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--data-seed", type=int, default=12345)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    r = run_bench(["isae-me", "isae-me-dl"], seeds=args.seeds, steps=args.steps,
                  data_seed=args.data_seed, log=lambda *a: None, **SIZES[args.size])
    c = r["config"]
    print(f"d={c['d']} m={c['m']} k={c['k']} n_train={c['n_train']} noise={c['noise']} "
          f"steps={c['steps']} seeds={c['seeds']} data seed {args.data_seed}; OMP oracle code IoU "
          f"{r['oracle']['gt_code_iou']:.3f}, train {r['train_seconds']:.0f}s\n")
    print("| arm | cross-seed code IoU | code IoU vs truth | OMP on learned D: cross-seed IoU | "
          "OMP on learned D: IoU vs truth | FVU | δ | FVU plateau change |")
    print("|---|---|---|---|---|---|---|---|")
    for name, label in (("isae-me", "isae-me (aRIP)"), ("isae-me-dl", "same, no aRIP")):
        p, o = r[name], r[name]["omp"]
        print(f"| {label} | {_pm(p['code_iou'], p['code_iou_std'])} | "
              f"{_pm(p['gt_code_iou'], p['gt_code_iou_std'])} | {_pm(o['code_iou'], o['code_iou_std'])} | "
              f"{_pm(o['gt_code_iou'], o['gt_code_iou_std'])} | {_pm(p['fvu'], p['fvu_std'])} | "
              f"{_pm(p['rip_delta'], p['rip_delta_std'])} | {_pm(p['plateau_change'], None)} |")
    f = r["findings"]["arip_in_isae_me"]
    print(f"\n{f['claim']}: {'holds' if f['holds'] else 'does NOT hold'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**r, "args": vars(args)}, fh, indent=2, default=str)


if __name__ == "__main__":
    main()
