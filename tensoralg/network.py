"""The graph view: a network (or a joined pair) as a bipartite networkx graph of tensors and
indices, unrolled from the canonical tree ([`to_graph`][tensoralg.network.to_graph]), and the
sequence length of a pair (`sequence_n_ctx`). The Wick sum over the joined network lives in
`tensoralg.strategies.wick`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["to_graph", "sequence_n_ctx"]


def sequence_n_ctx(na: Any, nb: Any, n_ctx: Any) -> int | None:
    """The sequence length of the pair ``na``, ``nb`` (layers; ``nb`` may be None):
    `tensoralg.canonical.resolve_n_ctx` (raises its ValueErrors)."""
    from .canonical import resolve_n_ctx

    return resolve_n_ctx([("a", na)] + ([] if nb is None else [("b", nb)]), n_ctx)


#: Core names in the graph view, by the labels a core carries (docs/mathematics.md §3.7: the attention
#: term's output core ``O[o, h, v]`` and mask core ``M[t, s]``; the bilinear ``D[o, h]``).
def _core_name(kind: str, labels: tuple) -> str:
    if labels == ("t", "s"):
        return "M"
    if kind == "attention":
        return "O"
    return "D"


class _GraphBuilder:
    """Unrolls `Tree` s into one bipartite networkx graph."""

    def __init__(self, g, named: bool):
        self.g = g
        self.named = named          # position-free chain: the names of earlier versions
        self.n_s = 0

    def index(self, iid: str, size: int, **attrs) -> str:
        if iid not in self.g:
            self.g.add_node(iid, kind="index", size=int(size), **attrs)
        return iid

    def tensor(self, tid: str, arr, **attrs) -> str:
        if tid in self.g:
            raise AssertionError(f"graph view: duplicate tensor name {tid}")
        self.g.add_node(tid, kind="tensor", shape=tuple(arr.shape), **attrs)
        return tid

    def tensor_id(self, side, name, k, path, cid, tag, core: bool) -> str:
        if self.named:  # Canonical.tree: leg names carry the stage (L2), cores get it here
            tid = f"{side}.{name}{k + 1 if core else ''}{path}"
        else:
            tid = f"{cid}.{name}"
        return tid if tid not in self.g else f"{cid}{tag}.{name}"

    def copy(self, tree, k: int, side: str, path: str, out_index: str, t_var: str | None):
        """Copy of node ``k`` (its every term) whose output is ``out_index`` and whose query
        position variable is ``t_var``; recurses into the copies its legs read."""
        node = tree.nodes[k]
        cid = f"{side}.n{k + 1}{path}"
        # term-local indices (hidden, heads, key position) are tagged with the term only when
        # several terms of the node have some
        local = [j for j, term in enumerate(node.terms)
                 if any(set(lab) - {"o", "t"} for lab in [c[1] for c in term.cores]
                        + [leg.labels + (leg.pos or "",) for leg in term.legs])]
        many = len(local) > 1
        for j, term in enumerate(node.terms):
            tag = f"#{j}" if many else ""
            common = dict(side=side, node=k, term=j, term_kind=term.kind, copy=path)
            s_var = None
            if any(leg.pos == "s" for leg in term.legs) or any("s" in lab for _, lab in
                                                                 term.cores):
                s_var = f"{cid}{tag}.s"
                self.index(f"i:{s_var}", tree.n_ctx, position=s_var, query=False, open=False)

            def label_index(lab: str, size: int, s_var=s_var, tag=tag) -> str:
                if lab == "o":
                    return out_index
                if lab == "t":
                    return f"i:{t_var}"
                if lab == "s":
                    return f"i:{s_var}"
                return self.index(f"i:{cid}{tag}.{lab}", size)

            for _c, (arr, labs) in enumerate(term.cores):
                name = _core_name(term.kind, labs)
                tid = self.tensor_id(side, name, k, path, cid, tag, core=True)
                self.tensor(tid, arr, role="core", name=name, **common)
                extra = arr.ndim - len(labs)
                for ax, lab in enumerate(labs):
                    self.g.add_edge(tid, label_index(lab, arr.shape[extra + ax]))
            legs = term.legs
            for leg in legs:
                var = None if leg.pos is None else (t_var if leg.pos == "t" else s_var)
                tid = self.tensor_id(side, leg.name, k, path, cid, tag, core=False)
                self.tensor(tid, leg.weight, role="leg", name=leg.name, position=var,
                            positional=leg.positional, **common)
                extra = leg.weight.ndim - 1 - len(leg.labels)
                for ax, lab in enumerate(leg.labels):
                    self.g.add_edge(tid, label_index(lab, leg.weight.shape[extra + ax]))
                if var is not None:  # the input copy it reads carries that position
                    self.g.add_edge(tid, f"i:{var}")
                D = leg.weight.shape[-1]
                if k == 0:
                    w = leg.weight
                    lid = self.index(f"leg:{tid}", D, leg=True, position=var,
                                     can_cap=bool(np.any(w[..., 0] != 0)),
                                     can_pair=bool(np.any(w[..., 1:] != 0)))
                    self.g.add_edge(tid, lid)
                    continue
                token = leg.name.rstrip("0123456789").lower() if self.named else \
                    f"/{leg.name.lower()}"
                sub = path + token
                child_out = self.index(f"i:{side}.n{k}{sub}.x", D, lifted=True)
                self.g.add_edge(tid, child_out)
                self.copy(tree, k - 1, side, sub, child_out, var)


def to_graph(a: Any, b: Any = None, output: Any = None, n_ctx: int | None = None) -> nx.Graph:
    """The tensor network of ``a`` (or of the pair ``a``, ``b`` joined at the output) as a
    bipartite `networkx.Graph`, unrolled from the canonical tree of lifted multilinear
    nodes (`tensoralg.canonical.tree`, docs/mathematics.md §4): the legs of node ``k + 1`` read
        copies
    of node ``k``'s lifted output, so every leg of a node ``k > 0`` joins a copy of node
    ``k - 1`` (all of its terms), and the legs of node 0 are the open input legs.

    Nodes are tensors (``kind="tensor"``) and indices (``kind="index"``, with ``size``); an index
    node links every tensor that carries it, so a bilinear term's hidden index appears as a
    *hyperedge*: one index node joined to its core ``D`` and both legs ``L``, ``R``.

    Tensor attributes: ``shape`` (the array's, e.g. ``(d_out, H + 1)`` for ``D``: the constant
    output row is implicit, see below), ``side`` (``"a"``/``"b"``), ``node`` (index into
    ``tree.nodes``), ``term`` (index of the term within its node), ``term_kind``
    (``"linear"``, ``"bilinear"``, ``"attention"``), ``copy`` (the path of legs from the root
    down to this copy, ``""`` at the root), ``role`` (``"core"`` or ``"leg"``), ``name``
    (``D``, ``O``, ``M`` for cores; the leg's name, e.g. ``L2``, ``Q1``, ``V``, ``W``), and for
    legs ``position`` and ``positional`` (RoPE: the weight has a position axis, joined to that
    position's index).

    Index attributes: ``leg=True`` on the open input legs (copies of the lifted input
    ``x~``, size ``d + 1``; also ``can_cap`` / ``can_pair``: whether the constant column /
    another column of the leg's weight is non-zero); ``lifted=True`` on an index joining a leg to
    a copy of the node below: it is that copy's lifted output ``(1, y)`` of size ``d + 1``,
    whose coordinates ``1..d`` the copy's terms write (their output axis has size ``d``) and
    whose coordinate 0 is the constant 1; ``output=True`` on the output index, ``open`` when it
    stays open (a single network, or ``output="each"``). Several terms of one node (a residual
    ``x + f(x)`` is a linear and an attention or bilinear term) are separate term subgraphs
    that all touch that node's output index: there it is a *sum* of the terms, not a
    contraction.

    Sequence models (with [`BilinearAttention`][tensoralg.BilinearAttention], docs/mathematics.md
    §3.7): positions are index nodes too (``size = n_ctx``; attribute ``position``: the position
    variable's name, ``query``: whether it is the root's query position): ``i:t`` is the query
    position of the root; every attention term copy has its own key position ``i:<copy>.s``, summed
    against the mask core ``M[t, s]``. Every leg tensor (and every open leg) has ``position``: the
    variable it reads (``"t"`` or ``"<copy>.s"``), and is joined to that variable's index (the input
    copy it contracts with carries the position; the weight itself has a position axis only when
    ``positional``). A copy of a node read by a leg at ``s`` has that ``s`` as its query
    position. For a pair, ``a`` and ``b`` share the output index ``i:o`` and the query position
    ``i:t`` (both summed in the inner product). Position-free networks carry
    ``position=None``, have no position indices and keep the node names of earlier versions
    (``a.D2``, ``a.L1l``, ``leg:a.L1l``); tensors of sequence models are named
    ``<side>.n<node + 1><copy>.<name>`` (e.g. ``a.n1.Q1``, ``a.n1/k1.V``: node 0's ``V`` in
    the copy read by node 1's leg ``K1``).

    Args:
        a, b: networks (``b`` optional; same input and output sizes).
        output: None or ``"each"`` (every output), an int ``c`` or a direction vector ``u``:
            the output index then has size 1 (``u . f``).
        n_ctx: the sequence length (sequence models; optional when a mask array fixes it);
            given for position-free networks, they are shown applied per position.

    Raises:
        ValueError: ``b`` with other input or output sizes than ``a``; a bad ``output``;
            ``n_ctx`` missing for a sequence model whose masks fix no length, not a positive
            int, or different from a mask.
    """
    from .canonical import Node, canonicalize, sequence_tree
    from .layers import as_network
    from .prepare import output_matrix

    na = as_network(a, "a")
    nb = None if b is None else as_network(b, "b")
    if nb is not None:
        if nb.in_features != na.in_features:
            raise ValueError(f"b: input size {nb.in_features} differs from a's "
                             f"{na.in_features}")
        if nb.out_features != na.out_features:
            raise ValueError(f"b: output size {nb.out_features} differs from a's "
                             f"{na.out_features}")
    U, keep = output_matrix(output, na.out_features, False)
    n = sequence_n_ctx(na, nb, n_ctx)
    trees = []
    for name, net in (("a", na), ("b", nb)):
        if net is None:
            continue
        if n is None:
            t = canonicalize(net, keep_embed=False).tree()
        else:
            t = sequence_tree(net, n, name)
        if output is not None and not keep:
            last = t.nodes[-1]
            t.nodes[-1] = Node([term.project_output(U) for term in last.terms], last.d_in,
                               U.shape[0])
        trees.append((name, t))
    import networkx as nx  # only here: its import costs about a second on a loaded machine

    g = nx.Graph()
    build = _GraphBuilder(g, named=n is None)
    out = build.index("i:o", U.shape[0], output=True, open=nb is None or keep)
    if n is not None:
        build.index("i:t", n, position="t", query=True, open=nb is None)
    for name, t in trees:
        build.copy(t, len(t.nodes) - 1, name, "", out, None if n is None else "t")
    return g
