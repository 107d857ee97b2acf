"""Command line of the audits: ``demo``, ``audit backdoor|forgetting|grokking``, ``compare``,
``matrix``. Registered into ``tensoralg``'s parser by `add_parsers`; every handler
returns an exit code and raises ``ValueError`` / ``FileNotFoundError`` for bad input (printed
by `tensoralg.cli.main` as one line, exit code 2).

Options shared by every command here: ``--seed``, ``--json PATH``, ``--no-progress``,
``--threads N``; ``demo``, ``audit *`` and ``matrix`` also take ``--out DIR``, ``--method`` and
``--n-samples`` (Monte Carlo; results then carry standard errors).
Paths (``--out``, ``--json``) are checked before any work (``--json`` by creating and deleting a
probe file next to it); the ``--json`` copy is written before the new run is swapped in, so a
late failure never costs the previous run. An output folder is replaced as a
whole by a complete run (written to a hidden folder next to it, then swapped in); a failed or
interrupted run (exit code 1 / 130) leaves the previous one untouched. ``--out`` must be new,
empty, or an earlier output of the same command."""

from __future__ import annotations

import argparse
import sys
import time

from ..threads import add_threads_option, nonneg_int
from ._cliutil import (
    apply_threads,
    check_checkpoints,
    check_n_samples_used,
    check_paths,
    fraction,
    mc_samples,
    positive_int,
    report,
    run,
)
from .common import METHODS


def _shared(p: argparse.ArgumentParser, seed_help: str) -> None:
    """The options every command here takes: --seed, --json, --no-progress, --threads."""
    p.add_argument("--seed", type=nonneg_int, default=0, help=f"{seed_help} (default 0)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the result JSON to PATH (a file path; missing folders on "
                        "the way are created, as for --out; checked before any work; default: "
                        "none)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (default: shown; they are hidden anyway when stderr "
                        "is not a terminal)")
    add_threads_option(p)


def _common(p: argparse.ArgumentParser, default_out: str, quick: bool = True) -> None:
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"output folder (default: {default_out}); must be new, empty or an "
                        f"earlier run of the same audit, which a completed run replaces")
    # demo is always quick: --quick is accepted there (a no-op) but not listed
    p.add_argument("--quick", action="store_true",
                   help="small size (tests; default off)" if quick else argparse.SUPPRESS)
    p.add_argument("--method", choices=METHODS, default="auto",
                   help="tensor similarity method (default auto): auto = exact for depth <= 2 (Monte Carlo if the "
                        "exact cost is refused), or force exact/closure/montecarlo")
    _metric(p)
    _n_samples(p)
    _shared(p, "seed for data split, init, batches and Monte Carlo samples")


def _seeds(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=nonneg_int, nargs="+", default=None, metavar="N",
                   help="run once per seed (e.g. --seeds 0 1 2; each run complete in "
                        "OUT/seed<N>/) and print every number as mean ± sample standard "
                        "deviation, each finding counted per seed (default: one run with "
                        "--seed)")


def _seed_list(args) -> list[int] | None:
    """``--seeds`` checked (distinct); refused together with a non-default ``--seed``."""
    from .common import check_seeds

    seeds = check_seeds(getattr(args, "seeds", None))
    if seeds is not None and args.seed != 0:
        raise ValueError(f"--seed {args.seed} and --seeds: give one of them (--seeds lists "
                         f"every seed run)")
    return seeds


def _data_spec(text: str) -> str:
    """argparse type of ``--data``: ``digits`` or ``npz:PATH`` (the file is checked later, still
    before any training, by the audit's configuration)."""
    from .common import check_data_spec

    try:
        return check_data_spec(text, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).lstrip(": ")) from None


def _data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=_data_spec, default="digits", metavar="digits|npz:PATH",
                   help="the images (default digits: scikit-learn's 8x8 digits, split by "
                        "--seed); npz:PATH: your own .npz with arrays X_train, y_train, X_test, "
                        "y_test (images (n, H, W) or (n, H, W, C) of any size, or square rows "
                        "(n, side*side); integer labels 0..K-1, every class in both splits; "
                        "pixels used as stored), checked before any training")


def _metric(p: argparse.ArgumentParser, language: bool = False) -> None:
    from .common import SIM_METRICS

    p.add_argument("--metric", choices=SIM_METRICS, default="gaussian",
                   help="similarity metric (default gaussian: E over x ~ N(0, I)); frobenius: "
                        "the symmetrised Frobenius cosine of the weights (the original "
                        "authors' metric for the backdoor and grokking figures; exact only)"
                        + ("; refused here: bilinear transformers have the Gaussian metric "
                           "only" if language else ""))


def _n_ctx(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-ctx", type=positive_int, default=None,
                   help="bilinear-transformer checkpoints: positions compared (default: the "
                        "shortest trained context; longer is refused)")


def _n_samples(p: argparse.ArgumentParser) -> None:
    from .common import MC_SAMPLES

    p.add_argument("--n-samples", type=mc_samples, default=None,
                   help=f"Monte Carlo directions when the method is montecarlo (default "
                        f"{MC_SAMPLES}); the standard errors shrink like 1/sqrt(N)")


def add_parsers(sub) -> None:
    """Register ``demo``, ``audit`` (backdoor / forgetting / grokking), ``compare``, ``matrix``."""
    p = sub.add_parser("demo", help="backdoor audit at quick size with a readable table (~15 s of CPU)",
                       description="Train a bilinear digit classifier, fine-tune a backdoor into "
                                   "it and audit the two checkpoints: per-class tensor similarity "
                                   "vs. CKA / output cosine / JS / weight cosine, attack success "
                                   "rate and accuracy.")
    _common(p, "runs/demo", quick=False)
    p.set_defaults(func=cmd_demo, own_threads=True)

    audit = sub.add_parser("audit", help="checkpoint audits: backdoor, forgetting, grokking, "
                                         "language")
    asub = audit.add_subparsers(dest="audit_command", metavar="AUDIT")
    asub.required = True

    b = asub.add_parser("backdoor", help="backdoor on digits: per-class slice similarity")
    _common(b, "runs/backdoor")
    b.add_argument("--target", type=int, default=9, help="backdoor target class (default 9)")
    b.add_argument("--poison-fraction", type=fraction, default=0.1,
                   help="fraction of non-target training images triggered and relabelled "
                        "(default 0.1)")
    _data(b)
    b.add_argument("--steps", type=positive_int, default=None,
                   help="clean training steps (default 2000; 500 with --quick)")
    b.add_argument("--finetune-steps", type=positive_int, default=None,
                   help="backdoor fine-tuning steps (default 600; 300 with --quick)")
    b.add_argument("--finetune-checkpoints", type=positive_int, default=None,
                   help="checkpoints through the backdoor and the control fine-tune, evenly "
                        "spaced, the last at the end (default 20, also with --quick); each is "
                        "compared with the clean model (the walk-through figure)")
    b.add_argument("--layers", type=positive_int, default=1,
                   help="bilinear blocks (depth; default 1)")
    b.add_argument("--d-model", type=positive_int, default=32,
                   help="residual stream width (default 32)")
    b.add_argument("--d-hidden", type=positive_int, default=64,
                   help="hidden units per bilinear block (default 64)")
    _seeds(b)
    b.set_defaults(func=cmd_backdoor, own_threads=True)

    f = asub.add_parser("forgetting", help="class curriculum on digits: per-class similarity")
    _common(f, "runs/forgetting")
    f.add_argument("--removed-class", type=int, default=9,
                   help="the class added last, then removed and re-added (default 9)")
    _data(f)
    f.add_argument("--stage-steps", type=positive_int, default=None,
                   help="training steps per curriculum stage (default 600; 150 with --quick)")
    f.add_argument("--checkpoints-per-stage", type=positive_int, default=None,
                   help="checkpoints saved within each stage, evenly spaced, the last at its "
                        "end (default 5: 40 over the 8 stages, also with --quick); each is "
                        "compared with the reference class by class")
    f.add_argument("--layers", type=positive_int, default=1,
                   help="bilinear blocks (depth; default 1)")
    _seeds(f)
    f.set_defaults(func=cmd_forgetting, own_threads=True)

    g = asub.add_parser("grokking", help="modular addition: checkpoint similarity matrix")
    _common(g, "runs/grokking")
    g.add_argument("--P", dest="P", type=positive_int, default=None,
                   help="modulus (default 31; 31 with --quick; 113 is reachable but slow on "
                        "CPU; at most 256, and at least 30 validation pairs)")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="full-batch training steps (default 5000; 1000 with --quick)")
    g.add_argument("--checkpoints", type=positive_int, default=None,
                   help="number of checkpoints on the log schedule (default 24; 12 with --quick)")
    g.add_argument("--train-fraction", type=fraction, default=None,
                   help="fraction of the P^2 pairs used for training (default 0.8, also with --quick)")
    _seeds(g)
    g.add_argument("--paper-size", action="store_true",
                   help="the original authors' size: P = 113 with 30%% of the pairs trained "
                        "(other settings as the default; slow: its measured CPU time is printed "
                        "before training and in docs/audits.md); not with --quick, --P or "
                        "--train-fraction (default off: P = 31, 80%% trained)")
    g.set_defaults(func=cmd_grokking, own_threads=True)

    _add_language(asub)

    c = sub.add_parser("compare", help="similarity of two checkpoints (all metrics and methods)")
    c.add_argument("a", help="checkpoint folder")
    c.add_argument("b", help="checkpoint folder")
    c.add_argument("--data", choices=["digits", "none"], default="none",
                   help="also compute the data baselines on this data set (test split; "
                        "default none)")
    c.add_argument("--methods", default="exact,montecarlo",
                   type=_subset(("exact", "closure", "montecarlo")),
                   help="comma-separated methods of exact, montecarlo, closure (default "
                        "exact,montecarlo; closure: the moment-closure similarity, APPROXIMATE "
                        "at depth >= 2, shown labelled)")
    c.add_argument("--metrics", default="gaussian,frobenius",
                   type=_subset(("gaussian", "frobenius")),
                   help="comma-separated metrics (default gaussian,frobenius)")
    c.add_argument("--n-samples", type=mc_samples, default=None,
                   help="Monte Carlo directions (at least 6; default 100000, and 20000 for "
                        "bilinear-transformer checkpoints, where each direction costs 6 (one "
                        "layer) to 26 (two layers) forward passes per model)")
    _n_ctx(c)
    _shared(c, "Monte Carlo seed and the digits split seed for --data digits")
    c.set_defaults(func=cmd_compare, own_threads=True)

    m = sub.add_parser("matrix", help="similarity matrix over checkpoints (heatmap + CSV)")
    m.add_argument("checkpoints", nargs="+", help="checkpoint folders (two or more)")
    m.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default runs/matrix); must be new, empty or an earlier "
                        "matrix output, which a completed run replaces")
    m.add_argument("--method", choices=METHODS, default="auto",
                   help="tensor similarity method (default auto: exact for depth <= 2, Monte "
                        "Carlo where exact is refused; bilinear transformers: exact for one "
                        "layer, refused beyond, naming montecarlo and closure (the moment-"
                        "closure similarity, APPROXIMATE))")
    m.add_argument("--output", type=int, default=None, metavar="CLASS",
                   help="compare one output slice instead of all outputs (default: all)")
    m.add_argument("--n-samples", type=mc_samples, default=None,
                   help="Monte Carlo directions when the method is montecarlo (default 100000, "
                        "and 20000 for bilinear-transformer checkpoints, as compare); the "
                        "standard errors shrink like 1/sqrt(N)")
    _n_ctx(m)
    _shared(m, "Monte Carlo seed")
    from .matrix_blocks import add_options as _block_options

    _block_options(m)  # --block-size, --resume, --scheduler, --workers (tensoralg.blocks)
    m.set_defaults(func=cmd_matrix, own_threads=True)


def _metric_list(text: str) -> tuple:
    """``--metrics``: comma-separated names of the degree report's metrics."""
    from .language_degree import METRIC_NAMES

    names = tuple(x.strip() for x in text.split(","))
    if not names or any(x not in METRIC_NAMES for x in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names from "
                                         f"{','.join(METRIC_NAMES)}, comma-separated; got "
                                         f"{text!r}")
    return names


def _add_language(asub) -> None:
    from .language import METHODS as LANG_METHODS

    p = asub.add_parser("language", help="bilinear transformer on stdlib text: checkpoint "
                                         "similarity vs n-gram learning")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default runs/language); must be new, empty or an earlier "
                        "run of this audit, which a completed run replaces")
    p.add_argument("--quick", action="store_true",
                   help="small size: 500 steps, 10 checkpoints, 60k characters (default off)")
    p.add_argument("--method", choices=LANG_METHODS, default="auto",
                   help="tensor similarity method (default auto: exact for one layer; for two "
                        "or more the degree report: exact S<=1 and S<=5 matrices, S<=9 and the "
                        "guided full similarity by Monte Carlo with verdicts, under three "
                        "metrics; montecarlo: every pair by radial Monte Carlo with its "
                        "verdict, the approximate moment-closure beside it as a labelled "
                        "column; closure: the moment-closure matrix, APPROXIMATE beyond one "
                        "layer)")
    _metric(p, language=True)
    p.add_argument("--metrics", type=_metric_list, default=None,
                   help="degree report: comma-separated input metrics among residual (N(0, I) "
                        "on the residual stream), vocab (N(0, I) on one-hot tokens through "
                        "each checkpoint's embedding), heldout (vocabulary space, covariance "
                        "the held-out token frequencies) (default all three)")
    p.add_argument("--deep-pairs", type=nonneg_int, default=None,
                   help="degree report: consecutive intervals (the sharpest exact S<=5 ones "
                        "per metric) where S<=9 and the guided full similarity are estimated "
                        "(default 3; 1 with --quick; 0 skips them; at most all intervals)")
    p.add_argument("--deep-metrics", type=_metric_list, default=None,
                   help="degree report: the metrics under which S<=9 and the guided full "
                        "similarity are estimated (default: every one of --metrics; heldout "
                        "with --quick)")
    p.add_argument("--degree-samples", type=positive_int, default=None,
                   help="degree report: Monte Carlo directions of S<=9 per pair (default 1000; "
                        "300 with --quick)")
    p.add_argument("--guided-samples", type=positive_int, default=None,
                   help="degree report: samples of the guided full similarity per pair "
                        "(default 2000; 1000 with --quick)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="attention blocks (default 2: the degree report, exact S<=1 and S<=5 "
                        "with S<=9 and the guided full similarity by Monte Carlo; 1 gives the "
                        "exact one-layer audit; 4 or more overflow at initialisation)")
    p.add_argument("--d-model", type=positive_int, default=None, help="residual width (default 16)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default 2)")
    p.add_argument("--d-head", type=positive_int, default=None, help="head size (default 4)")
    p.add_argument("--n-ctx", type=positive_int, default=None, help="context length (default 8)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps (default 3000; 500 with --quick)")
    p.add_argument("--checkpoints", type=positive_int, default=None,
                   help="checkpoints on the log schedule (default 32; 10 with --quick)")
    p.add_argument("--chars", type=positive_int, default=None,
                   help="corpus size in characters (default 200000; 60000 with --quick)")
    p.add_argument("--mc-pairs", type=int, default=None,
                   help="pairs of an exact or closure matrix re-estimated by Monte Carlo (default 3; 2 with --quick)")
    p.add_argument("--mc-samples", type=positive_int, default=None,
                   help="Monte Carlo samples per checked pair of an exact or closure matrix: "
                        "directions, radius integrated exactly (default 20000; 4000 with "
                        "--quick)")
    p.add_argument("--mc-matrix-samples", type=positive_int, default=None,
                   help="Monte Carlo directions shared by all pairs of the Monte Carlo matrix "
                        "(two or more layers, or --method montecarlo; default 4000, 1200 with "
                        "--quick)")
    p.add_argument("--no-closure", action="store_true",
                   help="with the Monte Carlo matrix: skip the moment-closure (approximate) "
                        "column shown beside it (default off: the column is shown)")
    _shared(p, "seed for initialisation, batches and Monte Carlo samples")
    p.set_defaults(func=cmd_language, own_threads=True)


def cmd_language(args) -> int:
    from .language import LanguageConfig, language_table, run_language

    kw = dict(seed=args.seed, method=args.method, metric=args.metric)
    for opt, key in (("layers", "n_layers"), ("d_model", "d_model"), ("heads", "n_heads"),
                     ("d_head", "d_head"), ("n_ctx", "n_ctx"), ("steps", "steps"),
                     ("checkpoints", "checkpoints"), ("chars", "n_chars"),
                     ("mc_pairs", "mc_pairs"), ("mc_samples", "mc_samples"),
                     ("mc_matrix_samples", "mc_matrix_samples"), ("metrics", "metrics"),
                     ("deep_pairs", "deep_pairs"), ("deep_metrics", "deep_metrics"),
                     ("degree_samples", "degree_samples"),
                     ("guided_samples", "guided_samples")):
        if getattr(args, opt) is not None:
            kw[key] = getattr(args, opt)
    if args.no_closure:
        kw["closure"] = False
    cfg = LanguageConfig.quick(**kw) if args.quick else LanguageConfig(**kw)
    cfg.validate()
    out = check_paths(args, "runs/language")
    apply_threads(args)
    t0 = time.perf_counter()
    result = run(args, "audit language",
                 lambda: run_language(cfg, out, show_progress=not args.no_progress,
                                      json_copy=args.json))
    header = (f"tensoralg audit language: bilinear transformer on Python stdlib text "
              f"({'quick' if args.quick else 'full'} size, {time.perf_counter() - t0:.1f} s)\n")
    return report(args, result, language_table, header, json_written=True)


def _samples(args) -> int:
    """``--n-samples`` of an audit (refused with a method that draws none), or its default."""
    from .common import MC_SAMPLES

    check_n_samples_used(args.n_samples, args.method)
    return MC_SAMPLES if args.n_samples is None else args.n_samples


def cmd_backdoor(args, demo: bool = False) -> int:
    from .backdoor import BackdoorConfig, backdoor_table, run_backdoor

    name = "demo" if demo else "audit backdoor"
    kw = dict(target=args.target, poison_fraction=args.poison_fraction, seed=args.seed,
              method=args.method, n_layers=args.layers, d_model=args.d_model,
              d_hidden=args.d_hidden, n_samples=_samples(args), metric=args.metric,
              data=args.data)
    if args.steps:
        kw["steps"] = args.steps
    if args.finetune_steps:
        kw["finetune_steps"] = args.finetune_steps
    if getattr(args, "finetune_checkpoints", None):
        kw["finetune_checkpoints"] = args.finetune_checkpoints
    cfg = BackdoorConfig.quick(**kw) if args.quick else BackdoorConfig(**kw)
    cfg.validate()
    seeds = None if demo else _seed_list(args)
    out = check_paths(args, "runs/demo" if demo else "runs/backdoor")
    apply_threads(args)
    t0 = time.perf_counter()
    if seeds is not None:
        from .backdoor import backdoor_seeds_table, run_backdoor_seeds

        result = run(args, name, lambda: run_backdoor_seeds(
            cfg, seeds, out, show_progress=not args.no_progress, json_copy=args.json))
        header = (f"tensoralg {name}: backdoor audit on {_data_name(cfg.data)}, {len(seeds)} seeds "
                  f"({'quick' if args.quick else 'full'} size, {time.perf_counter() - t0:.1f} s)\n")
        return report(args, result, backdoor_seeds_table, header, json_written=True)
    result = run(args, name, lambda: run_backdoor(cfg, out, show_progress=not args.no_progress,
                                                  json_copy=args.json))
    header = (f"tensoralg {name}: backdoor audit on {_data_name(cfg.data)} "
              f"({'quick' if args.quick else 'full'} size, {time.perf_counter() - t0:.1f} s)\n")
    return report(args, result, backdoor_table, header, json_written=True)


def _data_name(spec: str) -> str:
    return "scikit-learn digits" if spec == "digits" else spec


def cmd_demo(args) -> int:
    args.target, args.poison_fraction, args.layers = 9, 0.1, 1
    args.d_model, args.d_hidden, args.steps, args.finetune_steps = 32, 64, None, None
    args.finetune_checkpoints = None
    args.quick, args.data = True, "digits"
    return cmd_backdoor(args, demo=True)


def cmd_forgetting(args) -> int:
    from .forgetting import ForgettingConfig, forgetting_table, run_forgetting

    kw = dict(removed_class=args.removed_class, seed=args.seed, method=args.method,
              n_layers=args.layers, n_samples=_samples(args), metric=args.metric,
              data=args.data)
    if args.stage_steps:
        kw["stage_steps"] = args.stage_steps
    if args.checkpoints_per_stage:
        kw["per_stage"] = args.checkpoints_per_stage
    cfg = ForgettingConfig.quick(**kw) if args.quick else ForgettingConfig(**kw)
    cfg.validate()
    seeds = _seed_list(args)
    out = check_paths(args, "runs/forgetting")
    apply_threads(args)
    if seeds is not None:
        from .forgetting import forgetting_seeds_table, run_forgetting_seeds

        result = run(args, "audit forgetting", lambda: run_forgetting_seeds(
            cfg, seeds, out, show_progress=not args.no_progress, json_copy=args.json))
        return report(args, result, forgetting_seeds_table, json_written=True)
    result = run(args, "audit forgetting",
                 lambda: run_forgetting(cfg, out, show_progress=not args.no_progress,
                                        json_copy=args.json))
    return report(args, result, forgetting_table, json_written=True)


def cmd_grokking(args) -> int:
    from .grokking import GrokkingConfig, grokking_table, run_grokking

    kw = dict(seed=args.seed, method=args.method, n_samples=_samples(args), metric=args.metric)
    for name in ("P", "steps", "checkpoints", "train_fraction"):
        if getattr(args, name):
            kw[name] = getattr(args, name)
    if args.paper_size:
        clash = [f for f, v in (("--quick", args.quick), ("--P", args.P),
                                ("--train-fraction", args.train_fraction)) if v]
        if clash:
            raise ValueError(f"--paper-size sets P = 113 and 30% of the pairs trained: drop "
                             f"{' and '.join(clash)}")
        cfg = GrokkingConfig.paper(**kw)
    else:
        cfg = GrokkingConfig.quick(**kw) if args.quick else GrokkingConfig(**kw)
    cfg.validate()
    seeds = _seed_list(args)
    out = check_paths(args, "runs/grokking")
    if args.paper_size:
        from .grokking import PAPER_SIZE_COST

        print(f"tensoralg audit grokking --paper-size: {PAPER_SIZE_COST}", file=sys.stderr)
    apply_threads(args)
    if seeds is not None:
        from .grokking import grokking_seeds_table, run_grokking_seeds

        result = run(args, "audit grokking", lambda: run_grokking_seeds(
            cfg, seeds, out, show_progress=not args.no_progress, json_copy=args.json))
        return report(args, result, grokking_seeds_table, json_written=True)
    result = run(args, "audit grokking",
                 lambda: run_grokking(cfg, out, show_progress=not args.no_progress,
                                      json_copy=args.json))
    return report(args, result, grokking_table, json_written=True)


def cmd_compare(args) -> int:
    from .compare import compare_table, run_compare

    methods, metrics = args.methods, args.metrics    # lists (argparse type _subset)
    check_n_samples_used(args.n_samples, methods)
    check_paths(args)
    check_checkpoints([args.a, args.b])   # before torch is imported (by apply_threads)
    apply_threads(args)
    result = run(args, "compare", lambda: run_compare(
        args.a, args.b, methods=methods, metrics=metrics, data=args.data,
        n_samples=args.n_samples, seed=args.seed, show_progress=not args.no_progress,
        n_ctx=args.n_ctx))
    code = report(args, result, compare_table, wrote=False)
    if code == 0 and result["results"] and all("error" in r for r in result["results"]):
        print("tensoralg compare: every method was refused (see the notes above)",
              file=sys.stderr)
        return 1
    if code == 0 and result["results"] and all("error" in r or r.get("reliable") is False
                                               for r in result["results"]):
        print("tensoralg compare: no method gave an answer: each was refused or gave no "
              "reliable estimate (see the notes above)", file=sys.stderr)
        return 1
    return code


def cmd_matrix(args) -> int:
    if len(args.checkpoints) < 2:   # before the imports below (torch): seconds
        raise ValueError(f"checkpoints: need at least two, got {len(args.checkpoints)}")
    from .compare import matrix_table, run_matrix
    from .matrix_blocks import cmd_matrix_blocked, wants_blocks

    check_n_samples_used(args.n_samples, args.method)
    if wants_blocks(args):
        return cmd_matrix_blocked(args)

    out = check_paths(args, "runs/matrix")
    check_checkpoints(args.checkpoints)   # before torch is imported (by apply_threads)
    apply_threads(args)
    result = run(args, "matrix", lambda: run_matrix(args.checkpoints, out, method=args.method,
                                                    output=args.output, seed=args.seed,
                                                    n_samples=args.n_samples, json_copy=args.json,
                                                    n_ctx=args.n_ctx))
    return report(args, result, matrix_table, json_written=True)


def _subset(allowed: tuple[str, ...]):
    """argparse type: a comma-separated subset of ``allowed`` (deduplicated, in order), so that
    a bad list is reported with the command's usage line like every other bad option."""
    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        bad = [t for t in items if t not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of "
                                             f"{list(allowed)}, got {text!r}")
        return items
    return parse

