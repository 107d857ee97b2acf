"""Symbolic (sympy) check of the first-order path expansion of a transformer.

A residual stack ``h_l = h_{l-1} + B_l(h_{l-1})`` of bilinear attention blocks
``B = sum_h A_h + c`` (heads ``A_h``, output bias ``c``) and bilinear MLP blocks, between an
embedding and an unembedding ``U``, is expanded here with one *gain* symbol per head, per
attention output bias and per MLP: every block writes ``sum_g lambda_g B_g(h_{l-1})``. The model
is ``f = F(lambda = 1)`` of the polynomial ``F(X, lambda)``, and grouping ``F``'s terms by their
monomial in the gains gives the path expansion (docs/mathematics.md §3.10):

* ``lambda``-degree 0: the direct path ``U X`` (biases of the embedding and unembedding with it);
* ``lambda_g`` alone, to the first power: the first-order path of ``g`` (``U_lin A_g(X)``: its
  block reads the embedded input on every leg, since every other gain is zero), named as
  `tensoralg.decompose.paths` names it (``"L{l}.H{h}"``, ``"L{l}.MLP"``, ``"L{l}.bias"``);
* everything else (a product of two or more gains: a leg of a later block reading an earlier
  block's output): the remainder.

Terms with two or more gain factors are dropped as they arise (they form an ideal, so the terms
kept are exact); the remainder is the model's polynomial minus the kept ones. The polynomials are
exact: rational coefficients
(``Fraction(float)`` for float weights) in sympy's sparse polynomial ring over ``QQ``, one
variable per input entry ``X[t, i]`` and one per gain. The forward pass is written here from the
layers' definition (docs/mathematics.md §3.7: weights, biases, mask, scale and the position maps
``rotations`` of each attention layer); nothing calls tensoralg's forward pass, inner products or
path code except `tensoralg.decompose.paths` itself, whose networks and first-order sum are
then expanded by the same forward pass and compared term by term.

[`check_sequence_paths`][verify.paths.check_sequence_paths] checks a given model;
[`prove_sequence_paths`][verify.paths.prove_sequence_paths] builds a tiny two-layer model
with random rational weights (biases everywhere, a per-position map on one layer's queries and
keys, a bilinear MLP) and checks it.
"""

from __future__ import annotations

import time
from fractions import Fraction
from typing import Any

import numpy as np

from .certify import _frac, _network
from .symbolic import ProofResult

__all__ = ["check_sequence_paths", "prove_sequence_paths", "tiny_transformer"]


def _q(v: Any):
    from sympy import QQ

    f = _frac(v)
    return QQ(f.numerator, f.denominator)


def _qs(a: Any) -> list | None:
    if a is None:
        return None
    return np.vectorize(_q, otypes=[object])(np.asarray(a, dtype=object)).tolist()


class _Ring:
    """The polynomial ring and its product; with ``gains`` (the number of input variables
    first), terms with two or more gain factors are dropped as they arise: they generate an
    ideal (closed under products with anything), so what is kept is exact."""

    def __init__(self, zero, n_inputs: int | None = None):
        self.zero, self.n_inputs = zero, n_inputs

    def mul(self, a, b):
        p = a * b
        if self.n_inputs is None:
            return p
        k = self.n_inputs
        return p.ring({m: c for m, c in p.items() if sum(m[k:]) <= 1})


def _linear(W, b, x, zero):
    """``W x + b`` for one position (lists of ring elements)."""
    out = []
    for o, row in enumerate(W):
        acc = zero + (b[o] if b is not None else 0)
        for w, xi in zip(row, x):
            if w:
                acc += xi * w
        out.append(acc)
    return out


def _forward(layer, X: list, R: _Ring, gains=None) -> list:
    """``layer`` applied to ``X`` (``[position][feature]`` ring elements), from the layers'
    definition. ``gains``: ``{(block, part): ring element}`` multiplying what a residual block
    writes (``part`` ``("H", h)``, ``("bias",)`` or ``("MLP",)``); the block counter lives in
    ``gains["_block"]``."""
    from tensoralg.layers import Bilinear, BilinearAttention, Linear, Residual, Sequential

    if isinstance(layer, Sequential):
        for sub in layer.layers:
            X = _forward(sub, X, R, gains)
        return X
    if isinstance(layer, Linear):
        W, b = _qs(layer.weight), _qs(layer.bias)
        return [_linear(W, b, x, R.zero) for x in X]
    if isinstance(layer, Residual):
        block = None
        if gains is not None:
            block = gains["_block"]
            gains["_block"] += 1
        inner = _core(layer.inner, X, R, gains, block)
        return [[p + q for p, q in zip(xs, ys)] for xs, ys in zip(X, inner)]
    if isinstance(layer, (Bilinear, BilinearAttention)):
        return _core(layer, X, R, None, None)
    raise TypeError(f"cannot expand a layer of type {type(layer).__name__}")


def _gain(gains, block, part, zero):
    one = zero + 1
    return one if gains is None else gains.get((block, part), one)


def _core(layer, X, R: _Ring, gains, block):
    from tensoralg.layers import Bilinear, BilinearAttention

    zero = R.zero
    if isinstance(layer, Bilinear):
        g = _gain(gains, block, ("MLP",), zero)
        out = []
        for x in X:
            left = _linear(_qs(layer.left), _qs(layer.left_bias), x, zero)
            right = _linear(_qs(layer.right), _qs(layer.right_bias), x, zero)
            hidden = [R.mul(lp, rp) for lp, rp in zip(left, right)]
            out.append([R.mul(g, y) for y in _linear(_qs(layer.down), _qs(layer.down_bias),
                                                      hidden, zero)])
        return out
    if isinstance(layer, BilinearAttention):
        return _attention(layer, X, R, gains, block)
    if gains is not None:
        raise ValueError(f"verify.paths: a residual block must hold one BilinearAttention or "
                         f"Bilinear layer (Linear layers outside the blocks), got "
                         f"{type(layer).__name__}")
    return _forward(layer, X, R, None)


def _attention(layer, X, R_: _Ring, gains, block):
    n_ctx, zero, mul = len(X), R_.zero, R_.mul
    mask = _qs(layer.mask_matrix(n_ctx))
    scale = _q(layer.scale)
    R = layer.rotations(n_ctx)
    R = None if R is None else _qs(R)
    O, ob = _qs(layer.o), _qs(layer.o_bias)
    out = [[zero for _ in range(layer.out_features)] for _ in range(n_ctx)]
    for h in range(layer.n_heads):
        def vecs(name, h=h):
            W = _qs(getattr(layer, name))[h]
            b = getattr(layer, name + "_bias")
            b = None if b is None else _qs(b)[h]
            per = [_linear(W, b, X[t], zero) for t in range(n_ctx)]
            if R is not None and name != "v":
                per = [_linear(R[t], None, per[t], zero) for t in range(n_ctx)]
            return per

        q1, k1, q2, k2, v = (vecs(n) for n in ("q1", "k1", "q2", "k2", "v"))
        g = _gain(gains, block, ("H", h), zero)
        for t in range(n_ctx):
            z = [zero for _ in range(layer.d_v)]
            for s in range(n_ctx):
                c = mask[t][s] * scale
                if not c:
                    continue
                s1 = sum((mul(a, b) for a, b in zip(q1[t], k1[s])), zero)
                s2 = sum((mul(a, b) for a, b in zip(q2[t], k2[s])), zero)
                pat = mul(s1, s2) * c
                z = [zj + mul(pat, vj) for zj, vj in zip(z, v[s])]
            for o in range(layer.out_features):
                out[t][o] += mul(g, sum((z[j] * O[o][h][j] for j in range(layer.d_v)), zero))
    if ob is not None:
        g = _gain(gains, block, ("bias",), zero)
        for t in range(n_ctx):
            for o in range(layer.out_features):
                out[t][o] += g * ob[o]   # a gain times a constant: degree 1
    return out


def _blocks(net) -> list:
    """``[(kind, core)]`` of the residual blocks of ``[Linear...] Residual... [Linear...]``."""
    from tensoralg.canonical import flatten_layers
    from tensoralg.layers import Bilinear, BilinearAttention, Linear, Residual

    out = []
    for k, layer in enumerate(flatten_layers(net)):
        if isinstance(layer, Linear):
            continue
        inner = getattr(layer, "inner", None)
        if not isinstance(layer, Residual) or not isinstance(inner, (Bilinear,
                                                                     BilinearAttention)):
            raise ValueError(f"verify.paths: layer {k} is {type(layer).__name__}; expected "
                             f"[Linear...] Residual(BilinearAttention or Bilinear)... "
                             f"[Linear...]")
        out.append(("attention" if isinstance(inner, BilinearAttention) else "mlp", inner))
    return out


def _path_names(blocks) -> dict:
    """``{(block, part): name}`` in `tensoralg.decompose.paths`' naming: an attention block
    opens a layer, an MLP block joins the attention block just before it (else opens one)."""
    names, layer, prev = {}, -1, None
    for b, (kind, core) in enumerate(blocks):
        if kind == "attention" or prev != "attention":
            layer += 1
        if kind == "attention":
            for h in range(core.n_heads):
                names[(b, ("H", h))] = f"L{layer}.H{h}"
            if core.o_bias is not None:
                names[(b, ("bias",))] = f"L{layer}.bias"
        else:
            names[(b, ("MLP",))] = f"L{layer}.MLP"
        prev = kind
    return names


def check_sequence_paths(model: Any, decomposition: Any, n_ctx: int = 2) -> ProofResult:
    """Check ``decomposition`` = ``tensoralg.decompose.paths(model, n_ctx=n_ctx, order=1)``
    (computed by the caller: verify never imports the code it checks) against the gain
    expansion of the module docstring, exactly: each listed path network's polynomial equals
    the coefficient of its gain, ``rest = model - first_order`` equals the sum of the terms with
    two or more gains, and the listed paths plus that remainder equal the model's polynomial.

    Args:
        model: ``[Linear...] Residual(BilinearAttention or Bilinear)... [Linear...]``; meant
            for ``n_ctx * d <= 4`` and two or three blocks (the polynomial has degree up to
            ``5^attention blocks * 2^MLP blocks``).
        n_ctx: the sequence length.

    Returns:
        a [`ProofResult`][verify.symbolic.ProofResult] (``checked``: polynomial identities
        verified; ``detail``: the first failure).

    Raises:
        ValueError: a model of another shape (one line).
    """
    from sympy import QQ, ring

    t0 = time.perf_counter()
    net = _network(model, "model")
    blocks = _blocks(net)
    names = _path_names(blocks)
    d = net.in_features
    gain_keys = list(names)
    xs = [f"x{t}_{i}" for t in range(n_ctx) for i in range(d)]
    gs = [f"g{k}" for k in range(len(gain_keys))]
    Rg, *gens = ring(",".join(xs + gs), QQ)
    nx = len(xs)
    plain, gained = _Ring(Rg.zero), _Ring(Rg.zero, nx)
    X = [[gens[t * d + i] for i in range(d)] for t in range(n_ctx)]
    gains = {key: gens[nx + k] for k, key in enumerate(gain_keys)}
    gains["_block"] = 0
    F = _forward(net, X, gained, gains)       # the terms with at most one gain factor

    def zeros():
        return [[Rg.zero for _ in row] for row in F]

    direct, paths = zeros(), {k: zeros() for k in range(len(gain_keys))}
    for t, row in enumerate(F):
        for o, p in enumerate(row):
            for monom, coeff in p.items():
                term = Rg({tuple(monom[:nx]) + (0,) * len(gs): coeff})
                nz = [k for k, e in enumerate(monom[nx:]) if e]
                if not nz:
                    direct[t][o] += term
                else:
                    paths[nz[0]][t][o] += term
    want = {"direct": direct}
    want.update({names[key]: paths[k] for k, key in enumerate(gain_keys)})

    def add(a, b, sign=1):
        return [[p + sign * q for p, q in zip(r1, r2)] for r1, r2 in zip(a, b)]

    f1 = _forward(net, X, plain)              # the model's polynomial (every gain 1)
    rest = f1
    for part in want.values():
        rest = add(rest, part, -1)            # the terms with two or more gains

    fails, checked = [], 0
    pd = decomposition
    if sorted(pd.names) != sorted(want):
        fails.append(f"path names {sorted(pd.names)} differ from the expansion's {sorted(want)}")
    listed = zeros()
    for name, path_net in zip(pd.names, pd.networks):
        got = _forward(path_net, X, plain)
        if name in want:
            checked += 1
            if got != want[name]:
                fails.append(f"path {name!r} differs from the coefficient of its gain")
        listed = add(listed, got)
    first = _forward(pd.first_order, X, plain)
    checked += 3
    if add(f1, first, -1) != rest:
        fails.append("rest = model - first_order differs from the terms with two or more gains")
    if add(listed, rest) != f1:
        fails.append("the listed paths plus the remainder differ from the model's polynomial")
    if first != listed:
        fails.append("first_order differs from the sum of the listed path networks")
    if len(blocks) > 1 and all(p == 0 for row in rest for p in row):
        fails.append("the remainder is zero: the model has no composition to test")
    sizes = {"n_ctx": n_ctx, "d": d, "blocks": len(blocks), "paths": len(pd.names)}
    detail = fails[0] if fails else (f"{len(pd.names)} paths and the remainder equal the "
                                     f"gain expansion exactly")
    return ProofResult("sequence_paths_order1", sizes, not fails, time.perf_counter() - t0,
                       checked, detail)


def tiny_transformer(seed: int = 2):
    """A tiny two-layer bilinear-attention model with exact rational weights (halves in
    ``[-3/2, 3/2]``; with the default seed no path is zero): a 1 -> 2 embedding with bias,
    attention with two heads of size 1 and every bias, attention with one head of size 2 and a
    rational per-position map on its queries and keys, a bilinear MLP, a 2 -> 1 unembedding
    with bias."""
    from tensoralg.layers import Bilinear, BilinearAttention, Linear, Residual, Sequential

    rng = np.random.default_rng(seed)

    def q(*shape):
        return np.vectorize(lambda v: Fraction(int(v), 2), otypes=[object])(
            rng.integers(-3, 4, shape))

    def attn(H, dh, **kw):
        return BilinearAttention(q(H, dh, 2), q(H, dh, 2), q(H, dh, 2), q(H, dh, 2),
                                    q(H, 1, 2), q(2, H, 1), q1_bias=q(H, dh), k1_bias=q(H, dh),
                                    q2_bias=q(H, dh), k2_bias=q(H, dh), v_bias=q(H, 1),
                                    o_bias=q(2), **kw)

    return Sequential([
        Linear(q(2, 1), q(2)),
        Residual(attn(2, 1)),
        Residual(attn(1, 2, position_maps=q(2, 2, 2))),
        Residual(Bilinear(q(1, 2), q(1, 2), q(2, 1), q(1), q(1), q(2))),
        Linear(q(1, 2), q(1)),
    ])


def prove_sequence_paths(decompose_paths: Any, seed: int = 2) -> ProofResult:
    """[`check_sequence_paths`][verify.paths.check_sequence_paths] of ``decompose_paths``
    (``tensoralg.decompose.paths``, passed in by the caller) on
    [`tiny_transformer`][verify.paths.tiny_transformer] at ``n_ctx = 2``."""
    net = tiny_transformer(seed)
    return check_sequence_paths(net, decompose_paths(net, n_ctx=2, order=1), n_ctx=2)
