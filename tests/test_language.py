"""Bilinear transformer (export, checkpoints), the stdlib corpus, n-gram scores and the language
audit (tiny end to end, bad input)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tensoralg as ta
from tensoralg.checkpoint import load_checkpoint, save_checkpoint
from tensoralg.corpus import VOCAB, decode, encode, load_corpus, ngram_distributions, ngram_scores
from tensoralg.transformer import BilinearTransformer


def _model(seed=0, **kw):
    args = dict(vocab=11, d_model=6, n_layers=2, n_heads=2, d_head=4, d_mlp=5, n_ctx=5,
                rope=100.0, seed=seed, dtype="float64")
    args.update(kw)
    return BilinearTransformer(args.pop("vocab"), args.pop("d_model"), args.pop("n_layers"),
                               args.pop("n_heads"), args.pop("d_head"), **args)


# ---------------------------------------------------------------------------------------
# the model and its export
# ---------------------------------------------------------------------------------------

def test_namespaces():
    assert ta.BilinearTransformer is BilinearTransformer
    assert ta.nn.BilinearTransformer is BilinearTransformer


@pytest.mark.parametrize("kw", [{}, {"rope": None, "d_mlp": None, "n_layers": 1},
                                {"attn_scale": 0.37, "n_heads": 1}])
def test_export_equals_torch_forward(kw):
    m = _model(**kw)
    with torch.no_grad():            # make the blocks O(1) so that the check has teeth
        for p in m.parameters():
            p.mul_(2.0)
    tok = torch.as_tensor(np.random.default_rng(1).integers(0, 11, (7, 5)))
    ref = m(tok).detach().numpy()
    h0 = m.residual_stream(tok).detach().numpy()
    got = m.to_network()(h0)
    assert np.max(np.abs(got - ref)) <= 1e-12 * np.max(np.abs(ref))
    # the direct path alone (embedding, unembedding) differs from the full model by O(1):
    direct = h0 @ m.unembed.detach().numpy().T
    assert np.max(np.abs(direct - ref)) > 1e-2 * np.max(np.abs(ref))
    # one-hot input through the embedding
    onehot = np.eye(11)[tok.numpy()]
    got_e = m.to_network(embedding=True)(onehot)
    assert np.max(np.abs(got_e - ref)) <= 1e-12 * np.max(np.abs(ref))
    # an arbitrary residual stream (not an embedding): forward_residual is what is exported
    x = np.random.default_rng(2).normal(size=(3, 5, 6))
    ref_x = m.forward_residual(torch.as_tensor(x)).detach().numpy()
    assert np.max(np.abs(m.to_network()(x) - ref_x)) <= 1e-12 * np.max(np.abs(ref_x))


def test_prefix_export_and_longer_context_refused():
    m = _model()
    tok = torch.as_tensor(np.random.default_rng(3).integers(0, 11, (4, 5)))
    h0 = m.residual_stream(tok).detach().numpy()
    full = m.to_network()(h0)
    pre = m.to_network(n_ctx=3)(h0[:, :3])
    assert np.max(np.abs(pre - full[:, :3])) <= 1e-12 * np.max(np.abs(full))
    with pytest.raises(ValueError, match=r"n_ctx: expected an integer in \[1, 5\]"):
        m.to_network(n_ctx=6)
    with pytest.raises(ValueError, match="outside \\[1, n_ctx=5\\]"):
        m(torch.zeros((1, 6), dtype=torch.int64))
    with pytest.raises(ValueError, match="vocab=11"):
        m(torch.full((1, 3), 11))


def test_exact_similarity_one_layer_invariant_to_seed_copy():
    a = _model(n_layers=1, d_mlp=None, n_heads=1, seed=0)
    b = _model(n_layers=1, d_mlp=None, n_heads=1, seed=0)
    c = _model(n_layers=1, d_mlp=None, n_heads=1, seed=1)
    assert float(ta.similarity(a.to_network(), b.to_network())) == pytest.approx(1.0, abs=1e-12)
    s = float(ta.similarity(a.to_network(), c.to_network()))
    assert -1.0 <= s < 0.999


def test_bad_arguments():
    with pytest.raises(ValueError, match="even d_head"):
        BilinearTransformer(5, 4, 1, 1, 3, n_ctx=4, rope=10.0)
    with pytest.raises(ValueError, match="attn_scale"):
        BilinearTransformer(5, 4, 1, 1, 2, n_ctx=4, attn_scale=0.0)
    with pytest.raises(ValueError, match="n_ctx"):
        BilinearTransformer(5, 4, 1, 1, 2, n_ctx=0)
    # like every other seed of the library and the CLI (found by a fresh-eyes tester)
    with pytest.raises(ValueError, match=r"seed: expected an integer >= 0, got -1"):
        BilinearTransformer(5, 4, 1, 1, 2, n_ctx=4, seed=-1)


# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------

def test_checkpoint_round_trip(tmp_path):
    m = _model(dtype="float32")
    save_checkpoint(tmp_path / "c", m, step=7, provenance={"data": "x"})
    m2, cfg = load_checkpoint(tmp_path / "c")
    assert isinstance(m2, BilinearTransformer) and cfg["step"] == 7 and cfg["vocab"] == 11
    for (k, v), (k2, v2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    x = np.random.default_rng(0).normal(size=(2, 5, 6))
    assert np.array_equal(m.to_network()(x), m2.to_network()(x))


def test_checkpoint_edited_config_and_nan_refused(tmp_path):
    m = _model(dtype="float32")
    save_checkpoint(tmp_path / "c", m)
    cfg = json.loads((tmp_path / "c" / "cfg.json").read_text())
    cfg["attn_scale"] = cfg["attn_scale"] * 2          # same shapes, different function
    (tmp_path / "c" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="forward probe"):
        load_checkpoint(tmp_path / "c")
    with torch.no_grad():
        m.attn[0].q1[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        save_checkpoint(tmp_path / "d", m)
    assert not (tmp_path / "d").exists()


def test_checkpoint_nan_and_corrupt_on_disk_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    m = _model(dtype="float32")
    save_checkpoint(tmp_path / "c", m)
    w = load_file(tmp_path / "c" / "weights.safetensors")
    w["unembed"][0, 0] = float("nan")
    save_file(w, tmp_path / "c" / "weights.safetensors")
    with pytest.raises(ValueError, match="non-finite"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "weights.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError):
        load_checkpoint(tmp_path / "c")


# ---------------------------------------------------------------------------------------
# corpus and n-grams
# ---------------------------------------------------------------------------------------

def test_tokenizer_round_trip():
    text = "def f(x):\n    return x ~ 1\t\u00e9"
    ids = encode(text)
    assert len(VOCAB) == 97 and ids.dtype == np.int64
    assert decode(ids) == "def f(x):\n    return x ~ 1\ufffd\ufffd"
    assert ids[-1] == 0 and ids[-2] == 0          # tab and non-ASCII are <unk>


def test_corpus_deterministic_and_split():
    a = load_corpus(30_000)
    b = load_corpus(30_000)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.held_out, b.held_out)
    assert a.provenance == b.provenance
    p = a.provenance
    assert p["n_chars"] == len(a.train) + len(a.held_out) == (30_000 // 64) * 64
    assert len(p["sha256_text"]) == 64 and p["python_version"]
    # the split: segment i of 1024 characters held out iff i % 10 == 9
    n = p["n_chars"]      # 29 952: segments 9 and 19 are full, segment 29 holds the last 256
    held = [min(1024, n - 1024 * i) for i in range(n // 1024 + 1) if i % 10 == 9]
    assert held == [1024, 1024, 256] and len(a.held_out) == sum(held)
    c = load_corpus(40_000)
    assert c.provenance["sha256_text"] != p["sha256_text"]
    with pytest.raises(ValueError, match="n_chars"):
        load_corpus(1000)


def test_corpus_from_folder(tmp_path):
    (tmp_path / "b.py").write_text("b" * 30_000)
    (tmp_path / "a.py").write_text("a" * 30_000)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "x.py").write_text("x" * 30_000)   # excluded folder
    c = load_corpus(25_600, root=tmp_path)
    text = decode(np.concatenate([c.train, c.held_out]))
    # the text is a*30000 + "\n" + b*30000 (the folder "test" is excluded): 64 windows of 400
    # characters at floor(i * 60001 / 64); window 32 starts at 30000, on the newline
    assert set(text) == {"a", "b", "\n"} and c.provenance["n_files"] == 2
    assert (text.count("a"), text.count("b"), text.count("\n")) == (12800, 12799, 1)


def test_ngram_distributions_by_hand():
    train = np.array([1, 2, 1, 2, 1, 3])              # bigrams: 1->2 x2, 1->3 x1, 2->1 x2
    P = ngram_distributions(train, np.array([[1], [2], [3]]), 2, 4)
    assert np.allclose(P[0], [0, 0, 2 / 3, 1 / 3])
    assert np.allclose(P[1], [0, 1, 0, 0])
    assert np.allclose(P[2], np.bincount(train, minlength=4) / 6)   # unseen: back off to unigram
    P3 = ngram_distributions(train, np.array([[2, 1], [3, 2]]), 3, 4)
    assert np.allclose(P3[0], [0, 0, 1 / 2, 1 / 2])   # (2, 1) -> 2 and -> 3
    assert np.allclose(P3[1], P[1])                    # unseen (3, 2): back off to (2,)


def test_ngram_scores_perfect_model():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 5, 400)
    W = rng.integers(0, 5, (6, 6))
    scores_cache: dict = {}
    # a "model" whose logits are the log of the 3-gram distribution agrees with it perfectly
    ts = np.arange(2, 5)
    ctx = np.stack([W[:, t - 1:t + 1] for t in ts], 1).reshape(-1, 2)
    P3 = ngram_distributions(train, ctx, 3, 5).reshape(6, 3, 5)
    L = np.zeros((6, 6, 5))
    L[:, 2:5] = np.log(P3 + 1e-300)
    s = ngram_scores(L, W, train, 5, ngram_cache=scores_cache)
    assert s["agreement"][3] == 1.0
    assert s["kl"][3] == pytest.approx(0.0, abs=1e-9)
    assert s["positions"] == 18


# ---------------------------------------------------------------------------------------
# the audit
# ---------------------------------------------------------------------------------------

# tiny sizes; the architecture (two attention layers, the degree report under three metrics)
# is the default unless n_layers
TINY_DEFAULT = dict(n_chars=20_480, d_model=4, n_heads=1, d_head=2, n_ctx=4, steps=20,
                    checkpoints=3, batch_size=16, eval_windows=32, mc_pairs=1, mc_samples=300,
                    mc_matrix_samples=300, deep_pairs=1, degree_samples=300, guided_samples=300)
TINY = {**TINY_DEFAULT, "n_layers": 1}     # the exact one-layer audit
TINY_CLOSURE = {**TINY_DEFAULT, "method": "closure"}   # the closure matrix, asked for
TINY_MC = {**TINY_DEFAULT, "method": "montecarlo"}     # the radial Monte Carlo matrix


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from tensoralg.audit.language import LanguageConfig, run_language

    out = tmp_path_factory.mktemp("lang") / "run"
    return run_language(LanguageConfig(**TINY), out), out


@pytest.fixture(scope="module")
def tiny_default_run(tmp_path_factory):
    from tensoralg.audit.language import LanguageConfig, run_language

    out = tmp_path_factory.mktemp("lang2") / "run"
    return run_language(LanguageConfig(**TINY_DEFAULT), out), out


@pytest.fixture(scope="module")
def tiny_mc_run(tmp_path_factory):
    from tensoralg.audit.language import LanguageConfig, run_language

    out = tmp_path_factory.mktemp("lang4") / "run"
    return run_language(LanguageConfig(**TINY_MC), out), out


@pytest.fixture(scope="module")
def tiny_closure_run(tmp_path_factory):
    from tensoralg.audit.language import LanguageConfig, run_language

    out = tmp_path_factory.mktemp("lang3") / "run"
    return run_language(LanguageConfig(**TINY_CLOSURE), out), out


def test_tiny_audit_end_to_end_two_layers_explicit_closure(tiny_closure_run):
    """The audit with --method closure (two attention layers; since issue 21 the closure is
    no default, so it is asked for) end to end: files, the recorded method, the matrix entry
    against an independent closure call on the saved checkpoints, the closure labelled
    approximate in the table, and a Monte Carlo check whose verdict matches its own z values
    (z only where the Monte Carlo estimate is reliable)."""
    from tensoralg.audit.language import Z_DISAGREE, LanguageConfig, language_table
    from tensoralg.strategies import closure

    assert LanguageConfig().n_layers == 2 and LanguageConfig.quick().n_layers == 2
    result, out = tiny_closure_run
    for f in ("language.json", "language.csv", "language_pairs.csv", "language_matrices.png",
              "language_ngrams.png"):
        assert (out / f).is_file()
    js = json.loads((out / "language.json").read_text())
    assert js["config"]["n_layers"] == 2 and js["config"]["resolved_method"] == "closure"
    assert js["tensor_similarity"]["approximate"] is True
    assert "APPROXIMATE" in js["tensor_similarity"]["note"]
    assert all(k in js["times"] for k in ("train_s", "tensor_similarity_s",
                                          "montecarlo_check_s", "total_s"))
    S = np.array(js["matrices"]["tensor similarity"])
    assert S.shape == (3, 3) and np.allclose(np.diag(S), 1.0) and np.allclose(S, S.T)
    a, _ = load_checkpoint(out / "checkpoints" / "step_000000")
    b, _ = load_checkpoint(out / "checkpoints" / "step_000020")
    assert a.config()["n_layers"] == 2
    assert S[0, 2] == pytest.approx(closure.closure_similarity(a.to_network(), b.to_network(),
                                                                 n_ctx=4), rel=1e-10)
    mc = js["montecarlo_check"]
    assert len(mc) == 1 and mc[0]["stderr"] > 0 and "closure" in mc[0]
    summ = js["montecarlo_check_summary"]
    if mc[0]["reliable"]:
        assert summ["max_abs_z"] == pytest.approx(abs(mc[0]["z"]))
        assert summ["agrees"] == (abs(mc[0]["z"]) <= Z_DISAGREE)
    else:   # no reliable estimate: no value, no z, the reason and the lower bounds instead
        assert mc[0]["montecarlo"] is None and mc[0]["z"] is None and mc[0]["reason"]
        assert summ["agrees"] is None and set(mc[0]["certified_lower_bounds"]) == \
            {"<a,a>", "<b,b>"}
        assert any("MC no reliable estimate" in line for line in js["finding"])
    assert any("DISAGREES" in line for line in js["finding"]) == (summ["agrees"] is False)
    table = language_table(result)
    assert "1-gram agr" in table and "moment-closure (approx.) to final" in table
    assert "tensor sim to final" not in table
    assert "moment-closure_(approximate)" in (out / "language_pairs.csv").read_text()
    assert "tensor_similarity" not in (out / "language_pairs.csv").read_text()


def test_tiny_audit_montecarlo_two_layers_with_verdicts(tiny_mc_run, pair_without_cross_check):
    """The two-layer audit with --method montecarlo (the default from issue 21 until the
    degree report, item 7): no closure under the tensor-similarity heading.
    Each pair's entry is the Monte Carlo estimate of an independent tensoralg.similarity call
    on the saved checkpoints (same seed and directions) exactly when its diagnostics call it
    reliable, and blank (no reliable estimate, with the reason and certified lower bounds)
    otherwise; the closure is beside it, labelled approximate, equal to closure_similarity."""
    from tensoralg.audit.language import CLOSURE_NAME, language_table
    from tensoralg.strategies import closure

    result, out = tiny_mc_run
    js = json.loads((out / "language.json").read_text())
    assert js["config"]["resolved_method"] == "montecarlo"
    assert js["tensor_similarity"]["label"] == "Monte Carlo, reliable entries only"
    assert js["montecarlo_check"] == []           # the matrix itself is Monte Carlo
    names = ["step_000000", "step_000001", "step_000020"]
    nets = [load_checkpoint(out / "checkpoints" / n)[0].to_network() for n in names]
    S = js["matrices"]["tensor similarity"]
    C = np.array(js["moment_closure_approximate"]["matrix"])
    assert js["moment_closure_approximate"]["label"] == CLOSURE_NAME
    assert "APPROXIMATE" in js["moment_closure_approximate"]["note"]
    assert len(js["pairs"]) == 3 and js["tensor_similarity"]["n_pairs"] == 3
    for r in js["pairs"]:
        i, j = r["i"], r["j"]
        e = ta.similarity(nets[i], nets[j], method="montecarlo", n_ctx=4, n_samples=300, seed=0)
        # same directions, sums grouped differently: the estimate agrees to rounding; the
        # delta-method stderr of a similarity near 1 is a difference of nearly equal terms
        # (g^T C g with r ~ 0.9999 here), so rounding of the per-direction products shows at
        # ~1e-7 relative there; the verdict and replicates are compared as well
        assert r["reliable"] == e.reliable and r["stderr"] == pytest.approx(e.stderr, rel=1e-6)
        for (v1, s1), (v2, s2) in zip(r["replicates"], e.diagnostics.replicates):
            assert v1 == pytest.approx(v2, rel=1e-10)
            # a replicate's delta-method variance: 9 covariance terms, each a one-pass mean
            # of products minus a product of means, so worst-case rounding bounds its error
            # by about 9 eps r^2 absolutely, not relative to the variance, which cancels to
            # ~1e-13 at r ~ 0.9999 (seen: 3e-4 relative in the standard error, 7e-17 in the
            # variance, on one machine)
            assert abs(s1 * s1 - s2 * s2) <= 16 * np.finfo(float).eps * v2 * v2
        if e.reliable:
            assert S[i][j] == pytest.approx(float(e), rel=1e-10) == r["montecarlo"]
        else:
            assert S[i][j] is None and S[j][i] is None and r["montecarlo"] is None
            assert r["unreliable_estimate"] == pytest.approx(float(e), rel=1e-10)
            assert r["reason"] and r["certified_lower_bounds"] == pytest.approx(
                e.diagnostics.lower_bounds, rel=1e-10)
        want = closure.closure_similarity(nets[i], nets[j], n_ctx=4)
        assert C[i, j] == pytest.approx(want, rel=1e-10) == r[CLOSURE_NAME]
    assert js["tensor_similarity"]["n_reliable"] == sum(r["reliable"] for r in js["pairs"])
    table = language_table(result)
    assert "Monte Carlo sim to final" in table and "moment-closure (approx.) to final" in table
    assert ("no reliable estimate" in table) == (not js["pairs"][2]["reliable"])  # 0 vs 20
    assert any(line.startswith("Monte Carlo (300 shared directions") for line in js["finding"])
    head = (out / "language_pairs.csv").read_text().splitlines()[0]
    assert "tensor_similarity_(montecarlo)" in head and "moment-closure_(approximate)" in head
    assert "montecarlo_reliable" in head and ",tensor_similarity," not in head + ","


def test_compare_and_matrix_of_two_layer_checkpoints_never_default_to_the_closure(
        tiny_default_run, tmp_path, capsys):
    """compare: exact (refused, naming Monte Carlo first) and Monte Carlo with its verdict; the
    closure only when asked for, labelled. matrix (blocked or not): --method auto refused before
    any work, naming the alternatives."""
    from tensoralg.audit.compare import compare_table, run_compare, run_matrix
    from tensoralg.audit.matrix_blocks import run_matrix_blocked
    from tensoralg.cli import main

    _, out = tiny_default_run
    c = [str(out / "checkpoints" / n) for n in ("step_000000", "step_000001", "step_000020")]
    r = run_compare(c[0], c[2], n_samples=300)
    assert [x["method"] for x in r["results"]] == ["exact", "montecarlo"]
    ex, mc = r["results"]
    assert "error" in ex and ex["error"].index("method='montecarlo'") < \
        ex["error"].index("method='closure'")
    assert isinstance(mc["reliable"], bool)
    text = compare_table(r)
    assert ("no reliable estimate" in text) == (not mc["reliable"])
    assert "gaussian  closure" not in text and "moment-closure (approximate)" not in text
    rc = run_compare(c[0], c[2], methods=("closure",))
    assert rc["results"][0]["approximate"] is True
    assert "gaussian  moment-closure (approximate)" in compare_table(rc)
    for fn, kw in ((run_matrix, {}), (run_matrix_blocked, {"block_size": 2})):
        with pytest.raises(ValueError, match=r"--method auto: .*--method montecarlo.*--method "
                                             r"closure \(the moment-closure similarity: "
                                             r"APPROXIMATE"):
            fn(c, tmp_path / "m", **kw)
        assert not (tmp_path / "m").exists()
    assert main(["matrix", *c, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "--method auto" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_montecarlo_check_summary_by_hand():
    from tensoralg.audit.language import Z_DISAGREE, _mc_summary

    rec = lambda z: {"z": z}   # noqa: E731
    s = _mc_summary([rec(1.0), rec(-(Z_DISAGREE + 1))], "closure")
    assert s["max_abs_z"] == Z_DISAGREE + 1 and s["agrees"] is False
    s = _mc_summary([rec(-Z_DISAGREE), rec(None)], "exact")
    assert s["max_abs_z"] == Z_DISAGREE and s["agrees"] is True
    assert _mc_summary([], "closure")["agrees"] is None


def test_tiny_one_layer_audit_exact(tiny_run):
    from tensoralg.audit.language import language_table

    result, out = tiny_run
    for f in ("language.json", "language.csv", "language_pairs.csv", "language_matrices.png",
              "language_ngrams.png"):
        assert (out / f).is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
        ["step_000000", "step_000001", "step_000020"]
    js = json.loads((out / "language.json").read_text())
    assert js["config"]["steps"] == 20 and js["config"]["resolved_method"] == "exact"
    assert js["corpus"]["python_version"] and len(js["corpus"]["sha256_text"]) == 64
    assert js["times"]["total_s"] > 0
    S = np.array(js["matrices"]["tensor similarity"])
    assert S.shape == (3, 3) and np.allclose(np.diag(S), 1.0) and np.allclose(S, S.T)
    # the matrix entry equals an independent tensoralg.similarity call on the saved checkpoints
    a, _ = load_checkpoint(out / "checkpoints" / "step_000000")
    b, _ = load_checkpoint(out / "checkpoints" / "step_000020")
    assert S[0, 2] == pytest.approx(float(ta.similarity(a.to_network(), b.to_network())),
                                    rel=1e-10)
    mc = js["montecarlo_check"][0]
    # the estimate: under "montecarlo" when its diagnostics call it reliable, otherwise only
    # under "unreliable_estimate" (issue 21: an unreliable number is not an answer)
    val = mc["montecarlo"] if mc["reliable"] else mc["unreliable_estimate"]
    assert (mc["montecarlo"] is None) == (not mc["reliable"])
    assert abs(mc["exact"] - val) <= 5 * mc["stderr"]
    assert js["finding"] and "table" not in js
    assert "1-gram agr" in language_table(result)


def test_compare_and_matrix_accept_language_checkpoints(tiny_run, tmp_path):
    from tensoralg.audit.compare import run_compare, run_matrix

    result, out = tiny_run
    c = [str(out / "checkpoints" / n) for n in ("step_000000", "step_000001", "step_000020")]
    r = run_compare(c[0], c[2], methods=("closure",))
    vals = {x["method"]: x["global"] for x in r["results"]}
    S = np.array(result["matrices"]["tensor similarity"])      # exact (one layer)
    assert vals["closure"] == pytest.approx(S[0, 2], rel=1e-10)    # depth 1: closure is exact
    assert [x["metric"] for x in r["results"]] == ["gaussian"]
    with pytest.raises(ValueError, match="only the gaussian metric"):
        run_compare(c[0], c[2], methods=("exact",), metrics=("frobenius",))
    m = run_matrix(c, tmp_path / "mat")
    assert np.allclose(m["similarity_matrix"], S, rtol=1e-10, atol=1e-12)
    assert "similarity_stderr" not in m   # exact: no sampling error
    # Monte Carlo: every pair with its standard error and verdict (shared directions)
    m = run_matrix(c, tmp_path / "mc", method="montecarlo", n_samples=600)
    se, ok = np.array(m["similarity_stderr"]), np.array(m["similarity_reliable"])
    assert se.shape == ok.shape == (3, 3) and se[0, 1] > 0 and m["uncertainty"]["per_entry"]
    assert all(np.isnan(m["similarity_matrix"][i, j]) != ok[i, j] for i in range(3)
               for j in range(3))
    # the default sample count is compare's for transformer checkpoints (memory O(N^2), streamed)
    from tensoralg.audit.compare import SEQUENCE_MC_SAMPLES

    m = run_matrix(c, tmp_path / "mc_default", method="montecarlo")
    assert m["uncertainty"]["n_samples"] == SEQUENCE_MC_SAMPLES == 20_000
    with pytest.raises(ValueError, match=r"^--n-samples: expected an integer >= 6"):
        run_matrix(c, tmp_path / "mc", method="montecarlo", n_samples=5)   # before any loading
    with pytest.raises(ValueError, match="beyond the trained context n_ctx=4"):
        run_compare(c[0], c[1], methods=("exact",), n_ctx=5)


def test_vocabularies_differing_refused(tmp_path):
    from tensoralg.audit.compare import run_compare, run_matrix

    a = BilinearTransformer(11, 4, 1, 1, 2, n_ctx=4)
    b = BilinearTransformer(12, 4, 1, 1, 2, n_ctx=4)
    save_checkpoint(tmp_path / "a", a)
    save_checkpoint(tmp_path / "b", b)
    with pytest.raises(ValueError, match="vocabularies differ.*vocab 11.*vocab 12"):
        run_compare(str(tmp_path / "a"), str(tmp_path / "b"), methods=("exact",))
    with pytest.raises(ValueError, match="vocabularies differ"):
        run_matrix([str(tmp_path / "a"), str(tmp_path / "b")], tmp_path / "m")


def test_audit_bad_input(tmp_path):
    from tensoralg.audit.language import LanguageConfig, run_language

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="--out.*not a folder"):
        run_language(LanguageConfig(**TINY), f)
    with pytest.raises(ValueError, match="--method exact.*--layers 2"):
        run_language(LanguageConfig(**{**TINY, "n_layers": 2, "method": "exact"}), tmp_path / "o")
    with pytest.raises(ValueError, match="--method exact.*--layers 2"):   # the default depth
        run_language(LanguageConfig(**{**TINY_DEFAULT, "method": "exact"}), tmp_path / "o")
    with pytest.raises(ValueError, match="--n-ctx"):
        run_language(LanguageConfig(**{**TINY, "n_ctx": 3}), tmp_path / "o")
    with pytest.raises(ValueError, match="--checkpoints"):
        run_language(LanguageConfig(**{**TINY, "checkpoints": 30}), tmp_path / "o")
    with pytest.raises(ValueError, match="--eval-windows"):
        run_language(LanguageConfig(**{**TINY, "eval_windows": 10_000}), tmp_path / "o")
    with pytest.raises(ValueError, match="--method exact.*needs --method degree.*montecarlo"):
        run_language(LanguageConfig(**{**TINY_DEFAULT, "method": "exact"}), tmp_path / "o")
    with pytest.raises(ValueError, match="--mc-matrix-samples: expected >= 300.*got 299"):
        run_language(LanguageConfig(**{**TINY_MC, "mc_matrix_samples": 299}),
                     tmp_path / "o")
    # the Monte Carlo matrix's sample count does not matter where there is none (one layer)
    LanguageConfig(**{**TINY, "mc_matrix_samples": 299}).validate()
    with pytest.raises(ValueError, match="closure: expected True or False, got 'yes'"):
        run_language(LanguageConfig(**{**TINY_DEFAULT, "closure": "yes"}), tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_cli_out_is_a_file(tmp_path, capsys):
    from tensoralg.cli import main

    f = tmp_path / "file"
    f.write_text("x")
    code = main(["audit", "language", "--quick", "--out", str(f)])
    assert code == 2
    assert "not a folder" in capsys.readouterr().err


def test_transitions_skip_intervals_without_a_reliable_estimate():
    """NaN entries (a Monte Carlo pair with no reliable estimate) are left out of the ranking,
    the median and the correlation; none at all: no sharpest transition, "NOT assessed"."""
    from tensoralg.audit.language import finding_text, transitions_finding

    steps = [0, 1, 10, 100, 1000]
    S = np.eye(5)
    for i, v in enumerate([np.nan, 0.5, 0.9, 0.7]):
        S[i, i + 1] = S[i + 1, i] = v
    agreement = {2: [0.0, 0.1, 0.6, 0.61, 0.7]}
    fin = transitions_finding(steps, {"tensor similarity": S}, agreement, k=3)
    m = fin["metrics"]["tensor similarity"]
    assert [t["interval"] for t in m["sharpest"]] == [1, 3, 2] and m["n_intervals_assessed"] == 3
    assert m["sharpness_max_over_median"] == pytest.approx(0.5 / 0.3)   # median of 0.5 0.1 0.3
    none = np.eye(5) + np.where(np.eye(5) == 0, np.nan, 0.0)
    fin = transitions_finding(steps, {"tensor similarity": none}, agreement, k=3)
    assert fin["metrics"]["tensor similarity"]["sharpest"] == []
    text = finding_text(fin, "montecarlo", {2: 0.7})
    assert "Monte Carlo, reliable entries only) transitions: none" in text[0]
    assert any(line.startswith("NOT assessed") for line in text)


def test_transitions_finding_by_hand():
    from tensoralg.audit.language import transitions_finding

    steps = [0, 1, 10, 100, 1000]
    S = np.eye(5)
    for i in range(4):
        S[i, i + 1] = S[i + 1, i] = [0.99, 0.5, 0.98, 0.97][i]     # sharpest: interval 1
    agreement = {2: [0.0, 0.0, 0.6, 0.65, 0.7]}                      # fastest: interval 1
    fin = transitions_finding(steps, {"tensor similarity": S}, agreement, k=1)
    top = fin["metrics"]["tensor similarity"]["sharpest"][0]
    assert top["steps"] == [1, 10] and top["ngram_orders_fastest_same_interval"] == [2]
    assert fin["chance_same_interval"] == 0.25


def test_montecarlo_matrix_agrees_with_exact(pair_without_cross_check):
    """sequence_similarity_matrix(method="montecarlo") is the library's shared-direction
    estimator (ta.similarity_matrix): each entry ta.similarity of the pair with the same
    seed (up to rounding), with its standard error and verdict; a reliable entry lies within
    5 standard errors of the exact one-layer value."""
    import tensoralg as ta
    from tensoralg.audit.language import sequence_similarity_matrix

    nets = [_model(n_layers=1, d_mlp=None, n_heads=1, d_head=2, d_model=3, n_ctx=3,
                   seed=s).to_network() for s in range(3)]
    S, info = sequence_similarity_matrix(nets, "montecarlo", 3, n_samples=4000, seed=0)
    se, ok = info["stderr"], info["reliable"]
    exact, einfo = sequence_similarity_matrix(nets, "exact", 3)
    assert "loop" in einfo["path"] or "batched" in einfo["path"]
    off = ~np.eye(3, dtype=bool)
    assert np.all(se[off] > 0) and np.all(se[~off] == 0) and np.all(ok[~off])
    assert np.array_equal(S, S.T) and np.array_equal(se, se.T) and ok.sum() >= 7
    for i, j in ((0, 1), (0, 2), (1, 2)):
        e = ta.similarity(nets[i], nets[j], method="montecarlo", n_ctx=3, n_samples=4000,
                          seed=0)
        assert S[i, j] == pytest.approx(float(e), rel=1e-10)
        assert se[i, j] == pytest.approx(e.stderr, rel=1e-8) and ok[i, j] == e.reliable
    assert np.all(np.abs(S - exact)[off & ok] <= 5 * se[off & ok])


def test_montecarlo_check_reports_the_library_estimate_and_its_stderr(tiny_run):
    """The audit's Monte Carlo check of a pair is ta.similarity(method="montecarlo") on the
    saved checkpoints (same n_samples and seed: the same number, not just a close one) with
    its delta-method standard error; the exact one-layer value lies within 4 of them."""
    from tensoralg.strategies import sequence_exact

    _result, out = tiny_run
    js = json.loads((out / "language.json").read_text())
    mc = js["montecarlo_check"][0]
    assert mc["stderr"] > 0 and "delta method" in mc["stderr_method"]
    steps = [f"step_{s:06d}" for s in mc["steps"]]
    a, b = (load_checkpoint(out / "checkpoints" / s)[0].to_network() for s in steps)
    est = ta.similarity(a, b, method="montecarlo", n_ctx=TINY["n_ctx"],
                        n_samples=mc["n_samples"], seed=mc["seed"])
    val = mc["montecarlo"] if mc["reliable"] else mc["unreliable_estimate"]
    assert val == float(est) and mc["stderr"] == est.stderr and mc["reliable"] == est.reliable
    exact = sequence_exact.exact_similarity(a, b, n_ctx=TINY["n_ctx"])
    assert abs(exact - val) <= 4 * mc["stderr"]
    if mc["reliable"]:
        assert mc["z"] == pytest.approx((mc["exact"] - val) / mc["stderr"])
    else:   # no z against an unreliable estimate
        assert mc["z"] is None and mc["reason"] == est.diagnostics.reason


def test_compare_montecarlo_of_language_checkpoints_has_a_stderr(tiny_run):
    from tensoralg.audit.compare import run_compare

    _result, out = tiny_run
    c = [str(out / "checkpoints" / n) for n in ("step_000000", "step_000020")]
    r = run_compare(c[0], c[1], methods=("exact", "montecarlo"), n_samples=300, seed=3)
    vals = {x["method"]: x for x in r["results"]}
    mc = vals["montecarlo"]
    assert mc["global_stderr"] > 0 and "each" not in mc
    # an estimate that failed its diagnostics is not the answer: global is null, the value
    # sits under its own name (and still covers the exact value)
    val = mc["global"] if mc["reliable"] else mc["unreliable_estimate"]
    assert (mc["global"] is None) == (not mc["reliable"])
    assert abs(val - vals["exact"]["global"]) <= 4 * mc["global_stderr"]


def test_compare_of_language_checkpoints_defaults_to_fewer_monte_carlo_directions(tiny_run,
                                                                                 monkeypatch):
    # a direction of a transformer costs 6-26 forward passes per model: without --n-samples the
    # sequence default (SEQUENCE_MC_SAMPLES, here lowered for speed) is used and recorded
    from tensoralg.audit import compare

    monkeypatch.setattr(compare, "SEQUENCE_MC_SAMPLES", 300)
    _result, out = tiny_run
    c = [str(out / "checkpoints" / n) for n in ("step_000000", "step_000020")]
    r = compare.run_compare(c[0], c[1], methods=("montecarlo",), seed=3)
    assert r["config"]["n_samples"] == 300
    assert r["results"][0]["global_stderr"] > 0


# ---------------------------------------------------------------------------------------
# the degree report (issue 21, item 7): the default at two layers
# ---------------------------------------------------------------------------------------

def _tiny_transformers(n=3, **kw):
    args = dict(vocab=7, d_model=3, n_layers=2, n_heads=1, d_head=2, d_mlp=None, n_ctx=3,
                rope=10.0)
    args.update(kw)
    return [_model(seed=s, **args).double().eval() for s in range(n)]


def test_degree_report_structure_and_the_three_metrics(tiny_default_run):
    """The default two-layer run is the degree report: for each of the three metrics the exact
    S<=1 and S<=5 matrices over all checkpoints, S<=9 and the guided full similarity on the
    sharpest S<=5 interval, every number with the distribution it used, the finding per
    metric and degree; the files."""
    from tensoralg.audit.language import LanguageConfig, language_table
    from tensoralg.audit.language_degree import DEGREES, METRIC_NAMES, matrix_name

    assert LanguageConfig().resolved_method() == "degree"
    assert LanguageConfig.quick().resolved_method() == "degree"
    result, out = tiny_default_run
    for f in ("language.json", "language.csv", "language_pairs.csv", "language_deep.csv",
              "language_matrices.png", "language_data_matrices.png", "language_ngrams.png"):
        assert (out / f).is_file()
    js = json.loads((out / "language.json").read_text())
    assert js["report"] == "degree" and js["config"]["resolved_method"] == "degree"
    assert list(js["metrics_used"]) == list(METRIC_NAMES) == js["config"]["metrics"]
    used = js["metrics_used"]
    assert used["residual"]["distribution"] == "N(0, I)" and "residual" in used["residual"]["input"]
    assert used["vocab"]["distribution"] == "N(0, I)" and "one-hot" in used["vocab"]["input"]
    hc = js["heldout_covariance"]
    assert f"K of shape (97, {hc['n_seen']})" in used["heldout"]["distribution"]
    assert sum(hc["frequencies"]) == pytest.approx(1.0, rel=1e-12)
    assert len(hc["unseen_token_ids"]) == 97 - hc["n_seen"]
    for m in METRIC_NAMES:
        d = js["degree_report"][m]
        for deg in ("S<=1", "S<=5"):
            S = np.array(d[deg]["matrix"])
            assert S.shape == (3, 3) and np.allclose(S, S.T) and np.allclose(np.diag(S), 1)
            assert d[deg]["exact"] is True and d[deg]["distribution"] == used[m]["distribution"]
            assert js["matrices"][matrix_name(deg, m)] == d[deg]["matrix"]
        assert len(d["deep_intervals"]) == 1
        for deg in ("S<=9", "full"):
            (r,) = d[deg]["pairs"]
            assert d[deg]["exact"] is False and r["distribution"] == used[m]["distribution"]
            assert r["j"] == r["i"] + 1 == d["deep_intervals"][0] + 1
            assert r["stderr"] > 0 and r["n_samples"] == 300 and "computed_on" in r
            if r["reliable"]:
                assert r["value"] is not None and r["unreliable_estimate"] is None
            else:
                assert r["value"] is None and isinstance(r["unreliable_estimate"], float)
                assert r["reason"]
        for deg in DEGREES:
            f = js["finding_by_metric"][matrix_name(deg, m)]
            assert {"verdict", "spearman_with_ngram_change", "n_in_top_k_ngram_change",
                    "not_lined_up", "chance_top_k_ngram"} <= set(f)
    assert js["affine_check"]["max_relative_difference_of_gram"] < 1e-10
    assert all(k in js["times"] for k in ("train_s", "degree_report_s", "total_s", "cpu_s"))
    assert set(js["times"]["degree_report_by_metric_s"]) == set(METRIC_NAMES)
    table = language_table(result)
    assert "S<=9 (MC)" in table and "full (guided MC)" in table and "1-S<=5 hld" in table
    assert sum(line.startswith("S<=5 (exact) under") for line in js["finding"]) == 3


def test_degree_report_never_prints_an_unreliable_number(tiny_default_run):
    """Wherever an estimate is shown (table, CSV), an unreliable one is "no reliable
    estimate", never its number; a reliable one is value ± stderr."""
    from tensoralg.audit.language import language_table
    from tensoralg.audit.language_degree import NO_ESTIMATE, deep_rows, matrix_name, shown

    result, out = tiny_default_run
    bad = {"reliable": False, "value": None, "unreliable_estimate": 0.123456, "stderr": 0.01,
           "reason": "one direction carries 50% of a sum (>= 5%)"}
    assert shown(bad) == NO_ESTIMATE and "0.12" not in shown(bad)
    assert shown({**bad, "reliable": True, "value": 0.5}) == "0.5000 ± 0.0100"
    S = {matrix_name(d, "residual"): np.eye(2) for d in ("S<=1", "S<=5")}
    deep = {"residual": {"S<=9": {"pairs": [{**bad, "i": 0, "j": 1, "steps": [0, 7]}]},
                         "full": {"pairs": [{**bad, "i": 0, "j": 1, "steps": [0, 7]}]}}}
    (row,) = deep_rows(deep, ["residual"], S)
    assert row[5] == row[7] == NO_ESTIMATE and not any("0.123" in str(c) for c in row)
    import csv

    js = json.loads((out / "language.json").read_text())
    rows = list(csv.DictReader((out / "language_deep.csv").open()))
    lines = language_table(result).splitlines()
    n = 0
    for m, d in js["degree_report"].items():
        for r9, rf in zip(d["S<=9"]["pairs"], d["full"]["pairs"]):
            (row,) = [x for x in rows if x["metric"] == m and
                      [int(x["step_i"]), int(x["step_j"])] == r9["steps"]]
            (line,) = [x for x in lines if x.split()[:2] == [m, f"{r9['steps'][0]}->"
                                                             f"{r9['steps'][1]}"]]
            for r, col in ((r9, "S<=9 (Monte Carlo)"), (rf, "full (guided Monte Carlo)")):
                want = (f"{r['value']:.4f} ± {r['stderr']:.4f}" if r["reliable"]
                        else NO_ESTIMATE)
                assert row[col] == want and want in line
                n += 1
            assert line.count(NO_ESTIMATE) == (not r9["reliable"]) + (not rf["reliable"])
    assert n == 6


def test_degree_matrix_entries_equal_degree_similarity_on_a_pair(tiny_default_run):
    """The S<=1 (closed form) and S<=5 (degree_similarity_matrix) entries of each metric equal
    an independent ta.degree_similarity call on two saved checkpoints (S<=1 there by the DFT
    of the affine part), the held-out covariance rebuilt from the corpus."""
    from tensoralg.corpus import load_corpus

    _, out = tiny_default_run
    js = json.loads((out / "language.json").read_text())
    a, _ = load_checkpoint(out / "checkpoints" / "step_000001")
    b, _ = load_checkpoint(out / "checkpoints" / "step_000020")
    held = load_corpus(TINY_DEFAULT["n_chars"]).held_out
    p = np.bincount(held, minlength=97) / len(held)
    seen = p > 0
    cov = {"residual": None, "vocab": None,
           "heldout": ta.CovarianceFactor(np.diag(np.sqrt(p))[:, seen])}
    for m, emb in (("residual", False), ("vocab", True), ("heldout", True)):
        r = ta.degree_similarity(a.to_network(embedding=emb), b.to_network(embedding=emb),
                                 n_ctx=4, max_degree=(1, 5), cov=cov[m])
        assert r.exact(1) and r.exact(5)
        d = js["degree_report"][m]
        assert d["S<=1"]["matrix"][1][2] == pytest.approx(float(r[1]), rel=1e-10)
        assert d["S<=5"]["matrix"][1][2] == pytest.approx(float(r[5]), rel=1e-10)
        assert r.distribution == d["S<=5"]["distribution"]


@pytest.mark.parametrize("metric", ["residual", "vocab", "heldout"])
def test_affine_gram_equals_the_library(metric):
    """The closed-form S<=1 Gram (direct path W_U W_E^T K) equals degree_similarity_matrix's
    (the DFT of the affine part on the basis inputs) for every metric, with an MLP too."""
    from tensoralg.audit.language_degree import (
        affine_gram,
        metric_cov,
        metric_factor,
        metric_networks,
    )

    for kw in ({}, {"d_mlp": 4}):
        models = _tiny_transformers(**kw)
        p = np.array([0.3, 0.0, 0.1, 0.2, 0.15, 0.25, 0.0])
        K = np.diag(np.sqrt(p))[:, p > 0]
        Kf = metric_factor(metric, 7, K)
        G = affine_gram(models, metric, Kf, 3)
        lib = ta.degree_similarity_matrix(metric_networks(models, metric), n_ctx=3,
                                          max_degree=(1,), cov=metric_cov(metric, Kf))
        np.testing.assert_allclose(G, lib.gram[1], rtol=1e-10, atol=1e-12 * np.abs(G).max())


@pytest.mark.parametrize("metric", ["vocab", "heldout"])
def test_pair_networks_are_an_exact_change_of_variables(metric):
    """In vocabulary space the pair's networks on their joint input span have the same exact
    S<=5 Gram as the full one-hot networks under the metric."""
    from tensoralg.audit.language_degree import (
        metric_cov,
        metric_factor,
        metric_networks,
        pair_networks,
    )

    a, b = _tiny_transformers(2)
    p = np.array([0.3, 0.0, 0.1, 0.2, 0.15, 0.25, 0.0])
    Kf = metric_factor(metric, 7, np.diag(np.sqrt(p))[:, p > 0])
    na, nb, q = pair_networks(a, b, metric, Kf)
    assert q == min(6, Kf.shape[1]) and na.in_features == nb.in_features == q
    red = ta.degree_similarity_matrix([na, nb], n_ctx=3, max_degree=(5,))
    full = ta.degree_similarity_matrix(metric_networks([a, b], metric), n_ctx=3,
                                       max_degree=(5,), cov=metric_cov(metric, Kf))
    np.testing.assert_allclose(red.gram[5], full.gram[5], rtol=1e-10)


def test_heldout_factor():
    from tensoralg.audit.language_degree import heldout_factor

    K, rec = heldout_factor(np.array([0, 2, 2, 3, 0, 2]), 5)
    np.testing.assert_allclose(K @ K.T, np.diag([2, 0, 3, 1, 0]) / 6, rtol=1e-15)
    assert K.shape == (5, 3) and rec["unseen_token_ids"] == [1, 4] and rec["singular"]
    with pytest.raises(ValueError, match="held_out: no tokens"):
        heldout_factor(np.array([], dtype=int), 5)
    with pytest.raises(ValueError, match=r"held_out: token ids outside \[0, 5\)"):
        heldout_factor(np.array([0, 5]), 5)


def test_transitions_top_k_ngram_intervals_by_hand():
    from tensoralg.audit.language import transitions_finding

    steps = [0, 1, 10, 100, 1000]
    S = np.eye(5)
    for i in range(4):
        S[i, i + 1] = S[i + 1, i] = [0.9, 0.5, 0.98, 0.97][i]      # sharpest: 1, then 0
    agreement = {2: [0.0, 0.05, 0.6, 0.65, 0.9]}                    # changes .05 .55 .05 .25
    fin = transitions_finding(steps, {"m": S}, agreement, k=2)
    assert fin["top_k_ngram_change_intervals"] == [1, 3] and fin["chance_top_k_ngram"] == 0.5
    assert fin["metrics"]["m"]["n_sharpest_in_top_k_ngram_change"] == 1   # 1 yes, 0 no


def test_degree_report_bad_input(tmp_path, capsys):
    from tensoralg.audit.language import LanguageConfig, run_language
    from tensoralg.cli import main

    for kw, msg in (({"metrics": ("residual", "tokens")}, "--metrics: expected distinct"),
                    ({"metrics": ()}, "--metrics: expected distinct"),
                    ({"metrics": ("vocab", "vocab")}, "--metrics: expected distinct"),
                    ({"metrics": "vocab"}, "--metrics: expected distinct"),
                    ({"deep_metrics": ("vocab",), "metrics": ("residual",)},
                     "--deep-metrics: expected distinct names among --metrics residual"),
                    ({"deep_pairs": -1}, "--deep-pairs: expected a non-negative integer"),
                    ({"degree_samples": 299}, "--degree-samples: expected >= 300.*got 299"),
                    ({"guided_samples": 10}, "--guided-samples: expected >= 300.*got 10"),
                    ({"method": "degree", "n_layers": 1}, "--method degree: .*two or more")):
        with pytest.raises(ValueError, match=msg):
            run_language(LanguageConfig(**{**TINY_DEFAULT, **kw}), tmp_path / "o")
    # more deep pairs than intervals: all of them (tensoralg.sae trains with 2 checkpoints)
    from tensoralg.audit.language_degree import deep_intervals

    LanguageConfig(**{**TINY_DEFAULT, "deep_pairs": 5}).validate()
    S = np.eye(3)
    S[0, 1] = S[1, 0] = 0.9
    S[1, 2] = S[2, 1] = 0.5
    assert deep_intervals(S, 5) == [1, 0]
    # the sample counts do not matter where nothing is sampled
    LanguageConfig(**{**TINY_DEFAULT, "deep_pairs": 0, "degree_samples": 1}).validate()
    assert not (tmp_path / "o").exists()
    assert LanguageConfig.quick().deep_metrics == ("heldout",)
    assert LanguageConfig.quick(metrics=("vocab", "residual")).deep_metrics == ("vocab",)
    assert LanguageConfig().deep_metrics is None          # the default: every metric
    for args in (["--metrics", "residual,tokens"], ["--deep-pairs", "-1"],
                 ["--deep-metrics", "vocab,vocab"],
                 ["--degree-samples", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["audit", "language", "--quick", "--out", str(tmp_path / "o")] + args)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert args[0] in err and "Traceback" not in err


def test_a_stack_that_overflows_at_initialisation_says_so(tmp_path):
    """Tester finding: ``--layers 4`` stopped with "learning rate too high?" at step 1, before
    any update; the initial model itself overflows (degree 5^4 in the embeddings)."""
    from tensoralg.audit.language import LanguageConfig, make_model, train_language_model
    from tensoralg.nn import TrainingDiverged

    cfg = LanguageConfig(**{**TINY, "n_layers": 5, "d_model": 16, "steps": 3})
    model = make_model(cfg, 97)
    toks = np.random.default_rng(0).integers(0, 97, size=400)
    with pytest.raises(TrainingDiverged, match=r"at step 1, before any update: the initial "
                                               r"5-layer model's logits overflow .*degree "
                                               r"5\^5 = 3125"):
        train_language_model(model, toks, cfg, [0], lambda step, m: None)


def test_degree_report_says_which_paths_carry_the_sharpest_transition(tiny_default_run):
    """At the sharpest S<=5 interval the exact first-order path attribution: its 1 - S of the
    sum of the paths is the matrix's exact 1 - S<=5 (another engine), own changes plus cross
    terms add up to it, the rule's verdict is in the finding, the table, the CSV and the
    figure, next to the n-gram gains of that interval."""
    import csv

    from tensoralg.audit.language import language_table

    result, out = tiny_default_run
    js = json.loads((out / "language.json").read_text())
    metric = next(m for m in js["config"]["metrics"] if js["degree_report"][m]["paths"]["pairs"])
    d = js["degree_report"][metric]
    (r,) = d["paths"]["pairs"]
    i = d["deep_intervals"][0]
    assert (r["i"], r["j"]) == (i, i + 1) and r["names"] == ["direct", "L0.H0", "L1.H0"]
    S5 = np.array(d["S<=5"]["matrix"])
    assert abs(r["one_minus_similarity_of_sum"] - (1 - S5[i, i + 1])) < 1e-9
    assert r["check_abs_difference_to_S5"] < 1e-9
    assert abs(sum(r["own_change"]) + r["cross_terms"] - r["one_minus_similarity_of_sum"]) \
        < 1e-12
    frac = np.array(r["own_change_fraction"])
    assert (r["verdict"] == "one path") == (frac.max() > 0.5) and r["carried_by"]
    cks = js["checkpoints"]
    assert r["ngram_gain"]["2"] == pytest.approx(cks[i + 1]["agreement"]["2"]
                                                 - cks[i]["agreement"]["2"])
    assert "paths_s" in js["times"] and d["seconds"]["paths"] > 0
    assert sum(line.startswith("paths at the S<=5 transition") for line in js["finding"]) == \
        sum(len(js["degree_report"][m]["paths"]["pairs"]) for m in js["config"]["metrics"])
    assert "which first-order paths changed" in language_table(result)
    rows = list(csv.DictReader((out / "language_paths.csv").open()))
    assert [x["path"] for x in rows if x["metric"] == metric] == r["names"]
    assert (out / "language_paths.png").is_file()
    assert "language_paths.png" in js["files"] and "language_paths.csv" in js["files"]
