"""The fast top-k selection and support bookkeeping give exactly today's results.

References (independent, slower definitions): ``select_topk_sort`` — a full stable descending
sort; ``unique_rows_reference`` — ``torch.unique(dim=0)``; supports of codes — the selection of
the ``k`` largest ``|z|``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoralg.sae import models
from tensoralg.sae.models import (
    SparseAutoencoder,
    code_supports,
    select_topk,
    select_topk_sort,
    unique_rows,
    unique_rows_reference,
)
from tensoralg.sae.presets import make_config


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 20), m=st.integers(2, 24),
       levels=st.integers(1, 5), data=st.data())
def test_select_topk_equals_the_stable_sort_on_ties(seed, n, m, levels, data):
    k = data.draw(st.integers(1, m))
    g = torch.Generator().manual_seed(seed)
    # few distinct values: ties inside the top k, at its boundary, and whole tied rows
    s = torch.randint(-levels, levels + 1, (n, m), generator=g).double()
    assert torch.equal(select_topk(s, k), select_topk_sort(s, k))
    assert torch.equal(select_topk(s.float(), k), select_topk_sort(s.float(), k))
    # unordered: the same set per row
    assert torch.equal(select_topk(s, k, ordered=False).sort(-1).values,
                       select_topk_sort(s, k).sort(-1).values)


def test_select_topk_constructed_ties_nan_and_inf():
    s = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0],          # boundary tie: lower indices win
                      [5.0, 4.0, 3.0, 2.0, 1.0],          # no tie: plain order
                      [2.0, 2.0, 9.0, 2.0, 2.0],          # tie below the max
                      [float("nan"), 1.0, float("nan"), 1.0, 0.0],
                      [float("-inf")] * 3 + [0.0, float("-inf")]])
    want = [[1, 2], [0, 1], [2, 0], [0, 2], [3, 0]]
    assert select_topk(s, 2).tolist() == want
    assert torch.equal(select_topk(s, 2), select_topk_sort(s, 2))
    for k in (1, 3, 4, 5):
        assert torch.equal(select_topk(s, k), select_topk_sort(s, k))
    with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 5"):
        select_topk(s, 6)
    with pytest.raises(ValueError, match=r"k: expected"):
        select_topk(s, 0)


def test_unique_rows_equals_torch_unique():
    g = torch.Generator().manual_seed(0)
    for n, k, hi in ((1, 3, 5), (50, 2, 3), (300, 4, 6), (200, 8, 256)):
        rows = torch.randint(0, hi, (n, k), generator=g)
        rows = torch.cat([rows, rows[: n // 3]])          # guaranteed duplicates
        assert torch.equal(unique_rows(rows), unique_rows_reference(rows))


def test_code_supports_equal_the_selection_as_sets():
    g = torch.Generator().manual_seed(1)
    z = models.abstopk(torch.randn(40, 12, generator=g), 3)
    assert torch.equal(code_supports(z, 3).sort(1).values, select_topk(z.abs(), 3).sort(1).values)
    z[0] = 0.0                                            # a row with fewer than k non-zeros
    z[1, z[1] != 0] = 0.0
    assert torch.equal(code_supports(z, 3).sort(1).values, select_topk(z.abs(), 3).sort(1).values)


@pytest.mark.parametrize("preset", ["topk", "isae-me"])
def test_training_loss_identical_to_the_reference_paths(preset, monkeypatch):
    cfg = make_config(preset, 8, 24, 3, dtype="float64")
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = torch.round(x, decimals=1)              # ties in the pre-activations are likelier
    dead = torch.zeros(24, dtype=torch.bool)
    dead[::3] = True

    def run():
        sae = SparseAutoencoder(cfg, seed=5)
        parts = sae.loss(x, dead)
        parts["loss"].backward()
        return parts, {n: p.grad.clone() for n, p in sae.named_parameters()}

    fast, g_fast = run()
    monkeypatch.setattr(models, "select_topk", lambda s, k, ordered=True: select_topk_sort(s, k))
    monkeypatch.setattr(models, "unique_rows", unique_rows_reference)
    monkeypatch.setattr(models, "code_supports", lambda z, k: select_topk_sort(z.detach().abs(), k))
    ref, g_ref = run()
    for key in ("loss", "recon", "rip", "aux", "z"):
        assert torch.equal(fast[key], ref[key]), key
    for n in g_fast:
        assert torch.equal(g_fast[n], g_ref[n]), n


def _dense_reference_loss(sae, x, dead):
    """The loss written with dense codes (``activation(pre)`` and ``z @ W_dec``), the form the
    sparse ``embedding_bag`` path replaces."""
    cfg = sae.cfg
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    z = sae.activation(pre)
    if cfg.encoder == "multistep":
        for _ in range(cfg.n_steps):
            z = sae.activation(z + (x - sae.b_dec - z @ sae.W_dec) @ sae.step_matrix())
    x_hat = z @ sae.W_dec + sae.b_dec
    recon = ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    total = recon
    if cfg.rip != "none":
        total = total + cfg.rip_beta * models.rip_penalty(
            sae.W_dec, select_topk_sort(z.detach().abs(), cfg.k), cfg.rip, cfg.rip_delta,
            cfg.rip_max_supports)
    score = (pre.abs() if cfg.activation == "abstopk" else pre).masked_fill(~dead, float("-inf"))
    idx = select_topk_sort(score, min(cfg.k_aux, int(dead.sum())))
    vals = pre.gather(-1, idx)
    vals = torch.relu(vals) if cfg.activation == "topk" else vals
    z_aux = torch.zeros_like(pre).scatter(-1, idx, vals)
    resid = (x - x_hat).detach()
    aux = ((resid - z_aux @ sae.W_dec) ** 2).sum() / (resid ** 2).sum()
    return total + cfg.auxk_alpha * aux, z


@pytest.mark.parametrize("preset,n", [("topk", 64), ("abstopk", 64), ("isae-me", 64),
                                      ("isae-me", 2)])
def test_sparse_decoding_path_equals_the_dense_codes(preset, n, monkeypatch):
    """embedding_bag decoding (k atoms per row) = dense ``z @ W_dec``: loss, codes and every
    gradient to 1e-12 relative in float64. The multi-step encoder takes its ``W_dec Γ`` form at
    n=64 (5·64·(8·24 + 3·8) = 69,120 multiply-adds per call the plain way, 64·8·24 + 24·8·24 +
    5·64·3·24 = 39,936 that way) and the plain ``(x - b_dec - z W_dec) Γ`` form at n=2
    (2,160 against 5,712); the weights that embedding_bag sums tell which ran."""
    import torch.nn.functional as F
    real_bag, seen = F.embedding_bag, []

    def spy(idx, weight, *a, **kw):
        seen.append(tuple(weight.shape))
        return real_bag(idx, weight, *a, **kw)

    monkeypatch.setattr(models.F, "embedding_bag", spy)
    cfg = make_config(preset, 8, 24, 3, dtype="float64")
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    dead = torch.zeros(24, dtype=torch.bool)
    dead[1::4] = True
    a, b = SparseAutoencoder(cfg, seed=7), SparseAutoencoder(cfg, seed=7)
    with torch.no_grad():              # non-trivial biases so that every term is exercised
        for m in (a, b):
            m.b_dec.copy_(0.1 * x.mean(0))
            m.b_enc.copy_(0.01 * torch.arange(24, dtype=torch.float64))
    parts = a.loss(x, dead)
    parts["loss"].backward()
    ref_loss, ref_z = _dense_reference_loss(b, x, dead)
    ref_loss.backward()
    assert torch.equal(parts["z"] != 0, ref_z != 0)
    torch.testing.assert_close(parts["z"], ref_z, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(parts["loss"], ref_loss, rtol=1e-12, atol=0)
    assert float(parts["aux"]) > 0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-12, atol=1e-14, msg=name)
    if preset == "isae-me":
        assert ((24, 24) in seen) == (n == 64), seen
    torch.testing.assert_close(a.encode(x), ref_z.detach(), rtol=1e-12, atol=1e-14)
