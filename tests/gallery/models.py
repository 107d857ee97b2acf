"""A gallery of PyTorch modules as researchers write them (tiny widths), compiled by
``tensoralg.from_torch`` in ``tests/test_compile_gallery.py``.

Each factory returns ``(module, example_inputs, inputs)``. Weights are drawn from a seeded
generator and given O(1) biases so that every bias path matters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _init(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan = p.shape[-1] if p.ndim > 1 else 4
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan))
    return module


# ---------------------------------------------------------------------------------------
# the research code's two families, rebuilt from their published architecture
# ---------------------------------------------------------------------------------------

class BilinearBlock(nn.Module):
    def __init__(self, d_model, d_hidden, bias=True):
        super().__init__()
        self.left = nn.Linear(d_model, d_hidden, bias=bias)
        self.right = nn.Linear(d_model, d_hidden, bias=bias)
        self.down = nn.Linear(d_hidden, d_model, bias=bias)

    def forward(self, x):
        return self.down(self.left(x) * self.right(x))


class BilinearMLP(nn.Module):
    """Bilinear MLP classifier (Pearce et al. 2024, "Bilinear MLPs enable weight-based
    mechanistic interpretability"): embed -> residual bilinear blocks whose update is scaled by
    a fixed ``lerp`` weight -> head."""

    def __init__(self, d_in=6, d_model=5, d_hidden=7, d_out=3, n_layer=2, residual_scale=0.7):
        super().__init__()
        self.embed = nn.Linear(d_in, d_model, bias=False)
        self.blocks = nn.ModuleList(BilinearBlock(d_model, d_hidden) for _ in range(n_layer))
        self.head = nn.Linear(d_model, d_out, bias=False)
        self.residual_scale = residual_scale

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.lerp(x, x + block(x), self.residual_scale)
        return self.head(x)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, d_head, n_ctx, base=10000.0):
        super().__init__()
        # float64 tables: float32 ones are a rotary embedding only to ~1e-7
        inv = 1.0 / base ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        ang = torch.outer(torch.arange(n_ctx, dtype=torch.float64), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x):   # x: (batch, heads, T, d_head)
        T = x.shape[-2]
        return x * self.cos[:T] + rotate_half(x) * self.sin[:T]


class BilinearAttention(nn.Module):
    """Softmax-free attention whose pattern is the product of two query-key scores."""

    def __init__(self, d_model, n_head, d_head, n_ctx, rope=True):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.q1 = nn.Linear(d_model, n_head * d_head)          # query/key biases
        self.k1 = nn.Linear(d_model, n_head * d_head)
        self.q2 = nn.Linear(d_model, n_head * d_head)
        self.k2 = nn.Linear(d_model, n_head * d_head)
        self.v = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o = nn.Linear(n_head * d_head, d_model, bias=False)
        self.rotary = Rotary(d_head, n_ctx) if rope else None
        self.scale = 1.0 / d_head
        self.register_buffer("mask", torch.tril(torch.ones(n_ctx, n_ctx)), persistent=False)

    def heads(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.d_head).transpose(1, 2)

    def forward(self, x):
        B, T, D = x.shape
        q1, k1, q2, k2 = (self.heads(f(x)) for f in (self.q1, self.k1, self.q2, self.k2))
        if self.rotary is not None:
            q1, k1, q2, k2 = map(self.rotary, (q1, k1, q2, k2))
        pattern = (q1 @ k1.transpose(-2, -1)) * (q2 @ k2.transpose(-2, -1))
        pattern = pattern * self.scale * self.mask[:T, :T]
        z = pattern @ self.heads(self.v(x))
        return self.o(z.transpose(1, 2).reshape(B, T, D))


class BilinearTransformerLM(nn.Module):
    """Two-layer bilinear-attention language model: token embedding, attention (+ bilinear
    MLP) blocks on the residual stream, a final norm with a fixed (calibrated) scale, tied-free
    unembedding."""

    def __init__(self, vocab=13, d_model=8, n_head=2, d_head=4, n_ctx=5, n_layer=2, d_mlp=6,
                 rope=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.attn = nn.ModuleList(BilinearAttention(d_model, n_head, d_head, n_ctx, rope)
                                  for _ in range(n_layer))
        self.mlp = nn.ModuleList(BilinearBlock(d_model, d_mlp, bias=False)
                                 for _ in range(n_layer)) if d_mlp else None
        self.norm_weight = nn.Parameter(torch.ones(d_model))
        self.register_buffer("norm_scale", torch.tensor(1.7))    # fixed: folded into W_U
        self.unembed = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, attn in enumerate(self.attn):
            x = x + attn(x)
            if self.mlp is not None:
                x = x + self.mlp[i](x)
        x = x / self.norm_scale * self.norm_weight
        return self.unembed(x)


# ---------------------------------------------------------------------------------------
# other ways people write the same things
# ---------------------------------------------------------------------------------------

class TLAttention(nn.Module):
    """TransformerLens weight names and einsum layout (``W_Q: (n_heads, d_model, d_head)``),
    a squared query-key score as the pattern."""

    def __init__(self, d_model=6, n_heads=3, d_head=2, n_ctx=4):
        super().__init__()
        self.W_Q = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_K = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_V = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_O = nn.Parameter(torch.empty(n_heads, d_head, d_model))
        self.b_Q = nn.Parameter(torch.empty(n_heads, d_head))
        self.b_K = nn.Parameter(torch.empty(n_heads, d_head))
        self.b_V = nn.Parameter(torch.empty(n_heads, d_head))
        self.b_O = nn.Parameter(torch.empty(d_model))
        self.register_buffer("IGNORE", torch.tensor(0.0))
        self.register_buffer("mask", torch.tril(torch.ones(n_ctx, n_ctx)).bool())
        self.attn_scale = d_head ** 0.5

    def forward(self, resid_pre):
        q = torch.einsum("bpm,hmd->bphd", resid_pre, self.W_Q) + self.b_Q
        k = torch.einsum("bpm,hmd->bphd", resid_pre, self.W_K) + self.b_K
        v = torch.einsum("bpm,hmd->bphd", resid_pre, self.W_V) + self.b_V
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.attn_scale
        T = resid_pre.shape[1]
        pattern = torch.where(self.mask[:T, :T], scores ** 2, self.IGNORE)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        out = torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O
        return resid_pre + out


class FusedQKV(nn.Module):
    """One fused projection for both query/key pairs and the values; heads as a batch axis."""

    def __init__(self, d_model=8, n_head=2, n_ctx=4):
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 5 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))

    def forward(self, x):
        B, T, C = x.size()
        q1, k1, q2, k2, v = self.qkv(x).split(C, dim=2)
        q1, k1, q2, k2, v = (t.view(B, T, self.n_head, self.d_head).transpose(1, 2)
                             for t in (q1, k1, q2, k2, v))
        att = (q1 @ k1.transpose(-2, -1)) * (q2 @ k2.transpose(-2, -1)) * (1.0 / self.d_head)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, 0.0)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return x + self.proj(y)


class Head(nn.Module):
    def __init__(self, d_model, d_head):
        super().__init__()
        self.q1 = nn.Linear(d_model, d_head, bias=False)
        self.k1 = nn.Linear(d_model, d_head, bias=False)
        self.q2 = nn.Linear(d_model, d_head, bias=False)
        self.k2 = nn.Linear(d_model, d_head, bias=False)
        self.value = nn.Linear(d_model, d_head, bias=False)

    def forward(self, x):
        T = x.shape[1]
        s = (self.q1(x) @ self.k1(x).transpose(1, 2)) * (self.q2(x) @ self.k2(x).transpose(1, 2))
        s = s * torch.tril(torch.ones(T, T)) / x.shape[-1]
        return s @ self.value(x)


class HeadLoop(nn.Module):
    """Heads as a loop over an ``nn.ModuleList`` (the "makemore" style), concatenated."""

    def __init__(self, d_model=6, n_head=3, d_head=2, d_out=4):
        super().__init__()
        self.heads = nn.ModuleList(Head(d_model, d_head) for _ in range(n_head))
        self.proj = nn.Linear(n_head * d_head, d_model)
        self.out = nn.Linear(d_model, d_out)

    def forward(self, x):
        x = x + self.proj(torch.cat([h(x) for h in self.heads], dim=-1))
        return self.out(x)


class EinsumBilinear(nn.Module):
    """A bilinear layer as one coefficient tensor, ``y_o = x_i B_oij x_j``, einsum throughout,
    followed by an einsum-written linear readout."""

    def __init__(self, d_in=5, d_out=4, d_read=3):
        super().__init__()
        self.B = nn.Parameter(torch.empty(d_out, d_in, d_in))
        self.bias = nn.Parameter(torch.empty(d_out))
        self.R = nn.Parameter(torch.empty(d_read, d_out))

    def forward(self, x):
        y = torch.einsum("bi,oij,bj->bo", x, self.B, x) + self.bias
        return torch.einsum("bo,ro->br", y, self.R)


class GatedMLP(nn.Module):
    """A gated (GLU without activation) MLP written with ``F.linear`` on raw parameters."""

    def __init__(self, d_in=6, d_hidden=8, d_out=3):
        super().__init__()
        self.W1 = nn.Parameter(torch.empty(d_hidden, d_in))
        self.W2 = nn.Parameter(torch.empty(d_hidden, d_in))
        self.b1 = nn.Parameter(torch.empty(d_hidden))
        self.W3 = nn.Parameter(torch.empty(d_out, d_hidden))

    def forward(self, x):
        return F.linear(F.linear(x, self.W1, self.b1) * F.linear(x, self.W2), self.W3)


class TiedEmbedding(nn.Module):
    """Token embedding tied to the unembedding, a bilinear MLP block, a fixed logit scale."""

    def __init__(self, vocab=9, d_model=6, d_mlp=5):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.mlp = BilinearBlock(d_model, d_mlp, bias=False)
        self.logit_scale = 0.5

    def forward(self, idx):
        h = self.wte(idx)
        h = h + self.mlp(h)
        return self.logit_scale * (h @ self.wte.weight.T)


class DeepBilinear(nn.Module):
    """Two bilinear layers without residual (degree 4), ``nn.Bilinear``-free, squared gates."""

    def __init__(self, d_in=4, d1=5, d2=3):
        super().__init__()
        self.a = nn.Linear(d_in, d1)
        self.b = nn.Linear(d_in, d1)
        self.c = nn.Linear(d1, d2)

    def forward(self, x):
        h = self.a(x) * self.b(x)
        return self.c(h) ** 2 - 0.5 * self.c(h)


class LinearAttention(nn.Module):
    """Unnormalised linear attention (one query-key score), no mask, scaled values."""

    def __init__(self, d_model=6, d_head=3):
        super().__init__()
        self.q = nn.Linear(d_model, d_head)
        self.k = nn.Linear(d_model, d_head)
        self.v = nn.Linear(d_model, d_model)

    def forward(self, x):
        return (self.q(x) @ self.k(x).transpose(-1, -2)) @ self.v(x) / 4.0


class TorchBilinear(nn.Module):
    """``nn.Bilinear(x, x)`` (a full coefficient tensor with bias) between two ``nn.Linear``."""

    def __init__(self, d_in=4, d=3, d_out=2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.bil = nn.Bilinear(d, d, d_out)

    def forward(self, x):
        h = self.inp(x)
        return self.bil(h, h)


GALLERY = {
    # name: factory -> (module, example_inputs, inputs)
    "bilinear_mlp_lerp": lambda: (_init(BilinearMLP(), 1), torch.randn(3, 6), "residual"),
    "bilinear_lm_2layer": lambda: (_init(BilinearTransformerLM(), 2),
                                   torch.randint(0, 13, (2, 5)), "residual"),
    "bilinear_lm_tokens": lambda: (_init(BilinearTransformerLM(vocab=5, d_model=4, d_head=2,
                                                               n_ctx=3, n_layer=1, d_mlp=None),
                                         3),
                                   torch.randint(0, 5, (2, 3)), "tokens"),
    "transformerlens_attention": lambda: (_init(TLAttention(d_model=4, n_heads=2, n_ctx=3), 4),
                                          torch.randn(2, 3, 4), "residual"),
    "fused_qkv": lambda: (_init(FusedQKV(d_model=4, n_ctx=3), 5), torch.randn(2, 3, 4),
                          "residual"),
    "head_loop": lambda: (_init(HeadLoop(d_model=4, n_head=2), 6), torch.randn(2, 3, 4),
                          "residual"),
    "einsum_bilinear": lambda: (_init(EinsumBilinear(), 7), torch.randn(3, 5), "residual"),
    "gated_mlp_f_linear": lambda: (_init(GatedMLP(), 8), torch.randn(3, 6), "residual"),
    "tied_embedding": lambda: (_init(TiedEmbedding(), 9), torch.randint(0, 9, (2, 3)),
                               "residual"),
    "deep_bilinear": lambda: (_init(DeepBilinear(), 10), torch.randn(3, 4), "residual"),
    "torch_nn_bilinear": lambda: (_init(TorchBilinear(), 12), torch.randn(3, 4), "residual"),
    "linear_attention": lambda: (_init(LinearAttention(d_model=4, d_head=2), 11),
                                 torch.randn(2, 3, 4),
                                 "residual"),
}


# ---------------------------------------------------------------------------------------
# non-polynomial modules (refused, with the operator named)
# ---------------------------------------------------------------------------------------

class SoftmaxAttention(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 2.0, dim=-1)
        return a @ self.v(x)


class ReluMLP(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, d))

    def forward(self, x):
        return self.net(x)


class GeluGLU(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.w, self.v = nn.Linear(d, 8), nn.Linear(d, 8)

    def forward(self, x):
        return F.gelu(self.w(x)) * self.v(x)


class LayerNormBlock(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.l, self.r = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.ln(x)
        return x + self.l(h) * self.r(h)


class RMSNormHandWritten(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class DivideByActivation(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.l = nn.Linear(d, d)

    def forward(self, x):
        return self.l(x) / (1.0 + (x * x).sum(-1, keepdim=True))


class ControlFlow(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.l = nn.Linear(d, d)

    def forward(self, x):
        if x.sum() > 0:
            return self.l(x)
        return -self.l(x)


NON_POLYNOMIAL = {
    # name: (module, example input, the operator the refusal must name)
    "softmax_attention": (lambda: SoftmaxAttention(), (2, 3, 4), "softmax"),
    "relu_mlp": (lambda: ReluMLP(), (3, 4), "relu"),
    "gelu_glu": (lambda: GeluGLU(), (3, 4), "gelu"),
    "layer_norm": (lambda: LayerNormBlock(), (3, 4), "layer_norm"),
    "rms_norm": (lambda: RMSNormHandWritten(), (3, 4), "rsqrt"),
    "divide_by_activation": (lambda: DivideByActivation(), (3, 4), "div"),
}
