"""``tensoralg compare A B`` and ``tensoralg matrix CKPT...`` over saved checkpoints.

``compare``: global and per-output tensor similarity of two checkpoints for every requested
metric (``gaussian``: ``E[f_a . f_b]`` under ``x ~ N(0, I)``; ``frobenius``: symmetrised
coefficient tensors) and method (``exact``; ``closure``: exact at depth 1, a different
tree-restricted form beyond; ``montecarlo``: an unbiased estimate with its standard error), plus
the data baselines on the digits test split when ``--data digits`` is given.

``matrix``: the ``N x N`` similarity matrix of N same-shape checkpoints, one batched
``tensoralg.similarity_matrix`` call, as a heatmap and a CSV.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np

from .common import format_table, resolve_method, similarity_matrix, stamp, write_csv, write_json


def _load(path: str | Path):
    from ..checkpoint import load_checkpoint

    return load_checkpoint(path)


def _same_shape(cfgs: Sequence[dict], paths: Sequence[str]) -> None:
    shapes = {(c["d_in"], c["d_out"]) for c in cfgs}
    if len(shapes) > 1:
        desc = ", ".join(f"{p}: {c['d_in']} -> {c['d_out']}" for p, c in zip(paths, cfgs))
        raise ValueError(f"checkpoints: tensor similarity needs the same input and output sizes; "
                         f"got {desc}")


def run_compare(a: str, b: str, methods: Sequence[str] = ("exact", "closure", "montecarlo"),
                metrics: Sequence[str] = ("gaussian", "frobenius"), data: str = "none",
                n_samples: int = 100_000, seed: int = 0) -> dict:
    """Every (metric, method) similarity of checkpoints ``a`` and ``b``; a combination the core
    refuses (too costly, unsupported) is recorded with its error instead of failing the rest.

    Raises:
        FileNotFoundError / ValueError: missing or corrupt checkpoints, mismatched sizes,
            ``data="digits"`` for a model that is not a 64 -> 10 digit classifier.
    """
    import tensoralg as ta

    ma, ca = _load(a)
    mb, cb = _load(b)
    _same_shape([ca, cb], [a, b])
    if data not in ("none", "digits"):
        raise ValueError(f"--data: expected 'digits' or 'none', got {data!r}")
    if data == "digits" and (ca["d_in"], ca["d_out"]) != (64, 10):
        raise ValueError(f"--data digits: needs 64 -> 10 classifiers, these are "
                         f"{ca['d_in']} -> {ca['d_out']}")
    na, nb = ma.to_network(), mb.to_network()
    rows = []
    for metric in metrics:
        for method in methods:
            entry = {"metric": metric, "method": method}
            kw = {"n_samples": n_samples, "seed": seed} if method == "montecarlo" else {}
            t = time.perf_counter()
            try:
                g = ta.similarity(na, nb, metric=metric, method=method, **kw)
                each = ta.similarity(na, nb, metric=metric, method=method, output="each", **kw)
                entry["global"] = float(g)
                entry["each"] = [float(v) for v in np.asarray(each, dtype=np.float64)]
                if getattr(g, "stderr", None) is not None:
                    entry["global_stderr"] = float(g.stderr)
                if getattr(each, "stderr", None) is not None:
                    entry["each_stderr"] = [float(v) for v in np.ravel(each.stderr)]
            except (ValueError, NotImplementedError) as exc:  # CostTooHigh is a ValueError
                entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["seconds"] = time.perf_counter() - t
            rows.append(entry)
    result = {
        **stamp("compare", {"a": str(a), "b": str(b), "methods": list(methods),
                            "metrics": list(metrics), "data": data, "n_samples": n_samples,
                            "seed": seed}),
        "a": {"path": str(a), "step": ca.get("step"), "n_layers": ca.get("n_layers")},
        "b": {"path": str(b), "step": cb.get("step"), "n_layers": cb.get("n_layers")},
        "depth": max(ca["n_layers"], cb["n_layers"]),
        "results": rows,
    }
    if data == "digits":
        from ..baselines import all_baselines
        from ..data import load_digits_data

        d = load_digits_data(seed=seed)
        result["baselines"] = all_baselines(ma, mb, d.X_test)
        result["baselines_data"] = d.provenance
    return result


def compare_table(result: dict) -> str:
    out = [f"compare {result['a']['path']}  vs  {result['b']['path']} (depth {result['depth']})"]
    rows = []
    n_out = 0
    for r in result["results"]:
        if "error" in r:
            rows.append([r["metric"], r["method"], "-", "-", "-", r["error"][:60]])
            continue
        each = r["each"]
        n_out = len(each)
        stderr = f"±{r['global_stderr']:.1e}" if "global_stderr" in r else ""
        rows.append([r["metric"], r["method"], r["global"], min(each),
                     int(np.argmin(each)), stderr])
    out.append(format_table(["metric", "method", "global", "min slice", "argmin", "note"], rows))
    ok = [r for r in result["results"] if "each" in r]
    if ok and n_out <= 32:
        out.append("")
        out.append(format_table(["output"] + [f"{r['metric']}/{r['method']}" for r in ok],
                                [[c] + [r["each"][c] for r in ok] for c in range(n_out)]))
    if "baselines" in result:
        out.append("")
        out.append(format_table(["baseline (digits test split)", "value"],
                                [[k, v] for k, v in result["baselines"].items()]))
    return "\n".join(out)


def run_matrix(paths: Sequence[str], out: str | Path, method: str = "auto",
               output: int | None = None) -> dict:
    """Similarity matrix of the checkpoints at ``paths`` (heatmap ``matrix.png``, ``matrix.csv``,
    ``matrix.json`` under ``out``)."""
    from .plotting import heatmaps

    if len(paths) < 2:
        raise ValueError(f"checkpoints: need at least two, got {len(paths)}")
    loaded = [_load(p) for p in paths]
    cfgs = [c for _, c in loaded]
    _same_shape(cfgs, paths)
    d_out = cfgs[0]["d_out"]
    if output is not None and not (0 <= output < d_out):
        raise ValueError(f"--output: expected an output index in [0, {d_out}), got {output}")
    depth = max(c["n_layers"] for c in cfgs)
    resolve_method(method, depth)
    t = time.perf_counter()
    mat, used = similarity_matrix([m.to_network() for m, _ in loaded], method, depth=depth,
                                  output=output)
    seconds = time.perf_counter() - t
    labels = [Path(p).name or str(p) for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(p) for p in paths]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "matrix.csv", ["checkpoint"] + labels,
              ([lab] + [float(v) for v in row] for lab, row in zip(labels, mat)))
    what = "all outputs" if output is None else f"output {output}"
    heatmaps(out / "matrix.png", {f"tensor similarity ({used}, {what})": mat}, labels,
             "checkpoint x checkpoint similarity")
    result = {
        **stamp("matrix", {"checkpoints": [str(p) for p in paths], "method": method,
                           "output": output}),
        "labels": labels, "steps": [c.get("step") for c in cfgs], "method": used,
        "metric": "gaussian", "output": output, "similarity_matrix": mat, "seconds": seconds,
        "files": [str(out / "matrix.json"), str(out / "matrix.csv"), str(out / "matrix.png")],
    }
    write_json(out / "matrix.json", result)
    return result


def matrix_table(result: dict) -> str:
    labels = result["labels"]
    short = [lab[-14:] for lab in labels]
    mat = np.asarray(result["similarity_matrix"])
    return "\n".join([f"similarity matrix ({result['method']}, "
                      f"{'all outputs' if result['output'] is None else 'output ' + str(result['output'])}):",
                      format_table([""] + short, [[s] + [float(v) for v in row]
                                                  for s, row in zip(short, mat)])])
