"""Decompositions of multilinear networks: exact checks, eigen-components, residual paths, diffs.

Mathematics: ``DESIGN.md`` §3.8 (decompositions) and §3.6 (Gaussian chaos).

* :func:`check_decomposition` — is ``f = sum_i g_i``? The exact residual ``||f - sum g_i||^2``
  (Gaussian and Frobenius metrics), the Gram matrix of ``(f, g_1, ...)``, each component's share
  of ``||f||^2`` and the interference terms; with ``backend="exact"`` a rational certificate.
* :func:`eigen` — for depth-1 networks (embedding, one bilinear layer, head, biases, residual):
  the chaos coefficients ``(C0, C1, C2)`` of one output (or direction ``u . f``) and the
  eigendecomposition ``C2 = sum_i lambda_i v_i v_i^T``: ``f = C0 + C1.x + sum_i lambda_i He2(v_i.x)``
  with mutually orthogonal components of norm^2 ``2 lambda_i^2``, so keeping ``k`` of them costs
  exactly ``2 sum_dropped lambda_i^2``. The eigenvectors live in input space (through the
  embedding).
* :func:`paths` — a residual network ``head o (1 + B_n) o ... o (1 + B_1) o embed`` as a sum of
  ``2^n`` path networks, one per subset of blocks a signal passes through; their Gram matrix is
  the exact attribution.
* :func:`combine` / :func:`difference` — ``sum_i c_i f_i`` (e.g. a checkpoint minus another) as
  one network (hidden units side by side, coefficients on the output), so that its eigenvectors
  localize a change in input space.

Inner products go through the public API (:func:`tensoralg.cross_gram`, :func:`tensoralg.inner`);
the one piece of mathematics of its own is :func:`chaos_coefficients_depth1`, which reads the
degree-2 polynomial ``c + b.x + x^T A x`` straight off the lifted weights (never by sampling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import combinations
from typing import Any, Sequence

import numpy as np

from ..layers import Bilinear, Layer, Linear, Residual, Sequential, as_network

__all__ = ["check_decomposition", "DecompositionCheck", "chaos_coefficients_depth1",
           "ChaosCoefficients", "eigen", "EigenDecomposition", "combine", "difference",
           "paths", "PathDecomposition", "path_similarity", "bilinear_depth"]

_DEPTH_HINT = ("eigen-components need a depth-1 network (at most one bilinear layer on any "
               "path: degree <= 2); for a deeper network check a decomposition of your own "
               "with tensoralg.decompose.check_decomposition(model, components), or expand a "
               "residual network with tensoralg.decompose.paths(model)")


# ----------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------

def bilinear_depth(net: Layer) -> int:
    """Number of bilinear layers a signal passes through (``log2`` of the degree bound)."""
    return int(net.degree).bit_length() - 1


def _zeros(shape, exact: bool) -> np.ndarray:
    if exact:
        out = np.empty(shape, dtype=object)
        out.fill(Fraction(0))
        return out
    return np.zeros(shape)


def _arr(a, exact: bool) -> np.ndarray:
    if exact:
        return np.asarray(a, dtype=object)
    return np.asarray(a, dtype=np.float64)


def _coef(c: Any, exact: bool):
    return Fraction(c) if exact else float(c)


def _structure_key(net: Layer) -> tuple:
    """Models with equal keys have equal canonical shapes (they can share a batched Gram)."""
    if isinstance(net, Linear):
        return ("linear", net.weight.shape)
    if isinstance(net, Bilinear):
        return ("bilinear", net.left.shape, net.down.shape)
    if isinstance(net, Residual):
        return ("residual", _structure_key(net.inner))
    if isinstance(net, Sequential):
        return ("sequential",) + tuple(_structure_key(x) for x in net.layers)
    raise TypeError(f"unknown layer type {type(net).__name__}")


def _type_key(net: Layer) -> tuple:
    """The layer-type pattern (no sizes): networks with equal patterns can be run side by side."""
    if isinstance(net, (Linear, Bilinear)):
        return (type(net).__name__,)
    if isinstance(net, Residual):
        return ("Residual", _type_key(net.inner))
    return ("Sequential",) + tuple(_type_key(x) for x in net.layers)


def _output_vector(output: Any, n_out: int, name: str = "output") -> np.ndarray | None:
    """``None`` stays ``None``; an int becomes a one-hot row; a vector is checked."""
    if output is None:
        return None
    if isinstance(output, (bool, np.bool_)):
        raise ValueError(f"{name}: expected a class index or a direction vector, got {output!r}")
    if isinstance(output, (int, np.integer)):
        if not 0 <= int(output) < n_out:
            raise ValueError(f"{name}: class index {int(output)} out of range for a network with "
                             f"{n_out} outputs (expected 0..{n_out - 1})")
        u = np.zeros(n_out)
        u[int(output)] = 1.0
        return u
    if isinstance(output, str):
        raise ValueError(f"{name}: expected a class index or a direction vector of length "
                         f"{n_out}, got {output!r}")
    if hasattr(output, "detach"):
        output = output.detach().cpu().double().numpy()
    arr = np.asarray(output)
    if arr.dtype == object:
        u = np.array([Fraction(v) for v in arr.reshape(-1)], dtype=object)
    else:
        u = np.asarray(arr, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(u)):
            raise ValueError(f"{name}: the direction vector has non-finite entries")
    if arr.ndim != 1 or u.shape != (n_out,):
        raise ValueError(f"{name}: a direction vector must have shape ({n_out},) to match the "
                         f"network's {n_out} outputs, got shape {arr.shape}")
    return u


# ----------------------------------------------------------------------------------------
# Gram matrices of networks of mixed architectures (public API, batched per architecture)
# ----------------------------------------------------------------------------------------

def _gram_mixed(nets: Sequence[Layer], metric: str, backend: str, output: Any,
                on_cost: str = "raise") -> np.ndarray:
    """``G[i, j] = <n_i, n_j>`` with one :func:`tensoralg.cross_gram` call per pair of
    architecture groups. ``on_cost="nan"``: a block refused as too costly is left NaN."""
    import tensoralg as ta

    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(nets):
        groups.setdefault(_structure_key(n), []).append(i)
    exact = backend == "exact"
    n = len(nets)
    G = np.empty((n, n), dtype=object) if exact else np.full((n, n), np.nan)
    keys = list(groups)
    for gi, ki in enumerate(keys):
        for kj in keys[gi:]:
            I, J = groups[ki], groups[kj]
            a = [nets[i] for i in I]
            b = a if ki == kj else [nets[j] for j in J]
            try:
                block = ta.cross_gram(a, b, metric=metric, backend=backend, output=output)
            except ta.CostTooHigh:
                if on_cost == "raise":
                    raise
                block = np.full((len(I), len(J)), np.nan, dtype=object if exact else float)
            for p, i in enumerate(I):
                for q, j in enumerate(J):
                    G[i, j] = G[j, i] = block[p, q]
    return G


# ----------------------------------------------------------------------------------------
# sums of networks as one network
# ----------------------------------------------------------------------------------------

def _blockdiag(mats: list[np.ndarray], exact: bool) -> np.ndarray:
    rows = sum(m.shape[0] for m in mats)
    cols = sum(m.shape[1] for m in mats)
    out = _zeros((rows, cols), exact)
    r = c = 0
    for m in mats:
        out[r:r + m.shape[0], c:c + m.shape[1]] = m
        r, c = r + m.shape[0], c + m.shape[1]
    return out


def _cat_bias(biases: list, sizes: list[int], exact: bool):
    if all(b is None for b in biases):
        return None
    return np.concatenate([_zeros((s,), exact) if b is None else _arr(b, exact)
                           for b, s in zip(biases, sizes)])


def _parallel(layers: list[Layer], exact: bool) -> Layer:
    """Layers of the same type pattern run side by side on concatenated streams."""
    first = layers[0]
    if isinstance(first, Linear):
        return Linear(_blockdiag([_arr(l.weight, exact) for l in layers], exact),
                      _cat_bias([l.bias for l in layers], [l.out_features for l in layers], exact))
    if isinstance(first, Bilinear):
        hs = [l.hidden_features for l in layers]
        return Bilinear(_blockdiag([_arr(l.left, exact) for l in layers], exact),
                        _blockdiag([_arr(l.right, exact) for l in layers], exact),
                        _blockdiag([_arr(l.down, exact) for l in layers], exact),
                        _cat_bias([l.left_bias for l in layers], hs, exact),
                        _cat_bias([l.right_bias for l in layers], hs, exact),
                        _cat_bias([l.down_bias for l in layers], [l.out_features for l in layers],
                                  exact))
    if isinstance(first, Residual):
        return Residual(_parallel([l.inner for l in layers], exact))
    return Sequential([_parallel(list(col), exact) for col in zip(*[l.layers for l in layers])])


def as_bilinear_depth1(net: Any) -> Bilinear:
    """A depth-1 network (degree <= 2) as one :class:`~tensoralg.layers.Bilinear` layer on the
    input: the factored form of :func:`_quadratic_form`, plus one hidden unit per output for the
    affine part (``(b_o . x + c_o) * 1``). Same function, exactly (rationals stay rationals).

    Raises:
        ValueError: a network of depth >= 2 (names :func:`check_decomposition`).
    """
    net = as_network(net, "net")
    q = _quadratic_form(net, net.is_exact, "net")
    exact, O, d = q.exact, q.c.shape[0], q.B.shape[1]
    left = np.concatenate([q.Lt[:, 1:], q.B])
    left_bias = np.concatenate([q.Lt[:, 0], q.c])
    right = np.concatenate([q.Rt[:, 1:], _zeros((O, d), exact)])
    one = Fraction(1) if exact else 1.0
    right_bias = np.concatenate([q.Rt[:, 0], np.full(O, one, dtype=object if exact else float)])
    down = np.concatenate([q.D, _eye(O, exact)], axis=1)
    return Bilinear(left, right, down, left_bias, right_bias)


def _eye(n: int, exact: bool) -> np.ndarray:
    out = _zeros((n, n), exact)
    for i in range(n):
        out[i, i] = Fraction(1) if exact else 1.0
    return out


def combine(networks: Sequence[Any], coefficients: Sequence[Any] | None = None) -> Layer:
    """``sum_i c_i f_i`` as one network (all ``c_i = 1`` by default).

    Networks with the same layer-type pattern (e.g. checkpoints of one architecture; widths may
    differ) run side by side: the input is copied to each, every layer becomes block-diagonal
    (hidden units concatenated), and a final linear map sums the outputs weighted by ``c_i`` — so
    the depth is unchanged (DESIGN §3.8: "hidden units concatenated, one side's output
    negated"). Depth-1 networks of any pattern are first rewritten as one bilinear layer each
    (:func:`as_bilinear_depth1`). Rational networks with rational coefficients stay rational.

    Args:
        networks: a non-empty list of networks with the same ``in_features`` and
            ``out_features``.
        coefficients: numbers, one per network.

    Raises:
        ValueError: an empty list, sizes that differ (naming the network and both sizes), a
            coefficient count that differs, or deeper networks whose layer patterns differ.
    """
    nets = [as_network(n, f"networks[{i}]") for i, n in enumerate(networks)]
    if not nets:
        raise ValueError("networks: expected at least one network")
    coefficients = [1] * len(nets) if coefficients is None else list(coefficients)
    if len(coefficients) != len(nets):
        raise ValueError(f"coefficients: expected {len(nets)} numbers (one per network), got "
                         f"{len(coefficients)}")
    _check_sizes(nets[0], nets[1:], "networks", offset=1)
    exact = all(n.is_exact for n in nets) and not any(isinstance(c, float) for c in coefficients)
    if len({_type_key(n) for n in nets}) > 1:
        depths = [bilinear_depth(n) for n in nets]
        if max(depths) > 1:
            raise ValueError(f"networks: combine runs networks side by side layer by layer, so "
                             f"networks deeper than one bilinear layer need the same layer pattern "
                             f"(bilinear depths {depths}); compare them through their Gram matrix "
                             f"instead (check_decomposition does)")
        nets = [as_bilinear_depth1(n) for n in nets]
    d, O = nets[0].in_features, nets[0].out_features
    fan_out = Linear(np.concatenate([_eye(d, exact)] * len(nets)))
    fan_in = Linear(np.concatenate([_eye(O, exact) * _coef(c, exact) for c in coefficients],
                                   axis=1))
    return Sequential([fan_out, _parallel(nets, exact), fan_in])


def difference(a: Any, b: Any) -> Layer:
    """``f_b - f_a`` (the change from checkpoint ``a`` to checkpoint ``b``) as one network of the
    same depth (see :func:`combine`). Raises ``ValueError`` as :func:`combine`."""
    return combine([b, a], [1, -1])


def _check_sizes(ref: Layer, others: Sequence[Layer], name: str, offset: int = 0,
                 ref_name: str = "networks[0]") -> None:
    for i, n in enumerate(others, start=offset):
        if n.in_features != ref.in_features:
            raise ValueError(f"{name}[{i}]: reads {n.in_features} inputs but {ref_name} reads "
                             f"{ref.in_features}; every network must read the same input")
        if n.out_features != ref.out_features:
            raise ValueError(f"{name}[{i}]: has {n.out_features} outputs but {ref_name} has "
                             f"{ref.out_features}; every network must have the same outputs")


# ----------------------------------------------------------------------------------------
# 1. check_decomposition
# ----------------------------------------------------------------------------------------

@dataclass
class DecompositionCheck:
    """Result of :func:`check_decomposition`. Index 0 of the Gram matrices is the model.

    Attributes:
        equal: the decomposition reproduces the model. ``certified`` (exact backend): the
            residual is exactly 0 in rationals. Float backends: ``residual <= rtol * ||f||^2``.
        residual, residual_frobenius: ``||f - sum_i g_i||^2`` in the Gaussian (``E_x``) and
            symmetrized-Frobenius metrics (``None`` when the coefficient tensors have different
            orders: Frobenius needs equal depths).
        norm2: ``||f||^2`` (Gaussian). relative_residual: ``residual / norm2``.
        gram, gram_frobenius: ``(n+1, n+1)`` Gram matrices of ``(f, g_1, ..., g_n)``.
        share: ``||g_i||^2 / ||f||^2``; attribution: ``<f, g_i> / ||f||^2``;
            interference: ``sum_{i != j} <g_i, g_j> / ||f||^2`` (for an exact decomposition
            ``sum(share) + interference == 1``).
        residual_route: ``"network"`` (norm of the residual network ``f - sum g_i``, built by
            :func:`combine`: no cancellation between large terms) or ``"gram"``
            (``G_00 - 2 sum_i G_0i + sum_ij G_ij``; in float64 its absolute error is about
            ``eps * sum |G|``).
    """

    equal: bool
    certified: bool
    residual: Any
    residual_frobenius: Any
    norm2: Any
    relative_residual: float
    gram: np.ndarray
    gram_frobenius: np.ndarray | None
    share: np.ndarray
    attribution: np.ndarray
    interference: float
    backend: str
    residual_route: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-friendly form (rationals as strings)."""
        def js(v):
            if isinstance(v, np.ndarray):
                return [js(x) for x in v.tolist()] if v.ndim else js(v.item())
            if isinstance(v, list):
                return [js(x) for x in v]
            if isinstance(v, Fraction):
                return str(v)
            if isinstance(v, (np.floating, float)):
                return float(v)
            return v
        return {k: js(getattr(self, k)) for k in self.__dataclass_fields__}

    def __str__(self) -> str:
        verdict = ("EQUAL (certified in rationals)" if self.certified else
                   "equal (float64)" if self.equal else "NOT equal")
        return (f"{verdict}: ||f - sum g||^2 = {self.residual} (relative "
                f"{self.relative_residual:.3g}), shares {np.round(np.asarray(self.share, float), 4)}"
                f", interference {self.interference:.4g}")


def check_decomposition(model: Any, components: Sequence[Any], *, output: Any = None,
                        backend: str = "numpy", frobenius: bool = True,
                        rtol: float = 1e-9, _gram: np.ndarray | None = None) -> DecompositionCheck:
    """Check ``f = sum_i g_i`` exactly from the Gram matrix of ``(f, g_1, ..., g_n)`` (DESIGN §3.8).

    Args:
        model: the network ``f`` (``d`` inputs, ``O`` outputs).
        components: networks ``g_i`` with the same input and output sizes (any architectures).
        output: ``None`` (all outputs), a class index or a direction vector of length ``O``.
        backend: ``"numpy"`` or ``"exact"`` (rational arithmetic: ``equal`` is then a
            certificate that the residual is exactly 0; float weights are taken exactly).
        frobenius: also compute the symmetrized-Frobenius residual (needs equal depths).
        rtol: float backends only: ``equal`` iff ``residual <= rtol * ||f||^2``.

    Returns:
        a :class:`DecompositionCheck`.

    Raises:
        ValueError: no components, components with other input or output sizes, a bad
            ``output`` or ``backend``; tensoralg.CostTooHigh: an exact Gaussian inner product
            over the planner's budget.
    """
    import tensoralg as ta

    f = as_network(model, "model")
    if isinstance(components, (Layer, dict)) or hasattr(components, "to_network"):
        raise TypeError("components: expected a list of networks, got a single network")
    comps = [as_network(g, f"components[{i}]") for i, g in enumerate(components)]
    if not comps:
        raise ValueError("components: expected at least one component network")
    _check_sizes(f, comps, "components", ref_name="the model")
    if backend not in ("numpy", "exact"):
        raise ValueError(f"backend: expected 'numpy' or 'exact', got {backend!r}")
    _output_vector(output, f.out_features)
    exact = backend == "exact"
    nets = [f] + comps
    G = _gram_mixed(nets, "gaussian", backend, output) if _gram is None else _gram
    notes = []
    route = "gram"
    if exact or _gram is not None:
        residual = G[0, 0] - 2 * sum(G[0, 1:]) + sum(G[1:, 1:].ravel())
        if not exact:
            residual = max(float(residual), 0.0)
    else:
        try:
            r = combine(nets, [1] + [-1] * len(comps))
            residual = max(float(ta.inner(r, r, output=output)), 0.0)
            route = "network"
        except ValueError:
            residual = max(float(G[0, 0] - 2 * G[0, 1:].sum() + G[1:, 1:].sum()), 0.0)
    GF, residual_f = None, None
    if frobenius:
        orders = {bilinear_depth(n) for n in nets}
        if len(orders) == 1:
            GF = _gram_mixed(nets, "frobenius", backend, output)
            residual_f = GF[0, 0] - 2 * sum(GF[0, 1:]) + sum(GF[1:, 1:].ravel())
            if not exact:
                residual_f = float(residual_f)
        else:
            notes.append(f"frobenius: the networks have different bilinear depths "
                         f"{sorted(orders)} (coefficient tensors of different orders); the "
                         f"Frobenius residual is not defined")
    norm2 = G[0, 0]
    n2 = float(norm2)
    Gf = np.asarray(G, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.diag(Gf)[1:] / n2
        attribution = Gf[0, 1:] / n2
        inter = (Gf[1:, 1:].sum() - np.trace(Gf[1:, 1:])) / n2
        rel = float(residual) / n2 if n2 > 0 else (0.0 if residual == 0 else math.inf)
    equal = (residual == 0) if exact else bool(residual <= rtol * n2)
    return DecompositionCheck(equal=bool(equal), certified=bool(exact and equal),
                              residual=residual, residual_frobenius=residual_f, norm2=norm2,
                              relative_residual=rel, gram=G, gram_frobenius=GF, share=share,
                              attribution=attribution, interference=float(inter),
                              backend=backend, residual_route=route, notes=notes)


# ----------------------------------------------------------------------------------------
# 2. chaos coefficients of depth-1 networks and eigen-components
# ----------------------------------------------------------------------------------------

@dataclass
class _Quad:
    """``f(x) = c + B x + D ((Lt x~) * (Rt x~))`` with ``x~ = (1, x)``: a degree-<=2 map."""

    c: np.ndarray   # (m,)
    B: np.ndarray   # (m, d)
    D: np.ndarray   # (m, H)
    Lt: np.ndarray  # (H, d+1)
    Rt: np.ndarray  # (H, d+1)
    exact: bool

    @property
    def affine(self) -> bool:
        return self.D.shape[1] == 0


def _quadratic_form(net: Layer, exact: bool, name: str, q: _Quad | None = None) -> _Quad:
    """Compose the layers of a depth-1 network into the factored form of :class:`_Quad`
    (lifted bilinear factors in input coordinates; an embedding is folded into them)."""
    if q is None:
        d = net.in_features
        q = _Quad(_zeros((d,), exact), _eye(d, exact), _zeros((d, 0), exact),
                  _zeros((0, d + 1), exact), _zeros((0, d + 1), exact), exact)
    if isinstance(net, Sequential):
        for layer in net.layers:
            q = _quadratic_form(layer, exact, name, q)
        return q
    if isinstance(net, Linear):
        W = _arr(net.weight, exact)
        c = W @ q.c + (_arr(net.bias, exact) if net.bias is not None else 0)
        return _Quad(c, W @ q.B, W @ q.D, q.Lt, q.Rt, exact)
    if isinstance(net, Bilinear):
        if not q.affine:
            raise ValueError(f"{name}: a bilinear layer reads the output of another bilinear "
                             f"layer (degree 4 or more); {_DEPTH_HINT}")

        def lift(W, b):
            out = _zeros((W.shape[0], q.B.shape[1] + 1), exact)
            out[:, 0] = W @ q.c + (_arr(b, exact) if b is not None else 0)
            out[:, 1:] = W @ q.B
            return out
        Lt = lift(_arr(net.left, exact), net.left_bias)
        Rt = lift(_arr(net.right, exact), net.right_bias)
        O, d = net.out_features, q.B.shape[1]
        c = _arr(net.down_bias, exact) if net.down_bias is not None else _zeros((O,), exact)
        return _Quad(c, _zeros((O, d), exact), _arr(net.down, exact), Lt, Rt, exact)
    if isinstance(net, Residual):
        inner = _quadratic_form(net.inner, exact, name, q)
        return _Quad(q.c + inner.c, q.B + inner.B, np.concatenate([q.D, inner.D], axis=1),
                     np.concatenate([q.Lt, inner.Lt]), np.concatenate([q.Rt, inner.Rt]), exact)
    raise TypeError(f"{name}: unknown layer type {type(net).__name__}")


@dataclass
class ChaosCoefficients:
    """Hermite (Wiener chaos) coefficients of a degree-<=2 polynomial map, per output.

    ``f_o(x) = C0[o] + C1[o] . x + sum_ij C2[o,i,j] He_ij(x)`` with ``He_ii = x_i^2 - 1``,
    ``He_ij = x_i x_j`` (``i != j``); ``E[f_o g_o] = C0 C0' + C1.C1' + 2 <C2, C2'>_F``
    (DESIGN §3.6). Shapes: ``C0 (K,)``, ``C1 (K, d)``, ``C2 (K, d, d)`` symmetric, ``K`` outputs
    (or 1 for a direction). Object arrays of Fractions for rational networks.
    """

    C0: np.ndarray
    C1: np.ndarray
    C2: np.ndarray

    def norm2(self) -> np.ndarray:
        """``E[f_o^2] = C0^2 + |C1|^2 + 2 |C2|_F^2`` per output, shape ``(K,)``."""
        return (self.C0 * self.C0 + (self.C1 * self.C1).sum(axis=1)
                + 2 * (self.C2 * self.C2).sum(axis=(1, 2)))


def chaos_coefficients_depth1(net: Any, output: Any = None) -> ChaosCoefficients:
    """Chaos coefficients ``(C0, C1, C2)`` of a depth-1 network, read off its weights.

    The network (embedding, one bilinear layer, head, biases, residual connections) is composed
    into ``f(x) = c + B x + D((L~ x~) * (R~ x~))`` with lifted factors ``L~ = [l0 | l]``,
    ``R~ = [r0 | r]`` in input coordinates. Then ``f = c' + b.x + x^T A x`` with
    ``c' = c + D(l0 r0)``, ``b = B + D(l0 r + r0 l)``, ``A = sym(sum_h D_h l_h r_h^T)``, and for a
    degree-2 polynomial ``C0 = c' + tr A``, ``C1 = b``, ``C2 = A`` (DESIGN §3.6, from
    ``x^T A x = tr A + sum_ij A_ij He_ij(x)``). Exact in rationals for rational networks; never
    sampled. Cost ``O(K H d^2)`` for ``K`` outputs and ``H`` hidden units.

    Args:
        net: a depth-1 network with ``d`` inputs and ``O`` outputs.
        output: ``None`` (every output, ``K = O``), a class index or a direction ``u`` (length
            ``O``, ``K = 1``: the coefficients of ``u . f``).

    Raises:
        ValueError: a network of bilinear depth >= 2 (the message names check_decomposition),
            a bad ``output``.
    """
    net = as_network(net, "net")
    if bilinear_depth(net) > 1:
        raise ValueError(f"net: bilinear depth {bilinear_depth(net)} (degree up to "
                         f"{net.degree}); {_DEPTH_HINT}")
    u = _output_vector(output, net.out_features)
    exact = net.is_exact and (u is None or u.dtype == object or np.all(u == np.round(u)))
    q = _quadratic_form(net, exact, "net")
    c, B, D = q.c, q.B, q.D
    if u is not None:
        U = _arr(u, exact)[None, :]
        if exact:
            U = np.vectorize(Fraction, otypes=[object])(U)
        c, B, D = U @ c, U @ B, U @ D
    l0, l, r0, r = q.Lt[:, 0], q.Lt[:, 1:], q.Rt[:, 0], q.Rt[:, 1:]
    C0 = c + D @ (l0 * r0)
    C1 = B + D @ (l0[:, None] * r + r0[:, None] * l)
    half = Fraction(1, 2) if exact else 0.5
    K, d = C1.shape
    C2 = _zeros((K, d, d), exact)
    for o in range(K):
        M = (l.T * D[o]) @ r
        C2[o] = (M + M.T) * half
        C0[o] = C0[o] + np.trace(C2[o])
    return ChaosCoefficients(C0, C1, C2)


@dataclass
class EigenDecomposition:
    """Eigen-components of one output (or direction) of a depth-1 network (DESIGN §3.8).

    ``f(x) = C0 + C1 . x + sum_i lambda_i He2(v_i . x)`` with ``He2(t) = t^2 - 1`` (unit ``v_i``):
    the components are mutually orthogonal under ``x ~ N(0, I_d)`` and orthogonal to the
    constant and linear parts, with ``||lambda_i He2(v_i.x)||^2 = 2 lambda_i^2``. Eigenvalues
    are sorted by ``|lambda|``, largest first; ``eigenvectors[i]`` is ``v_i`` in input space
    (shape ``(d,)``: pixels for images).

    Attributes:
        C0 (float), C1 ``(d,)``, C2 ``(d, d)``: the chaos coefficients (float64).
        eigenvalues ``(d,)``, eigenvectors ``(d, d)`` (rows).
        norm2: ``E[f^2] = C0^2 + |C1|^2 + 2 sum_i lambda_i^2``.
        output: the class index or direction it was computed for.
    """

    C0: float
    C1: np.ndarray
    C2: np.ndarray
    eigenvalues: np.ndarray
    eigenvectors: np.ndarray
    output: Any = None

    @property
    def d(self) -> int:
        return self.C1.shape[0]

    @property
    def norm2(self) -> float:
        return float(self.C0 ** 2 + self.C1 @ self.C1 + 2 * np.sum(self.eigenvalues ** 2))

    @property
    def component_norm2(self) -> np.ndarray:
        """``||lambda_i He2(v_i.x)||^2 = 2 lambda_i^2``, shape ``(d,)``."""
        return 2 * self.eigenvalues ** 2

    def _check_k(self, k: Any) -> int:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise ValueError(f"k: expected an integer number of eigen-components, got {k!r}")
        if not 0 <= int(k) <= self.d:
            raise ValueError(f"k: expected 0 <= k <= {self.d} (the input dimension: there are "
                             f"{self.d} eigen-components), got {int(k)}")
        return int(k)

    def truncation_error(self, k: int) -> float:
        """``||f - f_k||^2 = 2 sum_{i >= k} lambda_i^2`` (exact identity; float64 sum)."""
        k = self._check_k(k)
        return float(2 * np.sum(self.eigenvalues[k:] ** 2))

    def faithfulness(self) -> dict:
        """For ``k = 0..d``: ``relative_error[k] = ||f - f_k||^2 / ||f||^2`` and
        ``similarity[k] = <f, f_k> / (||f|| ||f_k||) = sqrt(1 - relative_error[k])`` (the dropped
        part is orthogonal to ``f_k``). Returns ``{"k", "relative_error", "similarity"}``."""
        tail = 2 * np.concatenate([np.cumsum((self.eigenvalues ** 2)[::-1])[::-1], [0.0]])
        n2 = self.norm2
        rel = tail / n2 if n2 > 0 else np.zeros_like(tail)
        return {"k": np.arange(self.d + 1), "relative_error": rel,
                "similarity": np.sqrt(np.clip(1.0 - rel, 0.0, 1.0))}

    def component(self, i: int) -> Bilinear:
        """``lambda_i ((v_i.x)^2 - |v_i|^2)``: eigen-component ``i`` as a network (1 output;
        ``|v_i|^2`` instead of 1 keeps it exactly mean-zero for the stored float vector)."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.d:
            raise ValueError(f"i: expected a component index 0..{self.d - 1}, got {i!r}")
        v, lam = self.eigenvectors[i], float(self.eigenvalues[i])
        return Bilinear(v[None], v[None], [[lam]], down_bias=[-lam * float(v @ v)])

    def truncate(self, k: int) -> Bilinear:
        """``f_k = C0 + C1.x + sum_{i < k} lambda_i He2(v_i.x)`` as one bilinear layer
        (``d -> 1``; hidden units: the ``k`` eigenvectors and one for the linear part)."""
        k = self._check_k(k)
        V, lam = self.eigenvectors[:k], self.eigenvalues[:k]
        left = np.concatenate([V, self.C1[None]])
        right = np.concatenate([V, np.zeros((1, self.d))])
        right_bias = np.concatenate([np.zeros(k), [1.0]])
        down = np.concatenate([lam, [1.0]])[None]
        bias = self.C0 - float(np.sum(lam * np.einsum("ij,ij->i", V, V)))
        return Bilinear(left, right, down, None, right_bias, [bias])

    def components(self) -> list[Bilinear]:
        """``[C0 + C1.x, lambda_1 He2(v_1.x), ..., lambda_d He2(v_d.x)]``: they sum to ``f``."""
        return [self.truncate(0)] + [self.component(i) for i in range(self.d)]

    def to_dict(self, top: int | None = None) -> dict:
        """JSON-friendly summary (eigenvectors: the ``top`` first, all when None)."""
        top = self.d if top is None else min(top, self.d)
        fa = self.faithfulness()
        out = self.output
        return {"output": out if out is None or isinstance(out, int) else np.asarray(out).tolist(),
                "norm2": self.norm2, "C0": float(self.C0),
                "C1_norm2": float(self.C1 @ self.C1),
                "eigenvalues": self.eigenvalues.tolist(),
                "component_norm2": self.component_norm2.tolist(),
                "relative_error": fa["relative_error"].tolist(),
                "similarity": fa["similarity"].tolist(),
                "eigenvectors": self.eigenvectors[:top].tolist()}


def eigen(model: Any, output: Any = None):
    """Eigen-components of a depth-1 network's output ``output`` (DESIGN §3.8, §3.6).

    ``C2 = sum_i lambda_i v_i v_i^T`` (``numpy.linalg.eigh`` of the chaos-2 coefficient from
    :func:`chaos_coefficients_depth1`) gives ``f = C0 + C1.x + sum_i lambda_i He2(v_i.x)``.

    Args:
        model: a depth-1 network (embedding, one bilinear layer, head, biases, residual).
        output: a class index, a direction vector ``u`` (length ``O``), ``"each"`` (a list,
            one per output) or ``None`` (allowed only for a single-output network).

    Returns:
        an :class:`EigenDecomposition` (a list of them for ``"each"``).

    Raises:
        ValueError: a network of depth >= 2 (the message names check_decomposition), an output
            index out of range, a direction of the wrong length, ``None`` with several outputs.
    """
    net = as_network(model, "model")
    if bilinear_depth(net) > 1:
        raise ValueError(f"model: bilinear depth {bilinear_depth(net)} (degree up to "
                         f"{net.degree}); {_DEPTH_HINT}")
    O = net.out_features
    if isinstance(output, str) and output == "each":
        return [eigen(net, c) for c in range(O)]
    if output is None:
        if O != 1:
            raise ValueError(f"output: the model has {O} outputs; give a class index 0..{O - 1}, "
                             f"a direction vector of length {O}, or 'each'")
        output = 0
    _output_vector(output, O)
    co = chaos_coefficients_depth1(net, output)
    C0 = float(co.C0[0])
    C1 = np.asarray(co.C1[0], dtype=float)
    C2 = np.asarray(co.C2[0], dtype=float)
    lam, V = np.linalg.eigh(C2)
    order = np.argsort(-np.abs(lam), kind="stable")
    out = int(output) if isinstance(output, (int, np.integer)) else np.asarray(output)
    return EigenDecomposition(C0, C1, C2, lam[order], V[:, order].T.copy(), out)


# ----------------------------------------------------------------------------------------
# 3. residual paths
# ----------------------------------------------------------------------------------------

def _flat_layers(net: Layer) -> list[Layer]:
    if isinstance(net, Sequential):
        return [x for l in net.layers for x in _flat_layers(l)]
    return [net]


def _split_residual(net: Layer) -> tuple[list[Linear], list[Residual], list[Linear]]:
    layers = _flat_layers(net)
    i = 0
    while i < len(layers) and isinstance(layers[i], Linear):
        i += 1
    j = i
    while j < len(layers) and isinstance(layers[j], Residual):
        j += 1
    pre, blocks, post = layers[:i], layers[i:j], layers[j:]
    for k, b in enumerate(blocks):
        if not isinstance(b.inner, (Linear, Bilinear)):
            raise ValueError(f"model: paths needs residual blocks around one Linear or Bilinear "
                             f"layer; block {k + 1} wraps a {type(b.inner).__name__}")
    bad = [type(l).__name__ for l in post if not isinstance(l, Linear)]
    if bad:
        raise ValueError(f"model: paths expects [Linear ...] Residual blocks [Linear ...] "
                         f"(embedding, residual blocks, head); found a {bad[0]} outside the "
                         f"residual stream")
    return pre, blocks, post


def _path_name(T: tuple[int, ...]) -> str:
    return "direct" if not T else "+".join(str(k + 1) for k in T)


def _subsets(s: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [c for r in range(len(s) + 1) for c in combinations(s, r)]


def _path_network(pre, blocks, post, T: tuple[int, ...], exact: bool) -> Layer:
    """The path network of subset ``T``: ``y_{U + k} = sum_{P | Q = U} B_k(y_P, y_Q)`` with the
    block's biases on the direct leg (``P`` or ``Q`` empty) and its output bias on ``U`` empty,
    so that ``sum_T y_T`` is the residual stream (bilinear expansion of each block)."""
    strip = [Linear(l.weight, None) for l in post]
    if not T:
        return Sequential(pre + post) if pre + post else Linear(_eye(blocks[0].in_features, exact))
    m = blocks[0].in_features
    avail: list[tuple[int, ...]] = [()]
    stages: list[Layer] = []
    one = Fraction(1) if exact else 1.0
    for pos, k in enumerate(T):
        last = pos == len(T) - 1
        inner = blocks[k].inner
        col = {S: i * m for i, S in enumerate(avail)}
        carry = [] if last else list(avail)
        new = [tuple(sorted(S + (k,))) for S in avail]
        if last:
            new = [T]
        outs = carry + new
        row = {S: i * m for i, S in enumerate(outs)}
        n_in, n_out = len(avail) * m, len(outs) * m
        if isinstance(inner, Linear):
            W = _zeros((n_out, n_in), exact)
            b = _zeros((n_out,), exact)
            for S in carry:
                W[row[S]:row[S] + m, col[S]:col[S] + m] = _eye(m, exact)
            for Tn in new:
                U = tuple(x for x in Tn if x != k)
                W[row[Tn]:row[Tn] + m, col[U]:col[U] + m] = _arr(inner.weight, exact)
                if not U and inner.bias is not None:
                    b[row[Tn]:row[Tn] + m] = _arr(inner.bias, exact)
            stages.append(Linear(W, b))
            avail = outs
            continue
        H = inner.hidden_features
        units = [(None, S) for S in carry]
        for Tn in new:
            U = tuple(x for x in Tn if x != k)
            for P in _subsets(U):
                for Q in _subsets(U):
                    if tuple(sorted(set(P) | set(Q))) == U:
                        units.append(((P, Q), Tn))
        n_h = sum(m if pq is None else H for pq, _ in units)
        L, R = _zeros((n_h, n_in), exact), _zeros((n_h, n_in), exact)
        lb, rb = _zeros((n_h,), exact), _zeros((n_h,), exact)
        D, db = _zeros((n_out, n_h), exact), _zeros((n_out,), exact)
        h = 0
        for pq, S in units:
            if pq is None:   # carry y_S: (e_i . z) * 1
                L[h:h + m, col[S]:col[S] + m] = _eye(m, exact)
                rb[h:h + m] = one
                D[row[S]:row[S] + m, h:h + m] = _eye(m, exact)
                h += m
                continue
            P, Q = pq
            L[h:h + H, col[P]:col[P] + m] = _arr(inner.left, exact)
            R[h:h + H, col[Q]:col[Q] + m] = _arr(inner.right, exact)
            if not P and inner.left_bias is not None:
                lb[h:h + H] = _arr(inner.left_bias, exact)
            if not Q and inner.right_bias is not None:
                rb[h:h + H] = _arr(inner.right_bias, exact)
            D[row[S]:row[S] + m, h:h + H] = _arr(inner.down, exact)
            h += H
        for Tn in new:
            if Tn == (k,) and inner.down_bias is not None:
                db[row[Tn]:row[Tn] + m] = _arr(inner.down_bias, exact)
        stages.append(Bilinear(L, R, D, lb, rb, db))
        avail = outs
    return Sequential(pre + stages + strip)


@dataclass
class PathDecomposition:
    """Result of :func:`paths`. ``names[i]`` is ``"direct"`` or the blocks passed (``"1+2"``).

    Attributes:
        names, networks: the ``2^n`` path networks (they sum to the model exactly).
        depths: bilinear depth of each path network.
        cost: ``tensoralg.plan`` summary of each path's exact norm (``"REFUSED ..."`` over the
            planner's budget); over_budget: names of the refused paths.
        gram: ``(2^n, 2^n)`` Gaussian Gram matrix of the paths (NaN where refused): the exact
            attribution. share: ``gram[i, i] / ||f||^2``. norm2: ``||f||^2`` (NaN if refused).
        check: :func:`check_decomposition` of the model against the paths (``None`` when a
            path is over budget).
    """

    names: list[str]
    networks: list[Layer]
    depths: list[int]
    cost: list[str]
    over_budget: list[str]
    gram: np.ndarray
    share: np.ndarray
    norm2: Any
    check: DecompositionCheck | None

    def to_dict(self) -> dict:
        g = np.asarray(self.gram, dtype=float)
        return {"names": self.names, "depths": self.depths, "cost": self.cost,
                "over_budget": self.over_budget,
                "gram": [[None if not np.isfinite(v) else float(v) for v in r] for r in g],
                "share": [None if not np.isfinite(v) else float(v) for v in self.share],
                "norm2": None if not np.isfinite(float(self.norm2)) else float(self.norm2),
                "check": None if self.check is None else self.check.to_dict()}


def _path_networks(model: Any, name: str = "model", exact: bool | None = None):
    net = as_network(model, name)
    pre, blocks, post = _split_residual(net)
    if len(blocks) > 8:
        raise ValueError(f"{name}: {len(blocks)} residual blocks give {2 ** len(blocks)} paths; "
                         f"paths supports at most 8 blocks")
    exact = net.is_exact if exact is None else exact
    if not blocks:
        return net, ["direct"], [net]
    Ts = [T for r in range(len(blocks) + 1) for T in combinations(range(len(blocks)), r)]
    return net, [_path_name(T) for T in Ts], [_path_network(pre, blocks, post, T, exact)
                                              for T in Ts]


def paths(model: Any, *, backend: str = "numpy", check: bool = True) -> PathDecomposition:
    """Expand a residual network into path networks that sum to it exactly (DESIGN §3.8).

    ``model = head o (1 + B_n) o ... o (1 + B_1) o embed`` (``embed``/``head``: zero or more
    Linear layers; ``B_k``: one Bilinear or Linear layer). A bilinear block reads the stream
    ``y = sum_S y_S`` twice, so ``B_k(y) = sum_{P, Q} B_k(y_P, y_Q)``; grouping the terms by
    ``T = P | Q | {k}`` (the blocks a signal passed through) gives ``2^n`` path networks, e.g.
    ``direct``, ``1``, ``2``, ``1+2`` for two blocks. Biases go with the direct legs, the head's
    bias with ``direct``. The Gram matrix of the paths (Gaussian metric, batched per
    architecture) is the exact attribution of ``||f||^2``; :func:`check_decomposition`
    confirms the sum (in rationals with ``backend="exact"``). A path whose exact norm is over
    the planner's budget (``tensoralg.plan(...).refused``, e.g. depth 3) is listed with its
    cost, and its Gram entries are NaN (as are the model's, ``norm2``, when the model itself is
    over budget); the check then needs ``verify.decompose.check_decomposition_exact``.

    Raises:
        ValueError: a model that is not embed / residual blocks / head, more than 8 blocks.
    """
    import tensoralg as ta

    net, names, nets = _path_networks(model)
    cost, over = [], []
    for n, p in zip(names, nets):
        pl = ta.plan(p)
        cost.append(pl.summary())
        if pl.refused:
            over.append(n)
    # only networks within budget enter the Gram (a refused one would still pay its cross terms)
    keep = ([0] if not ta.plan(net).refused else []) + [i for i, n in enumerate(names, start=1)
                                                         if n not in over]
    allnets = [net] + nets
    sub = _gram_mixed([allnets[i] for i in keep], "gaussian", backend, None, on_cost="nan")
    G = np.full((len(allnets),) * 2, np.nan, dtype=object if backend == "exact" else float)
    G[np.ix_(keep, keep)] = sub
    chk = None
    if check and len(keep) == len(allnets):
        chk = check_decomposition(net, nets, backend=backend, frobenius=False, _gram=G)
    norm2 = G[0, 0]
    G = G[1:, 1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.diag(np.asarray(G, dtype=float)) / float(norm2)
    return PathDecomposition(names, nets, [bilinear_depth(p) for p in nets], cost, over, G,
                             share, norm2, chk)


def path_similarity(a: Any, b: Any, *, output: Any = None) -> dict[str, float | None]:
    """Similarity of the same path in two models with the same block structure (e.g. two
    checkpoints): ``{path name: sim(path_a, path_b)}`` (``None`` where exact is over budget or
    a path is zero).

    Raises:
        ValueError: models with different numbers of residual blocks or sizes.
    """
    import tensoralg as ta

    _, na, pa = _path_networks(a, "a")
    _, nb, pb = _path_networks(b, "b")
    if na != nb:
        raise ValueError(f"a and b have different residual structures: paths {na} vs {nb}")
    out = {}
    for n, x, y in zip(na, pa, pb):
        try:
            out[n] = float(ta.similarity(x, y, output=output))
        except ta.CostTooHigh:
            out[n] = None
        except ValueError as exc:
            if "norm zero" not in str(exc):
                raise
            out[n] = None
    return out
