"""Small helpers of [`tensoralg.decompose`][tensoralg.decompose]: exact/float arrays, output
directions, network keys, size checks and the batched Gram matrix of networks of mixed
architectures."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from ..canonical import zeros_array
from ..layers import Bilinear, Layer, Linear, Residual, Sequential, as_network

DEPTH_HINT = ("eigen-components need a depth-1 network (at most one bilinear layer on any "
               "path: degree <= 2); for a deeper network check a decomposition of your own "
               "with tensoralg.decompose.check_decomposition(model, components), or expand a "
               "residual network with tensoralg.decompose.paths(model)")


SEQUENCE_HINT = ("this part of tensoralg.decompose takes apart vector networks only (Linear, "
                 "Bilinear and Residual layers, e.g. a BilinearNet: eigen-components at depth "
                 "1, residual paths deeper); a transformer is taken apart into its first-order "
                 "paths by tensoralg.decompose.paths(model, n_ctx=...) / path_similarity, and "
                 "compared with another as a whole with ta.similarity / ta.inner (CLI: "
                 "tensoralg compare A B, tensoralg matrix CKPT...)")


def vector_network(obj: Any, name: str) -> Layer:
    """``as_network(obj, name)``, refusing a sequence model (one holding attention), which no
    decomposition here handles, with a message saying so (naming ``name``)."""
    net = as_network(obj, name)
    if net.is_sequence_model:
        raise ValueError(f"{name}: a sequence model (it holds attention, e.g. a bilinear "
                         f"transformer); {SEQUENCE_HINT}")
    return net


def bilinear_depth(net: Layer) -> int:
    """Number of bilinear layers a signal passes through (``log2`` of the degree bound)."""
    return int(net.degree).bit_length() - 1




def as_array(a, exact: bool) -> np.ndarray:
    if exact:
        return np.asarray(a, dtype=object)
    return np.asarray(a, dtype=np.float64)


def as_coef(c: Any, exact: bool):
    return Fraction(c) if exact else float(c)


def _structure_key(net: Layer) -> tuple:
    """Models with equal keys have equal canonical shapes (they can share a batched Gram)."""
    if isinstance(net, Linear):
        return ("linear", net.weight.shape)
    if isinstance(net, Bilinear):
        return ("bilinear", net.left.shape, net.down.shape)
    if isinstance(net, Residual):
        return ("residual", _structure_key(net.inner))
    if isinstance(net, Sequential):
        return ("sequential",) + tuple(_structure_key(x) for x in net.layers)
    raise TypeError(f"unknown layer type {type(net).__name__}")


def type_key(net: Layer) -> tuple:
    """The layer-type pattern (no sizes): networks with equal patterns can be run side by side."""
    if isinstance(net, (Linear, Bilinear)):
        return (type(net).__name__,)
    if isinstance(net, Residual):
        return ("Residual", type_key(net.inner))
    return ("Sequential",) + tuple(type_key(x) for x in net.layers)


def output_vector(output: Any, n_out: int, name: str = "output") -> np.ndarray | None:
    """``None`` stays ``None``; an int becomes a one-hot row; a vector is checked."""
    if output is None:
        return None
    if isinstance(output, (bool, np.bool_)):
        raise ValueError(f"{name}: expected a class index or a direction vector, got {output!r}")
    if isinstance(output, (int, np.integer)):
        from ..request import check_class_index

        u = np.zeros(n_out)
        u[check_class_index(output, n_out, name)] = 1.0
        return u
    if isinstance(output, str):
        raise ValueError(f"{name}: expected a class index or a direction vector of length "
                         f"{n_out}, got {output!r}")
    if hasattr(output, "detach"):
        output = output.detach().cpu().double().numpy()
    arr = np.asarray(output)
    if arr.ndim == 0:   # 9.0, nan, Fraction(1): neither an int index nor a vector
        raise ValueError(f"{name}: expected an int class index (0..{n_out - 1}) or a direction "
                         f"vector of shape ({n_out},), got "
                         f"{(output if arr.dtype == object else arr.item())!r}")
    if arr.dtype == object:
        u = np.array([Fraction(v) for v in arr.reshape(-1)], dtype=object)
    else:
        u = np.asarray(arr, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(u)):
            raise ValueError(f"{name}: the direction vector has non-finite entries")
    if arr.ndim != 1 or u.shape != (n_out,):
        raise ValueError(f"{name}: a direction vector must have shape ({n_out},) to match the "
                         f"network's {n_out} outputs, got shape {arr.shape}")
    return u


def identity_matrix(n: int, exact: bool) -> np.ndarray:
    out = zeros_array((n, n), exact)
    for i in range(n):
        out[i, i] = Fraction(1) if exact else 1.0
    return out


def gram_mixed(nets: Sequence[Layer], metric: str, backend: str, output: Any,
                on_cost: str = "raise") -> np.ndarray:
    """``G[i, j] = <n_i, n_j>`` with one [`tensoralg.cross_gram`][tensoralg.cross_gram] call per
    pair of architecture groups. ``on_cost="nan"``: a block refused as too costly is left NaN."""
    import tensoralg as ta

    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(nets):
        groups.setdefault(_structure_key(n), []).append(i)
    exact = backend == "exact"
    n = len(nets)
    G = np.empty((n, n), dtype=object) if exact else np.full((n, n), np.nan)
    keys = list(groups)
    for gi, ki in enumerate(keys):
        for kj in keys[gi:]:
            I, J = groups[ki], groups[kj]
            a = [nets[i] for i in I]
            b = a if ki == kj else [nets[j] for j in J]
            try:
                block = ta.cross_gram(a, b, metric=metric, backend=backend, output=output)
            except ta.CostTooHigh:
                if on_cost == "raise":
                    raise
                block = np.full((len(I), len(J)), np.nan, dtype=object if exact else float)
            for p, i in enumerate(I):
                for q, j in enumerate(J):
                    G[i, j] = G[j, i] = block[p, q]
    return G


def split_stack(layers: list) -> tuple[list, list, list]:
    """``(pre, blocks, post)`` of a flat layer list ``[Linear...] Residual... [Linear...]``:
    the leading linear layers, the residual blocks after them, and everything after those
    (the callers check that ``post`` is linear and the blocks are of kinds they take)."""
    from ..layers import Linear, Residual

    i = 0
    while i < len(layers) and isinstance(layers[i], Linear):
        i += 1
    j = i
    while j < len(layers) and isinstance(layers[j], Residual):
        j += 1
    return layers[:i], layers[i:j], layers[j:]
