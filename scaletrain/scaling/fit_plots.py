"""The fit's figures (matplotlib, Agg): IsoFLOP profiles, optimal allocation against compute, loss
against compute with the frontier, and Approach 3's iso-loss contours, after Hoffmann et al. 2022
figs. 2-4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from scaletrain.scaling.fit import ParametricFit, group_by_budget  # noqa: E402

APPROACH_COLORS = {"approach1": "tab:blue", "approach2": "tab:orange", "approach3": "tab:green"}


def write_plots(fit: dict[str, Any], inputs: Any, out_dir: Path) -> list[Path]:
    """Write the four PNGs into out_dir and return their paths."""
    writers = {"isoflop.png": _isoflop, "optimal_allocation.png": _optimal_allocation,
               "loss_vs_compute.png": _loss_vs_compute, "approach3_contours.png": _contours}
    paths = []
    for name, draw in writers.items():
        figure = draw(fit, inputs)
        path = out_dir / name
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        paths.append(path)
    return paths


def _isoflop(fit: dict[str, Any], inputs: Any) -> plt.Figure:
    figure, axis = plt.subplots(figsize=(7, 5))
    groups = group_by_budget(inputs.points)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(groups), 1)))
    minima = {m["flops"]: m for m in fit.get("approach2", {}).get("budgets", [])}
    for color, (budget, points) in zip(colors, groups.items(), strict=False):
        params = np.array([p.params for p in points])
        axis.scatter(params, [p.loss for p in points], color=color, label=f"C = {budget:.2g}")
        if budget in minima:
            x = np.linspace(np.log(params.min()) - 0.3, np.log(params.max()) + 0.3, 100)
            axis.plot(np.exp(x), np.polyval(minima[budget]["parabola"], x), color=color, lw=1)
            axis.scatter([minima[budget]["n_opt"]], [minima[budget]["loss_min"]], color=color, marker="*", s=180,
                         edgecolor="black", zorder=3)
    axis.set(xscale="log", xlabel="parameters N", ylabel="final validation loss",
             title="IsoFLOP profiles (Approach 2): parabolas in log N, minima starred")
    axis.legend(fontsize=8)
    return figure


def _optimal_allocation(fit: dict[str, Any], inputs: Any) -> plt.Figure:
    figure, axes = plt.subplots(1, 2, figsize=(12, 5))
    targets = [p["flops"] for p in fit["predictions"]]
    for axis, key, label in ((axes[0], "n_opt", "N_opt (parameters)"), (axes[1], "d_opt", "D_opt (tokens)")):
        for approach, color in APPROACH_COLORS.items():
            band = fit.get(approach, {}).get("band")
            if band is None:
                continue
            flops = np.array(band["flops"])
            exponent = fit[approach]["a" if key == "n_opt" else "b"]
            axis.plot(flops, band[key], color=color, label=f"{approach}: C^{exponent:.2f}")
            if band.get(f"{key}_ci"):
                low, high = np.array(band[f"{key}_ci"]).T
                axis.fill_between(flops, low, high, color=color, alpha=0.2)
            axis.scatter(targets, [p[approach][key] for p in fit["predictions"]], color=color, marker="x", s=60)
        for minimum in fit.get("approach2", {}).get("budgets", []):
            axis.scatter([minimum["flops"]], [minimum[key]], color="tab:orange", edgecolor="black", zorder=3)
        axis.axvspan(max(p.flops for p in inputs.points), max(targets), color="grey", alpha=0.08,
                     label="extrapolation")
        axis.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=label,
                 title=f"{label.split()[0]} against compute, 95% bootstrap bands; x: targets")
        axis.legend(fontsize=8)
    return figure


def _loss_vs_compute(fit: dict[str, Any], inputs: Any) -> plt.Figure:
    figure, axis = plt.subplots(figsize=(7, 5))
    sizes = sorted({p.params for p in inputs.points})
    colors = dict(zip(sizes, plt.cm.plasma(np.linspace(0, 0.85, len(sizes))), strict=True))
    labelled = set()
    for point, curve in zip(inputs.points, inputs.curves, strict=True):
        label = None if point.params in labelled else f"N = {point.params:.3g}"
        labelled.add(point.params)
        if curve is not None:
            axis.plot(curve.flops, curve.loss, color=colors[point.params], lw=0.8, alpha=0.8, label=label)
        else:
            axis.scatter([point.flops], [point.loss], color=colors[point.params], s=15, label=label)
    frontier = fit.get("approach1", {}).get("frontier", [])
    if frontier:
        axis.plot([p["flops"] for p in frontier], [p["loss"] for p in frontier], "k--", lw=1.5,
                  label="frontier (Approach 1)")
    axis.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="training loss (smoothed)",
             title="Loss against compute for every run, with the lower envelope")
    axis.legend(fontsize=7, ncol=2)
    return figure


def _contours(fit: dict[str, Any], inputs: Any) -> plt.Figure:
    figure, axis = plt.subplots(figsize=(7, 5))
    params = np.array([p.params for p in inputs.points])
    tokens = np.array([p.tokens for p in inputs.points])
    axis.scatter(params, tokens, c="black", s=12, label="runs", zorder=3)
    if "approach3" in fit:
        constants = fit["approach3"]
        law = ParametricFit(constants["E"], constants["A"], constants["B"], constants["alpha"], constants["beta"], 0)
        targets = [p["flops"] for p in fit["predictions"]]
        flops = np.geomspace(min(p.flops for p in inputs.points) / 3, max(targets) * 3, 60)
        optimal = np.array([law.compute_optimal(c) for c in flops])
        n_mesh, d_mesh = np.meshgrid(_span(params, optimal[:, 0]), _span(tokens, optimal[:, 1]))
        contour = axis.contour(n_mesh, d_mesh, law.loss(n_mesh, d_mesh), levels=14, cmap="viridis", linewidths=0.8)
        axis.clabel(contour, fontsize=7, fmt="%.2f")
        axis.plot(optimal[:, 0], optimal[:, 1], "r-", lw=2, label="efficient frontier N*(C), D*(C)")
        axis.scatter([law.compute_optimal(c)[0] for c in targets], [law.compute_optimal(c)[1] for c in targets],
                     color="red", marker="x", s=70, label="targets", zorder=4)
        title = f"Approach 3: iso-loss contours, alpha={law.alpha:.2f}, beta={law.beta:.2f}"
    else:
        title = f"Approach 3 skipped: {fit['skipped'].get('approach3', '')[:60]}"
    axis.set(xscale="log", yscale="log", xlabel="parameters N", ylabel="tokens D", title=title)
    axis.legend(fontsize=8)
    return figure


def _span(observed: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    return np.geomspace(min(observed.min(), predicted.min()) / 2, max(observed.max(), predicted.max()) * 2, 200)
