"""Invariances, symmetry, scale robustness, Monte Carlo agreement and closure behaviour."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from netgen import KINDS, rand_bilinear, rand_network
from shared_cases import load_cases

import tensoralg as ta

CASES = {c["name"]: c for c in load_cases()}

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- invariances (method=exact)

def _permute(layer: ta.Bilinear, perm):
    return ta.Bilinear(layer.left[perm], layer.right[perm], layer.down[:, perm],
                       layer.left_bias[perm], layer.right_bias[perm], layer.down_bias)


@FAST
@given(seed=st.integers(0, 2**32 - 1))
def test_hidden_permutation_swap_and_rescaling_give_similarity_one(seed):
    rng = np.random.default_rng(seed)
    f = rand_bilinear(rng, 4, 5, 3, True, 10.0 ** rng.uniform(-3, 3))
    perm = rng.permutation(5)
    alpha = 10.0 ** rng.uniform(-2, 2, 5) * rng.choice([-1, 1], 5)
    beta = 10.0 ** rng.uniform(-2, 2, 5) * rng.choice([-1, 1], 5)
    variants = [
        _permute(f, perm),
        ta.Bilinear(f.right, f.left, f.down, f.right_bias, f.left_bias, f.down_bias),
        ta.Bilinear(f.left * alpha[:, None], f.right * beta[:, None], f.down / (alpha * beta),
                    f.left_bias * alpha, f.right_bias * beta, f.down_bias),
    ]
    for g in variants:
        assert ta.similarity(f, g) == pytest.approx(1.0, abs=1e-12)
        assert ta.similarity(g, f) == pytest.approx(1.0, abs=1e-12)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_bond_gauge_on_internal_bond_depth2(seed):
    """An invertible linear map A on the bond between two bilinear layers: down1 -> A down1,
    down_bias1 -> A down_bias1, left2/right2 -> left2 A^-1 / right2 A^-1."""
    rng = np.random.default_rng(seed)
    l1 = rand_bilinear(rng, 2, 3, 3, True)
    l2 = rand_bilinear(rng, 3, 2, 2, True)
    A = rng.standard_normal((3, 3)) + 3 * np.eye(3)
    Ai = np.linalg.inv(A)
    g1 = ta.Bilinear(l1.left, l1.right, A @ l1.down, l1.left_bias, l1.right_bias, A @ l1.down_bias)
    g2 = ta.Bilinear(l2.left @ Ai, l2.right @ Ai, l2.down, l2.left_bias, l2.right_bias,
                     l2.down_bias)
    f, g = ta.Sequential([l1, l2]), ta.Sequential([g1, g2])
    assert ta.similarity(f, g) == pytest.approx(1.0, abs=1e-12)
    # closure is invariant to linear gauges on internal bonds too (docs/mathematics.md §3.2)
    assert ta.similarity(f, g, method="closure") == pytest.approx(1.0, abs=1e-12)


def test_shared_reparametrized_depth2_pair():
    # the project's own pair and, when ../shared is there, the shared one (<a, a> = 132)
    names = [n for n in ("reparam_depth2_identical", "shared/reparam_depth2_identical")
             if n in CASES]
    assert names
    for name in names:
        case = CASES[name]
        a = ta.Sequential.from_spec(case["a"])
        b = ta.Sequential.from_spec(case["b"])
        assert ta.similarity(a.astype_float(), b.astype_float()) == pytest.approx(1.0, abs=1e-12)
        assert ta.inner(a, b, backend="exact") == ta.inner(a, a, backend="exact") == \
            Fraction(case["aa"])
        if name.startswith("shared/"):
            # In this pair both second layers read the SAME function of x (y1 + y2 = x1 x2 +
            # x3^2 and y1 - y2 + y3 = x1 x2 + x3^2), so any second-moment closure sees identical
            # readouts and scores exactly 1 as well; the closure's failure needs readouts that
            # differ as functions of x (next test).
            assert ta.similarity(a, b, method="closure") == pytest.approx(1.0, abs=1e-12)


def test_closure_does_not_certify_a_depth2_reparametrization():
    """f = (x1 x2)^2 computed two ways:
    a: y = x1 x2 (one hidden feature), then y^2;  b: y' = (x1^2, x2^2), then y'_1 y'_2.
    Exact: identical functions, similarity 1 (E[f^2] = E[x1^4] E[x2^4] = 9).
    Closure treats each layer-2 input as Gaussian with the exact second moments:
    a: y has mean 0, variance 1 -> E_G[y^4] = 3;  b: y'_i have mean 1, variance 2, independent
    -> E_G[(y'_1 y'_2)^2] = 3 * 3 = 9;  cross: y independent of y' (all covariances vanish) ->
    E_G[y^2 y'_1 y'_2] = 1 * 1 * 1 = 1.  So closure similarity = 1 / sqrt(3 * 9) = 1/sqrt(27)."""
    a = ta.Sequential([ta.Bilinear([[1, 0]], [[0, 1]], [[1]]), ta.Bilinear([[1]], [[1]], [[1]])])
    b = ta.Sequential([ta.Bilinear([[1, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 0], [0, 1]]),
                       ta.Bilinear([[1, 0]], [[0, 1]], [[1]])])
    assert ta.inner(a, b, backend="exact") == ta.inner(a, a, backend="exact") == 9
    assert ta.similarity(a, b) == pytest.approx(1.0, abs=1e-12)
    assert ta.inner(a, a, method="closure", backend="exact") == 3
    assert ta.inner(b, b, method="closure", backend="exact") == 9
    assert ta.inner(a, b, method="closure", backend="exact") == 1
    assert ta.similarity(a, b, method="closure") == pytest.approx(1 / math.sqrt(27), abs=1e-14)


def test_closure_is_exact_at_depth_one():
    rng = np.random.default_rng(11)
    for kind_a, kind_b in [("bilinear", "embed_bilinear_head"), ("residual", "linear"),
                           ("bilinear_nobias", "bilinear")]:
        a = rand_network(rng, kind_a)
        b = rand_network(rng, kind_b)
        scale = math.sqrt(ta.inner(a, a) * ta.inner(b, b))
        assert abs(ta.inner(a, b, method="closure") - ta.inner(a, b)) <= 1e-10 * scale
        ae = ta.layers.map_arrays(a, lambda x: np.vectorize(Fraction, otypes=[object])(x))
        be = ta.layers.map_arrays(b, lambda x: np.vectorize(Fraction, otypes=[object])(x))
        assert ta.inner(ae, be, method="closure", backend="exact") == \
            ta.inner(ae, be, backend="exact")


# ---------------------------------------------------------------- similarity properties

@FAST
@given(kind_a=st.sampled_from(KINDS[:5]), kind_b=st.sampled_from(KINDS[:5]),
       seed=st.integers(0, 2**32 - 1))
def test_similarity_self_symmetric_bounded(kind_a, kind_b, seed):
    rng = np.random.default_rng(seed)
    a = rand_network(rng, kind_a)
    b = rand_network(rng, kind_b)
    assert ta.similarity(a, a) == 1.0
    s_ab, s_ba = ta.similarity(a, b), ta.similarity(b, a)
    assert abs(s_ab - s_ba) <= 8 * np.finfo(float).eps
    assert -1.0 <= s_ab <= 1.0
    assert -1.0 <= ta.similarity(a, b, method="closure") <= 1.0


@pytest.mark.parametrize("factor", [1e6, 1e-6])
@pytest.mark.parametrize("kind", ["bilinear", "embed_bilinear_head", "depth2_residual_embed_head"])
def test_output_scale_leaves_similarity_unchanged(kind, factor):
    rng = np.random.default_rng(5)
    a = rand_network(rng, kind, d=2)
    b = rand_network(rng, kind, d=2)
    ref = ta.similarity(a, b)
    assert ta.similarity(a.scaled_output(factor), b) == pytest.approx(ref, abs=1e-12)
    assert ta.similarity(a.scaled_output(factor), b.scaled_output(1 / factor)) == \
        pytest.approx(ref, abs=1e-12)
    # inner products scale exactly with the factor
    assert ta.inner(a.scaled_output(factor), b) == pytest.approx(factor * ta.inner(a, b),
                                                                 rel=1e-12)


@pytest.mark.parametrize("factor", [1e6, 1e-6])
def test_float32_torch_survives_extreme_scales(factor):
    """float32 has 24-bit mantissas (eps 6e-8) and overflows at 3e38; depth 2 with inner weights
    up to 1e3 and an output scale of 1e6 would overflow E[f^2] ~ 1e12 * (1e3)^16 without the
    exact power-of-two gauge normalization."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    a = rand_network(rng, "depth2", d=2, log_scale=(2.5, 3)).scaled_output(factor)
    b = rand_network(rng, "depth2", d=2, log_scale=(2.5, 3))
    ref = ta.similarity(a, b)
    got = ta.similarity(a, b, backend="torch", dtype=torch.float32, device="cpu")
    assert math.isfinite(got)
    # float32 contraction of ~800 configurations: error a few hundred eps32 at most
    assert got == pytest.approx(ref, abs=2e-4)
    g64 = ta.inner(a, b, backend="torch", device="cpu")
    assert g64 == pytest.approx(ta.inner(a, b), rel=1e-12)


# ---------------------------------------------------------------- Monte Carlo agreement

@pytest.mark.parametrize("kind", ["bilinear", "residual", "depth2"])
def test_montecarlo_agrees_within_four_standard_errors(kind):
    rng = np.random.default_rng(21)
    a = rand_network(rng, kind, d=3, log_scale=(-0.5, 0.5))
    b = rand_network(rng, kind, d=3, log_scale=(-0.5, 0.5))
    exact = ta.inner(a, b)
    est = ta.inner(a, b, method="montecarlo", n_samples=200_000, seed=1)
    assert est.stderr > 0
    assert abs(est - exact) <= 4 * est.stderr
    sim = ta.similarity(a, b, method="montecarlo", n_samples=200_000, seed=2)
    assert abs(sim - ta.similarity(a, b)) <= 4 * sim.stderr
    torch_est = ta.inner(a, b, method="montecarlo", backend="torch", n_samples=100_000, seed=3,
                         device="cpu")
    assert abs(torch_est - exact) <= 4 * torch_est.stderr


# ---------------------------------------------------------------- torch backend

def test_torch_float64_matches_numpy():
    pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    a = rand_network(rng, "depth2_residual_embed_head", d=2)
    b = rand_network(rng, "depth2_residual_embed_head", d=2)
    scale = math.sqrt(ta.inner(a, a) * ta.inner(b, b))
    for strategy in ("wick", "chaos"):
        kw = dict(strategy=strategy)
        assert abs(ta.inner(a, b, backend="torch", device="cpu", **kw) - ta.inner(a, b, **kw)) \
            <= 1e-12 * scale
        G = ta.gram([a, b], backend="torch", device="cpu", **kw)
        Gn = ta.gram([a, b], **kw)
        # entry (i, j) to 1e-12 of its Cauchy-Schwarz scale sqrt(G_ii G_jj): the two backends
        # run the same plan but their BLAS may round differently
        dg = np.sqrt(np.diag(Gn))
        assert np.all(np.abs(G - Gn) <= 1e-12 * np.outer(dg, dg))


def test_networks_are_callable_on_numpy_and_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    net = rand_network(rng, "depth2_residual_embed_head", d=2)
    x = rng.standard_normal((5, 2))
    y = net(x)
    assert y.shape == (5, 2)
    yt = net(torch.tensor(x))
    assert isinstance(yt, torch.Tensor) and yt.dtype == torch.float64
    assert np.allclose(yt.numpy(), y, rtol=1e-13, atol=0)
