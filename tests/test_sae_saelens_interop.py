"""Folders written here, read by SAELens itself (skipped where SAELens is not installed; it is
not a dependency of tensoralg or its tests — run with SAELens installed, e.g. in the separate
environment of tests/fixtures/saelens/README.md):

* single-step TopK / AbsTopK folders load in SAELens with the same codes and reconstructions,
  and SAELens -> save_model -> tensoralg is bit-identical in the tensors;
* a multi-step (iSAE-ME) folder is refused by SAELens (never read as a single-step SAE);
  after ``tensoralg.sae.saelens_compat.register()`` it loads with the multi-step codes.
"""

import json

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

from tensoralg.sae.formats import SAE_WEIGHTS_FILE, load_sae, save_sae  # noqa: E402
from tensoralg.sae.models import SparseAutoencoder  # noqa: E402
from tensoralg.sae.presets import make_config  # noqa: E402

RTOL32 = 8 * 1.1920929e-07      # a few float32 roundings of the same sums (as test_sae_formats)


def _model(preset, **kw):
    model = SparseAutoencoder(make_config(preset, 6, 16, 3, **kw), seed=4)
    with torch.no_grad():
        model.b_enc.normal_(generator=torch.Generator().manual_seed(1))
        model.b_dec.normal_(generator=torch.Generator().manual_seed(2))
        model.W_dec.mul_(torch.linspace(0.5, 2.0, 16)[:, None])   # rows of any norm
    model.metadata = {"model_name": "m", "hook_name": "blocks.1"}
    return model


def _x(n=200):
    return 2 * torch.randn(n, 6, generator=torch.Generator().manual_seed(7))


def _close(a, b):
    return float((a - b).abs().max()) <= RTOL32 * float(b.abs().max())


@pytest.mark.parametrize("preset", ["topk", "abstopk"])
def test_single_step_folders_load_in_saelens_with_the_same_function(tmp_path, preset):
    model = _model(preset)
    save_sae(tmp_path / "s", model)
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path / "s"))
    assert theirs.cfg.architecture() == preset and theirs.cfg.k == 3
    assert theirs.cfg.metadata.hook_name == "blocks.1"
    x = _x()
    with torch.no_grad():
        z, zt = model.encode(x), theirs.encode(x)
        assert torch.equal(z != 0, zt != 0) and _close(zt, z)
        assert _close(theirs.decode(zt), model.decode(z))
    # back: SAELens save_model -> tensoralg, bit-identical tensors
    theirs.save_model(str(tmp_path / "back"))
    again = load_sae(tmp_path / "back")
    for n, p in model.named_parameters():
        assert torch.equal(p, dict(again.named_parameters())[n]), n


@pytest.mark.parametrize("gamma", ["free", "diag"])
def test_multistep_folders_are_refused_then_registered(tmp_path, gamma):
    model = _model("isae-me", gamma=gamma)
    save_sae(tmp_path / "s", model)
    arch = json.loads((tmp_path / "s" / "cfg.json").read_text())["architecture"]
    from sae_lens.registry import SAE_CLASS_REGISTRY
    if arch not in SAE_CLASS_REGISTRY:      # before register() (another test may have run it)
        with pytest.raises(KeyError, match=arch):
            sae_lens.SAE.load_from_disk(str(tmp_path / "s"))
    from tensoralg.sae.saelens_compat import register
    register()
    register()                               # idempotent
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path / "s"))
    x = _x()
    with torch.no_grad():
        z, zt = model.encode(x), theirs.encode(x)
        assert torch.equal(z != 0, zt != 0) and _close(zt, z)
        assert _close(theirs(x), model(x))
        # not the single-step reading: the first pass alone gives other codes
        z0 = model.activation(model.pre_activation(x))
        assert not torch.equal(z0 != 0, z != 0)
    theirs.save_model(str(tmp_path / "back"))
    again = load_sae(tmp_path / "back")
    # the fields that define the function survive SAELens (training-only ones, e.g. rip, do not)
    for f in ("d_in", "d_sae", "k", "activation", "encoder", "n_steps", "gamma",
              "normalize_activations"):
        assert getattr(again.cfg, f) == getattr(model.cfg, f), f
    with torch.no_grad():
        assert torch.equal(again.encode(x), model.encode(x))
    for n, p in model.named_parameters():
        assert torch.equal(p, dict(again.named_parameters())[n]), n
    assert (tmp_path / "back" / SAE_WEIGHTS_FILE).is_file()
