"""Brute-force exact Gaussian inner products of small sequence models (bilinear attention).

A sequence model maps ``X`` (``n_ctx`` positions of ``d`` features) to ``n_ctx x d_out``
outputs. Here every output ``f[t][o]`` is expanded into an explicit polynomial in the
``n_ctx * d`` variables ``X[s, i]`` (variable index ``s * d + i``) with rational
coefficients, straight from the definition of each layer (docs/mathematics.md §3.7):

* Linear / Bilinear act on each position separately; Residual adds its input;
* BilinearAttention, per head ``h``:
  ``pattern[t, s] = mask[t, s] * scale * (q1_t . k1_s)(q2_t . k2_s)``,
  ``out_t = sum_h o_h sum_s pattern[t, s] v_s + o_bias``, with
  ``q*_t = R_t (q* x_t + bias)`` (``R_t`` the layer's RoPE rotation, identity without RoPE).

Then ``<a, b> = sum_t sum_o E[f_a[t][o] f_b[t][o]]`` under ``X[s, i] ~ N(0, 1)`` iid, monomial
by monomial (``E[x^alpha] = prod (alpha_i - 1)!!``, `tensoralg.verify._poly`). The constant 1 is the
same at every position simply because it is the number 1 of the polynomial ring.

Independent of tensoralg's attention code: it reads only the layers' weights, masks and RoPE
rotations (``BilinearAttention.mask_matrix`` / ``rotations``: the layer's definition, float64
rotations taken exactly as ``Fraction(float)``); it never forms Wick matchings or Gram matrices.
Sizes: meant for ``n_ctx <= 3``, ``d <= 3`` (a degree-10 product in up to 9 variables).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np

from ._poly import (
    Budget,
    ExpansionTooLarge,
    Poly,
    add_scaled,
    gaussian_inner,
    linear_combination,
    mul,
    variable,
)
from .certify import DEFAULT_MAX_WORK, _frac, _fracs, _network

__all__ = ["expand_sequence", "sequence_inner_exact"]

Seq = list[list[Poly]]  # [position][feature] -> polynomial


def _combine(W, b, polys, nvar, budget):
    outs = []
    for o, row in enumerate(W):
        terms = [(w, polys[i]) for i, w in enumerate(row) if w]
        budget.charge(sum(len(p) for _, p in terms) + 1)
        outs.append(linear_combination(terms, b[o] if b is not None else 0, nvar))
    return outs


def _attention(layer, X: Seq, nvar: int, budget: Budget) -> Seq:
    n_ctx = len(X)
    mask = np.vectorize(_frac, otypes=[object])(np.asarray(layer.mask_matrix(n_ctx), dtype=object))
    scale = _frac(layer.scale)
    R = layer.rotations(n_ctx)
    R = None if R is None else np.vectorize(_frac, otypes=[object])(R.astype(object)).tolist()
    H = layer.n_heads

    def head_vectors(name, h):
        W = _fracs(getattr(layer, name))[h]
        b = getattr(layer, name + "_bias")
        b = None if b is None else _fracs(b)[h]
        per_pos = [_combine(W, b, X[t], nvar, budget) for t in range(n_ctx)]
        if R is not None and name != "v":
            per_pos = [_combine(R[t], None, per_pos[t], nvar, budget) for t in range(n_ctx)]
        return per_pos

    O = _fracs(layer.o)
    ob = None if layer.o_bias is None else _fracs(layer.o_bias)
    out: Seq = [[{} for _ in range(layer.out_features)] for _ in range(n_ctx)]
    for h in range(H):
        q1, k1 = head_vectors("q1", h), head_vectors("k1", h)
        q2, k2 = head_vectors("q2", h), head_vectors("k2", h)
        v = head_vectors("v", h)
        for t in range(n_ctx):
            # z_t = sum_s pattern[t, s] v_s  (a vector of d_v polynomials)
            z = [{} for _ in range(layer.d_v)]
            for s in range(n_ctx):
                c = mask[t][s] * scale
                if not c:
                    continue
                s1: Poly = {}
                for e in range(layer.d_head):
                    add_scaled(s1, mul(q1[t][e], k1[s][e], budget), Fraction(1))
                s2: Poly = {}
                for e in range(layer.d_head):
                    add_scaled(s2, mul(q2[t][e], k2[s][e], budget), Fraction(1))
                pat = mul(s1, s2, budget)
                for j in range(layer.d_v):
                    add_scaled(z[j], mul(pat, v[s][j], budget), c)
            for o in range(layer.out_features):
                for j in range(layer.d_v):
                    add_scaled(out[t][o], z[j], O[o][h][j])
    if ob is not None:
        for t in range(n_ctx):
            for o in range(layer.out_features):
                add_scaled(out[t][o], {(0,) * nvar: Fraction(1)}, ob[o])
    return out


def _expand(layer, X: Seq, nvar: int, budget: Budget) -> Seq:
    from tensoralg.layers import Bilinear, BilinearAttention, Linear, Residual, Sequential

    if isinstance(layer, Sequential):
        for sub in layer.layers:
            X = _expand(sub, X, nvar, budget)
        return X
    if isinstance(layer, Linear):
        W, b = _fracs(layer.weight), _fracs(layer.bias)
        return [_combine(W, b, x, nvar, budget) for x in X]
    if isinstance(layer, Bilinear):
        out = []
        for x in X:
            left = _combine(_fracs(layer.left), _fracs(layer.left_bias), x, nvar, budget)
            right = _combine(_fracs(layer.right), _fracs(layer.right_bias), x, nvar, budget)
            hidden = [mul(lp, rp, budget) for lp, rp in zip(left, right)]
            out.append(_combine(_fracs(layer.down), _fracs(layer.down_bias), hidden, nvar, budget))
        return out
    if isinstance(layer, Residual):
        inner = _expand(layer.inner, X, nvar, budget)
        return [[linear_combination([(1, p), (1, q)]) for p, q in zip(xs, ys)]
                for xs, ys in zip(X, inner)]
    if isinstance(layer, BilinearAttention):
        return _attention(layer, X, nvar, budget)
    raise TypeError(f"cannot expand a layer of type {type(layer).__name__}")


def expand_sequence(net: Any, n_ctx: int, *, max_work: int = DEFAULT_MAX_WORK,
                    name: str = "net") -> Seq:
    """Expand a sequence model into exact polynomials ``out[t][o]`` in the ``n_ctx * d``
    variables ``X[s, i]`` (index ``s * d + i``).

    Raises:
        ExpansionTooLarge: more than ``n_ctx * d = 12`` variables (refused up front) or over
            ``max_work`` coefficient products.
        TypeError: not a network.
    """
    net = _network(net, name)
    d = net.in_features
    nvar = n_ctx * d
    if nvar > 12:
        raise ExpansionTooLarge(f"{name}: n_ctx * d = {n_ctx} * {d} = {nvar} variables; the "
                                f"brute-force sequence expansion is meant for at most 12")
    if net.n_ctx is not None and net.n_ctx != n_ctx:
        raise ValueError(f"{name}: n_ctx={n_ctx} differs from its attention mask (n_ctx={net.n_ctx})")
    X = [[variable(s * d + i, nvar) for i in range(d)] for s in range(n_ctx)]
    return _expand(net, X, nvar, Budget(max_work, f"{name}: sequence expansion"))


def sequence_inner_exact(a: Any, b: Any, n_ctx: int, *, output: Any = None, position: Any = None,
                         max_work: int = DEFAULT_MAX_WORK):
    """``sum_t sum_o E[f_a[t][o] f_b[t][o]]`` exactly (a ``Fraction``), ``X[s, i] ~ N(0, 1)`` iid.

    Args:
        output: None (sum over outputs), an int ``o`` or a vector ``u`` (``u . f``, floats taken
            exactly).
        position: None (sum over positions) or an int ``t``.

    Raises:
        ValueError: different input or output sizes; ExpansionTooLarge over the limits.
    """
    a, b = _network(a, "a"), _network(b, "b")
    if a.in_features != b.in_features or a.out_features != b.out_features:
        raise ValueError(f"a and b must have the same input and output sizes: a is "
                         f"{a.in_features} -> {a.out_features}, b is {b.in_features} -> "
                         f"{b.out_features}")
    pa = expand_sequence(a, n_ctx, max_work=max_work, name="a")
    pb = pa if b is a else expand_sequence(b, n_ctx, max_work=max_work, name="b")
    positions = range(n_ctx) if position is None else [int(position)]
    budget = Budget(max_work, "inner product")
    total = Fraction(0)
    for t in positions:
        fa, fb = pa[t], pb[t]
        if output is not None:
            if isinstance(output, (int, np.integer)):
                fa, fb = [fa[int(output)]], [fb[int(output)]]
            else:
                u = [_frac(x) for x in np.asarray(output, dtype=object).reshape(-1)]
                pu: Poly = {}
                qu: Poly = {}
                for w, p, q in zip(u, fa, fb):
                    add_scaled(pu, p, w)
                    add_scaled(qu, q, w)
                fa, fb = [pu], [qu]
        total += sum((gaussian_inner(p, q, budget) for p, q in zip(fa, fb)), Fraction(0))
    return total
