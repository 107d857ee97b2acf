"""Gram matrices over many models, similarity matrices and diffs (docs/mathematics.md §3.5)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from netgen import brute_inner, rand_network

import tensoralg as ta
from tensoralg import engine
from tensoralg.results import ExactNorm


def _models(kind, n, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return [rand_network(rng, kind, **kw) for _ in range(n)]


@pytest.mark.parametrize("kind", ["bilinear", "embed_bilinear_head", "depth2"])
def test_gram_equals_pairwise_inner(kind):
    models = _models(kind, 4, d=2, log_scale=(-1, 1))
    G = ta.gram(models)
    assert G.shape == (4, 4)
    norms = np.sqrt(np.diag(G))
    for i, a in enumerate(models):
        for j, b in enumerate(models):
            assert abs(G[i, j] - ta.inner(a, b)) <= 1e-12 * norms[i] * norms[j]
    assert np.array_equal(G, G.T)
    S = ta.similarity_matrix(models)
    assert np.allclose(np.diag(S), 1.0, atol=1e-15)
    assert abs(S[0, 1] - ta.similarity(models[0], models[1])) <= 1e-12


def test_gram_against_brute_force_and_exact_backend():
    models = _models("residual", 3, seed=2, d=2)
    G = ta.gram(models)
    Ge = ta.gram(models, backend="exact")
    for i in range(3):
        for j in range(3):
            want = brute_inner(models[i], models[j])
            assert Ge[i, j] == want
            assert abs(G[i, j] - float(want)) <= 1e-10 * math.sqrt(G[i, i] * G[j, j])


def test_cross_gram_and_slices():
    a = _models("bilinear", 3, seed=3, out=3)
    b = _models("bilinear", 2, seed=4, out=3)
    C = ta.cross_gram(a, b, output=1)
    assert C.shape == (3, 2)
    E = ta.cross_gram(a, b, output="each")
    assert E.shape == (3, 2, 3)
    for i in range(3):
        for j in range(2):
            assert C[i, j] == pytest.approx(ta.inner(a[i], b[j], output=1), rel=1e-12)
            assert E[i, j, 1] == pytest.approx(C[i, j], rel=1e-12)


def test_gram_blocks_give_the_same_matrix(monkeypatch):
    models = _models("embed_bilinear_head", 5, seed=5)
    G = ta.gram(models)
    monkeypatch.setattr(engine, "_MAX_INTERMEDIATE", 64)  # forces 1x1 or 2x2 blocks
    Gb = ta.gram(models)
    assert np.allclose(G, Gb, rtol=1e-13, atol=0)


def test_gram_output_scale_normalization_per_model():
    models = _models("bilinear", 3, seed=6)
    scaled = [models[0].scaled_output(1e150), models[1], models[2].scaled_output(1e-150)]
    S = ta.similarity_matrix(scaled)
    assert np.allclose(S, ta.similarity_matrix(models), rtol=0, atol=1e-12)


def test_diffs_follow_from_bilinearity():
    a, b, c = _models("embed_bilinear_head", 3, seed=8, d=2)
    want_ab, want_ac = brute_inner(a, b), brute_inner(a, c)
    scale = math.sqrt(ta.inner(a, a) * (ta.inner(b, b) + ta.inner(c, c)))
    assert abs(ta.inner_diff(a, b, c) - float(want_ab - want_ac)) <= 1e-10 * scale
    d2 = brute_inner(b, b) - 2 * brute_inner(b, c) + brute_inner(c, c)
    assert ta.diff_norm(b, c) == pytest.approx(math.sqrt(float(d2)), rel=1e-9)
    # exact backend: the squared distance is the exact rational
    fr = lambda n: ta.layers.map_arrays(n, lambda x: np.vectorize(Fraction, otypes=[object])(x))  # noqa: E731
    dn = ta.diff_norm(fr(b), fr(c), backend="exact")
    assert isinstance(dn, ExactNorm) and dn.squared == d2 and dn.exact ** 2 == d2
    assert ta.diff_norm(b, b) == 0.0


def test_diff_norm_between_architectures_falls_back_to_pairwise():
    rng = np.random.default_rng(1)
    b = rand_network(rng, "bilinear", hidden=3)
    c = rand_network(rng, "bilinear", hidden=4)
    d2 = brute_inner(b, b) - 2 * brute_inner(b, c) + brute_inner(c, c)
    assert ta.diff_norm(b, c) == pytest.approx(math.sqrt(float(d2)), rel=1e-9)


def test_gram_montecarlo_has_standard_errors():
    models = _models("bilinear", 3, seed=9, log_scale=(-0.3, 0.3))
    G = ta.gram(models)
    M = ta.gram(models, method="montecarlo", n_samples=100_000, seed=0)
    assert M.stderr.shape == (3, 3)
    assert np.all(np.abs(M - G) <= 4 * M.stderr)


def test_gram_closure_matches_exact_at_depth_one_and_pairs_at_depth_two():
    models = _models("bilinear", 3, seed=10)
    G = ta.gram(models)
    Gc = ta.gram(models, method="closure")
    assert np.allclose(Gc, G, rtol=1e-12, atol=0)
    deep = _models("depth2", 3, seed=11, d=2)
    Gd = ta.gram(deep, method="closure")
    for i in range(3):
        for j in range(3):
            assert Gd[i, j] == pytest.approx(ta.inner(deep[i], deep[j], method="closure"),
                                             rel=1e-12)


def test_inner_diff_across_architectures_and_exact():
    rng = np.random.default_rng(12)
    a = rand_network(rng, "bilinear", hidden=2)
    b = rand_network(rng, "bilinear", hidden=3)
    c = rand_network(rng, "bilinear", hidden=4)
    want = brute_inner(a, b) - brute_inner(a, c)
    assert ta.inner_diff(a, b, c, backend="exact") == want
    scale = math.sqrt(ta.inner(a, a) * (ta.inner(b, b) + ta.inner(c, c)))
    assert abs(ta.inner_diff(a, b, c) - float(want)) <= 1e-10 * scale


def test_gram_of_models_of_different_widths_is_every_pair_inner():
    """ta.gram / similarity_matrix / cross_gram refused float models of different hidden widths
    ('a batched Gram matrix needs same-architecture models') while ta.inner computed every pair:
    the models are grouped by architecture, batched within a group, and the cross-group blocks
    are cross Grams of two stacks; every entry equals the pair's inner / similarity."""
    rng = np.random.default_rng(11)

    def bil(h):
        return ta.Bilinear(rng.normal(size=(h, 3)), rng.normal(size=(h, 3)), rng.normal(size=(2, h)))
    ms = [bil(3), bil(4), bil(3), ta.Sequential([ta.Linear(rng.normal(size=(3, 3))), bil(5)]),
          bil(4)]
    G, S = ta.gram(ms), ta.similarity_matrix(ms)
    Gk = ta.gram(ms, output="each")
    C = ta.cross_gram(ms[:2], ms[1:])
    for i, a in enumerate(ms):
        for j, b in enumerate(ms):
            ref = ta.inner(a, b)
            assert abs(G[i, j] - ref) <= 1e-12 * abs(ref)
            assert abs(S[i, j] - ta.similarity(a, b)) <= 1e-12 * abs(ta.similarity(a, b))
            refk = ta.inner(a, b, output="each")
            assert np.all(np.abs(Gk[i, j] - refk) <= 1e-12 * np.abs(refk))
            if i < 2 and j >= 1:
                assert abs(C[i, j - 1] - ref) <= 1e-12 * abs(ref)
    assert np.array_equal(G, G.T)
    Ge = ta.gram(ms[:4], backend="exact")   # rationals: equal, not close
    assert all(Ge[i, j] == ta.inner(ms[i], ms[j], backend="exact")
               for i in range(4) for j in range(4))
