"""Array backends: NumPy float64, torch (any device and dtype) and exact rationals.

Every strategy computes on NumPy arrays (float64, or object arrays of
`fractions.Fraction` for the exact backend) prepared once, then hands each operand to a
*converter* that maps it to the backend's array type. The same contraction plan therefore runs
on every backend (docs/mathematics.md §4, as opt_einsum's per-library backends).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["BACKENDS", "converter", "to_numpy", "fraction_array", "available_memory",
           "is_exact_array", "torch_device"]

BACKENDS = ("numpy", "torch", "exact")


def fraction_array(arr: np.ndarray) -> np.ndarray:
    """``arr`` as an object array of exact `Fraction` (floats taken exactly)."""
    return np.vectorize(Fraction, otypes=[object])(arr)


def is_exact_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == object


def torch_device(device: Any):
    """The torch device for ``device`` (None: CUDA when available, else CPU).

    Raises:
        ValueError: an unknown device name, or CUDA asked for where it is not available.
    """
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: unknown torch device {device!r} ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available here "
                         f"(torch.cuda.is_available() is False); use device='cpu' or None")
    return dev


def _torch_dtype(dtype: Any):
    import torch

    if dtype is None:
        return torch.float64
    tdtype = dtype
    if not isinstance(dtype, (str, torch.dtype)):   # a NumPy dtype or type (np.float32)
        with contextlib.suppress(TypeError):
            tdtype = np.dtype(dtype).name
    if isinstance(tdtype, str):
        tdtype = getattr(torch, tdtype, None)
    if not isinstance(tdtype, torch.dtype) or not tdtype.is_floating_point:
        raise ValueError(f"dtype: unknown torch floating dtype {dtype!r}")
    if tdtype not in (torch.float64, torch.float32):
        # 16-bit floats keep about 3 significant digits and overflow above 65504 (float16):
        # an inner product of a few hundred terms is rounding noise or inf
        raise ValueError(f"dtype: the torch backend computes in float64 (the default) or "
                         f"float32, got {dtype!r} (16-bit floats keep about 3 significant "
                         f"digits)")
    return tdtype


def converter(backend: str, device: Any = None, dtype: Any = None) -> Callable[[np.ndarray], Any]:
    """A function mapping a NumPy operand to ``backend``'s array (validates device and dtype).

    Raises:
        ValueError: a device for a CPU-only backend, a dtype the backend does not compute in,
            an unknown torch device or dtype.
    """
    if backend != "torch" and device is not None:
        raise ValueError(f"device: only backend='torch' runs on a device; backend={backend!r} "
                         f"computes on the CPU (got device={device!r})")
    if backend == "numpy":
        if dtype not in (None, np.float64, "float64"):
            raise ValueError(f"dtype: the numpy backend computes in float64, got {dtype!r}")
        return lambda x: np.asarray(x, dtype=np.float64)
    if backend == "exact":
        return lambda x: x
    import torch

    dev = torch_device(device)
    tdtype = _torch_dtype(dtype)
    return lambda x: torch.as_tensor(np.asarray(x, dtype=np.float64), dtype=tdtype, device=dev)


def to_numpy(val: Any) -> np.ndarray:
    """A backend result as a NumPy array (torch tensors are moved to the CPU as float64)."""
    if isinstance(val, np.ndarray):
        return val
    if hasattr(val, "detach"):
        return val.detach().to("cpu").double().numpy()
    return np.asarray(val)


def itemsize(backend: str, dtype: Any = None) -> int:
    """Bytes per element that a backend's arrays take (object arrays: a pointer plus a
    Fraction, counted as 100 bytes)."""
    if backend == "exact":
        return 100
    if backend == "torch" and dtype is not None:
        return _torch_dtype(dtype).itemsize
    return 8


_HOST_MEMORY: list = [0.0, 0]  # (time read, bytes): /proc/meminfo read at most once a second


def available_memory(backend: str = "numpy", device: Any = None) -> int:
    """Bytes that a computation may safely use: half of the free memory of the device that
    computes (CUDA: ``torch.cuda.mem_get_info``; otherwise the host's available RAM, from
    ``/proc/meminfo`` or ``os.sysconf``)."""
    if backend == "torch":
        dev = torch_device(device)
        if dev.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(dev)
            return int(free) // 2
    import time

    now = time.monotonic()
    if now - _HOST_MEMORY[0] < 1.0:
        return _HOST_MEMORY[1]
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 << 30
    _HOST_MEMORY[:] = [now, int(avail) // 2]
    return int(avail) // 2
