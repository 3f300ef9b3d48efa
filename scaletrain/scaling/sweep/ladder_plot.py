"""The ladder's figure (SWEEP/ladder.png): per size, the stable run's training loss at constant LR
and each cooldown branch leaving it, with the branch's final validation loss, against tokens.

It shows what a ladder buys (Hägele et al. 2024, fig. 3): the stable curve flattens, each cooldown
drops below it, and the decayed points are the ones the fit reads. A run that failed (a divergence the
spike guard stopped) is dashed, and the loss axis spans the other runs' curves: a blow-up to 8 would
otherwise squeeze every finished curve into the bottom tenth of the figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from scaletrain.scaling.fit import smooth_training_curve  # noqa: E402
from scaletrain.scaling.sweep.layout import PLAN_FILE, RUNS_DIR  # noqa: E402
from scaletrain.scaling.sweep.results import run_status, training_records  # noqa: E402

LADDER_PLOT = "ladder.png"
DPI = 110


def write_ladder_plot(sweep_dir: Path) -> Path | None:
    """Draw SWEEP/ladder.png (draw_ladder); None when the sweep has no stable run with any training
    record yet."""
    figure = draw_ladder(sweep_dir)
    if figure is None:
        return None
    path = sweep_dir / LADDER_PLOT
    try:
        figure.savefig(path, dpi=DPI, bbox_inches="tight")
    finally:
        plt.close(figure)
    return path


def draw_ladder(sweep_dir: Path) -> plt.Figure | None:
    """The ladder's figure from plan.json and the runs' metrics.jsonl (the caller closes it)."""
    planned = json.loads((sweep_dir / PLAN_FILE).read_text())["runs"]
    stables = [run for run in planned if run.get("role") == "stable"]
    curves = {run["name"]: _curve(sweep_dir / RUNS_DIR / run["name"] / "metrics.jsonl") for run in planned}
    if not any(curves[run["name"]] is not None for run in stables):
        return None
    failed = {run["name"] for run in planned if run_status(sweep_dir / RUNS_DIR / run["name"]).state == "failed"}
    figure, axis = plt.subplots(figsize=(8, 5.5))
    norm = LogNorm(min(run["params"] for run in stables), max(run["params"] for run in stables) * (1 + 1e-9))
    for stable in stables:
        color = plt.cm.viridis(0.9 * norm(stable["params"]))
        _draw_size(axis, stable, [run for run in planned if run.get("stable_run") == stable["name"]], curves,
                   failed, color, sweep_dir)
    finished = [curve[1] for name, curve in curves.items() if curve is not None and name not in failed]
    if failed and finished:
        low, high = min(map(np.min, finished)), max(map(np.max, finished))
        axis.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
    figure.colorbar(plt.cm.ScalarMappable(norm=norm, cmap="viridis"), ax=axis, label="parameters N")
    axis.set(xscale="log", xlabel="training tokens D", ylabel="loss",
             title="Ladder: stable runs (thin), cooldown branches (thick), final val_loss (dots)")
    axis.legend(handles=_legend_handles(bool(failed)), fontsize=8, loc="upper right")
    return figure


def _draw_size(axis: plt.Axes, stable: dict[str, Any], branches: list[dict[str, Any]],
               curves: dict[str, tuple[np.ndarray, np.ndarray] | None], failed: set[str], color: Any,
               sweep_dir: Path) -> None:
    curve = curves[stable["name"]]
    if curve is not None:
        axis.plot(*curve, color=color, lw=0.8, alpha=0.7, ls="--" if stable["name"] in failed else "-")
    for branch in branches:
        branch_curve = curves[branch["name"]]
        if branch_curve is not None:
            axis.plot(*branch_curve, color=color, lw=1.8, ls="--" if branch["name"] in failed else "-")
        summary = sweep_dir / RUNS_DIR / branch["name"] / "summary.json"
        if summary.is_file():
            final = json.loads(summary.read_text())
            if final.get("val_loss") is not None:
                axis.scatter([final["tokens"]], [final["val_loss"]], color=color, edgecolor="black", s=30, zorder=3)


def _curve(metrics: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The run's training loss against tokens, smoothed as the fit smooths curves (fit.smooth_training_curve)."""
    records = [record for _, record in sorted(training_records(metrics).items()) if "tokens" in record]
    if len(records) < 2:
        return None
    return smooth_training_curve([r["tokens"] for r in records], [r["loss"] for r in records])


def _legend_handles(any_failed: bool) -> list[Line2D]:
    handles = [Line2D([], [], color="grey", lw=0.8, label="stable run (constant LR), training loss"),
               Line2D([], [], color="grey", lw=1.8, label="cooldown branch, training loss"),
               Line2D([], [], color="grey", marker="o", markeredgecolor="black", ls="",
                      label="branch's final val_loss")]
    if any_failed:
        handles.append(Line2D([], [], color="grey", lw=0.8, ls="--",
                              label="failed run (a divergence may leave the axis)"))
    return handles
