"""The degree report of the language audit (issue 21, item 7): under three input metrics, the
exact ``S<=1`` and ``S<=5`` matrices over all checkpoints, ``S<=9`` (Monte Carlo) and the guided
full similarity (Monte Carlo, ``proposal="modes"``) on the sharpest transitions, each estimate
with its verdict; and, per metric and degree, whether the sharpest transitions line up with
n-gram learning (docs/language.md, "The degree report").

The three metrics (every number records which one it used):

* ``residual`` — ``N(0, I_d)`` on the residual stream input ``h_0`` (``to_network()``);
* ``vocab`` — the paper's vocabulary-space metric: ``N(0, I_V)`` on the one-hot token input
  through each checkpoint's own embedding (``to_network(embedding=True)``), one distribution
  shared by all checkpoints;
* ``heldout`` — vocabulary space with ``Σ = diag(p)``, ``p`` the held-out token frequencies
  (the second moment ``E[x xᵀ]`` of the held-out one-hot tokens), so that every checkpoint's
  residual stream input ``h_0 = W_Eᵀ x`` has exactly the second moment ``W_Eᵀ diag(p) W_E`` of
  its held-out residual stream (uncentred, per position; positions independent). Tokens never
  seen in the held-out text have variance 0: ``Σ`` is singular, given to the library as the
  factor ``K = diag(sqrt(p))[:, seen]`` (``Σ = K Kᵀ``, ``ta.CovarianceFactor``).

``S<=K`` is the similarity of the degree-``<=K`` truncations (docs/mathematics.md §3.9,
"Homogeneous parts"): a different question from the full similarity, not an approximation.

Exact parts. ``S<=5``: [`tensoralg.degree_similarity_matrix`][tensoralg.degree_similarity_matrix]
(each checkpoint once, then the pairs). ``S<=1``: a ``BilinearTransformer`` has no bias and every
block is of degree >= 2 in its input, so its affine part is the direct path
``f_<=1(X)[t] = W_U W_Eᵀ K z_t`` (``W_U`` alone for ``residual``), and
``<f_<=1^a, f_<=1^b> = n_ctx tr(J_aᵀ J_b)``: a closed form of the weights (`affine_gram`), checked
in the run against ``degree_similarity_matrix(..., max_degree=1)`` on two checkpoints (residual
metric; the library reads the affine part by a DFT on the ``n_ctx·d`` basis inputs, ~22 s per
vocabulary-space checkpoint at the default size) and in tests/test_language.py on every metric.

Per pair, Monte Carlo (APPROXIMATE). In vocabulary space the pair's inputs enter only through
``K^T W_E^a`` and ``K^T W_E^b``: with ``Q`` an orthonormal basis of their joint column space
(``q <= 2 d`` columns), ``f(W_Eᵀ K z) = f(W_Eᵀ K Q Qᵀ z)`` and ``Qᵀ z ~ N(0, I_q)``, so the pair's
inner products are exactly those of ``f_a ∘ (W_E^aᵀ K Q)`` and ``f_b ∘ (W_E^bᵀ K Q)`` under
``N(0, I_q)`` (`pair_networks`; a change of variables, tested against the unreduced
networks). ``S<=9`` is [`tensoralg.degree_similarity`][tensoralg.degree_similarity] on them, the
full similarity ``tensoralg.similarity(..., method="montecarlo", proposal="modes")``; an estimate
whose diagnostics call it unreliable is "no reliable estimate", never a number, outside the JSON.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import format_table, progress, write_csv

#: The metrics of the degree report, in their order.
METRIC_NAMES = ("residual", "vocab", "heldout")
METRIC_LABELS = {
    "residual": "residual stream N(0, I)",
    "vocab": "vocabulary space N(0, I_V) (the paper's)",
    "heldout": "vocabulary space N(0, diag(held-out token frequencies))",
}
#: The degrees reported, with how each is computed.
DEGREES = ("S<=1", "S<=5", "S<=9", "full")
DEGREE_LABELS = {"S<=1": "S<=1 (exact)", "S<=5": "S<=5 (exact)",
                 "S<=9": "S<=9 (Monte Carlo)", "full": "full similarity (guided Monte Carlo)"}
NO_ESTIMATE = "no reliable estimate"
NOT_ESTIMATED = ("NOT assessed (not estimated under this metric: S<=9 and the guided full "
                 "similarity run under the metrics of --deep-metrics, on the --deep-pairs "
                 "sharpest S<=5 intervals; e.g. --deep-metrics residual,vocab,heldout)")


def matrix_name(degree: str, metric: str) -> str:
    """The key of a degree matrix in ``mats`` / the transitions: e.g. ``"S<=5 | residual"``."""
    return f"{degree} | {metric}"


def heldout_factor(held_out: np.ndarray, V: int) -> tuple[np.ndarray, dict]:
    """``K = diag(sqrt(p))[:, seen]`` (``(V, r)``, ``r`` the tokens seen) with ``K Kᵀ =
    diag(p) = E[x xᵀ]`` of the held-out one-hot tokens, and its record.

    Raises:
        ValueError: an empty held-out text or a token id outside ``[0, V)``.
    """
    toks = np.asarray(held_out, dtype=np.int64)
    if toks.size == 0:
        raise ValueError("held_out: no tokens; the held-out covariance is undefined")
    if toks.min() < 0 or toks.max() >= V:
        raise ValueError(f"held_out: token ids outside [0, {V})")
    counts = np.bincount(toks, minlength=V)
    p = counts / counts.sum()
    seen = np.flatnonzero(counts)
    K = np.diag(np.sqrt(p))[:, seen]
    rec = {"kind": "vocabulary-space second moment of the held-out one-hot tokens",
           "sigma": "diag(p), p = held-out token frequencies",
           "n_tokens": int(toks.size), "n_seen": int(seen.size),
           "unseen_token_ids": np.flatnonzero(counts == 0).tolist(),
           "frequencies": p.tolist(),
           "factor_shape": list(K.shape),
           "singular": bool(seen.size < V),
           "note": "tokens never seen held out have variance 0; Sigma = K K^T is passed as "
                   "ta.CovarianceFactor(K) with K = diag(sqrt(p))[:, seen]"}
    return K, rec


def metric_factor(metric: str, V: int, K_heldout: np.ndarray) -> np.ndarray | None:
    """The factor of the metric's input covariance in vocabulary space (None: residual)."""
    if metric == "residual":
        return None
    return np.eye(V) if metric == "vocab" else K_heldout


def metric_networks(models: Sequence[Any], metric: str) -> list:
    return [m.to_network(embedding=metric != "residual") for m in models]


def metric_cov(metric: str, K: np.ndarray | None):
    import tensoralg as ta

    return None if metric in ("residual", "vocab") else ta.CovarianceFactor(K)


def _weights(m) -> tuple[np.ndarray, np.ndarray]:
    """``(W_E (V, d), W_U (V, d))`` in float64."""
    return (m.embed.detach().double().numpy(), m.unembed.detach().double().numpy())


def affine_gram(models: Sequence[Any], metric: str, K: np.ndarray | None, n_ctx: int
                ) -> np.ndarray:
    """``G[i, j] = <f_<=1^i, f_<=1^j>`` of bias-free ``BilinearTransformer`` checkpoints under
    the metric: ``n_ctx · sum(J_i * J_j)`` with ``J = W_U`` (residual) or ``W_U W_Eᵀ K``
    (vocabulary space) — the direct path is the whole affine part (module docstring).

    Raises:
        ValueError: a model with biases (a ``BilinearTransformer`` has none) is not accepted.
    """
    Js = []
    for m in models:
        if any("bias" in n for n, _ in m.named_parameters()):
            raise ValueError("models: affine_gram needs bias-free BilinearTransformer models")
        E, U = _weights(m)
        Js.append(U if metric == "residual" else (U @ E.T) @ K)
    F = np.stack([J.ravel() for J in Js])
    return n_ctx * (F @ F.T)


def gram_to_similarity(G: np.ndarray) -> np.ndarray:
    d = np.diag(G)
    if np.any(d <= 0):
        raise ValueError(f"models {np.flatnonzero(d <= 0).tolist()}: the truncation has norm "
                         f"zero; the similarity is undefined")
    S = np.clip(G / np.sqrt(np.outer(d, d)), -1.0, 1.0)
    np.fill_diagonal(S, 1.0)
    return S


def pair_networks(ma, mb, metric: str, K: np.ndarray | None) -> tuple[Any, Any, int]:
    """The pair's networks on a common standard Gaussian input (module docstring): the
    residual-stream networks for ``residual``; in vocabulary space ``f ∘ (W_Eᵀ K Q)`` with
    ``Q`` ``(r, q)`` an orthonormal basis of the column space of ``[Kᵀ W_E^a, Kᵀ W_E^b]``.
    Returns ``(net_a, net_b, input width)``."""
    from ..layers import Linear, Sequential

    if metric == "residual":
        return ma.to_network(), mb.to_network(), int(ma.embed.shape[1])
    Ea, Eb = _weights(ma)[0], _weights(mb)[0]
    Q, _ = np.linalg.qr(np.concatenate([K.T @ Ea, K.T @ Eb], axis=1))
    return (Sequential([Linear(Ea.T @ K @ Q), ma.to_network()]),
            Sequential([Linear(Eb.T @ K @ Q), mb.to_network()]), int(Q.shape[1]))


def estimate_record(e, i: int, j: int, steps: Sequence[int], distribution: str,
                    computed_on: str) -> dict:
    """A Monte Carlo estimate as the JSON keeps it: ``value`` only when reliable (else None,
    the number under ``unreliable_estimate``), ``stderr``, ``reliable``, ``reason``, the
    certified lower bounds, the replicates."""
    d = e.diagnostics
    ok = bool(d.reliable)
    return {"i": i, "j": j, "steps": [steps[i], steps[j]],
            "value": float(e) if ok else None,
            "unreliable_estimate": None if ok else float(e),
            "stderr": float(e.stderr), "reliable": ok, "reason": d.reason,
            "max_share": d.max_share, "replicates": [list(x) for x in d.replicates],
            "certified_lower_bounds": dict(d.lower_bounds), "n_samples": int(e.n_samples),
            "distribution": distribution, "computed_on": computed_on}


def shown(r: dict | None, digits: int = 4) -> str:
    """An estimate for a table or CSV cell: the value ± stderr, or "no reliable estimate"."""
    if r is None:
        return "not assessed"
    if not r["reliable"]:
        return NO_ESTIMATE
    return f"{r['value']:.{digits}f} ± {r['stderr']:.{digits}f}"


def deep_intervals(S5: np.ndarray, k: int) -> list[int]:
    """The ``k`` consecutive intervals with the largest exact ``S<=5`` change (sharpest
    first)."""
    from .language_common import consecutive_change

    ch = consecutive_change(S5)
    return [int(i) for i in np.argsort(-ch, kind="stable")[:k]]


PATHS_HOW = ("tensoralg.decompose.transition_paths on the pair's networks: the exact joint Gram "
             "of the first-order paths (direct, each head) of both checkpoints; own change "
             "c_p = (share_before + share_after)/2 - similarity sqrt(share_before share_after), "
             "1 - S<=5 = sum_p c_p + cross terms (a bias-free stack: the sum of the first-order "
             "paths is f_<=5); second-order paths (virtual heads) are not implemented")


def transition_record(na, nb, i: int, steps: Sequence[int], n_ctx: int, s5: float,
                      computed_on: str) -> dict:
    """`transition_paths` of one interval as the JSON keeps it, with the check that its
    ``1 - S`` of the sum of the paths is the exact ``1 - S<=5`` of the matrix (same function:
    a bias-free stack's first-order paths sum to ``f_<=5``)."""
    from ..decompose.path_changes import transition_paths

    tr = transition_paths(na, nb, n_ctx=n_ctx)
    return {"i": i, "j": i + 1, "steps": [steps[i], steps[i + 1]], **tr.to_dict(),
            "summary": tr.summary(), "one_minus_S5": 1.0 - s5,
            "check_abs_difference_to_S5": abs(tr.one_minus_s - (1.0 - s5)),
            "computed_on": computed_on}


def run_metric(metric: str, models: Sequence[Any], steps: Sequence[int], K: np.ndarray | None,
               cfg, show_progress: bool = False) -> dict:
    """One metric's block of the report (module docstring)."""
    import tensoralg as ta

    n_ctx = cfg.n_ctx
    out: dict = {"metric": metric, "label": METRIC_LABELS[metric], "seconds": {}}
    cov = metric_cov(metric, K)
    t = time.perf_counter()
    G1 = affine_gram(models, metric, K, n_ctx)
    S1 = gram_to_similarity(G1)
    out["seconds"]["S<=1"] = time.perf_counter() - t
    t = time.perf_counter()
    nets = metric_networks(models, metric)
    r5 = ta.degree_similarity_matrix(nets, n_ctx=n_ctx, max_degree=(5,), cov=cov)
    S5 = np.asarray(r5[5], dtype=np.float64)
    out["seconds"]["S<=5"] = time.perf_counter() - t
    out["distribution"] = r5.distribution
    out["S<=1"] = {"matrix": S1, "gram_diagonal": np.diag(G1).tolist(), "exact": True,
                   "how": "closed form n_ctx tr(J_a^T J_b), J the direct path (the whole "
                          "affine part of a bias-free BilinearTransformer; "
                          "tensoralg.audit.language_degree.affine_gram)",
                   "distribution": r5.distribution}
    out["S<=5"] = {"matrix": S5, "exact": True, "how": r5.notes[5],
                   "distribution": r5.distribution,
                   "gram_diagonal": np.diag(r5.gram[5]).tolist()}
    deep = cfg.deep_metrics is None or metric in cfg.deep_metrics
    idx = deep_intervals(S5, cfg.deep_pairs) if deep else []
    out["deep_intervals"] = idx
    out["deep_selection"] = (f"the {len(idx)} consecutive intervals with the largest exact "
                             f"S<=5 change under this metric" if deep else
                             "none: this metric is not among --deep-metrics")
    s9, full, paths = [], [], []
    t9 = tg = tp = 0.0
    for i in progress(idx, f"S<=9 and guided ({metric})", show_progress):
        na, nb, q = pair_networks(models[i], models[i + 1], metric, K)
        how = ("the residual-stream networks" if metric == "residual" else
               f"the pair's joint {q}-dimensional input span (exact change of variables; "
               f"N(0, I_{q}) there)")
        t = time.perf_counter()
        paths.append(transition_record(na, nb, i, steps, n_ctx, float(S5[i, i + 1]), how))
        tp += time.perf_counter() - t
        t = time.perf_counter()
        ds = ta.degree_similarity(na, nb, n_ctx=n_ctx, max_degree=(9,),
                                  n_samples=cfg.degree_samples, seed=cfg.seed)
        t9 += time.perf_counter() - t
        rec = estimate_record(ds[9], i, i + 1, steps, r5.distribution, how)
        rec.update(note=ds.notes[9], library_distribution=ds.distribution,
                   seed=cfg.seed)
        s9.append(rec)
        t = time.perf_counter()
        g = ta.similarity(na, nb, n_ctx=n_ctx, method="montecarlo", proposal="modes",
                          n_samples=cfg.guided_samples, seed=cfg.seed)
        tg += time.perf_counter() - t
        rec = estimate_record(g, i, i + 1, steps, r5.distribution, how)
        rec.update(proposal="modes (guided: defensive mixture around the integrand's modes, "
                            "tensoralg.strategies.guided)", seed=cfg.seed)
        full.append(rec)
    out["seconds"]["S<=9"] = t9
    out["seconds"]["paths"] = tp
    from ..decompose.path_changes import CARRIED_RULE

    out["paths"] = {"pairs": paths, "exact": True, "rule": CARRIED_RULE,
                    "how": PATHS_HOW}
    out["seconds"]["full"] = tg
    out["S<=9"] = {"pairs": s9, "exact": False, "n_samples": cfg.degree_samples,
                   "how": "tensoralg.degree_similarity(max_degree=9): Monte Carlo on the DFT "
                          "parts, control variate exact S<=5 (APPROXIMATE)"}
    out["full"] = {"pairs": full, "exact": False, "n_samples": cfg.guided_samples,
                   "how": "tensoralg.similarity(method='montecarlo', proposal='modes') "
                          "(APPROXIMATE)"}
    return out


def sparse_matrix(N: int, pairs: Sequence[dict]) -> np.ndarray:
    """``(N, N)``: ones on the diagonal, the reliable consecutive estimates, NaN elsewhere (no
    reliable estimate or not assessed: left out of the ranking)."""
    M = np.full((N, N), np.nan)
    np.fill_diagonal(M, 1.0)
    for r in pairs:
        if r["reliable"]:
            M[r["i"], r["j"]] = M[r["j"], r["i"]] = r["value"]
    return M


def check_affine_against_library(models: Sequence[Any], n_ctx: int) -> dict:
    """``S<=1`` of the closed form against ``degree_similarity_matrix(max_degree=1)`` (the
    library's DFT of the affine part) on the first and last checkpoints, residual metric."""
    import tensoralg as ta

    t = time.perf_counter()
    two = [models[0], models[-1]]
    lib = ta.degree_similarity_matrix(metric_networks(two, "residual"), n_ctx=n_ctx,
                                      max_degree=(1,))
    G = affine_gram(two, "residual", None, n_ctx)
    rel = np.abs(G - lib.gram[1]) / np.abs(lib.gram[1]).max()
    return {"models": "first and last checkpoint, residual metric",
            "max_relative_difference_of_gram": float(rel.max()),
            "library": "tensoralg.degree_similarity_matrix(max_degree=1)",
            "seconds": time.perf_counter() - t}


# ----------------------------------------------------------------------------------------
# the finding
# ----------------------------------------------------------------------------------------

def verdict(t: dict, fin: dict) -> str:
    """The pre-declared rule of the finding (docs/language.md) on one metric's transitions."""
    k = len(t["sharpest"])
    n_al, n_same = t["n_sharpest_aligned_with_ngram"], t["n_sharpest_same_interval_as_ngram"]
    c1, c0 = fin["chance_within_1_interval"], fin["chance_same_interval"]
    if not k:
        return "NOT assessed (no reliable estimate between consecutive checkpoints)"
    if n_same / k > c0 and n_al / k > c1 and n_al >= 2:
        return "lines up"
    if n_same / k > c0 or n_al / k > c1:
        return "partly lines up"
    return "does NOT line up (no better than chance)"


def deep_rows(deep: dict, metrics: Sequence[str], S: dict) -> list[list]:
    """Rows of the S<=9 / full table and CSV: unreliable entries as text, never a number."""
    rows = []
    for metric in metrics:
        d = deep[metric]
        for r9, rf in zip(d["S<=9"]["pairs"], d["full"]["pairs"]):
            i, j = r9["i"], r9["j"]
            rows.append([metric, r9["steps"][0], r9["steps"][1],
                         float(S[matrix_name("S<=1", metric)][i, j]),
                         float(S[matrix_name("S<=5", metric)][i, j]),
                         shown(r9), r9["reason"] or "", shown(rf), rf["reason"] or ""])
    return rows


DEEP_HEADER = ["metric", "step_i", "step_j", "S<=1", "S<=5", "S<=9 (Monte Carlo)",
               "S<=9 reason", "full (guided Monte Carlo)", "full reason"]


def write_deep_csv(path, deep: dict, metrics: Sequence[str], S: dict) -> None:
    write_csv(path, DEEP_HEADER, deep_rows(deep, metrics, S))


def deep_table(deep: dict, metrics: Sequence[str], S: dict) -> str:
    rows = [[r[0], f"{r[1]}->{r[2]}", r[3], r[4], r[5], r[7]]
            for r in deep_rows(deep, metrics, S)]
    return format_table(["metric", "steps", "S<=1", "S<=5", "S<=9 (MC)", "full (guided MC)"],
                        rows)


# ----------------------------------------------------------------------------------------
# the run: outputs of the degree report
# ----------------------------------------------------------------------------------------

DEEP_CSV = "language_deep.csv"
DATA_FIG = "language_data_matrices.png"
DATA_METRICS = ("output cosine", "linear CKA", "weight cosine")
SHORT = {"residual": "res", "vocab": "voc", "heldout": "hld"}


PATHS_CSV = "language_paths.csv"
PATHS_FIG = "language_paths.png"
PATHS_HEADER = ["metric", "step_i", "step_j", "path", "similarity", "share_before",
                "share_after", "own_change", "own_change_fraction", "carries",
                "one_minus_S5", "verdict"] + [f"ngram_gain_{n}" for n in (1, 2, 3, 4)]


def paths_rows(deep: dict, metrics: Sequence[str]) -> list[list]:
    """One row per (metric, sharpest interval, path) of the path attribution."""
    rows = []
    for metric in metrics:
        for r in deep[metric].get("paths", {}).get("pairs", []):
            frac = r["own_change_fraction"] or [None] * len(r["names"])
            for p, n in enumerate(r["names"]):
                rows.append([metric, r["steps"][0], r["steps"][1], n, r["similarity"][p],
                             r["share_before"][p], r["share_after"][p], r["own_change"][p],
                             frac[p], n in r["carried_by"], r["one_minus_S5"], r["verdict"]]
                            + [r.get("ngram_gain", {}).get(str(k)) for k in (1, 2, 3, 4)])
    return rows


def paths_table(deep: dict, metrics: Sequence[str]) -> str:
    rows = [[f"{r[1]}->{r[2]}", r[0], r[3] + (" *" if r[9] else ""),
             "zero path" if r[4] is None else r[4], r[5], r[6], r[7],
             "" if r[8] is None else f"{r[8]:.0%}"]
            for r in paths_rows(deep, metrics)]
    return format_table(["steps", "metric", "path", "similarity", "share before",
                         "share after", "own change", "fraction"], rows)


def paths_lines(deep: dict, metrics: Sequence[str]) -> list[str]:
    """The finding's lines on the paths: per metric and sharpest interval, which paths carry
    the transition (`tensoralg.decompose.path_changes.CARRIED_RULE`), in numbers, next to the
    n-gram gains there."""
    out = []
    for metric in metrics:
        for r in deep[metric].get("paths", {}).get("pairs", []):
            gains = ", ".join(f"{n}-gram {v:+.3f}" for n, v in r.get("ngram_gain", {}).items())
            kind = ("the direct path" if r["carried_by"] == ["direct"] else
                    f"one head ({r['carried_by'][0]})" if r["verdict"] == "one path" else
                    r["verdict"])
            details = r["summary"][len(r["verdict"]):].strip()
            out.append(f"paths at the S<=5 transition {r['steps'][0]}->{r['steps'][1]} under "
                       f"{METRIC_LABELS[metric]}: carried by {kind} {details}; "
                       f"|1 - S of the paths' sum - (1 - S<=5)| = "
                       f"{r['check_abs_difference_to_S5']:.1e}; n-gram agreement gains there: "
                       f"{gains}")
    return out


def paths_figure(path, deep: dict, metrics: Sequence[str]):
    """One panel per (metric, sharpest interval): each first-order path's own change as a
    fraction of sum_p c_p (bars; hatched: the paths carrying the transition), with the path's
    similarity across the interval written on its bar and the n-gram gains in the title."""
    from .common import save_figure
    from .plotting import pyplot

    plt = pyplot()
    panels = [(m, r) for m in metrics for r in deep[m].get("paths", {}).get("pairs", [])]
    if not panels:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no sharpest S<=5 interval assessed (--deep-pairs 0 or no "
                "--deep-metrics)", ha="center", va="center", fontsize=9)
        return save_figure(fig, path)
    cols = min(3, len(panels))
    rows_ = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.6 * cols, 3.4 * rows_), squeeze=False,
                             layout="constrained")
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    for ax, (m, r) in zip(axes.ravel(), panels):
        frac = [0.0 if v is None else v for v in (r["own_change_fraction"] or
                                                   [0.0] * len(r["names"]))]
        bars = ax.bar(range(len(frac)), frac, color=["tab:red" if n in r["carried_by"] else
                                                     "tab:grey" for n in r["names"]])
        for b, s in zip(bars, r["similarity"]):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(),
                    "zero" if s is None else f"sim {s:.2f}", ha="center", va="bottom",
                    fontsize=6)
        ax.axhline(0.5, color="k", lw=0.6, ls=":")
        ax.set_xticks(range(len(frac)), r["names"], fontsize=7)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("own change / sum_p c_p", fontsize=7)
        gains = " ".join(f"{n}g{v:+.2f}" for n, v in r.get("ngram_gain", {}).items())
        ax.set_title(f"{SHORT[m]} {r['steps'][0]}->{r['steps'][1]}: 1-S<=5 "
                     f"{r['one_minus_S5']:.3g}, {r['verdict']}\nn-gram gains {gains}",
                     fontsize=7)
    fig.suptitle("first-order paths at the sharpest S<=5 transitions (exact; red: the paths "
                 "carrying it, dotted: half)", fontsize=9)
    return save_figure(fig, path)


def metric_line(head: str, t: dict, fin: dict, extra: str = "") -> str:
    """One line of the finding: the verdict and its numbers for one metric's transitions."""
    fmt = lambda v: "n/a" if v is None else f"{v:+.2f}"  # noqa: E731
    v = verdict(t, fin)
    k = len(t["sharpest"])
    if not k:
        return f"{head}{extra}: {v}"
    off = [x for x in t["sharpest"] if not x["ngram_orders_fastest_within_1_interval"]]
    tr = ", ".join(f"{x['steps'][0]}->{x['steps'][1]} (1-S = {x['change']:.3g})"
                   for x in t["sharpest"])
    # "every one within one interval" is no finding when chance alone puts every interval there
    # (few checkpoints): the verdict can then be "does NOT line up" beside it
    where = ("; not lined up: " + ", ".join(f"{x['steps'][0]}->{x['steps'][1]}" for x in off)
             ) if off else ("; every one within one interval of some order's fastest n-gram "
                            "gain" + (", as chance alone gives with this few intervals"
                                      if fin["chance_within_1_interval"] >= 1 else ""))
    return (f"{head}{extra}: {v} — sharpest {tr}; {t['n_sharpest_same_interval_as_ngram']} of "
            f"{k} in the interval of some order's fastest n-gram gain (chance "
            f"{fin['chance_same_interval']:.2f} each), {t['n_sharpest_aligned_with_ngram']} "
            f"within one (chance {fin['chance_within_1_interval']:.2f}), "
            f"{t['n_sharpest_in_top_k_ngram_change']} among the {fin['top_k']} intervals of "
            f"largest total n-gram change (chance {fin['chance_top_k_ngram']:.2f}), "
            f"{t['n_sharpest_within_1_of_order_specific']} within one of an order-specific "
            f"peak (chance {fin['chance_within_1_of_order_specific']:.2f}); Spearman "
            f"with the n-gram change {fmt(t['spearman_with_ngram_change'])} over "
            f"{t['n_intervals_assessed']} intervals{where}")


def run_degree_report(cfg, stage, show_progress: bool, c: dict) -> dict:
    """The degree report and its outputs (called by `tensoralg.audit.language._run`
    after training, evaluation and the data metrics; ``c`` holds what they produced)."""
    import torch

    from .common import PATHS_NOTE, stamp, write_json
    from .language_common import (
        CSV_NAME,
        JSON_NAME,
        MATRIX_FIG,
        NGRAM_DEFINITION,
        NGRAM_FIG,
        ORDERS,
        PAIRS_CSV,
        transitions_finding,
    )
    from .plotting import heatmaps

    times = c["times"]
    steps, names, scores, hist = c["steps"], c["names"], c["scores"], c["hist"]
    models = [m for _, m in c["snaps"]]
    N, V = len(models), c["V"]
    K, krec = heldout_factor(c["corpus"].held_out, V)
    deep, mats = {}, {}
    t = time.perf_counter()
    for metric in cfg.metrics:
        deep[metric] = run_metric(metric, models, steps, metric_factor(metric, V, K), cfg,
                                  show_progress)
    times["degree_report_s"] = time.perf_counter() - t
    times["degree_report_by_metric_s"] = {m: deep[m]["seconds"] for m in cfg.metrics}
    check = check_affine_against_library(models, cfg.n_ctx)
    times["affine_check_s"] = check["seconds"]
    for metric in cfg.metrics:
        mats[matrix_name("S<=1", metric)] = deep[metric]["S<=1"]["matrix"]
        mats[matrix_name("S<=5", metric)] = deep[metric]["S<=5"]["matrix"]
        mats[matrix_name("S<=9", metric)] = sparse_matrix(N, deep[metric]["S<=9"]["pairs"])
        mats[matrix_name("full", metric)] = sparse_matrix(N, deep[metric]["full"]["pairs"])
    data = {"output cosine": c["out_cos"], "linear CKA": c["cka"], "weight cosine": c["wcos"]}
    mats.update(data)
    agreement = {n: [s["agreement"][n] for s in scores] for n in ORDERS}
    fin = transitions_finding(steps, mats, agreement)
    times["paths_s"] = 0.0
    for metric in cfg.metrics:   # the n-gram gains next to each interval's paths
        times["paths_s"] += deep[metric]["seconds"]["paths"]
        for r in deep[metric]["paths"]["pairs"]:
            r["ngram_gain"] = {str(n): agreement[n][r["j"]] - agreement[n][r["i"]]
                               for n in ORDERS}

    text = ["order-specific learning (agreement[n] - agreement[n-1]) fastest at: " + "; ".join(
        f"{n}-gram: {v['steps'][0]}->{v['steps'][1]} (+{v['gain_over_lower_order']:.3f})"
        for n, v in fin["order_specific_fastest_interval"].items()),
        "fastest n-gram agreement gains: " + "; ".join(
        f"{n}-gram: steps {v['steps'][0]}->{v['steps'][1]} (+{v['agreement_gain']:.3f})"
        for n, v in fin["ngram_fastest_interval"].items())
        + "; largest total n-gram change: " + ", ".join(
            f"{steps[i]}->{steps[i + 1]}" for i in fin["top_k_ngram_change_intervals"])]
    table = {}
    for metric in cfg.metrics:
        for deg in DEGREES:
            name = matrix_name(deg, metric)
            head = f"{DEGREE_LABELS[deg]} under {METRIC_LABELS[metric]}"
            table[name] = _finding_record(fin, name, deep[metric][deg]["pairs"]
                                          if deg in ("S<=9", "full") else None)
            if deg in ("S<=1", "S<=5"):
                text.append(metric_line(head, fin["metrics"][name], fin))
                continue
            prs = deep[metric][deg]["pairs"]
            if not prs:
                table[name]["verdict"] = NOT_ESTIMATED
                text.append(f"{head}: {NOT_ESTIMATED}")
                continue
            text.append(metric_line(head, fin["metrics"][name], fin, (
                f" [estimated on {len(prs)} of {N - 1} intervals, those where S<=5 changes "
                f"most, so its counts below inherit S<=5's selection and the chance levels "
                f"are those of all {N - 1} intervals; reliable on "
                f"{sum(r['reliable'] for r in prs)}]")))
    text += paths_lines(deep, cfg.metrics)
    for name in DATA_METRICS:
        text.append(metric_line(f"{name} (data metric)", fin["metrics"][name], fin))
        table[name] = _finding_record(fin, name, None)
    text.append("final n-gram agreement: " + ", ".join(
        f"{n}-gram {agreement[n][-1]:.3f}" for n in ORDERS))
    text.append(f"S<=1 closed form vs tensoralg.degree_similarity_matrix (residual, first and "
                f"last checkpoint): max relative difference "
                f"{check['max_relative_difference_of_gram']:.1e}")

    # outputs
    t = time.perf_counter()
    labels = [str(s) for s in steps]
    exact = {f"{deg} | {METRIC_LABELS[m]}": mats[matrix_name(deg, m)]
             for m in cfg.metrics for deg in ("S<=1", "S<=5")}
    heatmaps(stage / MATRIX_FIG, exact, labels, "language checkpoints: exact S<=1 and S<=5 "
             "under each metric (S<=K: similarity of the degree-<=K truncations)",
             axis_label="step")
    heatmaps(stage / DATA_FIG, {"output cosine": c["out_cos"],
                                "linear CKA (final residual)": c["cka"],
                                "weight cosine": c["wcos"]}, labels,
             "language checkpoints: data metrics", axis_label="step")
    _figure(stage / NGRAM_FIG, steps, agreement, fin, deep, cfg.metrics)
    ch = {k: fin["metrics"][k]["change"] for k in mats}
    cols = [matrix_name(d, m) for m in cfg.metrics for d in ("S<=1", "S<=5")] + list(DATA_METRICS)
    header = (["checkpoint", "step", "train_loss", "held_out_loss", "held_out_accuracy"]
              + [f"agreement_{n}gram" for n in ORDERS] + [f"kl_{n}gram" for n in ORDERS]
              + [f"{k.replace(' ', '_')}_change_to_next" for k in cols])
    rows = []
    for i in range(N):
        rows.append([names[i], steps[i], hist["loss"][i], scores[i]["loss"],
                     scores[i]["accuracy"]] + [scores[i]["agreement"][n] for n in ORDERS]
                    + [scores[i]["kl"][n] for n in ORDERS]
                    + [(ch[k][i] if i + 1 < N else None) for k in cols])
    write_csv(stage / CSV_NAME, header, rows)
    pcols = [matrix_name(d, m) for m in cfg.metrics for d in ("S<=1", "S<=5")] + \
        list(DATA_METRICS)
    write_csv(stage / PAIRS_CSV, ["i", "j", "step_i", "step_j"]
              + [k.replace(" ", "_") for k in pcols],
              ([i, j, steps[i], steps[j]] + [float(mats[k][i, j]) for k in pcols]
               for i in range(N) for j in range(N)))
    write_deep_csv(stage / DEEP_CSV, deep, cfg.metrics, mats)
    write_csv(stage / PATHS_CSV, PATHS_HEADER, paths_rows(deep, cfg.metrics))
    paths_figure(stage / PATHS_FIG, deep, cfg.metrics)
    times["outputs_s"] = time.perf_counter() - t
    times["total_s"] = time.perf_counter() - c["t_all"]
    times["cpu_s"] = time.process_time() - c["cpu_all"]

    result = {
        **stamp("audit language", {**_asdict(cfg), "resolved_method": "degree"}),
        "metric": cfg.metric,   # Gaussian: each input metric below is a Gaussian N(0, Σ)
        "corpus": c["corpus"].provenance,
        "model": {**c["model_config"],
                  "exported": "per metric: residual stream -> logits (to_network()) or one-hot "
                              "tokens -> logits (to_network(embedding=True)); docs/language.md"},
        "report": "degree",
        "metrics_used": {m: {"label": METRIC_LABELS[m], "distribution": deep[m]["distribution"],
                             "input": ("residual stream h_0 (n_ctx, d_model)" if m == "residual"
                                       else "one-hot tokens (n_ctx, vocab)")}
                         for m in cfg.metrics},
        "heldout_covariance": krec,
        "degree_report": deep,
        "affine_check": check,
        "checkpoints": [{"name": names[i], "step": steps[i], "path": f"checkpoints/{names[i]}",
                         "train_loss": hist["loss"][i], **scores[i]} for i in range(N)],
        "matrices": {k: v for k, v in mats.items()
                     if k in data or k.startswith(("S<=1 ", "S<=5 "))},
        "matrices_note": "S<=1, S<=5: exact, every pair; S<=9 and the full similarity are "
                         "estimated on a few consecutive pairs only: degree_report[metric]"
                         "['S<=9' | 'full']['pairs'] (value null where no reliable estimate)",
        "transitions": fin,
        "finding": text,
        "finding_by_metric": table,
        "ngram_definition": NGRAM_DEFINITION,
        "times": times,
        "threads": {"torch": torch.get_num_threads(),
                    "note": "torch and BLAS threads as set by --threads (default 1)"},
        "files": [JSON_NAME, CSV_NAME, PAIRS_CSV, DEEP_CSV, PATHS_CSV, MATRIX_FIG, DATA_FIG,
                  NGRAM_FIG, PATHS_FIG, "checkpoints/"],
        "paths": PATHS_NOTE,
    }
    write_json(stage / JSON_NAME, result)
    return result


def _asdict(cfg) -> dict:
    from dataclasses import asdict

    d = asdict(cfg)
    d["metrics"] = list(d["metrics"])
    return d


def _finding_record(fin: dict, name: str, pairs) -> dict:
    t = fin["metrics"][name]
    rec = {"verdict": verdict(t, fin), "n_intervals_assessed": t["n_intervals_assessed"],
           "n_sharpest": len(t["sharpest"]),
           "n_same_interval_as_fastest_ngram": t["n_sharpest_same_interval_as_ngram"],
           "n_within_1_of_fastest_ngram": t["n_sharpest_aligned_with_ngram"],
           "n_in_top_k_ngram_change": t["n_sharpest_in_top_k_ngram_change"],
           "n_within_1_of_order_specific": t["n_sharpest_within_1_of_order_specific"],
           "chance_within_1_of_order_specific": fin["chance_within_1_of_order_specific"],
           "spearman_with_ngram_change": t["spearman_with_ngram_change"],
           "sharpness_max_over_median": t["sharpness_max_over_median"],
           "sharpest": [{"steps": x["steps"], "change": x["change"]} for x in t["sharpest"]],
           "not_lined_up": [{"steps": x["steps"], "change": x["change"]} for x in t["sharpest"]
                            if not x["ngram_orders_fastest_within_1_interval"]],
           "chance_same_interval": fin["chance_same_interval"],
           "chance_within_1_interval": fin["chance_within_1_interval"],
           "chance_top_k_ngram": fin["chance_top_k_ngram"]}
    if pairs is not None:
        rec["n_pairs_estimated"] = len(pairs)
        rec["n_reliable"] = sum(r["reliable"] for r in pairs)
    return rec


def _figure(path, steps, agreement, fin, deep, metrics):
    """n-gram agreement (shaded: the sharpest exact S<=5 transitions of the first metric), the
    exact consecutive changes, and the Monte Carlo ones where reliable ("no reliable
    estimate" marked by position only, never by a value)."""
    from matplotlib.transforms import blended_transform_factory

    from .common import save_figure
    from .plotting import pyplot

    plt = pyplot()
    fig, (ax, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    x = np.array([max(s, 0.5) for s in steps], dtype=float)   # step 0 drawn at 0.5 (log axis)
    mid = np.sqrt(x[:-1] * x[1:])
    for n, a in agreement.items():
        ax.plot(x, a, marker="o", ms=3, label=f"{n}-gram agreement")
    first = metrics[0]
    for r, t in enumerate(fin["metrics"][matrix_name("S<=5", first)]["sharpest"]):
        lo, hi = max(t["steps"][0], 0.5), t["steps"][1]
        for a_ in (ax, ax2, ax3):
            a_.axvspan(lo, hi, color="tab:red", alpha=0.15 if r else 0.3, lw=0)
    ax.set_xscale("log")
    ax.set_ylabel("top-1 agreement with n-gram")
    ax.set_title(f"n-gram learning; shaded: sharpest exact S<=5 transitions "
                 f"({METRIC_LABELS[first]})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    for m in metrics:
        for deg, ls in (("S<=1", ":"), ("S<=5", "-")):
            ax2.plot(mid, fin["metrics"][matrix_name(deg, m)]["change"], ls, marker=".",
                     label=f"{deg} | {SHORT[m]}")
    for name in DATA_METRICS:
        ax2.plot(mid, fin["metrics"][name]["change"], "--", lw=0.8, label=name)
    ax2.set_ylabel("1 - M[i, i+1] (exact / data)")
    ax2.legend(fontsize=6, loc="upper right", ncol=2)
    trans = blended_transform_factory(ax3.transData, ax3.transAxes)
    unrel = False
    for m in metrics:
        for deg, mk in (("S<=9", "s"), ("full", "^")):
            ok = [(mid[r["i"]], 1 - r["value"]) for r in deep[m][deg]["pairs"] if r["reliable"]]
            bad = [mid[r["i"]] for r in deep[m][deg]["pairs"] if not r["reliable"]]
            if ok:
                ax3.plot(*zip(*ok), mk, label=f"{deg} | {SHORT[m]} (reliable)")
            if bad:
                unrel = True
                ax3.plot(bad, [0.03] * len(bad), "x", color="grey", transform=trans)
    ax3.set_xscale("log")
    ax3.set_xlabel("training step")
    ax3.set_ylabel("1 - S (Monte Carlo)")
    ax3.set_title("S<=9 and guided full similarity on the sharpest S<=5 intervals"
                  + ("; grey x: no reliable estimate" if unrel else ""), fontsize=9)
    if ax3.get_legend_handles_labels()[0]:
        ax3.legend(fontsize=6, loc="upper right")
    return save_figure(fig, path)


def degree_table(result: dict) -> str:
    """The printed report of a degree run."""
    from .language_common import ORDERS

    metrics = list(result["metrics_used"])
    ch = {k: v["change"] for k, v in result["transitions"]["metrics"].items()}
    cks = result["checkpoints"]
    rows = []
    for i, c in enumerate(cks):
        row = [c["step"], c["loss"]] + [c["agreement"].get(str(n), c["agreement"].get(n))
                                        for n in ORDERS]
        for m in metrics:
            for d in ("S<=1", "S<=5"):
                v = ch[matrix_name(d, m)][i] if i + 1 < len(cks) else None
                row.append("" if v is None else float(v))
        rows.append(row)
    head = (["step", "held-out loss"] + [f"{n}-gram" for n in ORDERS]
            + [f"1-{d} {SHORT[m]}" for m in metrics for d in ("S<=1", "S<=5")])
    S = {k: np.asarray(v, dtype=float) for k, v in result["matrices"].items()}
    lines = ["metrics: " + "; ".join(f"{SHORT[m]} = {v['label']} [{v['distribution']}]"
                                     for m, v in result["metrics_used"].items()),
             "per checkpoint: change to the next checkpoint, 1 - S (exact)",
             format_table(head, rows), "",
             "S<=9 and the full similarity (Monte Carlo, with verdicts) on the sharpest S<=5 "
             "transitions:",
             deep_table(result["degree_report"], metrics, S), ""]
    if any(result["degree_report"][m].get("paths", {}).get("pairs") for m in metrics):
        lines += ["which first-order paths changed at the sharpest S<=5 transitions (exact; "
                  "own change c_p, its fraction of sum_p c_p; * carries the transition):",
                  paths_table(result["degree_report"], metrics), ""]
    lines += result["finding"]
    tm = result["times"]
    lines.append(f"time: {tm['total_s']:.1f} s wall, {tm['cpu_s']:.1f} s CPU (train "
                 f"{tm['train_s']:.1f} s, degree report {tm['degree_report_s']:.1f} s)")
    return "\n".join(lines)
