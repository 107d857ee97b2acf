"""Tensor-network engine: joined networks, Wick configurations, contraction plans, backends.

A pair of canonical networks (see :mod:`tensoralg.canonical`) is joined into one tensor network
whose open legs are copies of the lifted input ``x~``. Its Gaussian inner product is, by Isserlis'
theorem applied to the non-constant part of ``x~`` only (DESIGN §3.1),

    <a, b>_G = sum over partial matchings pi of the legs of
               contract(network, matched pairs bridged by P, unmatched legs capped by e0).

Bridging by ``P = diag(0, 1, ..., 1)`` and capping by ``e0`` are applied by splitting each leaf
factor ``F`` (rows: hidden units, columns: ``x~``) into its constant column ``F[:, 0]`` and its
non-constant block ``F[:, 1:]``, so no ``(d+1) x (d+1)`` tensor is ever built. The symmetrized
Frobenius metric (DESIGN §3.3) uses perfect bijections between the legs of ``a`` and ``b``
bridged by the identity, weighted ``1/n!``.

Every configuration is one einsum over the joined network. Its contraction path is found once by
``opt_einsum`` (per expression and shapes: a *topology*), kept in memory and on disk
(``$TENSORALG_CACHE_DIR`` or ``~/.cache/tensoralg``), and the same path runs on every backend:
NumPy float64, torch (any device and dtype) and exact rationals (object arrays of Fractions).

Symmetry reduction uses only leg permutations *checked* to be automorphisms of the joined
tensor network: swapping the two subtrees of a bilinear stage is used only when its left and
right factors are equal entry by entry (for every model of the stack), and swapping the two
networks only when both sides are the same stack. A permutation that preserves the function
but not the tensor network (e.g. swapping different factors of a symmetric bilinear form) is
never used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import opt_einsum as oe

from .canonical import Canonical
from .io import atomic_write_json
from .wick import bijections, group_closure, orbits, partial_matchings, telephone

__all__ = ["CostTooHigh", "Plan", "JoinedNetwork", "plan", "to_graph", "DEFAULT_MAX_FLOPS",
           "DEFAULT_MAX_CONFIGURATIONS"]

DEFAULT_MAX_FLOPS = 2e11
DEFAULT_MAX_FLOPS_EXACT = 2e7
DEFAULT_MAX_CONFIGURATIONS = 200_000


class CostTooHigh(ValueError):
    """An exact contraction whose estimated cost is over the budget (raised before any work)."""


# ----------------------------------------------------------------------------------------
# one side of the joined network
# ----------------------------------------------------------------------------------------

@dataclass
class _Side:
    """A stack of canonical networks as tensors with labels; leaves listed separately."""

    tensors: list[tuple[np.ndarray, tuple[str, ...], str]]  # (array, labels, node name)
    leaves: list[tuple[np.ndarray, str, str]]  # (leaf factor (N, H, d+1), hidden label, name)
    batch: str


class _Labels:
    def __init__(self):
        self.n = 0
        self.sizes: dict[str, int] = {}

    def new(self, size: int) -> str:
        s = oe.get_symbol(self.n)
        self.n += 1
        self.sizes[s] = size
        return s


def _output_projection(U, root: np.ndarray) -> np.ndarray:
    """``U @ root[:, 1:, ...]`` over the (non-constant) output axis; U: (K, O)."""
    body = root[:, 1:, ...]
    if body.dtype == object or (isinstance(U, np.ndarray) and U.dtype == object):
        return np.einsum("ko,no...->nk...", np.asarray(U, dtype=object), body.astype(object))
    return np.einsum("ko,no...->nk...", U, body)


def _build_side(can: Canonical, U: np.ndarray, labels: _Labels, out_label: str, side: str,
                precontract: bool = True) -> _Side:
    N = can.arrays()[0].shape[0]
    batch = labels.new(N)
    tensors: list = []
    leaves: list = []
    if not can.stages:
        W = _output_projection(U, can.linear)  # (N, K, d+1)
        leaves.append((W, out_label, f"{side}.W"))
        return _Side(tensors, leaves, batch)
    depth = can.depth
    stages = _pruned_stages(can, _output_projection(U, can.stages[-1].D))

    def build(stage: int, D: np.ndarray, parent_label: str, path: str):
        H = D.shape[-1]
        h = labels.new(H)
        tensors.append((D, (batch, parent_label, h), f"{side}.D{stage + 1}{path}"))
        L, R, _ = stages[stage]
        for fac, arr in (("L", L), ("R", R)):
            if stage == 0:
                leaves.append((arr, h, f"{side}.{fac}{stage + 1}{path}"))
            else:
                child = labels.new(arr.shape[-1])
                tensors.append((arr, (batch, h, child), f"{side}.{fac}{stage + 1}{path}"))
                build(stage - 1, stages[stage - 1][2], child, path + fac.lower())

    build(depth - 1, stages[-1][2], out_label, "")
    if precontract and len(tensors) > 1:
        # Pre-contract the non-leaf part of the tree once (it is the same in every Wick
        # configuration): T[batch, out, hidden index of each first-stage copy].
        leaf_h = list(dict.fromkeys(h for _, h, _ in leaves))
        size = N * labels.sizes[out_label] * math.prod(labels.sizes[h] for h in leaf_h)
        if size <= _MAX_PRECONTRACT:
            expr = ",".join("".join(l) for _, l, _ in tensors) + "->" + batch + out_label + \
                "".join(leaf_h)
            T = oe.contract(expr, *[t for t, _, _ in tensors], optimize="auto")
            tensors = [(T, (batch, out_label, *leaf_h), f"{side}.T")]
    return _Side(tensors, leaves, batch)


_MAX_PRECONTRACT = 1 << 26


def _nonzero(x: np.ndarray, axes) -> np.ndarray:
    return np.any(x != 0, axis=axes)


def _pruned_stages(can: Canonical, root: np.ndarray) -> list:
    """Zero patterns, removed exactly: hidden units whose ``D`` column, ``L`` row or ``R`` row is
    zero in every model contribute nothing, and an intermediate coordinate that no factor of the
    next stage reads is dropped (from ``D`` rows and the next factors' columns). The input
    coordinates of the first stage (``x~``) are kept. ``root`` is the output-projected ``D`` of
    the last stage."""
    st = [[s.L, s.R, s.D] for s in can.stages]
    st[-1][2] = root
    for k in range(len(st) - 1, -1, -1):
        L, R, D = st[k]
        # (a side whose every unit is pruned is the zero function: no configuration survives)
        keep = _nonzero(D, (0, 1)) & _nonzero(L, (0, 2)) & _nonzero(R, (0, 2))
        L, R, D = L[:, keep], R[:, keep], D[:, :, keep]
        if k > 0:
            used = _nonzero(L, (0, 1)) | _nonzero(R, (0, 1))
            L, R = L[:, :, used], R[:, :, used]
            st[k - 1][2] = st[k - 1][2][:, used, :]
        st[k] = [L, R, D]
    return st


def _leaf_generators(can: Canonical, offset: int) -> list[tuple[list[int], int]]:
    """Candidate leg permutations (subtree swaps) of one side, with the stage they need."""
    depth = can.depth
    n = 2 ** depth
    gens = []
    # legs of the subtree of a copy of stage s are contiguous blocks of size 2**(s+1),
    # left half from L, right half from R.
    for s in range(depth):
        block = 2 ** (s + 1)
        half = block // 2
        for start in range(0, n, block):
            perm = list(range(n))
            for i in range(half):
                perm[start + i], perm[start + half + i] = start + half + i, start + i
            gens.append(([p + offset for p in perm], s))
    return gens


def _equal_arrays(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and bool(np.all(x == y))


def _same_stack(a: Canonical, b: Canonical) -> bool:
    if a is b:
        return True
    xa, xb = a.arrays(), b.arrays()
    return len(xa) == len(xb) and all(_equal_arrays(x, y) for x, y in zip(xa, xb))


# ----------------------------------------------------------------------------------------
# the joined network and its plan
# ----------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What an exact inner product will cost, computed before any contraction.

    Attributes:
        n_legs: input legs of the joined network (``2**depth_a + 2**depth_b``).
        n_configurations: Wick configurations before any reduction (T(n) partial matchings for
            the Gaussian metric, ``n_a!`` bijections for Frobenius).
        n_nonzero: after dropping configurations that vanish by zero patterns.
        n_orbits: distinct configurations contracted after symmetry reduction.
        group_order: order of the verified automorphism group acting on the legs.
        flops: total estimated floating-point operations of the chosen opt_einsum paths.
        largest_intermediate: largest intermediate tensor (elements) of any path.
        expressions: einsum expressions of the orbit representatives (for inspection).
    """

    metric: str
    n_legs: int
    n_configurations: int
    n_nonzero: int
    n_orbits: int
    group_order: int
    flops: float
    largest_intermediate: int
    symmetries: list[str] = field(default_factory=list)
    expressions: list[str] = field(default_factory=list)
    refused: str | None = None

    def summary(self) -> str:
        if self.refused:
            return (f"{self.metric} metric: {self.n_legs} legs, {self.n_configurations:,} Wick "
                    f"configurations: REFUSED ({self.refused})")
        sym = ", ".join(self.symmetries) if self.symmetries else "none"
        return (f"{self.metric} metric: {self.n_legs} legs, {self.n_configurations} Wick "
                f"configurations, {self.n_nonzero} after zero patterns, {self.n_orbits} after "
                f"symmetry (group order {self.group_order}; symmetries: {sym}); "
                f"{self.flops:.3g} FLOPs, largest intermediate {self.largest_intermediate} "
                f"elements")

    def __str__(self) -> str:
        return self.summary()


_PATH_CACHE: dict[str, list] = {}


def _cache_dir() -> Path | None:
    root = os.environ.get("TENSORALG_CACHE_DIR")
    if root == "":
        return None
    return Path(root) if root else Path.home() / ".cache" / "tensoralg" / "paths"


def _find_paths(exprs: list[str], shapes: list[list[tuple]]) -> tuple[list, list[float], list[int]]:
    """Contraction paths (and their FLOPs and largest intermediates) for every expression.

    Keyed by the whole list of (expression, shapes): found once per topology, reused from
    memory, then from the disk cache across processes.
    """
    key_src = json.dumps([exprs, [[list(s) for s in sh] for sh in shapes]])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    if key in _PATH_CACHE:
        return _PATH_CACHE[key]
    cdir = _cache_dir()
    fpath = cdir / f"{key}.json" if cdir is not None else None
    if fpath is not None:
        res = _read_cached_paths(fpath, key_src, [len(sh) for sh in shapes])
        if res is not None:
            _PATH_CACHE[key] = res
            return res
    paths, flops, largest = [], [], []
    for expr, sh in zip(exprs, shapes):
        path, info = oe.contract_path(expr, *sh, shapes=True, optimize="auto")
        paths.append([tuple(p) for p in path])
        flops.append(float(info.opt_cost))
        largest.append(int(info.largest_intermediate))
    res = (paths, flops, largest)
    _PATH_CACHE[key] = res
    if fpath is not None:
        try:
            body = {"paths": paths, "flops": flops, "largest": largest}
            atomic_write_json(fpath, {"key_src": key_src, **body,
                                      "sha256": _digest(key_src, body)}, indent=None)
        except OSError:
            pass  # a read-only home must not break the computation
    return res


def _digest(key_src: str, body: dict) -> str:
    return hashlib.sha256((key_src + json.dumps(body, sort_keys=True)).encode()).hexdigest()


def _valid_path(path: Any, n_ops: int) -> bool:
    """A contraction path that contracts ``n_ops`` operands down to one, step by step."""
    count = n_ops
    for step in path:
        if (not step or len(set(step)) != len(step)
                or not all(isinstance(i, int) and 0 <= i < count for i in step)):
            return False
        count -= len(step) - 1
    return count == 1


def _read_cached_paths(fpath: Path, key_src: str, n_ops: list[int]):
    """The cached paths of ``fpath``, or None when absent, for another key, or damaged in any
    way (bad JSON or structure, checksum mismatch, a path that is not a complete contraction,
    non-finite costs): the caller then searches again and overwrites the file."""
    try:
        data = json.loads(fpath.read_text())
        if not isinstance(data, dict) or data.get("key_src") != key_src:
            return None
        body = {k: data[k] for k in ("paths", "flops", "largest")}
        if data.get("sha256") != _digest(key_src, body):
            return None
        paths = [[tuple(step) for step in path] for path in body["paths"]]
        flops = [float(f) for f in body["flops"]]
        largest = [int(x) for x in body["largest"]]
        if not (len(paths) == len(flops) == len(largest) == len(n_ops)):
            return None
        if not all(_valid_path(p, n) for p, n in zip(paths, n_ops)):
            return None
        if not all(math.isfinite(f) and f >= 0 for f in flops):
            return None
        return paths, flops, largest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class JoinedNetwork:
    """Two stacks of canonical networks joined at their outputs.

    Args:
        a, b: canonical forms with a leading batch axis (``N_a`` and ``N_b`` models).
        U: ``(K, O)`` output projection (identity: sum over outputs; a row: one slice).
        keep_output: keep the projected output index open (per-output values).
        metric: ``"gaussian"`` or ``"frobenius"``.
    """

    def __init__(self, a: Canonical, b: Canonical, U: np.ndarray, keep_output: bool = False,
                 metric: str = "gaussian"):
        self.a, self.b, self.metric = a, b, metric
        self.labels = _Labels()
        self.out_label = self.labels.new(U.shape[0])
        self.side_a = _build_side(a, U, self.labels, self.out_label, "a")
        self.side_b = _build_side(b, U, self.labels, self.out_label, "b")
        self.keep_output = keep_output
        self.n_a = len(self.side_a.leaves)
        self.n_b = len(self.side_b.leaves)
        self.same = _same_stack(a, b)
        self._symmetry()
        # leaf parts, built once so that shared intermediates are recognized across configs
        self.leaf_parts = [(F[..., 0], F[..., 1:], F)
                           for F, _, _ in self.side_a.leaves + self.side_b.leaves]

    # -- symmetry -------------------------------------------------------------------------
    def _symmetry(self):
        gens, names = [], []
        n = self.n_a + self.n_b
        for side, can, off in (("a", self.a, 0), ("b", self.b, self.n_a)):
            for perm, s in _leaf_generators(can, off):
                st = can.stages[s]
                if _equal_arrays(st.L, st.R):  # checked: the swap is an automorphism
                    full = list(range(n))
                    full[off:off + len(perm)] = perm
                    gens.append(full)
                    names.append(f"{side}: left/right swap at bilinear stage {s + 1}")
        self.swap_ab = self.same
        if self.same:
            gens.append(list(range(self.n_a, n)) + list(range(self.n_a)))
            names.append("a <-> b")
        self.group = group_closure(gens, n)
        self.symmetry_names = sorted(set(names))

    # -- configurations -------------------------------------------------------------------
    def n_configurations(self) -> int:
        n = self.n_a + self.n_b
        if self.metric == "gaussian":
            return telephone(n)
        return math.factorial(self.n_a) if self.n_a == self.n_b else 0

    def configurations(self) -> list[tuple[Any, int]]:
        """Orbit representatives with their sizes (after zero-pattern pruning)."""
        leaves = self.side_a.leaves + self.side_b.leaves
        if self.metric == "gaussian":
            can_cap = [bool(np.any(F[..., 0] != 0)) for F, _, _ in leaves]
            can_pair = [bool(np.any(F[..., 1:] != 0)) for F, _, _ in leaves]
            ms = list(partial_matchings(len(leaves), can_cap, can_pair))
        else:
            if self.n_a != self.n_b:
                raise ValueError(
                    f"metric='frobenius' needs coefficient tensors of the same order: a has "
                    f"{self.n_a} input legs, b has {self.n_b} (networks with a different number "
                    f"of bilinear stages); use metric='gaussian'")
            ms = list(bijections(range(self.n_a), range(self.n_a, self.n_a + self.n_b)))
        self.n_nonzero = len(ms)
        return orbits(ms, self.group)

    def expression(self, m) -> tuple[str, list[np.ndarray]]:
        pairs, singles = m
        ops, subs = [], []
        for side in (self.side_a, self.side_b):
            for arr, labs, _ in side.tensors:
                ops.append(arr)
                subs.append("".join(labs))
        leaves = self.side_a.leaves + self.side_b.leaves
        batches = [self.side_a.batch] * self.n_a + [self.side_b.batch] * self.n_b
        local = _Labels()
        local.n = self.labels.n
        parts = self.leaf_parts
        for i in singles:
            ops.append(parts[i][0])
            subs.append(batches[i] + leaves[i][1])
        for i, j in pairs:
            k = 1 if self.metric == "gaussian" else 2
            p = local.new(parts[i][k].shape[-1])
            ops.extend([parts[i][k], parts[j][k]])
            subs.extend([batches[i] + leaves[i][1] + p, batches[j] + leaves[j][1] + p])
        out = self.side_a.batch + self.side_b.batch + (self.out_label if self.keep_output else "")
        return ",".join(subs) + "->" + out, ops

    # -- plan & evaluation ----------------------------------------------------------------
    def plan(self, max_configurations: int = DEFAULT_MAX_CONFIGURATIONS,
             refuse: bool = True) -> Plan:
        total = self.n_configurations()
        if total > max_configurations and not refuse:
            return Plan(metric=self.metric, n_legs=self.n_a + self.n_b, n_configurations=total,
                        n_nonzero=-1, n_orbits=-1, group_order=len(self.group),
                        flops=math.inf, largest_intermediate=-1,
                        symmetries=self.symmetry_names,
                        refused=f"over max_configurations={max_configurations:,}; use "
                                f"method='closure' or 'montecarlo'")
        if total > max_configurations:
            raise CostTooHigh(
                f"exact {self.metric} inner product: the joined network has "
                f"{self.n_a + self.n_b} input legs, i.e. {total:,} Wick configurations, over "
                f"max_configurations={max_configurations:,}. Alternatives: method='closure' "
                f"(second-moment propagation, fast, approximate beyond depth 1) or "
                f"method='montecarlo' (unbiased, with a standard error)")
        self.reps = self.configurations()
        exprs, shapes = [], []
        for m, _ in self.reps:
            expr, ops = self.expression(m)
            exprs.append(expr)
            shapes.append([tuple(o.shape) for o in ops])
        self.paths, flops, largest = _find_paths(exprs, shapes)
        self.exprs = exprs
        return Plan(metric=self.metric, n_legs=self.n_a + self.n_b, n_configurations=total,
                    n_nonzero=self.n_nonzero, n_orbits=len(self.reps),
                    group_order=len(self.group), flops=float(sum(flops)),
                    largest_intermediate=max(largest) if largest else 0,
                    symmetries=self.symmetry_names, expressions=exprs)

    def contract(self, convert) -> Any:
        """Sum of all configurations; ``convert`` maps a NumPy array to the backend's array."""
        cache: dict[int, Any] = {}

        def conv(x):
            k = id(x)
            if k not in cache:
                cache[k] = (x, convert(x))
            return cache[k][1]

        total = None
        with oe.shared_intermediates():
            for (m, weight), path in zip(self.reps, self.paths):
                total = self._add_config(m, weight, path, conv, total)
        if total is None:  # every configuration vanishes by zero patterns
            shape = (self.labels.sizes[self.side_a.batch], self.labels.sizes[self.side_b.batch])
            if self.keep_output:
                shape += (self.labels.sizes[self.out_label],)
            if self.a.exact:
                total = np.empty(shape, dtype=object)
                total.fill(Fraction(0))
            else:
                total = convert(np.zeros(shape))
        return total

    def _add_config(self, m, weight, path, conv, total):
        expr, ops = self.expression(m)
        val = oe.contract(expr, *[conv(o) for o in ops], optimize=path)
        if self.swap_ab:
            # the group contains a<->b: an orbit holds as many images X^T as X
            val = (val + _swap01(val)) / 2
        if self.metric == "frobenius":
            w = Fraction(weight, math.factorial(self.n_a))
        else:
            w = Fraction(weight)
        term = val * (w if _is_exact_array(val) else float(w))
        return term if total is None else total + term


def _swap01(x):
    if hasattr(x, "transpose") and not isinstance(x, np.ndarray):  # torch
        return x.transpose(0, 1)
    return np.swapaxes(x, 0, 1)


def _is_exact_array(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == object


# ----------------------------------------------------------------------------------------
# graph view
# ----------------------------------------------------------------------------------------

def to_graph(a: Any, b: Any = None, output: Any = None) -> nx.Graph:
    """The tensor network of ``a`` (or of the pair ``a``, ``b`` joined at the output) as a
    bipartite :class:`networkx.Graph`.

    Nodes are tensors (``kind="tensor"``, with ``shape`` and ``side``) and indices
    (``kind="index"``, with ``size``); an index node links every tensor that carries it, so a
    bilinear layer's hidden index appears as a *hyperedge*: one index node joined to three
    tensors (``D``, ``L``, ``R``). Open input legs are index nodes with ``leg=True`` (copies of
    the lifted input ``x~``); the output index is ``open=True`` for a single network and shared
    by both sides for a pair.
    """
    from .layers import as_network
    from .canonical import canonicalize, stack

    net_a = as_network(a, "a")
    can_a = stack([canonicalize(net_a)])
    labels = _Labels()
    out = labels.new(net_a.out_features)
    U = np.eye(net_a.out_features)
    sides = [("a", _build_side(can_a, U, labels, out, "a", precontract=False))]
    if b is not None:
        net_b = as_network(b, "b")
        if net_b.out_features != net_a.out_features:
            raise ValueError(f"b: output size {net_b.out_features} differs from a's "
                             f"{net_a.out_features}")
        sides.append(("b", _build_side(stack([canonicalize(net_b)]), U, labels, out, "b",
                                       precontract=False)))
    g = nx.Graph()
    for name, side in sides:
        for arr, labs, node in side.tensors:
            g.add_node(node, kind="tensor", side=name, shape=tuple(arr.shape[1:]))
            for lab in labs[1:]:
                g.add_node(f"i:{lab}", kind="index", size=labels.sizes[lab])
                g.add_edge(node, f"i:{lab}")
        for arr, h, node in side.leaves:
            g.add_node(node, kind="tensor", side=name, shape=tuple(arr.shape[1:]))
            g.add_node(f"i:{h}", kind="index", size=labels.sizes[h])
            g.add_edge(node, f"i:{h}")
            leg = f"leg:{node}"
            g.add_node(leg, kind="index", size=arr.shape[-1], leg=True)
            g.add_edge(node, leg)
    g.nodes[f"i:{out}"]["open"] = b is None
    g.nodes[f"i:{out}"]["output"] = True
    return g


def plan(a: Any, b: Any = None, metric: str = "gaussian", output: Any = None,
         max_configurations: int = DEFAULT_MAX_CONFIGURATIONS) -> Plan:
    """The cost summary of the exact inner product ``<a, b>`` (``<a, a>`` if ``b`` is None):
    Wick configurations before and after zero-pattern and symmetry reduction, FLOPs and largest
    intermediate of the chosen opt_einsum paths. Contracts nothing. Over
    ``max_configurations`` the returned plan has ``refused`` set (a reason), ``flops = inf``
    and ``n_nonzero = n_orbits = -1`` (the configurations are not enumerated)."""
    from .products import _prepare_pair

    joined = _prepare_pair(a, a if b is None else b, metric=metric, output=output,
                           backend="numpy")[0]
    return joined.plan(max_configurations, refuse=False)
