"""`scaletrain fit SOURCE`: read runs from a sweep directory or a CSV, fit, and write fit.json + plots.

SOURCE is a sweep directory (its results.csv, and each run's metrics.jsonl for the training
curves of Approach 1) or a CSV with columns params,tokens,loss (optional flops, default 6·N·D,
and budget), so published data can be refitted too.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.scaling.fit import Curve, Point
from scaletrain.scaling.fit_plots import write_plots
from scaletrain.scaling.fit_report import FitInputs, fit_with_intervals, format_summary

CSV_COLUMNS = ("params", "tokens", "loss")
MIN_RUNS = 3
# Training losses are noisy step to step: Approach 1 reads them through a trailing mean over 5% of
# a run's steps (at least one), as Hoffmann et al. 2022 (sec. 3.1) smooth theirs.
CURVE_SMOOTHING = 0.05


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="a sweep directory, or a CSV with columns params,tokens,loss")
    parser.add_argument("--target-flops", type=float, nargs="+", metavar="C",
                        help="budgets to predict the compute-optimal model for (default: 10x and 100x the largest run)")
    parser.add_argument("--bootstrap", type=int, default=100, help="bootstrap refits for the 95%% intervals")
    parser.add_argument("--out", type=Path, help="output directory (default: SWEEP/fit or CSV_STEM_fit)")
    parser.add_argument("--params-column", choices=["params", "non_embedding_params"], default="params",
                        help="N: total parameters (Chinchilla) or without embeddings (Kaplan); sweeps record both")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")


def fit_from_args(args: argparse.Namespace) -> str:
    if args.bootstrap < 0:
        raise ValueError(f"--bootstrap {args.bootstrap} must be >= 0")
    if args.target_flops and min(args.target_flops) <= 0:
        raise ValueError(f"--target-flops {args.target_flops}: budgets must be positive")
    inputs = read_source(args.source, args.params_column)
    out_dir = args.out or (args.source / "fit" if args.source.is_dir() else
                           args.source.with_name(f"{args.source.stem}_fit"))
    report, _, _ = fit_and_write(inputs, out_dir, args.target_flops, args.bootstrap, args.seed)
    return report


def fit_sweep_directory(
    sweep_dir: Path, out_dir: Path, target_flops: list[float] | None, bootstrap: int, params_column: str,
) -> tuple[str, dict[str, Any], list[Path]]:
    return fit_and_write(read_source(sweep_dir, params_column), out_dir, target_flops, bootstrap, seed=0)


def fit_and_write(
    inputs: FitInputs, out_dir: Path, target_flops: list[float] | None, bootstrap: int, seed: int
) -> tuple[str, dict[str, Any], list[Path]]:
    """Fit, then write fit.json and the plots into a temporary directory renamed onto `out_dir`."""
    targets = sorted(target_flops or [10 * max(p.flops for p in inputs.points),
                                      100 * max(p.flops for p in inputs.points)])
    fit = {"source": inputs.source, "params_column": inputs.params_column, "num_points": len(inputs.points),
           **fit_with_intervals(inputs, targets, bootstrap, seed)}
    if all(approach not in fit for approach in ("approach1", "approach2", "approach3")):
        raise ValueError("no approach could fit these runs: " +
                         "; ".join(f"{name}: {reason}" for name, reason in fit["skipped"].items()))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        (staging / "fit.json").write_text(json.dumps(_strict(fit), indent=2, allow_nan=False) + "\n")
        names = [path.name for path in write_plots(fit, inputs, staging)]
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    plots = [out_dir / name for name in names]
    return format_summary(fit) + f"wrote {out_dir / 'fit.json'} and {len(plots)} plots\n", fit, plots


def read_source(source: Path, params_column: str = "params") -> FitInputs:
    if source.is_dir():
        return _read_sweep(source, params_column)
    if not source.is_file():
        raise ValueError(f"{source} does not exist; pass a sweep directory or a CSV with columns params,tokens,loss")
    return _read_csv(source)


def _read_csv(path: Path) -> FitInputs:
    rows = _csv_rows(path)
    missing = [column for column in CSV_COLUMNS if column not in rows[0]]
    if missing:
        raise ValueError(f"{path} has no column {', '.join(missing)}; a fit needs columns params,tokens,loss "
                         f"(optional flops, budget); found {', '.join(rows[0])}")
    points = []
    for number, row in enumerate(rows, start=2):  # line numbers as an editor shows them, header = 1
        params, tokens, loss = (_positive(row, column, path, number) for column in CSV_COLUMNS)
        flops = _positive(row, "flops", path, number) if row.get("flops") else 6.0 * params * tokens
        budget = _positive(row, "budget", path, number) if row.get("budget") else None
        points.append(Point(params, tokens, flops, loss, budget))
    _check_enough(points, path)
    return FitInputs(points, [None] * len(points), str(path), "params")


def _read_sweep(sweep_dir: Path, params_column: str) -> FitInputs:
    results = sweep_dir / "results.csv"
    if not results.is_file():
        raise ValueError(f"{sweep_dir} has no results.csv; is it a sweep directory? (`scaletrain sweep status` "
                         "writes it)")
    rows = [row for row in _csv_rows(results) if row.get("status") == "done"]
    if not rows:
        raise ValueError(f"{results} lists no finished run (status done); run `scaletrain sweep run` first")
    points, curves = [], []
    for number, row in enumerate(rows, start=2):
        params = _positive(row, params_column, results, number)
        budget = _positive(row, "budget", results, number) if row.get("budget") else None
        points.append(Point(params, _positive(row, "tokens", results, number), _positive(row, "flops", results, number),
                            _positive(row, "val_loss", results, number), budget))
        curves.append(_training_curve(sweep_dir / "runs" / row["name"] / "metrics.jsonl", params,
                                      _positive(row, "flops_per_token", results, number)))
    _check_enough(points, results)
    return FitInputs(points, curves, str(sweep_dir), params_column)


def _training_curve(metrics: Path, params: float, flops_per_token: float) -> Curve | None:
    records: dict[int, dict] = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in record and "tokens" in record:
                records[record["step"]] = record  # a step replayed after a resume replaces the first
    if not records:
        return None
    ordered = [records[step] for step in sorted(records)]
    tokens = np.array([r["tokens"] for r in ordered], dtype=float)
    losses = np.array([r["loss"] for r in ordered], dtype=float)
    window = max(1, math.ceil(CURVE_SMOOTHING * len(losses)))
    smoothed = np.convolve(losses, np.ones(window) / window, mode="valid")
    return Curve(params, tokens[window - 1:] * flops_per_token, tokens[window - 1:], smoothed)


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        raise ValueError(f"{path} holds no rows; it needs a header params,tokens,loss and one row per run")
    return rows


def _positive(row: dict[str, str], column: str, path: Path, line: int) -> float:
    text = row.get(column)
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}, line {line}: {column}={text!r} is not a positive number; fix or remove the row")
    return value


def _check_enough(points: list[Point], path: Path) -> None:
    if len(points) < MIN_RUNS:
        raise ValueError(f"{path}: {len(points)} runs are too few for a fit; the minimum is {MIN_RUNS} "
                         "(Approach 2 needs 3 sizes in each of 2 budgets, Approach 3 needs 6 runs)")


def _strict(tree: Any) -> Any:
    """fit.json is strict JSON: non-finite numbers become null."""
    if isinstance(tree, dict):
        return {key: _strict(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_strict(value) for value in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree
