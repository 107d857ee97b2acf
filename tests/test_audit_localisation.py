"""Per-class behavioural baselines (`tensoralg.baselines.per_class_baselines`) and the
localisation rule the backdoor and forgetting audits apply to tensor similarity and to each
baseline alike (`tensoralg.audit.common.localisation`)."""

import math

import numpy as np
import pytest
import torch

from tensoralg.audit.common import compare_localisation, localisation
from tensoralg.baselines import per_class_baselines


def _nets():
    from tensoralg.nn import BilinearNet

    return (BilinearNet(6, 3, d_model=5, d_hidden=4, seed=0),
            BilinearNet(6, 3, d_model=5, d_hidden=4, seed=1))


def test_per_class_baselines_by_hand():
    a, b = _nets()
    X = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    y = np.arange(40) % 3
    res = per_class_baselines(a, b, X, y)
    with torch.no_grad():
        la, lb = a(X).double().numpy(), b(X).double().numpy()   # the models' own dtype
    pa = np.exp(la) / np.exp(la).sum(1, keepdims=True)
    pb = np.exp(lb) / np.exp(lb).sum(1, keepdims=True)
    for c in range(3):
        m = y == c
        cos = [u @ v / np.linalg.norm(u) / np.linalg.norm(v) for u, v in zip(la[m], lb[m])]
        pcos = [u @ v / np.linalg.norm(u) / np.linalg.norm(v) for u, v in zip(pa[m], pb[m])]
        assert res["logit_cosine"][c] == pytest.approx(np.mean(cos), rel=1e-9)
        assert res["prob_cosine"][c] == pytest.approx(np.mean(pcos), rel=1e-9)
        assert res["accuracy_a"][c] == pytest.approx(np.mean(la[m].argmax(1) == c))
        assert res["agreement"][c] == pytest.approx(np.mean(la[m].argmax(1) == lb[m].argmax(1)))
        col = la[:, c] @ lb[:, c] / np.linalg.norm(la[:, c]) / np.linalg.norm(lb[:, c])
        assert res["output_slice_cosine"][c] == pytest.approx(col, rel=1e-9)


def test_per_class_baselines_bad_labels_and_empty_class():
    a, b = _nets()
    X = torch.randn(6, 6)
    with pytest.raises(ValueError, match=r"y: labels must lie in 0..2"):
        per_class_baselines(a, b, X, np.array([0, 1, 2, 3, 0, 1]))
    with pytest.raises(ValueError, match=r"y: expected \(6,\) labels"):
        per_class_baselines(a, b, X, np.array([0, 1]))
    res = per_class_baselines(a, b, X, np.array([0, 0, 1, 1, 0, 1]))   # no class 2
    assert math.isnan(res["logit_cosine"][2]) and math.isfinite(res["output_slice_cosine"][2])


def test_localisation_rule():
    # target lowest, gap 0.4 against a spread of 0.05 among the others: separation 8
    d = localisation([0.90, 0.95, 0.50], 2)
    assert d["localises"] and d["separation"] == pytest.approx(8.0)
    assert d["lowest_class"] == 2 and d["next_lowest_class"] == 0
    # lowest, but the gap (0.05) is smaller than the others' spread (0.5): does not localise
    d = localisation([0.40, 0.90, 0.35], 2)
    assert not d["localises"] and d["separation"] == pytest.approx(0.1)
    # not the lowest: negative separation
    d = localisation([0.5, 0.9, 0.8], 2)
    assert not d["localises"] and d["separation"] < 0 and d["lowest_class"] == 0
    # the other classes all equal: any positive gap stands apart (infinite separation)
    assert localisation([1.0, 1.0, 0.0], 2)["separation"] == math.inf
    assert not localisation([1.0, 1.0, 1.0], 2)["localises"]       # a tie is not localised
    # Monte Carlo: the gap must also exceed 2 standard errors
    assert not localisation([0.90, 0.95, 0.50], 2, stderr=[0.2, 0.2, 0.2])["localises"]
    assert localisation([0.90, 0.95, 0.50], 2, stderr=[0.01, 0.01, 0.01])["localises"]
    assert localisation([0.9, float("nan"), 0.5], 2)["assessed"] is False


def test_compare_localisation_verdicts():
    yes, no = localisation([0.9, 0.95, 0.5], 2), localisation([0.5, 0.9, 0.8], 2)
    c = compare_localisation(yes, {"x": no, "y": yes})
    assert c["verdicts"] == {"x": "better", "y": "equally (both localise)"}
    assert c["counts"] == {"better": 1, "equally": 1, "worse": 0, "not assessed": 0}
    c = compare_localisation(no, {"x": yes, "y": no})
    assert c["verdicts"] == {"x": "worse", "y": "equally (neither localises)"}
    assert "worse than 1 of 2" in c["statement"]
