"""SAELens classes for tensoralg's multi-step encoder (imported only by
`tensoralg.sae.saelens_compat.register`, which needs SAELens installed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .models import abstopk, topk


def build_classes() -> dict:
    """``{architecture: (SAE class, config class)}``; imports SAELens (ImportError without)."""
    from sae_lens.saes.sae import SAE, SAEConfig

    @dataclass
    class MultistepSAEConfig(SAEConfig):
        """SAELens config of tensoralg's multi-step encoder (fields as in tensoralg's
        ``SAEConfig``: ``k``, ``n_steps``, ``gamma``, ``step_size``; ``activation`` is fixed by
        the subclass)."""
        k: int = 100
        n_steps: int = 5
        gamma: str = "free"
        step_size: float = 1.0
        encoder: str = "multistep"

        @classmethod
        def architecture(cls) -> str:
            return f"tensoralg_multistep_{cls.activation_name}"

    class MultistepAbsTopKConfig(MultistepSAEConfig):
        activation_name = "abstopk"

    class MultistepTopKConfig(MultistepSAEConfig):
        activation_name = "topk"

    class MultistepSAE(SAE):
        """tensoralg's multi-step encoder as a ``sae_lens.SAE`` (see
        `tensoralg.sae.saelens_compat` for the formula)."""

        def initialize_weights(self) -> None:
            super().initialize_weights()
            c = self.cfg
            self.b_enc = nn.Parameter(torch.zeros(c.d_sae, dtype=self.dtype, device=self.device))
            if c.gamma == "free":
                self.W_step = nn.Parameter(torch.zeros(c.d_in, c.d_sae, dtype=self.dtype,
                                                       device=self.device))
            else:
                n = c.d_sae if c.gamma == "diag" else 1
                self.step_scale = nn.Parameter(torch.zeros(n, dtype=self.dtype,
                                                           device=self.device))

        def _act(self, pre: torch.Tensor) -> torch.Tensor:
            return (abstopk if self.cfg.activation_name == "abstopk" else topk)(pre, self.cfg.k)

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            sae_in = self.process_sae_in(x)                       # x - b_dec (normalized first)
            lead = sae_in.shape[:-1]
            xc = sae_in.reshape(-1, sae_in.shape[-1])
            pre = self.hook_sae_acts_pre(xc @ self.W_enc + self.b_enc)
            z = self._act(pre)
            gamma = self.W_step if self.cfg.gamma == "free" else self.W_dec.T * self.step_scale
            for _ in range(self.cfg.n_steps):
                z = self._act(z + (xc - z @ self.W_dec) @ gamma)
            return self.hook_sae_acts_post(z.reshape(*lead, z.shape[-1]))

        def fold_W_dec_norm(self) -> None:
            raise NotImplementedError("fold_W_dec_norm: the multi-step encoder's refinement "
                                      "uses W_dec itself; rescaling its rows changes the codes")

        def decode(self, feature_acts: torch.Tensor) -> torch.Tensor:
            out = self.hook_sae_recons(feature_acts @ self.W_dec + self.b_dec)
            out = self.run_time_activation_norm_fn_out(out)
            return self.reshape_fn_out(out, self.d_head)

    return {"tensoralg_multistep_abstopk": (MultistepSAE, MultistepAbsTopKConfig),
            "tensoralg_multistep_topk": (MultistepSAE, MultistepTopKConfig)}
