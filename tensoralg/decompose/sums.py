"""Sums of networks as one network ([`combine`][tensoralg.decompose.sums.combine],
[`difference`][tensoralg.decompose.sums.difference]) and the exact check that a sum of components
equals a model ([`check_decomposition`][tensoralg.decompose.sums.check_decomposition],
docs/mathematics.md §3.8)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from ..layers import Bilinear, Layer, Linear, Residual, Sequential
from ..prepare import check_pair
from ..prepare import check_sizes as _check_sizes
from ._common import (
    as_array,
    as_coef,
    bilinear_depth,
    gram_mixed,
    identity_matrix,
    output_vector,
    type_key,
    vector_network,
    zeros_array,
)
from .spectral import as_bilinear_depth1


def _blockdiag(mats: list[np.ndarray], exact: bool) -> np.ndarray:
    rows = sum(m.shape[0] for m in mats)
    cols = sum(m.shape[1] for m in mats)
    out = zeros_array((rows, cols), exact)
    r = c = 0
    for m in mats:
        out[r:r + m.shape[0], c:c + m.shape[1]] = m
        r, c = r + m.shape[0], c + m.shape[1]
    return out


def _cat_bias(biases: list, sizes: list[int], exact: bool):
    if all(b is None for b in biases):
        return None
    return np.concatenate([zeros_array((s,), exact) if b is None else as_array(b, exact)
                           for b, s in zip(biases, sizes)])


def _parallel(layers: list[Layer], exact: bool) -> Layer:
    """Layers of the same type pattern run side by side on concatenated streams."""
    first = layers[0]
    if isinstance(first, Linear):
        return Linear(_blockdiag([as_array(l.weight, exact) for l in layers], exact),
                      _cat_bias([l.bias for l in layers], [l.out_features for l in layers], exact))
    if isinstance(first, Bilinear):
        hs = [l.hidden_features for l in layers]
        return Bilinear(_blockdiag([as_array(l.left, exact) for l in layers], exact),
                        _blockdiag([as_array(l.right, exact) for l in layers], exact),
                        _blockdiag([as_array(l.down, exact) for l in layers], exact),
                        _cat_bias([l.left_bias for l in layers], hs, exact),
                        _cat_bias([l.right_bias for l in layers], hs, exact),
                        _cat_bias([l.down_bias for l in layers], [l.out_features for l in layers],
                                  exact))
    if isinstance(first, Residual):
        return Residual(_parallel([l.inner for l in layers], exact))
    return Sequential([_parallel(list(col), exact) for col in zip(*[l.layers for l in layers])])


def _coefficient(c: Any, name: str) -> int | Fraction | float:
    """A finite real number as an int, a Fraction or a float (numpy scalars included)."""
    if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Real) or not math.isfinite(c):
        raise ValueError(f"{name}: expected a finite number, got "
                         f"{(c.item() if isinstance(c, np.generic) else c)!r}")
    if isinstance(c, numbers.Integral):
        return int(c)
    return Fraction(c) if isinstance(c, numbers.Rational) else float(c)


def combine(networks: Sequence[Any], coefficients: Sequence[Any] | None = None) -> Layer:
    """``sum_i c_i f_i`` as one network (all ``c_i = 1`` by default).

    Networks with the same layer-type pattern (e.g. checkpoints of one architecture; widths may
    differ) run side by side: the input is copied to each, every layer becomes block-diagonal
    (hidden units concatenated), and a final linear map sums the outputs weighted by ``c_i`` — so
    the depth is unchanged (docs/mathematics.md §3.8: "hidden units concatenated, one side's output
    negated"). Depth-1 networks of any pattern are first rewritten as one bilinear layer each
    ([`as_bilinear_depth1`][tensoralg.decompose.spectral.as_bilinear_depth1]). Rational networks
    with rational coefficients stay rational.

    Args:
        networks: a non-empty list of networks with the same ``in_features`` and
            ``out_features``.
        coefficients: finite real numbers, one per network.

    Raises:
        ValueError: an empty list, a sequence model (attention: not decomposed here), sizes
            that differ (naming the network and both sizes), a coefficient count that differs,
            a coefficient that is not a finite number (naming ``coefficients[i]``), or deeper
            networks whose layer patterns differ.
    """
    nets = [vector_network(n, f"networks[{i}]") for i, n in enumerate(networks)]
    if not nets:
        raise ValueError("networks: expected at least one network")
    coefficients = [1] * len(nets) if coefficients is None else list(coefficients)
    if len(coefficients) != len(nets):
        raise ValueError(f"coefficients: expected {len(nets)} numbers (one per network), got "
                         f"{len(coefficients)}")
    coefficients = [_coefficient(c, f"coefficients[{i}]") for i, c in enumerate(coefficients)]
    _check_sizes(nets[0], nets[1:], "networks", offset=1)
    exact = all(n.is_exact for n in nets) and not any(isinstance(c, float) for c in coefficients)
    if len({type_key(n) for n in nets}) > 1:
        depths = [bilinear_depth(n) for n in nets]
        if max(depths) > 1:
            raise ValueError(f"networks: combine runs networks side by side layer by layer, so "
                             f"networks deeper than one bilinear layer need the same layer pattern "
                             f"(bilinear depths {depths}); compare them through their Gram matrix "
                             f"instead (check_decomposition does)")
        nets = [as_bilinear_depth1(n) for n in nets]
    d, O = nets[0].in_features, nets[0].out_features
    fan_out = Linear(np.concatenate([identity_matrix(d, exact)] * len(nets)))
    fan_in = Linear(np.concatenate([identity_matrix(O, exact) * as_coef(c, exact) for c in coefficients],
                                   axis=1))
    return Sequential([fan_out, _parallel(nets, exact), fan_in])


def difference(a: Any, b: Any) -> Layer:
    """``f_b - f_a`` (the change from checkpoint ``a`` to checkpoint ``b``) as one network of the
    same depth (see [`combine`][tensoralg.decompose.sums.combine]). Two networks with the same
    weights give the zero network (exactly: the float sum of ``f_b`` and ``-f_a`` would leave
    rounding noise of about ``eps ||f_b||^2`` that reads as a change). Raises ``ValueError`` as
    [`combine`][tensoralg.decompose.sums.combine], with size errors naming ``a`` and ``b``."""
    na, nb = vector_network(a, "a"), vector_network(b, "b")
    check_pair(na, nb, sliceable=False)
    if _same_network(na, nb):
        return combine([nb], [0])
    return combine([nb, na], [1, -1])


def _same_network(a: Layer, b: Layer) -> bool:
    """The same layers with the same weights (arrays compared first; the layer-format specs,
    which also say which optional biases are there, only when those agree)."""
    xs, ys = a.arrays(), b.arrays()
    if type(a) is not type(b) or len(xs) != len(ys) or not all(
            np.shape(x) == np.shape(y) and np.array_equal(x, y) for x, y in zip(xs, ys)):
        return False
    return a.to_spec() == b.to_spec()


@dataclass
class DecompositionCheck:
    """Result of [`check_decomposition`][tensoralg.decompose.sums.check_decomposition]. Index 0 of
    the Gram matrices is the model.

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
            [`combine`][tensoralg.decompose.sums.combine]: no cancellation between large terms) or
            ``"gram"`` (``G_00 - 2 sum_i G_0i + sum_ij G_ij``; in float64 its absolute error is
            about ``eps * sum |G|``).
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
    """Check ``f = sum_i g_i`` exactly from the Gram matrix of ``(f, g_1, ..., g_n)`` (docs/mathematics.md §3.8).

    Args:
        model: the network ``f`` (``d`` inputs, ``O`` outputs).
        components: networks ``g_i`` with the same input and output sizes (any architectures).
        output: ``None`` (all outputs), a class index or a direction vector of length ``O``.
        backend: ``"numpy"`` or ``"exact"`` (rational arithmetic: ``equal`` is then a
            certificate that the residual is exactly 0; float weights are taken exactly).
        frobenius: also compute the symmetrized-Frobenius residual (needs equal depths).
        rtol: float backends only: ``equal`` iff ``residual <= rtol * ||f||^2``.

    Returns:
        a [`DecompositionCheck`][tensoralg.decompose.sums.DecompositionCheck].

    Raises:
        ValueError: no components, components with other input or output sizes, a bad
            ``output`` or ``backend``; tensoralg.CostTooHigh: an exact Gaussian inner product
            over the planner's budget.
    """
    import tensoralg as ta

    f = vector_network(model, "model")
    if isinstance(components, (Layer, dict)) or hasattr(components, "to_network"):
        raise TypeError("components: expected a list of networks, got a single network")
    comps = [vector_network(g, f"components[{i}]") for i, g in enumerate(components)]
    if not comps:
        raise ValueError("components: expected at least one component network")
    _check_sizes(f, comps, "components", ref_name="the model")
    if backend not in ("numpy", "exact"):
        raise ValueError(f"backend: expected 'numpy' or 'exact', got {backend!r}")
    output_vector(output, f.out_features)
    exact = backend == "exact"
    nets = [f] + comps
    G = gram_mixed(nets, "gaussian", backend, output) if _gram is None else _gram
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
            GF = gram_mixed(nets, "frobenius", backend, output)
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
    if not n2 > 0:
        notes.append("the model has norm zero (a zero function, e.g. the difference of two "
                     "identical checkpoints): shares, attribution and interference are "
                     "undefined (NaN)")
    return DecompositionCheck(equal=bool(equal), certified=bool(exact and equal),
                              residual=residual, residual_frobenius=residual_f, norm2=norm2,
                              relative_residual=rel, gram=G, gram_frobenius=GF, share=share,
                              attribution=attribution, interference=float(inter),
                              backend=backend, residual_route=route, notes=notes)
