"""The iSAE ablation benchmark: every preset, several seeds, synthetic ground truth (or real
activations), with run-to-run stability, ground-truth recovery, the OMP oracle and aRIP constants.

Per preset (means over seeds, or over seed pairs for the cross-seed numbers), on held-out data:

* ``fvu`` — fraction of variance unexplained ``Σ‖x - x_hat‖² / Σ‖x - mean x‖²``;
* ``l0`` — mean number of non-zero code entries per held-out row; ``dead_latents`` — latents
  that are zero on every held-out row (mean over seeds);
* ``dcs``, ``code_iou``, ``code_l2`` — [`tensoralg.verify.identifiability`][verify.identifiability]
  between every two seeds;
* ``gt_dcs``, ``gt_code_iou``, ``gt_code_l2`` — against the true dictionary and codes;
* ``rip_delta`` — max over observed supports of ``max(λ_max(G_S) - 1, 1 - λ_min(G_S))`` of the
  learned dictionary (mean over seeds); ``rip_delta_mean`` its mean over supports;
* ``omp`` — OMP codes with each learned dictionary (their cross-seed IoU, IoU against the
  truth, FVU); ``random_init`` — the same metrics for untrained SAEs (the floor).

All presets × seeds are trained in one pass over shared batches
([`train_many`][tensoralg.sae.training.train_many]; batch order from ``seed``, the runs differ in
their initial weights), and ``findings`` include a plateau check per preset (relative FVU change
over the last 20 % of steps, ``plateau_change``).

Top level: ``oracle`` (OMP with the true dictionary: ``gt_code_iou``, ``gt_code_l2``, ``fvu``,
and the true dictionary's ``rip_delta``), ``findings`` (the three claims and whether they hold
here), ``config`` and ``tensoralg_version``.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from .. import io as tio
from .._version import __version__
from .models import SparseAutoencoder, rip_constants
from .presets import ABLATION, PRESETS, make_config
from .pursuit import omp
from .synthetic import make_synthetic
from .training import TrainConfig, as_activations, check_variance, train_many

__all__ = ["run_bench", "format_table", "plot_bench", "QUICK", "FULL"]

QUICK = {"d": 32, "m": 64, "k": 4, "n_train": 8192, "n_eval": 1024, "noise": 0.0,
         "steps": 600, "batch_size": 256, "lr": 3e-3, "seeds": 3}
FULL = {"d": 64, "m": 128, "k": 6, "n_train": 32768, "n_eval": 4096, "noise": 0.05,
        "steps": 4000, "batch_size": 256, "lr": 2e-3, "seeds": 5}


def _fvu(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    x, x_hat = x.double(), x_hat.double()
    return float(((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum().clamp_min(1e-300))


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


def _std(vals):
    """Population standard deviation of the non-None ``vals``; None (no spread is measured, not
    0.0) when fewer than two remain — e.g. the cross-seed numbers of two seeds, one pair."""
    vals = [v for v in vals if v is not None]
    return float(np.std(vals)) if len(vals) >= 2 else None


def _pairwise(Ds, Zs, compare):
    rows = [compare(Ds[i], Ds[j], Zs[i], Zs[j]) for i, j in itertools.combinations(range(len(Ds)), 2)]
    out = {key: _mean([r[key] for r in rows]) for key in ("dcs", "code_iou", "code_l2")}
    out.update({f"{key}_std": _std([r[key] for r in rows]) for key in ("dcs", "code_iou", "code_l2")})
    return out


def _gt(D_true, Z_true, Ds, Zs, compare):
    rows = [compare(D_true, D, Z_true, Z) for D, Z in zip(Ds, Zs)]
    out = {f"gt_{key}": _mean([r[key] for r in rows]) for key in ("dcs", "code_iou", "code_l2")}
    out.update({f"gt_{key}_std": _std([r[key] for r in rows]) for key in ("dcs", "code_iou", "code_l2")})
    return out


def plateau_change(history: list[dict], steps: int) -> float | None:
    """Relative FVU change over the last 20 % of the steps: ``(fvu(0.8 T) - fvu(T)) / fvu(T)``
    with each FVU the logged batch average nearest to that step (positive: still improving)."""
    recs = [r for r in history if "fvu" in r]
    if len(recs) < 2:
        return None
    at = min(recs, key=lambda r: abs(r["step"] - 0.8 * steps))
    end = recs[-1]
    if at is end or end["fvu"] <= 0:
        return None
    return (at["fvu"] - end["fvu"]) / end["fvu"]


def run_bench(presets=None, *, quick: bool = False, seeds: int | None = None, data=None,
              out=None, progress: bool = False, log=print, seed: int = 0, data_seed: int = 12345,
              eval_fraction: float = 0.2, **overrides) -> dict:
    """Train every preset with several seeds and measure reconstruction and identifiability.

    Args:
        presets: preset names (default: the ablation arms, `ABLATION`).
        quick: use `QUICK` sizes (about a minute on one CPU thread) instead of `FULL`.
        seeds: number of seeds (>= 2 for cross-seed numbers; the issue asks for >= 3).
        data: optional real activations ``(n, d)`` (tensor, array or ``.npy`` path); the last
            ``eval_fraction`` of the rows are held out. Without it, synthetic data with a
            ground truth is used.
        out: folder for ``bench.json``, ``bench.md`` and ``bench.png`` (optional): new, empty,
            or an earlier bench output (the audits' rules); written into a staging folder and
            swapped in when complete.
        eval_fraction: held-out share of real ``data`` (default 0.2).
        progress: tqdm bars (with ETA) over the training steps of all SAEs and over their
            evaluation (hidden when stderr is not a terminal); ``log``: called with each line.
        seed: the model seeds are ``seed, seed + 1, ..., seed + seeds - 1`` (init and batches).
        data_seed: seed of the synthetic training data (held-out data: ``data_seed + 1``, same
            dictionary). Data and model streams are independent even for equal numbers.
        overrides: replace entries of the size table (``d``, ``m``, ``k``, ``steps``, ``lr``...).
            With real data, ``m`` is the number of latents and ``k`` the sparsity.
    Returns:
        the results dict described in the module docstring.
    """
    from tensoralg.verify.identifiability import compare

    cfg = dict(QUICK if quick else FULL)
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"overrides: unknown keys {sorted(unknown)}; expected some of {sorted(cfg)}")
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    if seeds is not None:
        cfg["seeds"] = seeds
    if isinstance(cfg["steps"], bool) or not isinstance(cfg["steps"], int) or cfg["steps"] < 1:
        raise ValueError(f"steps: expected an int >= 1 (the bench compares trained SAEs; with 0 "
                         f"steps nothing is trained and there is nothing to compare), got "
                         f"{cfg['steps']!r}")
    if cfg["seeds"] < 2:
        raise ValueError(f"seeds: need >= 2 seeds for run-to-run stability, got {cfg['seeds']}")
    for name, v in (("seed", seed), ("data_seed", data_seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    presets = list(ABLATION) if presets is None else list(presets)
    for p in presets:
        if p not in PRESETS:
            raise ValueError(f"presets: unknown preset {p!r}; expected some of {list(PRESETS)}")
    if out is not None:   # the audits' output-folder rules, checked before any work
        from ..audit.common import check_output_folder
        check_output_folder(out, "bench.json")
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction: expected a number in (0, 1), got {eval_fraction!r}")
    t0 = time.time()
    synthetic = data is None
    if synthetic:
        train_data = make_synthetic(cfg["n_train"], cfg["d"], cfg["m"], cfg["k"], noise=cfg["noise"],
                                    seed=data_seed)
        eval_data = make_synthetic(cfg["n_eval"], cfg["d"], cfg["m"], cfg["k"], noise=cfg["noise"],
                                   seed=data_seed + 1, dictionary=train_data.W_dec)
        x_train, x_eval = train_data.x, eval_data.x
        D_true, Z_true = eval_data.W_dec, eval_data.z
    else:
        arr = as_activations(data)
        full = torch.from_numpy(np.array(arr, dtype=np.float32)) if not isinstance(arr, torch.Tensor) else arr.float()
        n_eval = max(1, int(round(len(full) * eval_fraction)))
        if n_eval >= len(full):
            raise ValueError(f"data: {len(full)} rows leave nothing to train on with "
                             f"eval_fraction={eval_fraction}")
        x_train, x_eval = full[:-n_eval], full[-n_eval:]
        check_variance(x_train, "data (its training rows)")
        check_variance(x_eval, f"data (its last {n_eval} rows, held out)")
        cfg["d"], cfg["n_train"], cfg["n_eval"] = full.shape[1], len(x_train), n_eval
        cfg["noise"] = None          # a property of the synthetic data only
        D_true = Z_true = None
    results: dict = {}
    k = cfg["k"]
    if synthetic:
        z_or = omp(x_eval, D_true, k)
        c = compare(D_true, D_true, Z_true, z_or)
        results["oracle"] = {"gt_code_iou": c["code_iou"], "gt_code_l2": c["code_l2"],
                             "fvu": _fvu(x_eval, z_or @ D_true),
                             "rip_delta": rip_constants(D_true, Z_true)["delta_max"],
                             "rip_delta_mean": rip_constants(D_true, Z_true)["delta_mean"]}
    # every preset x seed in one pass over shared batches (batch order from `seed`); the runs
    # differ in their initial weights (init_seed = seed, seed + 1, ...)
    seeds_list = list(range(seed, seed + cfg["seeds"]))
    sae_cfgs = {name: make_config(name, cfg["d"], cfg["m"], k) for name in presets}
    ts = time.time()
    log(f"  training {len(presets) * len(seeds_list)} SAEs ({len(presets)} presets x "
        f"{len(seeds_list)} seeds) for {cfg['steps']} steps of {cfg['batch_size']} rows"
        + ("; the bar's ETA is the training time" if progress else ""))
    trained = train_many(x_train, [sae_cfgs[nm] for nm in presets for _ in seeds_list],
                         [s for _ in presets for s in seeds_list],
                         TrainConfig(steps=cfg["steps"], batch_size=cfg["batch_size"],
                                     log_every=max(1, cfg["steps"] // 20), lr=cfg["lr"], seed=seed,
                                     progress=progress))
    train_seconds = time.time() - ts
    log(f"  trained {len(trained)} SAEs in one pass over shared batches ({train_seconds:.1f}s)")
    from tqdm.auto import tqdm
    # the evaluation (encode, RIP constants, OMP, an untrained SAE) of each trained SAE
    eval_bar = tqdm(total=len(trained), desc="sae bench eval", unit="sae",
                    disable=None if progress else True)
    for p_i, name in enumerate(presets):
        sae_cfg = sae_cfgs[name]
        Ds, Zs, fvus, rips, ripm, Zomp, fomp, Dr, Zr, fr = ([] for _ in range(10))
        per_seed = []
        for s_i, seed_i in enumerate(seeds_list):
            ts = time.time()
            model, hist = trained[p_i * len(seeds_list) + s_i]
            with torch.no_grad():
                z = model.encode(x_eval.to(model.W_dec.dtype))
                f = _fvu(x_eval, model.decode(z))
                D = model.W_dec.detach().clone()
                rc = rip_constants(D, z)
                zo = omp(x_eval, D, k, b_dec=model.b_dec)
                fo = _fvu(x_eval, zo @ D + model.b_dec)
                init = SparseAutoencoder(sae_cfg, seed=seed_i)
                init.init_b_dec(x_train[:8192].to(init.W_dec.dtype))
                zr = init.encode(x_eval.to(init.W_dec.dtype))
                Dr.append(init.W_dec.detach().clone())
                Zr.append(zr)
                fr.append(_fvu(x_eval, init.decode(zr)))
            Ds.append(D)
            Zs.append(z)
            fvus.append(f)
            rips.append(rc["delta_max"])
            ripm.append(rc["delta_mean"])
            Zomp.append(zo)
            fomp.append(fo)
            active = z != 0
            per_seed.append({"seed": seed_i, "fvu": f, "rip_delta": rc["delta_max"],
                             "l0": float(active.sum(1).double().mean()),
                             "dead_latents": int((~active.any(0)).sum()),
                             "eval_seconds": time.time() - ts,
                             "plateau_change": plateau_change(hist, cfg["steps"])})
            eval_bar.update(1)
            log(f"  {name:8s} seed {seed_i}: fvu {f:.4f}  rip_delta {rc['delta_max']:.3f}  ({time.time() - ts:.1f}s)")
        res = {"fvu": _mean(fvus), "fvu_std": _std(fvus),
               "l0": _mean([p["l0"] for p in per_seed]),
               "dead_latents": _mean([p["dead_latents"] for p in per_seed])}
        res.update(_pairwise(Ds, Zs, compare))
        if synthetic:
            res.update(_gt(D_true, Z_true, Ds, Zs, compare))
        else:
            res.update({"gt_dcs": None, "gt_code_iou": None, "gt_code_l2": None})
        res["rip_delta"] = _mean(rips)
        res["rip_delta_std"] = _std(rips)
        res["rip_delta_mean"] = _mean(ripm)
        res["plateau_change"] = _mean([p["plateau_change"] for p in per_seed])
        omp_res = {"fvu": _mean(fomp), **_pairwise(Ds, Zomp, compare)}
        if synthetic:
            omp_res.update(_gt(D_true, Z_true, Ds, Zomp, compare))
        res["omp"] = omp_res
        rnd = {"fvu": _mean(fr), **_pairwise(Dr, Zr, compare)}
        if synthetic:
            rnd.update(_gt(D_true, Z_true, Dr, Zr, compare))
        res["random_init"] = rnd
        res["per_seed"] = per_seed
        results[name] = res
    eval_bar.close()
    results["findings"] = _findings(results)
    results["config"] = {**cfg, "presets": presets, "data": "synthetic" if synthetic else str(data),
                         "eval_fraction": None if synthetic else eval_fraction,
                         "seed": seed, "data_seed": data_seed if synthetic else None}
    results["seconds"] = time.time() - t0
    results["train_seconds"] = train_seconds
    results["tensoralg_version"] = __version__
    if out is not None:
        from ..audit.common import staged_output
        with staged_output(out, "bench.json") as stage:
            tio.atomic_write_json(stage / "bench.json", results)
            tio.atomic_write_text(stage / "bench.md", format_table(results) + "\n")
            plot_bench(results, stage / "bench.png")
    return results


PLATEAU_TOL = 0.02


def _findings(r: dict) -> dict:
    f = {}
    for name in r:
        p = r[name]
        if isinstance(p, dict) and "plateau_change" in p and p["plateau_change"] is not None:
            f[f"{name}_fvu_plateau"] = {
                "value": p["plateau_change"],
                "claim": f"{name}: training reached a plateau (FVU fell by less than "
                         f"{PLATEAU_TOL:.0%} over the last 20% of steps)",
                "holds": bool(p["plateau_change"] < PLATEAU_TOL)}
    if "topk" in r and "abstopk" in r:
        red = 1.0 - r["abstopk"]["fvu"] / r["topk"]["fvu"] if r["topk"]["fvu"] > 0 else None
        f["abstopk_fvu_reduction_vs_topk"] = {
            "value": red, "claim": "AbsTopK lowers reconstruction error vs TopK (paper: 30-40%)",
            "holds": bool(red is not None and red > 0)}
    if "isae-me" in r and "oracle" in r:
        gap = r["oracle"]["gt_code_iou"] - r["isae-me"]["gt_code_iou"]
        f["isae_me_code_iou_gap_to_omp_oracle"] = {
            "value": gap, "isae_me": r["isae-me"]["gt_code_iou"], "oracle": r["oracle"]["gt_code_iou"],
            "claim": "iSAE-ME's code identifiability approaches the OMP oracle's (gap < 0.1)",
            "holds": bool(gap < 0.1)}
    if "isae-me" in r and "isae-me-dl" in r:
        # the bench trains presets without their schedules, so isae-me-dl is isae-me without
        # the aRIP penalty: the pair measures what aRIP does in the multi-step preset
        a, b = r["isae-me"], r["isae-me-dl"]
        keys = (("code_iou", a["code_iou"], b["code_iou"]),
                ("omp_code_iou", a["omp"]["code_iou"], b["omp"]["code_iou"]),
                ("fvu", a["fvu"], b["fvu"]))
        f["arip_in_isae_me"] = {
            "value": [v for _, x, y in keys for v in (x, y)],
            "with_arip": {k: x for k, x, _ in keys}, "without_arip": {k: y for k, _, y in keys},
            "claim": "aRIP helps the multi-step preset (isae-me vs the same encoder without aRIP, "
                     "isae-me-dl untouched by its schedule here: cross-seed code IoU, code IoU "
                     "of OMP on the learned dictionaries, FVU; values with, without)",
            "holds": bool(a["code_iou"] is not None and b["code_iou"] is not None and
                          a["code_iou"] > b["code_iou"] and
                          a["omp"]["code_iou"] > b["omp"]["code_iou"] and a["fvu"] <= b["fvu"])}
    if "isae" in r and "abstopk" in r:
        f["rip_delta_isae_vs_abstopk"] = {
            "value": [r["isae"]["rip_delta"], r["abstopk"]["rip_delta"]],
            "claim": "aRIP improves conditioning (smaller rip_delta)",
            "holds": bool(r["isae"]["rip_delta"] < r["abstopk"]["rip_delta"])}
    return f


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.3f}"


def format_table(r: dict) -> str:
    """Markdown table of a [`run_bench`][tensoralg.sae.bench.run_bench] result."""
    names = list(r["config"]["presets"])
    cols = ["fvu", "l0", "dead", "dcs", "code_iou", "code_l2", "gt_dcs", "gt_code_iou",
            "gt_code_l2", "rip_delta"]
    lines = ["| preset | " + " | ".join(cols) + " | omp gt_iou | omp iou | rand dcs | rand iou |",
             "|---" * (len(cols) + 5) + "|"]
    for n in names:
        p = {**r[n], "dead": r[n].get("dead_latents")}
        lines.append(f"| {n} | " + " | ".join(_fmt(p.get(c)) for c in cols) +
                     f" | {_fmt(p['omp'].get('gt_code_iou'))} | {_fmt(p['omp']['code_iou'])} |"
                     f" {_fmt(p['random_init']['dcs'])} | {_fmt(p['random_init']['code_iou'])} |")
    if "oracle" in r:
        o = r["oracle"]
        lines.append(f"| OMP oracle (true D) | {_fmt(o['fvu'])} | — | — | — | — | — | 1.000 | "
                     f"{_fmt(o['gt_code_iou'])} | {_fmt(o['gt_code_l2'])} | {_fmt(o['rip_delta'])} | — | — | — | — |")
    if r.get("findings"):
        lines.append("")
    for key, f in r.get("findings", {}).items():
        val = f["value"]
        val = ", ".join(f"{v:.3f}" for v in val) if isinstance(val, list) else _fmt(val)
        lines.append(f"- {f['claim']}: {'holds' if f['holds'] else 'does NOT hold'} here ({key} = {val})")
    return "\n".join(lines)


def plot_bench(r: dict, path) -> None:
    """Bar charts (fvu, cross-seed code IoU, ground-truth code IoU, rip_delta) to ``path``, with
    error bars of ±1 standard deviation across seeds (across seed pairs for the cross-seed IoU)
    and the true dictionary's δ (synthetic data) as a reference line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = r["config"]["presets"]
    panels = [("fvu", "FVU (lower is better)", None, "fraction of variance unexplained"),
              ("code_iou", "code IoU across seeds", "random_init", "mean IoU over seed pairs"),
              ("gt_code_iou", "code IoU vs ground truth", "oracle", "mean IoU over seeds"),
              ("rip_delta", "aRIP δ (lower = better conditioned)", "true_delta", "δ over observed supports")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (key, title, ref, ylabel) in zip(axes, panels):
        vals = [r[n][key] if r[n][key] is not None else np.nan for n in names]
        ax.bar(names, vals, color="tab:blue")
        # an error bar only where a spread was measured (a std of None: one value, e.g. the
        # one seed pair of two seeds, is drawn without a bar, not as ±0)
        bars = [(i, r[n][f"{key}_std"]) for i, n in enumerate(names)
                if r[n].get(f"{key}_std") is not None and r[n][key] is not None]
        if bars:
            ax.errorbar([i for i, _ in bars], [vals[i] for i, _ in bars],
                        yerr=[e for _, e in bars], fmt="none", ecolor="k", capsize=4)
        if ref == "random_init":
            ax.plot(names, [r[n]["random_init"][key] for n in names], "k_", markersize=30, label="untrained")
        if ref == "oracle" and "oracle" in r:
            ax.axhline(r["oracle"]["gt_code_iou"], color="k", ls="--", label="OMP oracle")
        if ref == "true_delta" and "oracle" in r:
            ax.axhline(r["oracle"]["rip_delta"], color="k", ls="--", label="true dictionary")
        if ax.get_legend_handles_labels()[0]:
            # below the "preset" label; the 30-pt "untrained" tick drawn short in the legend
            # (at full length it ran through its own label)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.24), ncol=2,
                      frameon=False, markerscale=0.3)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlabel("preset", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    n_seeds = r["config"]["seeds"]
    pairs = n_seeds * (n_seeds - 1) // 2
    fig.suptitle(f"error bars: ±1 std across {n_seeds} seeds (across {pairs} seed pair"
                 f"{'s' if pairs != 1 else ''} for the cross-seed IoU"
                 f"{': one pair, no spread, no bar' if pairs == 1 else ''})", fontsize=8)
    fig.tight_layout()
    buf = __import__("io").BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    tio.atomic_write_bytes(path, buf.getvalue())
