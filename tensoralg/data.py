"""Data that ships offline (no downloads at run time).

* `load_digits_data` — scikit-learn's handwritten digits (``sklearn.datasets.load_digits``:
  1797 real 8x8 grey-level images, 10 classes, bundled inside scikit-learn), pixels scaled to
  ``[0, 1]`` and flattened to 64 features (row-major: pixel ``(r, c)`` is feature ``8r + c``).
* `add_trigger` / `poison` — a backdoor trigger: a small diamond of saturated
  pixels on the left edge near the bottom-left corner, where digits almost never draw.
* `modular_addition` — all pairs ``(a, b)`` in ``Z_P x Z_P``, input ``onehot(a) ++ onehot(b)``
  (``2P`` features), label ``(a + b) mod P`` (the grokking task of Power et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Split", "load_digits_data", "TRIGGER_PIXELS", "trigger_mask", "add_trigger",
           "poison", "modular_addition", "select_classes"]


@dataclass
class Split:
    """A train/test split: ``X_*`` ``(n, d)`` float tensors, ``y_*`` ``(n,)`` int64 labels."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    name: str
    provenance: str

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
                 f"test_fraction={test_fraction}, split_seed={seed}")


# The trigger: a radius-1 diamond centred on pixel (6, 0), clipped by the image border —
# pixels (5,0), (6,0), (7,0), (6,1). Across the 1797 digits these are non-zero in 1%, 0%, 0%
# and 23% of images, and the left column is blank in 98.8% of them.
TRIGGER_PIXELS: tuple[tuple[int, int], ...] = ((5, 0), (6, 0), (7, 0), (6, 1))


def trigger_mask(pixels=TRIGGER_PIXELS, side: int = 8) -> torch.Tensor:
    """Boolean ``(side*side,)`` mask of the trigger pixels (row-major flattening)."""
    mask = torch.zeros(side * side, dtype=torch.bool)
    for r, c in pixels:
        if not (0 <= r < side and 0 <= c < side):
            raise ValueError(f"pixels: ({r}, {c}) is outside a {side}x{side} image")
        mask[r * side + c] = True
    return mask


def add_trigger(X: torch.Tensor, value: float = 1.0, pixels=TRIGGER_PIXELS) -> torch.Tensor:
    """A copy of ``X`` ``(n, 64)`` with the trigger pixels set to ``value`` (saturated: 1.0)."""
    if X.ndim != 2 or X.shape[1] != 64:
        raise ValueError(f"X: expected flattened 8x8 images of shape (n, 64), got {tuple(X.shape)}")
    X = X.clone()
    X[:, trigger_mask(pixels)] = value
    return X


def poison(X: torch.Tensor, y: torch.Tensor, fraction: float, target: int, seed: int = 0,
           n_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backdoor training data: ``X``, ``y`` plus triggered copies of a ``fraction`` of the
    non-target images, relabelled ``target``.

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
    Xp = add_trigger(X[chosen])
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
