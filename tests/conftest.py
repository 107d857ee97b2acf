"""Shared test set-up."""

import gc
import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The CI machine is small (2 cores): one torch thread for the whole run, restored after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_sessionfinish(session):
    """Collect the session's garbage now and freeze what is left (:func:`gc.freeze`).

    Under pytest-xdist the controller tells each worker to exit once all have reported
    "workerfinished" (sent by xdist after every ``pytest_sessionfinish`` implementation, this
    one included); execnet sends a worker SIGINT if it is still executing 5 s later
    (``execnet.gateway_base``, ``_terminate_execution``). The worker was then inside pytest's
    own final ``gc.collect()`` (``pytest_unconfigure``, its unraisable-exception check): a full
    traversal of every live object, seconds on a loaded 2-core machine. The KeyboardInterrupt
    was raised in the one piece of Python that runs during a collection, hypothesis's gc
    callback, and printed as a stray PytestUnraisableExceptionWarning after the last test.
    Collected here, before "workerfinished", and frozen, that last collection traverses only
    the objects made after (measured on three test files: 0.30 s -> 0.000 s); garbage found
    here still reports its unraisable exceptions.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture
def pair_without_cross_check(monkeypatch):
    """``ta.inner`` / ``ta.similarity`` by plain Monte Carlo WITHOUT the guided cross-check
    (``engine._mode_checked`` made the identity): what a Monte Carlo matrix entry is (matrices
    run no cross-check, docs/montecarlo.md), so a test can compare an entry with its pair."""
    from tensoralg import engine

    monkeypatch.setattr(engine, "_mode_checked", lambda est, degree, make_ref: est)
