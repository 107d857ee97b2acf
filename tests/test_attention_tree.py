"""The exact attention path on tensoralg.canonical's tree (issue 8, item 6): checked against
verify's brute-force polynomial expansion (rationals, independent of the tree), and the support
check refusing deeper models before any contraction."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from tensoralg.verify.attention import sequence_inner_exact
from test_attention_exact import attn as _attn

import tensoralg as ta
from tensoralg import canonical
from tensoralg.strategies import sequence_exact as A
from tensoralg.strategies.wick.terms import term_network


def _mixed(rng):
    """Embedding (with bias), residual attention with RoPE and every bias, an affine Residual,
    an unembedding (with bias): the affine layers are folded by the tree."""
    return ta.Sequential([
        ta.Linear(rng.normal(size=(2, 1)), rng.normal(size=2)),
        ta.Residual(_attn(rng, rope=10.0)),
        ta.Residual(ta.Linear(rng.normal(size=(2, 2)))),
        ta.Linear(rng.normal(size=(2, 2)), rng.normal(size=2))])


def _inner_residual(rng):
    """A Residual around ``[Linear, attention, Linear]`` (the old private canonical form refused
    it; the tree folds the block's affine maps into the attention term), two heads, no RoPE."""
    return ta.Sequential([
        ta.Linear(rng.normal(size=(2, 1))),
        ta.Residual(ta.Sequential([ta.Linear(rng.normal(size=(3, 2)), rng.normal(size=3)),
                                   _attn(rng, H=2, d=3, d_out=3, mask="none"),
                                   ta.Linear(rng.normal(size=(2, 3)))])),
        ta.Linear(rng.normal(size=(2, 2)))])


def test_canonicalize_returns_the_folded_tree_of_one_node():
    rng = np.random.default_rng(0)
    tree = A.canonicalize(_mixed(rng), 2)
    assert isinstance(tree, canonical.Tree) and len(tree.nodes) == 1
    assert [t.kind for t in tree.nodes[0].terms] == ["linear", "attention"]
    # rope: the query/key legs carry the position axis
    legs = {leg.name: leg for leg in tree.nodes[0].terms[1].legs}
    assert legs["Q1"].positional and legs["K2"].positional and not legs["V"].positional
    assert legs["Q1"].pos == "t" and legs["K1"].pos == "s"


def test_exact_on_the_tree_equals_brute_force():
    """Embedding, residual attention, RoPE, an affine residual, an unembedding, against a model
    with the embedding inside the residual block: equal to verify's expansion as rationals (the
    full sum and one slice; ~3 s each), and the float64 path to 1e-10 relative for the full sum
    and slices. (The "matchings" strategy is cross-checked against "chaos" in
    test_attention_exact.py; here it would take ~10 s per pair.)"""
    rng = np.random.default_rng(1)
    a, b = _mixed(rng), _inner_residual(rng)
    u = [0.5, -1.25]
    for kw in ({}, dict(output=u, position=1)):
        exact = A.exact_inner(a, b, n_ctx=2, backend="exact", **kw)
        assert isinstance(exact, Fraction)
        assert exact == sequence_inner_exact(a, b, 2, **kw)
    for x, y in ((a, b), (a, a), (b, b)):
        for kw in ({}, dict(output=1), dict(position=0), dict(output=u, position=1)):
            want = float(sequence_inner_exact(x, y, 2, **kw))
            got = A.exact_inner(x, y, n_ctx=2, **kw)
            assert abs(got - want) <= 1e-10 * abs(want)


def test_two_attention_layers_refused_before_any_contraction(monkeypatch):
    rng = np.random.default_rng(2)
    one = ta.Sequential([ta.Linear(rng.normal(size=(2, 2))), ta.Residual(_attn(rng))])
    deep = ta.Sequential([ta.Residual(_attn(rng)), ta.Residual(_attn(rng, rope=10.0)),
                          ta.Linear(rng.normal(size=(2, 2)))])

    def no_contraction(*args, **kw):
        raise AssertionError("a contraction was started")
    for name in ("JoinedTermPair", "TermSide", "chaos_pair"):
        monkeypatch.setattr(A, name, no_contraction)
    for call in (lambda: A.exact_inner(one, deep, n_ctx=2),
                 lambda: A.exact_inner(deep, one, n_ctx=2, backend="exact"),
                 lambda: A.count_configurations(one, deep, 2),
                 lambda: A.count_configurations(deep, deep, 2)):
        with pytest.raises(A.AttentionNotSupported,
                           match="layer 1 is a second attention layer.*method='montecarlo' "
                                 "or method='closure'"):
            call()
    # a Gram matrix checks every model before its first pair
    with pytest.raises(A.AttentionNotSupported, match="models\\[1\\]: .*layer 1 is a second"):
        A.exact_gram([one, deep], n_ctx=2)
    # a per-position Bilinear after the attention is still refused exactly
    mlp = ta.Sequential([ta.Residual(_attn(rng)),
                         ta.Bilinear(rng.normal(size=(2, 2)), rng.normal(size=(2, 2)),
                                     rng.normal(size=(2, 2)))])
    with pytest.raises(A.AttentionNotSupported, match="layer 1 is Bilinear"):
        A.exact_inner(mlp, one, n_ctx=2)
    # a Residual block with two non-linear layers: the tree's message, as AttentionNotSupported
    two = ta.Residual(ta.Sequential([_attn(rng), _attn(rng)]))
    with pytest.raises(A.AttentionNotSupported, match="Residual block holding 2 non-linear "
                                                      "layers.*montecarlo_inner"):
        A.exact_inner(two, one, n_ctx=2)


def test_canonicalize_checks_n_ctx():
    """A bad ``n_ctx`` is a plain ValueError naming it, not a refusal of the model."""
    net = _mixed(np.random.default_rng(5))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="n_ctx: expected a positive int") as info:
            A.canonicalize(net, bad)
        assert not isinstance(info.value, A.AttentionNotSupported)


def test_term_network_labels_by_side():
    """Each side's labels get its suffix except the shared output ``o`` and query position
    ``t``; the key position ``s`` becomes ``sa`` / ``sb``; the weights are not copied."""
    rng = np.random.default_rng(3)
    term = A.canonicalize(_mixed(rng), 2).nodes[0].terms[1]
    static, legs = term_network(term, "b")
    assert [lab for _, lab in static] == [("o", "hb", "vb"), ("t", "sb")]
    assert [(leg.name, leg.pos, leg.labels) for leg in legs] == [
        ("Q1b", "t", ("hb", "eb")), ("K1b", "sb", ("hb", "eb")), ("Q2b", "t", ("hb", "fb")),
        ("K2b", "sb", ("hb", "fb")), ("Vb", "sb", ("hb", "vb"))]
    assert all(x.weight is y.weight for x, y in zip(legs, term.legs))


def test_tree_folded_refuses_a_batched_tree():
    rng = np.random.default_rng(4)
    tree = canonical.sequence_tree(_mixed(rng), 2, fold=False)
    assert len(tree.nodes) == 4 and len(tree.folded().nodes) == 1
    with pytest.raises(ValueError, match="Tree.folded: fold one model"):
        canonical.Tree(tree.nodes, tree.d_in, tree.d_out, 2, batched=True).folded()
