"""Checkpoints of :class:`tensoralg.nn.BilinearNet`: a folder with ``weights.safetensors`` and a
flat ``cfg.json``, written atomically by :func:`tensoralg.io.save_folder`.

``cfg.json`` holds the architecture and sizes (the model's :meth:`~tensoralg.nn.BilinearNet.config`),
the weight dtype, the package version (``tensoralg_version``), the training ``step`` and free-form
provenance strings (``data``, ``run``, ... — anything flat).

Wrapping someone else's bilinear model
--------------------------------------
A plain torch ``state_dict`` of a bilinear network ``embed -> bilinear block(s) -> head`` can be
imported with :func:`from_state_dict`, given a map from our parameter names to theirs::

    sd = torch.load("their_model.pt", weights_only=True)      # a plain state_dict
    model = from_state_dict(sd, {
        "embed.weight": "W_E",                 # (d_model, d_in)
        "blocks.0.left.weight": "mlp.W_l",     # (d_hidden, d_model)
        "blocks.0.right.weight": "mlp.W_r",    # (d_hidden, d_model)
        "blocks.0.down.weight": "mlp.W_d",     # (d_model, d_hidden)
        "head.weight": "W_U",                  # (d_out, d_model)
    }, residual=True)
    save_checkpoint("ckpt/theirs", model, step=0, provenance={"source": "their_model.pt"})

Sizes are read from the shapes; biases are used when their names are mapped (all of
``blocks.*.{left,right,down}.bias`` together). Weights stored as ``(in, out)`` must be transposed
first (``sd[k].T``). A model without an embedding or head: map it to an identity matrix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .io import load_folder, read_config, save_folder
from .nn import ARCHITECTURE, BilinearNet

__all__ = ["save_checkpoint", "load_checkpoint", "load_network", "from_state_dict",
           "read_checkpoint_config", "FORMAT"]

FORMAT = "tensoralg.checkpoint/1"
_RESERVED = {"format", "architecture", "step", "tensoralg_version"}


def save_checkpoint(path: str | os.PathLike, model: BilinearNet, *, step: int = 0,
                    provenance: Mapping[str, Any] | None = None) -> Path:
    """Save ``model`` to folder ``path`` (weights then config, each written atomically).

    Args:
        step: training step of this checkpoint.
        provenance: flat extra entries for ``cfg.json`` (data set, run config, ...); values must
            be JSON scalars or lists; keys must not shadow the architecture keys.

    Raises:
        TypeError: ``model`` is not a :class:`BilinearNet`.
        ValueError: a weight with NaN/inf entries (naming the tensor; nothing is written),
            nested provenance values or a key that shadows the architecture config.
    """
    if not isinstance(model, BilinearNet):
        raise TypeError(f"model: expected a tensoralg.nn.BilinearNet, got {type(model).__name__} "
                        f"(wrap a state_dict with tensoralg.checkpoint.from_state_dict first)")
    arch = model.config()
    cfg = {"format": FORMAT, **arch, "step": int(step)}
    for key, value in dict(provenance or {}).items():
        if key in arch or key in _RESERVED:
            raise ValueError(f"provenance: key {key!r} would overwrite the checkpoint's "
                             f"architecture entry")
        if isinstance(value, dict):
            raise ValueError(f"provenance: entry {key!r} is a dict; cfg.json is flat")
        cfg[key] = value
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"model: tensor {name!r} has {bad} non-finite (NaN/inf) entries of "
                             f"{t.numel()}; refusing to write {path} (did training diverge?)")
    return save_folder(path, tensors, cfg)


def read_checkpoint_config(path: str | os.PathLike) -> dict:
    """``cfg.json`` of a checkpoint folder (clear errors for a missing/corrupt file)."""
    return read_config(path)


def load_checkpoint(path: str | os.PathLike) -> tuple[BilinearNet, dict]:
    """Load ``(model, cfg)`` from a folder written by :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: a missing folder, ``cfg.json`` or ``weights.safetensors``.
        ValueError: a corrupt/truncated file, a foreign ``architecture``, or weights whose
            names or shapes do not match the config (naming the tensor and both shapes).
    """
    tensors, cfg = load_folder(path)
    if cfg.get("architecture") != ARCHITECTURE:
        raise ValueError(f"{path}: cfg.json architecture {cfg.get('architecture')!r} is not "
                         f"{ARCHITECTURE!r}")
    try:
        model = BilinearNet.from_config(cfg)
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
        if not torch.isfinite(tensors[name]).all():
            raise ValueError(f"{path}: tensor {name!r} has non-finite (NaN/inf) entries")
    model.load_state_dict({k: tensors[k].to(ref.dtype) for k, ref in expected.items()})
    model.eval()
    return model, cfg


def load_network(path: str | os.PathLike):
    """The exact tensoralg network of the checkpoint at ``path`` (see :func:`load_checkpoint`)."""
    return load_checkpoint(path)[0].to_network()


def from_state_dict(state_dict: Mapping[str, torch.Tensor], names: Mapping[str, str] | None = None,
                    *, residual: bool = False, dtype: str | None = None) -> BilinearNet:
    """Wrap a plain torch ``state_dict`` of a bilinear model as a :class:`BilinearNet`.

    Args:
        state_dict: their tensors.
        names: our name -> their name (``embed.weight``, ``blocks.{i}.left.weight``,
            ``blocks.{i}.right.weight``, ``blocks.{i}.down.weight``, ``head.weight`` and
            optionally the matching ``.bias`` names); ``None`` = the names are already ours.
        residual: whether their blocks have a residual connection (not visible in weights).
        dtype: ``"float32"``/``"float64"``; default: the dtype of their embedding.

    Raises:
        ValueError: a mapped name missing from ``state_dict``, missing required weights,
            or shapes that do not chain (naming the tensor, its shape and the expected one).
    """
    names = dict(names) if names is not None else {k: k for k in state_dict}
    for ours, theirs in names.items():
        if theirs not in state_dict:
            raise ValueError(f"names: {ours!r} maps to {theirs!r}, which is not in the "
                             f"state_dict (keys: {sorted(state_dict)[:20]})")
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
    bias = "blocks.0.left.bias" in ours
    dtype = dtype or {torch.float64: "float64"}.get(ours["embed.weight"].dtype, "float32")
    model = BilinearNet(d_in, d_out, d_model=d_model, d_hidden=d_hidden, n_layers=n_layers,
                        bias=bias, residual=residual, embed_bias="embed.bias" in ours,
                        head_bias="head.bias" in ours, dtype=dtype)
    expected = model.state_dict()
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
                         f"each the size most tensors agree on)")
    for k, t in ours.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"state_dict: {k!r} (their {names[k]!r}) has NaN/inf entries")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in ours.items()})
    model.eval()
    return model


def _majority(tensors: Mapping[str, torch.Tensor], votes: list[tuple[str, int]]) -> int:
    """The size that most of ``tensors[name].shape[axis]`` agree on (ties: the first seen)."""
    from collections import Counter

    sizes = [int(tensors[k].shape[ax]) for k, ax in votes if k in tensors]
    return Counter(sizes).most_common(1)[0][0]


def _name_diff(expected: Mapping[str, Any], got: Mapping[str, Any]) -> tuple[list, list]:
    """Tensor names the model needs but ``got`` lacks, and names ``got`` has in excess."""
    return sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
