"""Generate ``gaussian_inner_products.json``: the project's own reference cases.

Run ``python tests/reference_cases/generate.py`` (deterministic; it rewrites the JSON). The
values are computed here with sympy alone — neither tensoralg nor verify is imported: each
network is evaluated on symbols ``x1..xd`` with rational weights, the product of two networks'
outputs is expanded, and every monomial ``x^alpha`` is replaced by its Gaussian moment
``prod_i E[x_i^alpha_i]``, ``E[x^k] = (k-1)!!`` for even ``k`` and 0 for odd ``k`` (x ~ N(0, I)).

Format (the same as ``../shared/cases``; see ``docs/spec.md``): a list of cases, each with
``name``, ``d``, networks ``a`` and ``b`` (lists of layer specs with rationals as strings) and
the exact ``aa``, ``ab``, ``bb`` (sums over outputs) and the float ``similarity``.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import sympy

OUT = Path(__file__).with_name("gaussian_inner_products.json")
GRID = [Fraction(n, 4) for n in range(-12, 13)]   # weights: quarters in [-3, 3]


def _w(rng, *shape):
    if len(shape) == 1:
        return [str(rng.choice(GRID)) for _ in range(shape[0])]
    return [_w(rng, *shape[1:]) for _ in range(shape[0])]


def linear(rng, d_in, d_out, bias=True):
    return {"type": "linear", "weight": _w(rng, d_out, d_in), "bias": _w(rng, d_out) if bias else None}


def bilinear(rng, d_in, h, d_out, bias=True):
    return {"type": "bilinear", "left": _w(rng, h, d_in), "right": _w(rng, h, d_in),
            "down": _w(rng, d_out, h), "left_bias": _w(rng, h) if bias else None,
            "right_bias": _w(rng, h) if bias else None, "down_bias": _w(rng, d_out) if bias else None}


def _mat(rows):
    return sympy.Matrix([[sympy.Rational(v) for v in r] for r in rows])


def _vec(v, n):
    return sympy.zeros(n, 1) if v is None else sympy.Matrix([sympy.Rational(t) for t in v])


def forward(layers, x):
    """Symbolic forward pass (column vector of sympy expressions)."""
    for L in layers:
        if L["type"] == "linear":
            W = _mat(L["weight"])
            x = W * x + _vec(L["bias"], W.rows)
        elif L["type"] == "bilinear":
            Lm, Rm, Dm = _mat(L["left"]), _mat(L["right"]), _mat(L["down"])
            u = Lm * x + _vec(L["left_bias"], Lm.rows)
            v = Rm * x + _vec(L["right_bias"], Rm.rows)
            x = Dm * sympy.Matrix([u[i] * v[i] for i in range(Lm.rows)]) + _vec(L["down_bias"], Dm.rows)
        elif L["type"] == "residual":
            x = x + forward([L["inner"]], x)
        else:
            raise ValueError(L["type"])
    return x


def gaussian_expectation(poly, xs):
    """E over x ~ N(0, I) of a polynomial: monomial by monomial, E[x^k] = (k-1)!! (k even)."""
    total = sympy.Integer(0)
    for powers, coeff in sympy.Poly(sympy.expand(poly), *xs).terms():
        term = sympy.Rational(coeff)
        for k in powers:
            term *= 0 if k % 2 else sympy.factorial2(k - 1)
        total += term
    return total


def inner(a, b, d):
    xs = sympy.symbols(f"x1:{d + 1}")
    x = sympy.Matrix(xs)
    fa, fb = forward(a, x), forward(b, x)
    return Fraction(str(gaussian_expectation(sum(fa[i] * fb[i] for i in range(fa.rows)), xs)))


def reparam_pair():
    """Two depth-2 networks, one polynomial, different hidden features: the first layer of ``a``
    computes y1 = x1 x2 and y2 = x3^2 - 1 directly; ``b`` computes y1 by polarization
    ((x1 + x2)^2 - (x1 - x2)^2) / 4, y2 with swapped, rescaled factors and a down bias."""
    first_a = {"type": "bilinear", "left": [["1", "0", "0"], ["0", "0", "1"]],
               "right": [["0", "1", "0"], ["0", "0", "1"]], "down": [["1", "0"], ["0", "1"]],
               "left_bias": ["0", "1"], "right_bias": ["0", "-1"], "down_bias": ["0", "0"]}
    first_b = {"type": "bilinear", "left": [["1", "1", "0"], ["1", "-1", "0"], ["0", "0", "2"]],
               "right": [["1", "1", "0"], ["1", "-1", "0"], ["0", "0", "1/2"]],
               "down": [["1/4", "-1/4", "0"], ["0", "0", "1"]],
               "left_bias": None, "right_bias": None, "down_bias": ["0", "-1"]}
    second = {"type": "bilinear", "left": [["1", "-1/2"], ["3/4", "1"]],
              "right": [["1/2", "1"], ["-1", "1/4"]], "down": [["1", "-2"]],
              "left_bias": ["1/2", "0"], "right_bias": ["-1", "1/4"], "down_bias": ["3/4"]}
    return [first_a, second], [first_b, second]


def cases():
    rng = random.Random(20261201)
    out = [("bilinear_biases", 3, [bilinear(rng, 3, 2, 2)], [bilinear(rng, 3, 3, 2)]),
           ("embed_bilinear_head", 2,
            [linear(rng, 2, 3, False), bilinear(rng, 3, 2, 3), linear(rng, 3, 2)],
            [linear(rng, 2, 2, False), bilinear(rng, 2, 3, 2), linear(rng, 2, 2)]),
           ("residual_block", 2, [{"type": "residual", "inner": bilinear(rng, 2, 2, 2)}],
            [{"type": "residual", "inner": bilinear(rng, 2, 3, 2)}]),
           ("depth2_biases", 2, [bilinear(rng, 2, 2, 2), bilinear(rng, 2, 2, 2)],
            [bilinear(rng, 2, 2, 3), bilinear(rng, 3, 2, 2)]),
           ("reparam_depth2_identical", 3, *reparam_pair()),
           ("one_plus_x_squared", 1,  # f(x) = (1 + x)^2: E[f^2] = 10 (the perfect-matching trap: 12)
            [{"type": "bilinear", "left": [["1"]], "right": [["1"]], "down": [["1"]],
              "left_bias": ["1"], "right_bias": ["1"], "down_bias": None}],
            [{"type": "bilinear", "left": [["1"]], "right": [["1"]], "down": [["1"]],
              "left_bias": ["1"], "right_bias": ["1"], "down_bias": None}])]
    result = []
    for name, d, a, b in out:
        aa, ab, bb = inner(a, a, d), inner(a, b, d), inner(b, b, d)
        result.append({"name": name, "d": d, "a": a, "b": b, "aa": str(aa), "ab": str(ab),
                       "bb": str(bb), "similarity": float(ab) / (float(aa) * float(bb)) ** 0.5})
    return result


def main() -> None:
    data = cases()
    byname = {c["name"]: c for c in data}
    # self-checks of the construction, computed independently of the expansion above
    assert byname["one_plus_x_squared"]["aa"] == "10"
    pa, pb = reparam_pair()
    xs = sympy.symbols("x1:4")
    assert sympy.expand(forward(pa, sympy.Matrix(xs))[0] - forward(pb, sympy.Matrix(xs))[0]) == 0
    assert byname["reparam_depth2_identical"]["aa"] == byname["reparam_depth2_identical"]["ab"]
    tmp = OUT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(OUT)
    print(f"wrote {len(data)} cases to {OUT}")


if __name__ == "__main__":
    main()
