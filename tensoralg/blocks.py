"""Gram and similarity matrices over more checkpoints than fit in memory: blocked, resumable,
optionally distributed on Dask (docs/mathematics.md §6).

The ``N x N`` matrix is cut into blocks of ``block_size`` checkpoints per side. Each block
``(I, J)`` with ``I <= J`` loads only its own checkpoints and runs the engine's batched Gram
strategy on them — [`tensoralg.gram`][tensoralg.gram] on a diagonal block,
[`tensoralg.cross_gram`][tensoralg.cross_gram] off the diagonal — so at most ``2 * block_size``
models are in memory per worker. The lower triangle is the transpose of the upper (``G`` is
symmetric). Similarities are ``S_ij = G_ij / sqrt(G_ii G_jj)`` with the norms ``G_ii`` taken from
the diagonal blocks.

Store (``out=``): a folder holding ``manifest.json`` (format, sizes, options, and every
checkpoint's path with the SHA-256 of its ``cfg.json`` and ``weights.safetensors``) and one
``G_<I>_<J>_<sha>.npy`` file per finished block, each written to a temporary file and renamed
into place (`tensoralg.io.atomic_write_bytes`); ``<sha>`` is the first 16 hex digits of the
SHA-256 of the file's bytes. The store is therefore consistent at every instant — after a crash,
a killed worker or Ctrl-C — and ``resume=True`` continues from the finished blocks, refusing a
store made from different checkpoints or options, and a block file whose bytes no longer match
its name (edited or damaged since it was written).

Execution: in this process, block after block (default); on a Dask cluster with ``client=``
(a ``dask.distributed.Client``) or ``workers=N`` (a ``LocalCluster`` of N single-threaded
worker processes started and closed here). Blocks are submitted as independent tasks; the
driver writes each result as it arrives. A worker that dies loses only the blocks it was
running: the scheduler reschedules them on the remaining workers (``distributed.scheduler.
allowed-failures``, default 3) and a block that raises is retried ``retries`` times. A worker
computes with ``backend="torch", device="cuda"`` when it has a GPU and ``backend="numpy"``
otherwise (``device="auto"``).

Before any block runs, every checkpoint's ``cfg.json`` and safetensors header is validated
(names, shapes and architecture against the config; the file's length against the header),
so a corrupt checkpoint fails the run naming the file.

Sequence models (bilinear-transformer checkpoints, or models with attention given in memory;
``n_ctx=``): blocks run in float64 NumPy with the functions of
the unblocked ``tensoralg.gram(models, n_ctx=...)`` — ``exact_gram`` / ``exact_inner`` (at most
one attention layer) or ``closure_gram`` (approximate at depth >= 2) — see
`_sequence_block`; Monte Carlo and ``output="each"`` are refused for them up front.

``dask[distributed]`` is the optional extra ``tensoralg[dask]``; it is only imported when
``client`` or ``workers`` is given.
"""

from __future__ import annotations

import hashlib
import io
import json
import numbers
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .io import CONFIG_FILE, WEIGHTS_FILE, atomic_write_bytes, atomic_write_json

__all__ = ["gram", "similarity_matrix", "validate_checkpoints", "BlockStore", "DEFAULT_BLOCK_SIZE",
           "FORMAT", "need_distributed"]

FORMAT = "tensoralg.blocks/2"   # 2: block files named by the SHA-256 of their bytes
MANIFEST = "manifest.json"
DEFAULT_BLOCK_SIZE = 64
_ARCH_KEYS = ("architecture", "d_in", "d_out", "d_model", "d_hidden", "n_layers", "bias",
              "residual", "embed_bias", "head_bias")
# bilinear transformers (tensoralg.transformer): the trained n_ctx may differ between them (the
# matrix is over a common n_ctx <= every trained one, as in `tensoralg matrix` without blocks)
_SEQ_ARCH_KEYS = ("architecture", "n_layers", "d_model", "n_heads", "d_head", "d_mlp", "vocab",
                  "rope", "attn_scale")
SEQUENCE_METHODS = ("exact", "closure")
_DEVICES = ("auto", "cpu", "cuda")


# ----------------------------------------------------------------------------------------
# sources: checkpoint folders (loaded lazily, where the block runs) or models in memory
# ----------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_transformer(cfg: dict) -> bool:
    from .transformer import ARCHITECTURE

    return cfg.get("architecture") == ARCHITECTURE


def _expected_shapes(cfg: dict, cache: dict) -> dict:
    """Tensor name -> shape of the model ``cfg`` describes (one model built per architecture)."""
    from .nn import BilinearNet
    from .transformer import BilinearTransformer

    seq = _is_transformer(cfg)
    key = tuple(cfg.get(k) for k in (_SEQ_ARCH_KEYS + ("n_ctx",) if seq else _ARCH_KEYS))
    if key not in cache:
        sd = (BilinearTransformer if seq else BilinearNet).from_config(cfg).state_dict()
        cache[key] = {k: tuple(v.shape) for k, v in sd.items()}
    return cache[key]


def validate_checkpoints(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """Validate every checkpoint folder before any block runs and fingerprint it.

    For each folder: ``cfg.json`` parses and names the ``tensoralg.nn.BilinearNet`` or the
    ``tensoralg.transformer.BilinearTransformer`` architecture; the safetensors header of
    ``weights.safetensors`` parses, the file holds exactly the bytes the header announces, and its
    tensor names and shapes are those the config implies.
    All checkpoints must share one architecture (they are stacked into batched contractions;
    transformers may differ in their trained ``n_ctx`` only, and must share one vocabulary).
    Weight values (NaN/inf) are checked when a block loads them
    ([`tensoralg.checkpoint.load_checkpoint`][tensoralg.checkpoint.load_checkpoint]).

    Returns:
        one dict per checkpoint: ``path`` (as given), ``resolved`` (absolute), ``cfg_sha256``,
        ``weights_sha256``, ``bytes`` (size of the weights file) and ``step``; for a transformer
        also ``n_ctx_trained``.

    Raises:
        FileNotFoundError: a missing folder, ``cfg.json`` or ``weights.safetensors`` (named).
        ValueError: a corrupt or truncated file, a foreign architecture, names/shapes that do not
            match the config, or an architecture differing from the first checkpoint's (naming
            both files and the differing keys; vocabularies that differ, naming each).
    """
    from safetensors import safe_open

    from .checkpoint import NETWORK, network_shapes
    from .io import read_config
    from .nn import ARCHITECTURE
    from .transformer import ARCHITECTURE as TRANSFORMER

    out, shapes_cache, first = [], {}, None
    for p in paths:
        path = Path(p)
        cfg = read_config(path)
        if cfg.get("architecture") not in (ARCHITECTURE, TRANSFORMER, NETWORK):
            raise ValueError(f"{path}: cfg.json architecture {cfg.get('architecture')!r} is not "
                             f"{ARCHITECTURE!r} or {TRANSFORMER!r}")
        try:
            expected = network_shapes(cfg) if cfg["architecture"] == NETWORK else \
                _expected_shapes(cfg, shapes_cache)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: cfg.json does not describe a model: {exc}") from None
        weights = path / WEIGHTS_FILE
        if not weights.is_file():
            raise FileNotFoundError(f"{weights}: missing ({path} is not a complete checkpoint)")
        size = weights.stat().st_size
        try:
            with safe_open(str(weights), framework="pt") as fh:
                got = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
            with open(weights, "rb") as raw:
                header_len = int.from_bytes(raw.read(8), "little")
                header = json.loads(raw.read(header_len))
        except Exception as exc:  # safetensors raises its own types for corrupt headers
            raise ValueError(f"{weights}: corrupt or truncated safetensors file ({exc})") from None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
        if 8 + header_len + end != size:
            raise ValueError(f"{weights}: truncated or padded: the header announces "
                             f"{8 + header_len + end} bytes, the file has {size}")
        if set(got) != set(expected):
            raise ValueError(f"{weights}: tensors do not match cfg.json: missing "
                             f"{sorted(set(expected) - set(got))}, unexpected "
                             f"{sorted(set(got) - set(expected))}")
        bad = [f"{k!r} has shape {got[k]}, cfg.json implies {expected[k]}" for k in expected
               if got[k] != expected[k]]
        if bad:
            raise ValueError(f"{weights}: {'; '.join(bad)}")
        seq = cfg["architecture"] == TRANSFORMER or bool(cfg.get("sequence"))
        arch = {k: cfg.get(k) for k in (("architecture", "d_in", "d_out", "sequence")
                                         if cfg["architecture"] == NETWORK else
                                         _SEQ_ARCH_KEYS if seq else _ARCH_KEYS)}
        if first is None:
            first = (path, arch)
        elif arch != first[1]:
            if arch["architecture"] != first[1]["architecture"]:
                raise ValueError(f"checkpoints: {path} is a {arch['architecture']!r} checkpoint, "
                                 f"{first[0]} a {first[1]['architecture']!r} one; a matrix "
                                 f"compares checkpoints of one kind")
            if seq and arch.get("vocab") != first[1].get("vocab"):
                raise ValueError(f"checkpoints: the vocabularies differ ({first[0]}: vocab "
                                 f"{first[1]['vocab']}, {path}: vocab {arch['vocab']}); logits "
                                 f"of different vocabularies cannot be compared")
            diff = {k: (first[1][k], arch[k]) for k in arch if first[1][k] != arch[k]}
            raise ValueError(f"checkpoints: {path} has a different architecture from {first[0]} "
                             f"({', '.join(f'{k}: {a!r} vs {b!r}' for k, (a, b) in diff.items())}); "
                             f"a blocked matrix stacks same-architecture models")
        entry = {"path": str(p), "resolved": str(path.resolve()),
                 "cfg_sha256": _sha256(path / CONFIG_FILE), "weights_sha256": _sha256(weights),
                 "bytes": size, "step": cfg.get("step")}
        if seq:   # a tensoralg_network without a mask array works at any n_ctx
            entry["n_ctx_trained"] = int(cfg["n_ctx"] or 1 << 30)
        out.append(entry)
    return out


def sequence_n_ctx(prints: Sequence[dict], n_ctx: Any) -> int:
    """The context length of a matrix over transformer checkpoints (``prints`` from
    `validate_checkpoints`): ``n_ctx``, or by default the shortest trained context.

    Raises:
        ValueError: ``n_ctx`` not a positive int, or beyond a checkpoint's trained context
            (naming it; longer contexts were never trained).
    """
    trained = [int(p["n_ctx_trained"]) for p in prints]
    if n_ctx is None:
        return min(trained)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) or n_ctx < 1:
        raise ValueError(f"n_ctx: expected a positive integer, got {n_ctx!r}")
    for p, t in zip(prints, trained):
        if n_ctx > t:
            raise ValueError(f"n_ctx={n_ctx}: beyond the trained context n_ctx={t} of "
                             f"{p['path']}; use at most {min(trained)}")
    return int(n_ctx)


def _model_fingerprint(net: Any) -> dict:
    """SHA-256 over a network's float64 arrays in order (models given in memory)."""
    h = hashlib.sha256()
    for a in net.arrays():
        arr = np.ascontiguousarray(np.asarray(a, dtype=np.float64))
        h.update(str(arr.shape).encode())
        h.update(arr.tobytes())
    return {"path": None, "model_sha256": h.hexdigest()}


def _prepare_sources(sources: Any) -> tuple[list, list[dict]]:
    """``(refs, fingerprints)``: a ref is a checkpoint path (str) or a tensoralg network."""
    from .layers import Layer, as_network

    if isinstance(sources, (str, os.PathLike, Layer)) or hasattr(sources, "to_network"):
        raise TypeError("sources: expected a sequence of checkpoint folders or models, got a "
                        "single one")
    try:
        items = list(sources)
    except TypeError:
        raise TypeError(f"sources: expected a sequence of checkpoint folders or models, got "
                        f"{type(sources).__name__}") from None
    if not items:
        raise ValueError("sources: empty sequence; need at least one checkpoint or model")
    is_path = [isinstance(s, (str, os.PathLike)) for s in items]
    if all(is_path):
        prints = validate_checkpoints(items)
        return [str(s) for s in items], prints
    if any(is_path):
        raise TypeError("sources: mix of checkpoint paths and models; give one kind")
    nets = [as_network(s, f"sources[{i}]") for i, s in enumerate(items)]
    for i, n in enumerate(nets[1:], 1):
        if (n.in_features, n.out_features) != (nets[0].in_features, nets[0].out_features):
            raise ValueError(f"sources[{i}]: maps {n.in_features} -> {n.out_features}, "
                             f"sources[0] maps {nets[0].in_features} -> {nets[0].out_features}; "
                             f"a Gram matrix needs the same input and output sizes")
    return nets, [_model_fingerprint(n) for n in nets]


def _load(ref: Any, n_ctx: int | None = None, sequence: bool = False):
    """The network of ``ref``; a transformer checkpoint (``sequence``) over ``n_ctx`` positions."""
    if isinstance(ref, str):
        if sequence:
            from .checkpoint import load_checkpoint

            return load_checkpoint(ref)[0].to_network(n_ctx=n_ctx)
        from .checkpoint import load_network

        return load_network(ref)
    return ref


# ----------------------------------------------------------------------------------------
# one block (runs in this process or on a Dask worker)
# ----------------------------------------------------------------------------------------

def _engine_request(opts: dict):
    """The engine's `Request` for a block, and the device used, on
    this machine."""
    from .request import make_request

    kw = {k: opts[k] for k in ("metric", "method", "output") if opts.get(k) is not None}
    if opts["method"] == "montecarlo":
        kw.update(n_samples=opts["n_samples"], seed=opts["seed"])
    for k in ("max_flops", "max_configurations"):
        if opts.get(k) is not None:
            kw[k] = opts[k]
    device = opts["device"]
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        kw.update(backend="torch", device="cuda", dtype="float64")
    else:
        kw["backend"] = "numpy"
    return make_request(**kw), device


def _block_task(rows: list, cols: list | None, opts: dict) -> tuple[np.ndarray, str]:
    """``G`` of one block: ``gram(rows)`` on the diagonal (``cols is None``), else
    ``cross_gram(rows, cols)``; float64 ``(len(rows), len(cols)[, K])`` and the device used.
    Loads the block's checkpoints here (on the worker)."""
    from . import engine

    if opts.get("threads"):
        import torch

        torch.set_num_threads(int(opts["threads"]))
    if opts.get("degree") is not None:
        return _degree_block(rows, cols, opts), "cpu"
    if opts.get("sequence"):
        return _sequence_block(rows, cols, opts), "cpu"
    req, device = _engine_request(opts)
    a = [_load(r) for r in rows]
    if cols is None:
        G = engine.gram(req, a)
    else:
        G = engine.cross_gram(req, a, [_load(c) for c in cols])
    if hasattr(G, "detach"):
        G = G.detach().to("cpu").numpy()
    return np.asarray(G, dtype=np.float64), device


def _sequence_block(rows: list, cols: list | None, opts: dict) -> np.ndarray:
    """One block of a Gram matrix of sequence models (bilinear attention, float64 NumPy), with
    the functions the unblocked ``tensoralg.gram(models, n_ctx=...)`` uses, so each entry is
    computed by the same operations:

    * ``method="exact"`` (at most one attention layer): the diagonal block is
      `tensoralg.strategies.sequence_exact.exact_gram`; off the diagonal each entry is
      `tensoralg.strategies.sequence_exact.exact_inner` (row model first, as ``exact_gram`` for
      ``i < j``).
    * ``method="closure"`` (APPROXIMATE at depth >= 2, exact at depth 1): the diagonal block is
      `tensoralg.strategies.closure.closure_gram`; off the diagonal
      `tensoralg.strategies.closure.closure_cross_gram` (the cross pairs only; equal to the
      corresponding block of ``closure_gram(rows + cols)``, same operations).
    """
    from .strategies import closure, sequence_exact

    n_ctx, output, method = opts["n_ctx"], opts["output"], opts["method"]
    a = [_load(r, n_ctx, True) for r in rows]
    b = None if cols is None else [_load(c, n_ctx, True) for c in cols]
    if method == "closure":
        if b is None:
            return closure.closure_gram(a, n_ctx=n_ctx, output=output)
        return closure.closure_cross_gram(a, b, n_ctx=n_ctx, output=output)
    kw = {} if opts.get("max_configurations") is None else \
        {"max_configurations": opts["max_configurations"]}
    if b is None:
        return sequence_exact.exact_gram(a, n_ctx=n_ctx, output=output, **kw)
    G = np.empty((len(a), len(b)))
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            G[i, j] = float(sequence_exact.exact_inner(x, y, n_ctx=n_ctx, output=output, **kw))
    return G


def _degree_trees(refs: list, opts: dict, first: int = 0) -> list:
    """The one-node trees of ``f_{<=K}`` (``K = opts["degree"]``) of ``refs``
    (`tensoralg.homogeneous.truncation_trees`), loading checkpoints here."""
    from .homogeneous import truncation_trees

    nets = [_load(r, opts["n_ctx"], True) for r in refs]
    names = [r if isinstance(r, str) else f"sources[{first + i}]" for i, r in enumerate(refs)]
    return truncation_trees(nets, opts["n_ctx"], int(opts["degree"]), names)


def _degree_block(rows: list, cols: list | None, opts: dict) -> np.ndarray:
    """One block of the Gram matrix of the truncations ``f_{<=K}`` (``S<=K``, bias-free
    sequence models; `tensoralg.degree_similarity_matrix`): each of the block's models'
    chaos forms once, then its pairs — `tensoralg.strategies.sequence_exact.tree_gram` on the
    diagonal, `tensoralg.strategies.sequence_exact.tree_cross_gram` off it (row models first,
    the operations of the unblocked matrix's entry ``(i, j)``, ``i < j``)."""
    from .strategies import sequence_exact

    a = _degree_trees(rows, opts)
    if cols is None:
        return sequence_exact.tree_gram(a, opts["n_ctx"])
    return sequence_exact.tree_cross_gram(a, _degree_trees(cols, opts), opts["n_ctx"])


def _check_degree(refs: list, prints: list[dict], opts: dict, block_size: int) -> None:
    """The blocked ``S<=K`` matrix (``opts["degree"]``): resolve ``n_ctx`` and refuse, before
    any block runs, what it cannot compute and a block over budget.

    Budget: one model's own pair against ``max_flops`` / ``max_configurations`` (as the
    unblocked matrix), and the largest block — its models' chaos forms held together plus the
    largest working set of one sum (`tensoralg.strategies.sequence_exact.tree_block_cost`) —
    against ``max_memory`` (default the memory available), refused with the estimate.

    Raises:
        ValueError: position-free models, a method other than exact, an ``output``, a device of
            "cuda", a model whose ``S<=K`` is not exact (biases), a bad ``n_ctx``;
        tensoralg.CostTooHigh: a pair or a block over budget (with the estimate).
    """
    from .backends import available_memory
    from .canonical import resolve_n_ctx
    from .errors import CostTooHigh
    from .prepare import position_selector
    from .request import make_request
    from .strategies import sequence_exact

    K = opts["degree"]
    if isinstance(K, bool) or not isinstance(K, numbers.Integral) or K < 1:
        raise ValueError(f"degree: expected a positive integer, got {K!r}")
    if not opts.get("sequence"):
        raise ValueError(f"degree={K}: the blocked S<={K} matrix is for sequence models "
                         f"(bilinear-transformer checkpoints or models with attention); "
                         f"tensoralg.degree_similarity_matrix computes position-free networks")
    if opts["method"] != "exact":
        raise ValueError(f"method: the S<={K} matrix (degree={K}) is exact, got "
                         f"{opts['method']!r}")
    if opts["metric"] != "gaussian":
        raise ValueError(f"metric: S<={K} is under metric='gaussian', got {opts['metric']!r}")
    if opts["output"] is not None:
        raise ValueError(f"output: the S<={K} matrix sums over all outputs, got "
                         f"output={opts['output']!r}")
    if opts["device"] == "cuda":
        raise ValueError("device: the S<=K blocks are computed in float64 NumPy; use 'auto' or "
                         "'cpu'")
    paths = all(isinstance(r, str) for r in refs)
    if paths:
        opts["n_ctx"] = sequence_n_ctx(prints, opts["n_ctx"])
    else:
        opts["n_ctx"] = resolve_n_ctx([(f"sources[{i}]", r) for i, r in enumerate(refs)],
                                      opts["n_ctx"])
    n_ctx = opts["n_ctx"]
    # checkpoints share one architecture (validated): one tree tells the cost of all
    trees = _degree_trees(refs[:1] if paths else refs, opts)
    req = make_request(n_ctx=n_ctx, max_flops=opts.get("max_flops"),
                       max_memory=opts.get("max_memory"),
                       **({} if opts.get("max_configurations") is None else
                          {"max_configurations": opts["max_configurations"]}))
    sel = position_selector(n_ctx, None, False)
    n, b = len(refs), int(block_size)
    models, pairs = (n, n * (n + 1) // 2) if n <= b else (2 * b, b * b)
    budget = available_memory("numpy", None) if opts.get("max_memory") is None \
        else float(opts["max_memory"])
    seen = set()
    for i, t in enumerate(trees):
        sig = sequence_exact._shape_signature(t)
        if sig in seen:
            continue
        seen.add(sig)
        try:
            sequence_exact.check_configurations_bound(t, t)
            sequence_exact.check_cost(req.replace(max_memory=None), t, t, n_ctx, (), sel, "chaos")
        except CostTooHigh as exc:
            raise CostTooHigh(f"degree={K}: one pair of {refs[i] if paths else f'sources[{i}]'}"
                              f": {exc}") from None
        need, flops = sequence_exact.tree_block_cost(t, n_ctx, models, pairs)
        if need > budget:
            raise CostTooHigh(f"degree={K}: a block of {models} models ({pairs} pairs, "
                              f"block_size={b}) needs an estimated {need / 2**30:.3g} GiB (its "
                              f"models' chaos tensors held together and the largest working set "
                              f"of one sum) and {flops:.3g} FLOPs, over max_memory="
                              f"{budget / 2**30:.3g} GiB; use a smaller block_size "
                              f"(--block-size)")


def _check_sequence(refs: list, prints: list[dict], opts: dict) -> None:
    """Sequence models (transformer checkpoints or in-memory attention models): resolve
    ``opts["n_ctx"]`` and refuse what the blocks cannot compute, before any block runs.

    Raises:
        ValueError: a method other than exact/closure, a metric other than gaussian,
            ``output="each"``, ``n_ctx`` beyond a trained context, a device of "cuda";
        tensoralg.CostTooHigh: ``method="exact"`` for a model the exact attention path does
            not handle (two attention layers, an MLP block), naming the alternative.
    """
    from .errors import CostTooHigh
    from .strategies import sequence_exact

    if opts["method"] not in SEQUENCE_METHODS:
        raise ValueError(f"method: blocked matrices of sequence models (bilinear attention) "
                         f"are 'exact' (one attention layer) or 'closure', got "
                         f"{opts['method']!r}; for Monte Carlo use the unblocked `tensoralg "
                         f"matrix` (one shared-sample matrix)")
    if opts["metric"] != "gaussian":
        raise ValueError(f"metric: sequence models have only metric='gaussian', got "
                         f"{opts['metric']!r}")
    if isinstance(opts["output"], str):
        raise ValueError(f"output: {opts['output']!r} is not supported for sequence models in "
                         f"blocks; give None, an output index or a direction")
    if opts["device"] == "cuda":
        raise ValueError("device: sequence models are computed in float64 NumPy; use 'auto' or "
                         "'cpu'")
    paths = all(isinstance(r, str) for r in refs)
    if paths:
        opts["n_ctx"] = sequence_n_ctx(prints, opts["n_ctx"])
    if opts["method"] == "exact":
        probe = refs[:1] if paths else refs   # checkpoints share one architecture
        for i, r in enumerate(probe):
            net = _load(r, opts["n_ctx"], True)
            try:
                sequence_exact.count_configurations(net, net, n_ctx=opts["n_ctx"])
            except sequence_exact.AttentionNotSupported as exc:
                raise CostTooHigh(f"method='exact' for sequence models[{i}]: {exc}; use "
                                  f"method='closure' (exact at depth 1, approximate beyond)"
                                  ) from None


# ----------------------------------------------------------------------------------------
# the store
# ----------------------------------------------------------------------------------------

class BlockStore:
    """A folder of finished blocks plus the manifest that names what they were computed from.

    Args:
        folder: the store folder (created if missing; must be empty or an earlier store).
        manifest: what this run computes (see `gram`): compared with the stored one.
        resume: continue an earlier store made from the same checkpoints and options.

    Raises:
        ValueError: ``folder`` is a file, a non-empty folder without ``manifest.json``, an earlier
            store while ``resume`` is false, or an earlier store of different checkpoints or
            options (naming the first differences).
    """

    def __init__(self, folder: str | os.PathLike, manifest: dict, resume: bool):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if self.folder.exists() and not self.folder.is_dir():
            raise ValueError(f"out: {self.folder} exists and is not a folder")
        if path.is_file():
            if not resume:
                raise ValueError(f"out: {self.folder} holds a block store from an earlier run "
                                 f"({len(self.finished())} blocks finished); pass resume=True "
                                 f"(CLI: --resume) to continue it, or choose a new folder")
            try:
                old = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: corrupt manifest ({exc})") from None
            why = _manifest_diff(old, manifest)
            if why:
                raise ValueError(f"out: the store in {self.folder} was made from different "
                                 f"checkpoints or options: {why}; choose a new folder (or "
                                 f"remove the store to start over)")
        elif self.folder.is_dir() and any(self.folder.iterdir()):
            raise ValueError(f"out: {self.folder} is not empty and holds no {MANIFEST} (not a "
                             f"block store); choose a new or empty folder")
        else:
            atomic_write_json(path, manifest)
        self.manifest = manifest

    def _paths(self, I: int, J: int) -> list[Path]:
        return sorted(self.folder.glob(f"G_{I:05d}_{J:05d}_*.npy"))

    def finished(self) -> list[tuple[int, int]]:
        done = set()
        for p in self.folder.glob("G_*_*_*.npy"):
            parts = p.stem.split("_")
            if len(parts) == 4 and parts[1].isdigit() and parts[2].isdigit():
                done.add((int(parts[1]), int(parts[2])))
        return sorted(done)

    def read(self, I: int, J: int, shape: tuple) -> np.ndarray:
        """The finished block ``(I, J)``, after checking that its bytes still hash to its name.

        Raises:
            ValueError: several files for one block, a file whose SHA-256 does not match its name
                (edited or damaged), an unreadable file, or a block of the wrong shape or dtype.
        """
        paths = self._paths(I, J)
        if len(paths) != 1:
            raise ValueError(f"{self.folder}: {len(paths)} files for block ({I}, {J}): "
                             f"{[p.name for p in paths]}; delete them and resume")
        p = paths[0]
        data = p.read_bytes()
        digest = hashlib.sha256(data).hexdigest()[:16]
        if p.stem.split("_")[3] != digest:
            raise ValueError(f"{p}: the file's SHA-256 starts {digest}, its name says "
                             f"{p.stem.split('_')[3]}: it was changed after it was written; "
                             f"delete it and resume")
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{p}: unreadable block file ({exc}); delete it and resume") from None
        if arr.shape != shape or arr.dtype != np.float64:
            raise ValueError(f"{p}: block of shape {arr.shape} ({arr.dtype}), expected {shape} "
                             f"float64; delete it and resume")
        return arr

    def write(self, I: int, J: int, block: np.ndarray) -> Path:
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(block, dtype=np.float64), allow_pickle=False)
        data = buf.getvalue()
        name = f"G_{I:05d}_{J:05d}_{hashlib.sha256(data).hexdigest()[:16]}.npy"
        return atomic_write_bytes(self.folder / name, data)


def _manifest_diff(old: dict, new: dict) -> str:
    """Why an earlier manifest ``old`` does not describe this run ``new`` ("" if it does)."""
    if old.get("format") != new["format"]:
        return f"format {old.get('format')!r}, this run writes {new['format']!r}"
    for k in ("n", "block_size", "metric", "method", "output", "n_samples", "seed", "n_ctx",
              "degree"):
        if old.get(k) != new.get(k):
            return f"{k} was {old.get(k)!r}, now {new.get(k)!r}"
    keys = ("cfg_sha256", "weights_sha256", "model_sha256")
    for i, (a, b) in enumerate(zip(old.get("checkpoints", []), new["checkpoints"])):
        if any(a.get(k) != b.get(k) for k in keys):
            what = b.get("path") or f"model {i}"
            was = a.get("path") or f"model {i}"
            return f"checkpoint #{i} ({what}) differs in content from the stored #{i} ({was})"
    return ""


# ----------------------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------------------

def _check_args(block_size, client, workers, resume, device, retries) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, numbers.Integral)
                                or workers < 1):
        raise ValueError(f"workers: expected a positive integer, got {workers!r}")
    if workers is not None and too_many_workers(workers):
        raise ValueError(f"workers: {too_many_workers(workers)}")
    if client is not None and workers is not None:
        raise ValueError("client, workers: give one — workers=N starts a local cluster, client= "
                         "uses an existing one")
    if device not in _DEVICES:
        raise ValueError(f"device: expected one of {list(_DEVICES)}, got {device!r}")
    if isinstance(retries, bool) or not isinstance(retries, numbers.Integral) or retries < 0:
        raise ValueError(f"retries: expected a non-negative integer, got {retries!r}")
    if not isinstance(resume, bool):
        raise ValueError(f"resume: expected True or False, got {resume!r}")


def too_many_workers(workers: int) -> str:
    """Why ``workers`` local worker processes are refused ("" when they are not): more than
    ``os.cpu_count()`` single-threaded processes only compete for the cores (and 100 000 of them
    hang the machine before any block runs)."""
    cpus = os.cpu_count() or 1
    if workers <= cpus:
        return ""
    return (f"expected at most os.cpu_count() = {cpus} local worker processes (one per CPU "
            f"core), got {workers}; for a larger cluster start it yourself and connect to it "
            f"(client= / --scheduler)")


def need_distributed():
    try:
        import distributed
    except ImportError:
        raise ValueError("client/workers (--scheduler/--workers) need dask.distributed, which is "
                         "not installed: pip install 'tensoralg[dask]'") from None
    return distributed


def _blocks(n: int, b: int) -> list[tuple[int, int]]:
    nb = -(-n // b)
    return [(I, J) for I in range(nb) for J in range(I, nb)]


def _run(refs, prints, *, out, block_size, client, workers, resume, opts, retries,
         show_progress, on_block) -> tuple[np.ndarray, dict]:
    """The Gram matrix ``G`` (N, N[, K]) of ``refs`` and a summary of the run."""
    from tqdm.auto import tqdm

    n, b = len(refs), int(block_size)
    if opts.get("degree") is not None:
        _check_degree(refs, prints, opts, b)
    elif opts.get("sequence"):
        _check_sequence(refs, prints, opts)
    K = _n_outputs(refs[0], opts["output"])
    tail = () if K is None else (K,)
    span = lambda I: range(I * b, min(n, (I + 1) * b))  # noqa: E731
    grid = _blocks(n, b)
    manifest = {"format": FORMAT, "n": n, "block_size": b, "metric": opts["metric"],
                "method": opts["method"], "output": _jsonable_output(opts["output"]),
                "n_samples": opts["n_samples"] if opts["method"] == "montecarlo" else None,
                "seed": opts["seed"] if opts["method"] == "montecarlo" else None,
                "n_ctx": opts.get("n_ctx"), "degree": opts.get("degree"), "blocks": len(grid),
                "checkpoints": prints}
    store = BlockStore(out, manifest, resume) if out is not None else None
    G = np.empty((n, n) + tail, dtype=np.float64)

    def put(I, J, block):
        rows, cols = span(I), span(J)
        G[rows.start:rows.stop, cols.start:cols.stop] = block
        G[cols.start:cols.stop, rows.start:rows.stop] = np.swapaxes(block, 0, 1)

    done, in_grid = set(), set(grid)
    if store is not None:
        for I, J in store.finished():
            if (I, J) in in_grid:
                put(I, J, store.read(I, J, (len(span(I)), len(span(J))) + tail))
                done.add((I, J))
    todo = [blk for blk in grid if blk not in done]
    devices: dict[str, int] = {}
    bar = tqdm(total=len(grid), initial=len(done), desc="blocks", unit="block",
               disable=None if show_progress else True, leave=False)

    def finish(I, J, block, device):
        if store is not None:
            store.write(I, J, block)
        put(I, J, block)
        devices[device] = devices.get(device, 0) + 1
        bar.update(1)
        if on_block is not None:
            on_block(len(grid) - len(todo) + sum(devices.values()), len(grid))

    def task_args(I, J):
        rows = [refs[i] for i in span(I)]
        return rows, (None if I == J else [refs[j] for j in span(J)]), opts

    try:
        if not todo:
            pass
        elif client is None and workers is None:
            for I, J in todo:
                block, device = _block_task(*task_args(I, J))
                finish(I, J, block, device)
        elif client is not None:
            _distributed_run(client, todo, task_args, finish, retries)
        else:
            distributed = need_distributed()
            with distributed.LocalCluster(n_workers=int(workers), threads_per_worker=1,
                                          processes=True, dashboard_address=":0") as cluster, \
                    distributed.Client(cluster) as local:
                _distributed_run(local, todo, task_args, finish, retries)
    finally:
        bar.close()
    summary = {"blocks": len(grid), "resumed_blocks": len(done), "computed_blocks": len(todo),
               "block_size": b, "devices": devices, "store": None if store is None else str(store.folder),
               "n_ctx": opts.get("n_ctx")}
    return G, summary


def _distributed_run(client, todo, task_args, finish, retries) -> None:
    """Submit every block as a task, write each result as it arrives; on any failure or Ctrl-C
    cancel what is still pending (finished blocks are already stored)."""
    distributed = need_distributed()
    futures, run = {}, uuid.uuid4().hex[:12]
    try:
        for I, J in todo:
            fut = client.submit(_block_task, *task_args(I, J), pure=False, retries=retries,
                                key=f"tensoralg-block-{run}-{I}-{J}")
            futures[fut] = (I, J)
        for fut in distributed.as_completed(list(futures)):
            I, J = futures.pop(fut)
            block, device = fut.result()
            finish(I, J, block, device)
    finally:
        if futures:
            client.cancel(list(futures))


def _n_outputs(ref: Any, output: Any) -> int | None:
    """K of ``output="each"`` (None otherwise)."""
    if isinstance(output, str) and output == "each":
        if isinstance(ref, str):
            from .io import read_config

            return int(read_config(ref)["d_out"])
        return int(ref.out_features)
    return None


def _jsonable_output(output: Any) -> Any:
    if output is None or isinstance(output, (str, numbers.Integral)):
        return output if not isinstance(output, numbers.Integral) else int(output)
    return [float(v) for v in np.ravel(np.asarray(output, dtype=np.float64))]


def _options(metric, method, output, device, n_samples, seed, threads, max_flops,
             max_configurations, n_ctx=None, degree=None, max_memory=None) -> dict:
    from .request import check_options as _check_options

    _check_options(metric, method, "numpy")
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"threads: expected a positive integer, got {threads!r}")
    return {"metric": metric, "method": method, "output": output, "device": device,
            "n_samples": n_samples, "seed": seed, "threads": int(threads),
            "max_flops": max_flops, "max_configurations": max_configurations, "n_ctx": n_ctx,
            "degree": degree, "max_memory": max_memory}


def _mark_sequence(refs: list, prints: list[dict], opts: dict) -> None:
    """Set ``opts["sequence"]`` for transformer checkpoints or in-memory attention models;
    refuse ``n_ctx`` for position-free ones."""
    seq = any("n_ctx_trained" in p for p in prints) or any(
        getattr(r, "is_sequence_model", False) for r in refs if not isinstance(r, str))
    if not seq and opts.get("n_ctx") is not None:
        raise ValueError("n_ctx: only for sequence models (bilinear-transformer checkpoints or "
                         "models with attention)")
    opts["sequence"] = seq


_API_DOC = """
    Args:
        sources: checkpoint folders (paths; loaded lazily where each block runs, validated up
            front by `validate_checkpoints`) or models in memory (tensoralg networks or
            objects with ``to_network()``; sent to the workers with their blocks).
        out: store folder for the finished blocks (``None``: keep nothing on disk). Must be
            missing, empty or an earlier store.
        block_size: checkpoints per block side (default 64): a worker holds at most
            ``2 * block_size`` models; there are ``nb (nb + 1) / 2`` blocks, ``nb = ceil(N / b)``.
        client: a ``dask.distributed.Client``: blocks run as tasks on its cluster (the
            checkpoint paths must be readable from the workers).
        workers: start a local Dask cluster of this many single-threaded worker processes for
            this call (at most ``os.cpu_count()``; exclusive with ``client``). Neither: blocks
            run here, one after another.
        resume: continue from the blocks already in ``out`` (refused if the store was made from
            other checkpoints — compared by SHA-256 of their files — or other options); False
            refuses an existing store.
        metric, method, output, n_samples, seed, max_flops, max_configurations: as for
            `tensoralg.gram` (Monte Carlo: every block draws the same ``seed`` samples, so
            the entries equal those of one unblocked call).
        degree: an int ``K``: the Gram matrix of the truncations ``f_{<=K}`` (``S<=K``,
            `tensoralg.degree_similarity_matrix`) of bias-free sequence models, exact:
            every block builds its models' truncations and chaos forms once, then its pairs
            (`_degree_block`); the first model's own pair is held against ``max_flops`` and the
            largest block against ``max_memory`` before any block runs. None (default): the
            models themselves.
        max_memory: with ``degree``, the bytes one block may hold (default the memory
            available).
        n_ctx: sequence models only (bilinear-transformer checkpoints, models with attention):
            the context length; for transformer checkpoints default the shortest trained one,
            longer refused. Their blocks run in float64 NumPy with ``method="exact"`` (at most
            one attention layer) or ``"closure"`` (approximate at depth >= 2) through
            `tensoralg.strategies.sequence_exact`, the functions of the unblocked matrix.
        device: ``"auto"`` (default: each worker uses CUDA through the torch backend when
            ``torch.cuda.is_available()``, else the NumPy backend), ``"cpu"`` or ``"cuda"``.
        threads: torch CPU threads per block task (default 1).
        retries: extra attempts for a block task that raises (Dask ``retries``; default 2).
            Blocks of a worker that dies are rescheduled by the scheduler without counting here.
        show_progress: a tqdm bar over blocks with its ETA (hidden when stderr is no terminal).
        on_block: ``callback(done, total)`` after each block is stored (e.g. for logging).

    Raises:
        TypeError / ValueError: bad arguments (named), before any work.
        FileNotFoundError / ValueError: a missing or corrupt checkpoint, named, before any block
            runs; a store of other checkpoints or options.
        ImportError: ``client``/``workers`` without ``dask.distributed`` installed.
        tensoralg.CostTooHigh: an exact block over the engine's budget (with ``degree``: a pair
            over ``max_flops`` or the largest block over ``max_memory``, with the estimate,
            before any block runs).
        KeyboardInterrupt: passed on after pending tasks are cancelled; the store keeps every
            finished block and resumes from them.
"""


def gram(sources: Sequence[Any], out: str | os.PathLike | None = None, *,
         block_size: int = DEFAULT_BLOCK_SIZE, client: Any = None, workers: int | None = None,
         resume: bool = True, metric: str = "gaussian", method: str = "exact",
         output: Any = None, device: str = "auto", n_samples: int = 100_000, seed: int = 0,
         threads: int = 1, max_flops: float | None = None, max_configurations: int | None = None,
         n_ctx: int | None = None, retries: int = 2, show_progress: bool = False,
         on_block: Callable[[int, int], Any] | None = None,
         return_summary: bool = False, degree: int | None = None,
         max_memory: float | None = None):
    """Gram matrix ``G[i, j] = <m_i, m_j>`` (float64 ``(N, N)``, ``(N, N, out)`` for
    ``output="each"``) of N same-architecture checkpoints, computed in blocks (see the module
    docstring); equal to [`tensoralg.gram`][tensoralg.gram] up to float64 rounding (the blocks run
    the same batched contractions on sub-stacks). ``return_summary=True`` also returns a dict:
    blocks, resumed/computed blocks, devices used, store folder.
    """
    _check_args(block_size, client, workers, resume, device, retries)
    if max_memory is not None and degree is None:
        raise ValueError("max_memory: a block budget of the degree=K matrix only; give degree")
    opts = _options(metric, method, output, device, n_samples, seed, threads, max_flops,
                    max_configurations, n_ctx, degree, max_memory)
    if client is not None or workers is not None:
        need_distributed()
    refs, prints = _prepare_sources(sources)
    _mark_sequence(refs, prints, opts)
    G, summary = _run(refs, prints, out=out, block_size=block_size, client=client,
                      workers=workers, resume=resume, opts=opts, retries=retries,
                      show_progress=show_progress, on_block=on_block)
    return (G, summary) if return_summary else G


def gram_of_validated(paths: Sequence[str], prints: list[dict], out=None, *,
                      block_size: int = DEFAULT_BLOCK_SIZE, client: Any = None,
                      workers: int | None = None, resume: bool = True, metric: str = "gaussian",
                      method: str = "exact", output: Any = None, device: str = "auto",
                      n_samples: int = 100_000, seed: int = 0, threads: int = 1,
                      n_ctx: int | None = None, retries: int = 2, show_progress: bool = False,
                      on_block=None, degree: int | None = None):
    """`gram` (returning ``(G, summary)``) for checkpoint ``paths`` already validated by
    `validate_checkpoints` (``prints``: its result), so that a caller that needed the
    configs first does not hash the files twice."""
    _check_args(block_size, client, workers, resume, device, retries)
    opts = _options(metric, method, output, device, n_samples, seed, threads, None, None, n_ctx,
                    degree)
    if client is not None or workers is not None:
        need_distributed()
    if len(prints) != len(paths):
        raise ValueError(f"prints: {len(prints)} fingerprints for {len(paths)} paths")
    _mark_sequence(list(paths), prints, opts)
    return _run([str(p) for p in paths], prints, out=out, block_size=block_size, client=client,
                workers=workers, resume=resume, opts=opts, retries=retries,
                show_progress=show_progress, on_block=on_block)


def similarity_matrix(sources: Sequence[Any], out: str | os.PathLike | None = None, *,
                      return_summary: bool = False, **kwargs):
    """Similarity matrix ``S[i, j] = G_ij / sqrt(G_ii G_jj)`` in [-1, 1] (clipped for rounding)
    of N same-architecture checkpoints, with ``G`` from `gram` (blocked, resumable,
    optionally on Dask; same keywords) and the norms ``G_ii`` from its diagonal blocks. Equal to
    [`tensoralg.similarity_matrix`][tensoralg.similarity_matrix] within float64 rounding (tested to
    1e-12; the rounding of entry ``(i, j)`` is of order ``eps`` times its scale ``||m_i|| ||m_j||``,
    which for a similarity is 1: near-orthogonal pairs carry larger elementwise relative
    differences, as between any two summation orders).

    Raises (besides those of `gram`):
        ValueError: a checkpoint whose network has norm zero (named).
    """
    G, summary = gram(sources, out, return_summary=True, **kwargs)
    S = similarity_from_gram(G, sources)
    return (S, summary) if return_summary else S


def similarity_from_gram(G: np.ndarray, sources: Sequence[Any] | None = None) -> np.ndarray:
    """``G_ij / sqrt(G_ii G_jj)`` clipped to [-1, 1] (Cauchy-Schwarz; clips last-ulp excess).

    Raises:
        ValueError: a diagonal entry ``<= 0`` (naming the source when ``sources`` are paths).
    """
    d = np.einsum("ii...->i...", G)
    bad = np.flatnonzero(np.any((d <= 0).reshape(len(d), -1), axis=1))
    if bad.size:
        names = [str(list(sources)[i]) if sources is not None and
                 isinstance(list(sources)[i], (str, os.PathLike)) else f"#{i}" for i in bad[:5]]
        raise ValueError(f"similarity_matrix: checkpoints {names} have norm zero; similarity is "
                         f"undefined for the zero function")
    return np.clip(G / np.sqrt(np.einsum("i...,j...->ij...", d, d)), -1.0, 1.0)


gram.__doc__ += _API_DOC
similarity_matrix.__doc__ += "\n    See `gram` for the arguments.\n"
