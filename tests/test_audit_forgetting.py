"""`tensoralg audit forgetting` end to end at a tiny size."""

import json

import numpy as np
import pytest

from tensoralg.audit.forgetting import curriculum
from tensoralg.cli import main


def test_curriculum_stages():
    st = curriculum(9)
    assert [lab for lab, _ in st] == ["{0,1,2,3,4}", "+5", "+6", "+7", "+8", "+9", "-9", "+9 again"]
    assert st[5][1] == list(range(10)) and 9 not in st[6][1] and sorted(st[7][1]) == list(range(10))
    st3 = curriculum(3)
    assert st3[-3][0] == "+3" and 3 not in st3[-2][1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("forgetting")
    rc = main(["audit", "forgetting", "--quick", "--out", str(out),
               "--no-progress"])
    return rc, out


def test_files_keys_and_finding(run):
    rc, out = run
    assert rc == 0
    for name in ("forgetting.json", "forgetting.csv", "forgetting_slices.png",
                 "forgetting_matrices.png", "checkpoints/stage07/cfg.json"):
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "forgetting.json").read_text())
    assert res["reference_stage"] == "+9"
    labels = [s["label"] for s in res["stages"]]
    ref = res["slice_similarity_to_reference"]["+9"]
    assert all(v == pytest.approx(1.0, abs=1e-9) for v in ref.values())
    mats = res["matrices"]
    for name in ("tensor_similarity", "cka_logits", "weight_cosine"):
        m = np.array(mats[name])
        assert m.shape == (len(labels), len(labels))
        # similarity matrices: unit diagonal and symmetric up to float64 rounding
        assert np.allclose(np.diag(m), 1.0, rtol=0, atol=1e-12)
        assert np.allclose(m, m.T, rtol=0, atol=1e-12)
    # the tensor matrix row of the reference equals the per-checkpoint global similarities
    i_ref = labels.index("+9")
    g = [res["global_similarity_to_reference"][lab] for lab in labels]
    # batched Gram vs pairwise similarity: same exact sum, different contraction order
    assert np.allclose(np.array(mats["tensor_similarity"])[i_ref], g, rtol=1e-12, atol=0)
    f = res["finding"]
    assert f["collapses"] and f["recovers"]
    assert f["removed_slice_at_removal"] < f["other_slices_min_at_removal"]
    # the table rounds the exact value like its neighbours (it printed all 17 digits)
    from tensoralg.audit.forgetting import forgetting_table
    text = forgetting_table(res)
    assert f"class 9: {f['removed_slice_at_removal']:.3f} after removal" in text


def test_bad_removed_class(tmp_path, capsys):
    assert main(["audit", "forgetting", "--quick", "--removed-class", "10",
                 "--out", str(tmp_path)]) == 2
    assert "--removed-class" in capsys.readouterr().err


def test_monte_carlo_forgetting_records_standard_errors(tmp_path, capsys):
    out = tmp_path / "f"
    assert main(["audit", "forgetting", "--quick", "--stage-steps", "20", "--method", "montecarlo",
                 "--n-samples", "3000", "--checkpoints-per-stage", "2", "--out", str(out),
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    res = json.loads((out / "forgetting.json").read_text())
    assert res["method"] == "montecarlo" and res["n_samples"] == 3000
    se = res["slice_similarity_to_reference_stderr"]
    labels = [s["label"] for s in res["stages"]]
    assert set(se) == set(labels) and all(len(row) == 10 for row in se.values())
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in se["+9"].values())  # reference vs itself
    assert all(v > 0 for v in se["-9"].values())
    f = res["finding"]
    assert f["collapse_gap_stderr"] > 0
    assert f["collapses"] == (f["collapse_gap"] > 2 * f["collapse_gap_stderr"])
    assert f["recovers"] == (f["recovery"] > 2 * f["recovery_stderr"])
    assert res["matrices"]["tensor_similarity_uncertainty"]["estimate"] is True
    # the matrix: the library's, each entry with its standard error and verdict
    import tensoralg as ta
    from tensoralg.checkpoint import load_checkpoint

    nets = [load_checkpoint(out / c)[0].to_network() for c in res["checkpoints"].values()]
    lib = ta.similarity_matrix(nets, method="montecarlo", seed=res["config"]["seed"],
                               n_samples=3000)
    m = res["matrices"]
    assert m["tensor_similarity_reliable"] == lib.reliable.tolist()
    assert np.array_equal(np.array(m["tensor_similarity_stderr"]), lib.stderr)
    S = np.array(m["tensor_similarity"], dtype=float)
    assert np.array_equal(S[lib.reliable], np.asarray(lib)[lib.reliable])
    assert np.all(np.isnan(S[~lib.reliable]))
    header = (out / "forgetting.csv").read_text().splitlines()[0]
    assert header == "stage,quantity,class,value,stderr"
    assert "±" in text and "3000 samples" in text
    t = res["over_training"]   # the inner checkpoints carry their standard errors too
    assert len(t["label"]) == 16 and all(len(se) == 10 for se in t["slice_similarity_stderr"])
    assert all(v > 0 for v in t["slice_similarity_stderr"][t["label"].index("-9@130")])


def test_behavioural_baselines_localise_the_removed_class_too(run):
    """At removal the removed class's accuracy drops to 0: the behavioural per-class baselines
    single it out as well, and the audit says so by the declared rule."""
    _, out = run
    res = json.loads((out / "forgetting.json").read_text())
    labels = [s["label"] for s in res["stages"]]
    assert set(res["per_class_baselines_to_reference"]) == set(labels)
    at = res["per_class_baselines_to_reference"]["-9"]
    assert at["accuracy_checkpoint"]["9"] == 0.0
    assert res["global_baselines_to_reference"]["+9"]["output_cosine"] == pytest.approx(1.0)
    loc = res["localisation"]
    assert loc["stage"] == "-9" and loc["tensor"]["localises"] is True
    assert loc["baselines"]["accuracy_change"]["localises"] is True
    assert loc["comparison"]["counts"]["equally"] >= 1
    from tensoralg.audit.forgetting import forgetting_table

    text = forgetting_table(res)
    assert "localisation rule (declared before the numbers)" in text and "linear CKA" in text


def test_inner_steps():
    from tensoralg.audit.forgetting import inner_steps

    assert inner_steps(150, 5) == [30, 60, 90, 120, 150]
    assert inner_steps(7, 3) == [2, 5, 7] and inner_steps(4, 1) == [4] and inner_steps(3, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="per_stage"):
        inner_steps(3, 4)


def test_checkpoints_over_training(run):
    """40 checkpoints (5 per stage) saved and compared with the reference class by class: the
    stage ends repeat the per-stage values, an inner checkpoint's slices are the library's,
    the removed class's accuracy and slices are tracked through the removal stage."""
    import tensoralg as ta
    from tensoralg.checkpoint import load_checkpoint

    _, out = run
    res = json.loads((out / "forgetting.json").read_text())
    t = res["over_training"]
    assert len(t["label"]) == 40 and t["reference"] == "+9"
    assert t["step"] == list(range(30, 1201, 30))
    labels = [s["label"] for s in res["stages"]]
    assert [t["stage"][j] for j in range(4, 40, 5)] == labels
    for j in range(4, 40, 5):   # stage ends: the per-stage numbers
        lab = t["stage"][j]
        assert t["checkpoint"][j] == res["checkpoints"][lab]
        assert t["slice_similarity"][j] == [res["slice_similarity_to_reference"][lab][str(c)]
                                            for c in range(10)]
    j = t["label"].index("-9@960")   # inside the removal stage
    ref = load_checkpoint(out / res["checkpoints"]["+9"])[0]
    mid = load_checkpoint(out / t["checkpoint"][j])[0]
    assert t["checkpoint"][j] == "checkpoints/stage06_step0000960"
    each = ta.similarity(ref, mid, output="each")
    assert np.allclose(t["slice_similarity"][j], each, rtol=1e-10, atol=1e-12)
    acc9 = [a[9] for a, st in zip(t["test_accuracy_per_class"], t["stage"]) if st == "-9"]
    assert acc9[-1] == 0.0
    first = res["finding"]["first_localising_checkpoint"]
    assert set(first) == {"slice_similarity", "accuracy_change", "output_slice_cosine",
                          "logit_cosine"}
    assert first["slice_similarity"] is not None and first["slice_similarity"].startswith("-9@")
    assert (out / "forgetting_over_training.png").read_bytes()[:4] == b"\x89PNG"
    assert "forgetting_over_training.png" in res["files"]
    rows = [ln for ln in (out / "forgetting.csv").read_text().splitlines()
            if ln.startswith("-9@960,over_training:slice_similarity,")]
    assert len(rows) == 10


def test_bad_checkpoints_per_stage(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["audit", "forgetting", "--quick", "--checkpoints-per-stage", "151",
                 "--out", str(out)]) == 2
    assert "--checkpoints-per-stage: expected 1 .. --stage-steps = 150, got 151" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["audit", "forgetting", "--quick", "--checkpoints-per-stage", "0",
              "--out", str(out)])
    assert not out.exists()
