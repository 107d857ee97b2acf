"""The general canonical form (canonical.Tree): nodes of lifted multilinear terms whose legs
carry positions. Every form is checked against the layers' own forward pass (an independent
computation: it never builds lifted tensors), in float64 and in exact rationals."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from netgen import rand_bilinear, rand_linear, rand_network, to_fractions
from test_attention_exact import attn

import tensoralg as ta
from tensoralg import canonical as C

VECTOR_KINDS = ["linear", "bilinear", "bilinear_nobias", "embed_bilinear_head", "residual",
                "depth2", "depth2_residual_embed_head"]


def rel_err(x, y):
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-300))


def fractions(a):
    return np.vectorize(Fraction, otypes=[object])(a)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(VECTOR_KINDS),
       keep_embed=st.booleans())
def test_vector_tree_evaluates_to_the_network(seed, kind, keep_embed):
    rng = np.random.default_rng(seed)
    net = rand_network(rng, kind, log_scale=(-0.5, 0.5))
    x = rng.normal(size=(6, net.in_features))
    t = C.canonicalize(net, keep_embed=keep_embed).tree()
    assert t.n_ctx is None and not t.batched
    assert t.degree == net.degree
    # float64 evaluation in another order: a few ulps of the largest output
    assert rel_err(t.forward(x), net(x)) < 1e-12


@pytest.mark.parametrize("kind", VECTOR_KINDS)
def test_vector_tree_is_exact_in_rationals(kind):
    rng = np.random.default_rng(3)
    net = to_fractions(rand_network(rng, kind, log_scale=(-0.5, 0.5)))
    x = fractions(rng.integers(-3, 4, size=(3, net.in_features)))
    t = C.canonicalize(net).tree()
    assert t.exact
    assert np.array_equal(t.forward(x), net(x))


def seq_models(rng, d=3, H=2, **kw):
    layer = attn(rng, H=H, dh=2, d=d, dv=2, **kw)
    return [layer,
            ta.Sequential([rand_linear(rng, 4, d), layer, rand_linear(rng, d, 2)]),
            ta.Sequential([rand_linear(rng, 4, d), layer,
                           ta.Residual(rand_bilinear(rng, d, 3, d)), rand_linear(rng, d, 2)])]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), residual=st.booleans(), bias=st.booleans(),
       rope=st.sampled_from([None, 100.0]), mask=st.sampled_from(["causal", "none"]),
       which=st.integers(0, 2), fold=st.booleans(), n_ctx=st.integers(1, 4))
def test_sequence_tree_evaluates_to_the_model(seed, residual, bias, rope, mask, which, fold,
                                              n_ctx):
    rng = np.random.default_rng(seed)
    net = seq_models(rng, residual=residual, bias=bias, rope=rope, mask=mask)[which]
    X = rng.normal(size=(3, n_ctx, net.in_features))
    t = C.sequence_tree(net, n_ctx, fold=fold)
    assert t.n_ctx == n_ctx and t.d_out == net.out_features
    assert rel_err(t.forward(X), net(X)) < 1e-12
    if fold:   # affine layers are folded away: one node per non-linear layer
        assert len(t.nodes) == 1 + (which == 2)


def test_sequence_tree_is_exact_in_rationals_and_legs_carry_positions():
    rng = np.random.default_rng(5)
    for net in seq_models(rng, residual=True, rope=None):
        net = to_fractions(net)
        X = fractions(rng.integers(-2, 3, size=(2, 3, net.in_features)))
        t = C.sequence_tree(net, 3)
        assert np.array_equal(t.forward(X), net(X))
        attn_terms = [term for node in t.nodes for term in node.terms if term.kind == "attention"]
        assert len(attn_terms) == 1
        legs = attn_terms[0].legs
        assert [leg.name for leg in legs] == ["Q1", "K1", "Q2", "K2", "V"]
        assert [leg.pos for leg in legs] == ["t", "s", "t", "s", "s"]
        assert attn_terms[0].degree == 5


def test_rope_legs_are_positional():
    rng = np.random.default_rng(6)
    t = C.sequence_tree(attn(rng, H=1, dh=2, d=2, dv=1, rope=50.0), 3)
    legs = {leg.name: leg for leg in t.legs()}
    assert legs["Q1"].positional and legs["K2"].positional and not legs["V"].positional
    assert legs["Q1"].weight.shape == (3, 1, 2, 3)   # (n_ctx, heads, d_head, d + 1)


def test_position_free_model_per_position_and_tree_dispatch():
    rng = np.random.default_rng(7)
    net = rand_network(rng, "depth2", log_scale=(-0.5, 0.5))
    X = rng.normal(size=(2, 3, net.in_features))
    t = C.tree(net, n_ctx=3)
    assert rel_err(t.forward(X), np.stack([net(X[:, p]) for p in range(3)], 1)) < 1e-12
    assert C.tree(net).n_ctx is None
    layer = attn(rng, mask=np.tril(np.ones((4, 4))))
    assert C.tree(layer).n_ctx == 4   # the mask fixes it


def test_batched_tree_shares_the_stack():
    rng = np.random.default_rng(8)
    nets = [rand_network(rng, "depth2") for _ in range(3)]
    t = C.stack([C.canonicalize(n) for n in nets]).tree()
    assert t.batched and t.legs()[0].weight.shape[0] == 3
    with pytest.raises(ValueError, match="unbatched"):
        t.forward(np.zeros((1, nets[0].in_features)))


def test_bad_input():
    rng = np.random.default_rng(9)
    layer = attn(rng)
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="n_ctx"):
            C.sequence_tree(layer, bad)
    with pytest.raises(ValueError, match="n_ctx: required"):
        C.tree(layer)
    with pytest.raises(ValueError, match="fold: expected True or False, got 'no'"):
        C.sequence_tree(layer, 3, fold="no")
    t = C.sequence_tree(layer, 3)
    with pytest.raises(ValueError, match=r"x: expected shape \(n, 3, 2\)"):
        t.forward(np.zeros((1, 2, 2)))
    with pytest.raises(ValueError, match="Residual block holding 2 non-linear"):
        C.sequence_tree(ta.Residual(ta.Sequential([layer, attn(rng)])), 3)
    # a rescaled chain is not canonical: dropping the constant row would not be exact
    can = C.canonicalize(rand_network(rng, "depth2"))
    can.stages[0].D[0, 0] = 2.0
    with pytest.raises(ValueError, match="not e0"):
        can.tree()


def test_unknown_layer_type_is_named():
    class Odd(ta.layers.Layer):
        in_features = out_features = 2

        def arrays(self):
            return [np.zeros(1)]

    with pytest.raises(TypeError, match="layer 0: unknown layer type Odd"):
        C.sequence_tree(ta.Sequential([Odd()]), 2)
