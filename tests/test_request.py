"""One request, validated once (tensoralg.request): every public entry point gives the same
one-line error for the same bad argument, before touching the models; and the three defects
of issue 20 (each test failed before the request/engine split)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from tensoralg.verify.attention import sequence_inner_exact

import tensoralg as ta
from tensoralg.request import Request, make_request
from tensoralg.results import ExactSimilarity
from tensoralg.strategies import closure as C
from tensoralg.strategies import montecarlo as MC
from tensoralg.strategies import sequence_exact as A


class _Untouchable:
    """A stand-in model: any use of it fails the test (the request must refuse first)."""

    def __getattr__(self, name):
        raise AssertionError(f"the model was touched ({name!r}) before the options were "
                             f"checked")

    def __iter__(self):
        raise AssertionError("the model was touched before the options were checked")


U = _Untouchable()

#: Every public entry point, called on untouchable models with the keyword arguments ``kw``.
ENTRY_POINTS = {
    "inner": lambda kw: ta.inner(U, U, **kw),
    "similarity": lambda kw: ta.similarity(U, U, **kw),
    "norm": lambda kw: ta.norm(U, **kw),
    "gram": lambda kw: ta.gram([U, U], **kw),
    "cross_gram": lambda kw: ta.cross_gram([U], [U], **kw),
    "similarity_matrix": lambda kw: ta.similarity_matrix([U, U], **kw),
    "inner_diff": lambda kw: ta.inner_diff(U, U, U, **kw),
    "diff_norm": lambda kw: ta.diff_norm(U, U, **kw),
    "plan": lambda kw: ta.plan(U, U, **kw),
}
#: plan plans the exact method: it takes no method, n_samples or seed.
_NOT_FOR_PLAN = {"method", "n_samples", "seed"}

BAD = [
    (dict(metric="cosine"), "metric: unknown metric 'cosine'"),
    (dict(method="sampling"), "method: unknown method 'sampling'"),
    (dict(backend="jax"), "backend: unknown backend 'jax'"),
    (dict(strategy="magic"), "strategy: unknown strategy 'magic'"),
    (dict(metric="frobenius", method="montecarlo"), "metric='frobenius' is a closed form"),
    (dict(max_flops=-1.0), "max_flops: expected a positive number"),
    (dict(max_flops=float("nan")), "max_flops: expected a positive number"),
    (dict(max_memory="lots"), "max_memory: expected a positive number"),
    (dict(max_configurations=0), "max_configurations: expected a positive integer"),
    (dict(max_configurations=2.5), "max_configurations: expected a positive integer"),
    (dict(device="cuda"), "device: only backend='torch' runs on a device"),
    (dict(dtype="float32"), "dtype: the numpy backend computes in float64"),
    # 16-bit floats: about 3 significant digits, overflow above 65504 (they used to run)
    (dict(backend="torch", dtype="float16"), "^dtype: the torch backend computes in float64 "
                                             "\\(the default\\) or float32, got 'float16'"),
    (dict(backend="torch", dtype="int32"), "^dtype: unknown torch floating dtype 'int32'$"),
    (dict(n_ctx=0), "n_ctx: expected a positive int"),
    (dict(n_ctx=2.0), "n_ctx: expected a positive int"),
    (dict(position="first"), "position: expected None, 'each' or an int"),
    (dict(output="all"), "output: expected None, an int, a vector or 'each'"),
    (dict(output=[np.nan, 1.0]), "output: .*finite"),
    (dict(output=[0.0, 0.0]), "output: the direction u is zero"),
    (dict(output=np.eye(2)), "output: expected None, an int class index, a vector or 'each'"),
    # a negative class index is refused everywhere (the CLI's --output and decompose refused it,
    # the API counted it from the last output as a Python index)
    (dict(output=-1), "^output: class index -1 is negative; expected an int >= 0 \\(a negative "
                      "index does not count from the last output\\)$"),
    (dict(method="montecarlo", n_samples=1), "n_samples: expected an integer >= 6"),
    (dict(method="montecarlo", seed=-1), "seed: expected a non-negative integer"),
    (dict(method="montecarlo", backend="exact"), "method='montecarlo' samples in floating point"),
    # tester item 7: n_samples / seed given to a method that does not sample (were ignored)
    (dict(n_samples=100), "^n_samples: applies to method='montecarlo' only; method='exact' does "
                          "not sample \\(drop n_samples, or pass method='montecarlo'\\), got "
                          "n_samples=100$"),
    (dict(method="closure", n_samples=100_000), "^n_samples: applies to method='montecarlo' only; "
                                               "method='closure'"),
    (dict(seed=3), "^seed: applies to method='montecarlo' only; method='exact' does not sample"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[next(iter(k)) + "=" + repr(k[next(iter(k))])[:12]
                                              for k, _ in BAD])
def test_every_entry_point_gives_the_same_error_before_any_work(kw, msg):
    messages = {}
    for name, call in ENTRY_POINTS.items():
        if name == "plan" and set(kw) & _NOT_FOR_PLAN:
            continue
        with pytest.raises(ValueError, match=msg) as info:
            call(kw)
        text = str(info.value)
        assert "\n" not in text, (name, text)
        messages[name] = text
    assert len(set(messages.values())) == 1, messages   # the same error everywhere


def test_sequence_entry_points_give_the_same_error():
    """The sequence-model functions of tensoralg.strategies (sequence_exact, montecarlo, closure)
    build the same request."""
    calls = {
        "exact_inner": lambda kw: A.exact_inner(U, U, **kw),
        "exact_similarity": lambda kw: A.exact_similarity(U, U, **kw),
        "closure_inner": lambda kw: C.closure_inner(U, U, **kw),
        "closure_similarity": lambda kw: C.closure_similarity(U, U, **kw),
        "montecarlo_inner": lambda kw: MC.montecarlo_inner(U, U, **kw),
        "montecarlo_similarity": lambda kw: MC.montecarlo_similarity(U, U, **kw),
        "count_configurations": lambda kw: A.count_configurations(U, U, **kw),
        "chaos_memory_bytes": lambda kw: A.chaos_memory_bytes(U, U, **kw),
        "inner": lambda kw: ta.inner(U, U, **kw),
        # Monte Carlo matrices and differences of sequence models (the position-free sampler)
        "similarity_matrix": lambda kw: ta.similarity_matrix([U, U], method="montecarlo", **kw),
        "gram": lambda kw: ta.gram([U, U], method="montecarlo", **kw),
        "diff_norm": lambda kw: ta.diff_norm(U, U, method="montecarlo", **kw),
        "inner_diff": lambda kw: ta.inner_diff(U, U, U, method="montecarlo", **kw),
    }
    for kw, msg in [(dict(n_ctx=0), "n_ctx: expected a positive int"),
                    (dict(n_ctx=3, output=-1), "output: class index -1 is negative"),
                    (dict(n_ctx=3, output=[np.inf, 1.0]), "output: .*finite"),
                    (dict(n_ctx=3, output="all"), "output: expected None")]:
        seen = set()
        for _name, call in calls.items():
            with pytest.raises(ValueError, match=msg):
                call(kw)
            try:
                call(kw)
            except ValueError as exc:
                seen.add(str(exc))
        assert len(seen) == 1, seen


def test_mismatched_models_give_the_same_error_from_every_entry_point():
    rng = np.random.default_rng(0)
    a = ta.Bilinear(rng.normal(size=(3, 2)), rng.normal(size=(3, 2)), rng.normal(size=(2, 3)))
    b = ta.Bilinear(rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), rng.normal(size=(2, 3)))
    calls = [lambda: ta.inner(a, b), lambda: ta.similarity(a, b), lambda: ta.gram([a, b]),
             lambda: ta.cross_gram([a], [b]), lambda: ta.similarity_matrix([a, b]),
             lambda: ta.diff_norm(a, b), lambda: ta.plan(a, b)]
    seen = set()
    for call in calls:
        with pytest.raises(ValueError, match="input dimensions differ: a takes 2 inputs, b "
                                             "takes 4"):
            call()
        try:
            call()
        except ValueError as exc:
            seen.add(str(exc))
    assert len(seen) == 1


def test_the_request_is_immutable_and_replace_revalidates():
    req = make_request(output=[1, 2])
    assert isinstance(req, Request)
    with pytest.raises(AttributeError):
        req.metric = "frobenius"
    with pytest.raises(ValueError):
        req.output[0] = 5.0   # the stored direction is read-only
    with pytest.raises(ValueError, match="n_ctx: expected a positive int"):
        req.replace(n_ctx=-3)
    with pytest.raises(TypeError):
        make_request(not_an_option=1)
    # Monte Carlo options: defaults when not given, kept by replace, dropped with the method
    mc = make_request(method="montecarlo", n_samples=600, seed=4)
    assert (mc.replace(n_ctx=3).n_samples, mc.replace(n_ctx=3).seed) == (600, 4)
    assert mc.replace(method="exact").method == "exact"
    assert (make_request(method="montecarlo").n_samples, make_request().seed) == (100_000, 0)
    with pytest.raises(ValueError, match="^n_samples: applies to method='montecarlo' only"):
        mc.replace(method="closure", n_samples=600)


# ---- the three defects named in issue 20 (each failed before) ----------------------------

def _depth1(rng):
    return ta.Sequential([ta.Bilinear(rng.normal(size=(5, 3)), rng.normal(size=(5, 3)),
                                      rng.normal(size=(2, 5)))])


def test_a_rational_output_direction_works_with_every_strategy():
    """Was UFuncOutputCastingError in the chaos strategy (float networks, rational u)."""
    rng = np.random.default_rng(0)
    a, b = _depth1(rng), _depth1(rng)
    u = ["1/2", "-1/3"]
    exact = ta.inner(a, b, output=u, backend="exact")
    assert isinstance(exact, Fraction)
    for strategy in ("wick", "chaos", "auto"):
        val = ta.inner(a, b, output=u, strategy=strategy)
        assert abs(val - float(exact)) <= 1e-12 * abs(float(exact))
    # the direction as floats gives the same value (1/2 is a float; -1/3 rounds)
    assert ta.inner(a, b, output=[0.5, -1 / 3], strategy="chaos") == pytest.approx(
        float(exact), rel=1e-12)


def _attention(rng, q1, k1, q2, k2, **kw):
    v = rng.normal(size=(2, 2, 3))
    o = rng.normal(size=(3, 2, 2))
    return ta.Residual(ta.BilinearAttention(q1, k1, q2, k2, v, o, **kw))


def test_an_exact_sequence_similarity_is_an_ExactSimilarity():
    """Was a bare sympy number (``One`` for a model with itself)."""
    rng = np.random.default_rng(1)
    W = lambda: np.vectorize(lambda x: Fraction(int(x), 4), otypes=[object])(  # noqa: E731
        rng.integers(-4, 5, size=(1, 2, 3)))
    # one head (the type does not depend on the head count; two heads took 3x the CPU time)
    a, b = (ta.Residual(ta.BilinearAttention(W(), W(), W(), W(), rng.normal(size=(1, 2, 3)),
                                             rng.normal(size=(3, 1, 2)))) for _ in range(2))
    s = ta.similarity(a, b, n_ctx=2, backend="exact")
    assert isinstance(s, ExactSimilarity)
    ab, aa, bb = (sequence_inner_exact(x, y, 2) for x, y in ((a, b), (a, a), (b, b)))
    assert s.squared == (1 if ab >= 0 else -1) * ab * ab / (aa * bb)   # verify's brute force
    one = ta.similarity(a, a, n_ctx=2, backend="exact")
    assert isinstance(one, ExactSimilarity) and one == 1 and one.exact == 1
    assert isinstance(A.exact_similarity(a, b, n_ctx=2, backend="exact"), ExactSimilarity)


def test_attention_similarity_is_symmetric_bit_for_bit():
    """A (q1, k1) <-> (q2, k2)-swapped pair (the same function, another tensor network) and
    a perturbed partner: sim(a, b) and sim(b, a) were 45 ulp apart."""
    rng = np.random.default_rng(3)
    q1, k1, q2, k2 = (rng.normal(size=(2, 2, 3)) for _ in range(4))
    state = rng.bit_generator.state
    a = _attention(rng, q1, k1, q2, k2, rope=100.0)
    rng.bit_generator.state = state                 # the same v and o
    b = _attention(rng, q2, k2, q1, k1, rope=100.0)
    assert ta.similarity(a, b, n_ctx=4) == ta.similarity(b, a, n_ctx=4)
    assert abs(ta.similarity(a, b, n_ctx=4) - 1) < 1e-13
    c = _attention(rng, q1 + 0.3 * rng.normal(size=q1.shape), k1, q2, k2, rope=100.0)
    for x, y in ((a, c), (b, c)):
        assert ta.similarity(x, y, n_ctx=4) == ta.similarity(y, x, n_ctx=4)
        assert ta.similarity(x, y, n_ctx=4, method="closure") == \
            ta.similarity(y, x, n_ctx=4, method="closure")


def test_a_remembered_request_never_accepts_an_option_it_would_refuse():
    """make_request remembers validated requests of plain options; 1000 and 1000.0 are equal
    dict keys but not equal options (an int >= 2 against a float)."""
    make_request(method="montecarlo", n_samples=1000)
    with pytest.raises(ValueError, match="n_samples: expected an integer >= 6"):
        make_request(method="montecarlo", n_samples=1000.0)
    make_request(n_ctx=3)
    with pytest.raises(ValueError, match="n_ctx: expected a positive int"):
        make_request(n_ctx=3.0)
    assert make_request(output=1) is make_request(output=1)


def test_a_misspelt_keyword_names_the_function_and_the_option_it_meant():
    """Tester finding: ``diff_norm(a, b, n_sample=...)`` used to fail inside make_request()."""
    for name, call in ENTRY_POINTS.items():
        with pytest.raises(TypeError, match="unexpected keyword argument 'n_sample'") as info:
            call(dict(n_sample=100))
        text = str(info.value)
        assert f"{name}()" in text, text
        assert "make_request" not in text, text
        if name not in ("inner", "similarity", "plan"):   # explicit signatures: Python's own
            assert "did you mean 'n_samples'?" in text, text


def test_a_closure_value_says_what_it_is():
    """Fresh-eyes tester: method='closure' at depth 2 returned a bare float 30x off the exact
    similarity with nothing on it saying so. It is a MomentClosureValue: the number (str,
    format, arithmetic and JSON as a float) whose repr names the moment closure and where it
    is approximate; arrays and exact-backend results are unchanged."""
    import json

    from tensoralg.results import MomentClosureValue

    rng = np.random.default_rng(0)

    def net():
        return ta.Sequential([ta.Bilinear(rng.normal(size=(5, 4)), rng.normal(size=(5, 4)),
                                          rng.normal(size=(3, 5))),
                              ta.Bilinear(rng.normal(size=(5, 3)), rng.normal(size=(5, 3)),
                                          rng.normal(size=(3, 5)))])

    a, b = net(), net()
    tr = ta.BilinearTransformer(7, 6, 2, 2, 2, n_ctx=3, seed=0)
    for v in (ta.similarity(a, b, method="closure"), ta.inner(a, b, method="closure"),
              ta.norm(a, method="closure"), ta.similarity(tr, tr, n_ctx=3, method="closure")):
        assert type(v) is MomentClosureValue
        assert "moment-closure" in repr(v) and "APPROXIMATE" in repr(v)
        assert str(v) == repr(float(v)) and f"{v:.3f}" == f"{float(v):.3f}"
        assert json.loads(json.dumps(v)) == float(v) and type(v * 2) is float
    assert not isinstance(ta.similarity(a, b, method="closure", output="each"),
                          MomentClosureValue)
    assert not isinstance(ta.similarity(a, b), MomentClosureValue)


def test_a_negative_class_index_is_refused_by_the_api_decompose_and_the_cli(tmp_path, capsys):
    """output=-1: the API counted it from the last output, the CLI (--output) and decompose
    refused it; now one rule (tensoralg.request.check_class_index) everywhere."""
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.cli import main
    from tensoralg.decompose import eigen

    rng = np.random.default_rng(0)
    nets = [ta.Bilinear(rng.normal(size=(3, 2)), rng.normal(size=(3, 2)), rng.normal(size=(2, 3)))
            for _ in range(2)]
    for call in (lambda: ta.inner(*nets, output=-1), lambda: ta.similarity(*nets, output=-1),
                 lambda: ta.gram(nets, output=-1), lambda: eigen(nets[0], output=-1)):
        with pytest.raises(ValueError, match="^output: class index -1 is negative"):
            call()
    with pytest.raises(ValueError, match=r"^output: class index 2 out of range for 2 outputs "
                                         r"\(expected 0..1\)$"):
        eigen(nets[0], output=2)
    paths = []
    for i, n in enumerate(nets):
        save_checkpoint(tmp_path / f"c{i}", n)
        paths.append(str(tmp_path / f"c{i}"))
    for argv in (["matrix", *paths, "--output", "-1", "--out", str(tmp_path / "m")],
                 ["decompose", paths[0], "--output", "-1", "--out", str(tmp_path / "d")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"tensoralg {argv[0]}: error: --output: class index -1 is negative; "
                       f"expected 0..1 (a negative index does not count from the last output)")
