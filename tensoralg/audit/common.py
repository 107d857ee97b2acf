"""Shared pieces of the audits: tensor similarity with a recorded method, stamped outputs
(JSON, CSV, PNG — all written atomically through :mod:`tensoralg.io`), progress bars."""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .._version import __version__
from ..io import atomic_write_bytes, atomic_write_json, atomic_write_text

METHODS = ("auto", "exact", "closure", "montecarlo")

PATHS_NOTE = "relative to the output folder (the folder holding this JSON)"


def stamp(command: str, config: Mapping[str, Any]) -> dict:
    """Header of every JSON the audits write: version, command, configuration, UTC time."""
    return {"tensoralg_version": __version__, "command": command, "config": dict(config),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def jsonable(obj: Any) -> Any:
    """Numbers and containers as plain JSON (NaN -> None, numpy -> python)."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return None if not math.isfinite(f) else f
    return obj


def write_json(path: str | Path, obj: Mapping[str, Any]) -> Path:
    return atomic_write_json(path, jsonable(obj))


def write_csv(path: str | Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(list(header))
    for row in rows:
        w.writerow([("" if v is None else (f"{v:.10g}" if isinstance(v, float) else v))
                    for v in (jsonable(list(row)))])
    return atomic_write_text(path, buf.getvalue())


def save_figure(fig: Any, path: str | Path) -> Path:
    """PNG through a buffer and an atomic rename; closes the figure."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def progress(iterable: Iterable, desc: str, enabled: bool, total: int | None = None):
    from tqdm.auto import tqdm

    # disable=None: tqdm hides the bar by itself when stderr is not a terminal (logs, CI)
    return tqdm(iterable, desc=desc, disable=None if enabled else True, total=total, leave=False)


# ----------------------------------------------------------------------------------------
# output folders: a run is written into a fresh folder and swapped into place when complete
# ----------------------------------------------------------------------------------------

def check_folder_path(path: str | Path, option: str = "--out") -> Path:
    """Refuse, before any work, a folder path that cannot be created: an existing file, or a
    path below a file. Creates nothing.

    Raises:
        ValueError: naming ``option`` and the offending path.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option}: {path} exists and is not a folder")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option}: {path} cannot be created: {parent} is a file, not a "
                                 f"folder")
            break
    return path


def check_file_path(path: str | Path, option: str = "--json") -> Path:
    """Refuse, before any work, a file path that cannot be written: an existing folder, or a path
    below a file. Creates nothing.

    Raises:
        ValueError: naming ``option`` and the offending path.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option}: {path} is a folder; expected a file path (e.g. "
                         f"{path / 'result.json'})")
    check_folder_path(path.parent, option)
    return path


def check_output_folder(out: str | Path, json_name: str) -> Path:
    """``out`` may be missing, an empty folder, or the complete output of an earlier run of the
    same audit (it holds ``json_name``); anything else is refused so that a run never deletes
    files it did not write.

    Raises:
        ValueError: ``out`` is a file, lies below a file, is the working folder (or holds it),
            or is a non-empty folder without ``json_name``.
    """
    out = check_folder_path(out, "--out")
    here = Path.cwd().resolve()
    if out.exists() and (out.resolve() == here or out.resolve() in here.parents):
        raise ValueError(f"--out: {out} is the current folder or holds it; a run replaces its "
                         f"output folder as a whole, so choose a subfolder (e.g. {out / 'run'})")
    if out.is_dir() and any(out.iterdir()) and not (out / json_name).is_file():
        raise ValueError(f"--out: {out} is not empty and holds no {json_name} (not an earlier run "
                         f"of this command); choose a new or empty folder, or remove it — a run "
                         f"replaces its output folder as a whole")
    return out


@contextlib.contextmanager
def staged_output(out: str | Path, json_name: str):
    """Write a run into a fresh hidden folder next to ``out`` and swap it into place only when
    the ``with`` block completes.

    Yields the staging folder. On any exception (including ``KeyboardInterrupt``) the staging
    folder is deleted and ``out`` is untouched, so ``out`` always holds one complete run (or
    nothing). On success the previous contents of ``out`` (an earlier run, see
    :func:`check_output_folder`) are replaced as a whole: ``out`` is renamed aside, the new
    folder renamed into place, and the old one deleted. Paths written inside the run must be
    relative to the folder, since it changes name at the end.

    Raises:
        ValueError: ``out`` refused by :func:`check_output_folder`.
    """
    out = check_output_folder(out, json_name).resolve()  # "." has no name to stage next to
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield stage
        # re-check: another process may have filled `out` meanwhile
        check_output_folder(out, json_name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "run")
    os.replace(stage, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def exact_cost_refused(net: Any) -> str | None:
    """Why the exact Gaussian inner product ``<net, net>`` is over budget, or ``None`` if it is
    affordable. Contracts nothing: :func:`tensoralg.plan` counts Wick configurations and
    estimates the FLOPs of the contraction paths (refused when it raises ``CostTooHigh``, marks
    the plan ``refused``, or estimates more than ``tensoralg.network.DEFAULT_MAX_FLOPS``)."""
    import tensoralg as ta
    from tensoralg.network import DEFAULT_MAX_FLOPS

    try:
        plan = ta.plan(net)
    except ta.CostTooHigh as exc:
        return _reason(str(exc))
    if getattr(plan, "refused", None):
        return _reason(plan.refused) if isinstance(plan.refused, str) else "over the exact budget"
    flops = float(getattr(plan, "flops", 0.0))
    if not flops <= DEFAULT_MAX_FLOPS:
        return f"about {flops:.3g} FLOPs, over the {DEFAULT_MAX_FLOPS:.3g} FLOP budget"
    return None


def _reason(text: str) -> str:
    """The core's refusal text without its advice (which names the API, not the CLI)."""
    for cut in ("; use method", ". Alternatives", "Alternatives:"):
        text = text.split(cut)[0]
    return text.strip().rstrip(".;,")


def run_staged(cfg: Any, out: str | Path, json_name: str, depth: int, model: Any,
               runner: Any, show_progress: bool) -> dict:
    """The shared frame of every audit: validate ``cfg``, check ``out``
    (:func:`check_output_folder`), choose the similarity method with the exact cost checked on
    the untrained ``model`` of the configured architecture BEFORE any training
    (:func:`choose_method`), then ``runner(cfg, stage, show_progress, method)`` inside
    :func:`staged_output`, so ``out`` is replaced only by a complete run."""
    cfg.validate()
    final = check_output_folder(out, json_name)
    method = choose_method(cfg.method, depth, model.to_network())
    with staged_output(final, json_name) as stage:
        result = runner(cfg, stage, show_progress, method)
    result["out"] = str(final)
    return result


def choose_method(method: str, depth: int, net: Any) -> str:
    """The similarity method a run will use, decided BEFORE any training from an untrained
    model ``net`` of the configured architecture (the cost depends on sizes only).

    ``auto``: ``exact`` for depth <= 2 when affordable, otherwise ``montecarlo``. ``exact``
    over budget raises (so that no training is wasted). ``closure``/``montecarlo``: as given.

    Raises:
        tensoralg.CostTooHigh: ``method == "exact"`` and the exact cost is refused (the message
            names the API alternatives ``method='closure'`` / ``method='montecarlo'``; the CLI
            rewords it with its options).
    """
    import tensoralg as ta

    m = resolve_method(method, depth)
    if m != "exact":
        return m
    why = exact_cost_refused(net)
    if why is None:
        return m
    if method == "auto":
        return "montecarlo"
    raise ta.CostTooHigh(f"the exact similarity of this depth-{depth} architecture is over budget "
                         f"({why}; planned before any training or contraction); use method='closure' (fast, exact only at depth 1) "
                         f"or method='montecarlo' (an estimate with a standard error)")


def resolve_method(method: str, depth: int) -> str:
    """``auto``: the exact Gaussian inner product for depth <= 2, Monte Carlo beyond.

    The exact method may still refuse a depth-2 model as too costly (``CostTooHigh``); the
    callers then fall back to Monte Carlo and record that in their output.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {list(METHODS)}, got {method!r}")
    if method != "auto":
        return method
    return "exact" if depth <= 2 else "montecarlo"


def pair_similarity(a: Any, b: Any, method: str = "auto", depth: int = 1,
                    norm2_a: Sequence[float] | None = None) -> dict:
    """Global and per-output tensor similarity (Gaussian metric) of two models.

    Three per-output inner-product vectors (``tensoralg.inner(..., output="each")``) give
    everything: slice ``c`` is ``<a_c, b_c> / sqrt(<a_c, a_c> <b_c, b_c>)`` and, since the
    Gaussian inner product sums over outputs (``DESIGN.md`` 3.1, 3.5), the global similarity is
    ``sum_c <a_c, b_c> / sqrt(sum_c <a_c, a_c> * sum_c <b_c, b_c>)`` — three contractions instead
    of six, which matters for exact depth-2 models.

    ``norm2_a``: ``<a_c, a_c>`` per output from an earlier call with the same ``a`` and method
    (skips one contraction). Returns ``{"global", "each", "method", "inner_each",
    "norm2_a_each", "norm2_b_each"}``.
    Under ``auto``, an exact computation refused as too costly (``CostTooHigh``) is redone by
    Monte Carlo and ``method`` says so.
    """
    import tensoralg as ta

    m = resolve_method(method, depth)

    def compute(meth):
        ab = np.asarray(ta.inner(a, b, method=meth, output="each"), dtype=np.float64)
        if norm2_a is not None and meth == m:
            aa = np.asarray(norm2_a, dtype=np.float64)
        else:
            aa = np.asarray(ta.inner(a, a, method=meth, output="each"), dtype=np.float64)
        bb = np.asarray(ta.inner(b, b, method=meth, output="each"), dtype=np.float64)
        return ab, aa, bb

    try:
        ab, aa, bb = compute(m)
    except ta.CostTooHigh:
        if method != "auto":
            raise
        m = "montecarlo"
        ab, aa, bb = compute(m)
    with np.errstate(divide="ignore", invalid="ignore"):
        each = ab / np.sqrt(aa * bb)  # NaN for an identically-zero output (no direction)
    glob = float(ab.sum() / np.sqrt(aa.sum() * bb.sum()))
    return {"global": glob, "each": each.tolist(), "method": m, "inner_each": ab.tolist(),
            "norm2_a_each": aa.tolist(), "norm2_b_each": bb.tolist()}


def similarity_matrix(models: Sequence[Any], method: str = "auto", depth: int = 1,
                      output: Any = None, seed: int = 0) -> tuple[np.ndarray, str]:
    """``tensoralg.similarity_matrix`` (one batched Gram computation) with the method recorded;
    ``seed`` is the Monte Carlo seed (unused by the other methods)."""
    import tensoralg as ta

    m = resolve_method(method, depth)
    mc = {"seed": seed}
    try:
        return np.asarray(ta.similarity_matrix(list(models), method=m, output=output,
                                               **(mc if m == "montecarlo" else {}))), m
    except ta.CostTooHigh:
        if method != "auto":
            raise
        return np.asarray(ta.similarity_matrix(list(models), method="montecarlo",
                                               output=output, **mc)), "montecarlo"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (floats to 4 decimals)."""
    cells = [[h for h in header]] + [[(f"{v:.4f}" if isinstance(v, float) else str(v))
                                      for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
