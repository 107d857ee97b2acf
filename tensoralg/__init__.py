"""tensoralg: exact, data-free similarity of multilinear networks.

The Gaussian inner product ``<f_a, f_b> = E_{x ~ N(0, I)}[f_a(x) . f_b(x)]`` of two polynomial
networks (bilinear MLPs, linear and residual layers) computed in closed form (Isserlis / Wick on
the lifted input ``x~ = (1, x)``), its similarity, slices, diffs and Gram matrices; see
``DESIGN.md`` section 3 for the mathematics.
"""

from ._version import __version__
from .layers import Bilinear, BilinearAttention, Layer, Linear, Residual, Sequential
from .products import (
    MonteCarloEstimate,
    cross_gram,
    diff_norm,
    gram,
    inner,
    inner_diff,
    norm,
    similarity,
    similarity_matrix,
)
from .network import CostTooHigh, Plan, plan, to_graph

__all__ = [
    "__version__",
    "Layer", "Linear", "Bilinear", "Residual", "Sequential", "BilinearAttention",
    "inner", "norm", "similarity", "gram", "cross_gram", "similarity_matrix",
    "inner_diff", "diff_norm", "MonteCarloEstimate",
    "to_graph", "plan", "Plan", "CostTooHigh",
]
