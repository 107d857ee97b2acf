"""Per-position linear maps on queries and keys (``BilinearAttention(position_maps=...)``):
a float32 rotary table, a random per-position map, exact RoPE as a table. Checked against
Gauss-Hermite quadrature on the whole input space (the forward pass only), verify's
brute-force expansion in rationals, and Monte Carlo; round trips through specs and
checkpoints; the one-line refusals."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from tensoralg.verify.attention import sequence_inner_exact
from tensoralg.verify.quadrature import quadrature_inner

import tensoralg as ta
from tensoralg import decompose as dc
from tensoralg.layers import rope_rotations, rotary_maps
from tensoralg.strategies import montecarlo as MC
from tensoralg.strategies import sequence_exact as A


def weights(rng, H=2, dh=2, d=2, dv=2, bias=True):
    W = lambda *s: rng.normal(size=s)  # noqa: E731
    kw = dict(q1=W(H, dh, d), k1=W(H, dh, d), q2=W(H, dh, d), k2=W(H, dh, d), v=W(H, dv, d),
              o=W(d, H, dv))
    if bias:
        kw.update(q1_bias=W(H, dh), k1_bias=W(H, dh), q2_bias=W(H, dh), k2_bias=W(H, dh),
                  v_bias=W(H, dv), o_bias=W(d))
    return kw


def float32_rope_table(n_ctx, d_head, base=10000.0):
    """cos/sin tables as researchers' code computes them: float32 throughout."""
    inv = (1.0 / base ** (np.arange(0, d_head, 2, dtype=np.float32) / np.float32(d_head))
           ).astype(np.float32)
    ang = np.outer(np.arange(n_ctx, dtype=np.float32), inv).astype(np.float32)
    return np.cos(ang), np.sin(ang)


def model(kw, **pos):
    return ta.Sequential([ta.Residual(ta.BilinearAttention(**kw, **pos)),
                          ta.Linear(np.arange(4.0).reshape(2, 2) - 1.5, [0.5, -0.25])])


def quad(a, b, n_ctx=2, d=2):
    return float(quadrature_inner(a, b, np.eye(d), n_ctx=n_ctx))


def test_rope_table_is_rope_bit_for_bit():
    """position_maps=rope_rotations(...) is the model rope=base: same forward and same exact
    inner products, bit for bit (rope=base itself is unchanged)."""
    rng = np.random.default_rng(0)
    kw = weights(rng)
    a = model(kw, rope=10.0)
    b = model(kw, position_maps=rope_rotations(6, 2, 10.0))
    x = rng.normal(size=(3, 4, 2))
    assert np.array_equal(a(x), b(x))
    c = model(weights(rng))
    assert ta.inner(a, c, n_ctx=4) == ta.inner(b, c, n_ctx=4)
    kw1 = weights(rng, H=1, dh=2, d=1, dv=1, bias=False)
    a1, b1 = (ta.BilinearAttention(**kw1, **p) for p in ({"rope": 10.0}, {"position_maps": rope_rotations(2, 2, 10.0)}))
    assert A.exact_inner(a1, a1, n_ctx=2, backend="exact") == \
        A.exact_inner(b1, a1, n_ctx=2, backend="exact")


def test_float32_rope_table_against_quadrature_and_exact_rope():
    """A float32 rotary table (angles off by ~4e-8) is its own exact model: its inner products
    equal quadrature to 1e-10 and differ from the exact-RoPE model's by ~1e-8 relative."""
    rng = np.random.default_rng(1)
    kw = weights(rng, dh=4)
    cos, sin = float32_rope_table(8, 4)
    maps = rotary_maps(cos, sin)
    assert 1e-9 < np.abs(maps - rope_rotations(8, 4, 10000.0)).max() < 1e-6
    a = model(kw, position_maps=maps)
    r = model(kw, rope=10000.0)
    c = model(weights(rng, dh=4))
    for n_ctx in (2,):
        for u, v in ((a, a), (a, c), (a, r)):
            exact, q = ta.inner(u, v, n_ctx=n_ctx), quad(u, v, n_ctx)
            assert abs(exact - q) <= 1e-10 * abs(q), (exact, q)
    n_ctx = 4
    ac, rc = ta.inner(a, c, n_ctx=n_ctx), ta.inner(r, c, n_ctx=n_ctx)
    assert 1e-12 < abs(ac - rc) / abs(rc) < 1e-6
    s_a, s_r = ta.similarity(a, c, n_ctx=n_ctx), ta.similarity(r, c, n_ctx=n_ctx)
    assert 1e-13 < abs(s_a - s_r) < 1e-6
    assert ta.similarity(a, r, n_ctx=n_ctx) == pytest.approx(1.0, abs=1e-12)


def test_random_position_maps_against_quadrature_brute_force_and_monte_carlo():
    rng = np.random.default_rng(3)
    bias = True
    maps = rng.normal(size=(3, 2, 2))
    a = model(weights(rng, bias=bias), position_maps=maps)
    b = ta.Residual(ta.BilinearAttention(**weights(rng, H=1), rope=3.0))
    for n_ctx in (2,):
        for u, v in ((a, a), (a, b)):
            exact, q = ta.inner(u, v, n_ctx=n_ctx), quad(u, v, n_ctx)
            assert abs(exact - q) <= 1e-10 * abs(q), (exact, q)
    # rationals against verify's brute-force expansion (one head, d = 1)
    a1 = ta.Residual(ta.BilinearAttention(**weights(rng, H=1, d=1, dv=1, bias=bias),
                                          position_maps=maps[:2]))
    ex = A.exact_inner(a1, a1, n_ctx=2, backend="exact")
    assert isinstance(ex, Fraction) and ex == sequence_inner_exact(a1, a1, 2)
    assert float(ex) == pytest.approx(ta.inner(a1, a1, n_ctx=2), rel=1e-12)
    # n_ctx = 3 (every row of the table) against Monte Carlo
    exact = ta.inner(a, b, n_ctx=3)
    mc = MC.montecarlo_inner(a, b, n_ctx=3, n_samples=20_000, seed=5)
    assert abs(float(mc) - exact) <= 5 * mc.stderr


def test_shorter_context_uses_the_leading_maps():
    rng = np.random.default_rng(4)
    kw, maps = weights(rng), rng.normal(size=(5, 2, 2))
    c = model(weights(rng))
    assert ta.inner(model(kw, position_maps=maps), c, n_ctx=3) == \
        pytest.approx(ta.inner(model(kw, position_maps=maps[:3]), c, n_ctx=3), rel=1e-14)


def test_exact_weights_keep_the_maps_exact():
    q = lambda *s: np.vectorize(lambda v: Fraction(int(v), 3), otypes=[object])(  # noqa: E731
        np.random.default_rng(6).integers(-3, 4, s))
    kw = {k: q(*np.shape(v)) for k, v in weights(np.random.default_rng(6), H=1, d=1).items()}
    layer = ta.BilinearAttention(**kw, position_maps=np.full((2, 2, 2), 0.1))
    assert layer.is_exact and layer.position_maps[0, 0, 0] == Fraction(0.1)
    assert ta.inner(layer, layer, n_ctx=2, backend="exact") == \
        sequence_inner_exact(layer, layer, 2)


def test_other_engines_accept_position_maps():
    """degree_similarity, the closure, the per-head Gram and the path decomposition run on
    a model with position maps and agree with the exact inner product where they are exact."""
    rng = np.random.default_rng(7)
    a = model(weights(rng), position_maps=rng.normal(size=(3, 2, 2)))
    b = model(weights(rng), rope=10.0)
    n_ctx = 3
    full = ta.similarity(a, b, n_ctx=n_ctx)
    ds = ta.degree_similarity(a, b, n_ctx=n_ctx)
    assert sorted(ds.keys()) == [1, 5] and ds.exact(1) and ds.exact(5)
    assert float(ds[5]) == pytest.approx(full, rel=1e-10)
    assert np.isfinite(float(ta.similarity(a, b, n_ctx=n_ctx, method="closure")))
    G = A.head_gram(a, a, n_ctx=n_ctx)
    assert G.shape == (2, 2)
    pd = dc.paths(a, n_ctx=n_ctx)
    assert pd.gram.sum() == pytest.approx(ta.inner(a, a, n_ctx=n_ctx), rel=1e-10)


def test_spec_and_checkpoint_round_trips(tmp_path):
    from tensoralg.checkpoint import load_network, save_checkpoint

    rng = np.random.default_rng(8)
    cos, sin = float32_rope_table(4, 2)
    a = model(weights(rng), position_maps=rotary_maps(cos, sin))
    x = rng.normal(size=(2, 4, 2))
    spec = json.loads(json.dumps(a.to_spec()))
    assert "position_maps" in spec[0]["inner"] and "position_maps" not in \
        model(weights(rng), rope=10.0).to_spec()[0]["inner"]
    back = ta.Sequential.from_spec(spec)
    assert np.abs(np.asarray(back(x), dtype=np.float64) - a(x)).max() < 1e-14
    save_checkpoint(tmp_path / "ck", a)
    loaded = load_network(tmp_path / "ck")
    net = loaded.to_network() if hasattr(loaded, "to_network") else loaded
    assert np.array_equal(net(x), a(x))
    assert net.max_n_ctx == 4
    assert ta.inner(net, a, n_ctx=4) == ta.inner(a, a, n_ctx=4)


def test_refusals():
    rng = np.random.default_rng(9)
    kw = weights(rng)
    with pytest.raises(ValueError, match=r"rope and position_maps: give one"):
        ta.BilinearAttention(**kw, rope=10.0, position_maps=np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match=r"position_maps: expected shape \(n_ctx_max, d_head, "
                                         r"d_head\) = \(n_ctx_max, 2, 2\).*got \(2, 3, 3\)"):
        ta.BilinearAttention(**kw, position_maps=np.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match="position_maps"):
        ta.BilinearAttention(**kw, position_maps=np.full((2, 2, 2), np.nan))
    a = model(kw, position_maps=np.ones((3, 2, 2)))
    with pytest.raises(ValueError, match=r"^n_ctx=4 exceeds the 3 positions a's attention "
                                         r"position_maps cover$"):
        ta.inner(a, a, n_ctx=4)
    with pytest.raises(ValueError, match=r"n_ctx=4 exceeds the 3 positions"):
        MC.montecarlo_inner(a, a, n_ctx=4, n_samples=600)
    with pytest.raises(ValueError, match=r"^x: sequences of length 4 exceed the 3 positions"):
        a(np.zeros((1, 4, 2)))
    with pytest.raises(ValueError, match="n_ctx=4 exceeds"):
        a[0].inner.rotations(4)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_maps(np.ones((2, 2)), np.ones((3, 2)))


def test_rotary_maps_layouts():
    """rotary_maps against the rotation written out: interleaved pairs (2i, 2i+1) and the
    rotate_half pairs (i, i + d/2), the latter also from (n_ctx, d_head) tables."""
    ang = np.array([[0.3, 0.7], [1.1, -0.4]])
    q = np.array([1.0, 2.0, 3.0, 4.0])
    R = rotary_maps(np.cos(ang), np.sin(ang))
    c, s = np.cos(ang[1]), np.sin(ang[1])
    want = np.array([q[0] * c[0] - q[1] * s[0], q[0] * s[0] + q[1] * c[0],
                     q[2] * c[1] - q[3] * s[1], q[2] * s[1] + q[3] * c[1]])
    assert np.allclose(R[1] @ q, want, rtol=0, atol=1e-15)
    half = np.concatenate([-q[2:], q[:2]])       # rotate_half(q)
    want_half = q * np.concatenate([c, c]) + half * np.concatenate([s, s])
    for cc, ss in ((np.cos(ang), np.sin(ang)),
                   (np.tile(np.cos(ang), 2), np.tile(np.sin(ang), 2))):
        assert np.allclose(rotary_maps(cc, ss, layout="half")[1] @ q, want_half, rtol=0,
                           atol=1e-15)
