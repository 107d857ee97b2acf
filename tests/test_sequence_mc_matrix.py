"""Monte Carlo matrices and differences of sequence models go through the position-free
estimator (one sampler, directions on the sphere of R^(n_ctx d)): each entry equals the pair
estimate with the same samples, and the estimates cover the exact values (one attention
layer, where the exact path answers)."""

from __future__ import annotations

import numpy as np
import pytest

import tensoralg as ta
from tensoralg.strategies.montecarlo import MonteCarloArray, MonteCarloEstimate


def _model(rng, heads=1, d=3, out=2):
    g = lambda *s: rng.standard_normal(s) / 2  # noqa: E731
    attn = ta.BilinearAttention(g(heads, 2, d), g(heads, 2, d), g(heads, 2, d), g(heads, 2, d),
                                g(heads, 2, d), g(d, heads, 2), mask="causal")
    return ta.Sequential([ta.Residual(attn), ta.Linear(rng.standard_normal((out, d)))])


@pytest.fixture(scope="module")
def models():
    rng = np.random.default_rng(0)
    return [_model(rng), _model(rng, heads=2), _model(rng)]


MC = dict(n_ctx=3, method="montecarlo", n_samples=2000, seed=3)


def _rel(x, y):
    return abs(float(x) - float(y)) / abs(float(y))


def test_similarity_matrix_entries_are_the_pair_estimates(models, pair_without_cross_check):
    S = ta.similarity_matrix(models, **MC)
    assert isinstance(S, MonteCarloArray) and S.shape == (3, 3)
    assert np.all(np.diag(S) == 1.0) and np.all(np.diag(S.stderr) == 0.0)
    for i in range(3):
        for j in range(3):
            if i == j:
                continue
            e = ta.similarity(models[i], models[j], **MC)
            # the same sums grouped differently: float64 rounding only
            assert _rel(S[i, j], e) <= 1e-12
            assert _rel(S.stderr[i, j], e.stderr) <= 1e-9
            assert bool(S.reliable[i, j]) == e.diagnostics.reliable


def test_gram_entries_are_the_pair_estimates_and_cover_the_exact_gram(models, pair_without_cross_check):
    G = ta.gram(models, **MC)
    E = ta.gram(models, n_ctx=3)   # exact: one attention layer
    for i in range(3):
        for j in range(3):
            e = ta.inner(models[i], models[j], **MC)
            assert _rel(G[i, j], e) <= 1e-12 and _rel(G.stderr[i, j], e.stderr) <= 1e-9
            assert abs(G[i, j] - E[i, j]) <= 4 * G.stderr[i, j]


def test_differences_of_sequence_models_by_monte_carlo_cover_the_exact_values(models):
    a, b, c = models
    E = ta.gram(models, n_ctx=3)
    kw = dict(MC, n_samples=4000, seed=1)
    d = ta.diff_norm(a, b, **kw)
    assert isinstance(d, MonteCarloEstimate) and d.diagnostics.reliable
    assert abs(float(d) - np.sqrt(E[0, 0] - 2 * E[0, 1] + E[1, 1])) <= 4 * d.stderr
    x = ta.inner_diff(a, b, c, **kw)
    assert abs(float(x) - (E[0, 1] - E[0, 2])) <= 4 * x.stderr
    # one integrand f_a . (f_b - f_c): the same directions as the two pair estimates
    ab, ac = ta.inner(a, b, **kw), ta.inner(a, c, **kw)
    assert abs(float(x) - (float(ab) - float(ac))) <= 1e-12 * (abs(float(ab)) + abs(float(ac)))


def test_sequence_monte_carlo_uses_every_direction_asked_for(models):
    # the pair estimators drew n_batches equal batches and dropped the remainder (1000 of 1001)
    a, b = models[:2]
    e = ta.inner(a, b, n_ctx=3, method="montecarlo", n_samples=1001, seed=5)
    assert e.n_samples == 1001
    G = ta.gram([a, b], n_ctx=3, method="montecarlo", n_samples=1001, seed=5)
    assert _rel(G[0, 1], e) <= 1e-12


@pytest.mark.parametrize("call", [
    lambda m: ta.similarity_matrix(m, **MC, position="each"),
    lambda m: ta.gram(m, **MC, output="each"),
    lambda m: ta.diff_norm(m[0], m[1], **MC, position="each"),
])
def test_each_slices_are_refused_before_sampling(models, call):
    with pytest.raises(ValueError, match="'each' are not supported"):
        call(models)


def test_a_difference_mixing_an_mlp_and_a_sequence_model_is_refused(models):
    rng = np.random.default_rng(1)
    mlp = ta.Bilinear(rng.standard_normal((4, 3)), rng.standard_normal((4, 3)),
                      rng.standard_normal((2, 4)))
    with pytest.raises(ValueError, match="^c: a position-free network of degree 2"):
        ta.inner_diff(models[0], models[1], mlp, **MC)


def test_position_free_differences_refuse_n_ctx():
    rng = np.random.default_rng(2)
    nets = [ta.Bilinear(rng.standard_normal((4, 3)), rng.standard_normal((4, 3)),
                        rng.standard_normal((2, 4))) for _ in range(2)]
    with pytest.raises(ValueError, match="only for sequence models"):
        ta.diff_norm(*nets, method="montecarlo", n_samples=600, n_ctx=3)
