"""Inner products of multilinear networks — the public API: inner, norm, similarity, gram,
cross_gram, similarity_matrix, inner_diff, diff_norm, plan.

The headline quantity (DESIGN §3.1) is the Gaussian inner product

    <f_a, f_b>_G = sum_o E_{x ~ N(0, I_d)} [ f_a(x)_o f_b(x)_o ],

computed exactly from the weights: by Isserlis' theorem (Isserlis 1918; Wick 1950) on the lifted
input ``x~ = (1, x)`` (the Wick strategy) or through Gaussian chaos coefficients (the chaos
strategy, DESIGN §3.6), whichever the planner finds cheaper. Tensor similarity is
``sim(a, b) = <a, b> / sqrt(<a, a> <b, b>)``, invariant to every reparametrization that leaves
the functions unchanged, because two polynomials are equal iff their symmetrized coefficient
tensors are (polarization).

This module is thin: prepare (checks, canonical stacks) -> plan (:mod:`tensoralg.planner`) ->
strategy (:mod:`tensoralg.strategies`). Units: the inner product has the units of output
squared; similarity is dimensionless in [-1, 1].
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Iterable

import numpy as np

from .backends import converter
from .canonical import Canonical
from .errors import CostTooHigh
from .layers import Layer, as_network
from .network import DEFAULT_MAX_CONFIGURATIONS
from .planner import (Plan, SequencePlan, make_plan, plan_sequence, refuse_exact_early,
                      refuse_if_needed)
from .prepare import (check_options, check_pair, networks, output_matrix, scaled, stack_for)
from .strategies import chaos, closure, montecarlo, wick
from .strategies.montecarlo import MC_MIN_DIRECTIONS, MonteCarloArray, MonteCarloEstimate

__all__ = ["inner", "norm", "similarity", "gram", "cross_gram", "similarity_matrix",
           "inner_diff", "diff_norm", "plan", "MonteCarloEstimate", "MonteCarloArray",
           "ExactSimilarity", "MC_MIN_DIRECTIONS"]

_MAX_INTERMEDIATE = 1 << 27  # elements; Wick gram blocks are split to stay under it


def _engine(ca: Canonical, cb: Canonical, U, keep, metric, method, backend, device, dtype,
            strategy, max_flops, max_memory, max_configurations, same=False):
    """Cross Gram ``(Na, Nb[, K])`` of two prepared stacks (normalized gauge)."""
    if method == "closure":
        X = closure.cross(ca, cb, U, keep, backend)
        if backend == "torch":  # closure is cheap: computed in NumPy float64, then as asked
            from .backends import to_numpy

            X = to_numpy(converter("torch", device, dtype)(X)).astype(np.float64)
        return X
    p = make_plan(ca, cb, U, keep, metric, backend, device, dtype, strategy, max_flops,
                  max_memory, max_configurations, same=same)
    refuse_if_needed(p)
    return _run(p, ca, cb, U, keep, backend, device, dtype, same)


def _run(p: Plan, ca, cb, U, keep, backend, device, dtype, same):
    """The cross Gram of two prepared stacks by the strategy of their (not refused) plan."""
    if p.strategy == "chaos":
        conv = converter(backend, device, dtype) if backend == "torch" else None
        return chaos.cross(ca, cb, U, keep, same=same, conv=conv)
    return wick.compute(p._joined, backend, device, dtype, shared=p.wick_shared)


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
        strategy: the exact representation: ``"auto"`` (default: the cheaper of the two within
            budget, see :mod:`tensoralg.planner`), ``"wick"`` (tensor-network Wick sum) or
            ``"chaos"`` (Gaussian chaos / Hermite coefficients, DESIGN §3.6; Gaussian metric).
        max_flops, max_memory, max_configurations: cost budget of the exact method, checked
            before any contraction or allocation; over it :class:`~tensoralg.CostTooHigh` names
            every strategy's estimate and the alternatives. Defaults: 2e11 FLOPs (2e7 with
            backend="exact"), half the available memory in bytes (of the CUDA device for
            torch) and 200 000 Wick configurations.

    Raises:
        ValueError: unknown metric/method/backend/strategy/output; a budget that is not a
            positive number; input or output sizes that differ between the networks;
            (similarity) a network of norm zero.
        CostTooHigh: an exact computation over budget.
"""




def _is_sequence(*nets) -> bool:
    return any(getattr(n, "is_sequence_model", False) for n in nets)


def _sequence(kind: str, na: Layer, nb: Layer, metric, method, backend, output, kw):
    """Sequence models (bilinear attention, DESIGN §3.7) through :mod:`tensoralg.attention`:
    exact for one attention layer, Monte Carlo and the (approximate) closure at any depth;
    refusals name the alternatives."""
    from . import attention

    if not (na.is_sequence_model and nb.is_sequence_model) and not all(
            getattr(n, "is_sequence_model", False) or n.degree <= 1 for n in (na, nb)):
        raise ValueError("a and b: a sequence model (with attention) compared with a "
                         "position-free network of degree > 1; compare two sequence models (a "
                         "per-position affine map is accepted)")
    if metric != "gaussian":
        raise ValueError("sequence models: only metric='gaussian' is implemented")
    n_ctx, position = kw.pop("n_ctx", None), kw.pop("position", None)
    device = kw.pop("device", None)
    if method == "closure":  # APPROXIMATE at depth >= 2 (attention.closure_inner)
        if backend not in ("numpy", "torch"):
            raise ValueError(f"method='closure' for sequence models runs in float64: use "
                             f"backend='numpy' or 'torch', got {backend!r}")
        fn = attention.closure_inner if kind == "inner" else attention.closure_similarity
        return fn(na, nb, n_ctx=n_ctx, output=output, position=position, backend=backend,
                  device=device)
    if method == "montecarlo":
        if backend == "exact":
            raise ValueError("method='montecarlo' samples in floating point: use "
                             "backend='numpy'")
        fn = attention.montecarlo_inner if kind == "inner" else attention.montecarlo_similarity
        return fn(na, nb, n_ctx=n_ctx, output=output, position=position,
                  n_samples=kw.get("n_samples", 20_000), seed=kw.get("seed", 0))
    args = dict(n_ctx=n_ctx, output=output, position=position, backend=backend,
                max_configurations=kw.get("max_configurations", DEFAULT_MAX_CONFIGURATIONS),
                device=device, max_memory=kw.get("max_memory"))
    try:
        if kind == "inner":
            return attention.exact_inner(na, nb, **args)
        return attention.exact_similarity(na, nb, **args)
    except attention.AttentionNotSupported as exc:
        raise CostTooHigh(f"exact inner product of sequence models: {exc}. "
                          f"{attention.ALTERNATIVES}") from None


_POSITION_FREE = object()


def _checked_pair(kind, a, b, metric, method, backend, strategy, output, seq_kw):
    """Options and the pair checked; sequence models answered through
    :mod:`tensoralg.attention` (returned as the third item), else ``_POSITION_FREE``."""
    check_options(metric, method, backend, strategy)
    na, nb = as_network(a, "a"), as_network(b, "b")
    check_pair(na, nb)
    if _is_sequence(na, nb):
        return na, nb, _sequence(kind, na, nb, metric, method, backend, output, seq_kw)
    if seq_kw.get("n_ctx") is not None or seq_kw.get("position") is not None:
        raise ValueError("n_ctx / position: only for sequence models (with attention)")
    return na, nb, _POSITION_FREE


def inner(a: Any, b: Any, metric: str = "gaussian", method: str = "exact",
          backend: str = "numpy", output: Any = None, *, strategy: str = "auto",
          n_samples: int = 100_000, seed: int = 0, device: Any = None, dtype: Any = None,
          max_flops: float | None = None, max_memory: float | None = None,
          max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, n_ctx: int | None = None,
          position: Any = None):
    """Inner product ``<f_a, f_b>`` of two networks with the same input and output sizes.

    Sequence models (with :class:`~tensoralg.BilinearAttention`; inputs ``(n, n_ctx, d)``) go
    through :mod:`tensoralg.attention`: the sum runs over query positions too (``position=t``
    slices one, ``"each"`` keeps them), ``n_ctx`` is the sequence length (optional when a mask
    array fixes it).

    Returns a float (numpy/torch backends), a :class:`fractions.Fraction` (exact backend), a
    NumPy vector for ``output="each"``, or a :class:`MonteCarloEstimate` for
    ``method="montecarlo"``.
    """
    na, nb, seq = _checked_pair("inner", a, b, metric, method, backend, strategy, output,
                                dict(n_ctx=n_ctx, position=position, n_samples=n_samples,
                                     seed=seed, max_configurations=max_configurations,
                                     device=device, max_memory=max_memory))
    if seq is not _POSITION_FREE:
        return seq
    U, keep = output_matrix(output, na.out_features, backend == "exact")
    converter(backend, device, dtype)  # validate dtype/device names early
    if method == "montecarlo":
        mean, se = montecarlo.moments([na], [nb], U, keep, n_samples, seed, backend, device,
                                      dtype)
        if keep:
            return MonteCarloArray(mean[0, 0], se[0, 0], n_samples)
        return MonteCarloEstimate(float(mean[0, 0]), float(se[0, 0]), n_samples)
    same = b is a
    if backend == "exact" and method == "exact":  # refuse before any rational work
        refuse_if_needed(refuse_exact_early([na], None if same else [nb], U, keep, metric,
                                            strategy, max_flops, max_memory,
                                            max_configurations, same=same))
    ca, ka = stack_for([na], backend, "a")
    cb, kb = (ca, ka) if same else stack_for([nb], backend, "b")
    X = _engine(ca, cb, U, keep, metric, method, backend, device, dtype, strategy, max_flops,
                max_memory, max_configurations, same=same)
    X = scaled(X, ka, kb, backend)[0, 0]
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
        def one(ab, aa, bb, where):
            if aa == 0 or bb == 0:
                raise ValueError(f"similarity{where}: a network has norm zero (||a||^2 = {aa}, "
                                 f"||b||^2 = {bb}); similarity is undefined")
            return ExactSimilarity.from_products(Fraction(ab), Fraction(aa), Fraction(bb))
        if np.ndim(Xab):
            return [one(x, y, z, f" (output {i})") for i, (x, y, z) in
                    enumerate(zip(Xab, Xaa, Xbb))]
        return one(Xab, Xaa, Xbb, "")
    if np.ndim(Xab) == 0 and np.ndim(Xaa) == 0 and np.ndim(Xbb) == 0:
        ab, aa, bb = float(Xab), float(Xaa), float(Xbb)
        if math.isfinite(ab) and math.isfinite(aa) and math.isfinite(bb) and aa > 0 and bb > 0:
            # the same IEEE operations as below, on Python floats (bad values: below)
            return min(1.0, max(-1.0, ab / math.sqrt(aa * bb)))
    Xaa, Xbb = np.asarray(Xaa, dtype=np.float64), np.asarray(Xbb, dtype=np.float64)
    if not (np.all(np.isfinite(Xaa)) and np.all(np.isfinite(Xbb))
            and np.all(np.isfinite(np.asarray(Xab, dtype=np.float64)))):
        raise ValueError(f"similarity{'' if np.ndim(Xaa) == 0 else ' (per output)'}: an inner "
                         f"product overflowed float64 (||a||^2 = {Xaa}, ||b||^2 = {Xbb}); "
                         f"internal activations beyond 1e154 — use backend='exact'")
    bad = (Xaa <= 0) | (Xbb <= 0)
    if np.any(bad):
        where = "" if np.ndim(Xaa) == 0 else f" (outputs {np.flatnonzero(bad).tolist()})"
        raise ValueError(f"similarity{where}: {what} has norm zero (||a||^2 = {Xaa}, ||b||^2 = "
                         f"{Xbb}); similarity is undefined for the zero function")
    # Cauchy-Schwarz bounds |sim| by 1; clip the last-ulp excess of rounding.
    return np.clip(Xab / np.sqrt(Xaa * Xbb), -1.0, 1.0)


def similarity(a: Any, b: Any, metric: str = "gaussian", method: str = "exact",
               backend: str = "numpy", output: Any = None, *, strategy: str = "auto",
               n_samples: int = 100_000, seed: int = 0, device: Any = None, dtype: Any = None,
               max_flops: float | None = None, max_memory: float | None = None,
               max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, n_ctx: int | None = None,
               position: Any = None):
    """Tensor similarity ``<a, b> / (||a|| ||b||)`` in [-1, 1] (cosine of the two functions under
    the chosen metric). ``sim(a, a) = 1``; symmetric; invariant to reparametrizations that keep
    the functions (exact method). Computed in a normalized gauge so that output scales of
    1e±300 cancel exactly. Returns a float, a sympy expression (exact backend), a vector
    (``output="each"``) or a :class:`MonteCarloEstimate` (delta-method standard error).
    With the chaos strategy the three inner products come from one expansion of each model.
    """
    na, nb, seq = _checked_pair("similarity", a, b, metric, method, backend, strategy, output,
                                dict(n_ctx=n_ctx, position=position, n_samples=n_samples,
                                     seed=seed, max_configurations=max_configurations,
                                     device=device, max_memory=max_memory))
    if seq is not _POSITION_FREE:
        return seq
    U, keep = output_matrix(output, na.out_features, backend == "exact")
    conv = converter(backend, device, dtype)
    if method == "montecarlo":
        return montecarlo.similarity(na, nb, U, keep, n_samples, seed, backend, device, dtype)
    if backend == "exact" and method == "exact":  # refuse before any rational work
        # the pair's plan is the first one the rational path makes (and refuses on)
        refuse_if_needed(refuse_exact_early([na], None if b is a else [nb], U, keep, metric,
                                            strategy, max_flops, max_memory,
                                            max_configurations, same=b is a))
    ca, _ = stack_for([na], backend, "a")
    if method == "closure":  # one propagation gives all three
        cb = ca if b is a else stack_for([nb], backend, "b")[0]
        taa, tab, tbb = closure.triple(ca, cb, U, keep, backend)
        Xaa, Xab, Xbb = taa[0], tab[0, 0], tbb[0]
    elif b is a:
        Xaa = _engine(ca, ca, U, keep, metric, method, backend, device, dtype, strategy,
                      max_flops, max_memory, max_configurations, same=True)[0, 0]
        Xab = Xbb = Xaa
    else:
        cb, _ = stack_for([nb], backend, "b")
        p = None
        if method == "exact":
            p = make_plan(ca, cb, U, keep, metric, backend, device, dtype, strategy, max_flops,
                          max_memory, max_configurations)
            refuse_if_needed(p)
        if p is not None and p.strategy == "chaos":
            Xaa, Xab, Xbb = (x[0, 0] for x in chaos.triple(
                ca, cb, U, keep, conv=conv if backend == "torch" else None))
        else:
            args = (U, keep, metric, method, backend, device, dtype, strategy, max_flops,
                    max_memory, max_configurations)
            Xaa = _engine(ca, ca, *args, same=True)[0, 0]
            if p is not None:
                Xab = wick.compute(p._joined, backend, device, dtype,
                                   shared=p.wick_shared)[0, 0]
            else:
                Xab = _engine(ca, cb, *args)[0, 0]
            Xbb = _engine(cb, cb, *args, same=True)[0, 0]
    sim = _sim_from(Xab, Xaa, Xbb, backend, "a or b")
    if backend != "exact" and not keep:
        return float(sim)
    return sim


def _gram_plans(ca, cb, U, keep, metric, backend, device, dtype, strategy, max_flops,
                max_memory, max_configurations, same):
    """The exact cross Gram's plans in the order :func:`_gram_blocks` makes and checks them:
    ``(plan, ia, sa, sb)``: ``ia`` the rows of a Wick block and ``sa``, ``sb`` its stacks, or
    ``(plan, None, ca, cb)`` when the plan computes the whole matrix at once. A refused plan
    is the last one (the computation raises on it). Shared with the exact backend's early
    refusal (:func:`tensoralg.planner.refuse_exact_early`, on float copies of the stacks), so
    both decide alike."""
    Na, Nb = ca.arrays()[0].shape[0], cb.arrays()[0].shape[0]
    budget = (max_flops, max_memory, max_configurations)
    p = make_plan(ca, cb, U, keep, metric, backend, device, dtype, strategy, *budget, same=same)
    if Na * Nb == 1 or p.strategy == "chaos" or strategy == "chaos":
        yield p, None, ca, cb  # (a forced chaos over budget is refused as chaos, never Wick)
        return
    # Wick: keep the largest intermediate of one block under _MAX_INTERMEDIATE
    one = make_plan(ca.sub([0]), cb.sub([0]), U, keep, metric, backend, device, dtype, "wick",
                    *budget)
    if one.refused:
        if strategy == "auto":  # name every strategy's estimate, as inner() does
            both = make_plan(ca.sub([0]), cb.sub([0]), U, keep, metric, backend, device,
                             dtype, "auto", *budget)
            one = both if both.refused else one
        yield one, [0], None, None
        return
    per_pair = max(1, one.largest_intermediate)
    block = max(1, int(math.isqrt(max(1, _MAX_INTERMEDIATE // per_pair))))
    if block >= max(Na, Nb):
        yield p, None, ca, cb
        return
    for i0 in range(0, Na, block):
        for j0 in range(0, Nb, block):
            ia, jb = list(range(i0, min(Na, i0 + block))), list(range(j0, min(Nb, j0 + block)))
            sa, sb = ca.sub(ia), cb.sub(jb)
            pb = make_plan(sa, sb, U, keep, metric, backend, device, dtype, "wick", *budget)
            yield pb, ia, sa, sb
            if pb.refused:
                return


def _gram_blocks(ca, cb, U, keep, metric, method, backend, device, dtype, strategy, max_flops,
                 max_memory, max_configurations, same):
    """Cross Gram (Na, Nb[, K]) in normalized gauge; the Wick strategy runs in blocks when its
    intermediates are large (the chaos strategy expands each model once)."""
    if method != "exact":
        return _engine(ca, cb, U, keep, metric, method, backend, device, dtype, strategy,
                       max_flops, max_memory, max_configurations, same=same)
    rows: dict[int, list] = {}
    for p, ia, sa, sb in _gram_plans(ca, cb, U, keep, metric, backend, device, dtype, strategy,
                                     max_flops, max_memory, max_configurations, same):
        refuse_if_needed(p)
        if ia is None:
            return _run(p, sa, sb, U, keep, backend, device, dtype, same)
        rows.setdefault(ia[0], []).append(_run(p, sa, sb, U, keep, backend, device, dtype,
                                               False))
    return np.concatenate([np.concatenate(rows[i], axis=1) for i in sorted(rows)], axis=0)


def _refuse_gram_early(nets_a, nets_b, U, keep, metric, strategy, max_flops, max_memory,
                       max_configurations, same, name_a, name_b):
    """The exact backend's Gram refusal before any rational conversion: the plans of
    :func:`_gram_plans` made on certified float copies of the stacks
    (:func:`tensoralg.planner.refuse_exact_early`); raises CostTooHigh with the message the
    rational path would give, else returns (and the rational path decides)."""
    def plans(ca, cb, Uf, same_):
        return _gram_plans(ca, cb, Uf, keep, metric, "exact", None, None, strategy, max_flops,
                           max_memory, max_configurations, same_)

    refuse_if_needed(refuse_exact_early(nets_a, None if same else nets_b, U, keep, metric,
                                        strategy, max_flops, max_memory, max_configurations,
                                        same=same, name_a=name_a, name_b=name_b, plans=plans))


def cross_gram(models_a: Iterable[Any], models_b: Iterable[Any], metric: str = "gaussian",
               method: str = "exact", backend: str = "numpy", output: Any = None, *,
               strategy: str = "auto", n_samples: int = 100_000, seed: int = 0,
               device: Any = None, dtype: Any = None, max_flops: float | None = None,
               max_memory: float | None = None,
               max_configurations: int = DEFAULT_MAX_CONFIGURATIONS):
    """Matrix ``G[i, j] = <a_i, b_j>`` of shape ``(Na, Nb)`` (``(Na, Nb, out)`` for
    ``output="each"``) for two collections of same-architecture models (networks, modules with
    ``to_network()``, specs, or checkpoint folders, loaded one at a time). With the chaos
    strategy each model is expanded once and the matrix is one matrix product; with Wick the
    models are stacked on a batch index and each configuration is one batched contraction (not
    Na*Nb calls). Returns a float64 array (object array of Fractions with backend="exact"; a
    :class:`MonteCarloArray` with ``.stderr`` for method="montecarlo")."""
    check_options(metric, method, backend, strategy)
    same = models_a is models_b
    name_a, name_b = ("models", "models") if same else ("models_a", "models_b")
    nets_a = networks(models_a, name_a)
    nets_b = nets_a if same else networks(models_b, name_b)
    for name, nets in ((name_a, nets_a), (name_b, nets_b)):
        seq = [i for i, n in enumerate(nets) if getattr(n, "is_sequence_model", False)]
        if seq:
            raise ValueError(f"{name}[{seq[0]}]: a sequence model (with attention); cross_gram "
                             f"takes position-free networks. For sequence models use "
                             f"ta.gram(models_a + models_b, n_ctx=...) (exact: one attention "
                             f"layer) and read its off-diagonal block, or "
                             f"tensoralg.attention.closure_cross_gram (APPROXIMATE beyond one "
                             f"attention layer)")
    check_pair(nets_a[0], nets_b[0])
    U, keep = output_matrix(output, nets_a[0].out_features, backend == "exact")
    converter(backend, device, dtype)
    for n in nets_a[1:] + nets_b:
        check_pair(nets_a[0], n)
    if method == "montecarlo":
        mean, se = montecarlo.moments(nets_a, nets_b, U, keep, n_samples, seed, backend, device,
                                      dtype)
        return MonteCarloArray(mean, se, n_samples)
    if backend == "exact" and method == "exact":  # refuse before any rational work
        _refuse_gram_early(nets_a, nets_b, U, keep, metric, strategy, max_flops, max_memory,
                           max_configurations, same, name_a, name_b)
    ca, ka = stack_for(nets_a, backend, name_a)
    cb, kb = (ca, ka) if same else stack_for(nets_b, backend, name_b)
    X = _gram_blocks(ca, cb, U, keep, metric, method, backend, device, dtype, strategy,
                     max_flops, max_memory, max_configurations, same)
    return scaled(X, ka, kb, backend)


_BLOCK_KEYS = ("out", "client", "workers", "block_size", "resume")


def _blocked(kind: str, models, metric, method, backend, output, kwargs):
    """Route gram/similarity_matrix to :mod:`tensoralg.blocks` when a blocked-store option
    (``out``, ``client``, ``workers``, ``block_size``, ``resume``) is given."""
    from . import blocks

    if backend == "exact":
        raise ValueError("out=/client=/workers=/block_size=: the blocked path computes in floating "
                         "point; use backend='numpy' or 'torch' (or drop those options)")
    device = kwargs.pop("device", None)
    dev = "cpu" if backend == "numpy" else ("auto" if device is None else str(device))
    opts = {k: kwargs.pop(k) for k in _BLOCK_KEYS if k in kwargs}
    if opts.get("block_size") is None:
        opts["block_size"] = blocks.DEFAULT_BLOCK_SIZE
    for k in ("n_samples", "seed", "max_flops", "max_configurations", "n_ctx"):
        if k in kwargs:
            opts[k] = kwargs.pop(k)
    kwargs.pop("dtype", None)
    kwargs.pop("strategy", None)
    kwargs.pop("max_memory", None)
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    fn = blocks.gram if kind == "gram" else blocks.similarity_matrix
    return fn(list(models), metric=metric, method=method, output=output, device=dev, **opts)


def _sequence_matrix(kind: str, models: list, metric, method, backend, output, kwargs):
    """Gram / similarity matrices of sequence models (with attention) through
    :mod:`tensoralg.attention` (per-model work once); None for position-free models."""
    if not any(getattr(m, "is_sequence_model", False) for m in models):
        return None  # (specs, folders and modules go the position-free way, unchanged)
    if any(kwargs.get(k) is not None for k in _BLOCK_KEYS if k != "resume"):
        return None  # the blocked store (tensoralg.blocks) handles sequence models itself
    from . import attention

    for i, m in enumerate(models):  # as inner: a sequence model is not compared with an MLP
        if isinstance(m, Layer) and not m.is_sequence_model and m.degree > 1:
            raise ValueError(f"models[{i}]: a position-free network of degree {m.degree} among "
                             f"sequence models (with attention); compare sequence models (a "
                             f"per-position affine map is accepted)")
    kw = dict(kwargs)
    n_ctx, position = kw.pop("n_ctx", None), kw.pop("position", None)
    if metric != "gaussian":
        raise ValueError("sequence models: only metric='gaussian' is implemented")
    if method not in ("closure", "exact"):
        raise ValueError(f"gram / similarity_matrix of sequence models: method='closure' or "
                         f"'exact', got {method!r} (Monte Carlo: montecarlo_inner per pair)")
    device = kw.pop("device", None)
    if backend not in ("numpy", "torch"):
        raise ValueError(f"gram / similarity_matrix of sequence models: backend='numpy' or "
                         f"'torch' (float64), got {backend!r}")
    fn = attention.closure_gram if method == "closure" else attention.exact_gram
    budget = {k: kw.pop(k) for k in ("max_configurations", "max_memory") if k in kw} \
        if method == "exact" else {}
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)} for sequence models")
    kw = budget
    return fn(models, n_ctx=n_ctx, output=output, position=position,
              similarity=kind == "similarity_matrix", backend=backend, device=device, **kw)


def gram(models: Iterable[Any], metric: str = "gaussian", method: str = "exact",
         backend: str = "numpy", output: Any = None, **kwargs):
    """Gram matrix ``G[i, j] = <m_i, m_j>`` of N same-architecture models, shape ``(N, N)``
    (models, specs or checkpoint folders). Chaos: one expansion per model and one matrix
    product; Wick: batched contractions (one per configuration orbit). Diffs follow from it:
    ``||m_i - m_j||^2 = G_ii - 2 G_ij + G_jj`` (DESIGN §3.5).

    More checkpoints than fit in memory: pass ``out=FOLDER`` (a resumable block store),
    ``client=`` (a Dask client) or ``workers=N`` (a local Dask cluster), optionally
    ``block_size=`` and ``resume=``; the matrix is then computed by :mod:`tensoralg.blocks`
    (docs/distributed.md)."""
    if isinstance(models, Layer) or hasattr(models, "to_network"):
        raise TypeError("models: expected a sequence of models, got a single model")
    models = list(models)
    if not models:
        raise ValueError("models: empty sequence of models")
    seq = _sequence_matrix("gram", models, metric, method, backend, output, kwargs)
    if seq is not None:
        return seq
    if any(kwargs.get(k) is not None for k in _BLOCK_KEYS if k != "resume"):
        return _blocked("gram", models, metric, method, backend, output, dict(kwargs))
    return cross_gram(models, models, metric=metric, method=method, backend=backend,
                      output=output, **kwargs)


def similarity_matrix(models: Iterable[Any], metric: str = "gaussian", method: str = "exact",
                      backend: str = "numpy", output: Any = None, **kwargs):
    """``S[i, j] = G_ij / sqrt(G_ii G_jj)`` from one :func:`gram` call (normalized gauge:
    unaffected by the models' output scales). Raises ValueError if a model has norm 0.
    ``out=``/``client=``/``workers=``/``block_size=``/``resume=`` as in :func:`gram` (blocked,
    resumable, optionally on Dask)."""
    check_options(metric, method, backend, kwargs.get("strategy", "auto"))
    if isinstance(models, Layer) or hasattr(models, "to_network"):
        raise TypeError("models: expected a sequence of models, got a single model")
    models = list(models)
    if not models:
        raise ValueError("models: empty sequence of models")
    seq = _sequence_matrix("similarity_matrix", models, metric, method, backend, output, kwargs)
    if seq is not None:
        return seq
    if any(kwargs.get(k) is not None for k in _BLOCK_KEYS if k != "resume"):
        return _blocked("similarity_matrix", models, metric, method, backend, output,
                        dict(kwargs))
    if method == "montecarlo":
        G = gram(models, metric=metric, method=method, backend=backend, output=output, **kwargs)
        dg = np.einsum("ii...->i...", np.asarray(G))
        if np.any(dg <= 0):
            raise ValueError("similarity_matrix: a model has (sampled) norm zero")
        return np.clip(np.asarray(G) / np.sqrt(np.einsum("i...,j...->ij...", dg, dg)), -1, 1)
    nets = networks(models, "models")
    for n in nets[1:]:
        check_pair(nets[0], n)
    U, keep = output_matrix(output, nets[0].out_features, backend == "exact")
    converter(backend, device=kwargs.get("device"), dtype=kwargs.get("dtype"))
    budget = (kwargs.get("max_flops"), kwargs.get("max_memory"),
              kwargs.get("max_configurations", DEFAULT_MAX_CONFIGURATIONS))
    if backend == "exact" and method == "exact":  # refuse before any rational work
        _refuse_gram_early(nets, nets, U, keep, metric, kwargs.get("strategy", "auto"), *budget,
                           True, "models", "models")
    c, _ = stack_for(nets, backend, "models")
    X = _gram_blocks(c, c, U, keep, metric, method, backend, kwargs.get("device"),
                     kwargs.get("dtype"), kwargs.get("strategy", "auto"), *budget, True)
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
    for k in ("max_flops", "max_configurations", "max_memory", "strategy"):
        kw.pop(k, None)
    if kw.pop("metric", "gaussian") != "gaussian":
        raise ValueError("metric='frobenius' has no Monte Carlo estimate; use method='exact'")
    if kw:
        raise TypeError(f"unexpected keyword arguments {sorted(kw)}")
    check_options("gaussian", "montecarlo", backend)
    nets = [as_network(m, "model") for m, _ in left + right]
    for n in nets[1:]:
        check_pair(nets[0], n)
    U, keep = output_matrix(output, nets[0].out_features, False)
    converter(backend, device, dtype)
    montecarlo.check_mc(n_samples, seed, backend)
    montecarlo.warn_few(n_samples)
    alpha = np.array([c for _, c in left], dtype=np.float64)
    beta = np.array([c for _, c in right], dtype=np.float64)
    nl = len(left)
    s1 = s2 = 0.0
    for F, w in montecarlo.features(nets, np.asarray(U, dtype=np.float64), n_samples, seed, backend,
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
        if "architecture differs" not in str(exc) or isinstance(exc, CostTooHigh):
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
        if "architecture differs" not in str(exc) or isinstance(exc, CostTooHigh):
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


def plan(a: Any, b: Any = None, metric: str = "gaussian", output: Any = None, *,
         backend: str = "numpy", strategy: str = "auto", device: Any = None, dtype: Any = None,
         max_flops: float | None = None, max_memory: float | None = None,
         max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, n_ctx: int | None = None,
         position: Any = None) -> Plan | SequencePlan:
    """The planner's decision for the exact inner product ``<a, b>`` (``<a, a>`` if ``b`` is
    None): every applicable strategy's estimate (Wick: configurations before and after
    zero-pattern and symmetry reduction, FLOPs and intermediates of the opt_einsum paths — or,
    when a lower bound on its FLOPs already exceeds ``max_flops`` or an affordable chaos
    expansion of at least ``planner.BOUND_MIN_FLOPS``, that bound, marked as one, in
    ``wick_lower_bound``; chaos: coefficients, FLOPs, memory), the choice and why. Contracts nothing and allocates nothing
    large; ``refused`` is set exactly when :func:`inner` with the same arguments would raise
    :class:`~tensoralg.CostTooHigh` (then ``flops = inf``).

    Sequence models (with :class:`~tensoralg.BilinearAttention`; ``n_ctx`` and ``position`` as
    in :func:`inner`): a :class:`~tensoralg.planner.SequencePlan` of what :func:`inner` does
    with the same options — the exact one-attention-layer path of :mod:`tensoralg.attention`
    with its number of Wick configurations, each model's canonical tree (terms, legs and the
    positions they read), or the refusal (a model outside the exact path, e.g. two attention
    layers; over ``max_configurations``: both :class:`~tensoralg.CostTooHigh`) naming
    the alternatives (``method="closure"``, ``method="montecarlo"``); ``refused`` is set exactly
    when :func:`inner` refuses; within ``max_configurations`` the estimated peak memory
    (:func:`tensoralg.attention.chaos_memory_bytes`, a dry run) is held against
    ``max_memory``. ``max_flops``, ``strategy`` and ``dtype`` do not apply to that path.

    Raises:
        ValueError: what :func:`inner` raises for the same arguments before any work (bad
            options, sizes, ``output``, ``position``, ``n_ctx``; ``n_ctx`` / ``position`` for
            position-free networks).
    """
    check_options(metric, "exact", backend, strategy)
    na = as_network(a, "a")
    nb = na if b is None else as_network(b, "b")
    check_pair(na, nb)
    if _is_sequence(na, nb):
        return plan_sequence(na, nb, metric, output, position, n_ctx, backend, device,
                             max_configurations, max_memory)
    if n_ctx is not None or position is not None:
        raise ValueError("n_ctx / position: only for sequence models (with attention)")
    U, keep = output_matrix(output, na.out_features, backend == "exact")
    converter(backend, device, dtype)
    same = b is None or b is a
    if backend == "exact":  # decided before any rational work when it is a refusal
        early = refuse_exact_early([na], None if same else [nb], U, keep, metric, strategy,
                                   max_flops, max_memory, max_configurations, same=same,
                                   full=True)
        if early is not None:
            return early
    ca, _ = stack_for([na], backend, "a")
    cb = ca if same else stack_for([nb], backend, "b")[0]
    return make_plan(ca, cb, U, keep, metric, backend, device, dtype, strategy, max_flops,
                     max_memory, max_configurations, same=same, full=True)
