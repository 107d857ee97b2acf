"""Guided Monte Carlo (APPROXIMATE): defensive mixture importance sampling of directions around
the modes of the integrand, the radius integrated exactly (docs/montecarlo.md, "Guided
sampling"; docs/mathematics.md §3.9).

On deep models the Gaussian norm is carried by rare inputs (one token far out along a
direction the model amplifies), which plain directions never draw. The radial estimator of
`montecarlo` writes ``x = r u`` and integrates the radius exactly
(``h(u) = E_r[f_a(r u) . f_b(r u)]``, a Gauss rule for the chi radius); here the directions
``u`` come from the mixture on the sphere ``S^(D-1)``

    q(u) = (1 - beta) uniform(u) + beta * mean_k vMF(u; mu_k, kappa_k)

of von Mises-Fisher components around the directions ``mu_k = m_k / |m_k|`` of the modes ``m_k``
of ``log |f(x)|^2 - |x|^2 / 2`` (the log of the integrand ``|f|^2 phi``), found by gradient ascent
from random starts and, for sequences, from one large token at each position, for both
models, both signs, at concentrations ``kappa = c |m_k|^2`` (`KAPPA_SCALES`). The weight is

    uniform(u) / q(u) = 1 / ((1 - beta) + beta * mean_k vMF_k(u) / uniform(u)) <= 1 / (1 - beta),

so the estimator ``mean_i w(u_i) h(u_i)`` is unbiased whatever the modes, its summand is bounded
(``|w h| <= 2 max |h|``), and its variance never exceeds ``1 / (1 - beta)`` times that of plain
directions (the defensive mixture of Hesterberg 1995; Owen & Zhou 2000). Inputs are ``N(0, I)``
here: an input distribution ``N(0, K K^T)`` is composed into the networks first (``f∘K``).
Similarities are the ratio estimator with the delta-method standard error (reporting the three
inner products they are the ratio of); ``||f_b - f_c||^2`` the weighted mean of the radial
average of ``|f_b - f_c|^2`` (modes of ``f_b``, ``f_c`` and ``f_b - f_c``); every result carries
the project's `Diagnostics`. It is an estimate, never
exact: when the modes found are not the ones that carry the norm it can still be wrong, which
the diagnostics may or may not reveal (measured: docs/results/montecarlo.md).
"""

from __future__ import annotations

import dataclasses
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
    skew_widening,
    warn_few,
)

__all__ = ["find_modes", "direction_components", "log_direction_ratio", "direction_draws",
           "inner", "similarity", "diff_sq", "Difference", "BETA", "KAPPA_SCALES"]

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
    """``[(t, e)]``: per position ``t`` (None for vector models) the top `N_DIRECTIONS`
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
    extra = _nonlinear_read_directions(net, shape[-1])
    for t in ([None] if len(shape) == 1 else range(shape[0])):
        g = G if t is None else G[:, t]
        lam, V = np.linalg.eigh(g.T @ g)
        mine = [V[:, -j] for j in range(1, min(N_DIRECTIONS, len(lam)) + 1)
                if lam[-j] > 1e-12 * max(lam[-1], 1e-300)]
        for e in extra:   # not already (nearly) among the gradient directions
            if all(abs(float(e @ f)) < SAME_DIRECTION for f in mine):
                mine.append(e)
        out += [(t, e) for e in mine]
    return out


#: Directions whose |cosine| is at least this are one start direction.
SAME_DIRECTION = 0.99


def _nonlinear_read_directions(net: Layer, d: int) -> list:
    """Up to `N_DIRECTIONS` unit directions of the input that the model's nonlinear layers
    (bilinear attention, bilinear) read most: the top right singular vectors of their stacked
    read weights (queries, keys, values; left, right), pulled back to the input through the
    linear layers before them along the residual stream's identity path. A strong linear
    read fills the gradient directions of `_read_directions` and can hide a rare, strong
    nonlinear feature from them; its weights cannot hide it."""
    from ..layers import Bilinear, BilinearAttention, Linear, Residual, Sequential

    rows: list = []

    def walk(layer, P):   # P: (width, d) map from the input to the stream; None: stop
        if P is None:
            return None
        if isinstance(layer, Sequential):
            for sub in layer.layers:
                P = walk(sub, P)
            return P
        if isinstance(layer, Residual):
            walk(layer.inner, P)
            return P
        if isinstance(layer, Difference):
            walk(layer.nb, P)
            walk(layer.nc, P)
            return None
        if isinstance(layer, Linear):
            return np.asarray(layer.weight, dtype=np.float64) @ P
        if isinstance(layer, Bilinear):
            rows.extend([np.asarray(layer.left, np.float64) @ P,
                         np.asarray(layer.right, np.float64) @ P])
            return None
        if isinstance(layer, BilinearAttention):
            for k in ("q1", "k1", "q2", "k2", "v"):
                w = np.asarray(getattr(layer, k), dtype=np.float64)
                rows.append(w.reshape(-1, w.shape[-1]) @ P)
            return None
        return None

    try:
        walk(net, np.eye(d))
        if not rows:
            return []
        _, sv, Vt = np.linalg.svd(np.concatenate(rows), full_matrices=False)
    except (TypeError, ValueError, AttributeError, np.linalg.LinAlgError):
        return []   # exact (rational) weights or a layer of another kind: gradients only
    return [Vt[j] for j in range(min(N_DIRECTIONS, len(sv))) if sv[j] > 1e-12 * sv[0]]


def _fingerprint(net) -> tuple:
    """A key of a network's function for `find_modes`' cache: its class and the bytes
    of its arrays (a `Difference`: those of its two networks)."""
    import hashlib

    if isinstance(net, Difference):
        return ("difference", _fingerprint(net.nb), _fingerprint(net.nc))
    h = hashlib.sha1(type(net).__name__.encode())
    for a in net.arrays():
        a = np.ascontiguousarray(np.asarray(a, dtype=np.float64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return (type(net).__name__, h.hexdigest())


#: The last modes found (a plain estimate and its guided cross-check search the same ones).
_MODE_CACHE: dict = {}
_MODE_CACHE_SIZE = 16


def _check_search_memory(nets, n_ctx: int | None, random_starts: int = RANDOM_STARTS) -> None:
    """CostTooHigh (before any work) when the mode search's attention scores, one start per
    random start and per position, read direction, radius and sign, at each temper, would not
    fit in `MC_MAX_BYTES` (autograd keeps about twice a forward pass's arrays)."""
    from .montecarlo import _SCORE_ARRAYS, check_score_memory

    starts = random_starts + (n_ctx or 1) * 2 * N_DIRECTIONS * len(START_RADII) * 2
    check_score_memory(nets, starts * len(TEMPERS), n_ctx,
                       "the mode search of proposal='modes'", arrays=2 * _SCORE_ARRAYS)


def find_modes(nets: list[Layer], U: np.ndarray, n_ctx: int | None, seed: Any,
               position: int | None = None, steps: int = STEPS,
               random_starts: int = RANDOM_STARTS, device: Any = None) -> np.ndarray:
    """The modes of `_find_modes` (its docstring), remembered for the last
    `_MODE_CACHE_SIZE` searches by the networks' weights, ``U``, ``n_ctx``, ``seed``,
    ``position``, ``steps``, ``random_starts`` and ``device`` (a read-only array).

    Raises:
        CostTooHigh: the search's attention scores would not fit in
            [`MC_MAX_BYTES`][tensoralg.strategies.montecarlo.MC_MAX_BYTES] (a long ``n_ctx``), before
            any work.
    """
    _check_search_memory(nets, n_ctx, random_starts)
    try:
        key = (tuple(_fingerprint(n) for n in nets), np.asarray(U, np.float64).tobytes(),
               np.shape(U), n_ctx, repr(seed), position, steps, random_starts, str(device))
    except (AttributeError, TypeError):
        key = None
    if key is not None and key in _MODE_CACHE:
        return _MODE_CACHE[key]
    modes = _find_modes(nets, U, n_ctx, seed, position, steps, random_starts, device)
    modes.setflags(write=False)
    if key is not None:
        while len(_MODE_CACHE) >= _MODE_CACHE_SIZE:
            _MODE_CACHE.pop(next(iter(_MODE_CACHE)))
        _MODE_CACHE[key] = modes
    return modes


#: Adam's learning rate in the mode search (betas and eps: `adam_step`).
ADAM_LR = 0.05


def adam_step(x, grad, m1, m2, step: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
    """One Adam update of ``x`` in place (Kingma & Ba 2015, Algorithm 1), ``m1``, ``m2`` the
    moment estimates (updated in place), ``step`` counted from 1: the same tensor operations
    in the same order as ``torch.optim.Adam``'s single-tensor update (without weight decay,
    amsgrad or maximize; the one it runs on CPU tensors), so the iterates are bit for bit
    those of ``torch.optim.Adam(lr=lr)`` (tests/test_guided_mc.py). Written out because the
    first use of ``torch.optim`` imports ``torch._dynamo`` (about 3 s, once per process)."""
    b1, b2 = betas
    m1.lerp_(grad, 1 - b1)
    m2.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bias1 = 1 - b1 ** float(step)
    bias2_sqrt = (1 - b2 ** float(step)) ** 0.5
    x.addcdiv_(m1, (m2.sqrt() / bias2_sqrt).add_(eps), value=-(lr / bias1))


def _find_modes(nets: list[Layer], U: np.ndarray, n_ctx: int | None, seed: Any,
                position: int | None = None, steps: int = STEPS,
                random_starts: int = RANDOM_STARTS, device: Any = None) -> np.ndarray:
    """Local maxima of ``log |U f(x)|^2 - |x|^2 / 2`` for each network, by Adam (torch,
    float64) from ``random_starts`` Gaussian starts at radii ``1..3 sqrt(dim)`` and from
    starts along the directions the model reads (`_read_directions`; for sequences one
    token at each position, the rest 0) at radii `START_RADII`, both signs; each start
    tempered (`TEMPERS`): with the Gaussian term weakened, ascent runs out along the
    directions where the top-degree part grows fastest (where rare inputs carry the norm)
    before the full term pulls it back to the mode at that scale. Keeps the modes within
    `MODE_WINDOW` nats of the model's best (merging those within `MODE_MERGE`)
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
        m1, m2 = torch.zeros_like(x), torch.zeros_like(x)   # Adam's moments
        ramp = max(1, (2 * steps) // 3)
        for step in range(steps):
            lam = torch.as_tensor(lam0 ** max(0.0, 1.0 - step / ramp), device=dev)
            xe = x * held if step < ramp else x
            loss = -_objective(net, Ut, xe, position, lam).sum()
            (grad,) = torch.autograd.grad(loss, x)
            with torch.no_grad():
                adam_step(x, grad, m1, m2, step + 1, ADAM_LR)
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


#: Concentrations of the direction components around each mode direction ``m / |m|``:
#: ``kappa = c |m|^2`` for each ``c`` here. ``c = 1`` matches the spread of the directions of
#: ``N(m, I)`` (angular standard deviation ``1 / |m|``); the wider ``c = 1/4`` covers peaks
#: broader than that. Any choice keeps the estimator unbiased (the weights are exact).
KAPPA_SCALES = (1.0, 0.25)


def _log_bessel_iv(nu: float, kappa: np.ndarray) -> np.ndarray:
    """``log I_nu(kappa)`` (modified Bessel function of the first kind) for ``nu >= 0`` and
    ``kappa > 0``, stable where ``I_nu`` under- or overflows float64 (large ``nu`` at moderate
    ``kappa``, the high-dimensional spheres of sequence models): scipy's ``ive`` where its value
    is representable, else the power series ``sum_j (kappa/2)^(2j + nu) / (j! Gamma(j + nu + 1))``
    summed in log space (positive terms: no cancellation)."""
    from scipy.special import gammaln, ive, logsumexp

    kappa = np.asarray(kappa, dtype=np.float64)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        v = ive(nu, kappa)
    out = np.log(np.where(v > 1e-280, v, 1.0)) + kappa
    bad = ~((v > 1e-280) & np.isfinite(v))
    for i in np.flatnonzero(bad):
        k = float(kappa.flat[i])
        j = np.arange(int(k / 2 + 12 * math.sqrt(k) + 64), dtype=np.float64)
        out.flat[i] = logsumexp((2 * j + nu) * math.log(k / 2) - gammaln(j + 1)
                                - gammaln(j + nu + 1))
    return out


def direction_components(modes: np.ndarray, scales=KAPPA_SCALES):
    """The von Mises-Fisher components of the direction proposal: ``(mu, kappa)``, ``mu``
    ``(K, D)`` the unit directions ``m / |m|`` of the modes ``(k, *shape)`` (flattened;
    ``D = prod(shape)``), ``kappa`` ``(K,)`` = ``c |m|^2`` for each ``c`` in ``scales``. Modes at
    the origin (no direction) and components with ``kappa < 1`` (nearly the uniform
    distribution already in the mixture) are left out; none at all for ``D = 1`` (the sphere is
    ``{-1, 1}``, which the radial rule covers exactly)."""
    M = np.asarray(modes, dtype=np.float64).reshape(len(modes), -1)
    D = M.shape[1]
    r2 = (M * M).sum(axis=1)
    keep = r2 > 0
    mu = M[keep] / np.sqrt(r2[keep])[:, None]
    mus, kappas = [], []
    for c in scales:
        k = c * r2[keep]
        ok = k >= 1.0
        mus.append(mu[ok])
        kappas.append(k[ok])
    mu, kappa = np.concatenate(mus), np.concatenate(kappas)
    if D < 2:
        return mu[:0], kappa[:0]
    return mu, kappa


def log_direction_ratio(u: np.ndarray, mu: np.ndarray, kappa: np.ndarray,
                        beta: float = BETA) -> np.ndarray:
    """``log(q(u) / uniform(u))`` for unit directions ``u`` ``(n, D)`` under the mixture
    ``q = (1 - beta) uniform + beta mean_k vMF(mu_k, kappa_k)`` on the sphere ``S^(D-1)``.

    The von Mises-Fisher density relative to the uniform one is
    ``|S^(D-1)| C_D(kappa) exp(kappa mu.u)`` with ``C_D(kappa) = kappa^(D/2-1) / ((2 pi)^(D/2)
    I_(D/2-1)(kappa))`` and ``|S^(D-1)| = 2 pi^(D/2) / Gamma(D/2)`` (Mardia & Jupp, Directional
    Statistics, 2000, §9.3.2), i.e. in logs
    ``log 2 - lgamma(D/2) - (D/2) log 2 + (D/2-1) log kappa - log I_(D/2-1)(kappa) + kappa mu.u``.
    With no components the ratio is 1 (plain sampling)."""
    u = np.asarray(u, dtype=np.float64)
    if len(mu) == 0:
        return np.zeros(len(u))
    from scipy.special import logsumexp

    D = u.shape[1]
    nu = D / 2 - 1
    c = (math.log(2) - math.lgamma(D / 2) - (D / 2) * math.log(2) + nu * np.log(kappa)
         - _log_bessel_iv(nu, kappa))                                  # (K,)
    e = u @ mu.T * kappa[None, :] + (c + math.log(beta / len(mu)))[None, :]
    e = np.concatenate([np.full((len(u), 1), math.log(1 - beta)), e], axis=1)
    return logsumexp(e, axis=1)


def _uniform_directions(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """``n`` uniform unit vectors ``(n, dim)``: normalised Gaussians (Marsaglia 1972)."""
    u = rng.standard_normal((n, dim))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    return u


def vmf_draws(mu: np.ndarray, kappa: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` draws ``(n, D)`` of the von Mises-Fisher distribution of mean direction ``mu``
    (a unit ``(D,)`` vector, ``D >= 2``) and concentration ``kappa > 0``: the algorithm and the
    random stream of ``scipy.stats.vonmises_fisher(mu, kappa).rvs(n, random_state=rng)``
    (scipy 1.11+; the same draws bit for bit, tested), written out so that a guided call does
    not import ``scipy.stats`` (about a second of CPU, once per process). ``D = 2``: numpy's
    von Mises angles; ``D = 3``: the inverse-CDF rule of Jakob (2012), "Numerically stable
    sampling of the von Mises Fisher distribution on S^2"; ``D >= 4``: Wood's rejection
    sampler (Wood 1994, "Simulation of the von Mises Fisher distribution", eq. 4 and steps
    0-3); ``D >= 3`` rotated from the north pole ``e_1`` to ``mu`` by the orthogonal factor
    of a QR decomposition."""
    mu = np.asarray(mu, dtype=np.float64)
    dim = mu.shape[0]
    if dim == 2:
        angle = rng.vonmises(np.arctan2(mu[1], mu[0]), kappa, size=n)
        return np.stack([np.cos(angle), np.sin(angle)], axis=-1)
    if dim == 3:
        x = rng.random(n)
        x = 1. + np.log(x + (1. - x) * np.exp(-2 * kappa)) / kappa
        circle = _uniform_directions(rng, n, 2)
        r = np.sqrt(1. - np.square(x))
        samples = np.stack([x, r * circle[..., 0], r * circle[..., 1]], axis=-1)
    else:
        m = dim - 1
        b = (-2 * kappa + np.sqrt(4 * kappa ** 2. + m ** 2)) / m
        if b == 0:   # large kappa: the expansion of the square root (as scipy)
            b = m / 4 * kappa ** -1. - m ** 3 / 64 * kappa ** -3.
        x0 = (1. - b) / (1. + b)
        c = kappa * x0 + m * (np.log(4) + np.log(b) - 2 * np.log1p(b))
        x = np.zeros((n,))
        done = 0
        while done < n:
            z = rng.beta(0.5 * m, 0.5 * m, size=n - done)
            w = (1 - (1 + b) * z) / (1 - (1 - b) * z)
            u = rng.random(n - done)
            ok = (kappa * w + m * (np.log((1 + b - w + w * b) / (1 + b))) - c) > np.log(u)
            k = np.sum(ok)
            x[done:done + k] = w[ok]
            done += k
        rest = np.einsum("...,...i->...i", np.sqrt(1 - x ** 2), _uniform_directions(rng, n, m))
        samples = np.concatenate([x[..., None], rest], axis=1)
    pole = np.zeros((dim,))
    pole[0] = 1.
    Q, _ = np.linalg.qr(np.transpose(np.concatenate([mu[None, :], np.zeros((dim - 1, dim))])))
    sign = 1 if np.allclose(np.matmul(Q, pole[:, None])[:, 0], mu) else -1
    return np.einsum("ij,...j->...i", Q, samples) * sign


def direction_draws(mu: np.ndarray, kappa: np.ndarray, D: int, n: int, seed: int,
                    beta: float = BETA, chunk: int = 4096):
    """Yield ``(u, w)`` in chunks: ``n`` directions ``(s, D)`` of the mixture ``q`` of
    `log_direction_ratio` (numpy ``default_rng(seed)``; the von Mises-Fisher draws by
    `vmf_draws`, those of ``scipy.stats.vonmises_fisher``) and their weights ``uniform / q``
    (at most ``1 / (1 - beta)``; exactly 1 with no components)."""
    rng = np.random.default_rng(seed)
    done = 0
    K = len(mu)
    b = beta if K else 0.0
    while done < n:
        s = min(chunk, n - done)
        u = rng.standard_normal((s, D))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        if K:
            pick = np.flatnonzero(rng.random(s) < b)
            comp = rng.integers(0, K, size=pick.size)
            for k in np.unique(comp):
                rows = pick[comp == k]
                u[rows] = vmf_draws(mu[k], kappa[k], rows.size, rng).reshape(rows.size, D)
        yield u, np.exp(-log_direction_ratio(u, mu, kappa, beta))
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


def _radial_samples(nets, pairs, U, n_ctx, position, degree: int, modes, n_samples: int,
                    seed: int, device, chunk_points: int = 1 << 15) -> np.ndarray:
    """``(P, w)``: ``P`` ``(len(pairs), n_samples)``, per direction ``u`` of the mixture
    (`direction_draws` around the directions of ``modes``), ``w(u) h_ij(u)`` for each
    ``(i, j)`` in ``pairs``, ``h_ij(u) = E_r[U f_i(r u) . U f_j(r u)]`` the exact radial average
    (the Gauss rule for the chi radius of `montecarlo`, exact for
    degree ``<= 2 degree``) and ``w = uniform / q`` ``(n_samples,)``. Unbiased: ``E_q[w h] = E_uniform[h] =
    <f_i, f_j>`` whatever the modes; ``|w h| <= 2 max |h|``, a bounded summand."""
    from .montecarlo import _finite_outputs, _radial_points, score_chunk

    shape = _shape(nets[0], n_ctx)
    D = int(np.prod(shape))
    pts, wq = _radial_points(D, 2 * degree)
    Q = pts.size
    mu, kappa = direction_components(modes)
    out, ws = [], []
    chunk = score_chunk(nets, n_ctx, Q, max(1, chunk_points // (Q * max(1, D))))
    for u, w in direction_draws(mu, kappa, D, n_samples, seed, chunk=chunk):
        s = len(u)
        X = (u[:, None, :] * pts[None, :, None]).reshape((s * Q,) + shape)
        F = [_forward(net, X, device) for net in nets]
        _finite_outputs(np.stack([f.reshape(s, -1) for f in F])[:, :, None, :])
        h = np.stack([(_products(F[i], F[j], U, position).reshape(s, Q) * wq).sum(axis=1)
                      for i, j in pairs])
        out.append(h * w[None, :])
        ws.append(w)
    return np.concatenate(out, axis=1), np.concatenate(ws)


def uniform_variance(P: np.ndarray, w: np.ndarray, g: np.ndarray | None = None) -> float:
    """The variance over UNIFORM directions of the per-direction summand ``psi = g . h(u)``
    (``g = None``: ``P`` has one row and ``psi = h``), estimated from the guided samples
    ``P = w h`` ``(m, n)`` and their weights ``w = uniform / q`` ``(n,)``:
    ``mean(w psi^2) - mean(w psi)^2`` (``E_q[w psi^2] = E_uniform[psi^2]``; the summand
    ``w psi^2 <= 2 max psi^2`` is bounded, and the mixture draws the rare directions where
    ``psi^2`` is large). Plain sampling's standard error is ``sqrt(Var_uniform(psi) / n)``; its
    own sample variance sees only the directions it drew, so on a heavy tail it is too small,
    which this estimate reveals (`cross_checked`)."""
    y = P[0] if g is None else np.asarray(g) @ P       # w psi
    return float(max(np.mean(y * y / w) - np.mean(y) ** 2, 0.0))


def _search_seed(seed: int) -> tuple:
    """The mode search's seed: ``(seed, 1)`` (a numpy SeedSequence), a stream independent of
    plain sampling's ``default_rng(seed)`` and of every other ``seed``'s streams."""
    return (int(seed), 1)


def _draw_seed(seed: int) -> tuple:
    """The guided directions' seed ``(seed, 2)`` (as `_search_seed`)."""
    return (int(seed), 2)


def _degree(nets) -> int:
    return max(int(n.degree) for n in nets)


def inner(na: Layer, nb: Layer, U: np.ndarray, keep: bool, n_samples: int, seed: int,
          n_ctx: int | None = None, position: int | None = None,
          device: Any = None) -> MonteCarloEstimate:
    """``<f_a, f_b>`` by guided radial importance sampling (APPROXIMATE; module docstring): a
    [`MonteCarloEstimate`][tensoralg.strategies.montecarlo.MonteCarloEstimate] with its standard
    error and diagnostics. ``device``: the torch device of the mode search and the forward passes
    (None: the CPU, forward in numpy).

    Raises:
        ValueError: ``output="each"`` (one number only).
    """
    _check_scalar(keep)
    _check_search_memory([na, nb], n_ctx)
    check_sampling_cost([na, nb], n_samples, _points([na, nb], n_ctx), n_ctx)
    warn_few(n_samples)
    same = nb is na
    modes = find_modes([na] if same else [na, nb], U, n_ctx, _search_seed(seed), position,
                       device=device)
    nets = [na] if same else [na, nb]
    P, w = _radial_samples(nets, [(0, 0) if same else (0, 1)], U, n_ctx, position,
                           _degree(nets), modes, n_samples, _draw_seed(seed), device)
    return _mean_estimate(P, w, "<a,a>" if same else None)


def _mean_estimate(P: np.ndarray, w: np.ndarray, norm_name: str | None) -> MonteCarloEstimate:
    """The weighted mean of the one row of ``P = w h`` with its standard error, diagnostics
    and ``.uniform_variance`` (`uniform_variance` of ``h``)."""
    p = P[0]
    n = len(p)
    d = inner_diagnostics(p, norm_name)
    f = skew_widening(p)
    out = MonteCarloEstimate(float(p.mean()), float(p.std(ddof=1) / math.sqrt(n)) * f, n,
                             dataclasses.replace(d, skew_factor=f))
    out.uniform_variance = uniform_variance(P, w)
    return out


def _points(nets, n_ctx) -> int:
    from .montecarlo import _radial_nodes

    return 2 * _radial_nodes(2 * _degree(nets))


def similarity(na: Layer, nb: Layer, U: np.ndarray, keep: bool, n_samples: int, seed: int,
               n_ctx: int | None = None, position: int | None = None,
               device: Any = None) -> MonteCarloEstimate:
    """``<a, b> / (||a|| ||b||)`` by guided radial importance sampling (APPROXIMATE): the ratio
    of the three weighted means from the same directions, delta-method standard error,
    diagnostics over the three sums. The three inner products it is the ratio of are reported
    as ``.inner_products`` (``{"<a,b>", "<a,a>", "<b,b>"}``, each a
    [`MonteCarloEstimate`][tensoralg.strategies.montecarlo.MonteCarloEstimate]): the value is
    exactly ``<a,b> / sqrt(<a,a> <b,b>)`` of those.

    Raises:
        ValueError: ``output="each"``; a sampled norm of zero.
    """
    _check_scalar(keep)
    _check_search_memory([na, nb], n_ctx)
    check_sampling_cost([na, nb], n_samples, _points([na, nb], n_ctx), n_ctx)
    warn_few(n_samples)
    modes = find_modes([na, nb], U, n_ctx, _search_seed(seed), position, device=device)
    P, w = _radial_samples([na, nb], [(0, 1), (0, 0), (1, 1)], U, n_ctx, position,
                           _degree([na, nb]), modes, n_samples, _draw_seed(seed), device)
    n = P.shape[1]
    est = ratio_estimate(P.sum(axis=1), P @ P.T, n)
    names = ("<a,b>", "<a,a>", "<b,b>")
    parts = {k: _mean_estimate(P[i:i + 1], w, None if i == 0 else k)
             for i, k in enumerate(names)}
    _, aa, bb = P.mean(axis=1)
    r = float(est)
    # the ratio's linearised summand psi = g . (h - m), g its gradient at the guided means
    g = np.array([1 / math.sqrt(aa * bb), -r / (2 * aa), -r / (2 * bb)])
    f = skew_widening(g @ (P - P.mean(axis=1, keepdims=True)))
    out = MonteCarloEstimate(float(est), est.stderr * f, n,
                             dataclasses.replace(ratio_diagnostics(P), skew_factor=f))
    out.inner_products = parts
    out.uniform_variance = uniform_variance(P - np.outer(P.mean(axis=1), w), w, g)
    return out


class Difference:
    """``f_b - f_c`` as one network for `find_modes` and the estimators (its modes are
    where the two models differ most, which need not be where either is large); ``degree``
    the larger of the two."""

    def __init__(self, nb: Layer, nc: Layer):
        self.nb, self.nc, self.in_features = nb, nc, nb.in_features
        self.degree = max(nb.degree, nc.degree)

    def __call__(self, x):
        return self.nb(x) - self.nc(x)


def diff_sq(nb: Layer, nc: Layer, U: np.ndarray, keep: bool, n_samples: int, seed: int,
            n_ctx: int | None = None, position: int | None = None,
            device: Any = None) -> MonteCarloEstimate:
    """``||f_b - f_c||^2`` by guided radial importance sampling (APPROXIMATE; module
    docstring): the weighted mean of the radial average of ``|U (f_b - f_c)|^2`` over directions
    of the mixture around the modes of ``f_b``, ``f_c`` and ``f_b - f_c``, with its standard
    error and the diagnostics of a squared norm (certified lower bound under
    ``"||b - c||^2"``). Unbiased whatever the modes found (the weights are ``uniform / q``).
    ``device``: as `inner`.

    Raises:
        ValueError: ``output="each"`` (one number only).
    """
    _check_scalar(keep)
    _check_search_memory([nb, nc], n_ctx)
    check_sampling_cost([nb, nc], n_samples, _points([nb, nc], n_ctx), n_ctx)
    warn_few(n_samples)
    diff = Difference(nb, nc)
    modes = find_modes([nb, nc, diff], U, n_ctx, _search_seed(seed), position,
                       device=device)
    P, w = _radial_samples([diff], [(0, 0)], U, n_ctx, position, diff.degree, modes, n_samples,
                           _draw_seed(seed), device)
    return _mean_estimate(P, w, "||b - c||^2")
