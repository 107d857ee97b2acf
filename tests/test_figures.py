"""Figures: the legend never covers the bars, every axis is labelled, the backdoor figure shows
the global similarity (issue 12 item 8)."""

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
