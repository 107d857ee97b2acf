"""Training loop for [`SparseAutoencoder`][tensoralg.sae.models.SparseAutoencoder]: AdamW, batches
from an in-memory tensor or a memory-mapped ``.npy``, periodic checkpoints, resume, determinism.

Checkpoint layout (the SAELens layout of [`tensoralg.sae.formats`][tensoralg.sae.formats], written
atomically):

* ``OUT/sae_weights.safetensors`` — ``W_enc, b_enc, W_dec, b_dec`` (SAELens names, shapes),
  and ``W_step`` / ``step_scale`` of a multi-step encoder (whose folder is labelled with an
  architecture SAELens refuses, ``tensoralg_multistep_*``);
* ``OUT/cfg.json`` — SAELens's fields (``architecture``, ``d_in``, ``d_sae``, ``k``,
  ``apply_b_dec_to_input``, ..., ``metadata``), the [`SAEConfig`][tensoralg.sae.models.SAEConfig]
  and ``train_*`` entries;
* ``OUT/trainer_state/`` — AdamW moments, dead-latent counters and the step, for resuming.

Determinism: the initial weights come from ``seed`` (stream ``"init"``); the batch of step ``s``
is a slice of a permutation drawn from a generator seeded by ``(seed, epoch)`` (stream
``"batches"``), so a resumed run sees exactly the batches the uninterrupted run would have seen
(bit-identical on CPU with the same threads). The streams are derived with
`tensoralg.sae._seeds.stream_seed`, so they are independent of each other and of the
``"data"`` stream of [`make_synthetic`][tensoralg.sae.synthetic.make_synthetic] with the same
number.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .. import io as tio
from ..errors import TrainingDiverged
from ._seeds import stream_generator
from .formats import check_device, load_sae, save_sae
from .models import SAEConfig, SparseAutoencoder

__all__ = ["TrainConfig", "TrainingDiverged", "train", "train_many", "save_sae", "load_sae",
           "as_activations", "check_variance", "make_lr_scheduler", "check_autocast"]

TRAINER_STATE = "trainer_state"


LOG_FILE = "train_log.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
DENSITY_PLOT = "feature_density.png"
DEAD_TOKENS_DEFAULT = 10_000_000       # Gao et al. (2024): dead = not fired in 10M tokens
_LR_DECAYS = ("constant", "linear", "cosine")
_NORMALIZE = ("none", "expected_norm")
_DECODER_INITS = ("random", "data")


@dataclass
class TrainConfig:
    """Optimization settings.

    Attributes:
        steps: total optimizer steps (a resumed run continues up to this number).
        batch_size: samples per step (batches drop the last partial one of each epoch).
        lr: AdamW peak learning rate; ``weight_decay``: AdamW weight decay (default 0).
        lr_warmup_steps: the lr rises linearly from ``lr / lr_warmup_steps`` to ``lr`` over the
            first this many steps (0: no warmup).
        lr_decay: after warmup, ``"constant"``, ``"linear"`` or ``"cosine"`` decay from ``lr``
            to ``lr_end`` at the last step (cosine: ``lr_end + (lr - lr_end)(1 + cos πp)/2``
            with ``p`` the fraction of the decay done; Loshchilov & Hutter, SGDR, 2017).
        lr_end: final learning rate of a linear or cosine decay (``0 <= lr_end <= lr``).
        grad_clip: clip the global gradient norm to this value (0: no clipping; the norm
            before clipping is logged either way).
        rip_warmup_steps, auxk_warmup_steps: the aRIP and AuxK weights rise linearly from 0 to
            the configured ``rip_beta`` / ``auxk_alpha`` over this many steps (0: full weight
            from the start).
        normalize: ``"none"`` or ``"expected_norm"``: the activations are multiplied by
            ``c = sqrt(d_in / E‖x‖²)`` (estimated on up to 8192 rows) during training, so that
            ``E‖c x‖² = d_in``; the saved and returned SAE has ``c`` folded into its biases
            (``b_enc / c``, ``b_dec / c``; exact for TopK/AbsTopK, which commute with positive
            scaling), so it takes raw activations and its codes are ``1/c`` times the training
            codes. (Per-row layer norm is a model option: ``SAEConfig.normalize_activations``.)
        dead_tokens: a latent counts as dead in the log and summary when it has not fired on
            this many training samples (None: ``min(10_000_000, n)``, the TopK paper's 10M
            tokens or the dataset size if smaller). The AuxK loss uses ``SAEConfig.dead_tokens``.
        seed: seeds the batch order, the ``b_dec`` sample and (unless ``init_seed`` is set)
            the initial weights.
        init_seed: seeds the initial weights instead of ``seed`` (None: ``seed``); several
            SAEs that share batches ([`train_many`][tensoralg.sae.training.train_many]) differ only
            in this.
        ckpt_every: write a checkpoint every this many steps (0: only at the end); needs ``out``.
        log_every: average the loss parts, L0 and gradient norm over this many steps and record
            them (in ``history``, the progress bar and ``OUT/train_log.jsonl``).
        progress: show a tqdm progress bar (only when stderr is a terminal).
        device: torch device for the model and batches.
        decoder_init: ``"random"`` (Gaussian directions, seeded by ``init_seed``) or
            ``"data"`` (atom ``j`` = the normalized ``j``-th row of the ``b_dec`` sample minus
            ``b_dec``;
            [`SparseAutoencoder.init_from_samples_`][tensoralg.sae.models.SparseAutoencoder.init_from_samples_]).
        resample_every: every this many steps (0: never), latents that did not fire since the
            last resampling are pointed at the residual ``x - x_hat`` of samples drawn from a
            pool of ``resample_pool`` training rows with probability proportional to the
            squared loss ``‖x - x_hat‖⁴`` (Bricken et al., "Towards Monosemanticity", 2023:
            decoder row = the normalized residual, encoder column = that times
            ``resample_enc_scale`` × the mean norm of the live encoder columns, ``b_enc = 0``,
            their AdamW moments reset).
        resample_duplicates: also resample the rarer latent of every pair whose atoms have
            ``|cos| >`` this (0: off), so that two latents never keep one ground-truth atom.
        resample_until: no resampling after this step (0: until the end).
        autocast: ``None`` (default: the SAE's own dtype), ``"bfloat16"`` or ``"float16"``: the
            forward pass and loss run under ``torch.autocast`` in that dtype (weights, AdamW and
            the decoder renormalization stay in float32; ``"float16"`` adds a
            ``torch.amp.GradScaler``). Checked against the device before any work
            ([`check_autocast`][tensoralg.sae.training.check_autocast]); refused for a float64 SAE.
        tensorboard: also write each log record as TensorBoard scalars (``sae/fvu``,
            ``sae/l0``, ``sae/dead_latents``, ``sae/lr``, ...) to ``OUT/tensorboard/`` (needs an
            ``out`` folder and the optional package ``tensorboard``: ``pip install
            tensorboard``; checked when the config is made).
        wandb: also log each record to Weights & Biases (``wandb.log``, keys ``sae/fvu``, ...,
            step = the optimizer step; ``wandb.init`` with ``project=wandb_project``, the train
            and SAE configs as its config, files under ``OUT/wandb/``). Needs an ``out`` folder
            and the optional package ``wandb`` (``pip install wandb``; checked when the config
            is made). Offline (no account, no network): set ``WANDB_MODE=offline`` and the run
            is written to ``OUT/wandb/offline-run-*`` for a later ``wandb sync``. A resumed run
            logs as a new W&B run whose steps continue from the checkpoint's.
        wandb_project: the W&B project (default ``"tensoralg-sae"``).
        multistep_start: a multi-step encoder runs no refinement step (it is the single-step
            encoder ``act(W_enc(x - b_dec) + b_enc)``) before this step, its ``T`` steps from
            it on (0: from the start), so the dictionary can first be learned cheaply.
    """

    steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay: str = "constant"
    lr_end: float = 0.0
    grad_clip: float = 0.0
    rip_warmup_steps: int = 0
    auxk_warmup_steps: int = 0
    normalize: str = "none"
    dead_tokens: int | None = None
    seed: int = 0
    init_seed: int | None = None
    ckpt_every: int = 0
    log_every: int = 50
    progress: bool = False
    device: str = "cpu"
    decoder_init: str = "random"
    resample_every: int = 0
    resample_duplicates: float = 0.0
    resample_until: int = 0
    resample_pool: int = 8192
    resample_enc_scale: float = 1.0
    multistep_start: int = 0
    autocast: str | None = None
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "tensoralg-sae"

    def __post_init__(self) -> None:
        if self.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError as exc:
                raise ValueError(f"wandb: the optional package is not installed (pip install "
                                 f"wandb): {exc}") from None
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            raise ValueError(f"wandb_project: expected a non-empty string, got "
                             f"{self.wandb_project!r}")
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError as exc:
                raise ValueError(f"tensorboard: the optional package is not installed (pip "
                                 f"install tensorboard): {exc}") from None
        check_device(self.device, "device")
        check_autocast(self.autocast, self.device)
        if self.decoder_init not in _DECODER_INITS:
            raise ValueError(f"decoder_init: expected one of {list(_DECODER_INITS)}, got "
                             f"{self.decoder_init!r}")
        if not (0 <= self.resample_duplicates < 1):
            raise ValueError(f"resample_duplicates: expected a cosine in [0, 1) (0: off), got "
                             f"{self.resample_duplicates!r}")
        if not (self.resample_enc_scale > 0 and math.isfinite(self.resample_enc_scale)):
            raise ValueError(f"resample_enc_scale: expected a finite number > 0, got "
                             f"{self.resample_enc_scale!r}")
        if self.resample_pool < 1:
            raise ValueError(f"resample_pool: expected >= 1, got {self.resample_pool!r}")
        for name in ("steps", "batch_size", "seed", "ckpt_every", "log_every", "lr_warmup_steps",
                     "rip_warmup_steps", "auxk_warmup_steps", "resample_every", "resample_until",
                     "resample_pool", "multistep_start"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        for name in ("batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a finite number > 0, got {self.lr!r}")
        if self.lr_decay not in _LR_DECAYS:
            raise ValueError(f"lr_decay: expected one of {list(_LR_DECAYS)}, got {self.lr_decay!r}")
        if not (0 <= self.lr_end <= self.lr):
            raise ValueError(f"lr_end: expected 0 <= lr_end <= lr={self.lr}, got {self.lr_end!r}")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ValueError(f"grad_clip: expected a finite number >= 0, got {self.grad_clip!r}")
        if self.normalize not in _NORMALIZE:
            raise ValueError(f"normalize: expected one of {list(_NORMALIZE)}, got {self.normalize!r}")
        if self.init_seed is not None and (isinstance(self.init_seed, bool) or
                                           not isinstance(self.init_seed, int) or self.init_seed < 0):
            raise ValueError(f"init_seed: expected None or an int >= 0, got {self.init_seed!r}")
        if self.dead_tokens is not None and (isinstance(self.dead_tokens, bool) or
                                             not isinstance(self.dead_tokens, int) or
                                             self.dead_tokens < 1):
            raise ValueError(f"dead_tokens: expected None or an int >= 1, got {self.dead_tokens!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based), in closed form: the reference
        that the ``torch.optim.lr_scheduler`` schedule the trainer runs
        ([`make_lr_scheduler`][tensoralg.sae.training.make_lr_scheduler]) is tested against."""
        if step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        if self.lr_decay == "constant":
            return self.lr
        span = self.steps - self.lr_warmup_steps
        p = min(1.0, (step - self.lr_warmup_steps) / (span - 1)) if span > 1 else 1.0
        if self.lr_decay == "linear":
            return self.lr_end + (self.lr - self.lr_end) * (1.0 - p)
        return self.lr_end + (self.lr - self.lr_end) * 0.5 * (1.0 + math.cos(math.pi * p))


_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def check_autocast(autocast: str | None, device: str = "cpu") -> None:
    """Check that ``torch.autocast`` in ``autocast`` (``"bfloat16"``/``"float16"``) runs on
    ``device`` (the device type has autocast; CUDA bf16 needs ``torch.cuda.is_bf16_supported``;
    torch does not disable it with a "target dtype is not supported" warning).

    Raises:
        ValueError: an unknown name, or a dtype the device lacks, naming both.
    """
    import warnings

    if autocast is None:
        return
    if autocast not in _AUTOCAST:
        raise ValueError(f"autocast: expected None, 'bfloat16' or 'float16', got {autocast!r}")
    dev = torch.device(device)
    if not torch.amp.is_autocast_available(dev.type):
        raise ValueError(f"autocast: torch has no autocast for device type {dev.type!r} "
                         f"(device={device!r})")
    if dev.type == "cuda" and autocast == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"autocast: 'bfloat16' requested but the CUDA device {device!r} does "
                         f"not support bfloat16; use 'float16' or None")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(dev.type, dtype=_AUTOCAST[autocast]):
            pass
    bad = [w for w in caught if "not supported" in str(w.message)]
    if bad:
        raise ValueError(f"autocast: {autocast!r} is not supported by autocast on {device!r} "
                         f"({str(bad[0].message).splitlines()[0]})")


def make_lr_scheduler(opt: torch.optim.Optimizer, train_cfg: TrainConfig, start: int = 0):
    """The learning-rate schedule of ``train_cfg``
    ([`TrainConfig.lr_at`][tensoralg.sae.training.TrainConfig.lr_at]) as
    ``torch.optim.lr_scheduler`` schedulers on ``opt``: ``LinearLR`` from ``1/W`` to 1 over the
    ``W = lr_warmup_steps`` warmup steps, then ``LinearLR`` to ``lr_end/lr`` (linear) or
    ``CosineAnnealingLR`` to ``lr_end`` (cosine) over the remaining ``steps - W`` steps, joined by
    ``SequentialLR``; a constant decay keeps the factor 1. Call ``.step()`` after each
    ``opt.step()``; the lr of step ``s`` is then ``opt.param_groups[i]["lr"]`` before it.

    ``start``: the schedule is advanced to step ``start`` (a resumed run; the groups' ``lr`` is
    first reset to ``train_cfg.lr``, so a restored optimizer state does not shift it).
    """
    import warnings

    from torch.optim import lr_scheduler as sch

    tc = train_cfg
    for group in opt.param_groups:
        group["lr"] = tc.lr
        group.pop("initial_lr", None)
    warm, span = tc.lr_warmup_steps, tc.steps - tc.lr_warmup_steps
    end = tc.lr_end / tc.lr
    if tc.lr_decay == "constant":
        decay = sch.LambdaLR(opt, lambda s: 1.0)
    elif span <= 1:                      # a single decay step is already at the end
        decay = sch.LambdaLR(opt, lambda s: end)
    elif tc.lr_decay == "linear":
        decay = sch.LinearLR(opt, start_factor=1.0, end_factor=end, total_iters=span - 1)
    else:
        decay = sch.CosineAnnealingLR(opt, T_max=span - 1, eta_min=tc.lr_end)
    if warm > 0:
        for group in opt.param_groups:   # each scheduler's constructor steps once: undo
            group["lr"] = tc.lr
        ramp = (sch.LinearLR(opt, start_factor=1.0 / warm, end_factor=1.0, total_iters=warm - 1)
                if warm > 1 else sch.LambdaLR(opt, lambda s: 1.0))   # lr_at(0) = lr for W = 1
        sched = sch.SequentialLR(opt, [ramp, decay], milestones=[warm])
    else:
        sched = decay
    with warnings.catch_warnings():      # replaying the steps of a resumed run: no opt.step
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(start):
            sched.step()
    return sched


def _ramp(step: int, warmup: int) -> float:
    return 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)


# --------------------------------------------------------------------------- data

def as_activations(data, name: str = "data"):
    """Accept a ``(n, d)`` tensor / array, or a path to a ``.npy`` (memory-mapped, not loaded).

    Returns a torch tensor, or a numpy array for a memory-mapped file or any read-only array
    (never wrapped in a tensor, which would share non-writable memory; the training loop copies
    each batch out of it). Raises FileNotFoundError / ValueError for a missing or corrupt file,
    a non-numeric array, a wrong rank, an empty array or non-finite entries. Files are always
    read with ``allow_pickle=False``.
    """
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.exists():
            raise FileNotFoundError(f"{name}: {path}: no such file")
        if path.suffix != ".npy":
            raise ValueError(f"{name}: expected a .npy file of shape (n, d), got {path}")
        not_numeric = (f"{name}: {path} is not a numeric .npy array of shape (n, d_in) (corrupt, "
                       f"truncated, or holding object/pickled data; save a float array with "
                       f"numpy.save)")
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError):
            # numpy's own message suggests unsafe loading (allow_pickle); never relay it
            raise ValueError(not_numeric) from None
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "fiu":
            raise ValueError(f"{not_numeric}; got "
                             f"{getattr(arr, 'dtype', type(arr).__name__)}")
    elif isinstance(data, torch.Tensor):
        arr = data.detach()
    elif isinstance(data, np.ndarray):
        arr = data                      # keeps an np.memmap a memmap (np.asarray would not)
    else:
        arr = np.asarray(data)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name}: expected a non-empty (n, d) array, got shape {tuple(arr.shape)}")
    if isinstance(arr, torch.Tensor):
        if not arr.is_floating_point():
            arr = arr.double()
        finite = torch.isfinite(arr).all(dim=1)
        if not bool(finite.all()):
            row = int((~finite).nonzero()[0, 0])
            raise ValueError(f"{name}: contains NaN or inf (first in row {row})")
        return arr
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name}: expected a numeric (n, d) array, got dtype {arr.dtype}")
    for start in range(0, arr.shape[0], 65536):  # chunked, so a memmap is never loaded whole
        finite = np.isfinite(arr[start:start + 65536]).all(axis=1)
        if not finite.all():
            row = start + int(np.argmin(finite))
            raise ValueError(f"{name}: contains NaN or inf (first in row {row})")
    if isinstance(arr, np.memmap) or not arr.flags.writeable:
        return arr
    return torch.from_numpy(np.ascontiguousarray(arr))


def check_variance(data, name: str = "data") -> None:
    """Refuse activations of zero variance: all rows equal (e.g. all zeros), so that
    ``Σ‖x - mean x‖² = 0`` and the FVU (the training loss's ``recon``) is 0/0, undefined; a
    model would be reported as a perfect (or an infinitely bad) fit of nothing to learn.
    ``data`` as returned by [`as_activations`][tensoralg.sae.training.as_activations] (a memmap is
    read in chunks, never whole).

    Raises:
        ValueError: one line naming ``name``.
    """
    first = data[:1]
    for start in range(0, data.shape[0], 65536):
        chunk = data[start:start + 65536]
        if bool((chunk != first).any()):
            return
    what = "all zeros" if not bool((first != 0).any()) else "all rows equal"
    raise ValueError(f"{name}: the activations have zero variance ({what}, {data.shape[0]} "
                     f"rows), so the FVU is undefined (0/0); give activations that vary")


def _rows(data, idx: torch.Tensor, dtype, device) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data[idx.to(data.device)].to(device=device, dtype=dtype)
    idx_np = idx.numpy()
    order = np.argsort(idx_np, kind="stable")   # read the memmap in increasing row order
    rows = np.empty((len(idx_np), data.shape[1]), dtype=np.float64)
    rows[order] = data[idx_np[order]]           # ... and put the rows back in batch order
    return torch.from_numpy(rows).to(device=device, dtype=dtype)


class _Batches:
    def __init__(self, n: int, batch_size: int, seed: int):
        if batch_size > n:
            raise ValueError(f"batch_size: {batch_size} exceeds the number of samples {n}")
        self.n, self.bs, self.seed = n, batch_size, seed
        self.per_epoch = n // batch_size
        self._epoch, self._perm = -1, None

    def indices(self, step: int) -> torch.Tensor:
        epoch, j = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            gen = stream_generator(self.seed, "batches", epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=gen), epoch
        return self._perm[j * self.bs:(j + 1) * self.bs]


# --------------------------------------------------------------------------- checkpoints

def _folded(model: SparseAutoencoder, scale: float) -> SparseAutoencoder:
    """``model`` with the input scale ``c`` folded in: biases divided by ``c`` (a copy)."""
    if scale == 1.0:
        return model
    import copy
    folded = copy.deepcopy(model)
    with torch.no_grad():
        folded.b_enc.div_(scale)
        folded.b_dec.div_(scale)
    return folded


def _save_checkpoint(out: Path, model, opt, step, dead, train_cfg, meta, scale,
                     dead_tokens, fires_since_resample=None) -> None:
    extra = {f"train_{k}": v for k, v in asdict(train_cfg).items()}
    extra.update(meta)
    extra["train_step"] = step
    extra["train_activation_scale"] = scale
    extra["train_dead_tokens"] = dead_tokens    # the threshold actually used (None resolved)
    extra["train_dead_latents"] = int((dead >= dead_tokens).sum())
    save_sae(out, _folded(model, scale), extra)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {"tokens_since_fired": dead}
    if fires_since_resample is not None:   # so that a resumed run resamples the same latents
        state["fires_since_resample"] = fires_since_resample
    if scale != 1.0:   # the unfolded biases, so that a resumed run continues bit-identically
        state.update({"unfolded.b_enc": model.b_enc.detach(), "unfolded.b_dec": model.b_dec.detach()})
    for p, s in opt.state.items():
        for key, val in s.items():
            state[f"{names[id(p)]}.{key}"] = torch.as_tensor(val).reshape(-1) if key == "step" else val
    tio.save_folder(out / TRAINER_STATE, state, {"step": step, "seed": train_cfg.seed,
                                                  "activation_scale": scale})


def _load_trainer_state(path: Path, model, opt):
    tensors, cfg = tio.load_folder(path / TRAINER_STATE)
    sd = opt.state_dict()
    order = [n for n, _ in model.named_parameters()]
    new_state = {}
    for i, name in enumerate(order):
        if f"{name}.exp_avg" in tensors:
            new_state[i] = {"step": tensors[f"{name}.step"].reshape(()),
                            "exp_avg": tensors[f"{name}.exp_avg"],
                            "exp_avg_sq": tensors[f"{name}.exp_avg_sq"]}
    sd["state"] = new_state
    opt.load_state_dict(sd)
    if "unfolded.b_enc" in tensors:
        with torch.no_grad():
            model.b_enc.copy_(tensors["unfolded.b_enc"])
            model.b_dec.copy_(tensors["unfolded.b_dec"])
    return (int(cfg["step"]), tensors["tokens_since_fired"], float(cfg.get("activation_scale", 1.0)),
            tensors.get("fires_since_resample"))


def density_histogram(fires: torch.Tensor, tokens: int, n_bins: int = 20) -> dict:
    """Histogram of the feature densities ``fires / tokens`` (fraction of samples each latent
    fired on) in ``n_bins`` log10 bins from ``1/tokens`` to 1, plus the never-firing count."""
    dens = fires.double() / max(tokens, 1)
    lo = -math.log10(max(tokens, 10))
    edges = torch.linspace(lo, 0.0, n_bins + 1, dtype=torch.float64)
    alive = dens > 0
    counts = torch.histc(torch.log10(dens[alive]), bins=n_bins, min=lo, max=0.0) if bool(alive.any()) \
        else torch.zeros(n_bins, dtype=torch.float64)
    return {"log10_density_edges": [round(float(e), 6) for e in edges],
            "counts": [int(c) for c in counts], "never_fired": int((~alive).sum()),
            "tokens": int(tokens)}


def plot_density(records: list[dict], path) -> None:
    """Feature-density histograms (one line per checkpoint) to ``path`` (PNG, atomic)."""
    import io as _io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for rec in records:
        e = rec["log10_density_edges"]
        mids = [(a + b) / 2 for a, b in itertools.pairwise(e)]
        ax.plot(mids, rec["counts"], marker=".", label=f"step {rec['step']} "
                f"({rec['never_fired']} never fired)")
    ax.set_xlabel("log10 feature density (fraction of samples a latent fires on)")
    ax.set_ylabel("number of latents")
    ax.set_title("feature density at checkpoints", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    tio.atomic_write_bytes(path, buf.getvalue())


def _read_log(path: Path, upto: int) -> list[dict]:
    """Records of an earlier ``train_log.jsonl`` up to step ``upto`` (a torn last line of an
    interrupted run is dropped)."""
    if not path.is_file():
        return []
    recs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= upto:
            recs.append(rec)
    return recs


# --------------------------------------------------------------------------- loop

def _init_seed(train_cfg: TrainConfig) -> int:
    return train_cfg.seed if train_cfg.init_seed is None else train_cfg.init_seed


def _init_decoder(model, train_cfg: TrainConfig, sample: torch.Tensor, scale: float) -> None:
    if train_cfg.decoder_init == "data":
        model.init_from_samples_(model.normalize_input(sample * scale if scale != 1.0 else sample)[0])


def _pool(data, train_cfg: TrainConfig, dtype, device):
    """The resampling pool of step ``step``: ``resample_pool`` rows drawn without replacement
    from the ``"resample_pool"`` stream (deterministic, so a resumed run resamples alike)."""
    if not train_cfg.resample_every:
        return None
    n = data.shape[0]

    def rows(step: int) -> torch.Tensor:
        gen = stream_generator(train_cfg.seed, "resample_pool", step)
        return _rows(data, torch.randperm(n, generator=gen)[:min(n, train_cfg.resample_pool)],
                     dtype, device)
    return rows


class _Stepper:
    """One SAE's optimizer step and its log window (shared by
    [`train`][tensoralg.sae.training.train] and
    [`train_many`][tensoralg.sae.training.train_many])."""

    KEYS = ("loss", "recon", "rip", "aux", "l0", "grad_norm")

    def __init__(self, model, opt, sae_cfg, train_cfg, dead, dead_tokens, scale, t0, pool=None,
                 start=0):
        self.model, self.opt, self.sae_cfg, self.train_cfg = model, opt, sae_cfg, train_cfg
        self.sched = make_lr_scheduler(opt, train_cfg, start)
        if train_cfg.autocast is not None and sae_cfg.dtype == "float64":
            raise ValueError("autocast: a float64 SAE is trained in float64 (exactness); use a "
                             "float32 SAE with autocast")
        self.device_type = model.W_dec.device.type
        self.scaler = torch.amp.GradScaler(self.device_type,
                                           enabled=train_cfg.autocast == "float16")
        self.dead, self.dead_tokens, self.scale, self.t0 = dead, dead_tokens, scale, t0
        self.fires = torch.zeros(sae_cfg.d_sae, dtype=torch.long)
        self.fires_since_resample = torch.zeros(sae_cfg.d_sae, dtype=torch.long)
        self.pool = pool            # step -> (rows, d_in) raw training rows, for resampling
        self.resampled = 0
        self.params = list(model.parameters())
        self.window = dict.fromkeys(self.KEYS, 0.0)
        self.n_window = 0
        model.train()

    def step(self, x, step, where="no checkpoint was written", last_good=None):
        model, sae_cfg, train_cfg = self.model, self.sae_cfg, self.train_cfg
        if self.scale != 1.0:
            x = x * self.scale
        dead = self.dead
        dead_mask = (dead >= sae_cfg.dead_tokens).to(x.device) if sae_cfg.auxk_alpha > 0 else None
        if train_cfg.multistep_start:
            model.refine_steps = 0 if step < train_cfg.multistep_start else None
        self.lr = self.opt.param_groups[0]["lr"]       # this step's, from the lr scheduler
        self.rip_ramp = rip_ramp = _ramp(step, train_cfg.rip_warmup_steps)
        self.aux_ramp = aux_ramp = _ramp(step, train_cfg.auxk_warmup_steps)
        with torch.autocast(self.device_type, dtype=_AUTOCAST.get(train_cfg.autocast),
                            enabled=train_cfg.autocast is not None):
            if rip_ramp == 1.0 and aux_ramp == 1.0:
                parts = model.loss(x, dead_mask)
            else:
                parts = model.loss(x, dead_mask, rip_coef=rip_ramp * sae_cfg.rip_beta,
                                   aux_coef=aux_ramp * sae_cfg.auxk_alpha)
        loss = parts["loss"].float() if train_cfg.autocast is not None else parts["loss"]
        if not bool(torch.isfinite(loss)):
            raise TrainingDiverged(f"loss became {float(loss.detach())} at step {step} (recon="
                                   f"{float(parts['recon'])}, rip={float(parts['rip'])}); "
                                   f"{where}; try a smaller lr", step, last_good)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)          # no-op unless float16 autocast
        model.remove_parallel_grad_()
        params = self.params
        if train_cfg.grad_clip > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip)
        else:
            gnorm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        self.scaler.step(self.opt)              # opt.step() unless float16 autocast
        self.scaler.update()
        self.sched.step()
        model.normalize_decoder_()
        with torch.no_grad():
            active = parts["z"] != 0
            fired = active.any(dim=0).cpu()
            counts = active.sum(dim=0).cpu()
            self.fires += counts
            self.fires_since_resample += counts
            dead += x.shape[0]
            dead[fired] = 0
            for k in ("loss", "recon", "rip", "aux"):
                self.window[k] += float(parts[k].detach())
            self.window["l0"] += float(active.sum(dim=1).double().mean())
            self.window["grad_norm"] += float(gnorm)
            self.n_window += 1
        tc = train_cfg
        if (tc.resample_every and (step + 1) % tc.resample_every == 0 and step + 1 < tc.steps
                and (tc.resample_until == 0 or step + 1 <= tc.resample_until)):
            self.resample(step)
        return parts

    @torch.no_grad()
    def resample(self, step: int) -> int:
        """Resample dead (and, if configured, duplicate) latents; returns how many."""
        model, tc = self.model, self.train_cfg
        latents = self.fires_since_resample == 0
        if tc.resample_duplicates > 0:
            W = model.W_dec.detach()
            cos = (W @ W.T).abs().cpu()
            cos.fill_diagonal_(0.0)
            i, j = torch.nonzero(torch.triu(cos, 1) > tc.resample_duplicates, as_tuple=True)
            rarer = torch.where(self.fires_since_resample[i] <= self.fires_since_resample[j], i, j)
            latents[rarer] = True
        self.fires_since_resample.zero_()
        idx = torch.nonzero(latents).squeeze(-1)
        if idx.numel() == 0 or self.pool is None:
            return 0
        x = self.pool(step)
        if self.scale != 1.0:
            x = x * self.scale
        xn = model.normalize_input(x)[0]
        resid = xn - model.decode(model._encode(xn, normalized=True)[0], normalized=
                                   model.cfg.normalize_activations == "layer_norm")
        w = (resid ** 2).sum(dim=1) ** 2
        r = min(idx.numel(), int((w > 0).sum()))
        if r == 0:
            return 0
        idx = idx[:r]
        gen = stream_generator(_init_seed(tc), "resample", step)
        rows = torch.multinomial(w.cpu().double(), r, replacement=False, generator=gen)
        atoms = resid[rows.to(resid.device)]
        atoms = atoms / atoms.norm(dim=1, keepdim=True)
        alive = torch.ones(model.cfg.d_sae, dtype=torch.bool)
        alive[idx] = False
        norms = model.W_enc.detach().norm(dim=0).cpu()
        enc_norm = float(norms[alive].mean()) if bool(alive.any()) else 1.0
        idx_dev = idx.to(model.W_dec.device)
        model.set_latents_(idx_dev, atoms, tc.resample_enc_scale * enc_norm)
        # AdamW moments of the resampled rows/columns start afresh
        for name, p in model.named_parameters():
            st = self.opt.state.get(p)
            if not st:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if name in ("W_dec",):
                    st[key][idx_dev] = 0.0
                elif name in ("W_enc", "W_step"):
                    st[key][:, idx_dev] = 0.0
                elif name == "b_enc":
                    st[key][idx_dev] = 0.0
        self.resampled += r
        return r

    def record(self, done: int) -> dict | None:
        """The averaged log record when step ``done`` ends a log window, else None."""
        tc, sae_cfg = self.train_cfg, self.sae_cfg
        if not (done % tc.log_every == 0 or done == tc.steps):
            return None
        rec = {"step": done, "tokens": done * tc.batch_size,
               **{k: self.window[k] / self.n_window for k in self.KEYS}}
        rec.update({"fvu": rec["recon"], "explained_variance": 1.0 - rec["recon"],
                    "dead_latents": int((self.dead >= self.dead_tokens).sum()),
                    "dead_tokens": self.dead_tokens, "lr": self.lr,
                    "rip_coef": self.rip_ramp * sae_cfg.rip_beta,
                    "aux_coef": self.aux_ramp * sae_cfg.auxk_alpha,
                    "resampled": self.resampled,
                    "seconds": time.perf_counter() - self.t0})
        self.window = dict.fromkeys(self.KEYS, 0.0)
        self.n_window = 0
        return rec


def _wandb_init(out: Path, train_cfg: TrainConfig, sae_cfg: SAEConfig, meta: dict,
                metadata: dict):
    """A W&B run for ``train`` (files under ``OUT/wandb/``; ``WANDB_MODE=offline`` keeps it
    local), its config the train and SAE configs and the run's recorded entries."""
    import wandb

    (out / WANDB_DIR).mkdir(parents=True, exist_ok=True)
    config = {"train": asdict(train_cfg), "sae": sae_cfg.to_dict(), "metadata": metadata,
              **{k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))}}
    return wandb.init(project=train_cfg.wandb_project, dir=str(out), name=out.name,
                      config=config, reinit="create_new")


def _expected_norm_scale(sample: torch.Tensor, d: int) -> float:
    msq = float((sample.double() ** 2).sum(dim=1).mean())
    if not msq > 0:
        raise ValueError("data: normalize='expected_norm' needs non-zero activations")
    return math.sqrt(d / msq)


def train_many(data, sae_cfgs, init_seeds, train_cfg: TrainConfig | None = None):
    """Train several SAEs in one pass over shared batches (e.g. seeds × presets).

    Every batch is read once and given to every SAE in turn; SAE ``i`` is exactly the SAE that
    ``train(data, sae_cfgs[i], replace(train_cfg, init_seed=init_seeds[i]))`` returns (same
    batch order from ``train_cfg.seed``, own initial weights from ``init_seeds[i]``,
    bit-identical on CPU). No checkpoints or log files (use [`train`][tensoralg.sae.training.train]
    for one SAE with ``out``).

    Args:
        data: as for [`train`][tensoralg.sae.training.train]; ``sae_cfgs``: list of
            [`SAEConfig`][tensoralg.sae.models.SAEConfig] (same ``d_in``);
        init_seeds: one int >= 0 per config; ``train_cfg``: shared optimization settings.
    Returns:
        list of ``(model, history)`` in the order of ``sae_cfgs``.
    Raises:
        ValueError: as [`train`][tensoralg.sae.training.train]; different lengths of ``sae_cfgs``
            and ``init_seeds``.
        TrainingDiverged: any of the SAEs diverged (its index is in the message).
    """
    from dataclasses import replace

    train_cfg = train_cfg or TrainConfig()
    sae_cfgs, init_seeds = list(sae_cfgs), list(init_seeds)
    if len(sae_cfgs) != len(init_seeds) or not sae_cfgs:
        raise ValueError(f"sae_cfgs, init_seeds: expected equal, non-zero lengths, got "
                         f"{len(sae_cfgs)} and {len(init_seeds)}")
    data = as_activations(data)
    check_variance(data)
    n, d = data.shape
    for i, c in enumerate(sae_cfgs):
        if c.d_in != d:
            raise ValueError(f"sae_cfgs[{i}]: d_in={c.d_in} but the data has shape {tuple(data.shape)}")
    batches = _Batches(n, train_cfg.batch_size, train_cfg.seed)
    device = torch.device(train_cfg.device)
    dead_tokens = train_cfg.dead_tokens or min(DEAD_TOKENS_DEFAULT, n)
    gen = stream_generator(train_cfg.seed, "b_dec")
    sample_idx = torch.randperm(n, generator=gen)[:min(n, 8192)]
    t0 = time.perf_counter()
    runs, cfgs = [], []
    for c, s in zip(sae_cfgs, init_seeds):
        tc = replace(train_cfg, init_seed=s)
        dtype = torch.float64 if c.dtype == "float64" else torch.float32
        model = SparseAutoencoder(c, seed=_init_seed(tc)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
        sample = _rows(data, sample_idx, dtype, device)
        scale = _expected_norm_scale(sample, d) if tc.normalize == "expected_norm" else 1.0
        model.init_b_dec(sample * scale if scale != 1.0 else sample)
        _init_decoder(model, tc, sample, scale)
        runs.append(_Stepper(model, opt, c, tc, torch.zeros(c.d_sae, dtype=torch.long),
                             dead_tokens, scale, t0, _pool(data, tc, dtype, device)))
        cfgs.append(dtype)
    histories = [[] for _ in runs]
    steps = range(train_cfg.steps)
    if train_cfg.progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc=f"sae train x{len(runs)}", unit="step", disable=None)
    for step in steps:
        idx = batches.indices(step)
        xs = {}
        for i, (run, dtype) in enumerate(zip(runs, cfgs)):
            if dtype not in xs:
                xs[dtype] = _rows(data, idx, dtype, device)
            try:
                run.step(xs[dtype], step)
            except TrainingDiverged as exc:
                raise TrainingDiverged(f"sae_cfgs[{i}]: {exc}", exc.step, None) from None
            rec = run.record(step + 1)
            if rec is not None:
                histories[i].append(rec)
    seconds = time.perf_counter() - t0
    out = []
    for run, hist in zip(runs, histories):
        run.model.refine_steps = None
        model = _folded(run.model, run.scale)
        model.eval()
        summary = dict(hist[-1]) if hist else {}
        summary.update({"steps_run": train_cfg.steps, "seconds": seconds,
                        "activation_scale": run.scale, "shared_with": len(runs)})
        model.train_summary = summary
        out.append((model, hist))
    return out


def train(data, sae_cfg: SAEConfig, train_cfg: TrainConfig | None = None, out=None,
          resume=None, meta: dict | None = None):
    """Train a sparse autoencoder.

    Args:
        data: ``(n, d_in)`` activations: tensor, array or path to a ``.npy`` (memory-mapped); or
            an [`ActivationStream`][tensoralg.sae.streaming.ActivationStream] (activations
            streamed from a live model through a shuffled buffer; its settings are recorded in
            ``cfg.json`` as ``streamed_*`` entries, its ``metadata`` as the SAE's unless ``meta`` gives one,
            and a resumed run must use the same stream).
        sae_cfg: architecture; ``train_cfg``: optimization (defaults
            [`TrainConfig`][tensoralg.sae.training.TrainConfig]).
        out: checkpoint folder (written every ``ckpt_every`` steps and at the end), or None.
            It also receives ``train_log.jsonl`` (one JSON record per ``log_every`` steps and
            one ``"event": "density"`` record per checkpoint) and ``feature_density.png``.
        resume: a checkpoint folder written by this function to continue from (its SAE
            config must equal ``sae_cfg``); training continues up to ``train_cfg.steps``.
        meta: extra flat entries for ``cfg.json`` (e.g. the data source); its entry
            ``"metadata"`` (a dict: ``model_name``, ``hook_name``, ``dataset_path``, ...) becomes
            ``model.metadata``, written as ``cfg.json``'s ``metadata`` as SAELens does (a resumed
            run keeps the checkpoint's when none is given).
    Returns:
        ``(model, history)``; ``history`` is the list of log records: ``step``, ``tokens``,
        ``loss``, ``recon`` (the batch FVU, also as ``fvu``), ``explained_variance``
        (``1 - fvu``), ``l0`` (mean active latents per sample), ``dead_latents`` (not fired on
        ``dead_tokens`` samples), ``lr``, ``grad_norm`` (before clipping), ``rip``, ``aux``,
        ``rip_coef``, ``aux_coef``, ``seconds`` — averages over the ``log_every`` steps — and
        ``resampled`` (latents resampled so far in this call, see ``resample_every``). The
        model is returned in raw-activation space (any ``normalize`` scale folded in), and
        ``model.train_summary`` holds the final record with ``samples_per_s``.
    Raises:
        ValueError: bad data (shape, NaN/inf, zero variance), a batch larger than the data (or
            than a stream's buffer), a stream's width other than ``d_in``, a resume checkpoint
            whose config (or stream) differs.
        TrainingDiverged: the loss became NaN/inf (the last good checkpoint is kept on disk).
        KeyboardInterrupt: passed on; as on divergence, ``out`` keeps its last checkpoint, or
            is left as before (missing or empty) when none was written yet.
    """
    from .streaming import ActivationStream

    train_cfg = train_cfg or TrainConfig()
    stream = data if isinstance(data, ActivationStream) else None
    if stream is None:
        data = as_activations(data)
    n, d = data.shape
    if d != sae_cfg.d_in:
        if stream is not None:
            raise ValueError(f"d_in: the model's activation at {stream.hook_name!r} has width "
                             f"{d}, the SAE config has d_in={sae_cfg.d_in}")
        raise ValueError(f"data: expected d_in={sae_cfg.d_in} columns, got shape {tuple(data.shape)}")
    if train_cfg.ckpt_every and out is None:
        raise ValueError("out: ckpt_every > 0 needs a checkpoint folder")
    if train_cfg.tensorboard and out is None:
        raise ValueError("out: tensorboard=True writes OUT/tensorboard/; give an out folder")
    if train_cfg.wandb and out is None:
        raise ValueError("out: wandb=True writes OUT/wandb/; give an out folder")
    device = torch.device(train_cfg.device)
    dtype = torch.float64 if sae_cfg.dtype == "float64" else torch.float32
    if stream is not None:
        stream.set_batch_size(train_cfg.batch_size)
        described = {f"streamed_{k}": v for k, v in stream.describe().items()}
        meta = {**(meta or {}), **described}
        if resume is not None:
            saved = tio.read_config(Path(resume))
            diff = {k: (saved.get(k), v) for k, v in described.items() if saved.get(k) != v}
            if diff:
                raise ValueError(f"resume: {resume} was trained on another stream (saved, now): "
                                 f"{diff}; a resumed run must read the same batches")
        if not (meta or {}).get("metadata"):
            meta["metadata"] = dict(stream.metadata)
        stream.check_variance()

        def next_batch(step: int) -> torch.Tensor:
            return stream.batch(step).to(device=device, dtype=dtype)
    else:
        check_variance(data)
        batches = _Batches(n, train_cfg.batch_size, train_cfg.seed)

        def next_batch(step: int) -> torch.Tensor:
            return _rows(data, batches.indices(step), dtype, device)
    model = SparseAutoencoder(sae_cfg, seed=_init_seed(train_cfg)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    dead = torch.zeros(sae_cfg.d_sae, dtype=torch.long)
    dead_tokens = train_cfg.dead_tokens or min(DEAD_TOKENS_DEFAULT, n)
    start, scale, fires_since_resample = 0, 1.0, None
    if resume is not None:
        resume = Path(resume)
        saved = tio.read_config(resume)
        want = sae_cfg.to_dict()
        diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
        if diff:
            raise ValueError(f"resume: {resume} was trained with a different SAE config "
                             f"(saved, requested): {diff}")
        loaded = load_sae(resume, device=str(device))
        model.load_state_dict(loaded.state_dict())
        start, dead, scale, fires_since_resample = _load_trainer_state(resume, model, opt)
        dead = dead.to(torch.long)
    else:
        if stream is not None:
            sample = stream.sample(8192).to(device=device, dtype=dtype)
        else:
            gen = stream_generator(train_cfg.seed, "b_dec")
            sample = _rows(data, torch.randperm(n, generator=gen)[:min(n, 8192)], dtype, device)
        if train_cfg.normalize == "expected_norm":
            scale = _expected_norm_scale(sample, d)
        model.init_b_dec(sample * scale if scale != 1.0 else sample)
        _init_decoder(model, train_cfg, sample, scale)
    meta = dict(meta or {})
    sae_meta = meta.pop("metadata", None)
    if sae_meta is not None and not isinstance(sae_meta, dict):
        raise ValueError(f"meta: entry 'metadata' must be a dict, got {type(sae_meta).__name__}")
    model.metadata = dict(sae_meta if sae_meta is not None else
                          (loaded.metadata if resume is not None else {}))
    out = Path(out) if out is not None else None
    last_good = str(out) if (out is not None and (out / tio.CONFIG_FILE).exists()) else None
    log_path = out / LOG_FILE if out is not None else None
    old_log = _read_log(log_path, start) if (log_path is not None and resume is not None) else []
    created_out = out is not None and not out.exists()
    writer = None
    wandb_run = None

    def discard() -> None:
        """No checkpoint in OUT yet: remove what this run wrote (its log, tensorboard/, the
        folder if it created it), so that a diverged or interrupted run (Ctrl-C, or SIGTERM
        through the CLI) leaves OUT as before (missing or empty) instead of a folder with a
        log and no SAE. A run with a checkpoint in OUT keeps it (``resume`` continues it)."""
        if out is None or last_good is not None:
            return
        if writer is not None:
            writer.close()
        if wandb_run is not None:
            wandb_run.finish(exit_code=1)
        import shutil
        if created_out:
            shutil.rmtree(out, ignore_errors=True)
        else:
            log_path.unlink(missing_ok=True)
            shutil.rmtree(out / TENSORBOARD_DIR, ignore_errors=True)
            shutil.rmtree(out / WANDB_DIR, ignore_errors=True)

    try:
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            tio.atomic_write_text(log_path, "".join(json.dumps(r) + "\n" for r in old_log))
        density_recs = [r for r in old_log if r.get("event") == "density"]
        history = []
        steps = range(start, train_cfg.steps)
        if train_cfg.progress:
            from tqdm import tqdm
            # disable=None: hidden when stderr is not a terminal (logs, CI, pipes)
            # counted in samples (tokens), so the rate reads tokens/s
            steps = tqdm(steps, desc="sae train", unit="tok", unit_scale=train_cfg.batch_size,
                         disable=None)
        t0 = time.perf_counter()
        last_ckpt = start
        pool = (_pool(data, train_cfg, dtype, device) if stream is None else
                (lambda step: stream.sample(train_cfg.resample_pool, step).to(device=device,
                                                                             dtype=dtype))
                if train_cfg.resample_every else None)
        run = _Stepper(model, opt, sae_cfg, train_cfg, dead, dead_tokens, scale, t0, pool,
                       start=start)
        if fires_since_resample is not None:
            run.fires_since_resample.copy_(fires_since_resample)
        for step in steps:
            x = next_batch(step)
            where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written"
            try:
                run.step(x, step, where, last_good)
            except TrainingDiverged as exc:
                if out is None or last_good is not None:
                    raise
                # discarded below: nothing of this run is left in OUT
                last = (f"; the last logged record before it: step {history[-1]['step']}, fvu "
                        f"{history[-1]['fvu']:.4g}" if history else "")
                raise TrainingDiverged(f"{exc}{last}; nothing was kept in {out} (no SAE, no log)",
                                       exc.step, None) from None
            dead = run.dead
            done = step + 1
            rec = run.record(done)
            if rec is not None:
                history.append(rec)
                if log_path is not None:
                    with open(log_path, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(rec) + "\n")
                if train_cfg.tensorboard:
                    if writer is None:
                        from torch.utils.tensorboard import SummaryWriter
                        writer = SummaryWriter(str(out / TENSORBOARD_DIR))
                    for key, value in rec.items():
                        if key != "step" and isinstance(value, (int, float)) and \
                                not isinstance(value, bool):
                            writer.add_scalar(f"sae/{key}", value, rec["step"])
                    writer.flush()
                if train_cfg.wandb:
                    if wandb_run is None:
                        wandb_run = _wandb_init(out, train_cfg, sae_cfg, meta, model.metadata)
                    wandb_run.log({f"sae/{k}": v for k, v in rec.items() if k != "step" and
                                   isinstance(v, (int, float)) and not isinstance(v, bool)},
                                  step=rec["step"])
                if train_cfg.progress:
                    steps.set_postfix(fvu=f"{rec['fvu']:.4f}", l0=f"{rec['l0']:.1f}",
                                      dead=rec["dead_latents"], lr=f"{rec['lr']:.2e}")
            if out is not None and ((train_cfg.ckpt_every and done % train_cfg.ckpt_every == 0)  # noqa: SIM102
                                    or done == train_cfg.steps):
                if all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                    # the samples since the previous checkpoint of this process: after a
                    # resume, the first record starts at the resumed step (docs/sae.md)
                    dens = {"event": "density", "step": done, "since_step": last_ckpt,
                            **density_histogram(run.fires, (done - last_ckpt) * train_cfg.batch_size)}
                    density_recs.append(dens)
                    with open(log_path, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(dens) + "\n")
                    run.fires.zero_()
                    last_ckpt = done
                    _save_checkpoint(out, model, opt, done, dead, train_cfg, meta, scale, dead_tokens,
                                     run.fires_since_resample)
                    last_good = str(out)
    except BaseException:
        discard()
        raise
    if out is not None and start >= train_cfg.steps and not (out / tio.CONFIG_FILE).exists():
        _save_checkpoint(out, model, opt, start, dead, train_cfg, meta, scale, dead_tokens)
    if writer is not None:
        writer.close()
    if wandb_run is not None:
        wandb_run.finish()
    seconds = time.perf_counter() - t0
    if out is not None and density_recs and start < train_cfg.steps:
        plot_density(density_recs[-5:], out / DENSITY_PLOT)
    model.refine_steps = None
    model = _folded(model, scale)
    model.eval()
    summary = dict(history[-1]) if history else {}
    summary.update({"steps_run": train_cfg.steps - start if start < train_cfg.steps else 0,
                    "seconds": seconds, "activation_scale": scale,
                    "samples_per_s": (max(0, train_cfg.steps - start) * train_cfg.batch_size /
                                      seconds) if seconds > 0 else None})
    model.train_summary = summary
    return model, history
