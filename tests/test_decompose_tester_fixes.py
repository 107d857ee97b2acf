"""tensoralg.decompose: defects a tester found (messages, --out/--json, --k 0, d = 1)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tensoralg import decompose as dc

from netgen import rand_bilinear, rand_linear
import tensoralg as ta


def _transformer(tmp_path, name="tr"):
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.transformer import BilinearTransformer

    model = BilinearTransformer(5, 4, 1, 1, 4, n_ctx=3, seed=0)
    save_checkpoint(tmp_path / name, model)
    return str(tmp_path / name), model


# ---- 1. attention models: say plainly that decompose does not take them apart ----------------


def test_api_refuses_attention_models_by_argument_name(tmp_path):
    """eigen / chaos_coefficients_depth1 said 'bilinear depth 2', combine and difference raised
    AttributeError ('BilinearAttention' object has no attribute 'layers'), check_decomposition
    and as_bilinear_depth1 TypeError 'unknown layer type', paths the block message above."""
    _, model = _transformer(tmp_path)
    n = model.to_network()
    v = ta.Sequential([rand_linear(np.random.default_rng(0), 5, 4)])
    cases = [(lambda: dc.eigen(n, 0), "model"),
             (lambda: dc.chaos_coefficients_depth1(n), "net"),
             (lambda: dc.as_bilinear_depth1(n), "net"),
             (lambda: dc.paths(n), "model"),
             (lambda: dc.path_similarity(v, n), "b"),
             (lambda: dc.combine([v, n]), r"networks\[1\]"),
             (lambda: dc.difference(n, n), "a"),
             (lambda: dc.check_decomposition(v, [n]), r"components\[0\]")]
    for fn, name in cases:
        with pytest.raises(ValueError, match=rf"^{name}: a sequence model \(it holds attention"
                                             rf".*takes apart vector networks only.*"
                                             rf"ta\.similarity"):
            fn()


# ---- 5. Python API messages ------------------------------------------------------------------
def test_float_output_is_named_as_not_a_class_index():
    """eigen(m, output=9.0) said 'direction vector must have shape (10,) ... got shape ()'."""
    rng = np.random.default_rng(1)
    net = ta.Sequential([rand_linear(rng, 4, 3), ta.Residual(rand_bilinear(rng, 3, 2, 3)),
                         rand_linear(rng, 3, 10)])
    for bad, shown in ((9.0, "9.0"), (np.float64(2.0), "2.0"), (float("nan"), "nan")):
        with pytest.raises(ValueError, match=r"^output: expected an int class index \(0\.\.9\) "
                                             r"or a direction vector of shape \(10,\), got "
                                             + shown + "$"):
            dc.eigen(net, output=bad)
    assert dc.eigen(net, output=9).output == 9   # an int still works


def test_combine_names_the_bad_coefficient():
    """combine([m, o], [1, nan]) said 'weight: 100 non-finite entries', naming an internal
    weight tensor instead of the coefficient."""
    rng = np.random.default_rng(2)
    m, o = rand_bilinear(rng, 4, 3, 2), rand_bilinear(rng, 4, 3, 2)
    for bad, shown in ((float("nan"), "nan"), (float("inf"), "inf"), ("a", "'a'"),
                       (None, "None"), ([1.0], r"\[1\.0\]")):
        with pytest.raises(ValueError, match=r"^coefficients\[1\]: expected a finite number, "
                                             r"got " + shown + "$"):
            dc.combine([m, o], [1, bad])
    ok = dc.combine([m, o], [1, np.float32(0.5)])
    assert ta.norm(ok) > 0
