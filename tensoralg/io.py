"""Saved artifacts: a folder with ``weights.safetensors`` and a flat ``cfg.json``; never pickles.

Every write goes to a temporary file in the destination folder and is renamed into place
(``os.replace``), so a crash never leaves a half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._version import __version__

WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "cfg.json"

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "check_folder", "save_folder",
           "load_folder", "read_config", "WEIGHTS_FILE", "CONFIG_FILE"]


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, then rename).
    Missing parent folders are created; the file gets the usual mode (0666 less the umask).

    Raises:
        IsADirectoryError: ``path`` is an existing folder.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a folder; expected the path of a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the usual mode
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, **kwargs: Any) -> Path:
    kwargs.setdefault("indent", 2)
    kwargs.setdefault("sort_keys", False)
    return atomic_write_text(path, json.dumps(obj, **kwargs) + "\n")


def save_folder(path: str | os.PathLike, tensors: Mapping[str, Any], cfg: Mapping[str, Any]) -> Path:
    """Save ``tensors`` (name -> torch tensor) and the flat config ``cfg`` into folder ``path``.

    ``cfg`` must be flat (values: str, int, float, bool, None or lists of those); the package
    version is added as ``tensoralg_version``. The weights are written first and the config
    last, each atomically, so a folder whose ``cfg.json`` exists is complete.

    Raises:
        ValueError: a nested (dict-valued) config entry.
    """
    import torch
    from safetensors.torch import save as st_save

    for key, value in cfg.items():
        if isinstance(value, dict):
            raise ValueError(f"cfg: entry {key!r} is a dict; cfg.json is flat")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    contiguous = {k: torch.as_tensor(v).detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path / WEIGHTS_FILE, st_save(contiguous))
    full_cfg = dict(cfg)
    full_cfg.setdefault("tensoralg_version", __version__)
    atomic_write_json(path / CONFIG_FILE, full_cfg)
    return path


def read_config(path: str | os.PathLike) -> dict:
    """Read ``cfg.json`` of a saved folder, with clear errors for a missing or corrupt file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    if not path.is_dir():
        raise ValueError(f"{path}: expected a checkpoint folder holding {WEIGHTS_FILE} and "
                         f"{CONFIG_FILE}, got a file")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path}: missing ({path} is not a complete checkpoint)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{cfg_path}: corrupt JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def check_folder(path: str | os.PathLike) -> dict:
    """``cfg.json`` of a saved folder (`read_config`) after checking that its weights file
    exists and its safetensors header is whole (the header and the data offsets it names,
    against the file's size) — milliseconds, without importing torch, so that a CLI refuses a
    truncated or corrupt checkpoint before its heavy imports. Raises as `load_folder`."""
    from safetensors import safe_open

    cfg = read_config(path)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(f"{weights}: missing ({path} is not a complete checkpoint)")
    try:
        with safe_open(str(weights), framework="numpy"):
            pass
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"{weights}: corrupt or truncated safetensors file ({exc})") from exc
    return cfg


def load_folder(path: str | os.PathLike, device: str = "cpu") -> tuple[dict, dict]:
    """Load ``(tensors, cfg)`` saved by `save_folder`.

    Raises:
        FileNotFoundError: a missing folder or file.
        ValueError: a corrupt or truncated ``weights.safetensors`` or ``cfg.json``.
    """
    from safetensors.torch import load_file

    cfg = read_config(path)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(f"{weights}: missing ({path} is not a complete checkpoint)")
    try:
        tensors = load_file(str(weights), device=device)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"{weights}: corrupt or truncated safetensors file ({exc})") from exc
    return tensors, cfg
