"""Shared pieces of the audits: tensor similarity with a recorded method, stamped outputs
(JSON, CSV, PNG — all written atomically through :mod:`tensoralg.io`), progress bars."""

from __future__ import annotations

import csv
import io
import math
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .._version import __version__
from ..io import atomic_write_bytes, atomic_write_json, atomic_write_text

METHODS = ("auto", "exact", "closure", "montecarlo")


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

    return tqdm(iterable, desc=desc, disable=not enabled, total=total, leave=False)


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
                      output: Any = None) -> tuple[np.ndarray, str]:
    """``tensoralg.similarity_matrix`` (one batched Gram computation) with the method recorded."""
    import tensoralg as ta

    m = resolve_method(method, depth)
    try:
        return np.asarray(ta.similarity_matrix(list(models), method=m, output=output)), m
    except ta.CostTooHigh:
        if method != "auto":
            raise
        return np.asarray(ta.similarity_matrix(list(models), method="montecarlo",
                                               output=output)), "montecarlo"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (floats to 4 decimals)."""
    cells = [[h for h in header]] + [[(f"{v:.4f}" if isinstance(v, float) else str(v))
                                      for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
