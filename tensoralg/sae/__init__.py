"""Identifiable sparse autoencoders (iSAE): AbsTopK, approximate-RIP regularization, multi-step
(LISTA-style) encoding, an OMP oracle, synthetic ground-truth data and run-to-run stability.

An SAE decomposes activations ``x ∈ R^d_in`` as ``x ≈ z @ W_dec + b_dec`` with a ``k``-sparse
code ``z ∈ R^d_sae``; the rows of ``W_dec`` (shape ``(d_sae, d_in)``) are the dictionary atoms,
kept at unit norm. Standard TopK SAEs are not identifiable (two seeds give different
dictionaries); the iSAE recipe addresses one-signed codes (AbsTopK), an ill-conditioned
dictionary (aRIP regularizer) and a too-weak encoder (multi-step encoder).

Submodules (imported lazily so that ``tensoralg.sae.cli`` stays light):

* [`tensoralg.sae.models`][tensoralg.sae.models] — `SAEConfig`, `SparseAutoencoder`, ``topk``,
  ``abstopk``, ``rip_penalty``, ``rip_constants``;
* [`tensoralg.sae.training`][tensoralg.sae.training] — `TrainConfig`, `train`, `train_many`
  (several SAEs over shared batches), checkpoints, the JSONL log;
* [`tensoralg.sae.formats`][tensoralg.sae.formats] — `save_sae` / `load_sae` in SAELens's layout
  (SAELens's standard / TopK / AbsTopK / JumpReLU folders load, their options folded);
* `tensoralg.sae.saelens_compat` — ``register()``: tensoralg's multi-step architecture
  in SAELens (needs SAELens);
* `tensoralg.sae.hooks` — activations at a named submodule of any ``torch.nn.Module``
  (`activations_at`, `collect_activations`: streamed, resumable);
* [`tensoralg.sae.streaming`][tensoralg.sae.streaming] — training from a live model:
  `ActivationStream` (activations at a hook streamed through a shuffled buffer, refills a
  function of the seed, so resuming stays bit-identical);
* `tensoralg.sae.evaluation` — the SAE spliced into the model: CE loss recovered, KL
  (`evaluate_spliced`, `evaluate_transformer`);
* [`tensoralg.sae.synthetic`][tensoralg.sae.synthetic] — `make_synthetic`;
* [`tensoralg.sae.pursuit`][tensoralg.sae.pursuit] — batched `omp` (exported as
  ``tensoralg.sae.omp``);
* [`tensoralg.sae.presets`][tensoralg.sae.presets] — ``topk``, ``abstopk``, ``isae``, ``isae-me``;
* [`tensoralg.sae.bench`][tensoralg.sae.bench] — `run_bench`;
* `tensoralg.sae.activations` — hidden states of all-MiniLM-L6-v2 (optional extra);
* [`tensoralg.sae.transformer_acts`][tensoralg.sae.transformer_acts] — the residual stream of a
  [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] on held-out corpus text
  (offline; `extract_transformer_activations`, `residual_stream_at`).

The stability metrics live in [`tensoralg.verify.identifiability`][verify.identifiability].
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SAEConfig": "models", "SparseAutoencoder": "models", "topk": "models",
    "abstopk": "models", "rip_penalty": "models", "rip_constants": "models",
    "TrainConfig": "training", "train": "training", "train_many": "training", "load_sae": "formats",
    "save_sae": "formats", "TrainingDiverged": "training",
    "make_synthetic": "synthetic", "SyntheticData": "synthetic",
    "omp": "pursuit", "PRESETS": "presets", "make_config": "presets",
    "run_bench": "bench", "extract_transformer_activations": "transformer_acts",
    "residual_stream_at": "transformer_acts",
    "ActivationStream": "streaming",
    "activations_at": "hooks", "collect_activations": "hooks",
    "evaluate_spliced": "evaluation", "evaluate_transformer": "evaluation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
