"""Argument checks shared by the torch models [`tensoralg.nn`][tensoralg.nn] and
`tensoralg.transformer` (a module of its own so that neither imports the other for them)."""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def torch_dtype(dtype: Any) -> torch.dtype:
    """``"float32"`` / ``"float64"`` (or that torch dtype) as a torch dtype; else ValueError."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The name (``"float32"`` / ``"float64"``) of a dtype accepted by `torch_dtype`."""
    return {v: k for k, v in _DTYPES.items()}[dtype]


def check_positive_int(value: Any, name: str) -> int:
    """``value`` if it is an int >= 1 (not a bool). Raises ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def check_finite_parameters(module: Any) -> None:
    """Every parameter of ``module`` is finite; else a ValueError naming the first bad one
    (its dotted name, e.g. ``attn.0.q1``, shape and count), before anything is exported. The
    exported network may not read every parameter (``BilinearTransformer.to_network`` leaves
    the embedding out by default), but a checkpoint holding NaN or inf is corrupt either way."""
    for name, p in module.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            raise ValueError(f"{name}: {bad} non-finite (NaN or inf) entries in the "
                             f"{type(module).__name__} parameter of shape {tuple(p.shape)}; "
                             f"weights must be finite")
