"""Execution of tensor contractions: one ``opt_einsum`` path per (subscripts, shapes), run
step by step as batched matrix products (numpy ``matmul``: BLAS for float64, exact for object
arrays of ``Fraction``), or in torch float64 on a device inside `torch_backend`.

This is the execution layer of the exact Wick strategy on terms with position-carrying legs
(`tensoralg.strategies.sequence_exact`) and of the sequence closure
(`tensoralg.strategies.closure`). It computes no mathematics of its own: a contraction
``einsum(sub, *ops)`` is split along the greedy path of ``opt_einsum.contract_path`` into
pairwise steps; a step ``"la,lb->lo"`` sums the labels present in one operand only and absent
from the output, then is one ``matmul`` over (batch, left, contracted) x (batch, contracted,
right) after a transpose and reshape. The same path runs on numpy and torch, so values agree
up to float64 rounding (and are exact on object arrays).

Torch (``backend="torch"``): `torch_backend` sets a thread-local executor for one call;
contractions with a path cost of at least ``TORCH.min_flops`` run on the device, the rest in
numpy. Operands reused by many contractions are uploaded once per call (`to_device`).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import opt_einsum as oe

__all__ = ["Plan", "PairStep", "ein", "einsum_any", "torch_backend", "torch_exec", "to_device",
           "TORCH", "TORCH_CPU_FLOPS"]

_EXPRS: dict = {}


def _block(lab: str, group: str) -> bool:
    """Whether the labels ``group`` sit next to each other, in that order, in ``lab``."""
    return not group or group in lab


class PairStep:
    """One pairwise step ``einsum("la,lb->lo", A, B)`` (labels unique within each operand) as a
    batched matrix product: labels in one operand only and absent from the output are summed
    first; labels in both operands and in the output are the batch, in both and not in the
    output are contracted. Compiled once per step of a `Plan` (fixed shapes).

    ``la``, ``lb`` are the operands' axes as they lie in memory (C order). The batch labels
    stay separate, strided axes of ``matmul`` (no copy); an operand whose left (or right) and
    contracted labels each sit together, not behind a batch label, is read in place as a
    matrix (transposed in BLAS when its contracted block comes first); the order of the
    contracted labels is taken from the operand that then needs no copy. Only an operand that
    is not so laid out is copied. The output is returned as the product leaves it, axes
    ``out_labels`` = batch + left + right (the next step, or the `Plan`, reads it in that
    order: no copy back to ``lo``'s order)."""

    def __init__(self, es: str, sa, sb):
        lhs, lo = es.split("->")
        la, lb = lhs.split(",")
        size = dict(zip(la, sa)) | dict(zip(lb, sb))
        self.sum_a = tuple(k for k, x in enumerate(la) if x not in lb and x not in lo)
        self.sum_b = tuple(k for k, x in enumerate(lb) if x not in la and x not in lo)
        la = "".join(x for x in la if x in lb or x in lo)
        lb = "".join(x for x in lb if x in la or x in lo)
        n = lambda lab: int(np.prod([size[x] for x in lab], dtype=np.int64))  # noqa: E731
        pick = lambda lab, group: "".join(x for x in lab if x in group)  # noqa: E731
        batch = pick(la, {x for x in lo if x in la and x in lb})
        con_set = {x for x in la if x in lb and x not in lo}
        left = pick(la, set(la) - set(lb))
        right = pick(lb, set(lb) - set(la))

        def free(lab, outer, con):
            """None (copied) or whether the contracted block comes first (read transposed)."""
            if not (_block(lab, outer) and _block(lab, con)) or (lab and lab[-1] in batch):
                return None
            return bool(con and outer) and lab.index(con) < lab.index(outer)

        best = None
        orders = (pick(la, con_set), pick(lb, con_set))   # on a tie, the larger operand's
        for con in dict.fromkeys(orders if n(la) >= n(lb) else orders[::-1]):
            fa, fb = free(la, left, con), free(lb, right, con)
            cost = (n(la) if fa is None else 0) + (n(lb) if fb is None else 0)
            if best is None or cost < best[0]:
                best = (cost, con, fa, fb)
        _, con, fa, fb = best
        # A is read as (batch, left, contracted), B as (batch, contracted, right): swapped when
        # the other block comes first in memory
        self.swap_a, self.swap_b = fa is True, fb is False and bool(con and right)
        # a copied operand keeps its last axis last (a strided copy reads rows, not columns)
        if fa is None:
            self.swap_a = bool(la) and la[-1] in left and bool(con)
        if fb is None:
            self.swap_b = bool(lb) and lb[-1] in con and bool(right)
        bdims = tuple(size[x] for x in batch)
        self.perm_a = tuple(la.index(x) for x in batch + (con + left if self.swap_a
                                                           else left + con))
        self.perm_b = tuple(lb.index(x) for x in batch + (right + con if self.swap_b
                                                           else con + right))
        self.copy_a, self.copy_b = fa is None, fb is None
        self.shape_a = (n(batch), n(left), n(con))
        self.shape_b = (n(batch), n(con), n(right))
        self.view_a = bdims + ((n(con), n(left)) if self.swap_a else (n(left), n(con)))
        self.view_b = bdims + ((n(right), n(con)) if self.swap_b else (n(con), n(right)))
        self.shape_c = tuple(size[x] for x in batch + left + right)
        self.out_labels = batch + left + right

    def __call__(self, A, B):
        if not isinstance(A, np.ndarray) and hasattr(A, "permute"):   # torch tensors
            import torch

            if self.sum_a:
                A = A.sum(dim=self.sum_a)
            if self.sum_b:
                B = B.sum(dim=self.sum_b)
            A = A.permute(self.perm_a).reshape(self.view_a)
            B = B.permute(self.perm_b).reshape(self.view_b)
            if self.swap_a:
                A = A.transpose(-1, -2)
            if self.swap_b:
                B = B.transpose(-1, -2)
            return torch.matmul(A, B).reshape(self.shape_c)
        A, B = np.asarray(A), np.asarray(B)   # an object einsum may return a bare Fraction
        if self.sum_a:
            A = np.asarray(A.sum(axis=self.sum_a))
        if self.sum_b:
            B = np.asarray(B.sum(axis=self.sum_b))
        A = A.transpose(self.perm_a)
        B = B.transpose(self.perm_b)
        A = np.ascontiguousarray(A).reshape(self.view_a) if self.copy_a else \
            A.reshape(self.view_a)
        B = np.ascontiguousarray(B).reshape(self.view_b) if self.copy_b else \
            B.reshape(self.view_b)
        if self.swap_a:
            A = A.swapaxes(-1, -2)
        if self.swap_b:
            B = B.swapaxes(-1, -2)
        return np.asarray(np.matmul(A, B)).reshape(self.shape_c)


# contractions below this path cost (flops) run step by step in numpy's C einsum
_MATMUL_MIN_FLOPS = 1e4


class Plan:
    """A contraction along the ``opt_einsum`` greedy path, found once per (subscripts, shapes),
    executed pairwise as batched matrix products (`PairStep`, numpy ``matmul``: BLAS
    for floats, exact for object arrays) without ``opt_einsum``'s per-call parsing; the many
    small contractions of the closure made per-call overhead dominate its time."""

    def __init__(self, sub: str, shapes):
        _, info = oe.contract_path(sub, *shapes, shapes=True, optimize="greedy")
        self.steps = [(inds, es) for inds, _, es, *_ in info.contraction_list]
        self.flops = float(info.opt_cost)
        self.largest = int(info.largest_intermediate)  # elements
        self.peak = self._peak(sub, shapes)
        self.sub = sub
        self.compiled = None

    def _peak(self, sub: str, shapes) -> int:
        """Elements live at the peak of one call beyond its operands: walking the path, the
        intermediates not yet consumed plus, at each step, transposed copies of its two inputs,
        its output and the output's transposed copy (what `PairStep` allocates)."""
        size: dict = {}
        for lab, shp in zip(sub.split("->")[0].split(","), shapes):
            size.update(zip(lab, shp))
        live = [0] * len(shapes)  # the operands themselves are counted by the caller
        peak = 0
        for inds, es in self.steps:
            lhs, out = es.split("->")
            taken = [live.pop(x) for x in inds]
            ins = sum(math.prod(size[c] for c in t) for t in lhs.split(","))
            n_out = math.prod(size[c] for c in out)
            peak = max(peak, sum(live) + sum(taken) + ins + 2 * n_out)
            live.append(n_out)
        return peak

    def _compile(self, ops):
        """Steps with the operands' axes as they lie in memory: a `PairStep` returns its
        output in its own axis order (``out_labels``), recorded here and read as such by the
        steps after it; the last output is transposed (a view) to the subscripts' order."""
        lhs0, out0 = self.sub.split("->")
        labels = lhs0.split(",")
        shapes = [o.shape for o in ops]
        compiled = []
        for inds, es in self.steps:
            tmp = [shapes.pop(x) for x in inds]
            act = [labels.pop(x) for x in inds]
            lo = es.split("->")[1]
            if len(inds) == 2 and self.flops >= _MATMUL_MIN_FLOPS:
                step = PairStep(",".join(act) + "->" + lo, *tmp)
                shapes.append(step.shape_c)
                labels.append(step.out_labels)
            else:   # tiny contractions: one C einsum call beats transposes and a matmul
                size = {}
                for lab, sh in zip(act, tmp):
                    size.update(zip(lab, sh))
                step = (lambda e: (lambda *xs: einsum_any(e, *xs)))(",".join(act) + "->" + lo)
                shapes.append(tuple(size[x] for x in lo))
                labels.append(lo)
            compiled.append((inds, step))
        self.final = tuple(labels[0].index(x) for x in out0)
        if self.final == tuple(range(len(out0))):
            self.final = None
        return compiled

    def __call__(self, *ops, keep=None):
        if self.compiled is None:
            self.compiled = self._compile(ops)
        on_torch = torch_exec() is not None and self.flops >= TORCH.min_flops and \
            ops[0].dtype != object
        if on_torch:
            ops = [to_device(o, keep is None or keep[k]) for k, o in enumerate(ops)]
        else:
            ops = list(ops)
        for inds, step in self.compiled:
            tmp = [ops.pop(x) for x in inds]
            ops.append(step(*tmp))
        out = ops[0]
        if self.final is not None:
            out = out.permute(self.final) if on_torch else np.transpose(out, self.final)
        return out.cpu().numpy() if on_torch else out


def einsum_any(es: str, *xs):
    if xs and not isinstance(xs[0], np.ndarray) and hasattr(xs[0], "permute"):
        import torch

        return torch.einsum(es, *xs)
    return np.einsum(es, *xs)


# torch execution of the contractions (backend="torch"): set by torch_backend for one call;
# contractions with a path cost of at least min_flops run on the device, the rest in numpy
TORCH = threading.local()


def torch_exec():
    return getattr(TORCH, "exec", None)


def to_device(arr, cache: bool):
    """``arr`` (float64 numpy) as a torch tensor on the current device; operands reused by
    many contractions (the chaos coefficients, covariances) are uploaded once per call (kept
    with a reference to the array, so that its ``id`` is not reused while cached)."""
    torch, dev, uploaded = TORCH.exec
    if not cache:
        return torch.from_numpy(np.ascontiguousarray(arr)).to(dev)
    hit = uploaded.get(id(arr))
    if hit is None or hit[0] is not arr:
        hit = uploaded[id(arr)] = (arr, torch.from_numpy(np.ascontiguousarray(arr)).to(dev))
    return hit[1]


class torch_backend:
    """Context for one call with ``backend="torch"``: the larger contractions run in torch
    float64 on ``device`` (CUDA when available and ``device`` is None), the bookkeeping and
    the sums of the chaos form in numpy (same values up to float64 rounding). ``cpu_min_flops``:
    on a CPU device, the path cost from which a contraction runs in torch (default
    `TORCH_CPU_FLOPS`)."""

    def __init__(self, backend: str, device: Any, name: str, cpu_min_flops: float | None = None):
        self.cpu_min_flops = TORCH_CPU_FLOPS if cpu_min_flops is None else float(cpu_min_flops)
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend: {name} runs in float64 on 'numpy' or 'torch', got "
                             f"{backend!r}")
        if backend == "numpy" and device is not None:
            raise ValueError(f"device: only backend='torch' runs on a device; backend='numpy' "
                             f"computes on the CPU (got device={device!r})")
        self.on = backend == "torch"
        if self.on:
            from ..backends import torch_device

            self.device = torch_device(device)

    def __enter__(self):
        if self.on:
            import torch

            self.prev = (torch_exec(), getattr(TORCH, "min_flops", 0.0))
            TORCH.exec = (torch, self.device, {})
            # on a GPU the kernel launch (~10 us) only pays above ~1e6 flops; on a CPU torch's
            # per-call overhead is several times numpy's matmul path on small operands
            TORCH.min_flops = 1e6 if self.device.type != "cpu" else self.cpu_min_flops
        return self

    def __exit__(self, *exc):
        if self.on:
            TORCH.exec, TORCH.min_flops = self.prev
        return False


# with backend="torch" on a CPU, contractions from this cost on run in torch
TORCH_CPU_FLOPS = 2e5


def ein(sub: str, *ops, keep=None):
    """Contraction ``sub`` of ``ops`` (float64) along a path found once per (subscripts,
    shapes); a single operand goes to ``numpy.einsum``. ``keep``: per operand, whether a torch
    execution may keep its device copy for later contractions (False for temporaries)."""
    key = (sub,) + tuple(o.shape for o in ops)
    fn = _EXPRS.get(key)
    if fn is None:
        if len(ops) == 1:
            fn = (lambda s: (lambda x, keep=None: np.einsum(s, x)))(sub)
        else:
            fn = Plan(sub, [o.shape for o in ops])
        _EXPRS[key] = fn
    return fn(*ops, keep=keep)
