"""A trainable bilinear transformer (torch) that exports its residual stream -> logits map as an
exact tensoralg network.

[`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] reads token ids ``(batch, T)``
with ``T <= n_ctx``::

    h_0[t]   = W_E[token_t]                               embedding,    W_E: (vocab, d_model)
    h_l      = h_{l-1} + Attn_l(h_{l-1})                  bilinear attention (every layer)
    h_l      = h_l + Mlp_l(h_l)                           bilinear MLP (only when d_mlp is set)
    logits[t] = W_U h_L[t]                                unembedding,  W_U: (vocab, d_model)

``Attn_l`` is exactly [`tensoralg.BilinearAttention`][tensoralg.BilinearAttention] (two query/key
pairs per head, the attention weight of query ``t`` on key ``s <= t`` is
``attn_scale · (q1_t·k1_s)(q2_t·k2_s)``, no softmax, causal mask, optional RoPE with the same
rotation matrices, [`tensoralg.layers.rope_rotations`][tensoralg.layers.rope_rotations]); ``Mlp_l``
is [`tensoralg.Bilinear`][tensoralg.Bilinear] (``down((left h) * (right h))``). There is no layer
norm and no softmax inside the model (the softmax is applied only by the training loss), no biases,
and no learned positional embedding (position enters only through RoPE and the causal mask): every
piece is a polynomial of the residual stream, so the map residual stream -> logits is a polynomial
network.

Export ([`BilinearTransformer.to_network`][tensoralg.transformer.BilinearTransformer.to_network]).
The Gaussian inner product of tensoralg is an expectation over inputs ``x ~ N(0, I)``. Token ids are
not Gaussian, so the metric is put on the *residual stream input* ``h_0`` (``(n, n_ctx, d_model)``,
every entry ``N(0, 1)``): ``to_network()`` returns
``Sequential([Residual(BilinearAttention), [Residual(Bilinear)], ..., Linear(W_U)])``, whose forward
on ``h_0 = W_E[tokens]`` equals the torch forward on ``tokens``. ``to_network(embedding=True)``
prepends ``Linear(W_Eᵀ)`` so that the input is a one-hot token vector per position
(``(n, n_ctx, vocab)``); the Gaussian metric then sits on that vocab-sized input, which weights
every embedding direction equally — a different question (kept for completeness; the audits use the
residual stream).

``n_ctx`` is the trained context length. The exported attention carries an explicit causal
mask array of size ``n_ctx`` (``to_network(n_ctx=m)`` for a shorter prefix ``m <= n_ctx``; the
outputs at positions ``< m`` depend only on positions ``< m``, so the prefix network is exactly
the trained model restricted to ``m`` tokens). Longer contexts are refused (RoPE angles and the
mask were never trained there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ._torchutil import check_positive_int, dtype_name, torch_dtype

if TYPE_CHECKING:   # imported at run time inside to_network (no cycle at import)
    from .layers import Sequential

__all__ = ["BilinearTransformer", "ARCHITECTURE"]

ARCHITECTURE = "bilinear_transformer"


class _Attention(nn.Module):
    """One bilinear attention layer (the weights of
    [`tensoralg.BilinearAttention`][tensoralg.BilinearAttention])."""

    def __init__(self, d_model: int, n_heads: int, d_head: int, dtype: torch.dtype):
        super().__init__()
        shape = (n_heads, d_head, d_model)
        for name in ("q1", "k1", "q2", "k2", "v"):
            setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=dtype)))
        self.o = nn.Parameter(torch.zeros((d_model, n_heads, d_head), dtype=dtype))

    def forward(self, h: torch.Tensor, mask_scale: torch.Tensor,
                rot: torch.Tensor | None) -> torch.Tensor:
        def proj(w, rotate):
            y = torch.einsum("btd,hed->bhte", h, w)
            if rotate and rot is not None:
                y = torch.einsum("tef,bhtf->bhte", rot, y)
            return y

        s1 = torch.einsum("bhte,bhse->bhts", proj(self.q1, True), proj(self.k1, True))
        s2 = torch.einsum("bhte,bhse->bhts", proj(self.q2, True), proj(self.k2, True))
        z = torch.einsum("bhts,bhsv->bhtv", s1 * s2 * mask_scale, proj(self.v, False))
        return torch.einsum("bhtv,ohv->bto", z, self.o)


class _Mlp(nn.Module):
    def __init__(self, d_model: int, d_mlp: int, dtype: torch.dtype):
        super().__init__()
        self.left = nn.Parameter(torch.zeros((d_mlp, d_model), dtype=dtype))
        self.right = nn.Parameter(torch.zeros((d_mlp, d_model), dtype=dtype))
        self.down = nn.Parameter(torch.zeros((d_model, d_mlp), dtype=dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.left.T * (h @ self.right.T)) @ self.down.T


class BilinearTransformer(nn.Module):
    """Token embedding -> ``n_layers`` blocks (bilinear attention, optional bilinear MLP), each on
    the residual stream -> unembedding. Softmax-free, norm-free, bias-free (module docstring).

    Args:
        vocab: vocabulary size (token ids in ``[0, vocab)``).
        d_model: residual stream width.
        n_layers: number of blocks.
        n_heads, d_head: attention heads and their size (queries, keys and values all
            ``d_head``).
        d_mlp: hidden size of a bilinear MLP after each attention layer; ``None`` (default):
            attention only.
        n_ctx: the (maximum) context length.
        rope: ``None`` or the rotary base (e.g. ``10000``); needs an even ``d_head``.
        attn_scale: the fixed constant ``c`` multiplying every attention pattern; default
            ``1 / d_head`` (one ``1/sqrt(d_head)`` per score, as
            [`tensoralg.BilinearAttention`][tensoralg.BilinearAttention]). It is stored in the
            exported layer's ``scale``, so nothing needs folding.
        seed: initialisation seed (a private generator; torch's global RNG is untouched).
        dtype: ``"float32"`` (default) or ``"float64"``.

    Input: int64 token ids ``(batch, T)``, ``1 <= T <= n_ctx``. Output: logits
    ``(batch, T, vocab)``.

    Raises:
        ValueError: non-positive sizes, an odd ``d_head`` with RoPE, a non-positive/non-finite
            ``rope`` or ``attn_scale``, an unknown dtype.
    """

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, d_head: int,
                 d_mlp: int | None = None, *, n_ctx: int, rope: float | None = None,
                 attn_scale: float | None = None, seed: int = 0, dtype: Any = "float32"):
        super().__init__()
        for name, value in (("vocab", vocab), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("d_head", d_head), ("n_ctx", n_ctx)):
            check_positive_int(value, name)
        if d_mlp is not None:
            check_positive_int(d_mlp, "d_mlp")
        if rope is not None:
            if isinstance(rope, bool) or not isinstance(rope, (int, float)) or \
                    not math.isfinite(rope) or rope <= 0:
                raise ValueError(f"rope: expected None or a positive finite rotary base, got "
                                 f"{rope!r}")
            if d_head % 2:
                raise ValueError(f"rope: rotary embeddings rotate coordinate pairs and need an "
                                 f"even d_head, got d_head={d_head}")
            rope = float(rope)
        if attn_scale is None:
            attn_scale = 1.0 / d_head
        if isinstance(attn_scale, bool) or not isinstance(attn_scale, (int, float)) or \
                not math.isfinite(attn_scale) or attn_scale <= 0:
            raise ValueError(f"attn_scale: expected a positive finite number, got {attn_scale!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
        dt = torch_dtype(dtype)
        self.hparams = dict(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                            d_head=d_head, d_mlp=d_mlp, n_ctx=n_ctx, rope=rope,
                            attn_scale=float(attn_scale), seed=seed, dtype=dtype_name(dt))
        self.embed = nn.Parameter(torch.zeros((vocab, d_model), dtype=dt))
        self.attn = nn.ModuleList([_Attention(d_model, n_heads, d_head, dt)
                                   for _ in range(n_layers)])
        self.mlp = nn.ModuleList([_Mlp(d_model, d_mlp, dt) for _ in range(n_layers)]) \
            if d_mlp is not None else None
        self.unembed = nn.Parameter(torch.zeros((vocab, d_model), dtype=dt))
        # hook points (identities, no parameters): hook_resid.l passes the residual stream h_l
        # (0 = embedding, n_layers = final), so forward hooks can read or replace it
        # (tensoralg.sae.hooks; as TransformerLens's hook_resid_pre)
        self.hook_resid = nn.ModuleList([nn.Identity() for _ in range(n_layers + 1)])
        self.reset_parameters(seed)

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic initialisation from ``seed``: embedding ``N(0, 1)`` (a unit-variance
        residual stream, the scale the Gaussian metric assumes), unembedding ``N(0, 1/d_model)``,
        queries/keys/values ``N(0, 1/d_model)``, the attention output and MLP ``down``
        ``N(0, 1/(fan_in · n_layers))`` scaled by ``0.5`` (the blocks start as a small
        correction to the identity), MLP ``left``/``right`` ``N(0, 1/d_model)``."""
        gen = torch.Generator().manual_seed(int(seed))
        hp = self.hparams
        d, L = hp["d_model"], hp["n_layers"]

        def draw(p, std):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)

        draw(self.embed, 1.0)
        for a in self.attn:
            for name in ("q1", "k1", "q2", "k2", "v"):
                draw(getattr(a, name), 1.0 / math.sqrt(d))
            draw(a.o, 0.5 / math.sqrt(hp["n_heads"] * hp["d_head"] * L))
        if self.mlp is not None:
            for m in self.mlp:
                draw(m.left, 1.0 / math.sqrt(d))
                draw(m.right, 1.0 / math.sqrt(d))
                draw(m.down, 0.5 / math.sqrt(hp["d_mlp"] * L))
        draw(self.unembed, 1.0 / math.sqrt(d))

    def _mask_scale(self, T: int, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = torch.tril(torch.ones((T, T), dtype=ref.dtype, device=ref.device))
        rot = None
        if self.hparams["rope"] is not None:
            from .layers import rope_rotations

            rot = torch.as_tensor(rope_rotations(T, self.hparams["d_head"], self.hparams["rope"]),
                                  dtype=ref.dtype, device=ref.device)
        return m * self.hparams["attn_scale"], rot

    def _check_tokens(self, tokens: Any) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.as_tensor(np.asarray(tokens))
        if tokens.ndim != 2:
            raise ValueError(f"tokens: expected token ids of shape (batch, T), got "
                             f"{tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens: expected integer token ids, got dtype {tokens.dtype}")
        T, n_ctx, V = tokens.shape[1], self.hparams["n_ctx"], self.hparams["vocab"]
        if not 1 <= T <= n_ctx:
            raise ValueError(f"tokens: sequence length {T} is outside [1, n_ctx={n_ctx}] (the "
                             f"trained context length), shape {tuple(tokens.shape)}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
            raise ValueError(f"tokens: ids must lie in [0, vocab={V}), got range "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        return tokens.to(torch.int64)

    def residual_stream(self, tokens: Any) -> torch.Tensor:
        """The embedded input ``h_0 = W_E[tokens]`` ``(batch, T, d_model)``."""
        return self.embed[self._check_tokens(tokens)]

    def forward_residual(self, h: torch.Tensor, return_final: bool = False
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(batch, T, vocab)`` from the residual stream input ``h``
        ``(batch, T, d_model)`` — the function
        [`to_network`][tensoralg.transformer.BilinearTransformer.to_network] exports.
        ``return_final``: also return the final residual stream ``h_L``."""
        if h.ndim != 3 or h.shape[2] != self.hparams["d_model"] or \
                not 1 <= h.shape[1] <= self.hparams["n_ctx"]:
            raise ValueError(f"h: expected shape (batch, T <= {self.hparams['n_ctx']}, "
                             f"{self.hparams['d_model']}), got {tuple(h.shape)}")
        ms, rot = self._mask_scale(h.shape[1], h)
        for i, a in enumerate(self.attn):
            h = self.hook_resid[i](h)
            h = h + a(h, ms, rot)
            if self.mlp is not None:
                h = h + self.mlp[i](h)
        h = self.hook_resid[len(self.attn)](h)
        logits = h @ self.unembed.T
        return (logits, h) if return_final else logits

    def forward(self, tokens: Any) -> torch.Tensor:
        return self.forward_residual(self.residual_stream(tokens))

    # ------------------------------------------------------------------------------------
    def to_network(self, embedding: bool = False, n_ctx: int | None = None) -> Sequential:
        """The exact tensoralg network of the residual stream -> logits map (float64 copies of
        the weights; module docstring).

        Args:
            embedding: prepend ``Linear(W_Eᵀ)`` (input: one-hot tokens, ``(n, n_ctx, vocab)``).
            n_ctx: context length of the causal mask (default the trained ``n_ctx``; shorter is
                the exact prefix model).

        Raises:
            ValueError: ``n_ctx`` not an integer in ``[1, trained n_ctx]``; a parameter with
                NaN or inf entries (named, e.g. ``attn.0.q1``), the embedding included.
        """
        from ._torchutil import check_finite_parameters
        from .layers import Bilinear, BilinearAttention, Linear, Residual, Sequential

        check_finite_parameters(self)
        trained = self.hparams["n_ctx"]
        n = trained if n_ctx is None else n_ctx
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= trained:
            raise ValueError(f"n_ctx: expected an integer in [1, {trained}] (the trained context "
                             f"length; longer contexts were never trained), got {n_ctx!r}")
        mask = np.tril(np.ones((n, n)))

        def w(p):
            return p.detach().to("cpu", torch.float64).numpy().copy()

        layers = [Linear(w(self.embed).T)] if embedding else []
        for i, a in enumerate(self.attn):
            layers.append(Residual(BilinearAttention(
                w(a.q1), w(a.k1), w(a.q2), w(a.k2), w(a.v), w(a.o), mask=mask,
                scale=self.hparams["attn_scale"], rope=self.hparams["rope"])))
            if self.mlp is not None:
                m = self.mlp[i]
                layers.append(Residual(Bilinear(w(m.left), w(m.right), w(m.down))))
        layers.append(Linear(w(self.unembed)))
        return Sequential(layers)

    def config(self) -> dict:
        """Flat architecture config (all constructor arguments plus ``architecture``)."""
        return {"architecture": ARCHITECTURE, **self.hparams}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> BilinearTransformer:
        """Build an (initialised, untrained) model from
        [`config`][tensoralg.transformer.BilinearTransformer.config]'s keys.

        Raises:
            ValueError: a wrong ``architecture`` or a missing size.
        """
        arch = cfg.get("architecture", ARCHITECTURE)
        if arch != ARCHITECTURE:
            raise ValueError(f"cfg: architecture {arch!r} is not {ARCHITECTURE!r}")
        required = ("vocab", "d_model", "n_layers", "n_heads", "d_head", "n_ctx")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"cfg: missing {missing} (needed to rebuild a {ARCHITECTURE})")
        kw = {k: cfg[k] for k in required + ("d_mlp", "rope", "attn_scale", "seed", "dtype")
              if k in cfg}
        return cls(**kw)
