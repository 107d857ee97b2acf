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


def test_exact_norms_and_distances_are_exact_results_like_the_exact_similarity():
    """ta.norm / ta.diff_norm with backend="exact" returned bare sympy expressions while the
    exact similarity is an ExactSimilarity (a float with .exact beside it): they are now
    ExactNorm, a float with .exact (sympy sqrt) and .squared (the rational), per output a list;
    the exact similarity of sequence models is an ExactSimilarity too."""
    from fractions import Fraction

    import sympy

    import tensoralg as ta
    from tensoralg.results import ExactNorm, ExactSimilarity

    rng = np.random.default_rng(5)

    def q(*s):
        return np.vectorize(lambda v: Fraction(int(v), 2), otypes=[object])(rng.integers(-3, 4, s))
    a, b = (ta.Bilinear(q(3, 2), q(3, 2), q(2, 3)) for _ in range(2))
    d2 = ta.inner(a, a, backend="exact") - 2 * ta.inner(a, b, backend="exact") + \
        ta.inner(b, b, backend="exact")
    d = ta.diff_norm(a, b, backend="exact")
    assert type(d) is ExactNorm and d.squared == d2
    assert d.exact == sympy.sqrt(sympy.Rational(d2.numerator, d2.denominator))
    assert float(d) == float(sympy.sqrt(sympy.Rational(d2.numerator, d2.denominator)).evalf(30))
    each = ta.diff_norm(a, b, backend="exact", output="each")
    assert isinstance(each, list) and all(type(x) is ExactNorm for x in each)
    assert sum(x.squared for x in each) == d2
    n = ta.norm(a, backend="exact")
    assert type(n) is ExactNorm and n.squared == ta.inner(a, a, backend="exact")
    assert all(type(x) is ExactNorm for x in ta.norm(a, backend="exact", output="each"))
    assert ta.diff_norm(a, a, backend="exact") == 0 and ta.diff_norm(a, a, backend="exact").exact == 0
    assert repr(d).startswith("ExactNorm(")

    def seq():
        w = [q(1, 2, 3) for _ in range(5)]
        return ta.Sequential([ta.Linear(q(3, 2)), ta.Residual(ta.BilinearAttention(*w, q(3, 1, 2))),
                              ta.Linear(q(2, 3))])
    sa, sb = seq(), seq()
    assert type(ta.similarity(sa, sb, n_ctx=2, backend="exact")) is ExactSimilarity
    assert all(type(x) is ExactSimilarity
               for x in ta.similarity(sa, sb, n_ctx=2, backend="exact", output="each"))
