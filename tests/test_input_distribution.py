"""The input distribution is part of the metric (issue 21 item 2, docs/mathematics.md §3.9):
``<f_a, f_b>`` under ``x ~ N(0, Σ)``, checked against expectations recomputed from the
definition — sympy polynomials of the networks and the Gaussian moments of ``N(0, Σ)`` from its
moment generating function ``exp(t^T Σ t / 2)`` — and, for sequence models, against Monte Carlo
with its standard error."""

from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np
import pytest
import sympy as sp

import tensoralg as ta

Q = lambda rng, *s: np.vectorize(lambda v: Fraction(int(v), 4), otypes=[object])(  # noqa: E731
    rng.integers(-4, 5, s))


def _bilinear(rng, d=2, h=3, o=2, rational=True, bias=True):
    W = (lambda *s: Q(rng, *s)) if rational else (lambda *s: rng.normal(size=s))
    kw = dict(left_bias=W(h), right_bias=W(h), down_bias=W(o)) if bias else {}
    return ta.Bilinear(W(h, d), W(h, d), W(o, h), **kw)


def _sympy_cov(S):
    return sp.Matrix([[sp.nsimplify(Fraction(x)) if isinstance(x, (Fraction, str)) else
                       sp.Rational(Fraction(float(x))) for x in row] for row in np.asarray(S,
                                                                                    dtype=object)])


def gaussian_inner(a, b, S) -> sp.Rational:
    """``sum_o E[f_a(x)_o f_b(x)_o]``, ``x ~ N(0, S)``, from the definition: the networks
    evaluated on sympy symbols (their own forward pass), the product expanded, and each
    monomial's moment read from the moment generating function of ``N(0, S)``."""
    S = _sympy_cov(S)
    d = S.shape[0]
    xs = sp.symbols(f"x0:{d}")
    ts = sp.symbols(f"t0:{d}")
    t = sp.Matrix(ts)
    mgf = sp.exp((t.T * S * t)[0, 0] / 2)

    @functools.cache
    def moment(alpha):
        expr = mgf
        for ti, k in zip(ts, alpha):
            expr = sp.diff(expr, ti, k)
        return sp.nsimplify(expr.subs(dict.fromkeys(ts, 0)))

    X = np.array([list(xs)], dtype=object)
    fa, fb = a(X)[0], b(X)[0]
    prod = sp.expand(sum(sp.nsimplify(x) * sp.nsimplify(y) for x, y in zip(fa, fb)))
    return sum(c * moment(m) for m, c in sp.Poly(prod, *xs).terms())


def _frac(v):
    return Fraction(int(v.p), int(v.q))


# ---- exact in rationals ----------------------------------------------------------------------

def test_exact_rational_factor_equals_the_definition():
    """⟨f_a, f_b⟩ under N(0, K Kᵀ) with a rational K, exactly (a Fraction), equals the
    expectation under N(0, Σ) computed from the definition."""
    rng = np.random.default_rng(0)
    a, b = _bilinear(rng), _bilinear(rng)
    K = np.array([[Fraction(3, 2), Fraction(0)], [Fraction(-1, 2), Fraction(1, 3)]],
                 dtype=object)
    S = K @ K.T
    got = ta.inner(a, b, cov=ta.CovarianceFactor(K), backend="exact")
    assert isinstance(got, Fraction)
    assert got == _frac(gaussian_inner(a, b, S))
    # a scalar and a diagonal with rational square roots are exact too
    assert ta.inner(a, b, cov="9/4", backend="exact") == _frac(
        gaussian_inner(a, b, np.diag([Fraction(9, 4)] * 2)))
    assert ta.inner(a, b, cov=["4", "1/9"], backend="exact") == _frac(
        gaussian_inner(a, b, np.diag([Fraction(4), Fraction(1, 9)])))


def test_exact_similarity_under_a_covariance():
    rng = np.random.default_rng(1)
    a, b = _bilinear(rng), _bilinear(rng)
    K = ta.CovarianceFactor([["1", "1/2"], ["0", "2"]])
    s = ta.similarity(a, b, cov=K, backend="exact")
    S = K.K @ K.K.T
    ab, aa, bb = (_frac(gaussian_inner(x, y, S)) for x, y in ((a, b), (a, a), (b, b)))
    assert s.squared == (1 if ab >= 0 else -1) * ab * ab / (aa * bb)


# ---- float64: scalar, diagonal, full, estimated; every strategy --------------------------------

@pytest.mark.parametrize("strategy", ["wick", "chaos"])
def test_float_covariances_equal_the_definition(strategy):
    rng = np.random.default_rng(2)
    a, b = _bilinear(rng, d=3), _bilinear(rng, d=3)
    A = rng.normal(size=(3, 3))
    full = A @ A.T + 0.1 * np.eye(3)
    for cov, S in [(2.5, 2.5 * np.eye(3)), ([0.5, 2.0, 3.0], np.diag([0.5, 2.0, 3.0])),
                   (full, full)]:
        want = float(gaussian_inner(a, b, S))
        got = ta.inner(a, b, cov=cov, strategy=strategy)
        assert abs(got - want) <= 1e-10 * abs(want), (cov, got, want)


def test_a_singular_covariance_is_a_distribution_on_a_subspace():
    """Σ of rank 1 along v: x = z v, so f is read on one line only (eigh factor, no Cholesky)."""
    rng = np.random.default_rng(3)
    a, b = _bilinear(rng, rational=False), _bilinear(rng, rational=False)
    v = np.array([0.6, 0.8])
    S = np.outer(v, v)
    want = float(gaussian_inner(a, b, S))
    assert ta.inner(a, b, cov=S) == pytest.approx(want, rel=1e-10)


def test_deeper_models_and_montecarlo_under_a_covariance():
    rng = np.random.default_rng(4)
    a = ta.Sequential([ta.Linear(rng.normal(size=(2, 2))), ta.Residual(_bilinear(rng, o=2,
                                                                                rational=False)),
                       ta.Linear(rng.normal(size=(2, 2)))])
    b = ta.Sequential([ta.Residual(_bilinear(rng, rational=False)),
                       ta.Linear(rng.normal(size=(2, 2)))])
    S = np.array([[1.5, -0.4], [-0.4, 0.7]])
    want = float(gaussian_inner(a, b, S))
    assert ta.inner(a, b, cov=S) == pytest.approx(want, rel=1e-10)
    est = ta.inner(a, b, cov=S, method="montecarlo", n_samples=4000, seed=1)
    assert abs(float(est) - want) <= 4 * est.stderr
    sim = ta.similarity(a, b, cov=S, method="closure")   # depth 1 in bilinear layers: exact
    assert sim == pytest.approx(ta.similarity(a, b, cov=S), rel=1e-10)


def test_activations_give_their_sample_covariance():
    rng = np.random.default_rng(5)
    a, b = _bilinear(rng, d=3, rational=False), _bilinear(rng, d=3, rational=False)
    X = rng.normal(size=(50, 3)) @ rng.normal(size=(3, 3))
    assert ta.inner(a, b, cov=X) == ta.inner(a, b, cov=np.cov(X, rowvar=False))
    p = ta.plan(a, b, cov=X)
    assert "sample covariance of 50 activation rows" in p.input_distribution


def test_scale_decides_which_degree_dominates():
    """Inputs scaled by σ multiply the degree-k part by σ^k: a homogeneous quadratic's squared
    norm scales by σ^4 exactly, a linear one's by σ^2."""
    rng = np.random.default_rng(6)
    q = _bilinear(rng, bias=False)
    lin = ta.Linear(Q(rng, 2, 2))
    for f, k in ((q, 2), (lin, 1)):
        assert ta.inner(f, f, cov="4", backend="exact") == 4 ** k * ta.inner(f, f,
                                                                             backend="exact")


def test_plans_record_the_distribution():
    rng = np.random.default_rng(7)
    a = _bilinear(rng, rational=False)
    assert ta.plan(a).input_distribution == "N(0, I)"
    assert "input: N(0, I)" in ta.plan(a).summary()
    p = ta.plan(a, cov=[1.0, 2.0])
    assert p.input_distribution.startswith("N(0, Sigma), d = 2: diagonal")


# ---- sequence models: the same Σ at every position --------------------------------------------

def _attn(rng):
    W = lambda *s: rng.normal(size=s)  # noqa: E731
    return ta.Residual(ta.BilinearAttention(W(1, 2, 2), W(1, 2, 2), W(1, 2, 2), W(1, 2, 2),
                                            W(1, 1, 2), W(2, 1, 1), q1_bias=W(1, 2),
                                            v_bias=W(1, 1)))


def test_sequence_models_read_the_covariance_at_every_position():
    """Exact one-layer attention under N(0, Σ) per position against plain Monte Carlo that
    draws every position's input from N(0, Σ) (its own sampling: |z| < 4), and against the
    standard metric of the models composed with the factor by hand."""
    rng = np.random.default_rng(8)
    a, b = _attn(rng), _attn(rng)
    S = np.array([[0.8, 0.3], [0.3, 0.5]])
    exact = ta.inner(a, b, n_ctx=2, cov=S)
    L = np.linalg.cholesky(S)
    composed = ta.inner(ta.Sequential([ta.Linear(L), a]), ta.Sequential([ta.Linear(L), b]),
                        n_ctx=2)
    assert exact == pytest.approx(composed, rel=1e-10)
    X = np.random.default_rng(0).standard_normal((200_000, 2, 2)) @ L.T
    p = (a(X) * b(X)).sum(axis=(1, 2))
    z = (p.mean() - exact) / (p.std(ddof=1) / np.sqrt(p.size))
    assert abs(z) < 4, z
    est = ta.inner(a, b, n_ctx=2, cov=S, method="montecarlo", n_samples=2000, seed=3)
    assert abs(float(est) - exact) <= 4 * est.stderr
    assert ta.plan(a, b, n_ctx=2, cov=S).input_distribution.startswith("N(0, Sigma)")


# ---- bad input: one-line errors before any work -----------------------------------------------

@pytest.mark.parametrize("cov,msg", [
    (np.array([[1.0, 0.5], [0.4, 1.0]]), "cov: the covariance matrix of shape \\(2, 2\\) is not "
                                         "symmetric"),
    (np.array([[1.0, 2.0], [2.0, 1.0]]), "not positive semidefinite \\(smallest eigenvalue -1"),
    (np.zeros((2, 2)), "cov: the covariance matrix is zero"),
    (np.array([[1.0, np.nan], [np.nan, 1.0]]),
     "cov: 2 non-finite \\(NaN or inf\\) entries in an array of shape \\(2, 2\\); a "
     "covariance \\(or activations\\) must be finite$"),
    (np.array([[1.0, np.inf, 0.0]]).T, "cov: 1 non-finite .*; a covariance \\(or activations\\) "
                                       "must be finite$"),
    # square activations (n = d) are read as a covariance: the refusal says so (tester item 5)
    (np.arange(64.0).reshape(8, 8), "cov: the covariance matrix of shape \\(8, 8\\) is not "
     "symmetric \\(max .*\\); a square \\(8, 8\\) array is read as a covariance matrix — "
     "activations need more rows than features \\(n > d = 8\\)$"),
    (-1.0, "cov: a scalar variance must be positive"),
    (float("inf"), "cov: a scalar variance must be finite"),
    ([1.0, 0.0], "cov: a diagonal covariance needs positive variances"),
    (np.ones((2, 5)), "cov: activations of shape \\(2, 5\\) have fewer rows \\(2\\) than "
                      "features \\(5\\)"),
    (np.ones((2, 2, 2)), "cov: expected None, a positive scalar"),
    ("abc", "cov: cannot read 'abc' as a variance"),
])
def test_bad_covariances_are_refused_before_any_work(cov, msg):
    from test_request import ENTRY_POINTS

    for name, call in ENTRY_POINTS.items():
        with pytest.raises(ValueError, match=msg) as info:
            call(dict(cov=cov))
        assert "\n" not in str(info.value), name


def test_covariance_refusals_that_need_the_models_or_the_backend():
    rng = np.random.default_rng(9)
    a, b = _bilinear(rng), _bilinear(rng)
    with pytest.raises(ValueError, match=r"^cov: a covariance matrix of shape \(3, 3\) for a, "
                                         r"which reads 2 input features \(per position\); "
                                         r"expected \(2, 2\)$"):
        ta.inner(a, b, cov=np.eye(3))
    # a vector of variances is named as what the user gave (it said "a covariance of size 3 x 3")
    with pytest.raises(ValueError, match=r"^cov: a vector of 3 variances \(a diagonal "
                                         r"covariance\) for a, which reads 2 input features "
                                         r"\(per position\); expected 2 variances$"):
        ta.inner(a, b, cov=np.ones(3))
    with pytest.raises(ValueError, match=r"^cov: 10 activation rows of 3 features for a"):
        ta.inner(a, b, cov=rng.normal(size=(10, 3)))
    with pytest.raises(ValueError, match="irrational square root"):
        ta.inner(a, b, cov=2, backend="exact")
    with pytest.raises(ValueError, match="a full covariance matrix needs a rational factor"):
        ta.inner(a, b, cov=np.eye(2), backend="exact")
    with pytest.raises(ValueError, match="cov: the input distribution belongs to the Gaussian"):
        ta.inner(a, b, cov=2.0, metric="frobenius")
    with pytest.raises(ValueError, match="cov: the blocked path"):
        ta.gram([a, b], cov=2.0, block_size=1)


def test_a_zero_factor_is_refused_as_a_covariance():
    from test_request import ENTRY_POINTS

    for _name, call in ENTRY_POINTS.items():
        with pytest.raises(ValueError, match=r"cov: the factor K of shape \(2, 2\) is zero"):
            call(dict(cov=ta.CovarianceFactor(np.zeros((2, 2)))))


def test_a_non_finite_factor_is_refused_as_a_covariance_factor():
    # tester item 6: the message named weights, not the covariance
    with pytest.raises(ValueError, match=r"^cov \(factor K\): 1 non-finite \(NaN or inf\) entries "
                                         r"in an array of shape \(2, 2\); the factor K must be "
                                         r"finite$"):
        ta.CovarianceFactor([[1.0, np.nan], [0.0, 1.0]])
