"""First-order paths of a transformer over training: which path changed, and how much
(docs/mathematics.md §3.10; docs/decompose.md, "Paths over training").

* `paths_over_training` — checkpoints ``f_0, ..., f_{N-1}`` of one architecture: every
  first-order path's exact similarity to the same path of the final checkpoint and of the next
  one, and its share of ``||sum of the listed paths||^2`` per checkpoint. Each checkpoint's own
  path Gram is computed once (its diagonal gives every similarity's norms); the cross terms are
  ``2 P`` inner products per checkpoint (``P`` paths), never a full cross-Gram.
* `transition_paths` — two checkpoints ``a -> b``: which paths carry the change of the sum of
  the listed paths (``f_{<=5}`` of a bias-free stack of attention layers, so its similarity is
  ``S<=5``). With ``F = sum_p p`` and ``u_p = p / ||F||`` (each model normalized by its own sum),

      1 - S(F_a, F_b) = 1/2 || sum_p (u_p^b - u_p^a) ||^2
                      = sum_p c_p + (cross terms),
      c_p = 1/2 ||u_p^b - u_p^a||^2
          = (share_p^a + share_p^b) / 2 - sim_p sqrt(share_p^a share_p^b),

  exactly (the joint Gram of the ``2 P`` path networks). ``c_p`` is path ``p``'s own change: it
  grows with how far the path turned (``1 - sim_p``) and with how much of the function it is
  (its shares), and it is ``share (1 - sim)`` when the share did not move. **The rule**
  (`CARRIED_RULE`): the transition is carried by the smallest set of paths, largest ``c_p``
  first, whose own changes sum to more than half of ``sum_p c_p``; one path ("L1.H0", or
  "direct") when that set has one element, several otherwise. The cross terms are reported
  beside it (they are what the paths' changes share).

Second-order paths (a leg of a later head reading an earlier head) are not listed here: their
exact engine (`tensoralg.decompose.sequence_paths.ORDER2_MESSAGE`) fits small models only, so
the remainder ``f - sum of the listed paths`` is not attributed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ..canonical import resolve_n_ctx
from ..layers import as_network
from .sequence_paths import _Engine, _path_networks, _sim, _trees

__all__ = ["PathsOverTraining", "PathTransition", "paths_over_training", "transition_paths",
           "CARRIED_RULE", "path_change"]

#: The declared rule of `transition_paths` (also in docs/decompose.md).
CARRIED_RULE = ("a transition is carried by the smallest set of first-order paths, largest own "
                "change c_p = (share_a + share_b)/2 - sim sqrt(share_a share_b) first, whose own "
                "changes sum to more than half of sum_p c_p: one path when that set has one "
                "element (a head, an MLP or the direct path), several otherwise")


def path_change(sim: float | None, share_a: float, share_b: float) -> float:
    """``c_p = (share_a + share_b)/2 - sim sqrt(share_a share_b)`` (module docstring): half the
    squared distance between the path normalized by each model's sum of listed paths. A path
    that is zero in one model (``sim`` None) changes by ``(share_a + share_b)/2``."""
    s = 0.0 if sim is None else float(sim)
    return max(0.5 * (share_a + share_b) - s * math.sqrt(max(share_a * share_b, 0.0)), 0.0)


def _carried(names: list, change: np.ndarray) -> list:
    """The rule of `CARRIED_RULE`: names of the smallest set, largest first."""
    total = float(np.sum(change))
    if not total > 0:
        return []
    out, acc = [], 0.0
    for i in np.argsort(-change, kind="stable"):
        out.append(names[int(i)])
        acc += float(change[i])
        if acc > 0.5 * total:
            break
    return out


def _prepare(models: list, n_ctx: Any, what: str):
    """Networks, their path networks and ``n_ctx``; one-line ValueErrors before any work."""
    nets = [as_network(m, f"{what}[{k}]") for k, m in enumerate(models)]
    for k, x in enumerate(nets):
        if not x.is_sequence_model:
            raise ValueError(f"{what}[{k}]: a position-free (vector) network; paths over "
                             f"training take transformers (sequence models); the paths of a "
                             f"vector network: tensoralg.decompose.paths / path_similarity")
    for k, x in enumerate(nets[1:], 1):
        if (x.in_features, x.out_features) != (nets[0].in_features, nets[0].out_features):
            raise ValueError(f"{what}[{k}]: maps {x.in_features} -> {x.out_features}, "
                             f"{what}[0] maps {nets[0].in_features} -> {nets[0].out_features}")
    n_ctx = resolve_n_ctx([(f"{what}[{k}]", x) for k, x in enumerate(nets)], n_ctx)
    pn = [_path_networks(x, f"{what}[{k}]") for k, x in enumerate(nets)]
    for k, p in enumerate(pn[1:], 1):
        if p[0] != pn[0][0]:
            raise ValueError(f"{what}[{k}]: paths {p[0]}, {what}[0] has {pn[0][0]}; paths are "
                             f"compared between models with the same layers and heads")
    return nets, pn, n_ctx


def _check_backend(backend: str) -> None:
    if backend not in ("numpy", "torch", "exact"):
        raise ValueError(f"backend: expected 'numpy', 'torch' or 'exact', got {backend!r}")


def _method(backend: str) -> str:
    return ("exact (chaos sums of the exact sequence engine, " +
            ("rationals" if backend == "exact" else f"float64, {backend}") + ")")


# ----------------------------------------------------------------------------------------
# over training
# ----------------------------------------------------------------------------------------

@dataclass
class PathsOverTraining:
    """Result of `paths_over_training` (``N`` checkpoints, ``P`` listed first-order paths).

    Attributes:
        names: the paths (`SequencePathDecomposition` names: ``"direct"``, ``"L0.H1"``,
            ``"L1.MLP"``, ...).
        kinds: ``"direct"``, ``"head"``, ``"mlp"``, ... per path.
        labels: one label per checkpoint.
        n_ctx: the sequence length of every number.
        gram: ``(N, P, P)`` each checkpoint's exact path Gram (float; the exact backend's
            Fractions converted at the end).
        norm2_listed: ``(N,)`` ``||sum of the listed paths||^2`` per checkpoint.
        share: ``(N, P)`` ``gram[k, p, p] / norm2_listed[k]``.
        to_final: ``(N, P)`` the exact similarity of each path to the same path of the final
            checkpoint (NaN where the path is zero in either).
        to_next: ``(N - 1, P)`` the same between checkpoints ``k`` and ``k + 1``.
        change_to_next: ``(N - 1, P)`` each path's own change ``c_p`` from ``k`` to ``k + 1``
            (`path_change`).
        method: how the numbers were computed.
    """

    names: list
    kinds: list
    labels: list
    n_ctx: int
    gram: np.ndarray
    norm2_listed: np.ndarray
    share: np.ndarray
    to_final: np.ndarray
    to_next: np.ndarray
    change_to_next: np.ndarray
    method: str

    def to_dict(self) -> dict:
        nan = lambda a: [[None if not np.isfinite(v) else float(v) for v in r]  # noqa: E731
                         for r in np.asarray(a, dtype=float)]
        return {"names": list(self.names), "kinds": list(self.kinds),
                "labels": list(self.labels), "n_ctx": self.n_ctx,
                "gram": np.asarray(self.gram, dtype=float).tolist(),
                "norm2_listed": [float(v) for v in self.norm2_listed],
                "share": nan(self.share), "to_final": nan(self.to_final),
                "to_next": nan(self.to_next), "change_to_next": nan(self.change_to_next),
                "method": self.method}

    def table(self) -> str:
        """Three tables, checkpoint x path: share, similarity to the final checkpoint,
        similarity to the next one."""
        from ..audit.common import format_table

        def cell(v):
            return "zero path" if not np.isfinite(v) else float(v)

        N = len(self.labels)
        out = []
        for what, M in (("share of ||sum of listed paths||^2", self.share),
                        ("similarity to the final checkpoint", self.to_final),
                        ("similarity to the next checkpoint", self.to_next)):
            rows = [[self.labels[k]] + [cell(v) for v in M[k]] for k in range(len(M))]
            out += [f"{what}:", format_table(["checkpoint"] + list(self.names), rows)]
        best = np.nanargmax(np.where(np.isfinite(self.change_to_next), self.change_to_next,
                                     -np.inf).sum(axis=1)) if N > 1 else None
        if best is not None:
            c = self.change_to_next[best]
            p = int(np.nanargmax(c))
            out.append(f"largest total own change of the paths: {self.labels[best]} -> "
                       f"{self.labels[best + 1]} (sum_p c_p = {np.nansum(c):.4g}; largest "
                       f"{self.names[p]}, c_p = {c[p]:.4g})")
        return "\n".join(out)

    __str__ = table


def paths_over_training(models: Any, *, n_ctx: Any = None, labels: Any = None,
                        backend: str = "numpy", device: Any = None) -> PathsOverTraining:
    """Every first-order path of checkpoints ``models[0..N-1]`` compared with the same path of
    the final checkpoint and of the next one, exactly (module docstring; docs/mathematics.md
    §3.10).

    Work: one exact path Gram per checkpoint (``P (P + 1) / 2`` path pairs; its diagonal is
    every similarity's norms) and ``2 P`` cross inner products per checkpoint (to the final and
    to the next); each path network's chaos form is built once and reused across pairs. Heads
    are compared by index (checkpoints of one training run); to compare independently trained
    models head by head, match them first (`match_heads`).

    Args:
        models: two or more sequence models (tensoralg networks, ``BilinearTransformer``s, ...)
            with the same residual structure (layers, heads per layer) and sizes.
        n_ctx: the sequence length (optional when a mask array fixes it).
        labels: one label per checkpoint (default ``"0", "1", ...``).
        backend: ``"numpy"`` / ``"torch"`` (float64) or ``"exact"`` (rationals).

    Returns:
        `PathsOverTraining`.

    Raises:
        ValueError (one line, before any contraction): fewer than two models, a vector network,
            models of different sizes or structures (naming the first that differs from
            ``models[0]``), ``n_ctx`` missing or disagreeing with a mask, ``labels`` of the
            wrong length, an unknown backend. CostTooHigh: a path pair over the exact engine's
            budget (checked for every pair before any contraction).
    """
    _check_backend(backend)
    models = list(models) if not isinstance(models, (str, bytes)) else [models]
    if len(models) < 2:
        raise ValueError(f"models: paths over training need two or more checkpoints, got "
                         f"{len(models)}")
    N = len(models)
    if labels is None:
        labels = [str(k) for k in range(N)]
    labels = [str(x) for x in labels]
    if len(labels) != N:
        raise ValueError(f"labels: {len(labels)} labels for {N} models")
    _, pn, n_ctx = _prepare(models, n_ctx, "models")
    exact = backend == "exact"
    trees = [_trees(p[1], n_ctx, exact, f"models[{k}]") for k, p in enumerate(pn)]
    names, kinds = pn[0][0], pn[0][2]
    P = len(names)
    eng = _Engine(n_ctx, backend, device)
    pairs = [(t[i], t[j]) for t in trees for i in range(P) for j in range(i, P)]
    pairs += [(trees[k][p], trees[m][p]) for k in range(N - 1) for m in {k + 1, N - 1}
              for p in range(P)]
    eng.check(pairs, "paths_over_training")

    def work():
        G = np.zeros((N, P, P))
        raw = []
        for k in range(N):
            g = [[None] * P for _ in range(P)]
            for i in range(P):
                for j in range(i, P):
                    g[i][j] = g[j][i] = eng.inner(trees[k][i], trees[k][j])
            raw.append(g)
            G[k] = [[float(v) for v in r] for r in g]
        total = np.array([float(sum(sum(r, Fraction(0) if exact else 0.0) for r in g))
                          for g in raw])

        def sim(k, m, p):
            s = _sim(eng.inner(trees[k][p], trees[m][p]), raw[k][p][p], raw[m][p][p])
            return np.nan if s is None else s

        final = np.array([[1.0 if np.isfinite(sim(N - 1, N - 1, p)) else np.nan
                           for p in range(P)] if k == N - 1 else
                          [sim(k, N - 1, p) for p in range(P)] for k in range(N)])
        nxt = np.array([[sim(k, k + 1, p) for p in range(P)] for k in range(N - 1)])
        return G, total, final, nxt

    G, total, final, nxt = eng.run(work)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.einsum("kpp->kp", G) / total[:, None]
    change = np.array([[path_change(None if not np.isfinite(nxt[k, p]) else nxt[k, p],
                                    share[k, p], share[k + 1, p]) for p in range(P)]
                       for k in range(N - 1)])
    return PathsOverTraining(list(names), list(kinds), labels, n_ctx, G, total, share, final,
                             nxt, change, _method(backend))


# ----------------------------------------------------------------------------------------
# one transition
# ----------------------------------------------------------------------------------------

@dataclass
class PathTransition:
    """Result of `transition_paths` (``P`` listed first-order paths).

    Attributes:
        names: the paths.
        kinds: ``"direct"``, ``"head"``, ``"mlp"``, ... per path.
        similarity: ``(P,)`` exact similarity of each path in ``a`` and ``b`` (NaN: a zero
            path).
        share_a: ``(P,)`` each path's share of ``a``'s ``||sum of the listed paths||^2``.
        share_b: the same in ``b``.
        change: ``(P,)`` each path's own change ``c_p`` (`path_change`).
        cross: the cross terms ``1 - S(F_a, F_b) - sum_p c_p``.
        one_minus_s: ``1 - S(F_a, F_b)``, ``F`` the sum of the listed paths (for a bias-free
            stack of attention layers ``1 - S<=5``), from the joint Gram (exact).
        carried_by: the paths carrying the change under `CARRIED_RULE` (largest first).
        verdict: ``"one path"`` or ``"several paths"`` (``"no change"`` when every ``c_p`` is 0).
        n_ctx: the sequence length of every number.
        method: how the numbers were computed.
    """

    names: list
    kinds: list
    similarity: np.ndarray
    share_a: np.ndarray
    share_b: np.ndarray
    change: np.ndarray
    cross: float
    one_minus_s: float
    carried_by: list
    verdict: str
    n_ctx: int
    method: str

    def to_dict(self) -> dict:
        f = lambda a: [None if not np.isfinite(v) else float(v) for v in a]  # noqa: E731
        total = float(np.sum(self.change))
        return {"names": list(self.names), "kinds": list(self.kinds),
                "similarity": f(self.similarity), "share_before": f(self.share_a),
                "share_after": f(self.share_b), "own_change": f(self.change),
                "own_change_fraction": f(self.change / total) if total > 0 else None,
                "sum_own_change": total, "cross_terms": float(self.cross),
                "one_minus_similarity_of_sum": float(self.one_minus_s),
                "carried_by": list(self.carried_by), "verdict": self.verdict,
                "rule": CARRIED_RULE, "n_ctx": self.n_ctx, "method": self.method}

    def summary(self) -> str:
        """One line: the verdict with its numbers."""
        total = float(np.sum(self.change))
        if not self.carried_by:
            return "no change of the first-order paths"
        parts = ", ".join(f"{n} {self.change[self.names.index(n)] / total:.0%}"
                          for n in self.carried_by)
        return (f"{self.verdict} ({parts} of sum_p c_p = {total:.3g}; cross terms "
                f"{self.cross:+.3g}; 1 - S of the sum of paths = {self.one_minus_s:.3g})")

    def table(self) -> str:
        from ..audit.common import format_table

        rows = [[n, "zero path" if not np.isfinite(s) else float(s), float(a), float(b),
                 float(c)] for n, s, a, b, c in zip(self.names, self.similarity, self.share_a,
                                                     self.share_b, self.change)]
        return "\n".join([format_table(["path", "similarity", "share before", "share after",
                                        "own change c_p"], rows), self.summary()])

    __str__ = table


def transition_paths(a: Any, b: Any, *, n_ctx: Any = None, backend: str = "numpy",
                     device: Any = None) -> PathTransition:
    """Which first-order paths carry the change from checkpoint ``a`` to ``b`` (module
    docstring: the exact identity ``1 - S(F_a, F_b) = sum_p c_p + cross terms`` and the rule
    `CARRIED_RULE`). Heads are compared by index (two checkpoints of one run).

    Work: the joint exact Gram of the ``2 P`` path networks (``P (2 P + 1)`` pairs).

    Args:
        a, b: sequence models with the same residual structure and sizes.
        n_ctx: the sequence length (optional when a mask array fixes it).
        backend: ``"numpy"`` / ``"torch"`` (float64) or ``"exact"`` (rationals).

    Returns:
        `PathTransition`.

    Raises:
        ValueError (one line, before any work): a vector network, models of different sizes or
            structures, ``n_ctx`` missing or disagreeing with a mask, a zero sum of paths.
        CostTooHigh: a path pair over the exact engine's budget (before any contraction).
    """
    _check_backend(backend)
    _, pn, n_ctx = _prepare([a, b], n_ctx, "models")
    exact = backend == "exact"
    ta_ = _trees(pn[0][1], n_ctx, exact, "a")
    tb_ = _trees(pn[1][1], n_ctx, exact, "b")
    names, kinds = pn[0][0], pn[0][2]
    P = len(names)
    T = ta_ + tb_
    eng = _Engine(n_ctx, backend, device)
    eng.check([(T[i], T[j]) for i in range(2 * P) for j in range(i, 2 * P)],
              "transition_paths")

    def work():
        g = [[None] * (2 * P) for _ in range(2 * P)]
        for i in range(2 * P):
            for j in range(i, 2 * P):
                g[i][j] = g[j][i] = eng.inner(T[i], T[j])
        return g

    g = eng.run(work)
    zero = Fraction(0) if exact else 0.0
    Faa = sum((g[i][j] for i in range(P) for j in range(P)), zero)
    Fbb = sum((g[P + i][P + j] for i in range(P) for j in range(P)), zero)
    Fab = sum((g[i][P + j] for i in range(P) for j in range(P)), zero)
    if float(Faa) <= 0 or float(Fbb) <= 0:
        raise ValueError("a and b: the sum of the listed paths is zero in "
                         f"{'a' if float(Faa) <= 0 else 'b'}; its similarity is undefined")
    S = _sim(Fab, Faa, Fbb)
    sims = np.array([np.nan if (s := _sim(g[p][P + p], g[p][p], g[P + p][P + p])) is None
                     else s for p in range(P)])
    sa = np.array([float(g[p][p]) / float(Faa) for p in range(P)])
    sb = np.array([float(g[P + p][P + p]) / float(Fbb) for p in range(P)])
    change = np.array([path_change(None if not np.isfinite(sims[p]) else sims[p], sa[p], sb[p])
                       for p in range(P)])
    carried = _carried(list(names), change)
    verdict = ("no change" if not carried else "one path" if len(carried) == 1
               else "several paths")
    one_minus = 1.0 - float(S)
    return PathTransition(list(names), list(kinds), sims, sa, sb, change,
                          one_minus - float(np.sum(change)), one_minus, carried, verdict,
                          n_ctx, _method(backend))
