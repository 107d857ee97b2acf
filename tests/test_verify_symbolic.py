"""tensoralg.verify.symbolic: sympy proofs of the identities, and python -m tensoralg.verify."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
from tensoralg.verify import symbolic as S
from tensoralg.verify.__main__ import main as verify_main
from tensoralg.verify.certify import gaussian_inner_exact

from tensoralg.layers import Bilinear


def _double_factorial(n):
    return math.prod(range(n, 0, -2)) if n > 0 else 1


def test_matching_counts():
    # perfect matchings of n legs: (n-1)!!; partial matchings: telephone numbers from the
    # recurrence T(n) = T(n-1) + (n-1) T(n-2) (leg n alone, or paired with one of n-1 others).
    tel = [1, 1]
    for n in range(2, 8):
        tel.append(tel[-1] + (n - 1) * tel[-2])
    for n in range(0, 8):
        perfect = sum(1 for _ in S.perfect_matchings(range(n)))
        assert perfect == (0 if n % 2 else _double_factorial(n - 1))
        partial = list(S.partial_matchings(range(n)))
        assert len(partial) == tel[n]
        for pairs, singles in partial:  # every leg used exactly once
            assert sorted([x for p in pairs for x in p] + singles) == list(range(n))
    assert tel[4] == 10  # the 10 configurations of one bilinear layer pair (docs/mathematics.md §3.1)


def test_gaussian_moments_by_integration():
    for k in range(0, 9):
        assert S.gaussian_moment_1d(k) == (0 if k % 2 else _double_factorial(k - 1))


@pytest.mark.parametrize("n,d", [(2, 3), (3, 3), (4, 2)])
def test_polarization(n, d):
    r = S.prove_polarization(n, d)
    assert r.passed, r.detail
    assert r.sizes == {"n": n, "d": d} and r.checked >= d ** n and r.seconds >= 0


def test_isserlis_centred_and_covariance():
    r = S.prove_isserlis(6, 2)
    assert r.passed and r.checked == sum(2 ** n for n in range(1, 7))
    assert S.prove_isserlis_covariance(4, 2).passed


def test_lifted_and_noncentred_isserlis():
    r = S.prove_lifted_isserlis(4, 2)
    assert r.passed, r.detail
    assert "naive rule wrong" in r.detail  # the perfect-matching rule with bridge I fails
    assert S.prove_noncentred_isserlis(3, 2).passed


def test_one_plus_x_squared_trap():
    v = S.one_plus_x_squared_values()
    # E[(1+x)^4] = 1 + 6*1 + 3 = 10; naive: 3 perfect matchings x (v.v)^2 = 3 * 4 = 12.
    assert v == {"integral": 10, "partial_matchings": 10, "naive_perfect_matchings": 12}
    assert S.prove_one_plus_x_squared().passed


def test_gram_closed_form_and_a_wrong_formula_fails():
    assert S.prove_gram_closed_form(2, 2, 1, 1).passed

    def missing_term(La, Ra, Da, Lb, Rb, Db):  # drops the constant-only configuration
        return S.gram_closed_form(La, Ra, Da, Lb, Rb, Db) - (Da.T * Db)[0, 0] * (
            La[0, 0] * Ra[0, 0] * Lb[0, 0] * Rb[0, 0])

    assert not S.prove_gram_closed_form(2, 1, 1, 1, closed_form=missing_term).passed


def test_gram_closed_form_agrees_with_certify_on_numbers():
    # Two independent routes: the symbolic closed form at rational values vs the exact
    # polynomial expansion of tensoralg.verify.certify.
    rng = np.random.default_rng(7)
    def q(*s):
        return np.vectorize(lambda v: Fraction(int(v), 3), otypes=[object])(
            rng.integers(-5, 6, s))
    La, Ra, Da, Lb, Rb, Db = q(2, 4), q(2, 4), q(2, 2), q(3, 4), q(3, 4), q(2, 3)
    a = Bilinear(La[:, 1:], Ra[:, 1:], Da, La[:, 0], Ra[:, 0])
    b = Bilinear(Lb[:, 1:], Rb[:, 1:], Db, Lb[:, 0], Rb[:, 0])
    def M(x):
        return sp.Matrix(x.tolist())
    closed = S.gram_closed_form(M(La), M(Ra), M(Da), M(Lb), M(Rb), M(Db))
    assert Fraction(int(sp.numer(closed)), int(sp.denom(closed))) == gaussian_inner_exact(a, b)


def test_invariances():
    for r in (S.prove_hidden_permutation(2, 3, 1), S.prove_left_right_swap(2, 2, 1),
              S.prove_rescaling(1, 2, 1), S.prove_bond_gauge(1, 2, 1, 1)):
        assert r.passed, (r.name, r.detail)


def test_broken_symmetries_are_detected():
    # negative controls for the identity test used above: permuting L alone, or rescaling
    # without compensating D, changes the polynomial.
    xt = sp.Matrix([1, *sp.symbols("x1:3")])
    L, R, D = S._symbolic_bilinear("", 2, 2, 1)
    f = S._bilinear_poly(L, R, D, xt)[0]
    g = S._bilinear_poly(L.extract([1, 0], [0, 1, 2]), R, D, xt)[0]
    h = S._bilinear_poly(2 * L, R, D, xt)[0]
    assert not S._ok(f - g) and not S._ok(f - h)


def test_run_all_and_table(capsys):
    results = S.run_all(quick=True, only="polarization")
    assert results and all(r.passed for r in results)
    table = S.format_table(results)
    assert table.splitlines()[0].split()[:3] == ["identity", "sizes", "result"]
    assert json.dumps([r.to_dict() for r in results])


def test_cli_quick_runs_everything_and_passes(capsys):
    assert verify_main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "passed" in out
    for name in ("polarization", "isserlis_lifted", "gram_closed_form", "inv_bond_gauge"):
        assert name in out


def test_cli_failure_exit_code_and_errors(monkeypatch, capsys, tmp_path):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(S, "_suite", lambda quick: [
        ("ok", S.prove_one_plus_x_squared), ("broken", broken)])
    path = tmp_path / "out.json"
    assert verify_main(["--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "RuntimeError: boom" in out
    payload = json.loads(path.read_text())
    assert payload["passed"] is False and len(payload["results"]) == 2
    assert payload["config"] == {"quick": False, "only": None}
    assert verify_main(["--only", "no-such-check"]) == 2
    with pytest.raises(SystemExit):
        verify_main(["--bogus"])
