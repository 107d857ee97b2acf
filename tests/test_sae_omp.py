"""tensoralg.sae.omp against scikit-learn's OrthogonalMatchingPursuit, and on exact recovery."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import OrthogonalMatchingPursuit

from tensoralg.sae.omp import omp
from tensoralg.sae.synthetic import make_synthetic


@pytest.mark.parametrize("seed,d,m,k", [(0, 8, 12, 1), (1, 8, 12, 3), (2, 10, 20, 5), (3, 6, 6, 6)])
def test_matches_sklearn(seed, d, m, k):
    rng = np.random.default_rng(seed)
    D = rng.standard_normal((m, d))
    D /= np.linalg.norm(D, axis=1, keepdims=True)
    X = rng.standard_normal((15, d))
    ours = omp(torch.from_numpy(X), torch.from_numpy(D), k).numpy()
    for i in range(len(X)):
        ref = OrthogonalMatchingPursuit(n_nonzero_coefs=k, fit_intercept=False).fit(D.T, X[i]).coef_
        assert np.allclose(ours[i], ref, rtol=1e-9, atol=1e-10), (i, ours[i], ref)


def test_recovers_exactly_sparse_codes_with_offset():
    syn = make_synthetic(200, 32, 40, 3, seed=0, dtype=torch.float64)
    b = torch.linspace(-1, 1, 32, dtype=torch.float64)
    z = omp(syn.x + b, syn.W_dec, 3, b_dec=b)
    # incoherent dictionary (d=32, m=40) and k=3: OMP finds the true support almost always
    hit = ((z != 0) == (syn.z != 0)).all(dim=1).double().mean()
    assert hit > 0.95
    exact = ((z != 0) == (syn.z != 0)).all(dim=1)
    assert torch.allclose(z[exact], syn.z[exact], atol=1e-9)


def test_bad_input():
    with pytest.raises(ValueError, match="x, W_dec"):
        omp(torch.zeros(3, 4), torch.zeros(5, 6), 2)
    with pytest.raises(ValueError, match="k"):
        omp(torch.zeros(3, 4), torch.zeros(5, 4), 5)
