"""CPU thread counts for torch and for the BLAS/OpenMP libraries under NumPy and SciPy.

Every ``tensoralg`` command takes ``--threads N`` (default `DEFAULT_THREADS` = 1) and
applies it here before any work. Python API users call
[`set_threads`][tensoralg.threads.set_threads] themselves; the library never changes thread counts
on import.

Why a default of one thread: the models here are small (matrices of tens to hundreds of rows),
where a thread pool's synchronisation costs more than it saves, and on a loaded machine extra
threads wait for cores. Measured on a 2-core machine shared with other jobs
(``benchmarks/bench_threads.py``, interleaved, medians of 3): ``train_classifier`` on the digits,
300 steps, 2.6 s with one thread against 25.4 s with torch's default of 2 (9.7x).
On an idle many-core machine with large models, pass ``--threads 0`` (the libraries' defaults,
usually one thread per core) or a larger N.

BLAS threads are set through threadpoolctl (OpenBLAS, MKL, BLIS and OpenMP runtimes, whichever
NumPy/SciPy/torch loaded), torch's intra-op pool through ``torch.set_num_threads``.
"""

from __future__ import annotations

import argparse
import numbers
import os

__all__ = ["DEFAULT_THREADS", "set_threads", "add_threads_option"]

DEFAULT_THREADS = 1
_ORIGINAL: dict = {}


def set_threads(n: int = DEFAULT_THREADS) -> None:
    """Use ``n`` CPU threads in torch and in BLAS/OpenMP; ``n = 0`` restores the libraries'
    defaults (as they were when this function was first called).

    Raises:
        ValueError: ``n`` not an integer >= 0, or more than ``os.cpu_count()`` (100 000
            threads crash torch's thread pool with a segmentation fault).
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"threads: expected an integer >= 0 (0: the libraries' defaults), "
                         f"got {n!r}")
    if too_many_threads(n):
        raise ValueError(f"threads: {too_many_threads(n)}")
    import torch
    from threadpoolctl import threadpool_limits

    if not _ORIGINAL:
        _ORIGINAL["torch"] = torch.get_num_threads()
        _ORIGINAL["pools"] = threadpool_limits()  # no limits: remembers the current ones
    if n == 0:
        torch.set_num_threads(_ORIGINAL["torch"])
        _ORIGINAL["pools"].restore_original_limits()
        return
    torch.set_num_threads(int(n))
    threadpool_limits(limits=int(n))


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0 (``--threads``, ``--k``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def too_many_threads(n: int) -> str:
    """Why ``n`` CPU threads are refused ("" when they are not): more threads than
    ``os.cpu_count()`` only compete for the cores, and very many crash the libraries' thread
    pools (torch: a segmentation fault at 65 536; libgomp: "Thread creation failed")."""
    cpus = os.cpu_count() or 1
    if n <= cpus:
        return ""
    return f"expected at most os.cpu_count() = {cpus} threads (one per CPU core), got {n}"


def thread_count(text: str) -> int:
    """argparse type of ``--threads``: an integer from 0 to ``os.cpu_count()``."""
    n = nonneg_int(text)
    why = too_many_threads(n)
    if why:
        raise argparse.ArgumentTypeError(why)
    return n


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads N`` (applied by `tensoralg.cli.main` before the command runs)."""
    parser.add_argument("--threads", type=thread_count, default=DEFAULT_THREADS, metavar="N",
                        help=f"CPU threads for torch and BLAS (default {DEFAULT_THREADS}: fastest "
                             f"for these small models on shared machines; 0: the libraries' "
                             f"defaults, one per core; at most the number of cores)")
