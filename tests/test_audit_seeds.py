"""``--seeds`` on the backdoor and forgetting audits: one complete run per seed, every number
as mean ± sample standard deviation, each finding counted per seed; bad seeds refused before
any training."""

import json

import numpy as np
import pytest

from tensoralg.audit.common import check_seeds, count_text, spread, spread_text
from tensoralg.cli import main


@pytest.mark.parametrize("audit", ("backdoor", "forgetting"))
@pytest.mark.parametrize("seeds, code, message", [
    ([], "exit", "expected at least one argument"),
    (["0", "-1"], "exit", "expected an integer >= 0, got -1"),
    (["1", "1"], 2, "--seeds: each seed once"),
])
def test_bad_seeds_are_refused_before_training(audit, seeds, code, message, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["audit", audit, "--quick", "--seeds", *seeds, "--out", str(out), "--no-progress"]
    if code == "exit":
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    else:
        assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seeds" in err and message in err
    assert not out.exists()


def test_seed_and_seeds_together_are_refused(tmp_path, capsys):
    assert main(["audit", "backdoor", "--quick", "--seed", "3", "--seeds", "1", "2",
                 "--out", str(tmp_path / "r")]) == 2
    assert "--seed 3 and --seeds" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_spread_and_counts():
    s = spread([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3) and s["sd"] == pytest.approx(np.std([1, 2, 4], ddof=1))
    assert spread([0.5])["sd"] is None        # one value: no spread measured, not a zero one
    assert spread_text(spread([0.5])) == "0.5000 (one value, no spread)"
    assert spread([1.0, float("inf"), None])["n"] == 1        # finite values only
    assert count_text([True, False, True]) == "holds in 2 of 3"
    assert count_text([True, None]) == "holds in 1 of 2 (1 not assessed)"
    with pytest.raises(ValueError, match="--seeds: expected one or more"):
        check_seeds([])


def test_backdoor_seeds_summary_matches_the_runs(tmp_path, capsys):
    out = tmp_path / "bd"
    assert main(["audit", "backdoor", "--quick", "--steps", "120", "--finetune-steps", "60",
                 "--seeds", "0", "1", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    summ = json.loads((out / "backdoor_seeds.json").read_text())
    runs = [json.loads((out / f"seed{s}" / "backdoor.json").read_text()) for s in (0, 1)]
    assert summ["seeds"] == [0, 1] and [r["config"]["seed"] for r in runs] == [0, 1]
    g = [r["global_similarity"] for r in runs]
    assert summ["numbers"]["global_similarity"]["mean"] == pytest.approx(np.mean(g))
    assert summ["numbers"]["global_similarity"]["sd"] == pytest.approx(np.std(g, ddof=1))
    s9 = [r["slice_similarity"]["9"] for r in runs]
    assert summ["per_class"]["slice_similarity"]["9"]["values"] == pytest.approx(s9)
    flags = [r["localisation"]["tensor"]["localises"] for r in runs]
    assert summ["localisation"]["tensor_similarity"]["localises"] == flags
    assert summ["localisation"]["tensor_similarity"]["localises_count"] == count_text(flags)
    assert "holds in" in summ["finding"]["statement"] and " ± " in text
    first = [r["over_training"]["first_localising_step"]["backdoored"] for r in runs]
    assert summ["finding"]["first_localising_step"] == first
    assert len(summ["finding"]["tensor_no_later_than_output_slice"]) == 2
    assert "no later than the output-slice cosine" in summ["finding"]["statement"]
    assert (out / "backdoor_seeds.csv").read_text().startswith("quantity,class,mean,sd,min,max,n")


def test_forgetting_seeds_counts_the_finding_per_seed(tmp_path):
    out = tmp_path / "fg"
    assert main(["audit", "forgetting", "--quick", "--stage-steps", "30", "--seeds", "2", "0",
                 "--out", str(out), "--no-progress"]) == 0
    summ = json.loads((out / "forgetting_seeds.json").read_text())
    runs = [json.loads((out / f"seed{s}" / "forgetting.json").read_text()) for s in (2, 0)]
    assert summ["finding"]["collapses"] == [r["finding"]["collapses"] for r in runs]
    assert summ["finding"]["collapses_count"] == count_text(summ["finding"]["collapses"])
    assert summ["finding"]["first_localising_checkpoint"] == [
        r["finding"]["first_localising_checkpoint"] for r in runs]
    assert "no later than the accuracy change" in summ["finding"]["statement"]
    rm = [r["finding"]["removed_slice_at_removal"] for r in runs]
    assert summ["numbers"]["removed_slice_at_removal"]["mean"] == pytest.approx(np.mean(rm))


def test_grokking_seeds(tmp_path, capsys):
    """--seeds on grokking: one complete run per seed, the numbers' spread and the findings
    counted; bad seeds refused before training."""
    out = tmp_path / "g"
    with pytest.raises(SystemExit):
        main(["audit", "grokking", "--quick", "--seeds", "--out", str(out)])
    assert main(["audit", "grokking", "--quick", "--seeds", "1", "1", "--out", str(out)]) == 2
    assert "--seeds: each seed once" in capsys.readouterr().err and not out.exists()
    assert main(["audit", "grokking", "--quick", "--steps", "150", "--checkpoints", "5",
                 "--seeds", "0", "1", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    s = json.loads((out / "grokking_seeds.json").read_text())
    assert s["seeds"] == [0, 1] and set(s["runs"]) == {"0", "1"}
    runs = [json.loads((out / f"seed{k}" / "grokking.json").read_text()) for k in (0, 1)]
    g = [r["finding"]["similarity_to_final_at_saturation"] for r in runs]
    sat = s["numbers"]["similarity_to_final_at_saturation"]
    fin = [v for v in g if v is not None]
    if fin:
        assert sat["mean"] == pytest.approx(np.mean(fin)) and sat["n"] == len(fin)
    rho = [r["fourier"]["spearman"]["intervals"]["tensor_similarity"] for r in runs]
    assert s["numbers"]["spearman_intervals:tensor_similarity"]["values"] == rho
    assert s["finding"]["keeps_changing"] == [r["finding"]["keeps_changing"] for r in runs]
    assert "keeps changing: holds in" in s["finding"]["statement"]
    assert "mean ± sd" in text and (out / "grokking_seeds.csv").is_file()
