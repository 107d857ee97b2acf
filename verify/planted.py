"""Planted high-dimensional models whose exact Gaussian inner products are known.

Every read of the input (queries, keys, values, bilinear left/right factors, the unembedding)
goes through one unit direction ``v`` of the residual stream, and every write (attention
outputs, bilinear down projections) goes along ``v``. By induction over the layers, the
residual stream is ``X + (Xv + stuff(Xv)) v^T``-shaped: its component orthogonal to ``v`` is
the input's own, never read. So ``f(X)`` depends on ``X`` only through ``Xv`` (``R^{n_ctx}``
for sequences, a scalar for vectors), and under ``X ~ N(0, I)``, ``Xv ~ N(0, I_{n_ctx})``:

    <f_a, f_b> = E_{Y ~ N(0, I_{n_ctx})}[ f_a(Y v^T) . f_b(Y v^T) ],

an ``n_ctx``-variable (vector models: one-variable) Gaussian integral that
`tensoralg.verify.quadrature.quadrature_inner` computes exactly on the slice
[`PlantedModel.slice`][verify.planted.PlantedModel.slice] — the exact full inner product at
``n_ctx * d`` in the hundreds. Two planted models built with the same ``v`` (same ``direction`` or
the same ``v_seed``) and different ``seed`` are an exactly comparable pair.

``scale=sigma`` gives ``f_sigma(X) = f_1(sigma X)`` exactly (the input standard deviation
folded into the weights: reads times sigma, writes divided by sigma, biases kept, the head times
sigma), i.e. the same model under inputs ``N(0, sigma^2 I)``. Its degree-k part scales by
``sigma^k`` (docs/mathematics.md §3.9), so a large sigma puts the norm in the top degree, carried by rare
large inputs: the regime where plain Monte Carlo fails.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PlantedModel", "planted_attention", "planted_bilinear", "unit_direction",
           "hidden_needle"]


def _check_int(v: Any, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {v!r}")
    return int(v)


def _check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or \
            not np.isfinite(float(scale)) or float(scale) <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)


def unit_direction(d: int, seed: int = 0) -> np.ndarray:
    """A random unit vector of ``R^d`` (``numpy.random.default_rng(seed)``), shape ``(d,)``."""
    d = _check_int(d, "d")
    v = np.random.default_rng(seed).standard_normal(d)
    return v / np.linalg.norm(v)


def _direction(direction: Any, d: int, v_seed: int) -> np.ndarray:
    if direction is None:
        return unit_direction(d, v_seed)
    v = np.array(direction, dtype=np.float64)
    if v.shape != (d,) or not np.all(np.isfinite(v)):
        raise ValueError(f"direction: expected a finite vector of shape ({d},), got shape "
                         f"{v.shape}")
    n = float(np.linalg.norm(v))
    if abs(n - 1.0) > 1e-12:
        raise ValueError(f"direction: expected a unit vector, got norm {n:.6g}")
    return v


@dataclass(frozen=True)
class PlantedModel:
    """A planted network and its direction.

    Attributes:
        network: the tensoralg network.
        direction: ``v``, shape ``(d,)``, unit norm.
        n_ctx: the sequence length the slice is built for (None for vector models).
        scale: the input scale ``sigma`` folded into the weights.
    """

    network: Any
    direction: np.ndarray
    n_ctx: int | None
    scale: float

    def slice(self):
        """The slice on which the model's exact inner products live: ``v`` at every position
        (``N = n_ctx`` variables; vector models: ``N = 1``), a
        [`tensoralg.verify.quadrature.GaussianSlice`][verify.quadrature.GaussianSlice]."""
        from .quadrature import GaussianSlice

        d = self.direction.size
        return GaussianSlice.from_basis(self.direction[None, :], d=d, n_ctx=self.n_ctx)


def planted_attention(d: int, n_ctx: int, *, n_layers: int = 2, n_heads: int = 2,
                      d_head: int = 2, d_v: int = 1, d_out: int = 1, scale: float = 1.0,
                      bias: bool = True, mask: Any = "causal", seed: int = 0,
                      direction: Any = None, v_seed: int = 0) -> PlantedModel:
    """A planted bilinear-attention transformer:
    ``Sequential([Residual(BilinearAttention) x n_layers, Linear(d -> d_out)])``, embedding
    free, residual stream of width ``d``.

    Head ``h`` of every layer: ``q1_h = a1_h v^T`` (``(d_head, d)``, ``a1_h ~ N(0, I)``), likewise
    ``k1, q2, k2`` and ``v_h = e_h v^T`` (``(d_v, d)``); ``o[:, h, :] = v c_h^T``;
    biases (``bias=True``) ``~ N(0, 1)`` for queries, keys and values, ``o_bias = beta v``;
    the head ``Linear(u v^T, b)``. All random numbers from ``default_rng(seed)``; ``v`` from
    ``direction`` or ``unit_direction(d, v_seed)``. Default attention scale ``1/d_head``.

    Args:
        d: residual width; n_ctx: sequence length of
            [`PlantedModel.slice`][verify.planted.PlantedModel.slice];
        scale: input standard deviation sigma folded into the weights (module docstring).

    Returns:
        [`PlantedModel`][verify.planted.PlantedModel] (degree ``5 ** n_layers``).

    Raises:
        ValueError: non-positive sizes, a bad ``scale`` or ``direction``.
    """
    from tensoralg import layers as ta

    d, n_ctx = _check_int(d, "d"), _check_int(n_ctx, "n_ctx")
    n_layers, n_heads = _check_int(n_layers, "n_layers"), _check_int(n_heads, "n_heads")
    d_head, d_v, d_out = _check_int(d_head, "d_head"), _check_int(d_v, "d_v"), \
        _check_int(d_out, "d_out")
    sigma = _check_scale(scale)
    v = _direction(direction, d, v_seed)
    rng = np.random.default_rng(seed)
    g = rng.standard_normal
    layers = []
    for _ in range(n_layers):
        reads = {name: sigma * g((n_heads, d_head, 1)) * v[None, None, :]
                 for name in ("q1", "k1", "q2", "k2")}
        reads["v"] = sigma * g((n_heads, d_v, 1)) * v[None, None, :]
        o = v[:, None, None] * g((1, n_heads, d_v)) / sigma
        biases = {}
        if bias:
            biases = {f"{name}_bias": g((n_heads, d_head)) for name in ("q1", "k1", "q2", "k2")}
            biases["v_bias"] = g((n_heads, d_v))
            biases["o_bias"] = g() * v / sigma
        layers.append(ta.Residual(ta.BilinearAttention(**reads, o=o, **biases, mask=mask)))
    head = sigma * g((d_out, 1)) * v[None, :]
    layers.append(ta.Linear(head, g(d_out) if bias else None))
    return PlantedModel(ta.Sequential(layers), v, n_ctx, sigma)


def planted_bilinear(d: int, *, depth: int = 2, hidden: int = 2, d_out: int = 1,
                     scale: float = 1.0, bias: bool = True, seed: int = 0,
                     direction: Any = None, v_seed: int = 0) -> PlantedModel:
    """A planted deep bilinear MLP (vector model):
    ``Sequential([Residual(Bilinear(d -> d)) x depth, Linear(d -> d_out)])`` with
    ``left = a v^T``, ``right = b v^T`` (``(hidden, d)``), ``down = v c^T``, biases ``~ N(0,1)``
    (``down_bias = beta v``), head ``u v^T``: ``f(x)`` depends on ``x`` only through ``x . v``
    (``N = 1`` slice). ``scale`` as in [`planted_attention`][verify.planted.planted_attention].
    Degree ``2 ** depth``.

    Raises:
        ValueError: non-positive sizes, a bad ``scale`` or ``direction``.
    """
    from tensoralg import layers as ta

    d, depth = _check_int(d, "d"), _check_int(depth, "depth")
    hidden, d_out = _check_int(hidden, "hidden"), _check_int(d_out, "d_out")
    sigma = _check_scale(scale)
    v = _direction(direction, d, v_seed)
    g = np.random.default_rng(seed).standard_normal
    layers = []
    for _ in range(depth):
        left = sigma * g((hidden, 1)) * v[None, :]
        right = sigma * g((hidden, 1)) * v[None, :]
        down = v[:, None] * g((1, hidden)) / sigma
        kw = dict(left_bias=g(hidden), right_bias=g(hidden), down_bias=g() * v / sigma) \
            if bias else {}
        layers.append(ta.Residual(ta.Bilinear(left, right, down, **kw)))
    layers.append(ta.Linear(sigma * g((d_out, 1)) * v[None, :], g(d_out) if bias else None))
    return PlantedModel(ta.Sequential(layers), v, None, sigma)


def hidden_needle(seed: int, *, scale: float = 0.8, d: int = 16, n_outputs: int = 6,
                  share: float = 0.3):
    """The planted two-layer attention needle (`planted_attention` at ``n_ctx = 2``, direction
    ``unit_direction(d, 7)``) beside a wide linear readout of the ``d - 1`` directions
    orthogonal to ``v``: ``n_outputs`` outputs, the first also reading the needle with the
    coefficient that gives it ``share`` of the squared norm. A strong linear read fills the
    gradient directions a mode search starts from and hides the needle from them (an
    independent tester's model that fooled both Monte Carlo estimators).

    Returns:
        ``(network, W, v, slice)``: ``W`` ``(n_outputs, d)`` the readout (rows orthogonal to
        ``v``), ``slice`` the v-slice. Exact inner products: quadrature on the slice plus the
        readouts' part orthogonal to v, ``2 tr(W_a P W_b^T)`` with ``P = I - v v^T`` (the two
        are uncorrelated: that part is linear, odd, in Gaussian coordinates independent of
        v's).
    """
    from tensoralg import layers as ta

    from .quadrature import quadrature_inner

    pm = planted_attention(d, 2, scale=scale, seed=seed, v_seed=7)
    v = pm.direction
    body = list(pm.network.layers[:-1])
    head = pm.network.layers[-1].weight[0]
    W = np.random.default_rng(1000 + seed).standard_normal((n_outputs, d))
    W -= np.outer(W @ v, v)
    needle = ta.Sequential(body + [ta.Linear(head[None, :])])
    n2 = float(quadrature_inner(needle, needle, pm.slice(), n_ctx=2))
    H = W.copy()
    H[0] += np.sqrt(share / (1 - share) * 2 * float(np.sum(W * W)) / n2) * head
    return ta.Sequential(body + [ta.Linear(H)]), W, v, pm.slice()
