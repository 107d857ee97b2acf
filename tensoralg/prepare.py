"""Preparation shared by every strategy: option and pair checks, output projections, canonical
stacks of models in an exact power-of-two gauge (one validation module for every entry point,
as in scikit-learn's ``utils.validation``)."""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections import OrderedDict
from dataclasses import replace
from fractions import Fraction
from typing import Any

import numpy as np

from .backends import fraction_array
from .canonical import Canonical, Stage, canonicalize, resolve_n_ctx, stack
from .layers import (
    Bilinear,
    Layer,
    Linear,
    Residual,
    Sequential,
    as_network,
    check_finite_weights,
    map_arrays,
)
from .request import Request, make_request

__all__ = ["check_pair", "output_matrix", "networks", "stack_for", "normalize", "scaled",
           "PREPARED", "PreparedCache", "check_sequence_pair", "check_sequence_models",
           "check_slices", "IN_SEQUENCE_GRAM", "position_selector", "layer_structure"]

def check_pair(na: Layer, nb: Layer, sliceable: bool = True) -> None:
    """Both networks read the same input and give the same outputs. ``sliceable``: the caller
    takes ``output=`` (the message then offers slicing one output)."""
    if na.in_features != nb.in_features:
        raise ValueError(f"input dimensions differ: a takes {na.in_features} inputs, b takes "
                         f"{nb.in_features}; both networks must read the same x")
    if na.out_features != nb.out_features:
        hint = "slice one output (output=c or a direction u) or compare" if sliceable else \
            "compare"
        raise ValueError(f"output dimensions differ: a gives {na.out_features} outputs, b gives "
                         f"{nb.out_features}; {hint} networks with the same outputs")


def check_sizes(ref: Layer, others, name: str, offset: int = 0,
                ref_name: str = "networks[0]") -> None:
    """Every network of ``others`` (``name[offset]``, ``name[offset + 1]``, ...) reads the
    inputs and gives the outputs of ``ref`` (``ref_name``)."""
    for i, n in enumerate(others, start=offset):
        if n.in_features != ref.in_features:
            raise ValueError(f"{name}[{i}]: reads {n.in_features} inputs but {ref_name} reads "
                             f"{ref.in_features}; every network must read the same input")
        if n.out_features != ref.out_features:
            raise ValueError(f"{name}[{i}]: has {n.out_features} outputs but {ref_name} has "
                             f"{ref.out_features}; every network must have the same outputs")


def output_matrix(output: Any, O: int, exact: bool) -> tuple[np.ndarray, bool]:
    """Output projection U ``(K, O)`` and whether the projected index stays open
    (``output="each"``): `tensoralg.request.Request.output_matrix`."""
    return make_request(output=output, backend="exact" if exact else "numpy").output_matrix(O)


def _load(m: Any, name: str) -> Layer:
    """A model, or a checkpoint folder (str or path) loaded when its turn comes."""
    import os

    if isinstance(m, (str, os.PathLike)):
        from .checkpoint import load_network

        return load_network(m)
    return as_network(m, name)


def model_list(models: Any, name: str) -> list:
    """``models`` (a sequence or iterable of models, specs or checkpoint folders) as a list;
    TypeError for one model, one path or something that is not a sequence."""
    if isinstance(models, Layer) or hasattr(models, "to_network"):
        raise TypeError(f"{name}: expected a sequence of models, got a single model")
    if isinstance(models, (str, bytes)) or hasattr(models, "__fspath__"):
        raise TypeError(f"{name}: expected a sequence of models, got one path {str(models)!r} "
                        f"(a list of checkpoint folders is a sequence: [path, ...])")
    try:
        return list(models)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of models, got "
                        f"{type(models).__name__}") from None


def networks(models: Any, name: str) -> list[Layer]:
    """A list of tensoralg networks from a sequence (or iterable) of models, specs or
    checkpoint folders."""
    nets = [_load(m, f"{name}[{i}]") for i, m in enumerate(model_list(models, name))]
    if not nets:
        raise ValueError(f"{name}: empty sequence of models")
    return nets


# ----------------------------------------------------------------------------------------
# gauge normalization (exact in floating point: powers of two only)
# ----------------------------------------------------------------------------------------

def _exp2(maxabs: np.ndarray) -> np.ndarray:
    """Integer e with maxabs = m 2**e, m in [0.5, 1); 0 where maxabs is 0."""
    return np.frexp(maxabs)[1].astype(np.int32)


def _maxabs(x: np.ndarray, axis) -> np.ndarray:
    return np.abs(x).max(axis=axis)


def _times_pow2(x: np.ndarray, e: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x * 2**e`` exactly (``e`` integer, broadcast against ``x``). For ``|e| <= 1000`` the
    factor ``2**e`` is a double and IEEE multiplication rounds ``x 2**e`` correctly, i.e. the
    result is bit-identical to ``np.ldexp(x, e)``, several times faster (vectorized); beyond
    that range ``ldexp`` itself."""
    if e.size == 0 or int(np.abs(e).max()) <= 1000:
        return np.multiply(x, np.ldexp(1.0, e), out=out)
    return np.ldexp(x, e, out=out)


def normalize(can: Canonical, inplace: bool = False) -> tuple[Canonical, np.ndarray]:
    """Rescale a float stack by exact gauges (powers of two) so every factor is O(1).

    Gauges used (each leaves the function unchanged, and is exact in floating point):
    per hidden unit ``L_h * 2**-a, R_h * 2**-b, D[:, h] * 2**(a+b)``; on each internal bond
    (the embedding's output too) the non-constant rows of the map before it times ``2**-e`` and
    the non-constant input columns of the next stage times ``2**e`` (the constant coordinate is
    never scaled). The output's exponent ``k`` is returned per model: ``f = 2**k f_normalized``.
    The input stack is not modified, unless ``inplace`` (for a stack that owns its arrays,
    none shared with another object or with another of its stages: then they are rescaled
    where they are and returned).
    """
    if can.exact:
        return can, np.zeros(can.arrays()[0].shape[0], dtype=np.int32)
    own = (lambda a: a) if inplace else np.copy
    if not can.stages:
        W = own(can.linear)
        k = _exp2(_maxabs(W[:, 1:, :], (1, 2)))
        _times_pow2(W[:, 1:, :], -k[:, None, None], out=W[:, 1:, :])
        return replace(can, linear=W), k
    stages = []
    embed = None
    if can.embed is not None:
        embed = own(can.embed)
        carry = _exp2(_maxabs(embed[:, 1:, :], (1, 2)))
        _times_pow2(embed[:, 1:, :], -carry[:, None, None], out=embed[:, 1:, :])
    else:
        carry = np.zeros(can.stages[0].L.shape[0], dtype=np.int32)
    for st in can.stages:
        L, R, D = st.L, st.R, st.D
        if carry.any():  # columns of the non-constant inputs times 2**carry
            c = carry[:, None, None]
            L, R = own(L), own(R)
            _times_pow2(L[:, :, 1:], c, out=L[:, :, 1:])
            _times_pow2(R[:, :, 1:], c, out=R[:, :, 1:])
        eL = _exp2(_maxabs(L, 2))
        eR = _exp2(_maxabs(R, 2))
        eL[:, 0] = 0
        eR[:, 0] = 0
        L = _times_pow2(L, -eL[:, :, None], out=L if inplace else None)
        R = _times_pow2(R, -eR[:, :, None], out=R if inplace else None)
        D = _times_pow2(D, (eL + eR)[:, None, :], out=D if inplace else None)
        carry = _exp2(_maxabs(D[:, 1:, :], (1, 2)))
        _times_pow2(D[:, 1:, :], -carry[:, None, None], out=D[:, 1:, :])
        stages.append(Stage(L, R, D))
    return replace(can, stages=stages, embed=embed), carry


def _to_exact(can: Canonical) -> Canonical:
    return can if can.exact else replace(can.map(fraction_array), exact=True)


def _to_float(c: Canonical) -> Canonical:
    return c if not c.exact else replace(c.map(lambda a: np.asarray(a, dtype=np.float64)),
                                         exact=False)


def stack_for(nets: list[Layer], backend: str, name: str) -> tuple[Canonical, np.ndarray]:
    """Canonical forms of ``nets`` stacked on a batch axis, in the backend's number type and a
    normalized power-of-two gauge; returns ``(stack, k)`` with ``f_i = 2**k_i f_i^normalized``
    (``k = 0`` on the exact backend).

    A single float network on the NumPy backend goes through `PREPARED` (its prepared
    stack is reused while the network's weights are unchanged; the stack is read-only)."""
    if len(nets) == 1 and backend == "numpy":
        hit = PREPARED.get(nets[0])
        if hit is not None:
            return hit
        snap = PREPARED.snapshot(nets[0]) if PREPARED.admit(nets[0]) else None
        out = _stack_for(nets, backend, name)
        if snap is not None:
            PREPARED.put(nets[0], snap, out)
        return out
    return _stack_for(nets, backend, name)


def _stack_for(nets: list[Layer], backend: str, name: str) -> tuple[Canonical, np.ndarray]:
    # (a cached stack is only reused while the weights equal its copies, and NaN equals
    # nothing: a NaN written into a cached network comes here too)
    for i, n in enumerate(nets):
        check_finite_weights(n, name if len(nets) == 1 else f"{name}[{i}]")
    if backend == "exact":
        # floats are converted exactly (Fraction(float)) before any folding arithmetic
        nets = [n if n.is_exact else map_arrays(n, fraction_array) for n in nets]
    cans = [canonicalize(n) for n in nets]
    if backend == "exact":
        cans = [_to_exact(c) for c in cans]
    else:
        cans = [_to_float(c) for c in cans]
    st = stack(cans, name)
    # the stack owns its arrays: canonical forms are built afresh from the weights (lifted
    # copies, products), and stack() views or copies them
    return normalize(st, inplace=True)


def float_stacks_for_exact(nets: list[Layer], name: str
                           ) -> tuple[Canonical, Canonical, float] | None:
    """For the exact backend's planning before any rational work: ``(val, mag, rtol)``, the
    float64 canonical stack of float networks ``nets`` (not normalized: gauges change no zero
    pattern the planner reads), the stack of the same networks with every weight replaced by its
    absolute value, and a relative bound on the rounding of ``val``.

    The canonical form is built from the weights and the constants 0 and 1 by sums and products
    only, so ``mag`` bounds, entry by entry, the sum of the absolute values of the terms of each
    exact entry. An entry is a chain of at most ``k`` matrix products (``k``: the number of
    weight arrays of a network) of inner sizes at most ``n`` (the largest canonical dimension),
    plus the additions of the lifting; by the standard bound on floating-point matrix products
    (Higham, Accuracy and Stability, §3.5) ``|val - exact| <= (k + 2) n u mag`` to first order,
    ``u = 2**-53``; ``rtol`` is twice that (also covering the rounding of ``mag`` itself and
    one further product, by an output direction or a folded embedding). The bound assumes no
    underflow: every nonzero term (a product of at most ``k`` weights and ones) stays above
    ``2**-900`` when the smallest nonzero ``|weight|`` to the ``k``-th power does, so that a
    zero of ``mag`` is an exact zero and rounding errors stay relative; else None. None also
    for networks given in Fractions (they are exact already)."""
    if any(n.is_exact for n in nets):
        return None
    count = [0]

    def absolute(a):
        count[0] += 1
        return np.abs(a)

    val = stack([_to_float(canonicalize(n)) for n in nets], name)
    k = 0
    mags = []
    for n in nets:
        count[0] = 0
        mags.append(_to_float(canonicalize(map_arrays(n, absolute))))
        k = max(k, count[0])
    mag = stack(mags, name)
    small = [float(np.abs(a[a != 0]).min()) for n in nets for a in n.arrays()
             if np.any(a != 0)]
    if small and min(small) < 1 and k * np.log2(min(small)) < -900:
        return None
    dim = max(max(a.shape[1:]) for a in val.arrays())
    return val, mag, 2.0 * (k + 2) * dim * 2.0 ** -53


def layer_structure(layer: Layer):
    """What, besides the weights' values, determines a position-free network's canonical form:
    layer types, nesting, shapes and which biases exist; None for other layers (not cached)."""
    if isinstance(layer, Sequential):
        parts = tuple(layer_structure(x) for x in layer.layers)
        return None if any(p is None for p in parts) else ("seq",) + parts
    if isinstance(layer, Residual):
        inner = layer_structure(layer.inner)
        return None if inner is None else ("res", inner)
    if isinstance(layer, Linear):
        return ("lin", layer.weight.shape, layer.bias is None)
    if isinstance(layer, Bilinear):
        return ("bil", layer.left.shape, layer.right.shape, layer.down.shape,
                layer.left_bias is None, layer.right_bias is None, layer.down_bias is None)
    return None


class _Memo(dict):
    """A stack's memo that counts the bytes of the arrays stored in it (for the cache's
    size bound without walking every entry)."""

    nbytes = 0

    def __setitem__(self, key, value) -> None:
        old = self.get(key)
        if old is not None:
            self.nbytes -= _nbytes(old)
        super().__setitem__(key, value)
        self.nbytes += _nbytes(value)


def _nbytes(value) -> int:
    return sum(getattr(v, "nbytes", 0)
               for v in (value if isinstance(value, (list, tuple)) else [value]))


class PreparedCache:
    """Prepared stacks of single networks, reused while the weights are unchanged.

    Entries are keyed by the network object (held weakly) and validated on every lookup by
    content: the network's structure (`layer_structure`) and a private copy of every weight
    array, compared element by element with the current weights (``==``, so an in-place
    change, a replaced array or a NaN is a miss). A hit returns the stored stack, whose arrays
    are read-only; its ``memo`` holds results derived from it (the chaos coefficients of
    `tensoralg.strategies.chaos.depth1`). Float64 networks of Linear, Bilinear, Residual
    and Sequential layers only. At most ``max_entries`` networks and ``max_bytes`` bytes
    (weights copies, stacks and memos), least recently used first out; thread-safe.

    A network is admitted on its second use (`admit`; the first only notes it, weakly, in
    a bounded list of ``max_seen``): networks used once — a stream of new checkpoints — cost no
    copies, keep no memory and evict none of the networks that are used again."""

    def __init__(self, max_entries: int = 32, max_bytes: int = 256 * 2**20,
                 max_seen: int = 4096):
        self.max_entries, self.max_bytes, self.max_seen = max_entries, max_bytes, max_seen
        self._entries: OrderedDict[int, tuple] = OrderedDict()
        self._seen: OrderedDict[int, weakref.ref] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._seen.clear()

    def admit(self, net: Layer) -> bool:
        """Whether ``net`` (just missed) is to be cached now: True from its second use on
        (the same object noted by an earlier call and still alive), else note it and return
        False."""
        key = id(net)
        with self._lock:
            ref = self._seen.pop(key, None)
            if ref is not None and ref() is net:
                return True
            try:
                self._seen[key] = weakref.ref(net)
            except TypeError:  # not weakly referenceable: never cached
                return False
            while len(self._seen) > self.max_seen:
                self._seen.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def snapshot(net: Layer):
        """``(structure, copies of the weights)``, or None for a network that is not cached."""
        sig = layer_structure(net)
        if sig is None:
            return None
        arrs = net.arrays()
        if any(a.dtype != np.float64 for a in arrs):
            return None
        return sig, [a.copy() for a in arrs]

    def get(self, net: Layer):
        with self._lock:
            e = self._entries.get(id(net))
        if e is None or e[0]() is not net:
            self.misses += 1
            return None
        sig, copies = e[1], e[2]
        arrs = net.arrays()
        if layer_structure(net) != sig or len(arrs) != len(copies) or not all(
                a.shape == c.shape and a.dtype == c.dtype and bool((a == c).all())
                for a, c in zip(arrs, copies)):
            with self._lock:
                if self._entries.get(id(net)) is e:
                    del self._entries[id(net)]
            self.misses += 1
            return None
        with self._lock:
            if id(net) in self._entries:
                self._entries.move_to_end(id(net))
        self.hits += 1
        return e[3]

    def put(self, net: Layer, snap, value) -> None:
        can, k = value
        for a in can.arrays() + [k]:
            a.flags.writeable = False
        can.memo = _Memo()
        key = id(net)

        def gone(ref, key=key):
            with self._lock:
                e = self._entries.get(key)
                if e is not None and e[0] is ref:
                    del self._entries[key]

        nbytes = sum(c.nbytes for c in snap[1]) + sum(a.nbytes for a in can.arrays())
        with self._lock:
            self._entries[key] = (weakref.ref(net, gone), snap[0], snap[1], value, nbytes)
            self._entries.move_to_end(key)
            self._evict()

    def _evict(self) -> None:
        total = sum(self._size(e) for e in self._entries.values())
        while self._entries and (len(self._entries) > self.max_entries or total > self.max_bytes):
            _, e = self._entries.popitem(last=False)
            total -= self._size(e)

    @staticmethod
    def _size(e) -> int:
        memo = e[3][0].memo
        return e[4] + (memo.nbytes if memo is not None else 0)

#: The process-wide cache of `stack_for` (``PREPARED.clear()`` empties it).
PREPARED = PreparedCache()


def scaled(X, ka, kb, backend):
    """Undo the normalizing gauge: entry (i, j) times 2**(ka_i + kb_j)."""
    if backend == "exact":
        return X
    e = ka.astype(np.int64)[:, None] + kb.astype(np.int64)[None, :]
    if X.ndim == 3:
        e = e[:, :, None]
    return np.ldexp(X, e)


# ----------------------------------------------------------------------------------------
# sequence models (every strategy: exact terms, closure, Monte Carlo)
# ----------------------------------------------------------------------------------------

#: Set inside a Gram matrix of sequence models, whose per-position affine members are paired
#: with themselves on the diagonal (a pair without attention, valid there).
IN_SEQUENCE_GRAM = contextvars.ContextVar("in_sequence_gram", default=False)


def check_sequence_pair(a: Any, b: Any, n_ctx: Any):
    """Two sequence models read as networks with the same input and output sizes, and their
    sequence length: ``(a, b, n_ctx)``."""
    a, b = as_network(a, "a"), as_network(b, "b")
    if not (a.is_sequence_model or b.is_sequence_model or IN_SEQUENCE_GRAM.get()):
        raise ValueError("a and b: neither model holds attention; these are position-free networks: "
                         "use tensoralg.inner")
    check_pair(a, b)   # the message of every other entry point
    return a, b, resolve_n_ctx([("a", a), ("b", b)], n_ctx)


def check_slices(req: Request, d_out: int, n_ctx: int) -> None:
    """The request's ``output`` and ``position`` against the models' output size and
    ``n_ctx`` (their form was checked by `tensoralg.request.make_request`)."""
    req.output_matrix(d_out)
    req.check_position(n_ctx)


def check_sequence_models(models, n_ctx):
    """The sequence models of a Gram matrix as networks, and their one sequence length:
    ``(nets, n_ctx)``."""
    nets = [as_network(m, f"models[{i}]") for i, m in enumerate(models)]
    if len(nets) < 1:
        raise ValueError("models: expected at least one model")
    # one sequence length for all of them (every mask that fixes one, named models[i]) before
    # the pairwise size checks, which then run at that length
    n_ctx = resolve_n_ctx([(f"models[{i}]", net) for i, net in enumerate(nets)], n_ctx)
    for _i, net in enumerate(nets[1:], 1):
        check_sequence_pair(nets[0], net, n_ctx)
    return nets, check_sequence_pair(nets[0], nets[-1], n_ctx)[2]


def position_selector(n_ctx: int, position: Any, exact: bool) -> np.ndarray:
    """The query positions summed: ones at every position, or at ``position`` only."""
    sel = np.zeros(n_ctx, dtype=object if exact else np.float64)
    one, zero = (Fraction(1), Fraction(0)) if exact else (1.0, 0.0)
    sel[:] = zero
    if position is None or isinstance(position, str):
        sel[:] = one
    else:
        sel[int(position)] = one
    return sel
