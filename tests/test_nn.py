"""tensoralg.nn: trainable bilinear modules and their exact export."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensoralg as ta
from tensoralg.nn import BilinearNet, TrainingDiverged, accuracy, train_classifier


def _x(n, d, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@settings(max_examples=20, deadline=None)
@given(n_layers=st.integers(1, 3), bias=st.booleans(), residual=st.booleans(),
       embed_bias=st.booleans(), head_bias=st.booleans(), seed=st.integers(0, 10_000))
def test_to_network_matches_forward_float64(n_layers, bias, residual, embed_bias, head_bias, seed):
    m = BilinearNet(5, 3, d_model=4, d_hidden=6, n_layers=n_layers, bias=bias, residual=residual,
                    embed_bias=embed_bias, head_bias=head_bias, seed=seed, dtype="float64")
    with torch.no_grad():  # non-zero biases so that they are exercised
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed),
                                    dtype=p.dtype))
    net = m.to_network()
    x = _x(17, 5, seed)
    with torch.no_grad():
        y_mod = m(x).numpy()
    y_net = net(x.numpy())
    scale = np.abs(y_mod).max()
    assert np.abs(y_net - y_mod).max() <= 1e-12 * max(scale, 1.0)
    assert net.degree == 2 ** n_layers


def test_structure_of_exported_network():
    m = BilinearNet(6, 2, d_model=3, d_hidden=4, n_layers=2, residual=True, bias=True)
    net = m.to_network()
    kinds = [type(layer).__name__ for layer in net.layers]
    assert kinds == ["Linear", "Residual", "Residual", "Linear"]
    assert net.in_features == 6 and net.out_features == 2
    # float32 weights are widened exactly
    assert np.array_equal(net.layers[0].weight, m.embed.weight.detach().double().numpy())


def test_similarity_with_own_network_is_one():
    m = BilinearNet(6, 3, d_model=4, d_hidden=5, residual=True, bias=True, seed=3)
    s = ta.similarity(m, m.to_network())
    assert abs(float(s) - 1.0) < 1e-10


def test_seed_determinism_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = BilinearNet(8, 3, seed=7)
    after = torch.rand(1)
    assert torch.equal(before, after)  # construction did not consume global randomness
    b = BilinearNet(8, 3, seed=7)
    c = BilinearNet(8, 3, seed=8)
    for (ka, va), (_, vb), (_, _vc) in zip(a.state_dict().items(), b.state_dict().items(),
                                          c.state_dict().items()):
        assert torch.equal(va, vb), ka
    assert not all(torch.equal(va, vc) for va, vc in zip(a.state_dict().values(),
                                                         c.state_dict().values()))


def test_training_is_deterministic_and_learns():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 4, generator=g)
    y = (X[:, 0] * X[:, 1] > 0).long()  # a quadratic rule: learnable by one bilinear block

    def run():
        m = BilinearNet(4, 2, d_model=4, d_hidden=8, seed=1)
        h = train_classifier(m, X, y, steps=150, lr=2e-2, batch_size=64, seed=2,
                             eval_sets={"train": (X, y)}, eval_at=[0, 150])
        return m, h

    m1, h1 = run()
    m2, h2 = run()
    assert h1 == h2
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert h1["train_acc"][0] < 0.8 and h1["train_acc"][-1] > 0.9


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_in=0, d_out=3), "d_in"),
    (dict(d_in=3, d_out=3, n_layers=0), "n_layers"),
    (dict(d_in=3, d_out=3, dtype="float16"), "dtype"),
    (dict(d_in=3, d_out=3, seed=1.5), "seed"),
    (dict(d_in=3, d_out=3, seed=-1), r"seed: expected an integer >= 0, got -1"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BilinearNet(**kwargs)


def test_bad_forward_and_training_input():
    m = BilinearNet(4, 2)
    with pytest.raises(ValueError, match=r"\(n, 4\)"):
        m(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="labels"):
        train_classifier(m, torch.zeros(3, 4), torch.tensor([0, 1, 2]), steps=1)
    with pytest.raises(ValueError, match=r"y: expected shape \(3,\)"):
        train_classifier(m, torch.zeros(3, 4), torch.tensor([0, 1]), steps=1)
    with pytest.raises(ValueError, match="steps"):
        train_classifier(m, torch.zeros(3, 4), torch.tensor([0, 1, 1]), steps=-1)


def test_from_config_roundtrip():
    m = BilinearNet(5, 3, d_model=4, d_hidden=6, n_layers=2, bias=True, residual=True, seed=4)
    m2 = BilinearNet.from_config(m.config())
    assert m2.config() == m.config()
    with pytest.raises(ValueError, match="architecture"):
        BilinearNet.from_config({**m.config(), "architecture": "transformer"})
    with pytest.raises(ValueError, match="missing"):
        BilinearNet.from_config({"architecture": "bilinear_net", "d_in": 3})


def test_numpy_inputs_train_like_tensors():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 4))                    # float64 numpy
    y = (X[:, 0] * X[:, 1] > 0).astype(np.int64)     # int64 numpy
    m1, m2 = BilinearNet(4, 2, d_model=4, d_hidden=8, seed=1), BilinearNet(4, 2, d_model=4,
                                                                        d_hidden=8, seed=1)
    h1 = train_classifier(m1, X, y, steps=20, batch_size=32, eval_sets={"t": (X, y)},
                          eval_at=[20])
    h2 = train_classifier(m2, torch.as_tensor(X, dtype=torch.float32), torch.as_tensor(y),
                          steps=20, batch_size=32, eval_sets={"t": (X, y)}, eval_at=[20])
    assert h1 == h2
    assert accuracy(m1, X, y) == accuracy(m1, torch.as_tensor(X), torch.as_tensor(y))


@pytest.mark.parametrize("X, y, match", [
    (np.zeros((3, 5)), np.array([0, 1, 1]), r"X: expected shape \(n, 4\).*d_in=4.*\(3, 5\)"),
    (np.zeros(4), np.array([0]), r"X: expected shape \(n, 4\), got \(4,\)"),
    (np.zeros((3, 4)), np.array([0.0, 1.0, 1.0]), r"y: expected integer class labels"),
    (np.zeros((3, 4)), np.array([[0], [1], [1]]), r"y: expected shape \(3,\).*\(3, 1\)"),
    (np.zeros((3, 4)), np.array([0, 1, 2]), r"y: labels must lie in \[0, 2\)"),
    (np.zeros((3, 4)), np.array([0, -1, 1]), r"y: labels must lie in \[0, 2\)"),
    (np.full((3, 4), np.nan), np.array([0, 1, 1]), r"X: has NaN/inf"),
    (np.array([["a"] * 4] * 3), np.array([0, 1, 1]), r"X: expected a numeric"),
])
def test_bad_training_input_is_named_before_training(X, y, match):
    m = BilinearNet(4, 2, seed=0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        train_classifier(m, X, y, steps=5)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_bad_eval_set_and_lr():
    m = BilinearNet(4, 2, seed=0)
    X, y = np.zeros((3, 4)), np.array([0, 1, 1])
    with pytest.raises(ValueError, match=r"eval_sets\['val'\] X"):
        train_classifier(m, X, y, steps=1, eval_sets={"val": (np.zeros((2, 3)), [0, 1])})
    for lr in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="lr"):
            train_classifier(m, X, y, steps=1, lr=lr)


def test_divergence_stops_training():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4))
    y = (X[:, 0] > 0).astype(np.int64)
    m = BilinearNet(4, 2, d_model=4, d_hidden=8, seed=1)
    with pytest.raises(TrainingDiverged, match="diverged") as exc:
        train_classifier(m, X, y, steps=50, lr=1e30, batch_size=None)
    assert 1 <= exc.value.step <= 50
