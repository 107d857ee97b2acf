"""Named SAE presets (the four arms of the iSAE ablation).

* ``topk``    — TopK baseline (ReLU pre-activations, keep the top k; Gao et al. 2024);
* ``abstopk`` — AbsTopK (signed codes: keep the k largest magnitudes);
* ``isae``    — AbsTopK + approximate-RIP regularizer (``rip="eig"``);
* ``isae-me`` — AbsTopK + aRIP + multi-step (LISTA-style) encoder, ``T = 5``.

All presets use the AuxK dead-latent loss (``auxk_alpha = 1/32``) and unit-norm atoms.
"""

from __future__ import annotations

from .models import SAEConfig

__all__ = ["PRESETS", "make_config"]

_COMMON = {"auxk_alpha": 1 / 32, "dead_tokens": 10_000}

PRESETS: dict[str, dict] = {
    "topk": {"activation": "topk"},
    "abstopk": {"activation": "abstopk"},
    "isae": {"activation": "abstopk", "rip": "eig", "rip_beta": 0.1, "rip_delta": 0.1},
    "isae-me": {"activation": "abstopk", "rip": "eig", "rip_beta": 0.1, "rip_delta": 0.1,
                "encoder": "multistep", "n_steps": 5, "gamma": "free", "step_size": 0.5},
}


def make_config(preset: str, d_in: int, d_sae: int, k: int, **overrides) -> SAEConfig:
    """:class:`SAEConfig` of a named preset; keyword ``overrides`` replace preset fields.

    Raises:
        ValueError: unknown preset name or invalid field values.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {list(PRESETS)}, got {preset!r}")
    kw = {**_COMMON, **PRESETS[preset], **overrides}
    return SAEConfig(d_in=d_in, d_sae=d_sae, k=k, **kw)
