"""Audit findings whose wording claimed more than was measured (found by a tester)."""

import json

from tensoralg.audit.language_degree import metric_line, verdict
from tensoralg.cli import main


def test_grokking_saturating_at_the_final_checkpoint_is_not_assessed(tmp_path, capsys):
    """With 5 checkpoints validation saturates at the last one, whose similarity to the final
    checkpoint is 1 by definition: "keeps changing: False" checked nothing."""
    assert main(["audit", "grokking", "--quick", "--checkpoints", "5", "--out",
                 str(tmp_path / "g"), "--no-progress"]) == 0
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "g" / "grokking.json").read_text())
    f = res["finding"]
    assert f["saturation_step"] == res["steps"][-1]
    assert f["saturates_at_final_checkpoint"] is True and f["keeps_changing"] is None
    assert "saturation is at the final checkpoint, nothing after it to compare" in text
    assert "keeps changing: False" not in text


def _transitions(lined_up: bool):
    sharpest = [{"steps": [i, i + 1], "change": 0.1 * (i + 1),
                 "ngram_orders_fastest_within_1_interval": lined_up} for i in range(2)]
    return {"sharpest": sharpest, "n_sharpest_aligned_with_ngram": 2 if lined_up else 0,
            "n_sharpest_same_interval_as_ngram": 0, "n_sharpest_in_top_k_ngram_change": 0,
            "n_sharpest_within_1_of_order_specific": 0, "spearman_with_ngram_change": None,
            "n_intervals_assessed": 2}


def _finding(chance_within_1: float):
    return {"chance_within_1_interval": chance_within_1, "chance_same_interval": 0.5,
            "top_k": 2, "chance_top_k_ngram": 1.0, "chance_within_1_of_order_specific": 1.0}


def test_language_every_transition_within_one_interval_by_chance_says_so():
    """Two intervals: every transition is within one interval of the n-gram gain whatever the
    model does, so the verdict is "does NOT line up" and the line said "every one lined up"
    beside it; it now says that chance alone gives this."""
    t, fin = _transitions(True), _finding(1.0)
    assert verdict(t, fin).startswith("does NOT line up")
    line = metric_line("residual", t, fin)
    assert "every one lined up" not in line
    assert line.endswith("; every one within one interval of some order's fastest n-gram gain, "
                         "as chance alone gives with this few intervals")
    # with chance below 1 the same count is a finding, stated without the caveat
    line = metric_line("residual", t, _finding(0.4))
    assert line.endswith("; every one within one interval of some order's fastest n-gram gain")
    assert "; not lined up: 0->1, 1->2" in metric_line("residual", _transitions(False),
                                                        _finding(0.4))
