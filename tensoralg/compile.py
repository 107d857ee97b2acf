"""Compile a PyTorch module into a tensoralg network (``tensoralg.from_torch``).

The module's computation is captured with PyTorch's own graph capture
(`torch.export.export`; `torch.fx.symbolic_trace` lowered to ATen by
`torch.fx.experimental.proxy_tensor.make_fx` where export cannot run) and the ATen graph is
walked once with *symbolic values*: every intermediate tensor is a polynomial of the input kept
as a sum of linear images of *cores* (docs/mathematics.md §2, §3.7 and §4):

* the lifted stream ``s~ = (1, s)`` at each position (an affine map; biases are column 0);
* a bilinear core, hidden units ``(L_h . s~)(R_h . s~)`` (an elementwise product of two affine
  maps, or a contraction of them at one position);
* an attention core, heads ``z_t = sum_s C[t, s] (q1_t . k1_s)(q2_t . k2_s) v_s`` (score products
  of queries and keys at two different positions applied to values).

Linear operations (reshapes, transposes, splits, concatenations, slicing, matmul/einsum/linear
with a parameter, sums, scalar and constant scales, residual adds, ``lerp`` with a constant
weight, eval-mode batch norm) act on the linear maps; a product of two values whose terms are not all affine first
turns the latest residual-stream-like value they are both linear images of into a new layer
(``Linear``, ``Bilinear``, ``Residual(Bilinear)``, ``BilinearAttention`` or
``Residual(BilinearAttention)``) and continues on its output. Operations on constants only
(parameters, buffers, masks, rotary tables) are evaluated with torch; so are the constants an
activation only gives the shape of (``zeros_like``, ``ones_like``, ``full_like``, ``new_zeros``,
``new_ones``, ``new_full``).

Position-dependent queries and keys: when their linear maps depend on the position, they are
first matched against [`tensoralg.layers.rope_rotations`][tensoralg.layers.rope_rotations]
(interleaved pairs; the "rotate half" layout is a permutation of the head coordinates, which
leaves the scores unchanged; the rotary base is read off the rotation at position 1 and the
whole table is checked to 1e-10): an exact rotary embedding compiles to ``rope=base``. Any other
linear map per position applied to every query and key alike (a rotary table computed in float32,
whose angles are off by ~4e-8; a learned per-position map) compiles to ``position_maps``, the
maps read off the traced table (docs/mathematics.md §3.7). Different maps on queries and keys,
or per head, are refused.

Every export is verified: the compiled network and the module (a float64 copy on the CPU, in
eval mode) are run on deterministic inputs of the example's shape and must agree to ``1e-10``
relative to the largest output; on a mismatch the first layer whose output differs from the
graph node it was built from is named.

What is refused (a one-line ``ValueError`` naming the operator, the module path and the source
line): non-polynomial operators (softmax, ReLU/GELU/SiLU, layer/RMS norm with a data-dependent
denominator, division by an activation, ...), data-dependent control flow, sums over positions
or over the batch, position-dependent affine maps (learned positional embeddings), and
polynomial structure the layer classes cannot express (three score factors, an attention layer
and an MLP summed in parallel, skip connections across more than one layer).
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
import string
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:   # torch is imported only when a module is compiled
    import torch

    from .layers import Sequential

__all__ = ["from_torch", "NotCompilable", "SUPPORTED_OPS", "NON_POLYNOMIAL_OPS"]

RTOL = 1e-10          # verification tolerance (relative to the largest reference output)
_TOL = 1e-12          # structural checks (position independence, identities), relative


class NotCompilable(ValueError):
    """The module cannot be expressed as a tensoralg network (the message says why and where)."""


# operators whose output is a rearrangement of their inputs' entries (run on index tensors)
_MOVE = {
    "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "unsqueeze", "squeeze",
    "expand", "expand_as", "slice", "select", "split", "split_with_sizes", "chunk", "unbind",
    "cat", "concat", "stack", "flatten", "unflatten", "clone", "contiguous", "alias", "detach",
    "flip", "roll", "repeat", "index_select", "narrow", "movedim", "swapaxes", "swapdims",
    "lift_fresh_copy", "view_as", "reshape_as", "tile", "broadcast_to", "diagonal", "alias_copy",
    "view_copy", "permute_copy", "transpose_copy", "unsqueeze_copy", "squeeze_copy",
    "expand_copy", "slice_copy", "select_copy", "split_copy", "unbind_copy",
}
_LINEAR = {"add", "sub", "rsub", "neg", "mul", "div", "true_divide", "lerp", "sum", "mean",
           "bilinear", "batch_norm",
           "matmul", "mm", "bmm", "linear", "einsum", "addmm", "square", "pow", "dropout",
           "masked_fill", "where", "to", "_to_copy", "type_as", "embedding", "index",
           "scaled_dot_product_attention"}
# ops that make a constant tensor shaped like an activation (its values never depend on it):
# the name -> its fill (a float), or the index of the fill value among the op's arguments (an int)
_CONSTANT_LIKE = {"zeros_like": 0.0, "ones_like": 1.0, "full_like": 1, "new_zeros": 0.0,
                  "new_ones": 1.0, "new_full": 2}
SUPPORTED_OPS = tuple(sorted((_MOVE | _LINEAR | set(_CONSTANT_LIKE))
                             - {"scaled_dot_product_attention"}))
NON_POLYNOMIAL_OPS = (
    "softmax", "_softmax", "log_softmax", "_log_softmax", "relu", "relu_", "gelu", "silu",
    "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "reciprocal", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "native_batch_norm",
    "instance_norm", "abs", "sign", "max", "min", "amax", "amin", "clamp", "clamp_min",
    "clamp_max", "hardtanh", "leaky_relu", "elu", "softplus", "mish", "erf", "sin", "cos",
    "norm", "linalg_vector_norm", "scaled_dot_product_attention", "maximum", "minimum",
    "argmax", "topk", "sort", "floor", "round", "threshold", "hardswish", "glu", "logsumexp",
)


# ----------------------------------------------------------------------------------------
# where a node comes from (for messages)
# ----------------------------------------------------------------------------------------

def _opname(node) -> str:
    t = node.target
    name = getattr(t, "__name__", None) or str(t)
    if hasattr(t, "_schema"):   # OpOverload: aten.softmax.int -> softmax
        name = t._schema.name.split("::")[-1]
    return name


def _where(node) -> str:
    """``module path (file:line: code)`` of a graph node."""
    path = ""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        path = path.replace("L['self'].", "").replace("L['self']", "") or "<root>"
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    src = ""
    files = [i for i, ln in enumerate(trace) if ln.strip().startswith("File ")]
    user = [i for i in files if "/torch/" not in trace[i]]
    files = user or files
    if files:
        ln = trace[files[-1]].strip()
        code = trace[files[-1] + 1].strip() if files[-1] + 1 < len(trace) else ""
        try:
            fname = ln.split('"')[1].rsplit("/", 1)[-1]
            lineno = ln.split("line ")[1].split(",")[0]
            src = f"{fname}:{lineno}: `{code}`"
        except IndexError:
            src = ln
    target = getattr(node.target, "__name__", str(node.target))
    op = str(node.target) if hasattr(node.target, "_schema") else target
    parts = [p for p in (f"module {path!r}" if path else "", src) if p]
    return f"{op} (node {node.name}" + (", " + ", ".join(parts) if parts else "") + ")"


def _fail(node, why: str) -> NotCompilable:
    return NotCompilable(f"from_torch: {_where(node)}: {why}")


# ----------------------------------------------------------------------------------------
# symbolic values
# ----------------------------------------------------------------------------------------

class _Core:
    """A multilinear core on stream ``stream``: 'lin' (the lifted stream, size F), 'bil'
    (hidden units (L s~)(R s~)) or 'att' (heads x value features of an attention core)."""

    _ids = itertools.count()

    def __init__(self, kind: str, stream: int, size: int, **data):
        self.kind, self.stream, self.size, self.data = kind, stream, size, data
        self.id = next(_Core._ids)


class _Sym:
    """A symbolic tensor of full shape ``shape`` (batch at axis 0, position at axis ``pos`` or
    none): ``value[b, ...] = sum_k terms[k][..., :] @ core_k(b)``; ``chain`` holds the same value
    as affine images ``G @ (1, u)`` of earlier values ``u`` (candidates for a new layer)."""

    def __init__(self, shape, pos, stream, terms, chain=None, hidden=False):
        self.shape, self.pos, self.stream = tuple(int(s) for s in shape), pos, stream
        self.terms: dict[int, np.ndarray] = terms        # core id -> M (shape[1:] + (K,))
        self.chain: dict[int, np.ndarray] = chain or {}  # sym id -> G (shape[1:] + (1 + D_u,))
        self.hidden = hidden
        self.id = None

    def nonlin(self, cores) -> bool:
        return any(cores[k].kind != "lin" for k in self.terms)


class _Pattern:
    """Attention pattern ``C[h, t, s] prod_f (Q_f[h, t] s~_t) . (K_f[h, s] s~_s)`` laid out on the
    axes ``labels`` (``'b'`` batch, ``('h', i)`` head axis i, ``'t'`` query, ``'s'`` key)."""

    def __init__(self, shape, labels, head_sizes, factors, C, stream):
        self.shape, self.labels, self.head_sizes = tuple(shape), tuple(labels), tuple(head_sizes)
        self.factors, self.C, self.stream = factors, C, stream


class _Tokens:
    def __init__(self, shape):
        self.shape = tuple(shape)


def _is_sym(v) -> bool:
    return isinstance(v, (_Sym, _Pattern, _Tokens))


class _Compiler:
    def __init__(self, B: int, T: int | None, inputs: str):
        self.B, self.T, self.inputs = B, T, inputs
        self.cores: dict[int, _Core] = {}
        self.streams: list[dict] = []    # {"d": features, "lin": core id, "from": sym id}
        self.layers: list = []
        self.layer_nodes: list = []      # (node, sym) each layer was built from
        self.syms: dict[int, _Sym] = {}
        self.materialized: dict[int, int] = {}   # sym id -> stream index
        self._sid = itertools.count()
        self.node = None
        self.vocab = None
        self.embed_seen = 0

    # -- bookkeeping ----------------------------------------------------------------------
    def new_stream(self, d: int, from_sym: int | None) -> int:
        core = _Core("lin", len(self.streams), d + 1)
        self.cores[core.id] = core
        self.streams.append({"d": d, "lin": core.id, "from": from_sym})
        return len(self.streams) - 1

    def register(self, v: _Sym, own: bool = False) -> _Sym:
        v.id = next(self._sid)
        self.syms[v.id] = v
        if own:
            v.chain[v.id] = self.identity_map(v.shape, v.pos)
        return v

    def fail(self, why: str) -> NotCompilable:
        return _fail(self.node, why)

    def identity_map(self, shape, pos) -> np.ndarray:
        """Lifted identity ``shape[1:] + (1 + D,)``: the value as coordinates of a stream made
        from it (features: the non-batch, non-position axes flattened in order)."""
        per = tuple(shape[1:])
        p = None if pos is None else pos - 1
        feat = [s for i, s in enumerate(per) if i != p]
        D = int(np.prod(feat)) if feat else 1
        G = np.zeros(per + (1 + D,))
        idx = np.indices(per).reshape(len(per), -1)
        fidx = np.ravel_multi_index([idx[i] for i in range(len(per)) if i != p], feat) \
            if feat else np.zeros(idx.shape[1], dtype=np.int64)
        flat = G.reshape(-1, 1 + D)
        flat[np.arange(flat.shape[0]), 1 + fidx] = 1.0
        return G

    def lin_sym(self, stream: int, M: np.ndarray, shape, pos, own=False) -> _Sym:
        return self.register(_Sym(shape, pos, stream, {self.streams[stream]["lin"]: M}), own)

    def const_sym(self, c: np.ndarray, shape, pos, stream: int) -> _Sym:
        """A constant broadcast to ``shape`` as a symbolic value (column 0 of the lin core)."""
        c = np.broadcast_to(np.asarray(c, dtype=np.float64), shape)
        if not np.allclose(c, c[:1], rtol=0, atol=0):
            raise self.fail("a constant that differs between batch entries")
        F = self.streams[stream]["d"] + 1
        M = np.zeros(tuple(shape[1:]) + (F,))
        M[..., 0] = c[0]
        v = self.lin_sym(stream, M, shape, pos)
        return v

    # -- streams: rebase and materialize ----------------------------------------------------
    def rebase(self, v: _Sym, stream: int) -> _Sym:
        if v.stream == stream:
            return v
        u = self.streams[stream]["from"]
        if u is not None and u in v.chain:
            return self.lin_sym(stream, v.chain[u], v.shape, v.pos)
        common = set(v.chain) & set(self.syms[u].chain) if u is not None else set()
        if common:   # v and u both affine images of an earlier w: is v an affine image of u?
            w = max(common)
            us = self.syms[u]
            Gu = self.per_position(us.chain[w], us.shape, us.pos)
            Gv = self.per_position(v.chain[w], v.shape, v.pos)
            lift = np.concatenate([np.eye(1, Gu.shape[1]), Gu])
            A = Gv @ np.linalg.pinv(lift)
            if np.allclose(A @ lift, Gv, rtol=0, atol=_TOL * max(1.0, np.abs(Gv).max())):
                per = [s for i, s in enumerate(v.shape[1:]) if v.pos is None or i != v.pos - 1]
                M = A.reshape(tuple(per) + (A.shape[1],))
                if v.pos is not None:
                    M = np.broadcast_to(np.expand_dims(M, v.pos - 1),
                                        tuple(v.shape[1:]) + (A.shape[1],)).copy()
                return self.lin_sym(stream, M, v.shape, v.pos)
        raise self.fail("combines a value computed before a layer with that layer's output (a "
                        "skip connection across layers, or a value of an earlier residual "
                        "stream): not expressible as a chain of tensoralg layers")

    def align(self, vals):
        syms = [v for v in vals if isinstance(v, (_Sym, _Pattern))]
        if not syms:
            return vals
        top = max(v.stream for v in syms)
        return [self.rebase(v, top) if isinstance(v, _Sym) else v for v in vals]

    def affine(self, vals: list[_Sym]) -> list[_Sym]:
        """Operands of a product as affine maps of one stream (making a layer if needed)."""
        vals = self.align(vals)
        if not any(v.nonlin(self.cores) for v in vals):
            onehot = self.inputs == "tokens" and self.vocab is not None and \
                all(v.stream == 0 for v in vals)
            common = set.intersection(*(set(v.chain) for v in vals))
            if not (onehot and common):
                return vals
            # one-hot tokens: the embedding (a Linear layer) first, then the products
        common = set.intersection(*(set(v.chain) for v in vals))
        if not common:
            raise self.fail("multiplies values that are not affine images of one common "
                        "intermediate value: the product is not expressible with tensoralg layers")
        u = max(common)
        j = self.materialize(u)
        return [self.rebase(v, j) for v in vals]

    def materialize(self, uid: int) -> int:
        if uid in self.materialized:
            return self.materialized[uid]
        u = self.syms[uid]
        if u.stream != len(self.streams) - 1:
            raise self.fail("a new layer from a value of an earlier stream")
        layers, D = self.build_layer(u)
        for layer in layers:
            self.layers.append(layer)
            self.layer_nodes.append((self.node, u if layer is layers[-1] else None))
        j = self.new_stream(D, uid)
        self.materialized[uid] = j
        return j

    def per_position(self, M: np.ndarray, shape, pos) -> np.ndarray:
        """``M`` (shape[1:] + (K,)) as ``(D, K)``, checking it is the same at every position."""
        K = M.shape[-1]
        if pos is None:
            return M.reshape(-1, K)
        M = np.moveaxis(M, pos - 1, 0)
        M = M.reshape(M.shape[0], -1, K)
        if not np.allclose(M, M[:1], rtol=0, atol=_TOL * max(1.0, np.abs(M).max())):
            raise self.fail("an affine map that differs between positions (e.g. a learned "
                            "positional embedding or bias added to the residual stream): "
                            "tensoralg layers act on every position alike")
        return M[0]

    def build_layer(self, u: _Sym):
        """The layers computing ``u`` from its stream: ``([layer], D)`` or, when the
        multilinear part reads the stream only through ``u``'s own affine part (an embedding
        followed by a residual block), ``([Linear, Residual(...)], D)``."""
        from .layers import Linear

        lin, bils, atts = None, [], []
        for k, M in u.terms.items():
            core = self.cores[k]
            Mp = self.per_position(M, u.shape, u.pos)
            if core.kind == "lin":
                lin = Mp
            elif core.kind == "bil":
                bils.append((core.data, Mp))
            else:
                atts.append((core.data, Mp))
        D = self.per_position(next(iter(u.terms.values())), u.shape, u.pos).shape[0]
        d = self.streams[u.stream]["d"]
        if lin is None:
            lin = np.zeros((D, d + 1))
        if bils and atts:
            raise self.fail("an attention layer and a bilinear MLP summed in one value (a "
                            "parallel block): tensoralg layers compose in sequence only")
        tol = _TOL * max(1.0, np.abs(lin).max())
        W = lin[:, 1:]
        plain = (d == D and np.allclose(W, np.eye(d), rtol=0, atol=tol)) or \
            np.allclose(W, 0, rtol=0, atol=tol)
        # an embedding (D < d) or an attention layer (which cannot absorb the affine part)
        if (atts or (bils and d > D)) and not plain:
            fac = self.factor_through(lin, bils, atts)
            if fac is not None:
                b = lin[:, 0]
                first = Linear(W, None if np.allclose(b, 0, rtol=0, atol=tol) else b)
                ident = np.concatenate([np.zeros((D, 1)), np.eye(D)], axis=1)
                return [first, self.layer_from(ident, *fac, D, D)], D
        return [self.layer_from(lin, bils, atts, D, d)], D

    def factor_through(self, lin, bils, atts):
        """Rewrite every factor ``X`` (rows over the lifted stream) as ``X' [e0; lin]`` when it
        lies in that row space; None otherwise."""
        lift = np.concatenate([np.eye(1, lin.shape[1]), lin])
        P = np.linalg.pinv(lift)

        def f(X):
            Y = X @ P
            if not np.allclose(Y @ lift, X, rtol=0, atol=1e-12 * max(1.0, np.abs(X).max())):
                raise LookupError
            return Y

        try:
            nb = [({"L": f(dat["L"]), "R": f(dat["R"])}, Mp) for dat, Mp in bils]
            na = [({"factors": [(f(Q), f(K)) for Q, K in dat["factors"]], "C": dat["C"],
                    "V": f(dat["V"])}, Mp) for dat, Mp in atts]
        except LookupError:
            return None
        return nb, na

    def layer_from(self, lin, bils, atts, D, d):
        from .layers import Bilinear, Linear, Residual

        F = d + 1
        bias, W = lin[:, 0], lin[:, 1:]
        tol = _TOL * max(1.0, np.abs(lin).max())
        is_id = d == D and np.allclose(W, np.eye(d), rtol=0, atol=tol)
        is_zero = np.allclose(W, 0, rtol=0, atol=tol)
        b = None if np.allclose(bias, 0, rtol=0, atol=tol) else bias
        if not bils and not atts:
            return Linear(W, b)
        if bils:
            L = np.concatenate([dat["L"] for dat, _ in bils])
            R = np.concatenate([dat["R"] for dat, _ in bils])
            Dn = np.concatenate([Mp for _, Mp in bils], axis=1)
            if not is_id and not is_zero:   # affine part as hidden units (a . x~)(e0 . x~)
                e0 = np.zeros((D, F))
                e0[:, 0] = 1.0
                L, R = np.concatenate([L, lin]), np.concatenate([R, e0])
                Dn = np.concatenate([Dn, np.eye(D)], axis=1)
                b = None
            lb = None if not np.any(L[:, 0]) else L[:, 0]
            rb = None if not np.any(R[:, 0]) else R[:, 0]
            layer = Bilinear(L[:, 1:], R[:, 1:], Dn, lb, rb, b)
            return Residual(layer) if is_id else layer
        att = self.attention_layer(atts, b)
        if is_id:
            return Residual(att)
        if is_zero:
            return att
        raise self.fail("an attention output added to an affine map other than the identity (a "
                        "residual connection) is not expressible")

    # -- attention ------------------------------------------------------------------------
    def attention_layer(self, atts, o_bias):
        from .layers import BilinearAttention

        parts = []
        for dat, Mp in atts:
            parts.append(self.attention_params(dat, Mp))
        ref = parts[0]

        def same_maps(a, b):
            if a is None or b is None:
                return a is None and b is None
            return a.shape == b.shape and np.allclose(a, b, rtol=0, atol=_TOL * max(
                1.0, np.abs(b).max()))

        for p in parts[1:]:
            if p["rope"] != ref["rope"] or not same_maps(p["position_maps"],
                                                         ref["position_maps"]) or \
                    not np.allclose(p["mask"], ref["mask"], rtol=1e-12, atol=0):
                raise self.fail("attention heads with different masks, rotary bases or "
                                "position maps cannot form one attention layer")
            if p["q1"].shape[1] != ref["q1"].shape[1] or p["v"].shape[1] != ref["v"].shape[1]:
                raise self.fail("attention heads of different sizes in one layer")
            p["o"] = p["o"] * (p["scale"] / ref["scale"])
        kw = {k: np.concatenate([p[k] for p in parts], axis=1 if k == "o" else 0)
              for k in ("q1", "k1", "q2", "k2", "v", "o", "q1_bias", "k1_bias", "q2_bias",
                        "k2_bias", "v_bias")}
        for k in ("q1_bias", "k1_bias", "q2_bias", "k2_bias", "v_bias"):
            if not np.any(kw[k]):
                kw[k] = None
        layer = BilinearAttention(**kw, o_bias=o_bias, mask=ref["mask"], scale=ref["scale"],
                                  rope=ref["rope"], position_maps=ref["position_maps"])
        n = layer.n_ctx
        layer._n_ctx_note = (f"; the network was compiled by ta.from_torch at n_ctx={n} (the "
                             f"example inputs' length) and is fixed there: to use another n_ctx, "
                             f"compile again with example inputs of that length (ta.from_torch; "
                             f"the --input-shape of tensoralg import)")
        return layer

    def attention_params(self, dat, Mp):
        (Q1, K1), (Q2, K2) = dat["factors"]
        E = max(Q1.shape[2], Q2.shape[2])

        def pad(A):
            return np.concatenate([A, np.zeros(A.shape[:2] + (E - A.shape[2],) + A.shape[3:])],
                                  axis=2) if A.shape[2] < E else A

        W = np.stack([pad(Q1), pad(K1), pad(Q2), pad(K2)])      # (4, H, T, E, F)
        H, T = W.shape[1], W.shape[2]
        X = np.moveaxis(W, 3, 0).reshape(E, 4, H, T, -1)         # (E, 4, H, T, F)
        X = np.moveaxis(X, 3, 0).reshape(T, E, -1)               # (T, E, 4 H F)
        scale_x = max(1.0, np.abs(X).max())
        rope = maps = None
        X0 = X[0]
        if not np.allclose(X, X[:1], rtol=0, atol=_TOL * scale_x):
            fit = self.fit_rope(X)
            if fit is not None:     # an exact rotary embedding: rope=base
                rope, perm = fit
                X0 = X[0, perm]
            else:                   # any other map per position: position_maps
                maps, X0 = self.fit_position_maps(X)
        X0 = X0.reshape(E, 4, H, -1)
        q1, k1, q2, k2 = (np.moveaxis(X0[:, i], 0, 1) for i in range(4))   # (H, E, F)
        C, V = dat["C"], dat["V"].copy()
        c0 = C[0]
        n0 = float(np.sum(c0 * c0))
        if n0 == 0:
            raise self.fail("an attention pattern that is identically zero")
        for h in range(H):
            a = float(np.sum(C[h] * c0)) / n0
            if not np.allclose(C[h], a * c0, rtol=0, atol=_TOL * max(1.0, np.abs(C).max())):
                raise self.fail("attention heads whose masks are not multiples of one mask")
            V[h] *= a
        nz = c0[c0 != 0]
        if np.allclose(nz, nz[0], rtol=1e-14, atol=0):
            mask, scale = (c0 != 0).astype(np.float64), float(nz[0])
        else:
            mask, scale = c0, 1.0
        dv = V.shape[1]
        o = Mp.reshape(Mp.shape[0], H, dv)
        return {"q1": q1[:, :, 1:], "k1": k1[:, :, 1:], "q2": q2[:, :, 1:], "k2": k2[:, :, 1:],
                "q1_bias": q1[:, :, 0], "k1_bias": k1[:, :, 0], "q2_bias": q2[:, :, 0],
                "k2_bias": k2[:, :, 0], "v": V[:, :, 1:], "v_bias": V[:, :, 0], "o": o,
                "mask": mask, "scale": scale, "rope": rope, "position_maps": maps}

    def fit_rope(self, X):
        """Rotary base and head-coordinate permutation with ``X[t] = R_t X[0]`` (R_t of
        `rope_rotations`, in permuted coordinates, to 1e-10); None when ``X`` is no exact
        rotary embedding (a float32 table, another map: `fit_position_maps`)."""
        from .layers import rope_rotations

        T, E = X.shape[0], X.shape[1]
        if E % 2 or T < 2:
            return None
        R1 = X[1] @ np.linalg.pinv(X[0])
        pairs, used = [], set()
        for a in range(E):
            if a in used:
                continue
            off = np.abs(R1[a]).copy()
            off[a] = -1
            b = int(np.argmax(off))
            if b in used:
                return None
            used |= {a, b}
            first, second = (a, b) if R1[b, a] > 0 else (b, a)
            theta = math.atan2(R1[second, first], R1[first, first])
            pairs.append((theta, first, second))
        pairs.sort(key=lambda p: -p[0])
        if not abs(pairs[0][0] - 1.0) < 1e-9 or (E > 2 and not pairs[1][0] > 0):
            return None
        base = 10000.0 if E == 2 else pairs[1][0] ** (-E / 2)
        perm = [i for _, f, s in pairs for i in (f, s)]
        Rt = rope_rotations(T, E, base)
        Xp = X[:, perm]
        err = np.abs(np.einsum("tef,tfk->tek", Rt, np.broadcast_to(Xp[:1], Xp.shape)) - Xp).max()
        if not err <= 1e-10 * max(1.0, np.abs(X).max()):
            return None
        return base, perm

    def fit_position_maps(self, X):
        """Maps ``R_t`` (``(T, E, E)``) and position-free rows ``W`` (``(E, 4 H F)``) with
        ``X[t] = R_t W`` for every position ``t`` (to 1e-10 relative): one linear map per
        position applied to every query and key of every head alike (a float32 rotary table, a
        learned per-position map; docs/mathematics.md §3.7). ``W = X[0]`` (so ``R_0 = I``)
        when ``X[0]`` spans the rows of every ``X[t]``; else ``W`` is an orthonormal basis of
        their common row space (of dimension at most ``E``). Refuses anything else."""
        T, E, F = X.shape
        tol = 1e-10 * max(1.0, np.abs(X).max())
        why = ("queries/keys whose linear maps depend on the position in a way that is not one "
               "linear map per position applied to every query and key alike (R_t q_t, R_s k_s)")

        def maps_for(W):
            R = np.einsum("tef,fk->tek", X, np.linalg.pinv(W))
            err = np.abs(np.einsum("tek,kf->tef", R, W) - X).max()
            return R if err <= tol else None

        R = maps_for(X[0])
        if R is not None:
            return R, X[0]
        sv, Vt = np.linalg.svd(X.reshape(T * E, F), full_matrices=False)[1:]
        r = int(np.sum(sv > 1e-12 * sv[0]))
        if r > E:
            raise self.fail(f"{why}: across positions they span {r} > d_head = {E} directions")
        W = np.zeros((E, F))
        W[:r] = Vt[:r]
        R = maps_for(W)
        if R is None:
            raise self.fail(why)
        return R, W


# ----------------------------------------------------------------------------------------
# linear algebra on symbolic values
# ----------------------------------------------------------------------------------------

def _map_terms(v: _Sym, fn) -> tuple[dict, dict]:
    return {k: fn(M) for k, M in v.terms.items()}, {k: fn(G) for k, G in v.chain.items()}


def _letters(n, skip=""):
    pool = [c for c in string.ascii_letters if c not in skip]
    return pool[:n]


class _Walker(_Compiler):
    """The graph walk: ``eval`` gives each node its value (constant tensor, _Sym, _Pattern)."""

    # -- add / scale --------------------------------------------------------------------------
    def scale(self, v, c: float):
        if isinstance(v, _Pattern):
            return _Pattern(v.shape, v.labels, v.head_sizes, v.factors, v.C * c, v.stream)
        terms, chain = _map_terms(v, lambda M: M * c)
        return self.register(_Sym(v.shape, v.pos, v.stream, terms, chain, v.hidden))

    def add(self, a, b, alpha: float = 1.0):
        import torch

        if not _is_sym(a) and not _is_sym(b):
            return torch.add(a, b, alpha=alpha)
        if not _is_sym(a) or not _is_sym(b):
            zero = b if _is_sym(a) else a
            if not np.any(_np(zero)):     # x + 0 (e.g. a where() branch of zeros)
                v = a if _is_sym(a) else self.scale(b, alpha)
                shape = tuple(np.broadcast_shapes(v.shape, np.shape(_np(zero))))
                if isinstance(v, _Pattern):
                    if v.shape != shape:
                        raise self.fail("broadcasts an attention pattern")
                    return v
                return self.broadcast(v, shape)
        if isinstance(a, _Pattern) or isinstance(b, _Pattern):
            raise self.fail("adds to an attention score or pattern: the pattern of bilinear "
                            "attention is a product of two score forms times a constant mask")
        if not _is_sym(a) or not _is_sym(b):
            if _is_sym(a):
                v, c = a, _np(b) * alpha
            else:
                v, c = self.scale(b, alpha), _np(a)
            shape = np.broadcast_shapes(v.shape, np.shape(c))
            v = self.broadcast(v, shape)
            c = np.broadcast_to(c, shape)
            if not np.allclose(c, c[:1], rtol=0, atol=0):
                raise self.fail("adds a constant that differs between batch entries")

            def addc(M):
                M = M.copy()
                M[..., 0] += c[0]
                return M

            terms = dict(v.terms)
            lin = self.streams[v.stream]["lin"]
            F = self.streams[v.stream]["d"] + 1
            terms[lin] = addc(terms.get(lin, np.zeros(tuple(v.shape[1:]) + (F,))))
            chain = {k: addc(G) for k, G in v.chain.items()}
            return self.register(_Sym(v.shape, v.pos, v.stream, terms, chain, v.hidden))
        a, b = self.align([a, self.scale(b, alpha) if alpha != 1 else b])
        shape = tuple(np.broadcast_shapes(a.shape, b.shape))
        a, b = self.broadcast(a, shape), self.broadcast(b, shape)
        if a.pos != b.pos:
            raise self.fail("adds values whose position axes differ")
        terms = dict(a.terms)
        for k, M in b.terms.items():
            terms[k] = terms[k] + M if k in terms else M
        chain = {k: a.chain[k] + b.chain[k] for k in a.chain if k in b.chain}
        v = _Sym(shape, a.pos, a.stream, terms, chain, a.hidden and b.hidden)
        return self.register(v, own=v.nonlin(self.cores) and not v.hidden)

    # -- data movement (index tensors) ----------------------------------------------------------
    def move(self, fn, args, kwargs):
        """Apply a rearranging operator by running it on index tensors."""
        import torch

        syms, offs, flat = [], [], [0]

        def sub(a):
            if isinstance(a, _Tokens):
                raise self.fail("rearranges the token ids; use them only in an embedding lookup")
            if isinstance(a, _Pattern):
                raise self.fail("rearranges an attention pattern other than by transposition")
            if isinstance(a, _Sym):
                n = int(np.prod(a.shape))
                idx = torch.arange(flat[-1], flat[-1] + n, dtype=torch.int64).reshape(a.shape)
                syms.append(a)
                offs.append(flat[-1])
                flat.append(flat[-1] + n)
                return idx
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        vals = [a for a in _flat_args(args) if isinstance(a, _Sym)]
        if getattr(fn, "__name__", "").split(".")[0] in ("cat", "concat", "stack") and \
                any(isinstance(a, torch.Tensor) for a in _flat_args(args)) and vals:
            # constants mixed with symbolic values (e.g. cat with a constant): make them symbolic
            stream = max(v.stream for v in vals)
            args = _replace(args, lambda a: self.const_sym(_np(a), tuple(a.shape) if a.ndim and
                                                            a.shape[0] == self.B else
                                                            (self.B,) + tuple(a.shape),
                                                            vals[0].pos, stream)
                            if isinstance(a, torch.Tensor) else a)
        args = list(args)
        args[:] = _replace(args, lambda a: self.rebase(a, max(v.stream for v in vals))
                           if isinstance(a, _Sym) else a)
        idx_args = sub(tuple(args))
        out = fn(*idx_args, **kwargs)
        if isinstance(out, torch.Tensor):
            return self._gathered(out, syms, offs)
        return [self._gathered(o, syms, offs) for o in out]

    def _gathered(self, out, syms, offs):
        src = out.numpy().astype(np.int64)
        shape = tuple(out.shape)
        which = np.searchsorted(np.array(offs), src, side="right") - 1
        if len(shape) == 0 or shape[0] != self.B:
            fold = " (heads folded into the batch, a (batch * heads, T, d_head) layout?)" \
                if shape and shape[0] % self.B == 0 and shape[0] > self.B else ""
            raise self.fail(f"moves the batch axis (result of shape {shape}; the batch of "
                            f"{self.B} must stay at axis 0){fold}")
        coords = np.indices(shape)
        loc = src - np.array(offs)[which]
        pos_axis = None
        for i, s in enumerate(syms):
            sel = which == i
            if not sel.any():
                continue
            sc = np.unravel_index(loc[sel], s.shape)
            if not np.array_equal(sc[0], coords[0][sel]):
                raise self.fail("folds the batch axis into another axis (e.g. heads into the "
                                "batch, a (batch * heads, T, d_head) layout): keep the batch "
                                "axis separate, e.g. (batch, heads, T, d_head)")
            if s.pos is not None:
                cand = [ax for ax in range(1, len(shape)) if np.array_equal(sc[s.pos],
                                                                           coords[ax][sel])
                        and shape[ax] == s.shape[s.pos]]
                if pos_axis is not None:
                    cand = [ax for ax in cand if ax == pos_axis]
                if not cand:
                    raise self.fail(f"selects positions or mixes them with other axes (result "
                                    f"of shape {shape}): a compiled network keeps every "
                                    f"position and acts on each alike (select after it)")
                pos_axis = cand[0] if pos_axis is None or len(cand) == 1 else pos_axis
        if any(s.pos is not None for s in syms) and pos_axis is None:
            raise self.fail("selects or merges positions (e.g. the last token's output): a "
                            "compiled network keeps every position; select after it (the API's "
                            "position=t)")
        # per-sample gather of every linear map
        first = src[0].reshape(-1)
        w0 = which[0].reshape(-1)
        per = [int(np.prod(s.shape[1:])) for s in syms]
        lloc = loc[0].reshape(-1)
        keys = set().union(*(s.terms for s in syms))
        chains = set.intersection(*(set(s.chain) for s in syms))
        out_terms, out_chain = {}, {}

        def gather(get, K):
            stacked = [get(s).reshape(-1, K) if get(s) is not None else np.zeros((n, K))
                       for s, n in zip(syms, per)]
            res = np.empty((first.size, K))
            for i, _s in enumerate(syms):
                sel = w0 == i
                res[sel] = stacked[i][lloc[sel] % per[i]]
            return res.reshape(shape[1:] + (K,))

        for k in keys:
            K = self.cores[k].size
            out_terms[k] = gather(lambda s, k=k: s.terms.get(k), K)
        for k in chains:
            K = syms[0].chain[k].shape[-1]
            out_chain[k] = gather(lambda s, k=k: s.chain[k], K)
        v = _Sym(shape, pos_axis, syms[0].stream, out_terms, out_chain,
                 all(s.hidden for s in syms))
        return self.register(v)

    def broadcast(self, v: _Sym, shape):

        shape = tuple(shape)
        if v.shape == shape:
            return v
        if len(shape) != len(v.shape):
            raise self.fail(f"broadcasts a value of shape {v.shape} to {shape} (adds a leading "
                            f"axis before the batch)")
        return self.move(lambda a: a.expand(shape), (v,), {})

    # -- einsum ---------------------------------------------------------------------------------
    def einsum(self, eq: str, ops: list):

        eq = eq.replace(" ", "")
        lhs, out = eq.split("->") if "->" in eq else (eq, None)
        ins = lhs.split(",")
        if any("..." in s for s in ins):
            ins, out = _expand_ellipsis(ins, out, [len(_shape(o)) for o in ops])
        if out is None:
            counts = {}
            for s in ins:
                for c in s:
                    counts[c] = counts.get(c, 0) + 1
            out = "".join(sorted(c for c, n in counts.items() if n == 1))
        while len(ops) > 2:   # contract left to right, keeping letters still needed
            rest = "".join(ins[2:]) + out
            keep = "".join(dict.fromkeys(c for c in ins[0] + ins[1] if c in rest))
            ops = [self.einsum2(ins[0], ins[1], keep, ops[0], ops[1])] + ops[2:]
            ins = [keep] + ins[2:]
        if len(ops) == 1:
            return self.einsum1(ins[0], out, ops[0])
        return self.einsum2(ins[0], ins[1], out, ops[0], ops[1])

    def einsum1(self, a_l, out, a):
        import torch

        if not _is_sym(a):
            return torch.einsum(f"{a_l}->{out}", a)
        ones = torch.ones((), dtype=torch.float64)
        return self.einsum2(a_l, "", out, a, ones)

    def einsum2(self, al, bl, out, a, b):
        import torch

        if not _is_sym(a) and not _is_sym(b):
            return torch.einsum(f"{al},{bl}->{out}", a, b)
        if isinstance(a, _Tokens) or isinstance(b, _Tokens):
            raise self.fail("uses the token ids other than in an embedding lookup")
        if not _is_sym(a):
            a, b, al, bl = b, a, bl, al
        if not _is_sym(b):
            return self.sym_const(al, bl, out, a, _np(b))
        if isinstance(a, _Pattern) and isinstance(b, _Pattern):
            return self.pattern_pattern(al, bl, out, a, b)
        if isinstance(b, _Pattern):
            a, b, al, bl = b, a, bl, al
        if isinstance(a, _Pattern):
            return self.pattern_value(al, bl, out, a, b)
        return self.sym_sym(al, bl, out, a, b)

    def sym_const(self, al, cl, out, a, c):
        if isinstance(a, _Pattern):
            return self.pattern_const(al, cl, out, a, c)
        bl_ = al[0]
        if out[:1] != bl_:
            raise self.fail("sums over or moves the batch axis")
        if bl_ in cl:   # a constant with a batch axis: must not depend on it
            i = cl.index(bl_)
            if not np.allclose(c, np.take(c, [0], axis=i), rtol=0, atol=0):
                raise self.fail("multiplies by a constant that differs between batch entries")
            c = np.take(c, 0, axis=i)
            cl = cl.replace(bl_, "")
        if a.pos is not None:
            p = al[a.pos]
            if p not in out:
                raise self.fail("sums over positions: tensoralg layers act on every position "
                                "alike (pool after the network instead)")
            if p in cl and c.shape[cl.index(p)] != a.shape[a.pos]:
                raise self.fail("broadcasts a constant along the position axis")
            pos = out.index(p)
        else:
            pos = None
        z = next(ch for ch in string.ascii_letters if ch not in al + cl + out)
        spec = f"{al[1:]}{z},{cl}->{out[1:]}{z}"
        terms, chain = _map_terms(a, lambda M: np.einsum(spec, M, c))
        shape = tuple(a.shape[al.index(ch)] if ch in al else c.shape[cl.index(ch)] for ch in out)
        v = _Sym(shape, pos, a.stream, terms, chain, hidden=a.hidden)
        own = a.hidden and v.nonlin(self.cores)
        v.hidden = False if own else a.hidden
        return self.register(v, own=own)

    def sym_sym(self, al, bl, out, a, b):
        a, b = self.affine([a, b])
        if al[0] != bl[0] or out[:1] != al[0]:
            raise self.fail("a product across batch entries")
        lin = self.streams[a.stream]["lin"]
        Ma, Mb = a.terms.get(lin), b.terms.get(lin)
        F = self.cores[lin].size
        if Ma is None:
            Ma = np.zeros(tuple(a.shape[1:]) + (F,))
        if Mb is None:
            Mb = np.zeros(tuple(b.shape[1:]) + (F,))
        pa = None if a.pos is None else al[a.pos]
        pb = None if b.pos is None else bl[b.pos]
        if pa is not None and pa != pb:
            return self.scores(al, bl, out, a, b, Ma, Mb, pa, pb)
        if pa is not None and pa not in out:
            raise self.fail("sums a product over positions")
        size = {ch: a.shape[i] for i, ch in enumerate(al)}
        size.update({ch: b.shape[i] for i, ch in enumerate(bl)})
        # hidden units: every assignment of the letters other than batch and position
        hl = "".join(dict.fromkeys(ch for ch in al[1:] + bl[1:] if ch != pa))
        A0 = self.at_pos0(Ma, al[1:], pa)
        B0 = self.at_pos0(Mb, bl[1:], pa)
        z = next(ch for ch in string.ascii_letters if ch not in hl + al + bl)
        ones = np.ones([size[ch] for ch in hl])
        L = np.einsum(f"{''.join(c for c in al[1:] if c != pa)}{z},{hl}->{hl}{z}", A0, ones)
        R = np.einsum(f"{''.join(c for c in bl[1:] if c != pa)}{z},{hl}->{hl}{z}", B0, ones)
        H = int(np.prod([size[ch] for ch in hl])) if hl else 1
        core = _Core("bil", a.stream, H, L=L.reshape(H, F), R=R.reshape(H, F))
        self.cores[core.id] = core
        M = _indicator([size[ch] for ch in out[1:]], out[1:], hl, size, pa)
        shape = tuple(size[ch] for ch in out)
        v = _Sym(shape, None if pa is None else out.index(pa), a.stream, {core.id: M},
                 hidden=True)
        return self.register(v, own=True)

    def at_pos0(self, M, letters, p):
        """``M`` (letters + F) at position 0, checking it does not depend on the position."""
        if p is None or p not in letters:
            return M
        i = letters.index(p)
        M0 = np.take(M, [0], axis=i)
        if not np.allclose(M, M0, rtol=0, atol=_TOL * max(1.0, np.abs(M).max())):
            raise self.fail("a product of factors whose affine maps depend on the position (a "
                            "learned positional embedding or bias, or rotary embeddings outside "
                            "a query-key score): tensoralg layers act on every position alike")
        return np.take(M, 0, axis=i)

    def scores(self, al, bl, out, a, b, Ma, Mb, pa, pb):
        if pa not in out or pb not in out:
            raise self.fail("contracts a position axis of a query-key product")
        heads = [ch for ch in out[1:] if ch not in (pa, pb)]
        for ch in heads:
            if ch not in al or ch not in bl:
                raise self.fail("an outer product of queries and keys (an output axis that "
                                "is not a shared head axis)")
        feat = [ch for ch in al[1:] if ch not in out]
        if any(ch not in bl for ch in feat) or any(ch not in al and ch not in out
                                                    for ch in bl[1:]):
            raise self.fail("a query-key product whose contracted axes do not match")
        F = Ma.shape[-1]
        size = {ch: a.shape[i] for i, ch in enumerate(al)}
        size.update({ch: b.shape[i] for i, ch in enumerate(bl)})
        hs = [size[ch] for ch in heads]
        H = int(np.prod(hs)) if hs else 1
        E = int(np.prod([size[c] for c in feat])) if feat else 1
        T = size[pa]
        z = "Z" if "Z" not in al + bl else "Y"
        Q = np.einsum(f"{al[1:]}{z}->{''.join(heads)}{pa}{''.join(feat)}{z}", Ma)
        K = np.einsum(f"{bl[1:]}{z}->{''.join(heads)}{pb}{''.join(feat)}{z}", Mb)
        Q, K = Q.reshape(H, T, E, F), K.reshape(H, T, E, F)
        labels = ["b"] + [("h", heads.index(ch)) if ch in heads else ("t" if ch == pa else "s")
                          for ch in out[1:]]
        shape = tuple([self.B] + [size[ch] for ch in out[1:]])
        return _Pattern(shape, labels, hs, [(Q, K)], np.ones((H, T, T)), a.stream)

    def _canon(self, letters, p: _Pattern):
        """Letters of ``p``'s axes -> (head letters in order, t letter, s letter)."""
        heads = [None] * len(p.head_sizes)
        t = s = None
        for ch, lab in zip(letters, p.labels):
            if lab == "t":
                t = ch
            elif lab == "s":
                s = ch
            elif lab != "b":
                heads[lab[1]] = ch
        return heads, t, s

    def pattern_const(self, pl, cl, out, p, c):
        if sorted(out) != sorted(pl) or any(ch not in pl for ch in cl):
            raise self.fail("a linear map of an attention pattern other than a constant mask "
                            "or scale")
        heads, t, s = self._canon(pl, p)
        full = np.einsum(f"{cl}->{cl}", c) if cl else c
        tgt = "".join(heads) + t + s
        bpl = pl[0]
        if bpl in cl:
            i = cl.index(bpl)
            if not np.allclose(full, np.take(full, [0], axis=i), rtol=0, atol=0):
                raise self.fail("a mask that differs between batch entries")
            full, cl = np.take(full, 0, axis=i), cl.replace(bpl, "")
        sizes = dict(zip(pl, p.shape))
        ones = np.ones([sizes[ch] for ch in tgt])
        cc = np.einsum(f"{cl},{tgt}->{tgt}", full, ones).reshape(p.C.shape)
        labels = [p.labels[pl.index(ch)] for ch in out]
        shape = tuple(p.shape[pl.index(ch)] for ch in out)
        return _Pattern(shape, labels, p.head_sizes, p.factors, p.C * cc, p.stream)

    def pattern_pattern(self, al, bl, out, a, b):
        if not (sorted(al) == sorted(bl) == sorted(out)):
            raise self.fail("a product of attention patterns other than elementwise")
        ha, ta, sa = self._canon(al, a)
        hb, tb, sb = self._canon(bl, b)
        if (ha, ta, sa) != (hb, tb, sb) or a.stream != b.stream:
            raise self.fail("an elementwise product of two score forms laid out differently")
        if len(a.factors) + len(b.factors) > 2:
            raise self.fail("a pattern with more than two score factors: bilinear attention "
                            "multiplies exactly two query-key products")
        labels = [a.labels[al.index(ch)] for ch in out]
        shape = tuple(a.shape[al.index(ch)] for ch in out)
        return _Pattern(shape, labels, a.head_sizes, a.factors + b.factors, a.C * b.C, a.stream)

    def pattern_value(self, pl, vl, out, p, v):
        if v.stream < p.stream:
            v = self.rebase(v, p.stream)
        if v.stream != p.stream or v.nonlin(self.cores):
            raise self.fail("applies an attention pattern to values that are not an affine "
                            "map of the pattern's input")
        heads, t, s = self._canon(pl, p)
        pv = vl[v.pos] if v.pos is not None else None
        if pv != s or s in out or t not in out:
            raise self.fail("an attention pattern must be contracted over key positions with "
                            "the values' positions and keep query positions")
        val = [ch for ch in vl[1:] if ch != s and ch not in heads]
        if any(ch not in out for ch in val) or any(ch not in pl + vl for ch in out):
            raise self.fail("attention values summed over their features")
        lin = self.streams[v.stream]["lin"]
        F = self.cores[lin].size
        Mv = v.terms.get(lin, np.zeros(tuple(v.shape[1:]) + (F,)))
        Mv0 = self.at_pos0(Mv, vl[1:], s)
        size = dict(zip(vl, v.shape))
        size.update(dict(zip(pl, p.shape)))
        z = "Z" if "Z" not in pl + vl else "Y"
        ones = np.ones([size[ch] for ch in heads])
        V = np.einsum(f"{''.join(c for c in vl[1:] if c != s)}{z},{''.join(heads)}->"
                      f"{''.join(heads)}{''.join(val)}{z}", Mv0, ones)
        H = int(np.prod(p.head_sizes)) if p.head_sizes else 1
        dv = int(np.prod([size[ch] for ch in val])) if val else 1
        V = V.reshape(H, dv, F)
        factors = list(p.factors)
        if len(factors) == 1:   # one score form: the second is the constant 1 (biases)
            T = p.C.shape[1]
            one = np.zeros((H, T, 1, F))
            one[..., 0] = 1.0
            factors.append((one, one.copy()))
        core = _Core("att", p.stream, H * dv, factors=factors, C=p.C, V=V)
        self.cores[core.id] = core
        hl = "".join(heads) + "".join(val)
        M = _indicator([size[ch] for ch in out[1:]], out[1:], hl, size, t)
        shape = tuple([self.B] + [size[ch] for ch in out[1:]])
        w = _Sym(shape, out.index(t), p.stream, {core.id: M}, hidden=True)
        return self.register(w, own=True)


def _indicator(out_sizes, out_letters, hl, size, pos):
    """``M[out..., h] = 1`` where hidden unit ``h`` (an assignment of ``hl``) agrees with the output
    entry on every output letter (the position letter is broadcast)."""
    H = int(np.prod([size[c] for c in hl])) if hl else 1
    hidx = np.indices([size[c] for c in hl]).reshape(len(hl), -1) if hl else np.zeros((0, 1), int)
    okeys = [c for c in out_letters if c != pos]
    M = np.zeros([size[c] for c in okeys] + [H])
    coords = tuple(hidx[hl.index(c)] for c in okeys)
    if any(c not in hl for c in okeys):
        raise ValueError("internal: output letter not in hidden letters")
    M[coords + (np.arange(H),)] = 1.0
    if pos is not None and pos in out_letters:
        i = out_letters.index(pos)
        M = np.expand_dims(M, i)
        M = np.broadcast_to(M, M.shape[:i] + (size[pos],) + M.shape[i + 1:]).copy()
    return M


def _expand_ellipsis(ins, out, ndims):
    used = set("".join(ins) + (out or "")) - {"."}
    spare = [c for c in string.ascii_letters if c not in used]
    n = max(nd - (len(s) - 3) for s, nd in zip(ins, ndims) if "..." in s)
    ell = "".join(spare[:n])
    new = []
    for s, nd in zip(ins, ndims):
        if "..." in s:
            k = nd - (len(s) - 3)
            s = s.replace("...", ell[n - k:])
        new.append(s)
    if out is not None:
        out = out.replace("...", ell)
    else:
        counts = {}
        for s in new:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return new, out


def _np(x) -> np.ndarray:
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else ()


def _flat_args(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat_args(a)
        else:
            yield a


def _replace(args, fn):
    if isinstance(args, (list, tuple)):
        return type(args)(_replace(a, fn) for a in args)
    return fn(args)


# ----------------------------------------------------------------------------------------
# the node dispatcher
# ----------------------------------------------------------------------------------------

_PATTERN_MOVES = {"permute", "transpose", "t", "clone", "contiguous", "alias", "detach",
                  "expand", "view", "reshape", "_unsafe_view", "lift_fresh_copy"}


class _Graph(_Walker):

    def value_of(self, node, env):
        return _replace(node.args, lambda a: env[a] if hasattr(a, "op") and hasattr(a, "meta")
                        else a), {k: _replace(v, lambda a: env[a] if hasattr(a, "op") and
                                              hasattr(a, "meta") else a)
                                  for k, v in node.kwargs.items()}

    def call(self, node, args, kwargs):

        self.node = node
        name = _opname(node)
        flat = list(_flat_args(list(args) + list(kwargs.values())))
        if node.target is operator.getitem:
            return args[0][args[1]]
        if not any(_is_sym(a) for a in flat):
            return node.target(*args, **kwargs)
        if name in _CONSTANT_LIKE:   # zeros_like(x), x.new_full(shape, v), ...: a constant
            return self.constant_like(name, args)
        if isinstance(args[0], _Pattern) and name in _PATTERN_MOVES:
            return self.pattern_move(node.target, args, kwargs)
        if name in _MOVE:
            return self.move(node.target, args, kwargs)
        h = getattr(self, "op_" + name.lstrip("_"), None)
        if h is None:
            if name in NON_POLYNOMIAL_OPS:
                raise self.fail("is not polynomial; tensoralg compiles polynomial networks "
                                "(linear maps, bilinear products, bilinear attention)")
            raise self.fail("is not supported by from_torch (not a polynomial operation, or one "
                            f"it does not know; supported: {', '.join(SUPPORTED_OPS)})")
        return h(*args, **kwargs)

    def constant_like(self, name, args):
        """``zeros_like``, ``ones_like``, ``full_like``, ``new_zeros``, ``new_ones``,
        ``new_full`` of an activation: a constant of the output's shape (the traced value's);
        only the shape of the activation is read, never its values."""
        import torch

        val = self.node.meta.get("val")
        fill = _CONSTANT_LIKE[name]
        if not isinstance(fill, float):
            fill = args[fill]
            if _is_sym(fill):
                raise self.fail("a fill value that depends on the input")
            fill = float(_np(fill)) if not isinstance(fill, (int, float)) else float(fill)
        if val is None or not hasattr(val, "shape"):
            raise self.fail("a constant whose shape the traced graph does not record")
        return torch.full(tuple(val.shape), fill, dtype=torch.float64)

    # -- patterns ------------------------------------------------------------------------
    def pattern_move(self, fn, args, kwargs):
        import torch

        p = args[0]
        idx = torch.arange(int(np.prod(p.shape))).reshape(p.shape)
        out = fn(idx, *args[1:], **kwargs)
        if not isinstance(out, torch.Tensor) or out.ndim != len(p.shape):
            raise self.fail("reshapes an attention pattern (only transpositions are supported)")
        src = np.unravel_index(out.numpy().reshape(-1), p.shape)
        coords = np.indices(out.shape).reshape(out.ndim, -1)
        labels = []
        for ax in range(out.ndim):
            m = [j for j in range(len(p.shape)) if np.array_equal(src[j], coords[ax])]
            if not m:
                raise self.fail("reshapes an attention pattern (only transpositions)")
            labels.append(p.labels[m[0]])
        if labels[0] != "b":
            raise self.fail("moves the batch axis of an attention pattern")
        return _Pattern(tuple(out.shape), labels, p.head_sizes, p.factors, p.C, p.stream)

    # -- arithmetic ----------------------------------------------------------------------
    def op_add(self, a, b, alpha=1):
        return self.add(a, b, alpha)

    def op_sub(self, a, b, alpha=1):
        return self.add(a, b, -alpha)

    def op_rsub(self, a, b, alpha=1):
        return self.add(b, a, -alpha)

    def op_neg(self, a):
        return self.scale(a, -1.0)

    def op_mul(self, a, b):
        if not _is_sym(a):
            a, b = b, a
        if isinstance(b, (int, float)) or (not _is_sym(b) and _np(b).ndim == 0):
            return self.scale(a, float(_np(b)))
        shape = tuple(np.broadcast_shapes(_shape(a), _shape(b)))
        ops = []
        for x in (a, b):
            if isinstance(x, _Sym):
                x = self.broadcast(x, shape)
            elif isinstance(x, _Pattern):
                if x.shape != shape:
                    raise self.fail("broadcasts an attention pattern")
            else:
                x = np.broadcast_to(_np(x), shape)
            ops.append(x)
        L = "".join(_letters(len(shape)))
        return self.einsum2(L, L, L, ops[0], ops[1])

    def op_div(self, a, b, rounding_mode=None):
        if rounding_mode is not None:
            raise self.fail("division with rounding is not polynomial")
        if _is_sym(b):
            raise self.fail("divides by an activation (a data-dependent denominator) — not "
                            "polynomial")
        c = _np(b)
        if np.any(c == 0):
            raise self.fail("divides by zero")
        return self.op_mul(a, 1.0 / c if c.ndim else float(1.0 / c))

    op_true_divide = op_div

    def op_square(self, a):
        return self.op_mul(a, a)

    def op_pow(self, a, e):
        if _is_sym(e) or not isinstance(e, (int, float)) or float(e) not in (1.0, 2.0):
            raise self.fail(f"a power {e!r} of an activation: only x**1 and x**2 are "
                            f"compiled (products of two factors)")
        return a if float(e) == 1.0 else self.op_mul(a, a)

    def op_lerp(self, a, b, w):
        if _is_sym(w):
            raise self.fail("lerp with an input-dependent weight is a product of three factors")
        # a + w (b - a) = (1 - w) a + w b
        if isinstance(w, (int, float)) or _np(w).ndim == 0:
            w = float(_np(w))
            return self.add(self.scale(a, 1.0 - w), self.scale(b, w))
        w = _np(w)
        return self.add(self.op_mul(a, 1.0 - w), self.op_mul(b, w))

    def op_masked_fill(self, a, mask, value):
        if _is_sym(mask) or _is_sym(value):
            raise self.fail("a mask that depends on the input")
        m = _np(mask).astype(bool)
        v = float(_np(value))
        if not np.isfinite(v):
            raise self.fail(f"masked_fill with {v} (a softmax mask): the softmax that follows "
                            f"is not polynomial")
        out = self.op_mul(a, (~m).astype(np.float64))
        return out if v == 0 else self.add(out, np.where(m, v, 0.0))

    def op_where(self, cond, a, b):
        if _is_sym(cond):
            raise self.fail("where() with an input-dependent condition is not polynomial")
        c = _np(cond).astype(np.float64)
        terms = []
        for x, w in ((a, c), (b, 1.0 - c)):
            if _is_sym(x):
                terms.append(self.op_mul(x, w))
            else:
                terms.append(_np(x) * w)
        return self.add(terms[0], terms[1])

    def op_dropout(self, a, p=0.5, train=False):
        if train and p > 0:
            raise self.fail("dropout in training mode is random, not polynomial")
        return a

    def op_to(self, a, *args, **kwargs):
        import torch

        dt = kwargs.get("dtype", next((x for x in args if isinstance(x, torch.dtype)), None))
        if dt is not None and not dt.is_floating_point:
            raise self.fail(f"casts an activation to {dt}")
        return a

    op_to_copy = op_to

    def op_type_as(self, a, b):
        return a

    def op_sum(self, a, dim=None, keepdim=False, dtype=None, _mean=False):
        if not isinstance(a, _Sym):
            raise self.fail("sums an attention pattern")
        n = len(a.shape)
        dims = list(range(n)) if dim is None or dim == [] else \
            [d % n for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
        L = "".join(_letters(n))
        out = "".join(c for i, c in enumerate(L) if i not in dims)
        cnt = float(np.prod([a.shape[d] for d in dims]))
        v = self.einsum1(L, out, a)
        if _mean:
            v = self.scale(v, 1.0 / cnt)
        if keepdim:

            shape = tuple(1 if i in dims else s for i, s in enumerate(a.shape))
            v = self.move(lambda x: x.reshape(shape), (v,), {})
        return v

    def op_mean(self, a, dim=None, keepdim=False, dtype=None):
        return self.op_sum(a, dim, keepdim, dtype, _mean=True)

    # -- linear maps and products ----------------------------------------------------------
    def op_einsum(self, eq, ops, **kwargs):
        return self.einsum(eq, list(ops))

    def op_linear(self, x, w, b=None):
        y = self.op_matmul(x, self.op_t(w) if _is_sym(w) else _np(w).T)
        return y if b is None else self.add(y, b)

    def op_t(self, w):
        import torch

        return self.move(torch.ops.aten.t.default, (w,), {})

    def op_bilinear(self, x1, x2, w, b=None):   # nn.Bilinear: y_o = x1_i W_oij x2_j + b_o
        if _is_sym(w) or _is_sym(b):
            raise self.fail("a bilinear form whose weight depends on the input")
        n = len(_shape(x1))
        lead = "".join(_letters(n - 1, "oij"))
        y = self.einsum(f"{lead}i,oij,{lead}j->{lead}o", [x1, _np(w), x2])
        return y if b is None else self.add(y, b)

    def op_batch_norm(self, x, weight, bias, mean, var, training, momentum, eps,
                      cudnn_enabled=False):
        """Eval-mode batch norm: fixed running statistics, an affine map per channel (dim 1)."""
        if training or mean is None or var is None:
            raise self.fail("batch norm in training mode (batch statistics) is not polynomial")
        if any(_is_sym(t) for t in (weight, bias, mean, var)):
            raise self.fail("batch norm statistics that depend on the input")
        C = _np(mean).shape[0]
        w = np.ones(C) if weight is None else _np(weight)
        b = np.zeros(C) if bias is None else _np(bias)
        scale = w / np.sqrt(_np(var) + float(eps))
        shape = (C,) + (1,) * (len(_shape(x)) - 2)
        y = self.op_mul(x, scale.reshape(shape))
        return self.add(y, (b - _np(mean) * scale).reshape(shape))

    def op_addmm(self, bias, a, b, beta=1, alpha=1):
        y = self.op_matmul(a, b)
        if alpha != 1:
            y = self.scale(y, alpha)
        return self.add(y, bias, beta) if beta else y

    def op_mm(self, a, b):
        return self.op_matmul(a, b)

    op_bmm = op_mm

    def op_matmul(self, a, b):

        sa, sb = _shape(a), _shape(b)
        na, nb = len(sa), len(sb)
        if na == 0 or nb == 0:
            raise self.fail("matmul of a scalar")
        if na >= 2 and nb >= 2:
            bshape = tuple(np.broadcast_shapes(sa[:-2], sb[:-2]))
            ops = []
            for x, s in ((a, sa), (b, sb)):
                if (len(s) > 2 and s[:-2] != bshape[len(bshape) - (len(s) - 2):]) or \
                        (len(s) - 2 < len(bshape) and _is_sym(x)):
                    full = bshape + s[-2:]
                    if isinstance(x, _Sym):
                        x = self.broadcast(x, full)
                    elif isinstance(x, _Pattern):
                        raise self.fail("broadcasts an attention pattern")
                    else:
                        x = np.broadcast_to(_np(x), full)
                ops.append(x)
            a, b = ops
            sa, sb = _shape(a), _shape(b)
            nbat = len(bshape)
            bl = "".join(_letters(nbat, "ijk"))
            al_ = bl[nbat - (len(sa) - 2):] + "ik"
            bl_ = bl[nbat - (len(sb) - 2):] + "kj"
            return self.einsum2(al_, bl_, bl + "ij", a, b)
        if na == 1 and nb == 1:
            return self.einsum2("k", "k", "", a, b)
        if na == 1:
            bl = "".join(_letters(nb - 2, "kj"))
            return self.einsum2("k", bl + "kj", bl + "j", a, b)
        bl = "".join(_letters(na - 2, "ik"))
        return self.einsum2(bl + "ik", "k", bl + "i", a, b)

    # -- embeddings ------------------------------------------------------------------------
    def op_embedding(self, w, tokens, *rest):
        if _is_sym(w) or not isinstance(tokens, _Tokens):
            raise self.fail("an embedding lookup must read a constant table with the token ids")
        return self.lookup(_np(w), tokens)

    def op_index(self, w, indices):
        if _is_sym(w) or len(indices) != 1 or not isinstance(indices[0], _Tokens):
            raise self.fail("indexing an activation (or by an activation) is not polynomial")
        return self.lookup(_np(w), indices[0])

    def lookup(self, W, tok: _Tokens):
        if W.ndim != 2:
            raise self.fail(f"an embedding table of shape {W.shape} (expected (vocab, d))")
        V, d = W.shape
        shape = tok.shape + (d,)
        pos = 1 if len(tok.shape) == 2 else None
        self.embed_seen += 1
        if self.inputs == "residual":
            if self.embed_seen > 1:
                raise self.fail("the token ids feed more than one embedding lookup; "
                                "inputs='residual' reads the output of a single embedding "
                                "(pass inputs='tokens' to compile from one-hot tokens)")
            self.embed_weight = W
            s = self.new_stream(d, None)
            return self.lin_sym(s, self.identity_map(shape, pos), shape, pos)
        if self.vocab is None:
            self.vocab = V
            self.embed_weight = W
            self.new_stream(V, None)
        elif self.vocab != V:
            raise self.fail(f"embedding tables of different vocabularies ({self.vocab} and {V})")
        per = shape[1:]
        M = np.zeros(per + (V + 1,))
        M[..., 1:] = np.broadcast_to(W.T, per[:-1] + (d, V)) if pos is not None else W.T
        return self.lin_sym(0, M, shape, pos, own=True)


# ----------------------------------------------------------------------------------------
# capture, walk, verify
# ----------------------------------------------------------------------------------------

def _check_module(module, inputs):
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if inputs not in ("residual", "tokens"):
        raise ValueError(f"inputs: expected 'residual' or 'tokens', got {inputs!r}")
    for kind, items in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in items:
            if t.device.type == "meta":
                raise ValueError(f"module: {kind} {name!r} is on the meta device (no values); "
                                 f"load the weights first (module.to_empty(...) + "
                                 f"load_state_dict)")
            if t.is_floating_point() and kind == "parameter" and \
                    not bool(torch.isfinite(t.detach()).all()):
                bad = int((~torch.isfinite(t.detach())).sum())
                raise ValueError(f"module: parameter {name!r} of shape {tuple(t.shape)} has "
                                 f"{bad} non-finite (NaN/inf) entries")
            if t.is_floating_point() and kind == "buffer" and bool(torch.isnan(t).any()):
                raise ValueError(f"module: buffer {name!r} has NaN entries")


def _check_example(example, inputs):
    import torch

    if isinstance(example, (tuple, list)):
        if len(example) != 1:
            raise ValueError(f"example_inputs: expected one input tensor (or a 1-tuple), got "
                             f"{len(example)} inputs; wrap a multi-input module")
        example = example[0]
    if isinstance(example, np.ndarray):
        example = torch.from_numpy(example)
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"example_inputs: expected a torch tensor, got {type(example).__name__}")
    if example.device.type == "meta":
        raise ValueError("example_inputs: a tensor on the meta device (no values)")
    if example.is_complex() or example.dtype == torch.bool:
        raise ValueError(f"example_inputs: dtype {example.dtype} is neither floating point "
                         f"(a residual-stream input) nor integer (token ids)")
    tokens = not example.is_floating_point()
    if inputs == "tokens" and not tokens:
        raise ValueError(f"example_inputs: inputs='tokens' needs integer token ids, got dtype "
                         f"{example.dtype}")
    if tokens:
        if example.ndim not in (1, 2):
            raise ValueError(f"example_inputs: token ids of shape {tuple(example.shape)}; "
                             f"expected (batch,) or (batch, n_ctx)")
        if example.numel() and int(example.min()) < 0:
            raise ValueError("example_inputs: negative token ids")
    elif example.ndim not in (2, 3):
        raise ValueError(f"example_inputs: shape {tuple(example.shape)}; expected (batch, d) "
                         f"vectors or (batch, n_ctx, d) sequences")
    if example.numel() == 0:
        raise ValueError(f"example_inputs: empty tensor of shape {tuple(example.shape)}; the "
                         f"forward check needs at least one input (a batch of 2 or more)")
    if not tokens and not bool(torch.isfinite(example).all()):
        bad = int((~torch.isfinite(example)).sum())
        raise ValueError(f"example_inputs: tensor of shape {tuple(example.shape)} has {bad} "
                         f"non-finite (NaN/inf) entries; the forward check needs finite inputs")
    return example.to("cpu"), tokens


def _capture(module, x):
    """(graph, {placeholder name: constant tensor}, user input placeholder name)."""
    import torch

    try:
        ep = torch.export.export(module, (x,), strict=False)
    except Exception as exc:
        if _data_dependent(exc):
            raise _control_flow(exc) from None
        return _capture_fx(module, x, exc)
    consts, user = {}, None
    sd = ep.state_dict
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            user = spec.arg.name
        elif spec.target in sd:
            consts[spec.arg.name] = sd[spec.target]
        else:
            consts[spec.arg.name] = ep.constants[spec.target]
    return ep.graph, consts, user


def _capture_fx(module, x, first_exc):
    """torch.fx's dispatcher-level tracer (``make_fx``, pre-dispatch ATen, fake tensors) on the
    module as a function of its weights and input; refuses data-dependent control flow like
    export. (``torch.fx.symbolic_trace`` cannot trace shape-dependent Python such as
    ``x.view(B, T, ...)`` with ``B, T = x.shape``, most transformer code.)"""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    names, tensors = list(named), [t.detach() for t in named.values()]

    def f(*args):
        return torch.func.functional_call(module, dict(zip(names, args[:-1])), (args[-1],))

    try:
        g = make_fx(f, tracing_mode="fake", pre_dispatch=True, record_module_stack=True,
                    record_stack_traces=True)(*tensors, x)
    except Exception as exc:
        if _data_dependent(exc) or _data_dependent(first_exc):
            raise _control_flow(exc if _data_dependent(exc) else first_exc) from None
        raise NotCompilable(f"from_torch: neither torch.export ({type(first_exc).__name__}: "
                            f"{_first_line(first_exc)}) nor torch.fx ({type(exc).__name__}: "
                            f"{_first_line(exc)}) could capture the module") from None
    consts, user = {}, None
    places = [n for n in g.graph.nodes if n.op == "placeholder"]
    for node, t in zip(places, tensors):
        consts[node.name] = t
    user = places[-1].name
    for node in g.graph.nodes:
        if node.op == "get_attr":
            consts[node.name] = getattr(g, node.target)
    return g.graph, consts, user


def _first_line(exc) -> str:
    s = str(exc).strip().splitlines()
    return s[0][:300] if s else ""


def _data_dependent(exc) -> bool:
    s = f"{type(exc).__name__} {exc}"
    return any(k in s for k in ("data-dependent", "data dependent", "DataDependent",
                                "GuardOnDataDependent", "control flow",
                                "symbolically traced variables cannot be used as inputs to "
                                "control flow"))


def _control_flow(exc) -> NotCompilable:
    import traceback

    src = ""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if "torch" not in fr.filename.replace("\\", "/").split("/site-packages/")[-1][:6] and \
                "/torch/" not in fr.filename:
            src = f" at {fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}: `{(fr.line or '').strip()}`"
            break
    text = str(exc)
    for line in text.splitlines():
        if 'File "' in line and "/torch/" not in line:
            src = src or " at " + line.strip()
    return NotCompilable(f"from_torch: the module's forward depends on the input through "
                         f"data-dependent control flow{src}; a polynomial network has one "
                         f"computation for every input ({_first_line(exc)})")


def _prescan(graph, user):
    """Refuse a non-polynomial operator on an input-dependent value before any other work."""
    dep = {user}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if any(getattr(a, "name", None) in dep for a in _flat_args(list(node.args) +
                                                                   list(node.kwargs.values()))):
            dep.add(node.name)
            name = _opname(node)
            if name in ("div", "true_divide") and len(node.args) > 1 and \
                    getattr(node.args[1], "name", None) in dep:
                raise _fail(node, "divides by an activation (a data-dependent denominator) — "
                                  "not polynomial")
            if name in NON_POLYNOMIAL_OPS or name.lstrip("_") in NON_POLYNOMIAL_OPS:
                raise _fail(node, "is not polynomial; tensoralg compiles polynomial networks "
                                  "(linear maps, bilinear products, bilinear attention)")


def from_torch(module: torch.nn.Module, example_inputs: Any, *, inputs: str = "residual"
               ) -> Sequential:
    """Compile a torch module into an exact tensoralg network, verified against its forward pass.

    Args:
        module: a ``torch.nn.Module`` whose forward is a polynomial of its single input (see the
            module docstring for the supported operations). It is not modified: a float64 copy
            on the CPU in eval mode is traced.
        example_inputs: one tensor (or a 1-tuple): float ``(batch, d)`` vectors or ``(batch,
            n_ctx, d)`` sequences; or integer token ids ``(batch,)`` / ``(batch, n_ctx)``. The
            graph is captured at this shape: a sequence model compiles at this ``n_ctx`` (its
            mask is an ``(n_ctx, n_ctx)`` array). Use a batch of at least 2.
        inputs: ``"residual"`` (default): the network reads the module's float input, or, for a
            module that reads token ids, the output of its (single) embedding lookup — the
            residual stream, where the Gaussian metric belongs (docs/mathematics.md §3.7). ``"tokens"``:
            the network reads one-hot tokens ``(batch, n_ctx, vocab)`` (embedding lookups become
            linear maps of the one-hot vector).

    Returns:
        a [`tensoralg.Sequential`][tensoralg.Sequential] of ``Linear``, ``Bilinear``,
        ``BilinearAttention`` and ``Residual`` layers (float64) whose forward equals the module's.

    Raises:
        TypeError: ``module`` not a module, ``example_inputs`` not a tensor.
        ValueError: ``inputs`` unknown; example inputs of a wrong dtype/shape, empty, with
            NaN/inf entries (or that the module itself rejects); weights on the meta device or with NaN/inf entries.
        NotCompilable (a ValueError): a non-polynomial operator, data-dependent control flow or
            structure the layer classes cannot express (naming the operator, the module path and
            the source line); or a compiled network that does not reproduce the module to
            ``1e-10`` relative (naming the first layer that differs).
    """
    import torch

    _check_module(module, inputs)
    x, tokens = _check_example(example_inputs, inputs)
    m = copy.deepcopy(module).to(device="cpu", dtype=torch.float64).eval()
    if not tokens:
        x = x.to(torch.float64)
    try:
        with torch.no_grad():
            y = m(x)
    except Exception as exc:
        raise ValueError(f"example_inputs: module(example_inputs) with shape "
                         f"{tuple(x.shape)} and dtype {x.dtype} raised {type(exc).__name__}: "
                         f"{_first_line(exc)}") from None
    if not isinstance(y, torch.Tensor):
        raise NotCompilable(f"from_torch: the module returns {type(y).__name__}; expected one "
                            f"tensor")
    graph, consts, user = _capture(m, x)
    _prescan(graph, user)
    B = int(x.shape[0])
    T = int(x.shape[1]) if (x.ndim == 3 or (tokens and x.ndim == 2)) else None
    c = _Graph(B, T, inputs)
    env = {}
    out = None
    for node in graph.nodes:
        c.node = node
        if node.op == "placeholder":
            if node.name == user:
                if tokens:
                    env[node] = _Tokens(x.shape)
                else:
                    s = c.new_stream(int(x.shape[-1]), None)
                    pos = 1 if x.ndim == 3 else None
                    env[node] = c.lin_sym(s, c.identity_map(tuple(x.shape), pos),
                                          tuple(x.shape), pos)
            else:
                t = consts[node.name]
                env[node] = t.to(torch.float64) if t.is_floating_point() else t
        elif node.op == "get_attr":
            env[node] = consts[node.name]
        elif node.op == "call_function":
            args, kwargs = c.value_of(node, env)
            val = c.call(node, args, kwargs)
            _tag(val, node)
            env[node] = val
        elif node.op == "output":
            outs = list(_flat_args(node.args))
            if len(outs) != 1:
                raise NotCompilable(f"from_torch: the graph has {len(outs)} outputs; expected one")
            out = env[outs[0]]
        else:
            raise _fail(node, f"unsupported graph node kind {node.op!r}")
    net = _finish(c, out, y)
    _verify(c, net, m, x, tokens, graph, consts, user)
    return net


def _tag(val, node):
    if isinstance(val, _Sym) and getattr(val, "node", None) is None:
        val.node = node
    elif isinstance(val, (list, tuple)):
        for v in val:
            _tag(v, node)


def _finish(c: _Graph, out, y):
    from .layers import Sequential

    if not isinstance(out, _Sym):
        if isinstance(out, (_Pattern, _Tokens)):
            raise NotCompilable("from_torch: the module returns an attention pattern or the "
                                "token ids, not a network output")
        raise NotCompilable("from_torch: the module's output does not depend on its input")
    c.node = getattr(out, "node", c.node)
    (out,) = c.align([out])
    seq = c.T is not None
    want = 3 if seq else 2
    if len(out.shape) != want or (seq and out.pos != 1):
        raise c.fail(f"the output has shape {tuple(y.shape)}; a compiled network returns "
                     f"(batch, d_out)" + (" or (batch, n_ctx, d_out) with positions on axis 1"
                                         if seq else ""))
    lin = c.streams[out.stream]["lin"]
    if set(out.terms) == {lin}:
        (layer,), _ = c.build_layer(out)
        W = layer.weight
        if not (c.layers and W.shape[0] == W.shape[1] and np.array_equal(W, np.eye(len(W)))
                and layer.bias is None):
            c.layers.append(layer)
            c.layer_nodes.append((c.node, out))
    else:
        others = [k for k in out.chain if k != out.id and c.syms[k].stream == out.stream
                  and not c.syms[k].hidden]
        if others:   # the residual stream, then an affine head
            j = c.materialize(max(others))
            return _finish(c, c.rebase(out, j), y)
        c.materialize(out.id)
    return Sequential(c.layers)


def _probe(c: _Graph, x, tokens, wide: bool = False):
    """Deterministic verification inputs of the example's shape; ``wide``: at least 4 rows,
    and for token ids every id of the vocabulary at least once."""
    import torch

    from .checkpoint import probe_input, probe_tokens

    shape = tuple(x.shape)
    if not tokens:
        if wide:
            shape = (max(4, shape[0]),) + shape[1:]
        return torch.from_numpy(probe_input(shape[-1], int(np.prod(shape[:-1]))).reshape(shape))
    vocab = c.vocab if c.vocab is not None else c.embed_weight.shape[0]
    n_ctx = shape[1] if len(shape) == 2 else 1
    ids = probe_tokens(vocab, n_ctx, shape[0]).reshape(shape[0], n_ctx)
    if wide:
        rows = -(-vocab // n_ctx)
        every = (np.arange(rows * n_ctx) % vocab).reshape(rows, n_ctx)
        ids = np.concatenate([ids, every])
    return torch.from_numpy(ids.reshape((ids.shape[0],) + shape[1:]))


def _net_input(c: _Graph, ids, tokens):
    if not tokens:
        return ids.numpy()
    if c.inputs == "tokens":
        return np.eye(c.vocab)[ids.numpy()]
    return c.embed_weight[ids.numpy()]


def _compare(c, net, m, probe, tokens):
    import torch

    with torch.no_grad():
        ref = m(probe).numpy()
    xin = _net_input(c, probe, tokens)
    ours = np.asarray(net(xin))
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    err = float(np.abs(ours - ref).max()) if ours.shape == ref.shape else float("inf")
    return err <= RTOL * max(scale, np.finfo(np.float64).tiny), err, scale, xin


def _verify(c: _Graph, net, m, x, tokens, graph, consts, user):
    """The compiled network against the module: on inputs of the example's shape (the captured
    graph's, used to locate a difference) and on a wider batch (every token id)."""
    probe = _probe(c, x, tokens)
    ok, err, scale, xin = _compare(c, net, m, probe, tokens)
    if ok:
        wide = _probe(c, x, tokens, wide=True)
        try:
            ok, err, scale, _ = _compare(c, net, m, wide, tokens)
        except Exception:
            ok = True
        if ok:
            return
        where = "they agree on the example-shaped inputs; the difference is on other rows"
    else:
        where = _first_mismatch(c, net, xin, probe, graph, consts, user)
    raise NotCompilable(f"from_torch: the compiled network differs from the module on the "
                        f"verification inputs: max |Δ| = {err:.3g} (outputs up to {scale:.3g}; "
                        f"tolerance {RTOL:g} relative); {where}")


def _first_mismatch(c, net, xin, probe, graph, consts, user) -> str:
    import torch

    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = probe if node.name == user else consts[node.name].to(
                torch.float64) if consts[node.name].is_floating_point() else consts[node.name]
        elif node.op == "get_attr":
            env[node] = consts[node.name]
        elif node.op == "call_function":
            args = _replace(node.args, lambda a: env.get(a, a) if hasattr(a, "op") else a)
            kwargs = {k: _replace(v, lambda a: env.get(a, a) if hasattr(a, "op") else a)
                      for k, v in node.kwargs.items()}
            with torch.no_grad():
                env[node] = node.target(*args, **kwargs)
    h = xin
    for j, (layer, (node, u)) in enumerate(zip(net.layers, c.layer_nodes)):
        h = layer(h)
        if u is None:   # an embedding split off the next layer: no node of its own
            continue
        ref = env.get(getattr(u, "node", None) or node)
        if not isinstance(ref, torch.Tensor) or tuple(ref.shape) != u.shape:
            continue
        r = ref.numpy()
        if u.pos is not None:
            r = np.moveaxis(r, u.pos, 1)
        r = r.reshape(h.shape)
        e = float(np.abs(h - r).max())
        if not e <= RTOL * max(float(np.abs(r).max()), np.finfo(np.float64).tiny):
            return (f"they first disagree at layer {j} ({layer!r}), built from "
                    f"{_where(u.node if getattr(u, 'node', None) is not None else node)} "
                    f"(max |Δ| = {e:.3g})")
    return "every layer agrees with its graph node; the difference is in the output map"
