"""Random multilinear networks for the core tests (shared by several test files)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from tensoralg.verify.certify import gaussian_inner_exact

import tensoralg as ta


def rand_bilinear(rng, d_in, hidden, d_out, biases=True, scale=1.0):
    g = lambda *s: scale ** (1 / 3) * rng.standard_normal(s)  # noqa: E731
    return ta.Bilinear(g(hidden, d_in), g(hidden, d_in), g(d_out, hidden),
                       g(hidden) if biases else None, g(hidden) if biases else None,
                       g(d_out) if biases else None)


def rand_linear(rng, d_in, d_out, bias=True, scale=1.0):
    return ta.Linear(scale * rng.standard_normal((d_out, d_in)),
                     scale * rng.standard_normal(d_out) if bias else None)


KINDS = ("linear", "bilinear", "bilinear_nobias", "embed_bilinear_head", "residual",
         "depth2", "depth2_residual_embed_head")


def rand_network(rng, kind, d=3, out=2, hidden=3, width=3, log_scale=(-3, 3)):
    """A random network of the given kind; inner layers get weight scales 10**U(log_scale)."""
    s = lambda: 10.0 ** rng.uniform(*log_scale)  # noqa: E731
    if kind == "linear":
        return ta.Sequential([rand_linear(rng, d, out, scale=s())])
    if kind == "bilinear":
        return ta.Sequential([rand_bilinear(rng, d, hidden, out, True, s())])
    if kind == "bilinear_nobias":
        return ta.Sequential([rand_bilinear(rng, d, hidden, out, False, s())])
    if kind == "embed_bilinear_head":
        return ta.Sequential([rand_linear(rng, d, width, False, s()),
                              rand_bilinear(rng, width, hidden, width, True, s()),
                              rand_linear(rng, width, out, True, s())])
    if kind == "residual":
        return ta.Sequential([ta.Residual(rand_bilinear(rng, d, hidden, d, True, s())),
                              rand_linear(rng, d, out, False, s())])
    if kind == "depth2":
        return ta.Sequential([rand_bilinear(rng, d, hidden, width, True, s()),
                              rand_bilinear(rng, width, hidden, out, True, s())])
    if kind == "depth2_residual_embed_head":
        return ta.Sequential([rand_linear(rng, d, width, False, s()),
                              ta.Residual(rand_bilinear(rng, width, hidden, width, True, s())),
                              ta.Residual(rand_bilinear(rng, width, hidden - 1, width, False, s())),
                              rand_linear(rng, width, out, True, s())])
    raise ValueError(kind)


def brute_inner(a, b) -> Fraction:
    """Independent exact <a, b>: polynomial expansion in rationals (tensoralg.verify.certify)."""
    return gaussian_inner_exact(a, b)


def to_fractions(net):
    """The same network with its float weights as exact Fractions."""
    return _map(net, lambda arr: np.vectorize(Fraction, otypes=[object])(arr))


def _map(layer, fn):
    return ta.layers.map_arrays(layer, fn)
