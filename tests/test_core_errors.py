"""Bad input gets a clear error, raised before any heavy work."""

from __future__ import annotations

import re

import numpy as np
import pytest
from netgen import rand_bilinear, rand_network

import tensoralg as ta


@pytest.fixture
def nets():
    rng = np.random.default_rng(0)
    return rand_network(rng, "bilinear", d=3, out=2), rand_network(rng, "bilinear", d=3, out=2)


def test_input_and_output_dimensions_must_match(nets):
    a, _ = nets
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="input dimensions differ: a takes 3 inputs, b takes 4"):
        ta.inner(a, rand_network(rng, "bilinear", d=4, out=2))
    with pytest.raises(ValueError, match="output dimensions differ: a gives 2 outputs, b gives 5"):
        ta.similarity(a, rand_network(rng, "bilinear", d=3, out=5))
    with pytest.raises(ValueError, match="output dimensions differ"):
        ta.gram([a, rand_network(rng, "bilinear", d=3, out=5)])


def test_factor_shapes_never_broadcast():
    with pytest.raises(ValueError, match=r"left \(3, 2\) and right \(4, 2\)"):
        ta.Bilinear(np.ones((3, 2)), np.ones((4, 2)), np.ones((1, 3)))
    with pytest.raises(ValueError, match=r"down: expected shape \(out, 3\).*got \(1, 4\)"):
        ta.Bilinear(np.ones((3, 2)), np.ones((3, 2)), np.ones((1, 4)))
    with pytest.raises(ValueError, match=r"left_bias: expected shape \(3,\)"):
        ta.Bilinear(np.ones((3, 2)), np.ones((3, 2)), np.ones((1, 3)), left_bias=np.ones(1))
    with pytest.raises(ValueError, match=r"bias: expected shape \(2,\)"):
        ta.Linear(np.ones((2, 3)), np.ones(3))
    with pytest.raises(ValueError, match=r"layers\[1\]: expects 4 inputs but layers\[0\] gives 2"):
        ta.Sequential([ta.Linear(np.ones((2, 3))), ta.Linear(np.ones((1, 4)))])
    with pytest.raises(ValueError, match="in_features == out_features"):
        ta.Residual(ta.Linear(np.ones((2, 3))))
    with pytest.raises(ValueError, match="expected a 2-d array"):
        ta.Linear(np.ones(3))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_rejected(bad):
    w = np.ones((2, 3))
    w[1, 2] = bad
    with pytest.raises(ValueError, match="weight: 1 non-finite"):
        ta.Linear(w)
    torch = pytest.importorskip("torch")
    t = torch.ones(2, 3)
    t[0, 0] = bad
    with pytest.raises(ValueError, match="left: 1 non-finite"):
        ta.Bilinear(t, torch.ones(2, 3), torch.ones(1, 2))


def test_zero_network_similarity_is_an_error(nets):
    a, _ = nets
    f = a.layers[0]
    zero = ta.Bilinear(f.left, f.right, np.zeros_like(f.down))
    assert ta.inner(zero, a) == 0.0
    with pytest.raises(ValueError, match="norm zero"):
        ta.similarity(a, zero)
    with pytest.raises(ValueError, match="norm zero"):
        ta.similarity(zero, zero, backend="exact")
    with pytest.raises(ValueError, match=r"models \[1\] have norm zero"):
        ta.similarity_matrix([a, zero])
    # one dead output slice
    b = ta.Bilinear(a.layers[0].left, a.layers[0].right,
                    np.vstack([a.layers[0].down[:1], np.zeros((1, 3))]))
    with pytest.raises(ValueError, match=r"outputs \[1\]"):
        ta.similarity(a, b, output="each")


def test_unknown_spec_entries():
    with pytest.raises(ValueError, match="unknown layer type 'conv'"):
        ta.Sequential.from_spec([{"type": "conv", "weight": [[1]]}])
    with pytest.raises(ValueError, match="missing \\['down'\\]"):
        ta.Sequential.from_spec([{"type": "bilinear", "left": [[1]], "right": [[1]]}])
    with pytest.raises(ValueError, match="unknown fields \\['scale'\\]"):
        ta.Sequential.from_spec([{"type": "linear", "weight": [[1]], "scale": 2}])
    with pytest.raises(ValueError, match="cannot read '1/0'"):
        ta.Sequential.from_spec([{"type": "linear", "weight": [["1/0"]]}])
    with pytest.raises(ValueError, match="non-empty list"):
        ta.Sequential.from_spec([])
    with pytest.raises(TypeError, match="expected a tensoralg network"):
        ta.inner(42, 43)


def test_unknown_option_names(nets):
    a, b = nets
    with pytest.raises(ValueError, match="metric: unknown metric 'cosine'"):
        ta.inner(a, b, metric="cosine")
    with pytest.raises(ValueError, match="method: unknown method 'exactly'"):
        ta.similarity(a, b, method="exactly")
    with pytest.raises(ValueError, match="backend: unknown backend 'jax'"):
        ta.gram([a, b], backend="jax")
    with pytest.raises(ValueError, match="method must be 'exact'"):
        ta.inner(a, b, metric="frobenius", method="closure")
    with pytest.raises(ValueError, match="use backend='numpy' or 'torch'"):
        ta.inner(a, b, method="montecarlo", backend="exact")
    with pytest.raises(ValueError, match="n_samples: expected an integer >= 6"):
        ta.inner(a, b, method="montecarlo", n_samples=1)
    with pytest.raises(ValueError, match="dtype: the numpy backend computes in float64"):
        ta.inner(a, b, dtype="float32")


def test_bad_outputs(nets):
    a, b = nets
    with pytest.raises(ValueError, match="output: class index 2 out of range for 2 outputs"):
        ta.inner(a, b, output=2)
    with pytest.raises(ValueError, match=r"direction vector must have shape \(2,\), got \(3,\)"):
        ta.inner(a, b, output=np.ones(3))
    with pytest.raises(ValueError, match="output: expected None, an int"):
        ta.inner(a, b, output="all")
    with pytest.raises(ValueError, match="output: 1 non-finite"):
        ta.inner(a, b, output=np.array([1.0, np.nan]))


def test_architecture_mismatch_in_gram_and_frobenius_orders():
    rng = np.random.default_rng(2)
    a = rand_network(rng, "bilinear", hidden=3)
    b = rand_network(rng, "bilinear", hidden=4)
    G = ta.gram([a, b])   # different widths: grouped by architecture, every pair computed
    assert abs(G[0, 1] - ta.inner(a, b)) <= 1e-12 * abs(ta.inner(a, b))
    deep = rand_network(rng, "depth2")
    with pytest.raises(ValueError, match="same order: a has 2 input legs, b has 4"):
        ta.inner(a, deep, metric="frobenius")
    with pytest.raises(ValueError, match="empty sequence"):
        ta.gram([])
    with pytest.raises(TypeError, match="sequence of models"):
        ta.gram(a)


def test_cost_budget_refuses_before_any_work():
    rng = np.random.default_rng(3)
    layers = [rand_bilinear(rng, 2, 2, 2) for _ in range(3)]
    deep3 = ta.Sequential(layers)
    # (at d = 2 the chaos strategy can take depth 3: the Wick budget is tested by forcing Wick)
    with pytest.raises(ta.CostTooHigh, match=r"46,206,736 Wick configurations.*montecarlo.*closure.*APPROXIMATE"):
        ta.inner(deep3, deep3, strategy="wick")
    # the approximate and sampled alternatives named in the message do run
    assert np.isfinite(ta.inner(deep3, deep3, method="closure"))
    assert np.isfinite(ta.inner(deep3, deep3, method="montecarlo", n_samples=1000))
    small = ta.Sequential(layers[:2])
    with pytest.raises(ta.CostTooHigh, match=r"FLOPs over max_flops=10"):
        ta.inner(small, small, max_flops=10)
    with pytest.raises(ValueError):  # CostTooHigh is a ValueError
        ta.similarity(small, small, max_configurations=100, strategy="wick")


def test_forward_input_shape_errors(nets):
    a, _ = nets
    with pytest.raises(ValueError, match=r"x: expected a batch of shape \(n, 3\), got \(4, 2\)"):
        a(np.ones((4, 2)))


def test_all_configurations_vanishing_gives_zero_not_an_error():
    """No bias and a zero second factor row pattern: every Wick configuration is pruned."""
    a = ta.Bilinear([[1.0, 0.0]], [[0.0, 1.0]], [[1.0], [0.0]])
    b = ta.Bilinear([[1.0, 0.0]], [[0.0, 1.0]], [[0.0], [2.0]])
    assert ta.inner(a, b, output=0) == 0.0
    from fractions import Fraction
    assert ta.inner(a, b, output=0, backend="exact") == Fraction(0)
    assert list(ta.inner(a, b, output="each")) == [0.0, 0.0]
    assert ta.plan(a, b, output=0).n_nonzero == 0


def test_montecarlo_arguments_checked_by_every_entry_point(nets):
    a, b = nets
    for fn in (ta.inner, ta.similarity):
        for bad in (0, -5, 1, 1e3, True):
            with pytest.raises(ValueError, match="n_samples: expected an integer >= 6"):
                fn(a, b, method="montecarlo", n_samples=bad)
        with pytest.raises(ValueError, match="seed: expected a non-negative integer"):
            fn(a, b, method="montecarlo", seed=-1)


@pytest.mark.parametrize("bad", [1.5, True, np.float64(2.0), [[1.0, 0.0]]])
def test_output_of_the_wrong_kind(nets, bad):
    a, b = nets
    with pytest.raises(ValueError, match="output: expected None, an int class index"):
        ta.inner(a, b, output=bad)


def test_torch_device_errors(nets):
    torch = pytest.importorskip("torch")
    a, b = nets
    with pytest.raises(ValueError, match="device: unknown torch device 'tpu'"):
        ta.inner(a, b, backend="torch", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ta.inner(a, b, backend="torch", device="cuda")
    with pytest.raises(ValueError, match="dtype: unknown torch floating dtype 'int8'"):
        ta.inner(a, b, backend="torch", dtype="int8")


def test_plan_reports_a_refusal_instead_of_raising():
    rng = np.random.default_rng(3)
    deep3 = ta.Sequential([rand_bilinear(rng, 2, 2, 2) for _ in range(3)])
    p = ta.plan(deep3, strategy="wick")  # (auto takes it through chaos at d = 2)
    assert p.refused and p.flops == float("inf") and p.n_configurations == 46206736
    assert "REFUSED" in p.summary()


def test_zero_direction_and_device_without_torch(nets):
    a, b = nets
    with pytest.raises(ValueError, match="output: the direction u is zero"):
        ta.similarity(a, b, output=np.zeros(2))
    with pytest.raises(ValueError, match="device: only backend='torch' runs on a device"):
        ta.inner(a, b, device="cuda")


@pytest.mark.parametrize("where", ["embed", "attn.0.v", "unembed"])
def test_a_nan_parameter_of_a_transformer_is_named_with_its_argument(where):
    """Tester finding: a NaN in the embedding (which the residual-stream metric does not read)
    was answered silently, and a NaN elsewhere was reported as ``v: ...`` without saying which
    model. Now every parameter is checked when the module is exported."""
    import torch

    good = ta.BilinearTransformer(7, 6, 1, 2, 2, n_ctx=3, seed=1)
    bad = ta.BilinearTransformer(7, 6, 1, 2, 2, n_ctx=3, seed=2)
    with torch.no_grad():
        dict(bad.named_parameters())[where].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=rf"^b: {re.escape(where)}: 1 non-finite \(NaN or inf\) "
                                         rf"entries in the BilinearTransformer parameter"):
        ta.similarity(good, bad, n_ctx=3)


def test_an_infinite_parameter_of_a_bilinear_net_is_named():
    import torch

    from tensoralg.nn import BilinearNet

    net = BilinearNet(4, 2, d_model=5, d_hidden=6, n_layers=1)
    with torch.no_grad():
        net.blocks[0].down.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^models\[1\]: blocks.0.down.weight: 1 non-finite"):
        ta.similarity_matrix([BilinearNet(4, 2, d_model=5, d_hidden=6, n_layers=1), net])


@pytest.mark.parametrize("call, name", [
    (lambda m, b: ta.similarity(m, b), "a"), (lambda m, b: ta.inner(m, b), "a"),
    (lambda m, b: ta.norm(m), "a"), (lambda m, b: ta.plan(m, b), "a"),
    (lambda m, b: ta.similarity(m, b, backend="exact"), "a"),
    (lambda m, b: ta.similarity(m, b, method="montecarlo", n_samples=400), "a"),
    (lambda m, b: ta.similarity_matrix([b, m]), r"models\[1\]"),
    (lambda m, b: ta.similarity_matrix([b, m], method="montecarlo", n_samples=400),
     r"models\[1\]")],
    ids=["similarity", "inner", "norm", "plan", "exact", "montecarlo", "matrix", "mc-matrix"])
def test_nan_written_into_weights_after_construction_is_named(call, name):
    """The constructors refuse NaN, but an array can be written into afterwards: every entry
    point names the model and the array instead of an overflow, a failed eigensolver or a NaN
    answer (fresh-eyes tester), also for a network whose prepared stack was cached."""
    rng = np.random.default_rng(0)
    m, b = rand_network(rng, "bilinear"), rand_network(rng, "bilinear")
    ta.similarity(m, b), ta.similarity(m, b)        # cached from the second use on
    m.layers[0].left[0, 0] = np.nan
    with pytest.raises(ValueError, match=rf"^{name}: 1 non-finite \(NaN or inf\) entries in "
                                         rf"its weight array 0"):
        call(m, b)


def test_inf_written_into_attention_weights_is_named():
    rng = np.random.default_rng(1)
    w = [rng.standard_normal((1, 2, 3)) for _ in range(5)]
    A = ta.BilinearAttention(*w, rng.standard_normal((3, 1, 2)))
    B = ta.BilinearAttention(*w, rng.standard_normal((3, 1, 2)))
    A.q1[0, 0, 0] = np.inf
    for kw in ({}, {"method": "closure"}, {"method": "montecarlo", "n_samples": 400}):
        with pytest.raises(ValueError, match=r"^a: 1 non-finite \(NaN or inf\) entries in its "
                                             r"weight array 0 of shape \(1, 2, 3\)"):
            ta.similarity(A, B, n_ctx=2, **kw)
    with pytest.raises(ValueError, match=r"^a: 1 non-finite"):
        ta.plan(A, B, n_ctx=2)


def test_nan_weights_are_named_on_every_monte_carlo_and_sequence_matrix_path():
    """The finiteness check sits where every network of a request is folded into its input
    distribution (engine._fold), so the Monte Carlo Gram, cross-Gram and difference paths and
    the sequence matrices name the model too (they returned NaN or 'no reliable estimate')."""
    rng = np.random.default_rng(3)
    m, b, c = (rand_network(rng, "bilinear") for _ in range(3))
    m.layers[0].left[0, 0] = np.nan
    mc = dict(method="montecarlo", n_samples=400)
    cases = [(lambda: ta.gram([b, m], **mc), r"models\[1\]"),
             (lambda: ta.cross_gram([b], [m], **mc), r"models_b\[0\]"),
             (lambda: ta.diff_norm(m, b, **mc), "b"),          # diff_norm(b, c)
             (lambda: ta.inner_diff(c, b, m, **mc), "c")]      # inner_diff(a, b, c)
    w = [rng.standard_normal((1, 2, 3)) for _ in range(5)]
    A = ta.BilinearAttention(*w, rng.standard_normal((3, 1, 2)))
    B = ta.BilinearAttention(*w, rng.standard_normal((3, 1, 2)))
    A.v[0, 0, 0] = np.inf
    cases += [(lambda: ta.similarity_matrix([B, A], n_ctx=2), r"models\[1\]"),
              (lambda: ta.gram([B, A], n_ctx=2, method="closure"), r"models\[1\]"),
              # the Monte Carlo matrices and differences of sequence models (session 10)
              (lambda: ta.similarity_matrix([B, A], n_ctx=2, **mc), r"models\[1\]"),
              (lambda: ta.gram([B, A], n_ctx=2, **mc), r"models\[1\]"),
              (lambda: ta.diff_norm(B, A, n_ctx=2, **mc), "c"),
              (lambda: ta.inner_diff(B, B, A, n_ctx=2, **mc), "c")]
    for call, name in cases:
        with pytest.raises(ValueError, match=rf"^{name}: 1 non-finite \(NaN or inf\) entries"):
            call()


def test_models_that_are_not_a_sequence_get_a_one_line_error():
    """Fresh-eyes tester: ta.gram(5) raised numpy's bare "'int' object is not iterable", and
    ta.similarity_matrix("ab") read the string as the paths "a" and "b"."""
    for call, name in ((lambda: ta.gram(5), "models"), (lambda: ta.cross_gram(3, [1]), "models_a"),
                       (lambda: ta.similarity_matrix(7.0), "models")):
        with pytest.raises(TypeError, match=rf"^{name}: expected a sequence of models, got "):
            call()
    with pytest.raises(TypeError, match=r"^models: expected a sequence of models, got one path "
                                        r"'ab'"):
        ta.similarity_matrix("ab")
