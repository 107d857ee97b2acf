"""The closure's two kernels compute one quantity (docs/mathematics.md §3.2, §3.7).

Position-free networks run the packed moment propagation (``closure.triple`` over the stages
of :class:`~tensoralg.canonical.Canonical`: batched matrix products, rationals); sequence
models run the chaos-form propagation over (position, feature) moments (``_ClosureModel``,
read from :func:`~tensoralg.canonical.sequence_tree`). A position-free network is a sequence
model at ``n_ctx = 1``, so the second kernel, run on it, must give the first one's value: the
two are written independently (moment arrays and their Isserlis products against partial
matchings of forms in chaos form), so agreement checks both. Measured agreement: 1e-15
relative; the bound 1e-12 is float64 rounding of sums reordered over terms of both signs.
"""

import numpy as np
import pytest
from netgen import rand_network

import tensoralg as ta
from tensoralg.strategies import closure as C

KINDS = ["linear", "bilinear", "bilinear_nobias", "embed_bilinear_head", "residual", "depth2",
         "depth2_residual_embed_head"]


def _sequence_kernel(a, b, each: bool):
    """``(<a,a>, <a,b>, <b,b>)`` of the chaos-form kernel at one position."""
    depth = max(C._n_stages(a, 1, "a"), C._n_stages(b, 1, "b"))
    ma, mb = C._ClosureModel(a, 1, "a", depth), C._ClosureModel(b, 1, "b", depth)
    U, sel = np.eye(a.out_features), np.ones(1)
    return tuple(np.asarray(C._closure_pair_value(x, y, U, each, sel, False))
                 for x, y in ((ma, ma), (ma, mb), (mb, mb)))


def _rel(x, y):
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return np.max(np.abs(x - y)) / np.max(np.abs(y))


@pytest.mark.parametrize("kind_b", KINDS)
@pytest.mark.parametrize("kind_a", ["bilinear", "depth2", "depth2_residual_embed_head"])
def test_sequence_kernel_at_one_position_equals_the_packed_kernel(kind_a, kind_b):
    rng = np.random.default_rng([KINDS.index(kind_a), KINDS.index(kind_b)])
    a, b = rand_network(rng, kind_a), rand_network(rng, kind_b)
    for output, each in ((None, False), ("each", True)):
        want = (ta.inner(a, a, method="closure", output=output),
                ta.inner(a, b, method="closure", output=output),
                ta.inner(b, b, method="closure", output=output))
        got = _sequence_kernel(a, b, each)
        for g, w in zip(got, want):
            assert _rel(g, w) <= 1e-12, (kind_a, kind_b, output, g, w)


def test_three_bilinear_layers():
    """Depth 3 (where the closure is furthest from the exact value) agrees too."""
    rng = np.random.default_rng(3)
    g = lambda *s: rng.normal(size=s) / np.sqrt(s[-1])  # noqa: E731
    deep = lambda: ta.Sequential([ta.Bilinear(g(4, 3), g(4, 3), g(3, 4)),  # noqa: E731
                                  ta.Residual(ta.Bilinear(g(4, 3), g(4, 3), g(3, 4))),
                                  ta.Bilinear(g(4, 3), g(4, 3), g(2, 4))])
    a, b = deep(), deep()
    got = _sequence_kernel(a, b, False)
    want = [ta.inner(x, y, method="closure") for x, y in ((a, a), (a, b), (b, b))]
    for gv, w in zip(got, want):
        assert _rel(gv, w) <= 1e-12
    # and it is the closure, not the exact value (which differs at depth 3)
    assert _rel(want[1], ta.inner(a, b)) > 1e-6
