"""SWEEP/tune/lr_tuning.png: the LR grid of `sweep tune`, one curve per (size, horizon), and the fitted law."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from scaletrain.scaling.sweep.tune_fit import GridResult, Optimum, TuningFit, seed_means


def plot_tuning(results: list[GridResult], fit: TuningFit, path: Path) -> Path:
    """Loss (seeds averaged in ln L) against LR per (size, horizon) at its best batch, the parabolas, and
    the fitted law's eta* at each (dotted)."""
    import matplotlib  # imported on use for speed: matplotlib costs seconds

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = seed_means(results)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for index, optimum in enumerate(fit.optima):
        color = f"C{index % 10}"
        batch = _nearest_batch(means, optimum)
        grid = sorted((r for r in means if (r.params, r.tokens) == (optimum.params, optimum.tokens)
                       and math.isfinite(r.loss) and r.batch_size == batch), key=lambda r: r.lr)
        horizon = f", D={optimum.tokens:.3g}" if len(fit.horizons) > 1 else ""
        axes.plot([r.lr for r in grid], [r.loss for r in grid], "o", color=color,
                  label=f"N={optimum.params:.3g}{horizon}: eta*={optimum.lr:.3g}")
        x = np.linspace(math.log(grid[0].lr), math.log(grid[-1].lr), 100)
        if optimum.parabola is not None:  # a stability-limited optimum is its best grid point
            axes.plot(np.exp(x), np.polyval(optimum.parabola, x), "-", color=color, alpha=0.6)
        axes.axvline(fit.lr(optimum.params, optimum.tokens), color=color, linestyle=":", alpha=0.8)
    axes.set_xscale("log")
    axes.set(xlabel="peak learning rate", ylabel="final validation loss",
             title=f"LR tuning: {fit.lr.formula('eta*')} (dotted)")
    axes.title.set_fontsize(8)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _nearest_batch(results: list[GridResult], optimum: Optimum) -> int:
    batches = {r.batch_size for r in results if (r.params, r.tokens) == (optimum.params, optimum.tokens)}
    return min(batches, key=lambda b: abs(math.log(b / optimum.batch_size)))
