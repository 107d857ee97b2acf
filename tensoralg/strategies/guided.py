"""Guided Monte Carlo (APPROXIMATE): defensive mixture importance sampling around the modes of
the integrand (docs/mathematics.md §3.9, "Monte Carlo that knows when it fails").

On deep models the Gaussian norm is carried by rare inputs (one token far out along a
direction the model amplifies), which plain and radial sampling never draw. The proposal

    q = (1 - beta) N(0, I) + beta * mean_k N(m_k, I)

puts mass around the modes ``m_k`` of ``log |f(x)|^2 - |x|^2 / 2`` (the log of the integrand
``|f|^2 phi``), found by gradient ascent from random starts and, for sequences, from one large
token at each position, for both models, both signs ``±m_k``. The weight is

    phi(x) / q(x) = 1 / ((1 - beta) + beta * mean_k exp(m_k . x - |m_k|^2 / 2)) <= 1 / (1 - beta),

so the estimator ``mean_i w(x_i) f_a(x_i) . f_b(x_i)`` (x_i ~ q) is unbiased and its variance
never exceeds ``1 / (1 - beta)`` times that of plain sampling (the defensive mixture of
Hesterberg 1995; Owen & Zhou 2000). Inputs are ``N(0, I)`` here: an input distribution
``N(0, K K^T)`` is composed into the networks first (``f∘K``). Similarities are the ratio
estimator with the delta-method standard error; ``||f_b - f_c||^2`` the weighted mean of
``|f_b - f_c|^2`` (modes of ``f_b``, ``f_c`` and ``f_b - f_c``); every result carries the project's
:class:`~tensoralg.strategies.montecarlo.Diagnostics` (replicates, largest single-sample
share, ``reliable``). It is an estimate, never exact: when the modes found are not the ones
that carry the norm it can still be wrong, which the diagnostics may or may not reveal.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..layers import Layer
from .montecarlo import (
    MonteCarloEstimate,
    check_sampling_cost,
    inner_diagnostics,
    ratio_diagnostics,
    ratio_estimate,
    warn_few,
)

__all__ = ["find_modes", "log_proposal_ratio", "draws", "inner", "similarity", "diff_sq", "BETA"]

#: Mixture weight of the modes in the proposal: weights are at most ``1 / (1 - BETA) = 2``.
BETA = 0.5
#: Gradient-ascent steps (Adam) per start.
STEPS = 200
#: Random starts per model (besides the one-large-token starts of sequence models).
RANDOM_STARTS = 8


def _shape(net: Layer, n_ctx: int | None) -> tuple:
    return (net.in_features,) if n_ctx is None else (n_ctx, net.in_features)


#: Tempering of the starts: the Gaussian term is multiplied by ``lam`` rising geometrically
#: from each of these to 1 over the first two thirds of the steps (homotopy continuation).
TEMPERS = (1.0, 0.1)


def _objective(net: Layer, U, x, position, lam):
    """``log(|U f(x)|^2 + tiny) - lam |x|^2 / 2`` per start (torch)."""
    import torch

    y = net(x) @ U.T
    if x.dim() == 3:
        y = y[:, position] if position is not None else y
    sq = (y * y).reshape(x.shape[0], -1).sum(dim=1)
    return torch.log(sq + 1e-300) - 0.5 * lam * (x * x).reshape(x.shape[0], -1).sum(dim=1)


#: Modes kept: those within this many nats of the best of their model...
MODE_WINDOW = 20.0
#: ...and farther than this from a better one (a component is N(m, I): closer is the same).
MODE_MERGE = 0.25
#: Radii (in input standard deviations) of the starts along the read directions.
START_RADII = (4.0, 8.0, 12.0)
#: Read directions per position (top eigenvectors of the gradients' second moment).
N_DIRECTIONS = 2


def _read_directions(net: Layer, Ut, shape: tuple, position, rng, n_points: int = 32):
    """``[(t, e)]``: per position ``t`` (None for vector models) the top :data:`N_DIRECTIONS`
    unit eigenvectors of ``sum_i g_i g_i^T``, ``g_i`` the gradient of ``|U f|^2`` at the
    token of ``x_i`` (``x_i ~ N(0, I)`` at radii 1..3): the directions the model reads
    most (its active subspace; for a planted model, its one direction)."""
    import torch

    x = torch.tensor(rng.standard_normal((n_points,) + shape)
                     * np.linspace(1.0, 3.0, n_points).reshape((n_points,) + (1,) * len(shape)),
                     requires_grad=True, device=Ut.device)
    y = net(x) @ Ut.T
    if x.dim() == 3 and position is not None:
        y = y[:, position]
    (y * y).sum().backward()
    G = x.grad.detach().cpu().numpy()
    G = G / np.maximum(np.linalg.norm(G.reshape(n_points, -1), axis=1), 1e-300).reshape(
        (n_points,) + (1,) * len(shape))  # each point counts once
    out = []
    for t in ([None] if len(shape) == 1 else range(shape[0])):
        g = G if t is None else G[:, t]
        lam, V = np.linalg.eigh(g.T @ g)
        for j in range(1, min(N_DIRECTIONS, len(lam)) + 1):
            if lam[-j] > 1e-12 * max(lam[-1], 1e-300):
                out.append((t, V[:, -j]))
    return out


def find_modes(nets: list[Layer], U: np.ndarray, n_ctx: int | None, seed: int,
               position: int | None = None, steps: int = STEPS,
               random_starts: int = RANDOM_STARTS, device: Any = None) -> np.ndarray:
    """Local maxima of ``log |U f(x)|^2 - |x|^2 / 2`` for each network, by Adam (torch,
    float64) from ``random_starts`` Gaussian starts at radii ``1..3 sqrt(dim)`` and from
    starts along the directions the model reads (:func:`_read_directions`; for sequences one
    token at each position, the rest 0) at radii :data:`START_RADII`, both signs; each start
    tempered (:data:`TEMPERS`): with the Gaussian term weakened, ascent runs out along the
    directions where the top-degree part grows fastest (where rare inputs carry the norm)
    before the full term pulls it back to the mode at that scale. Keeps the modes within
    :data:`MODE_WINDOW` nats of the model's best (merging those within :data:`MODE_MERGE`)
    and returns them with their negatives, ``(2 k, *shape)`` float64. ``device``: the torch
    device of the ascent (None: the CPU; the starts are drawn by numpy either way).
    """
    import torch

    shape = _shape(nets[0], n_ctx)
    dim = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    found = []
    dev = torch.device("cpu") if device is None else device
    Ut = torch.as_tensor(np.array(U, dtype=np.float64), device=dev)  # a copy: U may be read-only
    for net in nets:
        starts = [rng.standard_normal((random_starts,) + shape)
                  * np.repeat(np.linspace(1.0, 3.0, random_starts), dim).reshape(
                      (random_starts,) + shape)]
        hold = [np.ones((random_starts,) + shape[:-1] + (1,))]
        for t, e in _read_directions(net, Ut, shape, position, rng):
            for r in START_RADII:
                for sign in (1.0, -1.0):
                    x = np.zeros(shape)
                    h = np.zeros(shape[:-1] + (1,))
                    if t is None:
                        x[:], h[:] = sign * r * e, 1.0
                    else:
                        x[t], h[t] = sign * r * e, 1.0
                    starts.append(x[None])
                    hold.append(h[None])
        x0 = np.concatenate(starts)
        # one-token starts stay one token while tempered (the other positions held at 0)
        hold = np.concatenate(hold)
        lam0 = np.repeat(np.asarray(TEMPERS, dtype=np.float64), len(x0))
        x = torch.tensor(np.concatenate([x0] * len(TEMPERS)), dtype=torch.float64,
                         requires_grad=True, device=dev)
        held = torch.as_tensor(np.concatenate([hold] * len(TEMPERS)), device=dev)
        opt = torch.optim.Adam([x], lr=0.05)
        ramp = max(1, (2 * steps) // 3)
        for step in range(steps):
            lam = torch.as_tensor(lam0 ** max(0.0, 1.0 - step / ramp), device=dev)
            opt.zero_grad()
            xe = x * held if step < ramp else x
            loss = -_objective(net, Ut, xe, position, lam).sum()
            loss.backward()
            opt.step()
            if step == ramp - 1:
                with torch.no_grad():
                    x.mul_(held)
        with torch.no_grad():
            J = _objective(net, Ut, x, position, 1.0).cpu().numpy()
        m = x.detach().cpu().numpy()
        ok = np.isfinite(J) & np.all(np.isfinite(m.reshape(len(m), -1)), axis=1)
        m, J = m[ok], J[ok]
        # the modes that matter: within MODE_WINDOW nats of the best, near-duplicates merged
        order = np.argsort(-J)
        kept: list[int] = []
        for i in order:
            if J[i] < J[order[0]] - MODE_WINDOW:
                break
            if all(np.linalg.norm(m[i] - m[j]) > MODE_MERGE for j in kept):
                kept.append(i)
        found.append(m[kept])
    return np.concatenate(found + [-f for f in found])


def log_proposal_ratio(x: np.ndarray, modes: np.ndarray, beta: float = BETA) -> np.ndarray:
    """``log(q(x) / phi(x))`` for samples ``x (n, *shape)``: ``log((1 - beta) + beta *
    mean_k exp(m_k . x - |m_k|^2 / 2))`` (log-sum-exp, stable at large arguments)."""
    from scipy.special import logsumexp

    X = x.reshape(len(x), -1)
    M = modes.reshape(len(modes), -1)
    e = X @ M.T - 0.5 * (M * M).sum(axis=1)[None, :]               # (n, k)
    e = np.concatenate([np.full((len(X), 1), math.log(1 - beta)),
                        e + math.log(beta / len(M))], axis=1)
    return logsumexp(e, axis=1)


def draws(modes: np.ndarray, n: int, seed: int, beta: float = BETA, chunk: int = 4096):
    """Yield ``(x, w)`` in chunks: ``n`` samples of the mixture ``q`` (numpy
    ``default_rng(seed)``) and their weights ``phi / q`` (at most ``1 / (1 - beta)``)."""
    rng = np.random.default_rng(seed)
    shape = modes.shape[1:]
    done = 0
    while done < n:
        s = min(chunk, n - done)
        x = rng.standard_normal((s,) + shape)
        pick = rng.random(s) < beta
        k = rng.integers(0, len(modes), size=s)
        x[pick] += modes[k[pick]]
        yield x, np.exp(-log_proposal_ratio(x, modes, beta))
        done += s


def _forward(net: Layer, x: np.ndarray, device) -> np.ndarray:
    """``net(x)`` as float64 numpy, evaluated in torch on ``device`` when one is given."""
    if device is None:
        return np.asarray(net(x))
    import torch

    return net(torch.as_tensor(x, device=device)).cpu().numpy()


def _products(fa: np.ndarray, fb: np.ndarray, U: np.ndarray, position) -> np.ndarray:
    ya, yb = fa @ U.T, fb @ U.T
    if ya.ndim == 3 and position is not None:
        ya, yb = ya[:, position], yb[:, position]
    return (ya * yb).reshape(len(ya), -1).sum(axis=1)


def _check_scalar(keep: bool) -> None:
    if keep:
        raise ValueError("output: proposal='modes' estimates one number; pass output=None, a "
                         "class index or a direction (got 'each')")


def inner(na: Layer, nb: Layer, U: np.ndarray, keep: bool, n_samples: int, seed: int,
          n_ctx: int | None = None, position: int | None = None,
          device: Any = None) -> MonteCarloEstimate:
    """``<f_a, f_b>`` by guided importance sampling (APPROXIMATE; module docstring): a
    :class:`MonteCarloEstimate` with its standard error and diagnostics. ``device``: the torch
    device of the mode search and the forward passes (None: the CPU, forward in numpy).

    Raises:
        ValueError: ``output="each"`` (one number only).
    """
    _check_scalar(keep)
    check_sampling_cost([na, nb], n_samples, 1, n_ctx)
    warn_few(n_samples)
    same = nb is na
    modes = find_modes([na] if same else [na, nb], U, n_ctx, seed, position, device=device)
    p = np.concatenate([w * _products(_forward(na, x, device), _forward(nb, x, device), U,
                                      position)
                        for x, w in draws(modes, n_samples, seed + 1)])
    n = len(p)
    diag = inner_diagnostics(p, "<a,a>" if same else None)
    return MonteCarloEstimate(float(p.mean()), float(p.std(ddof=1) / math.sqrt(n)), n, diag)


def similarity(na: Layer, nb: Layer, U: np.ndarray, keep: bool, n_samples: int, seed: int,
               n_ctx: int | None = None, position: int | None = None,
               device: Any = None) -> MonteCarloEstimate:
    """``<a, b> / (||a|| ||b||)`` by guided importance sampling (APPROXIMATE): the ratio of the
    three weighted means, delta-method standard error, diagnostics over the three sums.

    Raises:
        ValueError: ``output="each"``; a sampled norm of zero.
    """
    _check_scalar(keep)
    check_sampling_cost([na, nb], n_samples, 1, n_ctx)
    warn_few(n_samples)
    modes = find_modes([na, nb], U, n_ctx, seed, position, device=device)
    parts = []
    for x, w in draws(modes, n_samples, seed + 1):
        fa, fb = _forward(na, x, device), _forward(nb, x, device)
        parts.append(np.stack([w * _products(fa, fb, U, position),
                               w * _products(fa, fa, U, position),
                               w * _products(fb, fb, U, position)]))
    P = np.concatenate(parts, axis=1)
    est = ratio_estimate(P.sum(axis=1), P @ P.T, P.shape[1])
    return MonteCarloEstimate(float(est), est.stderr, P.shape[1], ratio_diagnostics(P))


class _Difference:
    """``f_b - f_c`` as one network for :func:`find_modes` (its modes are where the two models
    differ most, which need not be where either is large)."""

    def __init__(self, nb: Layer, nc: Layer):
        self.nb, self.nc, self.in_features = nb, nc, nb.in_features

    def __call__(self, x):
        return self.nb(x) - self.nc(x)


def diff_sq(nb: Layer, nc: Layer, U: np.ndarray, keep: bool, n_samples: int, seed: int,
            n_ctx: int | None = None, position: int | None = None,
            device: Any = None) -> MonteCarloEstimate:
    """``||f_b - f_c||^2`` by guided importance sampling (APPROXIMATE; module docstring): the
    weighted mean of ``|U (f_b - f_c)|^2`` over draws of the mixture around the modes of
    ``f_b``, ``f_c`` and ``f_b - f_c``, with its standard error and the diagnostics of a
    squared norm (certified lower bound under ``"||b - c||^2"``). Unbiased whatever the
    modes found (the weights are ``phi / q``). ``device``: as :func:`inner`.

    Raises:
        ValueError: ``output="each"`` (one number only).
    """
    _check_scalar(keep)
    check_sampling_cost([nb, nc], n_samples, 1, n_ctx)
    warn_few(n_samples)
    modes = find_modes([nb, nc, _Difference(nb, nc)], U, n_ctx, seed, position, device=device)
    parts = []
    for x, w in draws(modes, n_samples, seed + 1):
        d = _forward(nb, x, device) - _forward(nc, x, device)
        parts.append(w * _products(d, d, U, position))
    p = np.concatenate(parts)
    n = len(p)
    return MonteCarloEstimate(float(p.mean()), float(p.std(ddof=1) / math.sqrt(n)), n,
                              inner_diagnostics(p, "||b - c||^2"))
