"""Monte Carlo (DESIGN §3.4): unbiased estimates of Gaussian inner products and similarities
from samples ``x ~ N(0, I)``, with standard errors. The cross-check of the exact strategies, and
the only option where no exact method is affordable."""

from __future__ import annotations

import numbers

import numpy as np

from ..backends import converter
from ..layers import Layer

__all__ = ["MonteCarloEstimate", "MonteCarloArray", "check_mc", "moments", "similarity"]


class MonteCarloEstimate(float):
    """A Monte Carlo estimate: a float with its standard error ``stderr`` and ``n_samples``."""

    stderr: float
    n_samples: int

    def __new__(cls, value: float, stderr: float, n_samples: int):
        obj = super().__new__(cls, value)
        obj.stderr = float(stderr)
        obj.n_samples = int(n_samples)
        return obj

    def __repr__(self) -> str:
        return f"MonteCarloEstimate({float(self)!r} ± {self.stderr:.3g}, n={self.n_samples})"


class MonteCarloArray(np.ndarray):
    """A NumPy array of Monte Carlo estimates with an array ``stderr`` of the same shape."""

    def __new__(cls, values, stderr, n_samples: int):
        obj = np.asarray(values, dtype=np.float64).view(cls)
        obj.stderr = np.asarray(stderr, dtype=np.float64)
        obj.n_samples = int(n_samples)
        return obj

    def __array_finalize__(self, obj):
        if obj is not None:
            self.stderr = getattr(obj, "stderr", None)
            self.n_samples = getattr(obj, "n_samples", 0)


def _mc_features(nets: list[Layer], U: np.ndarray, n_samples: int, seed: int, backend: str,
                 device, dtype, chunk: int = 8192):
    """Yield per-chunk projected outputs ``(N, s, K)`` for x ~ N(0, I) (float64 NumPy)."""
    d = nets[0].in_features
    if backend == "torch":
        import torch

        conv = converter("torch", device, dtype)
        gen = torch.Generator(device=conv(np.zeros(1)).device).manual_seed(int(seed))
        Ut = conv(U)
        done = 0
        while done < n_samples:
            s = min(chunk, n_samples - done)
            x = torch.randn(s, d, generator=gen, device=Ut.device, dtype=Ut.dtype)
            F = torch.stack([net(x) @ Ut.T for net in nets])
            yield F.detach().to("cpu").double().numpy()
            done += s
        return
    rng = np.random.default_rng(seed)
    done = 0
    while done < n_samples:
        s = min(chunk, n_samples - done)
        x = rng.standard_normal((s, d))
        yield np.stack([np.asarray(net(x), dtype=np.float64) @ U.T for net in nets])
        done += s


def check_mc(n_samples, seed, backend) -> None:
    if backend == "exact":
        raise ValueError("method='montecarlo' samples in floating point: use backend='numpy' "
                         "or 'torch'")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 2:
        raise ValueError(f"n_samples: expected an integer >= 2, got {n_samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")


def moments(nets_a, nets_b, U, keep, n_samples, seed, backend, device, dtype):
    """Sample means and standard errors of <a_i, b_j> products (Na, Nb[, K])."""
    check_mc(n_samples, seed, backend)
    U = np.asarray(U, dtype=np.float64)
    nets = list(nets_a) + list(nets_b)
    Na = len(nets_a)
    s1 = s2 = 0.0
    for F in _mc_features(nets, U, n_samples, seed, backend, device, dtype):
        Fa, Fb = F[:Na], F[Na:]
        if keep:
            P = np.einsum("asK,bsK->sabK", Fa, Fb)
        else:
            P = np.einsum("asK,bsK->sab", Fa, Fb)
        s1 = s1 + P.sum(axis=0)
        s2 = s2 + (P * P).sum(axis=0)
    mean = s1 / n_samples
    var = np.maximum(s2 / n_samples - mean * mean, 0.0) * n_samples / (n_samples - 1)
    return mean, np.sqrt(var / n_samples)


def similarity(na: Layer, nb: Layer, U, keep, n_samples, seed, backend, device, dtype):
    """Ratio estimator ab / sqrt(aa bb) with a delta-method standard error."""
    check_mc(n_samples, seed, backend)
    U = np.asarray(U, dtype=np.float64)
    sums = None
    for F in _mc_features([na, nb], U, n_samples, seed, backend, device, dtype):
        fa, fb = F[0], F[1]
        sum_axis = None if keep else -1
        pab = (fa * fb) if keep else (fa * fb).sum(sum_axis)
        paa = (fa * fa) if keep else (fa * fa).sum(sum_axis)
        pbb = (fb * fb) if keep else (fb * fb).sum(sum_axis)
        Z = np.stack([pab, paa, pbb])  # (3, s[, K])
        part = (Z.sum(axis=1), np.einsum("is...,js...->ij...", Z, Z))
        sums = part if sums is None else (sums[0] + part[0], sums[1] + part[1])
    m = sums[0] / n_samples
    cov = (sums[1] / n_samples - np.einsum("i...,j...->ij...", m, m)) * n_samples / (n_samples - 1)
    ab, aa, bb = m
    if np.any(aa <= 0) or np.any(bb <= 0):
        raise ValueError("similarity: a sampled norm is zero (a zero network?); similarity is "
                         "undefined")
    r = ab / np.sqrt(aa * bb)
    # gradient of r = ab / sqrt(aa bb) with respect to (ab, aa, bb)
    g = np.stack([1 / np.sqrt(aa * bb), -r / (2 * aa), -r / (2 * bb)])
    var = np.einsum("i...,ij...,j...->...", g, cov, g) / n_samples
    se = np.sqrt(np.maximum(var, 0.0))
    if keep:
        return MonteCarloArray(r, se, n_samples)
    return MonteCarloEstimate(float(r), float(se), n_samples)


