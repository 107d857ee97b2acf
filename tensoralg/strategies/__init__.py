"""Strategies: ways to compute the Gaussian inner product of two stacks of networks.

* :mod:`.wick` — exact: the Isserlis/Wick sum over partial matchings of the joined tensor
  network's legs (docs/mathematics.md §3.1); polynomial in the hidden widths, exponential in the
  legs. Position-free networks (:mod:`.wick.joined`) and terms whose legs carry positions
  (:mod:`.wick.terms`; sequence models with one attention layer, docs/mathematics.md §3.7) side
  by side.
* :mod:`.chaos` — exact: Euclidean inner products of Gaussian chaos (Hermite) coefficients
  (docs/mathematics.md §3.6); polynomial in the input width, exponential in the degree; Gram
  matrices of many models are one matrix product. Position-free networks
  (:mod:`.chaos.position_free`, with its depth-1 specialization :mod:`.chaos.depth1`) and terms
  whose legs carry positions (:mod:`.chaos.sequence`) side by side.
* :mod:`.sequence_exact` — exact, sequence models with one attention layer: the canonical
  form checked, configurations counted, cost and memory estimated, and each pair of terms summed
  by Wick matchings (:mod:`.wick.terms`) or, by default, chaos pairs (:mod:`.chaos.sequence`)
  (``exact_inner``, ``exact_gram``, ``head_gram``).
* :mod:`.executor` — how the terms' contractions run: batched matmul steps, cached paths, torch.
* :mod:`.closure` — APPROXIMATE beyond depth 1: second-moment propagation (docs/mathematics.md §3.2),
  for position-free networks and, over (position, feature), for sequence models.
* :mod:`.montecarlo` — unbiased sampling with standard errors (docs/mathematics.md §3.4), for both
  kinds of model.

Each exact strategy estimates its own cost (FLOPs, peak memory) before any work;
:mod:`tensoralg.planner` chooses between them.
"""
