"""The exact attention path frees what it allocated when it returns: no reference cycles keep a
pair's chaos tensors, packed copies or cross grams alive until the garbage collector runs, so
the three inner products of one similarity do not stack their peaks (a long-context
similarity once took 17.6 GiB where each product was estimated at under 6)."""

import gc
import tracemalloc

import numpy as np

import tensoralg as ta
from tensoralg.strategies import sequence_exact as se


def _models():
    rng = np.random.default_rng(0)

    def g(*s):
        return rng.normal(size=s)

    def model(h):
        att = ta.BilinearAttention(g(h, 4, 8), g(h, 4, 8), g(h, 4, 8), g(h, 4, 8), g(h, 4, 8),
                                   g(8, h, 4))
        return ta.Sequential([ta.Linear(g(8, 5)), ta.Residual(att), ta.Linear(g(3, 8))])

    return model(2), model(1)


def test_exact_inner_leaves_no_reference_cycles():
    a, b = _models()
    se.exact_inner(a, b, n_ctx=6)      # caches (compiled paths, dry costs) filled
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        se.exact_inner(a, b, n_ctx=6)
        se.exact_inner(a, a, n_ctx=6)
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()


def test_similarity_peak_within_the_largest_products_estimate():
    a, b = _models()
    n = 40
    est = max(se.chaos_memory_bytes(x, y, n) for x, y in ((a, b), (a, a), (b, b)))
    ta.similarity(a, b, n_ctx=n)      # warm: paths compiled, estimates cached
    gc.collect()
    was = gc.isenabled()
    gc.disable()    # the collector must not be what frees a product's tensors
    tracemalloc.start()
    try:
        ta.similarity(a, b, n_ctx=n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        if was:
            gc.enable()
    # the estimate counts the stored chaos tensors and the largest working set of one sum;
    # numpy's own small allocations and the trees come on top (measured: 0.94-0.98 of the
    # estimate for one product at n_ctx 64-256)
    assert peak <= 1.1 * est, (peak, est)


def test_plan_states_what_a_similarity_costs():
    a, b = _models()
    n = 12
    p = ta.plan(a, b, n_ctx=n)
    costs = [se.chaos_cost_req(se.make_request(n_ctx=n), x, y) for x, y in ((a, b), (a, a),
                                                                             (b, b))]
    assert p.similarity_memory_bytes == max(c[0] for c in costs)
    assert p.similarity_flops == sum(c[1] for c in costs)
    assert "a similarity also computes <a, a> and <b, b>" in str(p)
    assert ta.plan(a, a, n_ctx=n).similarity_memory_bytes is None   # one model: <a, a> itself
