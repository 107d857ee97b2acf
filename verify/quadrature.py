"""Exact Gaussian inner products on low-dimensional slices, by Gauss–Hermite quadrature.

The oracle of docs/mathematics.md §3.9 (docs/quadrature.md). A network ``f`` (vector model: input ``x`` of size ``d``;
sequence model: input ``X`` of shape ``(n_ctx, d)``) of polynomial degree at most ``K`` is
restricted to a *slice*: an affine map of ``N`` independent standard Gaussian variables,

    X(Y) = offset + sum_i Y_i B_i,      Y ~ N(0, I_N),      g(Y) = f(X(Y)),

with ``B_i`` of the input's shape (``(d,)`` or ``(n_ctx, d)``). The usual slice has
orthonormal directions ``B_i`` (in the Frobenius inner product of the input space) and
``offset = 0``: then ``X(Y)`` is the standard Gaussian ``N(0, I)`` of the input space
*conditioned on* lying in ``span(B_1..B_N)`` — equivalently, ``X ~ N(0, I)`` projected
orthogonally onto that span. For sequences built with
[`GaussianSlice.from_basis`][verify.quadrature.GaussianSlice.from_basis], position ``t`` in
``positions`` gets ``x_t = P_t^T y_t`` (``P_t`` an orthonormal ``(N_t, d)`` basis, ``y_t`` its own
``N_t`` Gaussian variables) and every other position's input is exactly 0 (the lifted constant 1 is
still there: biases act at every position). ``N = sum_t N_t``.

Computed here, with no sampling and no tensoralg fast path (only the layers' forward pass,
``net(X)`` on a NumPy batch):

* `quadrature_inner` — ``<g_a, g_b> = sum_t sum_o E_Y[g_a(Y)[t,o] g_b(Y)[t,o]]`` (the sum
  over output positions ``t`` and outputs ``o`` that ``tensoralg.inner`` uses);
* `quadrature_similarity` — ``<g_a, g_b> / sqrt(<g_a, g_a><g_b, g_b>)``;
* `chaos_profile` — the Wiener-chaos (Hermite order) decomposition
  ``<g_a, g_b> = sum_k <P_k g_a, P_k g_b>``, ``P_k`` the orthogonal projection onto the span of
  the tensor Hermite polynomials ``He_alpha(Y) = prod_i He_{alpha_i}(Y_i)`` with ``|alpha| = k``.

**Theorem (Gauss–Hermite exactness).** With the ``m`` probabilists' Gauss–Hermite nodes
``y_j`` (the roots of ``He_m``) and weights ``w_j`` normalized to sum 1
(``numpy.polynomial.hermite_e.hermegauss``), ``sum_j w_j p(y_j) = E_{y~N(0,1)}[p(y)]`` for every
polynomial ``p`` of degree ``<= 2m - 1`` (Gauss 1814; Golub & Welsch, Math. Comp. 23, 1969;
Abramowitz & Stegun 25.4.46). The tensor-product rule on ``m^N`` points is therefore exact for
every polynomial whose degree in each variable separately is ``<= 2m - 1`` (Fubini). Here
``g_a g_b`` has degree ``<= 2K`` in each ``Y_i`` and ``g He_alpha`` (``alpha_i <= K``) too, so
``m = K + 1`` nodes per variable make every number below exact in exact arithmetic.

**Error in float64.** The only error is rounding: each network value carries the forward
pass's own float64 rounding, and the weighted sum of ``m^N`` terms adds about
``eps * sum_j w_j |g_a(y_j) g_b(y_j)|`` (``eps = 2.2e-16``). The results carry that sum
(``abs_sum``) so a caller can see when cancellation makes the relative error large: the
relative error is of order ``eps * abs_sum / |value|`` times a modest factor (the forward
pass's condition), not a rigorous bound. The Hermite coefficients are computed in the
orthonormal basis ``psi_k = He_k / sqrt(k!)`` (three-term recurrence; the matrix
``sqrt(w_j) psi_k(y_j)`` is orthogonal), so they are as well conditioned as the values.

Degree: ``K = max(a.degree, b.degree)`` from the layers (an upper bound: products of layer
degrees); a larger ``degree=`` is accepted (more nodes, still exact), a smaller one is refused
(fewer nodes would not be exact for the network's structure).

Cost: ``m^N`` forward evaluations per network (refused above ``max_points``, default
``MAX_POINTS = 2e7``: e.g. ``K = 25`` (two bilinear-attention layers, ``m = 26``) allows
``N <= 5``). Memory: batches of ``batch_size`` points; `chaos_profile` keeps per network
one block of ``m^(N-1)`` values and ``C(K+N, N)`` coefficients per output (refused above
``max_memory`` bytes).

Planted models whose function of the full input is exactly one of these slices live in
[`tensoralg.verify.planted`][verify.planted].
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.polynomial.hermite_e import hermegauss

__all__ = ["GaussianSlice", "QuadratureInner", "QuadratureSimilarity", "ChaosProfile",
           "quadrature_inner", "quadrature_similarity", "chaos_profile", "gauss_hermite",
           "MAX_POINTS", "MAX_MEMORY", "ORTHONORMAL_TOL"]

MAX_POINTS = 20_000_000          #: default cap on the grid size m**N (network evaluations)
MAX_MEMORY = 2 * 1024 ** 3       #: default cap (bytes) on chaos_profile's arrays
ORTHONORMAL_TOL = 1e-10          #: max |B B^T - I| accepted as orthonormal
_EPS = float(np.finfo(np.float64).eps)


# ----------------------------------------------------------------------------------------
# the slice
# ----------------------------------------------------------------------------------------

def _finite_array(value: Any, name: str) -> np.ndarray:
    try:
        arr = np.array(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: cannot read as a real array ({exc})") from None
    if not np.all(np.isfinite(arr)):
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise ValueError(f"{name}: {bad} non-finite (NaN or inf) entries in an array of shape "
                         f"{arr.shape}")
    return arr


def _check_orthonormal(rows: np.ndarray, name: str) -> None:
    gram = rows @ rows.T
    err = float(np.max(np.abs(gram - np.eye(rows.shape[0])))) if rows.size else 0.0
    if err > ORTHONORMAL_TOL:
        raise ValueError(f"{name}: the {rows.shape[0]} directions are not orthonormal "
                         f"(max |B B^T - I| = {err:.3g} > {ORTHONORMAL_TOL:g}); orthonormalize "
                         f"them (numpy.linalg.qr) or use GaussianSlice.affine for a general "
                         f"linear map")


@dataclass(frozen=True, eq=False)
class GaussianSlice:
    """The inputs ``X(Y) = offset + sum_i Y_i directions[i]``, ``Y ~ N(0, I_N)``.

    Attributes:
        directions: ``(N,) + input_shape`` float64; ``input_shape`` is ``(d,)`` for vector
            models and ``(n_ctx, d)`` for sequence models.
        offset: ``input_shape`` float64 (zeros for a linear slice).
        orthonormal: True when the directions are orthonormal and the offset is 0 (then the
            slice is ``N(0, I)`` of the input space conditioned on the span of the directions).

    Build with [`from_basis`][verify.quadrature.GaussianSlice.from_basis] (orthonormal, checked) or
    [`affine`][verify.quadrature.GaussianSlice.affine] (any map).
    """

    directions: np.ndarray
    offset: np.ndarray
    orthonormal: bool

    @property
    def n_variables(self) -> int:
        """``N``, the number of Gaussian variables."""
        return int(self.directions.shape[0])

    @property
    def input_shape(self) -> tuple:
        return tuple(self.offset.shape)

    @property
    def is_sequence(self) -> bool:
        return self.offset.ndim == 2

    def inputs(self, y: np.ndarray) -> np.ndarray:
        """``X(Y)`` for a batch ``y`` of shape ``(n, N)``: shape ``(n,) + input_shape``."""
        flat = self.directions.reshape(self.n_variables, -1)
        return (self.offset.reshape(-1)[None, :] + y @ flat).reshape((-1,) + self.input_shape)

    @classmethod
    def from_basis(cls, basis: Any, *, d: int, n_ctx: int | None = None,
                   positions: Sequence[int] | None = None) -> GaussianSlice:
        """An orthonormal linear slice.

        Args:
            basis: vector models (``n_ctx=None``): an ``(N, d)`` array with orthonormal rows.
                Sequence models: one ``(N_t, d)`` array (the same basis at every position in
                ``positions``; default all ``n_ctx`` positions) or a list of such arrays, one per
                position in ``positions`` (default the prefix ``0 .. len(basis) - 1``). Position
                ``t`` gets ``x_t = P_t^T y_t``; the other positions' inputs are 0.
            d: the input size; n_ctx: the sequence length (None for vector models).
            positions: distinct positions in ``[0, n_ctx)``.

        Raises:
            ValueError: rows that are not orthonormal (``|P P^T - I| > ORTHONORMAL_TOL``),
                wrong shapes, non-finite entries, bad or repeated positions, no variables.
        """
        if n_ctx is None:
            if positions is not None:
                raise ValueError("positions: only for sequence slices (give n_ctx)")
            P = _finite_array(basis, "basis")
            if P.ndim != 2 or P.shape[1] != d or P.shape[0] < 1:
                raise ValueError(f"basis: expected an (N, {d}) array with N >= 1 for a vector "
                                 f"model with d={d}, got shape {P.shape}")
            _check_orthonormal(P, "basis")
            return cls(P, np.zeros(d), True)
        n_ctx = _positive_int(n_ctx, "n_ctx")
        if isinstance(basis, (list, tuple)) and basis and not np.isscalar(basis[0]) and \
                np.ndim(basis[0]) == 2:
            bases = [_finite_array(p, f"basis[{i}]") for i, p in enumerate(basis)]
            if positions is None:
                positions = list(range(len(bases)))
            elif len(positions) != len(bases):
                raise ValueError(f"positions: {len(positions)} positions for {len(bases)} "
                                 f"per-position bases")
        else:
            P = _finite_array(basis, "basis")
            positions = list(range(n_ctx)) if positions is None else list(positions)
            bases = [P] * len(positions)
        pos = []
        for p in positions:
            if isinstance(p, bool) or not isinstance(p, numbers.Integral) or not 0 <= p < n_ctx:
                raise ValueError(f"positions: expected ints in [0, {n_ctx}), got {p!r}")
            pos.append(int(p))
        if len(set(pos)) != len(pos):
            raise ValueError(f"positions: repeated position in {pos}")
        rows = []
        for i, (t, P) in enumerate(zip(pos, bases)):
            if P.ndim != 2 or P.shape[1] != d:
                raise ValueError(f"basis[{i}]: expected an (N_t, {d}) array for position {t}, "
                                 f"got shape {P.shape}")
            _check_orthonormal(P, f"basis[{i}] (position {t})")
            for r in P:
                B = np.zeros((n_ctx, d))
                B[t] = r
                rows.append(B)
        if not rows:
            raise ValueError("basis: the slice has no Gaussian variables (N = 0)")
        return cls(np.stack(rows), np.zeros((n_ctx, d)), True)

    @classmethod
    def affine(cls, directions: Any, offset: Any = None) -> GaussianSlice:
        """A general affine slice ``X = offset + sum_i Y_i directions[i]`` (no orthonormality
        asked): the input distribution is then ``N(offset, sum_i B_i B_i^T)``.

        Args:
            directions: ``(N, d)`` (vector models) or ``(N, n_ctx, d)`` (sequence models).
            offset: ``(d,)`` / ``(n_ctx, d)`` or None (zero).

        Raises:
            ValueError: wrong shapes, non-finite entries, N = 0.
        """
        B = _finite_array(directions, "directions")
        if B.ndim not in (2, 3) or B.shape[0] < 1:
            raise ValueError(f"directions: expected (N, d) or (N, n_ctx, d) with N >= 1, got "
                             f"shape {B.shape}")
        off = np.zeros(B.shape[1:]) if offset is None else _finite_array(offset, "offset")
        if off.shape != B.shape[1:]:
            raise ValueError(f"offset: expected shape {B.shape[1:]} to match directions of "
                             f"shape {B.shape}, got {off.shape}")
        flat = B.reshape(B.shape[0], -1)
        ortho = not np.any(off) and float(np.max(np.abs(flat @ flat.T - np.eye(len(B))))) <= \
            ORTHONORMAL_TOL
        return cls(B, off, ortho)


# ----------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------

def _positive_int(v: Any, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {v!r}")
    return int(v)


def _network(net: Any, name: str):
    from tensoralg.layers import as_network

    try:
        net = as_network(net, name)
    except TypeError as exc:
        raise TypeError(str(exc)) from None
    return net.astype_float() if net.is_exact else net


def gauss_hermite(m: int) -> tuple:
    """The ``m``-point probabilists' Gauss–Hermite rule: nodes ``y`` (``(m,)``, the roots of
    ``He_m``) and weights ``w`` (``(m,)``, summing to 1) with ``sum_j w_j p(y_j) =
    E_{y~N(0,1)} p(y)`` for every polynomial of degree ``<= 2m - 1``."""
    m = _positive_int(m, "m")
    y, w = hermegauss(m)
    return y, w / w.sum()


def _hermite_orthonormal(y: np.ndarray, kmax: int) -> np.ndarray:
    """``psi_k(y_j) = He_k(y_j) / sqrt(k!)`` for ``k = 0..kmax``: array ``(kmax + 1, len(y))``,
    by the recurrence ``psi_{k+1} = (y psi_k - sqrt(k) psi_{k-1}) / sqrt(k + 1)``."""
    out = np.empty((kmax + 1, y.size))
    out[0] = 1.0
    if kmax >= 1:
        out[1] = y
    for k in range(1, kmax):
        out[k + 1] = (y * out[k] - math.sqrt(k) * out[k - 1]) / math.sqrt(k + 1)
    return out


@dataclass(frozen=True)
class _Setup:
    nets: tuple
    slice: GaussianSlice
    degree: int
    m: int
    nodes: np.ndarray
    weights: np.ndarray
    position: int | None
    output: Any
    batch_size: int
    n_points: int


def _setup(nets: Sequence[Any], basis: Any, n_ctx, positions, degree, output, position,
           max_points, batch_size) -> _Setup:
    """Validate everything (networks, slice, degree, output, cost) before any evaluation."""
    nets = tuple(_network(n, name) for n, name in zip(nets, ("a", "b")))
    d, d_out = nets[0].in_features, nets[0].out_features
    for n, _name in zip(nets[1:], ("b",)):
        if n.in_features != d or n.out_features != d_out:
            raise ValueError(f"a and b must have the same input and output sizes: a is {d} -> "
                             f"{d_out}, b is {n.in_features} -> {n.out_features}")
    fixed = {n.n_ctx for n in nets if n.n_ctx is not None}
    if len(fixed) > 1:
        raise ValueError(f"a and b: attention masks fix different n_ctx {sorted(fixed)}")
    sequence = any(n.is_sequence_model for n in nets)
    if isinstance(basis, GaussianSlice):
        if positions is not None:
            raise ValueError("positions: give them to GaussianSlice.from_basis, not with a "
                             "GaussianSlice")
        sl = basis
        shape = sl.input_shape
        if shape[-1] != d:
            raise ValueError(f"basis: the slice has input shape {shape}; the networks read "
                             f"d={d} features")
        if sequence and not sl.is_sequence:
            raise ValueError(f"basis: a sequence model needs a slice of shape (N, n_ctx, {d}), "
                             f"got directions of shape {sl.directions.shape}")
        if sl.is_sequence and n_ctx is not None and shape[0] != n_ctx:
            raise ValueError(f"n_ctx={n_ctx} differs from the slice's n_ctx={shape[0]}")
        if sl.is_sequence and fixed and shape[0] not in fixed:
            raise ValueError(f"basis: the slice has n_ctx={shape[0]} but the attention mask "
                             f"fixes n_ctx={fixed.pop()}")
        if not sl.is_sequence and n_ctx is not None:
            raise ValueError("n_ctx: the slice is a vector slice (directions of shape (N, d))")
    else:
        if n_ctx is None and fixed:
            n_ctx = next(iter(fixed))
        if n_ctx is not None:
            n_ctx = _positive_int(n_ctx, "n_ctx")
            if fixed and n_ctx not in fixed:
                raise ValueError(f"n_ctx={n_ctx} differs from the attention mask's "
                                 f"n_ctx={next(iter(fixed))}")
        elif sequence:
            raise ValueError("n_ctx: a sequence model (with attention) needs the sequence length")
        sl = GaussianSlice.from_basis(basis, d=d, n_ctx=n_ctx, positions=positions)
    n_pos = sl.input_shape[0] if sl.is_sequence else None
    if position is not None:
        if n_pos is None:
            raise ValueError("position: only for sequence slices")
        if isinstance(position, bool) or not isinstance(position, numbers.Integral) or \
                not 0 <= position < n_pos:
            raise ValueError(f"position: expected an int in [0, {n_pos}) or None, got "
                             f"{position!r}")
        position = int(position)
    if output is not None:
        if isinstance(output, numbers.Integral) and not isinstance(output, bool):
            if not 0 <= output < d_out:
                raise ValueError(f"output: index {output} out of range for {d_out} outputs")
            output = int(output)
        elif isinstance(output, (str, bool)):
            raise ValueError(f"output: expected None, an int or a vector of shape ({d_out},), "
                             f"got {output!r}")
        else:
            u = _finite_array(output, "output").reshape(-1)
            if u.shape != (d_out,):
                raise ValueError(f"output: a direction vector must have shape ({d_out},), got "
                                 f"{u.shape}")
            output = u
    structural = max(int(n.degree) for n in nets)
    if degree is None:
        K = structural
    else:
        K = _positive_int(degree, "degree", 0)
        if structural > K:
            raise ValueError(f"degree: {K} is below the networks' structural degree "
                             f"{structural}; m = degree + 1 nodes would not be exact")
    m = K + 1
    N = sl.n_variables
    n_points = m ** N
    max_points = _positive_int(max_points, "max_points")
    if n_points > max_points:
        raise ValueError(f"basis: N = {N} Gaussian variables at m = {m} nodes each (degree "
                         f"{K}) is a grid of {m}^{N} = {n_points:.3g} points, i.e. "
                         f"{n_points:.3g} forward evaluations per network; the cap is "
                         f"max_points = {max_points:.3g} (use fewer variables)")
    if batch_size is None:
        width = max([d, d_out] + [getattr(n, "hidden_features", 0) for n in nets])
        per_point = (n_pos or 1) * max(width, 1) * max(n_pos or 1, 1)
        batch_size = max(1, min(65_536, 2 ** 21 // per_point))
    batch_size = _positive_int(batch_size, "batch_size")
    y, w = gauss_hermite(m)
    return _Setup(nets, sl, K, m, y, w, position, output, batch_size, n_points)


def _values(s: _Setup, net, y: np.ndarray) -> np.ndarray:
    """``g(y)`` for a batch ``y`` ``(n, N)``, flattened to ``(n, n_out)`` (positions x outputs).

    Raises FloatingPointError when the forward pass overflows to inf/NaN on the grid."""
    out = np.asarray(net(s.slice.inputs(y)), dtype=np.float64)
    if not np.all(np.isfinite(out)):
        raise FloatingPointError(f"the network's values are not finite (inf/NaN) on the "
                                 f"quadrature grid (nodes up to |y| = {s.nodes.max():.3g}): "
                                 f"float64 overflow; rescale the network or the slice")
    if s.position is not None:
        out = out[:, s.position]
    if isinstance(s.output, int):
        out = out[..., s.output]
    elif s.output is not None:
        out = out @ s.output
    return out.reshape(out.shape[0], -1)


def _grid(s: _Setup, flat: np.ndarray):
    """Nodes ``(len(flat), N)`` and product weights ``(len(flat),)`` of flat grid indices."""
    idx = np.unravel_index(flat, (s.m,) * s.slice.n_variables)
    y = np.stack([s.nodes[i] for i in idx], axis=1)
    w = np.prod(np.stack([s.weights[i] for i in idx], axis=1), axis=1)
    return y, w


def _sums(s: _Setup):
    """Exact-quadrature sums over the grid: the ``<g_i, g_j>`` of every pair of networks and
    ``sum_j w_j |g_a g_b|`` of each pair (rounding scale), accumulated with ``math.fsum``."""
    k = len(s.nets)
    pairs = [(i, j) for i in range(k) for j in range(i, k)]
    parts = {p: [] for p in pairs}
    absp = {p: [] for p in pairs}
    for start in range(0, s.n_points, s.batch_size):
        y, w = _grid(s, np.arange(start, min(start + s.batch_size, s.n_points)))
        g = [_values(s, n, y) for n in s.nets]
        for i, j in pairs:
            prod = np.einsum("no,no->n", g[i], g[j])
            parts[(i, j)].append(float(w @ prod))
            absp[(i, j)].append(float(w @ np.abs(prod)))
    return ({p: math.fsum(v) for p, v in parts.items()},
            {p: math.fsum(v) for p, v in absp.items()})


# ----------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuadratureInner:
    """``<g_a, g_b>`` on a slice, exact up to float64 rounding.

    Attributes:
        value: the inner product (units: products of the networks' outputs).
        abs_sum: ``sum_j w_j |g_a(y_j) . g_b(y_j)|`` over the grid; ``eps * abs_sum`` is the
            scale of the summation's rounding error.
        degree: ``K``; nodes: ``m = K + 1`` per variable; n_variables: ``N``;
        n_points: ``m^N`` evaluations per network.
    """

    value: float
    abs_sum: float
    degree: int
    nodes: int
    n_variables: int
    n_points: int

    def __float__(self) -> float:
        return float(self.value)

    @property
    def rounding_scale(self) -> float:
        """``eps * abs_sum``: the size of float64 summation rounding (not a rigorous bound)."""
        return _EPS * self.abs_sum


@dataclass(frozen=True)
class QuadratureSimilarity:
    """``<g_a, g_b> / sqrt(<g_a, g_a> <g_b, g_b>)`` on a slice, with its three inner products
    (all from the same grid)."""

    value: float
    ab: float
    aa: float
    bb: float
    degree: int
    nodes: int
    n_variables: int
    n_points: int

    def __float__(self) -> float:
        return float(self.value)


@dataclass(frozen=True)
class ChaosProfile:
    """Wiener-chaos decomposition on a slice: ``<g_a, g_b> = sum_{k=0..K} cross[k]``.

    Attributes:
        cross: ``(K + 1,)`` ``<P_k g_a, P_k g_b>`` per Hermite order ``k`` (``= norms_a`` when
            ``b`` is None).
        norms_a, norms_b: ``(K + 1,)`` ``||P_k g||^2`` per order (``norms_b`` None without b).
        total, total_a, total_b: ``<g_a, g_b>``, ``||g_a||^2``, ``||g_b||^2`` by direct
            quadrature of the products (not from the coefficients).
        above_degree: ``total - cross.sum()``: the discrete transform's mass at orders above
            ``K`` (0 in exact arithmetic when the degree is right; a float64-rounding number
            otherwise small).
        degree, nodes, n_variables, n_points: as in
            [`QuadratureInner`][verify.quadrature.QuadratureInner].
    """

    cross: np.ndarray
    norms_a: np.ndarray
    norms_b: np.ndarray | None
    total: float
    total_a: float
    total_b: float | None
    above_degree: float
    degree: int
    nodes: int
    n_variables: int
    n_points: int

    def similarity_by_order(self) -> np.ndarray:
        """``cross[k] / sqrt(norms_a[k] norms_b[k])`` (NaN where a norm is 0)."""
        nb = self.norms_a if self.norms_b is None else self.norms_b
        den = np.sqrt(self.norms_a * nb)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, self.cross / np.where(den > 0, den, 1.0), np.nan)


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------

_ARGS_DOC = """
    Args:
        a, b: tensoralg networks (``Sequential``, ``Linear``, ``Bilinear``, ``Residual``,
            ``BilinearAttention``; lists or specs) with the same input size ``d`` and output
            size ``d_out``. Rational weights are rounded to float64.
        basis: a `GaussianSlice`, or what `GaussianSlice.from_basis` reads: an
            ``(N, d)`` orthonormal array (vector models; for sequence models the same basis at
            every position in ``positions``), or a list of ``(N_t, d)`` orthonormal arrays, one
            per position in ``positions`` (default the prefix ``0..len-1``).
        n_ctx: the sequence length (needed for sequence models unless a mask array fixes it).
        positions: the positions the slice varies (sequence models); the others are input 0.
        degree: the polynomial degree ``K`` (default: the layers' structural degree; a larger
            value is accepted, a smaller one refused). ``m = K + 1`` nodes per variable.
        output: None (sum over outputs), an int ``o``, or a vector ``u`` of shape ``(d_out,)``
            (``u . f``).
        position: None (sum over output positions) or an int ``t`` (sequence models).
        max_points: refuse when ``m^N`` exceeds it (default ``MAX_POINTS``).
        batch_size: grid points per forward call (default: about 2^21 floats of input).

    Raises:
        ValueError: (all before any evaluation) a slice that is not orthonormal, has the wrong
            shape or non-finite entries; mismatched networks; a missing or inconsistent
            ``n_ctx``; a bad ``position``/``output``/``degree``; a grid above ``max_points``
            (the message names ``N``, ``m`` and ``m^N``).
        TypeError: not a network.
        FloatingPointError: the forward pass overflows float64 on the grid.
"""


def quadrature_inner(a: Any, b: Any, basis: Any, *, n_ctx: int | None = None,
                     positions: Sequence[int] | None = None, degree: int | None = None,
                     output: Any = None, position: int | None = None,
                     max_points: int = MAX_POINTS,
                     batch_size: int | None = None) -> QuadratureInner:
    s = _setup((a,) if b is None else (a, b), basis, n_ctx, positions, degree, output,
               position, max_points, batch_size)
    sums, absums = _sums(s)
    key = (0, 0) if len(s.nets) == 1 else (0, 1)
    return QuadratureInner(sums[key], absums[key], s.degree, s.m, s.slice.n_variables,
                           s.n_points)


quadrature_inner.__doc__ = """Exact ``<g_a, g_b> = sum_t sum_o E_Y[g_a(Y)[t,o] g_b(Y)[t,o]]``
    on a Gaussian slice ``g(Y) = f(X(Y))`` (module docstring), by the tensor-product
    Gauss–Hermite rule with ``m = K + 1`` nodes per variable (exact for per-variable degree
    ``<= 2m - 1``; float64 rounding only). ``b=None`` gives ``||g_a||^2``.

    When the networks depend on the input only through the slice's span (the planted models of
    `tensoralg.verify.planted`), this is the exact full Gaussian inner product ``<f_a, f_b>``.
""" + _ARGS_DOC + """
    Returns:
        `QuadratureInner` (``float(result)`` is the value).
"""


def quadrature_similarity(a: Any, b: Any, basis: Any, *, n_ctx: int | None = None,
                          positions: Sequence[int] | None = None,
                          degree: int | None = None, output: Any = None,
                          position: int | None = None, max_points: int = MAX_POINTS,
                          batch_size: int | None = None) -> QuadratureSimilarity:
    s = _setup((a, b), basis, n_ctx, positions, degree, output, position, max_points,
               batch_size)
    sums, _ = _sums(s)
    ab, aa, bb = sums[(0, 1)], sums[(0, 0)], sums[(1, 1)]
    for name, v in (("a", aa), ("b", bb)):
        if not v > 0:
            raise ValueError(f"{name}: zero norm on this slice (||g_{name}||^2 = {v:.3g}); the "
                             f"similarity is undefined")
    return QuadratureSimilarity(ab / math.sqrt(aa * bb), ab, aa, bb, s.degree, s.m,
                                s.slice.n_variables, s.n_points)


quadrature_similarity.__doc__ = """Exact similarity ``<g_a, g_b> / sqrt(<g_a, g_a><g_b, g_b>)``
    on a Gaussian slice (see `quadrature_inner`; the three inner products come from one
    pass over the grid).
""" + _ARGS_DOC + """
    Also raises ValueError (after the pass) when a network has zero norm on the slice.

    Returns:
        `QuadratureSimilarity`.
"""


def _packed_orders(m: int, n: int, K: int):
    """Flat indices into ``(m,)*n`` of the multi-indices with ``|alpha| <= K``, sorted by
    ``|alpha|`` (stable), their orders, and ``prefix[r]`` = how many have ``|alpha| <= r``."""
    if n == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.ones(K + 1, int)
    order = np.indices((m,) * n).reshape(n, -1).sum(axis=0)
    keep = np.flatnonzero(order <= K)
    keep = keep[np.argsort(order[keep], kind="stable")]
    orders = order[keep]
    prefix = np.searchsorted(orders, np.arange(K + 1), side="right")
    return keep, orders, prefix


def chaos_profile(a: Any, b: Any = None, basis: Any = None, *, n_ctx: int | None = None,
                  positions: Sequence[int] | None = None, degree: int | None = None,
                  output: Any = None, position: int | None = None,
                  max_points: int = MAX_POINTS, max_memory: float = MAX_MEMORY,
                  batch_size: int | None = None) -> ChaosProfile:
    if basis is None:
        raise ValueError("basis: chaos_profile needs a slice (an orthonormal basis or a "
                         "GaussianSlice)")
    nets = (a,) if b is None else (a, b)
    s = _setup(nets, basis, n_ctx, positions, degree, output, position, max_points, batch_size)
    N, m, K = s.slice.n_variables, s.m, s.degree
    n_out = (1 if s.output is not None else s.nets[0].out_features) * \
        (s.slice.input_shape[0] if s.slice.is_sequence and s.position is None else 1)
    block = m ** (N - 1)
    n_coef = math.comb(K + N, N)
    need = 8.0 * n_out * len(s.nets) * (3 * block + n_coef) + 8.0 * block * (N + 2)
    if need > max_memory:
        raise ValueError(f"max_memory: the chaos profile needs about {need / 2**20:.4g} MiB "
                         f"(N = {N}, m = {m}, {n_out} outputs: blocks of {block} values and "
                         f"{n_coef} coefficients per output and network) > max_memory = "
                         f"{max_memory / 2**20:.4g} MiB; pass output= or position=, or fewer "
                         f"variables")
    W = _hermite_orthonormal(s.nodes, K) * s.weights[None, :]   # W[k, j] = w_j psi_k(y_j)
    keep, orders_rest, prefix = _packed_orders(m, N - 1, K)
    acc = [[np.zeros((prefix[K - k1], n_out)) for k1 in range(K + 1)] for _ in s.nets]
    k = len(s.nets)
    pairs = [(i, j) for i in range(k) for j in range(i, k)]
    totals = {p: [] for p in pairs}
    rest_y = [s.nodes] * (N - 1)
    rest_w = [s.weights] * (N - 1)
    for j1 in range(m):
        G = [np.empty((block, n_out)) for _ in s.nets]
        for start in range(0, block, s.batch_size):
            flat = np.arange(start, min(start + s.batch_size, block))
            idx = np.unravel_index(flat, (m,) * (N - 1)) if N > 1 else ()
            y = np.stack([np.full(flat.size, s.nodes[j1])] + [ry[i] for ry, i in
                                                               zip(rest_y, idx)], axis=1)
            for g, net in zip(G, s.nets):
                g[start:start + flat.size] = _values(s, net, y)
        w_rest = np.ones(block)
        if N > 1:
            w_rest = np.prod(np.stack([rw[i] for rw, i in
                                       zip(rest_w, np.unravel_index(np.arange(block),
                                                                    (m,) * (N - 1)))]), axis=0)
        wj = s.weights[j1] * w_rest
        for i, j in pairs:
            totals[(i, j)].append(float(wj @ np.einsum("no,no->n", G[i], G[j])))
        for g, A in zip(G, acc):
            T = g.reshape((m,) * (N - 1) + (n_out,))
            for ax in range(N - 1):           # Hermite transform along the trailing axes
                T = np.moveaxis(np.tensordot(W, T, axes=([1], [ax])), 0, ax)
            B = T.reshape(block, n_out)[keep]
            for k1 in range(K + 1):
                A[k1] += W[k1, j1] * B[:prefix[K - k1]]
    tot = {p: math.fsum(v) for p, v in totals.items()}

    def per_order(i, j):
        out = np.zeros(K + 1)
        for k1 in range(K + 1):
            n = prefix[K - k1]
            contrib = np.einsum("no,no->n", acc[i][k1], acc[j][k1])
            out += np.bincount(orders_rest[:n] + k1, weights=contrib, minlength=K + 1)[:K + 1]
        return out

    na = per_order(0, 0)
    if k == 1:
        return ChaosProfile(na, na, None, tot[(0, 0)], tot[(0, 0)], None,
                            tot[(0, 0)] - float(na.sum()), K, m, N, s.n_points)
    nb, cross = per_order(1, 1), per_order(0, 1)
    return ChaosProfile(cross, na, nb, tot[(0, 1)], tot[(0, 0)], tot[(1, 1)],
                        tot[(0, 1)] - float(cross.sum()), K, m, N, s.n_points)


chaos_profile.__doc__ = """Wiener-chaos (Hermite order) decomposition on a Gaussian slice.

    The Hermite coefficients of ``g`` in the orthonormal tensor basis
    ``psi_alpha = He_alpha / sqrt(alpha!)`` are ``a_alpha = E[g psi_alpha]`` (so the usual
    ``c_alpha = E[g He_alpha] / alpha! = a_alpha / sqrt(alpha!)``), computed with the same
    ``m = K + 1``-node rule (exact: ``g psi_alpha`` has per-variable degree ``<= 2K``). Then
    ``<P_k g_a, P_k g_b> = sum_{|alpha| = k} sum_{t,o} a^a_alpha a^b_alpha``
    ``= sum_{|alpha|=k} alpha! c^a_alpha c^b_alpha``, and the orders ``0..K`` sum to the total
    (the chaos spaces are orthogonal; Wiener 1938, Cameron & Martin 1947; docs/mathematics.md §3.6).

    Scaling: for ``f(sigma x)`` (inputs ``N(0, sigma^2 I)``: the slice ``sigma * P``) order ``k``
    collects the monomial degrees ``k, k + 2, k + 4, ...``
    (``C_k = sum_j (k+2j)!/(k! j! 2^j) tr^j M_{k+2j}``, docs/mathematics.md §3.6), so orders ``K`` and
    ``K - 1`` scale exactly by ``sigma^(2K)`` and ``sigma^(2K-2)``; every order scales by
    ``sigma^(2n)`` when ``f`` is homogeneous of degree ``n``; other orders mix degrees
    (chaos orders are not homogeneous parts).

    The transform streams over the first variable's nodes, one block of ``m^(N-1)`` points at a
    time, keeping only the ``C(K + N, N)`` coefficients with ``|alpha| <= K`` per output.
""" + _ARGS_DOC + """        max_memory: bytes; refused (before any evaluation) above it.

    Returns:
        `ChaosProfile`.
"""
