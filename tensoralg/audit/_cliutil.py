"""Helpers shared by the audit commands (`tensoralg.audit.cli`) and the blocked ``matrix``
(`tensoralg.audit.matrix_blocks`): argparse types, path checks before any work, the guard
around a long run and the final report. Imports nothing of the command modules (no circle)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def local_workers(text: str) -> int:
    """argparse type of ``--workers``: a positive integer of at most ``os.cpu_count()`` local
    worker processes (refused with the usage line, before any checkpoint is read or any
    worker is started)."""
    from ..blocks import too_many_workers

    v = positive_int(text)
    why = too_many_workers(v)
    if why:
        raise argparse.ArgumentTypeError(why)
    return v


def fraction(text: str) -> float:
    """argparse type: a number in the open interval (0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {v}")
    return v


def mc_samples(text: str) -> int:
    """argparse type of ``--n-samples``: an integer >= ``MC_MIN_SAMPLES`` (so that a bad count
    is reported with the command's usage line, like every other bad option)."""
    from ..strategies.montecarlo import MC_MIN_SAMPLES, MC_REPLICATES

    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or v < MC_MIN_SAMPLES:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= {MC_MIN_SAMPLES} (Monte Carlo splits the directions into "
            f"{MC_REPLICATES} replicates of at least 2), got {text!r}")
    return v


def check_n_samples(n: int | None, option: str = "--n-samples") -> None:
    """Monte Carlo directions: at least ``MC_MIN_SAMPLES`` (the diagnostics split them into
    ``MC_REPLICATES`` replicates of two or more), or None for the command's default."""
    from ..strategies.montecarlo import MC_MIN_SAMPLES, MC_REPLICATES

    if n is not None and n < MC_MIN_SAMPLES:
        raise ValueError(f"{option}: expected an integer >= {MC_MIN_SAMPLES} (Monte Carlo splits "
                         f"the directions into {MC_REPLICATES} replicates of at least 2), got {n}")


def check_n_samples_used(n: int | None, methods) -> None:
    """An explicit ``--n-samples`` with only methods that draw no samples (``exact``,
    ``closure``) is refused: the count would be silently ignored. ``auto`` may fall back to
    Monte Carlo, so it keeps the count."""
    methods = [methods] if isinstance(methods, str) else list(methods)
    if n is not None and not {"auto", "montecarlo"} & set(methods):
        raise ValueError(f"--n-samples {n}: {', '.join(methods)} draws no samples (only "
                         f"montecarlo does, or auto when it falls back to it); drop "
                         f"--n-samples or ask for montecarlo")


def check_checkpoints(paths) -> None:
    """Each checkpoint folder exists and holds ``cfg.json`` and a whole safetensors file (the
    errors loading would give, before any heavy import: `tensoralg.io.check_folder`)."""
    from ..io import check_folder

    for p in paths:
        check_folder(p)


def check_paths(args, default_out: str | None = None) -> Path | None:
    """Validate ``--json`` (really writable: a probe file is created and deleted next to it) and
    ``--out`` before any work."""
    from .common import check_file_writable, check_folder_path

    if getattr(args, "json", None) is not None:
        check_file_writable(args.json, "--json")
    if default_out is None:
        return None
    return check_folder_path(default_out if args.out is None else args.out, "--out")


def run(args, name: str, fn):
    """``fn()``'s result, or an exit code (int) with the failures of a long run turned into one
    line: an over-budget exact method (reworded with the CLI options, exit 2), diverged training (exit 1), Ctrl-C (exit
    130; output folders are only ever replaced by complete runs, so nothing is half-written)."""
    from ..errors import CostTooHigh, TrainingDiverged

    try:
        return fn()
    except CostTooHigh as exc:
        from .common import reason_text

        why = reason_text(str(exc))
        if getattr(args, "metric", "gaussian") == "frobenius":   # no estimate to suggest
            raise ValueError(why) from None
        raise ValueError(f"--method {getattr(args, 'method', 'exact')}: {why}; use --method "
                         f"montecarlo (an estimate with its standard error and reliability "
                         f"verdict) or --method closure (the moment-closure similarity: fast, "
                         f"APPROXIMATE beyond depth 1)") from None
    except TrainingDiverged as exc:
        print(f"tensoralg {name}: error: {exc}; nothing was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tensoralg {name}: interrupted; no output was changed", file=sys.stderr)
        return 130


def apply_threads(args=None) -> None:
    """``--threads`` (default `tensoralg.threads.DEFAULT_THREADS`) applied to torch and BLAS."""
    from ..threads import DEFAULT_THREADS, set_threads

    set_threads(getattr(args, "threads", DEFAULT_THREADS))


def report(args, result, table, header: str = "", wrote: bool = True,
           json_written: bool = False) -> int:
    """A handler's exit code: `run`'s code for a refused/interrupted run, else write
    ``--json`` (unless the staged run already wrote it before its swap: ``json_written``), print
    the table (and the files written) and return 0."""
    if isinstance(result, int):
        return result
    if not json_written and args.json:
        from .common import write_json

        write_json(args.json, result)
    if header:
        print(header)
    print(table(result))
    if wrote:
        print(f"\nwrote {', '.join(str(Path(result['out']) / f) for f in result['files'])}")
    return 0
