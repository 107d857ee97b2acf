"""tensoralg.decompose: defects a tester found (messages, --out/--json, --k 0, d = 1)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from netgen import rand_bilinear, rand_linear

import tensoralg as ta
from tensoralg import decompose as dc
from tensoralg.cli import main


def _net(tmp_path, name="ck", d_in=6, d_out=3):
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.nn import BilinearNet

    save_checkpoint(tmp_path / name, BilinearNet(d_in, d_out, d_model=4, d_hidden=5, seed=0))
    return str(tmp_path / name)


def _transformer(tmp_path, name="tr"):
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.transformer import BilinearTransformer

    model = BilinearTransformer(5, 4, 1, 1, 4, n_ctx=3, seed=0)
    save_checkpoint(tmp_path / name, model)
    return str(tmp_path / name), model


# ---- 1. attention models: say plainly what decompose does with them ---------------------------
def test_cli_refuses_a_transformer_diff_against_a_vector_checkpoint(tmp_path, capsys):
    """It said 'paths needs residual blocks around one Linear or Bilinear layer; block 1 wraps a
    BilinearAttention'. A transformer checkpoint now gets its path table
    (tests/test_decompose_transformer_paths.py); a vector CKPT with a transformer --diff is
    refused naming the flag."""
    tr, _ = _transformer(tmp_path)
    out = tmp_path / "run"
    assert main(["decompose", _net(tmp_path), "--diff", tr, "--out", str(out)]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and cap.out == "", cap
    assert f"error: --diff: {tr} holds attention" in err, err
    assert not out.exists()


def test_api_refuses_attention_models_by_argument_name(tmp_path):
    """eigen / chaos_coefficients_depth1 said 'bilinear depth 2', combine and difference raised
    AttributeError ('BilinearAttention' object has no attribute 'layers'), check_decomposition
    and as_bilinear_depth1 TypeError 'unknown layer type', paths the block message above."""
    _, model = _transformer(tmp_path)
    n = model.to_network()
    v = ta.Sequential([rand_linear(np.random.default_rng(0), 5, 4)])
    cases = [(lambda: dc.eigen(n, 0), "model"),
             (lambda: dc.chaos_coefficients_depth1(n), "net"),
             (lambda: dc.as_bilinear_depth1(n), "net"),
             (lambda: dc.path_similarity(v, n), "b"),
             (lambda: dc.combine([v, n]), r"networks\[1\]"),
             (lambda: dc.difference(n, n), "a"),
             (lambda: dc.check_decomposition(v, [n]), r"components\[0\]")]
    for fn, name in cases:
        with pytest.raises(ValueError, match=rf"^{name}: a sequence model \(it holds attention"
                                             rf".*takes apart vector networks only.*"
                                             rf"ta\.similarity"):
            fn()


def _no_work(monkeypatch):
    """Make the decomposition itself fail loudly: a refusal must come before it."""
    import tensoralg.decompose.cli as dcli

    def boom(*a, **k):
        raise AssertionError("the decomposition ran before the refusal")
    monkeypatch.setattr(dcli, "decompose_checkpoint", boom)


# ---- 2. --out / --json that cannot be used ---------------------------------------------------
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (a folder refusing files)")
def test_out_in_a_folder_refusing_files_is_named_before_any_work(tmp_path, capsys, monkeypatch):
    """--out /proc/x failed at the end with "[Errno 2] No such file or directory:
    '/proc/.x.partial-...'", naming neither --out nor the folder."""
    ck = _net(tmp_path)
    _no_work(monkeypatch)
    assert main(["decompose", ck, "--out", "/proc/tensoralg-test-x"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.strip().endswith("error: --out: cannot write /proc/tensoralg-test-x: creating "
                                    "a file in /proc failed (No such file or directory)"), cap.err


@pytest.mark.parametrize("option, kind", [("--out", "folder"), ("--json", "file")])
def test_empty_out_or_json_is_refused(tmp_path, capsys, monkeypatch, option, kind):
    """--out "" used runs/decompose and --json "" wrote no copy, both in silence."""
    ck = _net(tmp_path)
    monkeypatch.chdir(tmp_path)
    _no_work(monkeypatch)
    argv = ["decompose", ck, option, ""] + (["--out", str(tmp_path / "o")]
                                            if option == "--json" else [])
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.strip() == (f"tensoralg decompose: error: {option}: "
                                                 f"expected a {kind} path, got an empty string")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "o").exists()


# ---- 3. --k 0 draws nothing and says so ------------------------------------------------------
def test_k0_claims_no_figure(tmp_path, capsys):
    """--k 0 printed 'figure: output 2' but wrote no figure."""
    ck = _net(tmp_path)
    out = tmp_path / "run"
    assert main(["decompose", ck, "--k", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "figure: output" not in text
    assert "no figure (--k 0: no eigenvectors to draw)" in text
    res = json.loads((out / "decompose.json").read_text())
    assert res["files"] == ["decompose.json"] and res["drawn_output"] is None
    assert not (out / "decompose_eigenvectors.png").exists()
    assert all(e["eigenvectors"] == [] for e in res["eigen"].values())
    # k = 1 still draws, and says which output
    assert main(["decompose", ck, "--k", "1", "--out", str(out)]) == 0
    res = json.loads((out / "decompose.json").read_text())
    assert f"figure: output {res['drawn_output']}" in capsys.readouterr().out
    assert res["files"] == ["decompose.json", "decompose_eigenvectors.png"]


# ---- 4. one input: one eigenvalue, no lambda_2 -----------------------------------------------
def test_one_input_shows_no_second_eigenvalue(tmp_path, capsys):
    """A d = 1 model showed lambda_2 = 0.0000 though it has one eigenvalue only."""
    ck = _net(tmp_path, "ck1", d_in=1, d_out=2)
    out = tmp_path / "run"
    assert main(["decompose", ck, "--k", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    col = header.index("lambda_2")
    rows = [x.split() for x in lines[3:5]]
    assert [r[col] for r in rows] == ["-", "-"], lines
    assert all(float(r[col - 1]) != 0 for r in rows)   # lambda_1 is there
    res = json.loads((out / "decompose.json").read_text())
    assert all(len(e["eigenvalues"]) == 1 for e in res["eigen"].values())


# ---- 5. Python API messages ------------------------------------------------------------------
def test_float_output_is_named_as_not_a_class_index():
    """eigen(m, output=9.0) said 'direction vector must have shape (10,) ... got shape ()'."""
    rng = np.random.default_rng(1)
    net = ta.Sequential([rand_linear(rng, 4, 3), ta.Residual(rand_bilinear(rng, 3, 2, 3)),
                         rand_linear(rng, 3, 10)])
    for bad, shown in ((9.0, "9.0"), (np.float64(2.0), "2.0"), (float("nan"), "nan")):
        with pytest.raises(ValueError, match=r"^output: expected an int class index \(0\.\.9\) "
                                             r"or a direction vector of shape \(10,\), got "
                                             + shown + "$"):
            dc.eigen(net, output=bad)
    assert dc.eigen(net, output=9).output == 9   # an int still works


def test_combine_names_the_bad_coefficient():
    """combine([m, o], [1, nan]) said 'weight: 100 non-finite entries', naming an internal
    weight tensor instead of the coefficient."""
    rng = np.random.default_rng(2)
    m, o = rand_bilinear(rng, 4, 3, 2), rand_bilinear(rng, 4, 3, 2)
    for bad, shown in ((float("nan"), "nan"), (float("inf"), "inf"), ("a", "'a'"),
                       (None, "None"), ([1.0], r"\[1\.0\]")):
        with pytest.raises(ValueError, match=r"^coefficients\[1\]: expected a finite number, "
                                             r"got " + shown + "$"):
            dc.combine([m, o], [1, bad])
    ok = dc.combine([m, o], [1, np.float32(0.5)])
    assert ta.norm(ok) > 0
