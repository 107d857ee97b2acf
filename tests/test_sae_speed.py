"""The fast top-k selection and support bookkeeping give exactly today's results.

References (independent, slower definitions): ``select_topk_sort`` — a full stable descending
sort; ``unique_rows_reference`` — ``torch.unique(dim=0)``; supports of codes — the selection of
the ``k`` largest ``|z|``.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tensoralg.sae import models
from tensoralg.sae.models import (SparseAutoencoder, code_supports, select_topk,
                                  select_topk_sort, unique_rows, unique_rows_reference)
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
