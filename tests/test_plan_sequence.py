"""ta.plan for sequence models (bilinear attention, docs/mathematics.md §3.7): it says what ta.inner does
with the same options — the exact one-attention-layer path of tensoralg.strategies.sequence_exact with its
Wick configurations, or the refusal — and ``refused`` is set exactly when inner refuses,
checked by running inner on both sides of the boundary."""

from __future__ import annotations

import numpy as np
import pytest
from test_attention_exact import attn

import tensoralg as ta
from tensoralg.planner import SequencePlan
from tensoralg.request import DEFAULT_MAX_FLOPS, DEFAULT_MAX_FLOPS_EXACT_SEQUENCE
from tensoralg.strategies import closure, sequence_exact


def _pair(seed=0):
    """``a``: one attention layer whose output bias is zero at output 1 (so the output slice
    ``output=1`` removes the capped linear term: fewer configurations); ``b``: another one."""
    rng = np.random.default_rng(seed)
    a = attn(rng, H=1, dh=2, d=2, dv=1, mask="causal")
    a = ta.BilinearAttention(a.q1, a.k1, a.q2, a.k2, a.v, a.o, q1_bias=a.q1_bias,
                             k1_bias=a.k1_bias, q2_bias=a.q2_bias, k2_bias=a.k2_bias,
                             v_bias=a.v_bias, o_bias=np.array([1.0, 0.0]), mask="causal")
    b = attn(rng, H=1, dh=2, d=2, dv=1, mask="causal")
    return a, b


def _deep(seed=1):
    rng = np.random.default_rng(seed)
    return ta.Sequential([attn(rng, H=1, dh=2, d=2, dv=1, residual=True, mask="causal"),
                          attn(rng, H=1, dh=2, d=2, dv=1, residual=True, mask="causal")])


def test_plan_counts_the_configurations_inner_contracts():
    a, b = _pair()
    p = ta.plan(a, b, n_ctx=2)
    assert isinstance(p, SequencePlan) and p.supported and p.refused is None
    assert p.strategy == "attention" and p.n_ctx == 2
    assert p.n_configurations == sequence_exact.count_configurations(a, b, n_ctx=2)
    assert p.n_legs == 10  # two attention terms of 5 legs (docs/mathematics.md §3.7)
    # the sliced linear term of a (zero output bias at output 1) can no longer be capped
    assert ta.plan(a, b, n_ctx=2, output=1).n_configurations < p.n_configurations
    # position= selects query positions: it changes no zero pattern, hence no count
    assert ta.plan(a, b, n_ctx=2, position=1).n_configurations == p.n_configurations
    text = str(p)
    assert "Wick configurations" in text and "choice: attention" in text
    assert "K1, K2, V at s" in text and "Q1, Q2 at t" in text


@pytest.mark.parametrize("kw", [{}, {"output": 1}, {"output": [1.0, 0.5]}, {"position": 0},
                                {"backend": "exact", "output": 1}])
def test_refused_exactly_when_inner_refuses_at_the_boundary(kw):
    a, b = _pair()
    n = ta.plan(a, b, n_ctx=2, **kw).n_configurations
    at = ta.plan(a, b, n_ctx=2, max_configurations=n, **kw)
    assert at.refused is None and at.strategy == "attention"
    ta.inner(a, b, n_ctx=2, max_configurations=n, **kw)  # runs
    over = ta.plan(a, b, n_ctx=2, max_configurations=n - 1, **kw)
    assert over.refused and over.strategy is None
    assert "method='closure'" in over.refused and "method='montecarlo'" in over.refused
    assert "REFUSED" in str(over)
    with pytest.raises(ta.CostTooHigh) as err:
        ta.inner(a, b, n_ctx=2, max_configurations=n - 1, **kw)
    assert str(err.value) == over.refused   # the plan gives inner's message


@pytest.mark.parametrize("kw", [{}, {"output": 1}, {"position": "each"},
                                {"backend": "exact", "output": 1}])
def test_max_flops_refuses_exactly_when_inner_refuses(kw):
    """max_flops applies to the exact attention path: the dry run's FLOP estimate is held
    against it, in plan and in inner alike (the same boundary, the same message)."""
    a, b = _pair()
    p = ta.plan(a, b, n_ctx=2, **kw)
    assert p.refused is None and p.flops > 0
    assert p.max_flops == (DEFAULT_MAX_FLOPS_EXACT_SEQUENCE if kw.get("backend") == "exact"
                           else DEFAULT_MAX_FLOPS)  # the defaults
    assert "estimated FLOPs" in str(p)
    ta.inner(a, b, n_ctx=2, max_flops=p.flops, **kw)  # runs at the boundary
    over = ta.plan(a, b, n_ctx=2, max_flops=p.flops * (1 - 1e-9), **kw)
    assert over.refused and over.strategy is None and over.reason == "over max_flops"
    assert "max_flops" in over.refused and "method='montecarlo'" in over.refused
    with pytest.raises(ta.CostTooHigh) as err:
        ta.inner(a, b, n_ctx=2, max_flops=p.flops * (1 - 1e-9), **kw)
    assert str(err.value) == over.refused


def test_the_flop_estimate_is_the_work_inner_does(monkeypatch):
    """The estimate is the path cost of every contraction the real run executes: counted here
    by wrapping the executor's Plan.__call__ during ta.inner (each call adds its own path
    cost), against the dry run's sum (the leg grams, plain einsum calls, are in neither)."""
    from tensoralg.strategies import executor

    rng = np.random.default_rng(3)
    a = attn(rng, H=2, dh=3, d=3, dv=2, mask="causal")
    b = attn(rng, H=1, dh=2, d=3, dv=2, mask="causal")
    est = ta.plan(a, b, n_ctx=3).flops
    done = []
    call = executor.Plan.__call__

    def counted(self, *ops, **kw):
        done.append(self.flops)
        return call(self, *ops, **kw)

    monkeypatch.setattr(executor.Plan, "__call__", counted)
    ta.inner(a, b, n_ctx=3)
    assert len(done) > 100 and est == sum(done)   # the same sums of the same integers


def test_two_attention_layers_are_refused_like_inner():
    deep = _deep()
    p = ta.plan(deep, n_ctx=2, max_configurations=10**12)
    assert p.refused and not p.supported and p.n_configurations is None
    assert "method='closure'" in p.refused and "method='montecarlo'" in p.refused
    assert p.n_legs == 25 + 25  # the unrolled trees: 5 legs of 5 legs each, per side
    assert "not available" in str(p) and "node 1: linear" in str(p)
    with pytest.raises(ta.CostTooHigh, match="method='closure'") as err:
        ta.inner(deep, deep, n_ctx=2, max_configurations=10**12)
    assert str(err.value) == p.refused
    # against a one-layer model: refused too (a is outside the exact path)
    a, _ = _pair()
    assert ta.plan(deep, a, n_ctx=2).refused
    with pytest.raises(ta.CostTooHigh):
        ta.inner(deep, a, n_ctx=2)


def _bad_cases():
    a, b = _pair()
    rng = np.random.default_rng(2)
    flat = ta.Bilinear(rng.normal(size=(3, 2)), rng.normal(size=(3, 2)), rng.normal(size=(2, 3)))
    fixed = attn(rng, H=1, dh=2, d=2, dv=1, mask=np.ones((3, 3)))
    return [
        ((a, b), {}, "n_ctx: required"),
        ((a, b), {"n_ctx": 0}, "n_ctx: expected a positive int"),
        ((fixed, b), {"n_ctx": 2}, "n_ctx=2 differs from a's attention mask"),
        ((a, b), {"n_ctx": 2, "position": 2}, "position: expected None, 'each' or an int"),
        ((a, b), {"n_ctx": 2, "output": 2}, "output: class index 2 out of range"),
        ((a, b), {"n_ctx": 2, "output": [1.0, 2.0, 3.0]}, r"output: a direction vector must"),
        ((a, b), {"n_ctx": 2, "metric": "frobenius"}, "only metric='gaussian'"),
        ((a, flat), {"n_ctx": 2}, "position-free network of degree > 1"),
        ((flat, flat), {"n_ctx": 2}, "n_ctx / position: only for sequence models"),
        ((a, b), {"n_ctx": 2, "device": "cpu"}, "device: only backend='torch'"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_plan_raises_what_inner_raises_before_any_work(case):
    (x, y), kw, msg = _bad_cases()[case]
    with pytest.raises(ValueError, match=msg):
        ta.inner(x, y, **kw)
    with pytest.raises(ValueError, match=msg):
        ta.plan(x, y, **kw)


def test_plan_checks_its_budget():
    a, b = _pair()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_configurations: expected a positive integer"):
            ta.plan(a, b, n_ctx=2, max_configurations=bad)


def test_two_attention_layers_by_default_are_refused_never_the_closure():
    """Issue 21: at depth 2 the default (method='exact', strategy='auto') of ta.similarity /
    ta.inner / ta.plan refuses, naming Monte Carlo first and the closure as APPROXIMATE; there
    is no method='auto' that could pick the closure; the closure runs only when asked for."""
    a, b = _deep(1), _deep(2)
    p = ta.plan(a, b, n_ctx=2)
    assert p.refused and p.strategy is None
    for fn in (ta.similarity, ta.inner):
        with pytest.raises(ta.CostTooHigh) as err:
            fn(a, b, n_ctx=2)
        msg = str(err.value)
        assert msg == p.refused
        assert msg.index("method='montecarlo'") < msg.index("method='closure'")
        assert "APPROXIMATE" in msg[msg.index("method='closure'"):]
        with pytest.raises(ValueError, match="method: unknown method 'auto'"):
            fn(a, b, n_ctx=2, method="auto")
    got = ta.similarity(a, b, n_ctx=2, method="closure")
    assert got == pytest.approx(closure.closure_similarity(a, b, n_ctx=2), rel=1e-12)


def test_a_shorter_context_of_a_causal_mask_array_is_the_prefix_model():
    """Tester finding: ``compare`` accepted an ``n_ctx`` below a checkpoint's trained context
    (the exact prefix model) while the library refused it. A causal mask array (no entry above
    the diagonal) now reads a shorter context as its leading block, in every entry point and
    in the forward pass; a non-causal mask, a longer context and a compiled module still
    refuse."""
    a = ta.BilinearTransformer(7, 6, 1, 2, 2, n_ctx=4, seed=1)
    b = ta.BilinearTransformer(7, 6, 1, 2, 2, n_ctx=3, seed=2)
    na, nb = a.to_network(), b.to_network()
    assert (na.n_ctx, nb.n_ctx) == (4, 3) and na.prefix_ok
    pa, pb = a.to_network(n_ctx=2), b.to_network(n_ctx=2)   # masks built at length 2
    for kw in ({}, {"method": "closure"}):
        assert abs(ta.similarity(na, nb, n_ctx=2, **kw) - ta.similarity(pa, pb, **kw)) <= 1e-12
    assert abs(ta.inner(na, nb, n_ctx=2) - ta.inner(pa, pb)) <= 1e-12 * abs(ta.inner(pa, pb))
    # the forward pass: positions < 2 of a length-4 input only read positions < 2
    x = np.random.default_rng(0).normal(size=(5, 4, 6))
    np.testing.assert_allclose(na(x[:, :2]), na(x)[:, :2], rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match=r"^n_ctx=4 differs from b's attention mask of shape "
                                         r"\(3, 3\)$"):
        ta.similarity(na, nb, n_ctx=4)
    rng = np.random.default_rng(3)
    full = attn(rng, H=1, dh=2, d=2, dv=1, mask=np.ones((3, 3)))
    assert not full.prefix_ok
    with pytest.raises(ValueError, match=r"n_ctx=2 differs from a's attention mask of shape "
                                         r"\(3, 3\) \(not causal: a shorter context is no "
                                         r"prefix of it\)$"):
        ta.inner(full, full, n_ctx=2)
    with pytest.raises(ValueError, match="x: has n_ctx=2 positions"):
        full(np.zeros((1, 2, 2)))


def test_matrices_and_diffs_take_transformer_modules():
    """Fresh-eyes tester: gram / similarity_matrix / diff_norm of BilinearTransformer modules
    failed (the modules were not recognised as sequence models: a cross_gram error whose
    advice was the failing call, or 'unknown layer type BilinearAttention'), while similarity
    took them. Each entry equals the pair's own inner product / similarity."""
    ms = [ta.BilinearTransformer(7, 6, 1, 2, 2, n_ctx=3, seed=s) for s in (0, 1)]
    G = ta.gram(ms, n_ctx=3)
    for i in range(2):
        for j in range(2):
            assert abs(G[i, j] - ta.inner(ms[i], ms[j], n_ctx=3)) <= 1e-12 * abs(G[i, i])
    S = ta.similarity_matrix(ms, n_ctx=3)
    assert abs(S[0, 1] - ta.similarity(ms[0], ms[1], n_ctx=3)) <= 1e-12
    Sc = ta.similarity_matrix(ms, n_ctx=3, method="closure")
    assert abs(Sc[0, 1] - ta.similarity(ms[0], ms[1], n_ctx=3, method="closure")) <= 1e-12
    d = ta.diff_norm(ms[0], ms[1], n_ctx=3)
    assert abs(d ** 2 - (G[0, 0] - 2 * G[0, 1] + G[1, 1])) <= 1e-10 * G.trace()


def test_a_similarity_refused_on_a_norm_says_which_product():
    """ta.plan(a, b) costs <a, b>; similarity also needs <a, a> and <b, b>: when the wider
    model's own product is over max_flops, the refusal names it (fresh-eyes tester: the plan
    of the pair ran, the similarity refused with a number nobody had been shown)."""
    rng = np.random.default_rng(7)
    a = attn(rng, H=2, dh=3, d=3, dv=2, mask="causal")
    b = attn(rng, H=1, dh=1, d=3, dv=1, mask="causal")
    ab, aa = ta.plan(a, b, n_ctx=3).flops, ta.plan(a, a, n_ctx=3).flops
    assert ab < aa
    budget = (ab + aa) / 2
    assert ta.plan(a, b, n_ctx=3, max_flops=budget).refused is None
    with pytest.raises(ta.CostTooHigh, match=r"^<a, a> \(similarity needs") as err:
        ta.similarity(a, b, n_ctx=3, max_flops=budget)
    assert ta.plan(a, a, n_ctx=3, max_flops=budget).refused in str(err.value)


def test_the_exact_backend_default_budget_of_sequence_models_refuses_a_minute_long_job():
    """On Fractions the attention path's contractions run at about 0.45 MFLOP/s (measured,
    tensoralg.request), so its default is DEFAULT_MAX_FLOPS_EXACT_SEQUENCE (about 10 s), not
    the position-free 2e7 (about 45 s there): a 6e6-FLOP pair is refused by default, in plan
    and in inner before any rational work, and runs when the budget is raised."""
    rng = np.random.default_rng(0)
    g = lambda *s: np.round(rng.normal(size=s) * 0.5, 2)  # noqa: E731
    a, b = (ta.Residual(ta.BilinearAttention(g(2, 4, 4), g(2, 4, 4), g(2, 4, 4), g(2, 4, 4),
                                             g(2, 4, 4), g(4, 2, 4), mask="causal"))
            for _ in range(2))
    p = ta.plan(a, b, n_ctx=6, backend="exact")
    assert DEFAULT_MAX_FLOPS_EXACT_SEQUENCE < p.flops < 2e7
    assert p.refused and "over max_flops=5e+06" in p.refused
    with pytest.raises(ta.CostTooHigh) as err:
        ta.inner(a, b, n_ctx=6, backend="exact")
    assert str(err.value) == p.refused
    assert ta.plan(a, b, n_ctx=6, backend="exact", max_flops=2e7).refused is None
