"""tensoralg: exact, data-free similarity of multilinear networks.

The Gaussian inner product ``<f_a, f_b> = E_{x ~ N(0, I)}[f_a(x) . f_b(x)]`` of two polynomial
networks (bilinear MLPs, linear and residual layers) computed in closed form (Isserlis / Wick on
the lifted input ``x~ = (1, x)``), its similarity, slices, diffs and Gram matrices; see
``docs/`` for the mathematics (``docs/index.md``).

Threads: the library leaves torch's and BLAS's thread counts alone; on small models or a loaded
machine call ``tensoralg.set_threads(1)`` (what the CLI does by default, `tensoralg.threads`).
"""

from . import _checkout
from ._version import __version__
from .degree import (
    DegreeSimilarity,
    DegreeSimilarityMatrix,
    degree_similarity,
    degree_similarity_matrix,
)
from .distribution import CovarianceFactor
from .errors import CostTooHigh
from .layers import Bilinear, BilinearAttention, Layer, Linear, Residual, Sequential
from .network import to_graph
from .planner import Plan
from .products import (
    MonteCarloEstimate,
    cross_gram,
    diff_norm,
    gram,
    inner,
    inner_diff,
    norm,
    plan,
    similarity,
    similarity_matrix,
)
from .threads import set_threads

_checkout.install()   # tensoralg.verify importable from an uninstalled source checkout

__all__ = [
    "__version__",
    "Layer", "Linear", "Bilinear", "Residual", "Sequential", "BilinearAttention",
    "inner", "norm", "similarity", "gram", "cross_gram", "similarity_matrix",
    "inner_diff", "diff_norm", "MonteCarloEstimate", "degree_similarity", "DegreeSimilarity",
    "degree_similarity_matrix", "DegreeSimilarityMatrix",
    "to_graph", "plan", "Plan", "CostTooHigh", "CovarianceFactor", "set_threads",
    "BilinearTransformer", "from_torch",
]


def __getattr__(name: str):
    # torch is imported only when the trainable transformer is asked for
    if name == "BilinearTransformer":
        from .transformer import BilinearTransformer

        return BilinearTransformer
    if name == "from_torch":   # torch is imported only when a module is compiled
        from .compile import from_torch

        return from_torch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
