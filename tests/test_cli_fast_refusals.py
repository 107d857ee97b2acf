"""Refusals the CLI can make from the arguments and file headers alone come before torch is
imported (that import took 3-5 s idle, up to 16 s on a loaded machine, before saying no):
``matrix`` with one checkpoint, a truncated ``weights.safetensors``. Each exit 2, nothing
created."""

import subprocess
import sys

import numpy as np


def _cli(argv):
    code = ("import sys\n"
            "from tensoralg.cli import main\n"
            "try:\n"
            f"    rc = main({argv!r})\n"
            "except SystemExit as e:\n"
            "    rc = e.code\n"
            "print('RC', rc, 'torch' in sys.modules)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_matrix_one_checkpoint_refused_before_torch(tmp_path):
    out = tmp_path / "m"
    r = _cli(["matrix", str(tmp_path), "--out", str(out)])
    assert "RC 2 False" in r.stdout, (r.stdout, r.stderr)
    assert "checkpoints: need at least two, got 1" in r.stderr
    assert not out.exists()


def test_truncated_weights_refused_before_torch(tmp_path):
    from safetensors.numpy import save_file

    from tensoralg.io import atomic_write_json

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        atomic_write_json(tmp_path / name / "cfg.json", {"architecture": "bilinear_net"})
        w = tmp_path / name / "weights.safetensors"
        save_file({"embed.weight": np.ones((4, 3))}, str(w))
    data = (tmp_path / "a" / "weights.safetensors").read_bytes()
    (tmp_path / "a" / "weights.safetensors").write_bytes(data[: len(data) - 20])
    r = _cli(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--methods", "exact"])
    assert "RC 2 False" in r.stdout, (r.stdout, r.stderr)
    assert "weights.safetensors: corrupt or truncated safetensors file" in r.stderr
