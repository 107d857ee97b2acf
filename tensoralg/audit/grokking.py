"""Grokking audit: modular addition, checkpoints on a log schedule, one similarity matrix.

A depth-1 bilinear network (one-hot ``a`` ++ one-hot ``b`` -> embedding -> bilinear block ->
head) is trained full-batch with AdamW and strong weight decay on a fraction of all
``(a, b)`` pairs mod ``P`` (Power et al. 2022, "Grokking"): it memorises the training pairs
early and generalises to the held-out pairs later. Checkpoints are saved on a log-spaced
schedule; their ``N x N`` tensor similarity matrix is one batched
``tensoralg.similarity_matrix`` call (exact Gaussian metric, or the symmetrised Frobenius
cosine with ``metric="frobenius"``: one Gram contraction per Wick configuration for the whole
stack of checkpoints).

Expected finding: the similarity to the final checkpoint keeps changing after validation
accuracy has saturated — the weights keep reorganising (circuit clean-up under weight decay)
while the validation accuracy no longer moves. Next to it: the Fourier picture of the weights
(`tensoralg.audit.grokking_fourier`: power per frequency of the embedding and of the bilinear
layer over training, the key frequencies, the Spearman correlation of each quantity's change
with the spectrum's change) and a data baseline, the output cosine over all P^2 inputs, which
at the quick size keeps changing after saturation too (docs/audits.md).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .common import (
    MC_SAMPLES,
    PATHS_NOTE,
    check_metric,
    format_table,
    matrix_record,
    matrix_uncertainty,
    mc_entries,
    method_label,
    pm,
    progress,
    run_staged,
    shown_matrix,
    similarity_matrix,
    stamp,
    write_csv,
    write_json,
)

JSON_NAME = "grokking.json"
CSV_NAME = "grokking.csv"
MATRIX_CSV = "grokking_matrix.csv"
FOURIER_CSV = "grokking_fourier.csv"
FIG_NAME = "grokking.png"
FIG_FOURIER = "grokking_fourier.png"

SATURATION_TOL = 0.02     # val accuracy within this of its maximum = saturated ...
SATURATION_ABOVE_CHANCE = 0.5  # ... provided the maximum is at least halfway from chance to 1
CHANGE_THRESHOLD = 0.02   # similarity to final at saturation below 1 - this = "keeps changing"

# The data set is all P^2 pairs as one-hot rows of 2P features, trained full batch: the inputs
# alone take 8 P^3 bytes in float32 (134 MB at P = 256; 8 GB at P = 1000) and every step runs
# all P^2 rows through the model. P = 256 keeps a run within a few hundred MB on a laptop.
MAX_P = 256
# "grokked" is read off the validation accuracy: with fewer than 30 held-out pairs one example
# moves it by more than 3 points (P = 2 had a single validation example), so refuse those sizes.
MIN_VALIDATION = 30
MEMORISED = 0.99   # train accuracy at which the training pairs count as memorised
GROKKED = 0.95     # val accuracy at which the run counts as grokked
CURVE_POINTS = 200  # accuracy is evaluated about this many times over a run (plus checkpoints)


@dataclass
class GrokkingConfig:
    P: int = 31
    # 0.8 rather than 0.7: seeds 0, 1, 2 at 0.7 reached validation 0.95 but ended at 0.997,
    # 0.955, 0.927 after 5000 steps; at 0.8 seeds 0, 1, 2 grokked at steps 400, 450, 400 and
    # ended at 1.000, 0.984, 0.995 (see quick() for why this model needs the larger fraction)
    train_fraction: float = 0.8
    steps: int = 5000
    checkpoints: int = 24
    d_model: int = 64
    d_hidden: int = 64
    lr: float = 3e-3
    weight_decay: float = 1.0
    seed: int = 0
    method: str = "auto"
    n_samples: int = MC_SAMPLES   # Monte Carlo samples (used when the method is montecarlo)
    metric: str = "gaussian"    # or "frobenius" (exact only; see common.SIM_METRICS)

    @classmethod
    def quick(cls, **kw) -> GrokkingConfig:
        # Chosen by a sweep (issue 12; one thread, a loaded 2-core machine). Seeds 0-4:
        # training accuracy >= 0.99 at step 45 with validation at 0.01-0.05 (chance 1/31 =
        # 0.032), validation >= 0.95 at steps 225-370, final validation 0.98-1.00. The model's
        # one bilinear layer sees embed(onehot(a) ++ onehot(b)), so besides the a-b cross terms
        # it computes terms in a alone and in b alone; with training fractions 0.5-0.7 those
        # stayed partly uncancelled (validation stuck at 0.8-0.95; removing the additive a-only
        # and b-only logit terms of such a model raised its accuracy on all pairs from 0.91 to
        # 0.98), hence the training fraction 0.8 (the default's), and the lr 3e-3 / weight decay
        # 1.0 regime of the default preset, sped up to lr 5e-3.
        # lr 1e-2 with weight decay 2-3 plateaued at 0.7-0.9; weight decay 10 never memorised.
        base = dict(P=31, steps=1000, checkpoints=12, d_model=64,
                    d_hidden=64, lr=5e-3, weight_decay=1.0)
        base.update(kw)
        return cls(**base)

    @classmethod
    def paper(cls, **kw) -> GrokkingConfig:
        """The paper's sizes: P = 113, 30 % of the pairs trained (`PAPER_P`,
        `PAPER_TRAIN_FRACTION`); the other settings are the defaults' unless given."""
        base = dict(P=PAPER_P, train_fraction=PAPER_TRAIN_FRACTION)
        base.update(kw)
        return cls(**base)

    def validate(self) -> None:
        check_metric(self.metric, self.method)
        if not 2 <= self.P <= MAX_P:
            raise ValueError(f"--P: expected a modulus in [2, {MAX_P}], got {self.P} (the "
                             f"full-batch data set is P^2 one-hot rows of 2P features: "
                             f"{8 * self.P ** 3 / 1e9:.3g} GB of float32 inputs at this P; "
                             f"{MAX_P} keeps it at {8 * MAX_P ** 3 / 1e6:.0f} MB)")
        if not 0.0 < self.train_fraction < 1.0:
            raise ValueError(f"--train-fraction: expected (0, 1), got {self.train_fraction}")
        n_train = max(1, min(self.P ** 2 - 1, int(round(self.train_fraction * self.P ** 2))))
        if self.P ** 2 - n_train < MIN_VALIDATION:
            raise ValueError(f"--P {self.P} with --train-fraction {self.train_fraction} leaves "
                             f"{self.P ** 2 - n_train} validation pairs of {self.P ** 2}; at least "
                             f"{MIN_VALIDATION} are needed to tell grokking from chance (use a "
                             f"larger --P or a smaller --train-fraction)")
        if self.steps < 1 or self.checkpoints < 2:
            raise ValueError(f"--steps >= 1 and --checkpoints >= 2 required, got {self.steps} and "
                             f"{self.checkpoints}")
        if self.checkpoints > self.steps + 1:
            raise ValueError(f"--checkpoints: at most --steps + 1 = {self.steps + 1} distinct "
                             f"checkpoint steps (0..{self.steps}), got {self.checkpoints}")
        from ._cliutil import check_n_samples

        check_n_samples(self.n_samples)


#: The original authors' grokking sizes (modulus, training fraction): `GrokkingConfig.paper`.
PAPER_P, PAPER_TRAIN_FRACTION = 113, 0.3


#: What --paper-size costs, printed before training (measured: docs/audits.md, "Run time").
PAPER_SIZE_COST = ("P = 113 with 30% of the 12769 pairs trained: every full-batch step runs "
                   "3831 pairs of 226 one-hot features (the default: 769 of 62). Measured on "
                   "one thread: --paper-size --steps 500 --checkpoints 8 took 23.5 s of CPU "
                   "(memorised at step 106, validation still at chance); the full 5000 steps "
                   "are estimated at about 4 minutes of CPU (not measured), and whether this "
                   "model groks at 30% trained within them is untested (docs/audits.md)")


def size_note(cfg: GrokkingConfig) -> str:
    """How this run's size compares with the paper's (P = 113, 30 % of the pairs trained)."""
    if cfg.P == PAPER_P and abs(cfg.train_fraction - PAPER_TRAIN_FRACTION) < 1e-12:
        return (f"size: the paper's (P = {PAPER_P}, {PAPER_TRAIN_FRACTION:.0%} of the pairs "
                f"trained), {cfg.steps} steps")
    return (f"size: P = {cfg.P}, {cfg.train_fraction:.0%} of the {cfg.P ** 2} pairs trained, "
            f"{cfg.steps} steps; the paper's figure uses P = {PAPER_P} with "
            f"{PAPER_TRAIN_FRACTION:.0%} trained (--paper-size)")


def log_schedule(steps: int, n: int) -> list[int]:
    """Exactly ``n`` distinct steps: 0 plus ``n - 1`` log-spaced steps from 1 to ``steps``.

    The rounded geometric points ``steps ** (k / (n - 2))`` collide at small ``k`` when ``n`` is
    large against ``log(steps)``; a collision is moved to the next free integer (forward pass)
    and the points are kept below ``steps`` (backward pass), so the schedule has exactly ``n``
    entries whenever ``2 <= n <= steps + 1``.

    Raises:
        ValueError: ``n < 2`` or ``n > steps + 1`` (not enough distinct steps).
    """
    if not 2 <= n <= steps + 1:
        raise ValueError(f"checkpoints: expected 2..steps + 1 = {steps + 1} distinct steps, got {n}")
    pts = [int(p) for p in np.round(np.geomspace(1, steps, n - 1))]
    for k in range(1, len(pts)):
        pts[k] = max(pts[k], pts[k - 1] + 1)
    pts[-1] = steps
    for k in range(len(pts) - 2, -1, -1):
        pts[k] = min(pts[k], pts[k + 1] - 1)
    return [0] + pts


def _model(cfg: GrokkingConfig):
    from ..nn import BilinearNet

    return BilinearNet(2 * cfg.P, cfg.P, d_model=cfg.d_model, d_hidden=cfg.d_hidden,
                       residual=False, bias=False, seed=cfg.seed)


def run_grokking(cfg: GrokkingConfig, out: str | Path, show_progress: bool = True,
                 json_copy: str | Path | None = None) -> dict:
    """Train, checkpoint on a log schedule, compute the similarity matrix, write outputs under
    ``out`` (``grokking.json``, CSVs, PNG, ``checkpoints/step*``); return the JSON dictionary.

    Accuracies are recorded at the checkpoints (``train_accuracy``/``val_accuracy``) and on a
    denser grid (``accuracy_curve``, every ``steps // 200`` steps); the finding's
    ``memorisation_step`` (train accuracy >= 0.99), ``grokking_step`` (validation accuracy
    >= 0.95; ``grokked``) and ``grokking_delay`` are read off the dense curve.

    Checks (``out``, the exact cost) happen before training, and the run is written into a
    fresh folder that replaces ``out`` as a whole only when complete, so ``out/checkpoints``
    never mixes runs; see
    [`tensoralg.audit.backdoor.run_backdoor`][tensoralg.audit.backdoor.run_backdoor]. Paths in the
    JSON are relative to ``out``.
    """
    return run_staged(cfg, out, JSON_NAME, 1, _model(cfg), _run_grokking, show_progress,
                      json_copy)


def _run_grokking(cfg: GrokkingConfig, out: Path, show_progress: bool, method: str) -> dict:
    from ..checkpoint import save_checkpoint
    from ..data import modular_addition
    from ..nn import train_classifier
    from .plotting import grokking_figure

    t0 = time.perf_counter()
    data = modular_addition(cfg.P, cfg.train_fraction, seed=cfg.seed)
    model = _model(cfg)
    schedule = log_schedule(cfg.steps, cfg.checkpoints)
    # accuracy is evaluated on a dense grid too (every steps / CURVE_POINTS steps; forward
    # passes only), so that the memorisation and grokking steps are read off to that
    # resolution rather than off the log-spaced checkpoints
    every = max(1, cfg.steps // CURVE_POINTS)
    on_schedule = set(schedule)
    snaps, names = [], []

    def keep(step, m):
        if step not in on_schedule:
            return
        snap = copy.deepcopy(m)
        snaps.append(snap)
        names.append(f"checkpoints/step{step:07d}")
        save_checkpoint(out / names[-1], snap, step=step,
                        provenance={"data": data.provenance, "audit": "grokking"})

    hist = train_classifier(model, data.X_train, data.y_train, steps=cfg.steps, lr=cfg.lr,
                            weight_decay=cfg.weight_decay, batch_size=None, seed=cfg.seed,
                            eval_sets={"train": (data.X_train, data.y_train),
                                       "val": (data.X_test, data.y_test)},
                            eval_at=sorted(on_schedule | set(range(0, cfg.steps + 1, every))),
                            callback=keep,
                            progress="grokking training" if show_progress else False)
    t_train = time.perf_counter() - t0
    t1 = time.perf_counter()
    bar = progress(None, "similarity matrix", show_progress, total=1)
    sim_method = "auto" if (cfg.method == "auto" and method == "exact") else method
    sim, method = similarity_matrix(snaps, sim_method, depth=1, seed=cfg.seed,
                                    n_samples=cfg.n_samples, metric=cfg.metric)
    bar.update(1)
    bar.close()
    se, ok = mc_entries(sim)
    rec = matrix_record(sim, se, ok)
    sim = shown_matrix(sim, ok)   # NaN (null, blank) where no reliable estimate
    t_sim = time.perf_counter() - t1

    curve = {"step": hist["step"], "train_accuracy": hist["train_acc"],
             "val_accuracy": hist["val_acc"], "train_loss": hist["loss"]}
    at = [hist["step"].index(s) for s in schedule]
    steps = schedule
    train_acc = [hist["train_acc"][i] for i in at]
    val_acc = [hist["val_acc"][i] for i in at]
    loss = [hist["loss"][i] for i in at]
    to_final = sim[-1].tolist()
    vmax = max(val_acc)
    chance = 1.0 / cfg.P
    floor = chance + SATURATION_ABOVE_CHANCE * (1.0 - chance)
    saturates = bool(vmax >= floor)
    i_sat = (next(i for i, v in enumerate(val_acc) if v >= vmax - SATURATION_TOL)
             if saturates else None)
    i_mem = next((i for i, v in enumerate(train_acc) if v >= MEMORISED), None)
    # memorisation and grokking steps off the dense accuracy curve
    j_mem = next((i for i, v in enumerate(curve["train_accuracy"]) if v >= MEMORISED), None)
    j_grok = next((i for i, v in enumerate(curve["val_accuracy"]) if v >= GROKKED), None)
    neighbour = [float(sim[i, i + 1]) for i in range(len(steps) - 1)]
    # a finding that leans on an entry without a reliable estimate is not assessed (None)
    gone = [] if ok is None else [steps[i] for i in range(len(steps)) if not ok[i, -1]]
    at_sat = None if i_sat is None or steps[i_sat] in gone else to_final[i_sat]
    after = neighbour[i_sat:] if i_sat is not None and i_sat < len(neighbour) else []
    after_bad = [] if ok is None or i_sat is None else \
        [steps[i] for i in range(i_sat, len(steps) - 1) if not ok[i, i + 1]]
    finding = {
        "memorisation_step": None if j_mem is None else curve["step"][j_mem],
        "val_acc_at_memorisation": None if j_mem is None else curve["val_accuracy"][j_mem],
        "grokking_step": None if j_grok is None else curve["step"][j_grok],
        "grokking_delay": (None if j_mem is None or j_grok is None
                           else curve["step"][j_grok] - curve["step"][j_mem]),
        "memorisation_criterion": (f"first step with train accuracy >= {MEMORISED} on the "
                                   f"accuracy curve (evaluated every {every} steps)"),
        "grokking_criterion": (f"first step with val accuracy >= {GROKKED} on the accuracy "
                               f"curve (evaluated every {every} steps)"),
        "saturates": saturates,
        "saturation_step": None if i_sat is None else steps[i_sat],
        "saturation_criterion": (f"first checkpoint with val accuracy >= max - {SATURATION_TOL}, "
                                 f"only if the max is at least {SATURATION_ABOVE_CHANCE:g} of the "
                                 f"way from chance (1/P = {chance:.4f}) to 1, i.e. >= {floor:.4f}"),
        "chance_accuracy": chance,
        "max_val_acc": vmax,
        "val_acc_at_saturation": None if i_sat is None else val_acc[i_sat],
        "final_val_acc": val_acc[-1],
        "final_train_acc": train_acc[-1],
        "similarity_to_final_at_saturation": at_sat,
        "similarity_to_final_at_memorisation": (None if i_mem is None or steps[i_mem] in gone
                                                else to_final[i_mem]),
        "min_neighbour_similarity_after_saturation": (min(after) if after and not after_bad
                                                      else None),
        # saturating at the final checkpoint leaves nothing after it: similarity 1 to itself
        "keeps_changing": (None if at_sat is None or i_sat == len(steps) - 1
                           else bool(at_sat < 1 - CHANGE_THRESHOLD)),
        "saturates_at_final_checkpoint": i_sat is not None and i_sat == len(steps) - 1,
        "assessed": not (i_sat is not None and steps[i_sat] in gone) and not after_bad,
        "not_assessed": ("; ".join(x for x in (
            f"no reliable Monte Carlo estimate of the similarity to the final checkpoint at "
            f"step(s) {', '.join(map(str, gone))}" if gone else "",
            f"no reliable Monte Carlo estimate of the neighbour similarity after step(s) "
            f"{', '.join(map(str, after_bad))}" if after_bad else "") if x) or None),
        "keeps_changing_criterion": f"similarity to final at saturation < {1 - CHANGE_THRESHOLD}",
        "grokked": j_grok is not None,
    }
    # the data baseline over all P^2 inputs, and the Fourier picture of the weights
    import torch

    from ..baselines import model_outputs, output_cosine
    from .grokking_fourier import fourier_figure, fourier_record, fourier_statement

    X_all = torch.cat([data.X_train, data.X_test])
    logits = [model_outputs(m, X_all) for m in snaps]
    out_final = [output_cosine(lg, logits[-1]) for lg in logits]
    out_next = [output_cosine(logits[i], logits[i + 1]) for i in range(len(logits) - 1)]
    fourier = fourier_record(snaps, cfg.P, sim, val_acc, out_next, out_final)
    data_at_sat = None if i_sat is None else out_final[i_sat]
    finding.update({
        "output_cosine_to_final_at_saturation": data_at_sat,
        "data_keeps_changing": (None if data_at_sat is None or i_sat == len(steps) - 1
                                else bool(data_at_sat < 1 - CHANGE_THRESHOLD)),
        "data_keeps_changing_criterion": (f"output cosine to the final checkpoint over all "
                                          f"P^2 = {cfg.P ** 2} inputs at saturation < "
                                          f"{1 - CHANGE_THRESHOLD}"),
        "key_frequencies": fourier["key_frequencies"],
        "fourier_statement": fourier_statement(fourier, steps),
    })
    result = {
        **stamp("audit grokking", asdict(cfg)),
        "steps": steps,
        "n_checkpoints": len(steps),
        "train_accuracy": train_acc,
        "val_accuracy": val_acc,
        "train_loss": loss,
        "accuracy_curve": curve,
        "similarity_matrix": sim,
        "similarity_to_final": to_final,
        "neighbour_similarity": neighbour,
        "method": method,
        "metric": cfg.metric,
        "similarity_matrix_uncertainty": matrix_uncertainty(method, cfg.n_samples, cfg.seed),
        **{f"similarity_matrix_{k}": v for k, v in rec.items()},
        "similarity_to_final_stderr": None if se is None else se[:, -1].tolist(),
        "similarity_to_final_reliable": None if ok is None else ok[:, -1].tolist(),
        "finding": finding,
        "output_cosine_to_final": out_final,
        "output_cosine_neighbour": out_next,
        "output_cosine_note": (f"mean cosine of the logits over all P^2 = "
                               f"{cfg.P ** 2} input pairs (train and validation)"),
        "fourier": fourier,
        "size_note": size_note(cfg),
        "data": data.provenance,
        "checkpoints": names,
        "paths": PATHS_NOTE,
        "seconds": {"training": t_train, "similarity_matrix": t_sim,
                    "total": time.perf_counter() - t0},
    }
    write_csv(out / CSV_NAME, ["step", "train_accuracy", "val_accuracy", "train_loss",
                               "similarity_to_final", "similarity_to_final_stderr",
                               "output_cosine_to_final", "spectrum_distance_to_final",
                               "key_share_embedding", "key_share_bilinear"],
              zip(steps, train_acc, val_acc, loss, to_final,
                  [None] * len(steps) if se is None else se[:, -1], out_final,
                  fourier["spectrum_distance_to_final"], fourier["key_share_embedding"],
                  fourier["key_share_bilinear"]))
    write_csv(out / FOURIER_CSV, ["step", "part"] + [f"k{k}" for k in fourier["frequencies"]],
              [[st, part] + row for part in ("embedding", "bilinear")
               for st, row in zip(steps, fourier[f"{part}_power_share"])])
    fourier_figure(out / FIG_FOURIER, fourier, steps, to_final, out_final, val_acc,
                   f"grokking, mod {cfg.P}: Fourier power over training ({len(steps)} "
                   f"checkpoints; key frequencies {fourier['key_frequencies']})")
    write_csv(out / MATRIX_CSV, ["step"] + [str(s) for s in steps],
              ([s] + [float(v) for v in row] for s, row in zip(steps, sim)))
    grokking_figure(out / FIG_NAME, steps, train_acc, val_acc, sim, to_final, method,
                    cfg.metric)
    result["files"] = [JSON_NAME, CSV_NAME, MATRIX_CSV, FIG_NAME, FOURIER_CSV, FIG_FOURIER]
    write_json(out / JSON_NAME, result)
    return result


def _baseline_lines(result: dict) -> list[str]:
    f = result["finding"]
    lines = []
    if f.get("output_cosine_to_final_at_saturation") is not None:
        lines.append(f"data baseline ({result['output_cosine_note']}): to the final checkpoint "
                     f"at saturation {f['output_cosine_to_final_at_saturation']:.3f} (keeps "
                     f"changing: {f['data_keeps_changing']}; "
                     f"{f['data_keeps_changing_criterion']})")
    if f.get("fourier_statement"):
        lines.append(f"Fourier (figure {FIG_FOURIER}): {f['fourier_statement']}")
    if result.get("size_note"):
        lines.append(result["size_note"])
    return lines


def grokking_table(result: dict) -> str:
    n = len(result["steps"])
    se = result.get("similarity_to_final_stderr") or [None] * n
    ok = result.get("similarity_to_final_reliable") or [None] * n
    oc = result.get("output_cosine_to_final") or [None] * n
    ks = (result.get("fourier") or {}).get("key_share_embedding") or [None] * n
    rows = [[s, tr, va, pm(sf, e or None, r), o, k] for s, tr, va, sf, e, r, o, k in zip(
        result["steps"], result["train_accuracy"], result["val_accuracy"],
        result["similarity_to_final"], se, ok, oc, ks)]
    f = result["finding"]
    cfg = result["config"]
    method = result["method"]
    unc = result.get("similarity_matrix_uncertainty") or {}
    if unc.get("estimate"):
        method += f" estimate from {unc['n_samples']} samples, ± 1 standard error"
    if f.get("saturation_step") is None:
        sat = (f"validation accuracy never rises clearly above chance (max "
               f"{f['max_val_acc']:.3f}; chance 1/P = {f['chance_accuracy']:.3f}; saturation "
               f"needs >= {f['chance_accuracy'] + SATURATION_ABOVE_CHANCE * (1 - f['chance_accuracy']):.3f}):"
               f" no saturation point; final val accuracy {f['final_val_acc']:.3f}")
    else:
        sat = (f"validation accuracy saturates at step {f['saturation_step']} "
               f"({f['val_acc_at_saturation']:.3f}; final {f['final_val_acc']:.3f}); similarity to "
               f"the final checkpoint there: "
               + ("none: saturation is at the final checkpoint, nothing after it to compare "
                  "(keeps changing: not assessed; more --checkpoints or --steps)"
                  if f.get("saturates_at_final_checkpoint") else
                  f"{f['similarity_to_final_at_saturation']:.3f} (keeps changing: "
                  f"{f['keeps_changing']})" if f['similarity_to_final_at_saturation'] is not None
                  else "no reliable estimate (keeps changing: not assessed)"))
    if f.get("memorisation_step") is None:
        grok = f"never memorised (train accuracy stays below {MEMORISED}); "
    else:
        grok = (f"memorised (train accuracy >= {MEMORISED}) at step {f['memorisation_step']} "
                f"with val accuracy {f['val_acc_at_memorisation']:.3f}; ")
    if f.get("grokking_step") is None:
        best = max(result["accuracy_curve"]["val_accuracy"])
        grok += f"not grokked: val accuracy never reaches {GROKKED} (best {best:.3f})"
    elif f.get("grokking_delay") is None:
        grok += f"val accuracy >= {GROKKED} at step {f['grokking_step']}"
    else:
        grok += (f"grokked (val accuracy >= {GROKKED}) at step {f['grokking_step']}, "
                 f"{f['grokking_delay']} steps later")
    return "\n".join([
        f"grokking audit: modular addition mod {cfg['P']}, {len(result['steps'])} checkpoints "
        f"({method_label(method)} {result['metric']} similarity, "
        f"{result['seconds']['total']:.1f} s)",
        format_table(["step", "train acc", "val acc", "sim to final", "out cos to final",
                      "key share"], rows), "", grok, sat]
        + _baseline_lines(result)
        + ([f"not assessed: {f['not_assessed']}"] if f.get("not_assessed") else []))


SEEDS_JSON = "grokking_seeds.json"
SEEDS_CSV = "grokking_seeds.csv"


def run_grokking_seeds(cfg: GrokkingConfig, seeds: list[int], out: str | Path,
                       show_progress: bool = True, json_copy: str | Path | None = None) -> dict:
    """`run_grokking` once per seed (data split, initialisation and Monte Carlo seed), each
    complete run in ``out/seed<N>/``, and ``grokking_seeds.json`` / ``.csv`` at the top: every
    number's mean ± sample standard deviation over the seeds and each finding counted per seed;
    see [`tensoralg.audit.backdoor.run_backdoor_seeds`][tensoralg.audit.backdoor.run_backdoor_seeds].

    Raises:
        ValueError: ``seeds`` empty, negative or repeated (``--seeds``), and as `run_grokking`.
    """
    from .common import run_seeds

    return run_seeds(cfg, seeds, out, SEEDS_JSON, 1, _model, _run_grokking,
                     _summarise_grokking, show_progress, json_copy)


def _summarise_grokking(results: list[dict], seeds: list[int], stage: Path) -> dict:
    from .common import count_text, spread

    def col(get):
        vals = []
        for r in results:
            try:
                v = get(r)
            except (KeyError, TypeError):
                v = None
            vals.append(None if v is None else float(v))
        return spread(vals)

    sp = lambda part, key: (lambda r: r["fourier"]["spearman"][part][key])  # noqa: E731
    numbers = {
        "memorisation_step": col(lambda r: r["finding"]["memorisation_step"]),
        "grokking_step": col(lambda r: r["finding"]["grokking_step"]),
        "final_val_acc": col(lambda r: r["finding"]["final_val_acc"]),
        "saturation_step": col(lambda r: r["finding"]["saturation_step"]),
        "similarity_to_final_at_saturation": col(
            lambda r: r["finding"]["similarity_to_final_at_saturation"]),
        "output_cosine_to_final_at_saturation": col(
            lambda r: r["finding"]["output_cosine_to_final_at_saturation"]),
        "key_frequency_count": col(lambda r: len(r["fourier"]["key_frequencies"])),
        "key_share_embedding_final": col(lambda r: r["fourier"]["key_share_embedding"][-1]),
        **{f"spearman_{part}:{key}": col(sp(part, key))
           for part in ("intervals", "to_final")
           for key in ("tensor_similarity", "val_accuracy", "data_output_cosine")},
    }

    def flag(r, get):
        try:
            return get(r)
        except (KeyError, TypeError):
            return None

    def beats(r, other):
        t, o = r["fourier"]["spearman"]["intervals"]["tensor_similarity"], \
            r["fourier"]["spearman"]["intervals"][other]
        return None if t is None or o is None else bool(t > o)

    findings = {
        "grokked": [r["finding"]["grokked"] for r in results],
        "keeps_changing": [r["finding"]["keeps_changing"] for r in results],
        "data_keeps_changing": [flag(r, lambda r: r["finding"]["data_keeps_changing"])
                                for r in results],
        "tensor_tracks_spectrum_better_than_accuracy": [beats(r, "val_accuracy")
                                                        for r in results],
        "tensor_tracks_spectrum_better_than_data": [beats(r, "data_output_cosine")
                                                    for r in results],
    }
    statement = (f"over {len(seeds)} seeds ({', '.join(map(str, seeds))}): "
                 + "; ".join(f"{k.replace('_', ' ')}: {count_text(v)}"
                             for k, v in findings.items())
                 + " (Spearman over the consecutive intervals; see fourier.correlation_rule "
                   "in each run)")
    summary = {"command": "audit grokking --seeds", "method": results[0]["method"],
               "metric": results[0]["metric"], "numbers": numbers,
               "key_frequencies": {str(s): r["fourier"]["key_frequencies"]
                                   for s, r in zip(seeds, results)},
               "finding": {**findings,
                           **{f"{k}_count": count_text(v) for k, v in findings.items()},
                           "statement": statement},
               "size_note": results[0]["size_note"],
               "spread_note": "mean ± sample standard deviation (ddof 1) over the seeds",
               "files": [SEEDS_JSON, SEEDS_CSV] + [f"seed{s}/{f}" for s, r in zip(seeds, results)
                                                  for f in r["files"]]}
    write_csv(stage / SEEDS_CSV, ["quantity", "mean", "sd", "min", "max", "n"],
              [(k, v["mean"], v["sd"], v["min"], v["max"], v["n"]) for k, v in numbers.items()])
    return summary


def grokking_seeds_table(summary: dict) -> str:
    """Every number as mean ± sample standard deviation over the seeds, and each finding
    counted per seed."""
    from .common import spread_text

    return "\n".join([
        f"grokking audit over {len(summary['seeds'])} seeds {summary['seeds']} "
        f"({summary['method']}, {summary['metric']} metric); {summary['spread_note']}:",
        format_table(["number", "mean ± sd"],
                     [[k, spread_text(v)] for k, v in summary["numbers"].items()]), "",
        "key frequencies per seed: " + "; ".join(f"seed {s}: {k}" for s, k in
                                                 summary["key_frequencies"].items()),
        summary["finding"]["statement"], summary["size_note"]])
