"""The tensor-network graph, the plan (cost summary), symmetry reduction and the path cache."""

from __future__ import annotations

import json
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest
from netgen import brute_inner, rand_bilinear, rand_network

import tensoralg as ta
from tensoralg.strategies.wick import joined as network
from tensoralg.strategies.wick.matchings import (
    group_closure,
    orbits,
    partial_matchings,
    parts,
    telephone,
)


def test_telephone_numbers_match_enumeration():
    for n in range(9):
        assert telephone(n) == sum(1 for _ in partial_matchings(n))
    assert [telephone(n) for n in (4, 8, 16)] == [10, 764, 46206736]


def test_pruned_matchings_are_the_full_enumeration_filtered_in_order():
    """``can_cap``, ``can_pair`` and ``pairable`` (the zero patterns of the Wick sums and the
    closure) drop exactly the matchings that use a forbidden single or pair, and keep the
    order of the full enumeration (the order the sums are added in)."""
    rng = np.random.default_rng(0)
    for n in range(7):
        for _ in range(5):
            cap = rng.random(n) < 0.7
            pair = rng.random(n) < 0.8
            ok = rng.random((n, n)) < 0.7
            ok = ok & ok.T
            want = [m for m in partial_matchings(n)
                    if all(cap[i] for i in m[1])
                    and all(pair[i] and pair[j] and ok[i][j] for i, j in m[0])]
            assert list(partial_matchings(n, cap, pair, ok)) == want
    # parts: the pairs and singles by first leg
    assert parts((((0, 3), (1, 2)), (4,))) == ((0, 3), (1, 2), (4,))
    assert parts((((1, 4),), (0, 2, 3))) == ((0,), (1, 4), (2,), (3,))


def test_orbit_sizes_sum_to_the_configurations():
    ms = list(partial_matchings(4))
    group = group_closure([[1, 0, 2, 3], [2, 3, 0, 1]], 4)
    reps = orbits(ms, group)
    assert sum(w for _, w in reps) == len(ms)
    assert len(reps) < len(ms)


def test_graph_has_hyperedges_and_legs():
    rng = np.random.default_rng(0)
    net = ta.Sequential([rand_bilinear(rng, 3, 4, 3), rand_bilinear(rng, 3, 2, 2)])
    g = ta.to_graph(net)
    assert isinstance(g, nx.Graph)
    tensors = [n for n, d in g.nodes(data=True) if d["kind"] == "tensor"]
    legs = [n for n, d in g.nodes(data=True) if d.get("leg")]
    assert len(legs) == 4  # depth 2: 2**2 copies of x~
    # the hidden index of every first-stage copy is a hyperedge (D, L, R)
    hyper = [n for n, d in g.nodes(data=True) if d["kind"] == "index" and g.degree(n) == 3]
    assert len(hyper) >= 3
    assert nx.is_bipartite(g) and nx.is_connected(g)
    joined = ta.to_graph(net, net)
    out = [n for n, d in joined.nodes(data=True) if d.get("output")]
    assert len(out) == 1 and joined.degree(out[0]) == 2 and not joined.nodes[out[0]]["open"]
    assert len(tensors) > 0


def test_plan_counts_and_symmetry_is_checked_not_assumed():
    rng = np.random.default_rng(1)
    f = rand_bilinear(rng, 3, 4, 2)
    sym = ta.Bilinear(f.left, f.left, f.down, f.left_bias, f.left_bias, f.down_bias)
    p = ta.plan(f, sym)
    assert p.n_configurations == 10 and p.group_order == 2  # only b's L == R swap
    assert ta.plan(sym).group_order == 8  # two swaps and a <-> b
    # x1 * x2: swapping L and R keeps the FUNCTION but not the tensor network: not used
    prod = ta.Bilinear([[1.0, 0.0]], [[0.0, 1.0]], [[1.0]])
    assert ta.plan(prod, ta.Bilinear([[1.0, 1.0]], [[1.0, -1.0]], [[1.0]])).group_order == 1
    assert ta.plan(prod).group_order == 2  # a <-> b only
    # zero patterns: no biases -> legs cannot be capped
    nob = rand_bilinear(rng, 3, 4, 2, biases=False)
    assert ta.plan(nob, nob).n_nonzero == 3  # perfect matchings of 4 legs
    assert "FLOPs" in p.summary()


def test_symmetry_reduced_sum_equals_unreduced():
    rng = np.random.default_rng(2)
    l1 = rand_bilinear(rng, 2, 3, 3)
    l1 = ta.Bilinear(l1.left, l1.left, l1.down, l1.left_bias, l1.left_bias, l1.down_bias)
    l2 = rand_bilinear(rng, 3, 2, 2)
    l2 = ta.Bilinear(l2.left, l2.left, l2.down, l2.left_bias, l2.left_bias, l2.down_bias)
    net = ta.Sequential([l1, l2])
    p = ta.plan(net)
    assert p.group_order == 128 and p.n_orbits < p.n_nonzero
    assert ta.inner(net, net, backend="exact") == brute_inner(net, net)


def test_path_cache_on_disk_is_reused_across_processes(tmp_path):
    code = (
        "import numpy as np, tensoralg as ta, json\n"
        "rng = np.random.default_rng(0)\n"
        "a = ta.Sequential([ta.Bilinear(*rng.standard_normal((2, 2, 3)), rng.standard_normal((2, 2))),"
        " ta.Bilinear(*rng.standard_normal((2, 1, 2)), rng.standard_normal((1, 1)))])\n"
        "from tensoralg.strategies.wick import joined as network\n"
        "calls = []\n"
        "orig = network.oe.contract_path\n"
        "def spy(*a, **k):\n"
        "    calls.append(k.get('shapes', False)); return orig(*a, **k)\n"
        "network.oe.contract_path = spy\n"
        "v = ta.inner(a, a, strategy='wick')\n"
        "print(json.dumps([v, sum(calls)]))\n")
    env = {"TENSORALG_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first = json.loads(subprocess.check_output([sys.executable, "-c", code], env=env))
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    second = json.loads(subprocess.check_output([sys.executable, "-c", code], env=env))
    assert first[1] > 0 and second[1] == 0  # no path search the second time
    assert first[0] == second[0]
    # a corrupt cache file is recomputed, not trusted
    files[0].write_text("{not json")
    third = json.loads(subprocess.check_output([sys.executable, "-c", code], env=env))
    assert third[0] == first[0] and third[1] == first[1]


def test_same_path_runs_on_every_backend():
    rng = np.random.default_rng(3)
    a = rand_network(rng, "embed_bilinear_head")
    b = rand_network(rng, "embed_bilinear_head")
    vals = [ta.inner(a, b), float(ta.inner(a, b, backend="exact"))]
    pytest.importorskip("torch")
    vals.append(ta.inner(a, b, backend="torch", device="cpu"))
    assert max(vals) - min(vals) <= 1e-12 * abs(vals[1]) + 1e-300


def test_single_bilinear_pair_goes_through_gram_matrices():
    """One bilinear layer pair: the chosen paths contract factor Gram matrices, O(H_a H_b d),
    and never build the (O, d+1, d+1) coefficient tensor."""
    rng = np.random.default_rng(4)
    d, Ha, Hb, O = 64, 256, 200, 10
    a = rand_bilinear(rng, d, Ha, O)
    b = rand_bilinear(rng, d, Hb, O)
    p = ta.plan(a, b)
    # 10 configurations, each a few Gram-sized products: O(H_a H_b d)
    assert p.n_orbits == 10
    assert p.flops <= 10 * 4 * (Ha + 1) * (Hb + 1) * (d + 1)
    # no intermediate of any chosen path carries two input legs (the d^2-sized tensor T)
    import opt_einsum as oe
    for expr in p.expressions:
        ins, _ = expr.split("->")
        legs = {c for c in set(ins) if c not in "abcde"}  # labels a..e: outputs, batches, hidden
        shapes = []
        for sub in ins.split(","):
            shapes.append(tuple({"a": O, "b": 1, "c": Ha + 1, "d": 1, "e": Hb + 1}.get(ch, d) for ch in sub))
        _, info = oe.contract_path(expr, *shapes, shapes=True)
        for step in info.contraction_list:
            out_sub = step[2].split("->")[1]
            assert len(legs & set(out_sub)) <= 1, (expr, step[2])


@pytest.mark.parametrize("tamper", ["drop_last_path", "reverse_paths", "list_file", "nan_flops",
                                    "bad_index", "truncate_step"])
def test_damaged_path_cache_is_never_trusted(tmp_path, monkeypatch, tamper):
    monkeypatch.setenv("TENSORALG_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(6)
    a = rand_network(rng, "depth2", d=2)
    b = rand_network(rng, "depth2", d=2)
    network._PATH_CACHE.clear()
    want = ta.inner(a, b, strategy="wick")  # the path cache belongs to the Wick strategy
    (f,) = tmp_path.glob("*.json")
    data = json.loads(f.read_text())
    if tamper == "drop_last_path":
        data["paths"] = data["paths"][:-1]
    elif tamper == "reverse_paths":
        data["paths"] = [list(reversed(p)) for p in data["paths"]]
    elif tamper == "list_file":
        data = [1, 2]
    elif tamper == "nan_flops":
        data["flops"][0] = float("nan")
    elif tamper == "bad_index":
        data["paths"][0][0] = [99, 100]
    elif tamper == "truncate_step":
        data["paths"][3] = data["paths"][3][:-1]
    f.write_text(json.dumps(data))
    network._PATH_CACHE.clear()
    assert ta.inner(a, b, strategy="wick") == want
    # the damaged entry was overwritten by a sound one, which is then used without a search
    network._PATH_CACHE.clear()
    searches = []
    orig = network.oe.contract_path
    monkeypatch.setattr(network.oe, "contract_path",
                        lambda *x, **k: searches.append(k.get("shapes")) or orig(*x, **k))
    assert ta.inner(a, b, strategy="wick") == want
    assert not any(searches)


# ---- the graph view of sequence models (the canonical tree, docs/mathematics.md §3.7 / §4) -------------

def _attn(rng, residual=False, **kw):
    from test_attention_exact import attn

    return attn(rng, H=2, dh=2, d=3, dv=2, residual=residual, **kw)


def _open_legs(g):
    return {n: d for n, d in g.nodes(data=True) if d.get("leg")}


def _tensor_of(g, leg):
    (t,) = [n for n in g[leg] if g.nodes[n]["kind"] == "tensor"]
    return g.nodes[t]


def test_graph_of_one_attention_layer_has_five_legs_two_at_t_three_at_s():
    from tensoralg import canonical

    rng = np.random.default_rng(10)
    mask = np.tril(np.ones((3, 3)))  # an array: fixes n_ctx = 3
    layer = _attn(rng, mask=mask)
    g = ta.to_graph(layer)
    tree = canonical.tree(layer)
    assert nx.is_bipartite(g) and nx.is_connected(g)
    legs = _open_legs(g)
    # one open leg per leg of every term of the (single) node: Term.degree
    for j, term in enumerate(tree.nodes[0].terms):
        mine = [n for n in legs if _tensor_of(g, n)["term"] == j]
        assert len(mine) == term.degree
    att = [n for n in legs if _tensor_of(g, n)["term_kind"] == "attention"]
    assert len(att) == 5 == tree.degree
    at_t = [n for n in att if legs[n]["position"] == "t"]
    at_s = [n for n in att if legs[n]["position"] != "t"]
    assert len(at_t) == 2 and len(at_s) == 3
    assert sorted(_tensor_of(g, n)["name"] for n in at_t) == ["Q1", "Q2"]
    assert sorted(_tensor_of(g, n)["name"] for n in at_s) == ["K1", "K2", "V"]
    (s_var,) = {legs[n]["position"] for n in at_s}
    s_index = g.nodes[f"i:{s_var}"]
    assert s_index["size"] == 3 and not s_index["query"] and g.nodes["i:t"]["query"]
    # the mask core M[t, s] joins the query and the key position
    (M,) = [n for n, d in g.nodes(data=True) if d.get("name") == "M"]
    assert set(g[M]) == {"i:t", f"i:{s_var}"} and g.nodes[M]["shape"] == (3, 3)
    # the head index is a hyperedge of the output core and the five legs
    (O,) = [n for n, d in g.nodes(data=True) if d.get("name") == "O"]
    heads = [i for i in g[O] if g.nodes[i]["size"] == 2 and g.degree(i) == 6]
    assert len(heads) == 1


def test_graph_of_residual_attention_is_a_sum_of_two_terms():
    rng = np.random.default_rng(11)
    net = ta.Sequential([_attn(rng, residual=True, mask="causal"),
                         ta.Linear(rng.normal(size=(2, 3)))])
    g = ta.to_graph(net, n_ctx=4)
    root = [d for _, d in g.nodes(data=True) if d["kind"] == "tensor" and d["copy"] == ""]
    assert {(d["term"], d["term_kind"]) for d in root} == {(0, "linear"), (1, "attention")}
    # both terms write the (open) output index: their sum is the node's output
    assert {g.nodes[n]["term"] for n in g["i:o"]} == {0, 1}
    assert g.nodes["i:o"]["open"] and g.nodes["i:o"]["size"] == 2
    assert g.nodes["i:t"]["size"] == 4
    assert len(_open_legs(g)) == 1 + 5
    # a slice of the output: the output index has size 1
    assert ta.to_graph(net, n_ctx=4, output=1).nodes["i:o"]["size"] == 1


def test_joined_pair_of_sequence_models_shares_output_and_query_position():
    rng = np.random.default_rng(12)
    a = _attn(rng, residual=True, mask="causal")
    b = _attn(rng, mask="none", rope=100.0)
    g = ta.to_graph(a, b, n_ctx=3)
    assert nx.is_bipartite(g) and nx.is_connected(g)
    outs = [n for n, d in g.nodes(data=True) if d.get("output")]
    queries = [n for n, d in g.nodes(data=True) if d.get("query")]
    assert outs == ["i:o"] and queries == ["i:t"]
    for i in ("i:o", "i:t"):
        assert {g.nodes[n]["side"] for n in g[i]} == {"a", "b"}
        assert not g.nodes[i]["open"]
    keys = [n for n, d in g.nodes(data=True) if d.get("query") is False]
    assert len(keys) == 2  # one key position per attention term copy, one per side
    assert ta.to_graph(a, b, n_ctx=3, output="each").nodes["i:o"]["open"]
    # RoPE: b's query/key legs carry a position axis
    (q,) = [d for _, d in g.nodes(data=True) if d.get("side") == "b" and d.get("name") == "Q1"]
    assert q["positional"] and q["shape"][0] == 3


def test_graph_of_two_attention_layers_unrolls_the_tree():
    rng = np.random.default_rng(13)
    net = ta.Sequential([_attn(rng, residual=True, mask="causal"),
                         _attn(rng, residual=True, mask="causal")])
    from tensoralg import canonical

    tree = canonical.tree(net, n_ctx=2)
    legs_per_node = [sum(t.degree for t in node.terms) for node in tree.nodes]
    g = ta.to_graph(net, n_ctx=2)
    assert nx.is_bipartite(g) and nx.is_connected(g)
    # every leg of node 1 reads its own copy of node 0 (all of its terms)
    assert len(_open_legs(g)) == legs_per_node[0] * legs_per_node[1] == 6 * 6
    lifted = [n for n, d in g.nodes(data=True) if d.get("lifted")]
    assert len(lifted) == legs_per_node[1]
    assert all(g.nodes[n]["size"] == 3 + 1 for n in lifted)
    # the copy read by node 1's key leg K1 has node 1's key position as its query position
    (s1,) = [n for n, d in g.nodes(data=True) if d.get("query") is False and d["position"]
             == "a.n2.s"]
    assert set(g["a.n1/k1.M"]) == {s1, "i:a.n1/k1.s"}
    assert {g.nodes[n]["position"] for n in g["a.n1/k1.Q1"] if n.startswith("leg:")} == \
        {"a.n2.s"}
    assert set(g["a.n1/q1.M"]) == {"i:t", "i:a.n1/q1.s"}


def test_graph_errors_name_the_argument():
    rng = np.random.default_rng(14)
    causal = _attn(rng, mask="causal")
    with pytest.raises(ValueError, match="n_ctx: required"):
        ta.to_graph(causal)
    with pytest.raises(ValueError, match="n_ctx: expected a positive int"):
        ta.to_graph(causal, n_ctx=0)
    fixed = _attn(rng, mask=np.ones((3, 3)))
    with pytest.raises(ValueError, match="n_ctx=2 differs from a's attention mask"):
        ta.to_graph(fixed, n_ctx=2)
    with pytest.raises(ValueError, match="attention masks fix different sequence lengths"):
        ta.to_graph(fixed, _attn(rng, mask=np.ones((4, 4))))
    with pytest.raises(ValueError, match="b: input size 2 differs from a's 3"):
        ta.to_graph(causal, ta.Linear(np.ones((3, 2))), n_ctx=2)
    with pytest.raises(ValueError, match="output: class index 5 out of range"):
        ta.to_graph(causal, n_ctx=2, output=5)
    # the mask of one side fixes n_ctx for both
    assert ta.to_graph(fixed, causal).nodes["i:t"]["size"] == 3


def test_position_free_graph_keeps_its_names_and_has_no_positions():
    from netgen import to_fractions

    rng = np.random.default_rng(15)
    net = ta.Sequential([rand_bilinear(rng, 3, 4, 3), rand_bilinear(rng, 3, 2, 2)])
    for model in (net, to_fractions(net)):
        g = ta.to_graph(model)
        assert {"a.D2", "a.L2", "a.R2", "a.D1l", "a.L1r", "leg:a.L1l", "leg:a.R1r"} <= set(g)
        assert all(d.get("position") is None for _, d in g.nodes(data=True))
        # D without its constant row (the lifted index it writes has one more coordinate)
        assert g.nodes["a.D1l"]["shape"] == (3, 5)
        (x,) = [n for n in g["a.D1l"] if g.nodes[n].get("lifted")]
        assert g.nodes[x]["size"] == 3 + 1 and set(g[x]) == {"a.D1l", "a.L2"}
    g = ta.to_graph(ta.Linear(np.ones((2, 3))))
    assert set(g) == {"a.W", "leg:a.W", "i:o"}
