"""tensoralg.data: offline digits, the backdoor trigger, modular addition."""

import pytest
import torch

from tensoralg.data import (
    TRIGGER_PIXELS,
    add_trigger,
    load_digits_data,
    modular_addition,
    poison,
    select_classes,
    trigger_mask,
)


def test_digits_shapes_range_and_stratified_split():
    d = load_digits_data(test_fraction=0.25, seed=0)
    assert len(d.X_train) + len(d.X_test) == 1797
    assert d.X_train.shape[1] == 64 and d.n_classes == 10
    assert float(d.X_train.min()) == 0.0 and float(d.X_train.max()) == 1.0
    counts = torch.bincount(d.y_test, minlength=10)
    assert counts.min() >= 40  # stratified: ~45 per class out of ~450
    again = load_digits_data(test_fraction=0.25, seed=0)
    assert torch.equal(d.X_train, again.X_train)


def test_trigger_is_where_digits_rarely_draw():
    d = load_digits_data()
    X = torch.cat([d.X_train, d.X_test])
    mask = trigger_mask()
    assert int(mask.sum()) == len(TRIGGER_PIXELS) == 4
    # pixels in the trigger are drawn far less often than the image average
    drawn = (X[:, mask] > 0).float().mean(0)
    assert float(drawn.max()) < 0.3 and float((X > 0).float().mean()) > 0.45
    Xt = add_trigger(d.X_test)
    assert torch.all(Xt[:, mask] == 1.0)
    assert torch.equal(Xt[:, ~mask], d.X_test[:, ~mask])
    with pytest.raises(ValueError, match="outside"):
        trigger_mask(((8, 0),))
    with pytest.raises(ValueError, match=r"\(n, 64\)"):
        add_trigger(torch.zeros(2, 10))


def test_poison_relabels_a_fraction_of_non_target_images():
    d = load_digits_data()
    X, y, mask = poison(d.X_train, d.y_train, 0.1, target=9, seed=0)
    n_non_target = int((d.y_train != 9).sum())
    assert int(mask.sum()) == round(0.1 * n_non_target)
    assert torch.all(y[mask] == 9)
    assert torch.all(X[mask][:, trigger_mask()] == 1.0)
    assert torch.equal(X[~mask], d.X_train)
    with pytest.raises(ValueError, match="fraction"):
        poison(d.X_train, d.y_train, 1.5, target=9)
    with pytest.raises(ValueError, match="target"):
        poison(d.X_train, d.y_train, 0.1, target=10)


def test_modular_addition():
    s = modular_addition(P=7, train_fraction=0.5, seed=1)
    X = torch.cat([s.X_train, s.X_test])
    y = torch.cat([s.y_train, s.y_test])
    assert X.shape == (49, 14) and len(s.X_train) == round(0.5 * 49)
    a = X[:, :7].argmax(1)
    b = X[:, 7:].argmax(1)
    assert torch.equal(y, (a + b) % 7)
    assert torch.all(X.sum(1) == 2)
    # every pair exactly once
    assert len(set(zip(a.tolist(), b.tolist()))) == 49
    with pytest.raises(ValueError, match="P"):
        modular_addition(P=1)
    with pytest.raises(ValueError, match="train_fraction"):
        modular_addition(P=5, train_fraction=0.0)


def test_select_classes():
    d = load_digits_data()
    X, y = select_classes(d.X_train, d.y_train, [0, 4])
    assert set(y.tolist()) == {0, 4} and len(X) == len(y)
