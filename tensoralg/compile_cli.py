"""``tensoralg import MODULE:FACTORY CKPT --out DIR``: compile a user's torch module (built by
``FACTORY``, weights from ``CKPT``) with [`tensoralg.from_torch`][tensoralg.compile.from_torch] into
a checkpoint folder (``weights.safetensors`` + ``cfg.json``, architecture ``tensoralg_network``)."""

from __future__ import annotations

import argparse
import json

from .threads import add_threads_option


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "import", help="compile a PyTorch module and its state dict into a checkpoint folder",
        description="Build the module with MODULE:FACTORY (FACTORY(**kwargs) returns an "
                    "nn.Module), load CKPT (a torch state dict, .pt/.pth read with "
                    "weights_only=True, or .safetensors) into it, compile it with "
                    "tensoralg.from_torch (verified against its forward pass) and save the "
                    "network to --out.")
    p.add_argument("factory", metavar="MODULE:FACTORY")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint folder to write (required; no default)")
    p.add_argument("--input-shape", required=True, metavar="B,[T,]D",
                   help="example input shape: batch,d (vectors), batch,n_ctx,d (sequences), or "
                        "batch,n_ctx for token ids with --inputs tokens/--tokens (required; no "
                        "default)")
    p.add_argument("--tokens", action="store_true",
                   help="the module reads integer token ids (example: zeros of --input-shape; "
                        "default: real-valued inputs)")
    p.add_argument("--inputs", choices=("residual", "tokens"), default="residual",
                   help="residual (default): the network reads the residual stream; tokens: "
                        "one-hot tokens")
    p.add_argument("--kwargs", default="{}", metavar="JSON",
                   help="keyword arguments for FACTORY as a JSON object (default {})")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write what was imported (folder, architecture, provenance) as "
                        "JSON to PATH (a file path; missing folders on the way are created, as "
                        "for --out; checked before any work; default: none)")
    add_threads_option(p)
    p.set_defaults(func=run_import, own_threads=True)


def _factory(spec: str):
    import importlib
    import os
    import sys

    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ValueError(f"MODULE:FACTORY: expected 'package.module:callable', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod)
    except ImportError as exc:
        raise ValueError(f"MODULE:FACTORY: cannot import {mod!r} ({exc})") from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"MODULE:FACTORY: {mod!r} has no callable {name!r}")
    return fn


def _check_kwargs(fn, kwargs: dict, spec: str) -> None:
    """``FACTORY(**kwargs)`` binds (checked against the signature before the call, so that an
    unknown or missing keyword is named as --kwargs, not as the factory's own TypeError)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):   # no signature to check (a builtin): the call decides
        return
    try:
        sig.bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"--kwargs: {spec} does not take {json.dumps(kwargs)} ({exc}); its "
                         f"parameters are {sig}") from None


def _state_dict(path: str):
    from pathlib import Path

    import torch

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"CKPT: {path}: no such file")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as exc:
            raise ValueError(f"CKPT: {path}: corrupt safetensors file ({exc})") from None
    try:
        sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch's own message is not passed on: it advises weights_only=False, which runs
        # arbitrary code from the file
        raise ValueError(f"CKPT: {path}: corrupt, or not a state dict of tensors "
                         f"(torch.load(weights_only=True) refused it: {type(exc).__name__}); "
                         f"save module.state_dict() with torch.save, or as .safetensors") \
            from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"CKPT: {path}: expected a dict of tensors (a state_dict)")
    return sd


def load_into(module, sd, where: str = "CKPT") -> None:
    """``module.load_state_dict(sd)`` (strict) with a one-line error naming the tensors."""
    own = module.state_dict()
    missing = sorted(set(own) - set(sd))
    extra = sorted(set(sd) - set(own))
    shapes = [f"{k!r} is {tuple(sd[k].shape)} in {where}, {tuple(own[k].shape)} in the module"
              for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or extra or shapes:
        parts = ([f"missing {missing}"] if missing else []) + \
            ([f"unexpected {extra}"] if extra else []) + shapes
        raise ValueError(f"{where}: the state dict does not match the module: "
                         f"{'; '.join(parts)}")
    module.load_state_dict(sd, strict=True)


def _check_out(path: str):
    """``--out`` before any import: a folder that does not exist yet (below folders), an empty
    folder or an earlier checkpoint folder (holding ``cfg.json``), which is overwritten — what
    [`tensoralg.checkpoint.save_checkpoint`][tensoralg.checkpoint.save_checkpoint] writes into
    without removing anything else."""
    from pathlib import Path

    from .audit.common import check_folder_path
    from .io import CONFIG_FILE

    expected = ("expected a folder that does not exist yet, an empty folder or a checkpoint "
                "folder to overwrite")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {path} is an existing file; {expected}")
    if out.is_dir() and any(out.iterdir()) and not (out / CONFIG_FILE).is_file():
        raise ValueError(f"--out: {path} is a folder that is neither empty nor a checkpoint "
                         f"folder (no {CONFIG_FILE}); {expected}")
    return check_folder_path(out, "--out")   # a path below a file


def run_import(args: argparse.Namespace) -> int:
    _check_out(args.out)
    if args.json:
        from .audit.common import check_file_writable

        check_file_writable(args.json, "--json")
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kwargs: not JSON ({exc})") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--kwargs: expected a JSON object")
    try:
        shape = tuple(int(s) for s in args.input_shape.split(","))
    except ValueError:
        raise ValueError(f"--input-shape: expected comma-separated integers, got "
                         f"{args.input_shape!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"--input-shape: sizes must be positive, got {args.input_shape!r}")
    from .audit._cliutil import apply_threads

    apply_threads(args)
    fn = _factory(args.factory)
    import torch

    from .checkpoint import save_checkpoint
    from .compile import from_torch

    _check_kwargs(fn, kwargs, args.factory)
    module = fn(**kwargs)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"MODULE:FACTORY: {args.factory} returned {type(module).__name__}, not "
                        f"a torch.nn.Module")
    load_into(module, _state_dict(args.ckpt))
    tokens = args.tokens or args.inputs == "tokens"
    x = torch.zeros(shape, dtype=torch.int64) if tokens else torch.zeros(shape)
    if not tokens:   # a non-degenerate example (zeros would hide nothing, but look odd)
        x = torch.linspace(-1, 1, int(torch.tensor(shape).prod())).reshape(shape)
    net = from_torch(module, x, inputs=args.inputs)
    path = save_checkpoint(args.out, net, provenance={"source": str(args.ckpt),
                                                      "factory": args.factory,
                                                      "inputs": args.inputs})
    print(f"tensoralg import: {args.factory} + {args.ckpt} -> {path} ({net!r}, verified "
          f"against the module's forward pass)")
    if args.json:
        from ._version import __version__
        from .io import atomic_write_json

        atomic_write_json(args.json, {"tensoralg_version": __version__, "out": str(path),
                                      "factory": args.factory, "ckpt": str(args.ckpt),
                                      "inputs": args.inputs, "input_shape": list(shape),
                                      "network": repr(net), "verified": True})
    return 0
