"""Identifiable sparse autoencoders (iSAE): AbsTopK, approximate-RIP regularization, multi-step
(LISTA-style) encoding, an OMP oracle, synthetic ground-truth data and run-to-run stability.

An SAE decomposes activations ``x ∈ R^d_in`` as ``x ≈ z @ W_dec + b_dec`` with a ``k``-sparse
code ``z ∈ R^d_sae``; the rows of ``W_dec`` (shape ``(d_sae, d_in)``) are the dictionary atoms,
kept at unit norm. Standard TopK SAEs are not identifiable (two seeds give different
dictionaries); the iSAE recipe addresses one-signed codes (AbsTopK), an ill-conditioned
dictionary (aRIP regularizer) and a too-weak encoder (multi-step encoder).

Submodules (imported lazily so that ``tensoralg.sae.cli`` stays light):

* :mod:`tensoralg.sae.models` — :class:`SAEConfig`, :class:`SparseAutoencoder`, ``topk``,
  ``abstopk``, ``rip_penalty``, ``rip_constants``;
* :mod:`tensoralg.sae.training` — :class:`TrainConfig`, :func:`train`, :func:`train_many`
  (several SAEs over shared batches), checkpoints, the JSONL log;
* :mod:`tensoralg.sae.formats` — :func:`save_sae` / :func:`load_sae` in SAELens's layout
  (SAELens's standard / TopK / AbsTopK / JumpReLU folders load, their options folded);
* :mod:`tensoralg.sae.saelens_compat` — ``register()``: tensoralg's multi-step architecture
  in SAELens (needs SAELens);
* :mod:`tensoralg.sae.hooks` — activations at a named submodule of any ``torch.nn.Module``
  (:func:`activations_at`, :func:`collect_activations`: streamed, resumable);
* :mod:`tensoralg.sae.evaluation` — the SAE spliced into the model: CE loss recovered, KL
  (:func:`evaluate_spliced`, :func:`evaluate_transformer`);
* :mod:`tensoralg.sae.synthetic` — :func:`make_synthetic`;
* :mod:`tensoralg.sae.pursuit` — batched :func:`omp` (exported as ``tensoralg.sae.omp``);
* :mod:`tensoralg.sae.presets` — ``topk``, ``abstopk``, ``isae``, ``isae-me``;
* :mod:`tensoralg.sae.bench` — :func:`run_bench`;
* :mod:`tensoralg.sae.activations` — hidden states of all-MiniLM-L6-v2 (optional extra);
* :mod:`tensoralg.sae.transformer_acts` — the residual stream of a
  :class:`~tensoralg.transformer.BilinearTransformer` on held-out corpus text (offline;
  :func:`extract_transformer_activations`, :func:`residual_stream_at`).

The stability metrics live in :mod:`tensoralg.verify.identifiability`.
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
    "activations_at": "hooks", "collect_activations": "hooks",
    "evaluate_spliced": "evaluation", "evaluate_transformer": "evaluation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
