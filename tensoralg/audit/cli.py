"""Command line of the audits: ``demo``, ``audit backdoor|forgetting|grokking``, ``compare``,
``matrix``. Registered into ``tensoralg``'s parser by :func:`add_parsers`; every handler
returns an exit code and raises ``ValueError`` / ``FileNotFoundError`` for bad input (printed
by :func:`tensoralg.cli.main` as one line, exit code 2)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .common import METHODS


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {v}")
    return v


def _out_dir(path: str | None, default: str) -> Path:
    out = Path(path or default)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _threads(args=None) -> None:
    import torch

    torch.set_num_threads(getattr(args, "threads", 1) or 1)


def _common(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"output folder (default: {default_out})")
    p.add_argument("--quick", action="store_true", help="small size (tests, demo)")
    p.add_argument("--seed", type=int, default=0, help="seed for data split, init and batches")
    p.add_argument("--method", choices=METHODS, default="auto",
                   help="tensor similarity method: auto = exact for depth <= 2 (Monte Carlo if the "
                        "exact cost is refused), or force exact/closure/montecarlo")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the result JSON to PATH")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="torch CPU threads (default 1: small shared machines)")


def add_parsers(sub) -> None:
    """Register ``demo``, ``audit`` (backdoor / forgetting / grokking), ``compare``, ``matrix``."""
    p = sub.add_parser("demo", help="backdoor audit at quick size with a readable table (~1 min)",
                       description="Train a bilinear digit classifier, fine-tune a backdoor into "
                                   "it and audit the two checkpoints: per-class tensor similarity "
                                   "vs. CKA / output cosine / JS / weight cosine, attack success "
                                   "rate and accuracy.")
    _common(p, "runs/demo")
    p.set_defaults(func=cmd_demo)

    audit = sub.add_parser("audit", help="checkpoint audits: backdoor, forgetting, grokking")
    asub = audit.add_subparsers(dest="audit_command", metavar="AUDIT")
    asub.required = True

    b = asub.add_parser("backdoor", help="backdoor on digits: per-class slice similarity")
    _common(b, "runs/backdoor")
    b.add_argument("--target", type=int, default=9, help="backdoor target class (default 9)")
    b.add_argument("--poison-fraction", type=_fraction, default=0.1,
                   help="fraction of non-target training images triggered and relabelled")
    b.add_argument("--steps", type=_positive_int, default=None, help="clean training steps")
    b.add_argument("--finetune-steps", type=_positive_int, default=None)
    b.add_argument("--layers", type=_positive_int, default=1, help="bilinear blocks (depth)")
    b.add_argument("--d-model", type=_positive_int, default=32)
    b.add_argument("--d-hidden", type=_positive_int, default=64)
    b.set_defaults(func=cmd_backdoor)

    f = asub.add_parser("forgetting", help="class curriculum on digits: per-class similarity")
    _common(f, "runs/forgetting")
    f.add_argument("--removed-class", type=int, default=9,
                   help="the class added last, then removed and re-added (default 9)")
    f.add_argument("--stage-steps", type=_positive_int, default=None,
                   help="training steps per curriculum stage")
    f.add_argument("--layers", type=_positive_int, default=1)
    f.set_defaults(func=cmd_forgetting)

    g = asub.add_parser("grokking", help="modular addition: checkpoint similarity matrix")
    _common(g, "runs/grokking")
    g.add_argument("--P", dest="P", type=_positive_int, default=None,
                   help="modulus (default 31; 113 is reachable but slow on CPU)")
    g.add_argument("--steps", type=_positive_int, default=None)
    g.add_argument("--checkpoints", type=_positive_int, default=None,
                   help="number of checkpoints on the log schedule")
    g.add_argument("--train-fraction", type=_fraction, default=None)
    g.set_defaults(func=cmd_grokking)

    c = sub.add_parser("compare", help="similarity of two checkpoints (all metrics and methods)")
    c.add_argument("a", help="checkpoint folder")
    c.add_argument("b", help="checkpoint folder")
    c.add_argument("--data", choices=["digits", "none"], default="none",
                   help="also compute the data baselines on this data set (test split)")
    c.add_argument("--methods", default="exact,closure,montecarlo",
                   help="comma-separated methods (exact, closure, montecarlo)")
    c.add_argument("--metrics", default="gaussian,frobenius",
                   help="comma-separated metrics (gaussian, frobenius)")
    c.add_argument("--n-samples", type=_positive_int, default=100_000,
                   help="Monte Carlo samples")
    c.add_argument("--json", metavar="PATH", default=None, help="write every number as JSON")
    c.set_defaults(func=cmd_compare)

    m = sub.add_parser("matrix", help="similarity matrix over checkpoints (heatmap + CSV)")
    m.add_argument("checkpoints", nargs="+", help="checkpoint folders (two or more)")
    m.add_argument("--out", metavar="DIR", default=None, help="output folder (default runs/matrix)")
    m.add_argument("--method", choices=METHODS, default="auto")
    m.add_argument("--output", type=int, default=None, metavar="CLASS",
                   help="compare one output slice instead of all outputs")
    m.add_argument("--json", metavar="PATH", default=None)
    m.set_defaults(func=cmd_matrix)


def _write_extra_json(path: str | None, result: dict) -> None:
    if path:
        from .common import write_json

        write_json(path, result)


def cmd_backdoor(args, demo: bool = False) -> int:
    from .backdoor import BackdoorConfig, backdoor_table, run_backdoor

    _threads(args)
    kw = dict(target=args.target, poison_fraction=args.poison_fraction, seed=args.seed,
              method=args.method, n_layers=args.layers, d_model=args.d_model,
              d_hidden=args.d_hidden)
    if args.steps:
        kw["steps"] = args.steps
    if args.finetune_steps:
        kw["finetune_steps"] = args.finetune_steps
    cfg = BackdoorConfig.quick(**kw) if args.quick else BackdoorConfig(**kw)
    cfg.validate()
    out = _out_dir(args.out, "runs/demo" if demo else "runs/backdoor")
    t0 = time.perf_counter()
    result = run_backdoor(cfg, out, show_progress=not args.no_progress)
    _write_extra_json(args.json, result)
    print(f"tensoralg {'demo' if demo else 'audit backdoor'}: backdoor audit on scikit-learn "
          f"digits ({'quick' if args.quick else 'full'} size, {time.perf_counter() - t0:.1f} s)\n")
    print(backdoor_table(result))
    print(f"\nwrote {', '.join(result['files'])}")
    return 0


def cmd_demo(args) -> int:
    args.target, args.poison_fraction, args.layers = 9, 0.1, 1
    args.d_model, args.d_hidden, args.steps, args.finetune_steps = 32, 64, None, None
    args.quick = True
    return cmd_backdoor(args, demo=True)


def cmd_forgetting(args) -> int:
    from .forgetting import ForgettingConfig, forgetting_table, run_forgetting

    _threads(args)
    kw = dict(removed_class=args.removed_class, seed=args.seed, method=args.method,
              n_layers=args.layers)
    if args.stage_steps:
        kw["stage_steps"] = args.stage_steps
    cfg = ForgettingConfig.quick(**kw) if args.quick else ForgettingConfig(**kw)
    cfg.validate()
    out = _out_dir(args.out, "runs/forgetting")
    result = run_forgetting(cfg, out, show_progress=not args.no_progress)
    _write_extra_json(args.json, result)
    print(forgetting_table(result))
    print(f"\nwrote {', '.join(result['files'])}")
    return 0


def cmd_grokking(args) -> int:
    from .grokking import GrokkingConfig, grokking_table, run_grokking

    _threads(args)
    kw = dict(seed=args.seed, method=args.method)
    for name in ("P", "steps", "checkpoints", "train_fraction"):
        if getattr(args, name):
            kw[name] = getattr(args, name)
    cfg = GrokkingConfig.quick(**kw) if args.quick else GrokkingConfig(**kw)
    cfg.validate()
    out = _out_dir(args.out, "runs/grokking")
    result = run_grokking(cfg, out, show_progress=not args.no_progress)
    _write_extra_json(args.json, result)
    print(grokking_table(result))
    print(f"\nwrote {', '.join(result['files'])}")
    return 0


def cmd_compare(args) -> int:
    from .compare import compare_table, run_compare

    _threads(args)
    result = run_compare(args.a, args.b, methods=_split(args.methods, "--methods",
                                                         ("exact", "closure", "montecarlo")),
                         metrics=_split(args.metrics, "--metrics", ("gaussian", "frobenius")),
                         data=args.data, n_samples=args.n_samples)
    _write_extra_json(args.json, result)
    print(compare_table(result))
    return 0


def cmd_matrix(args) -> int:
    from .compare import matrix_table, run_matrix

    _threads(args)
    out = _out_dir(args.out, "runs/matrix")
    result = run_matrix(args.checkpoints, out, method=args.method, output=args.output)
    _write_extra_json(args.json, result)
    print(matrix_table(result))
    print(f"\nwrote {', '.join(result['files'])}")
    return 0


def _split(text: str, option: str, allowed: tuple[str, ...]) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if not items or bad:
        raise ValueError(f"{option}: expected a comma-separated subset of {list(allowed)}, got "
                         f"{text!r}")
    return items


def main(argv=None) -> int:  # pragma: no cover - convenience for `python -m tensoralg.audit.cli`
    from ..cli import main as ta_main

    return ta_main(argv if argv is not None else sys.argv[1:])
