"""Data that ships offline (no downloads at run time).

* `load_digits_data` — scikit-learn's handwritten digits (``sklearn.datasets.load_digits``:
  1797 real 8x8 grey-level images, 10 classes, bundled inside scikit-learn), pixels scaled to
  ``[0, 1]`` and flattened to 64 features (row-major: pixel ``(r, c)`` is feature ``8r + c``).
* `add_trigger` / `poison` — a backdoor trigger: a small diamond of saturated
  pixels on the left edge near the bottom-left corner, where digits almost never draw.
* `load_npz_data` — your own images from an ``.npz`` file (arrays ``X_train, y_train, X_test,
  y_test``; images of any size), validated before any training (the audits' ``--data npz:PATH``).
* `modular_addition` — all pairs ``(a, b)`` in ``Z_P x Z_P``, input ``onehot(a) ++ onehot(b)``
  (``2P`` features), label ``(a + b) mod P`` (the grokking task of Power et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Split", "load_digits_data", "load_npz_data", "audit_data", "check_data_spec",
           "TRIGGER_PIXELS", "trigger_pixels", "trigger_mask", "add_trigger", "poison",
           "modular_addition", "select_classes"]


@dataclass
class Split:
    """A train/test split: ``X_*`` ``(n, d)`` float tensors, ``y_*`` ``(n,)`` int64 labels;
    ``image_shape`` ``(H, W, C)`` of the flattened rows (row-major, channels last) when they are
    images, else None."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    name: str
    provenance: str
    image_shape: tuple[int, int, int] | None = None

    @property
    def d_in(self) -> int:
        return int(self.X_train.shape[1])


def _check_fraction(value: float, name: str, low_open: bool = True) -> float:
    value = float(value)
    if not (0.0 < value < 1.0) and not (not low_open and value == 0.0):
        raise ValueError(f"{name}: expected a fraction in (0, 1), got {value!r}")
    return value


def load_digits_data(test_fraction: float = 0.25, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> Split:
    """scikit-learn's digits (offline), pixels / 16 in ``[0, 1]``, stratified train/test split.

    Args:
        test_fraction: share of the 1797 images held out (stratified by class).
        seed: split seed (``sklearn.model_selection.train_test_split``).

    Raises:
        ValueError: ``test_fraction`` outside (0, 1).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    _check_fraction(test_fraction, "test_fraction")
    digits = load_digits()
    X = digits.data.astype(np.float64) / 16.0
    y = digits.target.astype(np.int64)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=test_fraction, random_state=seed,
                                          stratify=y)
    return Split(torch.as_tensor(Xtr, dtype=dtype), torch.as_tensor(ytr),
                 torch.as_tensor(Xte, dtype=dtype), torch.as_tensor(yte), 10, "digits",
                 f"sklearn.datasets.load_digits (scikit-learn bundled copy), pixels/16, "
                 f"test_fraction={test_fraction}, split_seed={seed}", (8, 8, 1))


# The trigger: a radius-1 diamond centred on pixel (6, 0), clipped by the image border —
# pixels (5,0), (6,0), (7,0), (6,1). Across the 1797 digits these are non-zero in 1%, 0%, 0%
# and 23% of images, and the left column is blank in 98.8% of them.
TRIGGER_PIXELS: tuple[tuple[int, int], ...] = ((5, 0), (6, 0), (7, 0), (6, 1))


def trigger_pixels(height: int = 8) -> tuple[tuple[int, int], ...]:
    """The trigger for images ``height`` rows high: the radius-1 diamond centred on pixel
    ``(height - 2, 0)``, clipped by the border — `TRIGGER_PIXELS` for the 8x8 digits.

    Raises:
        ValueError: ``height < 3``.
    """
    if height < 3:
        raise ValueError(f"height: the trigger needs images at least 3 pixels high, got {height}")
    h = int(height)
    return ((h - 3, 0), (h - 2, 0), (h - 1, 0), (h - 2, 1))


def trigger_mask(pixels=TRIGGER_PIXELS, side: int = 8,
                 shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Boolean mask of the trigger pixels over a flattened image: ``(side*side,)`` for a square
    grey image, or ``(H*W*C,)`` for ``shape = (H, W, C)`` (row-major, channels last: every
    channel of a trigger pixel is set).

    Raises:
        ValueError: a pixel outside the image.
    """
    h, w, ch = (side, side, 1) if shape is None else (int(x) for x in shape)
    mask = torch.zeros((h, w, ch), dtype=torch.bool)
    for r, c in pixels:
        if not (0 <= r < h and 0 <= c < w):
            raise ValueError(f"pixels: ({r}, {c}) is outside a {h}x{w} image")
        mask[r, c, :] = True
    return mask.reshape(-1)


def add_trigger(X: torch.Tensor, value: float = 1.0, pixels=TRIGGER_PIXELS,
                shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """A copy of ``X`` ``(n, H*W*C)`` with the trigger pixels set to ``value`` (saturated: 1.0
    for the digits). ``shape``: ``(H, W, C)`` of the flattened images (default the 8x8 digits:
    ``X`` is ``(n, 64)``).

    Raises:
        ValueError: ``X`` not ``(n, H*W*C)``, or a trigger pixel outside the image.
    """
    d = 64 if shape is None else int(np.prod(shape))
    if X.ndim != 2 or X.shape[1] != d:
        what = "8x8 images of shape (n, 64)" if shape is None else \
            f"{'x'.join(map(str, shape))} images of shape (n, {d})"
        raise ValueError(f"X: expected flattened {what}, got {tuple(X.shape)}")
    X = X.clone()
    X[:, trigger_mask(pixels, shape=shape)] = value
    return X


def poison(X: torch.Tensor, y: torch.Tensor, fraction: float, target: int, seed: int = 0,
           n_classes: int = 10, shape: tuple[int, int, int] | None = None, value: float = 1.0,
           pixels=TRIGGER_PIXELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backdoor training data: ``X``, ``y`` plus triggered copies (`add_trigger` with
    ``value``, ``pixels``, ``shape``) of a ``fraction`` of the non-target images, relabelled
    ``target``.

    Returns:
        ``(X_mix, y_mix, poisoned)`` where ``poisoned`` is a boolean mask over the rows of ``X_mix``.

    Raises:
        ValueError: ``fraction`` outside (0, 1) or ``target`` outside ``[0, n_classes)``.
    """
    _check_fraction(fraction, "fraction")
    if not (0 <= int(target) < n_classes):
        raise ValueError(f"target: expected a class in [0, {n_classes}), got {target!r}")
    gen = torch.Generator().manual_seed(int(seed))
    candidates = torch.nonzero(y != target).flatten()
    k = max(1, int(round(fraction * len(candidates))))
    chosen = candidates[torch.randperm(len(candidates), generator=gen)[:k]]
    Xp = add_trigger(X[chosen], value, pixels, shape)
    yp = torch.full((k,), int(target), dtype=y.dtype)
    mask = torch.cat([torch.zeros(len(X), dtype=torch.bool), torch.ones(k, dtype=torch.bool)])
    return torch.cat([X, Xp]), torch.cat([y, yp]), mask


def select_classes(X: torch.Tensor, y: torch.Tensor, classes) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``(X, y)`` whose label is in ``classes``."""
    keep = torch.isin(y, torch.as_tensor(list(classes), dtype=y.dtype))
    return X[keep], y[keep]


def modular_addition(P: int = 31, train_fraction: float = 0.4, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> Split:
    """Modular addition: all ``P*P`` pairs, input ``onehot(a) ++ onehot(b)`` ``(2P,)``, label
    ``(a + b) mod P``; a random ``train_fraction`` of the pairs is the training set.

    Raises:
        ValueError: ``P < 2`` or ``train_fraction`` outside (0, 1).
    """
    if isinstance(P, bool) or not isinstance(P, int) or P < 2:
        raise ValueError(f"P: expected an integer modulus >= 2, got {P!r}")
    _check_fraction(train_fraction, "train_fraction")
    a, b = torch.meshgrid(torch.arange(P), torch.arange(P), indexing="ij")
    a, b = a.flatten(), b.flatten()
    X = torch.cat([torch.nn.functional.one_hot(a, P), torch.nn.functional.one_hot(b, P)], 1)
    X = X.to(dtype)
    y = (a + b) % P
    perm = torch.randperm(P * P, generator=torch.Generator().manual_seed(int(seed)))
    n_train = max(1, min(P * P - 1, int(round(train_fraction * P * P))))
    tr, te = perm[:n_train], perm[n_train:]
    return Split(X[tr], y[tr], X[te], y[te], P, f"modular_addition_P{P}",
                 f"modular addition mod {P}, one-hot(a)++one-hot(b), train_fraction="
                 f"{train_fraction}, split_seed={seed}")


# ----------------------------------------------------------------------------------------
# your own data: an .npz file (the audits' --data npz:PATH)
# ----------------------------------------------------------------------------------------

from ._dataspec import NPZ_ARRAYS  # noqa: E402  (the arrays' names, one definition)


def check_data_spec(spec: str, flag: str = "--data") -> str:
    """``digits`` or ``npz:PATH`` (the audits' ``--data``), returned unchanged; see
    `tensoralg.audit.common.check_data_spec` (torch-free, so that the CLI checks it before
    importing torch).

    Raises:
        ValueError: anything else, in one line naming ``flag``.
    """
    from ._dataspec import check_data_spec as check

    return check(spec, flag)


def load_npz_data(path: str, flag: str = "--data npz:PATH",
                  dtype: torch.dtype = torch.float32) -> Split:
    """Images and labels from an ``.npz`` file with arrays ``X_train``, ``y_train``, ``X_test``,
    ``y_test``, checked before any training.

    ``X_*``: ``(n, H, W)`` grey or ``(n, H, W, C)`` channels-last images of any size, or
    ``(n, D)`` rows with ``D`` a perfect square (read as ``sqrt(D) x sqrt(D)`` grey images); real
    numbers, all finite; train and test images of one size. ``y_*``: ``(n,)`` integer labels.
    The classes are ``0 .. K - 1`` with ``K = max(y_train) + 1 >= 2``; each must occur in
    ``y_train`` and in ``y_test`` (every audit reads the test set class by class). Pixels are
    used as stored (no rescaling); images are flattened row-major, channels last
    (`Split.image_shape` keeps ``(H, W, C)``). The file is read with ``allow_pickle=False``.

    Raises:
        ValueError: one line naming ``flag`` and the array at fault: a missing file or array,
            an unreadable file, wrong shapes or lengths, non-integer or out-of-range labels, a
            class missing from a split, NaN or infinite pixels.
    """
    import hashlib
    import zipfile
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag}: no such file: {path}")
    try:
        with np.load(p, allow_pickle=False) as z:
            missing = [k for k in NPZ_ARRAYS if k not in z.files]
            if missing:
                raise ValueError(f"{flag}: {path} lacks array(s) {', '.join(missing)} (has "
                                 f"{', '.join(z.files) or 'none'}; expected "
                                 f"{', '.join(NPZ_ARRAYS)})")
            arr = {k: z[k] for k in NPZ_ARRAYS}
    except ValueError as exc:
        if str(exc).startswith(flag):
            raise
        raise ValueError(f"{flag}: cannot read {path} as .npz arrays without pickles "
                         f"({exc})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{flag}: cannot read {path} as an .npz file ({exc})") from None
    shapes = {}
    for split in ("train", "test"):
        X, y = arr[f"X_{split}"], arr[f"y_{split}"]
        if X.dtype.kind not in "biuf":
            raise ValueError(f"{flag}: X_{split} must hold real numbers, got dtype {X.dtype}")
        if X.ndim == 2:
            side = int(np.sqrt(X.shape[1]))
            if side * side != X.shape[1] or side == 0:
                raise ValueError(f"{flag}: X_{split} has shape {X.shape}: flat rows must have a "
                                 f"square length (side x side grey images); else give images "
                                 f"(n, H, W) or (n, H, W, C)")
            shapes[split] = (side, side, 1)
        elif X.ndim in (3, 4):
            shapes[split] = tuple(int(x) for x in X.shape[1:]) + ((1,) if X.ndim == 3 else ())
        else:
            raise ValueError(f"{flag}: X_{split} has shape {X.shape}; expected images (n, H, W) "
                             f"or (n, H, W, C), or square rows (n, side*side)")
        if X.shape[0] == 0 or 0 in shapes[split]:
            raise ValueError(f"{flag}: X_{split} has shape {X.shape}: no images")
        if y.ndim != 1 or y.shape[0] != X.shape[0]:
            raise ValueError(f"{flag}: y_{split} has shape {y.shape}; expected ({X.shape[0]},), "
                             f"one label per image of X_{split}")
        if y.dtype.kind not in "iu":
            raise ValueError(f"{flag}: y_{split} must hold integer class labels, got dtype "
                             f"{y.dtype}")
        bad = ~np.isfinite(X) if X.dtype.kind == "f" else None
        if bad is not None and bad.any():
            raise ValueError(f"{flag}: X_{split} has {int(bad.sum())} NaN or infinite value(s) "
                             f"(first in image {int(np.argwhere(bad)[0][0])})")
    if shapes["train"] != shapes["test"]:
        raise ValueError(f"{flag}: X_train images are {shapes['train']} (H, W, C) but X_test "
                         f"images are {shapes['test']}")
    y_tr, y_te = arr["y_train"].astype(np.int64), arr["y_test"].astype(np.int64)
    if y_tr.min() < 0 or y_te.min() < 0:
        raise ValueError(f"{flag}: labels must be 0 .. K-1, got {min(y_tr.min(), y_te.min())}")
    k = int(y_tr.max()) + 1
    if k < 2:
        raise ValueError(f"{flag}: y_train has a single class (0); at least 2 are needed")
    if y_te.max() >= k:
        raise ValueError(f"{flag}: y_test has label {int(y_te.max())}, outside the training "
                         f"classes 0 .. {k - 1} (K = max(y_train) + 1)")
    for split, y in (("train", y_tr), ("test", y_te)):
        absent = sorted(set(range(k)) - set(np.unique(y).tolist()))
        if absent:
            raise ValueError(f"{flag}: class(es) {', '.join(map(str, absent[:10]))}"
                             f"{' ...' if len(absent) > 10 else ''} of 0 .. {k - 1} do not occur "
                             f"in y_{split} (every class needs training and test images)")
    shape = shapes["train"]
    d = int(np.prod(shape))
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    return Split(torch.as_tensor(arr["X_train"].reshape(len(y_tr), d), dtype=dtype),
                 torch.as_tensor(y_tr), torch.as_tensor(arr["X_test"].reshape(len(y_te), d),
                                                        dtype=dtype),
                 torch.as_tensor(y_te), k, f"npz:{p.name}",
                 f"npz file {p.resolve()} (sha256 {digest}), {len(y_tr)} train / {len(y_te)} "
                 f"test images of {'x'.join(map(str, shape))} (H x W x C), {k} classes, "
                 f"pixels as stored", shape)


_NPZ_CACHE: dict = {}


def audit_data(spec: str, seed: int = 0, flag: str = "--data") -> Split:
    """The audits' data: ``digits`` (`load_digits_data`, split by ``seed``) or ``npz:PATH``
    (`load_npz_data`, its own split; ``seed`` unused). An npz file is read once per
    (path, size, modification time): the check before training and the run share it.

    Raises:
        ValueError: a bad ``spec`` or file (one line naming ``flag``).
    """
    check_data_spec(spec, flag)
    if spec == "digits":
        return load_digits_data(seed=seed)
    import os

    path = spec[4:]
    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _NPZ_CACHE:
        return _NPZ_CACHE[key]
    data = load_npz_data(path, f"{flag} {spec}")
    _NPZ_CACHE.clear()   # one file kept: a large data set is not held twice
    if key is not None:
        _NPZ_CACHE[key] = data
    return data
