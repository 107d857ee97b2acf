"""tensoralg.baselines, each checked against an independent computation."""

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoralg.baselines import (
    DegenerateInputWarning,
    LinearCKA,
    all_baselines,
    js_divergence,
    linear_cka,
    output_cosine,
    weight_cosine,
)
from tensoralg.nn import BilinearNet


def _hsic_gram(K, L, debiased):
    """HSIC from n x n Gram matrices: biased tr(KHLH)/(n-1)^2 (Gretton et al. 2005) or the
    unbiased estimator of Song et al. 2012, eq. 5 (diagonals zeroed)."""
    n = len(K)
    if not debiased:
        H = np.eye(n) - 1.0 / n
        return np.trace(K @ H @ L @ H) / (n - 1) ** 2
    K, L = K.copy(), L.copy()
    np.fill_diagonal(K, 0)
    np.fill_diagonal(L, 0)
    one = np.ones(n)
    return (np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
            - 2.0 / (n - 2) * one @ K @ L @ one) / (n * (n - 3))


def _cka_gram(X, Y, debiased):
    # Both HSIC estimators are invariant to translating the features; centring first keeps the
    # n x n reference free of the cancellation that large offsets cause in K = X X^T.
    X, Y = X - X.mean(0), Y - Y.mean(0)
    K, L = X @ X.T, Y @ Y.T
    return _hsic_gram(K, L, debiased) / math.sqrt(_hsic_gram(K, K, debiased) * _hsic_gram(L, L, debiased))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(6, 40), p=st.integers(1, 6), q=st.integers(1, 6),
       shift=st.floats(-100, 100), batch=st.integers(1, 50), debiased=st.booleans())
def test_cka_matches_gram_matrix_formula(seed, n, p, q, shift, batch, debiased):
    r = np.random.default_rng(seed)
    X = r.normal(size=(n, p)) + shift
    Y = X @ r.normal(size=(p, q)) + r.normal(size=(n, q)) - 2 * shift
    ref = _cka_gram(X, Y, debiased)
    got = linear_cka(X, Y, debiased=debiased, batch_size=batch)
    assert got == pytest.approx(ref, rel=1e-8, abs=1e-10)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3))
def test_cka_invariances(seed, scale):
    """Invariant to orthogonal transforms, isotropic scaling and translation (Kornblith et al.)."""
    r = np.random.default_rng(seed)
    X, Y = r.normal(size=(30, 5)), r.normal(size=(30, 4))
    Q, _ = np.linalg.qr(r.normal(size=(5, 5)))
    base = linear_cka(X, Y)
    assert linear_cka(scale * X @ Q + 3.0, Y) == pytest.approx(base, rel=1e-9)
    assert linear_cka(X, X) == pytest.approx(1.0, rel=1e-12)


def test_cka_degenerate_input():
    r = np.random.default_rng(0)
    X = r.normal(size=(20, 3))
    with pytest.warns(DegenerateInputWarning):
        assert math.isnan(linear_cka(np.ones((20, 3)), X))
    acc = LinearCKA().update(X[:10], X[:10])
    with pytest.raises(ValueError, match="non-finite"):
        acc.update(np.full((5, 3), np.nan), X[:5])
    with pytest.raises(ValueError, match="paired rows"):
        acc.update(X[:5], X[:4])
    with pytest.raises(ValueError, match="feature sizes"):
        acc.update(X[:5, :2], X[:5])
    acc.update(X[10:], X[10:])  # the failed batches left no trace
    assert acc.n == 20 and acc.value() == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(ValueError, match="at least 4"):
        LinearCKA().update(X[:3], X[:3]).value(debiased=True)
    with pytest.raises(ValueError, match="at least 2"):
        LinearCKA().value()


def test_weight_cosine_against_parameters_to_vector():
    a, b = BilinearNet(5, 3, seed=1, bias=True), BilinearNet(5, 3, seed=2, bias=True)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.1)
    va = torch.nn.utils.parameters_to_vector(a.parameters()).double()
    vb = torch.nn.utils.parameters_to_vector(b.parameters()).double()
    ref = float((va @ vb / (va.norm() * vb.norm())).detach())
    assert weight_cosine(a, b) == pytest.approx(ref, rel=1e-12)
    assert weight_cosine(a, a) == pytest.approx(1.0, rel=1e-14)
    with pytest.raises(ValueError, match="shapes"):
        weight_cosine(a, BilinearNet(5, 3, d_hidden=7, bias=True))
    with pytest.raises(ValueError, match="different parameters"):
        weight_cosine(a, BilinearNet(5, 3))
    z = BilinearNet(5, 3, bias=True)
    with torch.no_grad():
        for p in z.parameters():
            p.zero_()
    with pytest.raises(ValueError, match="all-zero"):
        weight_cosine(a, z)


def test_output_cosine_against_sklearn():
    from sklearn.metrics.pairwise import cosine_similarity

    r = np.random.default_rng(1)
    A, B = r.normal(size=(12, 4)), r.normal(size=(12, 4))
    assert output_cosine(A, B) == pytest.approx(np.diag(cosine_similarity(A, B)).mean(), rel=1e-12)
    B[3] = 0
    with pytest.warns(DegenerateInputWarning):
        got = output_cosine(A, B)
    keep = np.arange(12) != 3
    assert got == pytest.approx(np.diag(cosine_similarity(A[keep], B[keep])).mean(), rel=1e-12)
    with pytest.raises(ValueError, match="shapes"):
        output_cosine(A, B[:, :3])


def test_js_divergence_against_kl_definition():
    from scipy.special import rel_entr, softmax

    r = np.random.default_rng(2)
    A, B = r.normal(size=(9, 5)) * 3, r.normal(size=(9, 5)) * 3
    p, q = softmax(A, axis=1), softmax(B, axis=1)
    m = (p + q) / 2
    ref = np.mean(0.5 * rel_entr(p, m).sum(1) + 0.5 * rel_entr(q, m).sum(1))
    assert js_divergence(A, B) == pytest.approx(ref, rel=1e-10)
    assert js_divergence(A, A + 7.0) == pytest.approx(0.0, abs=1e-12)  # softmax shift invariance
    far = np.array([[100.0, 0.0]]), np.array([[0.0, 100.0]])
    assert js_divergence(*far) == pytest.approx(math.log(2), rel=1e-9)
    with pytest.raises(ValueError, match="non-finite"):
        js_divergence(np.array([[np.inf, 0.0]]), np.zeros((1, 2)))


def test_all_baselines_identical_models():
    a = BilinearNet(6, 3, seed=0, residual=True)
    X = torch.rand(50, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = all_baselines(a, a, X)
    for k in ("cka_logits", "cka_logits_debiased", "cka_hidden", "output_cosine", "weight_cosine"):
        assert res[k] == pytest.approx(1.0, rel=1e-9), k
    assert res["js_divergence"] == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), alpha=st.floats(0.2, 5.0))
def test_weight_symmetry_moves_weight_cosine_not_the_function(seed, alpha):
    """Permuting a block's hidden units and rescaling left by alpha, right by 1/alpha keeps the
    function: outputs, CKA and tensor similarity stay at 1 while weight cosine drops."""
    import tensoralg as ta

    a = BilinearNet(6, 3, d_model=4, d_hidden=5, residual=True, bias=True, seed=seed,
                    dtype="float64")
    b = BilinearNet(6, 3, d_model=4, d_hidden=5, residual=True, bias=True, seed=seed,
                    dtype="float64")
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        blk_a, blk_b = a.blocks[0], b.blocks[0]
        blk_a.left.bias.normal_(generator=torch.Generator().manual_seed(seed))
        blk_a.right.bias.fill_(0.5)
        blk_b.left.weight.copy_(alpha * blk_a.left.weight[perm])
        blk_b.left.bias.copy_(alpha * blk_a.left.bias[perm])
        blk_b.right.weight.copy_(blk_a.right.weight[perm] / alpha)
        blk_b.right.bias.copy_(blk_a.right.bias[perm] / alpha)
        blk_b.down.weight.copy_(blk_a.down.weight[:, perm])
    X = torch.randn(40, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(a(X), b(X), rtol=1e-10, atol=1e-12)
    assert float(ta.similarity(a, b)) == pytest.approx(1.0, abs=1e-10)
    assert linear_cka(a(X).detach(), b(X).detach()) == pytest.approx(1.0, abs=1e-9)
    if not torch.equal(perm, torch.arange(5)) or abs(alpha - 1) > 1e-3:
        assert weight_cosine(a, b) < 1 - 1e-6
