"""The fit's figures, after Hoffmann et al. 2022 figs. 2-4 (matplotlib, Agg): IsoFLOP profiles,
optimal N and D against compute with bootstrap bands, loss against compute with the Approach 1
frontier, and Approach 3's iso-loss contours with its efficient frontier."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from scaletrain.scaling.fit import (  # noqa: E402
    MIN_BOOTSTRAP_FITS,
    MIN_SIZES_PER_BUDGET,
    FitData,
    IsoFlopMinimum,
    ParametricFit,
    ScalingFit,
    group_by_budget,
)

APPROACH_STYLE = {"approach1": ("tab:blue", "Approach 1"), "approach2": ("tab:orange", "Approach 2"),
                  "approach3": ("tab:green", "Approach 3")}
PLOT_FILES = ("isoflop.png", "optimal_allocation.png", "loss_vs_compute.png", "approach3_contours.png")
DPI = 110


def write_plots(result: ScalingFit, data: FitData, targets: list[float], out_dir: Path) -> list[Path]:
    """Write the four PNGs (PLOT_FILES) into out_dir; returns their paths."""
    drawings = (plot_isoflop, plot_optimal_allocation, plot_loss_vs_compute, plot_contours)
    paths = []
    for name, draw in zip(PLOT_FILES, drawings, strict=True):
        figure = draw(result, data, targets)
        try:
            figure.savefig(out_dir / name, dpi=DPI, bbox_inches="tight")
        finally:
            plt.close(figure)
        paths.append(out_dir / name)
    return paths


def plot_isoflop(result: ScalingFit, data: FitData, targets: list[float]) -> plt.Figure:
    """Loss against N per budget, each profile's parabola in ln N and its vertex (fig. 3 left); the
    budgets are coloured by C, runs on no profile of >= 3 sizes are grey."""
    figure, axis = plt.subplots(figsize=(7.5, 5))
    fit = result.fits.get("approach2")
    minima = fit.minima if fit is not None else []
    groups = [group for group in group_by_budget(data.points)
              if len({data.points[i].params for i in group}) >= MIN_SIZES_PER_BUDGET]
    profiled = {i for group in groups for i in group}
    others = [p for i, p in enumerate(data.points) if i not in profiled]
    if others:
        axis.scatter([p.params for p in others], [p.loss for p in others], color="lightgrey", s=12,
                     label="runs on no profile")
    flops = [math.exp(np.mean(np.log([data.points[i].flops for i in group]))) for group in groups]
    norm = LogNorm(min(flops, default=1.0), max(flops, default=1.0) * (1 + 1e-9))
    for group, budget in zip(groups, flops, strict=True):
        points = [data.points[i] for i in group]
        color = plt.cm.viridis(norm(budget) * 0.9)
        axis.scatter([p.params for p in points], [p.loss for p in points], color=color, s=22)
        minimum = next((m for m in minima if math.isclose(m.flops, budget, rel_tol=1e-9)), None)
        if minimum is not None:
            _draw_parabola(axis, minimum, [p.params for p in points], color)
    if groups:
        figure.colorbar(plt.cm.ScalarMappable(norm=norm, cmap="viridis"), ax=axis, label="IsoFLOP budget C")
    status = "parabolas in ln N, minima starred" if fit else f"Approach 2 skipped: {result.skipped['approach2'][:60]}"
    axis.set(xscale="log", xlabel="parameters N", ylabel="final loss", title=f"IsoFLOP profiles: {status}")
    if others or minima:
        axis.legend(fontsize=8, loc="upper right")
    return figure


def _draw_parabola(axis: plt.Axes, minimum: IsoFlopMinimum, sizes: list[float], color: Any) -> None:
    low, high = math.log(min(min(sizes), minimum.n_opt)) - 0.2, math.log(max(max(sizes), minimum.n_opt)) + 0.2
    x = np.linspace(low, high, 200)
    axis.plot(np.exp(x), np.polyval(minimum.parabola, x), color=color, lw=1)
    label = None if axis.get_legend_handles_labels()[1].count("profile minimum") else "profile minimum"
    axis.scatter([minimum.n_opt], [minimum.loss_min], color=color, marker="*", s=200, edgecolor="black", zorder=3,
                 label=label)


def plot_optimal_allocation(result: ScalingFit, data: FitData, targets: list[float]) -> plt.Figure:
    """N_opt(C) and D_opt(C) for every approach, with 95% bootstrap bands, the data behind them, and
    the extrapolation to the targets (fig. 1, Table 3)."""
    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    largest = max(p.flops for p in data.points)
    flops = np.geomspace(min(p.flops for p in data.points) / 2, max(targets) * 2, 120)
    for index, (axis, label) in enumerate(zip(axes, ("N_opt (parameters)", "D_opt (tokens)"), strict=True)):
        for approach, fit in result.fits.items():
            color, name = APPROACH_STYLE[approach]
            exponent = fit.constants()["ab"[index]]
            axis.plot(flops, fit.allocation(flops)[index], color=color, label=f"{name}: ∝ C^{exponent:.3f}")
            band = _band(result, approach, flops, index)
            if band is not None:
                axis.fill_between(flops, band[0], band[1], color=color, alpha=0.18)
            axis.scatter(targets, fit.allocation(np.array(targets))[index], color=color, marker="X", s=80,
                         edgecolor="black", zorder=4)
        _allocation_data(axis, result, index)
        axis.axvspan(largest, flops[-1], color="grey", alpha=0.08, label="extrapolation")
        for target in targets:
            axis.axvline(target, color="grey", ls=":", lw=1)
        axis.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=label,
                 title=f"{label.split()[0]} against compute; X: targets, bands: 95% bootstrap")
        axis.legend(fontsize=7, loc="upper left")  # "best" costs seconds with the bands
    return figure


def _band(result: ScalingFit, approach: str, flops: np.ndarray, index: int) -> np.ndarray | None:
    samples = result.samples(approach)
    if len(samples) < MIN_BOOTSTRAP_FITS:
        return None
    curves = np.array([sample.allocation(flops)[index] for sample in samples])
    curves = curves[np.all(np.isfinite(curves), axis=1)]
    return np.percentile(curves, [2.5, 97.5], axis=0) if len(curves) >= MIN_BOOTSTRAP_FITS else None


def _allocation_data(axis: plt.Axes, result: ScalingFit, index: int) -> None:
    """The optima the power laws went through: Approach 1's frontier runs and Approach 2's vertices."""
    if "approach1" in result.fits:
        frontier = result.fits["approach1"].frontier
        axis.scatter([p.flops for p in frontier], [(p.params, p.tokens)[index] for p in frontier], s=10,
                     color=APPROACH_STYLE["approach1"][0], alpha=0.6, label="Approach 1 frontier runs")
    if "approach2" in result.fits:
        minima = result.fits["approach2"].minima
        axis.scatter([m.flops for m in minima], [(m.n_opt, m.d_opt)[index] for m in minima], s=45,
                     color=APPROACH_STYLE["approach2"][0], edgecolor="black", label="Approach 2 profile minima")


def plot_loss_vs_compute(result: ScalingFit, data: FitData, targets: list[float]) -> plt.Figure:
    """Every run's (smoothed) training loss against FLOPs, or its final point, and the lower
    envelope Approach 1 fits (fig. 2 left)."""
    figure, axis = plt.subplots(figsize=(7.5, 5))
    sizes = np.array([p.params for p in data.points])
    norm = LogNorm(sizes.min(), sizes.max() * (1 + 1e-9))
    for point, curve in zip(data.points, data.curves, strict=True):
        color = plt.cm.plasma(norm(point.params))
        if curve is not None:
            axis.plot(curve.flops, curve.loss, color=color, lw=0.8, alpha=0.8)
        axis.scatter([point.flops], [point.loss], color=color, s=14, zorder=3)
    if "approach1" in result.fits:
        frontier = result.fits["approach1"].frontier
        axis.plot([p.flops for p in frontier], [p.loss for p in frontier], "k--", lw=1.5, label="frontier (Approach 1)")
    figure.colorbar(plt.cm.ScalarMappable(norm=norm, cmap="plasma"), ax=axis, label="parameters N")
    kind = "training curves (smoothed) and final points" if any(c is not None for c in data.curves) else "final points"
    axis.set(xscale="log", xlabel="training FLOPs C", ylabel="loss", title=f"Loss against compute: {kind}")
    if "approach1" in result.fits:
        axis.legend(fontsize=8, loc="upper right")
    return figure


def plot_contours(result: ScalingFit, data: FitData, targets: list[float]) -> plt.Figure:
    """Approach 3's iso-loss contours over (C, N) with D = C / 6N, and its efficient frontier N*(C)
    (fig. 4 left)."""
    figure, axis = plt.subplots(figsize=(7.5, 5))
    axis.scatter([p.flops for p in data.points], [p.params for p in data.points], c="black", s=10, label="runs",
                 zorder=3)
    fit = result.fits.get("approach3")
    if fit is None:
        axis.set_title(f"Approach 3 skipped: {result.skipped['approach3'][:70]}", fontsize=9)
    else:
        _draw_contours(axis, fit, data, targets)
    axis.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="parameters N")
    axis.legend(fontsize=8, loc="upper left")
    return figure


def _draw_contours(axis: plt.Axes, fit: ParametricFit, data: FitData, targets: list[float]) -> None:
    flops = np.geomspace(min(p.flops for p in data.points) / 10, max(targets) * 10, 200)
    n_opt = fit.allocation(flops)[0]
    sizes = [p.params for p in data.points] + [n for n in n_opt if np.isfinite(n)]
    params = np.geomspace(min(sizes) / 10, max(sizes) * 10, 200)
    c_mesh, n_mesh = np.meshgrid(flops, params)
    loss = fit.loss(n_mesh, c_mesh / (6 * n_mesh))
    levels = np.geomspace(loss.min(), np.percentile(loss, 80), 15)
    contours = axis.contour(c_mesh, n_mesh, loss, levels=levels, cmap="viridis", linewidths=0.8)
    axis.clabel(contours, fontsize=6, fmt="%.2f")
    if np.all(np.isfinite(n_opt)):
        axis.plot(flops, n_opt, color="tab:red", lw=2, label="efficient frontier N*(C)")
        axis.scatter(targets, fit.allocation(np.array(targets))[0], color="tab:red", marker="X", s=80,
                     edgecolor="black", zorder=4, label="targets")
    axis.set_title(f"Approach 3: iso-loss contours; alpha {fit.alpha:.3f}, beta {fit.beta:.3f}, "
                   f"N* ∝ C^{fit.a:.3f}", fontsize=9)
