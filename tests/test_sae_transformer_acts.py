"""Issue 13, item 7: SAE activations from the residual stream of a bilinear transformer
(`tensoralg sae activations --source transformer`), checked against an independent numpy
forward pass, plus bad input and a tiny end-to-end `sae bench --data`."""

import json

import numpy as np
import pytest
import torch

from tensoralg.checkpoint import save_checkpoint
from tensoralg.cli import main
from tensoralg.corpus import load_corpus
from tensoralg.sae import transformer_acts as ta_acts
from tensoralg.sae.transformer_acts import extract_transformer_activations, residual_stream_at
from tensoralg.transformer import BilinearTransformer

CHARS = 20_480          # the corpus minimum: ~2k held-out tokens
TINY = {"steps": 3, "d_model": 8, "n_heads": 2, "d_head": 4, "d_mlp": 8, "n_ctx": 6}


def _np_residuals(model, tokens):
    """h_0 .. h_L of ``model`` on ``tokens`` from its weights in plain numpy (float64), written
    from the formulas of tensoralg/transformer.py's docstring: RoPE by complex multiplication
    of the coordinate pairs (2i, 2i+1) by exp(i t base^(-2i/d_head)), explicit loops over heads
    and positions for the causal bilinear pattern."""
    hp = model.hparams
    P = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    h = P["embed"][np.asarray(tokens)]                        # (B, T, d)
    B, T, _ = h.shape
    dh = hp["d_head"]

    def rope(y):                                              # y: (B, T, dh)
        if hp["rope"] is None:
            return y
        ang = np.arange(T)[:, None] * hp["rope"] ** (-np.arange(0, dh, 2) / dh)[None, :]
        c = (y[..., 0::2] + 1j * y[..., 1::2]) * np.exp(1j * ang)[None]
        out = np.empty_like(y)
        out[..., 0::2], out[..., 1::2] = c.real, c.imag
        return out

    hs = [h.copy()]
    for layer in range(hp["n_layers"]):
        a = f"attn.{layer}."
        out = np.zeros_like(h)
        for head in range(hp["n_heads"]):
            q1, k1, q2, k2 = (rope(h @ P[a + n][head].T) for n in ("q1", "k1", "q2", "k2"))
            v = h @ P[a + "v"][head].T
            for b in range(B):
                for t in range(T):
                    z = sum(hp["attn_scale"] * (q1[b, t] @ k1[b, s]) * (q2[b, t] @ k2[b, s]) * v[b, s]
                            for s in range(t + 1))
                    out[b, t] += P[a + "o"][:, head, :] @ z
        h = h + out
        if hp["d_mlp"] is not None:
            m = f"mlp.{layer}."
            h = h + ((h @ P[m + "left"].T) * (h @ P[m + "right"].T)) @ P[m + "down"].T
        hs.append(h.copy())
    return hs


def _model(rope=10000.0, d_mlp=5, seed=3):
    m = BilinearTransformer(11, 6, 2, 2, 4, d_mlp, n_ctx=5, rope=rope, seed=seed, dtype="float64")
    with torch.no_grad():      # larger block outputs than the initialization's, so every term counts
        for a in m.attn:
            a.o.mul_(4.0)
    return m.eval()


@pytest.mark.parametrize("rope,d_mlp", [(10000.0, 5), (None, None)])
def test_residual_stream_equals_an_independent_forward(rope, d_mlp):
    m = _model(rope, d_mlp)
    tokens = np.random.default_rng(0).integers(0, 11, (3, 5))
    ref = _np_residuals(m, tokens)
    for layer in range(3):
        got = residual_stream_at(m, tokens, layer).numpy()
        # float64 sums of a few dozen terms: rounding ~1e-15 relative to the largest entry
        assert np.max(np.abs(got - ref[layer])) <= 1e-12 * np.max(np.abs(ref[layer])), layer
    assert np.array_equal(residual_stream_at(m, tokens, None).numpy(),
                          residual_stream_at(m, tokens, 2).numpy())
    # the blocks change the stream (else the comparison above could not tell layers apart)
    assert np.max(np.abs(ref[1] - ref[0])) > 1e-2 and np.max(np.abs(ref[2] - ref[1])) > 1e-2


def test_extraction_from_a_checkpoint_matches_the_independent_forward(tmp_path):
    ck = tmp_path / "ck"
    m = BilinearTransformer(97, 8, 2, 2, 4, 8, n_ctx=6, rope=10000.0, seed=1)
    save_checkpoint(ck, m, step=0)
    out = tmp_path / "acts.npy"
    info = extract_transformer_activations(out, ck, 1, n_chars=CHARS, n_windows=12, seed=5,
                                           dtype="float64")
    acts = np.load(out)
    assert acts.shape == (12 * 6, 8) and acts.dtype == np.float64
    assert info == {**json.loads((tmp_path / "acts.npy.json").read_text()), "out": str(out)}
    assert info["held_out"].startswith("unknown")         # no corpus_sha256 in this cfg.json
    held = load_corpus(CHARS).held_out
    windows = held[:12 * 6].reshape(12, 6)[info["window_order"]]
    assert sorted(info["window_order"]) == list(range(12)) and info["window_order"] != list(range(12))
    ref = _np_residuals(m.double(), windows)[1].reshape(-1, 8)
    assert np.max(np.abs(acts - ref)) <= 1e-12 * np.max(np.abs(ref))


def test_training_here_is_deterministic_and_saves_its_checkpoint(tmp_path):
    torch.set_num_threads(1)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    ia = extract_transformer_activations(a, None, None, n_chars=CHARS, n_windows=10, train=TINY,
                                         save_checkpoint_to=tmp_path / "ck")
    ib = extract_transformer_activations(b, None, None, n_chars=CHARS, n_windows=10, train=TINY)
    assert a.read_bytes() == b.read_bytes()
    assert np.load(a).shape == (10 * 6, 8) and np.load(a).dtype == np.float32
    assert ia["layer"] == 2 and ia["held_out"].startswith("yes")
    assert ia["model"]["config"]["steps"] == 3 and ib["model"]["final_train_loss"] == \
        ia["model"]["final_train_loss"]
    # the saved checkpoint reproduces the same rows, and knows its corpus
    c = tmp_path / "c.npy"
    ic = extract_transformer_activations(c, tmp_path / "ck", None, n_chars=CHARS, n_windows=10)
    assert ic["held_out"].startswith("yes") and np.array_equal(np.load(c), np.load(a))
    ic2 = extract_transformer_activations(tmp_path / "d.npy", tmp_path / "ck", 0,
                                          n_chars=CHARS + 1024, n_windows=10)
    assert ic2["held_out"].startswith("not verified")   # another selection of the corpus


def _no_corpus(monkeypatch):
    import tensoralg.corpus as corpus

    monkeypatch.setattr(corpus, "load_corpus", lambda *a, **k: pytest.fail("read the corpus"))


def test_bad_input_is_refused_before_any_work(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    save_checkpoint(ck, BilinearTransformer(97, 8, 2, 2, 4, n_ctx=6, seed=0), step=0)
    out = tmp_path / "x.npy"
    _no_corpus(monkeypatch)
    with pytest.raises(FileNotFoundError, match="checkpoint: .*nope"):
        extract_transformer_activations(out, tmp_path / "nope")
    for layer in (3, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 2\]"):
            extract_transformer_activations(out, ck, layer)
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 2\]"):
        extract_transformer_activations(out, None, 3)          # the model trained here has 2
    with pytest.raises(ValueError, match="out: expected a .npy"):
        extract_transformer_activations(tmp_path / "x.txt", ck)
    with pytest.raises(ValueError, match="train: settings"):
        extract_transformer_activations(out, ck, train={"steps": 2})
    with pytest.raises(ValueError, match="train: unknown settings"):
        extract_transformer_activations(out, None, train={"stepz": 2})
    with pytest.raises(ValueError, match="n_windows"):
        extract_transformer_activations(out, ck, n_windows=0)
    # not a transformer, truncated weights, corrupt cfg.json
    from tensoralg.nn import BilinearNet
    net = tmp_path / "net"
    save_checkpoint(net, BilinearNet(4, 3, d_model=4, d_hidden=4))
    with pytest.raises(ValueError, match="checkpoint: .*architecture 'bilinear_net'"):
        extract_transformer_activations(out, net)
    w = ck / "weights.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="checkpoint: "):
        extract_transformer_activations(out, ck)
    w.write_bytes(data)
    (ck / "cfg.json").write_text("{not json")
    with pytest.raises(ValueError, match="checkpoint: .*corrupt JSON"):
        extract_transformer_activations(out, ck)
    assert not out.exists()


def test_too_many_windows_names_the_held_out_size(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    save_checkpoint(ck, BilinearTransformer(97, 8, 1, 2, 4, n_ctx=6, seed=0), step=0)
    # 20,480 characters = 20 segments of 1,024, two held out: 2,048 tokens = 341 windows of 6
    with pytest.raises(ValueError, match="n_windows: 100000 windows .* has 341$"):
        extract_transformer_activations(tmp_path / "x.npy", ck, n_chars=CHARS, n_windows=100_000)
    # without a checkpoint: refused before a model is trained (2,048 // 16 = 128 windows)
    monkeypatch.setattr(ta_acts, "train_quick_transformer", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(ValueError, match="n_windows: 129 windows of n_ctx=16 .* has 128$"):
        extract_transformer_activations(tmp_path / "x.npy", None, n_chars=CHARS, n_windows=129)
    with pytest.raises(ValueError, match="train: --n-ctx: expected >= 4"):
        extract_transformer_activations(tmp_path / "x.npy", None, train={"n_ctx": 2})


def test_extraction_in_several_forward_batches_is_the_same(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    save_checkpoint(ck, BilinearTransformer(97, 8, 2, 2, 4, 8, n_ctx=6, seed=2), step=0)
    kw = dict(n_chars=CHARS, n_windows=30, dtype="float64")
    one = extract_transformer_activations(tmp_path / "a.npy", ck, 1, **kw)
    monkeypatch.setattr(ta_acts, "WINDOW_BATCH_TOKENS", 6 * 7)     # 5 batches: 7+7+7+7+2
    more = extract_transformer_activations(tmp_path / "b.npy", ck, 1, **kw)
    assert one["window_order"] == more["window_order"]
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    # windows do not interact: the same float64 sums per window, at most in another BLAS
    # blocking order for another batch size (rounding ~1e-16 relative per operation)
    assert a.shape == (180, 8) and np.max(np.abs(a - b)) <= 1e-12 * np.max(np.abs(a))


def test_cli_errors_name_the_flags(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    save_checkpoint(ck, BilinearTransformer(97, 8, 2, 2, 4, n_ctx=6, seed=0), step=0)
    _no_corpus(monkeypatch)
    base = ["sae", "activations", "--source", "transformer", "--out", str(tmp_path / "x.npy")]
    cases = [(["--checkpoint", str(ck), "--layer", "7"], "--layer: expected an integer in [0, 2]"),
             (["--checkpoint", str(tmp_path / "nope")], "--checkpoint: "),
             (["--checkpoint", str(ck), "--train-steps", "5"], "--train-steps: trains a model"),
             (["--max-texts", "5"], "--max-texts: only for --source minilm"),
             (["--train-steps", "0"], "--train-steps: expected an int >= 1")]
    for extra, words in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (extra, err)
    assert main(["sae", "activations", "--out", str(tmp_path / "y.npy"), "--checkpoint",
                 str(ck)]) == 2
    assert "--checkpoint: only for --source transformer" in capsys.readouterr().err


def test_tiny_end_to_end_bench_on_the_residual_stream(tmp_path, capsys):
    torch.set_num_threads(1)
    acts = tmp_path / "acts.npy"
    assert main(["sae", "activations", "--source", "transformer", "--out", str(acts),
                 "--train-steps", "5", "--chars", str(CHARS), "--windows", "40", "--layer", "1",
                 "--save-checkpoint", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "640 x 32 residual-stream activations" in out and "after block 1" in out
    assert json.loads((tmp_path / "acts.npy.json").read_text())["shape"] == [640, 32]
    assert main(["sae", "bench", "--data", str(acts), "--presets", "topk", "abstopk", "--seeds",
                 "2", "--m", "16", "--k", "3", "--steps", "20", "--batch-size", "64", "--quick",
                 "--no-progress", "--quiet", "--json", str(tmp_path / "b.json")]) == 0
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["config"]["d"] == 32 and r["config"]["n_eval"] == 128   # 20 % of 640 rows
    assert r["config"]["noise"] is None
    for name in ("topk", "abstopk"):
        p = r[name]
        assert np.isfinite(p["fvu"]) and 0 <= p["code_iou"] <= 1
        assert 0 <= p["dead_latents"] <= 16
        assert p["l0"] <= 3 + 1e-12
    # AbsTopK keeps the k largest |pre-activations|: exactly k non-zeros per row on real data
    assert r["abstopk"]["l0"] == 3.0
    assert "| l0 | dead |" in capsys.readouterr().out


def test_cli_minilm_source_keeps_its_defaults(tmp_path, monkeypatch, capsys):
    """`--source minilm` (the default) still passes layer 3, 2000 texts, 64 tokens, batch 32
    to the MiniLM extractor (the extra itself need not be installed for this)."""
    from tensoralg.sae import activations

    seen = {}

    def fake(out, **kw):
        seen.update(kw)
        return {"shape": [5, 384], "layer": kw["layer"], "model": "fake"}

    monkeypatch.setattr(activations, "real_extra_available", lambda: (True, ""))
    monkeypatch.setattr(activations, "extract_activations", fake)
    assert main(["sae", "activations", "--out", str(tmp_path / "a.npy")]) == 0
    assert seen == {"layer": 3, "max_texts": 2000, "max_tokens": 64, "batch_size": 32}
    assert main(["sae", "activations", "--source", "minilm", "--layer", "5", "--max-texts", "7",
                 "--out", str(tmp_path / "a.npy")]) == 0
    assert seen == {"layer": 5, "max_texts": 7, "max_tokens": 64, "batch_size": 32}
