"""tensoralg.verify.certify: exact equivalence certificates by rational polynomial expansion."""

from __future__ import annotations

import ast
import json
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
import tensoralg.verify
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_cases import load_cases
from tensoralg.verify.certify import (
    Certificate,
    ExpansionTooLarge,
    certify,
    expand,
    gaussian_inner_exact,
)

from tensoralg.layers import Bilinear, Linear, Residual, Sequential

ROOT = Path(__file__).resolve().parents[1]
CASES = {c["name"]: c for c in load_cases()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_shared_cases_exact_inner_products(name):
    # aa, ab, bb in the shared file were produced independently (sympy expansion); certify must
    # reproduce them exactly, and distance2 must equal aa - 2ab + bb (bilinearity).
    c = CASES[name]
    cert = certify(c["a"], c["b"])
    aa, ab, bb = (Fraction(c[k]) for k in ("aa", "ab", "bb"))
    assert (cert.norm2_a, cert.inner, cert.norm2_b) == (aa, ab, bb)
    assert cert.distance2 == aa - 2 * ab + bb
    assert cert.similarity == pytest.approx(c["similarity"], rel=1e-12)
    assert gaussian_inner_exact(c["a"], c["b"]) == ab


def test_reparametrized_depth2_pair_is_certified_equal():
    c = CASES["reparam_depth2_identical"]
    cert = certify(Sequential.from_spec(c["a"]), Sequential.from_spec(c["b"]))
    assert cert.equal and bool(cert)
    assert cert.distance2 == 0 and isinstance(cert.distance2, Fraction)
    assert cert.witness is None
    assert "EQUAL" in str(cert)


def test_different_pair_is_not_equal_with_exact_distance():
    c = CASES["depth2_biases"]
    cert = certify(c["a"], c["b"])
    assert not cert.equal
    assert cert.distance2 == Fraction(c["aa"]) - 2 * Fraction(c["ab"]) + Fraction(c["bb"]) > 0
    _out, _mono, ca, cb = cert.witness
    assert ca != cb
    json.dumps(cert.to_dict())  # serializable


def test_one_plus_x_squared_is_ten():
    # f(x) = (1 + x)^2 -> E[f^2] = E[(1+x)^4] = 1 + 6 E[x^2] + E[x^4] = 1 + 6 + 3 = 10.
    f = Bilinear([[1]], [[1]], [[1]], left_bias=["1"], right_bias=["1"])
    assert gaussian_inner_exact(f, f) == 10


def test_expansion_matches_symbolic_forward_evaluation():
    # Independent route: evaluate the layers on sympy symbols and expand.
    rng = np.random.default_rng(3)
    def fr(*s):
        return np.array([[Fraction(int(v), 4) for v in row] for row in rng.integers(-6, 7, s)],
                                 dtype=object)
    net = Sequential([Linear(fr(3, 2), fr(1, 3)[0]),
                      Bilinear(fr(2, 3), fr(2, 3), fr(2, 2), fr(1, 2)[0], None, fr(1, 2)[0]),
                      Residual(Bilinear(fr(1, 2), fr(1, 2), fr(2, 1)))])
    xs = sp.symbols("x0:2")
    y = net(np.array([list(xs)], dtype=object))[0]
    polys = expand(net)
    for o in range(2):
        ref = sp.Poly(sp.expand(y[o]), *xs)
        got = {m: sp.Rational(v.numerator, v.denominator) for m, v in polys[o].items()}
        assert got == dict(ref.terms())


def _rational_bilinear(draw, d, h, o):
    q = st.fractions(min_value=-3, max_value=3, max_denominator=4)
    def mat(r, c):
        return np.array([[draw(q) for _ in range(c)] for _ in range(r)], dtype=object)
    return mat(h, d), mat(h, d), mat(o, h), mat(1, h)[0], mat(1, h)[0]


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_reparametrizations_are_certified_equal(data):
    d, h, o = 2, data.draw(st.integers(1, 3)), 2
    L, R, D, lb, rb = _rational_bilinear(data.draw, d, h, o)
    L2, R2, D2, lb2, rb2 = _rational_bilinear(data.draw, o, 2, 1)
    a = Sequential([Bilinear(L, R, D, lb, rb), Bilinear(L2, R2, D2, lb2, rb2)])
    perm = data.draw(st.permutations(range(h)))
    scale = data.draw(st.sampled_from([Fraction(2), Fraction(-1, 3), Fraction(5, 2)]))
    # hidden permutation, left/right swap, rescaling L by s and D by 1/s in layer 1
    Lp, Rp = R[perm] * scale, L[perm]
    lbp, rbp = rb[perm] * scale, lb[perm]
    Dp = D[:, perm] / scale
    # gauge on the bond: D -> G D, L2 -> L2 G^-1, R2 -> R2 G^-1 with G rational invertible
    G = np.array([[Fraction(1), Fraction(2)], [Fraction(-1, 2), Fraction(3)]], dtype=object)
    Ginv = np.array(sp.Matrix(G.tolist()).inv().tolist(), dtype=object)
    Ginv = np.vectorize(lambda v: Fraction(int(v.p), int(v.q)), otypes=[object])(Ginv)
    b = Sequential([Bilinear(Lp, Rp, G.dot(Dp), lbp, rbp),
                    Bilinear(L2.dot(Ginv), R2.dot(Ginv), D2, lb2, rb2)])
    cert = certify(a, b)
    assert cert.equal and cert.distance2 == 0
    assert cert.inner == cert.norm2_a == cert.norm2_b
    # Perturbing one weight of the last layer by 1/7 adds (1/7) * h0(x), h0 the first hidden
    # unit of layer 2, so the exact distance must be E[h0^2] / 49 (zero iff h0 == 0).
    D2c = D2.copy()
    D2c[0, 0] += Fraction(1, 7)
    c = Sequential([a.layers[0], Bilinear(L2, R2, D2c, lb2, rb2)])
    h0 = Sequential([a.layers[0], Bilinear(L2[:1], R2[:1], [[Fraction(1)]], lb2[:1], rb2[:1])])
    cert2 = certify(a, c)
    assert cert2.distance2 == gaussian_inner_exact(h0, h0) / 49
    assert cert2.equal == (cert2.distance2 == 0)


def test_floats_are_converted_exactly():
    # 0.1 as a float is 3602879701896397/36028797018963968, not 1/10: certify sees the difference.
    a = Linear([[0.1, 0.5]])
    b = Linear([["1/10", "1/2"]])
    cert = certify(a, b)
    assert not cert.equal
    assert cert.distance2 == (Fraction(0.1) - Fraction(1, 10)) ** 2
    assert certify(a, Linear([[Fraction(0.1), Fraction(1, 2)]])).equal


def test_too_large_is_refused_quickly_with_the_limit():
    rng = np.random.default_rng(0)
    big = Sequential([Bilinear(rng.normal(size=(8, 30)), rng.normal(size=(8, 30)),
                               rng.normal(size=(30, 8)))] * 3)
    t0 = time.perf_counter()
    with pytest.raises(ExpansionTooLarge, match=r"max_monomials=200,000"):
        certify(big, big)
    assert time.perf_counter() - t0 < 2
    small = Sequential([Bilinear(rng.normal(size=(4, 3)), rng.normal(size=(4, 3)),
                                 rng.normal(size=(3, 4)))] * 2)
    with pytest.raises(ExpansionTooLarge, match="max_work=100"):
        certify(small, small, max_work=100)
    assert issubclass(ExpansionTooLarge, ValueError)


def test_bad_inputs():
    a = Linear([[1, 2]])
    with pytest.raises(ValueError, match="in_features"):
        certify(a, Linear([[1, 2, 3]]))
    with pytest.raises(ValueError, match="out_features"):
        certify(a, Linear([[1, 2], [3, 4]]))
    with pytest.raises(TypeError, match="a: expected a tensoralg network"):
        certify("not a network", a)
    with pytest.raises(ValueError, match="non-finite"):
        certify([{"type": "linear", "weight": [[float("nan"), 1.0]], "bias": None}], a)
    with pytest.raises(ValueError, match="unknown layer type"):
        certify([{"type": "conv", "weight": [[1, 2]]}], a)


def test_package_exports_function_and_lazy_import():
    assert tensoralg.verify.certify is certify
    assert isinstance(certify(Linear([[1]]), Linear([[1]])), Certificate)


def test_verify_does_not_import_tensoralg_fast_paths():
    # Independence rule: verify may only use tensoralg's layers (and io/_version for output).
    allowed = {"tensoralg.layers", "tensoralg.io", "tensoralg._version"}
    mine = ["__init__.py", "__main__.py", "_poly.py", "certify.py", "symbolic.py",
            "montecarlo.py", "attention.py", "decompose.py"]
    for name in mine:
        tree = ast.parse((ROOT / "verify" / name).read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
            for m in mods:
                if m == "tensoralg" or m.startswith("tensoralg."):
                    assert m in allowed, f"verify/{name} imports {m}"


def test_output_slices():
    rng = np.random.default_rng(5)
    def q(*s):
        return np.vectorize(lambda v: Fraction(int(v), 2), otypes=[object])(
            rng.integers(-4, 5, s))
    a = Bilinear(q(2, 2), q(2, 2), q(3, 2), q(2), q(2))
    b = Sequential([Linear(q(2, 2)), Bilinear(q(1, 2), q(1, 2), q(3, 1), None, q(1))])
    each = gaussian_inner_exact(a, b, output="each")
    assert len(each) == 3 and sum(each) == gaussian_inner_exact(a, b)
    assert [gaussian_inner_exact(a, b, output=c) for c in range(3)] == each
    with pytest.raises(ValueError, match="output: class index -1 is negative; expected 0..2"):
        gaussian_inner_exact(a, b, output=-1)   # as tensoralg: not counted from the end
    # a direction u equals appending the linear head u to both networks (independent route)
    u = [Fraction(1, 2), Fraction(-1), Fraction(3)]
    head = Linear(np.array([u], dtype=object))
    assert gaussian_inner_exact(a, b, output=u) == gaussian_inner_exact(
        Sequential([a, head]), Sequential([b, head]))
    with pytest.raises(ValueError, match="output: class index 3 out of range for 3"):
        gaussian_inner_exact(a, b, output=3)
    with pytest.raises(ValueError, match="output: expected None"):
        gaussian_inner_exact(a, b, output="sum")
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        gaussian_inner_exact(a, b, output=[1, 2])
