"""tensoralg.sae.omp (module tensoralg.sae.pursuit) against scikit-learn's
OrthogonalMatchingPursuit, and on exact recovery."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import OrthogonalMatchingPursuit

from tensoralg.sae import omp
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


def test_documented_import_gives_the_function_not_the_module():
    """`from tensoralg.sae import omp` used to return the submodule tensoralg.sae.omp."""
    import tensoralg.sae.bench  # noqa: F401  (imports the pursuit module first, as users may)
    from tensoralg.sae import TrainConfig, make_config, make_synthetic, omp, train  # noqa: F401

    data = make_synthetic(64, d=32, m=64, k=4, seed=0)
    z = omp(data.x, data.W_dec, k=4)
    assert callable(omp) and z.shape == (64, 64) and ((z != 0).sum(1) == 4).all()


def test_no_export_is_shadowed_by_a_submodule():
    import importlib
    import pkgutil
    import types

    import tensoralg.sae as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "activations":          # the optional transformers extra
            importlib.import_module(f"tensoralg.sae.{info.name}")
    for name in pkg.__all__:
        assert not isinstance(getattr(pkg, name), types.ModuleType), name


# The README's and docs/sae.md's SAE snippets run as written in tests/test_docs.py (every code
# block of the docs is executed there); this is the same calls at a smaller size, with checks.
def test_readme_snippet_literal_small():
    from tensoralg.verify.identifiability import compare, random_baseline

    from tensoralg.sae import TrainConfig, make_config, make_synthetic, omp, train

    data = make_synthetic(512, d=32, m=64, k=4, seed=0)
    sae, history = train(data.x, make_config("isae-me", 32, 64, 4), TrainConfig(steps=10, seed=0))
    r = compare(data.W_dec, sae.W_dec, data.z, sae.encode(data.x))
    z = omp(data.x, data.W_dec, k=4)
    assert history and 0 <= r["dcs"] <= 1 and ((z != 0).sum(1) == 4).all()
    # 10 steps cannot find the dictionary: the SAE is still near the random floor, not at 1
    rb = random_baseline(64, 64, 32, n_draws=10, seed=0)
    assert r["dcs"] < rb["dcs_mean"] + 0.1
