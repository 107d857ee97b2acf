"""An inner product that overflows float64 is an error on every entry point (it was a silent
NaN everywhere but ta.similarity), and a zero-norm model is named by its argument whatever
the pair's internal order (the message named the other one, with numbers of an internal
gauge, or a 500-character integer on the exact backend)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tensoralg as ta


def _net(rng, scale=1.0):
    return ta.Sequential([ta.Linear(rng.normal(size=(4, 4)) * scale),
                          ta.Bilinear(rng.normal(size=(5, 4)), rng.normal(size=(5, 4)),
                                      rng.normal(size=(2, 5)))])


rng0 = np.random.default_rng(0)
X, HUGE = _net(rng0), _net(rng0, 1e200)   # HUGE: finite weights, activations beyond 1e154
MC = dict(method="montecarlo", n_samples=600)
CALLS = {
    "similarity": lambda: ta.similarity(X, HUGE),
    "inner": lambda: ta.inner(X, HUGE),
    "inner each": lambda: ta.inner(X, HUGE, output="each"),
    "norm": lambda: ta.norm(HUGE),
    "gram": lambda: ta.gram([X, HUGE]),
    "cross_gram": lambda: ta.cross_gram([X], [HUGE]),
    "similarity_matrix": lambda: ta.similarity_matrix([X, HUGE]),
    "similarity_matrix wick": lambda: ta.similarity_matrix([X, HUGE], strategy="wick"),
    "similarity_matrix closure": lambda: ta.similarity_matrix([X, HUGE], method="closure"),
    "inner closure": lambda: ta.inner(X, HUGE, method="closure"),
    "diff_norm": lambda: ta.diff_norm(X, HUGE),
    "inner_diff": lambda: ta.inner_diff(X, HUGE, X),
    "similarity mc": lambda: ta.similarity(X, HUGE, **MC),
    "inner mc": lambda: ta.inner(X, HUGE, **MC),
    "similarity_matrix mc": lambda: ta.similarity_matrix([X, HUGE], **MC),
    "gram mc": lambda: ta.gram([X, HUGE], **MC),
    "diff_norm mc": lambda: ta.diff_norm(X, HUGE, **MC),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_an_overflow_is_an_error_on_every_entry_point(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ValueError, match="overflowed float64"):
            CALLS[name]()


def test_the_exact_backend_computes_what_float64_cannot():
    s = ta.similarity(X, HUGE, backend="exact")
    assert -1 <= float(s) <= 1


@pytest.mark.parametrize("backend", ["numpy", "exact"])
def test_a_zero_norm_model_is_named_by_its_argument_in_either_order(backend):
    rng = np.random.default_rng(1)
    z = ta.Sequential([ta.Linear(np.zeros((4, 4))), _net(rng).layers[1]])
    x = _net(rng)
    for a, b, who in ((z, x, "a has"), (x, z, "b has"), (z, z, "a and b have")):
        with pytest.raises(ValueError, match=f"^similarity: {who} norm zero") as err:
            ta.similarity(a, b, backend=backend)
        assert len(str(err.value)) < 250     # no internal numbers, no 500-digit integer
