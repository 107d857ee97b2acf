"""Shared timing helper of the benchmark scripts (run them as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import time


def best_of(fn, repeat: int = 3):
    """``(best wall time in seconds over repeat calls, result of the last call)``."""
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out
