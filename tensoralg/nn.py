"""Trainable bilinear networks (torch modules) that export to exact tensoralg networks.

[`BilinearNet`][tensoralg.nn.BilinearNet] is
``embed (linear) -> n_layers bilinear blocks -> head (linear)``::

    h_0 = E x + e0                                  embed,  E: (d_model, d_in)
    h_l = [h_{l-1} +] D_l((L_l h_{l-1} + l_l) * (R_l h_{l-1} + r_l)) + d_l     block l
    y   = U h_n + u0                                head,   U: (d_out, d_model)

(the residual ``h_{l-1} +`` and every bias are optional). It is a polynomial of degree
``2**n_layers`` in ``x``, so [`BilinearNet.to_network`][tensoralg.nn.BilinearNet.to_network] returns
the *same function* as a [`tensoralg.Sequential`][tensoralg.Sequential] of
[`Linear`][tensoralg.Linear], [`Bilinear`][tensoralg.Bilinear] and [`Residual`][tensoralg.Residual]
layers with float64 weights (exact copies of the torch weights), whose Gaussian inner products
tensoralg computes in closed form (``docs/gaussian_inner_product.md``).

Models are deterministic under ``seed`` (initialisation draws from a private generator and
never touches torch's global random state), and so is
[`train_classifier`][tensoralg.nn.train_classifier].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ._torchutil import check_positive_int, dtype_name, torch_dtype
from .errors import TrainingDiverged

if TYPE_CHECKING:   # at run time module __getattr__ below imports it on first use
    from .transformer import BilinearTransformer

__all__ = ["BilinearBlock", "BilinearNet", "train_classifier", "accuracy", "ARCHITECTURE",
           "TrainingDiverged", "BilinearTransformer"]


def __getattr__(name: str):
    # the bilinear transformer lives in tensoralg.transformer, loaded on first use
    if name == "BilinearTransformer":
        from .transformer import BilinearTransformer

        return BilinearTransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ARCHITECTURE = "bilinear_net"

class BilinearBlock(nn.Module):
    """``y = [x +] down((left x + l) * (right x + r)) + d`` with ``left, right: (d_hidden, d_model)``
    and ``down: (d_model, d_hidden)``; biases present iff ``bias``; residual iff ``residual``.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, d_model: int, d_hidden: int, bias: bool = False, residual: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        check_positive_int(d_model, "d_model")
        check_positive_int(d_hidden, "d_hidden")
        self.residual = bool(residual)
        self.left = nn.Linear(d_model, d_hidden, bias=bias, dtype=dtype)
        self.right = nn.Linear(d_model, d_hidden, bias=bias, dtype=dtype)
        self.down = nn.Linear(d_hidden, d_model, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.left(x) * self.right(x))
        return x + y if self.residual else y

    def to_layer(self):
        """The exact tensoralg layer: ``Bilinear`` (wrapped in ``Residual`` when residual)."""
        from .layers import Bilinear, Residual

        def b(lin):
            return None if lin.bias is None else lin.bias.detach()

        layer = Bilinear(self.left.weight.detach(), self.right.weight.detach(),
                         self.down.weight.detach(), b(self.left), b(self.right), b(self.down))
        return Residual(layer) if self.residual else layer


class BilinearNet(nn.Module):
    """Embedding -> ``n_layers`` bilinear blocks -> head; a trainable bilinear classifier.

    Args:
        d_in: input size (64 for 8x8 digits, ``2P`` for modular addition).
        d_out: number of outputs (classes).
        d_model: width of the embedding / residual stream.
        d_hidden: hidden size of each bilinear block.
        n_layers: number of bilinear blocks (depth; degree ``2**n_layers``).
        bias: biases in the bilinear blocks (left, right, down).
        residual: residual connection around each block.
        embed_bias, head_bias: biases of the embedding and the head.
        seed: initialisation seed (a private generator; the global torch RNG is untouched).
        dtype: ``"float32"`` (default) or ``"float64"``.

    Input ``(n, d_in)`` -> logits ``(n, d_out)``.

    Raises:
        ValueError: non-positive sizes or an unknown dtype.
    """

    def __init__(self, d_in: int, d_out: int, d_model: int = 32, d_hidden: int = 64,
                 n_layers: int = 1, bias: bool = False, residual: bool = False,
                 embed_bias: bool = False, head_bias: bool = False, seed: int = 0,
                 dtype: Any = "float32"):
        super().__init__()
        for name, value in (("d_in", d_in), ("d_out", d_out), ("d_model", d_model),
                            ("d_hidden", d_hidden), ("n_layers", n_layers)):
            check_positive_int(value, name)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
        dt = torch_dtype(dtype)
        self.hparams = dict(d_in=d_in, d_out=d_out, d_model=d_model, d_hidden=d_hidden,
                            n_layers=n_layers, bias=bool(bias), residual=bool(residual),
                            embed_bias=bool(embed_bias), head_bias=bool(head_bias), seed=seed,
                            dtype=dtype_name(dt))
        # torch's default init draws from the global RNG; fork it so construction leaves the
        # caller's random state untouched (the real init is reset_parameters below).
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Linear(d_in, d_model, bias=embed_bias, dtype=dt)
            self.blocks = nn.ModuleList(
                [BilinearBlock(d_model, d_hidden, bias=bias, residual=residual, dtype=dt)
                 for _ in range(n_layers)])
            self.head = nn.Linear(d_model, d_out, bias=head_bias, dtype=dt)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic initialisation: ``N(0, 1/fan_in)`` weights, zero biases.

        Each block's ``down`` is scaled by ``1/sqrt(d_hidden)`` more so that a residual stack
        starts near the identity-plus-small-quadratic regime.
        """
        gen = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
                continue
            fan_in = p.shape[1]
            std = 1.0 / math.sqrt(fan_in)
            if name.endswith("down.weight"):
                std /= math.sqrt(p.shape[1]) if self.hparams["residual"] else 1.0
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.hparams["d_in"]:
            raise ValueError(f"x: expected shape (n, {self.hparams['d_in']}), got {tuple(x.shape)}")
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def to_network(self):
        """The exact tensoralg network computing the same function (float64 weights).

        ``Sequential([Linear(embed), Bilinear | Residual(Bilinear), ..., Linear(head)])``; the
        float32 weights are widened to float64 exactly, so ``net(x)`` equals ``self.double()(x)``
        up to float64 rounding of the forward pass.

        Raises:
            ValueError: a parameter with NaN or inf entries (named, e.g. ``blocks.0.left.weight``).
        """
        from ._torchutil import check_finite_parameters
        from .layers import Linear, Sequential

        check_finite_parameters(self)

        def lin(m):
            return Linear(m.weight.detach(), None if m.bias is None else m.bias.detach())

        return Sequential([lin(self.embed)] + [b.to_layer() for b in self.blocks] + [lin(self.head)])

    def config(self) -> dict:
        """Flat architecture config (all constructor arguments plus ``architecture``)."""
        return {"architecture": ARCHITECTURE, **self.hparams}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> BilinearNet:
        """Build an (initialised, untrained) model from
        [`config`][tensoralg.nn.BilinearNet.config]'s keys.

        Raises:
            ValueError: a wrong ``architecture`` or a missing size.
        """
        arch = cfg.get("architecture", ARCHITECTURE)
        if arch != ARCHITECTURE:
            raise ValueError(f"cfg: architecture {arch!r} is not {ARCHITECTURE!r}")
        required = ("d_in", "d_out", "d_model", "d_hidden", "n_layers")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"cfg: missing {missing} (needed to rebuild a {ARCHITECTURE})")
        kwargs = {k: cfg[k] for k in ("d_in", "d_out", "d_model", "d_hidden", "n_layers", "bias",
                                      "residual", "embed_bias", "head_bias", "seed", "dtype")
                  if k in cfg}
        return cls(**kwargs)


# ----------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------

def _as_inputs(X: Any, name: str, d_in: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``X`` (numpy array or torch tensor) as a ``(n, d_in)`` float tensor of ``dtype``."""
    if not isinstance(X, torch.Tensor):
        try:
            X = torch.as_tensor(np.asarray(X))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: expected a numeric (n, d_in) array, got "
                             f"{type(X).__name__} ({exc})") from None
    if X.ndim != 2:
        raise ValueError(f"{name}: expected shape (n, {d_in if d_in else 'd_in'}), got "
                         f"{tuple(X.shape)}")
    if d_in is not None and X.shape[1] != d_in:
        raise ValueError(f"{name}: expected shape (n, {d_in}) to match the model's d_in={d_in}, "
                         f"got {tuple(X.shape)}")
    if X.dtype == torch.bool or X.is_complex():
        raise ValueError(f"{name}: expected real numbers, got dtype {X.dtype}")
    X = X.to(dtype)
    if not torch.isfinite(X).all():
        raise ValueError(f"{name}: has NaN/inf entries")
    return X


def _as_labels(y: Any, name: str, n: int, d_out: int | None, x_name: str = "X") -> torch.Tensor:
    """``y`` (numpy array or torch tensor) as ``(n,)`` int64 labels in ``[0, d_out)``."""
    if not isinstance(y, torch.Tensor):
        y = np.asarray(y)
        if y.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected integer class labels, got dtype {y.dtype}")
        y = torch.as_tensor(y)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"{name}: expected integer class labels, got dtype {y.dtype}")
    if y.ndim != 1 or len(y) != n:
        raise ValueError(f"{name}: expected shape ({n},) (one label per row of {x_name}), got "
                         f"{tuple(y.shape)}")
    y = y.to(torch.int64)
    if d_out is not None and n and (int(y.min()) < 0 or int(y.max()) >= d_out):
        raise ValueError(f"{name}: labels must lie in [0, {d_out}) (the model's d_out), got "
                         f"range [{int(y.min())}, {int(y.max())}]")
    return y


def _model_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    hp = getattr(model, "hparams", None)
    if isinstance(hp, Mapping) and "d_in" in hp and "d_out" in hp:
        return int(hp["d_in"]), int(hp["d_out"])
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    return (getattr(embed, "in_features", None), getattr(head, "out_features", None))


def _check_finite_weights(model: nn.Module, step: int) -> None:
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise TrainingDiverged(f"training diverged: parameter {name!r} has NaN/inf entries "
                                   f"after step {step} (learning rate too high?)", step)


@torch.no_grad()
def accuracy(model: nn.Module, X: Any, y: Any, batch_size: int = 4096) -> float:
    """Fraction of rows of ``X`` (n, d_in) whose argmax logit equals ``y`` (n,); NaN if n == 0.

    ``X`` and ``y`` may be numpy arrays or torch tensors.

    Raises:
        ValueError: ``X`` not ``(n, d_in)`` or ``y`` not ``(n,)`` integer labels.
    """
    d_in, _ = _model_sizes(model)
    X = _as_inputs(X, "X", d_in, next(model.parameters()).dtype)
    y = _as_labels(y, "y", len(X), None)
    if len(X) == 0:
        return float("nan")
    correct = 0
    for i in range(0, len(X), batch_size):
        correct += int((model(X[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
    return correct / len(X)


def train_classifier(model: nn.Module, X: Any, y: Any, *, steps: int,
                     lr: float = 1e-2, weight_decay: float = 0.0, batch_size: int | None = 256,
                     seed: int = 0, eval_sets: Mapping[str, tuple] | None = None,
                     eval_at: Sequence[int] = (), callback: Callable[[int, nn.Module], None] | None = None,
                     progress: bool | str = False) -> dict:
    """Train ``model`` with AdamW on cross-entropy; deterministic under ``seed``.

    Args:
        X: ``(n, d_in)`` inputs (numpy array or torch tensor; converted to the model's dtype);
            y: ``(n,)`` integer labels in ``[0, d_out)`` (numpy or torch).
        steps: optimiser steps; batch_size: minibatch size (``None`` = full batch).
        eval_sets: name -> (X, y) evaluated (accuracy) at every step in ``eval_at``.
        callback: ``callback(step, model)`` called at every step in ``eval_at`` (after the step;
            step 0 = before training), e.g. to save a checkpoint.
        progress: show a tqdm bar (a string is used as its description); the bar is hidden
            anyway when stderr is not a terminal.

    Returns:
        ``{"step": [...], "<name>_acc": [...], "loss": [...]}`` at the ``eval_at`` steps.

    Raises:
        ValueError: (before any training) ``X`` not ``(n, d_in)`` with the model's ``d_in``,
            ``y`` not ``(n,)`` integer labels in ``[0, d_out)``, bad ``eval_sets``,
            ``steps < 0``, a non-finite or non-positive ``lr``.
        TrainingDiverged: the loss became NaN/inf, or a weight did (checked at every step for
            the loss, at every ``eval_at`` step and at the end for the weights).
    """
    from tqdm.auto import tqdm

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected a non-negative integer, got {steps!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr: expected a positive finite learning rate, got {lr!r}")
    d_in, d_out = _model_sizes(model)
    dtype = next(model.parameters()).dtype
    X = _as_inputs(X, "X", d_in, dtype)
    y = _as_labels(y, "y", len(X), d_out)
    if len(X) == 0:
        raise ValueError("X: no training rows")
    checked_sets = {}
    for name, pair in dict(eval_sets or {}).items():
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"eval_sets[{name!r}]: expected an (X, y) pair")
        xe = _as_inputs(pair[0], f"eval_sets[{name!r}] X", d_in, dtype)
        checked_sets[name] = (xe, _as_labels(pair[1], f"eval_sets[{name!r}] y", len(xe), d_out))
    eval_sets = checked_sets
    gen = torch.Generator().manual_seed(int(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    eval_at = sorted({int(s) for s in eval_at})
    history: dict[str, list] = {"step": [], "loss": []}
    for name in eval_sets:
        history[f"{name}_acc"] = []

    def record(step: int, loss: float) -> None:
        _check_finite_weights(model, step)
        history["step"].append(step)
        history["loss"].append(loss)
        model.eval()
        for name, (xe, ye) in eval_sets.items():
            history[f"{name}_acc"].append(accuracy(model, xe, ye))
        model.train()
        if callback is not None:
            callback(step, model)

    pending = list(eval_at)
    if pending and pending[0] == 0:
        pending.pop(0)
        with torch.no_grad():
            record(0, float(nn.functional.cross_entropy(model(X), y)))
    bar = tqdm(range(1, steps + 1), desc=progress if isinstance(progress, str) else "train",
               disable=None if progress else True, leave=False)
    n = len(X)
    model.train()
    for step in bar:
        if batch_size is None or batch_size >= n:
            xb, yb = X, y
        else:
            idx = torch.randint(0, n, (batch_size,), generator=gen)
            xb, yb = X[idx], y[idx]
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            model.eval()
            raise TrainingDiverged(f"training diverged: the loss is {loss_value} at step {step} "
                                   f"(lr={lr:g}; learning rate too high?)", step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if pending and step == pending[0]:
            pending.pop(0)
            record(step, loss_value)
    model.eval()
    _check_finite_weights(model, steps)
    return history
