"""``tensoralg decompose CKPT [--output c] [--k K] [--diff CKPT2] [--n-ctx N]``: a checkpoint (or
the change from CKPT to CKPT2) taken apart.

* depth 1: eigen-components per output (``tensoralg.decompose.eigen``): the norm, the top
  eigenvalues, the exact relative error and similarity of keeping ``k``; the top ``k``
  eigenvectors of one output drawn in input space (8x8 images for digits);
* residual networks of depth >= 2: the residual paths (``tensoralg.decompose.paths``) with their
  exact shares of ``||f||^2`` and costs.

Writes ``decompose.json`` (stamped with the version and the options) and, for depth 1 with
``--k`` above 0, ``decompose_eigenvectors.png`` under ``--out`` (default ``runs/decompose``;
new, empty or an earlier decompose output, replaced as a whole only by a complete run).
Transformer checkpoints (a residual stack of bilinear attention and MLP blocks): the first-order
paths (``tensoralg.decompose.paths``: direct, each head, each MLP) with their exact shares of
``||sum of the listed paths||^2``, at ``--n-ctx`` positions (default: the trained context), and
with ``--diff CKPT2`` the exact similarity of each path to the same path of CKPT2
(``--match``: heads matched per layer by function first); ``--rest-samples N`` estimates the
remainder ``f - sum`` by Monte Carlo with its verdict (default 0: not assessed). ``--order 2``
adds the second-order paths (a leg of a later head reading an earlier head, the virtual
heads ``L1.H0.K1<-L0.H1``), exact by the feature-space chaos of two-node terms where
``n_ctx * d`` is small (refused in one line with its estimate before any work otherwise; not
with ``--diff``). The table is also drawn, each path's share, as ``decompose_paths.png``.

``tensoralg decompose paths-over-training CKPT1 CKPT2 ... [--n-ctx N]``: transformer checkpoints
of one architecture (e.g. one training run), every first-order path's exact similarity to the
same path of the final checkpoint and of the next one, and its share per checkpoint
(`tensoralg.decompose.paths_over_training`): a table, ``paths_over_training.json``, ``.csv`` and
a path x checkpoint heatmap ``paths_over_training.png`` under ``--out`` (default
``runs/paths_over_training``). A form of ``decompose`` rather than ``matrix --paths``: its
numbers are path x checkpoint tables from the path decomposition, where every option of
``matrix`` (``--method``, ``--output``, the blocked Dask matrix) is about checkpoint x
checkpoint similarities of whole models.
"""

from __future__ import annotations

from pathlib import Path

JSON_NAME = "decompose.json"
FIG_NAME = "decompose_eigenvectors.png"
PATHS_FIG = "decompose_paths.png"   # transformer checkpoints: each path's share
#: ``tensoralg decompose paths-over-training``: the word, its default folder and files.
OVER_TRAINING = "paths-over-training"
OT_OUT = "runs/paths_over_training"
OT_JSON, OT_CSV, OT_FIG = ("paths_over_training.json", "paths_over_training.csv",
                           "paths_over_training.png")
USAGE = ("%(prog)s CKPT [--diff CKPT2] [--match] [--output CLASS] [--k K] [--n-ctx N] "
         "[--order 1|2] [--rest-samples N] [--out DIR] [--json PATH] [--threads N]\n"
         "       %(prog)s paths-over-training CKPT1 CKPT2 [CKPT ...] [--n-ctx N] [--out DIR] "
         "[--json PATH] [--threads N]")


def add_parsers(sub) -> None:
    from ..threads import add_threads_option, nonneg_int

    def positive_int(v: str) -> int:
        n = nonneg_int(v)
        if n < 1:
            import argparse

            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v!r}")
        return n

    p = sub.add_parser("decompose", help="eigen-components / residual paths of a checkpoint "
                                         "(paths-over-training: of several)",
                       description=__doc__.split("\n\n")[0], usage=USAGE)
    p.add_argument("checkpoint", help="checkpoint folder (weights.safetensors + cfg.json), or "
                                      "the word paths-over-training followed by two or more "
                                      "transformer checkpoint folders")
    p.add_argument("more", nargs="*", metavar="CKPT",
                   help="after paths-over-training: the checkpoint folders, in training order, "
                        "the last one the final checkpoint (default: none)")
    p.add_argument("--diff", metavar="CKPT2", default=None,
                   help="decompose the change CKPT2 - CKPT instead (a difference network; "
                        "default: none)")
    p.add_argument("--output", type=int, default=None, metavar="CLASS",
                   help="the output (class) whose eigenvectors are drawn (default: all outputs "
                        "in the table, the largest in the figure)")
    p.add_argument("--k", type=nonneg_int, default=None,
                   help="eigen-components kept / drawn (default 4; 0: the table only, no "
                        "figure)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default runs/decompose)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the JSON to PATH (a file path; missing folders on the way "
                        "are created, as for --out; checked before any work; default: none)")
    p.add_argument("--n-ctx", type=positive_int, default=None, metavar="N",
                   help="transformer checkpoints: the sequence length of the paths (default: "
                        "the trained context)")
    p.add_argument("--order", default=None, metavar="1|2",
                   help="transformer checkpoints: 1 for the first-order paths (direct, each "
                        "head, each MLP), 2 to add the second-order paths (a leg of a later "
                        "head reading an earlier head, the virtual heads; exact for small "
                        "n_ctx * d only, refused with its estimate before any work; not with "
                        "--diff) (default 1)")
    p.add_argument("--match", action="store_true",
                   help="transformer checkpoints with --diff: match heads per layer by the "
                        "exact similarity of their paths before comparing them (default: "
                        "heads compared by index)")
    p.add_argument("--rest-samples", type=nonneg_int, default=0, metavar="N",
                   help="transformer checkpoints: Monte Carlo directions for the norm of the "
                        "remainder f - sum of the paths (default 0: not assessed)")
    add_threads_option(p)
    p.set_defaults(func=cmd_decompose, own_threads=True)


def _load(path: str, option: str):
    from ..checkpoint import load_checkpoint

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{option}: {path} is not a checkpoint folder")
    net = load_checkpoint(path)[0].to_network()
    if net.is_sequence_model:
        return net
    from . import bilinear_depth
    from .residual import _split_residual

    depth = bilinear_depth(net)
    if depth > 1:
        try:
            _split_residual(net)
        except ValueError:
            raise ValueError(f"{option}: {path} is a bilinear network of depth {depth} without "
                             f"residual blocks: such models are not decomposed (tensoralg "
                             f"decompose takes apart depth-1 networks into eigen-components and "
                             f"residual networks, [Linear ...] Residual blocks [Linear ...], into "
                             f"paths); compare checkpoints with tensoralg compare A B") from None
    return net


def check_order_option(order) -> int | None:
    """``--order`` as given on the command line: None, or 1 or 2 (a one-line ValueError)."""
    if order is None or order in (1, 2):
        return order
    if str(order).strip() in ("1", "2"):
        return int(str(order).strip())
    raise ValueError(f"--order: expected 1 (first-order paths) or 2 (second-order paths), got "
                     f"{order!r}")


def _sequence_result(net, checkpoint: str, diff: str | None, n_ctx: int | None, match: bool,
                     rest_samples: int, k: int, output: int | None, order: int = 1) -> dict:
    """The path table of a transformer checkpoint (and the similarity to ``--diff``)."""
    from ..audit.common import stamp
    from .residual import path_similarity, paths

    if output is not None:
        raise ValueError("--output: transformer checkpoints are taken apart into paths, summed "
                         "over outputs; --output is for eigen-components of vector networks")
    other = None
    if diff is not None:
        other = _load(diff, "--diff")
        if not other.is_sequence_model:
            raise ValueError(f"--diff: {diff} is a vector network and CKPT {checkpoint} a "
                             f"transformer; the paths of two checkpoints are compared within "
                             f"one architecture")
    elif match:
        raise ValueError("--match: matches the heads of CKPT and --diff CKPT2; give --diff")
    if order == 2 and diff is not None:
        raise ValueError("--order: 2 with --diff: the similarity between checkpoints is of the "
                         "first-order paths only; drop --diff for the second-order path table, "
                         "or use --order 1 with --diff")
    if n_ctx is not None and net.n_ctx is not None and n_ctx > net.n_ctx:
        raise ValueError(f"--n-ctx: {n_ctx} is longer than the trained context {net.n_ctx} of "
                         f"CKPT {checkpoint}")

    def named(fn):
        try:
            return fn()
        except ValueError as exc:
            msg = str(exc)
            if msg.startswith("n_ctx"):
                raise ValueError(f"--n-ctx: {msg}") from None
            if msg.startswith(("a and b", "b:")):
                raise ValueError(f"--diff: {msg}") from None
            raise ValueError(f"CKPT: {msg}") from None

    if other is not None:   # the pair's structure checked before any contraction
        from .sequence_paths import _path_networks

        pa, pb = _path_networks(net, "CKPT")[0], _path_networks(other, "--diff")[0]
        if pa != pb:
            raise ValueError(f"--diff: {diff} has the paths {pb}, CKPT {checkpoint} has {pa}; "
                             f"paths are compared between checkpoints with the same layers and "
                             f"heads")
    try:
        pd = named(lambda: paths(net, n_ctx=n_ctx, rest_samples=rest_samples, order=order))
    except ValueError as exc:
        if order == 2 and "two-node terms" in str(exc):
            raise ValueError(f"--order: 2 at n_ctx={n_ctx or net.n_ctx} is over the exact "
                             f"budget ({str(exc).split(': ', 2)[-1].split(' Alternatives')[0]}); "
                             f"use --order 1 (exact first-order paths) or a shorter --n-ctx"
                             ) from None
        raise
    result = stamp("decompose", {"checkpoint": checkpoint, "diff": diff, "output": output,
                                 "k": k, "n_ctx": pd.n_ctx, "match": match,
                                 "rest_samples": rest_samples, "order": order})
    subject = f"checkpoint {checkpoint}"
    result.update(subject=subject, sequence=True, d=net.in_features, n_outputs=net.out_features,
                  paths=pd.to_dict())
    if other is not None:
        sims = named(lambda: path_similarity(net, other, n_ctx=pd.n_ctx, match=match))
        result["similarity"] = {"to": diff, "values": dict(sims), "partner": sims.partner,
                                "matching": None if sims.matching is None else
                                {str(k_): v for k_, v in sims.matching.items()},
                                "method": sims.method}
    return result


def decompose_checkpoint(checkpoint: str, diff: str | None = None, output: int | None = None,
                         k: int = 4, n_ctx: int | None = None, match: bool = False,
                         rest_samples: int = 0, order: int | None = None
                         ) -> tuple[dict, object]:
    """The JSON result of ``tensoralg decompose`` and the eigendecomposition drawn (or None).

    Raises:
        ValueError: ``--output`` out of range, ``--k`` above the input dimension, a checkpoint
            holding attention (not decomposed here);
        FileNotFoundError / ValueError from loading the checkpoints.
    """
    from ..audit.common import stamp
    from . import bilinear_depth, difference, eigen, paths

    net = _load(checkpoint, "CKPT")
    if net.is_sequence_model:
        return _sequence_result(net, checkpoint, diff, n_ctx, match, rest_samples, k,
                                output, 1 if order is None else order), None
    for flag, given in (("--n-ctx", n_ctx is not None), ("--match", match),
                        ("--order", order is not None),
                        ("--rest-samples", bool(rest_samples))):
        if given:
            raise ValueError(f"{flag}: only for transformer checkpoints (sequence models); "
                             f"CKPT {checkpoint} is a vector network")
    what = f"checkpoint {checkpoint}"
    if diff is not None:
        from ._common import type_key

        other = _load(diff, "--diff")
        if other.is_sequence_model:
            raise ValueError(f"--diff: {diff} holds attention (a transformer) and CKPT "
                             f"{checkpoint} is a vector network; the change is decomposed "
                             f"between checkpoints of one architecture")
        if (other.in_features, other.out_features) != (net.in_features, net.out_features):
            raise ValueError(f"--diff: {diff} maps {other.in_features} inputs to "
                             f"{other.out_features} outputs, CKPT {checkpoint} maps "
                             f"{net.in_features} to {net.out_features}; the change between two "
                             f"checkpoints needs the same input and output sizes")
        if max(bilinear_depth(net), bilinear_depth(other)) > 1 and \
                type_key(net) != type_key(other):
            raise ValueError(f"--diff: {diff} (bilinear depth {bilinear_depth(other)}) and CKPT "
                             f"{checkpoint} (bilinear depth {bilinear_depth(net)}) have different "
                             f"layer patterns; the change is decomposed between checkpoints of "
                             f"one architecture (compare them with tensoralg compare A B)")
        net = difference(net, other)
        what = f"change {checkpoint} -> {diff}"
    O, d = net.out_features, net.in_features
    if output is not None:
        from ..request import check_class_index

        check_class_index(output, O, "--output")
    if k > d:
        raise ValueError(f"--k: {k} eigen-components requested but the input has only {d} "
                         f"dimensions")
    result = stamp("decompose", {"checkpoint": checkpoint, "diff": diff, "output": output,
                                 "k": k})
    result.update(subject=what, depth=bilinear_depth(net), d=d, n_outputs=O)
    if bilinear_depth(net) <= 1:
        eigs = eigen(net, "each")
        drawn = output if output is not None else int(max(range(O), key=lambda c: eigs[c].norm2))
        result["eigen"] = {str(c): e.to_dict(top=k if c == drawn else 0)
                           for c, e in enumerate(eigs)}
        if k == 0:   # no eigenvector kept: nothing is drawn
            result["drawn_output"] = None
            return result, None
        result["drawn_output"] = drawn
        return result, eigs[drawn]
    pd = paths(net)
    result["paths"] = pd.to_dict()
    return result, None


def table(result: dict) -> str:
    from ..audit.common import format_table

    k = result["config"]["k"]
    if result.get("sequence"):
        return _sequence_table(result)
    lines = [f"{result['subject']}: {result['d']} inputs, {result['n_outputs']} outputs, "
             f"bilinear depth {result['depth']}"]
    if "eigen" in result:
        rows = []
        for c, e in result["eigen"].items():
            lam = e["eigenvalues"]
            defined = e["norm2"] > 0   # a zero function has no relative error or direction
            rows.append([c, e["norm2"], e["C0"] ** 2, e["C1_norm2"], lam[0],
                         lam[1] if len(lam) > 1 else "-",   # one input: one eigenvalue
                         e["relative_error"][k] if defined else "undefined (f = 0)",
                         e["similarity"][k] if defined else "undefined (f = 0)"])
        lines.append(format_table(["output", "||f||^2", "C0^2", "|C1|^2", "lambda_1", "lambda_2",
                                   f"rel. error (k={k})", f"similarity (k={k})"], rows))
        lines.append("f = C0 + C1.x + sum_i lambda_i He2(v_i.x); keeping the top k components "
                     "costs exactly 2 sum_dropped lambda_i^2 (relative error above); "
                     + (f"figure: output {result['drawn_output']}"
                        if result["drawn_output"] is not None
                        else "no figure (--k 0: no eigenvectors to draw)"))
    else:
        p = result["paths"]
        rows = [[n, dep, s, "over budget" if n in p["over_budget"] else ""]
                for n, dep, s in zip(p["names"], p["depths"], p["share"])]
        lines.append(format_table(["path", "depth", "share of ||f||^2", "note"], rows))
        chk = p["check"]
        if chk is not None:
            lines.append(f"paths sum to the model: {chk['equal']} (relative residual "
                         f"{chk['relative_residual']:.2e}); interference {chk['interference']:.4g}")
    return "\n".join(lines)


def _sequence_table(result: dict) -> str:
    from ..audit.common import format_table

    p = result["paths"]
    sim = result.get("similarity")
    head = ["path", "kind", "||path||^2", "share"]
    if sim is not None:
        head += ["similarity to --diff", "partner"]
    rows = []
    for i, (n, kd) in enumerate(zip(p["names"], p["kinds"])):
        row = [n, kd, p["gram"][i][i], p["share"][i]]
        if sim is not None:
            v = sim["values"].get(n)
            row += ["zero path" if v is None else v, sim["partner"].get(n, n)]
        rows.append(row)
    rn = p["rest_norm"]
    if rn is None:
        rest = ""
    elif "stderr" not in rn:
        rest = f"||rest|| = {rn['value']:.6g} "
    elif rn["reliable"] is False:
        rest = f"||rest||: no reliable estimate ({rn['diagnostics']}) "
    else:
        rest = f"||rest|| = {rn['value']:.6g} ± {rn['stderr']:.2g} "
    what = "first- and second-order paths" if p.get("order") == 2 else "first-order paths"
    lines = [f"{result['subject']}: {what} at n_ctx={p['n_ctx']} "
             f"({result['d']} inputs, {result['n_outputs']} outputs)",
             format_table(head, rows),
             f"share: of ||sum of the listed paths||^2 = {p['norm2_listed']:.6g} (exact); "
             f"interference {p['interference']:.4g}",
             f"rest = f - sum of the listed paths: {rest}({p['methods']['rest_norm']})"]
    if sim is not None:
        lines.append(f"similarity: {sim['method']}")
    return "\n".join(lines)


def cmd_decompose(args) -> int:
    from ..audit._cliutil import apply_threads, check_paths
    from ..audit.common import staged_output, write_json

    if args.checkpoint == OVER_TRAINING:
        return cmd_paths_over_training(args)
    if args.more:
        raise ValueError(f"CKPT: one checkpoint folder, got {1 + len(args.more)} "
                         f"({args.checkpoint} {' '.join(args.more)}); several checkpoints over "
                         f"training: tensoralg decompose {OVER_TRAINING} CKPT1 CKPT2 ...")
    args.k = 4 if args.k is None else args.k
    args.order = check_order_option(args.order)
    for path, option in ((args.checkpoint, "CKPT"), (args.diff, "--diff")):
        if path is not None and not Path(path).is_dir():   # before torch is imported
            raise FileNotFoundError(f"{option}: {path} is not a checkpoint folder")
    out = check_paths(args, "runs/decompose")   # --json, --out: empty or unwritable refused
    apply_threads(args)
    from .report import eigenvector_figure, path_share_figure

    result, eig = decompose_checkpoint(args.checkpoint, args.diff, args.output, args.k,
                                       args.n_ctx, args.match, args.rest_samples, args.order)
    with staged_output(out, JSON_NAME) as stage:
        files = [JSON_NAME]
        if eig is not None:
            eigenvector_figure(stage / FIG_NAME, eig, args.k,
                               f"{result['subject']}: output {result['drawn_output']}")
            files.append(FIG_NAME)
        elif result.get("sequence"):
            path_share_figure(stage / PATHS_FIG, result["paths"], result["subject"])
            files.append(PATHS_FIG)
        result["files"] = files
        write_json(stage / JSON_NAME, result)
        if args.json is not None:
            write_json(args.json, result)
    print(table(result))
    print(f"wrote {', '.join(str(Path(out) / f) for f in files)}")
    return 0


def cmd_paths_over_training(args) -> int:
    """``tensoralg decompose paths-over-training`` (`tensoralg.decompose.training_cli`)."""
    from . import training_cli

    return training_cli.cmd_paths_over_training(args, OVER_TRAINING, OT_OUT,
                                                (OT_JSON, OT_CSV, OT_FIG))
