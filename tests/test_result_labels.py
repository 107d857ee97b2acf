"""What a result is shows where it is printed (fresh-eyes tester): closure arrays and the
closure diffs say APPROXIMATE (only scalar similarity / inner / norm did), and a Monte Carlo
array's repr and str carry its standard errors and how many entries are not reliable."""

from __future__ import annotations

import numpy as np
import pytest

import tensoralg as ta
from tensoralg.results import MomentClosureArray, MomentClosureValue


def _deep(rng):
    g = rng.normal
    return ta.Sequential([ta.Bilinear(g(size=(4, 3)), g(size=(4, 3)), g(size=(3, 4))),
                          ta.Bilinear(g(size=(4, 3)), g(size=(4, 3)), g(size=(2, 4)))])


rng0 = np.random.default_rng(0)
A, B = _deep(rng0), _deep(rng0)
CL = dict(method="closure")


@pytest.mark.parametrize("call", [
    lambda: ta.similarity_matrix([A, B], **CL), lambda: ta.gram([A, B], **CL),
    lambda: ta.cross_gram([A], [B], **CL), lambda: ta.similarity(A, B, output="each", **CL),
    lambda: ta.inner(A, B, output="each", **CL)])
def test_closure_arrays_say_they_are_approximate(call):
    X = call()
    assert isinstance(X, MomentClosureArray) and "APPROXIMATE" in repr(X)
    assert "APPROXIMATE" in repr(X[:1])          # a slice keeps the label
    assert type(ta.similarity_matrix([A, B])) is np.ndarray   # exact: a plain array


def test_closure_diffs_are_closure_values():
    for v in (ta.diff_norm(A, B, **CL), ta.inner_diff(A, B, A, **CL)):
        assert isinstance(v, MomentClosureValue) and "APPROXIMATE" in repr(v)
    assert type(ta.diff_norm(A, B)) is float


def test_a_monte_carlo_array_shows_its_errors_and_verdicts():
    M = ta.similarity_matrix([A, B], method="montecarlo", n_samples=600, seed=0)
    text = repr(M)
    assert text == str(M) and "APPROXIMATE" in text and "standard errors" in text
    bad = int((~M.reliable).sum())
    assert (f"{bad} of its 4 entries NOT reliable" in text) if bad else \
        "every one of its 4 entries reliable" in text
    with pytest.warns(RuntimeWarning):   # too few directions: the diagonal is flagged too
        few = ta.similarity_matrix([A, B], method="montecarlo", n_samples=7, seed=0)
    assert "NOT reliable" in repr(few) and not few.reliable.all()
    G = ta.gram([A, B], method="montecarlo", n_samples=600)
    assert "standard errors" in repr(G) and "NOT reliable" not in repr(G)   # no verdicts kept
