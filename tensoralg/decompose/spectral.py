"""Chaos coefficients of depth-1 networks and their eigen-components (docs/mathematics.md §3.6, §3.8):
[`chaos_coefficients_depth1`][tensoralg.decompose.spectral.chaos_coefficients_depth1],
[`eigen`][tensoralg.decompose.spectral.eigen], and a depth-1 network as one bilinear layer
([`as_bilinear_depth1`][tensoralg.decompose.spectral.as_bilinear_depth1])."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ..layers import Bilinear, Layer, Linear, Residual, Sequential
from ._common import (
    DEPTH_HINT,
    as_array,
    bilinear_depth,
    identity_matrix,
    output_vector,
    vector_network,
    zeros_array,
)


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
    """Compose the layers of a depth-1 network into the factored form of `_Quad`
    (lifted bilinear factors in input coordinates; an embedding is folded into them)."""
    if q is None:
        d = net.in_features
        q = _Quad(zeros_array((d,), exact), identity_matrix(d, exact), zeros_array((d, 0), exact),
                  zeros_array((0, d + 1), exact), zeros_array((0, d + 1), exact), exact)
    if isinstance(net, Sequential):
        for layer in net.layers:
            q = _quadratic_form(layer, exact, name, q)
        return q
    if isinstance(net, Linear):
        W = as_array(net.weight, exact)
        c = W @ q.c + (as_array(net.bias, exact) if net.bias is not None else 0)
        return _Quad(c, W @ q.B, W @ q.D, q.Lt, q.Rt, exact)
    if isinstance(net, Bilinear):
        if not q.affine:
            raise ValueError(f"{name}: a bilinear layer reads the output of another bilinear "
                             f"layer (degree 4 or more); {DEPTH_HINT}")

        def lift(W, b):
            out = zeros_array((W.shape[0], q.B.shape[1] + 1), exact)
            out[:, 0] = W @ q.c + (as_array(b, exact) if b is not None else 0)
            out[:, 1:] = W @ q.B
            return out
        Lt = lift(as_array(net.left, exact), net.left_bias)
        Rt = lift(as_array(net.right, exact), net.right_bias)
        O, d = net.out_features, q.B.shape[1]
        c = as_array(net.down_bias, exact) if net.down_bias is not None else zeros_array((O,), exact)
        return _Quad(c, zeros_array((O, d), exact), as_array(net.down, exact), Lt, Rt, exact)
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
    (docs/mathematics.md §3.6). Shapes: ``C0 (K,)``, ``C1 (K, d)``, ``C2 (K, d, d)`` symmetric, ``K`` outputs
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
    degree-2 polynomial ``C0 = c' + tr A``, ``C1 = b``, ``C2 = A`` (docs/mathematics.md §3.6, from
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
    net = vector_network(net, "net")
    if bilinear_depth(net) > 1:
        raise ValueError(f"net: bilinear depth {bilinear_depth(net)} (degree up to "
                         f"{net.degree}); {DEPTH_HINT}")
    u = output_vector(output, net.out_features)
    exact = net.is_exact and (u is None or u.dtype == object or np.all(u == np.round(u)))
    q = _quadratic_form(net, exact, "net")
    c, B, D = q.c, q.B, q.D
    if u is not None:
        U = as_array(u, exact)[None, :]
        if exact:
            U = np.vectorize(Fraction, otypes=[object])(U)
        c, B, D = U @ c, U @ B, U @ D
    l0, l, r0, r = q.Lt[:, 0], q.Lt[:, 1:], q.Rt[:, 0], q.Rt[:, 1:]
    C0 = c + D @ (l0 * r0)
    C1 = B + D @ (l0[:, None] * r + r0[:, None] * l)
    half = Fraction(1, 2) if exact else 0.5
    K, d = C1.shape
    C2 = zeros_array((K, d, d), exact)
    for o in range(K):
        M = (l.T * D[o]) @ r
        C2[o] = (M + M.T) * half
        C0[o] = C0[o] + np.trace(C2[o])
    return ChaosCoefficients(C0, C1, C2)


@dataclass
class EigenDecomposition:
    """Eigen-components of one output (or direction) of a depth-1 network (docs/mathematics.md §3.8).

    ``f(x) = C0 + C1 . x + sum_i lambda_i He2(v_i . x)`` with ``He2(t) = t^2 - 1`` (unit ``v_i``):
    the components are mutually orthogonal under ``x ~ N(0, I_d)`` and orthogonal to the
    constant and linear parts, with ``||lambda_i He2(v_i.x)||^2 = 2 lambda_i^2``. Eigenvalues
    are sorted by ``|lambda|``, largest first; ``eigenvectors[i]`` is ``v_i`` in input space
    (shape ``(d,)``: pixels for images).

    Attributes:
        C0: the constant chaos coefficient (float).
        C1: ``(d,)``, the linear chaos coefficients (float64).
        C2: ``(d, d)``, the quadratic chaos coefficients (float64).
        eigenvalues: ``(d,)``, sorted by ``|lambda|``, largest first.
        eigenvectors: ``(d, d)``, one unit eigenvector ``v_i`` per row.
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
        part is orthogonal to ``f_k``). Returns ``{"k", "relative_error", "similarity"}``; both
        are NaN for a zero function (``||f|| = 0``: no relative error, no direction)."""
        tail = 2 * np.concatenate([np.cumsum((self.eigenvalues ** 2)[::-1])[::-1], [0.0]])
        n2 = self.norm2
        rel = tail / n2 if n2 > 0 else np.full_like(tail, np.nan)
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
    """Eigen-components of a depth-1 network's output ``output`` (docs/mathematics.md §3.8, §3.6).

    ``C2 = sum_i lambda_i v_i v_i^T`` (``numpy.linalg.eigh`` of the chaos-2 coefficient from
    [`chaos_coefficients_depth1`][tensoralg.decompose.spectral.chaos_coefficients_depth1]) gives ``f
    = C0 + C1.x + sum_i lambda_i He2(v_i.x)``.

    Args:
        model: a depth-1 network (embedding, one bilinear layer, head, biases, residual).
        output: a class index, a direction vector ``u`` (length ``O``), ``"each"`` (a list,
            one per output) or ``None`` (allowed only for a single-output network).

    Returns:
        an [`EigenDecomposition`][tensoralg.decompose.spectral.EigenDecomposition] (a list of them
        for ``"each"``).

    Raises:
        ValueError: a network of depth >= 2 (the message names check_decomposition), an output
            index out of range, a direction of the wrong length, ``None`` with several outputs.
    """
    net = vector_network(model, "model")
    if bilinear_depth(net) > 1:
        raise ValueError(f"model: bilinear depth {bilinear_depth(net)} (degree up to "
                         f"{net.degree}); {DEPTH_HINT}")
    O = net.out_features
    if isinstance(output, str) and output == "each":
        return [eigen(net, c) for c in range(O)]
    if output is None:
        if O != 1:
            raise ValueError(f"output: the model has {O} outputs; give a class index 0..{O - 1}, "
                             f"a direction vector of length {O}, or 'each'")
        output = 0
    output_vector(output, O)
    co = chaos_coefficients_depth1(net, output)
    C0 = float(co.C0[0])
    C1 = np.asarray(co.C1[0], dtype=float)
    C2 = np.asarray(co.C2[0], dtype=float)
    lam, V = np.linalg.eigh(C2)
    order = np.argsort(-np.abs(lam), kind="stable")
    out = int(output) if isinstance(output, (int, np.integer)) else np.asarray(output)
    return EigenDecomposition(C0, C1, C2, lam[order], V[:, order].T.copy(), out)


def as_bilinear_depth1(net: Any) -> Bilinear:
    """A depth-1 network (degree <= 2) as one [`Bilinear`][tensoralg.layers.Bilinear] layer on the
    input: the factored form of `_quadratic_form`, plus one hidden unit per output for the
    affine part (``(b_o . x + c_o) * 1``). Same function, exactly (rationals stay rationals).

    Raises:
        ValueError: a network of depth >= 2 (names `check_decomposition`).
    """
    net = vector_network(net, "net")
    q = _quadratic_form(net, net.is_exact, "net")
    exact, O, d = q.exact, q.c.shape[0], q.B.shape[1]
    left = np.concatenate([q.Lt[:, 1:], q.B])
    left_bias = np.concatenate([q.Lt[:, 0], q.c])
    right = np.concatenate([q.Rt[:, 1:], zeros_array((O, d), exact)])
    one = Fraction(1) if exact else 1.0
    right_bias = np.concatenate([q.Rt[:, 0], np.full(O, one, dtype=object if exact else float)])
    down = np.concatenate([q.D, identity_matrix(O, exact)], axis=1)
    return Bilinear(left, right, down, left_bias, right_bias)
