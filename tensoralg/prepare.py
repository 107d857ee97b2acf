"""Preparation shared by every strategy: option and pair checks, output projections, canonical
stacks of models in an exact power-of-two gauge (one validation module for every entry point,
as in scikit-learn's ``utils.validation``)."""

from __future__ import annotations

import numbers
from dataclasses import replace
from fractions import Fraction
from typing import Any

import numpy as np

from .backends import BACKENDS, fraction_array
from .canonical import Canonical, Stage, canonicalize, stack
from .layers import Layer, _map_arrays, as_network

__all__ = ["METRICS", "METHODS", "STRATEGIES", "check_options", "check_pair", "output_matrix",
           "networks", "stack_for", "normalize", "scaled", "check_budget"]

METRICS = ("gaussian", "frobenius")
METHODS = ("exact", "closure", "montecarlo")
STRATEGIES = ("auto", "wick", "chaos")


def check_options(metric: str, method: str, backend: str, strategy: str = "auto") -> None:
    """Raises ValueError naming an unknown metric, method, backend or strategy, or a
    combination that has no meaning (Frobenius is a closed form: exact only)."""
    if metric not in METRICS:
        raise ValueError(f"metric: unknown metric {metric!r}; expected one of {METRICS}")
    if method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; expected one of {METHODS}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; expected one of {BACKENDS}")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy: unknown strategy {strategy!r}; expected one of "
                         f"{STRATEGIES} ('wick': the tensor-network Wick sum, 'chaos': Gaussian "
                         f"chaos (Hermite) coefficients, 'auto': the cheaper within budget)")
    if metric == "frobenius" and method != "exact":
        raise ValueError(f"metric='frobenius' is a closed form of the weights: method must be "
                         f"'exact', got {method!r}")
    if strategy != "auto" and method != "exact":
        raise ValueError(f"strategy={strategy!r} chooses an exact representation; it needs "
                         f"method='exact', got method={method!r}")


def check_budget(name: str, value: Any) -> None:
    """A budget (``max_flops``, ``max_memory``) must be a positive finite number or None."""
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or \
            not np.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name}: expected a positive number (or None for the default), "
                         f"got {value!r}")


def check_pair(na: Layer, nb: Layer) -> None:
    if na.in_features != nb.in_features:
        raise ValueError(f"input dimensions differ: a takes {na.in_features} inputs, b takes "
                         f"{nb.in_features}; both networks must read the same x")
    if na.out_features != nb.out_features:
        raise ValueError(f"output dimensions differ: a gives {na.out_features} outputs, b gives "
                         f"{nb.out_features}; slice one output (output=c or a direction u) or "
                         f"compare networks with the same outputs")


def output_matrix(output: Any, O: int, exact: bool) -> tuple[np.ndarray, bool]:
    """Output projection U ``(K, O)`` and whether the projected index stays open
    (``output="each"``)."""
    if output is None:
        U = np.eye(O, dtype=np.float64)
        keep = False
    elif isinstance(output, str):
        if output != "each":
            raise ValueError(f"output: expected None, an int, a vector of length {O} or 'each'; "
                             f"got {output!r}")
        U, keep = np.eye(O, dtype=np.float64), True
    elif isinstance(output, numbers.Integral) and not isinstance(output, (bool, np.bool_)):
        c = int(output)
        if not -O <= c < O:
            raise ValueError(f"output: index {c} out of range for {O} outputs")
        U = np.zeros((1, O))
        U[0, c % O] = 1.0
        keep = False
    else:
        from .layers import as_array

        if isinstance(output, (bool, numbers.Real)) or np.ndim(output) != 1:
            raise ValueError(f"output: expected None, an int class index, a vector of length {O} "
                             f"or 'each'; got {output!r}")
        u = as_array(output, "output", 1)
        if u.shape != (O,):
            raise ValueError(f"output: direction of shape {u.shape} does not match the {O} outputs")
        if not np.any(u != 0):
            raise ValueError("output: the direction u is zero; u . f is the zero function")
        U, keep = u[None, :], False
    if exact:
        U = fraction_array(U)
    return U, keep


def _load(m: Any, name: str) -> Layer:
    """A model, or a checkpoint folder (str or path) loaded when its turn comes."""
    import os

    if isinstance(m, (str, os.PathLike)):
        from .checkpoint import load_network

        return load_network(m)
    return as_network(m, name)


def networks(models: Any, name: str) -> list[Layer]:
    """A list of tensoralg networks from a sequence (or iterable) of models, specs or
    checkpoint folders."""
    if isinstance(models, Layer) or hasattr(models, "to_network"):
        raise TypeError(f"{name}: expected a sequence of models, got a single model")
    nets = [_load(m, f"{name}[{i}]") for i, m in enumerate(models)]
    if not nets:
        raise ValueError(f"{name}: empty sequence of models")
    return nets


# ----------------------------------------------------------------------------------------
# gauge normalization (exact in floating point: powers of two only)
# ----------------------------------------------------------------------------------------

def _exp2(maxabs: np.ndarray) -> np.ndarray:
    """Integer e with maxabs = m 2**e, m in [0.5, 1); 0 where maxabs is 0."""
    return np.frexp(maxabs)[1].astype(np.int32)  # int32: numpy's ldexp loop takes it directly


def normalize(can: Canonical) -> tuple[Canonical, np.ndarray]:
    """Rescale a float stack by exact gauges (powers of two) so every factor is O(1).

    Gauges used (each leaves the function unchanged, and is exact in floating point):
    per hidden unit ``L_h * 2**-a, R_h * 2**-b, D[:, h] * 2**(a+b)``; on each internal bond
    (the embedding's output too) the non-constant rows of the map before it times ``2**-e`` and
    the non-constant input columns of the next stage times ``2**e`` (the constant coordinate is
    never scaled). The output's exponent ``k`` is returned per model: ``f = 2**k f_normalized``.
    """
    if can.exact:
        return can, np.zeros(can.arrays()[0].shape[0], dtype=np.int32)
    if not can.stages:
        W = can.linear.copy()
        k = _exp2(np.abs(W[:, 1:, :]).max(axis=(1, 2)))
        W[:, 1:, :] = np.ldexp(W[:, 1:, :], -k[:, None, None])
        return replace(can, linear=W), k
    stages = []
    embed = None
    if can.embed is not None:
        embed = can.embed.copy()
        carry = _exp2(np.abs(embed[:, 1:, :]).max(axis=(1, 2)))
        embed[:, 1:, :] = np.ldexp(embed[:, 1:, :], -carry[:, None, None])
    else:
        carry = np.zeros(can.stages[0].L.shape[0], dtype=np.int32)
    for st in can.stages:
        L, R, D = st.L.copy(), st.R.copy(), st.D.copy()
        L[:, :, 1:] = np.ldexp(L[:, :, 1:], carry[:, None, None])
        R[:, :, 1:] = np.ldexp(R[:, :, 1:], carry[:, None, None])
        eL = _exp2(np.abs(L).max(axis=2))
        eR = _exp2(np.abs(R).max(axis=2))
        eL[:, 0] = 0
        eR[:, 0] = 0
        L = np.ldexp(L, -eL[:, :, None])
        R = np.ldexp(R, -eR[:, :, None])
        D = np.ldexp(D, (eL + eR)[:, None, :])
        carry = _exp2(np.abs(D[:, 1:, :]).max(axis=(1, 2)))
        D[:, 1:, :] = np.ldexp(D[:, 1:, :], -carry[:, None, None])
        stages.append(Stage(L, R, D))
    return replace(can, stages=stages, embed=embed), carry


def _to_exact(can: Canonical) -> Canonical:
    return can if can.exact else replace(can.map(fraction_array), exact=True)


def _to_float(c: Canonical) -> Canonical:
    return c if not c.exact else replace(c.map(lambda a: np.asarray(a, dtype=np.float64)),
                                         exact=False)


def stack_for(nets: list[Layer], backend: str, name: str) -> tuple[Canonical, np.ndarray]:
    """Canonical forms of ``nets`` stacked on a batch axis, in the backend's number type and a
    normalized power-of-two gauge; returns ``(stack, k)`` with ``f_i = 2**k_i f_i^normalized``
    (``k = 0`` on the exact backend)."""
    if backend == "exact":
        # floats are converted exactly (Fraction(float)) before any folding arithmetic
        nets = [n if n.is_exact else _map_arrays(n, fraction_array) for n in nets]
    cans = [canonicalize(n) for n in nets]
    if backend == "exact":
        cans = [_to_exact(c) for c in cans]
    else:
        cans = [_to_float(c) for c in cans]
    st = stack(cans, name)
    return normalize(st)


def scaled(X, ka, kb, backend):
    """Undo the normalizing gauge: entry (i, j) times 2**(ka_i + kb_j)."""
    if backend == "exact":
        return X
    e = ka.astype(np.int64)[:, None] + kb.astype(np.int64)[None, :]
    if X.ndim == 3:
        e = e[:, :, None]
    return np.ldexp(X, e)


def as_fraction_result(X, keep: bool):
    return np.vectorize(Fraction, otypes=[object])(X) if keep else Fraction(X)
