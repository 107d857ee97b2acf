"""Small input and exit-code defects of the command line and the model import found by a
tester: ``--workers`` above the CPU count, ``compare`` with no answer at all, NaN / empty
example inputs of ``from_torch``, a non-integer checkpoint ``step``, the few-samples warning of
``compare`` printed twice."""

import json
import os

import pytest
import torch

import tensoralg as ta
from tensoralg import blocks
from tensoralg.checkpoint import load_checkpoint, save_checkpoint
from tensoralg.cli import main
from tensoralg.nn import BilinearNet, BilinearTransformer


def _no_local_cluster(monkeypatch):
    """Make starting a LocalCluster fail loudly: a refusal must come before it."""
    distributed = pytest.importorskip("distributed")

    def started(*a, **k):
        raise AssertionError("a LocalCluster was started")

    monkeypatch.setattr(distributed, "LocalCluster", started)


# ---- 1. --workers / workers= above os.cpu_count() -------------------------------------------

def test_cli_workers_above_cpu_count_is_refused_before_anything(tmp_path, capsys, monkeypatch):
    _no_local_cluster(monkeypatch)
    for i in range(2):
        save_checkpoint(tmp_path / f"c{i}", BilinearNet(6, 3, d_model=4, d_hidden=5, seed=i))
    too_many = (os.cpu_count() or 1) + 1
    with pytest.raises(SystemExit) as exc:
        main(["matrix", str(tmp_path / "c0"), str(tmp_path / "c1"), "--workers", str(too_many),
              "--out", str(tmp_path / "m")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--workers" in err and "os.cpu_count()" in err and str(too_many) in err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1]) > 0
    assert not (tmp_path / "m").exists()


def test_api_workers_above_cpu_count_is_refused(monkeypatch):
    _no_local_cluster(monkeypatch)
    nets = [BilinearNet(6, 3, d_model=4, d_hidden=5, seed=i) for i in range(2)]
    too_many = (os.cpu_count() or 1) + 1
    msg = rf"workers: .*os\.cpu_count\(\) = {os.cpu_count() or 1}.*got {too_many}"
    with pytest.raises(ValueError, match=msg):
        blocks.gram([n.to_network() for n in nets], workers=too_many)
    with pytest.raises(ValueError, match=msg):
        ta.gram(nets, workers=too_many)
    with pytest.raises(ValueError, match=msg):
        ta.similarity_matrix(nets, workers=too_many)


# ---- 2. compare: no method gave an answer -> exit 1 -----------------------------------------

def test_compare_exits_1_when_refused_and_unreliable(tmp_path, capsys):
    # two-layer transformers: exact is refused (too many Wick configurations) and the Monte
    # Carlo estimate at these 400 directions fails its diagnostic ("no reliable estimate")
    for name, seed in (("a", 7), ("b", 8)):
        save_checkpoint(tmp_path / name, BilinearTransformer(11, 8, 2, 2, 4, n_ctx=4, seed=seed))
    js = tmp_path / "c.json"
    rc = main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--n-samples", "400",
               "--json", str(js)])
    res = json.loads(js.read_text())["results"]
    assert all("error" in r or r.get("reliable") is False for r in res)   # the premise
    assert any("error" not in r for r in res)
    err = capsys.readouterr().err
    assert rc == 1
    note = [line for line in err.splitlines() if line.startswith("tensoralg compare:")]
    assert len(note) == 1 and "no reliable estimate" in note[0]


# ---- 3. from_torch: non-finite or empty example inputs --------------------------------------

@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_from_torch_refuses_non_finite_example_inputs(bad):
    x = torch.randn(4, 8)
    x[1, 2] = float(bad)
    with pytest.raises(ValueError, match=r"^example_inputs: .*\(4, 8\).*non-finite"):
        ta.from_torch(torch.nn.Linear(8, 3), x)


@pytest.mark.parametrize("shape", [(0, 8), (0, 3, 8)])
def test_from_torch_refuses_empty_example_inputs(shape):
    with pytest.raises(ValueError, match=rf"^example_inputs: .*{tuple(shape)!r}".replace(
            "(", r"\(").replace(")", r"\)")):
        ta.from_torch(torch.nn.Linear(8, 3), torch.randn(*shape))


# ---- 4. a checkpoint whose step is not an integer -------------------------------------------

@pytest.mark.parametrize("step", ["fifty", 2.5, True, None])
def test_checkpoint_non_integer_step_is_named(tmp_path, step):
    for name, model in (("net", BilinearNet(6, 3, d_model=4, d_hidden=5, seed=0)),
                        ("network", BilinearNet(6, 3, d_model=4, d_hidden=5, seed=0).to_network())):
        path = tmp_path / name
        save_checkpoint(path, model, step=50)
        cfg = json.loads((path / "cfg.json").read_text())
        cfg["step"] = step
        (path / "cfg.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=rf"^{path}: cfg.json 'step' must be an integer"):
            load_checkpoint(path)


def test_cli_non_integer_step_is_one_line(tmp_path, capsys):
    for i in range(2):
        save_checkpoint(tmp_path / f"c{i}", BilinearNet(6, 3, d_model=4, d_hidden=5, seed=i))
    cfg = json.loads((tmp_path / "c1" / "cfg.json").read_text())
    cfg["step"] = "fifty"
    (tmp_path / "c1" / "cfg.json").write_text(json.dumps(cfg))
    assert main(["compare", str(tmp_path / "c0"), str(tmp_path / "c1"),
                 "--methods", "exact"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "c1") in err and "'step'" in err and "Traceback" not in err


# ---- 5. compare with few samples: one warning, not two --------------------------------------

def test_compare_few_samples_warns_once(tmp_path, capsys):
    for i in range(2):
        save_checkpoint(tmp_path / f"c{i}",
                        BilinearNet(6, 3, d_model=4, d_hidden=5, n_layers=2, seed=i))
    with pytest.warns(RuntimeWarning) as rec:
        main(["compare", str(tmp_path / "c0"), str(tmp_path / "c1"), "--n-samples", "100",
              "--methods", "montecarlo", "--metrics", "gaussian"])
    few = [w for w in rec if "n_samples=100 < 300" in str(w.message)]
    assert len(few) == 1


# ---- an explicit --n-samples with a method that draws no samples ---------------------------
@pytest.mark.parametrize("argv", [
    ["compare", "A", "B", "--methods", "exact,closure", "--n-samples", "1000"],
    ["matrix", "A", "B", "--method", "exact", "--n-samples", "1000"],
    ["matrix", "A", "B", "--method", "closure", "--n-samples", "1000", "--block-size", "2"],
    ["audit", "backdoor", "--quick", "--method", "exact", "--n-samples", "1000"],
    ["audit", "forgetting", "--quick", "--method", "closure", "--n-samples", "1000"],
    ["audit", "grokking", "--quick", "--method", "exact", "--n-samples", "1000"],
])
def test_n_samples_without_monte_carlo_is_refused(tmp_path, capsys, argv):
    """The count used to be ignored in silence; it is refused before any file is read or
    written (the checkpoint folders A and B do not exist, and --out stays absent)."""
    out = tmp_path / "out"
    argv = [str(tmp_path / x) if x in ("A", "B") else x for x in argv]
    if argv[0] != "compare":
        argv += ["--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--n-samples 1000:" in err and "draws no samples" in err
    assert not out.exists()


def test_n_samples_with_auto_is_kept(tmp_path, capsys):
    """``auto`` may fall back to Monte Carlo: the count is accepted (the run then fails on the
    missing checkpoints, not on --n-samples)."""
    assert main(["matrix", str(tmp_path / "A"), str(tmp_path / "B"), "--n-samples", "1000",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--n-samples" not in err and "A" in err


def test_cli_warning_is_one_line_named_by_the_command(tmp_path):
    """A warning reads like the errors ("tensoralg compare: warning: ..."), not as a source
    line of the script that started the command (it pointed at the console script)."""
    import subprocess
    import sys

    for i in range(2):
        save_checkpoint(tmp_path / f"c{i}",
                        BilinearNet(6, 3, d_model=4, d_hidden=5, n_layers=2, seed=i))
    run = subprocess.run([sys.executable, "-m", "tensoralg", "compare", str(tmp_path / "c0"),
                          str(tmp_path / "c1"), "--n-samples", "100", "--methods", "montecarlo",
                          "--metrics", "gaussian"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "default"})
    lines = [x for x in run.stderr.splitlines() if "n_samples=100 < 300" in x]
    assert lines == [lines[0]] and lines[0].startswith("tensoralg compare: warning: n_samples=100")


# ---- --out / --json that cannot be written, or empty ----------------------------------------
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (a folder refusing files)")
@pytest.mark.parametrize("argv", [["audit", "backdoor", "--quick"], ["audit", "grokking", "--quick"],
                                  ["matrix", "A", "B"]])
def test_out_in_a_folder_refusing_files_is_named_before_any_work(tmp_path, capsys, argv):
    """--out /proc/x failed at the end with the OS error on a staging folder
    ('/proc/.x.partial-...'), without naming --out; it is refused first, naming it."""
    argv = [str(tmp_path / x) if x in ("A", "B") else x for x in argv]
    assert main(argv + ["--out", "/proc/tensoralg-test-x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("error: --out: cannot write /proc/tensoralg-test-x: creating a file in "
                        "/proc failed (No such file or directory)"), err


@pytest.mark.parametrize("option", ["--out", "--json"])
def test_empty_out_or_json_is_refused(tmp_path, capsys, option, monkeypatch):
    """--out "" used the default folder and --json "" wrote nothing, in silence."""
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "grokking", "--quick", option, ""]) == 2
    err = capsys.readouterr().err.strip()
    kind = "folder" if option == "--out" else "file"
    assert err == f"tensoralg audit grokking: error: {option}: expected a {kind} path, got an " \
                  f"empty string"
    assert not (tmp_path / "runs").exists()
