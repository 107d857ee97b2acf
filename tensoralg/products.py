"""Inner products of multilinear networks: Gaussian (exact, closure, Monte Carlo), Frobenius;
similarity, slices, diffs and Gram matrices.

The headline quantity (DESIGN §3.1) is the Gaussian inner product

    <f_a, f_b>_G = sum_o E_{x ~ N(0, I_d)} [ f_a(x)_o f_b(x)_o ],

computed exactly from the weights by Isserlis' theorem (Isserlis 1918; Wick 1950) on the lifted
input ``x~ = (1, x)``: a sum over partial matchings of the joined tensor network's input legs
(pairs bridged by ``P``, single legs capped by ``e0``). Tensor similarity is
``sim(a, b) = <a, b> / sqrt(<a, a> <b, b>)``, invariant to every reparametrization that leaves
the functions unchanged, because two polynomials are equal iff their symmetrized coefficient
tensors are (polarization).

Units: the inner product has the units of output squared; similarity is dimensionless in
[-1, 1].
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

from .canonical import Canonical, Stage, canonicalize, stack
from .layers import Layer, _map_arrays, as_network
from .network import (DEFAULT_MAX_CONFIGURATIONS, DEFAULT_MAX_FLOPS, DEFAULT_MAX_FLOPS_EXACT,
                      CostTooHigh, JoinedNetwork)

__all__ = ["inner", "norm", "similarity", "gram", "cross_gram", "similarity_matrix",
           "inner_diff", "diff_norm", "MonteCarloEstimate", "MonteCarloArray"]

METRICS = ("gaussian", "frobenius")
METHODS = ("exact", "closure", "montecarlo")
BACKENDS = ("numpy", "torch", "exact")
_MAX_INTERMEDIATE = 1 << 27  # elements; gram blocks are split to stay under it


class MonteCarloEstimate(float):
    """A Monte Carlo estimate: a float with its standard error ``stderr`` and ``n_samples``."""

    stderr: float
    n_samples: int

    def __new__(cls, value: float, stderr: float, n_samples: int):
        obj = super().__new__(cls, value)
        obj.stderr = float(stderr)
        obj.n_samples = int(n_samples)
        return obj

    def __repr__(self) -> str:
        return f"MonteCarloEstimate({float(self)!r} ± {self.stderr:.3g}, n={self.n_samples})"


class MonteCarloArray(np.ndarray):
    """A NumPy array of Monte Carlo estimates with an array ``stderr`` of the same shape."""

    def __new__(cls, values, stderr, n_samples: int):
        obj = np.asarray(values, dtype=np.float64).view(cls)
        obj.stderr = np.asarray(stderr, dtype=np.float64)
        obj.n_samples = int(n_samples)
        return obj

    def __array_finalize__(self, obj):
        if obj is not None:
            self.stderr = getattr(obj, "stderr", None)
            self.n_samples = getattr(obj, "n_samples", 0)


# ----------------------------------------------------------------------------------------
# option checking
# ----------------------------------------------------------------------------------------

def _check_options(metric: str, method: str, backend: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric: unknown metric {metric!r}; expected one of {METRICS}")
    if method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; expected one of {METHODS}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; expected one of {BACKENDS}")
    if metric == "frobenius" and method != "exact":
        raise ValueError(f"metric='frobenius' is a closed form of the weights: method must be "
                         f"'exact', got {method!r}")


def _check_pair(na: Layer, nb: Layer) -> None:
    if na.in_features != nb.in_features:
        raise ValueError(f"input dimensions differ: a takes {na.in_features} inputs, b takes "
                         f"{nb.in_features}; both networks must read the same x")
    if na.out_features != nb.out_features:
        raise ValueError(f"output dimensions differ: a gives {na.out_features} outputs, b gives "
                         f"{nb.out_features}; slice one output (output=c or a direction u) or "
                         f"compare networks with the same outputs")


def _output_matrix(output: Any, O: int, exact: bool) -> tuple[np.ndarray, bool]:
    """Output projection U (K, O) and whether the projected index stays open."""
    if output is None:
        U = np.eye(O, dtype=np.float64)
        keep = False
    elif isinstance(output, str):
        if output != "each":
            raise ValueError(f"output: expected None, an int, a vector of length {O} or 'each'; "
                             f"got {output!r}")
        U, keep = np.eye(O, dtype=np.float64), True
    elif isinstance(output, numbers.Integral) and not isinstance(output, (bool, np.bool_)):
        c = int(output)
        if not -O <= c < O:
            raise ValueError(f"output: index {c} out of range for {O} outputs")
        U = np.zeros((1, O))
        U[0, c % O] = 1.0
        keep = False
    else:
        from .layers import as_array

        if isinstance(output, (bool, numbers.Real)) or np.ndim(output) != 1:
            raise ValueError(f"output: expected None, an int class index, a vector of length {O} "
                             f"or 'each'; got {output!r}")
        u = as_array(output, "output", 1)
        if u.shape != (O,):
            raise ValueError(f"output: direction of shape {u.shape} does not match the {O} outputs")
        if not np.any(u != 0):
            raise ValueError("output: the direction u is zero; u . f is the zero function")
        U, keep = u[None, :], False
    if exact:
        U = np.vectorize(Fraction, otypes=[object])(U)
    return U, keep


# ----------------------------------------------------------------------------------------
# gauge normalization (exact in floating point: powers of two only)
# ----------------------------------------------------------------------------------------

def _exp2(maxabs: np.ndarray) -> np.ndarray:
    """Integer e with maxabs = m 2**e, m in [0.5, 1); 0 where maxabs is 0."""
    return np.frexp(maxabs)[1].astype(np.int64)


def _normalize(can: Canonical) -> tuple[Canonical, np.ndarray]:
    """Rescale a float stack by exact gauges (powers of two) so every factor is O(1).

    Gauges used (each leaves the function unchanged, and is exact in floating point):
    per hidden unit ``L_h * 2**-a, R_h * 2**-b, D[:, h] * 2**(a+b)``; on each internal bond the
    non-constant rows of ``D`` times ``2**-e`` and the non-constant input columns of the next
    stage times ``2**e`` (the constant coordinate is never scaled). The output's exponent
    ``k`` is returned per model: ``f = 2**k f_normalized``.
    """
    if can.exact:
        return can, np.zeros(can.arrays()[0].shape[0], dtype=np.int64)
    if not can.stages:
        W = can.linear.copy()
        k = _exp2(np.abs(W[:, 1:, :]).max(axis=(1, 2)))
        W[:, 1:, :] = np.ldexp(W[:, 1:, :], -k[:, None, None])
        return Canonical(can.d, can.out, [], W, False), k
    stages = []
    carry = np.zeros(can.stages[0].L.shape[0], dtype=np.int64)
    for st in can.stages:
        L, R, D = st.L.copy(), st.R.copy(), st.D.copy()
        L[:, :, 1:] = np.ldexp(L[:, :, 1:], carry[:, None, None])
        R[:, :, 1:] = np.ldexp(R[:, :, 1:], carry[:, None, None])
        eL = _exp2(np.abs(L).max(axis=2))
        eR = _exp2(np.abs(R).max(axis=2))
        eL[:, 0] = 0
        eR[:, 0] = 0
        L = np.ldexp(L, -eL[:, :, None])
        R = np.ldexp(R, -eR[:, :, None])
        D = np.ldexp(D, (eL + eR)[:, None, :])
        carry = _exp2(np.abs(D[:, 1:, :]).max(axis=(1, 2)))
        D[:, 1:, :] = np.ldexp(D[:, 1:, :], -carry[:, None, None])
        stages.append(Stage(L, R, D))
    return Canonical(can.d, can.out, stages, None, False), carry


def _fraction_array(arr: np.ndarray) -> np.ndarray:
    return np.vectorize(Fraction, otypes=[object])(arr)


def _to_exact(can: Canonical) -> Canonical:
    if can.exact:
        return can
    fr = np.vectorize(Fraction, otypes=[object])
    if not can.stages:
        return Canonical(can.d, can.out, [], fr(can.linear), True)
    return Canonical(can.d, can.out, [Stage(fr(s.L), fr(s.R), fr(s.D)) for s in can.stages],
                     None, True)


def _networks(models: Any, name: str) -> list[Layer]:
    if isinstance(models, Layer) or hasattr(models, "to_network"):
        raise TypeError(f"{name}: expected a sequence of models, got a single model")
    nets = [as_network(m, f"{name}[{i}]") for i, m in enumerate(models)]
    if not nets:
        raise ValueError(f"{name}: empty sequence of models")
    return nets


def _stack_for(nets: list[Layer], backend: str, name: str) -> tuple[Canonical, np.ndarray]:
    if backend == "exact":
        # floats are converted exactly (Fraction(float)) before any folding arithmetic
        nets = [n if n.is_exact else _map_arrays(n, _fraction_array) for n in nets]
    cans = [canonicalize(n) for n in nets]
    if backend == "exact":
        cans = [_to_exact(c) for c in cans]
    else:
        cans = [c if not c.exact else _float_can(c) for c in cans]
    st = stack(cans, name)
    return _normalize(st)


def _float_can(c: Canonical) -> Canonical:
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    if not c.stages:
        return Canonical(c.d, c.out, [], f(c.linear), False)
    return Canonical(c.d, c.out, [Stage(f(s.L), f(s.R), f(s.D)) for s in c.stages], None, False)


def _prepare_pair(a: Any, b: Any, metric: str = "gaussian", output: Any = None,
                  backend: str = "numpy"):
    na, nb = as_network(a, "a"), as_network(b, "b")
    _check_pair(na, nb)
    ca, ka = _stack_for([na], backend, "a")
    cb, kb = (ca, ka) if b is a else _stack_for([nb], backend, "b")
    U, keep = _output_matrix(output, na.out_features, backend == "exact")
    return JoinedNetwork(ca, cb, U, keep, metric), ka, kb


# ----------------------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------------------

def _converter(backend: str, device: Any, dtype: Any):
    if backend != "torch" and device is not None:
        raise ValueError(f"device: only backend='torch' runs on a device; backend={backend!r} "
                         f"computes on the CPU (got device={device!r})")
    if backend == "numpy":
        if dtype not in (None, np.float64, "float64"):
            raise ValueError(f"dtype: the numpy backend computes in float64, got {dtype!r}")
        return lambda x: np.asarray(x, dtype=np.float64)
    if backend == "exact":
        return lambda x: x
    import torch

    if device is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: unknown torch device {device!r} ({exc})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but CUDA is not available here "
                             f"(torch.cuda.is_available() is False); use device='cpu' or None")
    if dtype is None:
        tdtype = torch.float64
    elif isinstance(dtype, str):
        tdtype = getattr(torch, dtype, None)
        if not isinstance(tdtype, torch.dtype) or not tdtype.is_floating_point:
            raise ValueError(f"dtype: unknown torch floating dtype {dtype!r}")
    else:
        tdtype = dtype
    return lambda x: torch.as_tensor(np.asarray(x, dtype=np.float64), dtype=tdtype, device=dev)


def _to_numpy(val: Any) -> np.ndarray:
    if isinstance(val, np.ndarray):
        return val
    if hasattr(val, "detach"):
        return val.detach().to("cpu").double().numpy()
    return np.asarray(val)


# ----------------------------------------------------------------------------------------
# exact and closure engines on stacks; results are (Na, Nb[, K]) arrays in normalized gauge
# ----------------------------------------------------------------------------------------

def _exact_stacks(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, metric: str,
                  backend: str, device, dtype, max_flops: float, max_configurations: int):
    joined = JoinedNetwork(ca, cb, U, keep, metric)
    plan = joined.plan(max_configurations)
    if plan.flops > max_flops:
        raise CostTooHigh(
            f"exact {metric} inner product: estimated {plan.flops:.3g} FLOPs over "
            f"max_flops={max_flops:.3g} ({plan.summary()}). Alternatives: method='closure' "
            f"(fast, approximate beyond depth 1), method='montecarlo' (with a standard error), "
            f"or raise max_flops")
    val = joined.contract(_converter(backend, device, dtype))
    if backend == "exact":
        return val
    return _to_numpy(val).astype(np.float64)


def _closure_ops(can: Canonical) -> list:
    if not can.stages:
        return [("lin", can.linear)]
    return [("bil", s) for s in can.stages]


def _closure_stacks(ca: Canonical, cb: Canonical, U: np.ndarray, keep: bool, backend: str):
    """Gaussian closure (DESIGN §3.2): propagate the joint second moments of the lifted
    activations as if each layer's input were Gaussian; exact at depth 1."""
    exact = backend == "exact"
    d1 = ca.d + 1
    Na, Nb = ca.arrays()[0].shape[0], cb.arrays()[0].shape[0]
    I = np.eye(d1) if not exact else np.vectorize(Fraction, otypes=[object])(np.eye(d1))
    Maa = np.broadcast_to(I, (Na, d1, d1))
    Mbb = np.broadcast_to(I, (Nb, d1, d1))
    Mab = np.broadcast_to(I, (Na, Nb, d1, d1))
    ops_a, ops_b = _closure_ops(ca), _closure_ops(cb)
    es = lambda *args: np.einsum(*args, optimize=not exact)  # noqa: E731

    def stats_self(M):
        mu = M[:, :, 0]
        C = M - es("ni,nj->nij", mu, mu)
        return mu, C

    mua, Caa = stats_self(Maa)
    mub, Cbb = stats_self(Mbb)

    def advance_self(op, M, mu, C):
        kind, val = op
        if kind == "lin":
            return es("nij,njk,nlk->nil", val, M, val)
        L, R, D = val.L, val.R, val.D
        m1 = es("nhi,ni->nh", L, mu)
        m2 = es("nhi,ni->nh", R, mu)
        LC = es("nhi,nij->nhj", L, C)
        RC = es("nhi,nij->nhj", R, C)
        c12 = es("nhj,nhj->nh", LC, R)
        c13 = es("nhj,nkj->nhk", LC, L)   # l_h C l_k
        c14 = es("nhj,nkj->nhk", LC, R)   # l_h C r_k
        c23 = es("nhj,nkj->nhk", RC, L)   # r_h C l_k
        c24 = es("nhj,nkj->nhk", RC, R)   # r_h C r_k
        p = m1 * m2 + c12
        E = (p[:, :, None] * p[:, None, :] + c13 * (m2[:, :, None] * m2[:, None, :])
             + c14 * (m2[:, :, None] * m1[:, None, :]) + c23 * (m1[:, :, None] * m2[:, None, :])
             + c24 * (m1[:, :, None] * m1[:, None, :]) + c13 * c24 + c14 * c23)
        return es("noh,nhk,npk->nop", D, E, D)

    Cab = Mab - es("ai,bj->abij", mua, mub)
    depth = max(len(ops_a), len(ops_b))
    for t in range(depth):
        op_a = ops_a[t] if t < len(ops_a) else None
        op_b = ops_b[t] if t < len(ops_b) else None
        Mab = _cross_step(op_a, op_b, Mab, mua, mub, Caa, Cbb, Cab, es)
        if op_a is not None:
            Maa = advance_self(op_a, Maa, mua, Caa)
            mua, Caa = stats_self(Maa)
        if op_b is not None:
            Mbb = advance_self(op_b, Mbb, mub, Cbb)
            mub, Cbb = stats_self(Mbb)
        Cab = Mab - es("ai,bj->abij", mua, mub)
    body = Mab[:, :, 1:, 1:]
    if keep:
        return es("ko,abop,kp->abk", U, body, U)
    return es("ko,abop,kp->ab", U, body, U)


def _forms(op):
    if op is None:
        return None
    kind, val = op
    return [val] if kind == "lin" else [val.L, val.R]


def _cross_step(op_a, op_b, Mab, mua, mub, Caa, Cbb, Cab, es):
    """One closure step of the cross moment ``E[y~_a' y~_b'^T]``.

    Each side's new unit is a product of its linear forms of the (jointly Gaussian) input: one
    form for a linear op, two (left, right) for a bilinear op, and the identity (the activation
    itself) for a side with no op left. The expectation of the product of all forms is the
    non-centred Isserlis sum: pairs bridged by the covariance, singletons by the mean.
    """
    Na, Nb = Mab.shape[0], Mab.shape[1]
    fa = _forms(op_a)
    fb = _forms(op_b)
    if fa is None:
        fa = [np.broadcast_to(np.eye(Mab.shape[2], dtype=Mab.dtype), (Na,) + Mab.shape[2:3] * 2)]
    if fb is None:
        fb = [np.broadcast_to(np.eye(Mab.shape[3], dtype=Mab.dtype), (Nb,) + Mab.shape[3:4] * 2)]
    forms = [("a", f) for f in fa] + [("b", f) for f in fb]
    mus = [es("nhi,ni->nh", f, mua if s == "a" else mub) for s, f in forms]
    n = len(forms)

    # broadcast every quantity to (Na, Nb, Ha, Hb): side-a forms index h, side-b forms k
    def bmean(i):
        s = forms[i][0]
        return mus[i][:, None, :, None] if s == "a" else mus[i][None, :, None, :]

    def bcov(i, j):
        si, fi = forms[i]
        sj, fj = forms[j]
        if si == "a" and sj == "a":
            return es("nhi,nij,nhj->nh", fi, Caa, fj)[:, None, :, None]
        if si == "b" and sj == "b":
            return es("nhi,nij,nhj->nh", fi, Cbb, fj)[None, :, None, :]
        if si == "a":
            return es("ahi,abij,bkj->abhk", fi, Cab, fj)
        return es("ahi,abij,bkj->abhk", fj, Cab, fi)

    from .wick import partial_matchings

    E = 0
    for pairs, singles in partial_matchings(n):
        term = 1
        for i in singles:
            term = term * bmean(i)
        for i, j in pairs:
            term = term * bcov(i, j)
        E = E + term
    Da = op_a[1].D if op_a is not None and op_a[0] == "bil" else None
    Db = op_b[1].D if op_b is not None and op_b[0] == "bil" else None
    E = np.broadcast_to(E, (Na, Nb, fa[0].shape[1], fb[0].shape[1]))
    if Da is not None:
        E = es("aoh,abhk->abok", Da, E)
    if Db is not None:
        E = es("abok,bpk->abop", E, Db)
    return E


# ----------------------------------------------------------------------------------------
# Monte Carlo
# ----------------------------------------------------------------------------------------

# Monte Carlo over directions, radius integrated exactly (spherical-radial decomposition):
# x = r u with u uniform on the sphere and r ~ chi_d independent, so for a polynomial integrand
# g of degree <= D,  E[g(x)] = E_u[h(u)],  h(u) = E_r[(g(r u) + g(-r u)) / 2],  and h(u) is a
# polynomial of degree <= D/2 in s = r^2 / 2 ~ Gamma(d/2): an m-point Gauss rule for the
# weight s^(d/2-1) e^(-s) (generalized Laguerre) integrates it exactly once 2m - 1 >= D/2.
# Why: plain sampling of a degree-8 integrand (depth 2) is heavy-tailed and its sample
# standard error under-covers badly (n = 10 000: the truth beyond 3 SE in 2.9 % of runs,
# beyond 2 SE in 11 %); h is bounded on the sphere, its standard error covers from a few
# hundred directions on (measured: tests/test_mc_coverage.py), and at equal network
# evaluations its RMS error was 2-3x smaller on random depth-2 pairs.
MC_MIN_DIRECTIONS = 300


def _radial_rule(d: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Radii and probability weights that integrate ``r^k`` (even k <= degree) exactly, r ~ chi_d.

    Golub-Welsch on the Jacobi matrix of the generalized Laguerre weight (alpha = d/2 - 1):
    nodes are its eigenvalues, weights the squared first eigenvector components — already
    normalized, so no Gamma(d/2) appears (scipy's roots_genlaguerre overflows for d > 340)."""
    from scipy.linalg import eigh_tridiagonal

    m = (degree // 2) // 2 + 1
    alpha = d / 2 - 1
    k = np.arange(m, dtype=np.float64)
    diag = 2 * k + alpha + 1
    off = np.sqrt(k[1:] * (k[1:] + alpha))
    s, V = eigh_tridiagonal(diag, off)
    return np.sqrt(2 * s), V[0] ** 2


def _mc_features(nets: list[Layer], U: np.ndarray, n_samples: int, seed: int, backend: str,
                 device, dtype, chunk: int = 8192):
    """Yield ``(F, w)`` per chunk of directions: projected outputs ``F (N, s, Q, K)`` (float64
    NumPy) at the ``Q`` quadrature points ``±r_q u`` of each direction ``u`` and the weights
    ``w (Q,)`` (sum 1) such that ``sum_q w_q g(x_q)`` is the exact radial average of any
    polynomial ``g`` of degree <= 2 * max degree of ``nets`` along the ray of ``u``."""
    d = nets[0].in_features
    r, w = _radial_rule(d, 2 * max(n.degree for n in nets))
    pts = np.concatenate([r, -r])           # (Q,)
    wq = np.concatenate([w, w]) / 2
    Q = pts.size
    chunk = max(1, chunk // Q)
    if backend == "torch":
        import torch

        conv = _converter("torch", device, dtype)
        gen = torch.Generator(device=conv(np.zeros(1)).device).manual_seed(int(seed))
        Ut = conv(U)
        pt = conv(pts)
        done = 0
        while done < n_samples:
            s = min(chunk, n_samples - done)
            u = torch.randn(s, d, generator=gen, device=Ut.device, dtype=Ut.dtype)
            u = u / torch.linalg.vector_norm(u, dim=1, keepdim=True)
            x = (u[:, None, :] * pt[None, :, None]).reshape(s * Q, d)
            F = torch.stack([(net(x) @ Ut.T).reshape(s, Q, -1) for net in nets])
            yield F.detach().to("cpu").double().numpy(), wq
            done += s
        return
    rng = np.random.default_rng(seed)
    done = 0
    while done < n_samples:
        s = min(chunk, n_samples - done)
        u = rng.standard_normal((s, d))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        x = (u[:, None, :] * pts[None, :, None]).reshape(s * Q, d)
        yield np.stack([(np.asarray(net(x), dtype=np.float64) @ U.T).reshape(s, Q, -1)
                        for net in nets]), wq
        done += s


def _warn_few(n_samples: int) -> None:
    if n_samples < MC_MIN_DIRECTIONS:
        import warnings

        warnings.warn(f"n_samples={n_samples} < {MC_MIN_DIRECTIONS}: the Monte Carlo standard "
                      f"error may under-cover (measured on depth-2 pairs: at 100 directions the "
                      f"truth lay beyond 3 SE in 1.3 % of runs instead of 0.27 %)",
                      RuntimeWarning, stacklevel=4)


def _check_mc(n_samples, seed, backend) -> None:
    if backend == "exact":
        raise ValueError("method='montecarlo' samples in floating point: use backend='numpy' "
                         "or 'torch'")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 2:
        raise ValueError(f"n_samples: expected an integer >= 2, got {n_samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")


def _mc_moments(nets_a, nets_b, U, keep, n_samples, seed, backend, device, dtype):
    """Sample means and standard errors of <a_i, b_j> products (Na, Nb[, K])."""
    _check_mc(n_samples, seed, backend)
    U = np.asarray(U, dtype=np.float64)
    nets = list(nets_a) + list(nets_b)
    Na = len(nets_a)
    _warn_few(n_samples)
    s1 = s2 = 0.0
    for F, w in _mc_features(nets, U, n_samples, seed, backend, device, dtype):
        Fa, Fb = F[:Na], F[Na:]
        if keep:
            P = np.einsum("asqK,bsqK,q->sabK", Fa, Fb, w)
        else:
            P = np.einsum("asqK,bsqK,q->sab", Fa, Fb, w)
        s1 = s1 + P.sum(axis=0)
        s2 = s2 + (P * P).sum(axis=0)
    mean = s1 / n_samples
    var = np.maximum(s2 / n_samples - mean * mean, 0.0) * n_samples / (n_samples - 1)
    return mean, np.sqrt(var / n_samples)


def _mc_similarity(na: Layer, nb: Layer, U, keep, n_samples, seed, backend, device, dtype):
    """Ratio estimator ab / sqrt(aa bb) with a delta-method standard error."""
    _check_mc(n_samples, seed, backend)
    U = np.asarray(U, dtype=np.float64)
    _warn_few(n_samples)
    sums = None
    for F, w in _mc_features([na, nb], U, n_samples, seed, backend, device, dtype):
        fa, fb = F[0], F[1]
        out = "sK" if keep else "s"
        pab, paa, pbb = (np.einsum(f"sqK,sqK,q->{out}", x, y, w)
                         for x, y in ((fa, fb), (fa, fa), (fb, fb)))
        Z = np.stack([pab, paa, pbb])  # (3, s[, K])
        part = (Z.sum(axis=1), np.einsum("is...,js...->ij...", Z, Z))
        sums = part if sums is None else (sums[0] + part[0], sums[1] + part[1])
    m = sums[0] / n_samples
    cov = (sums[1] / n_samples - np.einsum("i...,j...->ij...", m, m)) * n_samples / (n_samples - 1)
    ab, aa, bb = m
    if np.any(aa <= 0) or np.any(bb <= 0):
        raise ValueError("similarity: a sampled norm is zero (a zero network?); similarity is "
                         "undefined")
    r = ab / np.sqrt(aa * bb)
    # gradient of r = ab / sqrt(aa bb) with respect to (ab, aa, bb)
    g = np.stack([1 / np.sqrt(aa * bb), -r / (2 * aa), -r / (2 * bb)])
    var = np.einsum("i...,ij...,j...->...", g, cov, g) / n_samples
    se = np.sqrt(np.maximum(var, 0.0))
    if keep:
        return MonteCarloArray(r, se, n_samples)
    return MonteCarloEstimate(float(r), float(se), n_samples)


# ----------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------

def _core(ca, cb, U, keep, metric, method, backend, device, dtype, max_flops, max_configurations):
    if method == "exact":
        if max_flops is None:
            max_flops = DEFAULT_MAX_FLOPS_EXACT if backend == "exact" else DEFAULT_MAX_FLOPS
        return _exact_stacks(ca, cb, U, keep, metric, backend, device, dtype, max_flops,
                             max_configurations)
    X = _closure_stacks(ca, cb, U, keep, backend)
    if backend == "torch":  # closure is cheap: computed in NumPy float64, then as asked
        X = _to_numpy(_converter("torch", device, dtype)(X)).astype(np.float64)
    return X


def _scaled(X, ka, kb, backend):
    """Undo the normalizing gauge: entry (i, j) times 2**(ka_i + kb_j)."""
    if backend == "exact":
        return X
    e = ka[:, None] + kb[None, :]
    if X.ndim == 3:
        e = e[:, :, None]
    return np.ldexp(X, e)


_DOC_KW = """
    Keyword args (shared by inner, norm, similarity, gram, cross_gram, similarity_matrix):
        metric: ``"gaussian"`` (E over x ~ N(0, I_d), DESIGN §3.1) or ``"frobenius"``
            (``<Sym T_a, Sym T_b>_F`` of the lifted coefficient tensors, DESIGN §3.3; needs the
            same number of bilinear stages on both sides; method ``"exact"`` only).
        method: ``"exact"`` (Isserlis/Wick partial-matching sum), ``"closure"`` (Gaussian
            closure, DESIGN §3.2: exact at depth 1, APPROXIMATE for depth >= 2 — the exact value
            of a different, tree-restricted form, not E[f_a f_b]; it does not certify functional
            reparametrizations of deep networks), or ``"montecarlo"`` (unbiased estimate from
            ``n_samples`` random directions drawn with ``seed``, the radius along each
            integrated exactly by a Gauss rule at ``±r_q`` — 2, 4, 6, 10 network evaluations
            per direction for networks of degree 1, 2, 4, 8; carries ``.stderr``, which covers
            from ``MC_MIN_DIRECTIONS = 300`` directions on — fewer give a RuntimeWarning).
        backend: ``"numpy"`` (float64), ``"torch"`` (``device``: default CUDA when available,
            else CPU; ``dtype``: default float64), or ``"exact"`` (rational arithmetic).
        output: ``None`` (sum over outputs), an int ``c`` (the class slice ``f_c``), a vector ``u``
            of length ``out`` (the direction ``u . f``) or ``"each"`` (one value per output).
        max_flops, max_configurations: cost budget of the exact method, checked before any
            contraction; over it :class:`~tensoralg.CostTooHigh` names the estimate and the
            alternatives. Defaults: 2e11 FLOPs (2e7 with backend="exact") and 200 000 Wick
            configurations.

    Raises:
        ValueError: unknown metric/method/backend/output; input or output sizes that differ
            between the networks; (similarity) a network of norm zero.
        CostTooHigh: an exact computation over budget.
"""


def inner(a: Any, b: Any, metric: str = "gaussian", method: str = "exact",
          backend: str = "numpy", output: Any = None, *, n_samples: int = 100_000,
          seed: int = 0, device: Any = None, dtype: Any = None, max_flops: float | None = None,
          max_configurations: int = DEFAULT_MAX_CONFIGURATIONS):
    """Inner product ``<f_a, f_b>`` of two networks with the same input and output sizes.

    Returns a float (numpy/torch backends), a :class:`fractions.Fraction` (exact backend), a
    NumPy vector for ``output="each"``, or a :class:`MonteCarloEstimate` for
    ``method="montecarlo"``.
    """
    _check_options(metric, method, backend)
    na, nb = as_network(a, "a"), as_network(b, "b")
    _check_pair(na, nb)
    U, keep = _output_matrix(output, na.out_features, backend == "exact")
    _converter(backend, device, dtype)  # validate dtype/device names early
    if method == "montecarlo":
        mean, se = _mc_moments([na], [nb], U, keep, n_samples, seed, backend, device, dtype)
        if keep:
            return MonteCarloArray(mean[0, 0], se[0, 0], n_samples)
        return MonteCarloEstimate(float(mean[0, 0]), float(se[0, 0]), n_samples)
    ca, ka = _stack_for([na], backend, "a")
    cb, kb = (ca, ka) if b is a else _stack_for([nb], backend, "b")
    X = _core(ca, cb, U, keep, metric, method, backend, device, dtype, max_flops,
              max_configurations)
    X = _scaled(X, ka, kb, backend)[0, 0]
    if backend == "exact":
        return np.vectorize(Fraction, otypes=[object])(X) if keep else Fraction(X)
    return X if keep else float(X)


def norm(a: Any, metric: str = "gaussian", method: str = "exact", backend: str = "numpy",
         output: Any = None, **kwargs):
    """``||f_a|| = sqrt(<f_a, f_a>)``. With ``backend="exact"`` a sympy expression
    (``sqrt`` of a rational), with ``"montecarlo"`` an estimate with a delta-method stderr."""
    val = inner(a, a, metric=metric, method=method, backend=backend, output=output, **kwargs)
    if backend == "exact":
        import sympy

        if isinstance(val, np.ndarray):
            return [sympy.sqrt(sympy.Rational(v.numerator, v.denominator)) for v in val]
        return sympy.sqrt(sympy.Rational(val.numerator, val.denominator))
    if isinstance(val, MonteCarloEstimate):
        r = math.sqrt(max(float(val), 0.0))
        return MonteCarloEstimate(r, val.stderr / (2 * r) if r > 0 else float("inf"),
                                  val.n_samples)
    return np.sqrt(np.maximum(val, 0.0)) if isinstance(val, np.ndarray) else math.sqrt(max(val, 0.0))


class ExactSimilarity(float):
    """An exact similarity (``backend="exact"``): the float nearest to it, plus ``.exact``.

    ``.exact`` is the sympy number ``sign(ab) * sqrt(R)`` with ``R = ab^2 / (aa bb)`` a reduced
    rational (square factors taken out by sympy; a plain Rational when ``R`` is a perfect
    square), and ``.squared`` is the signed Fraction ``sign(ab) * R``. Arithmetic and
    comparisons act on the float; use ``.exact`` / ``.squared`` for exact work."""

    exact: Any
    squared: Fraction

    @classmethod
    def from_products(cls, ab: Fraction, aa: Fraction, bb: Fraction) -> "ExactSimilarity":
        import sympy

        R = ab * ab / (aa * bb)
        sign = 1 if ab >= 0 else -1
        exact = sign * sympy.sqrt(sympy.Rational(R.numerator, R.denominator))
        obj = super().__new__(cls, float(sympy.Float(exact.evalf(30), 30)))
        obj.exact, obj.squared = exact, sign * R
        return obj

    def __repr__(self) -> str:
        text = str(self.exact)
        if len(text) > 60:
            digits = len(str(self.squared.numerator)) + len(str(self.squared.denominator))
            text = f"sign * sqrt(p/q), {digits} digits: see .exact"
        return f"ExactSimilarity({float(self)!r}, exact={text})"


def _sim_from(Xab, Xaa, Xbb, backend, what: str):
    if backend == "exact":
        import sympy

        def one(ab, aa, bb, where):
            if aa == 0 or bb == 0:
                raise ValueError(f"similarity{where}: a network has norm zero (||a||^2 = {aa}, "
                                 f"||b||^2 = {bb}); similarity is undefined")
            return ExactSimilarity.from_products(Fraction(ab), Fraction(aa), Fraction(bb))
        if np.ndim(Xab):
            return [one(x, y, z, f" (output {i})") for i, (x, y, z) in
                    enumerate(zip(Xab, Xaa, Xbb))]
        return one(Xab, Xaa, Xbb, "")
    Xaa, Xbb = np.asarray(Xaa, dtype=np.float64), np.asarray(Xbb, dtype=np.float64)
    bad = (Xaa <= 0) | (Xbb <= 0)
    if np.any(bad):
        where = "" if np.ndim(Xaa) == 0 else f" (outputs {np.flatnonzero(bad).tolist()})"
        raise ValueError(f"similarity{where}: {what} has norm zero (||a||^2 = {Xaa}, ||b||^2 = "
                         f"{Xbb}); similarity is undefined for the zero function")
    # Cauchy-Schwarz bounds |sim| by 1; clip the last-ulp excess of rounding.
    return np.clip(Xab / np.sqrt(Xaa * Xbb), -1.0, 1.0)


def similarity(a: Any, b: Any, metric: str = "gaussian", method: str = "exact",
               backend: str = "numpy", output: Any = None, *, n_samples: int = 100_000,
               seed: int = 0, device: Any = None, dtype: Any = None,
               max_flops: float | None = None,
               max_configurations: int = DEFAULT_MAX_CONFIGURATIONS):
    """Tensor similarity ``<a, b> / (||a|| ||b||)`` in [-1, 1] (cosine of the two functions under
    the chosen metric). ``sim(a, a) = 1``; symmetric; invariant to reparametrizations that keep
    the functions (exact method). Computed in a normalized gauge so that output scales of
    1e±300 cancel exactly. Returns a float, an :class:`ExactSimilarity` (exact backend: the
    float with the exact value ``.exact = ±sqrt(R)``, ``R`` a reduced rational), a vector
    (``output="each"``) or a :class:`MonteCarloEstimate` (delta-method standard error).
    """
    _check_options(metric, method, backend)
    na, nb = as_network(a, "a"), as_network(b, "b")
    _check_pair(na, nb)
    U, keep = _output_matrix(output, na.out_features, backend == "exact")
    _converter(backend, device, dtype)
    if method == "montecarlo":
        return _mc_similarity(na, nb, U, keep, n_samples, seed, backend, device, dtype)
    args = (U, keep, metric, method, backend, device, dtype, max_flops, max_configurations)
    ca, _ = _stack_for([na], backend, "a")
    Xaa = _core(ca, ca, *args)[0, 0]
    if b is a:
        Xab = Xbb = Xaa
    else:
        cb, _ = _stack_for([nb], backend, "b")
        Xab = _core(ca, cb, *args)[0, 0]
        Xbb = _core(cb, cb, *args)[0, 0]
    sim = _sim_from(Xab, Xaa, Xbb, backend, "a or b")
    if backend != "exact" and not keep:
        return float(sim)
    return sim


def _gram_blocks(ca, cb, U, keep, metric, method, backend, device, dtype, max_flops,
                 max_configurations):
    """Cross Gram (Na, Nb[, K]) in normalized gauge, in blocks when intermediates are large."""
    Na, Nb = ca.arrays()[0].shape[0], cb.arrays()[0].shape[0]
    args = (U, keep, metric, method, backend, device, dtype, max_flops, max_configurations)
    if method != "exact" or Na * Nb == 1:
        return _core(ca, cb, *args)
    # block size: keep the largest intermediate of one block under _MAX_INTERMEDIATE
    one = JoinedNetwork(_sub(ca, [0]), _sub(cb, [0]), U, keep, metric).plan(max_configurations)
    per_pair = max(1, one.largest_intermediate)
    block = max(1, int(math.isqrt(max(1, _MAX_INTERMEDIATE // per_pair))))
    if block >= max(Na, Nb):
        return _core(ca, cb, *args)
    rows = []
    for i0 in range(0, Na, block):
        row = []
        for j0 in range(0, Nb, block):
            ia, jb = list(range(i0, min(Na, i0 + block))), list(range(j0, min(Nb, j0 + block)))
            row.append(_core(_sub(ca, ia), _sub(cb, jb), *args))
        rows.append(np.concatenate(row, axis=1))
    return np.concatenate(rows, axis=0)


def _sub(can: Canonical, idx: list[int]) -> Canonical:
    if not can.stages:
        return Canonical(can.d, can.out, [], can.linear[idx], can.exact)
    return Canonical(can.d, can.out, [Stage(s.L[idx], s.R[idx], s.D[idx]) for s in can.stages],
                     None, can.exact)


def cross_gram(models_a: Sequence[Any], models_b: Sequence[Any], metric: str = "gaussian",
               method: str = "exact", backend: str = "numpy", output: Any = None, *,
               n_samples: int = 100_000, seed: int = 0, device: Any = None, dtype: Any = None,
               max_flops: float | None = None,
               max_configurations: int = DEFAULT_MAX_CONFIGURATIONS):
    """Matrix ``G[i, j] = <a_i, b_j>`` of shape ``(Na, Nb)`` (``(Na, Nb, out)`` for
    ``output="each"``) for two lists of same-architecture models: the models are stacked on a
    batch index and each Wick configuration is one batched contraction (not Na*Nb calls).
    Returns a float64 array (object array of Fractions with backend="exact"; a
    :class:`MonteCarloArray` with ``.stderr`` for method="montecarlo")."""
    _check_options(metric, method, backend)
    name_a, name_b = ("models", "models") if models_a is models_b else ("models_a", "models_b")
    nets_a = _networks(models_a, name_a)
    nets_b = nets_a if models_a is models_b else _networks(models_b, name_b)
    _check_pair(nets_a[0], nets_b[0])
    U, keep = _output_matrix(output, nets_a[0].out_features, backend == "exact")
    _converter(backend, device, dtype)
    for i, n in enumerate(nets_a[1:] + nets_b):
        _check_pair(nets_a[0], n)
    if method == "montecarlo":
        mean, se = _mc_moments(nets_a, nets_b, U, keep, n_samples, seed, backend, device, dtype)
        return MonteCarloArray(mean, se, n_samples)
    ca, ka = _stack_for(nets_a, backend, name_a)
    same = models_a is models_b
    cb, kb = (ca, ka) if same else _stack_for(nets_b, backend, name_b)
    X = _gram_blocks(ca, cb, U, keep, metric, method, backend, device, dtype, max_flops,
                     max_configurations)
    return _scaled(X, ka, kb, backend)


def gram(models: Sequence[Any], metric: str = "gaussian", method: str = "exact",
         backend: str = "numpy", output: Any = None, **kwargs):
    """Gram matrix ``G[i, j] = <m_i, m_j>`` of N same-architecture models, shape ``(N, N)``,
    computed as batched contractions (one per Wick configuration orbit). Diffs follow from it:
    ``||m_i - m_j||^2 = G_ii - 2 G_ij + G_jj`` (DESIGN §3.5)."""
    if isinstance(models, Layer) or hasattr(models, "to_network"):
        raise TypeError("models: expected a sequence of models, got a single model")
    models = list(models) if not isinstance(models, list) else models
    return cross_gram(models, models, metric=metric, method=method, backend=backend,
                      output=output, **kwargs)


def similarity_matrix(models: Sequence[Any], metric: str = "gaussian", method: str = "exact",
                      backend: str = "numpy", output: Any = None, **kwargs):
    """``S[i, j] = G_ij / sqrt(G_ii G_jj)`` from one batched :func:`gram` call (normalized
    gauge: unaffected by the models' output scales). Raises ValueError if a model has norm 0."""
    _check_options(metric, method, backend)
    if isinstance(models, Layer) or hasattr(models, "to_network"):
        raise TypeError("models: expected a sequence of models, got a single model")
    models = list(models)
    if method == "montecarlo":
        G = gram(models, metric=metric, method=method, backend=backend, output=output, **kwargs)
        dg = np.einsum("ii...->i...", np.asarray(G))
        if np.any(dg <= 0):
            raise ValueError("similarity_matrix: a model has (sampled) norm zero")
        return np.clip(np.asarray(G) / np.sqrt(np.einsum("i...,j...->ij...", dg, dg)), -1, 1)
    nets = _networks(models, "models")
    for n in nets[1:]:
        _check_pair(nets[0], n)
    U, keep = _output_matrix(output, nets[0].out_features, backend == "exact")
    _converter(backend, device=kwargs.get("device"), dtype=kwargs.get("dtype"))
    c, _ = _stack_for(nets, backend, "models")
    X = _gram_blocks(c, c, U, keep, metric, method, backend, kwargs.get("device"),
                     kwargs.get("dtype"), kwargs.get("max_flops"),
                     kwargs.get("max_configurations", DEFAULT_MAX_CONFIGURATIONS))
    dg = np.einsum("ii...->i...", X)
    if backend == "exact":
        Xf = np.vectorize(float, otypes=[float])(X)
        dgf = np.vectorize(float, otypes=[float])(dg)
    else:
        Xf, dgf = X, dg
    if np.any(dgf <= 0):
        raise ValueError(f"similarity_matrix: models {np.flatnonzero(np.atleast_1d(dgf <= 0)).tolist()} "
                         f"have norm zero; similarity is undefined")
    return np.clip(Xf / np.sqrt(np.einsum("i...,j...->ij...", dgf, dgf)), -1.0, 1.0)


def _mc_combination(left, right, kwargs):
    """Monte Carlo ``<sum_i alpha_i f_i, sum_j beta_j g_j>`` from one set of samples, as one
    per-direction integrand, so the standard error includes the covariance of the terms.
    ``left``/``right``: lists of ``(model, coefficient)``."""
    kw = dict(kwargs)
    backend = kw.pop("backend", "numpy")
    output = kw.pop("output", None)
    n_samples, seed = kw.pop("n_samples", 100_000), kw.pop("seed", 0)
    device, dtype = kw.pop("device", None), kw.pop("dtype", None)
    kw.pop("method", None)
    kw.pop("max_flops", None), kw.pop("max_configurations", None)
    if kw.pop("metric", "gaussian") != "gaussian":
        raise ValueError("metric='frobenius' has no Monte Carlo estimate; use method='exact'")
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
    _check_options("gaussian", "montecarlo", backend)
    nets = [as_network(m, "model") for m, _ in left + right]
    for n in nets[1:]:
        _check_pair(nets[0], n)
    U, keep = _output_matrix(output, nets[0].out_features, False)
    _converter(backend, device, dtype)
    _check_mc(n_samples, seed, backend)
    _warn_few(n_samples)
    alpha = np.array([c for _, c in left], dtype=np.float64)
    beta = np.array([c for _, c in right], dtype=np.float64)
    nl = len(left)
    s1 = s2 = 0.0
    for F, w in _mc_features(nets, np.asarray(U, dtype=np.float64), n_samples, seed, backend,
                             device, dtype):
        fl = np.einsum("i,isqK->sqK", alpha, F[:nl])
        fr = np.einsum("j,jsqK->sqK", beta, F[nl:])
        P = np.einsum(f"sqK,sqK,q->{'sK' if keep else 's'}", fl, fr, w)
        s1 = s1 + P.sum(axis=0)
        s2 = s2 + (P * P).sum(axis=0)
    mean = s1 / n_samples
    var = np.maximum(s2 / n_samples - mean * mean, 0.0) * n_samples / (n_samples - 1)
    se = np.sqrt(var / n_samples)
    if keep:
        return MonteCarloArray(mean, se, n_samples)
    return MonteCarloEstimate(float(mean), float(se), n_samples)


def inner_diff(a: Any, b: Any, c: Any, **kwargs):
    """``<a, b - c> = <a, b> - <a, c>`` (bilinearity, DESIGN §3.5), from one batched
    :func:`cross_gram` call when ``b`` and ``c`` share an architecture. Same keywords as
    :func:`inner` (``output="each"`` gives one value per output). In floating point the
    difference carries the absolute error of the two terms (about
    ``eps * ||a|| (||b|| + ||c||)``). With ``method="montecarlo"`` the per-sample integrand is
    ``f_a . (f_b - f_c)``, so the returned estimate's ``.stderr`` accounts for the correlation
    of the two terms."""
    if kwargs.get("method") == "montecarlo":
        return _mc_combination([(a, 1.0)], [(b, 1.0), (c, -1.0)], kwargs)
    try:
        row = cross_gram([a], [b, c], **kwargs)
        return row[0, 0] - row[0, 1]
    except ValueError as exc:
        if "architecture differs" not in str(exc):
            raise
    return inner(a, b, **kwargs) - inner(a, c, **kwargs)


def diff_norm(b: Any, c: Any, **kwargs):
    """``||b - c|| = sqrt(<b,b> - 2<b,c> + <c,c>)`` from the Gram matrix of ``[b, c]`` (one batched
    call when both have the same architecture). Exact with backend="exact" (a sympy number; a
    list of them for ``output="each"``); in float64 the absolute error is about
    ``eps * (||b||^2 + ||c||^2)``, so tiny differences between large networks are best measured
    with backend="exact". ``output="each"`` gives a vector (one norm per output). With
    ``method="montecarlo"`` the integrand is ``|f_b - f_c|^2`` per sample and the standard
    error of the norm is the delta-method one, ``se(d^2) / (2 d)``."""
    backend = kwargs.get("backend", "numpy")
    if kwargs.get("method") == "montecarlo":
        d2 = _mc_combination([(b, 1.0), (c, -1.0)], [(b, 1.0), (c, -1.0)], kwargs)
        d = np.sqrt(np.maximum(np.asarray(d2, dtype=np.float64), 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            se = np.where(d > 0, np.asarray(d2.stderr) / (2 * d), np.inf)
        if isinstance(d2, MonteCarloArray):
            return MonteCarloArray(d, se, d2.n_samples)
        return MonteCarloEstimate(float(d), float(se), d2.n_samples)
    try:
        G = gram([b, c], **kwargs)
        bb, bc, cc = G[0, 0], G[0, 1], G[1, 1]
    except ValueError as exc:
        if "architecture differs" not in str(exc):
            raise
        bb, bc, cc = inner(b, b, **kwargs), inner(b, c, **kwargs), inner(c, c, **kwargs)
    d2 = bb - 2 * bc + cc
    if backend == "exact":
        import sympy

        def root(v):
            v = Fraction(v)
            return sympy.sqrt(sympy.Rational(v.numerator, v.denominator))
        return [root(v) for v in d2] if np.ndim(d2) else root(d2)
    if np.ndim(d2):
        return np.sqrt(np.maximum(np.asarray(d2, dtype=np.float64), 0.0))
    return math.sqrt(max(float(d2), 0.0))
