"""Register tensoralg's multi-step (iSAE-ME) architecture with SAELens, where both are installed.

A multi-step folder written by [`tensoralg.sae.formats.save_sae`][tensoralg.sae.formats.save_sae] is
labelled ``tensoralg_multistep_abstopk`` / ``tensoralg_multistep_topk``, names SAELens does not
know, so ``sae_lens.SAE.load_from_disk`` refuses it (``KeyError`` from its architecture registry)
rather than read it as a single-step SAE with other codes. After `register`, SAELens loads such
folders into `MultistepSAE` (a ``sae_lens.SAE``), whose ``encode`` is the multi-step
encoder of [`SparseAutoencoder`][tensoralg.sae.models.SparseAutoencoder] written in SAELens's
conventions:

``z_0 = act((x - b_dec) W_enc + b_enc)``, then ``T`` times
``z_t = act(z_{t-1} + (x - b_dec - z_{t-1} W_dec) Γ)`` with ``Γ`` = ``W_step`` (gamma
``"free"``) or ``W_decᵀ · step_scale`` (``"diag"``, ``"tied"``), ``act`` TopK (ReLU of the k
largest) or AbsTopK (the k largest magnitudes with their sign); ``decode(z) = z W_dec + b_dec``.
The sums are the per-step form (tensoralg may sum them in another order on large batches: the
codes agree to rounding; tested in ``tests/test_sae_saelens_interop.py`` with SAELens installed).

SAELens is not a dependency of tensoralg: importing this module does not import SAELens;
`register` does, and raises ``ImportError`` naming the package when it is missing.
"""

from __future__ import annotations

from .formats import MULTISTEP_ARCHITECTURES

__all__ = ["register"]

_REGISTERED: dict = {}


def register() -> dict:
    """Register ``tensoralg_multistep_abstopk`` and ``tensoralg_multistep_topk`` with SAELens
    (``sae_lens.register_sae_class``). Idempotent; returns ``{architecture: (sae class, config
    class)}``.

    Raises:
        ImportError: SAELens is not installed (``pip install sae-lens``).
        ValueError: another package registered one of these names with different classes.
    """
    if _REGISTERED:
        return dict(_REGISTERED)
    try:
        import sae_lens  # noqa: F401
    except ImportError as exc:
        raise ImportError("register: SAELens is not installed (pip install sae-lens); "
                          "tensoralg's multi-step folders load with tensoralg.sae.load_sae "
                          "without it") from exc
    from sae_lens.registry import SAE_CLASS_REGISTRY, register_sae_class

    from ._saelens_classes import build_classes

    classes = build_classes()
    for arch in MULTISTEP_ARCHITECTURES:
        if arch in SAE_CLASS_REGISTRY:
            if SAE_CLASS_REGISTRY[arch] != classes[arch]:
                raise ValueError(f"register: SAELens already has an architecture {arch!r} "
                                 f"registered by {SAE_CLASS_REGISTRY[arch][0].__module__}")
            continue
        register_sae_class(arch, *classes[arch])
    _REGISTERED.update(classes)
    return dict(_REGISTERED)
