"""``tensoralg compare A B`` and ``tensoralg matrix CKPT...`` over saved checkpoints.

``compare``: global and per-output tensor similarity of two checkpoints for every requested
metric (``gaussian``: ``E[f_a . f_b]`` under ``x ~ N(0, I)``; ``frobenius``: symmetrised
coefficient tensors) and method (``exact``; ``montecarlo``: an unbiased estimate with its
standard error and reliability verdict, shown only when reliable; ``closure``, only when asked
for: the moment-closure similarity, exact at depth 1, a different tree-restricted quantity
beyond, labelled "moment-closure (approximate)" wherever shown), plus the data baselines on the
digits test split when ``--data digits`` is given. The default methods are exact and Monte
Carlo: where exact is out of reach (two attention layers) the answer is Monte Carlo's verdict,
never the closure (docs/mathematics.md §3.9).

``matrix``: the ``N x N`` similarity matrix of N same-shape checkpoints, one batched
``tensoralg.similarity_matrix`` call, as a heatmap and a CSV.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .common import (
    CLOSURE_LABEL,
    MC_SAMPLES,
    check_file_writable,
    choose_method,
    format_table,
    matrix_record,
    matrix_uncertainty,
    mc_entries,
    method_label,
    pm,
    progress,
    shown_matrix,
    similarity_matrix,
    staged_output,
    stamp,
    write_csv,
    write_json,
    write_json_copy,
)

# The Frobenius metric is a closed form of the weights (symmetrised coefficient tensors):
# only the exact method computes it; closure and Monte Carlo are Gaussian-metric methods.
FROBENIUS_METHODS = ("exact",)
#: The methods `tensoralg compare` runs by default (the closure only when asked for).
DEFAULT_METHODS = ("exact", "montecarlo")


def _load(path: str | Path):
    from ..checkpoint import load_checkpoint

    return load_checkpoint(path)


def _io(c: dict) -> tuple:
    """(inputs, outputs) of a checkpoint config; a transformer reads its residual stream."""
    from .language import is_transformer_cfg

    return (c["d_model"], c["vocab"]) if is_transformer_cfg(c) else (c["d_in"], c["d_out"])


def _same_shape(cfgs: Sequence[dict], paths: Sequence[str]) -> None:
    from .language import check_transformer_cfgs, is_transformer_cfg

    kinds = {is_transformer_cfg(c) for c in cfgs}
    if len(kinds) > 1:
        raise ValueError(f"checkpoints: a bilinear transformer cannot be compared with a "
                         f"bilinear classifier; got {', '.join(str(p) for p in paths)}")
    if kinds == {True}:
        check_transformer_cfgs(cfgs, paths)
    shapes = {_io(c) for c in cfgs}
    if len(shapes) > 1:
        desc = ", ".join(f"{p}: {_io(c)[0]} -> {_io(c)[1]}" for p, c in zip(paths, cfgs))
        raise ValueError(f"checkpoints: tensor similarity needs the same input and output sizes; "
                         f"got {desc}")


def check_sequence_n_ctx(nets: Sequence, paths: Sequence, n_ctx: int | None,
                         required: bool = False) -> int | None:
    """``--n-ctx`` against the attention masks of sequence networks (written by
    ``save_checkpoint`` / ``tensoralg import``), before any work: the length a mask array
    fixes, or ``n_ctx``. ``required``: a missing ``--n-ctx`` with no mask fixing the length is
    refused too (else left to the rows, as in ``compare``).

    Raises:
        ValueError: one line naming ``--n-ctx`` and the checkpoint (a length that differs from
            a mask array's, masks fixing different lengths, a missing length when required).
    """
    from ..canonical import resolve_n_ctx

    if n_ctx is None and not required:
        return None
    try:
        return resolve_n_ctx([(str(p), net) for p, net in zip(paths, nets)], n_ctx)
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("n_ctx:"):
            msg = msg[len("n_ctx:"):].lstrip()
        raise ValueError(f"--n-ctx: {msg}") from None


def valid_pairs(metrics: Sequence[str], methods: Sequence[str]
                ) -> tuple[list[tuple[str, str]], list[dict]]:
    """Split the requested (metric, method) combinations into those that exist and those skipped
    (``frobenius`` is exact-only), each skipped one with its reason."""
    run, skipped = [], []
    for metric in metrics:
        for method in methods:
            if metric == "frobenius" and method not in FROBENIUS_METHODS:
                skipped.append({"metric": metric, "method": method,
                                "reason": "the Frobenius metric is exact-only (a closed form of "
                                          "the weights)"})
            else:
                run.append((metric, method))
    return run, skipped


# Monte Carlo directions by default for sequence (bilinear-transformer) checkpoints
SEQUENCE_MC_SAMPLES = 20_000


def run_compare(a: str, b: str, methods: Sequence[str] = DEFAULT_METHODS,
                metrics: Sequence[str] = ("gaussian", "frobenius"), data: str = "none",
                n_samples: int | None = None, seed: int = 0, show_progress: bool = False,
                n_ctx: int | None = None) -> dict:
    """Every valid (metric, method) similarity of checkpoints ``a`` and ``b``.

    ``methods``: default exact and Monte Carlo; ``"closure"`` adds the moment-closure
    similarity (APPROXIMATE at depth >= 2; its entry has ``"approximate": True`` and a
    ``"label"``). Combinations that do not exist (``frobenius`` with ``closure``/``montecarlo``) are skipped
    and listed under ``skipped``; a combination the core refuses at run time (too costly) is
    recorded with its full error instead of failing the rest. ``seed``: the Monte Carlo seed
    and the digits split seed for ``data="digits"``. Bilinear-transformer checkpoints are
    compared as residual stream -> logits maps over ``n_ctx`` positions (default: the shorter
    trained context of the two; longer is refused); only the Gaussian metric exists for them.
    ``n_samples``: Monte Carlo directions; None: 100 000, or 20 000 for transformer checkpoints
    (a direction of a two-layer transformer costs 26 forward passes per model; 100 000 took
    7 minutes for a pair of the language audit's checkpoints).

    Raises:
        FileNotFoundError / ValueError: missing or corrupt checkpoints, mismatched sizes or
            vocabularies, ``n_ctx`` beyond a trained context,
            ``data="digits"`` for a model that is not a 64 -> 10 digit classifier, or only
            invalid combinations requested.
    """

    pairs, skipped = valid_pairs(metrics, methods)
    if not pairs:
        raise ValueError(f"--metrics/--methods: no valid combination in metrics {list(metrics)} "
                         f"x methods {list(methods)}: the Frobenius metric is exact-only (add "
                         f"--methods exact or --metrics gaussian)")

    ma, ca = _load(a)
    mb, cb = _load(b)
    _same_shape([ca, cb], [a, b])
    if data not in ("none", "digits"):
        raise ValueError(f"--data: expected 'digits' or 'none', got {data!r}")
    if data == "digits" and _io(ca) != (64, 10):
        raise ValueError(f"--data digits: needs 64 -> 10 classifiers, these are "
                         f"{_io(ca)[0]} -> {_io(ca)[1]}")
    from .language import is_transformer_cfg, sequence_networks

    seq = is_transformer_cfg(ca)
    # a sequence network written by save_checkpoint (attention layers): n_ctx from --n-ctx or
    # its mask array
    generic_seq = not seq and bool(ca.get("sequence") or cb.get("sequence"))
    if n_samples is None:
        n_samples = SEQUENCE_MC_SAMPLES if seq or generic_seq else 100_000
    if seq or generic_seq:
        if seq:
            (na, nb), n_ctx = sequence_networks([ma, mb], [ca, cb], [a, b], n_ctx)
        else:
            na, nb = ma.to_network(), mb.to_network()
            check_sequence_n_ctx([na, nb], [a, b], n_ctx)   # a bad --n-ctx: exit 2, no rows
        pairs, more = [p for p in pairs if p[0] == "gaussian"], \
            [{"metric": m, "method": me, "reason": "sequence models: only the Gaussian metric"}
             for m, me in pairs if m != "gaussian"]
        skipped += more
        if not pairs:
            raise ValueError("--metrics: bilinear-transformer checkpoints have only the gaussian "
                             "metric")
    else:
        if n_ctx is not None:
            raise ValueError("--n-ctx: only for bilinear-transformer (sequence) checkpoints")
        na, nb = ma.to_network(), mb.to_network()
    rows = []
    # Each Monte Carlo row runs two estimates (global and output="each") that raise the same
    # warnings (e.g. "n_samples=100 < 300"); the default filter's once-per-line registry does
    # not hold them back, since scipy, imported lazily by the first, resets it. Recorded here
    # and re-raised once each after the loop.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compare_rows(rows, pairs, na, nb, seq or generic_seq, n_samples, seed, n_ctx,
                      show_progress)
    _warn_once(caught)
    result = {
        **stamp("compare", {"a": str(a), "b": str(b), "methods": list(methods),
                            "metrics": list(metrics), "data": data, "n_samples": n_samples,
                            "seed": seed, "n_ctx": n_ctx}),
        "a": {"path": str(a), "step": ca.get("step"), "n_layers": ca.get("n_layers")},
        "b": {"path": str(b), "step": cb.get("step"), "n_layers": cb.get("n_layers")},
        "depth": max(ca["n_layers"], cb["n_layers"]),
        "results": rows,
        "skipped": skipped,
    }
    if data == "digits":
        from ..baselines import all_baselines
        from ..data import load_digits_data

        d = load_digits_data(seed=seed)
        result["baselines"] = all_baselines(ma, mb, d.X_test)
        result["baselines_data"] = d.provenance
    return result


def _compare_rows(rows: list, pairs, na, nb, sequence: bool, n_samples: int, seed: int,
                  n_ctx, show_progress: bool) -> None:
    """The rows of [`run_compare`][tensoralg.audit.compare.run_compare], one per (metric, method)
    pair, appended to ``rows``."""
    import tensoralg as ta

    for metric, method in progress(pairs, "compare", show_progress):
        entry = {"metric": metric, "method": method}
        if method == "closure":
            entry.update(label=CLOSURE_LABEL, approximate=True,
                         note="the moment-closure similarity: exact at depth 1, a different, "
                              "approximate quantity at depth >= 2 (docs/mathematics.md §3.2, "
                              "§3.9)")
        kw = {"n_samples": n_samples, "seed": seed} if method == "montecarlo" else {}
        if sequence:
            kw["n_ctx"] = n_ctx
        t = time.perf_counter()
        try:
            g = ta.similarity(na, nb, metric=metric, method=method, **kw)
            if sequence and method == "montecarlo":   # no output="each" there
                each = None
            else:
                each = ta.similarity(na, nb, metric=metric, method=method, output="each", **kw)
            entry["global"] = float(g)
            if each is not None:
                entry["each"] = [float(v) for v in np.asarray(each, dtype=np.float64)]
            if getattr(g, "stderr", None) is not None:
                entry["global_stderr"] = float(g.stderr)
            if getattr(g, "diagnostics", None) is not None:   # Monte Carlo: the verdict
                d = g.diagnostics
                entry["reliable"] = bool(d.reliable)
                if not d.reliable:   # not an answer: kept under its own name, global null
                    entry["unreliable_estimate"] = entry["global"]
                    entry["global"] = None
                entry["diagnostics"] = {"reason": d.reason, "max_share": d.max_share,
                                        "replicates_max_z": d.max_z,
                                        "replicates": [list(x) for x in d.replicates],
                                        "certified_lower_bounds": d.lower_bounds,
                                        "exact": bool(d.exact),
                                        "spread_ratio": d.spread_ratio,
                                        "cross_check": None if d.cross_check is None else
                                        dict(zip(("value", "stderr", "z", "reliable"),
                                                 d.cross_check))}
                if not d.reliable:   # what can be trusted instead
                    entry["exact_instead"] = exact_instead(na, nb, n_ctx if sequence else None)
            if getattr(each, "stderr", None) is not None:
                entry["each_stderr"] = [float(v) for v in np.ravel(each.stderr)]
            if getattr(each, "reliable", None) is not None:   # Monte Carlo: each slice's verdict
                entry["each_reliable"] = [bool(v) for v in np.ravel(each.reliable)]
        except (ValueError, NotImplementedError) as exc:  # CostTooHigh is a ValueError
            msg = str(exc)
            if msg.startswith("n_ctx:"):   # the library's argument is the CLI's --n-ctx
                msg = "--n-ctx" + msg[len("n_ctx"):]
            entry["error"] = f"{type(exc).__name__}: {msg}"
        entry["seconds"] = time.perf_counter() - t
        rows.append(entry)


def exact_instead(na, nb, n_ctx) -> dict:
    """What is exact for a pair whose Monte Carlo similarity has no reliable estimate: the
    exact first-order path similarities of two transformers (``{"paths": {name: sim}}``,
    `tensoralg.decompose.path_similarity`; left out where the models are not residual stacks
    of the same shape) and the degree-resolved similarities ``S<=1`` and ``S<=5`` (below the
    models' degree) where
    [`tensoralg.degree_similarity`][tensoralg.degree_similarity] computes them exactly
    (docs/mathematics.md §3.9: a different question from the full similarity, the similarity of the
    low-degree parts), as ``{"S<=K": value}``; a ``K`` it could only estimate is left out, and a
    refusal is kept as ``{"refused": message}``."""
    import tensoralg as ta

    deg = min(na.degree, nb.degree)
    Ks = [k for k in (1, 5) if k < deg] or [1]
    try:
        r = ta.degree_similarity(na, nb, n_ctx=n_ctx, max_degree=Ks)
    except ValueError as exc:   # CostTooHigh is a ValueError
        return {"refused": str(exc).split("\n")[0]}
    out = {f"S<={K}": float(r[K]) for K in Ks if r.method.get(K) == "exact"}
    if n_ctx is not None:   # transformers: the exact first-order paths, same path in both
        import tensoralg.decompose as dc

        try:
            ps = dc.path_similarity(na, nb, n_ctx=n_ctx)
        except (ValueError, NotImplementedError):   # not a residual stack, over budget
            return out
        out["paths"] = {k: (None if v is None else float(v)) for k, v in ps.items()}
    return out


#: First-order paths a table prints in place of an unreliable similarity (all are in the JSON).
_PATHS_SHOWN = 6


def _instead_text(r: dict) -> str:
    """What a table prints in place of an unreliable estimate: the exact degree-resolved
    similarities and the certified lower bounds on the squared norms."""
    ex = r.get("exact_instead") or {}
    vals = {k: v for k, v in ex.items() if k not in ("refused", "paths")}
    out = ""
    if vals:
        out = ("; exact instead (degree-resolved similarity, a different question: the "
               "low-degree parts) " + ", ".join(f"{k.replace('<=', '≤')} = {v:.6g}"
                                                for k, v in vals.items()))
    paths = {k: v for k, v in (ex.get("paths") or {}).items() if v is not None}
    if paths:   # the least similar first: where the two models differ
        shown = sorted(paths.items(), key=lambda kv: kv[1])[:_PATHS_SHOWN]
        out += ("; exact first-order paths (least similar first) "
                + ", ".join(f"{k} {v:.4g}" for k, v in shown)
                + (f", ... ({len(paths)} in the JSON)" if len(paths) > len(shown) else ""))
    lb = (r.get("diagnostics") or {}).get("certified_lower_bounds") or {}
    if lb:
        from ..strategies.montecarlo import MC_LOWER_BOUND_CONFIDENCE

        out += (f"; certified lower bounds (confidence {MC_LOWER_BOUND_CONFIDENCE:g}) "
                + ", ".join(f"{k} ≥ {v:.4g}" for k, v in lb.items()))
    return out


def _warn_once(caught) -> None:
    """Re-raise each distinct recorded warning (category and text) once, at the caller."""
    from ..errors import warn_caller

    seen = set()
    for w in caught:
        key = (w.category, str(w.message))
        if key not in seen:
            seen.add(key)
            warn_caller(str(w.message), w.category)


def _each_stderr(r: dict, c: int) -> float | None:
    """The standard error of output ``c``'s estimate (None for a deterministic method)."""
    se = r.get("each_stderr")
    return None if se is None else se[c]


def compare_table(result: dict) -> str:
    out = [f"compare {result['a']['path']}  vs  {result['b']['path']} (depth {result['depth']})"]
    rows = []
    n_out = 0
    notes = []
    for r in result["results"]:
        if "error" in r:
            notes.append(f"[{len(notes) + 1}] {r['metric']}/{r['method']}: {r['error']}")
            rows.append([r["metric"], method_label(r["method"]), "-", "-", "-",
                         f"refused, see [{len(notes)}]"])
            continue
        stderr = f"±{r['global_stderr']:.1e}" if "global_stderr" in r else \
            ("APPROXIMATE at depth >= 2" if r["method"] == "closure" else "")
        if r.get("reliable") is False:   # a failed diagnostic is not an answer
            lbs = r["diagnostics"].get("certified_lower_bounds") or {}
            notes.append(f"[{len(notes) + 1}] {r['metric']}/{r['method']}: "
                         f"{r['diagnostics']['reason']}"
                         + ("; certified lower bounds " + ", ".join(
                             f"{k} >= {v:.4g}" for k, v in lbs.items()) if lbs else "")
                         + _instead_text(r))
            rows.append([r["metric"], r["method"], "no reliable estimate", "-", "-",
                         f"see [{len(notes)}]"])
            continue
        each = r.get("each")
        if each is None:   # sequence-model Monte Carlo: global only
            rows.append([r["metric"], method_label(r["method"]), r["global"], "-", "-", stderr])
            continue
        n_out = len(each)
        if not all(r.get("each_reliable") or [True]):   # "min slice" would lean on a non-answer
            rows.append([r["metric"], method_label(r["method"]), r["global"],
                         "no reliable estimate", "-", stderr])
            continue
        c = int(np.argmin(each))
        rows.append([r["metric"], method_label(r["method"]), r["global"],
                     pm(each[c], _each_stderr(r, c)), c, stderr])
    out.append(format_table(["metric", "method", "global", "min slice", "argmin", "note"], rows))
    out += notes
    skipped = result.get("skipped", [])
    if skipped:
        by_reason: dict[str, list[str]] = {}
        for s in skipped:
            by_reason.setdefault(s["reason"], []).append(f"{s['metric']}/{s['method']}")
        out += [f"skipped {', '.join(v)}: {k}" for k, v in by_reason.items()]
    ok = [r for r in result["results"] if "each" in r and r.get("reliable") is not False]
    if ok and n_out <= 32:
        out.append("")
        out.append(format_table(["output"] + [f"{r['metric']}/{method_label(r['method'])}"
                                              for r in ok],
                                [[c] + [pm(r["each"][c], _each_stderr(r, c),
                                           (r.get("each_reliable") or [None] * n_out)[c])
                                        for r in ok] for c in range(n_out)]))
    if "baselines" in result:
        out.append("")
        # a divergence reads the other way round from the similarities (as in the demo)
        out.append(format_table(["baseline (digits test split)", "value"],
                                [[k + (" (0 = same; lower = more alike)" if "divergence" in k
                                       else ""), v]
                                 for k, v in result["baselines"].items()]))
    return "\n".join(out)


def run_matrix(paths: Sequence[str], out: str | Path, method: str = "auto",
               output: int | None = None, seed: int = 0, n_samples: int | None = None,
               json_copy: str | Path | None = None, n_ctx: int | None = None) -> dict:
    """Similarity matrix of the checkpoints at ``paths`` (heatmap ``matrix.png``, ``matrix.csv``,
    ``matrix.json`` under ``out``). ``seed``, ``n_samples``: Monte Carlo seed and sample count
    (default ``MC_SAMPLES``; ``SEQUENCE_MC_SAMPLES`` for bilinear-transformer checkpoints, as
    [`run_compare`][tensoralg.audit.compare.run_compare])
    (a Monte Carlo matrix carries per entry a standard error and a verdict:
    ``similarity_stderr`` / ``similarity_reliable``; an unreliable entry is null in
    ``similarity_matrix``, blank in the CSV and the heatmap, "no reliable estimate" in the
    table; see ``uncertainty``). ``json_copy``: also write the JSON there (checked up front,
    written before the swap).

    ``out`` must be missing, empty or an earlier matrix output (it holds ``matrix.json``); the
    three files are written into a fresh folder that replaces ``out`` only when complete.

    Raises:
        ValueError: fewer than two checkpoints, mismatched sizes, a bad ``output`` or ``out``;
            ``method="auto"`` for bilinear transformers of two or more layers (see
            [`sequence_matrix_method`][tensoralg.audit.compare.sequence_matrix_method]: no
            approximation is chosen by default);
        tensoralg.CostTooHigh: ``method="exact"`` over the exact budget (checked before any
            contraction).
    """
    from .common import check_output_folder
    from .plotting import heatmaps

    if len(paths) < 2:
        raise ValueError(f"checkpoints: need at least two, got {len(paths)}")
    final = check_output_folder(out, "matrix.json")
    if json_copy is not None:
        check_file_writable(json_copy, "--json")
    from ._cliutil import check_n_samples

    if n_samples is not None:
        check_n_samples(n_samples)
    loaded = [_load(p) for p in paths]
    cfgs = [c for _, c in loaded]
    _same_shape(cfgs, paths)
    from .language import TRANSFORMER_KEYS, is_transformer_cfg, sequence_networks

    seq = is_transformer_cfg(cfgs[0])
    # sequence networks written by save_checkpoint / tensoralg import (attention layers)
    generic_seq = not seq and any(c.get("sequence") for c in cfgs)
    if n_samples is None:
        n_samples = SEQUENCE_MC_SAMPLES if seq or generic_seq else MC_SAMPLES
    keys = TRANSFORMER_KEYS if seq else ("n_layers", "d_model", "d_hidden", "residual", "bias")
    arch = [tuple(c.get(k) for k in keys) for c in cfgs]
    for p, a in zip(paths[1:], arch[1:]):
        if a != arch[0]:
            raise ValueError(f"checkpoints: a similarity matrix needs one architecture; {p} has "
                             f"{dict(zip(keys, a))}, {paths[0]} has {dict(zip(keys, arch[0]))} "
                             f"(compare mixed pairs with `tensoralg compare`)")
    d_out = _io(cfgs[0])[1]
    if output is not None:
        from ..request import check_class_index

        check_class_index(output, d_out, "--output")
    depth = max(c["n_layers"] for c in cfgs)
    t = time.perf_counter()
    if seq:
        if output is not None:
            raise ValueError("--output: not supported for bilinear-transformer checkpoints "
                             "(the matrix sums over all logits)")
        used = sequence_matrix_method(method, depth)
        nets, n_ctx = sequence_networks([m for m, _ in loaded], cfgs, paths, n_ctx)
        mat, info = sequence_similarity_matrix_for_cli(nets, used, n_ctx, n_samples, seed)
        se, ok = info.get("stderr"), info.get("reliable")
    else:
        if n_ctx is not None and not generic_seq:
            raise ValueError("--n-ctx: only for sequence checkpoints (bilinear transformers, or "
                             "networks with attention layers)")
        nets = [m.to_network() for m, _ in loaded]
        if generic_seq:
            n_ctx = check_sequence_n_ctx(nets, paths, n_ctx, required=True)
        deepest = nets[max(range(len(cfgs)), key=lambda i: cfgs[i]["n_layers"])]
        planned = choose_method(method, depth, deepest, n_ctx)
        mat, used = similarity_matrix(nets, method if planned == "exact" else planned,
                                      depth=depth, output=output, seed=seed, n_samples=n_samples,
                                      n_ctx=n_ctx)
        se, ok = mc_entries(mat)
    rec = matrix_record(mat, se, ok)
    mat = shown_matrix(mat, ok)
    seconds = time.perf_counter() - t
    labels = [Path(p).name or str(p) for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(p) for p in paths]
    what = "all outputs" if output is None else f"output {output}"
    result = {
        **stamp("matrix", {"checkpoints": [str(p) for p in paths], "method": method,
                           "output": output, "seed": seed, "n_samples": n_samples,
                           "n_ctx": n_ctx}),
        "labels": labels, "steps": [c.get("step") for c in cfgs], "method": used,
        "method_label": method_label(used), "approximate": used != "exact",
        "metric": "gaussian", "output": output, "similarity_matrix": mat,
        **{f"similarity_{k}": v for k, v in rec.items()},
        "uncertainty": matrix_uncertainty(used, n_samples, seed), "seconds": seconds,
        "files": ["matrix.json", "matrix.csv", "matrix.png"],
        "paths": "files: relative to the output folder; checkpoints: as given on the command line",
    }
    with staged_output(final, "matrix.json") as stage:
        write_csv(stage / "matrix.csv", ["checkpoint"] + labels,
                  ([lab] + [float(v) for v in row] for lab, row in zip(labels, mat)))
        heatmaps(stage / "matrix.png",
                 {(f"{CLOSURE_LABEL} similarity ({what}): not the tensor similarity at depth "
                   f">= 2" if used == "closure" else f"tensor similarity ({used}, {what})"): mat},
                 labels, "checkpoint x checkpoint similarity" +
                 ("; blank: no reliable estimate" if rec.get("n_unreliable") else ""))
        write_json(stage / "matrix.json", result)
        result["out"] = str(final)
        if json_copy is not None:
            write_json_copy(json_copy, result, final, stage)
    return result


def sequence_matrix_method(method: str, depth: int) -> str:
    """The method of a similarity matrix of bilinear-transformer checkpoints: ``auto`` is exact
    for one attention layer and REFUSED beyond (a one-line ValueError naming the alternatives,
    before any work): the exact similarity of two attention layers is out of reach and the
    moment-closure similarity is a different, approximate quantity there
    (docs/mathematics.md §3.9), so it is computed only when asked for (``closure``)."""
    if method != "auto":
        return method
    if depth == 1:
        return "exact"
    raise ValueError(f"--method auto: the exact similarity of depth-{depth} bilinear "
                     f"transformers is out of reach, and no approximation is chosen for you; "
                     f"use --method montecarlo (a shared-direction estimate, each entry with "
                     f"its standard error and verdict), --method closure (the moment-closure "
                     f"similarity: APPROXIMATE, "
                     f"not the tensor similarity at depth >= 2), `tensoralg compare A B` (one "
                     f"pair's Monte Carlo estimate with its reliability verdict) or `tensoralg "
                     f"audit language` (every pair with its verdict)")


def sequence_similarity_matrix_for_cli(nets, method, n_ctx, n_samples, seed):
    from .language import sequence_similarity_matrix

    return sequence_similarity_matrix(nets, method, n_ctx, n_samples=n_samples, seed=seed)


def matrix_table(result: dict) -> str:
    """The matrix as a table: ``v ± se`` per Monte Carlo entry (``similarity_stderr``), "no
    reliable estimate" where its verdict failed (``similarity_reliable``)."""
    labels = result["labels"]
    short = [lab[-14:] for lab in labels]
    mat = result["similarity_matrix"]
    se = result.get("similarity_stderr")
    ok = result.get("similarity_reliable")
    unc = result.get("uncertainty") or {}
    est = ""
    if unc.get("estimate"):
        est = (f"; Monte Carlo estimate from {unc['n_samples']} samples, "
               + ("± 1 standard error" if se is not None else "no per-entry standard error"))

    def cell(i, j):
        v = mat[i][j]
        if se is None:
            return float(v)
        if ok is not None and not ok[i][j]:
            return "no reliable estimate"
        return float(v) if i == j else pm(float(v), se[i][j])   # S_ii = 1 by definition

    return "\n".join([f"similarity matrix ({method_label(result['method'])}{est}, "
                      f"{'all outputs' if result['output'] is None else 'output ' + str(result['output'])}):",
                      format_table([""] + short, [[s] + [cell(i, j) for j in range(len(short))]
                                                  for i, s in enumerate(short)])])
