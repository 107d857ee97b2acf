"""``tensoralg matrix`` with one checkpoint is refused by its count, exit 2, before torch is
imported (it took 3-5 s of torch import to say so) and before ``--out`` is created."""

import subprocess
import sys


def test_one_checkpoint_refused_before_torch(tmp_path):
    out = tmp_path / "m"
    code = ("import sys\n"
            "from tensoralg.cli import main\n"
            "try:\n"
            f"    rc = main(['matrix', {str(tmp_path)!r}, '--out', {str(out)!r}])\n"
            "except SystemExit as e:\n"
            "    rc = e.code\n"
            "print('RC', rc, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RC 2 False" in r.stdout, (r.stdout, r.stderr)
    assert "checkpoints: need at least two, got 1" in r.stderr
    assert not out.exists()
