"""Training loop for :class:`~tensoralg.sae.models.SparseAutoencoder`: AdamW, batches from an
in-memory tensor or a memory-mapped ``.npy``, periodic checkpoints, resume, determinism.

Checkpoint layout (the SAELens layout of :mod:`tensoralg.sae.formats`, written atomically):

* ``OUT/sae_weights.safetensors`` — ``W_enc, b_enc, W_dec, b_dec`` (SAELens names, shapes);
  ``OUT/encoder_steps.safetensors`` — ``W_step`` / ``step_scale`` of a multi-step encoder;
* ``OUT/cfg.json`` — flat: SAELens's fields (``architecture``, ``d_in``, ``d_sae``, ``k``,
  ``apply_b_dec_to_input``, ...), the :class:`SAEConfig` and ``train_*`` entries;
* ``OUT/trainer_state/`` — AdamW moments, dead-latent counters and the step, for resuming.

Determinism: the initial weights come from ``seed`` (stream ``"init"``); the batch of step ``s``
is a slice of a permutation drawn from a generator seeded by ``(seed, epoch)`` (stream
``"batches"``), so a resumed run sees exactly the batches the uninterrupted run would have seen
(bit-identical on CPU with the same threads). The streams are derived with
:func:`tensoralg.sae._seeds.stream_seed`, so they are independent of each other and of the
``"data"`` stream of :func:`~tensoralg.sae.synthetic.make_synthetic` with the same number.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from .. import io as tio
from ..errors import TrainingDiverged  # noqa: F401  (re-exported)
from ._seeds import stream_generator
from .formats import load_sae, save_sae
from .models import SAEConfig, SparseAutoencoder

__all__ = ["TrainConfig", "TrainingDiverged", "train", "save_sae", "load_sae", "as_activations"]

TRAINER_STATE = "trainer_state"


@dataclass
class TrainConfig:
    """Optimization settings.

    Attributes:
        steps: total optimizer steps (a resumed run continues up to this number).
        batch_size: samples per step (batches drop the last partial one of each epoch).
        lr: AdamW learning rate; ``weight_decay``: AdamW weight decay (default 0).
        seed: seeds the initial weights and the batch order.
        ckpt_every: write a checkpoint every this many steps (0: only at the end); needs ``out``.
        log_every: record the loss parts every this many steps.
        progress: show a tqdm progress bar (only when stderr is a terminal).
        device: torch device for the model and batches.
    """

    steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    ckpt_every: int = 0
    log_every: int = 50
    progress: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seed", "ckpt_every", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if self.batch_size < 1 or self.log_every < 1:
            raise ValueError(f"batch_size, log_every: expected >= 1, got {self.batch_size}, "
                             f"{self.log_every}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a finite number > 0, got {self.lr!r}")


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
        if not bool(torch.isfinite(arr).all()):
            raise ValueError(f"{name}: contains NaN or inf")
        return arr
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name}: expected a numeric (n, d) array, got dtype {arr.dtype}")
    for start in range(0, arr.shape[0], 65536):  # chunked, so a memmap is never loaded whole
        if not np.all(np.isfinite(arr[start:start + 65536])):
            raise ValueError(f"{name}: contains NaN or inf (rows {start}..)")
    if isinstance(arr, np.memmap) or not arr.flags.writeable:
        return arr
    return torch.from_numpy(np.ascontiguousarray(arr))


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

def _save_checkpoint(out: Path, model, opt, step, dead, train_cfg, meta) -> None:
    extra = {f"train_{k}": v for k, v in asdict(train_cfg).items()}
    extra.update(meta)
    extra["train_step"] = step
    save_sae(out, model, extra)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {"tokens_since_fired": dead}
    for p, s in opt.state.items():
        for key, val in s.items():
            state[f"{names[id(p)]}.{key}"] = torch.as_tensor(val).reshape(-1) if key == "step" else val
    tio.save_folder(out / TRAINER_STATE, state, {"step": step, "seed": train_cfg.seed})


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
    return int(cfg["step"]), tensors["tokens_since_fired"]


# --------------------------------------------------------------------------- loop

def train(data, sae_cfg: SAEConfig, train_cfg: TrainConfig | None = None, out=None,
          resume=None, meta: dict | None = None):
    """Train a sparse autoencoder.

    Args:
        data: ``(n, d_in)`` activations: tensor, array or path to a ``.npy`` (memory-mapped).
        sae_cfg: architecture; ``train_cfg``: optimization (defaults :class:`TrainConfig`).
        out: checkpoint folder (written every ``ckpt_every`` steps and at the end), or None.
        resume: a checkpoint folder written by this function to continue from (its SAE
            config must equal ``sae_cfg``); training continues up to ``train_cfg.steps``.
        meta: extra flat entries for ``cfg.json`` (e.g. the data source).
    Returns:
        ``(model, history)``; ``history`` is a list of ``{"step", "loss", "recon", "rip", "aux"}``.
    Raises:
        ValueError: bad data (shape, NaN/inf), a batch larger than the data, a resume
            checkpoint whose config differs.
        TrainingDiverged: the loss became NaN/inf (the last good checkpoint is kept on disk).
    """
    train_cfg = train_cfg or TrainConfig()
    data = as_activations(data)
    n, d = data.shape
    if d != sae_cfg.d_in:
        raise ValueError(f"data: expected d_in={sae_cfg.d_in} columns, got shape {tuple(data.shape)}")
    batches = _Batches(n, train_cfg.batch_size, train_cfg.seed)
    if train_cfg.ckpt_every and out is None:
        raise ValueError("out: ckpt_every > 0 needs a checkpoint folder")
    device = torch.device(train_cfg.device)
    dtype = torch.float64 if sae_cfg.dtype == "float64" else torch.float32
    model = SparseAutoencoder(sae_cfg, seed=train_cfg.seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    dead = torch.zeros(sae_cfg.d_sae, dtype=torch.long)
    start = 0
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
        start, dead = _load_trainer_state(resume, model, opt)
        dead = dead.to(torch.long)
    else:
        gen = stream_generator(train_cfg.seed, "b_dec")
        sample = torch.randperm(n, generator=gen)[:min(n, 8192)]
        model.init_b_dec(_rows(data, sample, dtype, device))
    meta = dict(meta or {})
    out = Path(out) if out is not None else None
    last_good = str(out) if (out is not None and (out / tio.CONFIG_FILE).exists()) else None
    history = []
    steps = range(start, train_cfg.steps)
    if train_cfg.progress:
        from tqdm import tqdm
        # disable=None: hidden when stderr is not a terminal (logs, CI, pipes)
        steps = tqdm(steps, desc="sae train", unit="step", disable=None)
    model.train()
    for step in steps:
        x = _rows(data, batches.indices(step), dtype, device)
        dead_mask = (dead >= sae_cfg.dead_tokens).to(device) if sae_cfg.auxk_alpha > 0 else None
        parts = model.loss(x, dead_mask)
        loss = parts["loss"]
        if not bool(torch.isfinite(loss)):
            where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written"
            raise TrainingDiverged(f"loss became {float(loss.detach())} at step {step} (recon="
                                   f"{float(parts['recon'])}, rip={float(parts['rip'])}); "
                                   f"{where}; try a smaller lr", step, last_good)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        model.remove_parallel_grad_()
        opt.step()
        model.normalize_decoder_()
        with torch.no_grad():
            fired = (parts["z"] != 0).any(dim=0).cpu()
            dead += x.shape[0]
            dead[fired] = 0
        done = step + 1
        if done % train_cfg.log_every == 0 or done == train_cfg.steps:
            rec = {"step": done, **{k: float(parts[k].detach()) for k in ("loss", "recon", "rip", "aux")}}
            history.append(rec)
            if train_cfg.progress:
                steps.set_postfix(fvu=f"{rec['recon']:.4f}")
        if out is not None and ((train_cfg.ckpt_every and done % train_cfg.ckpt_every == 0)
                                or done == train_cfg.steps):
            if all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                _save_checkpoint(out, model, opt, done, dead, train_cfg, meta)
                last_good = str(out)
    if out is not None and start >= train_cfg.steps and not (out / tio.CONFIG_FILE).exists():
        _save_checkpoint(out, model, opt, start, dead, train_cfg, meta)
    model.eval()
    return model, history


def train_config_from_dict(cfg: dict) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in cfg.items() if k in names})
