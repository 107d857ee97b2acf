"""Degree-resolved similarity (tensoralg.degree, docs/mathematics.md §3.9 "Homogeneous parts").

Independent checks: the homogeneous parts against a sympy expansion written here (not
tensoralg's forward pass); every exact S<=K against tensor-product Gauss–Hermite quadrature
(tensoralg.verify.quadrature.gauss_hermite) of the DFT-projected truncation over all the input variables
(a different computation: forward passes and a quadrature rule, not the graded network / the
exact Wick-chaos engines); the Monte Carlo estimates against the same quadrature truth within
their standard errors.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
from tensoralg.verify.quadrature import gauss_hermite

import tensoralg as ta
from tensoralg.degree import DegreeSimilarity, degree_similarity
from tensoralg.homogeneous import homogeneous_parts

# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------

def _bil(r, d, h, out, bias, scale=1.0):
    b = (lambda n: r.standard_normal(n)) if bias else (lambda n: None)
    return ta.Bilinear(scale * r.standard_normal((h, d)), r.standard_normal((h, d)),
                       r.standard_normal((out, h)) / h, b(h), b(h), b(out))


def _mlp(seed, bias=True, d=2, out=2):
    r = np.random.default_rng(seed)
    return ta.Sequential([ta.Residual(_bil(r, d, 3, d, bias)), ta.Residual(_bil(r, d, 2, d, bias)),
                          ta.Linear(r.standard_normal((out, d)), r.standard_normal(out) if bias
                                    else None)])


def _attn(r, d, heads, dh, bias, s=0.5, mask="causal", rope=None):
    g = r.standard_normal
    kw = {}
    if bias:
        kw = {n: g((heads, dh)) for n in ("q1_bias", "k1_bias", "q2_bias", "k2_bias")}
        kw["v_bias"] = g((heads, 1))
        kw["o_bias"] = g(d)
    return ta.BilinearAttention(s * g((heads, dh, d)), s * g((heads, dh, d)),
                                s * g((heads, dh, d)), s * g((heads, dh, d)),
                                s * g((heads, 1, d)), s * g((d, heads, 1)), mask=mask,
                                rope=rope, **kw)


def _two_layer(seed, bias=False, d_in=2, d=3, out=2, s=0.5, rope=None):
    """Embedding, two residual attention layers (different head counts), unembedding."""
    r = np.random.default_rng(seed)
    return ta.Sequential([ta.Linear(r.standard_normal((d, d_in))),
                          ta.Residual(_attn(r, d, 2, 2, bias, s, rope=rope)),
                          ta.Residual(_attn(r, d, 1, 2, bias, s, rope=rope)),
                          ta.Linear(r.standard_normal((out, d)))])


def _one_layer(seed, bias=True, d=2, out=2):
    r = np.random.default_rng(seed)
    return ta.Sequential([ta.Residual(_attn(r, d, 2, 1, bias, 0.7)),
                          ta.Linear(r.standard_normal((out, d)), r.standard_normal(out))])


# ---------------------------------------------------------------------------------------
# the truth: Gauss–Hermite quadrature of the DFT-projected truncations over every variable
# ---------------------------------------------------------------------------------------

def _quad_truncated(a, b, K, shape, nodes=None):
    """``(<a,b>, <a,a>, <b,b>)`` of the degree-<=K truncations, by the tensor-product
    Gauss–Hermite rule with ``K + 1`` nodes per variable (exact: per-variable degree <= 2K)."""
    D = int(np.prod(shape))
    m = K + 1 if nodes is None else nodes
    y, w = gauss_hermite(m)
    grid = np.array(list(itertools.product(range(m), repeat=D)))
    X = y[grid].reshape((-1,) + shape)
    W = np.prod(w[grid], axis=1)
    out = []
    for net in (a, b):
        P = homogeneous_parts(net, X)
        out.append(P[:K + 1].sum(axis=0).reshape(X.shape[0], -1))
    fa, fb = out
    return (float(W @ np.sum(fa * fb, axis=1)), float(W @ np.sum(fa * fa, axis=1)),
            float(W @ np.sum(fb * fb, axis=1)))


def _quad_part_norms(net, ks, shape):
    """``{k: ||P_k||^2}`` by the Gauss–Hermite rule with ``max(ks) + 1`` nodes per variable."""
    D = int(np.prod(shape))
    m = max(ks) + 1
    y, w = gauss_hermite(m)
    grid = np.array(list(itertools.product(range(m), repeat=D)))
    X = y[grid].reshape((-1,) + shape)
    W = np.prod(w[grid], axis=1)
    P = homogeneous_parts(net, X)
    return {k: float(W @ np.sum(P[k].reshape(X.shape[0], -1) ** 2, axis=1)) for k in ks}


def _sim(t):
    return t[0] / math.sqrt(t[1] * t[2])


# ---------------------------------------------------------------------------------------
# homogeneous parts
# ---------------------------------------------------------------------------------------

def _sym_bilinear(layer, x):
    L, R, D = (sp.Matrix(np.vectorize(sp.nsimplify)(a)) for a in (layer.left, layer.right,
                                                                 layer.down))
    lb = sp.zeros(L.rows, 1) if layer.left_bias is None else sp.Matrix(layer.left_bias)
    rb = sp.zeros(L.rows, 1) if layer.right_bias is None else sp.Matrix(layer.right_bias)
    db = sp.zeros(D.rows, 1) if layer.down_bias is None else sp.Matrix(layer.down_bias)
    h = (L * x + lb).multiply_elementwise(R * x + rb)
    return D * h + db


def test_parts_match_sympy_expansion_position_free():
    """P_k from the DFT equals the degree-k component of the sympy expansion (a forward pass
    written here, in rationals), and the parts sum to f."""
    r = np.random.default_rng(3)
    q = lambda a: np.vectorize(lambda v: Fraction(v).limit_denominator(50))(a)  # noqa: E731
    l1 = ta.Bilinear(q(r.standard_normal((2, 2))), q(r.standard_normal((2, 2))),
                     q(r.standard_normal((2, 2))), q(r.standard_normal(2)),
                     q(r.standard_normal(2)), q(r.standard_normal(2)))
    l2 = ta.Bilinear(q(r.standard_normal((2, 2))), q(r.standard_normal((2, 2))),
                     q(r.standard_normal((1, 2))), q(r.standard_normal(2)), None, None)
    net = ta.Sequential([ta.Residual(l1), l2])
    xs = sp.symbols("x0 x1")
    x = sp.Matrix(xs)
    y = x + _sym_bilinear(l1, x)
    f = sp.expand(_sym_bilinear(l2, y)[0])
    poly = sp.Poly(f, *xs)
    comp = {}
    for mono, c in poly.terms():
        comp[sum(mono)] = comp.get(sum(mono), 0) + c * sp.prod([v ** e for v, e in zip(xs, mono)])
    pt = np.array([[0.7, -1.3], [1.9, 0.4]])
    P = homogeneous_parts(net, pt)
    assert P.shape == (5, 2, 1)
    for k in range(5):
        want = np.array([float(comp.get(k, 0).subs(dict(zip(xs, p)))) for p in pt])
        np.testing.assert_allclose(P[k, :, 0], want, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(P.sum(axis=0), net(pt), rtol=1e-12)


def test_parts_match_sympy_expansion_attention():
    """One attention layer with biases, d = 1, n_ctx = 2: the DFT parts equal the degree-k
    components of a sympy forward pass written here (pattern mask * c * (q1.k1)(q2.k2))."""
    r = np.random.default_rng(5)
    net = _one_layer(5, bias=True, d=1, out=1)
    att, head = net[0].inner, net[1]
    xs = sp.symbols("x0 x1")
    c = sp.nsimplify(att.scale)
    M = att.mask_matrix(2)
    out = []
    for t in range(2):
        tot = 0
        for h in range(att.n_heads):
            def lin(w, b, pos, h=h):
                return sp.nsimplify(w[h, 0, 0]) * xs[pos] + (0 if b is None else
                                                             sp.nsimplify(b[h, 0]))
            for s in range(2):
                pat = M[t, s] * c * lin(att.q1, att.q1_bias, t) * lin(att.k1, att.k1_bias, s) \
                    * lin(att.q2, att.q2_bias, t) * lin(att.k2, att.k2_bias, s)
                tot += pat * lin(att.v, att.v_bias, s) * sp.nsimplify(att.o[0, h, 0])
        hval = xs[t] + tot + sp.nsimplify(att.o_bias[0])
        out.append(sp.expand(sp.nsimplify(head.weight[0, 0]) * hval + sp.nsimplify(head.bias[0])))
    X = r.standard_normal((3, 2, 1))
    P = homogeneous_parts(net, X)
    for t in range(2):
        poly = sp.Poly(out[t], *xs)
        for k in range(6):
            comp = sum(c_ * sp.prod([v ** e for v, e in zip(xs, mono)])
                       for mono, c_ in poly.terms() if sum(mono) == k)
            want = [float(sp.sympify(comp).subs({xs[0]: X[n, 0, 0], xs[1]: X[n, 1, 0]}))
                    for n in range(3)]
            np.testing.assert_allclose(P[k, :, t, 0], want, rtol=1e-10, atol=1e-11)


def test_parts_sum_to_f_two_layers_and_homogeneity():
    net = _two_layer(1, bias=True, rope=10000.0)
    X = np.random.default_rng(0).standard_normal((4, 2, 2))
    P = homogeneous_parts(net, X)
    assert P.shape == (26, 4, 2, 2)
    np.testing.assert_allclose(P.sum(axis=0), net(X), rtol=1e-10, atol=1e-12)
    # P_k(2 X) = 2^k P_k(X)
    P2 = homogeneous_parts(net, 2 * X)
    scale = 2.0 ** np.arange(26)
    for k in (0, 1, 3, 5, 9):
        np.testing.assert_allclose(P2[k], scale[k] * P[k], rtol=1e-8,
                                   atol=1e-9 * np.abs(P2).max())


def test_complex_forward_matches_real_forward():
    net = _two_layer(2, bias=True)
    X = np.random.default_rng(1).standard_normal((3, 2, 2))
    y = net(X)
    assert y.dtype == np.float64
    z = net(X.astype(np.complex128))
    assert z.dtype == np.complex128
    np.testing.assert_allclose(z.real, y, rtol=1e-14, atol=1e-14)
    assert np.all(z.imag == 0)


# ---------------------------------------------------------------------------------------
# exact S<=K against quadrature
# ---------------------------------------------------------------------------------------

def test_position_free_every_K_exact_against_quadrature():
    a, b = _mlp(1, bias=True), _mlp(2, bias=True)
    r = degree_similarity(a, b, max_degree=(1, 2, 3, 4))
    assert all(r.exact(K) for K in r.keys())
    for K in (1, 2, 3, 4):
        t = _quad_truncated(a, b, K, (2,))
        assert r[K] == pytest.approx(_sim(t), rel=1e-10, abs=1e-12)
    # at the degree: the full similarity; above it: refused, naming the degree
    assert r[4] == pytest.approx(ta.similarity(a, b), rel=1e-12)
    with pytest.raises(ValueError, match=r"max_degree: 6 is above the models' degree 4"):
        degree_similarity(a, b, max_degree=(1, 6))
    assert tuple(degree_similarity(a, b).keys()) == (1, 4)   # default: (1, 5, 9) below 4, and 4
    # the profiles: ||P_k||^2 by quadrature of each DFT part
    m = 5
    y, w = gauss_hermite(m)
    grid = np.array(list(itertools.product(range(m), repeat=2)))
    X, W = y[grid], np.prod(w[grid], axis=1)
    for net, prof in ((a, r.profile_a), (b, r.profile_b)):
        P = homogeneous_parts(net, X)
        for k in range(5):
            assert prof[k] == pytest.approx(float(W @ np.sum(P[k] ** 2, axis=1)), rel=1e-10)


def test_two_attention_layers_S5_exact_against_quadrature():
    """f = U(h + A2(h)), h = E X + A1(E X), no biases: f_<=5 = U(EX + A1(EX) + A2(EX)) on one
    node, by the exact attention path; truth by quadrature over the 4 input variables."""
    a, b = _two_layer(3), _two_layer(4)
    r = degree_similarity(a, b, n_ctx=2, max_degree=(1, 5), n_samples=60)
    assert r.exact(1) and r.exact(5)
    for K in (1, 5):
        assert r[K] == pytest.approx(_sim(_quad_truncated(a, b, K, (2, 2))), rel=1e-10)
    # the bias-free profile: parts of degree 0, 2, 3, 4 vanish exactly; 1 and 5 exact
    for prof, net in ((r.profile_a, a), (r.profile_b, b)):
        assert [prof[k] for k in (0, 2, 3, 4)] == [0.0] * 4
        q = _quad_part_norms(net, (1, 5), (2, 2))
        assert prof[1] == pytest.approx(q[1], rel=1e-10)
        assert prof[5] == pytest.approx(q[5], rel=1e-10)


def test_rope_heads_side_by_side_exact():
    a, b = _two_layer(5, rope=100.0), _two_layer(6, rope=100.0)
    r = degree_similarity(a, b, n_ctx=2, max_degree=5, n_samples=60)
    assert r.exact(5)
    assert r[5] == pytest.approx(_sim(_quad_truncated(a, b, 5, (2, 2))), rel=1e-10)


def test_one_attention_layer_with_biases():
    """S<=1 exact (affine part: the DFT Jacobian); K >= 5 the model itself (exact);
    K in 2..4 with biases: Monte Carlo, and it says why."""
    a, b = _one_layer(7), _one_layer(8)
    r = degree_similarity(a, b, n_ctx=2, max_degree=(1, 3, 5), n_samples=3000, seed=1)
    assert r.exact(1) and r.exact(5) and not r.exact(3)
    assert r[1] == pytest.approx(_sim(_quad_truncated(a, b, 1, (2, 2))), rel=1e-10)
    assert r[5] == pytest.approx(ta.similarity(a, b, n_ctx=2), rel=1e-10)
    assert "biases" in r.notes[3] and "control variate: exact S<=1" in r.notes[3]
    truth = _sim(_quad_truncated(a, b, 3, (2, 2)))
    est = r[3]
    assert est.reliable
    assert abs(est - truth) < 4 * est.stderr


def test_S9_montecarlo_with_control_variate_covers_quadrature(monkeypatch):
    """S<=9 of two attention layers is exact where the feature-space chaos fits (here N = 2);
    over its budget (simulated), Monte Carlo with the exact S<=5 as control variate."""
    from tensoralg.errors import CostTooHigh
    from tensoralg.strategies.chaos import composed

    a, b = _two_layer(9, s=0.4, d_in=1), _two_layer(10, s=0.4, d_in=1)
    truth = _sim(_quad_truncated(a, b, 9, (2, 1)))
    r = degree_similarity(a, b, n_ctx=2, max_degree=(5, 9), n_samples=60)
    assert r.exact(9) and "feature-space chaos" in r.notes[9]
    assert abs(r[9] - truth) < 1e-10

    def over(*args, **kw):
        raise CostTooHigh("over budget (simulated)")
    monkeypatch.setattr(composed, "check", over)
    r = degree_similarity(a, b, n_ctx=2, max_degree=(5, 9), n_samples=1500, seed=2)
    assert r.exact(5) and r.method[9] == "montecarlo"
    assert "control variate: exact S<=5" in r.notes[9]
    assert "feature-space chaos refused: over budget (simulated)" in r.notes[9]
    est = r[9]
    assert est.reliable, est.diagnostics.summary()
    assert abs(est - truth) < 4 * est.stderr
    assert est.stderr > 0


def test_cov_scales_the_parts():
    """N(0, σ² I): P_k scales by σ^k, so ||P_k||^2 by σ^(2k) (exact profile)."""
    a, b = _mlp(1), _mlp(2)
    r1 = degree_similarity(a, b, max_degree=(2, 4))
    r2 = degree_similarity(a, b, max_degree=(2, 4), cov=0.25)
    for k in range(5):
        assert r2.profile_a[k] == pytest.approx(0.25 ** k * r1.profile_a[k], rel=1e-10)
    assert r2[4] == pytest.approx(ta.similarity(a, b, cov=0.25), rel=1e-12)
    assert "0.25" in r2.distribution or "σ" in r2.distribution or "sigma" in r2.distribution


def test_repr_says_different_question_and_hides_unreliable():
    a, b = _mlp(1), _mlp(2)
    text = repr(degree_similarity(a, b, max_degree=(1, 2)))
    assert "different question" in text and "not an approximation" in text
    assert "(exact)" in text
    # a heavy-tailed two-layer pair: an unreliable S<=9 is not printed as a number
    from tensoralg.verify.planted import planted_attention
    pa = planted_attention(4, 3, seed=1, bias=False).network
    pb = planted_attention(4, 3, seed=2, bias=False).network
    with pytest.warns(RuntimeWarning, match="n_samples=60 < 300"):
        r = degree_similarity(pa, pb, n_ctx=3, max_degree=(5, 9), n_samples=60)
    assert r.exact(5)
    if not r[9].reliable:
        assert "no reliable estimate" in repr(r)
    assert isinstance(r, DegreeSimilarity)


@pytest.mark.parametrize("bad, match", [
    (0, "max_degree"), ((5, 1), "increasing"), ((1, 1), "increasing"), ((1.5,), "max_degree"),
    (True, "max_degree"), ("5", "max_degree"), ((), "max_degree"), ((-1, 2), "max_degree"),
])
def test_bad_max_degree(bad, match):
    with pytest.raises(ValueError, match=match) as exc:
        degree_similarity(_mlp(1), _mlp(2), max_degree=bad)
    assert "\n" not in str(exc.value)


def test_bad_arguments_one_line():
    a, b = _mlp(1), _mlp(2)
    for kw, match in (({"n_samples": 2}, "n_samples"), ({"seed": -1}, "seed"),
                      ({"cov": -1.0}, "cov"), ({"n_ctx": 3}, "n_ctx")):
        with pytest.raises(ValueError, match=match) as exc:
            degree_similarity(a, b, **kw)
        assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="n_ctx"):
        degree_similarity(_two_layer(1), _two_layer(2))
    with pytest.raises(ValueError, match="out") as exc:
        degree_similarity(_mlp(1, out=2), _mlp(2, out=3))
    # degree_similarity takes no output=: its message does not offer slicing (tester finding)
    assert "output=" not in str(exc.value) and "same outputs" in str(exc.value)
    with pytest.raises(ValueError, match="sequence model"):
        degree_similarity(_two_layer(1, d_in=2, out=2), _mlp(2), n_ctx=2)
    with pytest.raises(ValueError, match="m:"):
        homogeneous_parts(a, np.zeros((1, 2)), m=4)


def test_attention_then_bilinear_mlp_block_exact_to_degree_9():
    """One standard block (residual attention, then a residual bilinear MLP), no biases:
    f = U(h + M(h)), h = X + A(X), M(h) = D((L h)(R h)) has parts of degrees 1, 2, 5 (X, M(X),
    A(X)), 6 (the MLP reading A in one factor: L X * R A + L A * R X) and 10 (in both). The
    unrolled one-node form makes every S<=K with K <= 9 exact (degree 6 joins 12 legs); S<=10,
    the full similarity, joins 20 legs (~6.5e8 Wick configurations): over the leg-space
    engine's budget, exact by the feature-space chaos of the unrolled terms (10 legs over the
    N = 4 input variables). Truth by quadrature over the 4 input variables."""
    def model(seed):
        r = np.random.default_rng(seed)
        return ta.Sequential([ta.Residual(_attn(r, 2, 2, 1, False, 0.5)),
                              ta.Residual(_bil(r, 2, 3, 2, False)),
                              ta.Linear(r.standard_normal((2, 2)))])
    a, b = model(1), model(2)
    r = degree_similarity(a, b, n_ctx=2, max_degree=(2, 5, 6, 9, 10), n_samples=300)
    assert [r.exact(K) for K in (2, 5, 6, 9, 10)] == [True] * 5
    for K in (2, 5, 6, 10):
        assert r[K] == pytest.approx(_sim(_quad_truncated(a, b, K, (2, 2))), rel=1e-10)
    assert r[9] == r[6]                  # no parts of degree 7, 8, 9
    assert "feature-space chaos" in r.notes[10]
    assert [r.profile_a[k] for k in (3, 4, 7, 8, 9)] == [0.0] * 5
    q = _quad_part_norms(a, (6,), (2, 2))
    assert r.profile_a[6] == pytest.approx(q[6], rel=1e-10)


def test_two_attention_layers_S9_refused_with_its_count():
    """Two attention layers: S<=9 adds a layer-2 leg reading a layer-1 head (9 legs a side,
    18 joined, ~8.6e8 configurations): over the leg-space engine's budget; at N = n_ctx * d
    = 8 input variables also over the feature-space chaos's, so estimated, and the note says
    why (both)."""
    r = degree_similarity(_two_layer(1), _two_layer(2), n_ctx=4, max_degree=(5, 9), n_samples=300)
    assert r.exact(5) and not r.exact(9)
    assert "18 legs joined" in r.notes[9] and "max_configurations=200,000" in r.notes[9]
    assert "feature-space chaos refused" in r.notes[9] and "N = n_ctx*d = 8" in r.notes[9]


def test_a_zero_affine_part_is_zero_not_rounding_noise():
    """Bias-free models without a residual have P_0 = P_1 = 0 exactly: S<=1 is undefined (a
    norm-zero truncation), not a similarity of the DFT's rounding noise (it was 0.378,
    labelled exact, with ||P_1||^2 = 1e-33)."""
    g = lambda s: ta.Bilinear(*(np.random.default_rng(s).normal(size=z)  # noqa: E731
                                for z in [(8, 6), (8, 6), (3, 8)]))
    with pytest.raises(ValueError, match=r"max_degree: S<=1 is undefined: the part of degree "
                                         r"<= 1 of a and b is zero"):
        degree_similarity(g(0), g(1), max_degree=1)
    r = degree_similarity(g(0), g(1), max_degree=2)
    assert r.profile_a[0] == 0.0 and r.profile_a[1] == 0.0
    # the default degrees leave the undefined S<=1 out (the call once raised "norm zero ...
    # underflowed": misleading for a structural zero) and end with the full similarity
    d = degree_similarity(g(0), g(1))
    assert list(d.values) == [2] and d[2] == pytest.approx(ta.similarity(g(0), g(1)),
                                                           rel=1e-12)
    rng = np.random.default_rng(0)

    def attn():
        return ta.Sequential([ta.BilinearAttention(*(rng.normal(size=(2, 2, 4)) for _ in range(5)),
                                                   rng.normal(size=(4, 2, 2))),
                              ta.Linear(rng.normal(size=(3, 4)))])
    with pytest.raises(ValueError, match="S<=1 is undefined"):
        degree_similarity(attn(), attn(), n_ctx=3, max_degree=1)


# ---------------------------------------------------------------------------------------
# the exact matrix (each model's part once, then the pairs)
# ---------------------------------------------------------------------------------------

def test_matrix_two_attention_layers_against_quadrature():
    """Every entry of the S<=1 and S<=5 matrices of three two-layer models against the
    quadrature truth of that pair's truncations (independent of the chaos engine)."""
    ms = [_two_layer(s, rope=100.0) for s in (3, 4, 5)]
    r = ta.degree_similarity_matrix(ms, n_ctx=2, max_degree=(1, 5))
    assert isinstance(r, ta.DegreeSimilarityMatrix) and list(r.keys()) == [1, 5]
    for K in (1, 5):
        S = r[K]
        assert S.shape == (3, 3) and np.array_equal(S, S.T) and np.all(np.diag(S) == 1.0)
        for i, j in itertools.combinations(range(3), 2):
            q = _quad_truncated(ms[i], ms[j], K, (2, 2))
            assert S[i, j] == pytest.approx(_sim(q), rel=1e-10)
            assert r.gram[K][i, j] == pytest.approx(q[0], rel=1e-10)
    assert "different question" in repr(r)
    assert f"{S[0, 1]:.6f}" in repr(r)           # the matrices themselves are shown
    # any iterable of models (a generator here) gives the same matrices
    assert np.array_equal(ta.degree_similarity_matrix((m for m in ms), n_ctx=2,
                                                      max_degree=(1, 5))[5], r[5])


def test_matrix_position_free_and_one_layer_full():
    """Position-free: every K from the graded network, against quadrature; one attention
    layer: K at the degree is the full similarity (the models themselves)."""
    ms = [_mlp(s) for s in (1, 2, 3)]
    r = ta.degree_similarity_matrix(ms, max_degree=(2, 4))
    for i, j in itertools.combinations(range(3), 2):
        for K in (2, 4):
            assert r[K][i, j] == pytest.approx(_sim(_quad_truncated(ms[i], ms[j], K, (2,))),
                                               rel=1e-10)
    one = [_one_layer(s, bias=False) for s in (7, 8)]
    r = ta.degree_similarity_matrix(one, n_ctx=2, max_degree=5)
    assert r[5][0, 1] == pytest.approx(ta.similarity(one[0], one[1], n_ctx=2), rel=1e-12)


@pytest.mark.parametrize("models, kw, match", [
    ([], {}, r"models: expected a non-empty sequence"),
    ({"a": 1}, {}, r"models: expected a non-empty sequence of networks, got dict"),
    ("two", {}, r"models: expected a non-empty sequence of networks, got str"),
    ([_two_layer(1), _two_layer(2, d_in=3)], {"n_ctx": 2},
     r"^models\[1\]: reads 3 inputs but models\[0\] reads 2; every network must read the same "
     r"input$"),
    ([_two_layer(1), _two_layer(2)], {"n_ctx": 4, "max_degree": (1, 9)},
     r"S<=9 is not exact here \(exact path: the exact path would contract about .* Wick "
     r"configurations \(up to 18 legs joined\).*N = n_ctx\*d = 8 .*degree_similarity"),
    ([_two_layer(1), _two_layer(2)], {"n_ctx": 2, "max_degree": 30}, r"above the models'"),
    ([_two_layer(1), _two_layer(2)], {"n_ctx": 2, "max_degree": (5, 1)}, r"increasing"),
    ([_mlp(1), _mlp(2)], {"n_ctx": 2}, r"n_ctx: only for sequence models"),
    ([_two_layer(1, bias=True), _two_layer(2)], {"n_ctx": 2, "max_degree": 5},
     r"S<=5 is not exact for models\[0\] \(biases"),
])
def test_matrix_bad_input(models, kw, match):
    with pytest.raises(ValueError, match=match):
        ta.degree_similarity_matrix(models, **kw)


def test_matrix_torch_backend_agrees(monkeypatch):
    """backend='torch' (here torch's CPU device) runs the pairs' larger contractions in torch
    float64: the same matrix to rounding; an unknown backend is refused before any work."""
    from tensoralg.strategies import executor

    ms = [_two_layer(s, d=4) for s in (3, 4)]
    ref = ta.degree_similarity_matrix(ms, n_ctx=3, max_degree=5)
    uploads = []
    orig = executor.to_device
    monkeypatch.setattr(executor, "to_device", lambda *a: uploads.append(1) or orig(*a))
    monkeypatch.setattr(executor, "TORCH_CPU_FLOPS", 0.0)   # every contraction in torch
    tor = ta.degree_similarity_matrix(ms, n_ctx=3, max_degree=5, backend="torch", device="cpu")
    assert uploads, "no contraction ran in torch"
    np.testing.assert_allclose(tor.gram[5], ref.gram[5], rtol=1e-12)
    with pytest.raises(ValueError, match="backend: degree_similarity_matrix runs in float64"):
        ta.degree_similarity_matrix(ms, n_ctx=3, backend="exact")
