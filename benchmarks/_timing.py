"""Shared timing helper of the benchmark scripts (run them as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def best_of(fn, repeat: int = 3):
    """``(best wall time in seconds over repeat calls, result of the last call)``."""
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def run_json(code: str, src: Path) -> dict:
    """Run ``code`` in a fresh interpreter on one thread (BLAS; torch is the code's to set)
    with ``src`` (a tensoralg checkout) first on the path and no plan cache; returns the JSON
    object of its last output line, or ``{"error": last line of stderr}``."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TENSORALG_CACHE_DIR="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=str(src))
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])
