"""Sequence models (bilinear attention): options that inner, similarity, plan, gram and
count_configurations must treat alike (found by a fresh-install test pass)."""

from __future__ import annotations

import numpy as np
import pytest
from tensoralg.verify.attention import sequence_inner_exact
from test_attention_exact import attn

import tensoralg as ta
from tensoralg.strategies import sequence_exact


def _pair(seed=0):
    """A causal model (fixes no length) and one whose mask array fixes n_ctx = 2."""
    rng = np.random.default_rng(seed)
    return attn(rng), attn(rng, H=2, mask=rng.normal(size=(2, 2)))


def _err(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def test_similarity_reads_n_ctx_from_the_partner_mask_like_inner():
    """similarity(a, m) without n_ctx, a causal: n_ctx comes from m's mask, as in inner (the
    self term <a, a> alone fixes no length). Checked against verify's brute-force expansion."""
    a, m = _pair()
    got = ta.similarity(a, m)
    ab, aa, bb = (float(sequence_inner_exact(x, y, 2)) for x, y in ((a, m), (a, a), (m, m)))
    want = ab / np.sqrt(aa * bb)
    assert abs(got - want) <= 1e-10 * abs(want)
    assert ta.similarity(m, a) == pytest.approx(want, rel=1e-10)
    exact = ta.similarity(a, m, backend="exact")
    assert abs(float(exact) - want) <= 1e-10 * abs(want)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "9"])
def test_bad_max_configurations_same_error_in_plan_inner_and_gram(bad):
    a, _ = _pair()
    msg = f"max_configurations: expected a positive integer, got {bad!r}"
    assert _err(lambda: ta.plan(a, a, n_ctx=2, max_configurations=bad)) == (ValueError, msg)
    assert _err(lambda: ta.inner(a, a, n_ctx=2, max_configurations=bad)) == (ValueError, msg)
    assert _err(lambda: ta.similarity(a, a, n_ctx=2, max_configurations=bad)) == (ValueError,
                                                                                   msg)
    assert _err(lambda: ta.gram([a, a], n_ctx=2, max_configurations=bad)) == (ValueError, msg)


@pytest.mark.parametrize("u, what", [(np.array([np.nan, 1.0]), "non-finite"),
                                     (np.array([1.0, np.inf]), "non-finite"),
                                     (np.array(["a", "b"]), "real array"),
                                     (np.zeros(2), "is zero")])
def test_bad_direction_vector_refused_everywhere(u, what):
    """A NaN/inf/non-numeric or zero direction is an error naming `output` (as for
    position-free networks), in plan and inner alike and in count_configurations (where a NaN
    used to change the zero pattern and so the count)."""
    a, _ = _pair()
    e_plan = _err(lambda: ta.plan(a, a, n_ctx=2, output=u))
    e_inner = _err(lambda: ta.inner(a, a, n_ctx=2, output=u))
    assert e_plan == e_inner
    assert e_inner[1].startswith("output:") and what in e_inner[1]
    assert _err(lambda: sequence_exact.count_configurations(a, a, 2, output=u)) == e_inner
    assert _err(lambda: ta.similarity(a, a, n_ctx=2, output=u)) == e_inner


def test_valid_direction_still_accepted():
    a, m = _pair()
    u = [0.5, -2.0]  # a list is a direction too
    got = ta.inner(a, m, output=u)
    assert got == pytest.approx(float(sequence_inner_exact(a, m, 2, output=np.array(u))),
                                rel=1e-10)


def test_gram_masks_fixing_different_lengths_named_before_work():
    """A causal model between two masks fixing n_ctx = 2 and 3: a ValueError naming both
    models (not an AttentionNotSupported about 'one attention layer')."""
    rng = np.random.default_rng(1)
    a, m2, m3 = attn(rng), attn(rng, mask=rng.normal(size=(2, 2))), \
        attn(rng, mask=rng.normal(size=(3, 3)))
    for method in ("exact", "closure"):
        for fn in (ta.gram, ta.similarity_matrix):
            kind, msg = _err(lambda fn=fn, method=method: fn([a, m2, m3], method=method))
            assert kind is ValueError
            assert "models[1]: n_ctx=2" in msg and "models[2]: n_ctx=3" in msg
    kind, msg = _err(lambda: ta.gram([a, m2], n_ctx=3))
    assert kind is ValueError and msg == "n_ctx=3 differs from models[1]'s attention mask of " \
                                        "shape (2, 2)"


def test_cross_gram_of_sequence_models_is_a_clear_error():
    """cross_gram takes position-free networks; a sequence model is named (was a TypeError
    'unknown layer type BilinearAttention') and the alternatives are given."""
    a, m = _pair()
    rng = np.random.default_rng(2)
    lin = ta.Linear(rng.normal(size=(2, 2)))
    kind, msg = _err(lambda: ta.cross_gram([lin, a], [a]))
    assert kind is ValueError and msg.startswith("models_a[1]: a sequence model")
    assert "ta.gram(models_a + models_b" in msg and "closure_cross_gram" in msg
    kind, msg = _err(lambda: ta.cross_gram([lin], [m]))
    assert kind is ValueError and msg.startswith("models_b[0]: a sequence model")


def test_tree_degree_is_the_polynomial_degree_not_the_open_leg_count():
    """Two residual attention layers without biases: Tree.degree is 5 * 5 = 25 (each node's
    largest term), while the unrolled graph has (1 + 5) * (1 + 5) = 36 open legs. The degree
    is checked on f itself, in rationals: along the line s -> f(s x), the 26th finite
    difference vanishes exactly and the 25th does not."""
    from fractions import Fraction
    from math import comb

    from tensoralg import canonical
    rng = np.random.default_rng(3)
    q = lambda *s: np.vectorize(lambda v: Fraction(int(v), 2), otypes=[object])(  # noqa: E731
        rng.integers(-5, 6, s))

    def layer():
        return ta.Residual(ta.BilinearAttention(q(1, 2, 2), q(1, 2, 2), q(1, 2, 2), q(1, 2, 2),
                                                q(1, 2, 2), q(2, 1, 2), mask="none"))
    net = ta.Sequential([layer(), layer()])
    tree = canonical.tree(net, n_ctx=2)
    assert tree.degree == 25
    g = ta.to_graph(net, n_ctx=2)
    assert sum(1 for _, d in g.nodes(data=True) if d.get("leg")) == 36
    x = q(1, 2, 2)
    vals = [net(x * Fraction(k)) for k in range(27)]

    def diff(n):  # n-th forward difference at 0, every entry
        return sum((-1) ** (n - k) * comb(n, k) * vals[k] for k in range(n + 1))
    assert np.all(diff(26) == 0)
    assert np.any(diff(25) != 0)


def test_gram_refuses_a_position_free_mlp_among_sequence_models_like_inner():
    rng = np.random.default_rng(21)
    from netgen import rand_network
    from test_attention_exact import attn

    a = ta.Residual(attn(rng, H=1, dh=2, d=3, dv=1))
    mlp = rand_network(rng, "bilinear", d=3, out=3)
    with pytest.raises(ValueError, match="position-free network of degree > 1"):
        ta.inner(a, mlp, n_ctx=2)
    for fn in (ta.gram, ta.similarity_matrix):
        for method in ("exact", "closure"):
            with pytest.raises(ValueError, match=r"models\[1\]: a position-free network of "
                                                 r"degree 2 among sequence models"):
                fn([a, mlp], n_ctx=2, method=method)
    affine = ta.Linear(rng.normal(size=(3, 3)), rng.normal(size=3))   # accepted, per position
    G = ta.gram([a, affine], n_ctx=2)
    assert G[0, 1] == ta.inner(a, affine, n_ctx=2)          # the same computation
    # iid positions: <affine, affine> over 2 positions is twice the position-free one
    # (float64 through two different contractions: a few ulps)
    assert G[1, 1] == pytest.approx(2 * ta.inner(affine, affine), rel=1e-12)
    # the closure is exact at depth 1 (docs/mathematics.md §3.2): equal in exact arithmetic, so the
    # project's float64 bar for exact methods, 1e-10 relative, applies
    Gc = ta.gram([a, affine], n_ctx=2, method="closure")
    assert np.allclose(Gc, G, rtol=1e-10, atol=0)
