"""``from_torch`` on attention written as researchers write it: rotary tables computed in
float32 (rotate-half and interleaved layouts), a learned per-position map on queries and keys,
``torch.lerp`` residuals around attention and a bilinear MLP. Each compiles to
``position_maps`` and is checked against the module's own forward pass; what is not one map per
position on every query and key alike is refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import tensoralg as ta  # noqa: E402
from tensoralg.compile import NotCompilable  # noqa: E402
from tensoralg.layers import rope_rotations, rotary_maps  # noqa: E402


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryHalf(nn.Module):
    """LLaMA / GPT-NeoX style: float32 inv_freq, cached cos/sin of cat(freqs, freqs)."""

    def __init__(self, d_head, n_ctx, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2).float() / d_head))
        freqs = torch.outer(torch.arange(n_ctx).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):   # (B, H, T, E)
        T = x.shape[-2]
        return x * self.cos[:T] + rotate_half(x) * self.sin[:T]


class RotaryInterleaved(nn.Module):
    """GPT-J style: pairs (2i, 2i+1), float32 tables repeated per pair."""

    def __init__(self, d_head, n_ctx, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2).float() / d_head))
        freqs = torch.outer(torch.arange(n_ctx).float(), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x):
        T = x.shape[-2]
        c = self.cos[:T].repeat_interleave(2, dim=-1)
        s = self.sin[:T].repeat_interleave(2, dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return x * c + rot * s


class LearnedMaps(nn.Module):
    """A learned linear map per position on every query and key."""

    def __init__(self, d_head, n_ctx):
        super().__init__()
        self.maps = nn.Parameter(torch.randn(n_ctx, d_head, d_head) / d_head ** 0.5)

    def forward(self, x):
        T = x.shape[-2]
        return torch.einsum("tef,bhtf->bhte", self.maps[:T], x)


class Attention(nn.Module):
    def __init__(self, d_model, n_head, d_head, pos, q_only=False):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.q1, self.k1, self.q2, self.k2 = (nn.Linear(d_model, n_head * d_head)
                                              for _ in range(4))
        self.v = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o = nn.Linear(n_head * d_head, d_model, bias=False)
        self.pos, self.q_only = pos, q_only

    def heads(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.d_head).transpose(1, 2)

    def forward(self, x):
        B, T, _ = x.shape
        q1, k1, q2, k2 = (self.heads(f(x)) for f in (self.q1, self.k1, self.q2, self.k2))
        q1, q2 = self.pos(q1), self.pos(q2)
        if not self.q_only:
            k1, k2 = self.pos(k1), self.pos(k2)
        mask = torch.tril(torch.ones(T, T, dtype=x.dtype, device=x.device))
        pattern = (q1 @ k1.transpose(-2, -1)) * (q2 @ k2.transpose(-2, -1)) * mask / self.d_head
        z = pattern @ self.heads(self.v(x))
        return self.o(z.transpose(1, 2).reshape(B, T, -1))


class BilinearMLP(nn.Module):
    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.w = nn.Linear(d_model, 2 * d_hidden)
        self.down = nn.Linear(d_hidden, d_model)

    def forward(self, x):
        left, right = self.w(x).chunk(2, dim=-1)
        return self.down(left * right)


class Transformer(nn.Module):
    """Two blocks of (attention, bilinear MLP), each a torch.lerp residual."""

    def __init__(self, pos_factory, d_model=4, n_head=2, d_head=2, n_ctx=3, n_layer=2,
                 lerp=0.8):
        super().__init__()
        self.attn = nn.ModuleList(Attention(d_model, n_head, d_head, pos_factory())
                                  for _ in range(n_layer))
        self.mlp = nn.ModuleList(BilinearMLP(d_model, 3) for _ in range(n_layer))
        self.lerp = lerp

    def forward(self, x):
        for attn, mlp in zip(self.attn, self.mlp):
            x = torch.lerp(x, x + attn(x), self.lerp)
            x = torch.lerp(x, x + mlp(x), self.lerp)
        return x


def _attention_layers(net):
    out = [getattr(x, "inner", x) for x in net.layers]
    return [a for a in out if isinstance(a, ta.BilinearAttention)]


def _max_rel_err(net, module, x):
    with torch.no_grad():
        ref = module.double().eval()(x.double()).numpy()
    got = net(x.double().numpy())
    return np.abs(got - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_float32_rotary_tables_compile_as_position_maps(layout):
    torch.manual_seed(0)
    T, E = 3, 2
    rot = RotaryHalf if layout == "half" else RotaryInterleaved
    module = Transformer(lambda: rot(E, 8))
    x = torch.randn(2, T, 4)
    net = ta.from_torch(module, x)
    atts = _attention_layers(net)
    assert [type(getattr(y, "inner", y)).__name__ for y in net.layers] == \
        ["BilinearAttention", "Bilinear"] * 2
    assert len(atts) == 2
    cos, sin = (module.attn[0].pos.cos[:T], module.attn[0].pos.sin[:T])
    if layout == "half":
        cos, sin = cos[:, :E // 2], sin[:, :E // 2]
    want = rotary_maps(cos, sin, layout=layout)
    for att in atts:
        assert att.rope is None and att.position_maps.shape == (T, E, E)
        assert np.abs(att.position_maps - want).max() < 1e-12
        assert np.abs(att.position_maps - rope_rotations(T, E, 10000.0)).max() > 1e-9
    assert _max_rel_err(net, module, x) < 1e-10


def test_float64_rotary_tables_still_compile_to_rope():
    torch.manual_seed(1)
    module = Transformer(lambda: RotaryHalf(2, 8), n_layer=1).double()
    for attn in module.attn:   # tables in float64 from the start: an exact rotary embedding
        inv = 1.0 / 10000.0 ** (torch.arange(0, 2, 2, dtype=torch.float64) / 2)
        f = torch.outer(torch.arange(8, dtype=torch.float64), inv)
        attn.pos.cos, attn.pos.sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
    net = ta.from_torch(module, torch.randn(2, 3, 4, dtype=torch.float64))
    att = _attention_layers(net)[0]
    assert att.rope == pytest.approx(10000.0) and att.position_maps is None


def test_learned_per_position_maps_compile_and_give_exact_inner_products():
    torch.manual_seed(2)
    module = Transformer(lambda: LearnedMaps(2, 4), d_model=2, n_layer=1)
    x = torch.randn(2, 2, 2)
    net = ta.from_torch(module, x)
    att = _attention_layers(net)[0]
    maps = module.attn[0].pos.maps.detach().double().numpy()[:2]
    assert att.position_maps.shape == (2, 2, 2)
    # read off relative to position 0: R_t = maps[t] maps[0]^-1 (the rest is in the weights)
    assert np.allclose(att.position_maps, maps @ np.linalg.inv(maps[0]), rtol=0, atol=1e-12)
    assert _max_rel_err(net, module, x) < 1e-10
    # the compiled network's exact norm against quadrature on its whole input space
    from tensoralg.verify.quadrature import quadrature_inner

    first = ta.Sequential(net.layers[:1])
    q = float(quadrature_inner(first, first, np.eye(2), n_ctx=2))
    assert abs(ta.inner(first, first, n_ctx=2) - q) <= 1e-10 * q


def test_rotary_on_queries_only_is_refused():
    torch.manual_seed(3)
    module = Transformer(lambda: RotaryHalf(2, 8), n_layer=1)
    module.attn[0].q_only = True
    with pytest.raises(NotCompilable, match="not one linear map per position applied to "
                                            "every query and key alike"):
        ta.from_torch(module, torch.randn(2, 3, 4))


def test_softmax_attention_with_float32_rotary_is_still_refused():
    class Softmax(Attention):
        def forward(self, x):
            q, k = self.pos(self.heads(self.q1(x))), self.pos(self.heads(self.k1(x)))
            p = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            return self.o((p @ self.heads(self.v(x))).transpose(1, 2).reshape(x.shape))

    with pytest.raises(NotCompilable, match="softmax"):
        ta.from_torch(Softmax(4, 2, 2, RotaryHalf(2, 8)), torch.randn(2, 3, 4))
