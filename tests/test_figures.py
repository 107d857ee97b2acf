"""Figures: the legend never covers the bars, every axis is labelled, the backdoor figure shows
the global similarity (issue 12 item 8)."""

import itertools
from pathlib import Path

import numpy as np
import pytest

from tensoralg.audit import plotting


@pytest.fixture
def captured(monkeypatch):
    figs = []

    def keep(fig, path):
        figs.append(fig)
        return Path(path)
    monkeypatch.setattr(plotting, "save_figure", keep)
    return figs


def test_slice_bars_legend_outside_and_global_line(captured):
    plotting.slice_bars(Path("x.png"), list(np.linspace(0.9, 1.0, 10)), 9,
                        {"cka_logits": 0.97, "output_cosine": 0.95}, "t",
                        control=[0.99] * 10, global_similarity=0.93)
    fig = captured[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert any("global tensor similarity = 0.930" in t for t in texts)
    renderer = fig.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    assert ax.get_xlabel() and ax.get_ylabel()


def test_every_axis_is_labelled(captured):
    steps = [0, 1, 10, 100]
    plotting.grokking_figure(Path("g.png"), steps, [0.1, 0.5, 1, 1], [0.1, 0.1, 0.3, 1],
                             np.eye(4), [0.2, 0.3, 0.5, 1], "exact")
    plotting.heatmaps(Path("h.png"), {"m": np.eye(3)}, ["a", "b", "c"], "t")
    plotting.class_heatmap(Path("c.png"), np.eye(3), ["s0", "s1", "s2"], "t")
    for fig in captured:
        for ax in fig.axes:
            if ax.get_label() == "<colorbar>":
                assert ax.get_ylabel() or ax.get_xlabel()
                continue
            assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_backdoor_legend_names_the_target_bar(captured):
    # the red target bar had no legend entry (only the blue "class slice" one)
    plotting.slice_bars(Path("x.png"), list(np.linspace(0.9, 1.0, 10)), 3, {"cka": 0.97}, "t",
                        control=[0.99] * 10, global_similarity=0.93)
    legend = captured[0].axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert "tensor similarity, target class 3" in texts
    handle = legend.legend_handles[texts.index("tensor similarity, target class 3")]
    assert tuple(handle.get_facecolor()[:3]) == pytest.approx((0.839, 0.153, 0.157), abs=1e-2)


def test_heatmaps_readable_ticks_and_titles_clear_of_each_other(captured):
    # matrix.png had 6 pt tick labels; language_matrices.png's subplot titles (and each
    # panel's y label) ran into the neighbouring panel
    rng = np.random.default_rng(0)
    mats = {name: rng.uniform(0.3, 1, (8, 8)) for name in
            ("tensor similarity (Monte Carlo)", "output cosine", "linear CKA (final residual)",
             "weight cosine", "moment-closure (approximate): not the tensor similarity")}
    plotting.heatmaps(Path("x.png"), mats, [str(s) for s in range(8)], "t", axis_label="step")
    fig = captured[0]
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 5
    for ax in panels:
        assert min(t.get_fontsize() for t in ax.get_xticklabels() + ax.get_yticklabels()) >= 8
    for left, right in itertools.pairwise(panels):
        assert not _boxes_overlap(left.title.get_window_extent(r), right.title.get_window_extent(r))
        assert not _boxes_overlap(left.get_window_extent(r),
                                  right.yaxis.label.get_window_extent(r))
        assert not _boxes_overlap(left.get_window_extent(r),
                                  right.get_yaxis().get_tightbbox(r))


def test_eigenvector_colour_bar_is_labelled_and_shared(monkeypatch, tmp_path):
    import tensoralg as ta
    from tensoralg.audit import common
    from tensoralg.decompose import eigen
    from tensoralg.decompose.report import eigenvector_figure

    figs = []
    monkeypatch.setattr(common, "save_figure", lambda fig, path: figs.append(fig) or Path(path))
    rng = np.random.default_rng(0)
    net = ta.Bilinear(rng.normal(size=(5, 16)), rng.normal(size=(5, 16)), rng.normal(size=(1, 5)))
    e = eigen(net, 0)
    eigenvector_figure(tmp_path / "e.png", e, 3, "t")
    fig = figs[0]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and bars[0].get_ylabel() == "eigenvector entry (unit norm)"
    # one scale for every panel (the one bar reads them all)
    lim = max(np.abs(e.eigenvectors[i]).max() for i in range(3))
    for ax in fig.axes:
        for im in ax.get_images():
            assert im.get_clim() == pytest.approx((-lim, lim))


def test_bench_legend_line_does_not_cross_its_label(monkeypatch, tmp_path):
    # the 30-pt "untrained" tick was drawn full length in the legend, through its own label
    import matplotlib.pyplot as plt

    from tensoralg.sae import bench

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    names = ["topk", "batchtopk"]
    r = {"config": {"presets": names, "seeds": 2}, "oracle": {"gt_code_iou": 0.9, "rip_delta": 0.3}}
    for n in names:
        r[n] = {"fvu": 0.1, "code_iou": 0.6, "gt_code_iou": 0.7, "rip_delta": 0.4,
                "random_init": {"code_iou": 0.1}}
    bench.plot_bench(r, tmp_path / "b.png")
    fig = figs[0]
    fig.canvas.draw()
    rend = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            assert not _boxes_overlap(handle.get_window_extent(rend), text.get_window_extent(rend))
        assert not _boxes_overlap(legend.get_window_extent(rend),
                                  ax.xaxis.label.get_window_extent(rend))
    plt.close("all")


def test_demo_does_not_list_quick():
    # demo is always quick: --quick was listed in its help (it is accepted, a no-op)
    from tensoralg.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices
               and "demo" in a.choices)
    assert "--quick" not in sub.choices["demo"].format_help()
    assert "--quick" in sub.choices["audit"]._actions[-1].choices["backdoor"].format_help()
    assert parser.parse_args(["demo", "--quick"]).quick is True
