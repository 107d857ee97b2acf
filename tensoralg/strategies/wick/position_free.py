"""Exact strategy 1: the Isserlis/Wick sum over partial matchings of the joined tensor network
(docs/mathematics.md §3.1; Isserlis 1918, Wick 1950), one opt_einsum contraction per configuration orbit.
The mechanics (joined network, symmetry, zero patterns, paths) live in
`.joined`; this module is the strategy's face for the planner."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...backends import converter, to_numpy
from ...canonical import Canonical
from .joined import JoinedNetwork, WickPlan, wick_flops_lower_bound

__all__ = ["build", "compute", "lower_bound"]


def build(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, metric: str,
          max_configurations: int) -> tuple[JoinedNetwork, WickPlan]:
    """The joined network and its plan (paths found, nothing contracted). Over
    ``max_configurations`` the plan is returned with ``refused`` set and nothing enumerated."""
    joined = JoinedNetwork(ca, cb, U, keep, metric)
    return joined, joined.plan(max_configurations, refuse=False)


def lower_bound(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, metric: str,
                threshold: float) -> tuple[float, str] | None:
    """A lower bound on the Wick plan's FLOPs that exceeds ``threshold``, with how it was
    obtained, or None when none was found (then plan in full). First the closed form of
    `.joined.wick_flops_lower_bound` (shapes and zero patterns; nothing built);
    then the joined network is formed (cheap: no contraction) and its configuration orbits'
    paths are searched one by one, dearest first, until their FLOPs pass ``threshold``
    (`JoinedNetwork.flops_at_least`). Call within the configuration budget."""
    lb = wick_flops_lower_bound(ca, cb, U, metric)
    if lb is not None and lb > threshold:
        return lb, "closed-form lower bound; network not built"
    if metric != "gaussian":
        return None
    joined = JoinedNetwork(ca, cb, U, keep, metric)
    total, n, n_orbits = joined.flops_at_least(threshold)
    if total <= threshold:
        return None
    if n < n_orbits:
        return total, f"paths of {n} of {n_orbits} configuration orbits; the rest not searched"
    return total, f"paths of all {n_orbits} configuration orbits, found before"


def compute(joined: JoinedNetwork, backend: str, device: Any, dtype: Any,
            shared: bool = True):
    """Contract every configuration of a planned joined network on ``backend``; returns
    ``(N_a, N_b[, K])`` (float64 NumPy, or Fractions on the exact backend)."""
    val = joined.contract(converter(backend, device, dtype), shared=shared)
    if backend == "exact":
        return val
    return to_numpy(val).astype(np.float64)
