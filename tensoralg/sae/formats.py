"""SAE folders in the layout SAELens reads and writes (``SAE.save_model`` / ``SAE.load_from_disk``).

Layout (SAELens 6.x, ``sae_lens/constants.py`` and ``SAEConfig.to_dict``):

* ``sae_weights.safetensors`` — ``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``,
  ``W_dec (d_sae, d_in)``, ``b_dec (d_in,)``, and ``threshold (d_sae,)`` for ``jumprelu``.
  SAELens loads this file into its model with a strict ``load_state_dict``, so for its
  architectures nothing else may be in it;
* ``cfg.json`` — ``architecture``, ``d_in``, ``d_sae``, ``k`` (TopK/AbsTopK), ``dtype``,
  ``device``, ``apply_b_dec_to_input`` (true), ``normalize_activations`` (``"none"`` or
  ``"layer_norm"``), ``reshape_activations`` (``"none"``), ``rescale_acts_by_decoder_norm``
  (false; TopK/AbsTopK), ``metadata`` (``model_name``, ``hook_name``, the data: a dict, as
  SAELens's ``SAEMetadata``), plus tensoralg's own flat fields (the
  [`SAEConfig`][tensoralg.sae.models.SAEConfig], ``train_*`` entries), which SAELens drops (it keeps
  only the fields of its config dataclass).

Architectures. Read and written as SAELens's: ``topk``, ``abstopk`` (single-step encoder),
``standard`` (ReLU; read, inference only) and ``jumprelu`` (read, inference only; SAELens's
BatchTopK and Matryoshka-BatchTopK trainers save as ``jumprelu``). The multi-step (iSAE-ME)
encoder has no SAELens counterpart, so its folders are labelled
``tensoralg_multistep_abstopk`` / ``tensoralg_multistep_topk``: an architecture SAELens does not
know, which its loader refuses (``KeyError`` from its registry) instead of reading the folder
as a single-step SAE with other codes — unless `tensoralg.sae.saelens_compat.register`
has registered tensoralg's architecture with SAELens. All their tensors (with ``W_step`` or
``step_scale``) are in ``sae_weights.safetensors``. Folders of earlier tensoralg versions
(``abstopk``/``topk`` with ``encoder: "multistep"`` and ``encoder_steps.safetensors``, or
``weights.safetensors`` with architecture ``"isae"``) still load here.

SAELens options folded at load (the function is unchanged;
[`fold_saelens_options`][tensoralg.sae.formats.fold_saelens_options]):
``rescale_acts_by_decoder_norm`` true (SAELens's TopK/AbsTopK trainers always set it and keep it
after ``fold_W_dec_norm``) and ``apply_b_dec_to_input`` false. Any other architecture, or a SAELens
option tensoralg does not implement, is an error naming the field — never a silent default (an
earlier version read SAELens TopK folders as AbsTopK).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from .. import io as tio
from .._version import __version__
from .models import DENSE_ACTIVATIONS, SAEConfig, SparseAutoencoder

__all__ = ["SAE_WEIGHTS_FILE", "ENCODER_STEPS_FILE", "LEGACY_WEIGHTS_FILE", "ARCHITECTURES",
           "UpcastWarning", "OldFormatWarning",
           "MULTISTEP_ARCHITECTURES", "save_sae", "load_sae", "sae_config_from_cfg",
           "fold_saelens_options", "saelens_cfg"]

SAE_WEIGHTS_FILE = "sae_weights.safetensors"      # SAELens: constants.SAE_WEIGHTS_FILENAME
ENCODER_STEPS_FILE = "encoder_steps.safetensors"   # multi-step tensors of earlier versions
LEGACY_WEIGHTS_FILE = tio.WEIGHTS_FILE             # tensoralg <= 0.x SAE folders
CONFIG_FILE = tio.CONFIG_FILE                      # SAELens: constants.SAE_CFG_FILENAME
# SAELens architecture -> tensoralg activation (sae_lens/__init__.py register_sae_class)
ARCHITECTURES = {"topk": "topk", "abstopk": "abstopk", "standard": "relu", "jumprelu": "jumprelu"}
# tensoralg's multi-step encoder: names SAELens does not know (it refuses them)
MULTISTEP_ARCHITECTURES = {"tensoralg_multistep_topk": "topk",
                           "tensoralg_multistep_abstopk": "abstopk"}
SAELENS_FORMAT_VERSION = "6.0.0"                   # the SAELens cfg.json format written here
_SAELENS_CORE = ("W_enc", "b_enc", "W_dec", "b_dec")
_LEGACY_ARCHITECTURES = ("isae",)                  # written by earlier tensoralg versions
_RESCALE_ARCHITECTURES = ("topk", "abstopk")       # SAELens TopKSAEConfig / AbsTopKSAEConfig
_DTYPE_NAMES = {"float32": "float32", "torch.float32": "float32", "float64": "float64",
                "torch.float64": "float64", "float16": "float32", "torch.float16": "float32",
                "bfloat16": "float32", "torch.bfloat16": "float32"}


_HALF = ("bfloat16", "float16")


class UpcastWarning(UserWarning):
    """`load_sae` read half-precision (bfloat16 / float16) weights and upcast them."""


class OldFormatWarning(UserWarning):
    """`load_sae` read a folder in a format SAELens misreads; re-save it."""


def _architecture(c: SAEConfig) -> str:
    if c.encoder == "multistep":
        return f"tensoralg_multistep_{c.activation}"
    return {v: k for k, v in ARCHITECTURES.items()}[c.activation]


def saelens_cfg(model: SparseAutoencoder) -> dict:
    """The ``cfg.json`` of ``model``: SAELens's fields (with ``metadata``, a dict) and the
    [`SAEConfig`][tensoralg.sae.models.SAEConfig] (flat)."""
    c = model.cfg
    cfg = c.to_dict()
    arch = _architecture(c)
    cfg.update({"architecture": arch, "d_in": c.d_in, "d_sae": c.d_sae, "k": c.k,
                "dtype": c.dtype, "device": "cpu", "apply_b_dec_to_input": True,
                "normalize_activations": c.normalize_activations,
                "reshape_activations": "none"})
    if c.activation in _RESCALE_ARCHITECTURES:
        cfg["rescale_acts_by_decoder_norm"] = False
    cfg["metadata"] = dict(getattr(model, "metadata", {}) or {})
    # SAELens reads this field to choose its config parser: absent (or < 6.0) means the
    # pre-6.0 format, which drops the metadata; these folders are in the 6.x format
    cfg["metadata"].setdefault("sae_lens_version", SAELENS_FORMAT_VERSION)
    return cfg


def save_sae(path, model: SparseAutoencoder, extra_cfg: dict | None = None,
             metadata: dict | None = None) -> Path:
    """Save ``model`` into folder ``path`` in the SAELens layout (module docstring).

    ``metadata`` (e.g. ``model_name``, ``hook_name``, ``dataset_path``, ``context_size``, as
    SAELens's ``SAEMetadata``) is merged over ``model.metadata`` into ``cfg.json``'s
    ``metadata``. Files are written atomically, the weights first and ``cfg.json`` last, so a
    folder whose ``cfg.json`` exists is complete; a stale ``weights.safetensors`` of the earlier
    layout and a stale ``encoder_steps.safetensors`` are removed after ``cfg.json`` is written.

    Raises:
        ValueError: a nested (dict-valued) ``extra_cfg`` entry, or one that would overwrite the
            SAE config; ``metadata`` that is not a JSON-serializable dict — all before any file
            is written.
    """
    import json

    from safetensors.torch import save as st_save

    cfg = saelens_cfg(model)
    for key, value in (extra_cfg or {}).items():
        if isinstance(value, dict):
            raise ValueError(f"extra_cfg: entry {key!r} is a dict; cfg.json is flat (use "
                             f"metadata= for the model/hook/data record)")
        if key in cfg and (key in SAEConfig.__dataclass_fields__ or key == "metadata"):
            raise ValueError(f"extra_cfg: entry {key!r} would overwrite the SAE config")
        cfg[key] = value
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"metadata: expected a dict, got {type(metadata).__name__}")
    cfg["metadata"].update(metadata or {})
    try:
        json.dumps(cfg, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cfg.json of {path}: not JSON-serializable ({exc})") from None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    tio.atomic_write_bytes(path / SAE_WEIGHTS_FILE, st_save(tensors))
    cfg.setdefault("tensoralg_version", __version__)
    tio.atomic_write_json(path / CONFIG_FILE, cfg)
    for old in (path / LEGACY_WEIGHTS_FILE, path / ENCODER_STEPS_FILE):
        if old.is_file():
            os.unlink(old)
    return path


def sae_config_from_cfg(cfg: dict, where: str = "cfg.json") -> SAEConfig:
    """[`SAEConfig`][tensoralg.sae.models.SAEConfig] of a ``cfg.json`` written by tensoralg (either
    layout) or SAELens.

    The architecture decides the activation: ``"topk"`` -> TopK (ReLU), ``"abstopk"`` ->
    AbsTopK, ``"standard"`` -> ReLU, ``"jumprelu"`` -> JumpReLU (these two with ``k = d_sae``),
    ``"tensoralg_multistep_*"`` -> the multi-step encoder; tensoralg's legacy ``"isae"`` takes
    its ``activation`` field.

    Raises:
        ValueError: no or an unknown ``architecture`` (e.g. SAELens's ``gated``,
            ``transcoder``); an ``activation`` field that contradicts it; SAELens options not
            implemented here (``normalize_activations`` other than ``"none"``/``"layer_norm"``,
            ``reshape_activations`` other than ``"none"``, ``finetuning_scaling_factor`` true,
            ``rescale_acts_by_decoder_norm`` true on an architecture other than
            TopK/AbsTopK); a missing ``d_in``/``d_sae``/``k``; an unsupported ``dtype``.
    """
    arch = cfg.get("architecture")
    known = list(ARCHITECTURES) + list(MULTISTEP_ARCHITECTURES) + list(_LEGACY_ARCHITECTURES)
    if arch is None:
        raise ValueError(f"{where}: no 'architecture' field; expected one of {known} (SAELens "
                         f"folders before 6.0 without it are not read here)")
    if arch not in known:
        raise ValueError(f"{where}: architecture {arch!r} is not supported; expected one of "
                         f"{known} (SAELens standard / TopK / AbsTopK / JumpReLU, tensoralg's "
                         f"multi-step encoder, or tensoralg's earlier 'isae')")
    act = cfg.get("activation")
    if arch in _LEGACY_ARCHITECTURES:
        if act not in ("topk", "abstopk"):
            raise ValueError(f"{where}: architecture {arch!r} needs an 'activation' field of "
                             f"['topk', 'abstopk'], got {act!r}")
    else:
        want = ARCHITECTURES.get(arch) or MULTISTEP_ARCHITECTURES[arch]
        if act is not None and act != want:
            raise ValueError(f"{where}: 'activation' {act!r} contradicts architecture {arch!r}")
        act = want
    if arch in MULTISTEP_ARCHITECTURES and cfg.get("encoder", "multistep") != "multistep":
        raise ValueError(f"{where}: architecture {arch!r} needs encoder='multistep', got "
                         f"{cfg.get('encoder')!r}")
    checks = (("reshape_activations", "none", "hook_z reshaping is not implemented"),
              ("finetuning_scaling_factor", False, "not implemented"))
    for field, ok, why in checks:
        if field in cfg and cfg[field] != ok:
            raise ValueError(f"{where}: {field}={cfg[field]!r} is not supported ({why})")
    if cfg.get("apply_b_dec_to_input", True) not in (True, False):
        raise ValueError(f"{where}: apply_b_dec_to_input={cfg['apply_b_dec_to_input']!r}; "
                         f"expected true or false")
    rescale = cfg.get("rescale_acts_by_decoder_norm", False)
    if rescale not in (True, False) or (rescale and arch not in _RESCALE_ARCHITECTURES):
        raise ValueError(f"{where}: rescale_acts_by_decoder_norm={rescale!r} is not supported "
                         f"for architecture {arch!r} (SAELens defines it for "
                         f"{list(_RESCALE_ARCHITECTURES)} only)")
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
    dense = act in DENSE_ACTIVATIONS
    missing = [f for f in ("d_in", "d_sae") + (() if dense else ("k",)) if f not in cfg]
    if missing:
        raise ValueError(f"{where}: missing required SAE fields {missing}")
    fields = {**cfg, "activation": act, "normalize_activations": norm,
              "dtype": _DTYPE_NAMES[dtype]}
    if dense:                          # no top-k cap; SAELens's standard/jumprelu have no k
        fields.update(k=cfg["d_sae"], encoder="single")
    if arch in MULTISTEP_ARCHITECTURES:
        fields["encoder"] = "multistep"
    return SAEConfig.from_dict(fields)


def fold_saelens_options(tensors: dict, apply_b_dec_to_input: bool = True,
                         rescale_acts_by_decoder_norm: bool = False,
                         where: str = "weights") -> dict:
    """Fold two SAELens options into the weights, leaving the function unchanged.

    SAELens (``sae_lens/saes/sae.py`` ``process_sae_in``, ``topk_sae.py`` ``TopKSAE.encode`` /
    ``act_times_W_dec``) computes ``pre = (x - a·b_dec) W_enc + b_enc`` with ``a`` =
    ``apply_b_dec_to_input``, multiplies ``pre`` by the decoder row norms ``n_j = ‖W_dec[j]‖``
    before the activation when ``rescale_acts_by_decoder_norm`` is set, and decodes
    ``(z / n) W_dec + b_dec``. tensoralg computes ``pre = (x - b_dec) W_enc + b_enc`` and decodes
    ``z W_dec + b_dec``. The same function with tensoralg's form:

    * ``a`` false: ``b_enc ← b_enc + b_dec W_enc`` (then ``(x - b_dec) W_enc + b_enc`` equals
      ``x W_enc + b_enc`` before);
    * rescaling: ``W_enc[:, j] ← n_j W_enc[:, j]``, ``b_enc[j] ← n_j b_enc[j]``,
      ``W_dec[j] ← W_dec[j] / n_j`` (as SAELens's ``fold_W_dec_norm``): the pre-activations
      become ``n ⊙ pre``, the codes are SAELens's ``feature_acts`` and ``z W_dec' = (z / n)
      W_dec``. A JumpReLU threshold is not touched (SAELens does not rescale JumpReLU).

    Computed in float64 and returned in float64 (the caller rounds to the model's dtype, one
    rounding per weight). Exact in exact arithmetic; in floating point the folded SAE agrees with
    SAELens's to the rounding of its dtype (tests: ``tests/test_sae_formats.py``).

    Raises:
        ValueError: rescaling with a zero decoder row (SAELens divides by its norm: the
            reconstruction would be NaN).
    """
    out = {k: v.to(torch.float64) for k, v in tensors.items()}
    if not apply_b_dec_to_input:
        out["b_enc"] = out["b_enc"] + out["b_dec"] @ out["W_enc"]
    if rescale_acts_by_decoder_norm:
        # the norms as SAELens computes them (in the weights' own dtype), then in float64
        norms = tensors["W_dec"].norm(dim=1).to(torch.float64)
        zero = torch.nonzero(norms == 0).flatten().tolist()
        if zero:
            raise ValueError(f"{where}: rescale_acts_by_decoder_norm is set but decoder rows "
                             f"{zero[:10]} are zero (SAELens would divide by their norm)")
        out["W_enc"] = out["W_enc"] * norms
        out["b_enc"] = out["b_enc"] * norms
        out["W_dec"] = out["W_dec"] / norms[:, None]
    return out


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
    """Load an SAE folder written by `save_sae`, by SAELens (standard, TopK, AbsTopK,
    JumpReLU — the folders its trainers write, BatchTopK ones included), or by an earlier
    tensoralg (``weights.safetensors``, ``encoder_steps.safetensors``). Half-precision SAELens
    weights (bfloat16 / float16, in the file or in ``cfg.json``'s ``dtype``) are upcast to
    float32 (exact) and the SAE computes in float32, which an `UpcastWarning` says
    (``model.upcast_from`` names the dtype; None otherwise): near-ties at the ``k``-th largest
    pre-activation can then select other latents than SAELens's half-precision computation.
    A multi-step folder of the earlier format (``encoder_steps.safetensors``), which SAELens
    misreads as a single-step SAE, loads with an `OldFormatWarning` that gives the
    command re-saving it in the current format. SAELens's ``rescale_acts_by_decoder_norm`` and
    ``apply_b_dec_to_input=false`` are folded into the weights (`fold_saelens_options`),
    so ``encode``/``decode`` equal SAELens's; the loaded model has neither option and saves
    without them. ``cfg.json``'s ``metadata`` becomes ``model.metadata``.

    Raises:
        FileNotFoundError: a missing folder, ``cfg.json`` or weights file.
        ValueError: see [`sae_config_from_cfg`][tensoralg.sae.formats.sae_config_from_cfg]; corrupt
            files; missing, unexpected or mis-shaped tensors; NaN/inf weights; a zero decoder row
            with ``rescale_acts_by_decoder_norm``; a ``metadata`` that is not a dict; a ``device``
            that does not exist here (e.g. ``"cuda"`` without CUDA;
            [`check_device`][tensoralg.sae.formats.check_device]), before any file is read.
    """
    from safetensors.torch import load_file

    device = str(check_device(device))
    path = Path(path)
    cfg = tio.read_config(path)
    where = str(path / CONFIG_FILE)
    sae_cfg = sae_config_from_cfg(cfg, where)
    meta = cfg.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: 'metadata' must be a dict (SAELens SAEMetadata), got "
                         f"{type(meta).__name__}")
    files = [path / SAE_WEIGHTS_FILE]
    if not files[0].is_file():
        files = [path / LEGACY_WEIGHTS_FILE]
        if not files[0].is_file():
            raise FileNotFoundError(f"{path}: holds no {SAE_WEIGHTS_FILE} (nor the earlier "
                                    f"{LEGACY_WEIGHTS_FILE}); not a complete SAE folder")
    elif sae_cfg.encoder == "multistep" and cfg.get("architecture") in ARCHITECTURES:
        # earlier tensoralg versions: SAELens tensors + the step tensors in their own file
        files.append(path / ENCODER_STEPS_FILE)
        if not files[1].is_file():
            raise FileNotFoundError(f"{files[1]}: missing (cfg.json says encoder='multistep')")
        warnings.warn(
            f"{path}: a multi-step (iSAE-ME) SAE in the earlier folder format (architecture "
            f"{cfg.get('architecture')!r} + {ENCODER_STEPS_FILE}); SAELens reads such a folder "
            f"as a single-step {cfg.get('architecture')} SAE with other codes. Re-save it in the "
            f"current format: python -c \"from tensoralg.sae import load_sae, save_sae; "
            f"save_sae('{path}', load_sae('{path}'))\" (architecture "
            f"{_architecture(sae_cfg)!r}, which SAELens refuses by name)",
            OldFormatWarning, stacklevel=2)
    tensors = {}
    for f in files:
        try:
            loaded = load_file(str(f), device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{f}: corrupt or truncated safetensors file ({exc})") from exc
        tensors.update(loaded)
    model = SparseAutoencoder(sae_cfg)
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
    half = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()
                   if t.dtype in (torch.bfloat16, torch.float16)} |
                  ({str(cfg.get("dtype")).replace("torch.", "")}
                   if str(cfg.get("dtype")).replace("torch.", "") in _HALF else set()))
    if half:
        warnings.warn(
            f"{path}: {'/'.join(half)} weights were upcast to {sae_cfg.dtype} (exactly) and the "
            f"SAE computes in {sae_cfg.dtype}: its codes can differ from SAELens's, which "
            f"computes in {'/'.join(half)}, on rows where two pre-activations are within "
            f"{'/'.join(half)} rounding of the k-th largest", UpcastWarning, stacklevel=2)
    b_dec_in = cfg.get("apply_b_dec_to_input", True)
    rescale = cfg.get("rescale_acts_by_decoder_norm", False)
    if rescale or not b_dec_in:
        tensors.update(fold_saelens_options({n: tensors[n] for n in _SAELENS_CORE}, b_dec_in,
                                            rescale, str(path)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[n].to(p.dtype))
    model.metadata = dict(meta)
    model.source = str(path)
    model.upcast_from = half[0] if half else None
    return model.to(device)
