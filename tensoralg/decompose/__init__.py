"""Decompositions of multilinear networks: exact checks, eigen-components, residual paths, diffs.

Mathematics: docs/mathematics.md §3.8 (decompositions) and §3.6 (Gaussian chaos).

* [`check_decomposition`][tensoralg.decompose.sums.check_decomposition] — is ``f = sum_i g_i``? The
  exact residual ``||f - sum g_i||^2`` (Gaussian and Frobenius metrics), the Gram matrix of
  ``(f, g_1, ...)``, each component's share of ``||f||^2`` and the interference terms; with
  ``backend="exact"`` a rational certificate.
* [`eigen`][tensoralg.decompose.spectral.eigen] — for depth-1 networks (embedding, one bilinear
  layer, head, biases, residual): the chaos coefficients ``(C0, C1, C2)`` of one output (or
  direction ``u . f``) and the eigendecomposition ``C2 = sum_i lambda_i v_i v_i^T``:
  ``f = C0 + C1.x + sum_i lambda_i He2(v_i.x)`` with mutually orthogonal components of norm^2
  ``2 lambda_i^2``, so keeping ``k`` of them costs exactly ``2 sum_dropped lambda_i^2``. The
  eigenvectors live in input space (through the embedding).
* [`paths`][tensoralg.decompose.residual.paths] — a residual network
  ``head o (1 + B_n) o ... o (1 + B_1) o embed`` as a sum of ``2^n`` path networks, one per subset
  of blocks a signal passes through; their Gram matrix is the exact attribution.
* [`paths`][tensoralg.decompose.residual.paths] of a transformer (a residual stack of bilinear
  attention and MLP blocks): the first-order paths (direct, each head, each MLP) with their exact
  Gram matrix and the remainder ``f - sum`` by Monte Carlo;
  [`path_similarity`][tensoralg.decompose.residual.path_similarity] (``match=True``) and
  [`match_heads`][tensoralg.decompose.sequence_paths.match_heads] compare two checkpoints head by
  head (docs/mathematics.md §3.10);
  [`paths_over_training`][tensoralg.decompose.path_changes.paths_over_training] compares every
  first-order path of a series of checkpoints with the final and the next one, and
  [`transition_paths`][tensoralg.decompose.path_changes.transition_paths] says which paths carry
  the change between two checkpoints (one path or several, by a declared rule).
* [`combine`][tensoralg.decompose.sums.combine] /
  [`difference`][tensoralg.decompose.sums.difference] — ``sum_i c_i f_i`` (e.g. a checkpoint minus
  another) as one network (hidden units side by side, coefficients on the output), so that its
  eigenvectors localize a change in input space.

Inner products go through the public API ([`tensoralg.cross_gram`][tensoralg.cross_gram],
[`tensoralg.inner`][tensoralg.inner]); the one piece of mathematics of its own is
[`chaos_coefficients_depth1`][tensoralg.decompose.spectral.chaos_coefficients_depth1], which reads
the degree-2 polynomial ``c + b.x + x^T A x`` straight off the lifted weights (never by sampling).
"""

from ._common import bilinear_depth
from .path_changes import PathsOverTraining, PathTransition, paths_over_training, transition_paths
from .residual import PathDecomposition, path_similarity, paths
from .sequence_paths import PathSimilarity, SequencePathDecomposition, match_heads
from .spectral import (
    ChaosCoefficients,
    EigenDecomposition,
    as_bilinear_depth1,
    chaos_coefficients_depth1,
    eigen,
)
from .sums import DecompositionCheck, check_decomposition, combine, difference

__all__ = ["check_decomposition", "DecompositionCheck", "chaos_coefficients_depth1",
           "ChaosCoefficients", "eigen", "EigenDecomposition", "combine", "difference",
           "paths", "PathDecomposition", "path_similarity", "bilinear_depth", "as_bilinear_depth1",
           "SequencePathDecomposition", "PathSimilarity", "match_heads",
           "paths_over_training", "PathsOverTraining", "transition_paths", "PathTransition"]
