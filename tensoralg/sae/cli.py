"""``tensoralg sae`` sub-commands: ``train``, ``stability``, ``bench``, ``activations``.

Heavy imports (torch, matplotlib, transformers) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import sys

from ..threads import add_threads_option

__all__ = ["add_parsers"]

PRESET_NAMES = ("topk", "abstopk", "isae", "isae-me")


def _stamp(payload: dict, args: argparse.Namespace) -> dict:
    from .._version import __version__
    cfg = {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}
    return {"tensoralg_version": __version__, "command": f"sae {args.sae_command}", "args": cfg, **payload}


def _write_json(path, payload) -> None:
    from ..io import atomic_write_json
    atomic_write_json(path, payload, default=str)


def _synthetic_spec(text: str) -> dict:
    """Parse ``d,m,k[,n[,noise]]`` (e.g. ``32,64,4,8192``)."""
    parts = text.split(",")
    if not 3 <= len(parts) <= 5:
        raise argparse.ArgumentTypeError(f"expected d,m,k[,n[,noise]], got {text!r}")
    try:
        spec = {"d": int(parts[0]), "m": int(parts[1]), "k": int(parts[2]),
                "n": int(parts[3]) if len(parts) > 3 else 8192,
                "noise": float(parts[4]) if len(parts) > 4 else 0.0}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected d,m,k[,n[,noise]] numbers, got {text!r}") from exc
    return spec


def _check_int(value, flag: str, low: int, what: str = "") -> None:
    if value is not None and value < low:
        raise ValueError(f"{flag}: expected an int >= {low}{what}, got {value}")


def _check_out(out) -> None:
    """``sae train --out`` must be missing, an empty folder, or an earlier SAE checkpoint folder
    (its ``cfg.json`` names ``d_sae``), so that training never writes into (and a later run
    never replaces) a folder of other files. Checked before any work; creates nothing.

    Raises:
        ValueError: one line naming ``--out`` and what was found.
    """
    import json
    from pathlib import Path

    from ..audit.common import check_folder_path

    out = Path(out)
    if out.is_file():
        raise ValueError(f"--out: {out} is a file; expected a folder (the SAE checkpoint folder "
                         f"to create or update)")
    check_folder_path(out, "--out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    cfg = out / "cfg.json"
    try:
        is_sae = "d_sae" in json.loads(cfg.read_text())
    except (OSError, ValueError, TypeError):
        is_sae = False
    if not is_sae:
        raise ValueError(f"--out: {out} is not empty and is not an SAE checkpoint folder (no "
                         f"cfg.json with d_sae); choose a new or empty folder, or an earlier "
                         f"`sae train` output")


def _eval_fvu(model, data, n_max: int = 8192) -> tuple[float, int]:
    """FVU (the training loss's ``recon`` term) of ``model`` on the first ``n_max`` rows."""
    import numpy as np
    import torch

    rows = data[:n_max]
    x = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.array(rows, dtype=np.float64))
    x = x.to(model.W_dec.dtype)
    with torch.no_grad():
        return float(model.loss(x)["recon"]), int(x.shape[0])


def _cmd_train(args) -> int:
    import torch

    from ..io import save_folder
    from .presets import make_config
    from .synthetic import make_synthetic
    from .training import TrainConfig, TrainingDiverged, as_activations, train

    if (args.data is None) == (args.synthetic is None):
        raise ValueError("give exactly one of --data X.npy or --synthetic d,m,k[,n[,noise]]")
    _check_int(args.steps, "--steps", 0, " (0: write the initialized, untrained SAE)")
    _check_int(args.seed, "--seed", 0)
    _check_int(args.data_seed, "--data-seed", 0)
    _check_int(args.d_sae, "--d-sae", 1)
    if args.data is not None and (args.d_sae is None or args.k is None):
        missing = " and ".join(f for f, v in (("--d-sae", args.d_sae), ("--k", args.k)) if v is None)
        raise ValueError(f"{missing}: required with --data (the data fixes only d_in)")
    s = args.synthetic
    d_sae = args.d_sae if args.d_sae is not None else s["m"]
    k = args.k if args.k is not None else s["k"]
    if not 1 <= k <= d_sae:
        raise ValueError(f"--k: expected 1 <= k <= d_sae={d_sae}, got {k}")
    _check_out(args.out)
    if args.json:
        from ..audit.common import check_file_writable
        check_file_writable(args.json, "--json")
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {}
    if s is not None:
        syn = make_synthetic(s["n"], s["d"], s["m"], s["k"], noise=s["noise"], seed=args.data_seed)
        data, d_in = syn.x, s["d"]
        meta = {"data": f"synthetic d={s['d']} m={s['m']} k={s['k']} n={s['n']} noise={s['noise']}",
                "data_seed": args.data_seed}
    else:
        data = as_activations(args.data, "--data")
        d_in = int(data.shape[1])
        meta = {"data": str(args.data)}
    overrides = {}
    if args.rip_beta is not None:
        overrides["rip_beta"] = args.rip_beta
    if args.n_steps is not None:
        overrides["n_steps"] = args.n_steps
    sae_cfg = make_config(args.preset, d_in, d_sae, k, **overrides)
    tcfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                       ckpt_every=args.ckpt_every, progress=not args.no_progress)
    meta["preset"] = args.preset
    try:
        model, hist = train(data, sae_cfg, tcfg, out=args.out, resume=args.resume, meta=meta)
    except TrainingDiverged as exc:
        print(f"tensoralg sae train: error: {exc}", file=sys.stderr)
        return 1
    if s is not None:
        save_folder(f"{args.out}/ground_truth", {"W_dec": syn.W_dec}, {"d_in": d_in, "d_sae": s["m"], "k": s["k"],
                                                                    "kind": "ground_truth", **meta})
    if hist:
        fvu, how = hist[-1]["recon"], "last batch"
        what = f"trained {args.preset} SAE"
    else:   # no optimizer step ran (--steps 0, or a resume already at --steps): evaluate it
        fvu, n_eval = _eval_fvu(model, data)
        how = f"first {n_eval} samples"
        what = (f"initialized (untrained, --steps 0) {args.preset} SAE" if args.steps == 0
                else f"{args.preset} SAE (already at step {args.steps}, nothing to train)")
    print(f"{what} d_in={d_in} d_sae={d_sae} k={k}: step {tcfg.steps}, fvu {fvu:.4f} ({how}) "
          f"-> {args.out}")
    if args.json:
        _write_json(args.json, _stamp({"history": hist, "fvu": fvu, "fvu_on": how,
                                       "sae_cfg": sae_cfg.to_dict(), "out": str(args.out)}, args))
    return 0


def _cmd_stability(args) -> int:
    import numpy as np
    import torch

    from verify.identifiability import compare, random_baseline
    from .models import rip_constants
    from .training import as_activations, load_sae

    _check_int(args.seed, "--seed", 0)
    a, b = load_sae(args.run_a), load_sae(args.run_b)
    if a.cfg.d_in != b.cfg.d_in:
        raise ValueError(f"RUN_A, RUN_B: different d_in ({a.cfg.d_in} vs {b.cfg.d_in})")
    res = {"run_a": str(args.run_a), "run_b": str(args.run_b)}
    z_a = z_b = None
    if args.data is not None:
        x = as_activations(args.data, "--data")
        x = torch.as_tensor(np.array(x[: args.max_samples], dtype=np.float64)).to(a.W_dec.dtype)
        if x.shape[1] != a.cfg.d_in:
            raise ValueError(f"--data: expected d_in={a.cfg.d_in} columns, got shape {tuple(x.shape)}")
        with torch.no_grad():
            z_a, z_b = a.encode(x), b.encode(x.to(b.W_dec.dtype))
        res["rip_delta_a"] = rip_constants(a.W_dec, z_a)["delta_max"]
        res["rip_delta_b"] = rip_constants(b.W_dec, z_b)["delta_max"]
    c = compare(a.W_dec, b.W_dec, z_a, z_b)
    res.update({k: v for k, v in c.items() if k not in ("perm", "signs")})
    res["random_dcs"] = random_baseline(a.cfg.d_sae, b.cfg.d_sae, a.cfg.d_in, seed=args.seed)["dcs_mean"]
    if args.ground_truth is not None:
        from ..io import load_folder
        gt, _ = load_folder(args.ground_truth)
        if "W_dec" not in gt:
            raise ValueError(f"--ground-truth: {args.ground_truth} holds no W_dec tensor")
        res["gt_dcs_a"] = compare(gt["W_dec"], a.W_dec)["dcs"]
        res["gt_dcs_b"] = compare(gt["W_dec"], b.W_dec)["dcs"]
    for key, val in res.items():
        print(f"{key:>12s}: {val:.4f}" if isinstance(val, float) else f"{key:>12s}: {val}")
    if args.json:
        _write_json(args.json, _stamp(res, args))
    return 0


def _cmd_bench(args) -> int:
    import torch

    from .bench import format_table, run_bench

    overrides = {k: getattr(args, k) for k in ("d", "m", "k", "steps", "lr", "n_train")
                 if getattr(args, k) is not None}
    for flag, value in (("--seed", args.seed), ("--data-seed", args.data_seed)):
        _check_int(value, flag, 0)
    r = run_bench(args.presets, quick=args.quick, seeds=args.seeds, data=args.data, out=args.out,
                  seed=args.seed, data_seed=args.data_seed, progress=not (args.no_progress or args.quiet),
                  log=(lambda *a: None) if args.quiet else print, **overrides)
    print(format_table(r))
    if args.out:
        print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    if args.json:
        _write_json(args.json, _stamp(r, args))
    return 0


def _cmd_activations(args) -> int:
    from .activations import extract_activations

    info = extract_activations(args.out, layer=args.layer, max_texts=args.max_texts,
                               max_tokens=args.max_tokens, batch_size=args.batch_size)
    print(f"wrote {info['shape'][0]} x {info['shape'][1]} activations of layer {info['layer']} "
          f"({info['model']}) -> {args.out}")
    if args.json:
        _write_json(args.json, _stamp(info, args))
    return 0


def add_parsers(sub) -> None:
    """Add the ``sae`` command (sub-commands train / stability / bench / activations) to ``sub``."""
    p = sub.add_parser("sae", help="identifiable sparse autoencoders",
                       description="Identifiable sparse autoencoders: train, compare runs, benchmark.")
    ss = p.add_subparsers(dest="sae_command", metavar="SAE_COMMAND")
    ss.required = True

    t = ss.add_parser("train", help="train an SAE on a .npy of activations or synthetic data")
    t.add_argument("--preset", choices=PRESET_NAMES, default="isae-me")
    t.add_argument("--data", help="(n, d) float .npy of activations (memory-mapped)")
    t.add_argument("--synthetic", type=_synthetic_spec, metavar="d,m,k[,n[,noise]]",
                   help="train on synthetic data with a ground-truth dictionary (saved to OUT/ground_truth)")
    t.add_argument("--data-seed", type=int, default=0,
                   help="seed of the --synthetic data (default 0); drawn from a stream independent "
                        "of --seed's, so equal numbers never give equal draws")
    t.add_argument("--d-sae", type=int, help="number of latents (default: m of --synthetic)")
    t.add_argument("--k", type=int, help="active latents per sample (default: k of --synthetic)")
    t.add_argument("--steps", type=int, default=2000,
                   help="optimizer steps (default 2000); 0 writes the initialized, untrained SAE "
                        "(a baseline) and reports its FVU on the first 8192 samples")
    t.add_argument("--batch-size", type=int, default=256)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batch order")
    t.add_argument("--rip-beta", type=float, help="override the preset's aRIP weight")
    t.add_argument("--n-steps", type=int, help="override the multi-step encoder's T")
    t.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: end only)")
    t.add_argument("--resume", help="checkpoint folder to continue from")
    t.add_argument("--out", required=True,
                   help="checkpoint folder (weights.safetensors + cfg.json): new, empty, or an "
                        "earlier SAE checkpoint folder (e.g. the --resume folder)")
    add_threads_option(t)
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is hidden anyway when stderr is not a terminal)")
    t.add_argument("--json", help="also write the loss history as JSON here")
    t.set_defaults(func=_cmd_train)

    s = ss.add_parser("stability", help="compare two trained SAEs (DCS, code IoU, code l2)")
    s.add_argument("run_a", metavar="RUN_A")
    s.add_argument("run_b", metavar="RUN_B")
    s.add_argument("--data", help=".npy of activations to compare the codes on")
    s.add_argument("--max-samples", type=int, default=4096)
    s.add_argument("--ground-truth", help="folder with a ground-truth W_dec (from train --synthetic)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random-dictionary baseline (random_dcs)")
    s.add_argument("--json")
    add_threads_option(s)
    s.set_defaults(func=_cmd_stability)

    b = ss.add_parser("bench", help="train every preset with several seeds and report stability")
    b.add_argument("--quick", action="store_true", help="small sizes: about a minute on CPU")
    b.add_argument("--presets", nargs="+", choices=PRESET_NAMES)
    b.add_argument("--seeds", type=int, help="seeds per preset (default 3 quick / 5 full)")
    b.add_argument("--data", help="real activations .npy instead of synthetic data")
    b.add_argument("--d", type=int); b.add_argument("--m", type=int); b.add_argument("--k", type=int)
    b.add_argument("--steps", type=int); b.add_argument("--lr", type=float)
    b.add_argument("--n-train", type=int)
    add_threads_option(b)
    b.add_argument("--out", help="folder for bench.json, bench.md, bench.png")
    b.add_argument("--json")
    b.add_argument("--seed", type=int, default=0,
                   help="first model seed (seeds --seed, --seed+1, ...; default 0)")
    b.add_argument("--data-seed", type=int, default=12345,
                   help="seed of the synthetic train data (eval data: --data-seed + 1)")
    b.add_argument("--no-progress", action="store_true",
                   help="no progress bar per training run (hidden anyway when stderr is not a "
                        "terminal)")
    b.add_argument("--quiet", action="store_true", help="no per-seed log lines")
    b.set_defaults(func=_cmd_bench)

    a = ss.add_parser("activations", help="extract hidden states of all-MiniLM-L6-v2 (optional extra)")
    a.add_argument("--out", required=True, help="output .npy")
    a.add_argument("--layer", type=int, default=3, help="hidden-state index (0 = embeddings, 1..6)")
    a.add_argument("--max-texts", type=int, default=2000)
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--batch-size", type=int, default=32)
    a.add_argument("--json")
    add_threads_option(a)
    a.set_defaults(func=_cmd_activations)
