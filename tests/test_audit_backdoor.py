"""`tensoralg audit backdoor` end to end at a tiny size, and its pieces."""

import json

import numpy as np
import pytest

from tensoralg.cli import main

KEYS = {"global_similarity", "slice_similarity", "target_class", "attack_success_rate",
        "clean_accuracy", "baselines", "method", "tensoralg_version", "config"}


@pytest.fixture(scope="module")
def backdoor_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("backdoor")
    rc = main(["audit", "backdoor", "--quick", "--steps", "400", "--finetune-steps", "250",
               "--out", str(out), "--no-progress", "--json", str(out / "copy.json")])
    return rc, out


def test_exit_code_and_files(backdoor_run):
    rc, out = backdoor_run
    assert rc == 0
    for name in ("backdoor.json", "backdoor.csv", "backdoor_slices.png", "copy.json",
                 "checkpoints/clean/cfg.json", "checkpoints/backdoored/weights.safetensors"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "backdoor_slices.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_keys_and_the_finding(backdoor_run):
    _, out = backdoor_run
    res = json.loads((out / "backdoor.json").read_text())
    assert set(res) >= KEYS
    assert res["target_class"] == 9 and res["method"] == "exact" and res["metric"] == "gaussian"
    assert set(res["clean_accuracy"]) == {"before", "after"}
    assert set(res["baselines"]) == {"cka_logits", "cka_logits_debiased", "cka_hidden",
                                     "output_cosine", "js_divergence", "weight_cosine"}
    slices = {int(k): v for k, v in res["slice_similarity"].items()}
    assert sorted(slices) == list(range(10))
    # the paper's finding: the target class's slice is the lowest of all
    assert min(slices, key=slices.get) == 9
    assert res["finding"]["target_slice_is_lowest"] is True
    # the backdoor works and clean behaviour barely moves
    assert res["attack_success_rate"] > 0.8 > res["attack_success_rate_before"]
    assert res["clean_accuracy"]["after"] > res["clean_accuracy"]["before"] - 0.05


def test_csv_holds_every_slice(backdoor_run):
    _, out = backdoor_run
    lines = (out / "backdoor.csv").read_text().splitlines()
    assert lines[0] == "quantity,class,value,stderr"
    slice_rows = [ln for ln in lines if ln.startswith("slice_similarity,")]
    res = json.loads((out / "backdoor.json").read_text())
    assert len(slice_rows) == 10
    for row in slice_rows:
        _, c, v, se = row.split(",")
        assert float(v) == pytest.approx(res["slice_similarity"][c], rel=1e-9)
        assert se == ""                  # exact: no sampling error
    assert res["slice_similarity_stderr"] is None and res["n_samples"] is None


def test_slices_match_an_independent_monte_carlo(backdoor_run):
    """Cross-check the audit's exact slices with a plain sampling estimate of
    E[f_a,c f_b,c] / sqrt(E[f_a,c^2] E[f_b,c^2]) under x ~ N(0, I) (no tensoralg inner products)."""
    _, out = backdoor_run
    import torch

    from tensoralg.checkpoint import load_checkpoint

    a, _ = load_checkpoint(out / "checkpoints" / "clean")
    b, _ = load_checkpoint(out / "checkpoints" / "backdoored")
    x = torch.randn(200_000, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        ya, yb = a.double()(x).numpy(), b.double()(x).numpy()
    mc = (ya * yb).mean(0) / np.sqrt((ya ** 2).mean(0) * (yb ** 2).mean(0))
    mc_global = (ya * yb).sum(1).mean() / np.sqrt((ya ** 2).sum(1).mean() * (yb ** 2).sum(1).mean())
    res = json.loads((out / "backdoor.json").read_text())
    exact = np.array([res["slice_similarity"][str(c)] for c in range(10)])
    # 200k samples: the standard error of a similarity near 0.9 is ~ 1e-3; allow 5 sigma.
    assert np.abs(mc - exact).max() < 5e-3
    assert abs(mc_global - res["global_similarity"]) < 5e-3


def test_bad_options_are_clear(tmp_path, capsys):
    assert main(["audit", "backdoor", "--quick", "--target", "12", "--out", str(tmp_path)]) == 2
    assert "--target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["audit", "backdoor", "--poison-fraction", "1.5"])
    assert exc.value.code == 2
    assert "poison-fraction" in capsys.readouterr().err


def test_checkpoint_paths_are_relative_to_the_output_folder(backdoor_run):
    _, out = backdoor_run
    res = json.loads((out / "backdoor.json").read_text())
    assert res["paths"].startswith("relative to the output folder")
    for path in res["checkpoints"].values():
        assert not path.startswith("/") and (out / path / "cfg.json").is_file()
    assert res["files"] == ["backdoor.json", "backdoor.csv", "backdoor_slices.png",
                            "backdoor_over_training.png", "backdoor_eigenvectors.png"]
    f = res["finding"]   # eigenvectors of the target's change (tensoralg.decompose)
    assert 0 <= f["top_eigenvector_trigger_mass"] <= 1 and f["trigger_pixel_share"] == 4 / 64


def test_monte_carlo_audit_records_its_standard_errors(tmp_path, capsys):
    """Depth 3: auto picks Monte Carlo; every similarity carries a standard error and n_samples
    (JSON, CSV, table), and the values are tensoralg.similarity's with the run's seed."""
    import tensoralg as ta
    from tensoralg.checkpoint import load_checkpoint

    out = tmp_path / "b"
    assert main(["audit", "backdoor", "--quick", "--layers", "3", "--steps", "30",
                 "--finetune-steps", "20", "--finetune-checkpoints", "2", "--n-samples", "4000",
                 "--seed", "2", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    res = json.loads((out / "backdoor.json").read_text())
    assert res["method"] == "montecarlo" and res["n_samples"] == 4000
    se = res["slice_similarity_stderr"]
    assert sorted(se, key=int) == [str(c) for c in range(10)]
    assert all(0 < v < 0.5 for v in se.values()) and 0 < res["global_similarity_stderr"] < 0.5
    assert res["control"]["slice_similarity_stderr"] and res["control"]["global_similarity_stderr"] > 0
    a, _ = load_checkpoint(out / "checkpoints" / "clean")
    b, _ = load_checkpoint(out / "checkpoints" / "backdoored")
    each = ta.similarity(a, b, method="montecarlo", output="each", n_samples=4000, seed=2)
    # the same estimator, samples and seed: equal to float64 rounding (JSON keeps every digit)
    assert np.allclose([res["slice_similarity"][str(c)] for c in range(10)], each, rtol=1e-12,
                       atol=0)
    assert np.allclose([se[str(c)] for c in range(10)], each.stderr, rtol=1e-12, atol=0)
    f = res["finding"]
    assert f["gap_stderr"] == pytest.approx(np.hypot(se["9"], se[str(f["lowest_other_class"])]))
    # each slice carries the library's own verdict; a finding that leans on a slice without a
    # reliable estimate is not assessed, and the table prints no number for such a slice
    rel = res["slice_similarity_reliable"]
    assert [rel[str(c)] for c in range(10)] == each.reliable.tolist()
    bad = [c for c in range(10) if not rel[str(c)]]
    if bad:
        assert f["assessed"] is False and not f["target_slice_is_clearly_lowest"]
        assert f["not_assessed"].endswith(", ".join(map(str, bad)))
        assert "finding not assessed: no reliable Monte Carlo estimate" in text
        assert text.count("no reliable estimate") >= len(bad)
    else:
        assert f["assessed"] is True
        assert f["gap_within_2_stderr"] == (abs(f["gap"]) <= 2 * f["gap_stderr"])
    lines = (out / "backdoor.csv").read_text().splitlines()
    assert lines[0] == "quantity,class,value,stderr"
    row9 = next(ln for ln in lines if ln.startswith("slice_similarity,9,"))
    assert float(row9.split(",")[3]) == pytest.approx(se["9"], rel=1e-9)
    assert "±" in text and "4000 samples" in text


def test_gap_finding_is_stderr_aware():
    from tensoralg.audit.common import gap_finding

    each = [0.9, 0.8, 0.95, 0.75]
    # gap 0.05 with stderr sqrt(0.02^2 + 0.02^2) = 0.028: lowest, but within 2 standard errors
    f = gap_finding(each, [0.01, 0.02, 0.01, 0.02], 3)
    assert f["target_slice_is_lowest"] and f["lowest_other_class"] == 1
    assert f["gap"] == pytest.approx(0.05) and f["gap_stderr"] == pytest.approx(0.02 * 2 ** 0.5)
    assert f["gap_within_2_stderr"] and not f["target_slice_is_clearly_lowest"]
    f = gap_finding(each, [0.001] * 4, 3)            # same gap, 0.0014 stderr: clear
    assert not f["gap_within_2_stderr"] and f["target_slice_is_clearly_lowest"]
    # a slice without a reliable Monte Carlo estimate: no verdict (even a clear-looking gap)
    f = gap_finding(each, [0.001] * 4, 3, [True, False, True, True])
    assert f["assessed"] is False and not f["target_slice_is_clearly_lowest"]
    assert f["target_slice_is_lowest"] is None and f["gap_within_2_stderr"] is None
    assert f["not_assessed"] == "no reliable Monte Carlo estimate for slice(s) 1"
    assert gap_finding(each, [0.001] * 4, 3, [True] * 4)["assessed"] is True
    f = gap_finding(each, None, 3)                   # deterministic: any positive gap
    assert f["gap_stderr"] is None and f["target_slice_is_clearly_lowest"]
    assert not gap_finding(each, None, 0)["target_slice_is_lowest"]


def test_closure_at_depth_two_is_labelled_approximate_everywhere(tmp_path, capsys):
    """The closure's value at depth >= 2 is not the tensor similarity: the table, the JSON and
    the CSV say "moment-closure (approximate)" (the table printed the bare method name, the
    CSV and JSON had no label; found by a tester)."""
    out = tmp_path / "bd"
    rc = main(["audit", "backdoor", "--quick", "--no-progress", "--steps", "60",
               "--finetune-steps", "30", "--layers", "2", "--d-model", "8", "--d-hidden", "8",
               "--method", "closure", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "similarity method: moment-closure (approximate) (gaussian metric)" in text
    res = json.loads((out / "backdoor.json").read_text())
    assert res["method"] == "closure" and res["approximate"] is True
    assert res["method_label"] == "moment-closure (approximate)"
    lines = (out / "backdoor.csv").read_text().splitlines()
    assert lines[1] == "similarity_method,,moment-closure (approximate),"


def test_per_class_baselines_and_localisation(backdoor_run):
    """The behavioural baselines per class on clean test images are in the JSON, CSV and
    table, equal to a recomputation from the saved checkpoints, and the localisation rule is
    applied to tensor similarity and to each baseline with a counted comparison."""
    _, out = backdoor_run
    import json as _json

    from tensoralg.audit.backdoor import backdoor_table
    from tensoralg.baselines import per_class_baselines
    from tensoralg.checkpoint import load_checkpoint
    from tensoralg.data import load_digits_data

    res = _json.loads((out / "backdoor.json").read_text())
    a, _ = load_checkpoint(out / "checkpoints" / "clean")
    b, _ = load_checkpoint(out / "checkpoints" / "backdoored")
    d = load_digits_data(seed=0)
    pc = per_class_baselines(a, b, d.X_test, d.y_test)
    got = res["per_class_baselines"]
    for key in ("logit_cosine", "prob_cosine", "output_slice_cosine", "agreement"):
        assert [got[key][str(c)] for c in range(10)] == pytest.approx(pc[key], rel=1e-9)
    assert [got["accuracy_compared"][str(c)] for c in range(10)] == pytest.approx(pc["accuracy_b"])
    loc = res["localisation"]
    assert loc["rule"].startswith("a per-class score localises the change to class t")
    assert set(loc["baselines"]) == {"logit_cosine", "prob_cosine", "output_slice_cosine",
                                     "agreement", "accuracy_change"}
    assert loc["tensor"]["localises"] is True and loc["tensor"]["lowest_class"] == 9
    assert sum(loc["comparison"]["counts"].values()) == 5
    assert res["finding"]["localisation_statement"] == loc["comparison"]["statement"]
    assert res["control"]["localisation"]["tensor"]["localises"] is False   # no backdoor there
    csv = (out / "backdoor.csv").read_text()
    assert "per_class:logit_cosine,9," in csv and "localisation_separation:tensor_similarity" in csv
    text = backdoor_table(res)
    assert "localisation rule (declared before the numbers)" in text
    assert text.index("localisation rule") < text.index("Tensor similarity localises")


def test_walkthrough_over_the_fine_tune(backdoor_run):
    """20 checkpoints through each fine-tune (plus step 0, the clean model), each against the
    clean model: the last repeats the final numbers, an inner one is the library's similarity
    of the saved checkpoints, the attack success rate and the first localising steps are
    recorded, and the figure is written."""
    import tensoralg as ta
    from tensoralg.checkpoint import load_checkpoint

    _, out = backdoor_run
    res = json.loads((out / "backdoor.json").read_text())
    ot = res["over_training"]
    assert len(ot["step"]) == 21 and ot["step"][0] == 0 and ot["step"][-1] == 250
    assert ot["step"][1:3] == [12, 25]   # round(k * 250 / 20)
    b, c = ot["runs"]["backdoored"], ot["runs"]["control"]
    assert np.allclose(b["slice_similarity"][0], 1.0, atol=1e-12)   # the clean model itself
    assert b["slice_similarity"][-1] == [res["slice_similarity"][str(k)] for k in range(10)]
    assert c["slice_similarity"][-1] == [res["control"]["slice_similarity"][str(k)]
                                         for k in range(10)]
    assert b["attack_success_rate"][-1] == res["attack_success_rate"]
    assert b["attack_success_rate"][0] == res["attack_success_rate_before"]
    assert b["clean_accuracy"][-1] == res["clean_accuracy"]["after"]
    j = ot["step"].index(125)
    assert b["checkpoint"][j] == "checkpoints/backdoored_step0000125"
    clean = load_checkpoint(out / "checkpoints" / "clean")[0]
    mid = load_checkpoint(out / b["checkpoint"][j])[0]
    assert np.allclose(b["slice_similarity"][j], ta.similarity(clean, mid, output="each"),
                       rtol=1e-10, atol=1e-12)
    assert (out / c["checkpoint"][j] / "cfg.json").is_file()
    first = ot["first_localising_step"]["backdoored"]
    assert first["slice_similarity"] in ot["step"]   # the backdoor is singled out on the way
    assert first["attack_success_rate_0.5"] in ot["step"]
    assert "attack success rate reaches 0.5 at step" in res["finding"]["over_training_statement"]
    assert (out / "backdoor_over_training.png").read_bytes()[:4] == b"\x89PNG"
    rows = (out / "backdoor.csv").read_text().splitlines()
    assert sum(ln.startswith("over_training:control:step125:slice_similarity,") for ln in rows) == 10


def test_bad_finetune_checkpoints(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["audit", "backdoor", "--quick", "--finetune-checkpoints", "301",
                 "--out", str(out)]) == 2
    assert "--finetune-checkpoints: expected 1 .. --finetune-steps = 300, got 301" in \
        capsys.readouterr().err
    assert not out.exists()
