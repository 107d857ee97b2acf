"""Downstream evaluation (tensoralg.sae.evaluation): the spliced model's next-token loss, zero
ablation, "CE loss recovered" and KL, checked against a forward pass of the bilinear
transformer written out by hand with the SAE applied in it, and cross-entropy / KL written in
numpy float64 (1e-12 relative); invariants (a perfect SAE recovers everything, an SAE that
outputs zeros nothing); any module through a hook; the errors."""

import numpy as np
import pytest
import torch
from torch import nn

from tensoralg.sae.evaluation import evaluate_spliced, evaluate_transformer
from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.transformer import BilinearTransformer

V, D, T = 11, 8, 6


def _model():
    return BilinearTransformer(V, D, 2, 2, 4, 12, n_ctx=T, rope=10000.0, seed=3,
                               dtype="float64").eval()


def _tokens(n=10, seed=0):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def _sae(activation="abstopk", k=3, m=16, seed=1):
    return SparseAutoencoder(SAEConfig(D, m, k, activation=activation, dtype="float64"),
                             seed=seed)


def _by_hand(model, sae, layer, tokens):
    """logits of the clean, spliced and zero-ablated model: the blocks' forward written out,
    the residual stream replaced before block `layer` (after the last block for the final)."""
    def run(replace):
        with torch.no_grad():
            h = model.embed[tokens]
            ms, rot = model._mask_scale(T, h)
            for i in range(2):
                if i == layer:
                    h = replace(h)
                h = h + model.attn[i](h, ms, rot)
                h = h + model.mlp[i](h)
            if layer == 2:
                h = replace(h)
            return (h @ model.unembed.T).numpy()
    return (run(lambda h: h), run(lambda h: sae(h.reshape(-1, D)).reshape(h.shape)),
            run(torch.zeros_like))


def _log_softmax(a):
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_metrics_match_a_hand_written_forward(layer):
    model, sae, tokens = _model(), _sae(), _tokens()
    with torch.no_grad():
        sae.b_dec.normal_(generator=torch.Generator().manual_seed(5))
    res = evaluate_transformer(model, sae, layer, tokens, batch_size=3)
    clean, spl, zero = _by_hand(model, sae, layer, tokens)
    tgt = tokens[:, 1:].numpy().reshape(-1)
    lp = {k: _log_softmax(v[:, :-1].reshape(-1, V)) for k, v in
          (("clean", clean), ("spl", spl), ("zero", zero))}
    ce = {k: -v[np.arange(len(tgt)), tgt].mean() for k, v in lp.items()}
    kl = {k: (np.exp(lp["clean"]) * (lp["clean"] - lp[k])).sum(-1).mean() for k in ("spl", "zero")}
    rel = dict(rel=1e-12, abs=1e-14)
    assert res["loss_clean"] == pytest.approx(ce["clean"], **rel)
    assert res["loss_spliced"] == pytest.approx(ce["spl"], **rel)
    assert res["loss_zero"] == pytest.approx(ce["zero"], **rel)
    assert res["kl_spliced"] == pytest.approx(kl["spl"], **rel)
    assert res["kl_zero"] == pytest.approx(kl["zero"], **rel)
    assert res["ce_loss_recovered"] == pytest.approx(
        (ce["zero"] - ce["spl"]) / (ce["zero"] - ce["clean"]), rel=1e-10)
    assert res["n_tokens"] == 10 * (T - 1) and res["n_rows"] == 10 * T and res["layer"] == layer
    assert res["l0"] == 3.0
    # fvu of the SAE on the rows it saw, from the residual stream read by the hook
    from tensoralg.sae.transformer_acts import residual_stream_at
    x = residual_stream_at(model, tokens, layer).reshape(-1, D)
    with torch.no_grad():
        want = float(((x - sae(x)) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
        xh = sae(x)
    assert res["fvu"] == pytest.approx(want, rel=1e-10)
    # shrinkage: L2 ratio and the relative reconstruction bias (Gated-SAE paper eq. 10) in numpy
    xn, hn = x.numpy(), xh.numpy()
    ratio = np.linalg.norm(hn, axis=1) / np.linalg.norm(xn, axis=1)
    assert res["l2_ratio"] == pytest.approx(ratio.mean(), rel=1e-12)
    gamma = (hn ** 2).sum() / (xn * hn).sum()
    assert res["relative_reconstruction_bias"] == pytest.approx(gamma, rel=1e-12)
    # gamma minimizes sum |x_hat / g - x|^2 over g
    def loss(g):
        return ((hn / g - xn) ** 2).sum()
    assert loss(gamma) <= min(loss(gamma * 1.001), loss(gamma / 1.001))


def _identity_sae():
    """AbsTopK with k = d_sae = d_in, W_enc = W_dec = I: x_hat = x exactly."""
    sae = SparseAutoencoder(SAEConfig(D, D, D, activation="abstopk", dtype="float64"), seed=0)
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(D, dtype=torch.float64))
        sae.W_dec.copy_(torch.eye(D, dtype=torch.float64))
    return sae


def test_perfect_and_zero_saes_bound_the_recovered_loss():
    model, tokens = _model(), _tokens()
    perfect = evaluate_transformer(model, _identity_sae(), 1, tokens)
    assert perfect["loss_spliced"] == perfect["loss_clean"] and perfect["kl_spliced"] == 0.0
    assert perfect["ce_loss_recovered"] == 1.0 and perfect["fvu"] == 0.0
    assert perfect["l2_ratio"] == pytest.approx(1.0, rel=1e-14)
    assert perfect["relative_reconstruction_bias"] == pytest.approx(1.0, rel=1e-14)
    dead = _identity_sae()
    with torch.no_grad():
        dead.W_dec.zero_()
    zero = evaluate_transformer(model, dead, 1, tokens)
    assert zero["loss_spliced"] == zero["loss_zero"] and zero["ce_loss_recovered"] == 0.0
    assert zero["kl_spliced"] == zero["kl_zero"] > 0
    # x_hat = b_dec = 0: ratio 0, and the bias undefined (0/0), not NaN
    assert zero["l2_ratio"] == 0.0 and zero["relative_reconstruction_bias"] is None


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.body = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, V)

    def forward(self, tokens):
        return self.head(self.body(self.emb(tokens)))


def test_any_module_through_a_hook():
    lm = TinyLM().double()
    tokens = _tokens(8)
    res = evaluate_spliced(lm, _identity_sae(), "body", [tokens[:4], tokens[4:]])
    assert res["ce_loss_recovered"] == 1.0 and res["kl_spliced"] == 0.0
    sae = _sae(activation="topk", k=2)
    res = evaluate_spliced(lm, sae, "body.0", [tokens], point="input")
    with torch.no_grad():
        e = lm.emb(tokens)
        logits = lm.head(lm.body(sae(e.reshape(-1, D)).reshape(e.shape)))
        lp = torch.log_softmax(logits[:, :-1], -1).reshape(-1, V)
        want = float(-lp[torch.arange(lp.shape[0]), tokens[:, 1:].reshape(-1)].mean())
    assert res["loss_spliced"] == pytest.approx(want, rel=1e-12)


def test_errors_before_work():
    lm = TinyLM().double()
    with pytest.raises(ValueError, match=r"'bdy' is not a submodule of TinyLM .*nearest: "
                                         r"\['body'"):
        evaluate_spliced(lm, _sae(), "bdy", [_tokens()])
    with pytest.raises(ValueError, match=r"sae: d_in=8 \(.*SAE.*\), but the activation at 'head' has shape"):
        evaluate_spliced(lm, _sae(), "head", [_tokens()])
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[0, 2\]"):
        evaluate_transformer(_model(), _sae(), 3, _tokens())
    with pytest.raises(ValueError, match=r"tokens: expected \(n_windows, T >= 2\)"):
        evaluate_transformer(_model(), _sae(), 1, _tokens()[:, :1])
    with pytest.raises(ValueError, match="no predicted tokens"):
        evaluate_spliced(lm, _sae(), "body", [])


def test_nan_activation_is_refused():
    lm = TinyLM().double()
    with torch.no_grad():
        lm.emb.weight[3, 0] = float("nan")
    tokens = _tokens()
    tokens[0, 0] = 3
    with pytest.raises(ValueError, match=r"the activation at 'body' has NaN or inf"):
        evaluate_spliced(lm, _sae(), "body", [tokens])


def _support_and_rows(sae, x):
    """The most common support of the SAE's codes on rows x, and those rows."""
    with torch.no_grad():
        z = sae.encode(x)
    sup = [tuple(torch.nonzero(r).flatten().tolist()) for r in z]
    best = max(set(sup), key=sup.count)
    return list(best), x[[s == best for s in sup]]


@pytest.mark.parametrize("activation", ["abstopk", "topk"])
def test_fixed_support_map_is_the_sae_on_that_support(activation):
    sae = _sae(activation=activation, k=2, m=5)
    with torch.no_grad():
        sae.b_enc.normal_(generator=torch.Generator().manual_seed(2))
        sae.b_dec.normal_(generator=torch.Generator().manual_seed(3))
    x = torch.randn(4000, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    S, rows = _support_and_rows(sae, x)
    assert rows.shape[0] > 10
    from tensoralg.sae.evaluation import fixed_support_map
    A, c = fixed_support_map(sae, S)
    with torch.no_grad():
        torch.testing.assert_close(rows @ A + c, sae(rows), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"support: expected distinct latent indices"):
        fixed_support_map(sae, [0, 0])


def test_spliced_network_similarity_is_exact_for_one_attention_block():
    """A one-block attention-only transformer: the spliced network's forward equals the torch
    model with the fixed-support map spliced in, and its exact Gaussian similarity to the
    original agrees with Monte Carlo (within 4 standard errors); an identity SAE gives 1."""
    import tensoralg
    from tensoralg.sae.evaluation import fixed_support_map, spliced_network
    from tensoralg.sae.hooks import spliced
    model = BilinearTransformer(V, 6, 1, 1, 3, None, n_ctx=3, rope=None, seed=0,
                                dtype="float64").eval()
    sae = SparseAutoencoder(SAEConfig(6, 10, 3, activation="abstopk", dtype="float64"), seed=2)
    S = [1, 4, 7]
    net = spliced_network(model, sae, 0, S)
    A, c = fixed_support_map(sae, S)
    h = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad(), spliced(model, "hook_resid.0", lambda a: a @ A + c):
        want = model.forward_residual(h).numpy()
    np.testing.assert_allclose(net(h.numpy()), want, rtol=1e-12, atol=1e-12)
    orig = model.to_network()
    exact = tensoralg.similarity(orig, net)
    mc = tensoralg.similarity(orig, net, method="montecarlo", n_samples=20000, seed=0)
    assert abs(exact - float(mc)) <= 4 * mc.stderr + 1e-12 and -1 < exact < 1
    ident = SparseAutoencoder(SAEConfig(6, 6, 6, activation="abstopk", dtype="float64"))
    with torch.no_grad():
        ident.W_enc.copy_(torch.eye(6, dtype=torch.float64))
        ident.W_dec.copy_(torch.eye(6, dtype=torch.float64))
    same = spliced_network(model, ident, 1, list(range(6)))
    assert tensoralg.similarity(orig, same) == pytest.approx(1.0, abs=1e-12)


def test_spliced_network_of_a_deeper_model_is_refused_as_too_costly():
    import tensoralg
    from tensoralg.errors import CostTooHigh
    from tensoralg.sae.evaluation import spliced_network
    model = _model()
    net = spliced_network(model, _sae(), 1, [0, 3, 5])
    with pytest.raises(CostTooHigh, match="method='closure'"):
        tensoralg.similarity(model.to_network(), net)


def test_sae_evaluate_command(tmp_path):
    """`sae evaluate` (registered by cli.add_evaluate_parser): the layer from the SAE's
    metadata, the last 20 % of the seeded held-out windows, the same numbers as
    evaluate_transformer on those windows."""
    import argparse
    import json as _json

    from tensoralg.audit.language import eval_windows
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.corpus import VOCAB, load_corpus
    from tensoralg.sae.cli import add_evaluate_parser
    from tensoralg.sae.formats import save_sae
    model = BilinearTransformer(len(VOCAB), 8, 2, 2, 4, 12, n_ctx=6, seed=1).eval()
    save_checkpoint(tmp_path / "ck", model, step=0)
    sae = SparseAutoencoder(SAEConfig(8, 16, 3, activation="topk"), seed=0)
    save_sae(tmp_path / "sae", sae, metadata={"hook_name": "hook_resid.1"})
    top = argparse.ArgumentParser()
    add_evaluate_parser(top.add_subparsers(dest="sae_command"))
    args = top.parse_args(["evaluate", "--sae", str(tmp_path / "sae"), "--checkpoint",
                           str(tmp_path / "ck"), "--chars", "30000", "--no-progress",
                           "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    got = _json.loads((tmp_path / "r.json").read_text())
    corpus = load_corpus(30000)
    count = len(corpus.held_out) // 6
    W = eval_windows(corpus.held_out, 6, count)[np.random.default_rng(0).permutation(count)]
    n_eval = round(0.2 * count)
    want = evaluate_transformer(model, sae, 1, torch.as_tensor(W[count - n_eval:]))
    assert got["layer"] == 1 and got["n_windows"] == n_eval
    for key in ("loss_clean", "loss_spliced", "loss_zero", "kl_spliced", "fvu"):
        assert got[key] == want[key], key
    save_sae(tmp_path / "nohook", sae)
    args = top.parse_args(["evaluate", "--sae", str(tmp_path / "nohook"), "--checkpoint",
                           str(tmp_path / "ck")])
    with pytest.raises(ValueError, match="--layer: required"):
        args.func(args)
    # a --layer that contradicts the recorded hook is refused naming both (was: exit 0, the SAE
    # spliced where it was not trained); the same layer, or none recorded, is accepted
    args = top.parse_args(["evaluate", "--sae", str(tmp_path / "sae"), "--checkpoint",
                           str(tmp_path / "ck"), "--layer", "2"])
    with pytest.raises(ValueError, match=r"^--layer: 2 splices at hook_resid.2, but the SAE .*sae "
                                         r"was trained on hook_name='hook_resid.1'"):
        args.func(args)
    args = top.parse_args(["evaluate", "--sae", str(tmp_path / "sae"), "--checkpoint",
                           str(tmp_path / "ck"), "--layer", "1", "--chars", "30000",
                           "--no-progress", "--json", str(tmp_path / "r1.json")])
    assert args.func(args) == 0
    assert _json.loads((tmp_path / "r1.json").read_text())["loss_spliced"] == got["loss_spliced"]
