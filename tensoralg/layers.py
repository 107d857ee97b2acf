"""Multilinear layers and their composition.

Every network here is a polynomial map ``R^d -> R^out`` built from

* :class:`Linear` — ``y = W x + b``;
* :class:`Bilinear` — ``y = D((L x + l0) * (R x + r0)) + d0`` (a bilinear MLP, CP form);
* :class:`Residual` — ``y = x + inner(x)``;
* :class:`Sequential` — composition, applied in order.

Weights are stored as NumPy arrays: ``float64`` for floating-point input (torch tensors and
float32 arrays are converted exactly), or ``object`` arrays of :class:`fractions.Fraction`
when the weights are given as rationals (``Fraction``, ``int`` or strings such as ``"-3/4"``),
so that the ``exact`` backend computes in rational arithmetic with no rounding at all.

Networks are callable on a batch: ``net(x)`` with ``x`` of shape ``(n, d)`` (NumPy or torch)
returns ``(n, out)`` of the same kind (torch: same dtype and device as ``x``).
"""

from __future__ import annotations

import numbers
from fractions import Fraction
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["Layer", "Linear", "Bilinear", "Residual", "Sequential", "as_network"]


# ----------------------------------------------------------------------------------------
# array helpers
# ----------------------------------------------------------------------------------------

def _is_torch(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch")


def _to_fraction(v: Any, name: str) -> Fraction:
    if isinstance(v, Fraction):
        return v
    if isinstance(v, bool):
        raise TypeError(f"{name}: booleans are not weights")
    if isinstance(v, numbers.Integral):
        return Fraction(int(v))
    if isinstance(v, str):
        try:
            return Fraction(v.strip())
        except (ValueError, ZeroDivisionError) as exc:
            raise ValueError(f"{name}: cannot read {v!r} as a rational number") from exc
    if isinstance(v, numbers.Real):
        f = float(v)
        if not np.isfinite(f):
            raise ValueError(f"{name}: non-finite value {f!r}; weights must be finite")
        return Fraction(f)
    raise TypeError(f"{name}: cannot read {type(v).__name__} {v!r} as a number")


def _flatten(seq: Any) -> list:
    if isinstance(seq, (list, tuple)):
        out = []
        for s in seq:
            out.extend(_flatten(s))
        return out
    return [seq]


def as_array(value: Any, name: str, ndim: int) -> np.ndarray:
    """Read ``value`` as a float64 array or, for rational input, an object array of Fractions.

    Raises ``ValueError`` naming ``name`` on a wrong number of dimensions, an empty array or a
    non-finite entry.
    """
    if _is_torch(value):
        value = value.detach().to("cpu")
        if value.is_floating_point():
            value = value.double()
        value = value.numpy()
    if isinstance(value, np.ndarray) and value.dtype != object:
        if value.dtype.kind not in "fiu":
            raise TypeError(f"{name}: expected a real array, got dtype {value.dtype}")
        arr = np.array(value, dtype=np.float64)
    else:
        flat = _flatten(value.tolist() if isinstance(value, np.ndarray) else value)
        exact = any(isinstance(v, (Fraction, str)) for v in flat) or (
            isinstance(value, np.ndarray) and value.dtype == object
        )
        if exact:
            arr = np.array(value, dtype=object)
            shape = arr.shape
            arr = np.array([_to_fraction(v, name) for v in arr.reshape(-1)] or [], dtype=object)
            arr = arr.reshape(shape)
        else:
            try:
                arr = np.array(value, dtype=np.float64)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{name}: cannot read as a numeric array ({exc})") from exc
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name}: empty array of shape {arr.shape}")
    if arr.dtype != object and not np.all(np.isfinite(arr)):
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise ValueError(f"{name}: {bad} non-finite (NaN or inf) entries in an array of shape "
                         f"{arr.shape}; weights must be finite")
    return arr


def _check_len(arr: np.ndarray | None, n: int, name: str, what: str) -> None:
    if arr is not None and arr.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},) to match {what}, got {arr.shape}")


def _numeric(w: np.ndarray, like: Any):
    """Weights converted to match the input ``like`` (torch tensor, float array or object array)."""
    if _is_torch(like):
        import torch

        dtype = like.dtype if like.is_floating_point() else torch.float64
        return torch.as_tensor(np.asarray(w, dtype=np.float64), dtype=dtype, device=like.device)
    if isinstance(like, np.ndarray) and like.dtype == object:
        return w
    return np.asarray(w, dtype=np.float64)


def _prepare_input(x: Any, d: int) -> tuple[Any, bool]:
    squeeze = False
    if not _is_torch(x):
        x = np.asarray(x)
        if x.dtype != object:
            x = x.astype(np.float64, copy=False)
    if x.ndim == 1:
        x, squeeze = x[None, :], True
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x: expected a batch of shape (n, {d}), got {tuple(x.shape)}")
    return x, squeeze


# ----------------------------------------------------------------------------------------
# layers
# ----------------------------------------------------------------------------------------

class Layer:
    """Base class: a polynomial map from ``in_features`` to ``out_features``."""

    in_features: int
    out_features: int

    def __call__(self, x: Any) -> Any:
        x, squeeze = _prepare_input(x, self.in_features)
        y = self._forward(x)
        return y[0] if squeeze else y

    def _forward(self, x: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def degree(self) -> int:
        """Degree of the network as a polynomial (an upper bound: 2**number of bilinear layers)."""
        raise NotImplementedError  # pragma: no cover

    @property
    def is_exact(self) -> bool:
        """True when every weight is a rational (object array of Fractions)."""
        return all(a.dtype == object for a in self.arrays())

    def arrays(self) -> list[np.ndarray]:
        raise NotImplementedError  # pragma: no cover

    def to_spec(self) -> dict | list:
        """The layer in the JSON layer format of ``docs/spec.md`` (strings for rationals)."""
        raise NotImplementedError  # pragma: no cover

    def astype_float(self) -> "Layer":
        """A copy with float64 weights (rationals rounded to nearest)."""
        return _map_arrays(self, lambda a: np.asarray(a, dtype=np.float64))

    def scaled_output(self, factor: float) -> "Layer":
        """A copy whose output is multiplied by ``factor`` (the last layer's weights and bias)."""
        raise NotImplementedError  # pragma: no cover

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_features} -> {self.out_features})"


def _spec_array(a: np.ndarray | None):
    if a is None:
        return None
    if a.dtype == object:
        return np.vectorize(lambda v: str(v), otypes=[object])(a).tolist()
    return a.tolist()


class Linear(Layer):
    """Affine layer ``y = weight @ x + bias``.

    Args:
        weight: ``(out, in)``.
        bias: ``(out,)`` or ``None``.

    Raises:
        ValueError: wrong shapes, empty or non-finite weights.
    """

    def __init__(self, weight: Any, bias: Any = None):
        self.weight = as_array(weight, "weight", 2)
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else as_array(bias, "bias", 1)
        _check_len(self.bias, self.out_features, "bias", f"weight of shape {self.weight.shape}")

    def _forward(self, x):
        y = x @ _numeric(self.weight, x).T
        if self.bias is not None:
            y = y + _numeric(self.bias, x)
        return y

    @property
    def degree(self) -> int:
        return 1

    def arrays(self):
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def to_spec(self):
        return {"type": "linear", "weight": _spec_array(self.weight), "bias": _spec_array(self.bias)}

    def scaled_output(self, factor):
        return Linear(self.weight * factor, None if self.bias is None else self.bias * factor)


class Bilinear(Layer):
    """Bilinear layer (bilinear MLP, CP form):
    ``y = down @ ((left @ x + left_bias) * (right @ x + right_bias)) + down_bias``.

    Args:
        left, right: ``(hidden, in)``.
        down: ``(out, hidden)``.
        left_bias, right_bias: ``(hidden,)`` or ``None``; down_bias: ``(out,)`` or ``None``.

    Raises:
        ValueError: factor shapes that disagree (a hidden size or input size with two values),
            empty or non-finite weights.
    """

    def __init__(self, left: Any, right: Any, down: Any, left_bias: Any = None,
                 right_bias: Any = None, down_bias: Any = None):
        self.left = as_array(left, "left", 2)
        self.right = as_array(right, "right", 2)
        self.down = as_array(down, "down", 2)
        if self.left.shape != self.right.shape:
            raise ValueError(f"left and right must have the same shape (hidden, in); got "
                             f"left {self.left.shape} and right {self.right.shape}")
        hidden, self.in_features = self.left.shape
        if self.down.shape[1] != hidden:
            raise ValueError(f"down: expected shape (out, {hidden}) to match left/right with "
                             f"hidden size {hidden}, got {self.down.shape}")
        self.out_features = self.down.shape[0]
        self.hidden_features = hidden
        self.left_bias = None if left_bias is None else as_array(left_bias, "left_bias", 1)
        self.right_bias = None if right_bias is None else as_array(right_bias, "right_bias", 1)
        self.down_bias = None if down_bias is None else as_array(down_bias, "down_bias", 1)
        _check_len(self.left_bias, hidden, "left_bias", f"hidden size {hidden}")
        _check_len(self.right_bias, hidden, "right_bias", f"hidden size {hidden}")
        _check_len(self.down_bias, self.out_features, "down_bias", f"down of shape {self.down.shape}")

    def _forward(self, x):
        lx = x @ _numeric(self.left, x).T
        rx = x @ _numeric(self.right, x).T
        if self.left_bias is not None:
            lx = lx + _numeric(self.left_bias, x)
        if self.right_bias is not None:
            rx = rx + _numeric(self.right_bias, x)
        y = (lx * rx) @ _numeric(self.down, x).T
        if self.down_bias is not None:
            y = y + _numeric(self.down_bias, x)
        return y

    @property
    def degree(self) -> int:
        return 2

    def arrays(self):
        return [a for a in (self.left, self.right, self.down, self.left_bias, self.right_bias,
                            self.down_bias) if a is not None]

    def to_spec(self):
        return {"type": "bilinear", "left": _spec_array(self.left), "right": _spec_array(self.right),
                "down": _spec_array(self.down), "left_bias": _spec_array(self.left_bias),
                "right_bias": _spec_array(self.right_bias), "down_bias": _spec_array(self.down_bias)}

    def scaled_output(self, factor):
        return Bilinear(self.left, self.right, self.down * factor, self.left_bias, self.right_bias,
                        None if self.down_bias is None else self.down_bias * factor)


class Residual(Layer):
    """Residual connection ``y = x + inner(x)``; ``inner`` must map ``d -> d``.

    Raises:
        ValueError: ``inner`` whose output size differs from its input size.
    """

    def __init__(self, inner: Layer):
        if not isinstance(inner, Layer):
            raise TypeError(f"inner: expected a tensoralg layer, got {type(inner).__name__}")
        if inner.in_features != inner.out_features:
            raise ValueError(f"inner: a residual block needs in_features == out_features, got "
                             f"{inner.in_features} -> {inner.out_features}")
        self.inner = inner
        self.in_features = self.out_features = inner.in_features

    def _forward(self, x):
        return x + self.inner._forward(x)

    @property
    def degree(self) -> int:
        return max(1, self.inner.degree)

    def arrays(self):
        return self.inner.arrays()

    def to_spec(self):
        return {"type": "residual", "inner": self.inner.to_spec()}

    def scaled_output(self, factor):
        raise ValueError("scaled_output: a network ending in a residual block has no output "
                         "weights to scale; append a Linear head")


class Sequential(Layer):
    """Composition of layers, applied in order.

    Raises:
        ValueError: an empty list, or consecutive layers whose sizes do not chain.
    """

    def __init__(self, layers: Iterable[Layer]):
        layers = list(layers)
        if not layers:
            raise ValueError("layers: a Sequential needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"layers[{i}]: expected a tensoralg layer, got {type(layer).__name__}")
        for i in range(1, len(layers)):
            if layers[i].in_features != layers[i - 1].out_features:
                raise ValueError(f"layers[{i}]: expects {layers[i].in_features} inputs but "
                                 f"layers[{i - 1}] gives {layers[i - 1].out_features}")
        self.layers = layers
        self.in_features = layers[0].in_features
        self.out_features = layers[-1].out_features

    def _forward(self, x):
        for layer in self.layers:
            x = layer._forward(x)
        return x

    @property
    def degree(self) -> int:
        deg = 1
        for layer in self.layers:
            deg *= layer.degree
        return deg

    def arrays(self):
        return [a for layer in self.layers for a in layer.arrays()]

    def to_spec(self):
        return [layer.to_spec() for layer in self.layers]

    def scaled_output(self, factor):
        return Sequential(self.layers[:-1] + [self.layers[-1].scaled_output(factor)])

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __repr__(self):
        inner = ", ".join(repr(layer) for layer in self.layers)
        return f"Sequential([{inner}])"

    @classmethod
    def from_spec(cls, spec: Sequence[dict] | dict) -> "Sequential":
        """Build a network from the JSON layer format of ``docs/spec.md``.

        Numbers may be strings (``"-3/4"``), ints, Fractions or floats; when any is a string or a
        Fraction the layer keeps exact rationals.

        Raises:
            ValueError: an unknown layer ``type``, a missing field, or bad shapes.
        """
        if isinstance(spec, dict):
            spec = [spec]
        if not isinstance(spec, (list, tuple)) or not spec:
            raise ValueError("spec: expected a non-empty list of layer dicts")
        return cls([layer_from_spec(s, f"spec[{i}]") for i, s in enumerate(spec)])


_LAYER_FIELDS = {
    "linear": ({"weight"}, {"bias"}),
    "bilinear": ({"left", "right", "down"}, {"left_bias", "right_bias", "down_bias"}),
    "residual": ({"inner"}, set()),
}


def layer_from_spec(spec: dict, where: str = "spec") -> Layer:
    """One layer from its JSON dict (see :meth:`Sequential.from_spec`)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a layer dict, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind not in _LAYER_FIELDS:
        raise ValueError(f"{where}: unknown layer type {kind!r}; expected one of "
                         f"{sorted(_LAYER_FIELDS)}")
    required, optional = _LAYER_FIELDS[kind]
    missing = required - set(spec)
    if missing:
        raise ValueError(f"{where}: layer of type {kind!r} is missing {sorted(missing)}")
    unknown = set(spec) - required - optional - {"type"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} for a {kind!r} layer")

    def exact(v):
        # JSON numbers given as plain ints/floats alongside strings: keep them exact too.
        if v is None:
            return None
        return np.array(v, dtype=object)

    if kind == "linear":
        return Linear(exact(spec["weight"]), exact(spec.get("bias")))
    if kind == "bilinear":
        return Bilinear(exact(spec["left"]), exact(spec["right"]), exact(spec["down"]),
                        exact(spec.get("left_bias")), exact(spec.get("right_bias")),
                        exact(spec.get("down_bias")))
    inner = spec["inner"]
    if isinstance(inner, list):
        return Residual(Sequential([layer_from_spec(s, f"{where}.inner[{i}]")
                                    for i, s in enumerate(inner)]))
    return Residual(layer_from_spec(inner, f"{where}.inner"))


def as_network(net: Any, name: str = "network") -> Layer:
    """Accept a tensoralg layer, a list of layers, a layer spec, or an object with ``to_network()``."""
    if isinstance(net, Layer):
        return net
    if hasattr(net, "to_network") and callable(net.to_network):
        return as_network(net.to_network(), name)
    if isinstance(net, (list, tuple)) and net and all(isinstance(x, Layer) for x in net):
        return Sequential(net)
    if isinstance(net, (list, tuple, dict)):
        return Sequential.from_spec(net)
    raise TypeError(f"{name}: expected a tensoralg network (Linear, Bilinear, Residual, "
                    f"Sequential), a layer spec or a module with to_network(); got "
                    f"{type(net).__name__}")


def _map_arrays(layer: Layer, fn) -> Layer:
    if isinstance(layer, Linear):
        return Linear(fn(layer.weight), None if layer.bias is None else fn(layer.bias))
    if isinstance(layer, Bilinear):
        f = lambda a: None if a is None else fn(a)  # noqa: E731
        return Bilinear(f(layer.left), f(layer.right), f(layer.down), f(layer.left_bias),
                        f(layer.right_bias), f(layer.down_bias))
    if isinstance(layer, Residual):
        return Residual(_map_arrays(layer.inner, fn))
    if isinstance(layer, Sequential):
        return Sequential([_map_arrays(x, fn) for x in layer.layers])
    raise TypeError(f"unknown layer type {type(layer).__name__}")
