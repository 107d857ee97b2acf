"""Position-free Wick: joined networks, Wick configurations, contraction plans, backends.

A pair of canonical networks (see `tensoralg.canonical`) is joined into one tensor network
whose open legs are copies of the lifted input ``x~``. Its Gaussian inner product is, by Isserlis'
theorem applied to the non-constant part of ``x~`` only (docs/mathematics.md §3.1),

    <a, b>_G = sum over partial matchings pi of the legs of
               contract(network, matched pairs bridged by P, unmatched legs capped by e0).

Bridging by ``P = diag(0, 1, ..., 1)`` and capping by ``e0`` are applied by splitting each leaf
factor ``F`` (rows: hidden units, columns: ``x~``) into its constant column ``F[:, 0]`` and its
non-constant block ``F[:, 1:]``, so no ``(d+1) x (d+1)`` tensor is ever built. The symmetrized
Frobenius metric (docs/mathematics.md §3.3) uses perfect bijections between the legs of ``a`` and ``b``
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

import numpy as np
import opt_einsum as oe

from ...canonical import Canonical
from ...errors import CostTooHigh
from ...io import atomic_write_json
from ...request import DEFAULT_MAX_CONFIGURATIONS
from .matchings import bijections, group_closure, orbits, partial_matchings, telephone

__all__ = ["WickPlan", "JoinedNetwork", "n_wick_configurations", "wick_flops_lower_bound",
           "output_projection"]


def n_wick_configurations(can_a: Canonical, can_b: Canonical, metric: str) -> tuple[int, int]:
    """``(n_legs, configurations)`` of the joined network before any reduction, from the
    depths alone (nothing is built): ``T(n)`` partial matchings for the Gaussian metric,
    ``n_a!`` bijections for Frobenius."""
    n_a, n_b = 2 ** can_a.depth, 2 ** can_b.depth
    if metric == "gaussian":
        return n_a + n_b, telephone(n_a + n_b)
    return n_a + n_b, math.factorial(n_a) if n_a == n_b else 0


# ----------------------------------------------------------------------------------------
# one side of the joined network
# ----------------------------------------------------------------------------------------

@dataclass
class _Side:
    """A stack of canonical networks as tensors with labels; leaves listed separately.

    ``pre``: when set, ``tensors`` is the non-leaf part of the tree, contracted lazily into one
    tensor ``T[batch, out, hidden index of each first-stage copy]`` (the same in every Wick
    configuration); ``pre_labels`` are T's labels and ``pre_shape`` its shape."""

    tensors: list[tuple[np.ndarray, tuple[str, ...], str]]  # (array, labels, node name)
    leaves: list[tuple[np.ndarray, str, str]]  # (leaf factor (N, H, w), hidden label, name)
    batch: str
    embed: np.ndarray | None = None  # (N, m+1, d+1) lifted embedding before the leaves
    pre_labels: tuple | None = None
    pre_shape: tuple | None = None
    _T: Any = None
    _lazy: Any = None

    def operands(self) -> list[tuple[Any, tuple[str, ...]]]:
        """The non-leaf operands as (array or shape-only placeholder, labels)."""
        if self.pre_labels is None:
            return [(t, labs) for t, labs, _ in self.tensors]
        if self._lazy is None:
            self._lazy = _Lazy(self)
        return [(self._lazy, self.pre_labels)]

    def precontracted(self) -> np.ndarray:
        if self._T is None:
            expr = ",".join("".join(l) for _, l, _ in self.tensors) + "->" + \
                "".join(self.pre_labels)
            self._T = oe.contract(expr, *[t for t, _, _ in self.tensors], optimize="auto")
        return self._T


class _Lazy:
    """Placeholder for a side's pre-contracted tensor: its shape is known before any work."""

    def __init__(self, side: _Side):
        self.side = side
        self.shape = side.pre_shape


class _Labels:
    def __init__(self):
        self.n = 0
        self.sizes: dict[str, int] = {}

    def new(self, size: int) -> str:
        s = oe.get_symbol(self.n)
        self.n += 1
        self.sizes[s] = size
        return s


def output_projection(U, root: np.ndarray) -> np.ndarray:
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
        W = output_projection(U, can.linear)  # (N, K, d+1)
        leaves.append((W, out_label, f"{side}.W"))
        return _Side(tensors, leaves, batch)
    embed = can.embed
    depth = can.depth
    stages = _pruned_stages(can, output_projection(U, can.stages[-1].D))

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
    out = _Side(tensors, leaves, batch, embed)
    if precontract and len(tensors) > 1:
        # The non-leaf part of the tree is the same in every Wick configuration: contracted
        # once, lazily (at contraction time, never while planning).
        leaf_h = list(dict.fromkeys(h for _, h, _ in leaves))
        shape = (N, labels.sizes[out_label], *(labels.sizes[h] for h in leaf_h))
        if math.prod(shape) <= _MAX_PRECONTRACT:
            out.pre_labels = (batch, out_label, *leaf_h)
            out.pre_shape = shape
    return out


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
# a lower bound on the Wick plan's FLOPs, without building it
# ----------------------------------------------------------------------------------------

#: The closed-form lower bound enumerates at most this many configurations (T(10) = 9496).
LOWER_BOUND_MAX_CONFIGURATIONS = 10_000


def _leaf_sketch(c: Canonical, U, embed: np.ndarray | None):
    """``(N, K, hidden size of a first-stage copy, [(label, pair width, can_cap, can_pair)]
    per leaf in the order of `_build_side`)`` after zero-pattern pruning, or None when the
    side's non-leaf part would not be a single (pre-contracted) operand."""
    N = c.arrays()[0].shape[0]
    K = U.shape[0]
    st = _pruned_stages(c, output_projection(U, c.stages[-1].D))
    H0 = st[0][0].shape[1]
    n_copies = 2 ** (c.depth - 1)
    if c.depth >= 2 and N * K * H0 ** n_copies > _MAX_PRECONTRACT:
        return None
    leaves = []
    for i in range(2 * n_copies):  # depth first, L before R: leaves 2q, 2q+1 share copy q
        F = st[0][i % 2]
        cap = F[..., 0] if embed is None else np.einsum("nhw,nw->nh", F, embed[:, :, 0])
        leaves.append((i // 2, F.shape[-1] - 1, bool(np.any(cap != 0)),
                       bool(np.any(F[..., 1:] != 0))))
    return N, K, H0, leaves


def _swap_exponent(c: Canonical) -> int:
    """``log2`` of an upper bound on the order of the verified leg symmetries of one side:
    every copy of a stage whose left and right factors are equal may swap its subtrees."""
    return sum(2 ** (c.depth - 1 - s) for s, st in enumerate(c.stages)
               if _equal_arrays(st.L, st.R))


def wick_flops_lower_bound(a: Canonical, b: Canonical, U: np.ndarray,
                           metric: str = "gaussian") -> float | None:
    """A lower bound on `WickPlan.flops` (the opt_einsum cost of every configuration
    orbit) from the shapes and zero patterns alone: no joined network, expression or path
    search. None when not available (Frobenius metric, degree-1 sides, more than
    `LOWER_BOUND_MAX_CONFIGURATIONS` configurations, a side too large to pre-contract).

    Derivation. Each side's non-leaf part is one operand ``T`` (indices: batch, output ``k``,
    one hidden index ``h`` per first-stage copy, shared by its two leaves). In any contraction
    path of a configuration, consider the first step whose operands contain both ``T_a`` and
    ``T_b``; let ``X`` be the set of network tensors in the operand holding ``T_a``. The step
    touches every index that joins ``X`` to the rest or to the output: both batch indices and
    ``k`` (in the output, or shared with ``T_b``), and, for every pair of legs bridged across
    the sides (``T_a -h- leaf -p- leaf' -h'- T_b``), at least one index of that chain. So the
    step costs at least ``N_a N_b K`` times the smallest product, over the sets ``A`` of
    ``a``'s and ``B`` of ``b``'s hidden indices, of the sizes in ``A`` and ``B`` and the pair
    widths of the cross pairs that avoid both (opt_einsum counts a step as the product of its
    index sizes times at least 1). Orbits under the leg symmetries have at most ``|G|``
    members and this bound is the same on an orbit, so the plan's sum over orbit
    representatives is at least the sum over the configurations that survive the zero patterns,
    divided by an upper bound on ``|G|`` (subtree swaps of stages with equal factors, and
    ``a <-> b``)."""
    if metric != "gaussian" or not a.stages or not b.stages:
        return None
    n = 2 ** a.depth + 2 ** b.depth
    if telephone(n) > LOWER_BOUND_MAX_CONFIGURATIONS:
        return None
    bridged = a.embed is not None and b.embed is not None
    if not bridged:
        a, b = a.folded(), (a.folded() if b is a else b.folded())
    sa = _leaf_sketch(a, U, a.embed if bridged else None)
    sb = _leaf_sketch(b, U, b.embed if bridged else None)
    if sa is None or sb is None:
        return None
    (Na, K, Ha, la), (Nb, _, Hb, lb) = sa, sb
    leaves = la + lb
    na = len(la)
    ca, cb = 2 ** (a.depth - 1), 2 ** (b.depth - 1)
    cuts = [(A, B, Ha ** bin(A).count("1") * Hb ** bin(B).count("1"))
            for A in range(2 ** ca) for B in range(2 ** cb)]
    total = 0
    for pairs, _ in partial_matchings(n, [x[2] for x in leaves], [x[3] for x in leaves]):
        cross = [(leaves[i][0], leaves[j][0] , min(leaves[i][1], leaves[j][1]))
                 for i, j in pairs if i < na <= j]
        if not cross:
            total += 1
            continue
        best = None
        for A, B, base in cuts:
            cost = base
            for qa, qb, w in cross:
                if not (A >> qa) & 1 and not (B >> qb) & 1:
                    cost *= w
            best = cost if best is None else min(best, cost)
        total += best
    group = 2 ** (_swap_exponent(a) + _swap_exponent(b)) * (2 if _same_stack(a, b) else 1)
    return float(Na * Nb * K) * total / group


# ----------------------------------------------------------------------------------------
# the joined network and its plan
# ----------------------------------------------------------------------------------------

@dataclass
class WickPlan:
    """What the exact Wick strategy will cost, computed before any contraction.

    Attributes:
        n_legs: input legs of the joined network (``2**depth_a + 2**depth_b``).
        n_configurations: Wick configurations before any reduction (T(n) partial matchings for
            the Gaussian metric, ``n_a!`` bijections for Frobenius).
        n_nonzero: after dropping configurations that vanish by zero patterns.
        n_orbits: distinct configurations contracted after symmetry reduction.
        group_order: order of the verified automorphism group acting on the legs.
        flops: total estimated floating-point operations of the chosen opt_einsum paths.
        largest_intermediate: largest intermediate tensor (elements) of any path.
        intermediates: elements of all intermediates of all paths together (what the shared
            intermediate cache may hold at once).
        input_elements: elements of the operands (pre-contracted trees, leaves, bridges).
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
    intermediates: int = 0
    input_elements: int = 0

    largest_input: int = 0
    n_steps: int = 0

    #: Bytes of Python bookkeeping per intermediate held by the shared cache (array header,
    #: shape and stride tuples, the cache's key string and dict slot), counted with the data.
    STEP_OVERHEAD = 512

    def memory_bytes(self, itemsize: int, shared: bool = True) -> int:
        """`memory_elements` in bytes, plus the shared cache's per-intermediate
        bookkeeping."""
        extra = self.n_steps * self.STEP_OVERHEAD if shared else 0
        return int(self.memory_elements(shared) * itemsize + extra)

    def memory_elements(self, shared: bool = True) -> int:
        """Upper bound on the elements alive during the contraction: the operands; every
        intermediate (``shared=True``: the shared-intermediates cache keeps them all until the
        end) or the two largest of one configuration (``shared=False``); and the work of one
        pairwise step (BLAS ``tensordot`` may copy both operands into matrix layout next to its
        output: two of the largest operands plus one output)."""
        inter = self.intermediates if shared else 2 * self.largest_intermediate
        step = 2 * max(self.largest_intermediate, self.largest_input) + self.largest_intermediate
        return int(self.input_elements + inter + step)

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


def _cached_paths(exprs: list[str], shapes: list[list[tuple]]):
    """``(paths or None, key source, key, cache file or None)``: the paths of this topology
    from memory or the disk cache, without searching."""
    key_src = json.dumps([exprs, [[list(s) for s in sh] for sh in shapes]])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    cdir = _cache_dir()
    fpath = cdir / f"{key}.json" if cdir is not None else None
    if key in _PATH_CACHE:
        return _PATH_CACHE[key], key_src, key, fpath
    if fpath is not None:
        res = _read_cached_paths(fpath, key_src, [len(sh) for sh in shapes])
        if res is not None:
            _PATH_CACHE[key] = res
            return res, key_src, key, fpath
    return None, key_src, key, fpath


def _find_paths(exprs: list[str], shapes: list[list[tuple]]
                ) -> tuple[list, list[float], list[int], list[int]]:
    """Contraction paths (and their FLOPs, largest intermediates and total intermediate sizes)
    for every expression.

    Keyed by the whole list of (expression, shapes): found once per topology, reused from
    memory, then from the disk cache across processes.
    """
    res, key_src, key, fpath = _cached_paths(exprs, shapes)
    if res is not None:
        return res
    paths, flops, largest, inter = [], [], [], []
    for expr, sh in zip(exprs, shapes):
        path, f, big, tot = _one_path(expr, sh)
        paths.append(path)
        flops.append(f)
        largest.append(big)
        inter.append(tot)
    res = (paths, flops, largest, inter)
    _PATH_CACHE[key] = res
    if fpath is not None:
        try:
            body = {"paths": paths, "flops": flops, "largest": largest, "inter": inter}
            atomic_write_json(fpath, {"key_src": key_src, **body,
                                      "sha256": _digest(key_src, body)}, indent=None)
        except OSError:
            pass  # a read-only home must not break the computation
    return res


_EXPR_PATHS: dict[tuple, tuple] = {}


def _one_path(expr: str, shapes: list[tuple]) -> tuple[list, float, int, int]:
    """``(path, FLOPs, largest intermediate, all intermediates)`` of one expression by
    opt_einsum's ``"auto"`` search, kept in memory per (expression, shapes)."""
    key = (expr, tuple(tuple(s) for s in shapes))
    hit = _EXPR_PATHS.get(key)
    if hit is None:
        path, info = oe.contract_path(expr, *shapes, shapes=True, optimize="auto")
        hit = ([tuple(p) for p in path], float(info.opt_cost), int(info.largest_intermediate),
               int(sum(info.size_list)))
        if len(_EXPR_PATHS) >= 4096:
            _EXPR_PATHS.clear()
        _EXPR_PATHS[key] = hit
    return hit


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
        body = {k: data[k] for k in ("paths", "flops", "largest", "inter")}
        if data.get("sha256") != _digest(key_src, body):
            return None
        paths = [[tuple(step) for step in path] for path in body["paths"]]
        flops = [float(f) for f in body["flops"]]
        largest = [int(x) for x in body["largest"]]
        inter = [int(x) for x in body["inter"]]
        if not (len(paths) == len(flops) == len(largest) == len(inter) == len(n_ops)):
            return None
        if not all(_valid_path(p, n) for p, n in zip(paths, n_ops)):
            return None
        if not all(math.isfinite(f) and f >= 0 for f in flops):
            return None
        return paths, flops, largest, inter
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class JoinedNetwork:
    """Two stacks of canonical networks joined at their outputs.

    Args:
        a, b: canonical forms with a leading batch axis (``N_a`` and ``N_b`` models).
        U: ``(K, O)`` output projection (identity: sum over outputs; a row: one slice).
        keep_output: keep the projected output index open (per-output values).
        metric: ``"gaussian"`` or ``"frobenius"``.

    When both sides keep an embedding (``m < d``), legs stay at the model widths and a pair of
    legs is bridged by the embedding Gram ``E_s E_t^T`` (``(m_s, m_t)``, the covariance of the
    two embedded inputs) instead of ``P`` on the wide input; a single leg is capped by the
    embedded constant ``E~ e0 = (1, c)``. Otherwise embeddings are folded into the leaves.
    """

    def __init__(self, a: Canonical, b: Canonical, U: np.ndarray, keep_output: bool = False,
                 metric: str = "gaussian"):
        if metric != "gaussian" or a.embed is None or b.embed is None:
            a, b = a.folded(), (a.folded() if b is a else b.folded())
        self.a, self.b, self.metric = a, b, metric
        self.bridged = a.embed is not None
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
        self.leaf_parts = []
        for side in (self.side_a, self.side_b):
            for F, _, _ in side.leaves:
                if side.embed is None:
                    cap = F[..., 0]
                else:
                    cap = np.einsum("nhw,nw->nh", F, side.embed[:, :, 0])
                self.leaf_parts.append((cap, F[..., 1:], F))
        self.bridges = {}
        if self.bridged:
            Ea, Eb = a.embed[:, 1:, 1:], b.embed[:, 1:, 1:]
            self.bridges[("a", "a")] = np.einsum("nix,njx->nij", Ea, Ea)
            self.bridges[("b", "b")] = np.einsum("nix,njx->nij", Eb, Eb)
            self.bridges[("a", "b")] = np.einsum("nix,mjx->nmij", Ea, Eb)

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
        if self.metric == "gaussian":
            can_cap = [bool(np.any(cap != 0)) for cap, _, _ in self.leaf_parts]
            can_pair = [bool(np.any(nc != 0)) for _, nc, _ in self.leaf_parts]
            ms = list(partial_matchings(len(self.leaf_parts), can_cap, can_pair))
        else:
            if self.n_a != self.n_b:
                raise ValueError(
                    f"metric='frobenius' needs coefficient tensors of the same order: a has "
                    f"{self.n_a} input legs, b has {self.n_b} (networks with a different number "
                    f"of bilinear stages); use metric='gaussian'")
            ms = list(bijections(range(self.n_a), range(self.n_a, self.n_a + self.n_b)))
        self.n_nonzero = len(ms)
        return orbits(ms, self.group)

    def expression(self, m) -> tuple[str, list[Any]]:
        """The einsum of configuration ``m`` and its operands (a side's pre-contracted tree is
        a `_Lazy` placeholder until `contract`)."""
        pairs, singles = m
        ops, subs = [], []
        for side in (self.side_a, self.side_b):
            for arr, labs in side.operands():
                ops.append(arr)
                subs.append("".join(labs))
        leaves = self.side_a.leaves + self.side_b.leaves
        batches = [self.side_a.batch] * self.n_a + [self.side_b.batch] * self.n_b
        sides = ["a"] * self.n_a + ["b"] * self.n_b
        local = _Labels()
        local.n = self.labels.n
        parts = self.leaf_parts
        for i in singles:
            ops.append(parts[i][0])
            subs.append(batches[i] + leaves[i][1])
        k = 1 if self.metric == "gaussian" else 2
        for i, j in pairs:
            if self.bridged:
                p = local.new(parts[i][1].shape[-1])
                q = local.new(parts[j][1].shape[-1])
                G = self.bridges[(sides[i], sides[j])]
                bsub = batches[i] + p + q if sides[i] == sides[j] else \
                    batches[i] + batches[j] + p + q
                ops.extend([parts[i][1], G, parts[j][1]])
                subs.extend([batches[i] + leaves[i][1] + p, bsub, batches[j] + leaves[j][1] + q])
                continue
            p = local.new(parts[i][k].shape[-1])
            ops.extend([parts[i][k], parts[j][k]])
            subs.extend([batches[i] + leaves[i][1] + p, batches[j] + leaves[j][1] + p])
        out = self.side_a.batch + self.side_b.batch + (self.out_label if self.keep_output else "")
        return ",".join(subs) + "->" + out, ops

    # -- plan & evaluation ----------------------------------------------------------------
    def flops_at_least(self, threshold: float) -> tuple[float, int, int]:
        """Path FLOPs of configuration orbits, searched one orbit at a time (those with more
        pairs across the two sides first: the dearest) until their sum exceeds ``threshold``:
        ``(sum, orbits searched, orbits)``. The sum is part of `WickPlan.flops` (the same
        per-expression search), hence a lower bound of it, and equals it when every orbit was
        searched. Call within the configuration budget (it enumerates the configurations)."""
        reps = self.configurations()
        exprs, shapes = [], []
        for m, _ in reps:
            expr, ops = self.expression(m)
            exprs.append(expr)
            shapes.append([tuple(o.shape) for o in ops])
        known = _cached_paths(exprs, shapes)[0]
        if known is not None:  # found before (memory or disk): the whole sum, no search
            return float(sum(known[1])), len(reps), len(reps)
        index = {id(item): q for q, item in enumerate(reps)}

        def across(item):
            pairs = item[0][0]
            return -sum(1 for i, j in pairs if (i < self.n_a) != (j < self.n_a)), -len(pairs)

        order = sorted(reps, key=across)
        total, n = 0.0, 0
        for item in order:
            q = index[id(item)]
            total += _one_path(exprs[q], shapes[q])[1]
            n += 1
            if total > threshold:
                break
        return total, n, len(reps)

    def plan(self, max_configurations: int = DEFAULT_MAX_CONFIGURATIONS,
             refuse: bool = True) -> WickPlan:
        total = self.n_configurations()
        if total > max_configurations and not refuse:
            return WickPlan(metric=self.metric, n_legs=self.n_a + self.n_b,
                            n_configurations=total, n_nonzero=-1, n_orbits=-1,
                            group_order=len(self.group), flops=math.inf,
                            largest_intermediate=-1, symmetries=self.symmetry_names,
                            refused=f"over max_configurations={max_configurations:,}; use "
                                    f"method='closure' or 'montecarlo'")
        if total > max_configurations:
            raise CostTooHigh(
                f"exact {self.metric} inner product: the joined network has "
                f"{self.n_a + self.n_b} input legs, i.e. {total:,} Wick configurations, over "
                f"max_configurations={max_configurations:,}. Alternatives: method='closure' "
                f"(the moment-closure similarity: fast, APPROXIMATE beyond depth 1) or "
                f"method='montecarlo' (with a standard error and a reliability verdict)")
        self.reps = self.configurations()
        exprs, shapes = [], []
        seen: dict[int, int] = {}
        for m, _ in self.reps:
            expr, ops = self.expression(m)
            exprs.append(expr)
            shapes.append([tuple(o.shape) for o in ops])
            for o in ops:
                seen[id(o)] = math.prod(o.shape)
        self.paths, flops, largest, inter = _find_paths(exprs, shapes)
        self.exprs = exprs
        return WickPlan(metric=self.metric, n_legs=self.n_a + self.n_b, n_configurations=total,
                        n_nonzero=self.n_nonzero, n_orbits=len(self.reps),
                        group_order=len(self.group), flops=float(sum(flops)),
                        largest_intermediate=max(largest) if largest else 0,
                        symmetries=self.symmetry_names, expressions=exprs,
                        intermediates=int(sum(inter)), input_elements=int(sum(seen.values())),
                        largest_input=max(seen.values(), default=0),
                        n_steps=sum(len(p) for p in self.paths))

    def contract(self, convert, shared: bool = True) -> Any:
        """Sum of all configurations; ``convert`` maps a NumPy array to the backend's array.
        ``shared``: reuse intermediates across configurations (opt_einsum's
        ``shared_intermediates``; memory: every intermediate is kept until the end)."""
        cache: dict[int, Any] = {}

        def conv(x):
            if isinstance(x, _Lazy):
                x = x.side.precontracted()
            k = id(x)
            if k not in cache:
                cache[k] = (x, convert(x))
            return cache[k][1]

        total = None
        if shared:
            with oe.shared_intermediates():
                for (m, weight), path in zip(self.reps, self.paths):
                    total = self._add_config(m, weight, path, conv, total)
        else:
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
