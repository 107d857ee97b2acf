"""iSAE ablation benchmark (not run in CI).

    python benchmarks/bench_sae.py            # full synthetic sizes (several minutes on CPU)
    python benchmarks/bench_sae.py --quick    # about a minute
    python benchmarks/bench_sae.py --data acts.npy --m 768 --k 16   # real activations
    python benchmarks/bench_sae.py --speed    # training samples/s: today's model code vs that
                                              # of commit 15ea9a9 (full stable-sort selection),
                                              # imported from git history, side by side

Prints, side by side per preset, the ratios the iSAE claims are about: FVU relative to TopK,
cross-seed code IoU relative to the OMP-with-learned-dictionary IoU, ground-truth code IoU
relative to the OMP oracle's, and rip_delta relative to AbsTopK's.
"""

import argparse
import importlib.util
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from tensoralg.sae import models, training
from tensoralg.sae.bench import format_table, run_bench
from tensoralg.sae.presets import make_config
from tensoralg.sae.synthetic import make_synthetic
from tensoralg.sae.training import TrainConfig, train

BASE_REV = "15ea9a9"   # the last commit before the top-k speed-up (013aca4)
_SRC = ("tensoralg/sae/models.py", "tensoralg/sae/_seeds.py")


def load_before(rev: str = BASE_REV, tmp: str | None = None, name: str = "_sae_before"):
    """``tensoralg/sae/models.py`` as of commit ``rev``, imported from that commit's files.

    ``git archive`` (read-only: no worktree or ref is added to the repository) writes the old
    ``models.py`` and the ``_seeds.py`` it imports into a temporary folder as a package
    ``name`` (default ``_sae_before``); nothing of the old code is kept in the tree.
    """
    root = Path(__file__).resolve().parent.parent
    try:
        blob = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev, *_SRC],
                              check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        raise SystemExit(f"--speed needs the git history of this checkout (commit {rev}): "
                         f"{err.decode(errors='replace').strip() or exc}") from None
    folder = Path(tmp or tempfile.mkdtemp(prefix="sae_before_")) / name   # tmp: caller cleans
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        for member in tf.getmembers():
            if member.isfile():
                (folder / Path(member.name).name).write_bytes(tf.extractfile(member).read())
    (folder / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{name}.models")   # the package registered just above


def _samples_per_s(x, preset, d, m, k, steps, batch_size, before) -> float:
    """Samples/s of ``steps`` training steps of ``preset``; ``before``: the old models module
    (`load_before`) to train with instead of today's, or None."""
    saved = training.SparseAutoencoder
    if before is not None:
        training.SparseAutoencoder = before.SparseAutoencoder
    try:
        cfg = make_config(preset, d, m, k)
        t = time.perf_counter()
        train(x, cfg, TrainConfig(steps=steps, batch_size=batch_size, lr=1e-3, seed=0, log_every=steps))
        return steps * batch_size / (time.perf_counter() - t)
    finally:
        training.SparseAutoencoder = saved


def speed(reps: int = 5, steps: int = 20, d: int = 64, m: int = 256, k: int = 8,
          batch_size: int = 1024, rev: str = BASE_REV, also: str | None = None) -> dict:
    """Samples/s of training with today's model code and with that of commit ``rev`` (full
    stable-sort selection), interleaved ``reps`` times; medians and their ratio per preset.
    ``also``: a third commit timed in the same interleaved loop (``out[preset]["also"]``)."""
    with tempfile.TemporaryDirectory() as tmp:   # imported modules need no files afterwards
        _before = load_before(rev, tmp)
        _also = load_before(also, tmp, "_sae_also") if also else None
    x = make_synthetic(8 * batch_size, d, m, k, seed=0).x
    out = {}
    for preset in ("topk", "abstopk", "isae-me"):
        new, old, mid = [], [], []
        for _ in range(reps):
            new.append(_samples_per_s(x, preset, d, m, k, steps, batch_size, None))
            old.append(_samples_per_s(x, preset, d, m, k, steps, batch_size, _before))
            if _also is not None:
                mid.append(_samples_per_s(x, preset, d, m, k, steps, batch_size, _also))
        out[preset] = {"new": statistics.median(new), "old": statistics.median(old)}
        out[preset]["ratio"] = out[preset]["new"] / out[preset]["old"]
        if mid:
            out[preset]["also"] = statistics.median(mid)
    # the selection alone, on one (batch, m) score matrix
    s = torch.randn(batch_size, m, generator=torch.Generator().manual_seed(1))
    tn, to = [], []
    for _ in range(reps * 10):
        t = time.perf_counter()
        models.select_topk(s, k)
        tn.append(time.perf_counter() - t)
        t = time.perf_counter()
        _before.select_topk(s, k)
        to.append(time.perf_counter() - t)
    out["select_ms"] = {"new": 1e3 * statistics.median(tn), "old": 1e3 * statistics.median(to)}
    return out


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
    ap.add_argument("--speed", action="store_true",
                    help="only the training-throughput comparison of the top-k selection")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (--speed)")
    ap.add_argument("--base-rev", default=BASE_REV,
                    help=f"commit whose tensoralg/sae/models.py is the 'before' arm (--speed; "
                         f"default {BASE_REV})")
    ap.add_argument("--also-rev", default=None,
                    help="a third commit timed in the same interleaved loop (--speed; e.g. the "
                         "commit before a later speed-up)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.speed:
        r = speed(reps=args.reps, rev=args.base_rev, also=args.also_rev)
        print("training samples/s, d=64 m=256 k=8 batch 1024, one thread, medians of "
              f"{args.reps} interleaved runs")
        also = f"   {args.also_rev:>10s}  now/{args.also_rev}" if args.also_rev else ""
        print(f"preset     now (topk + embedding_bag)   before ({args.base_rev}, full sort)   "
              f"ratio{also}")
        for p in ("topk", "abstopk", "isae-me"):
            extra = (f"   {r[p]['also']:10.0f}  {r[p]['new'] / r[p]['also']:.2f}x"
                     if "also" in r[p] else "")
            print(f"{p:9s}  {r[p]['new']:26.0f}   {r[p]['old']:18.0f}   {r[p]['ratio']:.2f}x"
                  f"{extra}")
        sm = r["select_ms"]
        print(f"selection alone on (1024, 256), k=8: {sm['new']:.2f} ms vs {sm['old']:.2f} ms "
              f"({sm['old'] / sm['new']:.2f}x)")
        return
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
