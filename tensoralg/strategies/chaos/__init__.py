"""Exact strategy: Euclidean inner products of Gaussian chaos (Hermite / Wiener-Itô)
coefficients (docs/mathematics.md §3.6, §3.7), for position-free networks and for terms whose
legs carry positions, side by side.

* `.position_free` — the general packed kernels: per-model chaos features of a canonical
  stack, their inner products and Gram matrices, the cost estimate the planner reads.
* `.depth1` — a specialization of `.position_free` for depth-1 float networks (closed
  form, no work arrays), chosen inside `.position_free` (never by a caller) and held equal
  to the general kernel by tests/test_engine_fastpaths.py.
* `.sequence` — position-carrying: one term of a sequence model in chaos form
  (`TermSide`) and the sum over a pair of them (`chaos_pair`), the default way of
  the exact path of sequence models (`tensoralg.strategies.sequence_exact`).

What the planner and the engine call is exported here.
"""

from .position_free import (
                            ChaosEstimate,
                            cross,
                            estimate,
                            features,
                            inner_metric,
                            inner_packed,
                            multiset_weights,
                            n_packed,
                            packed_features,
                            triple,
                            whiten,
)
from .sequence import TermSide, chaos_pair, stored_entries

__all__ = ["ChaosEstimate", "cross", "estimate", "features", "inner_metric", "inner_packed",
           "multiset_weights", "n_packed", "packed_features", "triple", "whiten", "TermSide",
           "chaos_pair", "stored_entries"]
