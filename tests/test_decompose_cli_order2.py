"""``tensoralg decompose CKPT --n-ctx N --order 2``: the path table with the second-order paths
(virtual heads), ``--json`` and the figure; bad ``--order`` and the budget refusal are one
line, exit 2, before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tensoralg import decompose as dc
from tensoralg.cli import main
from tensoralg.transformer import BilinearTransformer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tensoralg.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("order2")
    # d_model 2 at n_ctx 2: N = n_ctx * d = 4 input variables, within the exact budget
    save_checkpoint(root / "a", BilinearTransformer(5, 2, 2, 1, 1, None, n_ctx=4, rope=None,
                                                    seed=3, dtype="float64"))
    return root


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_order_2_table_json_and_figure(ckpt, capsys):
    js = ckpt / "r.json"
    assert main(["decompose", str(ckpt / "a"), "--n-ctx", "2", "--order", "2",
                 "--out", str(ckpt / "o"), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "first- and second-order paths at n_ctx=2" in out
    assert "L1.H0.K1\u2190L0.H0" in out and "composition" in out
    r = json.loads(js.read_text())
    assert r["config"]["order"] == 2 and r["paths"]["order"] == 2
    names = r["paths"]["names"]
    assert names[:3] == ["direct", "L0.H0", "L1.H0"]
    assert names[3:] == [f"L1.H0.{leg}\u2190L0.H0" for leg in ("Q1", "K1", "Q2", "K2", "V")]
    assert (ckpt / "o" / "decompose_paths.png").stat().st_size > 0
    assert "decompose_paths.png" in r["files"]
    # the same numbers as the library
    from tensoralg.checkpoint import load_checkpoint

    pd = dc.paths(load_checkpoint(ckpt / "a")[0].to_network(), n_ctx=2, order=2)
    np.testing.assert_array_equal(np.array(r["paths"]["gram"]), pd.gram)


@pytest.mark.parametrize("value", ["3", "0", "two", "1.5"])
def test_bad_order_is_one_line_before_work(ckpt, capsys, value):
    assert main(["decompose", str(ckpt / "a"), "--order", value,
                 "--out", str(ckpt / "x")]) == 2
    err = _err(capsys)
    assert "error: --order: expected 1 (first-order paths) or 2" in err and repr(value) in err
    assert not (ckpt / "x").exists()


def test_order_2_over_budget_names_order(ckpt, capsys, monkeypatch):
    from tensoralg.strategies.chaos import composed

    def boom(*a, **k):
        raise AssertionError("work started before the refusal")
    monkeypatch.setattr(composed, "FeatureChaos", boom)
    # n_ctx 4: N = 8 input variables, the order-9 dense tensors over budget
    assert main(["decompose", str(ckpt / "a"), "--n-ctx", "4", "--order", "2",
                 "--out", str(ckpt / "y")]) == 2
    err = _err(capsys)
    assert "error: --order: 2 at n_ctx=4 is over the exact budget" in err
    assert "N = n_ctx*d = 8" in err and "--order 1" in err


def test_order_2_with_diff_refused(ckpt, capsys):
    assert main(["decompose", str(ckpt / "a"), "--diff", str(ckpt / "a"), "--order", "2",
                 "--n-ctx", "2", "--out", str(ckpt / "z")]) == 2
    assert "error: --order: 2 with --diff" in _err(capsys)


def test_order_on_a_vector_network_refused(tmp_path, capsys):
    import tensoralg as ta
    from tensoralg.checkpoint import save_checkpoint

    rng = np.random.default_rng(0)
    save_checkpoint(tmp_path / "v", ta.Bilinear(rng.normal(size=(4, 3)), rng.normal(size=(4, 3)),
                                                rng.normal(size=(2, 4))))
    assert main(["decompose", str(tmp_path / "v"), "--order", "2",
                 "--out", str(tmp_path / "o")]) == 2
    assert "error: --order: only for transformer checkpoints" in _err(capsys)
