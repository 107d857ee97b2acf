"""Exactness of tensoralg.inner against the shared reference cases and an independent brute force
(polynomial expansion in rationals, tensoralg.verify.certify.gaussian_inner_exact)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from netgen import KINDS, brute_inner, rand_network
from shared_cases import load_cases

import tensoralg as ta

CASES = load_cases()


def _rel(x, ref, scale):
    return abs(float(x) - float(ref)) / float(scale)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_shared_cases_exact_and_float(case):
    a = ta.Sequential.from_spec(case["a"])
    b = ta.Sequential.from_spec(case["b"])
    assert a.is_exact and b.is_exact
    for key, (x, y) in {"aa": (a, a), "ab": (a, b), "bb": (b, b)}.items():
        want = Fraction(case[key])
        got = ta.inner(x, y, backend="exact")
        assert isinstance(got, Fraction) and got == want, (key, got, want)
        fl = ta.inner(x.astype_float(), y.astype_float())
        assert abs(fl - float(want)) <= 1e-10 * abs(float(want)), (key, fl, want)
    sim = ta.similarity(a.astype_float(), b.astype_float())
    assert sim == pytest.approx(case["similarity"], rel=1e-10, abs=1e-15)


def test_one_plus_x_squared_partial_matchings_not_perfect():
    # f(x) = (1 + x)^2 = 1 + 2x + x^2: E[f^2] = E[1 + 4x + 6x^2 + 4x^3 + x^4] = 1 + 6 + 3 = 10.
    f = ta.Bilinear([[1]], [[1]], [[1]], left_bias=[1], right_bias=[1])
    assert ta.inner(f, f, backend="exact") == 10
    # The perfect-matching sum with bridge I (constant treated as Gaussian) would give
    # 3 * (sum over the lifted 2x2 identity contractions) = (1+1)^2 * 3 = 12, not 10.
    g = np.array([1.0, 1.0])  # lifted row (bias, weight)
    assert 3 * (g @ g) ** 2 == 12


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind_a=st.sampled_from(KINDS[:5]), kind_b=st.sampled_from(KINDS[:5]),
       seed=st.integers(0, 2**32 - 1))
def test_depth1_against_brute_force(kind_a, kind_b, seed):
    rng = np.random.default_rng(seed)
    a = rand_network(rng, kind_a)
    b = rand_network(rng, kind_b)
    ab, aa, bb = brute_inner(a, b), brute_inner(a, a), brute_inner(b, b)
    scale = math.sqrt(float(aa) * float(bb))
    assert _rel(ta.inner(a, b), ab, scale) <= 1e-10
    assert _rel(ta.inner(a, a), aa, float(aa)) <= 1e-10
    assert ta.inner(a, b, backend="exact") == ab


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind_a=st.sampled_from(KINDS[5:]), kind_b=st.sampled_from(KINDS),
       seed=st.integers(0, 2**32 - 1))
def test_depth2_against_brute_force(kind_a, kind_b, seed):
    rng = np.random.default_rng(seed)
    a = rand_network(rng, kind_a, d=2)
    b = rand_network(rng, kind_b, d=2)
    ab, aa, bb = brute_inner(a, b), brute_inner(a, a), brute_inner(b, b)
    scale = math.sqrt(float(aa) * float(bb))
    assert _rel(ta.inner(a, b), ab, scale) <= 1e-10
    assert _rel(ta.inner(b, a), ab, scale) <= 1e-10
    assert _rel(ta.inner(a, a), aa, float(aa)) <= 1e-10


def _head(net, U):
    """net followed by the projection rows U (an independent way to slice outputs)."""
    return ta.Sequential([net, ta.Linear(np.atleast_2d(U))])


@pytest.mark.parametrize("kind", ["bilinear", "embed_bilinear_head", "depth2"])
def test_slices_and_directions_against_brute_force(kind):
    rng = np.random.default_rng(7)
    a = rand_network(rng, kind, d=2, out=3, log_scale=(-1, 1))
    b = rand_network(rng, kind, d=2, out=3, log_scale=(-1, 1))
    scale = math.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    each = ta.inner(a, b, output="each")
    assert each.shape == (3,)
    for c in range(3):
        e = np.zeros(3)
        e[c] = 1.0
        want = brute_inner(_head(a, e), _head(b, e))
        assert _rel(ta.inner(a, b, output=c), want, scale) <= 1e-10
        assert _rel(each[c], want, scale) <= 1e-10
    u = np.array([0.5, -2.0, 1.25])
    want = brute_inner(_head(a, u), _head(b, u))
    assert _rel(ta.inner(a, b, output=u), want, scale) <= 1e-10
    assert _rel(ta.inner(a, b), sum(each), scale) <= 1e-10
    # per-output similarity vector
    sims = ta.similarity(a, b, output="each")
    for c in range(3):
        assert sims[c] == pytest.approx(ta.similarity(a, b, output=c), abs=1e-12)


def test_exact_backend_output_slices_are_fractions():
    case = CASES[0]
    a = ta.Sequential.from_spec(case["a"])
    b = ta.Sequential.from_spec(case["b"])
    parts = ta.inner(a, b, backend="exact", output="each")
    assert all(isinstance(p, Fraction) for p in parts)
    assert sum(parts) == Fraction(case["ab"])
    assert ta.inner(a, b, backend="exact", output=1) == parts[1]


def test_frobenius_against_homogenized_polynomial():
    """<Sym T_a, Sym T_b>_F = sum_alpha c_a(alpha) c_b(alpha) / multinomial(n; alpha) over the
    monomials of the polynomials homogenized with x_0 (the lifted constant) to degree n."""
    from tensoralg.verify.certify import expand

    def brute(a, b, n):
        pa, pb = expand(a), expand(b)
        total = Fraction(0)
        for p, q in zip(pa, pb):
            for alpha, ca in p.items():
                if alpha in q:
                    k0 = n - sum(alpha)
                    multi = math.factorial(n) // math.prod(math.factorial(k) for k in
                                                           (k0, *alpha))
                    total += ca * q[alpha] / multi
        return total

    rng = np.random.default_rng(3)
    for kind, n in (("bilinear", 2), ("embed_bilinear_head", 2), ("residual", 2), ("depth2", 4)):
        a = rand_network(rng, kind, d=2, log_scale=(-1, 1))
        b = rand_network(rng, kind, d=2, log_scale=(-1, 1))
        want = brute(a, b, n)
        scale = math.sqrt(float(brute(a, a, n)) * float(brute(b, b, n)))
        assert _rel(ta.inner(a, b, metric="frobenius"), want, scale) <= 1e-10
        assert ta.inner(a, b, metric="frobenius", backend="exact") == want


def test_exact_similarity_is_a_simplified_exact_value_with_its_float():
    import sympy

    rng = np.random.default_rng(0)
    a, b = (ta.Bilinear(rng.normal(size=(4, 3)), rng.normal(size=(4, 3)), rng.normal(size=(2, 4)))
            for _ in range(2))
    s = ta.similarity(a, b, backend="exact")
    ab, aa, bb = (ta.inner(x, y, backend="exact") for x, y in ((a, b), (a, a), (b, b)))
    # the exact value squares to ab^2 / (aa bb) and has the sign of ab
    assert sympy.Rational(s.exact ** 2) == sympy.Rational(ab * ab) / sympy.Rational(aa * bb)
    assert (s.exact < 0) == (ab < 0) and s.squared == (1 if ab >= 0 else -1) * ab * ab / (aa * bb)
    # the float is the exact value correctly rounded (50 digits of sympy decide)
    assert float(s) == float(sympy.Float(s.exact.evalf(50), 50))
    assert abs(float(s) - ta.similarity(a, b)) <= 1e-12
    assert len(repr(s)) < 120  # the hundreds of digits stay in .exact
    # a perfect square comes back rational
    one = ta.similarity(a, a, backend="exact")
    assert one == 1 and one.exact == 1
