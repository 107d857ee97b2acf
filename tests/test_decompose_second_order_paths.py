"""Second-order paths of transformers (dc.paths(..., order=2); docs/mathematics.md §3.10): the
virtual heads ``U A_{1,h}[LEG <- A_{0,h'}(X)]``.

Independent references: every path's forward pass written here in numpy from the raw weights
(each leg of the later head reading the embedded input, or the earlier head's output on one
leg), the homogeneous parts of the remainder (roots of unity on the model's own forward pass),
and tensor-product Gauss-Hermite quadrature (tensoralg.verify.quadrature) on the whole input
space (N = n_ctx * d = 4 Gaussian variables, exact for these degree-9 paths)."""

from __future__ import annotations

import numpy as np
import pytest
import tensoralg.verify.quadrature as vq

from tensoralg import decompose as dc
from tensoralg.errors import CostTooHigh
from tensoralg.layers import BilinearAttention, Linear, Residual, Sequential

N_CTX, D = 2, 2
LEGS = ("q1", "k1", "q2", "k2", "v")


def _model(seed=0, biases=True, H=1, dh=1):
    rng = np.random.default_rng(seed)

    def att():
        kw = {k: rng.normal(size=(H, dh, D)) * 0.8 for k in LEGS}
        if biases:
            kw.update({k + "_bias": rng.normal(size=(H, dh)) * 0.5 for k in ("q1", "k1", "v")})
        return BilinearAttention(**kw, o=rng.normal(size=(D, H, dh)), mask="causal")
    emb = Linear(rng.normal(size=(D, D)), rng.normal(size=D) if biases else None)
    return Sequential([emb, Residual(att()), Residual(att()),
                       Linear(rng.normal(size=(3, D)), rng.normal(size=3) if biases else None)])


def _attention(at, X, h, leg=None, Y=None):
    """Head ``h`` written out: every leg reads ``(1, X)``, ``leg`` reads ``(0, Y)``."""
    B = X.shape[0]
    Xl = np.concatenate([np.ones((B, N_CTX, 1)), X], 2)
    Yl = None if Y is None else np.concatenate([np.zeros((B, N_CTX, 1)), Y], 2)
    lw = at.lifted()
    r = {k: np.einsum("ei,bpi->bpe", lw[k][h], Yl if k == leg else Xl) for k in LEGS}
    M = at.mask_matrix(N_CTX) * at.scale
    pat = M * np.einsum("bte,bse->bts", r["q1"], r["k1"]) * \
        np.einsum("bte,bse->bts", r["q2"], r["k2"])
    return np.einsum("bts,bsv,ov->bto", pat, r["v"], lw["o"][:, h])


def _reference(model, X):
    """``{name: path(X)}`` of the second-order paths, from the raw weights."""
    emb, r0, r1, un = model.layers
    E = X @ emb.weight.T + (0 if emb.bias is None else emb.bias)
    out = {}
    for h in range(r1.inner.n_heads):
        for leg in LEGS:
            for h2 in range(r0.inner.n_heads):
                y = _attention(r0.inner, E, h2)
                out[f"L1.H{h}.{leg.upper()}\u2190L0.H{h2}"] = \
                    _attention(r1.inner, E, h, leg, y) @ un.weight.T
    return out


@pytest.fixture(scope="module")
def biased():
    model = _model()
    return model, dc.paths(model, n_ctx=N_CTX, order=2)


def test_names_networks_and_forward_passes(biased):
    model, pd = biased
    assert pd.names[:3] == ["direct", "L0.H0", "L1.H0"] and pd.order == 2
    ref = _reference(model, np.zeros((1, N_CTX, D)))
    assert pd.names[3:] == list(ref)
    assert pd.kinds[3:] == ["composition"] * 5
    X = np.random.default_rng(7).normal(size=(5, N_CTX, D))
    ref = _reference(model, X)
    for name, want in ref.items():
        got = pd.network(name)(X)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())
    total = sum(net(X) for net in pd.networks)
    np.testing.assert_allclose(pd.first_order(X), total, rtol=0,
                               atol=1e-12 * np.abs(total).max())
    # the listed paths and the rest sum to the model (rest = f - listed, by definition)
    np.testing.assert_allclose(total + pd.rest(X), model(X), rtol=0,
                               atol=1e-12 * np.abs(model(X)).max())


def test_gram_against_quadrature(biased):
    _, pd = biased
    basis = [np.eye(D)] * N_CTX
    for i, j in ((0, 0), (3, 3), (4, 6), (1, 7)):
        q = float(vq.quadrature_inner(pd.networks[i], pd.networks[j], basis, n_ctx=N_CTX))
        assert pd.gram[i, j] == pytest.approx(q, rel=1e-10, abs=1e-13 * abs(pd.gram[i, i])), \
            (pd.names[i], pd.names[j])
    assert pd.methods["gram"].startswith("exact (feature-space chaos")
    assert pd.rest_norm is None and pd.methods["rest_norm"].startswith("not assessed")


def test_rest_has_no_term_of_order_two_or_less():
    """Bias-free: the paths of order <= 2 hold every homogeneous part of degree <= 9 (orders 0,
    1, 2 have degrees 1, 5, 9), and the rest starts at degree 13 (two compositions). The
    homogeneous parts from the model's own forward pass on complex inputs: ``P_k(X) = (1/m)
    sum_j w^{-jk} f(w^j X)``, ``m = 26`` > the degree 25."""
    model = _model(seed=3, biases=False)
    pd = dc.paths(model, n_ctx=N_CTX, order=2)
    X = np.random.default_rng(1).normal(size=(3, N_CTX, D))
    m = 26
    w = np.exp(2j * np.pi / m)

    def parts(f):
        vals = [f(w ** j * X) for j in range(m)]
        return [sum(w ** (-j * k) * vals[j] for j in range(m)) / m for k in range(m)]

    pm, pl = parts(model), parts(pd.first_order)
    scale = max(np.abs(p).max() for p in pm)
    for k in range(m):
        if k in (1, 5, 9):
            np.testing.assert_allclose(pl[k], pm[k], rtol=0, atol=1e-10 * scale)
            assert np.abs(pm[k]).max() > 1e-6 * scale
        elif k <= 12:
            assert np.abs(pm[k]).max() < 1e-10 * scale and np.abs(pl[k]).max() < 1e-10 * scale
        else:
            assert np.abs(pl[k]).max() < 1e-10 * scale   # nothing listed above degree 9


def test_refusals_before_any_work(monkeypatch):
    from tensoralg.strategies.chaos import composed

    def boom(*a, **k):
        raise AssertionError("work started before the refusal")
    real = composed.FeatureChaos
    monkeypatch.setattr(composed, "FeatureChaos", boom)
    with pytest.raises(ValueError, match=r"^order: expected 1 .* got 3$"):
        dc.paths(_model(), n_ctx=N_CTX, order=3)
    with pytest.raises(ValueError, match="^backend: expected 'numpy', 'torch' or 'exact'"):
        dc.paths(_model(), n_ctx=N_CTX, order=2, backend="cupy")
    with pytest.raises(ValueError, match="^backend: expected 'numpy' or 'torch', got 'jax'$"):
        real([], 2, backend="jax")
    with pytest.raises(CostTooHigh, match=r"order 9 over N = n_ctx\*d = 16 .*Monte Carlo"):
        dc.paths(_model(), n_ctx=8, order=2)


def test_torch_backend_equals_numpy(biased):
    """backend="torch" (float64, here on the CPU): the dense lifted tensors and their packing
    into monomials in torch; the Gram equals NumPy's to 1e-12 (summation order only)."""
    model, pd = biased
    pt = dc.paths(model, n_ctx=N_CTX, order=2, backend="torch", device="cpu")
    assert pt.names == pd.names and "float64, torch" in pt.methods["gram"]
    np.testing.assert_allclose(pt.gram, pd.gram, rtol=1e-12, atol=1e-12 * np.abs(pd.gram).max())


@pytest.mark.slow   # ~15 s: rationals through object-array einsums
def test_exact_backend_gives_rationals_equal_to_float():
    from fractions import Fraction

    rng = np.random.default_rng(5)

    def att():
        kw = {k: rng.integers(-2, 3, size=(1, 1, 1)) / 2 for k in LEGS}
        kw.update({k + "_bias": rng.integers(-2, 3, size=(1, 1)) / 2 for k in ("q1", "k1")})
        return BilinearAttention(**kw, o=rng.integers(-2, 3, size=(1, 1, 1)) / 2 + 1.0,
                                 mask="causal")
    model = Sequential([Linear(np.array([[1.5]]), np.array([0.5])), Residual(att()),
                        Residual(att()), Linear(np.array([[1.0], [-0.5]]))])
    pf = dc.paths(model, n_ctx=2, order=2)
    pe = dc.paths(model, n_ctx=2, order=2, backend="exact")
    assert isinstance(pe.gram[3, 5], Fraction) and "rationals" in pe.methods["gram"]
    np.testing.assert_allclose(np.asarray(pe.gram, dtype=float), pf.gram, rtol=1e-12,
                               atol=1e-14 * np.abs(pf.gram).max())
