"""``tensoralg import MODULE:FACTORY CKPT --out DIR`` and check_export/from_state_dict on any
network (issue 22 items 2-3)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensoralg as ta  # noqa: E402
from tensoralg.checkpoint import check_export, from_state_dict, load_network  # noqa: E402
from tensoralg.cli import main  # noqa: E402

FACTORY = textwrap.dedent('''
    import torch
    from torch import nn


    class Gated(nn.Module):
        def __init__(self, d=5, h=6, o=3):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, o)

        def forward(self, x):
            return self.c(self.a(x) * self.b(x))


    def build(h=6):
        return Gated(h=h)


    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(7, 4)
            self.l, self.r = nn.Linear(4, 5), nn.Linear(4, 5)

        def forward(self, idx):
            h = self.wte(idx)
            return (self.l(h) * self.r(h)) @ self.l.weight
''')


@pytest.fixture()
def user_code(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mod = importlib.import_module("my_model")
    torch.manual_seed(0)
    module = mod.build()
    torch.save(module.state_dict(), tmp_path / "w.pt")
    return tmp_path, module


def test_import_writes_a_verified_checkpoint(user_code, capsys):
    tmp, module = user_code
    rc = main(["import", "my_model:build", "w.pt", "--out", "ck", "--input-shape", "3,5"])
    assert rc == 0
    assert "verified" in capsys.readouterr().out
    cfg = json.loads((tmp / "ck" / "cfg.json").read_text())
    assert cfg["architecture"] == "tensoralg_network" and cfg["factory"] == "my_model:build"
    net = load_network(tmp / "ck")
    x = np.random.default_rng(0).normal(size=(4, 5))
    ref = module.double()(torch.from_numpy(x)).detach().numpy()
    assert np.abs(net(x) - ref).max() <= 1e-10 * np.abs(ref).max()
    # compare accepts the imported checkpoint (a second import of the same weights: similarity 1)
    assert main(["import", "my_model:build", "w.pt", "--out", "ck2", "--input-shape", "3,5"]) == 0
    assert abs(ta.similarity(net, load_network(tmp / "ck2")) - 1.0) <= 1e-12


def test_import_token_model(user_code):
    tmp, _ = user_code
    import my_model

    torch.manual_seed(1)
    torch.save(my_model.Tok().state_dict(), tmp / "tok.pt")
    for inputs, d_in in (("residual", 4), ("tokens", 7)):
        assert main(["import", "my_model:Tok", "tok.pt", "--out", f"t_{inputs}", "--tokens",
                     "--inputs", inputs, "--input-shape", "2,3"]) == 0
        cfg = json.loads((tmp / f"t_{inputs}" / "cfg.json").read_text())
        assert cfg["d_in"] == d_in and cfg["inputs"] == inputs


def test_import_bad_input_one_line_errors(user_code, capsys):
    tmp, module = user_code
    sd = module.state_dict()
    sd["a.weight"] = sd["a.weight"][:, :4]
    torch.save(sd, tmp / "bad.pt")
    cases = [
        (["import", "my_model:build", "bad.pt", "--out", "x", "--input-shape", "3,5"],
         "does not match the module: 'a.weight' is (6, 4) in CKPT, (6, 5) in the module"),
        (["import", "my_model:build", "w.pt", "--out", "x", "--input-shape", "3,5",
          "--kwargs", '{"h": 7}'], "does not match the module"),
        (["import", "my_model:nope", "w.pt", "--out", "x", "--input-shape", "3,5"],
         "has no callable 'nope'"),
        (["import", "my_model", "w.pt", "--out", "x", "--input-shape", "3,5"],
         "expected 'package.module:callable'"),
        (["import", "my_model:build", "missing.pt", "--out", "x", "--input-shape", "3,5"],
         "no such file"),
        (["import", "my_model:build", "w.pt", "--out", "x", "--input-shape", "3,4"],
         "example_inputs: module(example_inputs) with shape (3, 4)"),
        (["import", "my_model:build", "w.pt", "--out", "x", "--input-shape", "3,a"],
         "--input-shape: expected comma-separated integers"),
        # a keyword the factory does not take: named as --kwargs (was the raw __init__() error)
        (["import", "my_model:build", "w.pt", "--out", "x", "--input-shape", "3,5",
          "--kwargs", '{"hidden": 7}'],
         "tensoralg import: error: --kwargs: my_model:build does not take {\"hidden\": 7} (got an "
         "unexpected keyword argument 'hidden'); its parameters are (h=6)"),
        (["import", "my_model:Gated", "w.pt", "--out", "x", "--input-shape", "3,5",
          "--kwargs", '{"q": 1}'], "--kwargs: my_model:Gated does not take {\"q\": 1}"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err, (argv, err)
    assert not (tmp / "x").exists()   # nothing half-written


def test_check_export_accepts_any_network_and_module():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).double()
    net = ta.Sequential([ta.Linear(lin.weight.detach().numpy(), lin.bias.detach().numpy())])
    x = torch.randn(5, 4, dtype=torch.float64)
    assert check_export(net, lin, x) <= 1e-15
    wrong = ta.Sequential([ta.Linear(lin.weight.detach().numpy()[::-1].copy())])
    with pytest.raises(ValueError, match="the export differs from module"):
        check_export(wrong, lin, x)
    with pytest.raises(ValueError, match=r"inputs must have shape \(n, 4\)"):
        check_export(net, lin, torch.randn(5, 3))


def test_from_state_dict_without_check_warns_about_transposed_weights():
    from tensoralg.nn import BilinearNet

    model = BilinearNet(4, 3, d_model=4, d_hidden=5, n_layers=1, bias=False, residual=True)
    with pytest.warns(UserWarning, match="transposed"):
        from_state_dict(model.state_dict(), residual=True)


def test_compare_matrix_blocks_and_decompose_read_compiled_checkpoints(tmp_path, capsys):
    """Compiled modules saved as checkpoints go through the CLI's compare, matrix (plain and
    blocked) and decompose, and the blocked matrix equals the in-memory similarity."""
    from gallery import models as G

    from tensoralg.checkpoint import save_checkpoint

    paths, nets = [], []
    for i in range(3):
        module, x, _ = G.GALLERY["bilinear_mlp_lerp"]()
        G._init(module, 100 + i)
        nets.append(ta.from_torch(module, x))
        paths.append(str(save_checkpoint(tmp_path / f"m{i}", nets[-1])))
    assert main(["compare", paths[0], paths[1], "--methods", "exact", "--metrics", "gaussian",
                 "--json", str(tmp_path / "c.json")]) == 0
    got = json.loads((tmp_path / "c.json").read_text())["results"]
    want = ta.similarity(nets[0], nets[1])
    assert abs(got[0]["global"] - want) <= 1e-12, got[0]
    assert main(["matrix", *paths, "--out", str(tmp_path / "mx"), "--block-size", "2"]) == 0
    S = np.load(tmp_path / "mx" / "matrix.npy")
    assert abs(S[0, 2] - ta.similarity(nets[0], nets[2])) <= 1e-12
    assert main(["decompose", paths[0], "--out", str(tmp_path / "dec")]) == 0
    assert (tmp_path / "dec" / "decompose.json").is_file()
    capsys.readouterr()


def test_import_refuses_an_unusable_out_before_importing_the_module(tmp_path, monkeypatch,
                                                                   capsys):
    # tester item 3: --out an existing file was a raw OS error, after compiling
    (tmp_path / "marker_mod.py").write_text(
        "open('imported', 'w').close()\ndef build():\n    raise AssertionError\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    for out, msg in (("a_file", "--out: a_file is an existing file; expected a folder that "
                                "does not exist yet, an empty folder or a checkpoint folder"),
                     ("full", "--out: full is a folder that is neither empty nor a checkpoint "
                              "folder (no cfg.json)"),
                     ("a_file/sub", "--out: a_file/sub cannot be created: a_file is a file")):
        assert main(["import", "marker_mod:build", "w.pt", "--out", out,
                     "--input-shape", "3,5"]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err, err
    assert not (tmp_path / "imported").exists()   # the module was never imported


class _NotATensor:
    pass


def test_a_corrupt_pt_file_is_named_without_torchs_unsafe_advice(user_code, capsys):
    # tester item 10: torch's message advises weights_only=False (runs code from the file)
    tmp, _ = user_code
    torch.save({"a.weight": _NotATensor()}, tmp / "pickled.pt")   # refused by weights_only
    (tmp / "garbage.pt").write_bytes(b"not a checkpoint" * 8)
    (tmp / "cut.pt").write_bytes((tmp / "w.pt").read_bytes()[:60])
    for name in ("pickled.pt", "garbage.pt", "cut.pt"):
        assert main(["import", "my_model:build", name, "--out", "x", "--input-shape", "3,5"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"CKPT: {name}: corrupt, or not a state dict of tensors" in err, err
        assert "weights_only=False" not in err and "`False`" not in err and "\n" not in err, err
