"""verify.paths: the first-order path expansion of a tiny transformer against its polynomial,
in sympy's exact polynomial ring (gain symbols per head, output bias and MLP)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from tensoralg.verify import paths as vp

import tensoralg as ta
import tensoralg.decompose as dc


def test_two_layer_transformer_paths_equal_the_gain_expansion():
    r = vp.prove_sequence_paths(dc.paths)
    assert r.passed, r.detail
    assert r.sizes == {"n_ctx": 2, "d": 1, "blocks": 3, "paths": 7} and r.checked == 10
    # no path of the tiny model is zero (else the check would prove less)
    pd = dc.paths(vp.tiny_transformer(), n_ctx=2)
    x = np.random.default_rng(0).normal(size=(3, 2, 1))
    assert all(np.abs(net(x)).max() > 0.1 for net in pd.networks)
    assert np.abs(pd.rest(x)).max() > 0.1


def _small():
    net = vp.tiny_transformer()   # embedding, 2-head attention, MLP, unembedding
    return ta.Sequential([net.layers[0], net.layers[1], net.layers[3], net.layers[4]])


def test_a_wrong_path_or_remainder_is_caught():
    net = _small()
    pd = dc.paths(net, n_ctx=2, order=1)
    assert vp.check_sequence_paths(net, pd, n_ctx=2).passed
    nets = list(pd.networks)                     # head 1's path network doubled
    i = pd.names.index("L0.H1")
    nets[i] = ta.Sequential([nets[i], ta.Linear([[2]])])
    r = vp.check_sequence_paths(net, replace(pd, networks=nets), n_ctx=2)
    assert not r.passed and r.detail == "path 'L0.H1' differs from the coefficient of its gain"
    # the first-order sum shifted by a constant
    wrong = replace(pd, first_order=ta.Sequential([pd.first_order, ta.Linear([[1]], [1])]))
    r = vp.check_sequence_paths(net, wrong, n_ctx=2)
    assert not r.passed and r.detail.startswith("rest = model - first_order differs")


def test_other_shapes_are_refused():
    net = vp.tiny_transformer(0)
    with pytest.raises(ValueError, match=r"verify\.paths: layer 1 is BilinearAttention"):
        vp.check_sequence_paths(ta.Sequential([net.layers[0], net.layers[1].inner]), None)
