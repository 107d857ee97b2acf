"""`tensoralg sae` defects: `stability` on runs that share randomness, `bench` with one seed
pair, flags a preset ignores, `--resume` against its recorded config, `evaluate --layer`
against the SAE's recorded hook."""

import json

from tensoralg.cli import main

SYN = ["--synthetic", "6,8,2,512", "--threads", "1", "--no-progress"]


def _train(out, *extra):
    assert main(["sae", "train", *SYN, "--out", str(out), *extra]) == 0


def test_stability_warns_and_records_shared_seeds(tmp_path, capsys):
    _train(tmp_path / "a", "--steps", "3", "--seed", "0", "--preset", "topk")
    _train(tmp_path / "b", "--steps", "3", "--seed", "0", "--preset", "topk", "--lr", "2e-3")
    _train(tmp_path / "c", "--steps", "3", "--seed", "1", "--preset", "topk")
    capsys.readouterr()
    js = tmp_path / "s.json"
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--json", str(js)]) == 0
    err = capsys.readouterr().err
    assert "warning: RUN_A and RUN_B share the initialization seed 0" in err
    assert "share the batch order (seed 0, batch size 256, same data)" in err
    rec = json.loads(js.read_text())["warnings"]
    assert len(rec) == 2 and "initialization seed 0" in rec[0] and "batch order" in rec[1]
    # the same folder twice: identical decoders
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "a"),
                 "--json", str(js)]) == 0
    assert "identical decoders" in capsys.readouterr().err
    # independent seeds: no warning
    assert main(["sae", "stability", str(tmp_path / "a"), str(tmp_path / "c"),
                 "--json", str(js)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert json.loads(js.read_text())["warnings"] == []


def test_bench_with_one_seed_pair_reports_no_spread_and_draws_no_bar(tmp_path, monkeypatch):
    import matplotlib.axes
    import numpy as np

    from tensoralg.sae.bench import plot_bench, run_bench
    r = run_bench(["topk"], quick=True, seeds=2, d=6, m=8, k=2, steps=4, n_train=256,
                  batch_size=32, log=lambda *a: None)
    t = r["topk"]
    # two seeds: one pair, so the cross-seed numbers have no spread (None, not 0.0) ...
    for key in ("code_iou_std", "dcs_std", "code_l2_std"):
        assert t[key] is None, key
        assert t["omp"][key] is None and t["random_init"][key] is None, key
    # ... while the per-seed numbers have two values
    for key in ("fvu_std", "gt_code_iou_std", "rip_delta_std"):
        assert t[key] is not None and np.isfinite(t[key]), key
    drawn = []

    def record(name):
        real = getattr(matplotlib.axes.Axes, name)

        def fn(self, *a, **k):
            if k.get("yerr") is not None:
                drawn.append((self.get_title() or "?", list(np.ravel(k["yerr"]))))
            return real(self, *a, **k)
        return fn
    for name in ("bar", "errorbar"):
        monkeypatch.setattr(matplotlib.axes.Axes, name, record(name))
    plot_bench(r, tmp_path / "b.png")
    # error bars: FVU, ground-truth IoU and δ (two seeds each); none of ±0 for the one pair
    assert [e for _, e in drawn] == [[t["fvu_std"]], [t["gt_code_iou_std"]],
                                     [t["rip_delta_std"]]], drawn
    assert (tmp_path / "b.png").stat().st_size > 0
