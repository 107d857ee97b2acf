"""Strategies: ways to compute the Gaussian inner product of two stacks of networks.

* `.wick` — exact: the Isserlis/Wick sum over partial matchings of the joined tensor
  network's legs (docs/mathematics.md §3.1); polynomial in the hidden widths, exponential in the
  legs. Position-free networks (`.wick.joined`) and terms whose legs carry positions
  (`.wick.terms`; sequence models with one attention layer, docs/mathematics.md §3.7) side
  by side.
* `.chaos` — exact: Euclidean inner products of Gaussian chaos (Hermite) coefficients
  (docs/mathematics.md §3.6); polynomial in the input width, exponential in the degree; Gram
  matrices of many models are one matrix product. Position-free networks
  (`.chaos.position_free`, with its depth-1 specialization `.chaos.depth1`) and terms
  whose legs carry positions (`.chaos.sequence`) side by side.
* `.sequence_exact` — exact, sequence models with one attention layer: the canonical
  form checked, configurations counted, cost and memory estimated, and each pair of terms summed
  by Wick matchings (`.wick.terms`) or, by default, chaos pairs (`.chaos.sequence`)
  (``exact_inner``, ``exact_gram``, ``head_gram``).
* `.executor` — how the terms' contractions run: batched matmul steps, cached paths, torch.
* `.closure` — APPROXIMATE beyond depth 1: second-moment propagation (docs/mathematics.md §3.2),
  for position-free networks and, over (position, feature), for sequence models.
* `.montecarlo` — unbiased sampling with standard errors (docs/mathematics.md §3.4), for both
  kinds of model.

Each exact strategy estimates its own cost (FLOPs, peak memory) before any work;
`tensoralg.planner` chooses between them.
"""
