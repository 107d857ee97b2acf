"""Exact strategy 1: the Isserlis/Wick sum over partial matchings of the joined tensor network
(DESIGN §3.1; Isserlis 1918, Wick 1950), one opt_einsum contraction per configuration orbit.
The mechanics (joined network, symmetry, zero patterns, paths) live in
:mod:`tensoralg.network`; this module is the strategy's face for the planner."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import converter, to_numpy
from ..canonical import Canonical
from ..network import JoinedNetwork, WickPlan

__all__ = ["build", "compute"]


def build(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, metric: str,
          max_configurations: int) -> tuple[JoinedNetwork, WickPlan]:
    """The joined network and its plan (paths found, nothing contracted). Over
    ``max_configurations`` the plan is returned with ``refused`` set and nothing enumerated."""
    joined = JoinedNetwork(ca, cb, U, keep, metric)
    return joined, joined.plan(max_configurations, refuse=False)


def compute(joined: JoinedNetwork, backend: str, device: Any, dtype: Any,
            shared: bool = True):
    """Contract every configuration of a planned joined network on ``backend``; returns
    ``(N_a, N_b[, K])`` (float64 NumPy, or Fractions on the exact backend)."""
    val = joined.contract(converter(backend, device, dtype), shared=shared)
    if backend == "exact":
        return val
    return to_numpy(val).astype(np.float64)
