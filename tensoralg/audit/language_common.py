"""Pieces of the language audit shared by its reports
([`tensoralg.audit.language`][tensoralg.audit.language], the degree report
`tensoralg.audit.language_degree`): file names, the n-gram orders and the transitions behind the
finding (docs/language.md, "Transitions and the finding")."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

JSON_NAME = "language.json"
CSV_NAME = "language.csv"
PAIRS_CSV = "language_pairs.csv"
MATRIX_FIG = "language_matrices.png"
NGRAM_FIG = "language_ngrams.png"
ORDERS = (1, 2, 3, 4)
N_TRANSITIONS = 3
#: What the n-gram agreement in every language report's JSON means.
NGRAM_DEFINITION = ("agreement[n]: fraction of held-out positions t >= 2 where the model's "
                    "argmax next token equals the argmax of the corpus n-gram predictor "
                    "(train-split counts, back-off to shorter contexts when unseen); kl[n] = "
                    "mean KL(P_n || softmax(logits)) in nats")


def consecutive_change(M: np.ndarray) -> np.ndarray:
    """``1 - M[i, i+1]`` for consecutive checkpoints, length ``N - 1``."""
    M = np.asarray(M, dtype=np.float64)
    return 1.0 - np.array([M[i, i + 1] for i in range(len(M) - 1)])


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    from scipy.stats import spearmanr

    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)      # NaN: no reliable estimate for that interval
    x, y = x[ok], y[ok]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(spearmanr(x, y).statistic)


def transitions_finding(steps: Sequence[int], mats: dict, agreement: dict,
                        k: int = N_TRANSITIONS) -> dict:
    """The numbers behind the finding (module docstring).

    ``mats``: metric name -> ``(N, N)`` matrix (similarity-like, 1 = identical; NaN where a
    Monte Carlo entry has no reliable estimate: such intervals are left out of the ranking,
    the median and the correlation); ``agreement``: n -> length-N n-gram agreement curve.
    Interval ``i`` is between checkpoints ``i`` and ``i + 1``.
    """
    steps = list(steps)
    N = len(steps)
    dA = {n: np.diff(np.asarray(a, float)) for n, a in agreement.items()}
    total = np.sum([np.abs(v) for v in dA.values()], axis=0)
    fastest = {n: int(np.argmax(v)) for n, v in dA.items()}
    # order-specific learning: what order n adds over order n - 1 (all orders agree on the most
    # common next characters, so their raw curves jump together early in training)
    orders = sorted(agreement)
    dX = {n: np.diff(np.asarray(agreement[n], float) - np.asarray(agreement[p], float))
          for p, n in itertools.pairwise(orders)}
    fastest_x = {n: int(np.argmax(v)) for n, v in dX.items()}
    # the k intervals of largest total n-gram change (do the sharpest transitions coincide?)
    top_ng = sorted(int(i) for i in np.argsort(-total, kind="stable")[:k])
    out: dict = {"intervals": [[steps[i], steps[i + 1]] for i in range(N - 1)],
                 "ngram_fastest_interval": {n: {"interval": i, "steps": [steps[i], steps[i + 1]],
                                                "agreement_gain": float(dA[n][i])}
                                            for n, i in fastest.items()},
                 "ngram_total_change": total.tolist(), "metrics": {},
                 "top_k": k, "top_k_ngram_change_intervals": top_ng,
                 "chance_top_k_ngram": (min(k, N - 1) / (N - 1)) if N > 1 else None}
    for name, M in mats.items():
        ch = consecutive_change(M)
        finite = np.flatnonzero(np.isfinite(ch))
        order = [int(finite[i]) for i in np.argsort(-ch[finite], kind="stable")[:k]]
        med = float(np.median(ch[finite])) if len(finite) else float("nan")
        tops = []
        for i in order:
            near = sorted(n for n, j in fastest.items() if abs(j - i) <= 1)
            same = sorted(n for n, j in fastest.items() if j == i)
            near_x = sorted(n for n, j in fastest_x.items() if abs(j - i) <= 1)
            tops.append({"interval": i, "steps": [steps[i], steps[i + 1]], "change": float(ch[i]),
                         "ngram_orders_fastest_same_interval": same,
                         "ngram_orders_fastest_within_1_interval": near,
                         "order_specific_fastest_within_1_interval": near_x})
        out["metrics"][name] = {
            "change": ch.tolist(),
            "n_intervals_assessed": int(len(finite)),
            "sharpest": tops,
            "sharpness_max_over_median": (float(ch[order[0]] / med) if order and med > 0
                                          else None),
            "spearman_with_ngram_change": spearman(ch, total),
            "n_sharpest_aligned_with_ngram": sum(bool(t["ngram_orders_fastest_within_1_interval"])
                                                 for t in tops),
            "n_sharpest_same_interval_as_ngram": sum(bool(t["ngram_orders_fastest_same_interval"])
                                                     for t in tops),
            "n_sharpest_within_1_of_order_specific": sum(
                bool(t["order_specific_fastest_within_1_interval"]) for t in tops),
            "n_sharpest_in_top_k_ngram_change": sum(t["interval"] in top_ng for t in tops),
        }
    # chance level: the fraction of intervals that are within one of some fastest interval
    n_int = N - 1
    covered = {j + d for j in fastest.values() for d in (-1, 0, 1) if 0 <= j + d < n_int}
    out["chance_within_1_interval"] = len(covered) / n_int if n_int else None
    out["chance_same_interval"] = len(set(fastest.values())) / n_int if n_int else None
    out["order_specific_fastest_interval"] = {
        n: {"interval": i, "steps": [steps[i], steps[i + 1]],
            "gain_over_lower_order": float(dX[n][i])} for n, i in fastest_x.items()}
    cov_x = {j + d for j in fastest_x.values() for d in (-1, 0, 1) if 0 <= j + d < n_int}
    out["chance_within_1_of_order_specific"] = len(cov_x) / n_int if n_int else None
    return out
