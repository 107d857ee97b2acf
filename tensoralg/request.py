"""One request, validated once (docs/mathematics.md §4; the model is scikit-learn's single
validation module and opt_einsum's parse -> plan -> execute).

Every public entry point (``inner``, ``norm``, ``similarity``, ``gram``, ``cross_gram``,
``similarity_matrix``, ``inner_diff``, ``diff_norm``, ``plan`` and the sequence-model functions
of `tensoralg.strategies`) turns its keyword arguments into one immutable `Request`
with `make_request` before any work. Everything below (planner, strategies, blocks)
receives the request and does not check its options again, so the same bad argument gives the
same one-line ``ValueError`` from every entry point. What depends on the models (an output
index against their output size, a position against ``n_ctx``) is checked by
`Request.output_matrix` and `Request.check_position`, once the models are known.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends import BACKENDS, converter, fraction_array
from .distribution import STANDARD, InputDistribution, input_distribution

__all__ = ["Request", "make_request", "METRICS", "METHODS", "STRATEGIES", "check_budget",
           "check_options", "MC_DEFAULT_SAMPLES", "DEFAULT_MAX_FLOPS", "DEFAULT_MAX_FLOPS_EXACT",
           "DEFAULT_MAX_FLOPS_EXACT_SEQUENCE",
           "DEFAULT_MAX_CONFIGURATIONS"]

METRICS = ("gaussian", "frobenius")
METHODS = ("exact", "closure", "montecarlo")
STRATEGIES = ("auto", "wick", "chaos")
#: Monte Carlo proposals: directions with the radius integrated exactly (docs/mathematics.md
#: §3.4), or the defensive mixture around the integrand's modes (§3.9, APPROXIMATE as well).
PROPOSALS = ("radial", "modes")
MC_DEFAULT_SAMPLES = 100_000
#: Budgets of the exact method (docs/mathematics.md §3.1): FLOPs (float backends; the exact
#: backend's rationals are far dearer per operation) and Wick configurations.
DEFAULT_MAX_FLOPS = 2e11
DEFAULT_MAX_FLOPS_EXACT = 2e7
#: ... and of the exact backend on sequence models: the attention path's contractions on
#: Fractions ran at 0.42-0.50 MFLOP/s (four one-layer pairs, d 2-4, n_ctx 2-4, one thread)
#: where the position-free stages run at 0.9-5 MFLOP/s, so 5e6 is about 10 s there as 2e7 is
#: 4-20 s here (a 2e7 default let a 65 s attention job through)
DEFAULT_MAX_FLOPS_EXACT_SEQUENCE = 5e6
DEFAULT_MAX_CONFIGURATIONS = 200_000


#: Monte Carlo diagnostics (docs/mathematics.md §3.9): the directions split into this many
#: independent replicates (disjoint, consecutive sets of directions).
MC_REPLICATES = 3
#: The fewest directions: two per replicate, for the replicates' standard errors.
MC_MIN_SAMPLES = 2 * MC_REPLICATES


def check_mc(n_samples, seed, backend) -> None:
    if backend == "exact":
        raise ValueError("method='montecarlo' samples in floating point: use backend='numpy' "
                         "or 'torch'")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or \
            n_samples < MC_MIN_SAMPLES:
        raise ValueError(f"n_samples: expected an integer >= {MC_MIN_SAMPLES} (the diagnostics "
                         f"split the directions into {MC_REPLICATES} independent replicates), "
                         f"got {n_samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_options(metric: str, method: str, backend: str, strategy: str = "auto") -> None:
    """Raises ValueError naming an unknown metric, method, backend or strategy, or a
    combination that has no meaning (Frobenius is a closed form: exact only)."""
    if not isinstance(metric, str) or metric not in METRICS:
        raise ValueError(f"metric: unknown metric {metric!r}; expected one of {METRICS}")
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; expected one of {METHODS}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; expected one of {BACKENDS}")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy: unknown strategy {strategy!r}; expected one of "
                         f"{STRATEGIES} ('wick': the tensor-network Wick sum, 'chaos': Gaussian "
                         f"chaos (Hermite) coefficients, 'auto': the cheaper within budget)")
    if metric == "frobenius" and method != "exact":
        raise ValueError(f"metric='frobenius' is a closed form of the weights: method must be "
                         f"'exact', got {method!r}")
    if strategy != "auto" and method != "exact":
        raise ValueError(f"strategy={strategy!r} chooses an exact representation; it needs "
                         f"method='exact', got method={method!r}")


def check_budget(name: str, value: Any) -> None:
    """A budget (``max_flops``, ``max_memory``) must be a positive finite number or None."""
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or \
            not np.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name}: expected a positive number (or None for the default), "
                         f"got {value!r}")


def _describe(value: Any) -> str:
    """A value for a one-line message: arrays by their shape."""
    if np.ndim(value) > 0 and not isinstance(value, str):
        return f"an array of shape {np.shape(value)}"
    return repr(value)


def check_class_index(index: Any, n_out: int | None = None, name: str = "output") -> int:
    """A class index: an int in ``0 .. n_out - 1`` (``n_out`` None: only ``>= 0`` is checked,
    before the models are known). The one rule of every entry point (the API's ``output=``,
    ``decompose``, the CLI's ``--output``): a negative index is refused, not counted from the
    last output as a Python index would be (a class index of -1 is far more often a mistake
    than a wish for the last class).

    Raises:
        ValueError: one line naming ``name``, the index and the valid range.
    """
    if not _is_int(index):
        raise ValueError(f"{name}: expected an int class index, got {index!r}")
    index = int(index)
    top = "" if n_out is None else f"0..{n_out - 1}"
    if index < 0:
        raise ValueError(f"{name}: class index {index} is negative; expected "
                         f"{top or 'an int >= 0'} (a negative index does not count from the "
                         f"last output)")
    if n_out is not None and index >= n_out:
        raise ValueError(f"{name}: class index {index} out of range for {n_out} outputs "
                         f"(expected {top})")
    return index


def _check_output(output: Any) -> Any:
    """``output`` in its normalized form: None, ``"each"``, an int ``>= 0``
    (`check_class_index`), or a read-only 1-D array (float64, or Fractions when any entry
    is rational) that is finite and not zero."""
    if output is None:
        return None
    if _is_int(output):
        return check_class_index(output)
    if isinstance(output, str):
        if output != "each":
            raise ValueError(f"output: expected None, an int, a vector or 'each'; got "
                             f"{output!r}")
        return output
    from .layers import as_array

    if isinstance(output, (bool, np.bool_, numbers.Number)) or np.ndim(output) != 1:
        raise ValueError(f"output: expected None, an int class index, a vector or 'each'; "
                         f"got {_describe(output)}")
    try:
        u = as_array(output, "output", 1)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    if not np.any(u != 0):
        raise ValueError("output: the direction u is zero; u . f is the zero function")
    u.setflags(write=False)
    return u


@dataclass(frozen=True, eq=False)
class Request:
    """What was asked, validated (build it with `make_request`).

    Attributes:
        metric: ``"gaussian"`` (E over x ~ N(0, I), docs/mathematics.md §3.1) or
            ``"frobenius"`` (§3.3).
        method: ``"exact"``, ``"closure"`` (APPROXIMATE at depth >= 2, §3.2) or
            ``"montecarlo"`` (an estimate with a standard error, §3.4).
        backend: ``"numpy"`` (float64), ``"torch"`` (``device``, ``dtype``) or ``"exact"``
            (rationals).
        strategy: ``"auto"``, ``"wick"`` or ``"chaos"`` (the exact representation).
        output: None (sum over outputs), an int class, ``"each"``, or a 1-D array ``u``
            (float64; Fractions when given rationals) for the direction ``u . f``.
        n_ctx, position: sequence length and query-position slice (sequence models).
        n_samples, seed: Monte Carlo sample count (directions) and seed.
        device, dtype: the torch device and dtype (``backend="torch"``; float64, the default,
            or float32).
        max_flops, max_memory, max_configurations: budgets of the exact method.
        distribution: the input distribution ``N(0, Σ)`` of the Gaussian metric
            (`InputDistribution`, from ``cov=``; §3.9).
        proposal: the Monte Carlo proposal, ``"radial"`` or ``"modes"`` (guided importance
            sampling, `tensoralg.strategies.guided`; §3.9).
    """

    metric: str = "gaussian"
    method: str = "exact"
    backend: str = "numpy"
    strategy: str = "auto"
    output: Any = None
    n_ctx: int | None = None
    position: Any = None
    n_samples: int = MC_DEFAULT_SAMPLES
    seed: int = 0
    device: Any = None
    dtype: Any = None
    max_flops: float | None = None
    max_memory: float | None = None
    max_configurations: int = DEFAULT_MAX_CONFIGURATIONS
    distribution: InputDistribution = STANDARD
    proposal: str = "radial"

    @property
    def exact(self) -> bool:
        """Rational arithmetic (``backend="exact"``)."""
        return self.backend == "exact"

    @property
    def budget(self) -> tuple:
        """``(max_flops, max_memory, max_configurations)``."""
        return self.max_flops, self.max_memory, self.max_configurations

    def replace(self, **changes) -> Request:
        """A new request with ``changes`` applied (validated again; the input distribution is
        kept)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "distribution"}
        if changes.get("method", self.method) != "montecarlo":   # (their defaults, unused)
            fields = {k: v for k, v in fields.items() if k not in ("n_samples", "seed")}
        return dataclasses.replace(make_request(**{**fields, **changes}),
                                   distribution=self.distribution)

    def output_matrix(self, O: int) -> tuple[np.ndarray, bool]:
        """Output projection ``U`` ``(K, O)`` and whether the projected index stays open
        (``output="each"``): float64, or Fractions with ``backend="exact"``.

        Raises:
            ValueError: a class index out of range or a direction whose length is not ``O``.
        """
        out = self.output
        keep = isinstance(out, str)
        if out is None or keep:
            U = np.eye(O, dtype=np.float64)
        elif _is_int(out):
            U = np.zeros((1, O))
            U[0, check_class_index(out, O)] = 1.0
        else:
            if out.shape != (O,):
                raise ValueError(f"output: a direction vector must have shape ({O},), got "
                                 f"{out.shape} (it does not match the {O} outputs)")
            if self.exact:
                return fraction_array(out[None, :]), False
            return np.asarray(out, dtype=np.float64)[None, :], False
        return (fraction_array(U) if self.exact else U), keep

    def check_position(self, n_ctx: int) -> None:
        """Raises ValueError for a ``position`` outside ``[-n_ctx, n_ctx)``."""
        p = self.position
        if p is not None and not isinstance(p, str) and not -n_ctx <= p < n_ctx:
            raise ValueError(f"position: expected None, 'each' or an int in [-{n_ctx}, "
                             f"{n_ctx}), got {p!r}")


def make_request(*, metric: str = "gaussian", method: str = "exact", backend: str = "numpy",
                 strategy: str = "auto", output: Any = None, n_ctx: Any = None,
                 position: Any = None, n_samples: Any = None, seed: Any = None,
                 device: Any = None, dtype: Any = None, max_flops: Any = None,
                 max_memory: Any = None,
                 max_configurations: Any = DEFAULT_MAX_CONFIGURATIONS,
                 cov: Any = None, proposal: Any = "radial") -> Request:
    """Validate every option once, in a fixed order, and return the `Request`.

    Raises:
        ValueError: an unknown metric / method / backend / strategy or a combination without
            meaning; a budget that is not a positive number; ``max_configurations`` not a
            positive int; a device for a CPU-only backend or an unknown dtype/device;
            ``n_ctx`` not a positive int; ``position`` not None, ``"each"`` or an int;
            ``output`` not None, an int, ``"each"`` or a finite non-zero vector;
            (``method="montecarlo"``) ``n_samples`` not an int >= 6 (three replicates), ``seed`` not a
            non-negative int, or the exact backend; ``n_samples`` or ``seed`` given (not None)
            with another method, which does not sample; a ``cov`` that is not a valid input
            covariance (`tensoralg.distribution.input_distribution`), or ``cov`` with
            ``metric="frobenius"``; a ``proposal`` other than ``"radial"`` / ``"modes"``, or
            ``"modes"`` without ``method="montecarlo"``.
    """
    key = (metric, method, backend, strategy, output, n_ctx, position, n_samples, seed,
           device, dtype, max_flops, max_memory, max_configurations, proposal)
    types = tuple(type(v) for v in key)
    if cov is None and all(t in _CACHEABLE for t in types):
        # the types are part of the key: 1000 and 1000.0 are equal dict keys, not equal options
        req = _RECENT.get((key, types))
        if req is None:
            req = _make_request(*key, None)
            if len(_RECENT) >= 256:
                _RECENT.clear()
            _RECENT[(key, types)] = req
        return req
    return _make_request(*key, cov)


#: Requests of hashable plain options, already validated (a warm call skips the checks).
_RECENT: dict = {}
_CACHEABLE = (type(None), str, int, float)


def _make_request(metric, method, backend, strategy, output, n_ctx, position, n_samples, seed,
                  device, dtype, max_flops, max_memory, max_configurations, proposal,
                  cov) -> Request:
    check_options(metric, method, backend, strategy)
    check_budget("max_flops", max_flops)
    check_budget("max_memory", max_memory)
    if not _is_int(max_configurations) or max_configurations <= 0:
        raise ValueError(f"max_configurations: expected a positive integer, got "
                         f"{max_configurations!r}")
    converter(backend, device, dtype)  # device / dtype names
    if n_ctx is not None and (not _is_int(n_ctx) or n_ctx < 1):
        raise ValueError(f"n_ctx: expected a positive int, got {n_ctx!r}")
    if position is not None and not (isinstance(position, str) and position == "each") \
            and not _is_int(position):
        raise ValueError(f"position: expected None, 'each' or an int, got {position!r}")
    output = _check_output(output)
    if method != "montecarlo":   # given explicitly to a method that does not sample
        for name, value in (("n_samples", n_samples), ("seed", seed)):
            if value is not None:
                raise ValueError(f"{name}: applies to method='montecarlo' only; "
                                 f"method={method!r} does not sample (drop {name}, or pass "
                                 f"method='montecarlo'), got {name}={value!r}")
    n_samples = MC_DEFAULT_SAMPLES if n_samples is None else n_samples
    seed = 0 if seed is None else seed
    if method == "montecarlo":
        check_mc(n_samples, seed, backend)
    if not isinstance(proposal, str) or proposal not in PROPOSALS:
        raise ValueError(f"proposal: unknown proposal {proposal!r}; expected one of "
                         f"{', '.join(map(repr, PROPOSALS))}")
    if proposal != "radial" and method != "montecarlo":
        raise ValueError(f"proposal={proposal!r} is a Monte Carlo proposal; it needs "
                         f"method='montecarlo', got method={method!r}")
    if cov is not None and metric != "gaussian":
        raise ValueError(f"cov: the input distribution belongs to the Gaussian metric; "
                         f"metric={metric!r} has none")
    distribution = input_distribution(cov, backend == "exact")
    return Request(metric=metric, method=method, backend=backend, strategy=strategy,
                   output=output, n_ctx=None if n_ctx is None else int(n_ctx),
                   position=position if position is None or isinstance(position, str)
                   else int(position), n_samples=n_samples, seed=seed, device=device,
                   dtype=dtype, max_flops=max_flops, max_memory=max_memory,
                   max_configurations=int(max_configurations), distribution=distribution,
                   proposal=proposal)

