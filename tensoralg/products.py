"""Inner products of multilinear networks — the public API: inner, norm, similarity, gram,
cross_gram, similarity_matrix, inner_diff, diff_norm, plan.

The headline quantity (docs/mathematics.md §3.1) is the Gaussian inner product

    <f_a, f_b>_G = sum_o E_{x ~ N(0, I_d)} [ f_a(x)_o f_b(x)_o ],

computed exactly from the weights: by Isserlis' theorem (Isserlis 1918; Wick 1950) on the lifted
input ``x~ = (1, x)`` (the Wick strategy) or through Gaussian chaos coefficients (the chaos
strategy, docs/mathematics.md §3.6), whichever the planner finds cheaper. Tensor similarity is
``sim(a, b) = <a, b> / sqrt(<a, a> <b, b>)``, invariant to every reparametrization that leaves
the functions unchanged, because two polynomials are equal iff their symmetrized coefficient
tensors are (polarization).

This module is thin: each function turns its arguments into one validated
`Request` (`make_request`) and hands it to
the function of the same name in `tensoralg.engine` (prepare -> plan -> strategy).
Units: the inner product has the units of output squared; similarity is dimensionless in [-1, 1].
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from . import engine
from .planner import Plan, SequencePlan
from .request import DEFAULT_MAX_CONFIGURATIONS, Request, make_request
from .results import ExactNorm, ExactSimilarity, mark_closure
from .strategies.montecarlo import MC_MIN_DIRECTIONS, MonteCarloArray, MonteCarloEstimate

if TYPE_CHECKING:
    import sympy

__all__ = ["inner", "norm", "similarity", "gram", "cross_gram", "similarity_matrix",
           "inner_diff", "diff_norm", "plan", "MonteCarloEstimate", "MonteCarloArray",
           "ExactSimilarity", "ExactNorm", "MC_MIN_DIRECTIONS"]

_DOC_KW = r"""
    Keyword args (shared by inner, norm, similarity, gram, cross_gram, similarity_matrix):
        metric: ``"gaussian"`` ($E$ over $x \sim N(0, I_d)$, docs/mathematics.md §3.1) or
            ``"frobenius"`` ($\langle \operatorname{Sym} T_a, \operatorname{Sym} T_b\rangle_F$ of the
            lifted coefficient tensors, docs/mathematics.md §3.3; needs the same number of
            bilinear stages on both sides; method ``"exact"`` only).
        method: ``"exact"`` (Isserlis/Wick partial-matching sum), ``"closure"`` (Gaussian
            closure, docs/mathematics.md §3.2: exact at depth 1, APPROXIMATE for depth >= 2 — the exact value
            of a different, tree-restricted form, not E[f_a f_b]; it does not certify functional
            reparametrizations of deep networks), or ``"montecarlo"`` (unbiased estimate from
            ``n_samples`` random directions (default 100 000) drawn with ``seed`` (default 0;
            both for ``"montecarlo"`` only: given with another method they raise
            ValueError), the radius along each
            integrated exactly by a Gauss rule at ``±r_q`` — 2, 4, 6, 10 network evaluations
            per direction for networks of degree 1, 2, 4, 8; carries ``.stderr``, which covers
            from ``MC_MIN_DIRECTIONS = 300`` directions on — fewer give a RuntimeWarning).
        backend: ``"numpy"`` (float64), ``"torch"`` (``device``: default CUDA when available,
            else CPU; ``dtype``: default float64), or ``"exact"`` (rational arithmetic).
        output: ``None`` (sum over outputs), an int ``c`` in ``0 .. out - 1`` (the class slice
            ``f_c``; a negative ``c`` is refused, it does not count from the last output), a vector
            ``u`` of length ``out`` (the direction ``u . f``) or ``"each"`` (one value per
            output).
        strategy: the exact representation: ``"auto"`` (default: the cheaper of the two within
            budget, see `tensoralg.planner`), ``"wick"`` (tensor-network Wick sum) or
            ``"chaos"`` (Gaussian chaos / Hermite coefficients, docs/mathematics.md §3.6; Gaussian metric).
        cov: the input distribution of the Gaussian metric, $x \sim N(0, \Sigma)$ (docs/mathematics.md
            §3.9; per position for sequence models): None ($\Sigma = I$), a positive scalar
            $\sigma^2$, a vector of variances (diagonal), a ``(d, d)`` symmetric PSD matrix,
            ``(n, d)`` activations with $n > d$ (their sample covariance) or
            `CovarianceFactor` ``(K)`` ($\Sigma = K K^\top$; rational $K$ keeps
            ``backend="exact"`` exact). Computed exactly as $\langle f_a \circ K, f_b \circ K\rangle$ under
            $N(0, I)$; plans record it (``input_distribution``).
        max_flops, max_memory, max_configurations: cost budget of the exact method, checked
            before any contraction or allocation; over it `CostTooHigh` names
            every strategy's estimate and the alternatives. Defaults: 2e11 FLOPs (2e7 with
            backend="exact", 5e6 there for sequence models), half the available memory in bytes (of the CUDA device for
            torch) and 200 000 Wick configurations.

    Raises:
        ValueError: unknown metric/method/backend/strategy/output; a budget that is not a
            positive number; input or output sizes that differ between the networks;
            (similarity) a network of norm zero.
        CostTooHigh: an exact computation over budget.
"""


_REQUEST_KEYS = tuple(inspect.signature(make_request).parameters)


def _request(fn: str, **kwargs) -> Request:
    """`make_request` for the public function ``fn``: an unknown
    keyword (a typo) is a TypeError naming ``fn``, the closest option and every option."""
    bad = [k for k in kwargs if k not in _REQUEST_KEYS]
    if bad:
        close = difflib.get_close_matches(bad[0], _REQUEST_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{fn}() got an unexpected keyword argument {bad[0]!r}{hint}; its "
                        f"options: {', '.join(_REQUEST_KEYS)}")
    return make_request(**kwargs)


def inner(a: Any, b: Any, metric: str = "gaussian", method: str = "exact",
          backend: str = "numpy", output: Any = None, *, strategy: str = "auto",
          n_samples: int | None = None, seed: int | None = None, device: Any = None,
          dtype: Any = None, max_flops: float | None = None, max_memory: float | None = None,
          max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, n_ctx: int | None = None,
          position: Any = None, cov: Any = None, proposal: str = "radial"
          ) -> float | Fraction | np.ndarray:
    r"""Inner product $\langle f_a, f_b\rangle$ of two networks with the same input and output sizes.

    Sequence models (with [`BilinearAttention`][tensoralg.BilinearAttention]; inputs
    ``(n, n_ctx, d)``) go through the sequence functions of `tensoralg.strategies`: the sum runs
    over query positions too (``position=t`` slices one, ``"each"`` keeps them), ``n_ctx`` is the
    sequence length (optional when a mask array fixes it).

    Returns a float (numpy/torch backends), a `fractions.Fraction` (exact backend), a
    NumPy vector for ``output="each"``, or a
    [`MonteCarloEstimate`][tensoralg.strategies.montecarlo.MonteCarloEstimate] for
    ``method="montecarlo"`` (an estimate, APPROXIMATE, with its standard error and
    ``diagnostics.reliable``). ``proposal="modes"`` (Monte Carlo only): guided importance sampling
    around the integrand's modes, for deep models whose norm sits in rare inputs
    (`tensoralg.strategies.guided`; docs/montecarlo.md).
    """
    req = make_request(metric=metric, method=method, backend=backend, strategy=strategy,
                       output=output, n_ctx=n_ctx, position=position, n_samples=n_samples,
                       seed=seed, device=device, dtype=dtype, max_flops=max_flops,
                       max_memory=max_memory, max_configurations=max_configurations, cov=cov,
                       proposal=proposal)
    return mark_closure(req, engine.inner(req, a, b))


def similarity(a: Any, b: Any, metric: str = "gaussian", method: str = "exact",
               backend: str = "numpy", output: Any = None, *, strategy: str = "auto",
               n_samples: int | None = None, seed: int | None = None, device: Any = None,
               dtype: Any = None, max_flops: float | None = None,
               max_memory: float | None = None,
               max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, n_ctx: int | None = None,
               position: Any = None, cov: Any = None, proposal: str = "radial"
               ) -> float | np.ndarray | list[ExactSimilarity]:
    r"""Tensor similarity $\langle a, b\rangle / (\|a\| \|b\|)$ in $[-1, 1]$ (cosine of the two
    functions under the chosen metric). $\mathrm{sim}(a, a) = 1$; symmetric (bit for bit: the pair is computed in one
    canonical order); invariant to reparametrizations that keep the functions (exact method).
    Computed in a normalized gauge so that output scales of 1e±300 cancel exactly. Returns a
    float, an `ExactSimilarity` (exact backend, vector and sequence
    models alike), a vector (``output="each"``) or a
    [`MonteCarloEstimate`][tensoralg.strategies.montecarlo.MonteCarloEstimate] (delta-method
    standard error; ``proposal="modes"`` as in [`inner`][tensoralg.products.inner]). With the chaos
    strategy the three inner products come from one expansion of each model.
    """
    req = make_request(metric=metric, method=method, backend=backend, strategy=strategy,
                       output=output, n_ctx=n_ctx, position=position, n_samples=n_samples,
                       seed=seed, device=device, dtype=dtype, max_flops=max_flops,
                       max_memory=max_memory, max_configurations=max_configurations, cov=cov,
                       proposal=proposal)
    return mark_closure(req, engine.similarity(req, a, b))


def cross_gram(models_a: Iterable[Any], models_b: Iterable[Any], metric: str = "gaussian",
               method: str = "exact", backend: str = "numpy", output: Any = None,
               **kwargs: Any) -> np.ndarray:
    r"""Matrix $G_{ij} = \langle a_i, b_j\rangle$ of shape ``(Na, Nb)`` (``(Na, Nb, out)`` for
    ``output="each"``) for two collections of same-architecture models (networks, modules with
    ``to_network()``, specs, or checkpoint folders, loaded one at a time). With the chaos
    strategy each model is expanded once and the matrix is one matrix product; with Wick the
    models are stacked on a batch index and each configuration is one batched contraction (not
    Na*Nb calls). Keywords as [`inner`][tensoralg.products.inner] (``strategy``, ``n_samples``,
    ``seed``, ``device``, ``dtype``, the budgets). Returns a float64 array (object array of
    Fractions with backend="exact"; a `MonteCarloArray` with ``.stderr`` for
    method="montecarlo")."""
    req = _request("cross_gram", metric=metric, method=method, backend=backend, output=output,
                   **kwargs)
    return mark_closure(req, engine.cross_gram(req, models_a, models_b))


_BLOCK_KEYS = ("out", "client", "workers", "block_size", "resume")


def _split_block_options(kwargs: dict) -> tuple[dict, dict]:
    """``(blocked-store options, request options)`` of gram / similarity_matrix keywords."""
    blocked = {k: kwargs[k] for k in _BLOCK_KEYS if k in kwargs}
    return blocked, {k: v for k, v in kwargs.items() if k not in _BLOCK_KEYS}


def _wants_blocks(blocked: dict) -> bool:
    return any(blocked.get(k) is not None for k in _BLOCK_KEYS if k != "resume")


def _blocked(kind: str, req: Request, models, opts: dict):
    """Route gram/similarity_matrix to `tensoralg.blocks` when a blocked-store option
    (``out``, ``client``, ``workers``, ``block_size``, ``resume``) is given."""
    from . import blocks

    engine.radial_only(req, kind)
    if req.exact:
        raise ValueError("out=/client=/workers=/block_size=: the blocked path computes in floating "
                         "point; use backend='numpy' or 'torch' (or drop those options)")
    if req.distribution.kind != "standard":
        raise ValueError("cov: the blocked path (out=/client=/workers=/block_size=) computes "
                         "under N(0, I); compose the models with the factor first, or drop "
                         "those options")
    dev = "cpu" if req.backend == "numpy" else ("auto" if req.device is None else str(req.device))
    opts = dict(opts)
    if opts.get("block_size") is None:
        opts["block_size"] = blocks.DEFAULT_BLOCK_SIZE
    output = req.output.tolist() if isinstance(req.output, np.ndarray) else req.output
    fn = blocks.gram if kind == "gram" else blocks.similarity_matrix
    return fn(list(models), metric=req.metric, method=req.method, output=output, device=dev,
              n_samples=req.n_samples, seed=req.seed, max_flops=req.max_flops,
              max_configurations=req.max_configurations, n_ctx=req.n_ctx, **opts)


def norm(a: Any, metric: str = "gaussian", method: str = "exact", backend: str = "numpy",
         output: Any = None, **kwargs: Any
         ) -> float | np.ndarray | ExactNorm | list[ExactNorm]:
    r"""$\|f_a\| = \sqrt{\langle f_a, f_a\rangle}$. With ``backend="exact"`` an
    `ExactNorm` (a float; ``.exact`` the sympy ``sqrt`` of a rational,
    ``.squared`` the rational; a list of them for ``output="each"``), with ``"montecarlo"`` an
    estimate with a delta-method stderr.
    Keywords as [`inner`][tensoralg.products.inner]."""
    req = _request("norm", metric=metric, method=method, backend=backend, output=output, **kwargs)
    return mark_closure(req, engine.norm(req, a))


def gram(models: Iterable[Any], metric: str = "gaussian", method: str = "exact",
         backend: str = "numpy", output: Any = None, **kwargs: Any) -> np.ndarray:
    r"""Gram matrix $G_{ij} = \langle m_i, m_j\rangle$ of $N$ same-architecture models, shape ``(N, N)``
    (models, specs or checkpoint folders). Chaos: one expansion per model and one matrix
    product; Wick: batched contractions (one per configuration orbit). Diffs follow from it:
    $\|m_i - m_j\|^2 = G_{ii} - 2 G_{ij} + G_{jj}$ (docs/mathematics.md §3.5). Keywords as
    [`inner`][tensoralg.products.inner].

    More checkpoints than fit in memory: pass ``out=FOLDER`` (a resumable block store),
    ``client=`` (a Dask client) or ``workers=N`` (a local Dask cluster), optionally
    ``block_size=`` and ``resume=``; the matrix is then computed by `tensoralg.blocks`
    (docs/distributed.md)."""
    blocked, kw = _split_block_options(kwargs)
    req = _request("gram", metric=metric, method=method, backend=backend, output=output, **kw)
    if _wants_blocks(blocked):
        return mark_closure(req, _blocked("gram", req, engine.models_list(models), blocked))
    return mark_closure(req, engine.gram(req, models))


def similarity_matrix(models: Iterable[Any], metric: str = "gaussian", method: str = "exact",
                      backend: str = "numpy", output: Any = None, **kwargs: Any
                      ) -> np.ndarray:
    """``S[i, j] = G_ij / sqrt(G_ii G_jj)`` from one [`gram`][tensoralg.products.gram] call
    (normalized gauge: unaffected by the models' output scales). Raises ValueError if a model has
    norm 0. With ``method="montecarlo"`` a `MonteCarloArray` from one set of directions, with a
    standard error and a verdict per entry, each equal to
    [`similarity`][tensoralg.products.similarity] of its pair with the same ``n_samples`` and
    ``seed`` (vector and sequence models).
    ``out=``/``client=``/``workers=``/``block_size=``/``resume=`` as in
    [`gram`][tensoralg.products.gram] (blocked, resumable, optionally on Dask). Keywords as
    [`inner`][tensoralg.products.inner]."""
    blocked, kw = _split_block_options(kwargs)
    req = _request("similarity_matrix", metric=metric, method=method, backend=backend,
                   output=output, **kw)
    if _wants_blocks(blocked):
        return mark_closure(req, _blocked("similarity_matrix", req, engine.models_list(models),
                                          blocked))
    return mark_closure(req, engine.similarity_matrix(req, models))


def inner_diff(a: Any, b: Any, c: Any, **kwargs: Any) -> float | Fraction | np.ndarray:
    r"""$\langle a, b - c\rangle = \langle a, b\rangle - \langle a, c\rangle$ (bilinearity,
    docs/mathematics.md §3.5), from one batched [`cross_gram`][tensoralg.products.cross_gram] call
    when ``b`` and ``c`` share an architecture. Same keywords as
    [`inner`][tensoralg.products.inner] (``output="each"`` gives one value per output). In
    floating point the difference carries the absolute error of the two terms (about
    $\varepsilon \|a\| (\|b\| + \|c\|)$). With ``method="montecarlo"`` the per-sample integrand
    is $f_a \cdot (f_b - f_c)$, so the returned estimate's ``.stderr`` accounts for the correlation
    of the two terms."""
    req = _request("inner_diff", **kwargs)
    return mark_closure(req, engine.inner_diff(req, a, b, c))


def diff_norm(b: Any, c: Any, **kwargs: Any
              ) -> float | np.ndarray | sympy.Expr | list[sympy.Expr]:
    r"""$\|b - c\| = \sqrt{\langle b,b\rangle - 2\langle b,c\rangle + \langle c,c\rangle}$ from the
    Gram matrix of ``[b, c]`` (one batched call when both have the same architecture). Exact with backend="exact": an
    `ExactNorm` (a float; ``.exact`` the sympy number, ``.squared``
    the rational ``||b - c||^2``; a list of them for ``output="each"``), as the exact
    similarity is an `ExactSimilarity`; in float64 the absolute error is about
    ``eps * (||b||^2 + ||c||^2)``, so tiny differences between large networks are best measured
    with backend="exact". ``output="each"`` gives a vector (one norm per output). With
    ``method="montecarlo"`` the integrand is ``|f_b - f_c|^2`` per sample and the standard
    error of the norm is the delta-method one, ``se(d^2) / (2 d)``; ``proposal="modes"``:
    guided importance sampling of ``|f_b - f_c|^2`` (modes of ``f_b``, ``f_c`` and ``f_b - f_c``;
    vector and sequence models, one number, with the diagnostics of
    [`inner`][tensoralg.products.inner]). The radial default takes vector and sequence models
    (directions on the sphere of ``R^(n_ctx d)``).

    Raises:
        ValueError: ``proposal="modes"`` with ``output="each"``; ``output="each"`` or
            ``position="each"`` in radial Monte Carlo of sequence models; the errors of
            [`inner`][tensoralg.products.inner]."""
    req = _request("diff_norm", **kwargs)
    return mark_closure(req, engine.diff_norm(req, b, c))


def plan(a: Any, b: Any = None, metric: str = "gaussian", output: Any = None, *,
         backend: str = "numpy", strategy: str = "auto", device: Any = None, dtype: Any = None,
         max_flops: float | None = None, max_memory: float | None = None,
         max_configurations: int = DEFAULT_MAX_CONFIGURATIONS, n_ctx: int | None = None,
         position: Any = None, cov: Any = None) -> Plan | SequencePlan:
    """The planner's decision for the exact inner product ``<a, b>`` (``<a, a>`` if ``b`` is
    None): every applicable strategy's estimate (Wick: configurations before and after
    zero-pattern and symmetry reduction, FLOPs and intermediates of the opt_einsum paths — or,
    when a lower bound on its FLOPs already exceeds ``max_flops`` or an affordable chaos
    expansion of at least ``planner.BOUND_MIN_FLOPS``, that bound, marked as one, in
    ``wick_lower_bound``; chaos: coefficients, FLOPs, memory), the choice and why. Contracts
    nothing and allocates nothing large; ``refused`` is set exactly when
    [`inner`][tensoralg.products.inner] with the same arguments would raise
    [`CostTooHigh`][tensoralg.CostTooHigh] (then ``flops = inf``).

    Sequence models (with [`BilinearAttention`][tensoralg.BilinearAttention]; ``n_ctx`` and
    ``position`` as in [`inner`][tensoralg.products.inner]): a `SequencePlan` of what
    [`inner`][tensoralg.products.inner] does with the same options — the exact one-attention-layer
    path of `tensoralg.strategies.sequence_exact` with its number of Wick configurations, each
    model's canonical tree (terms, legs and the positions they read), or the refusal (a model
    outside the exact path, e.g. two attention layers; over ``max_configurations``: both
    [`CostTooHigh`][tensoralg.CostTooHigh]) naming the alternatives (``method="closure"``,
    ``method="montecarlo"``); ``refused`` is set exactly when [`inner`][tensoralg.products.inner]
    refuses; within ``max_configurations`` the estimated peak memory and FLOPs
    (`tensoralg.strategies.sequence_exact.chaos_cost_req`, a dry run) are held against
    ``max_memory`` and ``max_flops`` (over either: CostTooHigh). ``strategy`` and ``dtype`` do not
    apply to that path.

    Raises:
        ValueError: what [`inner`][tensoralg.products.inner] raises for the same arguments before
            any work (bad options, sizes, ``output``, ``position``, ``n_ctx``; ``n_ctx`` /
            ``position`` for position-free networks).
    """
    req = make_request(metric=metric, backend=backend, strategy=strategy, output=output,
                       n_ctx=n_ctx, position=position, device=device, dtype=dtype,
                       max_flops=max_flops, max_memory=max_memory,
                       max_configurations=max_configurations, cov=cov)
    return engine.plan(req, a, b)


for _f in (inner, norm, similarity, gram, cross_gram, similarity_matrix):
    _f.__doc__ += _DOC_KW
del _f
