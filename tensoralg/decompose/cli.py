"""``tensoralg decompose CKPT [--output c] [--k K] [--diff CKPT2]``: a checkpoint (or the change
from CKPT to CKPT2) taken apart.

* depth 1: eigen-components per output (``tensoralg.decompose.eigen``): the norm, the top
  eigenvalues, the exact relative error and similarity of keeping ``k``; the top ``k``
  eigenvectors of one output drawn in input space (8x8 images for digits);
* residual networks of depth >= 2: the residual paths (``tensoralg.decompose.paths``) with their
  exact shares of ``||f||^2`` and costs.

Writes ``decompose.json`` (stamped with the version and the options) and, for depth 1 with
``--k`` above 0, ``decompose_eigenvectors.png`` under ``--out`` (default ``runs/decompose``;
new, empty or an earlier decompose output, replaced as a whole only by a complete run).
Sequence models (attention: bilinear transformers) are refused: ``tensoralg compare`` /
``matrix`` compare them.
"""

from __future__ import annotations

from pathlib import Path

JSON_NAME = "decompose.json"
FIG_NAME = "decompose_eigenvectors.png"


def add_parsers(sub) -> None:
    from ..threads import add_threads_option, nonneg_int

    p = sub.add_parser("decompose", help="eigen-components / residual paths of a checkpoint",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="checkpoint folder (weights.safetensors + cfg.json)")
    p.add_argument("--diff", metavar="CKPT2", default=None,
                   help="decompose the change CKPT2 - CKPT instead (a difference network; "
                        "default: none)")
    p.add_argument("--output", type=int, default=None, metavar="CLASS",
                   help="the output (class) whose eigenvectors are drawn (default: all outputs "
                        "in the table, the largest in the figure)")
    p.add_argument("--k", type=nonneg_int, default=4,
                   help="eigen-components kept / drawn (default 4; 0: the table only, no "
                        "figure)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default runs/decompose)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the JSON to PATH (a file path; missing folders on the way "
                        "are created, as for --out; checked before any work; default: none)")
    add_threads_option(p)
    p.set_defaults(func=cmd_decompose, own_threads=True)


def _load(path: str, option: str):
    from ..checkpoint import load_checkpoint

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{option}: {path} is not a checkpoint folder")
    net = load_checkpoint(path)[0].to_network()
    if net.is_sequence_model:
        raise ValueError(f"{option}: {path} holds attention (a sequence model, e.g. a bilinear "
                         f"transformer): tensoralg decompose takes apart vector networks only "
                         f"(Linear, Bilinear and Residual layers, e.g. a BilinearNet checkpoint: "
                         f"eigen-components at depth 1, residual paths deeper); to compare "
                         f"transformer checkpoints use tensoralg compare A B or tensoralg matrix "
                         f"CKPT... (ta.similarity in Python)")
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


def decompose_checkpoint(checkpoint: str, diff: str | None = None, output: int | None = None,
                         k: int = 4) -> tuple[dict, object]:
    """The JSON result of ``tensoralg decompose`` and the eigendecomposition drawn (or None).

    Raises:
        ValueError: ``--output`` out of range, ``--k`` above the input dimension, a checkpoint
            holding attention (not decomposed here);
        FileNotFoundError / ValueError from loading the checkpoints.
    """
    from ..audit.common import stamp
    from . import bilinear_depth, difference, eigen, paths

    net = _load(checkpoint, "CKPT")
    what = f"checkpoint {checkpoint}"
    if diff is not None:
        from ._common import type_key

        other = _load(diff, "--diff")
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


def cmd_decompose(args) -> int:
    from ..audit._cliutil import apply_threads, check_paths
    from ..audit.common import staged_output, write_json

    for path, option in ((args.checkpoint, "CKPT"), (args.diff, "--diff")):
        if path is not None and not Path(path).is_dir():   # before torch is imported
            raise FileNotFoundError(f"{option}: {path} is not a checkpoint folder")
    out = check_paths(args, "runs/decompose")   # --json, --out: empty or unwritable refused
    apply_threads(args)
    from .report import eigenvector_figure

    result, eig = decompose_checkpoint(args.checkpoint, args.diff, args.output, args.k)
    with staged_output(out, JSON_NAME) as stage:
        files = [JSON_NAME]
        if eig is not None:
            eigenvector_figure(stage / FIG_NAME, eig, args.k,
                               f"{result['subject']}: output {result['drawn_output']}")
            files.append(FIG_NAME)
        result["files"] = files
        write_json(stage / JSON_NAME, result)
        if args.json is not None:
            write_json(args.json, result)
    print(table(result))
    print(f"wrote {', '.join(str(Path(out) / f) for f in files)}")
    return 0
