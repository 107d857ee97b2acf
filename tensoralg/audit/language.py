"""Language audit: a bilinear transformer trained on Python's standard library, checkpoints on a
log schedule, and four checkpoint x checkpoint similarity matrices next to the n-gram
statistics the model learns.

The experiment (issue 10). An attention-only
[`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] is trained on the character-level
corpus of `tensoralg.corpus` (next-token cross-entropy, AdamW). Checkpoints are saved at log-spaced
steps. Over all pairs of checkpoints:

Two layers (the default) or more: the **degree report** (`tensoralg.audit.language_degree`,
issue 21 item 7): under three input metrics (residual stream ``N(0, I)``, the paper's
vocabulary-space metric, a covariance matched to the held-out residual stream) the exact
``S<=1`` and ``S<=5`` matrices over all checkpoints, ``S<=9`` and the guided full similarity
(Monte Carlo, with verdicts) on the sharpest ``S<=5`` intervals, and per metric and degree
whether the sharpest transitions line up with n-gram learning. The matrices below are what
``method`` ``exact`` (one layer, the default there), ``montecarlo`` or ``closure`` compute:

* **tensor similarity** of the residual stream -> logits maps (Gaussian metric on the residual
  stream input, `BilinearTransformer.to_network`), through the public
  ``tensoralg.similarity_matrix`` when it accepts sequence models and otherwise a loop over
  ``tensoralg.inner`` (self terms once per checkpoint). One layer (``n_layers=1``):
  ``method="exact"``, and a few pairs are re-estimated by Monte Carlo with their standard
  errors. Two layers or more, where the exact similarity is out of reach
  (docs/mathematics.md §3.9): ``method="montecarlo"`` — every pair estimated from one shared
  set of directions (`tensoralg.strategies.montecarlo.montecarlo_similarity_pairs`) with its
  reliability verdict; an entry is reported only when reliable, otherwise "no reliable
  estimate" with the reason and the certified lower bounds on the norms. The moment-closure
  similarity (``method="closure"``, APPROXIMATE beyond depth 1: on trained checkpoints far from
  the tensor similarity, docs/language.md) is shown beside it only as a column labelled
  "moment-closure (approximate)" (``closure=False`` / ``--no-closure`` drops it), or as the
  matrix when asked for with ``method="closure"``;
* **output cosine**: mean cosine of the two logit vectors over held-out positions;
* **linear CKA** of the final residual stream over held-out positions;
* **weight cosine** of the flattened parameters (`tensoralg.baselines`).

Per checkpoint, the agreement of the model's next-token distribution with the corpus 1-, 2-, 3-
and 4-gram predictors (`tensoralg.corpus.ngram_scores`: top-1 agreement and KL).

Transitions. For consecutive checkpoints ``i, i+1`` (equal spacing in log step) the change of a
metric is ``1 - M[i, i+1]``. The sharpest tensor-similarity transitions are the intervals with
the largest change; the n-gram learning of order ``n`` is fastest in the interval with the
largest increase of ``agreement[n]``. The finding reports, in numbers, whether the sharpest
tensor-similarity transitions coincide (same interval, or a neighbour) with the fastest n-gram
learning, and the Spearman correlation between each metric's change profile and the total n-gram
change ``Σ_n |Δ agreement[n]|``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    PATHS_NOTE,
    check_file_writable,
    check_output_folder,
    format_table,
    progress,
    staged_output,
    stamp,
    write_csv,
    write_json,
    write_json_copy,
)
from .grokking import log_schedule  # the same log-spaced checkpoint steps
from .language_common import (  # noqa: F401
    CSV_NAME,
    JSON_NAME,
    MATRIX_FIG,
    N_TRANSITIONS,
    NGRAM_DEFINITION,
    NGRAM_FIG,
    ORDERS,
    PAIRS_CSV,
    consecutive_change,
    spearman,
    transitions_finding,
)

METHODS = ("auto", "exact", "closure", "montecarlo", "degree")
# |z| beyond which the Monte Carlo check reports a disagreement: a Gaussian is beyond 4 with
# probability 6e-5, so with the default 3 pairs a correct standard error trips it ~2e-4 of the time
Z_DISAGREE = 4.0


@dataclass
class LanguageConfig:
    """Every parameter of a language audit (all recorded in the JSON).

    Sizes: two attention layers (the issue's model) at d_model 16, n_ctx 8, 2 heads of 4, and
    the degree report (``metrics``; ``S<=9`` with ``degree_samples`` directions and the guided
    full similarity with ``guided_samples`` samples on the ``deep_pairs`` sharpest ``S<=5``
    intervals under each of ``deep_metrics``, None: every metric); ``method="montecarlo"``:
    tensor similarity by Monte Carlo with ``mc_matrix_samples`` shared directions, the
    moment-closure matrix beside it as a labelled approximation when ``closure``;
    ``n_layers=1`` gives the exact one-layer audit. ``mc_pairs`` / ``mc_samples``: the Monte Carlo check of an exact
    or (explicit) closure matrix. Measured times in docs/results/language.md, also for how far the
    closure is from Monte Carlo on these checkpoints.
    """

    n_chars: int = 200_000
    n_layers: int = 2
    d_model: int = 16
    n_heads: int = 2
    d_head: int = 4
    d_mlp: int | None = None
    n_ctx: int = 8
    rope: float | None = 10000.0
    steps: int = 3000
    checkpoints: int = 32
    batch_size: int = 64
    lr: float = 5e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_windows: int = 256
    method: str = "auto"
    mc_pairs: int = 3
    mc_samples: int = 20_000
    mc_matrix_samples: int = 4000
    closure: bool = True
    metrics: tuple = ("residual", "vocab", "heldout")
    deep_pairs: int = 3
    deep_metrics: tuple | None = None
    degree_samples: int = 1000
    guided_samples: int = 2000
    seed: int = 0
    # the similarity metric (--metric): Gaussian only; the library has no Frobenius metric for
    # sequence models (tensoralg.similarity refuses metric="frobenius" there)
    metric: str = "gaussian"

    @classmethod
    def quick(cls, **kw) -> LanguageConfig:
        base = dict(n_chars=60_000, steps=500, checkpoints=10, eval_windows=128, mc_pairs=2,
                    mc_samples=4000, mc_matrix_samples=1200, deep_pairs=1, degree_samples=300,
                    guided_samples=1000)
        base.update(kw)
        if "deep_metrics" not in kw:   # S<=9 and the guided similarity under one metric only
            ms = tuple(base.get("metrics", cls.metrics))
            base["deep_metrics"] = ("heldout",) if "heldout" in ms else ms[:1]
        return cls(**base)

    def validate(self) -> None:
        from ..corpus import HELD_OUT_EVERY, SEGMENT
        from .common import SIM_METRICS

        if self.metric not in SIM_METRICS:
            raise ValueError(f"--metric: expected one of {', '.join(SIM_METRICS)}, got "
                             f"{self.metric!r}")
        if self.metric != "gaussian":
            raise ValueError(f"--metric {self.metric}: the language audit compares bilinear "
                             f"transformers, for which only the Gaussian metric is implemented "
                             f"(the Frobenius metric covers bilinear MLPs: the backdoor, "
                             f"forgetting and grokking audits)")

        for name in ("n_layers", "d_model", "n_heads", "d_head", "n_ctx", "steps", "batch_size",
                     "eval_windows", "mc_samples", "mc_matrix_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got "
                                 f"{v!r}")
        if self.n_ctx < 4:
            raise ValueError(f"--n-ctx: expected >= 4 (the 4-gram score needs 3 tokens of "
                             f"context and one prediction), got {self.n_ctx}")
        if self.n_chars < 2 * SEGMENT * HELD_OUT_EVERY:
            raise ValueError(f"--chars: expected >= {2 * SEGMENT * HELD_OUT_EVERY}, got "
                             f"{self.n_chars}")
        if not 2 <= self.checkpoints <= self.steps + 1:
            raise ValueError(f"--checkpoints: expected 2..steps + 1 = {self.steps + 1}, got "
                             f"{self.checkpoints}")
        if self.method not in METHODS:
            raise ValueError(f"--method: expected one of {list(METHODS)}, got {self.method!r}")
        if self.method == "exact" and self.n_layers > 1:
            raise ValueError(f"--method exact: the exact similarity of sequence models handles "
                             f"one attention layer; --layers {self.n_layers} needs --method "
                             f"degree (the default there: exact S<=1 and S<=5, S<=9 and the "
                             f"full similarity by Monte Carlo with verdicts), montecarlo "
                             f"(estimates with a reliability verdict) or closure (the "
                             f"moment-closure similarity, APPROXIMATE beyond depth 1)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr: expected a positive finite learning rate, got {self.lr}")
        if not isinstance(self.closure, bool):
            raise ValueError(f"closure: expected True or False, got {self.closure!r}")
        if self.mc_pairs < 0:
            raise ValueError(f"--mc-pairs: expected >= 0, got {self.mc_pairs}")
        if self.mc_samples < 300 and self.mc_pairs:
            raise ValueError(f"--mc-samples: expected >= 300 (fewer directions make the standard "
                             f"error unreliable), got {self.mc_samples}")
        from .language_degree import METRIC_NAMES

        m = self.metrics
        if isinstance(m, str) or not isinstance(m, (tuple, list)) or not m or \
                any(x not in METRIC_NAMES for x in m) or len(set(m)) != len(m):
            raise ValueError(f"--metrics: expected distinct names from {list(METRIC_NAMES)} "
                             f"(comma-separated), got {m!r}")
        d = self.deep_metrics
        if d is not None and (isinstance(d, str) or not isinstance(d, (tuple, list)) or
                              any(x not in m for x in d) or len(set(d)) != len(d)):
            raise ValueError(f"--deep-metrics: expected distinct names among --metrics "
                             f"{','.join(m)} (comma-separated), got {d!r}")
        if self.method == "degree" and self.n_layers < 2:
            raise ValueError(f"--method degree: the degree report is for two or more layers "
                             f"(S<=9 is above a one-layer model's degree 5); --layers "
                             f"{self.n_layers} has the exact similarity (--method auto)")
        for name in ("deep_pairs", "degree_samples", "guided_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')}: expected a non-negative "
                                 f"integer, got {v!r}")
        if self.resolved_method() == "degree" and self.deep_pairs and self.deep_metrics != ():
            for name in ("degree_samples", "guided_samples"):
                if getattr(self, name) < 300:
                    raise ValueError(f"--{name.replace('_', '-')}: expected >= 300 (fewer "
                                     f"directions make the standard error unreliable), got "
                                     f"{getattr(self, name)}")
        if self.mc_matrix_samples < 300 and self.resolved_method() == "montecarlo":
            raise ValueError(f"--mc-matrix-samples: expected >= 300 (fewer directions make the "
                             f"standard error unreliable), got {self.mc_matrix_samples}")
        max_windows = (self.n_chars // HELD_OUT_EVERY) // self.n_ctx
        if self.eval_windows > max_windows:
            raise ValueError(f"--eval-windows: {self.eval_windows} windows of {self.n_ctx} tokens "
                             f"need more held-out text than the ~{self.n_chars // HELD_OUT_EVERY} "
                             f"characters of --chars {self.n_chars}; at most {max_windows}")

    def resolved_method(self) -> str:
        """``auto``: exact for one attention layer; for two or more, where the exact
        similarity is out of reach, the degree report (exact S<=1 and S<=5 matrices, S<=9 and
        the guided full similarity by Monte Carlo with verdicts, under three metrics:
        `tensoralg.audit.language_degree`) — never the closure, which is APPROXIMATE
        there (docs/mathematics.md §3.9) and runs only when asked for."""
        if self.method != "auto":
            return self.method
        return "exact" if self.n_layers == 1 else "degree"


#: How each method's numbers are labelled wherever they are shown (tables, figures, JSON).
METHOD_LABELS = {"exact": "exact",
                 "montecarlo": "Monte Carlo, reliable entries only",
                 "closure": "moment-closure, APPROXIMATE"}
#: The name of the closure matrix shown beside a Monte Carlo one.
CLOSURE_NAME = "moment-closure (approximate)"


def _shown(name: str, method: str) -> str:
    """A matrix's name as shown in text and CSV headers: the tensor-similarity matrix carries
    its method unless exact (an approximate number never sits under a plain heading)."""
    if name != "tensor similarity" or method == "exact":
        return name
    return CLOSURE_NAME if method == "closure" else f"tensor similarity ({method})"


def make_model(cfg: LanguageConfig, vocab: int):
    from ..transformer import BilinearTransformer

    return BilinearTransformer(vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_head,
                               cfg.d_mlp, n_ctx=cfg.n_ctx, rope=cfg.rope, seed=cfg.seed)


def train_language_model(model, train_tokens: np.ndarray, cfg: LanguageConfig, save_at: Sequence[int],
                         callback, show_progress: bool = False) -> dict:
    """AdamW on next-token cross-entropy over random windows of ``n_ctx + 1`` training tokens
    (starts drawn from a private generator seeded with ``cfg.seed``), gradient norm clipped at
    ``cfg.grad_clip``. ``callback(step, model)`` at every step in ``save_at`` (0 = before
    training). Returns ``{"step": [...], "loss": [...]}`` (the minibatch loss at those steps).

    Raises:
        TrainingDiverged: a NaN/inf loss or weight.
    """
    import torch

    from ..nn import TrainingDiverged

    toks = torch.as_tensor(np.asarray(train_tokens, dtype=np.int64))
    n_ctx = cfg.n_ctx
    if len(toks) < n_ctx + 2:
        raise ValueError(f"train_tokens: {len(toks)} tokens, need more than n_ctx + 1 = {n_ctx + 1}")
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    offs = torch.arange(n_ctx + 1)
    save = {int(s) for s in save_at}
    hist = {"step": [], "loss": []}
    last = float("nan")
    if 0 in save:
        callback(0, model)
        hist["step"].append(0)
        hist["loss"].append(None)
    for step in progress(range(1, cfg.steps + 1), "train", show_progress, total=cfg.steps):
        starts = torch.randint(0, len(toks) - n_ctx - 1, (cfg.batch_size,), generator=gen)
        win = toks[starts[:, None] + offs]
        logits = model(win[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 win[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            if step == 1:   # before any update: the initial model itself overflows
                n = cfg.n_layers
                raise TrainingDiverged(
                    f"training diverged: loss {loss.item()} at step 1, before any update: the "
                    f"initial {n}-layer model's logits overflow (a stack of {n} bilinear "
                    f"attention layers is a polynomial of degree 5^{n} = {5 ** n} in the "
                    f"embeddings); --layers 1..3 train at the default sizes (measured: 4 and 5 "
                    f"overflow at initialisation)", step)
            raise TrainingDiverged(f"training diverged: loss {loss.item()} at step {step} "
                                   f"(learning rate too high?)", step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        last = float(loss.detach())
        if step in save:
            for name, p in model.named_parameters():
                if not torch.isfinite(p).all():
                    raise TrainingDiverged(f"training diverged: parameter {name!r} has NaN/inf "
                                           f"entries after step {step}", step)
            callback(step, model)
            hist["step"].append(step)
            hist["loss"].append(last)
    return hist


def eval_windows(held_out: np.ndarray, n_ctx: int, count: int) -> np.ndarray:
    """The first ``count`` non-overlapping windows of ``n_ctx`` held-out tokens, ``(count, n_ctx)``."""
    m = len(held_out) // n_ctx
    if count > m:
        raise ValueError(f"eval_windows: {count} windows of {n_ctx} tokens requested, the held-out "
                         f"text has {m}")
    return np.asarray(held_out[:count * n_ctx], dtype=np.int64).reshape(count, n_ctx)


# ----------------------------------------------------------------------------------------
# checkpoints of bilinear transformers in `compare` and `matrix`
# ----------------------------------------------------------------------------------------

TRANSFORMER_KEYS = ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "vocab", "rope",
                    "attn_scale")


def is_transformer_cfg(cfg: dict) -> bool:
    from ..transformer import ARCHITECTURE

    return cfg.get("architecture") == ARCHITECTURE


def check_transformer_cfgs(cfgs: Sequence[dict], paths: Sequence[Any]) -> None:
    """Refuse transformer checkpoints whose vocabularies differ (their logits index different
    tokens, so no similarity is meaningful), naming each path and its vocabulary size."""
    vocabs = [c.get("vocab") for c in cfgs]
    if len(set(vocabs)) > 1:
        desc = ", ".join(f"{p}: vocab {v}" for p, v in zip(paths, vocabs))
        raise ValueError(f"checkpoints: the vocabularies differ ({desc}); logits of different "
                         f"vocabularies cannot be compared")


def sequence_networks(models: Sequence[Any], cfgs: Sequence[dict], paths: Sequence[Any],
                      n_ctx: int | None) -> tuple[list, int]:
    """The residual stream -> logits networks of transformer checkpoints over ``n_ctx``
    positions (default: the shortest trained context among them).

    Raises:
        ValueError: ``n_ctx`` beyond a checkpoint's trained context (naming it).
    """
    trained = [int(c["n_ctx"]) for c in cfgs]
    if n_ctx is None:
        n_ctx = min(trained)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1:
        raise ValueError(f"--n-ctx: expected a positive integer, got {n_ctx!r}")
    for p, t in zip(paths, trained):
        if n_ctx > t:
            raise ValueError(f"--n-ctx {n_ctx}: beyond the trained context n_ctx={t} of {p}; "
                             f"use at most {min(trained)}")
    return [m.to_network(n_ctx=n_ctx) for m in models], n_ctx


# ----------------------------------------------------------------------------------------
# similarity matrices of sequence models
# ----------------------------------------------------------------------------------------

def sequence_similarity_matrix(nets: Sequence[Any], method: str, n_ctx: int,
                               show_progress: bool = False, n_samples: int = 20_000,
                               seed: int = 0) -> tuple[np.ndarray, dict]:
    """``S[i, j] = <f_i, f_j> / sqrt(<f_i, f_i> <f_j, f_j>)`` of sequence models (Gaussian metric,
    summed over positions ``< n_ctx`` and outputs).

    ``method="montecarlo"``: ``tensoralg.similarity_matrix(nets, method="montecarlo", ...)``
    (one shared set of directions, streamed: memory ``O(N^2)``; each entry with its
    delta-method standard error and verdict, equal to ``tensoralg.similarity`` of the pair with
    the same ``n_samples`` and ``seed``); the matrix holds every estimate, ``info["stderr"]``
    and ``info["reliable"]`` the per-entry errors and verdicts (diagonal: 1, 0 — ``S_ii = 1``
    identically; the norms' diagnostics are part of every pair's).

    Otherwise first tries the public batched
    ``tensoralg.similarity_matrix(nets, method=..., n_ctx=...)``;
    if it does not accept sequence models (``TypeError``/``ValueError``/``NotImplementedError``
    other than ``CostTooHigh``), loops: ``tensoralg.inner(a, a)`` once per model and
    ``tensoralg.inner(a, b)`` once per unordered pair. Returns the matrix and a dict saying
    which path ran, why, and the seconds taken.

    Raises:
        tensoralg.CostTooHigh: the method refuses these models (e.g. exact at depth 2).
        ValueError: a model with zero norm.
    """
    import tensoralg as ta

    t0 = time.perf_counter()
    info: dict = {"method": method, "n_ctx": n_ctx}
    if method == "montecarlo":   # the library's shared directions, every entry with its verdict
        M = ta.similarity_matrix(list(nets), method="montecarlo", n_ctx=n_ctx,
                                 n_samples=n_samples, seed=seed)
        info.update(path="tensoralg.similarity_matrix (Monte Carlo: one shared set of "
                         "directions, a delta-method standard error and a verdict per entry)",
                    n_samples=n_samples, seed=seed, stderr=np.array(M.stderr),
                    reliable=np.array(M.reliable), seconds=time.perf_counter() - t0)
        return np.array(M, dtype=np.float64), info
    try:
        S = np.asarray(ta.similarity_matrix(list(nets), method=method, n_ctx=n_ctx),
                       dtype=np.float64)
        info.update(path="tensoralg.similarity_matrix (batched)",
                    seconds=time.perf_counter() - t0)
        return S, info
    except ta.CostTooHigh:
        raise
    except (TypeError, ValueError, NotImplementedError) as exc:
        info["batched_unavailable"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    N = len(nets)
    G = np.zeros((N, N))
    pairs = [(i, j) for i in range(N) for j in range(i, N)]
    for i, j in progress(pairs, f"tensor similarity ({method})", show_progress):
        G[i, j] = G[j, i] = float(ta.inner(nets[i], nets[j], method=method, n_ctx=n_ctx))
    d = np.diag(G)
    if np.any(d <= 0):
        raise ValueError(f"similarity matrix: models {np.flatnonzero(d <= 0).tolist()} have norm "
                         f"zero (method {method}); similarity is undefined")
    S = np.clip(G / np.sqrt(np.outer(d, d)), -1.0, 1.0)
    info.update(path=f"loop over tensoralg.inner ({len(pairs)} calls, self terms once per "
                     f"model)", seconds=time.perf_counter() - t0, gram_diagonal=d.tolist())
    return S, info


# ----------------------------------------------------------------------------------------
# transitions and the finding
# ----------------------------------------------------------------------------------------

def finding_text(fin: dict, method: str, ngram_final: dict) -> list[str]:
    lines = []
    ts = fin["metrics"]["tensor similarity"]
    fastest = "ngram_orders_fastest_within_1_interval"
    tr = ", ".join(f"steps {t['steps'][0]}->{t['steps'][1]} (1-S = {t['change']:.3g}"
                   + (f"; fastest {'/'.join(str(n) for n in t[fastest])}-gram learning within one "
                      f"interval)"
                      if t[fastest] else "; no n-gram order learns fastest there)")
                   for t in ts["sharpest"])
    label = METHOD_LABELS.get(method, method)
    lines.append(f"sharpest tensor-similarity ({label}) transitions: "
                 + (tr or "none: no interval between consecutive checkpoints has a reliable "
                          "estimate"))
    fast = "; ".join(f"{n}-gram: steps {v['steps'][0]}->{v['steps'][1]} (+{v['agreement_gain']:.3f})"
                     for n, v in fin["ngram_fastest_interval"].items())
    lines.append(f"fastest n-gram agreement gains: {fast}")
    fmt = lambda v: "n/a" if v is None else f"{v:+.2f}"  # noqa: E731
    lines.append("Spearman(consecutive change, total n-gram change): " + ", ".join(
        f"{_shown(k, method)} {fmt(v['spearman_with_ngram_change'])}"
        for k, v in fin["metrics"].items()))
    lines.append("sharpest/median consecutive change: " + ", ".join(
        f"{_shown(k, method)} "
        f"{'n/a' if v['sharpness_max_over_median'] is None else format(v['sharpness_max_over_median'], '.1f')}"
        for k, v in fin["metrics"].items()))
    n_al, n_same, k = (ts["n_sharpest_aligned_with_ngram"],
                       ts["n_sharpest_same_interval_as_ngram"], len(ts["sharpest"]))
    c1, c0 = fin["chance_within_1_interval"], fin["chance_same_interval"]
    # "reproduced" needs alignment clearly above what randomly placed transitions would give
    if not k:
        verdict = "NOT assessed (no reliable tensor-similarity estimate between consecutive " \
                  "checkpoints)"
    elif n_same / k > c0 and n_al / k > c1 and n_al >= 2:
        verdict = "reproduced"
    elif n_same / k > c0 or n_al / k > c1:
        verdict = "partly reproduced"
    else:
        verdict = "NOT reproduced (no better than chance)"
    lines.append(f"{verdict}: {n_same} of the {k} sharpest tensor-similarity transitions fall in "
                 f"the interval where some n-gram order learns fastest (chance {c0:.2f} each), "
                 f"{n_al} within one interval (chance {c1:.2f} each)")
    if fin.get("order_specific_fastest_interval"):
        nx = ts["n_sharpest_within_1_of_order_specific"]
        spec = "; ".join(f"{n}-gram over {n - 1}-gram: steps {v['steps'][0]}->{v['steps'][1]} "
                         f"(+{v['gain_over_lower_order']:.3f})"
                         for n, v in fin["order_specific_fastest_interval"].items())
        lines.append(f"order-specific learning (agreement[n] - agreement[n-1]) fastest at: {spec}; "
                     f"{nx} of the {k} sharpest tensor-similarity transitions lie within one "
                     f"interval of one of these (chance "
                     f"{fin['chance_within_1_of_order_specific']:.2f} each)")
    lines.append("final n-gram agreement: " + ", ".join(f"{n}-gram {v:.3f}"
                                                        for n, v in ngram_final.items()))
    return lines


# ----------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------

def _mc_summary(mc: list, method: str) -> dict:
    """Largest |z| of the Monte Carlo check and whether every checked pair agrees within
    ``Z_DISAGREE`` standard errors (None without a check)."""
    zs = [abs(r["z"]) for r in mc if r["z"] is not None]
    return {"max_abs_z": max(zs) if zs else None,
            "agrees": (max(zs) <= Z_DISAGREE) if zs else None, "threshold_z": Z_DISAGREE,
            "note": ("one layer: the matrix is exact, a disagreement is Monte Carlo's"
                     if method == "exact" else
                     f"{method}: approximate; a disagreement means the matrix is unverified")}


def _mc_pairs(N: int, change: np.ndarray, k: int) -> list[tuple[int, int]]:
    """``k`` pairs for the Monte Carlo check: the sharpest consecutive transition, first vs
    last, middle vs last, then further consecutive pairs."""
    cand = []
    if len(change):
        i = int(np.argmax(change))
        cand.append((i, i + 1))
    cand += [(0, N - 1), (N // 2, N - 1)] + [(i, i + 1) for i in range(N - 1)]
    out = []
    for p in cand:
        if p not in out and p[0] != p[1]:
            out.append(p)
    return out[:k]


def run_language(cfg: LanguageConfig, out: str | Path, show_progress: bool = False,
                 json_copy: str | Path | None = None) -> dict:
    """Train, checkpoint, compare; write JSON, CSVs, figures and the checkpoints under ``out``
    (staged: ``out`` is replaced only by a complete run).

    Raises:
        ValueError: a bad configuration or ``out`` (before any work).
        tensoralg.CostTooHigh: the similarity method refuses the architecture.
        TrainingDiverged: NaN/inf during training.
    """
    cfg.validate()
    final = check_output_folder(out, JSON_NAME)
    if json_copy is not None:
        check_file_writable(json_copy, "--json")
    with staged_output(final, JSON_NAME) as stage:
        result = _run(cfg, stage, show_progress)
        result["out"] = str(final)
        if json_copy is not None:
            write_json_copy(json_copy, result, final, stage)
    return result


def _run(cfg: LanguageConfig, stage: Path, show_progress: bool) -> dict:
    import torch

    import tensoralg as ta

    from ..baselines import linear_cka, output_cosine, weight_cosine
    from ..checkpoint import save_checkpoint
    from ..corpus import VOCAB, load_corpus, ngram_scores

    times: dict = {}
    t_all = time.perf_counter()
    cpu_all = time.process_time()
    t = time.perf_counter()
    corpus = load_corpus(cfg.n_chars)
    V = len(VOCAB)
    W = eval_windows(corpus.held_out, cfg.n_ctx, cfg.eval_windows)
    times["corpus_s"] = time.perf_counter() - t
    method = cfg.resolved_method()

    model = make_model(cfg, V)
    schedule = log_schedule(cfg.steps, cfg.checkpoints)
    snaps: list = []
    names: list = []
    prov = {"data": "python stdlib source (tensoralg.corpus)",
            "corpus_sha256": corpus.provenance["sha256_text"],
            "python_version": corpus.provenance["python_version"], "run": "audit language"}

    def keep(step, m):
        name = f"step_{step:06d}"
        save_checkpoint(stage / "checkpoints" / name, m, step=step, provenance=prov)
        snaps.append((step, copy.deepcopy(m).double().eval()))
        names.append(name)

    t = time.perf_counter()
    hist = train_language_model(model, corpus.train, cfg, schedule, keep, show_progress)
    times["train_s"] = time.perf_counter() - t

    # per checkpoint: held-out logits, final residual stream, n-gram scores
    t = time.perf_counter()
    steps = [s for s, _ in snaps]
    Wt = torch.as_tensor(W)
    logits, finals, scores = [], [], []
    cache: dict = {}
    with torch.no_grad():
        for _, m in snaps:
            lg, hL = m.forward_residual(m.residual_stream(Wt), return_final=True)
            logits.append(lg.numpy())
            finals.append(hL.reshape(-1, cfg.d_model).numpy())
            scores.append(ngram_scores(lg.numpy(), W, corpus.train, V, ORDERS, ngram_cache=cache))
    times["eval_s"] = time.perf_counter() - t

    N = len(snaps)
    t = time.perf_counter()
    out_cos = np.eye(N)
    cka = np.eye(N)
    wcos = np.eye(N)
    for i in range(N):
        for j in range(i + 1, N):
            out_cos[i, j] = out_cos[j, i] = output_cosine(logits[i].reshape(-1, V),
                                                          logits[j].reshape(-1, V))
            cka[i, j] = cka[j, i] = linear_cka(finals[i], finals[j])
            wcos[i, j] = wcos[j, i] = weight_cosine(snaps[i][1], snaps[j][1])
    times["baselines_s"] = time.perf_counter() - t
    if method == "degree":   # the default at two or more layers (issue 21, item 7)
        from .language_degree import run_degree_report

        return run_degree_report(cfg, stage, show_progress, dict(
            corpus=corpus, V=V, snaps=snaps, names=names, steps=steps, hist=hist,
            scores=scores, out_cos=out_cos, cka=cka, wcos=wcos, times=times, t_all=t_all,
            cpu_all=cpu_all, model_config=make_model(cfg, V).config()))

    nets = [m.to_network() for _, m in snaps]
    pairs: list = []
    closure_S = None
    if method == "montecarlo":
        S, pairs, sim_info = montecarlo_pair_matrix(nets, cfg.n_ctx, cfg.mc_matrix_samples,
                                                    cfg.seed, steps, show_progress)
        if cfg.closure:   # beside it, labelled: the moment-closure similarity (approximate)
            closure_S, cinfo = sequence_similarity_matrix(nets, "closure", cfg.n_ctx,
                                                          show_progress)
            sim_info["closure_seconds"] = cinfo["seconds"]
            for r in pairs:
                r[CLOSURE_NAME] = float(closure_S[r["i"], r["j"]])
    else:
        S, sim_info = sequence_similarity_matrix(nets, method, cfg.n_ctx, show_progress,
                                                 n_samples=cfg.mc_samples, seed=cfg.seed)
    times["tensor_similarity_s"] = sim_info["seconds"] + sim_info.get("closure_seconds", 0.0)

    # Monte Carlo check of a few pairs of an exact or (explicitly asked) closure matrix
    t = time.perf_counter()
    mc = []
    for i, j in _mc_pairs(N, consecutive_change(S), cfg.mc_pairs if method != "montecarlo" else 0):
        # ratio of Monte Carlo means with its delta-method standard error (directions sampled,
        # radius integrated exactly: tensoralg.strategies.montecarlo.montecarlo_similarity)
        e = ta.similarity(nets[i], nets[j], method="montecarlo", n_ctx=cfg.n_ctx,
                          n_samples=cfg.mc_samples, seed=cfg.seed)
        est, se = float(e), float(e.stderr)
        d = e.diagnostics
        mc.append({"i": i, "j": j, "steps": [steps[i], steps[j]], method: float(S[i, j]),
                   "montecarlo": est if d.reliable else None,
                   "unreliable_estimate": None if d.reliable else est, "stderr": se,
                   "reliable": bool(d.reliable), "reason": d.reason,
                   "certified_lower_bounds": d.lower_bounds,
                   "stderr_method": "delta method on the ratio of means of per-direction "
                                    "products (tensoralg.strategies.montecarlo.montecarlo_similarity)",
                   "z": ((float(S[i, j]) - est) / se if se > 0 and d.reliable else None),
                   "n_samples": cfg.mc_samples, "seed": cfg.seed})
    times["montecarlo_check_s"] = time.perf_counter() - t

    mats = {"tensor similarity": S, "output cosine": out_cos, "linear CKA": cka,
            "weight cosine": wcos}
    if closure_S is not None:
        mats[CLOSURE_NAME] = closure_S
    agreement = {n: [s["agreement"][n] for s in scores] for n in ORDERS}
    fin = transitions_finding(steps, mats, agreement)
    text = finding_text(fin, method, {n: agreement[n][-1] for n in ORDERS})
    if method == "montecarlo":
        text += montecarlo_text(pairs, N, sim_info, closure_S is not None)
    if mc:
        worst = max(abs(r["z"]) for r in mc if r["z"] is not None) if any(
            r["z"] is not None for r in mc) else None
        label = METHOD_LABELS.get(method, method)
        text.append("Monte Carlo check: " + "; ".join(
            f"steps {r['steps'][0]} vs {r['steps'][1]}: {label} {r[method]:.4f}, MC "
            + (f"{r['montecarlo']:.4f} ± {r['stderr']:.4f}" if r["reliable"] else
               f"no reliable estimate ({r['reason']}; certified lower bounds "
               + ", ".join(f"{k} >= {v:.4g}" for k, v in r["certified_lower_bounds"].items())
               + ")") for r in mc)
            + ("" if worst is None else f" (largest |z| = {worst:.1f})"))
        if worst is not None and worst > Z_DISAGREE:
            if method == "exact":
                text.append(f"the exact values are exact (one layer); |z| > {Z_DISAGREE:g} means "
                            f"the Monte Carlo standard error under-covers (heavy-tailed "
                            f"per-direction products): add directions or seeds")
            else:
                text.append(f"Monte Carlo DISAGREES with the {method} matrix (|z| > "
                            f"{Z_DISAGREE:g}): the {method} value is approximate and the "
                            f"two-layer Monte Carlo estimate is heavy-tailed, so neither is "
                            f"verified; the transitions above are those of the {method} matrix, "
                            f"not a verified tensor similarity (docs/language.md)")

    # outputs
    t = time.perf_counter()
    from .plotting import heatmaps

    labels = [str(s) for s in steps]
    shown = {f"tensor similarity ({METHOD_LABELS.get(method, method)})": S,
             "output cosine": out_cos, "linear CKA (final residual)": cka, "weight cosine": wcos}
    if closure_S is not None:
        shown[f"{CLOSURE_NAME}: not the tensor similarity"] = closure_S
    heatmaps(stage / MATRIX_FIG, shown, labels,
             f"language checkpoints: {len(shown)} similarity matrices"
             + ("; Monte Carlo blank where no reliable estimate" if method == "montecarlo"
                else ""), axis_label="step")
    _ngram_figure(stage / NGRAM_FIG, steps, agreement, fin, METHOD_LABELS.get(method, method))
    header = (["checkpoint", "step", "train_loss", "held_out_loss", "held_out_accuracy"]
              + [f"agreement_{n}gram" for n in ORDERS] + [f"kl_{n}gram" for n in ORDERS]
              + [f"{_shown(k, method).replace(' ', '_')}_to_final" for k in mats]
              + [f"{_shown(k, method).replace(' ', '_')}_change_to_next" for k in mats])
    rows = []
    for i in range(N):
        rows.append([names[i], steps[i], hist["loss"][i], scores[i]["loss"],
                     scores[i]["accuracy"]] + [scores[i]["agreement"][n] for n in ORDERS]
                    + [scores[i]["kl"][n] for n in ORDERS]
                    + [float(M[i, -1]) for M in mats.values()]
                    + [(float(1 - M[i, i + 1]) if i + 1 < N else None) for M in mats.values()])
    write_csv(stage / CSV_NAME, header, rows)
    by_pair = {(r["i"], r["j"]): r for r in pairs}
    mc_cols = ["montecarlo_estimate_or_blank", "montecarlo_stderr", "montecarlo_reliable",
               "montecarlo_reason"] if pairs else []

    def mc_row(i, j):
        r = by_pair.get((min(i, j), max(i, j)))
        if not mc_cols:
            return []
        if r is None:
            return [None, None, None, None]
        return [r["montecarlo"], r["stderr"], r["reliable"], r["reason"]]

    write_csv(stage / PAIRS_CSV, ["i", "j", "step_i", "step_j"] +
              [_shown(k, method).replace(" ", "_") for k in mats] + mc_cols,
              ([i, j, steps[i], steps[j]] + [float(M[i, j]) for M in mats.values()] + mc_row(i, j)
               for i in range(N) for j in range(N)))
    times["outputs_s"] = time.perf_counter() - t
    times["total_s"] = time.perf_counter() - t_all
    times["cpu_s"] = time.process_time() - cpu_all   # CPU time of this process (all threads)

    result = {
        **stamp("audit language", {**asdict(cfg), "resolved_method": method}),
        "metric": cfg.metric,
        "corpus": corpus.provenance,
        "model": {**make_model(cfg, V).config(), "exported": "residual stream -> logits "
                  "(Gaussian metric on the residual stream input; docs/language.md)"},
        "tensor_similarity": {**sim_info, "approximate": method != "exact",
                              "label": METHOD_LABELS.get(method, method),
                              "note": ("exact Gaussian inner product (one attention layer)"
                                       if method == "exact" else
                                       CLOSURE_NOTE if method == "closure" else
                                       "Monte Carlo estimates from one shared set of directions "
                                       "(tensoralg.strategies.montecarlo.montecarlo_similarity_pairs); an "
                                       "entry is in the matrix only when its diagnostics call "
                                       "it reliable (NaN/null otherwise: no reliable estimate, "
                                       "see pairs)")},
        "pairs": pairs,
        **({"moment_closure_approximate": {"matrix": closure_S, "label": CLOSURE_NAME,
                                           "note": CLOSURE_NOTE}}
           if closure_S is not None else {}),
        "checkpoints": [{"name": names[i], "step": steps[i], "path": f"checkpoints/{names[i]}",
                         "train_loss": hist["loss"][i], **scores[i]} for i in range(N)],
        "matrices": dict(mats.items()),
        "montecarlo_check": mc,
        "montecarlo_check_summary": _mc_summary(mc, method),
        "transitions": fin,
        "finding": text,
        "ngram_definition": NGRAM_DEFINITION,
        "times": times,
        "threads": {"torch": torch.get_num_threads(),
                    "note": "torch and BLAS threads as set by --threads (default 1)"},
        "files": [JSON_NAME, CSV_NAME, PAIRS_CSV, MATRIX_FIG, NGRAM_FIG, "checkpoints/"],
        "paths": PATHS_NOTE,
    }
    write_json(stage / JSON_NAME, result)
    return result


CLOSURE_NOTE = ("moment-closure similarity: APPROXIMATE beyond depth 1, the similarity of a "
                "surrogate with Gaussian layer inputs; on trained two-layer checkpoints not an "
                "estimate of the tensor similarity (docs/mathematics.md §3.9)")


def montecarlo_pair_matrix(nets: Sequence[Any], n_ctx: int, n_samples: int, seed: int,
                           steps: Sequence[int], show_progress: bool = False
                           ) -> tuple[np.ndarray, list, dict]:
    """Every pair's Monte Carlo similarity with its verdict, from one shared set of directions
    (`tensoralg.strategies.montecarlo.montecarlo_similarity_pairs`; each entry equals
    ``tensoralg.similarity(a, b, method="montecarlo", n_ctx=n_ctx, n_samples=n_samples,
    seed=seed)`` up to rounding).

    Returns ``(S, pairs, info)``: ``S`` ``(N, N)`` with ones on the diagonal, the estimate
    where reliable and NaN where not; ``pairs``: one record per ``i < j`` (``montecarlo`` is
    None when unreliable, the number then kept only under ``unreliable_estimate``, not an
    answer; ``reason``, ``certified_lower_bounds``, the replicates); ``info``:
    what ran, the counts and the seconds.
    """
    from ..strategies.montecarlo import montecarlo_similarity_pairs

    t0 = time.perf_counter()
    bar = (lambda it: progress(it, "tensor similarity (Monte Carlo)", True)) \
        if show_progress else None
    est = montecarlo_similarity_pairs(nets, n_ctx=n_ctx, n_samples=n_samples, seed=seed,
                                      progress=bar)
    N = len(nets)
    S = np.eye(N)
    pairs = []
    for (i, j), e in est.items():
        d = e.diagnostics
        S[i, j] = S[j, i] = float(e) if d.reliable else np.nan
        pairs.append({"i": i, "j": j, "steps": [steps[i], steps[j]],
                      "montecarlo": float(e) if d.reliable else None,
                      "unreliable_estimate": None if d.reliable else float(e),
                      "stderr": e.stderr,
                      "reliable": bool(d.reliable), "reason": d.reason,
                      "max_share": d.max_share, "replicates_max_z": d.max_z,
                      "replicates": [list(x) for x in d.replicates],
                      "certified_lower_bounds": d.lower_bounds})
    n_rel = sum(r["reliable"] for r in pairs)
    info = {"method": "montecarlo", "n_ctx": n_ctx, "n_samples": n_samples, "seed": seed,
            "path": "shared-direction radial Monte Carlo with per-pair diagnostics "
                    "(tensoralg.strategies.montecarlo.montecarlo_similarity_pairs)",
            "n_pairs": len(pairs), "n_reliable": n_rel,
            "n_consecutive_reliable": sum(r["reliable"] for r in pairs if r["j"] == r["i"] + 1),
            "seconds": time.perf_counter() - t0}
    return S, pairs, info


def montecarlo_text(pairs: list, N: int, info: dict, with_closure: bool) -> list[str]:
    """The finding's lines on a Monte Carlo matrix: how many pairs are reliable, the
    consecutive entries (value or "no reliable estimate" with the reason), the closure beside
    them labelled approximate."""
    lines = [f"Monte Carlo ({info['n_samples']} shared directions, seed {info['seed']}): "
             f"{info['n_reliable']} of {info['n_pairs']} pairs have a reliable estimate, "
             f"{info['n_consecutive_reliable']} of {N - 1} consecutive pairs; the rest: no "
             f"reliable estimate (not shown in the matrix)"]
    bad = [r["reason"] for r in pairs if not r["reliable"]]
    if bad:
        heavy = sum("one direction carries" in x for x in bad)
        split = sum("disagree" in x for x in bad)
        lines.append(f"why not reliable: in {heavy} pairs one direction carries >= 5 % of a sum "
                     f"(heavy tail), in {split} the 3 independent replicates disagree (|z| > 3)")
    cons = [r for r in pairs if r["j"] == r["i"] + 1]
    lines.append("consecutive pairs, Monte Carlo" + (f" | {CLOSURE_NAME}" if with_closure else "")
                 + ": " + "; ".join(
                     f"{r['steps'][0]}->{r['steps'][1]} "
                     + (f"{r['montecarlo']:.4f} ± {r['stderr']:.4f}" if r["reliable"] else
                        "no reliable estimate (lower bounds " + ", ".join(
                            f"{k} >= {v:.3g}" for k, v in r["certified_lower_bounds"].items())
                        + ")")
                     + (f" | {r[CLOSURE_NAME]:.4f}" if with_closure else "") for r in cons))
    return lines


def _ngram_figure(path: Path, steps, agreement, fin, label: str = "exact") -> Path:
    from .common import save_figure
    from .plotting import pyplot

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    x = np.array([max(s, 0.5) for s in steps], dtype=float)   # step 0 drawn at 0.5 (log axis)
    for n, a in agreement.items():
        ax.plot(x, a, marker="o", ms=3, label=f"{n}-gram agreement")
    tops = fin["metrics"]["tensor similarity"]["sharpest"]
    for r, t in enumerate(tops):
        lo, hi = max(t["steps"][0], 0.5), t["steps"][1]
        for a_ in (ax, ax2):
            a_.axvspan(lo, hi, color="tab:red", alpha=0.15 if r else 0.3, lw=0)
    ax.set_xscale("log")
    ax.set_ylabel("top-1 agreement with n-gram")
    ax.set_title(f"n-gram learning; shaded: sharpest tensor-similarity ({label}) transitions")
    ax.legend(fontsize=7, loc="upper left")
    mid = np.sqrt(x[:-1] * x[1:])
    for name, v in fin["metrics"].items():
        ax2.plot(mid, v["change"], marker=".",
                 label=f"{name} ({label})" if name == "tensor similarity" else name)
    ax2.set_xscale("log")
    ax2.set_xlabel("training step")
    ax2.set_ylabel("1 - M[i, i+1]")
    ax2.legend(fontsize=7, loc="upper right")
    return save_figure(fig, path)


def language_table(result: dict) -> str:
    if result.get("report") == "degree":
        from .language_degree import degree_table

        return degree_table(result)
    rows = []
    S = np.asarray(result["matrices"]["tensor similarity"], dtype=float)
    method = result["config"].get("resolved_method", "exact")
    C = result.get("moment_closure_approximate")
    C = None if C is None else np.asarray(C["matrix"], dtype=float)
    for i, c in enumerate(result["checkpoints"]):
        v = float(S[i, -1])
        rows.append([c["step"], c["loss"]] + [c["agreement"][str(n)] if str(n) in c["agreement"]
                                              else c["agreement"][n] for n in ORDERS]
                    + [v if np.isfinite(v) else "no reliable estimate"]
                    + ([] if C is None else [float(C[i, -1])]))
    head = {"exact": "tensor sim to final", "montecarlo": "Monte Carlo sim to final",
            "closure": "moment-closure (approx.) to final"}.get(method, f"{method} to final")
    lines = [format_table(["step", "held-out loss"] + [f"{n}-gram agr" for n in ORDERS]
                          + [head] + ([] if C is None else
                                      ["moment-closure (approx.) to final"]), rows), ""]
    lines += result["finding"]
    tm = result["times"]
    lines.append(f"time: {tm['total_s']:.1f} s wall, {tm['cpu_s']:.1f} s CPU (train "
                 f"{tm['train_s']:.1f} s, tensor similarity {tm['tensor_similarity_s']:.1f} s)")
    return "\n".join(lines)
