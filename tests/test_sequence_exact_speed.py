"""The exact attention path's shared work: each model's chaos form once (its "b" side the "a"
side relabeled), a lone pair's part norms read from the pair's own contractions. Values are
those of the plain way."""

from __future__ import annotations

import numpy as np
import pytest

import tensoralg as ta
from tensoralg import homogeneous
from tensoralg.strategies import sequence_exact
from tensoralg.strategies.chaos import sequence as chaos_sequence


def _two_layer(seed, d=3, heads=2, dh=2):
    r = np.random.default_rng(seed)
    layers = [ta.Residual(ta.BilinearAttention(*(r.normal(size=(heads, dh, d)) * 0.5
                                                 for _ in range(5)),
                                               r.normal(size=(d, heads, dh)) * 0.5))
              for _ in range(2)]
    return ta.Sequential(layers + [ta.Linear(r.normal(size=(2, d)))])


def _s5_tree(net, n_ctx=3):
    f, why = homogeneous.unrolled(net, n_ctx, 5)
    assert f is not None, why
    return f, f.tree(set(range(6)))


def test_relabeled_side_is_the_fresh_side():
    _, tree = _s5_tree(_two_layer(1))
    for term in tree.nodes[0].terms:
        fresh = chaos_sequence.TermSide(term, "b", np.einsum, 3, False)
        own = chaos_sequence.TermSide(term, "a", np.einsum, 3, False)
        new = own.relabeled(term, "b")
        assert new.R.keys() == fresh.R.keys() and new.signature() == fresh.signature()
        for S, (arr, lab) in fresh.R.items():
            assert new.R[S][1] == lab
            assert (arr is None and new.R[S][0] is None) or np.array_equal(new.R[S][0], arr)
        assert [x[1] for x in new.outer] == [x[1] for x in fresh.outer]
    other = tree.nodes[0].terms[0]
    with pytest.raises(ValueError, match="not the term of this side"):
        chaos_sequence.TermSide(tree.nodes[0].terms[1], "a", np.einsum, 3,
                                False).relabeled(other, "b")


def test_a_lone_pair_contracts_each_term_pair_once(monkeypatch):
    """S<=1 and S<=5 of a bias-free two-layer pair: 3 + n_a n_b + n_a^2 + n_b^2 term pairs;
    the profiles ||P_5||^2 are read from the S<=5 products (they were 2 more contractions),
    bit for bit what the part's own inner product gives."""
    a, b = _two_layer(1), _two_layer(2)
    calls = []
    orig = chaos_sequence.chaos_pair
    monkeypatch.setattr(sequence_exact, "chaos_pair",
                        lambda *x, **k: calls.append(not x[0].dry) or orig(*x, **k))
    r = ta.degree_similarity(a, b, n_ctx=3, max_degree=5)
    n = [len(_s5_tree(x)[1].nodes[0].terms) for x in (a, b)]
    # (not + 2 products of the profiles; the dry runs of the cost checks are not counted)
    assert n[0] >= 2 and sum(calls) == 3 + n[0] * n[1] + n[0] ** 2 + n[1] ** 2
    for side, net in ((r.profile_a, a), (r.profile_b, b)):
        f, _ = _s5_tree(net)
        t = f.tree({5})
        own = float(sequence_exact.tree_inner_req(ta.request.make_request(n_ctx=3), t, t, 3))
        assert side[5] == own
    # and the similarity is the one of the three products computed separately
    ta_, tb = _s5_tree(a)[1], _s5_tree(b)[1]
    req = ta.request.make_request(n_ctx=3)
    ab, aa, bb = (float(sequence_exact.tree_inner_req(req, x, y, 3))
                  for x, y in ((ta_, tb), (ta_, ta_), (tb, tb)))
    assert float(r[5]) == pytest.approx(ab / np.sqrt(aa * bb), rel=1e-12)
