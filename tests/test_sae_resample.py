"""Decoder initialization from data and dead/duplicate-latent resampling (issue 13, item 6)."""

import pytest
import torch

from tensoralg.sae.models import SAEConfig, SparseAutoencoder
from tensoralg.sae.presets import make_config
from tensoralg.sae.synthetic import make_synthetic
from tensoralg.sae.training import TrainConfig, _Stepper, train


@pytest.fixture(scope="module")
def syn():
    return make_synthetic(1024, 8, 12, 2, seed=0)


def test_decoder_init_from_samples():
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sae = SparseAutoencoder(SAEConfig(4, 6, 2, encoder="multistep", step_size=0.5,
                                      dtype="float64"), seed=0)
    sae.init_b_dec(x)
    sae.init_from_samples_(x)
    want = (x[:6] - x.mean(0)) / (x[:6] - x.mean(0)).norm(dim=1, keepdim=True)
    torch.testing.assert_close(sae.W_dec, want, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(sae.W_enc, want.T, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(sae.W_step, 0.5 * want.T, rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="at least d_sae=6 rows, got 5"):
        sae.init_from_samples_(x[:5])


def test_train_with_decoder_init_data_starts_from_samples(syn):
    cfg = make_config("abstopk", 8, 12, 2)
    m0, _ = train(syn.x, cfg, TrainConfig(steps=0, batch_size=64, decoder_init="data"))
    r0, _ = train(syn.x, cfg, TrainConfig(steps=0, batch_size=64))
    # every atom of the data-initialized SAE is the direction of a training row minus b_dec
    dirs = syn.x.double() - m0.b_dec.detach().double()
    cos = (m0.W_dec.detach().double() @ (dirs / dirs.norm(dim=1, keepdim=True)).T).abs()
    assert bool((cos.max(dim=1).values > 1 - 1e-6).all())
    assert not bool(((r0.W_dec.detach().double() @ (dirs / dirs.norm(dim=1, keepdim=True)).T)
                     .abs().max(dim=1).values > 1 - 1e-6).any())
    with pytest.raises(ValueError, match="decoder_init: expected one of"):
        TrainConfig(decoder_init="zeros")


def test_resample_points_dead_and_duplicate_latents_at_residuals(syn):
    cfg = make_config("topk", 8, 12, 2, dtype="float64")
    x = syn.x.double()
    model = SparseAutoencoder(cfg, seed=0)
    model.init_b_dec(x)
    with torch.no_grad():
        model.b_enc[3] = -1e3                       # latent 3 never fires (dead)
        model.W_dec[7] = model.W_dec[5]            # latent 7 duplicates latent 5
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tc = TrainConfig(steps=10, batch_size=64, resample_every=2, resample_duplicates=0.99,
                     resample_pool=256)
    run = _Stepper(model, opt, cfg, tc, torch.zeros(12, dtype=torch.long), 10**6, 1.0, 0.0,
                   pool=lambda step: x[:256])
    run.step(x[:64], 0)
    fired = run.fires_since_resample.clone()
    assert fired[3] == 0
    before = model.W_dec.detach().clone()
    run.step(x[64:128], 1)                          # step 2 ends: resampling
    changed = sorted(torch.nonzero((model.W_dec.detach() != before).any(dim=1) &
                                   ((model.W_dec.detach() - before).abs().max(dim=1).values > 1e-2))
                     .squeeze(-1).tolist())
    assert 3 in changed and (7 in changed or 5 in changed) and run.resampled >= 2
    # each resampled atom is a unit residual direction of a pool row; b_enc 0; moments reset
    with torch.no_grad():
        # (the weights here are those after the step-2 update, then the resampling)
        assert abs(float(model.W_dec[3].norm()) - 1) < 1e-12 and float(model.b_enc[3]) == 0.0
        assert float(opt.state[model.W_dec]["exp_avg"][3].abs().sum()) == 0.0
        assert float(opt.state[model.W_enc]["exp_avg_sq"][:, 3].abs().sum()) == 0.0
    assert int(run.fires_since_resample.sum()) == 0


def test_resample_residual_directions_exactly(syn):
    """The new atom is the normalized residual of a pool row: recompute it from the model."""
    cfg = make_config("abstopk", 8, 12, 2, dtype="float64")
    x = syn.x.double()[:64]
    model = SparseAutoencoder(cfg, seed=1)
    model.init_b_dec(x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tc = TrainConfig(steps=10, batch_size=64, resample_every=1)
    run = _Stepper(model, opt, cfg, tc, torch.zeros(12, dtype=torch.long), 10**6, 1.0, 0.0,
                   pool=lambda step: x)
    run.fires_since_resample[:] = 1
    run.fires_since_resample[[2, 9]] = 0
    with torch.no_grad():
        resid = x - model(x)
    assert run.resample(0) == 2
    unit = resid / resid.norm(dim=1, keepdim=True)
    for j in (2, 9):
        assert float((unit @ model.W_dec[j].detach()).max()) > 1 - 1e-12


def test_resume_with_resampling_is_bit_identical(syn, tmp_path):
    cfg = make_config("abstopk", 8, 12, 2)
    tc = dict(batch_size=100, seed=1, resample_every=5, resample_duplicates=0.3)
    full, hist = train(syn.x, cfg, TrainConfig(steps=24, **tc), out=tmp_path / "full")
    assert hist[-1]["resampled"] > 0
    train(syn.x, cfg, TrainConfig(steps=12, **tc), out=tmp_path / "half")
    resumed, _ = train(syn.x, cfg, TrainConfig(steps=24, **tc), out=tmp_path / "half",
                       resume=tmp_path / "half")
    for k, v in full.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_multistep_start_trains_the_single_step_encoder_first(syn):
    cfg = make_config("isae-me", 8, 12, 2, n_steps=2)
    init = SparseAutoencoder(cfg, seed=0)
    late, _ = train(syn.x, cfg, TrainConfig(steps=6, batch_size=64, multistep_start=6))
    on, _ = train(syn.x, cfg, TrainConfig(steps=6, batch_size=64))
    assert torch.equal(late.W_step, init.W_step)          # no refinement ran: Γ got no gradient
    assert not torch.equal(on.W_step, init.W_step)
    assert late.refine_steps is None                       # the returned SAE runs its T steps
    # before multistep_start the training is exactly that of the single-step encoder
    single = make_config("isae-me", 8, 12, 2, n_steps=0)
    s, _ = train(syn.x, single, TrainConfig(steps=6, batch_size=64))
    for k in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(late, k), getattr(s, k)), k
