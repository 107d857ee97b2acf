"""Multilinear layers and their composition.

Every network here is a polynomial map ``R^d -> R^out`` built from

* [`Linear`][tensoralg.layers.Linear] — ``y = W x + b``;
* [`Bilinear`][tensoralg.layers.Bilinear] — ``y = D((L x + l0) * (R x + r0)) + d0`` (a bilinear MLP,
  CP form);
* [`Residual`][tensoralg.layers.Residual] — ``y = x + inner(x)``;
* [`Sequential`][tensoralg.layers.Sequential] — composition, applied in order;
* [`BilinearAttention`][tensoralg.layers.BilinearAttention] — softmax-free attention whose pattern
  is a product of two bilinear score forms (a sequence layer; see ``docs/attention.md`` and
  docs/mathematics.md §3.7).

Weights are stored as NumPy arrays: ``float64`` for floating-point input (torch tensors and
float32 arrays are converted exactly), or ``object`` arrays of `fractions.Fraction`
when the weights are given as rationals (``Fraction``, ``int`` or strings such as ``"-3/4"``),
so that the ``exact`` backend computes in rational arithmetic with no rounding at all.

Networks are callable on a batch: ``net(x)`` with ``x`` of shape ``(n, d)`` (NumPy or torch)
returns ``(n, out)`` of the same kind (torch: same dtype and device as ``x``). A batch of
sequences ``x`` of shape ``(n, n_ctx, d)`` gives ``(n, n_ctx, out)``: position-free layers
(Linear, Bilinear) act on every position separately; a network holding a
[`BilinearAttention`][tensoralg.layers.BilinearAttention] layer accepts only sequences.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["Layer", "Linear", "Bilinear", "Residual", "Sequential", "BilinearAttention",
           "as_network", "map_arrays", "rope_rotations", "rotary_maps"]


# ----------------------------------------------------------------------------------------
# array helpers
# ----------------------------------------------------------------------------------------

def _is_torch(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch")


def _to_fraction(v: Any, name: str, what: str = "weights") -> Fraction:
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
            raise ValueError(f"{name}: non-finite value {f!r}; {what} must be finite")
        return Fraction(f)
    raise TypeError(f"{name}: cannot read {type(v).__name__} {v!r} as a number")


def _flatten(seq: Any) -> list:
    if isinstance(seq, (list, tuple)):
        out = []
        for s in seq:
            out.extend(_flatten(s))
        return out
    return [seq]


def as_array(value: Any, name: str, ndim: int, what: str = "weights") -> np.ndarray:
    """Read ``value`` as a float64 array or, for rational input, an object array of Fractions.

    Raises ``ValueError`` naming ``name`` on a wrong number of dimensions, an empty array or a
    non-finite entry (``what`` must be finite: ``"weights"`` by default).
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
            arr = np.array([_to_fraction(v, name, what) for v in arr.reshape(-1)] or [],
                           dtype=object)
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
                         f"{arr.shape}; {what} must be finite")
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


def _prepare_input(x: Any, d: int, sequence: bool = False,
                   n_ctx: int | None = None, note: str = "", prefix: bool = False
                   ) -> tuple[Any, bool]:
    squeeze = False
    if not _is_torch(x):
        x = np.asarray(x)
        if x.dtype != object:  # complex input stays complex (homogeneous parts, degree.py)
            x = x.astype(np.complex128 if np.iscomplexobj(x) else np.float64, copy=False)
    if sequence:
        if x.ndim != 3 or x.shape[2] != d:
            raise ValueError(f"x: a network with attention expects a batch of sequences of shape "
                             f"(n, n_ctx, {d}), got {tuple(x.shape)} (one sequence: pass x[None])")
        # a causal mask reads a shorter sequence as the prefix model (its leading block)
        if n_ctx is not None and x.shape[1] != n_ctx and not (prefix and x.shape[1] < n_ctx):
            raise ValueError(f"x: has n_ctx={x.shape[1]} positions (shape {tuple(x.shape)}) but the "
                             f"attention mask is ({n_ctx}, {n_ctx}){note}")
        return x, squeeze
    if x.ndim == 1:
        x, squeeze = x[None, :], True
    if x.ndim not in (2, 3) or x.shape[-1] != d:
        raise ValueError(f"x: expected a batch of shape (n, {d}), got {tuple(x.shape)} (or a batch "
                         f"of sequences of shape (n, n_ctx, {d}))")
    return x, squeeze


# ----------------------------------------------------------------------------------------
# layers
# ----------------------------------------------------------------------------------------

class Layer:
    """Base class: a polynomial map from ``in_features`` to ``out_features``."""

    in_features: int
    out_features: int

    def __call__(self, x: Any) -> Any:
        x, squeeze = _prepare_input(x, self.in_features, self.is_sequence_model, self.n_ctx,
                                    self.n_ctx_note, self.prefix_ok)
        cap = self.max_n_ctx
        if self.is_sequence_model and cap is not None and x.shape[1] > cap:
            raise ValueError(f"x: sequences of length {x.shape[1]} exceed the {cap} positions "
                             f"the network's position_maps cover")
        y = self._forward(x)
        return y[0] if squeeze else y

    def _forward(self, x: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def degree(self) -> int:
        """Degree of the network as a polynomial (an upper bound: 2**number of bilinear layers)."""
        raise NotImplementedError  # pragma: no cover

    @property
    def is_sequence_model(self) -> bool:
        """True when the network holds attention, i.e. reads sequences ``(n_ctx, d)``, not vectors."""
        return False

    @property
    def n_ctx(self) -> int | None:
        """The sequence length fixed by an attention mask array; None when any length works."""
        return None

    @property
    def max_n_ctx(self) -> int | None:
        """The longest sequence the network's per-position maps cover (the first axis of a
        [`BilinearAttention`][tensoralg.layers.BilinearAttention]'s ``position_maps``); None when
        any length works."""
        return None

    @property
    def prefix_ok(self) -> bool:
        """Whether a context ``n`` shorter than the masks' ``n_ctx`` is this network's exact
        prefix model: every attention mask is causal (``mask="causal"``, or an array with no
        non-zero entry above the diagonal; ``"none"`` is not), so positions ``< n`` read
        positions ``< n`` only and the masks' leading ``(n, n)`` blocks give them. Not for a
        layer compiled by [`tensoralg.from_torch`][tensoralg.compile.from_torch] (its mask was
        traced at one length; the module may scale by the length, so it says how to compile again:
        ``n_ctx_note``)."""
        return True

    @property
    def n_ctx_note(self) -> str:
        """Why the mask fixes ``n_ctx`` and how to get another length (ends the messages that
        refuse another ``n_ctx``): set by [`tensoralg.from_torch`][tensoralg.compile.from_torch] on
        the attention layers it compiles; ``""`` otherwise."""
        return ""

    @property
    def is_exact(self) -> bool:
        """True when every weight is a rational (object array of Fractions)."""
        return all(a.dtype == object for a in self.arrays())

    def arrays(self) -> list[np.ndarray]:
        raise NotImplementedError  # pragma: no cover

    def to_spec(self) -> dict | list:
        """The layer in the JSON layer format of ``docs/spec.md`` (strings for rationals)."""
        raise NotImplementedError  # pragma: no cover

    def astype_float(self) -> Layer:
        """A copy with float64 weights (rationals rounded to nearest)."""
        return map_arrays(self, lambda a: np.asarray(a, dtype=np.float64))

    def scaled_output(self, factor: float) -> Layer:
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

    def arrays(self) -> list[np.ndarray]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def to_spec(self) -> dict:
        return {"type": "linear", "weight": _spec_array(self.weight), "bias": _spec_array(self.bias)}

    def scaled_output(self, factor: float) -> Linear:
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

    def arrays(self) -> list[np.ndarray]:
        return [a for a in (self.left, self.right, self.down, self.left_bias, self.right_bias,
                            self.down_bias) if a is not None]

    def to_spec(self) -> dict:
        return {"type": "bilinear", "left": _spec_array(self.left), "right": _spec_array(self.right),
                "down": _spec_array(self.down), "left_bias": _spec_array(self.left_bias),
                "right_bias": _spec_array(self.right_bias), "down_bias": _spec_array(self.down_bias)}

    def scaled_output(self, factor: float) -> Bilinear:
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

    @property
    def is_sequence_model(self) -> bool:
        return self.inner.is_sequence_model

    @property
    def n_ctx(self) -> int | None:
        return self.inner.n_ctx

    @property
    def max_n_ctx(self) -> int | None:
        return self.inner.max_n_ctx

    @property
    def prefix_ok(self) -> bool:
        return self.inner.prefix_ok

    @property
    def n_ctx_note(self) -> str:
        return self.inner.n_ctx_note

    def _forward(self, x):
        return x + self.inner._forward(x)

    @property
    def degree(self) -> int:
        return max(1, self.inner.degree)

    def arrays(self) -> list[np.ndarray]:
        return self.inner.arrays()

    def to_spec(self) -> dict:
        return {"type": "residual", "inner": self.inner.to_spec()}

    def scaled_output(self, factor: float) -> Layer:
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
        fixed = [(i, layer.n_ctx) for i, layer in enumerate(layers) if layer.n_ctx is not None]
        for i, n in fixed[1:]:
            if n != fixed[0][1]:
                raise ValueError(f"layers[{i}]: attention mask fixes n_ctx={n} but layers[{fixed[0][0]}] "
                                 f"fixes n_ctx={fixed[0][1]}")
        self.layers = layers
        self.in_features = layers[0].in_features
        self.out_features = layers[-1].out_features
        self._n_ctx = fixed[0][1] if fixed else None

    @property
    def is_sequence_model(self) -> bool:
        return any(layer.is_sequence_model for layer in self.layers)

    @property
    def n_ctx(self) -> int | None:
        return self._n_ctx

    @property
    def max_n_ctx(self) -> int | None:
        caps = [layer.max_n_ctx for layer in self.layers if layer.max_n_ctx is not None]
        return min(caps) if caps else None

    @property
    def prefix_ok(self) -> bool:
        return all(layer.prefix_ok for layer in self.layers)

    @property
    def n_ctx_note(self) -> str:
        return next((n for n in (layer.n_ctx_note for layer in self.layers) if n), "")

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

    def arrays(self) -> list[np.ndarray]:
        return [a for layer in self.layers for a in layer.arrays()]

    def to_spec(self) -> list:
        return [layer.to_spec() for layer in self.layers]

    def scaled_output(self, factor: float) -> Sequential:
        return Sequential(self.layers[:-1] + [self.layers[-1].scaled_output(factor)])

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __repr__(self):
        inner = ", ".join(repr(layer) for layer in self.layers)
        return f"Sequential([{inner}])"

    @classmethod
    def from_spec(cls, spec: Sequence[dict] | dict) -> Sequential:
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
    "bilinear_attention": ({"q1", "k1", "q2", "k2", "v", "o"},
                           {"q1_bias", "k1_bias", "q2_bias", "k2_bias", "v_bias", "o_bias",
                            "mask", "scale", "rope", "position_maps"}),
}


def layer_from_spec(spec: dict, where: str = "spec") -> Layer:
    """One layer from its JSON dict (see
    [`Sequential.from_spec`][tensoralg.layers.Sequential.from_spec])."""
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
    if kind == "bilinear_attention":
        mask = spec.get("mask", "causal")
        return BilinearAttention(*(exact(spec[k]) for k in ("q1", "k1", "q2", "k2", "v", "o")),
                                 **{k: exact(spec.get(k)) for k in _ATTENTION_BIASES},
                                 mask=mask if isinstance(mask, str) else exact(mask),
                                 scale=spec.get("scale"), rope=spec.get("rope"),
                                 position_maps=exact(spec.get("position_maps")))
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
        try:
            exported = net.to_network()
        except ValueError as exc:   # e.g. a NaN parameter: say which argument holds it
            raise ValueError(f"{name}: {exc}") from None
        return as_network(exported, name)
    if isinstance(net, (list, tuple)) and net and all(isinstance(x, Layer) for x in net):
        return Sequential(net)
    if isinstance(net, (list, tuple, dict)):
        return Sequential.from_spec(net)
    raise TypeError(f"{name}: expected a tensoralg network (Linear, Bilinear, Residual, "
                    f"Sequential, BilinearAttention), a layer spec or a module with to_network(); got "
                    f"{type(net).__name__}")


def check_finite_weights(net: Layer, name: str) -> None:
    """ValueError naming ``name`` when a float weight of ``net`` holds NaN or inf: the
    constructors refuse them, but an array can be written into after construction
    (``m.layers[0].weight[0, 0] = np.nan``), and the float paths would then report an overflow,
    a failed eigensolver or a NaN answer."""
    for k, a in enumerate(net.arrays()):
        if a.dtype != object and not np.isfinite(a).all():
            bad = int(a.size - np.count_nonzero(np.isfinite(a)))
            raise ValueError(f"{name}: {bad} non-finite (NaN or inf) entries in its weight "
                             f"array {k} of shape {a.shape} (written after construction?); "
                             f"weights must be finite")


def map_arrays(layer: Layer, fn) -> Layer:
    if isinstance(layer, Linear):
        return Linear(fn(layer.weight), None if layer.bias is None else fn(layer.bias))
    if isinstance(layer, Bilinear):
        f = lambda a: None if a is None else fn(a)  # noqa: E731
        return Bilinear(f(layer.left), f(layer.right), f(layer.down), f(layer.left_bias),
                        f(layer.right_bias), f(layer.down_bias))
    if isinstance(layer, Residual):
        return Residual(map_arrays(layer.inner, fn))
    if isinstance(layer, BilinearAttention):
        return layer._map(fn)
    if isinstance(layer, Sequential):
        return Sequential([map_arrays(x, fn) for x in layer.layers])
    raise TypeError(f"unknown layer type {type(layer).__name__}")


# ----------------------------------------------------------------------------------------
# bilinear attention (sequences)
# ----------------------------------------------------------------------------------------

_ATTENTION_WEIGHTS = ("q1", "k1", "q2", "k2", "v", "o")
_ATTENTION_BIASES = ("q1_bias", "k1_bias", "q2_bias", "k2_bias", "v_bias", "o_bias")


def _einsum(like: Any):
    if _is_torch(like):
        import torch

        return torch.einsum
    if np.iscomplexobj(like):   # complex inputs (homogeneous parts): BLAS-backed contractions
        return lambda *ops: np.einsum(*ops, optimize=True)
    return np.einsum


def rope_rotations(n_ctx: int, d_head: int, base: float) -> np.ndarray:
    """Rotary position rotations ``R[t]`` (``(n_ctx, d_head, d_head)``, float64).

    Coordinates ``(2i, 2i+1)`` of a head vector at position ``t`` are rotated by the angle
    ``t * base**(-2i/d_head)`` (RoFormer, Su et al. 2021, eq. 13-15, interleaved pairs):
    ``R[t] @ q`` is the rotated query. ``R[t].T @ R[s]`` depends on ``s - t`` only.
    """
    theta = float(base) ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)
    ang = np.arange(n_ctx, dtype=np.float64)[:, None] * theta[None, :]
    c, s = np.cos(ang), np.sin(ang)
    R = np.zeros((n_ctx, d_head, d_head))
    i = np.arange(0, d_head, 2)
    R[:, i, i] = c
    R[:, i, i + 1] = -s
    R[:, i + 1, i] = s
    R[:, i + 1, i + 1] = c
    return R


def rotary_maps(cos: Any, sin: Any, layout: str = "interleaved") -> np.ndarray:
    """Position maps ``(n_ctx, d_head, d_head)`` (float64) of a rotary embedding given by its
    tables, for ``BilinearAttention(..., position_maps=...)``: ``R[t] @ q`` is the query at
    position ``t`` rotated by the table's angles, whatever precision they were computed in (a
    float32 table gives the float32 rotation, taken as it is).

    Args:
        cos, sin: ``(n_ctx, d_head // 2)`` (one entry per coordinate pair), or
            ``(n_ctx, d_head)`` with equal halves (the ``cat((freqs, freqs))`` tables of
            "rotate half" code); numpy arrays or torch tensors.
        layout: ``"interleaved"`` (pairs ``(2i, 2i+1)``, RoFormer, Su et al. 2021, eq. 13-15;
            what [`rope_rotations`][tensoralg.layers.rope_rotations] builds) or ``"half"``
            (pairs ``(i, i + d_head/2)``, the ``rotate_half`` convention of GPT-NeoX/LLaMA code).

    Raises:
        ValueError: tables of different shapes or not two-dimensional, ``(n_ctx, d_head)``
            tables whose halves differ, non-finite entries, an unknown ``layout``.
    """
    c, s = as_array(cos, "cos", 2), as_array(sin, "sin", 2)
    c, s = np.asarray(c, dtype=np.float64), np.asarray(s, dtype=np.float64)
    if c.shape != s.shape:
        raise ValueError(f"cos and sin: expected tables of one shape (n_ctx, d_head // 2), got "
                         f"{c.shape} and {s.shape}")
    if layout not in ("interleaved", "half"):
        raise ValueError(f"layout: expected 'interleaved' or 'half', got {layout!r}")
    if layout == "half" and c.shape[1] % 2 == 0 and c.shape[1] >= 2:
        h = c.shape[1] // 2
        if np.array_equal(c[:, :h], c[:, h:]) and np.array_equal(s[:, :h], s[:, h:]):
            c, s = c[:, :h], s[:, :h]
    n_ctx, n_pairs = c.shape
    d_head = 2 * n_pairs
    i = np.arange(n_pairs)
    first, second = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + n_pairs)
    R = np.zeros((n_ctx, d_head, d_head))
    R[:, first, first] = c
    R[:, first, second] = -s
    R[:, second, first] = s
    R[:, second, second] = c
    return R


class BilinearAttention(Layer):
    """Bilinear (softmax-free) multi-head attention on sequences (docs/mathematics.md §3.7).

    For an input sequence ``x_0 .. x_{n_ctx-1}`` (each of size ``d``) and every head ``h``::

        q1_t = R_t (q1_h x_t + q1_bias_h)       k1_s = R_s (k1_h x_s + k1_bias_h)   (same for q2, k2)
        v_s  = v_h x_s + v_bias_h
        pattern_h[t, s] = mask[t, s] * scale * (q1_t . k1_s) * (q2_t . k2_s)
        out_t = sum_h o[:, h, :] @ sum_s pattern_h[t, s] v_s  + o_bias

    ``R_t`` is the identity without RoPE, the rotary rotation of
    [`rope_rotations`][tensoralg.layers.rope_rotations] with ``rope=base``, and
    ``position_maps[t]`` with ``position_maps=`` (any linear map per position, applied to every
    query and key of every head: a float32 rotary table, [`rotary_maps`][tensoralg.layers.rotary_maps],
    or a learned per-position map; docs/mathematics.md §3.7). The output at position ``t`` is a
    polynomial of degree 5 in the lifted inputs: degree 2 in ``x_t`` (the queries) times degree
    3 in ``x_s`` (keys and value), summed over ``s`` against the mask.

    Args:
        q1, k1, q2, k2: ``(n_heads, d_head, d)``, all four the same shape.
        v: ``(n_heads, d_v, d)``.
        o: ``(d_out, n_heads, d_v)``.
        q1_bias, k1_bias, q2_bias, k2_bias: ``(n_heads, d_head)`` or None; v_bias
            ``(n_heads, d_v)`` or None; o_bias ``(d_out,)`` or None.
        mask: ``"causal"`` (``mask[t, s] = 1`` for ``s <= t``, else 0), ``"none"`` (all ones),
            or an ``(n_ctx, n_ctx)`` array (finite; fixes the sequence length).
        scale: the constant ``c`` multiplying every pattern; default ``1/d_head`` (the square
            of the usual ``1/sqrt(d_head)``, one factor per score). Rational when the weights are.
        rope: None, or the rotary base (a positive number, e.g. 10000); needs an even ``d_head``.
        position_maps: None, or ``(n_ctx_max, d_head, d_head)``: ``R_t = position_maps[t]``
            (finite; Fractions when the weights are, floats then taken exactly). Sequences up
            to ``n_ctx_max`` long; not together with ``rope``.

    Raises:
        ValueError: head, feature or output sizes that disagree (naming both shapes), a bad
            mask (shape, non-finite entries, unknown string), a non-finite or non-positive
            rope base, an odd ``d_head`` with RoPE, both ``rope`` and ``position_maps``,
            ``position_maps`` of another shape than ``(n_ctx_max, d_head, d_head)``, empty or
            non-finite weights.
    """

    def __init__(self, q1: Any, k1: Any, q2: Any, k2: Any, v: Any, o: Any, q1_bias: Any = None,
                 k1_bias: Any = None, q2_bias: Any = None, k2_bias: Any = None,
                 v_bias: Any = None, o_bias: Any = None, mask: Any = "causal",
                 scale: Any = None, rope: Any = None, position_maps: Any = None):
        w = {"q1": q1, "k1": k1, "q2": q2, "k2": k2, "v": v}
        for name, val in w.items():
            setattr(self, name, as_array(val, name, 3))
        self.o = as_array(o, "o", 3)
        shape = self.q1.shape
        for name in ("k1", "q2", "k2"):
            got = getattr(self, name).shape
            if got != shape:
                raise ValueError(f"{name}: expected shape (n_heads, d_head, d) = {shape} like q1, "
                                 f"got {got}; queries and keys must share heads, head size and "
                                 f"input size")
        self.n_heads, self.d_head, self.in_features = shape
        if self.v.shape[0] != self.n_heads or self.v.shape[2] != self.in_features:
            raise ValueError(f"v: expected shape ({self.n_heads}, d_v, {self.in_features}) to match "
                             f"q1 of shape {shape}, got {self.v.shape}")
        self.d_v = self.v.shape[1]
        if self.o.shape[1:] != (self.n_heads, self.d_v):
            raise ValueError(f"o: expected shape (d_out, {self.n_heads}, {self.d_v}) to match v of "
                             f"shape {self.v.shape}, got {self.o.shape}")
        self.out_features = self.o.shape[0]
        want = {"q1_bias": (self.n_heads, self.d_head), "k1_bias": (self.n_heads, self.d_head),
                "q2_bias": (self.n_heads, self.d_head), "k2_bias": (self.n_heads, self.d_head),
                "v_bias": (self.n_heads, self.d_v), "o_bias": (self.out_features,)}
        given = {"q1_bias": q1_bias, "k1_bias": k1_bias, "q2_bias": q2_bias, "k2_bias": k2_bias,
                 "v_bias": v_bias, "o_bias": o_bias}
        for name, val in given.items():
            arr = None if val is None else as_array(val, name, len(want[name]))
            if arr is not None and arr.shape != want[name]:
                raise ValueError(f"{name}: expected shape {want[name]}, got {arr.shape}")
            setattr(self, name, arr)
        exact = all(a.dtype == object for a in self._weight_arrays())
        # mask
        if isinstance(mask, str):
            if mask not in ("causal", "none"):
                raise ValueError(f"mask: expected 'causal', 'none' or an (n_ctx, n_ctx) array, "
                                 f"got {mask!r}")
            self.mask = mask
        else:
            m = as_array(mask, "mask", 2)
            if m.shape[0] != m.shape[1]:
                raise ValueError(f"mask: expected a square (n_ctx, n_ctx) array, got shape {m.shape}")
            if exact and m.dtype != object:
                m = np.vectorize(lambda v: Fraction(float(v)), otypes=[object])(m)
            self.mask = m
        # scale
        if scale is None:
            self.scale = Fraction(1, self.d_head) if exact else 1.0 / self.d_head
        else:
            c = _to_fraction(scale, "scale")
            self.scale = c if exact else float(c)
        # rope
        if rope is not None:
            if isinstance(rope, bool) or not isinstance(rope, numbers.Real) or \
                    not np.isfinite(float(rope)) or float(rope) <= 0:
                raise ValueError(f"rope: expected None or a positive finite rotary base, got {rope!r}")
            if self.d_head % 2:
                raise ValueError(f"rope: rotary embeddings rotate coordinate pairs and need an even "
                                 f"d_head, got d_head={self.d_head} (q1 of shape {shape})")
            rope = float(rope)
        self.rope = rope
        # position maps
        if position_maps is not None:
            if rope is not None:
                raise ValueError(f"rope and position_maps: give one (rope={rope:g} is the "
                                 f"position map rope_rotations(n_ctx, d_head, rope))")
            pm = as_array(position_maps, "position_maps", 3)
            if pm.shape[1:] != (self.d_head, self.d_head):
                raise ValueError(f"position_maps: expected shape (n_ctx_max, d_head, d_head) = "
                                 f"(n_ctx_max, {self.d_head}, {self.d_head}) for q1 of shape "
                                 f"{shape}, got {pm.shape}")
            if exact and pm.dtype != object:
                pm = np.vectorize(lambda v: Fraction(float(v)), otypes=[object])(pm)
            elif not exact and pm.dtype == object:
                pm = pm.astype(np.float64)
            position_maps = pm
        self.position_maps = position_maps

    # -- structure ----------------------------------------------------------------------
    def _weight_arrays(self):
        return [a for a in (self.q1, self.k1, self.q2, self.k2, self.v, self.o, self.q1_bias,
                            self.k1_bias, self.q2_bias, self.k2_bias, self.v_bias, self.o_bias)
                if a is not None]

    @property
    def is_sequence_model(self) -> bool:
        return True

    @property
    def n_ctx(self) -> int | None:
        return None if isinstance(self.mask, str) else int(self.mask.shape[0])

    @property
    def prefix_ok(self) -> bool:
        if isinstance(self.mask, str):
            return self.mask == "causal"
        return not self.n_ctx_note and not np.any(np.triu(np.asarray(self.mask != 0), 1))

    @property
    def n_ctx_note(self) -> str:
        return getattr(self, "_n_ctx_note", "")

    @property
    def max_n_ctx(self) -> int | None:
        return None if self.position_maps is None else int(self.position_maps.shape[0])

    @property
    def position_kwargs(self) -> dict:
        """``{"rope": ..., "position_maps": ...}``: the keyword arguments that give a copy the
        same position maps ``R_t``."""
        return {"rope": self.rope, "position_maps": self.position_maps}

    @property
    def degree(self) -> int:
        return 5

    def arrays(self) -> list[np.ndarray]:
        return self._weight_arrays() + ([] if isinstance(self.mask, str) else [self.mask]) + \
            ([] if self.position_maps is None else [self.position_maps])

    def mask_matrix(self, n_ctx: int) -> np.ndarray:
        """The ``(n_ctx, n_ctx)`` mask (Fractions when the layer is exact, else float64).

        A causal mask array ([`prefix_ok`][tensoralg.layers.Layer.prefix_ok]) longer than ``n_ctx``
        gives its leading block: the exact prefix model.

        Raises:
            ValueError: ``n_ctx`` differs from a mask array's size (and is not a shorter prefix
                of a causal one).
        """
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) or n_ctx < 1:
            raise ValueError(f"n_ctx: expected a positive int, got {n_ctx!r}")
        if not isinstance(self.mask, str):
            if n_ctx < self.mask.shape[0] and self.prefix_ok:
                return self.mask[:n_ctx, :n_ctx]
            if self.mask.shape[0] != n_ctx:
                raise ValueError(f"n_ctx={n_ctx} differs from the attention mask of shape "
                                 f"{self.mask.shape}{self.n_ctx_note}")
            return self.mask
        m = np.ones((n_ctx, n_ctx), dtype=np.int64)
        if self.mask == "causal":
            m = np.tril(m)
        if self.is_exact:
            return np.vectorize(Fraction, otypes=[object])(m)
        return m.astype(np.float64)

    def rotations(self, n_ctx: int) -> np.ndarray | None:
        """The position maps ``R_t`` of positions ``0 .. n_ctx-1``, ``(n_ctx, d_head, d_head)``:
        the RoPE rotations (float64, [`rope_rotations`][tensoralg.layers.rope_rotations]), the
        leading ``n_ctx`` of ``position_maps`` (as stored: Fractions when the layer is exact),
        or None (identity).

        Raises:
            ValueError: ``n_ctx`` beyond the ``n_ctx_max`` positions of ``position_maps``.
        """
        if self.position_maps is not None:
            cap = self.position_maps.shape[0]
            if n_ctx > cap:
                raise ValueError(f"n_ctx={n_ctx} exceeds the {cap} positions of the attention "
                                 f"layer's position_maps (shape {self.position_maps.shape})")
            return self.position_maps[:n_ctx]
        if self.rope is None:
            return None
        return rope_rotations(n_ctx, self.d_head, self.rope)

    def lifted(self) -> dict:
        """Weights with their biases as column 0 (the lifted input ``x~ = (1, x)``).

        Returns a dict: ``q1, k1, q2, k2`` of shape ``(n_heads, d_head, d + 1)``, ``v``
        ``(n_heads, d_v, d + 1)`` and ``o`` ``(d_out, n_heads, d_v)``, ``o_bias`` ``(d_out,)``
        or None; object arrays of Fractions when the layer is exact, else float64.
        """
        out = {}
        for name in ("q1", "k1", "q2", "k2", "v"):
            w = getattr(self, name)
            b = getattr(self, name + "_bias")
            zero = Fraction(0) if w.dtype == object else 0.0
            col = np.full(w.shape[:2] + (1,), zero, dtype=w.dtype) if b is None else \
                np.asarray(b, dtype=w.dtype)[:, :, None]
            out[name] = np.concatenate([col, w], axis=2)
        out["o"] = self.o
        out["o_bias"] = self.o_bias
        return out

    # -- forward ------------------------------------------------------------------------
    def _forward(self, x):
        if x.ndim != 3:
            raise ValueError(f"x: BilinearAttention expects a batch of sequences (n, n_ctx, "
                             f"{self.in_features}), got {tuple(x.shape)}")
        n_ctx = x.shape[1]
        if isinstance(x, np.ndarray) and x.dtype == object:
            return self._forward_einsum(x)
        # float (numpy or torch): every contraction is a (batched) matrix product, so BLAS
        # does the work (numpy's unoptimised einsum took 10-40x longer on these shapes)
        n, d = x.shape[0], x.shape[2]
        torch_in = _is_torch(x)

        def perm(a, axes):
            return a.permute(*axes) if torch_in else a.transpose(axes)

        rot = self.rotations(n_ctx)
        rot = None if rot is None else _numeric(rot, x)
        xf = x.reshape(n * n_ctx, d)

        def proj(name):
            w = _numeric(getattr(self, name), x)                     # (h, e, d)
            h, e = w.shape[0], w.shape[1]
            y = perm((xf @ w.reshape(h * e, d).T).reshape(n, n_ctx, h, e), (0, 2, 1, 3))
            b = getattr(self, name + "_bias")
            if b is not None:
                y = y + _numeric(b, x)[None, :, None, :]
            if rot is not None and name != "v":
                y = (rot[None, None] @ y[..., None])[..., 0]        # R[t] y[n, h, t]
            return y                                                # (n, h, t, e)

        s1 = proj("q1") @ proj("k1").swapaxes(-1, -2)                # (n, h, t, s)
        s2 = proj("q2") @ proj("k2").swapaxes(-1, -2)
        scale = _numeric(np.array(self.scale, dtype=object if isinstance(self.scale, Fraction)
                                  else np.float64), x)
        m = _numeric(self.mask_matrix(n_ctx), x) * scale
        z = (s1 * s2 * m[None, None]) @ proj("v")                     # (n, h, t, d_v)
        o = _numeric(self.o, x)                                      # (d_out, h, d_v)
        h, dv = z.shape[1], z.shape[3]
        y = (perm(z, (0, 2, 1, 3)).reshape(n * n_ctx, h * dv) @ o.reshape(o.shape[0], h * dv).T)
        y = y.reshape(n, n_ctx, o.shape[0])
        if self.o_bias is not None:
            y = y + _numeric(self.o_bias, x)
        return y

    def _forward_einsum(self, x):
        """The forward pass on exact (object) inputs, written as the definition's einsums."""
        n_ctx = x.shape[1]
        ein = _einsum(x)
        rot = self.rotations(n_ctx)
        rot = None if rot is None else _numeric(rot, x)

        def proj(name):
            y = ein("ntd,hed->nhte", x, _numeric(getattr(self, name), x))
            b = getattr(self, name + "_bias")
            if b is not None:
                y = y + _numeric(b, x)[None, :, None, :]
            if rot is not None and name != "v":
                y = ein("tef,nhtf->nhte", rot, y)
            return y

        s1 = ein("nhte,nhse->nhts", proj("q1"), proj("k1"))
        s2 = ein("nhte,nhse->nhts", proj("q2"), proj("k2"))
        scale = _numeric(np.array(self.scale, dtype=object if isinstance(self.scale, Fraction)
                                  else np.float64), x)
        m = _numeric(self.mask_matrix(n_ctx), x) * scale
        pattern = s1 * s2 * m[None, None]
        z = ein("nhts,nhsv->nhtv", pattern, proj("v"))
        y = ein("nhtv,ohv->nto", z, _numeric(self.o, x))
        if self.o_bias is not None:
            y = y + _numeric(self.o_bias, x)
        return y

    # -- specs and copies ---------------------------------------------------------------
    def to_spec(self) -> dict:
        spec = {"type": "bilinear_attention"}
        for name in _ATTENTION_WEIGHTS + _ATTENTION_BIASES:
            spec[name] = _spec_array(getattr(self, name))
        spec["mask"] = self.mask if isinstance(self.mask, str) else _spec_array(self.mask)
        spec["scale"] = str(self.scale) if isinstance(self.scale, Fraction) else float(self.scale)
        spec["rope"] = self.rope
        if self.position_maps is not None:
            spec["position_maps"] = _spec_array(self.position_maps)
        return spec

    def _map(self, fn):
        kw = {name: None if getattr(self, name) is None else fn(getattr(self, name))
              for name in _ATTENTION_WEIGHTS + _ATTENTION_BIASES}
        mask = self.mask if isinstance(self.mask, str) else fn(self.mask)
        maps = None if self.position_maps is None else fn(self.position_maps)
        out = BilinearAttention(**kw, mask=mask, scale=self.scale, rope=self.rope,
                                position_maps=maps)
        return out

    def scaled_output(self, factor: float) -> BilinearAttention:
        kw = {name: getattr(self, name) for name in _ATTENTION_WEIGHTS + _ATTENTION_BIASES}
        kw["o"] = self.o * factor
        kw["o_bias"] = None if self.o_bias is None else self.o_bias * factor
        return BilinearAttention(**kw, mask=self.mask, scale=self.scale, **self.position_kwargs)

    def __repr__(self):
        extra = "" if self.rope is None else f", rope={self.rope:g}"
        if self.position_maps is not None:
            extra = f", position_maps={self.position_maps.shape}"
        mask = self.mask if isinstance(self.mask, str) else f"array{self.mask.shape}"
        return (f"BilinearAttention({self.in_features} -> {self.out_features}, "
                f"heads={self.n_heads}, d_head={self.d_head}, d_v={self.d_v}, mask={mask}{extra})")
