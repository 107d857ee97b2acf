"""Exact ``S<=9`` of bias-free stacks of two attention layers (docs/mathematics.md §3.9-3.10):
``f_{<=9}`` is the direct path, every head and every composition of one leg of a layer-2 head
with a layer-1 head, computed by the feature-space chaos of one- and two-node terms.

Independent reference: the model's forward pass written out here in numpy from the raw weights,
its homogeneous parts by roots of unity on that forward pass, and tensor-product Gauss-Hermite
quadrature (tensoralg.verify.quadrature) with 10 nodes on each of the N = n_ctx * d = 4 Gaussian
variables (exact for a product of two polynomials of degree 9 in each variable)."""

from __future__ import annotations

import numpy as np
import pytest
import tensoralg.verify.quadrature as vq

import tensoralg as ta
from tensoralg.layers import BilinearAttention, Linear, Residual, Sequential

N_CTX, D = 2, 2
LEGS = ("q1", "k1", "q2", "k2", "v")


def _model(seed, biases=False, H=1, dh=1, layers=2):
    rng = np.random.default_rng(seed)

    def att():
        kw = {k: rng.normal(size=(H, dh, D)) * 0.8 for k in LEGS}
        if biases:
            kw.update({k + "_bias": rng.normal(size=(H, dh)) * 0.5 for k in ("q1", "k1", "v")})
        return BilinearAttention(**kw, o=rng.normal(size=(D, H, dh)), mask="causal", scale=0.7)
    return Sequential([Linear(rng.normal(size=(D, D)))] + [Residual(att()) for _ in range(layers)]
                      + [Linear(rng.normal(size=(2, D)))])


def _attention(at, X):
    """Bilinear attention written out: ``out_t = sum_s M[t, s] c (q1_t.k1_s)(q2_t.k2_s) O v_s``
    (complex inputs allowed)."""
    r = {k: np.einsum("hei,bpi->bphe", getattr(at, k), X) for k in LEGS}
    M = at.mask_matrix(X.shape[1]) * at.scale
    pat = M[None, :, :, None] * np.einsum("bthe,bshe->btsh", r["q1"], r["k1"]) * \
        np.einsum("bthe,bshe->btsh", r["q2"], r["k2"])
    return np.einsum("btsh,bshv,ohv->bto", pat, r["v"], at.o)


def _forward(model, X):
    emb, *blocks, un = model.layers
    h = X @ emb.weight.T
    for r in blocks:
        h = h + _attention(r.inner, h)
    return h @ un.weight.T


_PARTS: dict = {}


def _truncation(model, X, K, m=32):
    """``f_{<=K}(X) = sum_{k<=K} P_k(X)``, ``P_k(X) = (1/m) sum_j w^{-jk} f(w^j X)`` with
    ``w = exp(2 pi i / m)``, ``m = 32`` above the degree 25 of two layers (parts cached per
    model and input)."""
    key = (id(model), id(X))
    if key not in _PARTS:
        w = np.exp(2j * np.pi * np.arange(m) / m)
        vals = np.stack([_forward(model, wj * X) for wj in w])
        _PARTS[key] = [(np.einsum("j,j...->...", w ** (-k), vals) / m).real for k in range(10)]
    return sum(_PARTS[key][:K + 1])


@pytest.fixture(scope="module")
def grid():
    y, w = vq.gauss_hermite(10)
    n = N_CTX * D
    X = np.stack(np.meshgrid(*[y] * n, indexing="ij")).reshape(n, -1).T.reshape(-1, N_CTX, D)
    wt = np.prod(np.stack(np.meshgrid(*[w] * n, indexing="ij")).reshape(n, -1), axis=0)
    return X, wt


def _quad(grid, fa, fb):
    _, wt = grid
    return float(np.einsum("b,bto,bto->", wt, fa, fb))


@pytest.fixture(scope="module")
def models():
    return [_model(0), _model(1, H=2)]


@pytest.fixture(scope="module")
def pair(models):
    return ta.degree_similarity(*models, n_ctx=N_CTX, max_degree=(1, 5, 9))


@pytest.fixture(scope="module")
def matrix(models):
    return ta.degree_similarity_matrix(models, n_ctx=N_CTX, max_degree=(1, 5, 9))


def test_forward_written_out(models):
    X = np.random.default_rng(3).normal(size=(4, N_CTX, D)) * 0.5
    for m in models:
        np.testing.assert_allclose(_forward(m, X), m(X), rtol=1e-10, atol=1e-12)


def test_s9_exact_against_quadrature(models, pair, grid):
    a, b = models
    r = pair
    assert r.method == {1: "exact", 5: "exact", 9: "exact"}
    assert "feature-space chaos" in r.notes[9] and "feature-space" not in r.notes[5]
    X = grid[0]
    for K in (5, 9):
        fa, fb = _truncation(a, X, K), _truncation(b, X, K)
        ab, aa, bb = _quad(grid, fa, fb), _quad(grid, fa, fa), _quad(grid, fb, fb)
        assert abs(float(r[K]) - ab / np.sqrt(aa * bb)) < 1e-10
    # the profile's degree-9 parts, exact
    for side, m in ((r.profile_a, a), (r.profile_b, b)):
        p9 = _truncation(m, X, 9) - _truncation(m, X, 8)
        q = _quad(grid, p9, p9)
        assert abs(float(side[9]) - q) < 1e-10 * q
        assert side[6] == side[7] == side[8] == 0.0
    # the degrees are not orthogonal: the cross terms of P_1, P_5, P_9 are in S<=9
    fa = _truncation(a, X, 9)
    assert abs(_quad(grid, fa, fa) - sum(float(r.profile_a[k]) for k in (1, 5, 9))) > 1e-3


def test_s5_unchanged_by_asking_for_s9(models, pair, matrix):
    r5 = ta.degree_similarity(*models, n_ctx=N_CTX, max_degree=5)
    assert float(pair[5]) == float(r5[5]) and pair.notes[5] == r5.notes[5]
    M5 = ta.degree_similarity_matrix(models, n_ctx=N_CTX, max_degree=5)
    assert np.array_equal(M5[5], matrix[5]) and M5.notes[5] == matrix.notes[5]


def test_s9_matrix_against_quadrature(models, pair, matrix, grid):
    assert "feature-space chaos" in matrix.notes[9]
    f = [_truncation(m, grid[0], 9) for m in models]
    G = np.array([[_quad(grid, u, v) for v in f] for u in f])
    np.testing.assert_allclose(matrix.gram[9], G, rtol=1e-10, atol=0)
    assert abs(matrix[9][0, 1] - float(pair[9])) < 1e-12


@pytest.mark.filterwarnings("ignore:n_samples=60")
def test_over_budget_is_monte_carlo_with_its_verdict():
    # N = n_ctx * d = 8 input variables: the degree-9 dense lifted tensors are over budget
    a, b = _model(0), _model(1)
    r = ta.degree_similarity(a, b, n_ctx=4, max_degree=(5, 9), n_samples=60)
    assert r.method == {5: "exact", 9: "montecarlo"}
    assert "feature-space chaos refused" in r.notes[9] and "N = n_ctx*d = 8" in r.notes[9]
    assert hasattr(r[9], "reliable")
    with pytest.raises(ValueError, match=r"max_degree: S<=9 is not exact here .*N = n_ctx\*d = 8"
                       r".*Monte Carlo"):
        ta.degree_similarity_matrix([a, b], n_ctx=4, max_degree=(5, 9))


def test_biases_at_degree_nine_refused_before_work(monkeypatch):
    from tensoralg.strategies import sequence_exact

    def boom(*a, **k):   # the exact engine must not run before the refusal
        raise AssertionError("work before the refusal")
    monkeypatch.setattr(sequence_exact, "tree_gram", boom)
    a, b = _model(0, biases=True), _model(1)
    msg = (r"^max_degree: S<=9 is not exact for models\[0\] \(biases.*\); S<=9 with biases is "
           r"not exact here .*order=2.*Monte Carlo per pair, with its verdict$")
    with pytest.raises(ValueError, match=msg):
        ta.degree_similarity_matrix([a, b], n_ctx=N_CTX, max_degree=(1, 9))


@pytest.mark.filterwarnings("ignore:n_samples=60")
def test_biases_at_degree_nine_pair_says_why():
    a, b = _model(0, biases=True), _model(1)
    r = ta.degree_similarity(a, b, n_ctx=N_CTX, max_degree=9, n_samples=60)
    assert r.method[9] == "montecarlo"
    assert "S<=9 with biases is not exact here" in r.notes[9] and "order=2" in r.notes[9]


def test_s9_matrix_torch_backend_equals_numpy(models, matrix):
    Mt = ta.degree_similarity_matrix(models, n_ctx=N_CTX, max_degree=9, backend="torch",
                                     device="cpu")
    np.testing.assert_allclose(Mt.gram[9], matrix.gram[9], rtol=1e-12, atol=0)
