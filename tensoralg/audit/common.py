"""Shared pieces of the audits: tensor similarity with a recorded method, stamped outputs
(JSON, CSV, PNG — all written atomically through `tensoralg.io`), progress bars."""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..io import atomic_write_bytes, atomic_write_json, atomic_write_text

METHODS = ("auto", "exact", "closure", "montecarlo")

#: The similarity metrics an audit can use (``--metric``): ``gaussian`` (E over x ~ N(0, I),
#: docs/mathematics.md §3.1) and ``frobenius``, the symmetrised Frobenius cosine of the lifted
#: coefficient tensors (§3.3; the metric of the original authors' backdoor and grokking figures;
#: a closed form of the weights, so exact only).
SIM_METRICS = ("gaussian", "frobenius")


def check_metric(metric: str, method: str) -> None:
    """Refuse, before any training, an unknown ``--metric`` or a Frobenius run with a method
    that has no Frobenius value (``closure``, ``montecarlo``).

    Raises:
        ValueError: one line naming ``--metric`` (and ``--method``).
    """
    if metric not in SIM_METRICS:
        raise ValueError(f"--metric: expected one of {', '.join(SIM_METRICS)}, got {metric!r}")
    if metric == "frobenius" and method not in ("auto", "exact"):
        raise ValueError(f"--metric frobenius: the symmetrised Frobenius cosine is a closed form "
                         f"of the weights, computed exactly; --method {method} has none (use "
                         f"--method exact or auto)")

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
    """Refuse, before any work, a folder path that cannot be created: an empty string, an
    existing file, a path below a file, or one whose nearest existing folder refuses a new
    file (a probe file is created and deleted there; e.g. ``/proc``, a read-only mount).

    Raises:
        ValueError: naming ``option`` and the offending path.
    """
    if str(path) == "":
        raise ValueError(f"{option}: expected a folder path, got an empty string")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option}: {path} exists and is not a folder")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option}: {path} cannot be created: {parent} is a file, not a "
                                 f"folder")
            break
    _probe(path.parent, path, option)   # the staged output is a sibling folder, renamed
    return path


def _probe(folder: Path, path: Path, option: str) -> None:
    """Create and delete a temporary file in the nearest existing folder on the way to
    ``folder`` (permission bits and ``os.access`` say nothing for root, read-only mounts or
    ``/proc``), so that a run never works for minutes and then fails writing its result."""
    folder = folder.resolve()
    while not folder.exists():
        folder = folder.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name or 'out'}.probe-", suffix=".tmp",
                                     dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{option}: cannot write {path}: creating a file in {folder} failed "
                         f"({exc.strerror or exc})") from None


def check_file_path(path: str | Path, option: str = "--json") -> Path:
    """Refuse, before any work, a file path that cannot be written: an existing folder, or a path
    below a file. Creates nothing: missing folders on the way are created when the file is
    written (as for ``--out``).

    Raises:
        ValueError: naming ``option`` and the offending path.
    """
    if str(path) == "":
        raise ValueError(f"{option}: expected a file path, got an empty string")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option}: {path} is a folder; expected a file path (e.g. "
                         f"{path / 'result.json'})")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option}: {path} cannot be created: {parent} is a file, not "
                                 f"a folder")
            break
    return path


def check_file_writable(path: str | Path, option: str = "--json") -> Path:
    """`check_file_path`, then prove that the file can really be created: a temporary file
    is created and deleted in the nearest existing folder on the way to ``path`` (permission
    bits and ``os.access`` say nothing for root, read-only mounts or ``/proc``). Called before
    any work, so that a run never trains for minutes and then fails writing its result.

    Raises:
        ValueError: naming ``option``, the folder and the operating system's reason.
    """
    path = check_file_path(path, option)
    _probe(path.parent, path, option)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    `check_output_folder`) are replaced as a whole: ``out`` is renamed aside, the new
    folder renamed into place, and the old one deleted. Paths written inside the run must be
    relative to the folder, since it changes name at the end. The folder gets the usual mode
    (``0o777`` less the umask), not the ``0o700`` of `tempfile.mkdtemp`.

    Raises:
        ValueError: ``out`` refused by `check_output_folder`.
    """
    out = check_output_folder(out, json_name).resolve()  # "." has no name to stage next to
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield stage
        # re-check: another process may have filled `out` meanwhile
        check_output_folder(out, json_name)
        os.chmod(stage, 0o777 & ~_umask())
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


def exact_cost_refused(net: Any, n_ctx: int | None = None,
                       metric: str = "gaussian") -> str | None:
    """Why the exact Gaussian inner product ``<net, net>`` is over budget, or ``None`` if it is
    affordable. Contracts nothing: [`tensoralg.plan`][tensoralg.plan] counts Wick configurations and
    estimates the FLOPs of the contraction paths (refused when it raises ``CostTooHigh``, marks
    the plan ``refused``, or estimates more than ``tensoralg.request.DEFAULT_MAX_FLOPS``).
    ``n_ctx``: the sequence length of a sequence network (None for others); ``metric``: the
    metric planned (``gaussian`` or ``frobenius``)."""
    import tensoralg as ta
    from tensoralg.request import DEFAULT_MAX_FLOPS

    try:
        plan = (ta.plan(net, metric=metric) if n_ctx is None
                else ta.plan(net, metric=metric, n_ctx=n_ctx))
    except ta.CostTooHigh as exc:
        return reason_text(str(exc))
    if getattr(plan, "refused", None):
        return reason_text(plan.refused) if isinstance(plan.refused, str) else "over the exact budget"
    flops = float(getattr(plan, "flops", 0.0))
    if not flops <= DEFAULT_MAX_FLOPS:
        return f"about {flops:.3g} FLOPs, over the {DEFAULT_MAX_FLOPS:.3g} FLOP budget"
    return None


def reason_text(text: str) -> str:
    """The core's refusal text without its advice (which names the API, not the CLI)."""
    for cut in ("; use method", ". Alternatives", "Alternatives:"):
        text = text.split(cut)[0]
    return text.strip().rstrip(".;,")


def write_json_copy(json_copy: str | Path, result: Mapping[str, Any], final: Path,
                    stage: Path) -> Path:
    """Write the ``--json`` copy of ``result`` while the run is still staged, so that a failure
    here leaves the previous run untouched. A path inside the final folder ``final`` is written
    at the same place inside ``stage`` (it becomes part of the run that is swapped in)."""
    path = Path(json_copy)
    try:
        rel = path.resolve().relative_to(Path(final).resolve())
    except ValueError:
        return write_json(path, result)
    return write_json(stage / rel, result)


# the --data spec (torch-free, one definition shared with tensoralg.data)
from .._dataspec import check_data_spec  # noqa: E402


def data_info(spec: str, seed: int = 0) -> tuple[int, tuple[int, int, int]]:
    """``(n_classes, (H, W, C))`` of an audit's ``--data``: the digits' ``(10, (8, 8, 1))``
    without loading them, or an npz file's, read and checked
    (`tensoralg.data.audit_data`; the run reuses the read).

    Raises:
        ValueError: a bad ``--data`` (one line naming it).
    """
    if check_data_spec(spec) == "digits":   # torch is not imported for the digits' sizes
        return 10, (8, 8, 1)
    from ..data import audit_data

    d = audit_data(spec, seed)
    return d.n_classes, d.image_shape


def run_staged(cfg: Any, out: str | Path, json_name: str, depth: int, model: Any,
               runner: Any, show_progress: bool, json_copy: str | Path | None = None) -> dict:
    """The shared frame of every audit: validate ``cfg``, check ``out``
    (`check_output_folder`) and ``json_copy`` (`check_file_writable`), choose the
    similarity method with the exact cost checked on the untrained ``model`` of the configured
    architecture BEFORE any training (`choose_method`), then
    ``runner(cfg, stage, show_progress, method)`` inside `staged_output`, then the
    ``json_copy`` (`write_json_copy`) — all before the swap, so ``out`` is replaced only
    by a complete run and a late failure leaves the previous run untouched."""
    cfg.validate()
    final = check_output_folder(out, json_name)
    if json_copy is not None:
        check_file_writable(json_copy, "--json")
    method = choose_method(cfg.method, depth, model.to_network(),
                           metric=getattr(cfg, "metric", "gaussian"))
    with staged_output(final, json_name) as stage:
        result = runner(cfg, stage, show_progress, method)
        result["out"] = str(final)
        if json_copy is not None:
            write_json_copy(json_copy, result, final, stage)
    return result


def choose_method(method: str, depth: int, net: Any, n_ctx: int | None = None,
                  metric: str = "gaussian") -> str:
    """The similarity method a run will use, decided BEFORE any training from an untrained
    model ``net`` of the configured architecture (the cost depends on sizes only).

    ``auto``: ``exact`` for depth <= 2 when affordable, otherwise ``montecarlo``. ``exact``
    over budget raises (so that no training is wasted). ``closure``/``montecarlo``: as given.
    ``metric="frobenius"`` (a closed form of the weights): always ``exact`` at any depth, and
    over budget raises whatever ``method`` says (there is no Frobenius estimate to fall back on).

    Raises:
        tensoralg.CostTooHigh: ``method == "exact"`` and the exact cost is refused (the message
            names the API alternatives ``method='closure'`` / ``method='montecarlo'``; the CLI
            rewords it with its options).
    """
    import tensoralg as ta

    check_metric(metric, method)
    m = "exact" if metric == "frobenius" else resolve_method(method, depth)
    if m != "exact":
        return m
    why = exact_cost_refused(net, n_ctx, metric)
    if why is None:
        return m
    if method == "auto" and metric == "gaussian":
        return "montecarlo"
    if metric == "frobenius":
        raise ta.CostTooHigh(f"--metric frobenius: the exact Frobenius similarity of this "
                             f"depth-{depth} architecture is over budget ({why}; planned before "
                             f"any training); the Frobenius metric has no estimate to fall back "
                             f"on: use a smaller architecture or --metric gaussian")
    raise ta.CostTooHigh(f"the exact similarity of this depth-{depth} architecture is over budget "
                         f"({why}; planned before any training or contraction); use "
                         f"method='montecarlo' (an estimate with a standard error and "
                         f"reliability verdict) or method='closure' (the moment-closure "
                         f"similarity: fast, APPROXIMATE beyond depth 1)")


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


MC_SAMPLES = 100_000   # default Monte Carlo sample count of the audits

#: How the closure is labelled wherever an audit, compare or matrix shows it: it is the
#: moment-closure similarity, APPROXIMATE at depth >= 2 (docs/mathematics.md §3.2, §3.9).
CLOSURE_LABEL = "moment-closure (approximate)"


def method_label(method: str) -> str:
    """The method as shown in tables, titles and figures: the closure labelled approximate."""
    return CLOSURE_LABEL if method == "closure" else method


def pair_similarity(a: Any, b: Any, method: str = "auto", depth: int = 1,
                    norm2_a: Sequence[float] | None = None, n_samples: int = MC_SAMPLES,
                    seed: int = 0, metric: str = "gaussian") -> dict:
    """Global and per-output tensor similarity of two models under ``metric`` (``gaussian``, or
    ``frobenius``: the symmetrised Frobenius cosine, docs/mathematics.md §3.3, exact only —
    ``auto`` then means exact at any depth, with no Monte Carlo fallback).

    Exact / closure: three per-output inner-product vectors (``tensoralg.inner(...,
    output="each")``) give everything: slice ``c`` is ``<a_c, b_c> / sqrt(<a_c, a_c> <b_c,
    b_c>)`` and, since the Gaussian inner product sums over outputs (``docs/gaussian_inner_product.md``),
    the global similarity is ``sum_c <a_c, b_c> / sqrt(sum_c <a_c, a_c> * sum_c <b_c, b_c>)``
    — three contractions instead of six, which matters for exact depth-2 models.
    ``norm2_a``: ``<a_c, a_c>`` per output from an earlier call with the same ``a`` and method
    (skips one contraction).

    Monte Carlo: ``tensoralg.similarity(a, b, method="montecarlo", output="each")`` and the
    global ``tensoralg.similarity(a, b, method="montecarlo")`` with ``n_samples`` Gaussian
    inputs drawn with ``seed``: ratio estimates with delta-method standard errors (an
    approximation, accurate when the standard error is small against the norms).

    Returns ``{"global", "each", "method", "global_stderr", "each_stderr", "n_samples",
    "seed", "inner_each", "norm2_a_each", "norm2_b_each"}`` (Monte Carlo adds
    ``"global_reliable"`` and ``"global_reason"``: the global estimate's verdict; an unreliable
    ``"global"`` is the [`MonteCarloEstimate`][tensoralg.MonteCarloEstimate], which never formats as
    a number; and ``"each_reliable"`` / ``"each_reason"``: each slice's verdict); the stderr
    entries, ``n_samples`` and ``seed`` are ``None`` and the inner products are present only for
    the deterministic methods. Under ``auto``, an exact computation refused as too costly
    (``CostTooHigh``) is redone by Monte Carlo and ``method`` says so.
    """
    import tensoralg as ta

    check_metric(metric, method)
    m = "exact" if metric == "frobenius" else resolve_method(method, depth)

    def compute(meth):
        kw = {"method": meth, "output": "each", "metric": metric}
        ab = np.asarray(ta.inner(a, b, **kw), dtype=np.float64)
        if norm2_a is not None and meth == m:
            aa = np.asarray(norm2_a, dtype=np.float64)
        else:
            aa = np.asarray(ta.inner(a, a, **kw), dtype=np.float64)
        bb = np.asarray(ta.inner(b, b, **kw), dtype=np.float64)
        return ab, aa, bb

    if m != "montecarlo":
        try:
            ab, aa, bb = compute(m)
        except ta.CostTooHigh:
            if method != "auto" or metric != "gaussian":
                raise
            m = "montecarlo"
    if m == "montecarlo":
        kw = {"method": "montecarlo", "n_samples": n_samples, "seed": seed}
        each = ta.similarity(a, b, output="each", **kw)
        glob = ta.similarity(a, b, **kw)
        # the global estimate carries its verdict: an unreliable one stays a MonteCarloEstimate
        # (formatting prints "no reliable estimate (<reason>)", float() still the value)
        return {"global": glob if glob.reliable is False else float(glob),
                "global_reliable": glob.reliable,
                "global_reason": None if glob.diagnostics is None else glob.diagnostics.reason,
                "each": [float(v) for v in np.asarray(each)],
                "each_reliable": [bool(v) for v in each.reliable],
                "each_reason": [d.reason for d in each.diagnostics],
                "method": m, "global_stderr": float(glob.stderr),
                "each_stderr": [float(v) for v in np.ravel(each.stderr)],
                "n_samples": int(glob.n_samples), "seed": seed,
                "inner_each": None, "norm2_a_each": None, "norm2_b_each": None}
    with np.errstate(divide="ignore", invalid="ignore"):
        each = ab / np.sqrt(aa * bb)  # NaN for an identically-zero output (no direction)
    glob = float(ab.sum() / np.sqrt(aa.sum() * bb.sum()))
    return {"global": glob, "each": each.tolist(), "method": m, "global_stderr": None,
            "each_stderr": None, "n_samples": None, "seed": None, "inner_each": ab.tolist(),
            "norm2_a_each": aa.tolist(), "norm2_b_each": bb.tolist()}


def unreliable_slices(each_reliable: Sequence[bool] | None) -> list[int]:
    """The slices whose Monte Carlo estimate failed its diagnostics (none for exact methods)."""
    return [] if each_reliable is None else [c for c, ok in enumerate(each_reliable) if not ok]


def gap_finding(each: Sequence[float], each_stderr: Sequence[float] | None, cls: int,
                each_reliable: Sequence[bool] | None = None) -> dict:
    """Is slice ``cls`` below every other slice, and by more than its sampling noise?

    ``gap = min_{c != cls} each[c] - each[cls]`` with, for Monte Carlo, the standard error
    ``sqrt(se[cls]^2 + se[c*]^2)`` (``c*`` the lowest other class; the two estimates share their
    samples, so this ignores their covariance — an approximation). The gap is called
    *significant* when it exceeds 2 standard errors (exact methods: any positive gap).
    ``each_reliable`` (Monte Carlo): a slice without a reliable estimate makes "lowest" a claim
    about a number that is not an answer, so the finding is then not assessed (``assessed``
    False, ``not_assessed`` says which slices; the clearly-lowest verdict is False)."""
    others = [c for c in range(len(each)) if c != cls]
    low = min(others, key=lambda c: each[c])
    gap = float(each[low] - each[cls])
    se = None
    if each_stderr is not None:
        se = float(math.hypot(each_stderr[cls], each_stderr[low]))
    lowest = bool(each[cls] < each[low])
    bad = unreliable_slices(each_reliable)
    if bad:
        return {"target_slice": float(each[cls]), "lowest_other_slice": float(each[low]),
                "lowest_other_class": int(low), "gap": gap, "gap_stderr": se,
                "target_slice_is_lowest": None, "gap_within_2_stderr": None,
                "target_slice_is_clearly_lowest": False, "assessed": False,
                "not_assessed": f"no reliable Monte Carlo estimate for slice(s) "
                                f"{', '.join(map(str, bad))}",
                "rule": "clearly lowest: gap > 2 standard errors, every slice reliable"}
    return {"assessed": True,
            "target_slice": float(each[cls]), "lowest_other_slice": float(each[low]),
            "lowest_other_class": int(low), "gap": gap, "gap_stderr": se,
            "target_slice_is_lowest": lowest,
            "gap_within_2_stderr": None if se is None else bool(abs(gap) <= 2 * se),
            "target_slice_is_clearly_lowest": bool(gap > (2 * se if se is not None else 0.0)),
            "rule": ("clearly lowest: gap > 2 standard errors, gap stderr = sqrt(se_target^2 + "
                     "se_lowest_other^2) (covariance ignored)") if se is not None
                    else "clearly lowest: gap > 0 (deterministic method, no sampling error)"}


def similarity_matrix(models: Sequence[Any], method: str = "auto", depth: int = 1,
                      output: Any = None, seed: int = 0, n_samples: int = MC_SAMPLES,
                      n_ctx: int | None = None,
                      metric: str = "gaussian") -> tuple[np.ndarray, str]:
    """``tensoralg.similarity_matrix`` (one batched Gram computation) with the method recorded;
    ``metric``: ``gaussian`` or ``frobenius`` (exact only, no Monte Carlo fallback);
    ``seed`` and ``n_samples`` drive Monte Carlo (unused by the other methods); ``n_ctx``: the
    sequence length of sequence networks (None for others). A Monte Carlo
    matrix is the library's `MonteCarloArray` itself:
    per entry a delta-method standard error and a reliability verdict (`mc_entries`)."""
    import tensoralg as ta

    check_metric(metric, method)
    m = "exact" if metric == "frobenius" else resolve_method(method, depth)
    mc = {"seed": seed, "n_samples": n_samples}
    if n_ctx is not None:
        output = {"output": output, "n_ctx": n_ctx}
    else:
        output = {"output": output}
    try:
        return ta.similarity_matrix(list(models), method=m, metric=metric, **output,
                                    **(mc if m == "montecarlo" else {})), m
    except ta.CostTooHigh:
        if method != "auto" or metric != "gaussian":
            raise
        return ta.similarity_matrix(list(models), method="montecarlo", **output,
                                    **mc), "montecarlo"


def mc_entries(mat: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(stderr, reliable)`` of a similarity matrix as plain arrays: a Monte Carlo matrix's
    per-entry standard errors and verdicts, ``(None, None)`` for a deterministic one."""
    se, ok = getattr(mat, "stderr", None), getattr(mat, "reliable", None)
    return (None if se is None else np.array(se, dtype=np.float64),
            None if ok is None else np.array(ok, dtype=bool))


def shown_matrix(mat: Any, reliable: np.ndarray | None) -> np.ndarray:
    """The matrix as plain floats with NaN where its estimate is not reliable: blank in figures,
    null in the JSON, empty in the CSV (a value failing its diagnostics is not an answer)."""
    S = np.array(mat, dtype=np.float64)
    if reliable is not None:
        S[~reliable] = np.nan
    return S


def matrix_record(mat: Any, stderr: np.ndarray | None, reliable: np.ndarray | None) -> dict:
    """The JSON fields of a Monte Carlo matrix's per-entry uncertainty (``{}`` otherwise):
    ``stderr`` and ``reliable`` matrices, and the numbers of the unreliable entries kept apart
    as ``[i, j, value]`` (not answers; the matrix itself holds null there)."""
    if stderr is None:
        return {}
    vals = np.asarray(mat, dtype=np.float64)
    bad = [] if reliable is None else np.argwhere(~reliable).tolist()
    return {"stderr": stderr.tolist(),
            "reliable": None if reliable is None else reliable.tolist(),
            "n_unreliable": len(bad),
            "unreliable_estimates": [[i, j, float(vals[i, j])] for i, j in bad]}


def matrix_uncertainty(method: str, n_samples: int, seed: int, per_entry: bool = True) -> dict:
    """What the JSON says about a similarity matrix's error. ``per_entry`` False: a Monte Carlo
    matrix assembled from Gram blocks (``tensoralg matrix --block-size``), which carries no
    per-entry standard error."""
    if method == "closure":
        return {"estimate": False, "n_samples": None, "seed": None,
                "note": "closure: deterministic (no sampling error) but APPROXIMATE beyond one "
                        "non-linear layer (not E[f_a . f_b]; measured error in "
                        "docs/closure.md and docs/attention.md)"}
    if method != "montecarlo":
        return {"estimate": False, "n_samples": None, "seed": None,
                "note": f"{method}: deterministic (no sampling error)"}
    if not per_entry:
        return {"estimate": True, "n_samples": n_samples, "seed": seed, "per_entry": False,
                "note": ("Monte Carlo estimate G_ij / sqrt(G_ii G_jj) of a Gram matrix sampled "
                         "in blocks (all entries share the samples); no per-entry standard "
                         "error or verdict in the blocked path: drop the block options for "
                         "them, or use `tensoralg compare A B` for one pair.")}
    return {"estimate": True, "n_samples": n_samples, "seed": seed, "per_entry": True,
            "note": ("Monte Carlo estimate G_ij / sqrt(G_ii G_jj) from one shared set of "
                     "directions, each entry with its delta-method standard error and "
                     "reliability verdict (stderr / reliable matrices beside it); an entry "
                     "without a reliable estimate is null in the matrix, blank in figures and "
                     "CSV, and no finding leans on it. The error shrinks like "
                     "1/sqrt(n_samples).")}


def pm(value: float, stderr: float | None, reliable: bool | None = None) -> Any:
    """``value`` as is (deterministic) or ``"v ± se"`` text for a Monte Carlo estimate; an
    estimate that failed its diagnostics (``value.reliable`` or ``reliable`` False) as
    ``"no reliable estimate"`` (with ``(<reason>)`` when the value carries one)."""
    if getattr(value, "reliable", None) is False:
        return str(value)
    if reliable is False:
        return "no reliable estimate"
    if stderr is None:
        return value
    return f"{value:.4f} ± {stderr:.1g}" if stderr < 1e-4 else f"{value:.4f} ± {stderr:.4f}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (floats to 4 decimals)."""
    cells = [list(header)] + [[(f"{v:.4f}" if isinstance(v, float) else str(v))
                                      for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# localisation: does a per-class score single out one class? (declared before any number)
# ----------------------------------------------------------------------------------------

#: The threshold of the localisation rule (`localisation`).
LOCALISATION_MIN_SEPARATION = 1.0

#: The rule every audit applies, to tensor similarity and to each behavioural baseline alike.
LOCALISATION_RULE = (
    "a per-class score localises the change to class t when t's score is the lowest of all "
    "classes and its gap to the next-lowest class is at least the spread (max - min) of the "
    "other classes' scores: separation = (next-lowest - score_t) / (max_other - min_other) "
    f">= {LOCALISATION_MIN_SEPARATION:g} (a scale-free test: it compares metrics with different "
    "ranges); similarities enter as they are (lower = more changed), per-class accuracy as "
    "-|accuracy change|; with Monte Carlo the gap must also exceed 2 standard errors")


def localisation(scores: Sequence[float], target: int,
                 stderr: Sequence[float] | None = None) -> dict:
    """Apply `LOCALISATION_RULE` to per-class ``scores`` (lower = more changed) for class
    ``target``.

    Returns ``{"assessed", "score", "lowest_class", "next_lowest", "next_lowest_class", "gap",
    "spread_others", "separation", "localises"}``: ``separation`` is ``gap / spread_others``
    (``inf`` when the other classes are all equal and the gap is positive; null in the JSON);
    ``assessed`` is False (and ``localises`` None) when a score is not finite.
    ``stderr``: per-class standard errors (Monte Carlo); the gap must then also exceed twice
    ``sqrt(se_t^2 + se_next^2)`` (covariance ignored).
    """
    s = np.asarray(scores, dtype=np.float64)
    if not np.all(np.isfinite(s)):
        return {"assessed": False, "localises": None,
                "not_assessed": f"no finite score for class(es) "
                                f"{', '.join(map(str, np.flatnonzero(~np.isfinite(s))))}"}
    others = [c for c in range(len(s)) if c != target]
    nxt = min(others, key=lambda c: s[c])
    gap = float(s[nxt] - s[target])
    spread = float(s[others].max() - s[others].min())
    sep = gap / spread if spread > 0 else (math.inf if gap > 0 else 0.0)
    ok = gap > 0 and sep >= LOCALISATION_MIN_SEPARATION
    out = {"assessed": True, "score": float(s[target]), "lowest_class": int(np.argmin(s)),
           "next_lowest": float(s[nxt]), "next_lowest_class": int(nxt), "gap": gap,
           "spread_others": spread, "separation": sep}
    if stderr is not None:
        se = float(math.hypot(stderr[target], stderr[nxt]))
        out["gap_stderr"] = se
        ok = ok and gap > 2 * se
    out["localises"] = bool(ok)
    return out


def compare_localisation(tensor: Mapping[str, Any],
                         baselines: Mapping[str, Mapping[str, Any]]) -> dict:
    """Tensor similarity's `localisation` against each baseline's: ``better`` (tensor
    localises, the baseline does not), ``worse`` (the reverse), ``equally (both localise)``,
    ``equally (neither localises)``, ``not assessed`` (either is not assessed); plus the
    counts and one sentence with every separation."""
    verdicts = {}
    for name, b in baselines.items():
        t, o = tensor.get("localises"), b.get("localises")
        verdicts[name] = ("not assessed" if t is None or o is None else
                          "better" if t and not o else "worse" if o and not t else
                          "equally (both localise)" if t else "equally (neither localises)")
    counts = {v: sum(1 for x in verdicts.values() if x.startswith(v))
              for v in ("better", "equally", "worse", "not assessed")}

    def sep(d):
        if not d.get("assessed"):
            return "not assessed"
        x = d["separation"]
        return (f"{'inf' if math.isinf(x) else f'{x:.2f}'} (lowest class {d['lowest_class']}; "
                f"{'localises' if d['localises'] else 'does not localise'})")

    def larger(b):   # both localise: which stands further apart (a number, not a verdict)
        if not (tensor.get("localises") and b.get("localises")):
            return ""
        t, o = tensor["separation"], b["separation"]
        return (", larger separation for tensor similarity" if t > o else
                ", larger separation for the baseline" if o > t else ", equal separations")

    parts = [f"{name}: {sep(b)} -> tensor {verdicts[name]}{larger(b)}"
             for name, b in baselines.items()]
    sentence = (f"tensor similarity: separation {sep(tensor)}; " + "; ".join(parts) +
                f". Tensor similarity localises better than {counts['better']}, equally well as "
                f"{counts['equally']}, worse than {counts['worse']} of {len(baselines)} "
                f"behavioural baselines on this data")
    return {"rule": LOCALISATION_RULE, "verdicts": verdicts, "counts": counts,
            "statement": sentence}


# ----------------------------------------------------------------------------------------
# several seeds: one complete run per seed, and the spread of every number over the seeds
# ----------------------------------------------------------------------------------------

def check_seeds(seeds: Sequence[int] | None) -> list[int] | None:
    """``--seeds``: a non-empty list of distinct non-negative integers (or None: one run).

    Raises:
        ValueError: one line naming ``--seeds``.
    """
    if seeds is None:
        return None
    seeds = list(seeds)
    if not seeds:
        raise ValueError("--seeds: expected one or more non-negative integers, got none")
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, (int, np.integer))
           or s < 0]
    if bad:
        raise ValueError(f"--seeds: expected non-negative integers, got {bad}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: each seed once, got {seeds}")
    return [int(s) for s in seeds]


def spread(values: Sequence[Any]) -> dict:
    """``{"mean", "sd", "min", "max", "n", "values"}`` of one number over seeds: ``sd`` is the
    sample standard deviation (``ddof = 1``; 0 for one seed); the statistics use the finite
    values only (an infinite separation or a missing estimate is left out, ``n`` counts the
    ones used) and are None when there is none."""
    vals = [None if v is None else float(v) for v in values]
    fin = np.array([v for v in vals if v is not None and math.isfinite(v)], dtype=np.float64)
    if fin.size == 0:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0, "values": vals}
    # one value has no spread: sd None (not 0.0, which would claim a measured zero spread)
    return {"mean": float(fin.mean()), "sd": float(fin.std(ddof=1)) if fin.size > 1 else None,
            "min": float(fin.min()), "max": float(fin.max()), "n": int(fin.size),
            "values": vals}


def spread_text(s: Mapping[str, Any]) -> str:
    """A `spread` as ``"0.9123 ± 0.0041"`` (mean ± sample standard deviation)."""
    if s["mean"] is None:
        return "n/a"
    if s["sd"] is None:
        return f"{s['mean']:.4f} (one value, no spread)"
    return f"{s['mean']:.4f} ± {s['sd']:.4f}"


def seeds_table(summary: Mapping[str, Any], head: str, cols: Sequence[tuple[str, str]],
                marked: str, mark: str) -> str:
    """The text table of a several-seed audit summary (backdoor, forgetting): ``head`` (a
    line), the per-class numbers ``cols`` (``(key, header)`` in ``summary["per_class"]``) as
    mean ± sd with class ``marked`` labelled ``mark``, the global numbers, the localisation
    rule with each per-class metric's separation, and the finding."""
    pc = summary["per_class"]
    rows = [[c] + [spread_text(pc[k][c]) for k, _ in cols] + ([mark] if c == marked else [""])
            for c in pc["slice_similarity"]]
    return "\n".join([
        head,
        format_table(["class"] + [h for _, h in cols] + ["note"], rows), "",
        format_table(["number", "mean ± sd"],
                     [[k, spread_text(v)] for k, v in summary["numbers"].items()]), "",
        f"localisation rule (declared before the numbers): {summary['localisation_rule']}",
        format_table(["per-class metric", "separation (mean ± sd)", "localises"],
                     [[k, spread_text(d["separation"]), d["localises_count"]]
                      for k, d in summary["localisation"].items()]),
        summary["finding"]["statement"]])


def count_text(flags: Sequence[Any]) -> str:
    """``"holds in 3 of 3"`` for a finding per seed (None: not assessed, counted apart)."""
    yes = sum(1 for f in flags if f is True)
    na = sum(1 for f in flags if f is None)
    return f"holds in {yes} of {len(flags)}" + (f" ({na} not assessed)" if na else "")


def run_seeds(cfg: Any, seeds: Sequence[int], out: str | Path, json_name: str, depth: int,
              model_fn: Any, runner: Any, summarise: Any, show_progress: bool,
              json_copy: str | Path | None = None) -> dict:
    """`run_staged` for several seeds: every check before any training (configuration for
    each seed, ``out``, ``json_copy``, the method planned on an untrained model), then one
    complete run per seed into ``seed<N>/`` of one staged folder, then
    ``summarise(results, seeds, stage)`` (the spread of each number and the findings counted
    per seed; it may write more files into ``stage``) written as ``json_name`` at the top;
    ``out`` is replaced only when every seed ran."""
    import dataclasses

    seeds = check_seeds(seeds)
    cfgs = [dataclasses.replace(cfg, seed=s) for s in seeds]
    for c in cfgs:
        c.validate()
    final = check_output_folder(out, json_name)
    if json_copy is not None:
        check_file_writable(json_copy, "--json")
    method = choose_method(cfg.method, depth, model_fn(cfgs[0]).to_network(),
                           metric=getattr(cfg, "metric", "gaussian"))
    with staged_output(final, json_name) as stage:
        results = []
        for c in cfgs:
            sub = stage / f"seed{c.seed}"
            sub.mkdir()
            results.append(runner(c, sub, show_progress, method))
        summary = summarise(results, seeds, stage)
        summary.update({**stamp(summary["command"], {**dataclasses.asdict(cfg),
                                                      "seeds": seeds}),
                        "seeds": seeds, "runs": {str(s): f"seed{s}" for s in seeds},
                        "paths": PATHS_NOTE})
        write_json(stage / json_name, summary)
        summary["out"] = str(final)
        if json_copy is not None:
            write_json_copy(json_copy, summary, final, stage)
    return summary


def localisation_over_seeds(locs: Sequence[Mapping[str, Any]]) -> tuple[dict, dict, str]:
    """The per-seed localisation results (each ``{"tensor", "baselines", "comparison"}``)
    gathered: per metric the separation's `spread` and ``localises`` per seed, counted; per
    baseline the comparison verdicts per seed; and one sentence with the counts."""
    names = ["tensor_similarity"] + list(locs[0]["baselines"])

    def get(loc, name):
        return loc["tensor"] if name == "tensor_similarity" else loc["baselines"][name]

    out = {}
    for name in names:
        flags = [get(lc, name).get("localises") for lc in locs]
        out[name] = {"separation": spread([get(lc, name).get("separation") for lc in locs]),
                     "localises": flags, "localises_count": count_text(flags)}
    verdicts = {name: [lc["comparison"]["verdicts"][name] for lc in locs] for name in names[1:]}
    text = ("localisation rule (declared before the numbers) per seed: "
            + "; ".join(f"{n} localises: {out[n]['localises_count']}" for n in names)
            + "; tensor similarity vs each baseline per seed: "
            + "; ".join(f"{n}: " + ", ".join(f"{v} in {sum(1 for x in vs if x == v)}"
                                             for v in dict.fromkeys(vs))
                        for n, vs in verdicts.items()))
    return out, verdicts, text


def inner_steps(stage_steps: int, per_stage: int) -> list[int]:
    """The steps inside one stage (1 .. ``stage_steps``) at which a checkpoint is saved:
    ``per_stage`` evenly spaced ones, the last at the stage's end.

    Raises:
        ValueError: ``per_stage`` outside ``1 .. stage_steps``.
    """
    if not 1 <= per_stage <= stage_steps:
        raise ValueError(f"per_stage: expected 1 .. {stage_steps}, got {per_stage}")
    pts = [int(round(k * stage_steps / per_stage)) for k in range(1, per_stage + 1)]
    return sorted(set(pts))


def append_similarity(rec: dict, ps: dict) -> None:
    """Append one checkpoint's `pair_similarity` result ``ps`` (global and per-class values,
    their standard errors and verdicts) to the over-training record ``rec``'s lists."""
    rec["global_similarity"].append(ps["global"])
    rec["global_similarity_stderr"].append(ps["global_stderr"])
    rec["slice_similarity"].append([float(v) for v in ps["each"]])
    rec["slice_similarity_stderr"].append(ps["each_stderr"])
    rec["slice_similarity_reliable"].append(ps.get("each_reliable"))
