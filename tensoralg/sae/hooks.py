"""Activations at a named submodule of any ``torch.nn.Module``, with forward hooks.

A *hook* is ``(hook_name, point)``: ``hook_name`` a name of ``model.named_modules()`` (e.g.
``"attn.1"``, ``"encoder.layer.3"``, TransformerLens's ``"blocks.0.hook_resid_pre"``) and
``point`` ``"output"`` (what the submodule returns; the first element of a tuple) or
``"input"`` (its first positional argument, read by a forward pre-hook). The activation of a
batch is the tensor there, reshaped to rows ``(-1, d)`` (``d`` its last dimension).

* `activations_at` — the activation of one forward pass (stopped at the hook);
* `collect_activations` — stream the rows of many batches to a ``.npy`` on disk in
  chunks, with a progress bar (``tqdm``, ETA), resumable after an interruption, and a
  ``.npy.json`` record of the model, hook and data (the ``metadata`` SAELens keeps in an SAE's
  ``cfg.json``: ``model_name``, ``hook_name``, ``dataset_path``, ...);
* `spliced` — a context in which the activation at the hook is replaced by ``fn(act)``
  (e.g. an SAE's reconstruction; `tensoralg.sae.evaluation`).

A ``hook_name`` that is not a submodule is a ``ValueError`` listing the nearest names
(``difflib``), raised before any forward pass.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["HOOK_POINTS", "get_submodule", "activations_at", "collect_activations", "spliced",
           "read_activation_metadata", "call_model", "check_point"]

HOOK_POINTS = ("output", "input")
_STATE = "state.json"


class _Stop(Exception):
    """Raised by a hook to end the forward pass once the activation is read."""


def get_submodule(model: nn.Module, hook_name: str) -> nn.Module:
    """``model``'s submodule named ``hook_name`` (a name of ``model.named_modules()``).

    Raises:
        ValueError: ``model`` is not an ``nn.Module``; ``hook_name`` is not a string or not a
            submodule (the message lists the nearest names, by ``difflib``, and how many
            submodules there are).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(hook_name, str):
        raise ValueError(f"hook_name: expected a submodule name (str), got {hook_name!r}")
    names = [n for n, _ in model.named_modules()]
    if hook_name in names:
        return model.get_submodule(hook_name) if hook_name else model
    near = difflib.get_close_matches(hook_name, names, n=5, cutoff=0.0)
    # all of them when they fit on a line (the root module "" is not a hook)
    listed = f"; all: {[n for n in names if n]}" if len(names) <= 40 else ""
    raise ValueError(f"hook_name: {hook_name!r} is not a submodule of {type(model).__name__} "
                     f"({len(names)} submodules); nearest: {near}{listed}")


def check_point(point: str) -> None:
    if point not in HOOK_POINTS:
        raise ValueError(f"point: expected one of {list(HOOK_POINTS)}, got {point!r}")


def _tensor_of(value, hook_name: str, point: str) -> torch.Tensor:
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"hook_name: the {point} of {hook_name!r} is a "
                         f"{type(value).__name__}, not a tensor")
    return value


def call_model(model: nn.Module, batch) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def activations_at(model: nn.Module, hook_name: str, batch, point: str = "output",
                   stop: bool = True) -> torch.Tensor:
    """The activation at ``(hook_name, point)`` of ``model`` on ``batch`` (a tensor, a tuple of
    positional arguments or a dict of keyword arguments), detached, in its own shape.

    ``stop``: end the forward pass at the hook (the layers after it are not run).

    Raises:
        ValueError: see `get_submodule`; a bad ``point``; the hook never ran in the
            forward pass, or what it sees is not a tensor.
    """
    check_point(point)
    module = get_submodule(model, hook_name)
    seen: list[torch.Tensor] = []

    def grab(value):
        seen.append(_tensor_of(value, hook_name, point).detach())
        if stop:
            raise _Stop

    if point == "input":
        handle = module.register_forward_pre_hook(lambda mod, args: grab(args))
    else:
        handle = module.register_forward_hook(lambda mod, args, out: grab(out))
    try:
        with torch.no_grad():
            call_model(model, batch)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"hook_name: {hook_name!r} ({point}) did not run in the forward pass "
                         f"of {type(model).__name__}")
    return seen[0]


@contextlib.contextmanager
def spliced(model: nn.Module, hook_name: str, fn: Callable[[torch.Tensor], torch.Tensor],
            point: str = "output"):
    """Within the ``with`` block, ``model``'s activation at ``(hook_name, point)`` is replaced
    by ``fn(act)`` (same shape) in every forward pass. For a tuple output the first element is
    replaced.

    Raises:
        ValueError: see `get_submodule`; a bad ``point``; ``fn`` returns another shape.
    """
    check_point(point)
    module = get_submodule(model, hook_name)

    def replace(value):
        act = _tensor_of(value, hook_name, point)
        new = fn(act)
        if not isinstance(new, torch.Tensor) or new.shape != act.shape:
            raise ValueError(f"fn: must return a tensor of the activation's shape "
                             f"{tuple(act.shape)} at {hook_name!r}, got "
                             f"{getattr(new, 'shape', type(new).__name__)}")
        new = new.to(act.dtype)
        if isinstance(value, (tuple, list)):
            return type(value)([new, *value[1:]])
        return new

    if point == "input":
        handle = module.register_forward_pre_hook(lambda mod, args: replace(args))
    else:
        handle = module.register_forward_hook(lambda mod, args, out: replace(out))
    try:
        yield model
    finally:
        handle.remove()


def _rows(act: torch.Tensor) -> torch.Tensor:
    return act.reshape(-1, act.shape[-1]) if act.ndim > 1 else act.reshape(-1, 1)


def collect_activations(model: nn.Module, hook_name: str, batches: Iterable, out, *,
                        point: str = "output", chunk_rows: int = 65_536,
                        dtype: str = "float32", metadata: dict | None = None,
                        rows: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
                        progress: bool = True, resume: bool = True) -> dict:
    """Run ``model`` on every batch of ``batches`` and write the rows of the activation at
    ``(hook_name, point)`` to ``out`` (``.npy``, ``(n_rows, d)``), streamed to disk.

    Chunks: rows are buffered per batch and written, once at least ``chunk_rows`` are buffered,
    as ``out.partial/chunk_NNNNN.npy`` (atomically, then ``state.json`` with the number of
    batches done). An interrupted run called again with the same model, hook, dtype and
    metadata resumes after the last chunk written (its batches are skipped without a forward
    pass; ``batches`` must yield the same batches in the same order); ``resume=False`` starts
    over. At the end the chunks are concatenated into ``out`` (a temporary file renamed into
    place) and ``out.partial`` is removed; ``out + ".json"`` records ``hook_name``, ``point``,
    the shape and dtype, and ``metadata`` (e.g. ``model_name``, ``dataset_path``,
    ``context_size``: what [`tensoralg.sae.formats.save_sae`][tensoralg.sae.formats.save_sae] writes
    into ``cfg.json``'s ``metadata``, as SAELens does). Progress: a ``tqdm`` bar over the batches
    (total and ETA when ``batches`` has a length).

    Args:
        model: any ``torch.nn.Module`` (put in eval mode by the caller if it matters).
        hook_name, point: the hook (module docstring).
        batches: an iterable of model inputs (tensor, tuple of arguments, dict of keyword
            arguments).
        out: the ``.npy`` path.
        chunk_rows: rows per chunk on disk (memory bound of the buffer, plus one batch).
        dtype: ``"float32"`` or ``"float64"`` of the rows written.
        metadata: JSON-serializable dict recorded in ``out.json`` (``model_name``, ``dataset_path``,
            ...); ``hook_name`` is added.
        rows: optional ``rows(act, batch) -> (n, d)`` choosing the rows of a batch (e.g. the
            non-padding tokens); default all positions, ``act.reshape(-1, d)``.
    Returns:
        the info dict written to ``out.json``.
    Raises:
        ValueError: see `get_submodule` (before any forward pass); a bad ``point``,
            ``chunk_rows``, ``dtype``, ``metadata`` or ``out``; a resumable run in ``out.partial``
            of another hook/dtype/metadata (with ``resume=True``); a batch whose activation has
            NaN/inf (named; nothing of it is written) or another width ``d``; no batches.
    """
    from tqdm.auto import tqdm

    from ..io import atomic_write_bytes, atomic_write_json

    check_point(point)
    get_submodule(model, hook_name)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype: expected 'float32' or 'float64', got {dtype!r}")
    out = Path(out)
    if out.suffix != ".npy" or out.is_dir():
        raise ValueError(f"out: expected a .npy file path, got {out}")
    if not isinstance(metadata or {}, dict):
        raise ValueError(f"metadata: expected a dict, got {type(metadata).__name__}")
    meta = dict(metadata or {})
    meta.setdefault("hook_name", hook_name)
    try:
        key = json.dumps({"hook_name": hook_name, "point": point, "dtype": dtype,
                          "metadata": meta}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata: not JSON-serializable ({exc})") from None
    fingerprint = hashlib.sha256(key.encode()).hexdigest()
    work = out.with_name(out.name + ".partial")
    state = {"fingerprint": fingerprint, "batches_done": 0, "chunks": [], "d": None}
    if work.is_dir() and resume and (work / _STATE).is_file():
        old = json.loads((work / _STATE).read_text())
        if old.get("fingerprint") != fingerprint:
            raise ValueError(f"out: {work} holds an interrupted run of another hook, dtype or "
                             f"metadata; pass resume=False to start over")
        state = old
    elif work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(work / _STATE, state)
    np_dtype = np.dtype(dtype)
    buf: list[np.ndarray] = []
    buffered = 0
    done = state["batches_done"]

    def flush(n_batches: int) -> None:
        nonlocal buf, buffered
        if not buf:
            return
        block = np.concatenate(buf)
        name = f"chunk_{len(state['chunks']):05d}.npy"
        import io as _io
        b = _io.BytesIO()
        np.save(b, block, allow_pickle=False)
        atomic_write_bytes(work / name, b.getvalue())
        state["chunks"].append({"file": name, "rows": int(block.shape[0])})
        state["batches_done"] = n_batches
        atomic_write_json(work / _STATE, state)
        buf, buffered = [], 0

    total = len(batches) if hasattr(batches, "__len__") else None
    # disable=None: hidden when stderr is not a terminal (logs, CI, pipes)
    bar = tqdm(total=total, initial=done, desc=f"activations at {hook_name}", unit="batch",
               disable=None if progress else True)
    i = -1
    try:
        for i, batch in enumerate(batches):
            if i < done:
                continue                      # written before the interruption
            act = activations_at(model, hook_name, batch, point)
            r = rows(act, batch) if rows is not None else _rows(act)
            if r.ndim != 2:
                raise ValueError(f"rows: expected (n, d) rows for batch {i}, got "
                                 f"{tuple(r.shape)}")
            if state["d"] is None:
                state["d"] = int(r.shape[1])
            elif r.shape[1] != state["d"]:
                raise ValueError(f"batches: batch {i} gives rows of width {r.shape[1]} at "
                                 f"{hook_name!r}, earlier batches {state['d']}")
            if not bool(torch.isfinite(r).all()):
                bad = int((~torch.isfinite(r)).any(dim=1).nonzero()[0, 0])
                raise ValueError(f"batches: the activation at {hook_name!r} of batch {i} has "
                                 f"NaN or inf (row {bad} of the batch); nothing of it was "
                                 f"written")
            buf.append(r.to("cpu", torch.float64).numpy().astype(np_dtype))
            buffered += r.shape[0]
            if buffered >= chunk_rows:
                flush(i + 1)
            bar.update(1)
            bar.set_postfix(rows=sum(c["rows"] for c in state["chunks"]) + buffered)
        flush(i + 1)
        state["batches_done"] = max(state["batches_done"], i + 1)
    finally:
        bar.close()
    n = sum(c["rows"] for c in state["chunks"])
    if n == 0:
        raise ValueError("batches: no rows were collected (empty batches?)")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np_dtype, shape=(n, state["d"]))
    at = 0
    for c in state["chunks"]:
        block = np.load(work / c["file"])
        arr[at:at + block.shape[0]] = block
        at += block.shape[0]
    arr.flush()
    del arr
    os.replace(tmp, out)
    info = {"source": f"forward hook on {type(model).__name__}", "hook_name": hook_name,
            "point": point, "shape": [n, state["d"]], "dtype": dtype,
            "n_batches": state["batches_done"], "metadata": meta, "out": str(out)}
    atomic_write_json(str(out) + ".json", info)
    shutil.rmtree(work)
    return info


def read_activation_metadata(path) -> dict:
    """The ``metadata`` recorded next to an activation file ``path`` (``path + ".json"``, as
    written by `collect_activations` and ``tensoralg sae activations``), with
    ``dataset_path`` defaulting to ``path``; ``{"dataset_path": path}`` when there is no record.

    Raises:
        ValueError: the record exists but is not JSON, or its ``metadata`` is not a dict.
    """
    side = Path(str(path) + ".json")
    meta: dict = {}
    if side.is_file():
        try:
            info = json.loads(side.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{side}: not a readable JSON record ({exc})") from None
        meta = info.get("metadata", {}) if isinstance(info, dict) else {}
        if not isinstance(meta, dict):
            raise ValueError(f"{side}: 'metadata' must be a dict, got {type(meta).__name__}")
    return {"dataset_path": str(path), **meta}
