"""The IsoFLOP figure on a CPU ladder's span of sizes (one and a half decades): its N axis is labelled
20k, 50k, 100k without overlapping labels (matplotlib's default wrote 2x10^4, 3x10^4, ... on top of one
another in the second English ladder's figure), and the title and a note say which profiles have no
parabola and why (that ladder fitted 4 of its 12); a check budget's sizes, within a decade, get two labels."""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import numpy as np

from scaletrain.scaling.fit import FitData, ScalingFit, fit_isoflop
from scaletrain.scaling.fit_plots import _label_sizes, plot_isoflop
from scaletrain.scaling.laws import Point

SIZES = np.geomspace(1.5e4, 5.0e5, 6)


def profile(budget: float, curved: bool) -> list[Point]:
    """Six sizes at one budget: Chinchilla-like losses (a minimum inside), or losses falling straight
    in ln N (a profile with no minimum)."""
    points = []
    for params in SIZES:
        tokens = budget / (6 * params)
        loss = (1.7 + 400 / params**0.34 + 410 / tokens**0.28 if curved else
                4.0 - 0.1 * np.log(params / SIZES[0]))
        points.append(Point(float(params), float(tokens), budget, float(loss), budget=budget))
    return points


def test_isoflop_axis_labels_are_short_and_apart_and_flat_profiles_are_explained() -> None:
    points = profile(1e12, True) + profile(3e12, False) + profile(1e13, True)
    fit = fit_isoflop(points)
    assert len(fit.minima) == 2 and len(fit.excluded) == 1
    figure = plot_isoflop(ScalingFit({"approach2": fit}, {}), FitData(points, [None] * len(points)), [])
    try:
        (axis,) = [a for a in figure.axes if a.get_xlabel() == "parameters N"]
        assert "at 2 of 3 budgets" in axis.get_title()
        notes = [t.get_text().replace("\n", " ") for t in axis.texts]
        assert notes == ["no parabola at 1 budget(s) (3e+12): the losses do not curve upward in log N, "
                         "so the profile has no minimum"]
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        low, high = axis.get_xlim()
        shown = [(tick.get_loc(), tick.label1) for tick in axis.xaxis.get_major_ticks() + axis.xaxis.get_minor_ticks()
                 if low <= tick.get_loc() <= high and tick.label1.get_visible() and tick.label1.get_text()]
        texts = sorted(label.get_text() for _, label in shown)
        assert texts == sorted(["20k", "50k", "100k", "200k", "500k"])
        boxes = [label.get_window_extent(renderer) for _, label in shown]
        for first, second in itertools.combinations(boxes, 2):
            assert not first.overlaps(second), (first, second)
    finally:
        plt.close(figure)


def test_a_check_budgets_sizes_within_a_decade_get_two_labels() -> None:
    """The second ladder's 3x check trained 144K-341K: the 2s and 5s alone labelled one tick (200k)."""
    figure, axis = plt.subplots()
    try:
        axis.set_xscale("log")
        axis.plot([1.44e5, 2.0e5, 2.66e5, 3.41e5], [3.1, 2.9, 2.88, 2.87])
        _label_sizes(axis)
        figure.canvas.draw()
        low, high = axis.get_xlim()
        texts = [tick.label1.get_text() for tick in axis.xaxis.get_major_ticks() + axis.xaxis.get_minor_ticks()
                 if low <= tick.get_loc() <= high and tick.label1.get_text()]
        assert sorted(texts) == ["200k", "300k"]
    finally:
        plt.close(figure)
