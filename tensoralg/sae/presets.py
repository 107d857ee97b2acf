"""Named SAE presets (the four arms of the iSAE ablation).

* ``topk``    — TopK baseline (ReLU pre-activations, keep the top k; Gao et al. 2024);
* ``abstopk`` — AbsTopK (signed codes: keep the k largest magnitudes);
* ``isae``    — AbsTopK + approximate-RIP regularizer (``rip="eig"``);
* ``isae-me`` — AbsTopK + aRIP + multi-step (LISTA-style) encoder, ``T = 5``;
* ``isae-me-dl`` — AbsTopK + multi-step encoder (``T = 5``, no aRIP) with a dictionary-learning
  training schedule (`SCHEDULES`, applied by [`schedule`][tensoralg.sae.presets.schedule]): dead
  latents resampled every 250 steps for the first 70 % of the steps, the single-step encoder until
  88 %, the ``T`` refinement steps after. Measured at d=64, m=256, k=8 (``benchmarks/sae_m256.py``):
  see the README.

All presets use the AuxK dead-latent loss (``auxk_alpha = 1/32``) and unit-norm atoms. The
first four are the arms of the iSAE ablation (`ABLATION`, what ``sae bench`` trains).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:      # torch is imported by make_config only: the CLI reads PRESETS without it
    from .models import SAEConfig

__all__ = ["PRESETS", "ABLATION", "SCHEDULES", "make_config", "schedule"]

_COMMON = {"auxk_alpha": 1 / 32, "dead_tokens": 10_000}

PRESETS: dict[str, dict] = {
    "topk": {"activation": "topk"},
    "abstopk": {"activation": "abstopk"},
    "isae": {"activation": "abstopk", "rip": "eig", "rip_beta": 0.1, "rip_delta": 0.1},
    "isae-me": {"activation": "abstopk", "rip": "eig", "rip_beta": 0.1, "rip_delta": 0.1,
                "encoder": "multistep", "n_steps": 5, "gamma": "free", "step_size": 0.5},
    "isae-me-dl": {"activation": "abstopk", "encoder": "multistep", "n_steps": 5,
                   "gamma": "free", "step_size": 0.5},
}

ABLATION = ("topk", "abstopk", "isae", "isae-me")

# training schedules of a preset: TrainConfig fields; a float in (0, 1) is a fraction of the steps
SCHEDULES: dict[str, dict] = {
    "isae-me-dl": {"resample_every": 250, "resample_until": 0.7, "multistep_start": 0.88},
}


def schedule(preset: str, steps: int) -> dict:
    """The [`TrainConfig`][tensoralg.sae.training.TrainConfig] fields of ``preset``'s training
    schedule for a run of ``steps`` steps (fractions resolved to step numbers; ``{}`` for a preset
    without one). Raises ValueError for an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {list(PRESETS)}, got {preset!r}")
    return {k: (int(v * steps) if isinstance(v, float) else v)
            for k, v in SCHEDULES.get(preset, {}).items()}


def make_config(preset: str, d_in: int, d_sae: int, k: int, **overrides) -> SAEConfig:
    """[`SAEConfig`][tensoralg.sae.models.SAEConfig] of a named preset; keyword ``overrides``
    replace preset fields.

    Raises:
        ValueError: unknown preset name or invalid field values.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {list(PRESETS)}, got {preset!r}")
    from .models import SAEConfig

    kw = {**_COMMON, **PRESETS[preset], **overrides}
    return SAEConfig(d_in=d_in, d_sae=d_sae, k=k, **kw)
