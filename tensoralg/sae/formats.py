"""SAE folders in the layout SAELens reads and writes (``SAE.save_model`` / ``SAE.load_from_disk``).

Layout (SAELens 6.x, ``sae_lens/constants.py`` and ``SAEConfig.to_dict``):

* ``sae_weights.safetensors`` — exactly ``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``,
  ``W_dec (d_sae, d_in)``, ``b_dec (d_in,)``. SAELens loads this file into its model with a
  strict ``load_state_dict``, so nothing else may be in it;
* ``cfg.json`` — ``architecture`` (``"topk"`` or ``"abstopk"``, both SAELens architectures),
  ``d_in``, ``d_sae``, ``k``, ``dtype``, ``device``, ``apply_b_dec_to_input`` (true),
  ``normalize_activations`` (``"none"`` or ``"layer_norm"``), ``reshape_activations``
  (``"none"``), ``rescale_acts_by_decoder_norm`` (false), plus tensoralg's own flat fields
  (the :class:`~tensoralg.sae.models.SAEConfig`, ``train_*`` entries), which SAELens drops
  (it keeps only the fields of its config dataclass);
* ``encoder_steps.safetensors`` — only for the multi-step encoder: ``W_step`` or
  ``step_scale``. SAELens does not read it: it loads a multi-step SAE as the single-step
  ``abstopk``/``topk`` SAE of its first encoder pass ``z_0`` (the ``encoder`` field of
  ``cfg.json`` says ``"multistep"``; tensoralg reads both files).

Loading accepts these folders (written by tensoralg or by SAELens) and tensoralg's earlier
layout (``weights.safetensors``, architecture ``"isae"`` or ``"topk"`` with an ``activation``
field). Any other architecture, or a SAELens option tensoralg does not implement, is an error
naming the field — never a silent default (an earlier version read SAELens TopK folders as
AbsTopK).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import io as tio
from .._version import __version__
from .models import SAEConfig, SparseAutoencoder

__all__ = ["SAE_WEIGHTS_FILE", "ENCODER_STEPS_FILE", "LEGACY_WEIGHTS_FILE", "ARCHITECTURES",
           "save_sae", "load_sae", "sae_config_from_cfg"]

SAE_WEIGHTS_FILE = "sae_weights.safetensors"      # SAELens: constants.SAE_WEIGHTS_FILENAME
ENCODER_STEPS_FILE = "encoder_steps.safetensors"
LEGACY_WEIGHTS_FILE = tio.WEIGHTS_FILE             # tensoralg <= 0.x SAE folders
CONFIG_FILE = tio.CONFIG_FILE                      # SAELens: constants.SAE_CFG_FILENAME
ARCHITECTURES = ("topk", "abstopk")                # the SAELens architectures read here
_LEGACY_ARCHITECTURES = ("isae",)                  # written by earlier tensoralg versions
_SAELENS_CORE = ("W_enc", "b_enc", "W_dec", "b_dec")
_DTYPE_NAMES = {"float32": "float32", "torch.float32": "float32", "float64": "float64",
                "torch.float64": "float64", "float16": "float32", "torch.float16": "float32",
                "bfloat16": "float32", "torch.bfloat16": "float32"}


def saelens_cfg(model: SparseAutoencoder) -> dict:
    """The flat ``cfg.json`` of ``model``: SAELens's fields and the :class:`SAEConfig`."""
    c = model.cfg
    cfg = c.to_dict()
    cfg.update({"architecture": c.activation, "d_in": c.d_in, "d_sae": c.d_sae, "k": c.k,
                "dtype": c.dtype, "device": "cpu", "apply_b_dec_to_input": True,
                "normalize_activations": c.normalize_activations,
                "reshape_activations": "none", "rescale_acts_by_decoder_norm": False})
    return cfg


def save_sae(path, model: SparseAutoencoder, extra_cfg: dict | None = None) -> Path:
    """Save ``model`` into folder ``path`` in the SAELens layout (module docstring).

    Files are written atomically, the weights first and ``cfg.json`` last, so a folder whose
    ``cfg.json`` exists is complete; a stale ``weights.safetensors`` of the earlier layout and a
    stale ``encoder_steps.safetensors`` are removed after ``cfg.json`` is written.

    Raises:
        ValueError: a nested (dict-valued) ``extra_cfg`` entry.
    """
    from safetensors.torch import save as st_save

    cfg = saelens_cfg(model)
    for key, value in (extra_cfg or {}).items():
        if isinstance(value, dict):
            raise ValueError(f"extra_cfg: entry {key!r} is a dict; cfg.json is flat")
        if key in cfg and key in SAEConfig.__dataclass_fields__:
            raise ValueError(f"extra_cfg: entry {key!r} would overwrite the SAE config")
        cfg[key] = value
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    core = {n: tensors.pop(n) for n in _SAELENS_CORE}
    tio.atomic_write_bytes(path / SAE_WEIGHTS_FILE, st_save(core))
    if tensors:
        tio.atomic_write_bytes(path / ENCODER_STEPS_FILE, st_save(tensors))
    cfg.setdefault("tensoralg_version", __version__)
    tio.atomic_write_json(path / CONFIG_FILE, cfg)
    stale = [path / LEGACY_WEIGHTS_FILE] + ([] if tensors else [path / ENCODER_STEPS_FILE])
    for old in stale:
        if old.is_file():
            os.unlink(old)
    return path


def sae_config_from_cfg(cfg: dict, where: str = "cfg.json") -> SAEConfig:
    """:class:`SAEConfig` of a ``cfg.json`` written by tensoralg (either layout) or SAELens.

    The architecture decides the activation: ``"topk"`` -> TopK (ReLU), ``"abstopk"`` ->
    AbsTopK; tensoralg's legacy ``"isae"`` takes its ``activation`` field.

    Raises:
        ValueError: no or an unknown ``architecture``; an ``activation`` field that contradicts
            it; SAELens options not implemented here (``apply_b_dec_to_input`` false,
            ``normalize_activations`` other than ``"none"``/``"layer_norm"``,
            ``reshape_activations`` other than ``"none"``, ``rescale_acts_by_decoder_norm``
            true, ``finetuning_scaling_factor`` true); a missing ``d_in``/``d_sae``/``k``; an
            unsupported ``dtype``.
    """
    arch = cfg.get("architecture")
    known = list(ARCHITECTURES) + list(_LEGACY_ARCHITECTURES)
    if arch is None:
        raise ValueError(f"{where}: no 'architecture' field; expected one of {known} (SAELens "
                         f"folders before 6.0 without it are 'standard' ReLU SAEs, not read here)")
    if arch not in known:
        raise ValueError(f"{where}: architecture {arch!r} is not supported; expected one of "
                         f"{known} (SAELens TopK / AbsTopK, or tensoralg's earlier 'isae')")
    act = cfg.get("activation")
    if arch in _LEGACY_ARCHITECTURES:
        if act not in ARCHITECTURES:
            raise ValueError(f"{where}: architecture {arch!r} needs an 'activation' field of "
                             f"{list(ARCHITECTURES)}, got {act!r}")
    elif act is not None and act != arch:
        raise ValueError(f"{where}: 'activation' {act!r} contradicts architecture {arch!r}")
    act = act if arch in _LEGACY_ARCHITECTURES else arch
    checks = (("apply_b_dec_to_input", True, "false: tensoralg always subtracts b_dec first"),
              ("reshape_activations", "none", "hook_z reshaping is not implemented"),
              ("rescale_acts_by_decoder_norm", False, "fold the decoder norms first "
                                                     "(SAELens: fold_W_dec_norm) and save again"),
              ("finetuning_scaling_factor", False, "not implemented"))
    for field, ok, why in checks:
        if field in cfg and cfg[field] != ok:
            raise ValueError(f"{where}: {field}={cfg[field]!r} is not supported ({why})")
    norm = cfg.get("normalize_activations", "none")
    if norm is None or norm is False:
        norm = "none"
    if norm not in ("none", "layer_norm"):
        raise ValueError(f"{where}: normalize_activations={norm!r} is not supported; expected "
                         f"'none' or 'layer_norm' (tensoralg folds its own scaling into the "
                         f"weights)")
    dtype = cfg.get("dtype", "float32")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"{where}: dtype {dtype!r} is not supported; expected one of "
                         f"{sorted(_DTYPE_NAMES)}")
    missing = [f for f in ("d_in", "d_sae", "k") if f not in cfg]
    if missing:
        raise ValueError(f"{where}: missing required SAE fields {missing}")
    fields = {**cfg, "activation": act, "normalize_activations": norm,
              "dtype": _DTYPE_NAMES[dtype]}
    return SAEConfig.from_dict(fields)


def check_device(device, name: str = "device") -> torch.device:
    """``torch.device(device)`` after checking it exists here: a CUDA (or MPS) device without
    CUDA (MPS) in this torch build / machine, or a CUDA index past the device count, is a
    ``ValueError`` naming ``name``, raised before any file is read or tensor allocated."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}: not a torch device: {device!r} ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {device!r} requested but CUDA is not available here "
                             f"(torch {torch.__version__}, built with CUDA "
                             f"{torch.version.cuda or 'none'}); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: {device!r} requested but only "
                             f"{torch.cuda.device_count()} CUDA device(s) exist")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}: {device!r} requested but MPS is not available here; "
                         f"use device='cpu'")
    return dev


def load_sae(path, device: str = "cpu") -> SparseAutoencoder:
    """Load an SAE folder written by :func:`save_sae`, by SAELens (TopK, AbsTopK), or by an
    earlier tensoralg (``weights.safetensors``). Half-precision SAELens weights are upcast to
    float32 (exact).

    Raises:
        FileNotFoundError: a missing folder, ``cfg.json`` or weights file.
        ValueError: see :func:`sae_config_from_cfg`; corrupt files; missing, unexpected or
            mis-shaped tensors; NaN/inf weights; a ``device`` that does not exist here (e.g.
            ``"cuda"`` without CUDA; :func:`check_device`), before any file is read.
    """
    from safetensors.torch import load_file

    device = str(check_device(device))
    path = Path(path)
    cfg = tio.read_config(path)
    sae_cfg = sae_config_from_cfg(cfg, str(path / CONFIG_FILE))
    files = [path / SAE_WEIGHTS_FILE]
    if not files[0].is_file():
        files = [path / LEGACY_WEIGHTS_FILE]
        if not files[0].is_file():
            raise FileNotFoundError(f"{path}: holds no {SAE_WEIGHTS_FILE} (nor the earlier "
                                    f"{LEGACY_WEIGHTS_FILE}); not a complete SAE folder")
    elif sae_cfg.encoder == "multistep":
        files.append(path / ENCODER_STEPS_FILE)
        if not files[1].is_file():
            raise FileNotFoundError(f"{files[1]}: missing (cfg.json says encoder='multistep')")
    tensors = {}
    for f in files:
        try:
            loaded = load_file(str(f), device=device)
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{f}: corrupt or truncated safetensors file ({exc})") from exc
        tensors.update(loaded)
    model = SparseAutoencoder(sae_cfg).to(device)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{path}: the weights lack tensors {missing}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{path}: unexpected tensors {extra} for architecture "
                         f"{cfg.get('architecture')!r} (expected {sorted(expected)})")
    bad = {n: (tuple(tensors[n].shape), expected[n]) for n in expected
           if tuple(tensors[n].shape) != expected[n]}
    if bad:
        raise ValueError(f"{path}: tensor shapes (got, expected) do not match cfg.json: {bad}")
    for n in expected:
        if not bool(torch.isfinite(tensors[n]).all()):
            raise ValueError(f"{path}: tensor {n} contains NaN or inf")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[n].to(p.dtype))
    return model
