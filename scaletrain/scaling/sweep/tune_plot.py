"""SWEEP/tune/lr_tuning.png: the LR grid of `sweep tune`, one curve per (size, horizon), and the fitted law."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from scaletrain.scaling.sweep.tune_fit import GridResult, Optimum, TuningFit, seed_means

if TYPE_CHECKING:  # matplotlib is imported on use: it costs seconds
    from matplotlib.figure import Figure


def plot_tuning(results: list[GridResult], fit: TuningFit, path: Path) -> Path:
    """Write draw_tuning's figure to `path` (PNG)."""
    figure = draw_tuning(results, fit)
    import matplotlib.pyplot as plt  # after draw_tuning, which chooses the backend
    try:
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
    return path


def draw_tuning(results: list[GridResult], fit: TuningFit) -> Figure:
    """Loss (seeds averaged in ln L) against LR per (size, horizon) at its best batch, the parabolas, and
    the fitted law's eta* at each (dotted). An LR where a seed failed (diverged) is an x on the top edge; a
    stability-limited optimum (its best grid point, tune.unstable_neighbour) says so in the legend, which
    stands beside the axes so that it hides no point."""
    import matplotlib  # imported on use for speed: matplotlib costs seconds

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    means = seed_means(results)
    figure, axes = plt.subplots(figsize=(9, 4.5))
    on_top_edge = axes.get_xaxis_transform()  # x in data, y in axes fraction
    for index, optimum in enumerate(fit.optima):
        color = f"C{index % 10}"
        batch = _nearest_batch(means, optimum)
        cell = [r for r in means if (r.params, r.tokens) == (optimum.params, optimum.tokens) and r.batch_size == batch]
        grid = sorted((r for r in cell if math.isfinite(r.loss)), key=lambda r: r.lr)
        failed = [r.lr for r in cell if not math.isfinite(r.loss)]
        horizon = f", D={optimum.tokens:.3g}" if len(fit.horizons) > 1 else ""
        edge = " (stability edge)" if optimum.stability_limited else ""
        axes.plot([r.lr for r in grid], [r.loss for r in grid], "o", color=color,
                  label=f"N={optimum.params:.3g}{horizon}: eta*={optimum.lr:.3g}{edge}")
        if failed:
            axes.plot(failed, [1.0] * len(failed), "x", color=color, markersize=8, transform=on_top_edge,
                      clip_on=False)
        x = np.linspace(math.log(grid[0].lr), math.log(grid[-1].lr), 100)
        if optimum.parabola is not None:  # a stability-limited optimum is its best grid point
            axes.plot(np.exp(x), np.polyval(optimum.parabola, x), "-", color=color, alpha=0.6)
        axes.axvline(fit.lr(optimum.params, optimum.tokens), color=color, linestyle=":", alpha=0.8)
    axes.set_xscale("log")
    axes.set(xlabel="peak learning rate", ylabel="final validation loss",
             title=f"LR tuning: {fit.lr.formula('eta*')} (dotted)")
    axes.title.set_fontsize(8)
    handles, labels = axes.get_legend_handles_labels()
    if any(line.get_marker() == "x" for line in axes.get_lines()):
        handles.append(Line2D([], [], marker="x", color="grey", linestyle=""))
        labels.append("a seed failed at this LR")
    axes.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    figure.tight_layout()
    return figure


def _nearest_batch(results: list[GridResult], optimum: Optimum) -> int:
    batches = {r.batch_size for r in results if (r.params, r.tokens) == (optimum.params, optimum.tokens)}
    return min(batches, key=lambda b: abs(math.log(b / optimum.batch_size)))
