"""``--data npz:PATH`` on the backdoor and forgetting audits: your own images (any size), each
bad file refused in one line naming ``--data`` (exit 2) before any training, and a run on a tiny
generated data set."""

import json

import numpy as np
import pytest

from tensoralg.cli import main
from tensoralg.data import load_npz_data, trigger_mask, trigger_pixels


def _images(k=4, per_train=30, per_test=12, shape=(6, 7, 2), seed=0):
    """``k`` classes of ``H x W x C`` images: class c lights a block of rows/columns of its
    own, plus noise; the left column stays dark (where the trigger goes)."""
    rng = np.random.default_rng(seed)
    h, w, _ = shape

    def split(n):
        X = rng.uniform(0.0, 0.2, size=(k * n, *shape)).astype(np.float32)
        y = np.repeat(np.arange(k), n)
        for c in range(k):
            X[y == c, (c % h):(c % h) + 2, 2 + (c % (w - 3)):4 + (c % (w - 3)), :] += 0.8
        X[:, :, 0, :] = 0.0
        return X, y

    X_train, y_train = split(per_train)
    X_test, y_test = split(per_test)
    return dict(X_train=X_train, y_train=y_train, X_test=X_test, y_test=y_test)


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_the_trigger_generalises_the_digits_one():
    assert trigger_pixels(8) == ((5, 0), (6, 0), (7, 0), (6, 1))
    assert trigger_mask().tolist() == trigger_mask(trigger_pixels(8), shape=(8, 8, 1)).tolist()
    m = trigger_mask(trigger_pixels(6), shape=(6, 7, 2)).reshape(6, 7, 2)
    assert m.sum() == 8 and m[3, 0].all() and m[4, 0].all() and m[5, 0].all() and m[4, 1].all()


def test_load_npz_flattens_images_channels_last(tmp_path):
    arrays = _images()
    d = load_npz_data(_npz(tmp_path / "d.npz", **arrays))
    assert d.image_shape == (6, 7, 2) and d.n_classes == 4 and d.d_in == 84
    assert np.array_equal(d.X_train[5].numpy(), arrays["X_train"][5].reshape(-1))
    assert "sha256" in d.provenance
    flat = load_npz_data(_npz(tmp_path / "f.npz", **{**arrays,
                              "X_train": np.zeros((120, 16), np.float32),
                              "X_test": np.zeros((48, 16), np.float32)}))
    assert flat.image_shape == (4, 4, 1)


def _bad_files():
    a = _images()
    nan = a["X_test"].copy()
    nan[3, 1, 2, 0] = np.nan
    return {
        "missing array": ({k: v for k, v in a.items() if k != "y_test"},
                          "lacks array(s) y_test"),
        "labels of another length": ({**a, "y_train": a["y_train"][:-1]},
                                     "y_train has shape (119,); expected (120,)"),
        "images of other sizes": ({**a, "X_test": a["X_test"][:, :5]},
                                  "X_train images are (6, 7, 2) (H, W, C) but X_test images "
                                  "are (5, 7, 2)"),
        "flat rows, not square": ({**a, "X_train": np.zeros((120, 10), np.float32)},
                                  "flat rows must have a square length"),
        "float labels": ({**a, "y_train": a["y_train"].astype(float)},
                         "y_train must hold integer class labels"),
        "test label out of range": ({**a, "y_test": np.where(a["y_test"] == 3, 7, a["y_test"])},
                                    "y_test has label 7, outside the training classes 0 .. 3"),
        "negative label": ({**a, "y_train": a["y_train"] - 1}, "labels must be 0 .. K-1, got -1"),
        "class absent from test": ({**a, "y_test": np.where(a["y_test"] == 2, 1, a["y_test"])},
                                   "class(es) 2 of 0 .. 3 do not occur in y_test"),
        "NaN pixel": ({**a, "X_test": nan}, "X_test has 1 NaN or infinite value(s) (first in "
                                            "image 3)"),
    }


@pytest.mark.parametrize("audit", ("backdoor", "forgetting"))
@pytest.mark.parametrize("case", sorted(_bad_files()))
def test_bad_npz_is_refused_before_training(audit, case, tmp_path, capsys):
    arrays, message = _bad_files()[case]
    path = _npz(tmp_path / "bad.npz", **arrays)
    out = tmp_path / "run"
    rc = main(["audit", audit, "--quick", "--data", f"npz:{path}", "--out", str(out),
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"--data npz:{path}" in err[0] and message in err[0], err[0]
    assert not out.exists()


def test_a_bad_data_spec_or_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["audit", "backdoor", "--quick", "--data", "svhn", "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    assert "--data: expected 'digits' or 'npz:PATH'" in capsys.readouterr().err
    assert main(["audit", "forgetting", "--quick", "--data", f"npz:{tmp_path}/none.npz",
                 "--out", str(tmp_path / "r")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "junk.npz").write_text("not a zip")
    assert main(["audit", "forgetting", "--quick", "--data", f"npz:{tmp_path}/junk.npz",
                 "--out", str(tmp_path / "r")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_class_options_follow_the_files_classes(tmp_path, capsys):
    path = _npz(tmp_path / "d.npz", **_images(k=4))
    assert main(["audit", "backdoor", "--quick", "--data", f"npz:{path}", "--target", "4",
                 "--out", str(tmp_path / "r")]) == 2
    assert "--target: expected a class 0..3 of --data npz:" in capsys.readouterr().err
    assert main(["audit", "forgetting", "--quick", "--data", f"npz:{path}",
                 "--removed-class", "9", "--out", str(tmp_path / "r")]) == 2
    assert "--removed-class: expected a class 0..3" in capsys.readouterr().err
    small = _npz(tmp_path / "s.npz", **_images(k=2))
    assert main(["audit", "forgetting", "--quick", "--data", f"npz:{small}",
                 "--out", str(tmp_path / "r")]) == 2
    assert "2 classes; the curriculum needs at least 3" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_backdoor_and_forgetting_run_on_a_generated_npz(tmp_path, capsys):
    """4 classes of 6x7 two-channel images: both audits run end to end on the file's own split,
    with models of the file's input size and class count."""
    path = _npz(tmp_path / "d.npz", **_images(k=4))
    out = tmp_path / "b"
    assert main(["audit", "backdoor", "--quick", "--steps", "150", "--finetune-steps", "100",
                 "--data", f"npz:{path}", "--target", "3", "--out", str(out),
                 "--no-progress"]) == 0
    assert "backdoor audit on npz:" in capsys.readouterr().out
    res = json.loads((out / "backdoor.json").read_text())
    assert sorted(res["slice_similarity"], key=int) == ["0", "1", "2", "3"]
    assert res["config"]["data"] == f"npz:{path}" and "sha256" in res["data"]
    assert res["n_test"] == 48
    assert res["attack_success_rate"] > res["attack_success_rate_before"]
    cfg = json.loads((out / "checkpoints" / "clean" / "cfg.json").read_text())
    assert (cfg["d_in"], cfg["d_out"]) == (84, 4)   # 6 * 7 * 2 pixels, 4 classes
    cfg = json.loads((out / "checkpoints" / "backdoored" / "cfg.json").read_text())
    assert "(3, 0), (4, 0), (5, 0), (4, 1)" in json.dumps(cfg)   # the trigger of 6-high images
    assert res["finding"]["trigger_pixel_share"] == 8 / 84

    out = tmp_path / "f"
    assert main(["audit", "forgetting", "--quick", "--stage-steps", "60", "--data",
                 f"npz:{path}", "--removed-class", "1", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "forgetting.json").read_text())
    # K // 2 = 2 base classes (0, 2), then +3, +1, -1, +1 again
    assert [s["label"] for s in res["stages"]] == ["{0,2}", "+3", "+1", "-1", "+1 again"]
    assert res["reference_stage"] == "+1"
    assert len(res["slice_similarity_to_reference"]["-1"]) == 4
