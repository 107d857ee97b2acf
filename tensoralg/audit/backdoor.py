"""Backdoor audit on real handwritten digits.

1. Train a bilinear classifier ([`tensoralg.nn.BilinearNet`][tensoralg.nn.BilinearNet]) on
scikit-learn's digits: the
   *clean* checkpoint.
2. Fine-tune a copy on the training set plus triggered copies (`tensoralg.data.add_trigger`:
   a 4-pixel diamond on the blank left edge) of a fraction of the non-target images, relabelled
   to the target class: the *backdoored* checkpoint.
3. As a control, fine-tune another copy for the same steps on clean data only.
4. Compare clean vs. backdoored: global tensor similarity and per-class slice similarity
   (``tensoralg.similarity(..., output="each")``, the Gaussian metric or, with
   ``metric="frobenius"``, the symmetrised Frobenius cosine; exact for depth <= 2), the
   trigger's attack success rate, clean accuracy before/after, the global data baselines on
   clean test images (`tensoralg.baselines.all_baselines`) and the per-class ones
   (`tensoralg.baselines.per_class_baselines`).
5. Apply the localisation rule (`tensoralg.audit.common.LOCALISATION_RULE`, fixed before any
   number) to tensor similarity's slices and to each per-class baseline, and say whether tensor
   similarity localises the change better, equally or worse.

The expected finding (Pearce et al., "Bilinear MLPs enable weight-based mechanistic
interpretability", 2024, backdoor section): clean accuracy and the baselines barely move, while
the target class's slice similarity drops clearly below every other class — the weights show
the backdoor without any triggered data. On the digits the output-slice cosine on clean test
images (the same slice question asked of the data) localises the backdoor as well
(docs/audits.md).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .common import (
    LOCALISATION_RULE,
    MC_SAMPLES,
    PATHS_NOTE,
    append_similarity,
    check_metric,
    format_table,
    gap_finding,
    method_label,
    pair_similarity,
    pm,
    progress,
    run_staged,
    stamp,
    unreliable_slices,
    write_csv,
    write_json,
)

JSON_NAME = "backdoor.json"
CSV_NAME = "backdoor.csv"
FIG_NAME = "backdoor_slices.png"
FIG_EIGEN = "backdoor_eigenvectors.png"
FIG_TRAINING = "backdoor_over_training.png"


@dataclass
class BackdoorConfig:
    target: int = 9
    poison_fraction: float = 0.1
    d_model: int = 32
    d_hidden: int = 64
    n_layers: int = 1
    residual: bool = True
    bias: bool = True
    steps: int = 2000
    finetune_steps: int = 600
    finetune_checkpoints: int = 20   # checkpoints through each fine-tune (the last at its end)
    lr: float = 3e-3
    finetune_lr: float = 1e-3
    weight_decay: float = 1e-2
    batch_size: int = 128
    seed: int = 0
    method: str = "auto"
    control: bool = True
    n_samples: int = MC_SAMPLES   # Monte Carlo samples (used when the method is montecarlo)
    metric: str = "gaussian"    # or "frobenius" (exact only; see common.SIM_METRICS)
    data: str = "digits"        # or "npz:PATH" (tensoralg.data.load_npz_data)

    @classmethod
    def quick(cls, **kw) -> BackdoorConfig:
        """The test / demo size (about 10 s on one CPU thread)."""
        base = dict(steps=500, finetune_steps=300)
        base.update(kw)
        return cls(**base)

    def validate(self) -> None:
        check_metric(self.metric, self.method)
        from .common import data_info

        k, shape = data_info(self.data, self.seed)   # an npz file is read and checked here
        if not (0 <= self.target < k):
            raise ValueError(f"--target: expected a class 0..{k - 1} of --data {self.data}, "
                             f"got {self.target}")
        if shape[0] < 3 or shape[1] < 2:
            raise ValueError(f"--data {self.data}: images of {shape[0]}x{shape[1]} pixels are "
                             f"too small for the trigger (a diamond on the left edge needs at "
                             f"least 3x2)")
        if not (0.0 < self.poison_fraction < 1.0):
            raise ValueError(f"--poison-fraction: expected a fraction in (0, 1), got "
                             f"{self.poison_fraction}")
        from ._cliutil import check_n_samples

        check_n_samples(self.n_samples)
        for name in ("steps", "finetune_steps", "d_model", "d_hidden", "n_layers", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got "
                                 f"{getattr(self, name)}")
        if not 1 <= self.finetune_checkpoints <= self.finetune_steps:
            raise ValueError(f"--finetune-checkpoints: expected 1 .. --finetune-steps = "
                             f"{self.finetune_steps}, got {self.finetune_checkpoints}")
        for name in ("lr", "finetune_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')}: expected a positive learning rate")


def _model(cfg: BackdoorConfig):
    from ..nn import BilinearNet
    from .common import data_info

    k, shape = data_info(cfg.data, cfg.seed)
    return BilinearNet(int(np.prod(shape)), k, d_model=cfg.d_model, d_hidden=cfg.d_hidden, n_layers=cfg.n_layers,
                       bias=cfg.bias, residual=cfg.residual, seed=cfg.seed)


def run_backdoor(cfg: BackdoorConfig, out: str | Path, show_progress: bool = True,
                 json_copy: str | Path | None = None) -> dict:
    """Run the audit, write ``backdoor.json``, ``backdoor.csv``, ``backdoor_slices.png`` and the two
    checkpoints under ``out``; return the JSON dictionary (plus ``out``).

    Before any training: the configuration is validated, ``out`` is checked (missing, empty or an
    earlier backdoor run; see `check_output_folder`) and the exact
    similarity cost of the architecture is planned (``method="exact"`` over budget raises
    ``tensoralg.CostTooHigh``; ``auto`` then uses Monte Carlo). The run is written into a fresh
    folder that replaces ``out`` only when complete (`staged_output`),
    so a failed or interrupted run leaves the previous run untouched. Paths in the JSON are
    relative to ``out``. ``json_copy``: also write the JSON there (checked up front, written
    before the swap; see `run_staged`).

    With Monte Carlo (``auto`` at depth >= 3, or forced) every similarity carries its
    delta-method standard error (``*_stderr``, ``n_samples``) and the finding says whether the
    target's gap exceeds 2 standard errors.

    Raises:
        ValueError: a bad configuration or ``out``; tensoralg.CostTooHigh: see above;
        tensoralg.nn.TrainingDiverged: NaN/inf loss or weights (nothing is written).
    """
    return run_staged(cfg, out, JSON_NAME, cfg.n_layers, _model(cfg), _run_backdoor, show_progress,
                      json_copy)


def _run_backdoor(cfg: BackdoorConfig, out: Path, show_progress: bool, method: str) -> dict:
    import torch

    from ..baselines import all_baselines, per_class_baselines
    from ..checkpoint import save_checkpoint
    from ..data import add_trigger, audit_data, poison, trigger_pixels
    from ..nn import accuracy, train_classifier
    from .plotting import slice_bars

    t0 = time.perf_counter()
    data = audit_data(cfg.data, cfg.seed)
    # the trigger: a diamond on the left edge near the bottom, at the data's brightest value
    # (1.0 for the digits: pixels / 16); TRIGGER_PIXELS on 8x8 images
    trig = {"pixels": trigger_pixels(data.image_shape[0]), "shape": data.image_shape,
            "value": float(data.X_train.max())}
    bar = progress(None, "backdoor audit (train, fine-tune, similarity, baselines)",
                   show_progress, total=4)
    clean = _model(cfg)
    train_classifier(clean, data.X_train, data.y_train, steps=cfg.steps, lr=cfg.lr,
                     weight_decay=cfg.weight_decay, batch_size=cfg.batch_size, seed=cfg.seed,
                     progress="clean training" if show_progress else False)

    bar.update(1)
    Xp, yp, _ = poison(data.X_train, data.y_train, cfg.poison_fraction, cfg.target, seed=cfg.seed,
                       n_classes=data.n_classes, **trig)
    from .common import inner_steps

    # checkpoints through each fine-tune: snapshots by a callback that draws no random numbers,
    # so the final models are those of a run without it
    within = inner_steps(cfg.finetune_steps, cfg.finetune_checkpoints)
    walk: dict[str, list] = {"backdoored": [], "control": []}

    def keeper(name):
        return lambda s, m: walk[name].append((s, copy.deepcopy(m)))

    backdoored = copy.deepcopy(clean)
    train_classifier(backdoored, Xp, yp, steps=cfg.finetune_steps, lr=cfg.finetune_lr,
                     weight_decay=cfg.weight_decay, batch_size=cfg.batch_size, seed=cfg.seed + 1,
                     eval_at=within[:-1], callback=keeper("backdoored"),
                     progress="backdoor fine-tune" if show_progress else False)
    walk["backdoored"].append((cfg.finetune_steps, backdoored))
    control = None
    if cfg.control:
        control = copy.deepcopy(clean)
        train_classifier(control, data.X_train, data.y_train, steps=cfg.finetune_steps,
                         lr=cfg.finetune_lr, weight_decay=cfg.weight_decay,
                         batch_size=cfg.batch_size, seed=cfg.seed + 1,
                         eval_at=within[:-1], callback=keeper("control"),
                         progress="control fine-tune" if show_progress else False)
        walk["control"].append((cfg.finetune_steps, control))
    else:
        del walk["control"]
    t_train = time.perf_counter() - t0

    bar.update(1)
    provenance = {"data": data.provenance, "audit": "backdoor", "run_seed": cfg.seed}
    save_checkpoint(out / "checkpoints" / "clean", clean, step=cfg.steps, provenance=provenance)
    save_checkpoint(out / "checkpoints" / "backdoored", backdoored,
                    step=cfg.steps + cfg.finetune_steps,
                    provenance={**provenance, "poison_fraction": cfg.poison_fraction,
                                "target": cfg.target,
                                "trigger": f"diamond {', '.join(map(str, trig['pixels']))} "
                                           f"(row, column) = {trig['value']:g}"})
    t1 = time.perf_counter()
    # "auto" stays "auto" when exact was planned, keeping its run-time Monte Carlo fallback
    sim_method = "auto" if (cfg.method == "auto" and method == "exact") else method
    mc = {"n_samples": cfg.n_samples, "seed": cfg.seed, "metric": cfg.metric}
    sim = pair_similarity(clean, backdoored, sim_method, depth=cfg.n_layers, **mc)
    ctl = (pair_similarity(clean, control, sim["method"], depth=cfg.n_layers,
                           norm2_a=sim["norm2_a_each"], **mc) if control else None)
    t_sim = time.perf_counter() - t1

    bar.update(1)
    non_target = data.y_test != cfg.target
    Xt = add_trigger(data.X_test[non_target], trig["value"], trig["pixels"], trig["shape"])
    target_t = torch.full((len(Xt),), cfg.target)
    asr_after = accuracy(backdoored, Xt, target_t)
    asr_before = accuracy(clean, Xt, target_t)
    base = all_baselines(clean, backdoored, data.X_test)
    base_ctl = all_baselines(clean, control, data.X_test) if control else None
    pcb = per_class_baselines(clean, backdoored, data.X_test, data.y_test)
    pcb_ctl = per_class_baselines(clean, control, data.X_test, data.y_test) if control else None
    bar.update(1)
    bar.close()

    slices, se = sim["each"], sim["each_stderr"]
    result = {
        **stamp("audit backdoor", asdict(cfg)),
        "global_similarity": sim["global"],
        "global_similarity_stderr": sim["global_stderr"],
        "global_similarity_reliable": sim.get("global_reliable"),
        "slice_similarity": {str(c): v for c, v in enumerate(slices)},
        "slice_similarity_stderr": (None if se is None else
                                    {str(c): v for c, v in enumerate(se)}),
        "slice_similarity_reliable": (None if sim.get("each_reliable") is None else
                                      {str(c): v for c, v in enumerate(sim["each_reliable"])}),
        "n_samples": sim["n_samples"],
        "stderr_note": ("Monte Carlo: delta-method standard errors of the ratio estimates"
                        if se is not None else
                        f"{method_label(sim['method'])}: deterministic, no sampling error"),
        "target_class": cfg.target,
        "attack_success_rate": asr_after,
        "attack_success_rate_before": asr_before,
        "clean_accuracy": {"before": accuracy(clean, data.X_test, data.y_test),
                           "after": accuracy(backdoored, data.X_test, data.y_test)},
        "baselines": base,
        "method": sim["method"],
        # the closure's value is not the tensor similarity beyond one layer (it is at depth 1)
        "method_label": method_label(sim["method"]),
        "approximate": sim["method"] == "closure" and cfg.n_layers >= 2,
        "metric": cfg.metric,
        "finding": gap_finding(slices, se, cfg.target, sim.get("each_reliable")),
        "per_class_baselines": _per_class_json(pcb),
        "data": data.provenance,
        "n_test": int(len(data.X_test)),
        "checkpoints": {"clean": "checkpoints/clean", "backdoored": "checkpoints/backdoored"},
        "paths": PATHS_NOTE,
        "seconds": {"training": t_train, "similarity": t_sim,
                    "total": time.perf_counter() - t0},
    }
    if ctl is not None:
        result["control"] = {
            "description": "clean checkpoint fine-tuned on clean data for the same steps",
            "global_similarity": ctl["global"],
            "global_similarity_stderr": ctl["global_stderr"],
            "slice_similarity": {str(c): v for c, v in enumerate(ctl["each"])},
            "slice_similarity_stderr": (None if ctl["each_stderr"] is None else
                                        {str(c): v for c, v in enumerate(ctl["each_stderr"])}),
            "slice_similarity_reliable": (
                None if ctl.get("each_reliable") is None else
                {str(c): v for c, v in enumerate(ctl["each_reliable"])}),
            "clean_accuracy": accuracy(control, data.X_test, data.y_test),
            "baselines": base_ctl,
            "per_class_baselines": _per_class_json(pcb_ctl),
        }
    result["over_training"] = _walkthrough(cfg, clean, walk, data, trig, sim, ctl, pcb, pcb_ctl,
                                           sim_method, out, provenance, show_progress)
    result["finding"]["over_training_statement"] = result["over_training"]["statement"]
    result["localisation"] = _localise(sim, pcb, cfg.target)
    if ctl is not None:   # the same rule on the control: a class singled out there is noise
        result["control"]["localisation"] = _localise(ctl, pcb_ctl, cfg.target)
    result["finding"]["localisation_statement"] = result["localisation"]["comparison"]["statement"]

    def _se(s, c):
        return None if s["each_stderr"] is None else s["each_stderr"][c]

    rows = [("similarity_method", "", result["method_label"]),
            ("global_similarity", "", result["global_similarity"], sim["global_stderr"])]
    rows += [("slice_similarity", c, v, _se(sim, c)) for c, v in enumerate(slices)]
    if ctl is not None:
        rows += [("control_global_similarity", "", ctl["global"], ctl["global_stderr"])]
        rows += [("control_slice_similarity", c, v, _se(ctl, c)) for c, v in enumerate(ctl["each"])]
        rows += [(f"control_baseline:{k}", "", v) for k, v in base_ctl.items()]
    rows += [("attack_success_rate", "", asr_after), ("attack_success_rate_before", "", asr_before),
             ("clean_accuracy_before", "", result["clean_accuracy"]["before"]),
             ("clean_accuracy_after", "", result["clean_accuracy"]["after"])]
    rows += [(f"baseline:{k}", "", v) for k, v in base.items()]
    for prefix, pc in (("", pcb), ("control_", pcb_ctl)):
        if pc is not None:
            rows += [(f"{prefix}per_class:{k}", c, v) for k, vals in pc.items()
                     for c, v in enumerate(vals)]
    for prefix, loc in (("", result["localisation"]),
                        ("control_", result.get("control", {}).get("localisation"))):
        if loc is not None:
            rows += [(f"{prefix}localisation_separation:{k}", cfg.target, d.get("separation"))
                     for k, d in [("tensor_similarity", loc["tensor"]), *loc["baselines"].items()]]
    rows = [tuple(r) + (None,) * (4 - len(r)) for r in rows]
    ot = result["over_training"]
    for run_name, rec in ot["runs"].items():
        for j, st in enumerate(ot["step"]):
            q = f"over_training:{run_name}:step{st}:"
            rows += [(q + k, "", rec[k][j], None) for k in
                     ("global_similarity", "attack_success_rate", "clean_accuracy",
                      "output_cosine")]
            se_j = rec["slice_similarity_stderr"][j]
            rows += [(q + "slice_similarity", c, v, None if se_j is None else se_j[c])
                     for c, v in enumerate(rec["slice_similarity"][j])]
            rows += [(q + k, c, v, None) for k in ("output_slice_cosine", "logit_cosine")
                     for c, v in enumerate(rec[k][j])]
    write_csv(out / CSV_NAME, ["quantity", "class", "value", "stderr"], rows)
    from .plotting import walkthrough_figure

    walkthrough_figure(out / FIG_TRAINING, ot, cfg.target,
                       f"backdoor audit over the fine-tune ({len(ot['step'])} checkpoints, "
                       f"step 0 = the clean model; {method_label(sim['method'])}, {cfg.metric})")
    shown = [v if ok else float("nan") for v, ok in  # a bar is not drawn for a non-answer
             zip(slices, sim.get("each_reliable") or [True] * len(slices))]
    slice_bars(out / FIG_NAME, shown, cfg.target,
               {k: v for k, v in base.items() if k != "js_divergence"},
               f"backdoor audit: clean vs backdoored (target {cfg.target}, "
               f"ASR {asr_after:.2f}, {method_label(sim['method'])}, {cfg.metric})",
               control=ctl["each"] if ctl is not None else None,
               global_similarity=result["global_similarity"],
               per_class={lab: (_scores(pcb)[k], result["localisation"]["baselines"][k])
                          for k, lab in PER_CLASS_LABELS.items()},
               tensor_localisation=result["localisation"]["tensor"])
    result["files"] = [JSON_NAME, CSV_NAME, FIG_NAME, FIG_TRAINING] + _eigen_change(cfg, clean, backdoored,
                                                                    result, out,
                                                                    data.image_shape)
    write_json(out / JSON_NAME, result)
    return result


def _walkthrough(cfg: BackdoorConfig, clean, walk: dict, data, trig: dict, sim: dict,
                 ctl: dict | None, pcb: dict, pcb_ctl: dict | None, sim_method: str, out: Path,
                 provenance: dict, show_progress: bool) -> dict:
    """The fine-tunes checkpoint by checkpoint (step 0 = the clean model), each against the clean
    model: global and per-class tensor similarity, attack success rate, clean accuracy, output
    cosine and the per-class output-slice and logit cosines on clean test images; the inner
    checkpoints are saved under ``checkpoints/<run>_step<N>``; the last of each run reuses the
    final numbers. Also: the first step at which each per-class score localises the change to
    the target (`LOCALISATION_RULE`) and at which the attack success rate reaches 0.5."""
    import torch

    from ..baselines import model_outputs, output_cosine, per_class_baselines
    from ..checkpoint import save_checkpoint
    from ..data import add_trigger
    from ..nn import accuracy
    from .common import localisation

    non_target = data.y_test != cfg.target
    Xt = add_trigger(data.X_test[non_target], trig["value"], trig["pixels"], trig["shape"])
    tt = torch.full((len(Xt),), cfg.target)
    lg_clean = model_outputs(clean, data.X_test)
    finals = {"backdoored": (sim, pcb), "control": (ctl, pcb_ctl)}
    steps = [0] + [s for s, _ in walk["backdoored"]]
    runs = {}
    first = {}
    norm2 = sim.get("norm2_a_each")
    for name, snaps in walk.items():
        rec = {k: [] for k in ("checkpoint", "global_similarity", "global_similarity_stderr",
                               "slice_similarity", "slice_similarity_stderr",
                               "slice_similarity_reliable", "attack_success_rate",
                               "clean_accuracy", "output_cosine", "output_slice_cosine",
                               "logit_cosine")}
        for j, (st, m) in enumerate(progress([(0, clean)] + snaps, f"{name} over the fine-tune",
                                             show_progress)):
            last = j == len(snaps)
            ps, pc = finals[name] if last else (
                pair_similarity(clean, m, sim_method, depth=cfg.n_layers, norm2_a=norm2,
                                n_samples=cfg.n_samples, seed=cfg.seed, metric=cfg.metric),
                per_class_baselines(clean, m, data.X_test, data.y_test))
            if j == 0:
                path = "checkpoints/clean"
            elif last:
                path = f"checkpoints/{name}" if name == "backdoored" else None
            else:
                path = f"checkpoints/{name}_step{st:07d}"
                save_checkpoint(out / path, m, step=cfg.steps + st,
                                provenance={**provenance, "run": name, "finetune_step": st})
            rec["checkpoint"].append(path)
            append_similarity(rec, ps)
            rec["attack_success_rate"].append(accuracy(m, Xt, tt))
            rec["clean_accuracy"].append(accuracy(m, data.X_test, data.y_test))
            rec["output_cosine"].append(output_cosine(lg_clean, model_outputs(m, data.X_test)))
            rec["output_slice_cosine"].append(pc["output_slice_cosine"])
            rec["logit_cosine"].append(pc["logit_cosine"])
        runs[name] = rec

        def first_step(key, rec=rec):
            for j, st in enumerate(steps[1:], 1):
                ok = rec["slice_similarity_reliable"][j]
                if key == "slice_similarity" and ok is not None and not all(ok):
                    continue   # no finding leans on a slice without a reliable estimate
                se = rec["slice_similarity_stderr"][j] if key == "slice_similarity" else None
                if localisation(rec[key][j], cfg.target, se).get("localises"):
                    return st
            return None

        first[name] = {k: first_step(k) for k in ("slice_similarity", "output_slice_cosine",
                                                  "logit_cosine")}
        first[name]["attack_success_rate_0.5"] = next(
            (st for st, a in zip(steps, rec["attack_success_rate"]) if a >= 0.5), None)

    def said(v):
        return "never" if v is None else f"step {v}"

    b = first["backdoored"]
    text = (f"{len(steps)} checkpoints (step 0 = clean, then every "
            f"{cfg.finetune_steps / cfg.finetune_checkpoints:g} fine-tune steps): the attack "
            f"success rate reaches 0.5 at {said(b['attack_success_rate_0.5'])}; class "
            f"{cfg.target} is singled out by the rule from {said(b['slice_similarity'])} by "
            f"tensor similarity, {said(b['output_slice_cosine'])} by the output-slice cosine, "
            f"{said(b['logit_cosine'])} by the logit cosine on clean test images")
    if "control" in first:
        c = first["control"]
        text += (f"; in the clean control run: tensor similarity {said(c['slice_similarity'])}, "
                 f"output-slice cosine {said(c['output_slice_cosine'])} (a class singled out "
                 f"there is noise)")
    return {"step": steps, "runs": runs, "first_localising_step": first, "statement": text,
            "note": "each checkpoint against the clean model; per-class values are lists "
                    "indexed by class; the control run's last checkpoint is not saved (as "
                    "before)"}


#: The behavioural per-class scores the localisation rule is applied to (clean test data),
#: with their labels in tables and figures.
PER_CLASS_LABELS = {
    "logit_cosine": "logit cosine (class's test images)",
    "prob_cosine": "probability cosine (class's test images)",
    "output_slice_cosine": "output-slice cosine (all test images)",
    "agreement": "prediction agreement (class's test images)",
    "accuracy_change": "-|accuracy change| (class's test images)",
}


def _scores(pc: dict) -> dict:
    """The per-class scores of `PER_CLASS_LABELS` (lower = more changed)."""
    out = {k: pc[k] for k in ("logit_cosine", "prob_cosine", "output_slice_cosine", "agreement")}
    out["accuracy_change"] = [-abs(b - a) for a, b in zip(pc["accuracy_a"], pc["accuracy_b"])]
    return out


def _per_class_json(pc: dict | None) -> dict | None:
    if pc is None:
        return None
    names = {"accuracy_a": "accuracy_clean", "accuracy_b": "accuracy_compared"}
    return {names.get(k, k): {str(c): v for c, v in enumerate(vals)} for k, vals in pc.items()}


def _localise(sim: dict, pc: dict, target: int) -> dict:
    """`LOCALISATION_RULE` applied to tensor similarity's slices and to each behavioural
    per-class score, and the comparison (tensor better / equally / worse)."""
    from .common import compare_localisation, localisation

    bad = unreliable_slices(sim.get("each_reliable"))
    tensor = ({"assessed": False, "localises": None,
               "not_assessed": f"no reliable Monte Carlo estimate for slice(s) "
                               f"{', '.join(map(str, bad))}"} if bad else
              localisation(sim["each"], target, sim.get("each_stderr")))
    base = {k: localisation(v, target) for k, v in _scores(pc).items()}
    return {"rule": LOCALISATION_RULE, "target_class": target, "tensor": tensor,
            "baselines": base, "comparison": compare_localisation(tensor, base)}


def _eigen_change(cfg: BackdoorConfig, clean, backdoored, result: dict, out: Path,
                  shape: tuple[int, int, int] = (8, 8, 1)) -> list[str]:
    """Depth 1: eigenvectors of the target's clean->backdoored change as 8x8 images next to the
    trigger, and the top eigenvector's squared mass inside the trigger (into the finding)."""
    if cfg.n_layers != 1:
        result["eigen_change"] = None
        return []

    from ..data import trigger_mask, trigger_pixels
    from ..decompose.report import change_eigen, eigenvector_figure

    mask = trigger_mask(trigger_pixels(shape[0]), shape=shape).numpy()
    eig, summary = change_eigen(clean.to_network(), backdoored.to_network(), cfg.target, 4, mask)
    tm = summary["top_eigenvector_mask"]
    result["eigen_change"] = summary
    result["finding"].update(
        top_eigenvector_trigger_mass=tm["mass_inside"], trigger_pixel_share=tm["pixel_share"],
        eigen_statement=f"class {cfg.target}'s change (backdoored - clean): the top eigenvector "
                        f"puts {tm['mass_inside']:.1%} of its squared mass on the trigger's "
                        f"{mask.sum()} pixels ({tm['pixel_share']:.1%} of the image; "
                        f"{tm['ratio']:.1f}x their share, where 1x is no concentration on "
                        f"the trigger); the most concentrated of the top 4 "
                        f"(v{1 + int(np.argmax(summary['top_k_mask_mass']))}) "
                        f"{max(summary['top_k_mask_mass']):.1%}; the linear term "
                        + (f"{summary['linear_term_mask']['mass_inside']:.1%}"
                           if summary["linear_term_mask"] else "is zero"))
    eigenvector_figure(out / FIG_EIGEN, eig, 4, f"class {cfg.target}: eigenvectors of "
                       f"backdoored - clean (input space)", mask)
    return [FIG_EIGEN]


def backdoor_table(result: dict) -> str:
    """A readable report: per-class slice similarity (± its standard error for Monte Carlo) next
    to the baselines, ASR, accuracy."""
    target = result["target_class"]
    se = result.get("slice_similarity_stderr")
    control = result.get("control", {})
    ctl, ctl_se = control.get("slice_similarity"), control.get("slice_similarity_stderr")
    rel = result.get("slice_similarity_reliable") or {}
    ctl_rel = control.get("slice_similarity_reliable") or {}
    f = result["finding"]
    header = ["class", "tensor sim (slice)"] + (["control (clean FT)"] if ctl else []) + ["note"]
    rows = []
    for c, v in result["slice_similarity"].items():
        row = [c, pm(v, se and se[c], rel.get(c))] + \
            ([pm(ctl[c], ctl_se and ctl_se[c], ctl_rel.get(c))] if ctl else [])
        if int(c) != target:
            note = ""
        elif f.get("assessed") is False:
            note = "<- target (not assessed)"
        elif f.get("target_slice_is_clearly_lowest"):
            note = "<- target (lowest)"
        elif f["target_slice_is_lowest"]:
            note = "<- target (lowest, within 2 SE)"
        else:
            note = "<- target"
        rows.append(row + [note])
    lines = [format_table(header, rows), ""]
    b = result["baselines"]
    cb = control.get("baselines")
    metric_rows = [["tensor similarity (global)",
                    pm(result["global_similarity"], result.get("global_similarity_stderr"))]
                   + ([pm(control["global_similarity"], control.get("global_similarity_stderr"))]
                      if cb else [])]
    for k, v in b.items():
        # a divergence reads the other way round from the similarities above it
        label = f"baseline {k}" + (" (0 = same; lower = more alike)" if "divergence" in k else "")
        metric_rows.append([label, v] + ([cb[k]] if cb else []))
    lines.append(format_table(["metric (clean model vs each)", "backdoored"]
                              + (["control"] if cb else []), metric_rows))
    acc = result["clean_accuracy"]
    method = method_label(result["method"])
    if result.get("n_samples"):
        method += f", {result['n_samples']} samples, ± = 1 standard error"
    g = pm(f["gap"], f.get("gap_stderr"))
    gap = f"gap {g:.3f}" if isinstance(g, float) else f"gap {g}"
    if f.get("gap_within_2_stderr"):
        gap += " — within 2 standard errors: not distinguishable at this sample count"
    if f.get("assessed") is False:
        compared = f"finding not assessed: {f['not_assessed']}"
    else:
        compared = (f"target slice {f['target_slice']:.3f} vs lowest other "
                    f"{f['lowest_other_slice']:.3f} (class {f.get('lowest_other_class')}); {gap}")
    lines += ["",
              f"attack success rate (trigger -> {target}): {result['attack_success_rate']:.3f} "
              f"(clean model: {result['attack_success_rate_before']:.3f})",
              f"clean test accuracy: {acc['before']:.3f} before, {acc['after']:.3f} after",
              f"similarity method: {method} ({result['metric']} metric); {compared}"]
    if f.get("eigen_statement"):
        lines.append(f["eigen_statement"])
    if f.get("over_training_statement"):
        lines.append(f"over the fine-tune (figure {FIG_TRAINING}): "
                     f"{f['over_training_statement']}")
    if result.get("localisation"):
        lines += ["", localisation_table(result)]
    return "\n".join(lines)


def localisation_table(result: dict) -> str:
    """Per-class behavioural baselines on clean test images next to tensor similarity, the
    localisation rule (stated first), each metric's separation, and the comparison."""
    pcb = result["per_class_baselines"]
    loc = result["localisation"]
    target = loc["target_class"]
    cols = [("logit_cosine", "logit cos"), ("prob_cosine", "prob cos"),
            ("output_slice_cosine", "out-slice cos"), ("agreement", "agree"),
            ("accuracy_clean", "acc clean"), ("accuracy_compared", "acc compared")]
    rows = [[c, result["slice_similarity"][c]] + [pcb[k][c] for k, _ in cols]
            + (["<- target"] if int(c) == target else [""]) for c in result["slice_similarity"]]
    lines = ["per-class behaviour on clean test images (clean model vs backdoored):",
             format_table(["class", "tensor sim"] + [h for _, h in cols] + ["note"], rows), "",
             f"localisation rule (declared before the numbers): {loc['rule']}"]

    def sep(d):
        if not d.get("assessed"):
            return ["not assessed", "", ""]
        x = d["separation"]
        return [d["lowest_class"], "inf" if x == float("inf") else f"{x:.2f}",
                "yes" if d["localises"] else "no"]

    ctl = result.get("control", {}).get("localisation")
    verdicts = loc["comparison"]["verdicts"]
    rows = [["tensor similarity (slice)"] + sep(loc["tensor"]) + ["-"]
            + ([sep(ctl["tensor"])[2]] if ctl else [])]
    rows += [[PER_CLASS_LABELS[k]] + sep(d) + [verdicts[k]]
             + ([sep(ctl["baselines"][k])[2]] if ctl else [])
             for k, d in loc["baselines"].items()]
    lines += [format_table(["per-class metric", "lowest class", "separation", "localises",
                            "tensor vs this"] + (["control localises"] if ctl else []), rows),
              loc["comparison"]["statement"]]
    return "\n".join(lines)


SEEDS_JSON = "backdoor_seeds.json"
SEEDS_CSV = "backdoor_seeds.csv"


def run_backdoor_seeds(cfg: BackdoorConfig, seeds: list[int], out: str | Path,
                       show_progress: bool = True, json_copy: str | Path | None = None) -> dict:
    """`run_backdoor` once per seed (``cfg`` with ``seed`` replaced), each complete run in
    ``out/seed<N>/``, and ``backdoor_seeds.json`` / ``.csv`` at the top: every number's mean ±
    sample standard deviation over the seeds (`tensoralg.audit.common.spread`) and each finding
    counted per seed ("holds in 3 of 3"). Checks, planning and staging as `run_backdoor`
    (nothing is written unless every seed ran).

    Raises:
        ValueError: ``seeds`` empty, negative or repeated (``--seeds``), and as `run_backdoor`.
    """
    from .common import run_seeds

    return run_seeds(cfg, seeds, out, SEEDS_JSON, cfg.n_layers, _model, _run_backdoor,
                     _summarise_backdoor, show_progress, json_copy)


def _summarise_backdoor(results: list[dict], seeds: list[int], stage: Path) -> dict:
    from .common import count_text, localisation_over_seeds, spread

    def col(get):
        return spread([get(r) for r in results])

    classes = list(results[0]["slice_similarity"])
    target = results[0]["target_class"]
    numbers = {
        "global_similarity": col(lambda r: float(r["global_similarity"])),
        "attack_success_rate": col(lambda r: r["attack_success_rate"]),
        "clean_accuracy_before": col(lambda r: r["clean_accuracy"]["before"]),
        "clean_accuracy_after": col(lambda r: r["clean_accuracy"]["after"]),
        **{f"baseline:{k}": col(lambda r, k=k: r["baselines"][k])
           for k in results[0]["baselines"]},
    }
    if results[0].get("control"):
        numbers["control_global_similarity"] = col(
            lambda r: float(r["control"]["global_similarity"]))
    per_class = {"slice_similarity": {c: col(lambda r, c=c: r["slice_similarity"][c])
                                      for c in classes}}
    for k in results[0]["per_class_baselines"]:
        per_class[k] = {c: col(lambda r, c=c, k=k: r["per_class_baselines"][k][c])
                        for c in classes}
    localisation, verdicts, loc_text = localisation_over_seeds([r["localisation"]
                                                                for r in results])
    lowest = [r["finding"].get("target_slice_is_clearly_lowest") if r["finding"].get("assessed",
              True) else None for r in results]
    # over the fine-tune: does tensor similarity single the target out no later than the
    # output-slice cosine (None: neither ever does)?
    first = [r["over_training"]["first_localising_step"]["backdoored"] for r in results]
    no_later = [None if f["slice_similarity"] is None and f["output_slice_cosine"] is None
                else f["output_slice_cosine"] is None or (f["slice_similarity"] is not None and
                                                          f["slice_similarity"]
                                                          <= f["output_slice_cosine"])
                for f in first]
    statement = (f"over {len(seeds)} seeds ({', '.join(map(str, seeds))}): class {target}'s "
                 f"tensor slice is clearly the lowest: {count_text(lowest)}; over the fine-tune "
                 f"tensor similarity singles it out no later than the output-slice cosine: "
                 f"{count_text(no_later)} (first steps: tensor "
                 f"{[f['slice_similarity'] for f in first]}, output-slice "
                 f"{[f['output_slice_cosine'] for f in first]}, ASR >= 0.5 "
                 f"{[f['attack_success_rate_0.5'] for f in first]}); " + loc_text)
    summary = {"command": "audit backdoor --seeds", "target_class": target,
               "method": results[0]["method"], "metric": results[0]["metric"],
               "numbers": numbers, "per_class": per_class, "localisation": localisation,
               "localisation_rule": LOCALISATION_RULE, "verdicts": verdicts,
               "finding": {"first_localising_step": first,
                           "tensor_no_later_than_output_slice": no_later,
                           "target_slice_clearly_lowest": lowest,
                           "target_slice_clearly_lowest_count": count_text(lowest),
                           "statement": statement},
               "spread_note": "mean ± sample standard deviation (ddof 1) over the seeds",
               "files": [SEEDS_JSON, SEEDS_CSV] + [f"seed{s}/{f}" for s, r in zip(seeds, results)
                                                  for f in r["files"]]}
    write_seeds_csv(stage / SEEDS_CSV, summary)
    return summary


def write_seeds_csv(path: Path, summary: dict) -> None:
    """Rows ``quantity, class, mean, sd, min, max, n`` of a seeds summary."""
    from .common import write_csv

    rows = [(k, "", s["mean"], s["sd"], s["min"], s["max"], s["n"])
            for k, s in summary["numbers"].items()]
    for k, per in summary["per_class"].items():
        rows += [(k, c, s["mean"], s["sd"], s["min"], s["max"], s["n"]) for c, s in per.items()]
    for k, d in summary["localisation"].items():
        s = d["separation"]
        rows.append((f"localisation_separation:{k}", summary.get("target_class", ""), s["mean"],
                     s["sd"], s["min"], s["max"], s["n"]))
    write_csv(path, ["quantity", "class", "mean", "sd", "min", "max", "n"], rows)


def backdoor_seeds_table(summary: dict) -> str:
    """Per-class numbers and the global ones as mean ± sample standard deviation over the
    seeds, the localisation rule, and each finding counted per seed."""
    from .common import seeds_table

    cols = [("slice_similarity", "tensor sim"), ("logit_cosine", "logit cos"),
            ("output_slice_cosine", "out-slice cos"), ("accuracy_compared", "acc backdoored")]
    n = len(summary["seeds"])
    head = (f"backdoor audit over {n} seeds {summary['seeds']} ({summary['method']}, "
            f"{summary['metric']} metric); {summary['spread_note']}:")
    return seeds_table(summary, head, cols, str(summary["target_class"]), "<- target")
