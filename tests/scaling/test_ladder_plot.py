"""The ladder's figure with a run that diverged: the failed run is dashed and the loss axis spans the
finished runs, so a blow-up does not squeeze their curves (as the second English ladder's 16.8K run did)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from scaletrain.scaling.sweep.ladder_plot import draw_ladder
from scaletrain.scaling.sweep.layout import PLAN_FILE, RUNS_DIR
from scaletrain.scaling.sweep.results import write_status_file

STEPS = 60


def write_run(sweep_dir: Path, name: str, losses: np.ndarray, val_loss: float | None = None) -> None:
    run_dir = sweep_dir / RUNS_DIR / name
    run_dir.mkdir(parents=True)
    records = [{"step": step + 1, "tokens": 512 * (step + 1), "loss": float(loss)} for step, loss in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    if val_loss is not None:
        (run_dir / "summary.json").write_text(json.dumps({"step": STEPS, "tokens": 512 * STEPS, "val_loss": val_loss}))


def ladder_dir(tmp_path: Path, diverged: bool) -> Path:
    """Two sizes, a stable run and one cooldown branch each; the larger size's stable run may diverge."""
    runs = []
    for params, label in ((1.0e4, "small"), (4.0e4, "large")):
        runs += [{"name": f"stable-{label}", "role": "stable", "params": params},
                 {"name": f"c-{label}", "role": "branch", "params": params, "stable_run": f"stable-{label}"}]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / PLAN_FILE).write_text(json.dumps({"runs": runs}))
    falling = 4.0 + 2.0 * np.exp(-np.arange(STEPS) / 15)
    write_run(tmp_path, "stable-small", falling)
    write_run(tmp_path, "c-small", falling - 0.2, val_loss=float(falling[-1] - 0.25))
    if diverged:
        write_run(tmp_path, "stable-large", np.where(np.arange(STEPS) < 40, falling - 0.3, 8.5))
        write_status_file(tmp_path / RUNS_DIR / "stable-large", {"state": "failed", "returncode": 3})
        write_status_file(tmp_path / RUNS_DIR / "c-large", {"state": "failed", "reason": "its stable run failed"})
    else:
        write_run(tmp_path, "stable-large", falling - 0.3)
        write_run(tmp_path, "c-large", falling - 0.5, val_loss=float(falling[-1] - 0.55))
    return tmp_path


def test_a_diverged_run_is_dashed_and_off_the_top(tmp_path: Path) -> None:
    figure = draw_ladder(ladder_dir(tmp_path, diverged=True))
    try:
        (axis,) = [a for a in figure.axes if a.get_xlabel() == "training tokens D"]
        styles = sorted(line.get_linestyle() for line in axis.lines)
        assert styles == ["-", "-", "--"]  # the small size's stable run and branch; the failed stable run
        finished = np.concatenate([line.get_ydata() for line in axis.lines if line.get_linestyle() == "-"])
        low, high = axis.get_ylim()
        assert low <= finished.min() and finished.max() <= high < 8.0
        labels = [text.get_text() for text in axis.get_legend().get_texts()]
        assert "failed run (a divergence may leave the axis)" in labels
    finally:
        plt.close(figure)


def test_without_failures_the_axis_is_matplotlibs(tmp_path: Path) -> None:
    figure = draw_ladder(ladder_dir(tmp_path, diverged=False))
    try:
        (axis,) = [a for a in figure.axes if a.get_xlabel() == "training tokens D"]
        assert [line.get_linestyle() for line in axis.lines] == ["-"] * 4
        assert len(axis.get_legend().get_texts()) == 3
        assert axis.get_autoscaley_on()
    finally:
        plt.close(figure)
