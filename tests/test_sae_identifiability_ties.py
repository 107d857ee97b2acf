"""tensoralg.verify.identifiability: ties in the atom matching (duplicate atoms) do not change the scores."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tensoralg.verify.identifiability import code_iou, compare, match_atoms


def _case(seed, m=7, d=5, k=2, n=60, dup=(0, 1)):
    rng = np.random.default_rng(seed)
    D = rng.standard_normal((m, d))
    D[dup[1]] = D[dup[0]] * (1 if seed % 2 else -1)      # a duplicate atom (maybe sign-flipped)
    Z = np.zeros((n, m))
    for i in range(n):
        idx = rng.choice(m, k, replace=False)
        Z[i, idx] = rng.standard_normal(k)
    return rng, D, Z


def test_swapping_identical_atoms_with_their_codes_keeps_the_score():
    _, D, Z = _case(0)
    swap = [1, 0, 2, 3, 4, 5, 6]
    Db, Zb = D[swap], Z[:, swap]
    # the bare Hungarian matching pairs the duplicates the wrong way round here (the bug)
    assert code_iou(Z, Zb, match_atoms(D, Db)) < 0.9
    c = compare(D, Db, Z, Zb)
    assert c["code_iou"] == 1.0 and c["code_l2"] < 1e-12 and abs(c["dcs"] - 1.0) < 1e-12
    assert compare(D, D, Z, Z)["code_iou"] == 1.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), data=st.data())
def test_scores_are_invariant_to_the_order_of_tied_atoms(seed, data):
    rng, D, Z = _case(seed, dup=(2, 5))
    # b: a noisy relabelled copy of a (permutation + signs), codes perturbed
    perm = np.array(data.draw(st.permutations(range(7))))
    signs = rng.choice([-1.0, 1.0], 7)
    Db = D[perm] * signs[:, None]
    Zb = (Z + 0.3 * rng.standard_normal(Z.shape) * (Z != 0))[:, perm] * signs
    Zb[rng.random(Zb.shape) < 0.05] = 0.0
    ref = compare(D, Db, Z, Zb)
    # swapping the two duplicate atoms of b (with their codes) is the same decomposition
    i, j = int(np.flatnonzero(perm == 2)[0]), int(np.flatnonzero(perm == 5)[0])
    sw = np.arange(7)
    sw[[i, j]] = sw[[j, i]]
    other = compare(D, Db[sw], Z, Zb[:, sw])
    for key in ("dcs", "code_iou", "code_l2"):
        assert abs(ref[key] - other[key]) <= 1e-12, key
