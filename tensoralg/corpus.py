"""An offline text corpus: the source (code, comments and docstrings) of Python's standard
library, with a fixed character tokenizer, a deterministic train/held-out split and corpus
n-gram predictors.

Everything here is available on every machine with Python, without downloads. The corpus
*does* depend on the Python version (the standard library changes between releases), so
`Corpus.provenance` records the version and a SHA-256 of the selected text; two runs
with the same hash trained on the same characters.

Tokenizer (`VOCAB`, 97 tokens): id 0 is ``<unk>`` (every character outside the list:
tabs, non-ASCII, control characters), id 1 is the newline, ids 2..96 are the printable ASCII
characters ``' '`` (32) to ``'~'`` (126) in code-point order.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VOCAB", "UNK", "encode", "decode", "stdlib_files", "Corpus", "load_corpus",
           "ngram_distributions", "ngram_scores"]

VOCAB: tuple[str, ...] = ("<unk>", "\n") + tuple(chr(c) for c in range(32, 127))
UNK = 0
_LOOKUP = np.zeros(128, dtype=np.int64)          # code point -> id (0 = unk)
_LOOKUP[10] = 1
_LOOKUP[32:127] = np.arange(2, 97)

# folders of the standard library left out: test suites (huge, repetitive), vendored
# third-party code, GUI demos, and package installers shipping binary wheels.
EXCLUDED_DIRS = ("__pycache__", "test", "tests", "idle_test", "site-packages", "dist-packages",
                 "ensurepip", "turtledemo", "lib2to3", "idlelib", "tkinter")
DEFAULT_CHARS = 200_000
SEGMENT = 1024          # split unit (characters)
HELD_OUT_EVERY = 10     # segment i is held out iff i % 10 == 9
BLOCKS = 64             # a size below the whole library takes this many evenly spaced windows


def encode(text: str) -> np.ndarray:
    """Token ids (int64) of ``text`` under `VOCAB` (unknown characters -> 0)."""
    cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    ids = np.zeros(cp.shape, dtype=np.int64)
    ok = cp < 128
    ids[ok] = _LOOKUP[cp[ok]]
    return ids


def decode(ids: Any) -> str:
    """Text of token ids (``<unk>`` shown as U+FFFD)."""
    return "".join("\ufffd" if i == UNK else VOCAB[i] for i in np.asarray(ids).ravel())


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The ``.py`` files of the standard library (``sysconfig.get_paths()["stdlib"]``, or
    ``root``), sorted by their POSIX path relative to it, without `EXCLUDED_DIRS`.

    Raises:
        FileNotFoundError: the folder does not exist or holds no ``.py`` file.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"stdlib: {base} is not a folder")
    found = []
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        for f in files:
            if f.endswith(".py"):
                found.append(Path(dirpath) / f)
    found.sort(key=lambda p: p.relative_to(base).as_posix())
    if not found:
        raise FileNotFoundError(f"stdlib: no .py files under {base}")
    return found


@dataclass
class Corpus:
    """Tokenized train and held-out text.

    Attributes:
        train, held_out: int64 token ids (1-D).
        vocab: `VOCAB`.
        provenance: python version, stdlib path, file count, sizes, SHA-256 of the selected
            text and of the two token arrays, the split rule.
    """

    train: np.ndarray
    held_out: np.ndarray
    vocab: tuple = VOCAB
    provenance: dict = field(default_factory=dict)


def load_corpus(n_chars: int = DEFAULT_CHARS, root: str | os.PathLike | None = None) -> Corpus:
    """The first ``n_chars`` characters' worth of standard-library text, split deterministically.

    Selection: the files of `stdlib_files` are read as UTF-8 (undecodable bytes replaced)
    and joined by newlines into one text ``T`` in sorted path order. If ``T`` is longer than
    ``n_chars``, `BLOCKS` windows of ``n_chars // BLOCKS`` characters are taken at the
    evenly spaced offsets ``floor(i · len(T) / BLOCKS)``, ``i = 0..BLOCKS-1`` (so every part of
    the library contributes, not only the modules starting with ``a``); otherwise ``T`` is
    used whole. Split: the selection is cut into segments of `SEGMENT` characters and
    segment ``i`` is held out iff ``i % 10 == 9`` (about 10 %). No random numbers are used.

    Args:
        n_chars: size of the selection in characters (>= 2 · SEGMENT · HELD_OUT_EVERY = 20 480,
            so that both splits are non-empty and every window is longer than a segment).
        root: another folder to read instead of the standard library (tests).

    Raises:
        ValueError: ``n_chars`` not an integer >= 20 480.
        FileNotFoundError: no readable ``.py`` files.
    """
    minimum = 2 * SEGMENT * HELD_OUT_EVERY
    if isinstance(n_chars, bool) or not isinstance(n_chars, (int, np.integer)) or \
            n_chars < minimum:
        raise ValueError(f"n_chars: expected an integer >= {minimum} (two held-out segments of "
                         f"{SEGMENT} characters), got {n_chars!r}")
    n_chars = int(n_chars)
    files = stdlib_files(root)
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    text = "\n".join(p.read_bytes().decode("utf-8", errors="replace") for p in files)
    if len(text) > n_chars:
        w = n_chars // BLOCKS
        starts = [(i * len(text)) // BLOCKS for i in range(BLOCKS)]
        sel = "".join(text[s:s + w] for s in starts)
    else:
        sel = text
    ids = encode(sel)
    seg = np.arange(len(ids)) // SEGMENT
    held = seg % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    train, held_out = ids[~held], ids[held]
    prov = {
        "source": "python standard library (.py files)",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib": str(base),
        "n_files": len(files),
        "library_chars": len(text),
        "n_chars_requested": n_chars,
        "n_chars": len(sel),
        "selection": (f"{BLOCKS} evenly spaced windows of {n_chars // BLOCKS} characters"
                      if len(text) > n_chars else "the whole library"),
        "split": f"segments of {SEGMENT} characters; segment i held out iff i % "
                 f"{HELD_OUT_EVERY} == {HELD_OUT_EVERY - 1}",
        "excluded_dirs": list(EXCLUDED_DIRS),
        "vocab_size": len(VOCAB),
        "unk_fraction": float(np.mean(ids == UNK)) if len(ids) else 0.0,
        "n_train_tokens": int(len(train)),
        "n_held_out_tokens": int(len(held_out)),
        "sha256_text": hashlib.sha256(sel.encode("utf-8")).hexdigest(),
        "sha256_train": hashlib.sha256(train.astype("<i8").tobytes()).hexdigest(),
        "sha256_held_out": hashlib.sha256(held_out.astype("<i8").tobytes()).hexdigest(),
    }
    return Corpus(train=train, held_out=held_out, vocab=VOCAB, provenance=prov)


# ----------------------------------------------------------------------------------------
# n-gram predictors
# ----------------------------------------------------------------------------------------

def _codes(tokens: np.ndarray, k: int, V: int) -> np.ndarray:
    """Integer code of every window of ``k`` consecutive tokens (``len - k + 1`` of them)."""
    n = len(tokens) - k + 1
    c = np.zeros(max(n, 0), dtype=np.int64)
    for j in range(k):
        c = c * V + tokens[j:j + n]
    return c


def ngram_distributions(train: np.ndarray, contexts: np.ndarray, n: int, V: int) -> np.ndarray:
    """Maximum-likelihood ``n``-gram next-token distributions ``(m, V)`` for ``m`` contexts.

    ``contexts``: ``(m, n - 1)`` token ids (the ``n - 1`` tokens before the predicted one; for
    ``n = 1`` an ``(m, 0)`` array: the unigram distribution for every row). Counts come from
    ``train``. A context never seen in ``train`` backs off to its last ``n - 2`` tokens (and so
    on down to the unigram), so every row is a distribution.

    Raises:
        ValueError: ``n`` not in 1..4, a context of the wrong width, or ids outside ``[0, V)``.
    """
    if n not in (1, 2, 3, 4):
        raise ValueError(f"n: expected an n-gram order in 1..4, got {n!r}")
    contexts = np.asarray(contexts, dtype=np.int64)
    if contexts.ndim != 2 or contexts.shape[1] != n - 1:
        raise ValueError(f"contexts: expected shape (m, {n - 1}), got {contexts.shape}")
    train = np.asarray(train, dtype=np.int64)
    m = len(contexts)
    if n == 1:
        p = np.bincount(train, minlength=V).astype(np.float64)
        return np.broadcast_to(p / p.sum(), (m, V)).copy()
    code = np.zeros(m, dtype=np.int64)
    for j in range(n - 1):
        code = code * V + contexts[:, j]
    tr = _codes(train, n - 1, V)[:-1]            # context codes of every train position
    nxt = train[n - 1:]
    need, inv = np.unique(code, return_inverse=True)
    pos = np.searchsorted(need, tr)
    pos = np.minimum(pos, len(need) - 1)
    hit = need[pos] == tr
    counts = np.zeros((len(need), V), dtype=np.float64)
    np.add.at(counts, (pos[hit], nxt[hit]), 1.0)
    rows = counts[inv]
    tot = rows.sum(1)
    out = np.empty((m, V))
    seen = tot > 0
    out[seen] = rows[seen] / tot[seen, None]
    if not seen.all():
        out[~seen] = ngram_distributions(train, contexts[~seen, 1:], n - 1, V)
    return out


def ngram_scores(model_logits: np.ndarray, windows: np.ndarray, train: np.ndarray, V: int,
                 orders=(1, 2, 3, 4), start: int = 2, ngram_cache: dict | None = None) -> dict:
    """How well a model's next-token distribution agrees with the corpus n-gram predictors.

    Definitions. ``windows`` ``(B, T)`` are held-out token sequences and ``model_logits``
    ``(B, T, V)`` the model's logits on them (position ``t`` predicts token ``t + 1`` from tokens
    ``<= t``). At every position ``t`` with ``start <= t <= T - 2`` (``start = 2``: every order up
    to 4 has its full context inside the window) let ``P_model = softmax(logits[t])`` and
    ``P_n`` the `ngram_distributions` of order ``n`` for the context ``tokens[t-n+2 ..
    t]``. Then, averaged over those positions:

    * ``agreement[n]`` = fraction where ``argmax P_model == argmax P_n`` (top-1 agreement;
      ties in ``P_n`` go to the lowest token id),
    * ``kl[n]`` = ``KL(P_n || P_model) = Σ_v P_n(v) log(P_n(v) / P_model(v))`` in nats (finite:
      ``P_model > 0`` everywhere),
    * ``ngram_accuracy[n]`` (model-free): fraction where ``argmax P_n`` is the true next
      token; ``accuracy``: the same for the model; ``loss``: the model's cross-entropy (nats).

    ``ngram_cache``: a dict reused across calls with the same ``windows`` (the n-gram side is
    computed once).
    """
    L = np.asarray(model_logits, dtype=np.float64)
    W = np.asarray(windows, dtype=np.int64)
    B, T = W.shape
    if L.shape != (B, T, V):
        raise ValueError(f"model_logits: expected shape {(B, T, V)}, got {L.shape}")
    if start + 2 > T:
        raise ValueError(f"windows: need length >= {start + 2}, got {T}")
    cache = ngram_cache if ngram_cache is not None else {}
    ts = np.arange(start, T - 1)
    target = W[:, ts + 1].ravel()
    logits = L[:, ts].reshape(-1, V)
    logp = logits - logits.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    top = logp.argmax(1)
    res = {"positions": int(len(target)), "start": start,
           "loss": float(-np.mean(logp[np.arange(len(target)), target])),
           "accuracy": float(np.mean(top == target)), "agreement": {}, "kl": {},
           "ngram_accuracy": {}}
    for n in orders:
        if n not in cache:
            ctx = np.stack([W[:, t - n + 2:t + 1] for t in ts], 1).reshape(-1, n - 1) if n > 1 \
                else np.zeros((len(target), 0), dtype=np.int64)
            P = ngram_distributions(train, ctx, n, V)
            cache[n] = P
        P = cache[n]
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(P > 0, P * (np.log(np.where(P > 0, P, 1.0)) - logp), 0.0)
        res["agreement"][n] = float(np.mean(top == P.argmax(1)))
        res["kl"][n] = float(np.mean(terms.sum(1)))
        res["ngram_accuracy"][n] = float(np.mean(P.argmax(1) == target))
    return res
