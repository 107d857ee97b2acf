"""``tensoralg sae`` sub-commands: ``train``, ``stability``, ``bench``, ``activations``.

Heavy imports (torch, matplotlib, transformers) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import sys

from ..threads import add_threads_option

__all__ = ["add_parsers", "add_evaluate_parser"]

PRESET_NAMES = ("topk", "abstopk", "isae", "isae-me", "isae-me-dl")
#: Help of every ``--json`` here (as the other commands': missing folders created, as for --out).
JSON_HELP = ("also write {} as JSON to PATH (a file path; missing folders on the way are "
             "created, as for --out; checked before any work; default: none)")


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


def _check_json(args) -> None:
    """``--json`` really writable (`tensoralg.audit.common.check_file_writable`); before
    any work and before torch is imported."""
    if getattr(args, "json", None):
        from ..audit.common import check_file_writable
        check_file_writable(args.json, "--json")


def _check_npy(path, flag: str) -> None:
    """The cheap part of
    [`tensoralg.sae.training.as_activations`][tensoralg.sae.training.as_activations] (a .npy file
    that exists), before torch is imported; the contents are checked when it is read."""
    from pathlib import Path

    if path is None:
        return
    if not Path(path).exists():
        raise FileNotFoundError(f"{flag}: {path}: no such file")
    if Path(path).suffix != ".npy":
        raise ValueError(f"{flag}: expected a .npy file of shape (n, d), got {path}")


def _check_folder(path, flag: str) -> None:
    """A folder holding a readable ``cfg.json`` (`tensoralg.io.read_config`), before
    torch is imported; the weights are checked when it is loaded."""
    from ..io import read_config

    if path is None:
        return
    try:
        read_config(path)
    except (OSError, ValueError) as exc:
        raise type(exc)(f"{flag}: {exc}") from None


def _threads(args) -> None:
    """``--threads`` applied (torch imported) once the paths and options are checked."""
    from ..audit._cliutil import apply_threads
    apply_threads(args)


def _check_int(value, flag: str, low: int, what: str = "") -> None:
    if value is not None and value < low:
        raise ValueError(f"{flag}: expected an int >= {low}{what}, got {value}")


def _check_out(out) -> None:
    """``sae train --out`` must be missing, an empty folder, or an earlier SAE checkpoint folder
    (its ``cfg.json`` names ``d_sae``), so that training never writes into (and a later run
    never replaces) a folder of other files. An earlier run there is continued in place when it
    is the ``--resume`` folder, and otherwise replaced as a whole once the new run completes
    (`_replaces_earlier_run`), so a folder never mixes two runs' files. Checked before any
    work; creates nothing.

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


# TrainConfig / train() arguments set from `sae train` flags: their errors name the flag
_TRAIN_FLAGS = ("steps", "batch_size", "lr", "seed", "ckpt_every", "lr_warmup_steps", "lr_decay",
                "lr_end", "grad_clip", "rip_warmup_steps", "auxk_warmup_steps", "normalize",
                "dead_tokens", "log_every", "resume", "device", "autocast", "tensorboard",
                "wandb", "wandb_project")


def _as_flag_error(exc: ValueError) -> ValueError:
    """``exc`` with a leading ``name:`` of a `_TRAIN_FLAGS` argument (e.g. ``batch_size:``)
    written as the flag (``--batch-size:``); other messages unchanged."""
    msg = str(exc)
    name = msg.split(":", 1)[0]
    if name in _TRAIN_FLAGS:
        msg = "--" + name.replace("_", "-") + msg[len(name):]
    return ValueError(msg)


def _replaces_earlier_run(out, resume) -> bool:
    """Whether ``sae train --out`` holds an earlier run (see `_check_out`) that this run
    replaces as a whole: any non-empty ``--out`` that is not the ``--resume`` folder itself."""
    from pathlib import Path

    out = Path(out)
    if not out.is_dir() or not any(out.iterdir()):
        return False
    return resume is None or Path(resume).resolve() != out.resolve()


def _eval_fvu(model, data, n_max: int = 8192) -> tuple[float, int]:
    """FVU (the training loss's ``recon`` term) of ``model`` on the first ``n_max`` rows."""
    import numpy as np
    import torch

    rows = data.sample(n_max) if hasattr(data, "sample") else data[:n_max]
    x = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.array(rows, dtype=np.float64))
    x = x.to(device=model.W_dec.device, dtype=model.W_dec.dtype)
    with torch.no_grad():
        return float(model.loss(x)["recon"]), int(x.shape[0])


# `sae train` flags recorded in a run's cfg.json: (flag, args attribute, cfg.json key, default
# of a new run, whether a resumed run may change it freely). Their argparse default is None, so
# that a flag the user did not type takes the resumed run's value.
_RECORDED_FLAGS = (
    ("--steps", "steps", "train_steps", 2000, True),       # the target: continuing extends it
    ("--batch-size", "batch_size", "train_batch_size", 256, False),
    ("--lr", "lr", "train_lr", 1e-3, False),
    ("--lr-warmup-steps", "lr_warmup_steps", "train_lr_warmup_steps", 0, False),
    ("--lr-decay", "lr_decay", "train_lr_decay", "constant", False),
    ("--lr-end", "lr_end", "train_lr_end", 0.0, False),
    ("--grad-clip", "grad_clip", "train_grad_clip", 0.0, False),
    ("--rip-warmup-steps", "rip_warmup_steps", "train_rip_warmup_steps", 0, False),
    ("--auxk-warmup-steps", "auxk_warmup_steps", "train_auxk_warmup_steps", 0, False),
    ("--dead-tokens", "dead_tokens", "train_dead_tokens", None, False),
    ("--seed", "seed", "train_seed", 0, False),
    ("--data-seed", "data_seed", "data_seed", 0, False),
    ("--log-every", "log_every", "train_log_every", 50, True),     # bookkeeping only
    ("--ckpt-every", "ckpt_every", "train_ckpt_every", 0, True),   # bookkeeping only
    ("--autocast", "autocast", "train_autocast", None, False),
    ("--device", "device", "train_device", "cpu", True),           # where, not what
    ("--tensorboard", "tensorboard", "train_tensorboard", False, True),
    ("--wandb", "wandb", "train_wandb", False, True),
    ("--wandb-project", "wandb_project", "train_wandb_project", "tensoralg-sae", True),
    # the streamed source (--model): a resumed run must read the same batches
    ("--model", "model", "stream_model", None, False),
    ("--hook", "hook", "stream_hook", None, False),
    ("--hook-point", "hook_point", "stream_hook_point", "output", False),
    ("--tokens", "tokens", "stream_tokens", None, False),
    ("--context-size", "context_size", "stream_context_size", None, False),
    ("--buffer-size", "buffer_size", "stream_buffer_size", 65_536, False),
    ("--forward-batch", "forward_batch", "stream_forward_batch", None, False),
    ("--vocab-size", "vocab_size", "stream_vocab_size", None, False),
)


def _recorded_normalize(saved: dict) -> str:
    if saved.get("normalize_activations") == "layer_norm":
        return "layer_norm"
    return "expected_norm" if saved.get("train_normalize") == "expected_norm" else "none"


def _resolve_train_flags(args) -> list[str]:
    """Fill the ``sae train`` flags the user did not give: from the ``--resume`` run's
    ``cfg.json`` (its recorded training config), else the defaults of a new run. A flag given
    with another value than the resumed run's is refused naming both values, unless
    ``--override`` (then the given value wins and is recorded; one note per flag is returned);
    ``--steps``, ``--log-every`` and ``--ckpt-every`` may change freely. ``--synthetic`` must
    describe the same data as the run's. Before any work (reads only ``cfg.json``).

    Raises:
        ValueError: a conflicting flag without ``--override``; ``--override`` without
            ``--resume``.
    """
    notes = []
    if args.resume is None:
        if args.override:
            raise ValueError("--override: only with --resume (it lets a flag replace the "
                             "resumed run's recorded value)")
        for _flag, attr, _key, default, _free in _RECORDED_FLAGS:
            if getattr(args, attr) is None:
                setattr(args, attr, default)
        if args.normalize is None:
            args.normalize = "none"
        return notes
    from ..io import read_config

    saved = read_config(args.resume)
    recorded = [(flag, attr, saved.get(key, default), free)
                for flag, attr, key, default, free in _RECORDED_FLAGS]
    recorded.append(("--normalize", "normalize", _recorded_normalize(saved), False))
    if args.synthetic is not None and str(saved.get("data", "")).startswith("synthetic"):
        s = args.synthetic
        spec = f"synthetic d={s['d']} m={s['m']} k={s['k']} n={s['n']} noise={s['noise']}"
        if spec != saved["data"]:
            if not args.override:
                raise ValueError(f"--synthetic: {spec} differs from the resumed run's "
                                 f"{saved['data']} ({args.resume}); omit the difference, or give "
                                 f"--override to train on other data")
            notes.append(f"--synthetic {spec} replaces the resumed run's {saved['data']} "
                         f"(--override)")
    for flag, attr, have, free in recorded:
        given = getattr(args, attr)
        if given is None:
            setattr(args, attr, have)
        elif given != have and not free:
            if not args.override:
                raise ValueError(f"{flag}: {given} differs from the resumed run's {have} "
                                 f"({args.resume}/cfg.json); omit it to continue that run, or "
                                 f"give --override to change it")
            notes.append(f"{flag} {given} replaces the resumed run's {have} (--override)")
    return notes


def _check_preset_flags(args) -> None:
    """Refuse ``sae train`` flags that the architecture ignores (before any work): ``--n-steps``
    without a multi-step encoder, ``--rip-beta`` / ``--rip-warmup-steps`` without the aRIP
    penalty. The architecture is the preset's (``--preset``, default isae-me) or, with
    ``--resume``, the run's recorded one."""
    if args.resume is not None:      # its cfg.json's flat SAE fields (read without torch)
        from ..io import read_config
        saved = read_config(args.resume)
        what = f"the resumed run ({args.resume})"
        encoder = "multistep" if str(saved.get("architecture", "")).startswith(
            "tensoralg_multistep_") else saved.get("encoder", "single")
        rip = saved.get("rip", "none") if saved.get("rip_beta", 0) else "none"
    else:
        from .presets import PRESETS
        preset = args.preset or "isae-me"
        what = f"preset {preset!r}"
        encoder = PRESETS[preset].get("encoder", "single")
        rip = PRESETS[preset].get("rip", "none")
    multi = [p for p in PRESET_NAMES if _preset_field(p, "encoder") == "multistep"]
    with_rip = [p for p in PRESET_NAMES if _preset_field(p, "rip") not in (None, "none")]
    if args.n_steps is not None and encoder != "multistep":
        raise ValueError(f"--n-steps: {what} has a single-step encoder, which has no refinement "
                         f"steps to set (--n-steps is for the multi-step presets {multi})")
    if rip == "none":
        # --rip-beta given at all, --rip-warmup-steps other than its default 0: ignored
        for flag, ignored in (("--rip-beta", args.rip_beta is not None),
                              ("--rip-warmup-steps", bool(args.rip_warmup_steps))):
            if ignored:
                raise ValueError(f"{flag}: {what} has no aRIP penalty, so {flag} would be "
                                 f"ignored (the aRIP presets are {with_rip})")


def _preset_field(preset: str, field: str):
    from .presets import PRESETS
    return PRESETS[preset].get(field)


def _resumed_config(args, d_in: int):
    """The SAE config of the ``--resume`` folder; explicit --preset/--d-sae/--k/--rip-beta/
    --n-steps/--normalize must agree with it (one-line error naming the flag otherwise)."""
    from ..io import read_config
    from .formats import sae_config_from_cfg

    saved = read_config(args.resume)
    try:
        cfg = sae_config_from_cfg(saved, f"--resume: {args.resume}/cfg.json")
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    checks = (("--d-sae", args.d_sae, cfg.d_sae), ("--k", args.k, cfg.k),
              ("--rip-beta", args.rip_beta, cfg.rip_beta), ("--n-steps", args.n_steps, cfg.n_steps),
              ("--preset", args.preset, saved.get("preset", args.preset)))
    for flag, given, have in checks:
        if given is not None and given != have:
            raise ValueError(f"{flag}: {given} differs from the resumed run's {have} "
                             f"({args.resume}); omit it to continue that run")
    if cfg.d_in != d_in:
        raise ValueError(f"--resume: {args.resume} has d_in={cfg.d_in}, the data has {d_in} "
                         f"columns")
    return cfg, saved.get("preset", "(resumed)")


def _summary_lines(model, out) -> list[str]:
    s = getattr(model, "train_summary", {}) or {}
    if "fvu" not in s:
        return []
    rate = f"{s['samples_per_s']:,.0f} samples/s" if s.get("samples_per_s") else "-"
    lines = [f"summary: {s['steps_run']} steps run ({s['tokens']:,} samples seen in all) in "
             f"{s['seconds']:.1f} s ({rate})",
             f"  last log window (to step {s['step']}): FVU {s['fvu']:.4f} (explained variance "
             f"{s['explained_variance']:.4f}), L0 {s['l0']:.2f}, dead latents "
             f"{s['dead_latents']}/{model.cfg.d_sae} (not fired in {s['dead_tokens']:,} samples), "
             f"lr {s['lr']:.3g}, grad norm {s['grad_norm']:.3g}"]
    if s.get("activation_scale", 1.0) != 1.0:
        lines.append(f"  activations were scaled by {s['activation_scale']:.6g} in training "
                     f"(E|x|^2 = d_in); the saved SAE has it folded in and takes raw activations")
    lines.append(f"  log: {out}/train_log.jsonl; feature density: {out}/feature_density.png")
    return lines


_STREAM_ONLY = (("--hook", "hook"), ("--hook-point", "hook_point"), ("--tokens", "tokens"),
                ("--context-size", "context_size"), ("--buffer-size", "buffer_size"),
                ("--forward-batch", "forward_batch"), ("--vocab-size", "vocab_size"))


def _check_stream_flags(args, typed=()) -> None:
    """The ``--model`` source's flags, before any work: ``--hook`` given, the stream-only flags
    not typed (``typed``: their attribute names) without ``--model``, sizes positive,
    ``--tokens`` an integer .npy of sequences (read by `tensoralg.sae.streaming.load_tokens`:
    shape, dtype and, with ``--vocab-size``, the id range)."""
    if args.model is None:
        for flag, attr in _STREAM_ONLY:
            if attr in typed:
                raise ValueError(f"{flag}: only with --model (it sets the streamed source)")
        return
    if args.hook is None:
        raise ValueError("--hook: required with --model (the submodule whose activation is "
                         "learned, e.g. blocks.0 or hook_resid.1)")
    for flag, value in (("--buffer-size", args.buffer_size), ("--forward-batch", args.forward_batch),
                        ("--context-size", args.context_size), ("--vocab-size", args.vocab_size),
                        ("--d-in", args.d_in)):
        _check_int(value, flag, 1)
    if args.tokens not in (None, "corpus"):
        from .streaming import load_tokens
        load_tokens(args.tokens, args.context_size, args.vocab_size, "--tokens")


def _open_stream(args):
    """The `ActivationStream` of ``--model/--hook/--tokens`` (checks in order: the model loads,
    the hook exists (available names listed), the token ids fit the model's vocabulary, one
    forward pass of one sequence gives one row per token of width ``--d-in``); each error one
    line naming the flag."""
    from .hooks import get_submodule
    from .streaming import (
        ActivationStream,
        check_token_ids,
        corpus_tokens,
        load_model_spec,
        load_tokens,
        model_vocab_size,
    )

    model = load_model_spec(args.model, "--model")
    try:
        get_submodule(model, args.hook)
    except ValueError as exc:
        raise ValueError("--hook: " + str(exc).split(": ", 1)[1]) from None
    hp = getattr(model, "hparams", None)
    vocab = args.vocab_size if args.vocab_size is not None else model_vocab_size(model)
    if args.tokens in (None, "corpus"):
        n_ctx = hp.get("n_ctx") if isinstance(hp, dict) else None
        if args.tokens is None and type(model).__name__ != "BilinearTransformer":
            raise ValueError(f"--tokens: required for a {type(model).__name__} (the offline "
                             f"corpus is the default only for a tensoralg BilinearTransformer)")
        ctx = args.context_size or n_ctx
        if ctx is None:
            raise ValueError("--context-size: required with --tokens corpus for a model that "
                             "records no n_ctx")
        tokens, dataset = corpus_tokens(ctx)
        check_token_ids(tokens, vocab, "--tokens", "the corpus")
    else:
        tokens = load_tokens(args.tokens, args.context_size, vocab, "--tokens")
        dataset = str(args.tokens)
    try:
        stream = ActivationStream(model, args.hook, tokens, point=args.hook_point,
                                  buffer_size=args.buffer_size, seed=args.seed,
                                  forward_batch=args.forward_batch, device=args.device,
                                  vocab_size=vocab,
                                  metadata={"model_name": args.model, "dataset_path": dataset})
    except ValueError as exc:
        msg = str(exc)
        for name, flag in (("buffer_size", "--buffer-size"), ("forward_batch", "--forward-batch"),
                           ("hook", "--hook"), ("tokens", "--tokens")):
            if msg.startswith(name + ":"):
                msg = flag + msg[len(name):]
        raise ValueError(msg) from None
    except (RuntimeError, TypeError, IndexError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"--model: a forward pass of {args.model} on one sequence of --tokens "
                         f"{tuple(tokens[:1].shape)} failed ({type(exc).__name__}: {first})"
                         ) from None
    if args.d_in is not None and args.d_in != stream.d_in:
        raise ValueError(f"--d-in: {args.d_in}, but the {args.hook_point} of {args.hook!r} in "
                         f"{args.model} has width {stream.d_in}")
    if args.batch_size > stream.rows:
        raise ValueError(f"--batch-size: {args.batch_size} exceeds the buffer of {stream.rows} "
                         f"rows (--buffer-size {args.buffer_size}, whole sequences of "
                         f"{stream.context_size} tokens); raise --buffer-size or lower "
                         f"--batch-size")
    return stream


def _cmd_train(args) -> int:
    from pathlib import Path

    from ..io import save_folder

    _check_folder(args.resume, "--resume")
    typed = {attr for _flag, attr in _STREAM_ONLY if getattr(args, attr) is not None}
    notes = _resolve_train_flags(args)
    if sum(x is not None for x in (args.data, args.synthetic, args.model)) != 1:
        raise ValueError("give exactly one of --data X.npy, --synthetic d,m,k[,n[,noise]] or "
                         "--model MODULE:FACTORY --hook NAME (with --resume: the run's --model "
                         "is taken when none of them is given)")
    _check_stream_flags(args, typed)
    _check_preset_flags(args)
    _check_int(args.steps, "--steps", 0, " (0: write the initialized, untrained SAE)")
    _check_int(args.seed, "--seed", 0)
    _check_int(args.data_seed, "--data-seed", 0)
    _check_int(args.d_sae, "--d-sae", 1)
    for flag, value in (("--lr-warmup-steps", args.lr_warmup_steps), ("--log-every", args.log_every),
                        ("--rip-warmup-steps", args.rip_warmup_steps),
                        ("--auxk-warmup-steps", args.auxk_warmup_steps),
                        ("--dead-tokens", args.dead_tokens), ("--ckpt-every", args.ckpt_every)):
        _check_int(value, flag, 1 if flag in ("--log-every", "--dead-tokens") else 0)
    if (args.data is not None or args.model is not None) and args.resume is None and \
            (args.d_sae is None or args.k is None):
        missing = " and ".join(f for f, v in (("--d-sae", args.d_sae), ("--k", args.k)) if v is None)
        src = "--data" if args.data is not None else "--model"
        raise ValueError(f"{missing}: required with {src} (the data fixes only d_in), unless "
                         f"--resume gives them")
    s = args.synthetic
    if args.resume is None:
        d_sae = args.d_sae if args.d_sae is not None else s["m"]
        k = args.k if args.k is not None else s["k"]
        if not 1 <= k <= d_sae:
            raise ValueError(f"--k: expected 1 <= k <= d_sae={d_sae}, got {k}")
    _check_npy(args.data, "--data")
    _check_out(args.out)
    # a run never writes into another run's folder: an --out holding an earlier run (other than
    # the --resume folder, continued in place) is replaced as a whole once this run completes
    staged = _replaces_earlier_run(args.out, args.resume)
    if staged:
        from ..audit.common import check_output_folder
        check_output_folder(args.out, "cfg.json")     # e.g. refuses --out . (it is replaced)
    _check_json(args)
    for note in notes:
        print(f"note: {note}")
    _threads(args)
    from .presets import make_config
    from .synthetic import make_synthetic
    from .training import TrainConfig, TrainingDiverged, as_activations, check_variance, train

    try:
        tcfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                           seed=args.seed, ckpt_every=args.ckpt_every,
                           progress=not args.no_progress,
                           lr_warmup_steps=args.lr_warmup_steps, lr_decay=args.lr_decay,
                           lr_end=args.lr_end, grad_clip=args.grad_clip,
                           rip_warmup_steps=args.rip_warmup_steps,
                           auxk_warmup_steps=args.auxk_warmup_steps,
                           normalize="expected_norm" if args.normalize == "expected_norm" else "none",
                           dead_tokens=args.dead_tokens, log_every=args.log_every,
                           device=args.device, autocast=args.autocast,
                           tensorboard=bool(args.tensorboard), wandb=bool(args.wandb),
                           wandb_project=args.wandb_project)
    except ValueError as exc:
        raise _as_flag_error(exc) from None
    if s is not None:
        syn = make_synthetic(s["n"], s["d"], s["m"], s["k"], noise=s["noise"], seed=args.data_seed)
        data, d_in = syn.x, s["d"]
        meta = {"data": f"synthetic d={s['d']} m={s['m']} k={s['k']} n={s['n']} noise={s['noise']}",
                "data_seed": args.data_seed}
    elif args.model is not None:
        data = _open_stream(args)
        d_in = data.d_in
        meta = {"data": f"stream: {args.model} at {args.hook} ({args.hook_point}) on "
                        f"{data.metadata['dataset_path']}",
                "metadata": dict(data.metadata),
                **{key: getattr(args, attr) for _f, attr, key, _d, _free in _RECORDED_FLAGS
                   if key.startswith("stream_")}}
    else:
        from .hooks import read_activation_metadata
        data = as_activations(args.data, "--data")
        check_variance(data, "--data")
        d_in = int(data.shape[1])
        if args.d_in is not None and args.d_in != d_in:
            raise ValueError(f"--d-in: {args.d_in}, but --data {args.data} has {d_in} columns")
        meta = {"data": str(args.data), "metadata": read_activation_metadata(args.data)}
    if args.resume is not None:
        sae_cfg, preset = _resumed_config(args, d_in)
        d_sae, k = sae_cfg.d_sae, sae_cfg.k
    else:
        preset = args.preset or "isae-me"
        overrides = {}
        if args.rip_beta is not None:
            overrides["rip_beta"] = args.rip_beta
        if args.n_steps is not None:
            overrides["n_steps"] = args.n_steps
        if args.normalize == "layer_norm":
            overrides["normalize_activations"] = "layer_norm"
        sae_cfg = make_config(preset, d_in, d_sae, k, **overrides)
    meta["preset"] = preset
    from dataclasses import replace

    from .presets import PRESETS, schedule
    if preset in PRESETS:   # the preset's training schedule (resampling, encoder phases), if any
        tcfg = replace(tcfg, **schedule(preset, tcfg.steps))

    def run_into(folder):
        try:
            result = train(data, sae_cfg, tcfg, out=folder, resume=args.resume, meta=meta)
        except ValueError as exc:
            raise _as_flag_error(exc) from None
        if s is not None:
            save_folder(Path(folder) / "ground_truth", {"W_dec": syn.W_dec},
                        {"d_in": d_in, "d_sae": s["m"], "k": s["k"], "kind": "ground_truth", **meta})
        return result

    stage = None
    try:
        if staged:
            from ..audit.common import staged_output
            with staged_output(args.out, "cfg.json") as stage:
                model, hist = run_into(stage)
        else:
            model, hist = run_into(args.out)
    except TrainingDiverged as exc:
        msg = str(exc)
        if stage is not None:   # the staged run was discarded; --out keeps the earlier run
            msg = (msg.replace(f"the last good checkpoint is {stage}", "its checkpoints were "
                               "discarded")
                   .replace(f"nothing was kept in {stage} (no SAE, no log)", "nothing was kept")
                   + f"; {args.out} still holds the earlier run, unchanged")
        print(f"tensoralg sae train: error: {msg}", file=sys.stderr)
        return 1
    step = tcfg.steps
    if hist:
        fvu, how = hist[-1]["recon"], f"mean over the last {min(args.log_every, tcfg.steps)} steps' batches"
        what = f"trained {preset} SAE"
    else:   # no optimizer step ran (--steps 0, or a resume already at --steps): evaluate it
        fvu, n_eval = _eval_fvu(model, data)
        how = f"first {n_eval} samples"
        if args.steps == 0 and args.resume is None:
            what = f"initialized (untrained, --steps 0) {preset} SAE"
        else:   # a resumed run at or past --steps: report the step it is really at
            from ..io import read_config
            step = read_config(args.out)["train_step"]
            what = (f"{preset} SAE (already at step {step}, --steps {args.steps}: nothing to "
                    f"train)")
    print(f"{what} d_in={d_in} d_sae={d_sae} k={k}: step {step}, fvu {fvu:.4f} ({how}) "
          f"-> {args.out}")
    for line in _summary_lines(model, args.out) if hist else []:
        print(line)
    if args.json:
        _write_json(args.json, _stamp({"history": hist, "fvu": fvu, "fvu_on": how,
                                       "summary": getattr(model, "train_summary", {}),
                                       "sae_cfg": sae_cfg.to_dict(), "out": str(args.out)}, args))
    return 0


def _cmd_stability(args) -> int:
    _check_int(args.seed, "--seed", 0)
    _check_int(args.max_samples, "--max-samples", 1)
    _check_folder(args.run_a, "RUN_A")
    _check_folder(args.run_b, "RUN_B")
    _check_npy(args.data, "--data")
    _check_folder(args.ground_truth, "--ground-truth")
    _check_json(args)
    _threads(args)
    import numpy as np
    import torch

    from tensoralg.verify.identifiability import compare, random_baseline

    from ..io import read_config
    from .models import rip_constants
    from .training import as_activations, load_sae

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
        # latents that fire on none of the --data samples
        res["dead_on_data_a"] = int((~(z_a != 0).any(dim=0)).sum())
        res["dead_on_data_b"] = int((~(z_b != 0).any(dim=0)).sum())
        res["data_samples"] = int(x.shape[0])
    saved = {}
    for tag, run in (("a", args.run_a), ("b", args.run_b)):
        saved[tag] = read_config(run)
        if "train_dead_latents" in saved[tag]:   # at the run's last checkpoint, its own threshold
            res[f"train_dead_latents_{tag}"] = saved[tag]["train_dead_latents"]
            res[f"train_dead_tokens_{tag}"] = saved[tag].get("train_dead_tokens")
    res["warnings"] = shared_randomness(saved["a"], saved["b"], a, b)
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
        if key == "warnings":
            continue
        print(f"{key:>12s}: {val:.4f}" if isinstance(val, float) else f"{key:>12s}: {val}")
    for msg in res["warnings"]:
        print(f"tensoralg sae stability: warning: {msg}", file=sys.stderr)
    if args.json:
        _write_json(args.json, _stamp(res, args))
    return 0


def shared_randomness(cfg_a: dict, cfg_b: dict, sae_a=None, sae_b=None) -> list[str]:
    """Why two runs' agreement would not measure identifiability: the same weights, the same
    initialization seed, or the same batch order (same ``train_seed`` and batch size on the same
    data), read from their ``cfg.json`` (``train_seed``, ``train_init_seed``,
    ``train_batch_size``, ``data``, ``data_seed``; folders without them, e.g. SAELens's, give
    nothing). One message per finding; ``[]`` when the runs are independent or unknown."""
    import torch

    out = []
    if sae_a is not None and sae_b is not None and \
            sae_a.W_dec.shape == sae_b.W_dec.shape and torch.equal(sae_a.W_dec, sae_b.W_dec):
        out.append("RUN_A and RUN_B have identical decoders (the same SAE twice?): their "
                   "agreement is 1 by construction")

    def init(c):
        return c.get("train_init_seed") if c.get("train_init_seed") is not None \
            else c.get("train_seed")

    if "train_seed" in cfg_a and "train_seed" in cfg_b:
        if init(cfg_a) == init(cfg_b):
            out.append(f"RUN_A and RUN_B share the initialization seed {init(cfg_a)}: their "
                       f"agreement measures determinism, not identifiability (train them "
                       f"with different --seed)")
        same_data = (cfg_a.get("data"), cfg_a.get("data_seed")) == \
            (cfg_b.get("data"), cfg_b.get("data_seed"))
        if cfg_a["train_seed"] == cfg_b["train_seed"] and same_data and \
                cfg_a.get("train_batch_size") == cfg_b.get("train_batch_size"):
            out.append(f"RUN_A and RUN_B share the batch order (seed {cfg_a['train_seed']}, "
                       f"batch size {cfg_a.get('train_batch_size')}, same data): part of their "
                       f"agreement is the shared batches, not identifiability")
    return out


def _cmd_bench(args) -> int:
    overrides = {k: getattr(args, k) for k in ("d", "m", "k", "steps", "lr", "n_train", "batch_size")
                 if getattr(args, k) is not None}
    for flag, value in (("--seed", args.seed), ("--data-seed", args.data_seed)):
        _check_int(value, flag, 0)
    _check_int(args.steps, "--steps", 1, " (the bench compares trained SAEs; 0 trains nothing)")
    if args.out:   # the audits' rules: new, empty, or an earlier `sae bench` output; before any work
        from ..audit.common import check_output_folder
        check_output_folder(args.out, "bench.json")
    _check_npy(args.data, "--data")
    _check_json(args)
    _threads(args)
    from .bench import format_table, run_bench

    r = run_bench(args.presets, quick=args.quick, seeds=args.seeds, data=args.data, out=args.out,
                  seed=args.seed, data_seed=args.data_seed, eval_fraction=args.eval_fraction,
                  progress=not (args.no_progress or args.quiet),
                  log=(lambda *a: None) if args.quiet else print, **overrides)
    print(format_table(r))
    if args.out:
        print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    if args.json:
        _write_json(args.json, _stamp(r, args))
    return 0


_MINILM_ONLY = (("--max-texts", "max_texts", 2000), ("--max-tokens", "max_tokens", 64),
                ("--batch-size", "batch_size", 32))
_TRANSFORMER_ONLY = (("--checkpoint", "checkpoint"), ("--chars", "chars"),
                     ("--windows", "windows"), ("--train-steps", "train_steps"),
                     ("--save-checkpoint", "save_checkpoint"), ("--seed", "seed"),
                     ("--dtype", "dtype"))


def _check_activations_paths(args) -> None:
    """``--out`` (a writable .npy path, as ``sae train``/``bench`` read), ``--save-checkpoint``
    (new) and ``--json``, before torch is imported (the extraction checks them again)."""
    from pathlib import Path

    from ..audit.common import check_file_writable, check_folder_path

    if Path(args.out).suffix != ".npy" or Path(args.out).is_dir():
        raise ValueError(f"--out: expected a .npy file path (sae train/bench read .npy), got "
                         f"{args.out}")
    check_file_writable(args.out, "--out")
    if args.save_checkpoint is not None:
        check_folder_path(args.save_checkpoint, "--save-checkpoint")
        if Path(args.save_checkpoint).exists():
            raise ValueError(f"--save-checkpoint: {args.save_checkpoint} exists; give a new path")
    _check_json(args)


def _cmd_activations(args) -> int:
    _check_activations_paths(args)
    if args.source == "transformer":
        return _cmd_activations_transformer(args)
    from .activations import extract_activations, real_extra_available

    given = [flag for flag, key in _TRANSFORMER_ONLY if getattr(args, key) is not None]
    if given:
        raise ValueError(f"{given[0]}: only for --source transformer (the MiniLM source takes "
                         f"--layer, --max-texts, --max-tokens, --batch-size)")
    for _flag, key, default in _MINILM_ONLY:
        if getattr(args, key) is None:
            setattr(args, key, default)
    _check_json(args)
    ok, why = real_extra_available()
    if not ok:    # one line through the CLI's error handler, not an ImportError traceback
        raise ValueError(f"the optional extra is missing: {why}")
    _threads(args)
    layer = 3 if args.layer is None else args.layer
    info = extract_activations(args.out, layer=layer, max_texts=args.max_texts,
                               max_tokens=args.max_tokens, batch_size=args.batch_size)
    print(f"wrote {info['shape'][0]} x {info['shape'][1]} activations of layer {info['layer']} "
          f"({info['model']}) -> {args.out}")
    if args.json:
        _write_json(args.json, _stamp(info, args))
    return 0


def _cmd_activations_transformer(args) -> int:
    from .transformer_acts import DEFAULT_CHARS, extract_transformer_activations

    given = [flag for flag, key, _ in _MINILM_ONLY if getattr(args, key) is not None]
    if given:
        raise ValueError(f"{given[0]}: only for --source minilm (the transformer source reads "
                         f"held-out windows of the model's context length; see --windows)")
    if args.checkpoint is not None:
        for flag, key in (("--train-steps", "train_steps"), ("--save-checkpoint", "save_checkpoint")):
            if getattr(args, key) is not None:
                raise ValueError(f"{flag}: trains a model here, which --checkpoint "
                                 f"{args.checkpoint} replaces; give one or the other")
    _check_int(args.train_steps, "--train-steps", 1)
    _check_int(args.seed, "--seed", 0)
    _check_int(args.windows, "--windows", 1)
    _check_folder(args.checkpoint, "--checkpoint")
    _check_json(args)
    _threads(args)
    train = {"steps": args.train_steps} if args.train_steps is not None else None
    try:
        info = extract_transformer_activations(
            args.out, args.checkpoint, args.layer,
            n_chars=DEFAULT_CHARS if args.chars is None else args.chars, n_windows=args.windows,
            seed=0 if args.seed is None else args.seed, train=train,
            save_checkpoint_to=args.save_checkpoint, dtype=args.dtype or "float32")
    except ValueError as exc:   # name the CLI's flags, not the function's arguments
        msg = str(exc)
        for arg, flag in (("checkpoint:", "--checkpoint:"), ("layer:", "--layer:"),
                          ("n_windows:", "--windows:"), ("n_chars:", "--chars:"),
                          ("out:", "--out:"), ("save_checkpoint_to:", "--save-checkpoint:")):
            if msg.startswith(arg):
                msg = flag + msg[len(arg):]
                break
        raise ValueError(msg) from None
    except FileNotFoundError as exc:
        msg = str(exc)
        raise FileNotFoundError(msg.replace("checkpoint:", "--checkpoint:", 1)
                                if msg.startswith("checkpoint:") else msg) from None
    m = info["model"]
    how = (f"checkpoint {m['checkpoint']} (step {m['step']})" if not m["trained_here"] else
           f"a model trained here ({m['config']['steps']} steps, final train loss "
           f"{m['final_train_loss']:.3f}" + (f", saved to {m['saved_to']}" if "saved_to" in m
                                             else "") + ")")
    print(f"wrote {info['shape'][0]} x {info['shape'][1]} residual-stream activations "
          f"({info['layer_meaning']}, layer {info['layer']} of {info['n_layers']}) of "
          f"{info['n_windows']} held-out windows of {info['n_ctx']} tokens, from {how} -> "
          f"{args.out} (+ .json)")
    print(f"held-out text: {info['held_out']}")
    if args.json:
        _write_json(args.json, _stamp(info, args))
    return 0


def add_parsers(sub) -> None:
    """Add the ``sae`` command (sub-commands train / stability / bench / activations) to ``sub``."""
    p = sub.add_parser("sae", help="identifiable sparse autoencoders",
                       description="Identifiable sparse autoencoders: train, compare runs, benchmark.")
    ss = p.add_subparsers(dest="sae_command", metavar="SAE_COMMAND")
    ss.required = True

    t = ss.add_parser("train", help="train an SAE on a .npy of activations, activations "
                                    "streamed from a live model, or synthetic data")
    t.add_argument("--preset", choices=PRESET_NAMES, default=None,
                   help="architecture preset (default isae-me; with --resume: the resumed run's); "
                        "isae-me-dl also brings its training schedule (dead-latent resampling, "
                        "single-step encoder for the first 88 %% of --steps)")
    t.add_argument("--data", help="(n, d) float .npy of activations (memory-mapped); default: none, "
                                  "give this or --synthetic")
    t.add_argument("--synthetic", type=_synthetic_spec, metavar="d,m,k[,n[,noise]]",
                   help="train on synthetic data with a ground-truth dictionary (saved to "
                        "OUT/ground_truth); n defaults to 8192, noise to 0")
    t.add_argument("--model", metavar="MODULE:FACTORY",
                   help="stream the activations from a live model instead of a file: "
                        "MODULE:FACTORY (an importable module or a .py path, and a function "
                        "returning a torch.nn.Module; e.g. "
                        "tensoralg.sae.streaming:quick_transformer, the project's offline "
                        "transformer) or a tensoralg transformer checkpoint folder; needs --hook "
                        "(default: none)")
    t.add_argument("--hook", metavar="NAME",
                   help="with --model: the submodule (a name of model.named_modules()) whose "
                        "output is learned (required with --model; default: none); an unknown "
                        "name is refused listing the available ones, before any forward pass")
    t.add_argument("--hook-point", choices=("output", "input"), default=None,
                   help="with --model: read the hook's output or its first input (default output)")
    t.add_argument("--tokens", metavar="PATH",
                   help="with --model: integer .npy of token ids, (n_seq, context) or a 1-D "
                        "stream cut by --context-size; ids checked against the model's "
                        "vocabulary; default for a tensoralg transformer: 'corpus', the train "
                        "split of the offline corpus in windows of its n_ctx")
    t.add_argument("--context-size", type=int, default=None,
                   help="tokens per sequence for a 1-D --tokens (default: the file's second "
                        "dimension; for --tokens corpus the model's n_ctx)")
    t.add_argument("--buffer-size", type=int, default=None,
                   help="with --model: activation rows per shuffled buffer refill, rounded down "
                        "to whole sequences (default 65536); memory is this times d_in floats")
    t.add_argument("--forward-batch", type=int, default=None,
                   help="with --model: sequences per forward pass when refilling (default: "
                        "8192 // context size, about 8192 tokens)")
    t.add_argument("--vocab-size", type=int, default=None,
                   help="with --model: token ids must be below this (default: the model's "
                        "vocabulary, when it declares one)")
    t.add_argument("--d-in", type=int, default=None,
                   help="expected activation width; refused when the data or the hook's "
                        "activation has another (default: not checked)")
    t.add_argument("--data-seed", type=int, default=None,
                   help="seed of the --synthetic data (default 0; with --resume: the run's); "
                        "drawn from a stream independent of --seed's, so equal numbers never "
                        "give equal draws")
    t.add_argument("--d-sae", type=int, help="number of latents (default: m of --synthetic; with "
                                             "--resume: the resumed run's)")
    t.add_argument("--k", type=int, help="active latents per sample (default: k of --synthetic; "
                                         "with --resume: the resumed run's)")
    t.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default 2000; with --resume: the run's target, which "
                        "--steps may raise to continue it); 0 writes the initialized, untrained SAE "
                        "(a baseline) and reports its FVU on the first 8192 samples")
    t.add_argument("--batch-size", type=int, default=None,
                   help="samples per step (default 256)")
    t.add_argument("--lr", type=float, default=None,
                   help="peak AdamW learning rate (default 1e-3)")
    t.add_argument("--lr-warmup-steps", type=int, default=None,
                   help="linear lr warmup over this many steps (default 0: none)")
    t.add_argument("--lr-decay", choices=("constant", "linear", "cosine"), default=None,
                   help="lr decay after warmup, down to --lr-end at the last step (default constant)")
    t.add_argument("--lr-end", type=float, default=None,
                   help="final lr of a linear or cosine decay (default 0)")
    t.add_argument("--grad-clip", type=float, default=None,
                   help="clip the global gradient norm to this value (default 0: no clipping)")
    t.add_argument("--rip-warmup-steps", type=int, default=None,
                   help="raise the aRIP weight linearly from 0 over this many steps (default 0; "
                        "refused for a preset without aRIP)")
    t.add_argument("--auxk-warmup-steps", type=int, default=None,
                   help="raise the AuxK weight linearly from 0 over this many steps (default 0)")
    t.add_argument("--normalize", choices=("none", "expected_norm", "layer_norm"), default=None,
                   help="activation normalization (default none): expected_norm scales the data to "
                        "E|x|^2 = d_in in training and folds the scale into the saved SAE; "
                        "layer_norm normalizes each row (saved as SAELens's layer_norm)")
    t.add_argument("--dead-tokens", type=int, default=None,
                   help="a latent is reported dead when it has not fired on this many samples "
                        "(default: min(10,000,000, n), the TopK paper's 10M tokens)")
    t.add_argument("--log-every", type=int, default=None,
                   help="write a record to OUT/train_log.jsonl every N steps (default 50)")
    t.add_argument("--seed", type=int, default=None,
                   help="seed of the initial weights and batch order (default 0)")
    t.add_argument("--rip-beta", type=float, help="override the preset's aRIP weight (default: the "
                                                  "preset's, 0.1 for isae and isae-me; refused "
                                                  "for a preset without aRIP)")
    t.add_argument("--n-steps", type=int, help="override the multi-step encoder's T (default: the "
                                               "preset's, 5 for isae-me and isae-me-dl; refused "
                                               "for a single-step preset)")
    t.add_argument("--ckpt-every", type=int, default=None,
                   help="checkpoint every N steps (default 0: at the end only)")
    t.add_argument("--resume", help="checkpoint folder to continue from (default: none); the SAE "
                                    "config (preset, --d-sae, --k) and the training flags "
                                    "(--lr, --batch-size, --seed, ...; the defaults above are "
                                    "for a new run) are taken from it, and a flag that "
                                    "contradicts them is refused unless --override")
    t.add_argument("--device", default=None,
                   help="torch device to train on, e.g. cuda or cuda:1 (default cpu; checked "
                        "before any work)")
    t.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                   help="run the forward pass and loss under torch.autocast in this dtype "
                        "(weights and AdamW stay float32; float16 adds a gradient scaler); "
                        "default: none, the SAE's own dtype")
    t.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write the log records as TensorBoard scalars to OUT/tensorboard/ "
                        "(needs the tensorboard package; default: off)")
    t.add_argument("--wandb", action="store_true", default=None,
                   help="also log the records to Weights & Biases (needs the wandb package: pip "
                        "install 'tensoralg[wandb]'; files under OUT/wandb/; set "
                        "WANDB_MODE=offline to keep the run local; default: off)")
    t.add_argument("--wandb-project", default=None,
                   help="the W&B project of --wandb (default tensoralg-sae)")
    t.add_argument("--override", action="store_true",
                   help="with --resume: let the training flags given replace the run's recorded "
                        "values (default: a conflicting flag is an error)")
    t.add_argument("--out", required=True,
                   help="checkpoint folder (sae_weights.safetensors + cfg.json, SAELens layout; "
                        "required): new, empty, the --resume folder (continued in place), or "
                        "an earlier SAE checkpoint folder, which is replaced as a whole once "
                        "the run completes (an interrupted or diverged run leaves it as it was)")
    add_threads_option(t)
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar (default: shown; it is hidden anyway when stderr is not "
                        "a terminal)")
    t.add_argument("--json", metavar="PATH",
                   help=JSON_HELP.format("the loss history and summary"))
    t.set_defaults(func=_cmd_train, own_threads=True)

    s = ss.add_parser("stability", help="compare two trained SAEs (DCS, code IoU, code l2, dead "
                                        "latents)")
    s.add_argument("run_a", metavar="RUN_A", help="SAE folder (tensoralg or SAELens layout)")
    s.add_argument("run_b", metavar="RUN_B", help="SAE folder (tensoralg or SAELens layout)")
    s.add_argument("--data", help=".npy of activations to compare the codes on (default: none, "
                                  "dictionaries only)")
    s.add_argument("--max-samples", type=int, default=4096,
                   help="rows of --data used (default 4096)")
    s.add_argument("--ground-truth", help="folder with a ground-truth W_dec (from train "
                                          "--synthetic; default: none)")
    s.add_argument("--seed", type=int, default=0,
                   help="seed of the random-dictionary baseline (random_dcs; default 0)")
    s.add_argument("--json", metavar="PATH", help=JSON_HELP.format("the results"))
    add_threads_option(s)
    s.set_defaults(func=_cmd_stability, own_threads=True)

    b = ss.add_parser("bench", help="train every preset with several seeds and report stability")
    b.add_argument("--quick", action="store_true",
                   help="small sizes, about a minute on CPU (default: the full sizes)")
    b.add_argument("--presets", nargs="+", choices=PRESET_NAMES,
                   help="presets to train (default: the four ablation arms topk, abstopk, "
                        "isae, isae-me)")
    b.add_argument("--seeds", type=int, help="seeds per preset (default 3 quick / 5 full)")
    b.add_argument("--data", help="real activations .npy instead of synthetic data (default: "
                                  "synthetic; the last --eval-fraction rows are held out)")
    b.add_argument("--d", type=int, help="activation dimension of the synthetic data (default 32 "
                                         "quick / 64 full)")
    b.add_argument("--m", type=int, help="latents (default 64 quick / 128 full)")
    b.add_argument("--k", type=int, help="active latents per sample (default 4 quick / 6 full)")
    b.add_argument("--steps", type=int, help="optimizer steps per run (default 600 quick / 4000 full)")
    b.add_argument("--lr", type=float, help="learning rate (default 3e-3 quick / 2e-3 full)")
    b.add_argument("--batch-size", type=int, help="samples per step (default 256)")
    b.add_argument("--n-train", type=int, help="synthetic training samples (default 8192 quick / "
                                               "32768 full)")
    b.add_argument("--eval-fraction", type=float, default=0.2,
                   help="held-out share of --data rows, taken from the end (default 0.2)")
    add_threads_option(b)
    b.add_argument("--out", help="folder for bench.json, bench.md, bench.png (default: none): new, "
                                 "empty, or an earlier `sae bench` output, which is replaced as a "
                                 "whole once the run completes")
    b.add_argument("--json", metavar="PATH", help=JSON_HELP.format("the results"))
    b.add_argument("--seed", type=int, default=0,
                   help="first model seed (seeds --seed, --seed+1, ...; default 0)")
    b.add_argument("--data-seed", type=int, default=12345,
                   help="seed of the synthetic train data (eval data: --data-seed + 1; default 12345)")
    b.add_argument("--no-progress", action="store_true",
                   help="no progress bar per training run (default: shown; hidden anyway when "
                        "stderr is not a terminal)")
    b.add_argument("--quiet", action="store_true", help="no per-seed log lines (default: printed)")
    b.set_defaults(func=_cmd_bench, own_threads=True)

    a = ss.add_parser("activations", help="extract real activations: hidden states of "
                                          "all-MiniLM-L6-v2 (optional extra) or the residual "
                                          "stream of a bilinear transformer (offline)")
    a.add_argument("--source", choices=("minilm", "transformer"), default="minilm",
                   help="minilm (default): all-MiniLM-L6-v2 on standard-library docstrings "
                        "(optional extra tensoralg[real]); transformer: the residual stream of a "
                        "tensoralg BilinearTransformer (--checkpoint, or one trained here) on "
                        "held-out standard-library source (tensoralg.corpus)")
    a.add_argument("--out", required=True, help="output .npy (required); the extraction info "
                                                "is written next to it as OUT.json")
    a.add_argument("--layer", type=int, default=None,
                   help="minilm: hidden-state index, 0 = embeddings, 1..6 (default 3); "
                        "transformer: residual stream after block L, 0 = embedding, n_layers = "
                        "final (default: final)")
    a.add_argument("--max-texts", type=int, default=None,
                   help="minilm: standard-library docstring paragraphs (default 2000)")
    a.add_argument("--max-tokens", type=int, default=None,
                   help="minilm: truncation length (default 64)")
    a.add_argument("--batch-size", type=int, default=None,
                   help="minilm: texts per forward pass (default 32)")
    a.add_argument("--checkpoint", default=None,
                   help="transformer: checkpoint folder (weights.safetensors + cfg.json, e.g. "
                        "`audit language`'s checkpoints/step_*); default: train a small one here "
                        "(2 blocks, d_model 32, context 16, ~25 s on one core)")
    a.add_argument("--chars", type=int, default=None,
                   help="transformer: corpus selection size in characters (default 200000, "
                        "~10 %% held out); give the language run's --chars to keep its "
                        "checkpoints' text held out")
    a.add_argument("--windows", type=int, default=None,
                   help="transformer: held-out windows of n_ctx tokens, one row per position "
                        "(default: all of them)")
    a.add_argument("--train-steps", type=int, default=None,
                   help="transformer without --checkpoint: training steps (default 600)")
    a.add_argument("--save-checkpoint", default=None,
                   help="transformer without --checkpoint: save the model trained here to this "
                        "new folder (default: not saved)")
    a.add_argument("--seed", type=int, default=None,
                   help="transformer: seed of the window order and of the model trained here "
                        "(default 0)")
    a.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="transformer: dtype of the .npy (default float32; computed in float64)")
    a.add_argument("--json", metavar="PATH", help=JSON_HELP.format("the extraction info"))
    add_threads_option(a)
    a.set_defaults(func=_cmd_activations, own_threads=True)
    add_evaluate_parser(ss)


def _cmd_evaluate(args) -> int:
    """``sae evaluate``: the SAE spliced into a BilinearTransformer checkpoint at its layer, on
    the held-out corpus windows that ``sae activations --source transformer`` reads (same
    ``--chars`` and ``--seed`` give the same window order); the last ``--eval-fraction`` of
    them are the rows ``sae bench`` holds out."""
    _check_int(args.seed, "--seed", 0)
    if not 0 < args.eval_fraction <= 1:
        raise ValueError(f"--eval-fraction: expected a number in (0, 1], got {args.eval_fraction}")
    _check_folder(args.sae, "--sae")
    _check_folder(args.checkpoint, "--checkpoint")
    _check_json(args)
    _threads(args)
    import numpy as np
    import torch

    from ..audit.language import eval_windows
    from ..corpus import load_corpus
    from .evaluation import evaluate_transformer
    from .formats import load_sae
    from .transformer_acts import DEFAULT_CHARS, load_transformer

    sae = load_sae(args.sae)
    layer = args.layer
    hook = sae.metadata.get("hook_name", "")
    if layer is None:
        if not (isinstance(hook, str) and hook.startswith("hook_resid.")
                and hook[len("hook_resid."):].isdigit()):
            raise ValueError(f"--layer: required (the SAE's metadata names no residual-stream "
                             f"hook_resid.L, got hook_name={hook!r})")
        layer = int(hook[len("hook_resid."):])
    elif isinstance(hook, str) and hook and hook != f"hook_resid.{layer}":
        raise ValueError(f"--layer: {layer} splices at hook_resid.{layer}, but the SAE "
                         f"{args.sae} was trained on hook_name={hook!r} (its cfg.json "
                         f"metadata); omit --layer to evaluate it where it was trained")
    try:
        model, _ = load_transformer(args.checkpoint, layer)
    except (ValueError, FileNotFoundError) as exc:
        raise type(exc)(str(exc).replace("checkpoint:", "--checkpoint:", 1)
                        .replace("layer:", "--layer:", 1)) from None
    n_ctx = model.hparams["n_ctx"]
    corpus = load_corpus(DEFAULT_CHARS if args.chars is None else args.chars)
    count = len(corpus.held_out) // n_ctx
    order = np.random.default_rng(args.seed).permutation(count)
    W = eval_windows(corpus.held_out, n_ctx, count)[order]
    n_eval = max(1, int(round(count * args.eval_fraction)))
    tokens = torch.as_tensor(W[count - n_eval:])
    res = evaluate_transformer(model.float() if sae.W_dec.dtype == torch.float32 else model,
                               sae, layer, tokens, progress=not args.no_progress)
    res.update({"sae": str(args.sae), "checkpoint": str(args.checkpoint), "n_windows": n_eval,
                "windows": f"the last {n_eval} of {count} held-out windows in the order of "
                           f"seed {args.seed}"})
    print(f"SAE {args.sae} spliced at {res['hook_name']} of {args.checkpoint}, {res['n_tokens']} "
          f"predicted tokens of {n_eval} held-out windows:")
    ce, fvu = res["ce_loss_recovered"], res["fvu"]
    print(f"  loss clean {res['loss_clean']:.4f}  spliced {res['loss_spliced']:.4f}  zero "
          f"{res['loss_zero']:.4f} nats/token;  CE loss recovered "
          f"{'n/a' if ce is None else f'{ce:.4f}'};  KL {res['kl_spliced']:.4f};  fvu "
          f"{'undefined (zero-variance activations)' if fvu is None else f'{fvu:.4f}'};  L0 "
          f"{res['l0']:.2f}")
    l2r, bias = res["l2_ratio"], res["relative_reconstruction_bias"]
    print(f"  L2 ratio |x_hat|/|x| {'n/a' if l2r is None else f'{l2r:.4f}'};  relative "
          f"reconstruction bias {'n/a' if bias is None else f'{bias:.4f}'} (1: no shrinkage)")
    if args.json:
        _write_json(args.json, _stamp(res, args))
    return 0


def add_evaluate_parser(ss) -> None:
    """Register ``sae evaluate`` on the ``sae`` subparsers ``ss`` (one call from
    `add_parsers`)."""
    e = ss.add_parser("evaluate", help="splice an SAE into a bilinear transformer at its layer: "
                                       "next-token loss, CE loss recovered, KL on held-out text")
    e.add_argument("--sae", required=True,
                   help="SAE folder (tensoralg or SAELens layout; required)")
    e.add_argument("--checkpoint", required=True,
                   help="BilinearTransformer checkpoint folder (weights.safetensors + cfg.json; "
                        "required)")
    e.add_argument("--layer", type=int, default=None,
                   help="residual stream h_L the SAE reads (default: from the SAE's metadata "
                        "hook_name hook_resid.L; a --layer that contradicts a recorded "
                        "hook_name is refused)")
    e.add_argument("--chars", type=int, default=None,
                   help="corpus selection size (default 200000; as `sae activations --chars`)")
    e.add_argument("--seed", type=int, default=0,
                   help="window order (as `sae activations --seed`; default 0)")
    e.add_argument("--eval-fraction", type=float, default=0.2,
                   help="evaluate on the last fraction of the ordered windows (default 0.2: "
                        "the rows `sae bench` holds out)")
    e.add_argument("--no-progress", action="store_true",
                   help="no progress bar (default: a bar on a terminal)")
    e.add_argument("--json", metavar="PATH", help=JSON_HELP.format("the results"))
    add_threads_option(e)
    e.set_defaults(func=_cmd_evaluate, own_threads=True)
