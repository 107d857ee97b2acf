"""tensoralg.verify.identifiability: stability metrics on constructed cases with known answers."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensoralg.verify.identifiability import (
    code_iou,
    code_l2,
    compare,
    dictionary_cosine_similarity,
    match_atoms,
    random_baseline,
)


def _unit(rng, m, d):
    D = rng.standard_normal((m, d))
    return D / np.linalg.norm(D, axis=1, keepdims=True)


def _sparse_codes(rng, n, m, k):
    z = np.zeros((n, m))
    for i in range(n):
        idx = rng.choice(m, k, replace=False)
        z[i, idx] = rng.uniform(0.5, 1.5, k) * rng.choice([-1, 1], k)
    return z


def _permuted_flipped(D, z, rng):
    """D_b[p[i]] = s_i D[i]; codes z_b[:, p[i]] = s_i z[:, i]  =>  z_b @ D_b == z @ D."""
    m = D.shape[0]
    p = rng.permutation(m)
    s = rng.choice([-1.0, 1.0], m)
    Db = np.zeros_like(D)
    zb = np.zeros_like(z)
    Db[p] = s[:, None] * D
    zb[:, p] = z * s
    return Db, zb, p, s


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(1, 12), d=st.integers(2, 10))
def test_permuted_sign_flipped_copy_is_identical(seed, m, d):
    rng = np.random.default_rng(seed)
    D = _unit(rng, m, d) * rng.uniform(0.5, 2.0, (m, 1))  # norms must not matter
    z = _sparse_codes(rng, 20, m, min(3, m))
    Db, zb, p, s = _permuted_flipped(D, z, rng)
    assert np.allclose(zb @ Db, z @ D)
    r = compare(D, Db, z, zb)
    assert r["dcs"] == pytest.approx(1.0, abs=1e-12)
    assert r["code_iou"] == 1.0
    assert r["code_l2"] == pytest.approx(0.0, abs=1e-12)
    # the matching recovers the permutation whenever no two atoms are parallel
    m_ = match_atoms(D, Db)
    A = D / np.linalg.norm(D, axis=1, keepdims=True)
    coh = np.abs(A @ A.T) - np.eye(m)
    if coh.max() < 1 - 1e-9:
        assert np.array_equal(m_.perm, p)
        assert np.array_equal(m_.signs, s)


def test_rotated_basis_dcs_is_cos_45():
    # D_a = I_2, D_b = I_2 rotated by 45 degrees: every |cos| = 1/sqrt(2).
    c = 1 / math.sqrt(2)
    Db = np.array([[c, c], [-c, c]])
    assert dictionary_cosine_similarity(np.eye(2), Db) == pytest.approx(c, abs=1e-15)


def test_code_iou_and_l2_known_values():
    D = np.eye(3)
    m = match_atoms(D, D)  # identity matching
    za = np.array([[1.0, 2.0, 0.0]])
    zb = np.array([[0.0, 5.0, 1.0]])
    assert code_iou(za, zb, m) == pytest.approx(1 / 3)  # {0,1} vs {1,2}: 1 shared of 3
    # l2: ||(1,2,0)-(0,5,1)|| / ||(1,2,0)|| = sqrt(1+9+1)/sqrt(5)
    assert code_l2(za, zb, m) == pytest.approx(math.sqrt(11 / 5))
    assert code_l2(za, 1.1 * za, m) == pytest.approx(0.1)
    # both empty: identical supports by convention; IoU is a per-sample mean
    assert code_iou(np.zeros((2, 3)), np.zeros((2, 3)), m) == 1.0
    assert code_iou(np.array([[1.0, 0, 0], [0, 0, 0]]), np.array([[0, 1.0, 0], [0, 0, 0]]), m) == 0.5
    assert code_l2(np.zeros((1, 3)), np.zeros((1, 3)), m) == 0.0
    assert code_l2(np.zeros((1, 3)), za, m) == math.inf


def test_sign_flip_is_undone_in_codes():
    D = np.eye(2)
    Db = np.array([[-1.0, 0.0], [0.0, 1.0]])
    za = np.array([[1.0, 2.0]])
    zb = np.array([[-1.0, 2.0]])  # same signal: zb @ Db == za @ D
    r = compare(D, Db, za, zb)
    assert r["signs"] == [-1.0, 1.0] and r["code_l2"] == 0.0 and r["code_iou"] == 1.0


def test_zero_atoms_never_nan():
    rng = np.random.default_rng(0)
    D = _unit(rng, 4, 5)
    Db = D.copy()
    Db[2] = 0.0  # a dead atom
    dcs = dictionary_cosine_similarity(D, Db)
    assert dcs == pytest.approx(3 / 4)  # three exact matches, the dead atom has |cos| 0
    assert dictionary_cosine_similarity(np.zeros((3, 5)), np.zeros((3, 5))) == 0.0
    z = np.zeros((3, 4))
    r = compare(np.zeros((4, 5)), Db, z, z)
    assert all(np.isfinite(r[k]) for k in ("dcs", "code_iou", "code_l2"))


def test_rectangular_dictionaries_and_unmatched_latents():
    D = np.eye(3)[:2]             # 2 atoms
    Db = np.eye(3)                # 3 atoms; atom 2 has no partner
    m = match_atoms(D, Db)
    assert m.dcs == 1.0 and list(m.perm) == [0, 1]
    za = np.array([[1.0, 0.0]])
    zb = np.array([[1.0, 0.0, 1.0]])  # extra activity on the unmatched atom
    assert code_iou(za, zb, m) == pytest.approx(1 / 2)
    assert code_l2(za, zb, m) == pytest.approx(1.0)
    m2 = match_atoms(Db, D)       # the larger one first: one atom of a stays unmatched
    assert list(m2.perm).count(-1) == 1 and m2.dcs == 1.0


def test_random_baseline_is_a_floor():
    rb = random_baseline(16, 16, 8, n_draws=3, seed=1)
    assert 0.0 < rb["dcs_mean"] < 0.9
    rng = np.random.default_rng(3)
    D = _unit(rng, 16, 8)
    assert dictionary_cosine_similarity(D, D) > rb["dcs_mean"]


def test_bad_inputs():
    with pytest.raises(ValueError, match="D_a, D_b"):
        match_atoms(np.eye(3), np.eye(4))
    with pytest.raises(ValueError, match="D_a"):
        match_atoms(np.ones(3), np.eye(3))
    with pytest.raises(ValueError, match="NaN"):
        match_atoms(np.full((2, 2), np.nan), np.eye(2))
    m = match_atoms(np.eye(3), np.eye(3))
    with pytest.raises(ValueError, match="z_b"):
        code_iou(np.zeros((2, 3)), np.zeros((2, 4)), m)
    with pytest.raises(ValueError, match="different numbers of samples"):
        code_l2(np.zeros((2, 3)), np.zeros((3, 3)), m)


def test_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    D = torch.eye(3, dtype=torch.float32)
    assert compare(D, D, torch.eye(3), torch.eye(3))["code_iou"] == 1.0
