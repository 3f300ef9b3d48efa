"""The fit's figures, after Hoffmann et al. 2022 figs. 2-4 (matplotlib, Agg): IsoFLOP profiles,
optimal N and D against compute with bootstrap bands, loss against compute with the Approach 1
frontier, and Approach 3's iso-loss contours with its efficient frontier; then the law forms'
rolling backtests (backtest.png) and, with --check, the held-out runs against their predictions
(check.png). A missing approach or form leaves its panel with the reason, never an error."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import EngFormatter, FuncFormatter  # noqa: E402

from scaletrain.scaling.backtest import Backtest  # noqa: E402
from scaletrain.scaling.check import CheckedPoint, CheckResult  # noqa: E402
from scaletrain.scaling.fit import (  # noqa: E402
    MIN_BOOTSTRAP_FITS,
    MIN_SIZES_PER_BUDGET,
    FitData,
    IsoFlopMinimum,
    ParametricFit,
    ScalingFit,
    group_by_budget,
)
from scaletrain.scaling.laws import FlopsPerToken  # noqa: E402

APPROACH_STYLE = {"approach1": ("tab:blue", "Approach 1"), "approach2": ("tab:orange", "Approach 2"),
                  "approach3": ("tab:green", "Approach 3")}
PLOT_FILES = ("isoflop.png", "optimal_allocation.png", "loss_vs_compute.png", "approach3_contours.png",
              "backtest.png")
CHECK_PLOT = "check.png"
DPI = 110


def write_plots(result: ScalingFit, data: FitData, targets: list[float], out_dir: Path,
                check: CheckResult | None = None) -> list[Path]:
    """Write the PNGs (PLOT_FILES, and CHECK_PLOT with a held-out check) into out_dir; returns their paths."""
    drawings = (plot_isoflop, plot_optimal_allocation, plot_loss_vs_compute, plot_contours, plot_backtest)
    figures = [(name, lambda draw=draw: draw(result, data, targets)) for name, draw in zip(PLOT_FILES, drawings,
                                                                                             strict=True)]
    if check is not None:
        figures.append((CHECK_PLOT, lambda: plot_check(check, result.chosen)))
    paths = []
    for name, draw in figures:
        figure = draw()
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
    status = (f"parabolas in ln N at {len(minima)} of {len(groups)} budgets, minima starred" if fit else
              f"Approach 2 skipped: {result.skipped.get('approach2', 'not run')[:60]}")
    axis.set(xscale="log", xlabel="parameters N", ylabel="final loss", title=f"IsoFLOP profiles: {status}")
    if fit is not None and fit.excluded:
        axis.annotate(_excluded_note(fit.excluded), (0.0, -0.13), xycoords="axes fraction", fontsize=7,
                      color="dimgrey", va="top")
    _label_sizes(axis)
    if others or minima:
        axis.legend(fontsize=8, loc="upper right")
    return figure


def _excluded_note(excluded: list[tuple[float, str]]) -> str:
    """Why the profiles without a parabola have none: a paragraph per reason with its budgets, below the axis."""
    budgets: dict[str, list[float]] = {}
    for flops, why in excluded:
        budgets.setdefault(why.split(";")[0], []).append(flops)
    return "\n".join(textwrap.fill(f"no parabola at {len(c)} budget(s) ({', '.join(f'{f:.2g}' for f in sorted(c))}): "
                                   f"{why}", width=110) for why, c in budgets.items())


def _label_sizes(axis: plt.Axes) -> None:
    """Label a log N axis 20k, 50k, 100k: matplotlib's default writes its minor ticks as 2x10^4, 3x10^4, ...
    which overlap on the one or two decades a CPU ladder spans. Within 2.5 decades the 2s and 5s are
    labelled too, within one decade (a check budget's sizes, 144k-341k) the 3s as well, so that at least
    two ticks say where the points are; beyond 2.5 decades the powers of ten only."""
    low, high = axis.get_xlim()
    decades = math.log10(high / low)
    mantissas = (1, 2, 3, 5) if decades <= 1 else (1, 2, 5) if decades <= 2.5 else (1,)
    short = EngFormatter(sep="")

    def label(value: float, position: int | None) -> str:
        if value <= 0:
            return ""
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
        return short(value, position) if any(math.isclose(mantissa, m) for m in mantissas) else ""

    axis.xaxis.set_major_formatter(FuncFormatter(label))
    axis.xaxis.set_minor_formatter(FuncFormatter(label))


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
        shown = any(np.any(np.isfinite(fit.allocation(flops)[index])) for fit in result.fits.values())
        if not (shown or {"approach1", "approach2"} & set(result.fits)):
            # every fit is degenerate (A or B fitted to 0, an exponent <= 0): no optimum to draw on a log axis
            axis.text(0.5, 0.5, "no compute-optimal allocation:\nthe fit leaves the loss independent of N or D",
                      transform=axis.transAxes, ha="center", va="center")
        axis.set(xscale="log", yscale="log" if shown else "linear", xlabel="training FLOPs C", ylabel=label,
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
    """Approach 3's iso-loss contours over (C, N) with D = C / fpt(N), the sweep's own FLOPs line
    (laws.FlopsPerToken; 6N for a CSV without FLOPs), and its efficient frontier N*(C) (fig. 4 left)."""
    figure, axis = plt.subplots(figsize=(7.5, 5))
    axis.scatter([p.flops for p in data.points], [p.params for p in data.points], c="black", s=10, label="runs",
                 zorder=3)
    fit = result.fits.get("approach3")
    if fit is None:
        axis.set_title(f"Approach 3 skipped: {result.skipped.get('approach3', 'not run')[:70]}", fontsize=9)
    else:
        _draw_contours(axis, fit, data, targets, result.fpt)
    axis.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="parameters N")
    axis.legend(fontsize=8, loc="upper left")
    return figure


def _draw_contours(axis: plt.Axes, fit: ParametricFit, data: FitData, targets: list[float],
                   fpt: FlopsPerToken) -> None:
    flops = np.geomspace(min(p.flops for p in data.points) / 10, max(targets) * 10, 200)
    n_opt = fit.allocation(flops)[0]
    sizes = [p.params for p in data.points] + [n for n in n_opt if np.isfinite(n)]
    params = np.geomspace(min(sizes) / 10, max(sizes) * 10, 200)
    c_mesh, n_mesh = np.meshgrid(flops, params)
    loss = fit.loss(n_mesh, c_mesh / fpt(n_mesh))
    levels = np.geomspace(loss.min(), np.percentile(loss, 80), 15)
    contours = axis.contour(c_mesh, n_mesh, loss, levels=levels, cmap="viridis", linewidths=0.8)
    axis.clabel(contours, fontsize=6, fmt="%.2f")
    if np.all(np.isfinite(n_opt)):
        axis.plot(flops, n_opt, color="tab:red", lw=2, label="efficient frontier N*(C)")
        axis.scatter(targets, fit.allocation(np.array(targets))[0], color="tab:red", marker="X", s=80,
                     edgecolor="black", zorder=4, label="targets")
    axis.set_title(f"Approach 3: iso-loss contours along D = C / fpt(N) ({fpt.source}); alpha {fit.alpha:.3f}, "
                   f"beta {fit.beta:.3f}, N* ∝ C^{fit.a:.3f}", fontsize=9)


def plot_backtest(result: ScalingFit, data: FitData, targets: list[float]) -> plt.Figure:
    """Per law form, every counted fold's predictions (fitted on the budgets below its origin, predicting
    every budget from it on) against the measured loss, coloured by fold; the y = x line is a perfect
    extrapolation."""
    forms = list(result.laws) + [form for form in result.law_skipped if form not in result.laws]
    figure, axes = plt.subplots(1, max(len(forms), 1), figsize=(4.6 * max(len(forms), 1), 4.4), squeeze=False)
    if not forms:
        axes[0][0].set(title="no law form was fitted", xlabel="measured loss", ylabel="predicted loss")
    for axis, form in zip(axes[0], forms, strict=True):
        law = result.laws.get(form)
        if law is None:
            axis.set_title(f"{form} skipped", fontsize=9)
            axis.text(0.5, 0.5, textwrap.fill(result.law_skipped[form], 40), ha="center", va="center", fontsize=8,
                      transform=axis.transAxes)
        else:
            _draw_backtest(axis, form, law.backtest, form == result.chosen)
        axis.set(xlabel="measured loss", ylabel="predicted loss")
    return figure


def _draw_backtest(axis: plt.Axes, form: str, backtest: Backtest, chosen: bool) -> None:
    scored = backtest.scored
    for fold in scored:
        color = plt.cm.viridis(scored.index(fold) / max(len(scored) - 1, 1) * 0.9)
        axis.scatter(fold.measured, fold.predicted, color=color, s=22, zorder=3,
                     label=f"from C {fold.budget_flops:.2g} on (fitted on {fold.train_budgets} budgets)")
    values = [v for fold in scored for v in (*fold.measured, *fold.predicted) if math.isfinite(v)]
    if values:
        low, high = min(values), max(values)
        pad = 0.05 * (high - low or 1.0)
        axis.plot([low - pad, high + pad], [low - pad, high + pad], "k--", lw=1, label="y = x")
        axis.legend(fontsize=7, loc="lower right")
    mark = " (chosen)" if chosen else ""
    summary = (f"mean |error| {backtest.mean_abs_error_pct:.2f}%, rankings {backtest.rankings_correct}/"
               f"{backtest.rankings}, {len(scored)} of {len(backtest.folds)} folds counted" if scored else
               "no backtest fold counted")
    axis.set_title(f"{form}{mark}\n{summary}", fontsize=9, fontweight="bold" if chosen else "normal")


def plot_check(check: CheckResult, form: str | None) -> plt.Figure:
    """The held-out runs: predicted loss with its 90% prediction interval against the measured one
    (left), and both against N per held-out budget (right)."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    budgets = group_by_budget([c.point for c in check.points])
    for rank, group in enumerate(sorted(budgets, key=lambda g: check.points[g[0]].point.flops)):
        color = plt.cm.viridis(rank / max(len(budgets) - 1, 1) * 0.9)
        members = sorted((check.points[i] for i in group), key=lambda c: c.point.params)
        flops = float(np.exp(np.mean(np.log([c.point.flops for c in members]))))
        errors = _interval_bars(members)
        left.errorbar([c.point.loss for c in members], [c.predicted for c in members], yerr=errors, fmt="o",
                      color=color, capsize=3, label=f"C {flops:.2g}")
        right.plot([c.point.params for c in members], [c.point.loss for c in members], "o-", color=color,
                   label=f"measured, C {flops:.2g}")
        right.errorbar([c.point.params for c in members], [c.predicted for c in members], yerr=errors, fmt="x--",
                       color=color, capsize=3, label="predicted (90% interval)")
    values = [v for c in check.points for v in (c.point.loss, c.predicted) if math.isfinite(v)]
    left.plot([min(values), max(values)], [min(values), max(values)], "k--", lw=1, label="y = x")
    inside, judged = check.coverage
    left.set(xlabel="measured loss", ylabel="predicted loss", title=f"held-out runs ({form or 'chosen law'}): "
             f"mean |error| {check.mean_abs_error_pct:.2f}%, {inside}/{judged} inside 90%")
    right.set(xscale="log", xlabel="parameters N", ylabel="loss", title="held-out budgets: loss against N")
    _label_sizes(right)
    left.legend(fontsize=7, loc="upper left")
    right.legend(fontsize=7, loc="upper right")
    return figure


def _interval_bars(members: list[CheckedPoint]) -> np.ndarray | None:
    """matplotlib's yerr (distances below and above) of the intervals; None where any is missing."""
    if any(c.inside is None for c in members):
        return None
    return np.array([[c.predicted - c.lower for c in members], [c.upper - c.predicted for c in members]])
