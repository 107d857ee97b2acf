"""iSAE ablation benchmark (not run in CI).

    python benchmarks/bench_sae.py            # full synthetic sizes (several minutes on CPU)
    python benchmarks/bench_sae.py --quick    # about a minute
    python benchmarks/bench_sae.py --data acts.npy --m 768 --k 16   # real activations

Prints, side by side per preset, the ratios the iSAE claims are about: FVU relative to TopK,
cross-seed code IoU relative to the OMP-with-learned-dictionary IoU, ground-truth code IoU
relative to the OMP oracle's, and rip_delta relative to AbsTopK's.
"""

import argparse

import torch

from tensoralg.sae.bench import format_table, run_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--data")
    ap.add_argument("--m", type=int)
    ap.add_argument("--k", type=int)
    ap.add_argument("--out")
    ap.add_argument("--seed", type=int, default=0, help="first model seed")
    ap.add_argument("--data-seed", type=int, default=12345, help="seed of the synthetic data")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    r = run_bench(quick=args.quick, seeds=args.seeds, data=args.data, out=args.out,
                  seed=args.seed, data_seed=args.data_seed, progress=not args.no_progress,
                  steps=args.steps, m=args.m, k=args.k)
    print(format_table(r))
    names = r["config"]["presets"]
    print("\npreset     fvu/topk  iou/omp_learned  gt_iou/oracle  rip/abstopk")
    for n in names:
        p = r[n]
        fvu = p["fvu"] / r["topk"]["fvu"] if "topk" in r else float("nan")
        iou = p["code_iou"] / p["omp"]["code_iou"] if p["omp"]["code_iou"] else float("nan")
        gt = (p["gt_code_iou"] / r["oracle"]["gt_code_iou"]) if "oracle" in r else float("nan")
        rip = p["rip_delta"] / r["abstopk"]["rip_delta"] if "abstopk" in r else float("nan")
        print(f"{n:9s}  {fvu:8.3f}  {iou:15.3f}  {gt:13.3f}  {rip:11.3f}")


if __name__ == "__main__":
    main()
