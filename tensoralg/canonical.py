"""Canonical lifted form of a multilinear network.

Every network of :mod:`tensoralg.layers` is rewritten, exactly, as maps between *lifted* spaces
(``x~ = (1, x)``, constant at index 0, DESIGN §2):

* a linear layer becomes ``W~ = [[1, 0], [b, W]]`` of shape ``(out+1, in+1)``;
* a bilinear layer becomes ``(L~, R~, D~)`` with ``L~, R~ : (H+1, in+1)`` and ``D~ : (out+1, H+1)``;
  hidden unit 0 is the constant unit (``L~_0 = R~_0 = e0``) that carries the constant and the
  output bias;
* a residual block ``x + inner(x)`` widens every stage of ``inner`` with units that carry ``x``
  along (``x_i = (e_i . x~)(e0 . x~)`` through a bilinear stage) and adds it at the end;
* consecutive linear maps are folded into the neighbouring bilinear factors, except a leading
  *embedding* that narrows the input (``m < d``): it is kept apart as ``embed`` so that the
  legs of the tensor network stay at the model width ``m + 1`` (the Wick strategy bridges two
  legs through the embedding Gram ``E_a E_b^T``; the chaos strategy whitens the joint input
  covariance, DESIGN §3.6).

The result is a :class:`Canonical`: an optional lifted ``embed`` followed by ``stages`` (lifted
bilinear stages, applied in order) or, for a network of degree 1, a single lifted matrix
``linear``. As a tensor network it is a full binary tree with ``2**len(stages)`` input legs
(DESIGN §2), each leg a copy of the lifted (embedded) input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np

from .layers import Bilinear, Layer, Linear, Residual, Sequential

__all__ = ["Stage", "Canonical", "canonicalize", "stack"]


@dataclass
class Stage:
    """Lifted bilinear stage ``x~_out = D ((L x~_in) * (R x~_in))``; arrays may carry a leading
    batch axis (a stack of models)."""

    L: np.ndarray
    R: np.ndarray
    D: np.ndarray


@dataclass
class Canonical:
    """Canonical lifted form; ``stages`` empty means degree 1, given by ``linear``.

    ``embed`` (optional, only with stages): the lifted leading linear map ``(m+1, d+1)`` (or
    ``(N, m+1, d+1)`` for a stack), applied before the first stage, whose factors then have
    ``m + 1`` columns."""

    d: int
    out: int
    stages: list[Stage] = field(default_factory=list)
    linear: np.ndarray | None = None
    exact: bool = False
    embed: np.ndarray | None = None
    #: Results derived from this exact object (e.g. chaos coefficients per output projection),
    #: set only on the read-only stacks of :mod:`tensoralg.prepare`'s cache; ``replace``,
    #: ``map``, ``sub`` and ``folded`` start without one.
    memo: dict | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def leg_width(self) -> int:
        """Size of one input leg: ``m + 1`` behind a kept embedding, else ``d + 1``."""
        return self.d + 1 if self.embed is None else self.embed.shape[-2]

    def folded(self) -> "Canonical":
        """The same network with its embedding folded into the first stage's factors."""
        if self.embed is None:
            return self
        s0 = self.stages[0]
        E = self.embed
        mm = (lambda x, y: np.matmul(x, y)) if not self.exact else (
            lambda x, y: np.einsum("...ij,...jk->...ik", x, y))
        first = Stage(mm(s0.L, E), mm(s0.R, E), s0.D)
        return replace(self, stages=[first] + list(self.stages[1:]), embed=None)

    def map(self, fn) -> "Canonical":
        """A copy with ``fn`` applied to every array."""
        f = lambda a: None if a is None else fn(a)  # noqa: E731
        return replace(self, stages=[Stage(fn(s.L), fn(s.R), fn(s.D)) for s in self.stages],
                       linear=f(self.linear), embed=f(self.embed))

    def sub(self, idx) -> "Canonical":
        """Models ``idx`` of a stack (leading batch axis)."""
        return self.map(lambda a: a[idx])

    @property
    def depth(self) -> int:
        return len(self.stages)

    @property
    def n_legs(self) -> int:
        return 2 ** self.depth

    def arrays(self) -> list[np.ndarray]:
        if not self.stages:
            return [self.linear]
        head = [] if self.embed is None else [self.embed]
        return head + [a for s in self.stages for a in (s.L, s.R, s.D)]

    def shapes(self) -> tuple:
        return tuple(a.shape for a in self.arrays())


def _zeros(shape, exact: bool) -> np.ndarray:
    if exact:
        out = np.empty(shape, dtype=object)
        out.fill(Fraction(0))
        return out
    return np.zeros(shape)


def _one(exact: bool):
    return Fraction(1) if exact else 1.0


def _lift_linear(layer: Linear, exact: bool) -> np.ndarray:
    out, inp = layer.weight.shape
    W = _zeros((out + 1, inp + 1), exact)
    W[0, 0] = _one(exact)
    W[1:, 1:] = layer.weight
    if layer.bias is not None:
        W[1:, 0] = layer.bias
    return W


def _lift_bilinear(layer: Bilinear, exact: bool) -> Stage:
    H, inp = layer.left.shape
    out = layer.down.shape[0]
    L = _zeros((H + 1, inp + 1), exact)
    R = _zeros((H + 1, inp + 1), exact)
    D = _zeros((out + 1, H + 1), exact)
    L[0, 0] = R[0, 0] = D[0, 0] = _one(exact)
    L[1:, 1:] = layer.left
    R[1:, 1:] = layer.right
    D[1:, 1:] = layer.down
    if layer.left_bias is not None:
        L[1:, 0] = layer.left_bias
    if layer.right_bias is not None:
        R[1:, 0] = layer.right_bias
    if layer.down_bias is not None:
        D[1:, 0] = layer.down_bias
    return Stage(L, R, D)


def _ops(layer: Layer, exact: bool) -> list:
    """The layer as a list of lifted ops: np.ndarray (linear) or Stage (bilinear)."""
    if isinstance(layer, Linear):
        return [_lift_linear(layer, exact)]
    if isinstance(layer, Bilinear):
        return [_lift_bilinear(layer, exact)]
    if isinstance(layer, Sequential):
        return [op for sub in layer.layers for op in _ops(sub, exact)]
    if isinstance(layer, Residual):
        return _residual(_ops(layer.inner, exact), layer.in_features, exact)
    raise TypeError(f"unknown layer type {type(layer).__name__}; expected Linear, Bilinear, "
                    f"Residual or Sequential")


def _residual(ops: list, d: int, exact: bool) -> list:
    """Exact rewrite of ``x + f(x)`` where ``f`` is the chain ``ops`` (``d -> d``).

    Every intermediate lifted space ``(1, y)`` becomes ``(1, y, x)``: linear ops carry ``x`` by an
    identity block, bilinear ops by ``d`` extra hidden units ``x_i * 1``. The last op adds ``x`` to
    its output instead of carrying it.
    """
    one = _one(exact)
    new = []
    n_ops = len(ops)
    for idx, op in enumerate(ops):
        first, last = idx == 0, idx == n_ops - 1
        # columns of x inside this op's input space
        if isinstance(op, np.ndarray):
            m1, n1 = op.shape
        else:
            m1, n1 = op.D.shape[0], op.L.shape[1]
        n_in = n1 if first else n1 + d
        x_cols = list(range(1, d + 1)) if first else list(range(n1, n1 + d))
        m_out = m1 if last else m1 + d
        x_rows = list(range(1, d + 1)) if last else list(range(m1, m1 + d))
        if isinstance(op, np.ndarray):
            W = _zeros((m_out, n_in), exact)
            W[:m1, :n1] = op
            for r, c in zip(x_rows, x_cols):
                W[r, c] = W[r, c] + one
            new.append(W)
        else:
            H1 = op.L.shape[0]
            L = _zeros((H1 + d, n_in), exact)
            R = _zeros((H1 + d, n_in), exact)
            D = _zeros((m_out, H1 + d), exact)
            L[:H1, :n1] = op.L
            R[:H1, :n1] = op.R
            D[:m1, :H1] = op.D
            for i, (r, c) in enumerate(zip(x_rows, x_cols)):
                L[H1 + i, c] = one
                R[H1 + i, 0] = one
                D[r, H1 + i] = D[r, H1 + i] + one
            new.append(Stage(L, R, D))
    return new


def canonicalize(net: Layer, keep_embed: bool = True) -> Canonical:
    """Exact canonical lifted form of ``net`` (float64 arrays, or Fractions if ``net.is_exact``).

    ``keep_embed``: keep a leading linear map that narrows the input (``m < d``) apart as
    ``embed`` instead of folding it into the first stage's factors."""
    exact = net.is_exact
    ops = _ops(net, exact)
    stages: list[Stage] = []
    embed = None
    pending: np.ndarray | None = None  # product of linear maps not yet folded
    for op in ops:
        if isinstance(op, np.ndarray):
            pending = op if pending is None else op @ pending
        else:
            if pending is not None:
                if not stages and keep_embed and pending.shape[0] < pending.shape[1]:
                    embed = pending
                else:
                    op = Stage(op.L @ pending, op.R @ pending, op.D)
                pending = None
            stages.append(op)
    if stages and pending is not None:
        last = stages[-1]
        stages[-1] = Stage(last.L, last.R, pending @ last.D)
        pending = None
    if exact:
        for s in stages:
            for a in (s.L, s.R, s.D):
                a[...] = np.vectorize(Fraction, otypes=[object])(a)
        if pending is not None:
            pending = np.vectorize(Fraction, otypes=[object])(pending)
        if embed is not None:
            embed = np.vectorize(Fraction, otypes=[object])(embed)
    return Canonical(d=net.in_features, out=net.out_features, stages=stages, linear=pending,
                     exact=exact, embed=embed)


def stack(cans: list[Canonical], name: str = "models") -> Canonical:
    """Stack canonical forms of same-architecture models on a leading batch axis.

    Raises:
        ValueError: models whose canonical shapes differ (name the first mismatch).
    """
    ref = cans[0]
    if any((c.embed is None) != (ref.embed is None) for c in cans):
        cans = [c.folded() for c in cans]
        ref = cans[0]
    for i, c in enumerate(cans[1:], start=1):
        if c.depth != ref.depth or c.shapes() != ref.shapes():
            raise ValueError(f"{name}[{i}]: architecture differs from {name}[0] (canonical "
                             f"shapes {c.shapes()} vs {ref.shapes()}); a batched Gram matrix "
                             f"needs same-architecture models")
    exact = all(c.exact for c in cans)

    def st(arrs):
        if exact:
            return np.stack(arrs).astype(object)
        if len(arrs) == 1:  # one model: a view (canonical forms own their arrays)
            return np.asarray(arrs[0], dtype=np.float64)[None]
        return np.stack([np.asarray(a, dtype=np.float64) for a in arrs])

    if not ref.stages:
        return Canonical(ref.d, ref.out, [], st([c.linear for c in cans]), exact)
    stages = [Stage(st([c.stages[k].L for c in cans]), st([c.stages[k].R for c in cans]),
                    st([c.stages[k].D for c in cans])) for k in range(ref.depth)]
    embed = None if ref.embed is None else st([c.embed for c in cans])
    return Canonical(ref.d, ref.out, stages, None, exact, embed)
