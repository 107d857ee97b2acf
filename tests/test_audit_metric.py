"""``--metric gaussian|frobenius`` on every audit: recorded in the JSON, applied to every
similarity, and bad values refused (exit 2, one line) before any training."""

import json

import numpy as np
import pytest

from tensoralg.cli import main

AUDITS = ("backdoor", "forgetting", "grokking", "language")


@pytest.mark.parametrize("audit", AUDITS)
def test_unknown_metric_is_refused_before_any_work(audit, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["audit", audit, "--quick", "--metric", "cosine", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--metric" in err and "invalid choice: 'cosine'" in err
    assert not out.exists()


@pytest.mark.parametrize("audit", ("backdoor", "forgetting", "grokking"))
@pytest.mark.parametrize("method", ("montecarlo", "closure"))
def test_frobenius_needs_the_exact_method(audit, method, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["audit", audit, "--quick", "--metric", "frobenius", "--method", method,
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--metric frobenius" in err[0] and f"--method {method}" in err[0]
    assert not out.exists()


def test_language_has_the_gaussian_metric_only(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["audit", "language", "--quick", "--metric", "frobenius", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--metric frobenius" in err[0] and "Gaussian" in err[0]
    assert not out.exists()


def test_frobenius_over_budget_is_refused_before_training(tmp_path, capsys):
    """Depth 3: the exact Frobenius contraction is over budget, and there is no Frobenius
    estimate to fall back on (the Gaussian metric would switch to Monte Carlo)."""
    out = tmp_path / "run"
    assert main(["audit", "backdoor", "--quick", "--layers", "3", "--metric", "frobenius",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--metric frobenius" in err[0] and "over budget" in err[0]
    assert "montecarlo" not in err[0]     # no advice that cannot work
    assert not out.exists()


def test_config_refuses_an_unknown_metric():
    from tensoralg.audit.backdoor import BackdoorConfig
    from tensoralg.audit.forgetting import ForgettingConfig
    from tensoralg.audit.grokking import GrokkingConfig

    for cls in (BackdoorConfig, ForgettingConfig, GrokkingConfig):
        with pytest.raises(ValueError, match="--metric: expected one of gaussian, frobenius"):
            cls(metric="Gaussian").validate()


def _frob_each(a, b):
    import tensoralg as ta

    return np.asarray(ta.similarity(a, b, metric="frobenius", output="each"), dtype=float)


def test_backdoor_frobenius_is_recorded_and_applied(tmp_path):
    from tensoralg.checkpoint import load_checkpoint

    out = tmp_path / "bd"
    assert main(["audit", "backdoor", "--quick", "--steps", "120", "--finetune-steps", "60",
                 "--metric", "frobenius", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "backdoor.json").read_text())
    assert res["metric"] == "frobenius" and res["config"]["metric"] == "frobenius"
    a, _ = load_checkpoint(out / "checkpoints" / "clean")
    b, _ = load_checkpoint(out / "checkpoints" / "backdoored")
    each = np.array([res["slice_similarity"][str(c)] for c in range(10)])
    np.testing.assert_allclose(each, _frob_each(a, b), rtol=1e-10)
    import tensoralg as ta

    gauss = np.asarray(ta.similarity(a, b, output="each"), dtype=float)
    assert np.abs(each - gauss).max() > 1e-3       # a different metric, not relabelled


def test_forgetting_and_grokking_frobenius_matrices(tmp_path):
    import tensoralg as ta
    from tensoralg.checkpoint import load_checkpoint

    out = tmp_path / "fg"
    assert main(["audit", "forgetting", "--quick", "--stage-steps", "20", "--metric",
                 "frobenius", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "forgetting.json").read_text())
    assert res["metric"] == "frobenius"
    nets = [load_checkpoint(out / p)[0] for p in res["checkpoints"].values()]
    np.testing.assert_allclose(res["matrices"]["tensor_similarity"],
                               ta.similarity_matrix(nets, metric="frobenius"), rtol=1e-10)

    out = tmp_path / "gk"
    assert main(["audit", "grokking", "--quick", "--P", "13", "--steps", "60",
                 "--checkpoints", "4", "--metric", "frobenius", "--out", str(out),
                 "--no-progress"]) == 0
    res = json.loads((out / "grokking.json").read_text())
    assert res["metric"] == "frobenius"
    nets = [load_checkpoint(out / p)[0] for p in res["checkpoints"]]
    np.testing.assert_allclose(res["similarity_matrix"],
                               ta.similarity_matrix(nets, metric="frobenius"), rtol=1e-10)
