"""`tensoralg audit grokking` end to end at a tiny size."""

import json

import numpy as np
import pytest

from tensoralg.audit.grokking import log_schedule
from tensoralg.cli import main


def test_log_schedule():
    s = log_schedule(1000, 8)
    assert s[0] == 0 and s[1] == 1 and s[-1] == 1000
    assert s == sorted(set(s))
    # rounded geometric points 1000 ** (k / 6), k = 0..6 (no duplicates at this size)
    assert len(s) == 8
    for k, v in enumerate(s[1:]):
        assert abs(v - 1000 ** (k / 6)) <= 0.5


def test_grokking_end_to_end(tmp_path):
    rc = main(["audit", "grokking", "--quick", "--steps", "200", "--checkpoints", "6",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    for name in ("grokking.json", "grokking.csv", "grokking_matrix.csv", "grokking.png"):
        assert (tmp_path / name).stat().st_size > 0
    res = json.loads((tmp_path / "grokking.json").read_text())
    steps = res["steps"]
    assert steps == log_schedule(200, 6)
    assert len(list((tmp_path / "checkpoints").iterdir())) == len(steps)
    sim = np.array(res["similarity_matrix"])
    assert sim.shape == (len(steps), len(steps))
    assert np.allclose(np.diag(sim), 1.0) and np.allclose(sim, sim.T, atol=1e-9)
    assert res["similarity_to_final"] == pytest.approx(sim[-1].tolist())
    assert len(res["train_accuracy"]) == len(res["val_accuracy"]) == len(steps)
    for key in ("saturation_step", "similarity_to_final_at_saturation", "keeps_changing"):
        assert key in res["finding"]
    assert res["config"]["P"] == 13 and res["method"] == "exact"


def test_bad_grokking_options(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["audit", "grokking", "--P", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["audit", "grokking", "--train-fraction", "1.0"])
    assert main(["audit", "grokking", "--quick", "--P", "1", "--out", str(tmp_path)]) == 2


def test_P_is_bounded_before_any_work(tmp_path, capsys):
    from tensoralg.audit.grokking import MAX_P

    assert main(["audit", "grokking", "--quick", "--P", "100000", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"[2, {MAX_P}]" in err and "100000" in err and "GB" in err
    assert not (tmp_path / "o").exists()
