"""Shared test set-up."""

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
