"""tensoralg.decompose: the identities against independent exact computations (verify's
polynomial expansion in rationals), invariances, and bad input."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from netgen import rand_bilinear, rand_linear
from tensoralg.verify.certify import certify, gaussian_inner_exact
from tensoralg.verify.decompose import (
    chaos_coefficients,
    check_decomposition_exact,
    hermite_expansion,
)

import tensoralg as ta
from tensoralg import decompose as dc


def q(rng, *shape):
    """Small random rationals (halves in [-2, 2]) as an object array."""
    return np.vectorize(lambda v: Fraction(int(v), 2), otypes=[object])(
        rng.integers(-4, 5, shape))


def rational_depth1(rng, d=3, m=3, H=3, O=2, residual=True):
    """Embedding -> (residual) bilinear with all biases -> head with bias, in rationals."""
    block = ta.Bilinear(q(rng, H, m), q(rng, H, m), q(rng, m, H), q(rng, H), q(rng, H), q(rng, m))
    return ta.Sequential([ta.Linear(q(rng, m, d), q(rng, m)),
                          ta.Residual(block) if residual else block,
                          ta.Linear(q(rng, O, m), q(rng, O))])


def float_depth1(rng, d=6, m=4, H=5, O=3):
    return ta.Sequential([rand_linear(rng, d, m), ta.Residual(rand_bilinear(rng, m, H, m)),
                          rand_linear(rng, m, O)])


def rational_residual(rng, n_blocks=2, d=2, m=2, H=2, O=2):
    blocks = [ta.Residual(ta.Bilinear(q(rng, H, m), q(rng, H, m), q(rng, m, H), q(rng, H),
                                      q(rng, H), q(rng, m))) for _ in range(n_blocks)]
    return ta.Sequential([ta.Linear(q(rng, m, d), q(rng, m))] + blocks
                         + [ta.Linear(q(rng, O, m), q(rng, O))])


def slice_net(net, u):
    """``u . f`` as a 1-output network (a linear read-out appended)."""
    return ta.Sequential([net, ta.Linear(np.asarray(u, dtype=object if net.is_exact else float)[None])])


# ---------------------------------------------------------------------------------------
# 2. chaos coefficients: exactly the brute-force Hermite expansion
# ---------------------------------------------------------------------------------------

def test_hermite_expansion_known_cases():
    # x^3 = He3 + 3 He1 and (x1 x2)^2 = (He2+1)(He2+1) in two variables (docs/mathematics.md §3.6 checks)
    assert hermite_expansion({(3,): Fraction(1)}) == {(3,): 1, (1,): 3}
    assert hermite_expansion({(2, 2): Fraction(1)}) == {(2, 2): 1, (2, 0): 1, (0, 2): 1, (0, 0): 1}


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_chaos_coefficients_equal_brute_force_in_rationals(seed, residual):
    rng = np.random.default_rng(seed)
    net = rational_depth1(rng, residual=residual)
    co = dc.chaos_coefficients_depth1(net)
    assert co.C2.dtype == object
    for o in range(net.out_features):
        C0, C1, C2 = chaos_coefficients(net, o)
        assert co.C0[o] == C0
        assert list(co.C1[o]) == C1
        assert co.C2[o].tolist() == C2
    # a direction u . f (integer direction stays rational)
    u = [2, -3]
    C0, C1, C2 = chaos_coefficients(net, u)
    cu = dc.chaos_coefficients_depth1(net, u)
    assert (cu.C0[0], list(cu.C1[0]), cu.C2[0].tolist()) == (C0, C1, C2)
    # E[f^2] = C0^2 + |C1|^2 + 2|C2|_F^2 against the expansion's Gaussian moments
    assert list(co.norm2()) == gaussian_inner_exact(net, net, output="each")


def test_chaos_coefficients_float_match_engine():
    rng = np.random.default_rng(3)
    net = float_depth1(rng)
    co = dc.chaos_coefficients_depth1(net)
    ref = ta.inner(net, net, output="each")
    np.testing.assert_allclose(co.norm2(), ref, rtol=1e-10)
    # float route vs the exact route on the same (exactly representable) weights
    exact = [chaos_coefficients(net, o) for o in range(net.out_features)]
    for o, (C0, C1, C2) in enumerate(exact):
        np.testing.assert_allclose(co.C2[o], np.array(C2, dtype=float), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(co.C1[o], np.array(C1, dtype=float), rtol=1e-10, atol=1e-12)
        assert abs(co.C0[o] - float(C0)) <= 1e-10 * max(1.0, abs(float(C0)))


# ---------------------------------------------------------------------------------------
# eigen-components: orthogonality, truncation error, faithfulness
# ---------------------------------------------------------------------------------------

def test_truncation_error_equals_independent_expansion():
    rng = np.random.default_rng(4)
    net = float_depth1(rng, d=5)
    for c in range(net.out_features):
        e = dc.eigen(net, c)
        sl = slice_net(net, np.eye(net.out_features)[c])
        assert e.norm2 == pytest.approx(ta.inner(net, net, output=c), rel=1e-10)
        for k in range(e.d + 1):
            # ||f_c - f_k||^2 by exact expansion of the float networks, vs 2 sum_dropped lambda^2
            ref = float(certify(e.truncate(k), sl).distance2)
            want = e.truncation_error(k)
            assert abs(ref - want) <= 1e-10 * e.norm2, (c, k, ref, want)
        fa = e.faithfulness()
        for k in (1, 3):
            assert fa["similarity"][k] == pytest.approx(ta.similarity(e.truncate(k), sl), rel=1e-10)


def test_eigen_components_orthogonal_and_sum_to_the_output():
    rng = np.random.default_rng(5)
    net = float_depth1(rng, d=4)
    e = dc.eigen(net, [1.0, -2.0, 0.5])
    comps = e.components()
    G = ta.gram(comps[1:])            # same architecture: one batched call
    np.testing.assert_allclose(np.diag(G), e.component_norm2, rtol=1e-10)
    off = G - np.diag(np.diag(G))
    assert np.max(np.abs(off)) <= 1e-10 * e.norm2
    lin = [ta.inner(comps[0], g) for g in comps[1:]]
    assert np.max(np.abs(lin)) <= 1e-10 * e.norm2
    chk = dc.check_decomposition(slice_net(net, [1.0, -2.0, 0.5]), comps)
    assert chk.equal and chk.residual_route == "network"
    assert chk.relative_residual <= 1e-12
    assert sum(chk.share) + chk.interference == pytest.approx(1.0, rel=1e-10)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.1, 10.0))
def test_eigenvalues_invariant_to_hidden_permutation_and_rescaling(seed, scale):
    rng = np.random.default_rng(seed)
    d, H, O = 4, 5, 2
    L, R, D = rng.normal(size=(H, d)), rng.normal(size=(H, d)), rng.normal(size=(O, H))
    lb, rb = rng.normal(size=H), rng.normal(size=H)
    net = ta.Bilinear(L, R, D, lb, rb)
    perm = rng.permutation(H)
    s = scale * np.exp(rng.normal(size=H))
    # permute hidden units, scale left by s, right by 1/s: the same function
    other = ta.Bilinear(L[perm] * s[perm, None], R[perm] / s[perm, None], D[:, perm],
                        lb[perm] * s[perm], rb[perm] / s[perm])
    a, b = dc.eigen(net, 1), dc.eigen(other, 1)
    np.testing.assert_allclose(b.eigenvalues, a.eigenvalues, rtol=1e-9,
                               atol=1e-12 * np.abs(a.eigenvalues).max())


# ---------------------------------------------------------------------------------------
# 1. check_decomposition against verify's expansion
# ---------------------------------------------------------------------------------------

def test_check_decomposition_exact_agrees_with_verify():
    rng = np.random.default_rng(6)
    f = rational_depth1(rng)
    g1 = rational_depth1(rng)
    g2 = dc.combine([f, g1], [1, -1])          # f - g1: depth 1, rational
    chk = dc.check_decomposition(f, [g1, g2], backend="exact")
    ref = check_decomposition_exact(f, [g1, g2])
    assert chk.certified and chk.equal and chk.residual == 0 == ref.residual
    assert chk.residual_frobenius == 0 == ref.residual_frobenius
    assert chk.gram.tolist() == ref.gram
    # an unequal decomposition: both routes give the same nonzero residual, exactly
    g3 = rational_depth1(rng)
    bad = dc.check_decomposition(f, [g1, g3], backend="exact")
    ref = check_decomposition_exact(f, [g1, g3])
    assert not bad.equal and bad.residual == ref.residual > 0
    assert bad.residual_frobenius == ref.residual_frobenius > 0
    assert bad.gram.tolist() == ref.gram
    flt = dc.check_decomposition(f.astype_float(), [g1.astype_float(), g3.astype_float()])
    assert flt.residual == pytest.approx(float(ref.residual), rel=1e-10)
    assert not flt.equal and not flt.certified


def test_difference_network_is_the_difference():
    rng = np.random.default_rng(7)
    a, b = rational_depth1(rng), rational_depth1(rng)
    diff = dc.difference(a, b)                 # b - a, hidden units side by side
    ref = check_decomposition_exact(b, [a, diff])
    assert ref.equal
    # deeper same-architecture checkpoints: block-diagonal, same depth
    a2, b2 = rational_residual(rng), rational_residual(rng)
    d2 = dc.difference(a2, b2)
    assert dc.bilinear_depth(d2) == 2
    assert check_decomposition_exact(b2, [a2, d2]).equal


# ---------------------------------------------------------------------------------------
# 3. residual paths
# ---------------------------------------------------------------------------------------

def test_paths_sum_to_the_model_certificate_in_rationals():
    rng = np.random.default_rng(8)
    net = rational_residual(rng, n_blocks=2, d=1, m=2, H=1, O=1)   # small: rational Wick sums
    pd = dc.paths(net, backend="exact")
    assert pd.names == ["direct", "1", "2", "1+2"]
    assert pd.depths == [0, 1, 1, 2]
    assert pd.check.certified and pd.check.residual == 0
    # independent: the expansion says the paths add up to the model, and the Gram agrees
    ref = check_decomposition_exact(net, pd.networks)
    assert ref.equal
    assert [r[1:] for r in ref.gram[1:]] == pd.gram.tolist()


def test_paths_three_blocks_sum_exactly():
    rng = np.random.default_rng(9)
    net = rational_residual(rng, n_blocks=3, d=2, m=2, H=1, O=1)
    from tensoralg.decompose.residual import _path_networks

    _, names, nets = _path_networks(net)
    assert names == ["direct", "1", "2", "3", "1+2", "1+3", "2+3", "1+2+3"]
    assert check_decomposition_exact(net, nets).equal


def test_paths_three_blocks_list_costs():
    rng = np.random.default_rng(9)
    # width 48: the depth-3 path has 46 206 736 Wick configurations and its degree-8 chaos
    # expansion needs about 1.7e12 FLOPs even in packed storage (at width 16 the chaos
    # strategy now computes it, in about a minute; at width 2 in milliseconds)
    net = rational_residual(rng, n_blocks=3, d=48, m=48, H=1, O=1)
    pd = dc.paths(net.astype_float(), check=False)
    assert pd.over_budget == ["1+2+3"]           # depth 3: refused by the planner
    assert "REFUSED" in pd.cost[-1]
    assert np.isnan(pd.gram[-1, -1]) and np.isfinite(pd.gram[0, 0])


def test_path_similarity_same_model_is_one():
    rng = np.random.default_rng(10)
    net = rational_residual(rng).astype_float()
    sims = dc.path_similarity(net, net)
    assert set(sims) == {"direct", "1", "2", "1+2"}
    assert all(v == pytest.approx(1.0, abs=1e-12) for v in sims.values())


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------

def test_bad_input():
    rng = np.random.default_rng(11)
    net = float_depth1(rng, d=4, O=3)
    e = dc.eigen(net, 0)
    with pytest.raises(ValueError, match=r"k: expected 0 <= k <= 4.*got 5"):
        e.truncate(5)
    with pytest.raises(ValueError, match=r"k: expected 0 <= k <= 4.*got -1"):
        e.truncation_error(-1)
    with pytest.raises(ValueError, match=r"output: class index 3 out of range .* 3 outputs"):
        dc.eigen(net, 3)
    with pytest.raises(ValueError, match=r"output: a direction vector must have shape \(3,\)"):
        dc.eigen(net, [1.0, 2.0])
    with pytest.raises(ValueError, match=r"output: the model has 3 outputs"):
        dc.eigen(net)
    other_in = float_depth1(rng, d=5, O=3)
    other_out = float_depth1(rng, d=4, O=2)
    with pytest.raises(ValueError, match=r"components\[1\]: reads 5 inputs .* model reads 4"):
        dc.check_decomposition(net, [net, other_in])
    with pytest.raises(ValueError, match=r"components\[0\]: has 2 outputs .* model has 3"):
        dc.check_decomposition(net, [other_out])
    with pytest.raises(ValueError, match=r"components: expected at least one"):
        dc.check_decomposition(net, [])
    with pytest.raises(ValueError, match=r"output: class index 7 out of range"):
        dc.check_decomposition(net, [net], output=7)
    deep = rational_residual(rng)
    with pytest.raises(ValueError, match=r"bilinear depth 2.*check_decomposition"):
        dc.eigen(deep, 0)
    with pytest.raises(ValueError, match=r"check_decomposition"):
        dc.chaos_coefficients_depth1(deep)
    with pytest.raises(ValueError, match=r"networks\[1\]: reads 5 inputs"):
        dc.combine([net, other_in])
    with pytest.raises(ValueError, match=r"same layer pattern"):
        dc.combine([deep, ta.Sequential([rand_linear(rng, 2, 2), rand_linear(rng, 2, 2)])])
    with pytest.raises(ValueError, match=r"paths expects"):
        dc.paths(ta.Sequential([ta.Residual(rand_bilinear(rng, 3, 2, 3)),
                                rand_bilinear(rng, 3, 2, 3)]))


# ---------------------------------------------------------------------------------------
# 4. a change localized in input space (the audits' eigenvector report)
# ---------------------------------------------------------------------------------------

def test_change_eigen_localizes_a_planted_change(tmp_path):
    from tensoralg.decompose.report import change_eigen, eigenvector_figure, mask_mass

    rng = np.random.default_rng(12)
    d, O = 16, 3
    before = float_depth1(rng, d=d, m=4, H=5, O=O)
    mask = np.zeros(d, dtype=bool)
    mask[[5, 6, 9]] = True
    w = np.where(mask, rng.normal(size=d), 0.0)
    # after = before + 3 (w.x)^2 on output 2 only: the change is one eigen-component on the mask
    plant = ta.Bilinear(w[None], w[None], [[0.0], [0.0], [3.0]])
    after = dc.combine([before, plant])
    eig, summary = change_eigen(before, after, 2, k=2, mask=mask)
    # derivation: 3 (w.x)^2 = 3|w|^2 (v.x)^2 with v = w/|w|, so lambda_1 = 3|w|^2, C1 = 0, C0 = 3|w|^2
    assert eig.eigenvalues[0] == pytest.approx(3 * w @ w, rel=1e-10)
    assert abs(eig.eigenvalues[1]) <= 1e-10 * eig.eigenvalues[0]
    assert summary["top_eigenvector_mask"]["mass_inside"] == pytest.approx(1.0, rel=1e-10)
    assert summary["top_eigenvector_mask"]["pixel_share"] == 3 / 16
    assert summary["linear_term_mask"] is None or np.allclose(eig.C1, 0, atol=1e-12)
    assert mask_mass(np.ones(d), mask)["mass_inside"] == pytest.approx(3 / 16)
    # no change on output 0: zero eigenvalues
    e0, _ = change_eigen(before, after, 0, k=2)
    assert np.max(np.abs(e0.eigenvalues)) <= 1e-12
    path = eigenvector_figure(tmp_path / "eig.png", eig, 3, "planted", mask)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"mask: expected shape \(16,\)"):
        mask_mass(np.ones(d), np.ones(4, dtype=bool))


# ---------------------------------------------------------------------------------------
# 5. CLI
# ---------------------------------------------------------------------------------------

def _checkpoints(tmp_path, n_layers=1, d_model=4, d_hidden=5):
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.nn import BilinearNet

    kw = dict(d_model=d_model, d_hidden=d_hidden, n_layers=n_layers, residual=True, bias=True)
    a, b = BilinearNet(16, 3, seed=0, **kw), BilinearNet(16, 3, seed=1, **kw)
    save_checkpoint(tmp_path / "a", a, step=0)
    save_checkpoint(tmp_path / "b", b, step=1)
    return a, b


def test_cli_decompose_eigen_and_diff(tmp_path, capsys):
    import json

    from tensoralg.cli import main

    a, b = _checkpoints(tmp_path)
    out = tmp_path / "run"
    assert main(["decompose", str(tmp_path / "a"), "--diff", str(tmp_path / "b"), "--output",
                 "2", "--k", "3", "--out", str(out), "--json", str(tmp_path / "c.json")]) == 0
    res = json.loads((out / "decompose.json").read_text())
    assert res["files"] == ["decompose.json", "decompose_eigenvectors.png"]
    assert (out / "decompose_eigenvectors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "c.json").read_text())["eigen"] == res["eigen"]
    e2 = res["eigen"]["2"]
    assert len(e2["eigenvectors"]) == 3 and res["drawn_output"] == 2
    # the change's norm per output is ||b - a||^2 of that slice (engine, from bilinearity)
    want = ta.diff_norm(b.to_network(), a.to_network(), output=2) ** 2
    assert e2["norm2"] == pytest.approx(want, rel=1e-9)
    assert "rel. error (k=3)" in capsys.readouterr().out


def test_cli_decompose_paths_and_bad_input(tmp_path, capsys):
    import json

    from tensoralg.cli import main

    _checkpoints(tmp_path, n_layers=2, d_model=2, d_hidden=2)
    out = tmp_path / "run"
    assert main(["decompose", str(tmp_path / "a"), "--out", str(out)]) == 0
    res = json.loads((out / "decompose.json").read_text())
    assert res["paths"]["names"] == ["direct", "1", "2", "1+2"]
    assert res["paths"]["check"]["equal"] and res["files"] == ["decompose.json"]
    assert main(["decompose", str(tmp_path / "a"), "--output", "3", "--out", str(out)]) == 2
    assert "--output: class index 3 out of range for 3 outputs (expected 0..2)" in capsys.readouterr().err
    assert main(["decompose", str(tmp_path / "a"), "--k", "17", "--out", str(out)]) == 2
    assert "--k: 17" in capsys.readouterr().err
    assert main(["decompose", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err


def test_the_change_between_identical_checkpoints_is_exactly_zero(tmp_path, capsys):
    """Fresh-eyes tester: difference(b, b) left rounding noise (||f|| = 5e-14) that read as a
    change (a similarity of 0.02 with another model, shares of 0.15; the CLI printed a relative
    error of 0.67 and a similarity of 0.58 per class). It is the zero network now, and what
    is undefined for a zero function says so."""
    import json

    from tensoralg.cli import main

    rng = np.random.default_rng(3)
    b = rand_bilinear(rng, 4, 3, 5)
    z = dc.difference(b, b)
    assert ta.norm(z) == 0.0 and ta.norm(z, backend="exact") == 0
    with pytest.raises(ValueError, match="^similarity: a has norm zero"):
        ta.similarity(z, b)
    chk = dc.check_decomposition(z, [z])
    assert chk.equal and chk.norm2 == 0 and any("norm zero" in n for n in chk.notes)
    # a change that is not zero is still the difference (same weights, one entry moved)
    c = ta.Bilinear(b.left.copy(), b.right, b.down)
    c.left[0, 0] += 1.0
    assert ta.norm(dc.difference(b, c)) > 0
    _a, _ = _checkpoints(tmp_path)
    out = tmp_path / "run0"
    assert main(["decompose", str(tmp_path / "a"), "--diff", str(tmp_path / "a"),
                 "--out", str(out)]) == 0
    assert "undefined (f = 0)" in capsys.readouterr().out
    res = json.loads((out / "decompose.json").read_text())
    assert all(e["norm2"] == 0 and e["similarity"][1] is None for e in res["eigen"].values())


def test_difference_size_errors_name_a_and_b():
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="^input dimensions differ: a takes 3 inputs, b takes 5"):
        dc.difference(rand_bilinear(rng, 3, 2, 4), rand_bilinear(rng, 5, 2, 4))


def test_cli_decompose_errors_name_what_the_user_typed(tmp_path, capsys):
    """--diff errors named 'a' and 'b' (the library's names), a depth-2 network without residual
    blocks was refused with the paths decomposition's internals: both now name CKPT / --diff and
    the checkpoint, and say such models are not decomposed."""
    import numpy as np

    import tensoralg as ta
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.cli import main

    rng = np.random.default_rng(0)

    def bil(d, h, o):
        return ta.Bilinear(rng.normal(size=(h, d)), rng.normal(size=(h, d)), rng.normal(size=(o, h)))
    save_checkpoint(tmp_path / "a", bil(3, 4, 2))
    save_checkpoint(tmp_path / "wide", bil(5, 4, 2))
    save_checkpoint(tmp_path / "deep", ta.Sequential([bil(3, 4, 3), bil(3, 4, 2)]))
    a, wide, deep = (str(tmp_path / n) for n in ("a", "wide", "deep"))
    not_decomposed = ("is a bilinear network of depth 2 without residual blocks: such models are "
                      "not decomposed")
    cases = [(["decompose", a, "--diff", wide],
              f"--diff: {wide} maps 5 inputs to 2 outputs, CKPT {a} maps 3 to 2; the change "
              f"between two checkpoints needs the same input and output sizes"),
             (["decompose", deep, "--k", "2"], f"CKPT: {deep} {not_decomposed}"),
             (["decompose", a, "--diff", deep], f"--diff: {deep} {not_decomposed}")]
    _checkpoints(tmp_path / "res1", n_layers=1, d_model=2, d_hidden=2)
    _checkpoints(tmp_path / "res2", n_layers=2, d_model=2, d_hidden=2)
    r1, r2 = str(tmp_path / "res1" / "a"), str(tmp_path / "res2" / "a")
    cases.append((["decompose", r2, "--diff", r1, "--k", "2"],
                  f"--diff: {r1} (bilinear depth 1) and CKPT {r2} (bilinear depth 2) have "
                  f"different layer patterns"))
    for argv, msg in cases:
        assert main([*argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"tensoralg decompose: error: {msg}") and "\n" not in err, err
    assert not (tmp_path / "o").exists()
