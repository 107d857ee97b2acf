"""Per-call fast paths of the engine (issue 8): the prepared-stack cache must never return a
stale answer, the power-of-two gauge is bit-identical to ``np.ldexp``, the depth-1 chaos kernel
equals the general chaos expansion, and the matrix-product closure equals the partial-matching
closure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from netgen import KINDS, brute_inner, rand_bilinear, rand_linear, rand_network

import tensoralg as ta
from tensoralg import prepare
from tensoralg.canonical import canonicalize, stack
from tensoralg.prepare import PREPARED, normalize, output_matrix, stack_for
from tensoralg.strategies import closure
from tensoralg.strategies.chaos import depth1 as chaos_depth1
from tensoralg.strategies.chaos import position_free as chaos


def _one_layer(rng, d=5, m=4, H=6, out=3):
    return ta.Sequential([rand_linear(rng, d, m), rand_bilinear(rng, m, H, m),
                          rand_linear(rng, m, out)])


def _rel(x, y):
    return abs(float(x) - float(y)) / max(abs(float(y)), 1e-300)


# ------------------------------------------------------------------ prepared-stack cache

def test_cache_hit_returns_the_same_read_only_stack():
    """Admitted on the second use (the first only notes the network), a hit from the third."""
    PREPARED.clear()
    a = _one_layer(np.random.default_rng(0))
    s0, _ = stack_for([a], "numpy", "a")
    assert len(PREPARED) == 0 and s0.stages[0].L.flags.writeable  # first use: not kept
    s1, k1 = stack_for([a], "numpy", "a")
    assert len(PREPARED) == 1
    s2, k2 = stack_for([a], "numpy", "a")
    assert s2 is s1 and k2 is k1
    assert all(not x.flags.writeable for x in s1.arrays())
    with pytest.raises(ValueError):
        s1.stages[0].L[0, 0, 0] = 1.0
    for x, y in zip(s0.arrays(), s1.arrays()):  # the uncached stack is the same one
        assert np.array_equal(x, y)


def test_networks_used_once_are_not_copied_nor_kept(monkeypatch):
    """A stream of new networks (each used once) leaves the cache empty and does not evict a
    network that is used again; the list of networks seen once is bounded."""
    PREPARED.clear()
    monkeypatch.setattr(PREPARED, "max_seen", 8)
    rng = np.random.default_rng(11)
    keep = _one_layer(rng)
    stack_for([keep], "numpy", "k"), stack_for([keep], "numpy", "k")
    stream = [_one_layer(rng) for _ in range(PREPARED.max_entries + 5)]  # alive: distinct ids
    for net in stream:
        stack_for([net], "numpy", "a")
    assert len(PREPARED) == 1
    hits = PREPARED.hits
    stack_for([keep], "numpy", "k")
    assert PREPARED.hits == hits + 1
    assert len(PREPARED._seen) == 8


@pytest.mark.parametrize("where", ["left", "down", "head_bias", "embed"])
def test_in_place_weight_change_is_never_served_from_the_cache(where):
    """Warm the cache (and the chaos memo), change one weight in place, and compare with the
    independent rational expansion of verify (brute force)."""
    rng = np.random.default_rng(1)
    a, b = _one_layer(rng), _one_layer(rng)
    before = ta.similarity(a, b)
    ta.inner(a, b), ta.inner(a, b, method="closure")  # every path warm
    layer = {"left": a.layers[1].left, "down": a.layers[1].down, "head_bias": a.layers[2].bias,
             "embed": a.layers[0].weight}[where]
    layer[(0,) * layer.ndim] += 0.5
    want = float(brute_inner(a, b))
    for method in ("exact", "closure"):  # closure is exact at depth 1
        got = ta.inner(a, b, method=method)
        assert _rel(got, want) < 1e-10, (method, got, want)
    assert ta.similarity(a, b) != before


def test_tiny_in_place_change_below_float_sums_is_still_seen():
    """A change far below the rounding of any float checksum: the cache compares every weight."""
    rng = np.random.default_rng(2)
    a, b = _one_layer(rng), _one_layer(rng)
    x = ta.inner(a, b)
    ta.inner(a, b)  # second use: both cached
    w = a.layers[1].right
    old = w[2, 1]
    w[2, 1] = np.nextafter(old, np.inf)
    hit_before = PREPARED.hits
    ta.inner(a, b)
    assert PREPARED.hits == hit_before + 1  # b hit, a missed
    w[2, 1] = old
    assert ta.inner(a, b) == x


def test_replaced_array_and_changed_structure_are_misses():
    rng = np.random.default_rng(3)
    a, b = _one_layer(rng), _one_layer(rng)
    ta.inner(a, b)
    a.layers[1].left = a.layers[1].left * 2.0  # attribute replaced (same shape)
    assert _rel(ta.inner(a, b), float(brute_inner(a, b))) < 1e-10
    a.layers[1].left_bias = None  # a bias removed: the structure changed
    assert _rel(ta.inner(a, b), float(brute_inner(a, b))) < 1e-10
    a.layers.insert(2, ta.Linear(np.eye(4) * 3.0))  # a layer added in place
    assert _rel(ta.inner(a, b), float(brute_inner(a, b))) < 1e-10


def test_new_model_with_the_same_shapes_gets_its_own_answer():
    """Objects that die free their entries; a new model at a reused address is not confused
    with the old one (the entry holds the network weakly and compares weights)."""
    rng = np.random.default_rng(4)
    b = _one_layer(rng)
    for _ in range(6):
        a = _one_layer(rng)
        assert _rel(ta.inner(a, b), float(brute_inner(a, b))) < 1e-10
        del a


def test_cache_is_bounded_and_clearable():
    PREPARED.clear()
    rng = np.random.default_rng(5)
    nets = [_one_layer(rng) for _ in range(PREPARED.max_entries + 5)]
    for n in nets:
        stack_for([n], "numpy", "a"), stack_for([n], "numpy", "a")  # admitted on second use
    assert len(PREPARED) == PREPARED.max_entries
    PREPARED.clear()
    assert len(PREPARED) == 0


def test_exact_and_torch_backends_and_stacks_are_not_cached():
    PREPARED.clear()
    a = _one_layer(np.random.default_rng(6))
    for _ in range(2):
        stack_for([a], "exact", "a")
        stack_for([a, a], "numpy", "a")
    assert len(PREPARED) == 0


# ------------------------------------------------------------------ gauge

def test_power_of_two_multiply_is_bit_identical_to_ldexp():
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.uniform(-300, 300, 500),
                        [5e-324, -2.2e-308, 1.7e308, 0.0, -0.0]])
    for e in [0, 1, -1, 52, -52, 600, -600, 1000, -1000, 1001, -1022, -1074, 1023, 2000, -2100]:
        ee = np.full(x.shape, e, dtype=np.int32)
        with np.errstate(over="ignore", under="ignore"):
            assert prepare._times_pow2(x, ee).tobytes() == np.ldexp(x, ee).tobytes(), e
    ee = rng.integers(-1100, 1100, x.shape).astype(np.int32)  # mixed: falls back to ldexp
    with np.errstate(over="ignore", under="ignore"):
        assert prepare._times_pow2(x, ee).tobytes() == np.ldexp(x, ee).tobytes()


@pytest.mark.parametrize("kind", KINDS)
def test_normalized_stack_is_the_same_function(kind):
    """f = 2**k f_normalized, checked by the rational expansion of the de-normalized values."""
    rng = np.random.default_rng(8)
    nets = [rand_network(rng, kind, d=3, out=2, log_scale=(-60, 60)) for _ in range(2)]
    can = stack([canonicalize(n) for n in nets])
    norm, k = normalize(can)
    U, _ = output_matrix(None, 2, False)
    for i in range(2):
        for j in range(2):
            want = float(brute_inner(nets[i], nets[j]))
            got = chaos.cross(norm.sub([i]), norm.sub([j]), U, False)[0, 0]
            assert _rel(np.ldexp(got, int(k[i]) + int(k[j])), want) < 1e-9


# ------------------------------------------------------------------ depth-1 chaos kernel

@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(
    ["bilinear", "bilinear_nobias", "embed_bilinear_head", "residual"]),
    n=st.integers(1, 3), output=st.sampled_from([None, 1, "each", "dir"]))
def test_depth1_kernel_equals_the_general_expansion(seed, kind, n, output):
    rng = np.random.default_rng(seed)
    nets = [rand_network(rng, kind, d=4, out=3, hidden=3, width=3) for _ in range(n)]
    out = np.array([0.5, -1.0, 2.0]) if output == "dir" else output
    U, _ = output_matrix(out, 3, False)
    can, _ = stack_for(nets, "numpy", "m")
    (can,), r = chaos.whiten([can], False)
    assert chaos_depth1.applies(can)
    fast = chaos_depth1.features(can, U)
    slow = chaos.packed_features(can, U, r)
    # the same sums over H <= 4 hidden units in another order: rounding of a few ulps of the
    # largest coefficient, so 1e-12 of it is a ~1e4-ulp margin that a wrong term still breaks
    for f, s in zip(fast, slow):
        assert np.allclose(f, s, rtol=1e-12, atol=1e-12 * np.abs(s).max())


@pytest.mark.parametrize("work", [1, 200])
def test_depth1_kernel_in_chunks_of_outputs_equals_one_chunk(work, monkeypatch):
    """A small work vector: one output per chunk (``work=1``, a vector of the one-output size,
    not kept) or a few outputs per chunk; the same coefficients as all outputs at once."""
    rng = np.random.default_rng(12)
    nets = [rand_network(rng, "embed_bilinear_head", d=4, out=5, hidden=6, width=4)
            for _ in range(2)]
    U, _ = output_matrix(None, 5, False)
    can, _ = stack_for(nets, "numpy", "m")
    (can,), _ = chaos.whiten([can], False)
    whole = chaos_depth1.features(can, U)
    monkeypatch.setattr(chaos_depth1, "WORK_ELEMENTS", work)
    monkeypatch.setattr(chaos_depth1, "_local", __import__("threading").local())
    parts = chaos_depth1.features(can, U)
    # the same products; BLAS may order a sum of H = 6 terms differently for another matrix
    # shape, which moves it by a few ulps of its largest term: 64 ulps of the largest entry
    for x, y in zip(whole, parts):
        assert np.allclose(x, y, rtol=0, atol=64 * np.finfo(float).eps * np.abs(x).max())
    assert getattr(chaos_depth1._local, "buf", None) is None or \
        chaos_depth1._local.buf.size <= work


def test_depth1_similarity_matches_brute_force_and_wick():
    rng = np.random.default_rng(9)
    # wide enough that the planner takes chaos (at d=5, H=6 Wick's estimate is smaller)
    a, b = _one_layer(rng, d=8, m=8, H=16, out=4), _one_layer(rng, d=8, m=8, H=16, out=4)
    want = float(brute_inner(a, b)) / np.sqrt(float(brute_inner(a, a)) * float(brute_inner(b, b)))
    assert ta.plan(a, b).strategy == "chaos"
    for strategy in ("auto", "chaos", "wick"):
        assert abs(ta.similarity(a, b, strategy=strategy) - want) < 1e-12


def test_chaos_choice_searches_no_wick_path(monkeypatch):
    """The planner's shortcut: an affordable chaos expansion is taken without building the Wick
    network or searching its contraction paths."""
    from tensoralg.strategies import wick

    def boom(*args, **kw):
        raise AssertionError("Wick network built")

    monkeypatch.setattr(wick, "build", boom)
    rng = np.random.default_rng(10)
    a, b = _one_layer(rng, d=8, m=8, H=16, out=4), _one_layer(rng, d=8, m=8, H=16, out=4)
    assert np.isfinite(ta.similarity(a, b))
    assert ta.gram([a, b]).shape == (2, 2)


# ------------------------------------------------------------------ closure as matrix products

@pytest.mark.parametrize("kind", ["bilinear", "residual", "depth2", "depth2_residual_embed_head",
                                  "embed_bilinear_head"])
@pytest.mark.parametrize("output", [None, "each"])
def test_matrix_product_closure_equals_the_partial_matching_sum(kind, output):
    """The bilinear step written as Grams and column-scaled output maps equals the step summed
    over the partial matchings of the four forms (:func:`closure._cross_step`), models
    stacked on both sides."""
    rng = np.random.default_rng(11)
    na = [rand_network(rng, kind, d=4, out=3, hidden=3, width=3) for _ in range(2)]
    nb = [rand_network(rng, kind, d=4, out=3, hidden=3, width=3) for _ in range(3)]
    U, keep = output_matrix(output, 3, False)
    ca, _ = stack_for(na, "numpy", "a")
    cb, _ = stack_for(nb, "numpy", "b")
    fast = closure.triple(ca, cb, U, keep, "numpy")
    slow = closure.triple(ca, cb, U, keep, "numpy", _general=True)
    # the same products summed in another grouping (batched matrix products against one
    # contraction per matching): a few ulps of the largest entry; 1e-13 of it leaves a ~500-ulp
    # margin that a missing or doubled matching still breaks
    for f, s in zip(fast, slow):
        assert np.allclose(f, s, rtol=1e-12, atol=1e-13 * np.abs(s).max())


def test_closure_exact_backend_uses_the_same_steps_in_rationals():
    rng = np.random.default_rng(12)
    a = rand_network(rng, "depth2", d=3, out=2, hidden=2, width=2)
    b = rand_network(rng, "depth2", d=3, out=2, hidden=2, width=2)
    got = ta.inner(a, b, method="closure", backend="exact")
    ca, _ = stack_for([a], "exact", "a")
    cb, _ = stack_for([b], "exact", "b")
    U, keep = output_matrix(None, 2, True)
    want = closure.triple(ca, cb, U, keep, "exact", _general=True)[1][0, 0]
    assert got == want
    assert abs(float(got) - ta.inner(a, b, method="closure")) <= 1e-10 * abs(float(got))
