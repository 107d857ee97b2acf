"""First-order paths of transformers (tensoralg.decompose.paths / path_similarity /
match_heads on sequence models; docs/mathematics.md §3.10).

Independent references: each path's forward pass written here in numpy from the raw weights,
the remainder of a two-block stack from the blocks' own forward passes, and tensor-product
Gauss-Hermite quadrature (tensoralg.verify.quadrature) on the whole input space (N = n_ctx * d
<= 5 Gaussian variables, exact for these degree-5 paths)."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

import tensoralg as ta
from tensoralg import decompose as dc
from tensoralg.cli import main
from tensoralg.layers import Bilinear, BilinearAttention, Linear, Residual, Sequential
from tensoralg.transformer import BilinearTransformer


def _transformer(seed=0, d=8, H=2, dh=4, L=2, d_mlp=None, n_ctx=4, rope=10000.0, vocab=11):
    return BilinearTransformer(vocab, d, L, H, dh, d_mlp, n_ctx=n_ctx, rope=rope, seed=seed,
                               dtype="float64")


def _biased(rng, d=2, H=2, dh=2, exact=False, n_ctx=None, rope=None):
    """embedding (bias) -> Residual(attention, every bias) -> Residual(bilinear MLP, biases)
    -> Residual(attention, o_bias) -> unembedding (bias)."""
    def w(*shape):
        a = rng.integers(-3, 4, size=shape) / 4 if exact else rng.standard_normal(shape) * 0.6
        return np.vectorize(Fraction, otypes=[object])(a * 4) / 4 if exact else a

    def att(o_bias):
        kw = {k: w(H, dh, d) for k in ("q1", "k1", "q2", "k2", "v")}
        bias = {k + "_bias": w(H, dh) for k in ("q1", "k1", "q2", "k2", "v")}
        return BilinearAttention(**kw, **bias, o=w(d, H, dh), o_bias=w(d) if o_bias else None,
                                 mask="causal" if n_ctx is None else np.tril(np.ones((n_ctx,) * 2)),
                                 rope=rope)
    return Sequential([Linear(w(d, d), w(d)), Residual(att(True)),
                       Residual(Bilinear(w(3, d), w(3, d), w(d, 3), w(3), w(3), w(d))),
                       Residual(att(False)), Linear(w(3, d), w(3))])


# ---- independent numpy forward passes of the paths (from the torch module's weights) ------

def _rope(n_ctx, dh, base):
    theta = base ** (-np.arange(0, dh, 2) / dh)
    ang = np.arange(n_ctx)[:, None] * theta[None]
    R = np.zeros((n_ctx, dh, dh))
    i = np.arange(0, dh, 2)
    R[:, i, i], R[:, i, i + 1], R[:, i + 1, i], R[:, i + 1, i + 1] = (
        np.cos(ang), -np.sin(ang), np.sin(ang), np.cos(ang))
    return R


def _numpy_paths(model: BilinearTransformer, X: np.ndarray) -> dict:
    hp = model.hparams
    T = X.shape[1]
    U = model.unembed.detach().numpy()
    R = _rope(T, hp["d_head"], hp["rope"]) if hp["rope"] else np.broadcast_to(
        np.eye(hp["d_head"]), (T, hp["d_head"], hp["d_head"]))
    mask = np.tril(np.ones((T, T))) * hp["attn_scale"]
    out = {"direct": X @ U.T}
    for l, a in enumerate(model.attn):
        p = {k: getattr(a, k).detach().numpy() for k in ("q1", "k1", "q2", "k2", "v", "o")}
        for h in range(hp["n_heads"]):
            def proj(k, rot=True, p=p, h=h):
                y = np.einsum("ntd,ed->nte", X, p[k][h])
                return np.einsum("tef,ntf->nte", R, y) if rot else y
            pat = np.einsum("nte,nse->nts", proj("q1"), proj("k1")) * \
                np.einsum("nte,nse->nts", proj("q2"), proj("k2")) * mask
            z = np.einsum("nts,nsv->ntv", pat, proj("v", False))
            out[f"L{l}.H{h}"] = np.einsum("ntv,ov->nto", z, p["o"][:, h]) @ U.T
        if model.mlp is not None:
            m = model.mlp[l]
            Lw, Rw, Dw = (getattr(m, k).detach().numpy() for k in ("left", "right", "down"))
            out[f"L{l}.MLP"] = ((X @ Lw.T) * (X @ Rw.T)) @ Dw.T @ U.T
    return out


def test_path_networks_are_the_paths_written_out_in_numpy():
    model = _transformer(d_mlp=6)
    pd = dc.paths(model)
    X = np.random.default_rng(1).standard_normal((5, 4, 8))
    ref = _numpy_paths(model, X)
    assert pd.names == list(ref)
    for name, net in zip(pd.names, pd.networks):
        np.testing.assert_allclose(net(X), ref[name], rtol=0, atol=1e-12 * np.abs(ref[name]).max())
    total = sum(ref.values())
    np.testing.assert_allclose(pd.first_order(X), total, rtol=0, atol=1e-12 * np.abs(total).max())


def test_one_block_stack_paths_sum_to_the_model_and_rest_is_exactly_zero():
    rng = np.random.default_rng(3)
    full = _biased(rng, exact=True)
    one = Sequential([full.layers[0], full.layers[1], full.layers[4]])   # one attention block
    pd = dc.paths(one, n_ctx=3, backend="exact")
    assert pd.rest_norm == 0 and "exact: zero" in pd.methods["rest_norm"]
    assert pd.names == ["direct", "L0.H0", "L0.H1", "L0.bias"]
    X = np.vectorize(Fraction, otypes=[object])(rng.integers(-4, 5, (2, 3, 2))) / 3
    assert np.all(sum(p(X) for p in pd.networks) == one(X))            # rationals: exactly
    Xf = rng.standard_normal((4, 3, 2))
    fl = one.astype_float()
    pdf = dc.paths(fl, n_ctx=3)
    np.testing.assert_allclose(sum(p(Xf) for p in pdf.networks), fl(Xf), rtol=0,
                               atol=1e-12 * np.abs(fl(Xf)).max())


def test_paths_plus_the_remainder_are_the_model_in_rationals_with_biases():
    """Three blocks (attention, MLP, attention) with every bias: rest(X) = f(X) - sum of the
    paths must be U_W (B_2(h_1) - B_2(x) + B_3(h_2) - B_3(x)), the compositions, computed
    here from the blocks' own forward passes."""
    rng = np.random.default_rng(4)
    net = _biased(rng, exact=True)
    pd = dc.paths(net, n_ctx=2, backend="exact")
    assert pd.names == ["direct", "L0.H0", "L0.H1", "L0.bias", "L0.MLP", "L1.H0", "L1.H1"]
    X = np.vectorize(Fraction, otypes=[object])(rng.integers(-4, 5, (2, 2, 2))) / 5
    emb, b1, b2, b3, un = net.layers
    x = emb(X)
    h1 = b1(x)
    h2 = b2(h1)
    rest = (b2(h1) - h1 - (b2(x) - x) + b3(h2) - h2 - (b3(x) - x)) @ un.weight.T
    assert np.all(sum(p(X) for p in pd.networks) + rest == net(X))
    assert np.all(pd.rest(X) == rest)


def test_bias_free_remainder_has_no_part_of_degree_at_most_5():
    """Two attention layers without biases: the listed paths are f_<=5 exactly, so the
    remainder's homogeneous parts of degree 0..8 vanish (DFT over 26 points, written here)."""
    model = _transformer(d=4, H=2, dh=2, n_ctx=3)
    pd = dc.paths(model)
    X = np.random.default_rng(2).standard_normal((3, 3, 4)) * 0.5
    m = 26
    w = np.exp(2j * np.pi * np.arange(m) / m)
    vals = np.stack([pd.rest(wj * X) for wj in w])
    parts = np.fft.fft(vals, axis=0) / m
    scale = np.abs(parts).max()
    assert scale > 1e-6
    assert np.abs(parts[:9]).max() < 1e-12 * scale, np.abs(parts[:9]).max() / scale
    assert np.abs(parts[9]).max() > 1e-6 * scale    # the compositions start at degree 9


def test_gram_against_gauss_hermite_quadrature():
    """Every Gram entry (biases, RoPE, an MLP, an output bias) against the tensor-product
    Gauss-Hermite rule on the whole input space (n_ctx * d = 4 variables: exact)."""
    from tensoralg.verify.quadrature import quadrature_inner

    rng = np.random.default_rng(5)
    net = _biased(rng, d=2, H=2, dh=2, rope=100.0)
    pd = dc.paths(net, n_ctx=2)
    P = len(pd.names)
    Q = np.array([[float(quadrature_inner(pd.networks[i], pd.networks[j], np.eye(2), n_ctx=2,
                                          degree=5))
                   for j in range(P)] for i in range(P)])
    d = np.sqrt(np.diag(Q))
    err = np.abs(pd.gram - Q) / np.outer(d, d)
    assert err.max() < 1e-10, err.max()
    assert pd.methods["gram"].startswith("exact")
    np.testing.assert_allclose(pd.share, np.diag(Q) / Q.sum(), rtol=1e-10)


def test_exact_backend_equals_float():
    rng = np.random.default_rng(6)
    net = _biased(rng, d=2, H=1, dh=2, exact=True)
    ex = dc.paths(net, n_ctx=2, backend="exact")
    fl = dc.paths(net.astype_float(), n_ctx=2)
    assert all(isinstance(v, Fraction) for v in ex.gram.reshape(-1))
    G = np.asarray(ex.gram, dtype=float)
    assert np.abs(G - fl.gram).max() < 1e-12 * np.abs(G).max()


# ---- head matching -------------------------------------------------------------------------

def _permuted(model, perms):
    other = _transformer(seed=0, d=model.hparams["d_model"], H=model.hparams["n_heads"],
                         dh=model.hparams["d_head"], d_mlp=model.hparams["d_mlp"])
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for l, perm in perms.items():
            a = other.attn[l]
            for k in ("q1", "k1", "q2", "k2", "v"):
                getattr(a, k).copy_(getattr(model.attn[l], k)[perm])
            a.o.copy_(model.attn[l].o[:, perm])
    return other


def test_head_permutation_is_recovered_and_every_matched_path_scores_one():
    model = _transformer(seed=3, H=3, dh=2, d_mlp=4)
    perms = {0: [2, 0, 1], 1: [1, 2, 0]}
    other = _permuted(model, perms)
    X = np.random.default_rng(0).standard_normal((2, 4, 8))
    ref = model.to_network()(X)
    # same function: equal to rounding (the heads are summed in another order; outputs ~660)
    assert np.abs(other.to_network()(X) - ref).max() < 1e-13 * np.abs(ref).max()
    m = dc.match_heads(model, other)
    for l, perm in perms.items():   # a's head h is b's head k with perm[k] = h
        assert [perm.index(h) for h in range(3)] == m[l]["perm"]
    sims = dc.path_similarity(model, other, match=True)
    assert all(abs(v - 1) < 1e-12 for v in sims.values()), sims
    assert sims.matching == {l: m[l]["perm"] for l in perms}
    plain = dc.path_similarity(model, other)
    assert min(plain.values()) < 0.99    # without matching the heads are compared by index


def test_leg_swap_leaves_every_path_similarity_at_one():
    model = _transformer(seed=4)
    other = _permuted(model, {})
    with torch.no_grad():
        for a, b in zip(other.attn, model.attn):
            for x, y in (("q1", "q2"), ("k1", "k2"), ("q2", "q1"), ("k2", "k1")):
                getattr(a, x).copy_(getattr(b, y))
    sims = dc.path_similarity(model, other)
    assert all(abs(v - 1) < 1e-12 for v in sims.values()), sims
    assert sims.method.startswith("exact")


@pytest.mark.filterwarnings("ignore:n_samples=")
def test_remainder_by_monte_carlo_says_so():
    net = _biased(np.random.default_rng(7), d=2, H=1, dh=2)
    pd = dc.paths(net, n_ctx=2, rest_samples=12)
    assert isinstance(pd.rest_norm, ta.MonteCarloEstimate)
    assert pd.methods["rest_norm"].startswith("Monte Carlo (APPROXIMATE)")
    assert ("NOT reliable" in pd.methods["rest_norm"]) == (pd.rest_norm.reliable is False)
    d = pd.to_dict()
    json.dumps(d)
    assert d["rest_norm"]["n_samples"] == 12
    assert dc.paths(net, n_ctx=2).methods["rest_norm"].startswith("not assessed")


# ---- bad input: one line, before any work --------------------------------------------------

@pytest.fixture
def no_work(monkeypatch):
    from tensoralg.decompose import sequence_paths as sp

    def boom(*a, **k):
        raise AssertionError("work started before the refusal")
    monkeypatch.setattr(sp, "_gram", boom)
    monkeypatch.setattr(sp._Engine, "inner", boom)
    monkeypatch.setattr(sp, "sequence_tree", boom)


def _one_line(excinfo, start):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith(start), msg
    return msg


@pytest.mark.parametrize("order", [0, 3, "1", True, 1.0])
def test_bad_order(no_work, order):
    with pytest.raises(ValueError) as e:
        dc.paths(_transformer(), order=order)
    _one_line(e, "order: expected 1")


def test_order_2_over_budget_is_refused_before_the_gram(monkeypatch):
    """Second-order paths of the default test transformer (N = n_ctx*d = 32 input variables):
    the two-node terms' dense order-9 tensors are refused, naming the alternatives, before
    any chaos is built."""
    from tensoralg.errors import CostTooHigh
    from tensoralg.strategies.chaos import composed

    def boom(*a, **k):
        raise AssertionError("work started before the refusal")
    monkeypatch.setattr(composed, "FeatureChaos", boom)
    with pytest.raises(CostTooHigh) as e:
        dc.paths(_transformer(), order=2)
    msg = _one_line(e, "paths(order=2): the exact Gram of the listed paths: the exact inner")
    assert "Monte Carlo" in msg and "order=1" in msg and "N = n_ctx*d = 32" in msg


def test_missing_n_ctx(no_work):
    net = _biased(np.random.default_rng(0))   # causal masks: no length fixed
    with pytest.raises(ValueError) as e:
        dc.paths(net)
    _one_line(e, "n_ctx: required")


def test_unknown_path_name_and_different_heads(no_work):
    a = _transformer()
    with pytest.raises(ValueError) as e:
        dc.path_similarity(a, a, names=["L0.H7"])
    assert "'L0.H7'" in _one_line(e, "names: no path")
    with pytest.raises(ValueError) as e:
        dc.path_similarity(a, _transformer(H=4, dh=2))
    assert "heads per attention layer" in _one_line(e, "a and b: different structures")
    with pytest.raises(ValueError) as e:
        dc.path_similarity(a, _transformer(L=3), match=True)
    _one_line(e, "a and b: different structures")


@pytest.mark.parametrize("layers,what", [
    (lambda at: [at, Linear(np.eye(2))], "a BilinearAttention without a residual"),
    (lambda at: [Linear(np.eye(2)), Residual(Sequential([at, at]))], "residual block 0"),
    (lambda at: [Residual(at), at], "layer 1 is a BilinearAttention without a residual"),
])
def test_not_a_residual_stack(no_work, layers, what):
    at = BilinearAttention(*(np.ones((1, 2, 2)),) * 5, o=np.ones((2, 1, 2)))
    net = Sequential(layers(at))
    with pytest.raises(ValueError) as e:
        dc.paths(net, n_ctx=2)
    assert what in _one_line(e, "model: paths of a sequence model need a residual stack")


def test_vector_networks_keep_their_paths():
    from tensoralg.nn import BilinearNet

    net = BilinearNet(6, 2, d_model=4, d_hidden=4, residual=True, bias=True, seed=0)
    pd = dc.paths(net)
    assert pd.names == ["direct", "1"]
    for kw, flag in (({"n_ctx": 3}, "n_ctx"), ({"order": 1}, "order")):
        with pytest.raises(ValueError, match=rf"^{flag}: only for sequence models"):
            dc.paths(net, **kw)


# ---- CLI ------------------------------------------------------------------------------------

def test_cli_transformer_path_table(tmp_path, capsys):
    from tensoralg.checkpoint import save_checkpoint

    a, b = _transformer(seed=0, d=4, dh=2), _transformer(seed=1, d=4, dh=2)
    save_checkpoint(tmp_path / "a", a)
    save_checkpoint(tmp_path / "b", _permuted(a, {1: [1, 0]}))
    save_checkpoint(tmp_path / "c", b)
    js = tmp_path / "r.json"
    assert main(["decompose", str(tmp_path / "a"), "--diff", str(tmp_path / "b"), "--match",
                 "--n-ctx", "3", "--out", str(tmp_path / "o"), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "first-order paths at n_ctx=3" in out and "L1.H1" in out
    r = json.loads(js.read_text())
    assert r["paths"]["names"] == ["direct", "L0.H0", "L0.H1", "L1.H0", "L1.H1"]
    assert all(abs(v - 1) < 1e-12 for v in r["similarity"]["values"].values())
    assert r["similarity"]["matching"] == {"0": [0, 1], "1": [1, 0]}
    for argv, flag in ((["--n-ctx", "9"], "--n-ctx"), (["--output", "1"], "--output"),
                       (["--match"], "--match")):
        assert main(["decompose", str(tmp_path / "a"), *argv,
                     "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"error: {flag}:" in err, err
