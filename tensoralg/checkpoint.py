"""Checkpoints of [`tensoralg.nn.BilinearNet`][tensoralg.nn.BilinearNet], of the bilinear
transformer and of any tensoralg network (architecture ``tensoralg_network``, e.g. a module compiled
by [`tensoralg.from_torch`][tensoralg.compile.from_torch]): a folder with ``weights.safetensors``
and a flat ``cfg.json``, written atomically by `tensoralg.io.save_folder` (format:
``docs/spec.md``).

``cfg.json`` holds the architecture and sizes (the model's
[`config`][tensoralg.nn.BilinearNet.config]), the weight dtype, the package version
(``tensoralg_version``), the training ``step`` and free-form provenance strings (``data``, ``run``,
... — anything flat).

Wrapping someone else's bilinear model
--------------------------------------
A plain torch ``state_dict`` of a bilinear network ``embed -> bilinear block(s) -> head`` can be
imported with [`from_state_dict`][tensoralg.checkpoint.from_state_dict], given a map from our
parameter names to theirs::

    sd = torch.load("their_model.pt", weights_only=True)      # a plain state_dict
    model = from_state_dict(sd, {
        "embed.weight": "W_E",                 # (d_model, d_in)
        "blocks.0.left.weight": "mlp.W_l",     # (d_hidden, d_model)
        "blocks.0.left.bias": "mlp.b_l",       # (d_hidden,)   nn.Linear keeps a bias by default
        "blocks.0.right.weight": "mlp.W_r",    # (d_hidden, d_model)
        "blocks.0.right.bias": "mlp.b_r",
        "blocks.0.down.weight": "mlp.W_d",     # (d_model, d_hidden)
        "blocks.0.down.bias": "mlp.b_d",       # (d_model,)
        "head.weight": "W_U",                  # (d_out, d_model)
    }, residual=True, check=(their_model, x))  # x: a few inputs of shape (n, d_in)
    save_checkpoint("ckpt/theirs", model, step=0, provenance={"source": "their_model.pt"})

Sizes are read from the shapes. Every tensor of the state_dict must be mapped or listed in
``ignore=`` (a tensor left out would silently change the function: dropped biases are the
classic case). Block biases that their model lacks (e.g. ``down`` without a bias) are zeros.
``residual`` is not visible in the weights and has no default. ``check=(module, inputs)``
compares the export with their own forward pass and raises on a mismatch. Weights stored as
``(in, out)`` must be transposed first (``sd[k].T``). A model without an embedding or head: map
it to an identity matrix. Walk-through: ``proofs_notebooks/06_bring_your_own_model.ipynb``.

Forward probe: [`save_checkpoint`][tensoralg.checkpoint.save_checkpoint] stores the model's float64
outputs on a fixed, deterministic probe input (``probe_output`` in ``cfg.json``);
[`load_checkpoint`][tensoralg.checkpoint.load_checkpoint] recomputes them and refuses a checkpoint
whose ``cfg.json`` and weights no longer compute the saved function (e.g. a ``residual`` flag edited
by hand).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .io import load_folder, read_config, save_folder
from .nn import ARCHITECTURE, BilinearNet
from .transformer import ARCHITECTURE as TRANSFORMER
from .transformer import BilinearTransformer

_MODELS = {ARCHITECTURE: BilinearNet, TRANSFORMER: BilinearTransformer}
TRANSFORMER_PROBE_ROWS = 2

__all__ = ["NETWORK", "save_checkpoint", "load_checkpoint", "load_network", "from_state_dict",
           "check_export", "probe_input", "probe_tokens", "read_checkpoint_config", "FORMAT"]

FORMAT = "tensoralg.checkpoint/1"
_RESERVED = {"format", "architecture", "step", "tensoralg_version", "probe_rows", "probe_output",
             "n_ctx_note"}
PROBE_ROWS = 4
# Relative tolerance of the forward probe: both sides are float64 forward passes of the same
# weights, so they differ only by rounding (about 1e-16 times the depth's condition); 1e-9
# relative to the largest probe output leaves room for another BLAS or thread count, while
# every edit of the architecture flags that we tried changed the outputs by O(1) relative.
PROBE_RTOL = 1e-9


def probe_input(d_in: int, rows: int = PROBE_ROWS) -> np.ndarray:
    """The fixed probe input ``(rows, d_in)``, float64: ``x[i, j] = sqrt(2) sin(φ (i d_in + j + 1))``
    with ``φ`` the golden ratio — deterministic without a random generator (so it cannot change
    with a library version), entries of unit mean square, no two columns alike."""
    k = np.arange(1, rows * d_in + 1, dtype=np.float64).reshape(rows, d_in)
    return math.sqrt(2.0) * np.sin(k * (1 + math.sqrt(5)) / 2)


def probe_tokens(vocab: int, n_ctx: int, rows: int = 2) -> np.ndarray:
    """The fixed token probe ``(rows, n_ctx)`` of a
    [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer]:
    ``ids[i, t] = floor(vocab · frac(φ (i n_ctx + t + 1)))`` with ``φ`` the golden ratio (no random
    generator)."""
    k = np.arange(1, rows * n_ctx + 1, dtype=np.float64).reshape(rows, n_ctx)
    return np.minimum(np.floor(vocab * np.mod(k * (1 + math.sqrt(5)) / 2, 1.0)),
                      vocab - 1).astype(np.int64)


def _probe(model: BilinearNet, rows: int = PROBE_ROWS) -> np.ndarray:
    """``model``'s float64 outputs on [`probe_input`][tensoralg.checkpoint.probe_input] (computed on
    a float64 copy on the CPU); a transformer's logits on
    [`probe_tokens`][tensoralg.checkpoint.probe_tokens], flattened per row."""
    m = copy.deepcopy(model).to(device="cpu", dtype=torch.float64).eval()
    with torch.no_grad():
        if isinstance(model, BilinearTransformer):
            hp = model.hparams
            return m(torch.from_numpy(probe_tokens(hp["vocab"], hp["n_ctx"], rows))).reshape(
                rows, -1).numpy()
        x = torch.from_numpy(probe_input(model.hparams["d_in"], rows))
        return m(x).numpy()


# ----------------------------------------------------------------------------------------
# any tensoralg network (hand-built Sequential, attention with biases, compiled modules)
# ----------------------------------------------------------------------------------------

NETWORK = "tensoralg_network"
NETWORK_PROBE_ROWS = 2
NETWORK_PROBE_N_CTX = 3   # sequence models without a mask array are probed at this length
_NODE_FIELDS = {"linear": ("weight", "bias"),
                "bilinear": ("left", "right", "down", "left_bias", "right_bias", "down_bias"),
                "bilinear_attention": ("q1", "k1", "q2", "k2", "v", "o", "q1_bias", "k1_bias",
                                       "q2_bias", "k2_bias", "v_bias", "o_bias")}


def _flatten_network(net) -> tuple[list[str], dict[str, np.ndarray]]:
    """Pre-order node list (``cfg["nodes"]``) and tensors ``n{i}.{field}`` of a network tree."""
    from .layers import Bilinear, BilinearAttention, Linear, Residual, Sequential

    nodes, tensors = [], {}

    def visit(layer):
        i = len(nodes)
        if isinstance(layer, Sequential):
            nodes.append(f"sequential {len(layer.layers)}")
            for sub in layer.layers:
                visit(sub)
            return
        if isinstance(layer, Residual):
            nodes.append("residual")
            visit(layer.inner)
            return
        if isinstance(layer, BilinearAttention):
            mask = layer.mask if isinstance(layer.mask, str) else "array"
            nodes.append(f"bilinear_attention mask={mask} scale={float(layer.scale)!r} "
                         f"rope={layer.rope!r}"
                         + ("" if layer.position_maps is None else " position_maps=array"))
            if mask == "array":
                tensors[f"n{i}.mask"] = layer.mask
            if layer.position_maps is not None:
                tensors[f"n{i}.position_maps"] = layer.position_maps
        elif isinstance(layer, (Linear, Bilinear)):
            nodes.append("linear" if isinstance(layer, Linear) else "bilinear")
        else:
            raise TypeError(f"model: unknown layer type {type(layer).__name__}")
        for f in _NODE_FIELDS[nodes[-1].split()[0]]:
            if getattr(layer, f) is not None:
                tensors[f"n{i}.{f}"] = getattr(layer, f)

    visit(net)
    return nodes, tensors


def _network_from_tensors(nodes: list, tensors: Mapping[str, Any], where: str):
    """Rebuild the network of `_flatten_network` (raises ValueError on any mismatch)."""
    from .layers import Bilinear, BilinearAttention, Linear, Residual, Sequential

    pos = [0]

    def take():
        if pos[0] >= len(nodes):
            raise ValueError(f"{where}: cfg.json nodes end early")
        i = pos[0]
        pos[0] += 1
        return i, str(nodes[i]).split()

    def get(i, f):
        t = tensors.get(f"n{i}.{f}")
        return None if t is None else np.asarray(torch.as_tensor(t).to(torch.float64).numpy())

    def build():
        i, parts = take()
        kind = parts[0]
        if kind == "sequential":
            return Sequential([build() for _ in range(int(parts[1]))])
        if kind == "residual":
            return Residual(build())
        if kind not in _NODE_FIELDS:
            raise ValueError(f"{where}: cfg.json node {i} has unknown kind {kind!r}")
        kw = {f: get(i, f) for f in _NODE_FIELDS[kind]}
        if kind == "linear":
            return Linear(**kw)
        if kind == "bilinear":
            return Bilinear(**kw)
        opts = dict(p.split("=", 1) for p in parts[1:])
        mask = opts.get("mask", "causal")
        rope = opts.get("rope", "None")
        maps = opts.get("position_maps")
        if maps not in (None, "array") or (maps == "array" and get(i, "position_maps") is None):
            raise ValueError(f"{where}: cfg.json node {i} has position_maps={maps!r} but "
                             f"weights.safetensors no tensor n{i}.position_maps")
        return BilinearAttention(**kw, mask=get(i, "mask") if mask == "array" else mask,
                                 scale=float(opts["scale"]),
                                 rope=None if rope == "None" else float(rope),
                                 position_maps=get(i, "position_maps") if maps else None)

    try:
        net = build()
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{where}: cfg.json nodes are malformed ({exc})") from None
    if pos[0] != len(nodes):
        raise ValueError(f"{where}: cfg.json has {len(nodes) - pos[0]} nodes after the network")
    used = {f"n{i}.{f}" for i in range(len(nodes)) for f in
            _NODE_FIELDS.get(str(nodes[i]).split()[0], ()) + ("mask", "position_maps")}
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{where}: weights.safetensors holds tensors no node uses: {extra}")
    return net


def network_shapes(cfg: Mapping[str, Any]) -> dict:
    """Tensor name -> shape of a ``tensoralg_network`` checkpoint, from its ``cfg.json``."""
    out = {}
    for entry in cfg.get("shapes", []):
        name, _, dims = str(entry).partition("=")
        out[name] = tuple(int(d) for d in dims.split("x")) if dims else ()
    return out


def _network_probe(net, rows: int, n_ctx: int | None) -> np.ndarray:
    d = net.in_features
    if net.is_sequence_model:
        x = probe_input(d, rows * n_ctx).reshape(rows, n_ctx, d)
    else:
        x = probe_input(d, rows)
    return np.asarray(net(x), dtype=np.float64).reshape(rows, -1)


def _depth(net) -> int:
    from .layers import Bilinear, BilinearAttention, Residual, Sequential

    if isinstance(net, Sequential):
        return sum(_depth(x) for x in net.layers)
    if isinstance(net, Residual):
        return _depth(net.inner)
    return int(isinstance(net, (Bilinear, BilinearAttention)))


def _save_network(path, net, step, provenance) -> Path:
    if net.is_exact:
        raise ValueError("model: a network with exact rational weights; safetensors stores "
                         "floats (save its layer spec, net.to_spec(), as JSON instead)")
    nodes, arrays = _flatten_network(net)
    tensors = {}
    for name, a in arrays.items():
        a = np.asarray(a, dtype=np.float64)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"model: tensor {name!r} has non-finite (NaN/inf) entries; refusing "
                             f"to write {path}")
        tensors[name] = torch.from_numpy(np.ascontiguousarray(a))
    seq = bool(net.is_sequence_model)
    n_ctx = net.n_ctx if net.n_ctx is not None else (NETWORK_PROBE_N_CTX if seq else None)
    if n_ctx is not None and net.max_n_ctx is not None:   # within the position maps' table
        n_ctx = min(n_ctx, net.max_n_ctx)
    arch = {"architecture": NETWORK, "d_in": int(net.in_features),
            "d_out": int(net.out_features), "n_layers": _depth(net), "sequence": seq,
            "n_ctx": net.n_ctx, "nodes": nodes,
            "shapes": [f"{k}={'x'.join(str(d) for d in v.shape)}" for k, v in tensors.items()],
            "dtype": "float64"}
    if net.n_ctx_note:   # optional: how a compiled network's fixed n_ctx came about
        arch["n_ctx_note"] = str(net.n_ctx_note)
    cfg = _config(arch, step, provenance)
    cfg["probe_rows"] = NETWORK_PROBE_ROWS
    cfg["probe_n_ctx"] = n_ctx
    cfg["probe_output"] = [float(v) for v in _network_probe(net, NETWORK_PROBE_ROWS,
                                                            n_ctx).ravel()]
    return save_folder(path, tensors, cfg)


class SavedNetwork:
    """A loaded ``tensoralg_network`` checkpoint: ``network`` (the tensoralg layers) and its
    ``cfg``; ``to_network()`` returns the network (the interface of the torch models)."""

    def __init__(self, network, cfg):
        self.network, self.cfg = network, dict(cfg)
        self.hparams = {k: cfg.get(k) for k in ("d_in", "d_out", "n_layers", "n_ctx")}

    def to_network(self, embedding: bool = False, n_ctx: int | None = None):
        if embedding:
            raise ValueError("embedding: a tensoralg_network checkpoint has no separate "
                             "embedding (compile with inputs='tokens' for one-hot inputs)")
        fixed = self.network.n_ctx
        if n_ctx is not None and fixed is not None and n_ctx != fixed:
            raise ValueError(f"n_ctx={n_ctx}: this network's attention mask fixes n_ctx={fixed}"
                             f"{self.network.n_ctx_note}")
        return self.network

    def config(self) -> dict:
        return dict(self.cfg)


def _load_network(path, tensors, cfg) -> tuple[SavedNetwork, dict]:
    nodes = cfg.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValueError(f"{path}: cfg.json of a {NETWORK!r} has no 'nodes' list")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}; weights must be "
                             f"floating point")
        if not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor {name!r} has non-finite (NaN/inf) entries")
    want = network_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if want and want != got:
        bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        raise ValueError(f"{path}: weights.safetensors does not match cfg.json shapes at {bad}")
    try:
        net = _network_from_tensors(nodes, tensors, str(path))
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    _restore_n_ctx_note(net, cfg.get("n_ctx_note"), path)
    if "probe_output" not in cfg:
        warnings.warn(f"{path}: cfg.json has no forward probe; the config cannot be checked "
                      f"against the weights", stacklevel=3)
    else:
        rows = int(cfg.get("probe_rows", NETWORK_PROBE_ROWS))
        want_out = np.asarray(cfg["probe_output"], dtype=np.float64).reshape(rows, -1)
        got_out = _network_probe(net, rows, cfg.get("probe_n_ctx"))
        scale = float(np.max(np.abs(want_out))) if want_out.size else 0.0
        if got_out.shape != want_out.shape or not float(np.max(np.abs(got_out - want_out))) <= \
                PROBE_RTOL * max(scale, np.finfo(np.float64).tiny):
            raise ValueError(f"{path}: weights and cfg.json do not compute the function saved "
                             f"with them (forward probe differs); was cfg.json edited?")
    return SavedNetwork(net, cfg), cfg


def _restore_n_ctx_note(net, note, path) -> None:
    """Give the attention layers with a fixed n_ctx (a mask array) the saved ``n_ctx_note``
    ([`tensoralg.from_torch`][tensoralg.compile.from_torch] sets it on each of them; absent in older
    checkpoints and for networks without one: nothing to do)."""
    from .layers import BilinearAttention, Residual, Sequential

    if note is None:
        return
    if not isinstance(note, str):
        raise ValueError(f"{path}: cfg.json 'n_ctx_note' must be a string, got "
                         f"{type(note).__name__}")

    def visit(layer):
        if isinstance(layer, Sequential):
            for sub in layer.layers:
                visit(sub)
        elif isinstance(layer, Residual):
            visit(layer.inner)
        elif isinstance(layer, BilinearAttention) and layer.n_ctx is not None:
            layer._n_ctx_note = note

    visit(net)


def _config(arch: dict, step: int, provenance) -> dict:
    """The flat ``cfg.json`` of a checkpoint: format, architecture, step and the provenance
    entries (which may not overwrite the architecture or be nested)."""
    cfg = {"format": FORMAT, **arch, "step": int(step)}
    for key, value in dict(provenance or {}).items():
        if key in arch or key in _RESERVED:
            raise ValueError(f"provenance: key {key!r} would overwrite the checkpoint's "
                             f"architecture entry")
        if isinstance(value, dict):
            raise ValueError(f"provenance: entry {key!r} is a dict; cfg.json is flat")
        cfg[key] = value
    return cfg


def save_checkpoint(path: str | os.PathLike, model: Any, *, step: int = 0,
                    provenance: Mapping[str, Any] | None = None) -> Path:
    """Save ``model`` to folder ``path`` (weights then config, each written atomically).

    ``model``: a [`BilinearNet`][tensoralg.nn.BilinearNet], a
    [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer], or any tensoralg network
    (``Linear``/``Bilinear``/``Residual``/``Sequential``/ ``BilinearAttention`` with biases, blocks
    of any widths, a network compiled by [`tensoralg.from_torch`][tensoralg.compile.from_torch]):
    the last kind is stored as architecture ``"tensoralg_network"`` — tensors ``n{i}.{field}``
    (float64) and, in ``cfg.json``, the pre-order ``nodes`` of the layer tree (``"sequential 3"``,
    ``"residual"``, ``"linear"``, ``"bilinear"``,
    ``"bilinear_attention mask=... scale=... rope=..."``), their ``shapes``, ``d_in``, ``d_out``,
    ``n_layers`` (multilinear layers), ``sequence``, the forward probe and, for a network compiled
    by [`tensoralg.from_torch`][tensoralg.compile.from_torch] with attention, ``n_ctx_note`` (the
    n_ctx it was compiled at and how to recompile; optional: older checkpoints load without).

    Args:
        step: training step of this checkpoint.
        provenance: flat extra entries for ``cfg.json`` (data set, run config, ...); values must
            be JSON scalars or lists; keys must not shadow the architecture keys.

    Raises:
        TypeError: ``model`` is not a [`BilinearNet`][tensoralg.nn.BilinearNet] or a
            [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer].
        ValueError: a weight with NaN/inf entries (naming the tensor; nothing is written),
            nested provenance values or a key that shadows the architecture config.
    """
    from .layers import Layer

    if isinstance(model, SavedNetwork):
        model = model.network
    if isinstance(model, Layer):
        return _save_network(path, model, step, provenance)
    if not isinstance(model, (BilinearNet, BilinearTransformer)):
        raise TypeError(f"model: expected a tensoralg network, a tensoralg.nn.BilinearNet or a "
                        f"BilinearTransformer, got {type(model).__name__} (compile a torch "
                        f"module with tensoralg.from_torch first)")
    arch = model.config()
    cfg = _config(arch, step, provenance)
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"model: tensor {name!r} has {bad} non-finite (NaN/inf) entries of "
                             f"{t.numel()}; refusing to write {path} (did training diverge?)")
    rows = TRANSFORMER_PROBE_ROWS if isinstance(model, BilinearTransformer) else PROBE_ROWS
    cfg["probe_rows"] = rows
    cfg["probe_output"] = [float(v) for v in _probe(model, rows).ravel()]  # repr round-trips exactly
    return save_folder(path, tensors, cfg)


def read_checkpoint_config(path: str | os.PathLike) -> dict:
    """``cfg.json`` of a checkpoint folder (clear errors for a missing/corrupt file)."""
    return read_config(path)


def load_checkpoint(path: str | os.PathLike) -> tuple[BilinearNet, dict]:
    """Load ``(model, cfg)`` from a folder written by
    [`save_checkpoint`][tensoralg.checkpoint.save_checkpoint] (a
    [`BilinearNet`][tensoralg.nn.BilinearNet] or a
    [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer], by the ``architecture``
    entry).

    The forward probe stored by [`save_checkpoint`][tensoralg.checkpoint.save_checkpoint] is
    recomputed and compared (relative tolerance ``PROBE_RTOL`` of the largest probe output); a
    checkpoint written before probes existed loads with a warning.

    A ``tensoralg_network`` checkpoint loads as a
    [`SavedNetwork`][tensoralg.checkpoint.SavedNetwork] (its ``network`` and ``to_network()``).

    Raises:
        FileNotFoundError: a missing folder, ``cfg.json`` or ``weights.safetensors``.
        ValueError: a corrupt/truncated file, another ``format`` version, a foreign
            ``architecture``, a ``step`` that is not an integer, integer weights, weights whose
            names or shapes do not match the config (naming the tensor and both shapes), or
            weights and config that no longer compute the saved probe outputs (an edited
            ``cfg.json``: ``residual``, ``bias``, ...).
    """
    tensors, cfg = load_folder(path)
    fmt = cfg.get("format", FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"{path}: cfg.json format {fmt!r} is not {FORMAT!r} (written by "
                         f"another tensoralg version?); this version reads {FORMAT!r}")
    _check_step(path, cfg)
    if cfg.get("architecture") == NETWORK:
        return _load_network(path, tensors, cfg)
    cls = _MODELS.get(cfg.get("architecture"))
    if cls is None:
        raise ValueError(f"{path}: cfg.json architecture {cfg.get('architecture')!r} is not "
                         f"one of {sorted(_MODELS)}")
    try:
        model = cls.from_config(cfg)
    except ValueError as exc:
        raise ValueError(f"{path}: cfg.json does not describe a model: {exc}") from exc
    expected = model.state_dict()
    missing, extra = _name_diff(expected, tensors)
    if missing or extra:
        raise ValueError(f"{path}: weights.safetensors does not match cfg.json: missing "
                         f"{missing}, unexpected {extra}")
    for name, ref in expected.items():
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)} "
                             f"but cfg.json implies {tuple(ref.shape)}")
        if not tensors[name].is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} has dtype {tensors[name].dtype}; "
                             f"weights must be floating point")
        if not torch.isfinite(tensors[name]).all():
            raise ValueError(f"{path}: tensor {name!r} has non-finite (NaN/inf) entries")
        if tensors[name].dtype.itemsize < ref.dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has dtype {tensors[name].dtype} but "
                             f"cfg.json records {cfg.get('dtype')!r} weights: converted after "
                             f"saving, they cannot compute the saved forward probe; save the "
                             f"model in {cfg.get('dtype')} (or float64)")
    model.load_state_dict({k: tensors[k].to(ref.dtype) for k, ref in expected.items()})
    model.eval()
    _check_probe(path, model, cfg)
    return model, cfg


def _check_step(path, cfg: Mapping[str, Any]) -> None:
    """``step`` (written by [`save_checkpoint`][tensoralg.checkpoint.save_checkpoint] as an integer)
    is an integer when present."""
    step = cfg.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"{path}: cfg.json 'step' must be an integer, got {step!r}")


def _check_probe(path, model: BilinearNet, cfg: Mapping[str, Any]) -> None:
    if "probe_output" not in cfg:
        warnings.warn(f"{path}: cfg.json has no forward probe (written before tensoralg stored "
                      f"one); the config cannot be checked against the weights", stacklevel=3)
        return
    rows = cfg.get("probe_rows", PROBE_ROWS)
    try:
        want = np.asarray(cfg["probe_output"], dtype=np.float64).reshape(rows, -1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: cfg.json probe_output is malformed ({exc})") from exc
    got = _probe(model, rows)
    if want.shape != got.shape:
        raise ValueError(f"{path}: cfg.json probe_output has shape {want.shape} but the model "
                         f"gives {got.shape}")
    if not np.all(np.isfinite(got)):
        raise ValueError(f"{path}: the forward probe overflowed (non-finite outputs): the "
                         f"weights are too large to evaluate the model in its dtype")
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    if not err <= PROBE_RTOL * max(scale, np.finfo(np.float64).tiny):
        raise ValueError(f"{path}: weights and cfg.json do not compute the function saved with "
                         f"them: max |Δ output| = {err:.3g} on the forward probe (outputs up to "
                         f"{scale:.3g}; tolerance {PROBE_RTOL:g} relative). Was cfg.json edited "
                         f"(residual, bias, n_layers)?")


def load_network(path: str | os.PathLike, n_ctx: int | None = None):
    """The exact tensoralg network of the checkpoint at ``path`` (see
    [`load_checkpoint`][tensoralg.checkpoint.load_checkpoint]); ``n_ctx``: the context length of a
    sequence model (a transformer's prefix)."""
    model = load_checkpoint(path)[0]
    return model.to_network() if n_ctx is None else model.to_network(n_ctx=n_ctx)


def from_state_dict(state_dict: Mapping[str, torch.Tensor], names: Mapping[str, str] | None = None,
                    *, residual: bool, ignore: Iterable[str] = (),
                    check: tuple[Any, Any] | None = None, dtype: str | None = None) -> BilinearNet:
    """Wrap a plain torch ``state_dict`` of a bilinear model as a
    [`BilinearNet`][tensoralg.nn.BilinearNet].

    Args:
        state_dict: their tensors.
        names: our name -> their name (``embed.weight``, ``blocks.{i}.left.weight``,
            ``blocks.{i}.right.weight``, ``blocks.{i}.down.weight``, ``head.weight`` and the
            matching ``.bias`` names); ``None`` = the names are already ours.
        residual: whether their blocks have a residual connection ``h + block(h)`` (not visible
            in the weights; required).
        ignore: their tensor names that are deliberately not part of the function (buffers,
            optimizer leftovers). Every other tensor of ``state_dict`` must be mapped.
        check: ``(module, inputs)``: their module and an input batch ``(n, d_in)``; the export is
            compared with ``module(inputs)`` (relative tolerance 1e-9 of the largest output in
            float64, 1e-4 in lower precision) and a mismatch raises.
        dtype: ``"float32"``/``"float64"``; default: the dtype of their embedding.

    Block biases: if any ``blocks.*.{left,right,down}.bias`` is mapped, the unmapped ones are
    zeros (their model has no bias there, e.g. ``down`` built with ``bias=False``), which is the
    same function exactly.

    Raises:
        TypeError: ``residual`` not given.
        ValueError: a mapped or ignored name missing from ``state_dict``; tensors of
            ``state_dict`` that are neither mapped nor ignored (listed); missing required
            weights; shapes that do not chain (naming the tensor, its shape and the expected
            one); NaN/inf entries; with ``check``, outputs that differ from ``module(inputs)``
            (the largest difference, and the usual causes).
    """
    if not isinstance(residual, bool):
        raise TypeError(f"residual: expected True or False, got {residual!r}")
    names = dict(names) if names is not None else {k: k for k in state_dict}
    for ours, theirs in names.items():
        if theirs not in state_dict:
            raise ValueError(f"names: {ours!r} maps to {theirs!r}, which is not in the "
                             f"state_dict (keys: {sorted(state_dict)[:20]})")
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    unknown = [k for k in ignore if k not in state_dict]
    if unknown:
        raise ValueError(f"ignore: {unknown} not in the state_dict (keys: {sorted(state_dict)[:20]})")
    left_out = sorted(set(state_dict) - set(names.values()) - set(ignore))
    if left_out:
        raise ValueError(f"state_dict: tensors {left_out} are neither mapped in names nor listed "
                         f"in ignore=; leaving them out would change the function (e.g. biases "
                         f"map to 'blocks.<i>.left.bias', 'embed.bias', 'head.bias'). Map them, "
                         f"or pass ignore={left_out!r} if they are not part of the forward pass")
    ours = {k: torch.as_tensor(state_dict[v]) for k, v in names.items()}
    for req in ("embed.weight", "head.weight", "blocks.0.left.weight"):
        if req not in ours:
            raise ValueError(f"names: no tensor for {req!r}; a bilinear net needs embed.weight, "
                             f"blocks.<i>.left/right/down.weight and head.weight")
    n_layers = 0
    while f"blocks.{n_layers}.left.weight" in ours:
        n_layers += 1
    for k, t in ours.items():
        want = 1 if k.endswith(".bias") else 2
        if t.ndim != want:
            raise ValueError(f"state_dict: {k!r} (their {names[k]!r}) has shape {tuple(t.shape)}; "
                             f"expected a {'vector' if want == 1 else 'matrix'}")
    d_model, d_in = ours["embed.weight"].shape
    d_out = ours["head.weight"].shape[0]
    # d_model and d_hidden each appear in several tensors: take the size most of them agree on,
    # so that the error below names the tensor(s) that disagree, not their consistent neighbours.
    votes_model = [("embed.weight", 0), ("head.weight", 1)]
    votes_hidden = []
    for i in range(n_layers):
        for side in ("left", "right"):
            votes_model.append((f"blocks.{i}.{side}.weight", 1))
            votes_hidden.append((f"blocks.{i}.{side}.weight", 0))
        votes_model.append((f"blocks.{i}.down.weight", 0))
        votes_hidden.append((f"blocks.{i}.down.weight", 1))
    d_model = _majority(ours, votes_model)
    d_hidden = _majority(ours, votes_hidden)
    bias = any(f"blocks.{i}.{side}.bias" in ours for i in range(n_layers)
               for side in ("left", "right", "down"))
    dtype = dtype or {torch.float64: "float64"}.get(ours["embed.weight"].dtype, "float32")
    model = BilinearNet(d_in, d_out, d_model=d_model, d_hidden=d_hidden, n_layers=n_layers,
                        bias=bias, residual=residual, embed_bias="embed.bias" in ours,
                        head_bias="head.bias" in ours, dtype=dtype)
    expected = model.state_dict()
    if bias:  # a block bias their model does not have is zero (the same function)
        for i in range(n_layers):
            for side in ("left", "right", "down"):
                key = f"blocks.{i}.{side}.bias"
                if key not in ours and f"blocks.{i}.{side}.weight" in ours:
                    ours[key] = torch.zeros_like(expected[key])
                    names[key] = "(zeros)"
    missing, extra = _name_diff(expected, ours)
    if missing or extra:
        raise ValueError(f"names: incomplete or inconsistent mapping: missing {missing}, "
                         f"unexpected {extra}")
    bad = [f"{k!r} (their {names[k]!r}) has shape {tuple(ours[k].shape)}, expected "
           f"{tuple(ref.shape)}" for k, ref in expected.items()
           if tuple(ours[k].shape) != tuple(ref.shape)]
    if bad:
        raise ValueError(f"state_dict: {'; '.join(bad)} (sizes taken from the other weights: "
                         f"d_in={d_in}, d_out={d_out}, d_model={d_model}, d_hidden={d_hidden}, "
                         f"each the size most tensors agree on; blocks of different widths: "
                         f"compile the module with tensoralg.from_torch and save that)")
    for k, t in ours.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"state_dict: {k!r} (their {names[k]!r}) has NaN/inf entries")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in ours.items()})
    model.eval()
    if check is not None:
        check_export(model, *_check_pair_arg(check))
    else:
        warnings.warn("from_state_dict: no check=(module, inputs) given: a square weight stored "
                      "transposed, (in, out) instead of (out, in), has the right shape and cannot "
                      "be detected without comparing with the module's forward pass (or compile "
                      "the module itself with tensoralg.from_torch)", stacklevel=2)
    return model


def _check_pair_arg(check: Any) -> tuple[Any, Any]:
    if not (isinstance(check, (tuple, list)) and len(check) == 2 and callable(check[0])):
        raise TypeError(f"check: expected (module, inputs), got {type(check).__name__}")
    return check[0], check[1]


def check_export(model: Any, module: Any, inputs: Any) -> float:
    """Compare ``model`` (an export) with ``module(inputs)``; return the max absolute difference.

    ``model``: any tensoralg network (or an object with ``to_network()``: a
    [`BilinearNet`][tensoralg.nn.BilinearNet], a transformer, a loaded checkpoint); ``module``: any
    callable (a torch module is run on a float64 CPU copy of ``inputs`` as given).
    ``inputs``: array or tensor ``(n, d_in)``, or ``(n, n_ctx, d_in)`` for a sequence model
    (the network's input: the residual stream). The export runs in float64; the tolerance is
    ``1e-9`` of the largest reference output when ``module`` returns float64, ``1e-4`` otherwise
    (float32 forward passes round at about 1e-7 per operation).

    Raises:
        ValueError: ``inputs`` of the wrong shape, non-finite reference outputs, or a difference
            over the tolerance (with the likely causes: residual flag, left-out biases,
            transposed weights).
    """
    from .layers import as_network

    net = as_network(model, "model")
    x = torch.as_tensor(inputs)
    d_in = net.in_features
    want = 3 if net.is_sequence_model else 2
    if x.ndim != want or x.shape[-1] != d_in or x.shape[0] < 1:
        raise ValueError(f"check: inputs must have shape (n, {'n_ctx, ' if want == 3 else ''}"
                         f"{d_in}) with n >= 1, got {tuple(x.shape)}")
    if not torch.is_floating_point(x):
        x = x.to(torch.float64)
    with torch.no_grad():
        ref = module(x)
    ref = torch.as_tensor(ref).detach()
    tol_rel = 1e-9 if ref.dtype == torch.float64 else 1e-4
    ref64 = ref.to("cpu", torch.float64)
    if not torch.isfinite(ref64).all():
        raise ValueError("check: module(inputs) has NaN/inf entries")
    ours = torch.from_numpy(np.asarray(net(x.to("cpu", torch.float64).numpy()),
                                       dtype=np.float64))
    if ours.shape != ref64.shape:
        raise ValueError(f"check: the export gives outputs of shape {tuple(ours.shape)}, "
                         f"module(inputs) {tuple(ref64.shape)}")
    err = float((ours - ref64).abs().max())
    scale = float(ref64.abs().max())
    if not err <= tol_rel * max(scale, np.finfo(np.float64).tiny):
        raise ValueError(f"check: the export differs from module(inputs): max |Δ| = {err:.3g} "
                         f"(outputs up to {scale:.3g}; tolerance {tol_rel:g} relative). Usual "
                         f"causes: the residual flag, biases left out or ignored, weights stored "
                         f"(in, out) that need .T, or a nonlinearity the export cannot represent")
    return err


def _majority(tensors: Mapping[str, torch.Tensor], votes: list[tuple[str, int]]) -> int:
    """The size that most of ``tensors[name].shape[axis]`` agree on (ties: the first seen)."""
    from collections import Counter

    sizes = [int(tensors[k].shape[ax]) for k, ax in votes if k in tensors]
    return Counter(sizes).most_common(1)[0][0]


def _name_diff(expected: Mapping[str, Any], got: Mapping[str, Any]) -> tuple[list, list]:
    """Tensor names the model needs but ``got`` lacks, and names ``got`` has in excess."""
    return sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
