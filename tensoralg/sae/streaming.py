"""Training data streamed from a live model: the activation at a hook of any
``torch.nn.Module`` on token sequences, served in shuffled batches from a buffer of bounded size.

Buffer. Refill ``r`` holds the activation rows (one per token) of ``q = buffer_size //
context_size`` token sequences, ``q · context_size`` rows in all, in a random order; the batches of
``batches_per_refill = rows // batch_size`` consecutive steps are consecutive slices of it (the
last ``rows mod batch_size`` rows are dropped, as the last partial batch of an epoch is). Memory is
the buffer, ``rows × d_in`` values of ``dtype`` on ``device``, plus one forward pass of
``forward_batch`` sequences (default: about 8 192 tokens).

Determinism (the resume guarantee of [`tensoralg.sae.training.train`][tensoralg.sae.training.train]).
Refill ``r`` is a pure function of ``(seed, r)``: the sequences of global positions
``r·q … (r+1)·q - 1`` of the concatenated epochs, epoch ``e`` being the permutation of the
sequences drawn from the ``"stream_sequences"`` stream of ``(seed, e)``, and the row order the
permutation drawn from the ``"stream_shuffle"`` stream of ``(seed, r)``
(`tensoralg.sae._seeds`). A run resumed at step ``s`` recomputes refill
``s // batches_per_refill`` and continues with the very batches the uninterrupted run saw
(bit-identical on CPU with the same threads and ``forward_batch``, as the model's forward pass
is). SAELens's mixing buffer instead keeps half of each buffer for the next one, so its batches
depend on the whole history; here refills are independent, so a buffer should hold many
sequences (the default: 65 536 rows).

Tokens. An integer ``.npy`` (memory-mapped, never loaded whole): ``(n_seq, context_size)``
sequences, or a 1-D token stream cut into its first ``len // context_size`` non-overlapping
windows; every id in ``[0, vocab_size)`` (the vocabulary read from the model when it names one:
``hparams["vocab"]``, ``config.vocab_size`` or its first ``nn.Embedding``).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ._seeds import stream_generator
from .hooks import activations_at, check_point, get_submodule

__all__ = ["ActivationStream", "load_model_spec", "load_tokens", "check_token_ids",
           "model_vocab_size",
           "corpus_tokens", "quick_transformer", "DEFAULT_BUFFER", "DEFAULT_FORWARD_TOKENS"]

DEFAULT_BUFFER = 65_536          # rows (tokens) per refill
DEFAULT_FORWARD_TOKENS = 8192    # tokens per forward pass (forward_batch=None)


def load_model_spec(spec: str, flag: str = "model") -> nn.Module:
    """The model named by ``spec``: ``MODULE:FACTORY`` (an importable module, or a path to a
    ``.py`` file, and a callable in it called with no arguments) or a tensoralg
    [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] checkpoint folder. The
    model is put in eval mode (dropout off: the stream must be deterministic).

    Raises:
        ValueError: one line naming ``flag``: not of the form, a module that does not import, no
            such callable (the module's public callables are listed), a factory that fails or
            returns something other than an ``nn.Module``.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{flag}: expected MODULE:FACTORY or a checkpoint folder, got {spec!r}")
    if Path(spec).is_dir():
        from .transformer_acts import load_transformer
        try:
            model, _ = load_transformer(spec)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{flag}: {exc}") from None
        return model.eval()
    mod_name, sep, factory = spec.rpartition(":")
    if not sep or not mod_name or not factory:
        raise ValueError(f"{flag}: expected MODULE:FACTORY (e.g. mypkg.models:make_model or "
                         f"path/to/file.py:make_model) or a checkpoint folder, got {spec!r}")
    try:
        if mod_name.endswith(".py"):
            if not Path(mod_name).is_file():
                raise FileNotFoundError(f"{mod_name}: no such file")
            sp = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
            module = importlib.util.module_from_spec(sp)
            sp.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as exc:   # any failure of the user's module is theirs to see, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{flag}: cannot import {mod_name!r} ({type(exc).__name__}: "
                         f"{first})") from None
    fn = getattr(module, factory, None)
    if not callable(fn):
        names = sorted(n for n in dir(module) if not n.startswith("_")
                       and callable(getattr(module, n)))
        raise ValueError(f"{flag}: {mod_name!r} has no callable {factory!r}; its public "
                         f"callables: {names[:20]}")
    try:
        model = fn()
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{flag}: {spec}() raised {type(exc).__name__}: {first}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{flag}: {spec}() returned a {type(model).__name__}, expected a "
                         f"torch.nn.Module")
    return model.eval()


def model_vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size ``model`` declares (``hparams["vocab"]``, ``config.vocab_size``, or the
    number of rows of its first ``nn.Embedding``), None when it declares none."""
    hp = getattr(model, "hparams", None)
    if isinstance(hp, dict) and isinstance(hp.get("vocab"), int):
        return hp["vocab"]
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(v, int):
        return v
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return int(m.num_embeddings)
    return None


def load_tokens(path, context_size: int | None = None, vocab_size: int | None = None,
                flag: str = "tokens") -> np.ndarray:
    """The token sequences of an integer ``.npy`` at ``path``, ``(n_seq, context_size)``
    (memory-mapped; a 1-D file is cut into its first ``len // context_size`` windows), checked in
    chunks to lie in ``[0, vocab_size)`` (``vocab_size`` None: ``>= 0`` only).

    Raises:
        FileNotFoundError: no such file. ValueError: not a ``.npy``, not integer, not 1-D or 2-D,
            no full sequence, a ``context_size`` that contradicts a 2-D file's, an id out of range
            (its position and value named) — each one line naming ``flag``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{flag}: {path}: no such file (expected an integer .npy of "
                                f"token ids)")
    if p.suffix != ".npy":
        raise ValueError(f"{flag}: expected an integer .npy of token ids, got {path}")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {path} is not a readable .npy ({exc})") from None
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{flag}: {path} has dtype {arr.dtype}; expected integer token ids")
    if arr.ndim == 1:
        if context_size is None:
            raise ValueError(f"{flag}: {path} is a 1-D token stream of {arr.shape[0]} ids; give "
                             f"a context size to cut it into sequences")
        if context_size < 1:
            raise ValueError(f"{flag}: context size must be >= 1, got {context_size}")
        n = arr.shape[0] // context_size
        arr = arr[:n * context_size].reshape(n, context_size)
    elif arr.ndim == 2:
        if context_size is not None and context_size != arr.shape[1]:
            raise ValueError(f"{flag}: {path} holds sequences of {arr.shape[1]} tokens (shape "
                             f"{tuple(arr.shape)}), the context size given is {context_size}")
    else:
        raise ValueError(f"{flag}: {path} has shape {tuple(arr.shape)}; expected (n_seq, "
                         f"context_size) sequences or a 1-D token stream")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{flag}: {path} holds no full sequence (shape {tuple(arr.shape)})")
    check_token_ids(arr, vocab_size, flag, str(path))
    return arr


def check_token_ids(arr, vocab_size: int | None, flag: str = "tokens",
                    where: str = "the tokens") -> None:
    """Every id of the ``(n_seq, context_size)`` integer array ``arr`` in ``[0, vocab_size)``
    (``vocab_size`` None: ``>= 0``), read in chunks of about a million ids (a memmap is never
    loaded whole).

    Raises:
        ValueError: one line naming ``flag``, the first bad id, its sequence and position.
    """
    per = max(1, 1_048_576 // arr.shape[1])
    for start in range(0, arr.shape[0], per):
        chunk = np.asarray(arr[start:start + per])
        lo, hi = int(chunk.min()), int(chunk.max())
        bad = lo if lo < 0 else hi if (vocab_size is not None and hi >= vocab_size) else None
        if bad is not None:
            i, t = np.argwhere(chunk == bad)[0]
            want = (f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None
                    else "ids >= 0")
            raise ValueError(f"{flag}: {where} has token id {bad} at sequence {start + int(i)}, "
                             f"position {int(t)}; expected {want}")


def corpus_tokens(n_ctx: int, n_chars: int | None = None) -> tuple[np.ndarray, str]:
    """The train split of the offline corpus (`tensoralg.corpus.load_corpus`) as
    ``(n_seq, n_ctx)`` windows, and a description for ``metadata["dataset_path"]``."""
    from ..corpus import DEFAULT_CHARS, load_corpus

    corpus = load_corpus(n_chars or DEFAULT_CHARS)
    n = len(corpus.train) // n_ctx
    toks = np.asarray(corpus.train[:n * n_ctx], dtype=np.int64).reshape(n, n_ctx)
    return toks, (f"tensoralg.corpus train split (n_chars={n_chars or DEFAULT_CHARS}, sha256 "
                  f"{corpus.provenance['sha256_text'][:16]}...)")


def quick_transformer(seed: int = 0) -> nn.Module:
    """The project's offline model: the small
    [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] of
    [`train_quick_transformer`][tensoralg.sae.transformer_acts.train_quick_transformer] trained on
    the corpus's train split (deterministic; ~25 s on one core). A factory for
    ``tensoralg sae train --model tensoralg.sae.streaming:quick_transformer``."""
    from ..corpus import load_corpus
    from .transformer_acts import train_quick_transformer

    model, _ = train_quick_transformer(load_corpus().train, seed=seed)
    return model


class ActivationStream:
    """Shuffled batches of the activation at ``(hook_name, point)`` of ``model`` on ``tokens``
    (module docstring: the buffer, the determinism, the tokens).

    Args:
        model: any ``torch.nn.Module`` taking a ``(batch, context_size)`` long tensor of token
            ids (put in eval mode here; moved to ``device``).
        hook_name, point: the hook (`tensoralg.sae.hooks`); the activation must have one
            row per token (``batch · context_size · d_in`` values).
        tokens: ``(n_seq, context_size)`` integer array (or a path, read by `load_tokens`).
        buffer_size: rows per refill (at least one sequence; rounded down to whole sequences).
        seed: the sequence order and the row shuffle.
        forward_batch: sequences per forward pass (None: ``max(1, 8192 // context_size)``,
            about 8 192 tokens; a part of the determinism: the batching of a forward pass can
            change its rounding).
        device: where the model runs and the buffer lives; ``dtype``: ``"float32"`` or
            ``"float64"`` of the rows.
        vocab_size: the id range checked (None: the model's, `model_vocab_size`).
        metadata: entries added to `metadata` (e.g. ``model_name``, ``dataset_path``).

    Raises:
        ValueError: a hook that is not a submodule (nearest names listed, before any forward
            pass), bad tokens, a buffer smaller than a sequence, bad sizes; then, from one
            forward pass of one sequence: an activation without one row per token, or NaN/inf.
    """

    def __init__(self, model: nn.Module, hook_name: str, tokens, *, point: str = "output",
                 buffer_size: int = DEFAULT_BUFFER, seed: int = 0,
                 forward_batch: int | None = None, device: str = "cpu",
                 dtype: str = "float32", vocab_size: int | None = None,
                 context_size: int | None = None, metadata: dict | None = None):
        check_point(point)
        get_submodule(model, hook_name)          # names the nearest hooks; no forward pass yet
        for name, v, low in (("buffer_size", buffer_size, 1), ("forward_batch", forward_batch, 1),
                             ("seed", seed, 0)):
            if v is None and name == "forward_batch":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype: expected 'float32' or 'float64', got {dtype!r}")
        vocab = vocab_size if vocab_size is not None else model_vocab_size(model)
        if isinstance(tokens, (str, Path)):
            dataset = str(tokens)
            tokens = load_tokens(tokens, context_size, vocab)
        else:
            dataset = "(in-memory tokens)"
            if isinstance(tokens, torch.Tensor):
                tokens = tokens.numpy()
            if not isinstance(tokens, np.ndarray):
                tokens = np.asarray(tokens)
            if tokens.ndim != 2 or tokens.dtype.kind not in "iu" or 0 in tokens.shape:
                raise ValueError(f"tokens: expected a non-empty (n_seq, context_size) integer "
                                 f"array, got shape {tokens.shape} dtype {tokens.dtype}")
            check_token_ids(tokens, vocab)
        self.tokens = tokens
        self.n_seq, self.context_size = int(tokens.shape[0]), int(tokens.shape[1])
        if buffer_size < self.context_size:
            raise ValueError(f"buffer_size: {buffer_size} rows hold no full sequence of "
                             f"context_size={self.context_size} tokens")
        self.seqs_per_refill = buffer_size // self.context_size
        self.rows = self.seqs_per_refill * self.context_size
        self.model = model.eval().to(device)
        self.hook_name, self.point, self.seed = hook_name, point, seed
        self.forward_batch = (forward_batch if forward_batch is not None else
                              max(1, DEFAULT_FORWARD_TOKENS // self.context_size))
        self.device = torch.device(device)
        self.dtype = torch.float64 if dtype == "float64" else torch.float32
        self.vocab_size = vocab
        self._epoch, self._perm = -1, None
        self._refill, self._buf = -1, None
        self.batch_size = None
        self.refills_computed = 0
        probe = self._forward(torch.from_numpy(np.array(tokens[:1], dtype=np.int64)))
        self.d_in = int(probe.shape[1])
        self.metadata = {"model_class_name": type(model).__name__, "hook_name": hook_name,
                         "hook_point": point, "dataset_path": dataset,
                         "context_size": self.context_size, **(metadata or {})}

    @property
    def shape(self) -> tuple[int, int]:
        """``(tokens in one pass over the sequences, d_in)``."""
        return self.n_seq * self.context_size, self.d_in

    @property
    def buffer_bytes(self) -> int:
        return self.rows * self.d_in * (8 if self.dtype == torch.float64 else 4)

    def describe(self) -> dict:
        """The stream's settings (recorded in ``cfg.json``)."""
        return {"hook_name": self.hook_name, "hook_point": self.point,
                "context_size": self.context_size, "n_sequences": self.n_seq,
                "buffer_rows": self.rows, "sequences_per_refill": self.seqs_per_refill,
                "forward_batch": self.forward_batch, "seed": self.seed,
                "buffer_bytes": self.buffer_bytes}

    def _forward(self, seqs: torch.Tensor) -> torch.Tensor:
        act = activations_at(self.model, self.hook_name, seqs.to(self.device), self.point)
        want = seqs.shape[0] * seqs.shape[1]
        if act.ndim < 2 or act[..., 0].numel() != want:
            raise ValueError(f"hook: the {self.point} of {self.hook_name!r} has shape "
                             f"{tuple(act.shape)} for {tuple(seqs.shape)} tokens; expected one "
                             f"row per token ({want} rows of width d_in)")
        rows = act.reshape(want, act.shape[-1])
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(f"hook: the activation at {self.hook_name!r} has NaN or inf")
        return rows

    def set_batch_size(self, batch_size: int) -> None:
        """Fix the batch size (called by the trainer). Raises ValueError when the buffer holds
        less than one batch."""
        if batch_size > self.rows:
            raise ValueError(f"batch_size: {batch_size} exceeds the stream's buffer of "
                             f"{self.rows} rows ({self.seqs_per_refill} sequences of "
                             f"{self.context_size} tokens); raise the buffer size or lower "
                             f"the batch size")
        self.batch_size = batch_size
        self.batches_per_refill = self.rows // batch_size

    def _sequence_ids(self, refill: int) -> np.ndarray:
        q, n = self.seqs_per_refill, self.n_seq
        ids = np.empty(q, dtype=np.int64)
        for j, p in enumerate(range(refill * q, (refill + 1) * q)):
            e, i = divmod(p, n)
            if e != self._epoch:
                gen = stream_generator(self.seed, "stream_sequences", e)
                self._perm, self._epoch = torch.randperm(n, generator=gen).numpy(), e
            ids[j] = self._perm[i]
        return ids

    def buffer(self, refill: int) -> torch.Tensor:
        """Refill ``refill``'s rows ``(rows, d_in)``, shuffled (cached: the current one)."""
        if refill == self._refill:
            return self._buf
        ids = self._sequence_ids(refill)
        order = np.argsort(ids, kind="stable")        # read the memmap in increasing order
        seqs = np.empty((len(ids), self.context_size), dtype=np.int64)
        seqs[order] = self.tokens[ids[order]]
        seqs = torch.from_numpy(seqs)
        if self._buf is None:
            self._buf = torch.empty(self.rows, self.d_in, dtype=self.dtype, device=self.device)
        self._refill = -1                             # invalid while it is being refilled
        # shuffled row i is unshuffled row perm[i]: unshuffled row k is written to where[k]
        perm = torch.randperm(self.rows, generator=stream_generator(self.seed, "stream_shuffle",
                                                                     refill))
        where = torch.argsort(perm).to(self.device)
        buf, at = self._buf, 0
        for i in range(0, len(ids), self.forward_batch):
            rows = self._forward(seqs[i:i + self.forward_batch])
            buf[where[at:at + rows.shape[0]]] = rows.to(self.dtype)
            at += rows.shape[0]
        self._refill = refill
        self.refills_computed += 1
        return buf

    def batch(self, step: int) -> torch.Tensor:
        """The batch of optimizer step ``step``, ``(batch_size, d_in)`` (a view of the buffer)."""
        r, j = divmod(step, self.batches_per_refill)
        return self.buffer(r)[j * self.batch_size:(j + 1) * self.batch_size]

    def sample(self, n: int, step: int = 0) -> torch.Tensor:
        """The first ``min(n, rows)`` rows of the refill holding step ``step`` (the ``b_dec``
        initialization sample at step 0; the resampling pool later), a copy."""
        r = step // self.batches_per_refill if self.batch_size else 0
        return self.buffer(r)[:min(n, self.rows)].clone()

    def check_variance(self, name: str = "stream") -> None:
        """Refuse a stream whose first refill has zero variance (the FVU would be 0/0)."""
        b = self.buffer(0)
        if not bool((b != b[:1]).any()):
            raise ValueError(f"{name}: the activations at {self.hook_name!r} of the first "
                             f"{self.rows} tokens have zero variance, so the FVU is undefined")

    def __repr__(self) -> str:
        return (f"ActivationStream({type(self.model).__name__} at {self.hook_name!r}, "
                f"{self.n_seq} sequences x {self.context_size}, buffer {self.rows} rows, "
                f"d_in={self.d_in})")
