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
    assert np.allclose(np.diag(sim), 1.0, rtol=0, atol=1e-12)  # float64 rounding only
    assert np.allclose(sim, sim.T, rtol=0, atol=1e-12)
    assert res["similarity_to_final"] == pytest.approx(sim[-1].tolist())
    assert len(res["train_accuracy"]) == len(res["val_accuracy"]) == len(steps)
    for key in ("saturation_step", "similarity_to_final_at_saturation", "keeps_changing",
                "memorisation_step", "grokking_step", "grokking_delay", "grokked"):
        assert key in res["finding"]
    # the dense accuracy curve contains every checkpoint step, with the same accuracies
    curve = res["accuracy_curve"]
    assert len(curve["step"]) > len(steps) and set(steps) <= set(curve["step"])
    assert curve["step"] == sorted(set(curve["step"])) and curve["step"][-1] == 200
    for s, tr, va in zip(steps, res["train_accuracy"], res["val_accuracy"]):
        i = curve["step"].index(s)
        assert (curve["train_accuracy"][i], curve["val_accuracy"][i]) == (tr, va)
    f = res["finding"]
    mem = f["memorisation_step"]
    if mem is not None:  # the first step on the curve with train accuracy >= 0.99
        i = curve["step"].index(mem)
        assert curve["train_accuracy"][i] >= 0.99 > max(curve["train_accuracy"][:i], default=0)
    assert f["grokked"] == (f["grokking_step"] is not None)
    assert f["grokked"] == (max(curve["val_accuracy"]) >= 0.95)
    assert res["config"]["P"] == 31 and res["method"] == "exact"


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


def test_log_schedule_is_exact_when_points_collide():
    # 20 points on [1, 400] collide at the small end after rounding; the schedule still has
    # exactly the requested number of distinct steps, from 0 to --steps
    for steps, n in [(400, 20), (30, 30), (10, 11), (5000, 24), (1, 2), (7, 3)]:
        s = log_schedule(steps, n)
        assert len(s) == n and s == sorted(set(s)) and s[0] == 0 and s[-1] == steps, (steps, n, s)
    with pytest.raises(ValueError, match="checkpoints"):
        log_schedule(5, 7)


def test_checkpoint_count_is_exact_and_chance_is_not_saturation(tmp_path, capsys):
    """--checkpoints N gives N checkpoints; a run at chance-level validation accuracy (30 steps)
    reports no saturation point instead of "saturates at ... (0.09)"."""
    assert main(["audit", "grokking", "--quick", "--steps", "30", "--checkpoints", "20",
                 "--out", str(tmp_path / "g"), "--no-progress"]) == 0
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "g" / "grokking.json").read_text())
    assert res["n_checkpoints"] == len(res["steps"]) == len(res["checkpoints"]) == 20
    assert len(list((tmp_path / "g" / "checkpoints").iterdir())) == 20
    assert "20 checkpoints" in text
    f = res["finding"]
    chance = 1 / 31
    assert f["chance_accuracy"] == pytest.approx(chance)
    assert f["max_val_acc"] < chance + 0.5 * (1 - chance)    # this run has not learned
    assert f["saturates"] is False and f["saturation_step"] is None
    assert f["keeps_changing"] is None
    assert "chance" in f["saturation_criterion"] and "saturates at step" not in text
    assert "never rises clearly above chance" in text
    assert "not grokked" in text and f["grokked"] is False and f["grokking_step"] is None
    assert main(["audit", "grokking", "--quick", "--steps", "5", "--checkpoints", "7",
                 "--out", str(tmp_path / "h")]) == 2
    assert "--checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize("P", ["2", "7"])
def test_too_few_validation_pairs_refused(tmp_path, capsys, P):
    # --quick trains on 0.8 of the pairs: P = 2: 4 pairs, 3 train and 1 validation; P = 7: 49
    # pairs, round(0.8 * 49) = 39 train and 10 validation (< 30)
    assert main(["audit", "grokking", "--quick", "--P", P, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "validation pairs" in err and "at least 30" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quick_size_groks(tmp_path, seed):
    """--quick groks: it memorises first (train accuracy >= 0.99 while validation is near
    chance, 1/31 = 0.032), then validation reaches >= 0.95 clearly later and stays there.
    Measured (seeds 0-4, one thread): memorised at step 45 with validation 0.01-0.05, grokked at
    steps 225-370, final validation 0.98-1.00. The bounds below leave room around those."""
    assert main(["audit", "grokking", "--quick", "--seed", str(seed), "--out",
                 str(tmp_path / "g"), "--no-progress"]) == 0
    res = json.loads((tmp_path / "g" / "grokking.json").read_text())
    f = res["finding"]
    assert f["grokked"] and f["final_val_acc"] >= 0.95
    assert f["val_acc_at_memorisation"] < 0.2          # memorised, not yet generalised
    assert f["grokking_step"] >= 2 * f["memorisation_step"] and f["grokking_delay"] >= 100
    assert f["saturates"] and f["memorisation_step"] < f["saturation_step"]


def test_monte_carlo_entry_without_verdict_is_not_assessed(tmp_path, capsys, monkeypatch):
    """--method montecarlo with the (saturation step, final) entry forced to fail its verdict
    (the library's own Diagnostics, reliable False): the table says "no reliable estimate"
    there and ± elsewhere, the JSON has the stderr / reliable matrices and null for that
    entry, and the findings that lean on it (similarity to final at saturation, keeps
    changing, neighbour similarity after saturation) are not asserted."""
    import dataclasses

    import tensoralg as ta
    from tensoralg.strategies.montecarlo import MonteCarloArray

    real = ta.similarity_matrix

    def fake(models, **kw):
        m = real(models, **kw)
        N = m.shape[0]
        bad = {(N - 2, N - 1), (N - 1, N - 2)}
        diags = [dataclasses.replace(d, reliable=False, reason="forced by the test")
                 if divmod(k, N) in bad else d for k, d in enumerate(m.diagnostics)]
        return MonteCarloArray(np.asarray(m), m.stderr, m.n_samples, diags)

    monkeypatch.setattr(ta, "similarity_matrix", fake)
    assert main(["audit", "grokking", "--quick", "--steps", "800", "--checkpoints", "12",
                 "--method", "montecarlo", "--n-samples", "2000", "--out", str(tmp_path / "g"),
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "g" / "grokking.json").read_text())
    steps, f = res["steps"], res["finding"]
    assert f["saturation_step"] == steps[-2]      # this run saturates just before the end
    ok = np.array(res["similarity_matrix_reliable"])
    assert not ok[-2, -1] and not ok[-1, -2] and ok.sum() == ok.size - 2
    assert np.array(res["similarity_matrix_stderr"]).shape == (len(steps), len(steps))
    assert res["similarity_matrix"][-2][-1] is None and res["similarity_to_final"][-2] is None
    assert res["similarity_to_final_reliable"][-2] is False
    assert res["similarity_matrix_unreliable_estimates"][0][:2] == [len(steps) - 2,
                                                                    len(steps) - 1]
    assert f["similarity_to_final_at_saturation"] is None and f["keeps_changing"] is None
    assert f["min_neighbour_similarity_after_saturation"] is None
    assert f["assessed"] is False and str(steps[-2]) in f["not_assessed"]
    row = next(line for line in text.splitlines() if line.strip().startswith(f"{steps[-2]} "))
    # the similarity-to-final column (the data baseline and key share follow it)
    assert row.split()[3:6] == ["no", "reliable", "estimate"]
    assert text.count("±") >= len(steps) - 2 and "keeps changing: not assessed" in text
    assert "per_entry" in res["similarity_matrix_uncertainty"]
    assert (tmp_path / "g" / "grokking.png").stat().st_size > 0


def test_monte_carlo_matrix_is_the_library_matrix(tmp_path):
    """The audit's Monte Carlo matrix and its standard errors are ta.similarity_matrix of the
    saved checkpoints with the same seed and sample count (the same numbers)."""
    import tensoralg as ta
    from tensoralg.checkpoint import load_checkpoint

    assert main(["audit", "grokking", "--quick", "--steps", "40", "--checkpoints", "4",
                 "--method", "montecarlo", "--n-samples", "2000", "--seed", "2",
                 "--out", str(tmp_path / "g"), "--no-progress"]) == 0
    res = json.loads((tmp_path / "g" / "grokking.json").read_text())
    nets = [load_checkpoint(tmp_path / "g" / c)[0].to_network() for c in res["checkpoints"]]
    lib = ta.similarity_matrix(nets, method="montecarlo", seed=2, n_samples=2000)
    assert res["similarity_matrix_reliable"] == lib.reliable.tolist()
    S = np.array(res["similarity_matrix"], dtype=float)
    assert np.array_equal(S[lib.reliable], np.asarray(lib)[lib.reliable])
    assert np.array_equal(np.array(res["similarity_matrix_stderr"]), lib.stderr)


def test_frequency_power_of_pure_waves():
    """A cosine of frequency k in the a-tokens and of frequency j in the b-tokens puts all the
    power on k and j (k and P - k folded), and the spectrum sums to P * ||W||^2 (Parseval)."""
    from tensoralg.audit.grokking_fourier import frequency_power, key_frequencies, shares

    P = 31
    t = np.arange(P)
    W = np.zeros((3, 2 * P))
    W[0, :P] = np.cos(2 * np.pi * 5 * t / P)
    W[1, P:] = 2 * np.sin(2 * np.pi * 12 * t / P + 0.3)
    W[2, :] = 0.5                                  # constant: frequency 0
    p = frequency_power(W, P)
    assert p.shape == (16,) and np.isclose(p.sum(), P * (W ** 2).sum())
    assert set(np.flatnonzero(p > 1e-9)) == {0, 5, 12}
    assert np.isclose(p[12], 4 * p[5])
    s = shares(p)
    assert np.isclose(s.sum(), 1.0) and np.isclose(s[11], 0.8) and np.isclose(s[4], 0.2)
    assert key_frequencies(s) == [12]               # 80 % in one frequency
    assert key_frequencies(np.full(15, 1 / 15)) == list(range(1, 13))   # uniform: 12 of 15
    with pytest.raises(ValueError, match="W: expected"):
        frequency_power(np.zeros((2, 30)), P)


def test_fourier_picture_and_data_baseline(tmp_path, capsys):
    """The Fourier record of the run's own checkpoints, recomputed from the saved weights, the
    data baseline over all P^2 inputs, the declared correlations, CSV and figure."""
    from scipy.stats import spearmanr

    from tensoralg.audit.grokking_fourier import model_spectra, shares
    from tensoralg.checkpoint import load_checkpoint

    out = tmp_path / "g"
    assert main(["audit", "grokking", "--quick", "--steps", "300", "--checkpoints", "8",
                 "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    res = json.loads((out / "grokking.json").read_text())
    fo = res["fourier"]
    assert fo["frequencies"] == list(range(1, 16)) and len(fo["embedding_power_share"]) == 8
    last = load_checkpoint(out / res["checkpoints"][-1])[0]
    emb, bil = model_spectra(last, 31)
    assert np.allclose(fo["embedding_power_share"][-1], shares(emb), rtol=1e-12)
    assert np.allclose(fo["bilinear_power_share"][-1], shares(bil), rtol=1e-12)
    assert 1 <= len(fo["key_frequencies"]) <= 12
    assert fo["key_share_embedding"][-1] >= 0.8 - 1e-12
    sim = np.array(res["similarity_matrix"])
    x = [1 - sim[i, i + 1] for i in range(7)]
    assert fo["spearman"]["intervals"]["tensor_similarity"] == pytest.approx(
        spearmanr(x, fo["spectrum_change_intervals"]).statistic)
    oc = res["output_cosine_to_final"]
    assert len(oc) == 8 and oc[-1] == pytest.approx(1.0)
    f = res["finding"]
    assert "data_keeps_changing" in f and f["key_frequencies"] == fo["key_frequencies"]
    assert "P = 113 with 30% trained (--paper-size)" in res["size_note"]
    assert "Spearman with the spectrum's change" in text and "data baseline" in text
    for name in ("grokking_fourier.png", "grokking_fourier.csv"):
        assert (out / name).stat().st_size > 0 and name in res["files"]
    rows = (out / "grokking_fourier.csv").read_text().splitlines()
    assert rows[0].startswith("step,part,k1,k2") and len(rows) == 1 + 2 * 8


def test_paper_size_arguments(tmp_path, capsys):
    """--paper-size is validated only here (a run takes minutes): it is the paper's P and
    training fraction, and it refuses --quick, --P and --train-fraction before any work."""
    from tensoralg.audit.grokking import GrokkingConfig, size_note

    cfg = GrokkingConfig.paper()
    assert (cfg.P, cfg.train_fraction) == (113, 0.3)
    cfg.validate()
    assert size_note(cfg).startswith("size: the paper's (P = 113, 30% of the pairs trained)")
    for extra, named in ((["--quick"], "--quick"), (["--P", "31"], "--P"),
                         (["--train-fraction", "0.5"], "--train-fraction")):
        out = tmp_path / "r"
        assert main(["audit", "grokking", "--paper-size", *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--paper-size" in err[0] and f"drop {named}" in err[0]
        assert not out.exists()
