"""First-order paths over training (tensoralg.decompose.paths_over_training, transition_paths,
``tensoralg decompose paths-over-training``; docs/decompose.md, "Paths over training").

References that do not go through the code under test: `dc.paths` / `dc.path_similarity` pair
by pair (each checked against quadrature and hand-written forward passes in
tests/test_decompose_transformer_paths.py), and the exact ``S<=5`` of
``ta.degree_similarity`` (another engine: the DFT's homogeneous parts) for ``1 - S`` of the sum
of the paths of a bias-free stack."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tensoralg as ta
from tensoralg import decompose as dc
from tensoralg.cli import main
from tensoralg.decompose import path_changes as pc
from tensoralg.decompose import sequence_paths as sp
from tensoralg.transformer import BilinearTransformer


def _tf(seed=0, d=4, H=2, dh=2, L=2, n_ctx=2):
    return BilinearTransformer(11, d, L, H, dh, n_ctx=n_ctx, rope=10000.0, seed=seed,
                               dtype="float64")


def test_over_training_equals_the_pairwise_functions_and_each_gram_is_computed_once(
        monkeypatch):
    models = [_tf(s) for s in range(4)]
    calls = []
    inner = sp._Engine._inner
    monkeypatch.setattr(sp._Engine, "_inner",
                        lambda self, x, y: calls.append(1) or inner(self, x, y))
    r = dc.paths_over_training(models, labels=["a", "b", "c", "d"])
    N, P = 4, 5
    # each checkpoint's own Gram once (P(P+1)/2 pairs), then P cross terms to the final and to
    # the next checkpoint (the last but one: the same pair)
    assert len(calls) == N * P * (P + 1) // 2 + P * (2 * N - 3)
    monkeypatch.setattr(sp._Engine, "_inner", inner)
    assert r.names == ["direct", "L0.H0", "L0.H1", "L1.H0", "L1.H1"] and r.labels[-1] == "d"
    for k in range(N):
        pd = dc.paths(models[k])
        np.testing.assert_allclose(r.gram[k], pd.gram, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(r.share[k], pd.share, rtol=1e-12)
        fin = dc.path_similarity(models[k], models[-1])
        np.testing.assert_allclose(r.to_final[k], [fin[n] for n in r.names], atol=1e-12)
        if k + 1 < N:
            nxt = dc.path_similarity(models[k], models[k + 1])
            np.testing.assert_allclose(r.to_next[k], [nxt[n] for n in r.names], atol=1e-12)
            sh = r.share
            want = [pc.path_change(nxt[n], sh[k, p], sh[k + 1, p])
                    for p, n in enumerate(r.names)]
            np.testing.assert_allclose(r.change_to_next[k], want, atol=1e-12)
    np.testing.assert_allclose(r.to_final[-1], 1.0)
    js = r.to_dict()
    assert len(js["to_next"]) == N - 1 and "share of" in r.table()


def test_transition_identity_against_the_exact_s5_of_another_engine():
    """1 - S(F_a, F_b) of the sum of the first-order paths is 1 - S<=5 (a bias-free stack), and
    the own changes plus the cross terms add up to it."""
    a, b = _tf(0), _tf(1)
    tr = dc.transition_paths(a, b)
    s5 = ta.degree_similarity(a.to_network(), b.to_network(), n_ctx=2, max_degree=(5,))
    assert abs(tr.one_minus_s - (1 - float(s5[5]))) < 1e-10
    assert abs(float(np.sum(tr.change)) + tr.cross - tr.one_minus_s) < 1e-12
    sims = dc.path_similarity(a, b)
    np.testing.assert_allclose(tr.similarity, [sims[n] for n in tr.names], atol=1e-12)
    # c_p is half the squared distance of the normalized paths: by hand from the Gram entries
    pa, pb = dc.paths(a), dc.paths(b)
    p = tr.names.index("L1.H0")
    c = 0.5 * (pa.share[p] + pb.share[p]) - sims["L1.H0"] * np.sqrt(pa.share[p] * pb.share[p])
    assert abs(tr.change[p] - c) < 1e-12


def _with_head_replaced(model, layer, head, seed):
    """A copy with the query/key/value weights of one head drawn anew (every other head, the
    embedding and the unembedding unchanged)."""
    out = _tf(0)
    out.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for leg in ("q1", "k1", "q2", "k2", "v"):
            w = getattr(out.attn[layer], leg)
            w[head] = torch.randn(w[head].shape, generator=g, dtype=w.dtype)
    return out


def test_one_changed_head_carries_the_transition():
    a = _tf(0)
    b = _with_head_replaced(a, 1, 0, seed=5)
    tr = dc.transition_paths(a, b)
    sims = dict(zip(tr.names, tr.similarity))
    assert sims["L1.H0"] < 0.9 and all(abs(sims[n] - 1) < 1e-12 for n in tr.names
                                       if n != "L1.H0")
    assert tr.carried_by == ["L1.H0"] and tr.verdict == "one path"
    assert "one path" in tr.summary() and "L1.H0" in str(tr)
    # two heads changed (the direct path's share moves with them: its own change need not be 0)
    c = _with_head_replaced(b, 0, 1, seed=6)
    tr2 = dc.transition_paths(a, c)
    assert "L0.H1" in tr2.carried_by or "L1.H0" in tr2.carried_by
    assert (tr2.verdict == "several paths") == (len(tr2.carried_by) > 1)
    frac = tr2.change / tr2.change.sum()
    assert (frac.max() > 0.5) == (tr2.verdict == "one path")


def test_rule_by_hand():
    names = ["direct", "L0.H0", "L0.H1"]
    assert pc._carried(names, np.array([0.1, 0.6, 0.3])) == ["L0.H0"]
    assert pc._carried(names, np.array([0.3, 0.4, 0.3])) == ["L0.H0", "direct"]
    assert pc._carried(names, np.array([0.5, 0.5, 0.0])) == ["direct", "L0.H0"]   # not > half
    assert pc._carried(names, np.zeros(3)) == []
    assert pc.path_change(1.0, 0.2, 0.2) == 0.0
    assert pc.path_change(0.0, 0.2, 0.2) == pytest.approx(0.2)   # share (1 - sim)
    assert pc.path_change(None, 0.0, 0.3) == pytest.approx(0.15)


@pytest.fixture
def no_work(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("work started before the input was checked")
    monkeypatch.setattr(sp, "_trees", boom)
    monkeypatch.setattr(pc, "_trees", boom)


def test_bad_input_of_the_functions(no_work):
    from tensoralg.nn import BilinearNet

    a = _tf(0)
    with pytest.raises(ValueError, match=r"^models: paths over training need two or more"):
        dc.paths_over_training([a])
    with pytest.raises(ValueError, match=r"^models\[1\]: paths .* models\[0\] has"):
        dc.paths_over_training([a, _tf(0, H=1, dh=4)])
    with pytest.raises(ValueError, match=r"^models\[1\]: a position-free \(vector\) network"):
        dc.paths_over_training([a, BilinearNet(4, 11, d_model=4, d_hidden=4, seed=0)])
    with pytest.raises(ValueError, match=r"^labels: 1 labels for 2 models"):
        dc.paths_over_training([a, a], labels=["x"])
    with pytest.raises(ValueError, match=r"^backend:"):
        dc.transition_paths(a, a, backend="gpu")


# ---- CLI ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tensoralg.checkpoint import save_checkpoint

    d = tmp_path_factory.mktemp("pot")
    for s in range(3):
        save_checkpoint(d / f"c{s}", _tf(s), step=10 * s)
    save_checkpoint(d / "heads4", _tf(0, H=4, dh=2))
    from tensoralg.nn import BilinearNet

    save_checkpoint(d / "vec", BilinearNet(4, 3, d_model=4, d_hidden=4, seed=0))
    from tensoralg.layers import BilinearAttention, Linear, Residual, Sequential

    rng = np.random.default_rng(0)
    for k in range(2):   # causal masks: no sequence length fixed
        at = BilinearAttention(*(rng.standard_normal((1, 2, 2)) for _ in range(5)),
                               o=rng.standard_normal((2, 1, 2)), mask="causal")
        save_checkpoint(d / f"free{k}", Sequential([Residual(at), Linear(np.eye(2))]))
    return d


def test_cli_paths_over_training(ckpts, tmp_path, capsys):
    js = tmp_path / "r.json"
    out = tmp_path / "o"
    assert main(["decompose", "paths-over-training", *(str(ckpts / f"c{s}") for s in range(3)),
                 "--out", str(out), "--json", str(js)]) == 0   # --n-ctx: the trained 2
    text = capsys.readouterr().out
    assert "first-order paths of 3 checkpoints at n_ctx=2" in text
    assert "similarity to the final checkpoint" in text and "L1.H1" in text
    r = json.loads(js.read_text())
    assert r["steps"] == [0, 10, 20] and r["config"]["n_ctx"] == 2
    got = r["paths_over_training"]
    assert got["labels"] == ["c0", "c1", "c2"] and got["n_ctx"] == 2
    want = dc.path_similarity(_tf(0), _tf(2), n_ctx=2)
    np.testing.assert_allclose(got["to_final"][0], [want[n] for n in got["names"]], atol=1e-12)
    for f in ("paths_over_training.json", "paths_over_training.csv",
              "paths_over_training.png"):
        assert (out / f).is_file()
    rows = (out / "paths_over_training.csv").read_text().splitlines()
    assert rows[0].startswith("checkpoint,step,path,share") and len(rows) == 1 + 3 * 5


@pytest.mark.parametrize("argv,start", [
    (["paths-over-training", "{c0}"], "CKPT: paths-over-training needs two or more"),
    (["paths-over-training"], "CKPT: paths-over-training needs two or more"),
    (["paths-over-training", "{c0}", "{c1}", "{heads4}"], "CKPT 3: "),
    (["paths-over-training", "{c0}", "{vec}"], "CKPT 2: "),
    (["paths-over-training", "{c0}", "{c1}", "--n-ctx", "9"], "--n-ctx: 9 is longer"),
    (["paths-over-training", "{c0}", "{c1}", "--diff", "{c1}"], "--diff: not an option"),
    (["paths-over-training", "{c0}", "{c1}", "--k", "2"], "--k: not an option"),
    (["paths-over-training", "{c0}", "{nope}"], "CKPT 2: "),
    (["{c0}", "{c1}"], "CKPT: one checkpoint folder, got 2"),
    (["paths-over-training", "{free0}", "{free1}"], "--n-ctx: required"),
])
def test_cli_bad_input_one_line_before_loading(ckpts, tmp_path, capsys, monkeypatch, argv,
                                               start):
    import tensoralg.checkpoint as ck

    def boom(*a, **k):
        raise AssertionError("a checkpoint was loaded before the input was checked")
    monkeypatch.setattr(ck, "load_checkpoint", boom)
    names = {"c0": ckpts / "c0", "c1": ckpts / "c1", "heads4": ckpts / "heads4",
             "vec": ckpts / "vec", "nope": ckpts / "nope", "free0": ckpts / "free0",
             "free1": ckpts / "free1"}
    argv = [a.format(**names) for a in argv]
    assert main(["decompose", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: {start}" in err, err
    if "heads4" in " ".join(argv):
        assert "n_heads 4" in err and "has 2" in err
    if "vec" in " ".join(argv).replace("free", ""):
        assert "vector network" in err


def test_cli_compiled_networks_with_causal_masks_take_n_ctx(ckpts, tmp_path, capsys):
    assert main(["decompose", "paths-over-training", str(ckpts / "free0"), str(ckpts / "free1"),
                 "--n-ctx", "2", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "at n_ctx=2" in out and "L0.H0" in out
