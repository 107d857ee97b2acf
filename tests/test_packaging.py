"""Packaging: the repository's ``verify/`` folder is installed as ``tensoralg.verify``.

A user's own ``verify.py`` in the working folder used to shadow the top-level package ``verify``
(``from verify.identifiability import compare`` in the README tour then failed); installed as a
subpackage of tensoralg it cannot be shadowed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_pyproject_lists_every_package_and_maps_verify():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tensoralg").rglob("__init__.py")}
    assert set(tool["packages"]) == folders | {"tensoralg.verify"}
    assert tool["package-dir"] == {"tensoralg.verify": "verify"}


def test_a_users_verify_py_does_not_shadow_tensoralg_verify(tmp_path):
    (tmp_path / "verify.py").write_text('raise SystemExit("the user\'s own verify.py was imported")\n')
    code = ("import tensoralg.verify as v\n"
            "from tensoralg.verify.identifiability import compare\n"
            "from tensoralg.verify import certify, symbolic\n"
            "import sys\n"
            "assert 'verify' not in sys.modules, 'the top-level name verify was imported'\n"
            "print(v.__name__, symbolic.__name__, compare.__module__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tensoralg.verify", "tensoralg.verify.symbolic",
                                   "tensoralg.verify.identifiability"]


def test_python_m_tensoralg_verify(tmp_path):
    (tmp_path / "verify.py").write_text('raise SystemExit("the user\'s own verify.py was imported")\n')
    done = subprocess.run([sys.executable, "-m", "tensoralg.verify", "--quick", "--only",
                           "polarization"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "passed" in done.stdout
    done = subprocess.run([sys.executable, "-m", "tensoralg.verify", "--only", "no such check"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("python -m tensoralg.verify: error: no check matches "
                                   "--only 'no such check'")


@pytest.mark.slow
def test_wheel_holds_verify_under_tensoralg(tmp_path):
    # a normal (non-editable) build: the folder verify/ lands at tensoralg/verify/ in the wheel
    # (built from a copy: setuptools writes build/ next to pyproject.toml)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info",
                                                              "__pycache__", ".hypothesis"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert {n.split("/")[0] for n in names} == {"tensoralg", "tensoralg-0.1.0.dist-info"}
    for p in (ROOT / "verify").glob("*.py"):
        assert f"tensoralg/verify/{p.name}" in names
