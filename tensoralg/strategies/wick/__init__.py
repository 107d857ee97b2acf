"""Exact strategy: the Isserlis/Wick sum over partial matchings (docs/mathematics.md §3.1,
§3.7), for position-free networks and for terms whose legs carry positions, side by side.

* `.matchings` — partial and perfect matchings of legs, symmetry orbits.
* `.joined` — position-free: the joined tensor network of two canonical stacks, its
  configuration orbits, contraction paths (cached) and backends.
* `.position_free` — the position-free strategy's face for the planner: `build`,
  `lower_bound`, `compute`.
* `.terms` — position-carrying: the Wick sum over the joined network of two terms of
  `tensoralg.canonical.sequence_tree` (`JoinedTermPair`) and the cached sums of
  contractions it shares with the chaos pairs of `tensoralg.strategies.chaos.sequence`.

The exact path of sequence models, which sums each pair of terms either way, is
`tensoralg.strategies.sequence_exact`.

What the planner and the engine call is exported here.
"""

from .joined import (
           JoinedNetwork,
           WickPlan,
           n_wick_configurations,
           output_projection,
           wick_flops_lower_bound,
)
from .position_free import build, compute, lower_bound
from .terms import JoinedTermPair

__all__ = ["JoinedNetwork", "WickPlan", "n_wick_configurations", "output_projection",
           "wick_flops_lower_bound", "build", "compute", "lower_bound", "JoinedTermPair"]
