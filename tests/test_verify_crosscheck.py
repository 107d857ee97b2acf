"""Cross-check tensoralg's fast paths against verify's independent exact expansion.

verify itself never calls tensoralg.inner; these tests put the two side by side, on random
small rational networks (hypothesis) and on the shared reference cases.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensoralg.verify import certify, gaussian_inner_exact
from tensoralg.verify import montecarlo as mc

import tensoralg
from tensoralg.layers import Bilinear, Linear, Residual, Sequential

Q = st.fractions(min_value=-2, max_value=2, max_denominator=4)


@st.composite
def matrices(draw, rows, cols):
    return np.array([[draw(Q) for _ in range(cols)] for _ in range(rows)], dtype=object)


@st.composite
def maybe_vector(draw, n):
    if draw(st.booleans()):
        return None
    return draw(matrices(1, n))[0]


@st.composite
def bilinear(draw, d_in, d_out):
    h = draw(st.integers(1, 2))
    return Bilinear(draw(matrices(h, d_in)), draw(matrices(h, d_in)), draw(matrices(d_out, h)),
                    draw(maybe_vector(h)), draw(maybe_vector(h)), draw(maybe_vector(d_out)))


@st.composite
def networks(draw, d, out, max_bilinear=2):
    """Random small rational networks: optional linear embed, 1..max_bilinear bilinear layers
    (possibly residual), linear or bilinear head."""
    layers, width = [], d
    if draw(st.booleans()):
        w = draw(st.integers(1, 3))
        layers.append(Linear(draw(matrices(w, width)), draw(maybe_vector(w))))
        width = w
    for _ in range(draw(st.integers(1, max_bilinear))):
        if draw(st.booleans()):
            layers.append(Residual(draw(bilinear(width, width))))
        else:
            w = draw(st.integers(1, 2))
            layers.append(draw(bilinear(width, w)))
            width = w
    layers.append(Linear(draw(matrices(out, width)), draw(maybe_vector(out))))
    return Sequential(layers)


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_exact_inner_matches_expansion(data):
    d, out = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    a = data.draw(networks(d, out))
    b = data.draw(networks(d, out))
    ref = gaussian_inner_exact(a, b)
    got = tensoralg.inner(a, b, backend="exact")
    assert Fraction(got) == ref
    flt = tensoralg.inner(a, b)
    assert flt == pytest.approx(float(ref), rel=1e-10, abs=1e-10 * (1 + abs(float(ref))))


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_output_slices_match_expansion(data):
    d, out = 2, 2
    a, b = data.draw(networks(d, out, 1)), data.draw(networks(d, out, 1))
    for c in range(out):
        assert Fraction(tensoralg.inner(a, b, backend="exact", output=c)) == \
            gaussian_inner_exact(a, b, output=c)
    u = [Fraction(1, 2), Fraction(-3)]
    assert Fraction(tensoralg.inner(a, b, backend="exact", output=np.array(u, dtype=object))) \
        == gaussian_inner_exact(a, b, output=u)
    each = tensoralg.inner(a, b, output="each")
    assert np.allclose(each, [float(v) for v in gaussian_inner_exact(a, b, output="each")],
                       rtol=1e-10, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_closure_is_exact_at_depth_one(data):
    d, out = data.draw(st.integers(1, 3)), 2
    a, b = data.draw(bilinear(d, out)), data.draw(bilinear(d, out))
    ref = float(gaussian_inner_exact(a, b))
    assert tensoralg.inner(a, b, method="closure") == pytest.approx(ref, rel=1e-10, abs=1e-10)


def test_closure_misjudges_identical_depth2_networks():
    # x1^2 * x2^2 computed through (x1^2, x2^2) and through (x1 x2, x1 x2): certified equal,
    # exact similarity 1, closure similarity 1/sqrt(27) (independent-Gaussian proxies:
    # <a,b> = 1*1, ||a||^2 = 3*3, ||b||^2 = E[g^4] = 3).
    a = Sequential([Bilinear([[1, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 0], [0, 1]]),
                    Bilinear([[1, 0]], [[0, 1]], [[1]])])
    b = Sequential([Bilinear([[1, 0]], [[0, 1]], [[1], [1]]), Bilinear([[1, 0]], [[0, 1]], [[1]])])
    assert certify(a, b).equal
    assert tensoralg.similarity(a, b) == pytest.approx(1.0, rel=1e-12)
    assert tensoralg.similarity(a, b, method="closure") == pytest.approx(27 ** -0.5, rel=1e-10)


def test_tensoralg_montecarlo_agrees_with_exact():
    rng = np.random.default_rng(4)
    a = Bilinear(rng.normal(size=(3, 2)), rng.normal(size=(3, 2)), rng.normal(size=(2, 3)),
                 rng.normal(size=3))
    b = Sequential([Linear(rng.normal(size=(2, 2))),
                    Bilinear(rng.normal(size=(2, 2)), rng.normal(size=(2, 2)),
                             rng.normal(size=(2, 2)))])
    est = tensoralg.inner(a, b, method="montecarlo", n_samples=50_000, seed=0)
    check = mc.agreement(mc.MCEstimate(float(est), est.stderr, est.n_samples),
                         gaussian_inner_exact(a, b))
    assert check.passed, str(check)
