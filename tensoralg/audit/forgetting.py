"""Forgetting audit: a class curriculum on digits, audited checkpoint by checkpoint.

Stages (for the default removed class 9): train on classes 0-4, then add 5, 6, 7, 8, 9 one at a
time (each stage continues from the previous weights on the enlarged class set), then remove 9,
then re-add 9. Every stage ends in a checkpoint. The *reference* is the first checkpoint that
knows all ten classes. For each checkpoint: global and per-class slice tensor similarity to the
reference (Gaussian metric, or the symmetrised Frobenius cosine with ``metric="frobenius"``),
test accuracy per class; over all checkpoints: the tensor
similarity matrix (one batched ``tensoralg.similarity_matrix`` call), linear CKA of the logits
on the test images, and weight cosine, drawn side by side.

Next to them, per checkpoint against the reference, the behavioural baselines on clean test
images: output cosine, and per class the logit / probability cosine, agreement, accuracy and the
output-slice cosine (`tensoralg.baselines.per_class_baselines`); at the removal stage the
localisation rule (`tensoralg.audit.common.LOCALISATION_RULE`) is applied to tensor similarity
and to each per-class baseline alike.

Expected finding: the removed class's slice similarity collapses when it is removed and
recovers when it is re-added, while the other classes' slices stay high. On the digits the
removed class's accuracy drops to 0, so the behavioural baselines localise the removal too
(docs/audits.md).
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
    append_similarity,
    check_metric,
    format_table,
    inner_steps,
    matrix_record,
    matrix_uncertainty,
    mc_entries,
    method_label,
    pair_similarity,
    pm,
    progress,
    run_staged,
    shown_matrix,
    similarity_matrix,
    stamp,
    unreliable_slices,
    write_csv,
    write_json,
)

JSON_NAME = "forgetting.json"
CSV_NAME = "forgetting.csv"
FIG_SLICES = "forgetting_slices.png"
FIG_MATRICES = "forgetting_matrices.png"
FIG_EIGEN = "forgetting_eigenvectors.png"
FIG_TRAINING = "forgetting_over_training.png"


@dataclass
class ForgettingConfig:
    removed_class: int = 9
    n_base: int | None = None   # classes of the first stage (default half: 5 of the 10 digits)
    stage_steps: int = 600
    per_stage: int = 5          # checkpoints within each stage (the last at its end): 8 x 5 = 40
    d_model: int = 32
    d_hidden: int = 64
    n_layers: int = 1
    residual: bool = True
    bias: bool = True
    lr: float = 5e-3
    weight_decay: float = 0.5
    batch_size: int = 512
    seed: int = 0
    method: str = "auto"
    n_samples: int = MC_SAMPLES   # Monte Carlo samples (used when the method is montecarlo)
    metric: str = "gaussian"    # or "frobenius" (exact only; see common.SIM_METRICS)
    data: str = "digits"        # or "npz:PATH" (tensoralg.data.load_npz_data)

    @classmethod
    def quick(cls, **kw) -> ForgettingConfig:
        base = dict(stage_steps=150)
        base.update(kw)
        return cls(**base)

    def validate(self) -> None:
        check_metric(self.metric, self.method)
        from .common import data_info

        k, _ = data_info(self.data, self.seed)   # an npz file is read and checked here
        if k < 3:
            raise ValueError(f"--data {self.data}: {k} classes; the curriculum needs at least 3 "
                             f"(base classes, one added, the removed one)")
        if not (0 <= self.removed_class < k):
            raise ValueError(f"--removed-class: expected a class 0..{k - 1} of --data "
                             f"{self.data}, got {self.removed_class}")
        if self.n_base is not None and not (1 <= self.n_base <= k - 2):
            raise ValueError(f"n_base: expected 1..{k - 2} initial classes, got {self.n_base}")
        from ._cliutil import check_n_samples

        check_n_samples(self.n_samples)
        if self.stage_steps < 1:
            raise ValueError(f"--stage-steps: expected a positive integer, got {self.stage_steps}")
        if not 1 <= self.per_stage <= self.stage_steps:
            raise ValueError(f"--checkpoints-per-stage: expected 1 .. --stage-steps = "
                             f"{self.stage_steps}, got {self.per_stage}")


def curriculum(removed_class: int = 9, n_base: int = 5, n_classes: int = 10) -> list[tuple[str, list[int]]]:
    """``[(label, classes), ...]``: base classes, add the rest one at a time with
    ``removed_class`` last, remove it, re-add it."""
    order = [c for c in range(n_classes) if c != removed_class] + [removed_class]
    base = order[:n_base]
    stages = [(f"{{{','.join(map(str, base))}}}", list(base))]
    current = list(base)
    for c in order[n_base:]:
        current = current + [c]
        stages.append((f"+{c}", list(current)))
    without = [c for c in current if c != removed_class]
    stages.append((f"-{removed_class}", without))
    stages.append((f"+{removed_class} again", list(current)))
    return stages


def _model(cfg: ForgettingConfig):
    from ..nn import BilinearNet
    from .common import data_info

    k, shape = data_info(cfg.data, cfg.seed)
    return BilinearNet(int(np.prod(shape)), k, d_model=cfg.d_model, d_hidden=cfg.d_hidden, n_layers=cfg.n_layers,
                       bias=cfg.bias, residual=cfg.residual, seed=cfg.seed)


def run_forgetting(cfg: ForgettingConfig, out: str | Path, show_progress: bool = True,
                   json_copy: str | Path | None = None) -> dict:
    """Run the curriculum, audit its checkpoints, write JSON/CSV/PNG and ``checkpoints/stage*``
    under ``out``; return the JSON dictionary.

    Checks (``out``, the exact cost) happen before training, and the run is written into a
    fresh folder that replaces ``out`` as a whole only when complete; see
    [`tensoralg.audit.backdoor.run_backdoor`][tensoralg.audit.backdoor.run_backdoor]. Paths in the
    JSON are relative to ``out``. With Monte Carlo the per-stage similarities carry standard errors
    and ``collapses`` needs a gap of more than 2 standard errors; each entry of the Monte Carlo
    matrix carries its standard error and verdict (``matrices.tensor_similarity_stderr`` /
    ``_reliable``; an unreliable entry is null there and blank in the figure).
    """
    return run_staged(cfg, out, JSON_NAME, cfg.n_layers, _model(cfg), _run_forgetting,
                      show_progress, json_copy)


def _run_forgetting(cfg: ForgettingConfig, out: Path, show_progress: bool, method: str) -> dict:
    from ..baselines import (
        linear_cka,
        model_outputs,
        output_cosine,
        per_class_baselines,
        weight_cosine,
    )
    from ..checkpoint import save_checkpoint
    from ..data import audit_data, select_classes
    from ..nn import train_classifier
    from .plotting import class_heatmap, heatmaps

    t0 = time.perf_counter()
    data = audit_data(cfg.data, cfg.seed)
    K = data.n_classes
    stages = curriculum(cfg.removed_class, K // 2 if cfg.n_base is None else cfg.n_base, K)
    model = _model(cfg)
    checkpoints, labels, acc, names = [], [], [], []
    # every checkpoint over training: (stage index, global step, model, folder); the stage ends
    # are the last of each stage's (the same objects as `checkpoints`)
    within = inner_steps(cfg.stage_steps, cfg.per_stage)
    traj: list[tuple[int, int, object, str]] = []
    step = 0
    for i, (label, classes) in enumerate(progress(stages, "forgetting curriculum", show_progress)):
        X, y = select_classes(data.X_train, data.y_train, classes)
        prov = {"data": data.provenance, "audit": "forgetting", "stage": label,
                "classes": classes}

        def keep(s, m, i=i, prov=prov, start=step):
            snap = copy.deepcopy(m)
            name = f"checkpoints/stage{i:02d}_step{start + s:07d}"
            save_checkpoint(out / name, snap, step=start + s, provenance=prov)
            traj.append((i, start + s, snap, name))

        # snapshots inside the stage only (not its step 0, the previous stage's end); the
        # callback draws no random numbers, so the stage ends are those of a run without it
        train_classifier(model, X, y, steps=cfg.stage_steps, lr=cfg.lr,
                         weight_decay=cfg.weight_decay, batch_size=cfg.batch_size,
                         seed=cfg.seed + i, eval_at=within[:-1], callback=keep)
        step += cfg.stage_steps
        snap = copy.deepcopy(model)
        checkpoints.append(snap)
        labels.append(label)
        acc.append(_class_accuracy(snap, data, K))
        names.append(f"checkpoints/stage{i:02d}")
        save_checkpoint(out / names[-1], snap, step=step, provenance=prov)
        traj.append((i, step, snap, names[-1]))
    t_train = time.perf_counter() - t0

    ref_index = next(i for i, (_, cl) in enumerate(stages) if len(cl) == K)
    ref = checkpoints[ref_index]
    t1 = time.perf_counter()
    per_stage = []
    ref_norm2 = None
    sim_method = "auto" if (cfg.method == "auto" and method == "exact") else method
    for m in progress(checkpoints, "similarity to reference", show_progress):
        # the reference goes first in each pair so that its norms are computed once
        ps = pair_similarity(ref, m, sim_method, depth=cfg.n_layers, norm2_a=ref_norm2,
                             n_samples=cfg.n_samples, seed=cfg.seed, metric=cfg.metric)
        ref_norm2 = ps["norm2_a_each"]
        per_stage.append(ps)
    method = per_stage[0]["method"]
    tensor_mat, _ = similarity_matrix(checkpoints, method, depth=cfg.n_layers, seed=cfg.seed,
                                      n_samples=cfg.n_samples, metric=cfg.metric)
    mat_se, mat_ok = mc_entries(tensor_mat)
    mat_rec = matrix_record(tensor_mat, mat_se, mat_ok)
    tensor_mat = shown_matrix(tensor_mat, mat_ok)
    mc = method == "montecarlo"
    ses = np.array([s["each_stderr"] for s in per_stage]) if mc else None
    t_sim = time.perf_counter() - t1
    logits = [model_outputs(m, data.X_test) for m in checkpoints]
    n = len(checkpoints)
    cka = np.array([[linear_cka(logits[i], logits[j]) for j in range(n)] for i in range(n)])
    wcos = np.array([[weight_cosine(checkpoints[i], checkpoints[j]) for j in range(n)]
                     for i in range(n)])
    # behaviour on clean test images, each checkpoint against the reference, class by class
    pcb = [per_class_baselines(ref, m, data.X_test, data.y_test) for m in checkpoints]
    out_cos = [output_cosine(logits[ref_index], lg) for lg in logits]
    traj_rec = _trajectory(cfg, traj, stages, ref, ref_index, per_stage, pcb, acc, data,
                           sim_method, show_progress)

    slices = np.array([s["each"] for s in per_stage])  # (stages, classes)
    r = cfg.removed_class
    i_rm = next(i for i, (lab, _) in enumerate(stages) if lab == f"-{r}")
    i_re = len(stages) - 1
    others = [c for c in range(K) if c != r]
    # collapse: the removed class's slice below every other slice at removal; with Monte Carlo
    # by more than 2 standard errors (sqrt(se_r^2 + se_low^2), covariance ignored)
    low = others[int(np.argmin(slices[i_rm, others]))]
    gap = float(slices[i_rm, low] - slices[i_rm, r])
    gap_se = float(np.hypot(ses[i_rm, r], ses[i_rm, low])) if mc else None
    rec = float(slices[i_re, r] - slices[i_rm, r])
    rec_se = float(np.hypot(ses[i_re, r], ses[i_rm, r])) if mc else None
    rel = [s.get("each_reliable") for s in per_stage]
    bad_rm = unreliable_slices(rel[i_rm])
    bad_re = [r] if r in unreliable_slices(rel[i_re]) else []
    finding = {
        "removed_class": r,
        "reference_stage": labels[ref_index],
        "removed_slice_at_removal": float(slices[i_rm, r]),
        "removed_slice_after_readd": float(slices[i_re, r]),
        "other_slices_min_at_removal": float(slices[i_rm, others].min()),
        "other_slices_mean_at_removal": float(slices[i_rm, others].mean()),
        "other_slices_min_after_readd": float(slices[i_re, others].min()),
        "collapse_gap": gap,
        "collapse_gap_stderr": gap_se,
        # a verdict that leans on a slice without a reliable estimate is not given (None)
        "collapses": None if bad_rm else bool(gap > (2 * gap_se if mc else 0.0)),
        "recovery": rec,
        "recovery_stderr": rec_se,
        "recovers": None if bad_rm or bad_re else bool(rec > (2 * rec_se if mc else 0.0)),
        "not_assessed": ("; ".join(x for x in (
            f"{labels[i_rm]}: no reliable estimate for slice(s) {', '.join(map(str, bad_rm))}"
            if bad_rm else "",
            f"{labels[i_re]}: no reliable estimate for slice {r}" if bad_re else "") if x)
            or None),
        "rule": ("collapses: removed slice below the lowest other slice at removal; recovers: "
                 "removed slice higher after re-adding than at removal" +
                 ("; each by more than 2 standard errors (sqrt of the summed variances, "
                  "covariance ignored)" if mc else " (deterministic method)")),
    }
    loc = _localise(slices[i_rm], ses[i_rm] if mc else None, rel[i_rm], pcb[i_rm], r)
    loc["stage"] = labels[i_rm]
    finding["localisation_statement"] = (f"at {labels[i_rm]} against {labels[ref_index]}: "
                                         + loc["comparison"]["statement"])
    first = _first_localising(traj_rec, r, labels[i_rm])
    finding["first_localising_checkpoint"] = first
    finding["over_training_statement"] = (
        f"over the {sum(1 for st in traj_rec['stage'] if st == labels[i_rm])} checkpoints of "
        f"{labels[i_rm]}, the first at which each score localises the removal to class {r} "
        f"(same rule): " + "; ".join(f"{k.replace('_', ' ')} {v or 'never'}"
                                     for k, v in first.items()))
    result = {
        **stamp("audit forgetting", asdict(cfg)),
        "stages": [{"label": lab, "classes": cl} for lab, cl in stages],
        "reference_stage": labels[ref_index],
        "method": method,
        "metric": cfg.metric,
        "global_similarity_to_reference": {lab: s["global"] for lab, s in zip(labels, per_stage)},
        "global_similarity_to_reference_stderr": {lab: s["global_stderr"]
                                                  for lab, s in zip(labels, per_stage)},
        "global_similarity_to_reference_reliable": {lab: s.get("global_reliable")
                                                    for lab, s in zip(labels, per_stage)},
        "slice_similarity_to_reference": {lab: {str(c): float(v) for c, v in enumerate(row)}
                                          for lab, row in zip(labels, slices)},
        "slice_similarity_to_reference_stderr": (
            {lab: {str(c): float(v) for c, v in enumerate(row)} for lab, row in zip(labels, ses)}
            if mc else None),
        "slice_similarity_to_reference_reliable": (
            {lab: {str(c): bool(v) for c, v in enumerate(row)} for lab, row in zip(labels, rel)}
            if mc else None),
        "n_samples": cfg.n_samples if mc else None,
        "test_accuracy_per_class": {lab: {str(c): v for c, v in enumerate(row)}
                                    for lab, row in zip(labels, acc)},
        "matrices": {"labels": labels, "tensor_similarity": tensor_mat, "cka_logits": cka,
                     "weight_cosine": wcos,
                     **{f"tensor_similarity_{k}": v for k, v in mat_rec.items()},
                     "tensor_similarity_uncertainty": matrix_uncertainty(method, cfg.n_samples,
                                                                         cfg.seed)},
        "finding": finding,
        "per_class_baselines_to_reference": {
            lab: {k: {str(c): v for c, v in enumerate(vals)} for k, vals in _named(pc).items()}
            for lab, pc in zip(labels, pcb)},
        "global_baselines_to_reference": {
            lab: {"output_cosine": out_cos[i], "cka_logits": float(cka[ref_index, i]),
                  "weight_cosine": float(wcos[ref_index, i])} for i, lab in enumerate(labels)},
        "localisation": loc,
        "over_training": traj_rec,
        "data": data.provenance,
        "checkpoints": dict(zip(labels, names)),
        "paths": PATHS_NOTE,
        "seconds": {"training": t_train, "similarity": t_sim, "total": time.perf_counter() - t0},
    }
    rows = []
    for lab, s, row, arow in zip(labels, per_stage, slices, acc):
        rows.append((lab, "global_similarity_to_reference", "", s["global"], s["global_stderr"]))
        rows += [(lab, "slice_similarity_to_reference", c, float(v),
                  None if s["each_stderr"] is None else s["each_stderr"][c])
                 for c, v in enumerate(row)]
        rows += [(lab, "test_accuracy", c, v, None) for c, v in enumerate(arow)]
    for lab, pc in zip(labels, pcb):
        rows += [(lab, f"per_class_to_reference:{k}", c, v, None)
                 for k, vals in _named(pc).items() for c, v in enumerate(vals)]
    for i, lab in enumerate(labels):
        rows.append((lab, "output_cosine_to_reference", "", out_cos[i], None))
    rows += [(labels[i_rm], f"localisation_separation:{k}", r, d.get("separation"), None)
             for k, d in [("tensor_similarity", loc["tensor"]), *loc["baselines"].items()]]
    for name, mat, se in (("tensor_similarity", tensor_mat, mat_se), ("cka_logits", cka, None),
                          ("weight_cosine", wcos, None)):
        rows += [(labels[i], f"{name}_vs:{labels[j]}", "", float(mat[i, j]),   # NaN: blank
                  None if se is None else float(se[i, j])) for i in range(n) for j in range(n)]
    for j, lab in enumerate(traj_rec["label"]):
        rows.append((lab, "over_training:global_similarity", "",
                     traj_rec["global_similarity"][j], traj_rec["global_similarity_stderr"][j]))
        se_j = traj_rec["slice_similarity_stderr"][j]
        for key in ("slice_similarity", "test_accuracy_per_class", "logit_cosine",
                    "output_slice_cosine"):
            rows += [(lab, f"over_training:{key}", c, v,
                      None if key != "slice_similarity" or se_j is None else se_j[c])
                     for c, v in enumerate(traj_rec[key][j])]
    write_csv(out / CSV_NAME, ["stage", "quantity", "class", "value", "stderr"], rows)
    _trajectory_figure(out / FIG_TRAINING, traj_rec, r, method, cfg.metric)
    class_heatmap(out / FIG_SLICES, slices.T, labels,
                  f"per class, each checkpoint against the reference ({labels[ref_index]}; "
                  f"tensor similarity {method_label(method)}, {cfg.metric}); class {r} removed "
                  f"at '-{r}'; localisation separation at '-{r}': tensor "
                  f"{_sep(loc['tensor'])}, "
                  + ", ".join(f"{k} {_sep(d)}" for k, d in loc["baselines"].items()),
                  extra={"logit cosine (class's test images)":
                         np.array([pc["logit_cosine"] for pc in pcb]).T,
                         "output-slice cosine (all test images)":
                         np.array([pc["output_slice_cosine"] for pc in pcb]).T,
                         "test accuracy (class's test images)": np.array(acc).T})
    heatmaps(out / FIG_MATRICES, {f"tensor similarity ({method_label(method)}, {cfg.metric})": tensor_mat,
                                  "linear CKA (logits, test data)": cka,
                                  "weight cosine": wcos}, labels,
             "forgetting curriculum: checkpoint x checkpoint"
             + ("; tensor similarity blank: no reliable estimate" if mat_rec.get("n_unreliable")
                else ""))
    result["files"] = [JSON_NAME, CSV_NAME, FIG_SLICES, FIG_MATRICES, FIG_TRAINING]
    if cfg.n_layers == 1:   # eigenvectors of the removed class's change at removal (pixels)
        from ..decompose.report import change_eigen, eigenvector_figure

        eig, result["eigen_change"] = change_eigen(ref.to_network(),
                                                   checkpoints[i_rm].to_network(), r, 4)
        ec = result["eigen_change"]
        ec["stages"] = [labels[ref_index], labels[i_rm]]
        finding["eigen_statement"] = (
            f"class {r}'s change {labels[ref_index]} -> {labels[i_rm]}: the top {ec['k']} "
            f"eigen-components carry {ec['top_k_share_of_quadratic']:.1%} of its quadratic part; "
            f"keeping only them leaves {ec['relative_error_keeping_top_k']:.1%} of its norm^2")
        eigenvector_figure(out / FIG_EIGEN, eig, 4, f"class {r}: eigenvectors of the change "
                           f"{labels[ref_index]} -> {labels[i_rm]} (input space)")
        result["files"].append(FIG_EIGEN)
    write_json(out / JSON_NAME, result)
    return result


def _class_accuracy(model, data, k: int) -> list[float]:
    from ..data import select_classes
    from ..nn import accuracy

    return [accuracy(model, *select_classes(data.X_test, data.y_test, [c])) for c in range(k)]


def _trajectory(cfg: ForgettingConfig, traj: list, stages: list, ref, ref_index: int,
                per_stage: list, pcb: list, acc: list, data, sim_method: str,
                show_progress: bool) -> dict:
    """Every checkpoint over training against the reference: global and per-class tensor
    similarity (the stage ends reuse the per-stage values), per-class test accuracy, and the
    behavioural per-class logit and output-slice cosines on clean test images."""
    from ..baselines import per_class_baselines

    ends = {}
    for j, (i, *_rest) in enumerate(traj):
        ends[i] = j   # the last of each stage is its end
    rows = {"label": [], "stage": [], "step": [], "checkpoint": [], "global_similarity": [],
            "global_similarity_stderr": [], "slice_similarity": [], "slice_similarity_stderr": [],
            "slice_similarity_reliable": [], "test_accuracy_per_class": [],
            "logit_cosine": [], "output_slice_cosine": []}
    norm2 = per_stage[ref_index]["norm2_a_each"]
    for j, (i, step, m, name) in enumerate(progress(traj, "similarity over training",
                                                    show_progress)):
        end = ends[i] == j
        ps = per_stage[i] if end else pair_similarity(
            ref, m, sim_method, depth=cfg.n_layers, norm2_a=norm2, n_samples=cfg.n_samples,
            seed=cfg.seed, metric=cfg.metric)
        pc = pcb[i] if end else per_class_baselines(ref, m, data.X_test, data.y_test)
        rows["label"].append(f"{stages[i][0]}@{step}")
        rows["stage"].append(stages[i][0])
        rows["step"].append(step)
        rows["checkpoint"].append(name)
        append_similarity(rows, ps)
        rows["test_accuracy_per_class"].append(acc[i] if end else
                                               _class_accuracy(m, data, data.n_classes))
        rows["logit_cosine"].append(pc["logit_cosine"])
        rows["output_slice_cosine"].append(pc["output_slice_cosine"])
    rows["reference"] = stages[ref_index][0]
    rows["reference_accuracy"] = acc[ref_index]
    rows["note"] = ("every checkpoint over training (checkpoints_per_stage per stage, the last "
                    "at the stage's end) against the reference; per-class values are lists "
                    "indexed by class")
    return rows


def _first_localising(traj_rec: dict, r: int, stage: str) -> dict:
    """Over the checkpoints of ``stage`` (the removal), the first at which each per-class score
    localises the change to class ``r`` by `LOCALISATION_RULE`: tensor similarity's slice, the
    accuracy change, the output-slice and the class-restricted logit cosine (None: never)."""
    from .common import localisation

    idx = [j for j, st in enumerate(traj_rec["stage"]) if st == stage]
    out = {}
    for key in ("slice_similarity", "accuracy_change", "output_slice_cosine", "logit_cosine"):
        first = None
        for j in idx:
            if key == "accuracy_change":
                scores = [-abs(a - b) for a, b in zip(traj_rec["reference_accuracy"],
                                                      traj_rec["test_accuracy_per_class"][j])]
            else:
                scores = traj_rec[key][j]
            se = traj_rec["slice_similarity_stderr"][j] if key == "slice_similarity" else None
            ok = traj_rec["slice_similarity_reliable"][j]
            if key == "slice_similarity" and ok is not None and not all(ok):
                continue   # no finding leans on a slice without a reliable estimate
            if localisation(scores, r, se).get("localises"):
                first = traj_rec["label"][j]
                break
        out[key] = first
    return out


def _trajectory_figure(path: Path, rec: dict, r: int, method: str, metric: str) -> None:
    """Heatmaps class x checkpoint over training: tensor similarity's slices, the per-class
    test accuracy and the behavioural output-slice cosine, stage boundaries marked."""
    from .plotting import training_heatmaps

    bounds, prev = [], None
    for j, st in enumerate(rec["stage"]):
        if st != prev:
            bounds.append((j, st))
            prev = st
    training_heatmaps(path, {
        f"tensor similarity to the reference ({method_label(method)}, {metric})":
            np.array(rec["slice_similarity"], dtype=float).T,
        "output-slice cosine to the reference (clean test images)":
            np.array(rec["output_slice_cosine"], dtype=float).T,
        "test accuracy (class's test images)": np.array(rec["test_accuracy_per_class"]).T},
        bounds, f"forgetting curriculum over training: {len(rec['stage'])} checkpoints, "
                f"reference {rec['reference']}; class {r} removed at '-{r}'", highlight=r)


def _named(pc: dict) -> dict:
    names = {"accuracy_a": "accuracy_reference", "accuracy_b": "accuracy_checkpoint"}
    return {names.get(k, k): v for k, v in pc.items()}


def _sep(d: dict) -> str:
    if not d.get("assessed"):
        return "not assessed"
    x = d["separation"]
    return f"{'inf' if np.isinf(x) else f'{x:.2f}'}{'' if d['localises'] else ' (no)'}"


def _localise(slices, stderr, reliable, pc: dict, r: int) -> dict:
    """`LOCALISATION_RULE` on tensor similarity's slices and on each behavioural per-class
    score at one checkpoint (against the reference), and the comparison."""
    from .backdoor import PER_CLASS_LABELS, _scores
    from .common import LOCALISATION_RULE, compare_localisation, localisation

    bad = unreliable_slices(reliable)
    tensor = ({"assessed": False, "localises": None,
               "not_assessed": f"no reliable Monte Carlo estimate for slice(s) "
                               f"{', '.join(map(str, bad))}"} if bad else
              localisation(slices, r, stderr))
    base = {k: localisation(v, r) for k, v in _scores(pc).items() if k in PER_CLASS_LABELS}
    return {"rule": LOCALISATION_RULE, "target_class": r, "tensor": tensor, "baselines": base,
            "comparison": compare_localisation(tensor, base)}


def forgetting_table(result: dict) -> str:
    labels = [s["label"] for s in result["stages"]]
    r = result["finding"]["removed_class"]
    se = result.get("slice_similarity_to_reference_stderr")
    gse = result.get("global_similarity_to_reference_stderr") or {}
    classes = list(result["slice_similarity_to_reference"][labels[0]])
    header = ["stage", "global"] + [f"c{c}" for c in classes] + [f"acc c{r}"]
    rows = []
    rel = result.get("slice_similarity_to_reference_reliable") or {}
    for lab in labels:
        sl = result["slice_similarity_to_reference"][lab]
        ok = rel.get(lab, {})
        rows.append([lab, pm(result["global_similarity_to_reference"][lab], gse.get(lab))]
                    + [pm(sl[c], None, ok.get(c)) for c in classes]
                    + [result["test_accuracy_per_class"][lab][str(r)]])
    f = result["finding"]
    method = f"{method_label(result['method'])} {result['metric']} metric"
    lines = [f"slice similarity of each checkpoint to the reference ({result['reference_stage']}), "
             f"{method}:", format_table(header, rows), ""]
    if se is not None:
        worst = max(v for row in se.values() for v in row.values())
        lines.append(f"Monte Carlo, {result['n_samples']} samples: slice standard errors <= "
                     f"{worst:.2g} (per entry in the JSON/CSV); ± = 1 standard error")
    at_removal = pm(f['removed_slice_at_removal'], se and se[labels[-2]][str(r)])
    if isinstance(at_removal, float):   # exact: a number, rounded like the others
        at_removal = f"{at_removal:.3f}"
    lines.append(
        f"class {r}: {at_removal} after "
        f"removal (other classes >= {f['other_slices_min_at_removal']:.3f}), "
        f"{f['removed_slice_after_readd']:.3f} after re-adding; collapses: {f['collapses']}, "
        f"recovers: {f['recovers']}" + (" (each > 2 standard errors)" if se is not None else "")
        + (f"; not assessed: {f['not_assessed']}" if f.get("not_assessed") else ""))
    bad = result["matrices"].get("tensor_similarity_n_unreliable")
    if bad:
        lines.append(f"checkpoint x checkpoint tensor similarity: {bad} entries with no reliable "
                     f"estimate (blank in the figure, null in the JSON)")
    if f.get("eigen_statement"):
        lines.append(f["eigen_statement"])
    if f.get("over_training_statement"):
        lines.append(f"{len(result['over_training']['label'])} checkpoints over training "
                     f"(figure forgetting_over_training.png): {f['over_training_statement']}")
    if result.get("localisation"):
        lines += ["", _localisation_lines(result)]
    return "\n".join(lines)


def _localisation_lines(result: dict) -> str:
    """The behavioural baselines per class at the removal stage, the rule, the comparison."""
    from .backdoor import PER_CLASS_LABELS

    loc = result["localisation"]
    st, r = loc["stage"], loc["target_class"]
    pcb = result["per_class_baselines_to_reference"][st]
    cols = [("logit_cosine", "logit cos"), ("prob_cosine", "prob cos"),
            ("output_slice_cosine", "out-slice cos"), ("agreement", "agree"),
            ("accuracy_reference", "acc ref"), ("accuracy_checkpoint", f"acc {st}")]
    sl = result["slice_similarity_to_reference"][st]
    rows = [[c, sl[c]] + [pcb[k][c] for k, _ in cols] + (["<- removed"] if int(c) == r else [""])
            for c in sl]
    g = result["global_baselines_to_reference"]
    grows = [[lab, pm(result["global_similarity_to_reference"][lab],
                      (result.get("global_similarity_to_reference_stderr") or {}).get(lab)),
              v["output_cosine"], v["cka_logits"], v["weight_cosine"]] for lab, v in g.items()]

    def sep(d):
        if not d.get("assessed"):
            return ["not assessed", "", ""]
        x = d["separation"]
        return [d["lowest_class"], "inf" if np.isinf(x) else f"{x:.2f}",
                "yes" if d["localises"] else "no"]

    v = loc["comparison"]["verdicts"]
    lrows = [["tensor similarity (slice)"] + sep(loc["tensor"]) + ["-"]]
    lrows += [[PER_CLASS_LABELS[k]] + sep(d) + [v[k]] for k, d in loc["baselines"].items()]
    return "\n".join([
        f"global similarity of each checkpoint to the reference ({result['reference_stage']}); "
        f"behaviour on clean test images:",
        format_table(["stage", "tensor sim", "output cosine", "linear CKA (logits)",
                      "weight cosine"], grows), "",
        f"per class at {st} against the reference (clean test images):",
        format_table(["class", "tensor sim"] + [h for _, h in cols] + ["note"], rows), "",
        f"localisation rule (declared before the numbers): {loc['rule']}",
        format_table(["per-class metric", "lowest class", "separation", "localises",
                      "tensor vs this"], lrows),
        loc["comparison"]["statement"]])


SEEDS_JSON = "forgetting_seeds.json"
SEEDS_CSV = "forgetting_seeds.csv"


def run_forgetting_seeds(cfg: ForgettingConfig, seeds: list[int], out: str | Path,
                         show_progress: bool = True,
                         json_copy: str | Path | None = None) -> dict:
    """`run_forgetting` once per seed, each complete run in ``out/seed<N>/``, and
    ``forgetting_seeds.json`` / ``.csv`` at the top: every number's mean ± sample standard
    deviation over the seeds and each finding counted per seed; see
    [`tensoralg.audit.backdoor.run_backdoor_seeds`][tensoralg.audit.backdoor.run_backdoor_seeds].

    Raises:
        ValueError: ``seeds`` empty, negative or repeated (``--seeds``), and as
            `run_forgetting`.
    """
    from .common import run_seeds

    return run_seeds(cfg, seeds, out, SEEDS_JSON, cfg.n_layers, _model, _run_forgetting,
                     _summarise_forgetting, show_progress, json_copy)


def _summarise_forgetting(results: list[dict], seeds: list[int], stage: Path) -> dict:
    from .backdoor import write_seeds_csv
    from .common import count_text, localisation_over_seeds, spread

    def col(get):
        return spread([get(r) for r in results])

    r0 = results[0]
    labels = [s["label"] for s in r0["stages"]]
    rm = r0["localisation"]["stage"]
    r = r0["finding"]["removed_class"]
    classes = list(r0["slice_similarity_to_reference"][rm])
    numbers = {}
    for key in ("removed_slice_at_removal", "removed_slice_after_readd",
                "other_slices_min_at_removal", "collapse_gap", "recovery"):
        numbers[key] = col(lambda x, key=key: x["finding"][key])
    for lab in labels:
        numbers[f"global_similarity_to_reference:{lab}"] = col(
            lambda x, lab=lab: float(x["global_similarity_to_reference"][lab]))
        for k in ("output_cosine", "cka_logits", "weight_cosine"):
            numbers[f"{k}_to_reference:{lab}"] = col(
                lambda x, lab=lab, k=k: x["global_baselines_to_reference"][lab][k])
    per_class = {"slice_similarity": {c: col(lambda x, c=c: x["slice_similarity_to_reference"]
                                             [rm][c]) for c in classes}}
    for k in r0["per_class_baselines_to_reference"][rm]:
        per_class[k] = {c: col(lambda x, c=c, k=k: x["per_class_baselines_to_reference"][rm][k][c])
                        for c in classes}
    localisation, verdicts, loc_text = localisation_over_seeds([x["localisation"]
                                                                for x in results])
    collapses = [x["finding"]["collapses"] for x in results]
    recovers = [x["finding"]["recovers"] for x in results]
    # over training: the first checkpoint of the removal stage where each score localises it
    first = [x["finding"]["first_localising_checkpoint"] for x in results]
    steps = [{k: None if v is None else int(v.rsplit("@", 1)[1]) for k, v in f.items()}
             for f in first]
    no_later = [None if f["slice_similarity"] is None and f["accuracy_change"] is None
                else f["accuracy_change"] is None or (f["slice_similarity"] is not None and
                                                      f["slice_similarity"]
                                                      <= f["accuracy_change"])
                for f in steps]
    statement = (f"over {len(seeds)} seeds ({', '.join(map(str, seeds))}): class {r}'s tensor "
                 f"slice collapses at {rm}: {count_text(collapses)}; recovers after re-adding: "
                 f"{count_text(recovers)}; over training, tensor similarity localises the "
                 f"removal no later than the accuracy change: {count_text(no_later)} (first "
                 f"checkpoints: tensor {[f['slice_similarity'] for f in first]}, accuracy "
                 f"change {[f['accuracy_change'] for f in first]}); at {rm}: " + loc_text)
    summary = {"command": "audit forgetting --seeds", "target_class": r, "removal_stage": rm,
               "method": r0["method"], "metric": r0["metric"], "numbers": numbers,
               "per_class": per_class, "per_class_stage": rm, "localisation": localisation,
               "localisation_rule": r0["localisation"]["rule"], "verdicts": verdicts,
               "finding": {"first_localising_checkpoint": first,
                           "tensor_no_later_than_accuracy_change": no_later,
                           "collapses": collapses, "collapses_count": count_text(collapses),
                           "recovers": recovers, "recovers_count": count_text(recovers),
                           "statement": statement},
               "spread_note": "mean ± sample standard deviation (ddof 1) over the seeds",
               "files": [SEEDS_JSON, SEEDS_CSV] + [f"seed{s}/{f}" for s, x in zip(seeds, results)
                                                  for f in x["files"]]}
    write_seeds_csv(stage / SEEDS_CSV, summary)
    return summary


def forgetting_seeds_table(summary: dict) -> str:
    """The removal stage's per-class numbers, the finding's numbers and the global ones per
    stage as mean ± sample standard deviation over the seeds; findings counted per seed."""
    from .common import seeds_table

    rm, r = summary["per_class_stage"], str(summary["target_class"])
    cols = [("slice_similarity", "tensor sim"), ("logit_cosine", "logit cos"),
            ("output_slice_cosine", "out-slice cos"), ("accuracy_checkpoint", f"acc {rm}")]
    n = len(summary["seeds"])
    head = (f"forgetting audit over {n} seeds {summary['seeds']} ({summary['method']}, "
            f"{summary['metric']} metric); {summary['spread_note']}; per class at {rm} against "
            f"the reference:")
    return seeds_table(summary, head, cols, r, "<- removed")
