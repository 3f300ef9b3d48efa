"""Reading the runs that `scaletrain fit` fits or checks: a sweep directory or a CSV, their data
fingerprints (runs on other data are refused), seeds and the corpus's unique tokens.

A sweep directory gives its results.csv's `done` rows (rewritten from its run directories first:
refresh_results) that are points of the law (not a ladder's stable runs, which are never cooled down:
their branches are the points), with val_loss as the loss,
each run's training curve (metrics.jsonl, for the plots) and plan.json's train_tokens as the unique
tokens. A CSV gives its rows (a sweep's results.csv: its done points), columns params,tokens,loss or
val_loss, optional flops (default 6ND), budget, seed, unique_tokens, data_fingerprint, and any downstream
task metrics as columns downstream/TASK/METRIC (sweep/layout.py; the ladder's downstream prediction fits them,
downstream.py).

Exclusion rules (fit_arguments.parse_exclusion, e.g. "num_layers < 2") remove runs from the runs
read, in order, each counted by the runs it removed.

N is the active parameters by default (fit_arguments.PARAMS_COLUMNS): a mixture of experts' results
record active_params beside params (the total), and its FLOPs per token, so its compute, follow the
active ones. A row without an active count (a CSV written before the column existed, or one with only
params) has active = total, which is exact for the dense models such rows come from.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.scaling.fit import Curve, FitData, Point, smooth_training_curve
from scaletrain.scaling.fit_arguments import DEFAULT_PARAMS_COLUMN, Exclusion, parse_exclusion
from scaletrain.scaling.sweep.layout import DOWNSTREAM_PREFIX, PLAN_FILE, RESULTS_FILE, RUNS_DIR

SWEEP_COLUMNS = ("name", "status", "budget", "tokens", "flops", "flops_per_token", "val_loss")
CSV_HINT = ("a CSV of runs needs columns params,tokens,loss (or val_loss; optional flops, budget, seed, "
            "unique_tokens, data_fingerprint)")
# results.csv's `role` (scaling/sweep/ladder.py): a ladder's stable run is not a point of the law.
NOT_A_POINT_ROLES = ("stable",)
Rows = list[tuple[int, dict[str, str]]]


@dataclass(frozen=True)
class Runs:
    """The runs read from a source: what the fit needs (data) and, per run, the row that names it (the
    run's name, or "line N" of the CSV) and the data fingerprint recorded for it (None: not recorded);
    `exclusions`: each exclusion rule and how many runs it removed."""

    data: FitData
    labels: list[str]
    fingerprints: list[str | None]
    path: Path
    exclusions: list[tuple[str, int]] = field(default_factory=list)
    task_values: list[dict[str, float]] = field(default_factory=list)

    @property
    def fingerprint(self) -> str | None:
        """The runs' one data fingerprint; None when no row records one (check_fingerprints refuses a mix)."""
        return next((value for value in self.fingerprints if value), None)


def read_source(source: Path, params_column: str = DEFAULT_PARAMS_COLUMN) -> FitData:
    return read_runs(source, params_column).data


def read_runs(source: Path, params_column: str = DEFAULT_PARAMS_COLUMN, exclude: Sequence[str] = ()) -> Runs:
    """A sweep directory (its results.csv's done rows, training curves, plan.json's train_tokens) or a
    CSV (a sweep's results.csv too: then its done rows, with val_loss as the loss), less the runs the
    `exclude` rules remove."""
    source = Path(source)
    rules = [parse_exclusion(rule) for rule in exclude]
    if source.is_dir():
        runs = _read_sweep(source, params_column, rules)
    elif source.is_file():
        runs = _read_csv(source, params_column, rules)
    else:
        raise ValueError(f"{source} does not exist; pass a sweep directory (with results.csv) or a CSV with "
                         "columns params,tokens,loss")
    check_fingerprints(runs.labels, runs.fingerprints, runs.path)
    return runs


def _read_csv(path: Path, params_column: str, rules: list[Exclusion]) -> Runs:
    rows, header = _csv_rows(path, (total_column(params_column), "tokens"), CSV_HINT)
    if "loss" not in header and "val_loss" not in header:
        raise ValueError(f"{path} lacks column(s) loss (found: {', '.join(header)}); {CSV_HINT}")
    if "status" in header:
        rows = _done_rows(rows, path)
    rows, removed = apply_exclusions(rows, header, rules, path)
    loss_column = "loss" if "loss" in header else "val_loss"
    unique_tokens = _train_tokens(path.parent) if path.name == RESULTS_FILE else None
    points = [_point(row, line, path, params_column, loss_column, unique_tokens) for line, row in rows]
    return Runs(FitData(points, [None] * len(points)), _labels(rows), _fingerprints(rows), path, removed,
                _task_values(rows, path))


def _read_sweep(sweep_dir: Path, params_column: str, rules: list[Exclusion]) -> Runs:
    refresh_results(sweep_dir)
    results = sweep_dir / RESULTS_FILE
    if not results.is_file():
        raise ValueError(f"{sweep_dir} has no results.csv; pass a sweep directory (`scaletrain sweep status` "
                         "writes results.csv) or a CSV with columns params,tokens,loss")
    rows, header = _csv_rows(results, (*SWEEP_COLUMNS, total_column(params_column)), "a sweep's results.csv is "
                             "written by `scaletrain sweep status`")
    done, removed = apply_exclusions(_done_rows(rows, results), header, rules, results)
    unique_tokens = _train_tokens(sweep_dir)
    points, curves = [], []
    for line, row in done:
        point = _point(row, line, results, params_column, "val_loss", unique_tokens)
        points.append(point)
        curves.append(_training_curve(sweep_dir / "runs" / row["name"] / "metrics.jsonl", point.params,
                                      _positive(row, "flops_per_token", results, line)))
    return Runs(FitData(points, curves), _labels(done), _fingerprints(done), results, removed,
                _task_values(done, results))


def refresh_results(sweep_dir: Path) -> None:
    """Rewrite SWEEP/results.csv from the run directories, as `sweep status` does, where every planned run has
    one (a sweep started here; an archive put back by `sweep restore` has only its finished runs' and is read
    as its results.csv says): a results.csv written before runs finished since would leave them out of the fit
    or the check without a word."""
    plan = sweep_dir / PLAN_FILE
    if not plan.is_file():
        return
    names = [run["name"] for run in json.loads(plan.read_text())["runs"]]
    if not names or not all((sweep_dir / RUNS_DIR / name).is_dir() for name in names):
        return
    from scaletrain.scaling.sweep.results import planned_rows, write_results_csv  # imports the training loop

    write_results_csv(sweep_dir, planned_rows(sweep_dir))


def apply_exclusions(rows: Rows, header: list[str], rules: list[Exclusion],
                     path: Path) -> tuple[Rows, list[tuple[str, int]]]:
    """The rows no rule removes, and (rule, rows it removed) per rule, applied in order. ValueError naming
    the rule and the fix for a column the source lacks, a cell the rule cannot compare, or no row left."""
    counts = []
    for rule in rules:
        if rule.column not in header:
            raise ValueError(f"exclusion {rule.rule!r}: {path} has no column {rule.column!r} (found: "
                             f"{', '.join(header)}); name one of those")
        kept = []
        for line, row in rows:
            try:
                excluded = rule.excludes(row.get(rule.column))
            except ValueError as error:
                raise ValueError(f"exclusion {rule.rule!r}, {path} row at line {line}: {error}") from None
            if not excluded:
                kept.append((line, row))
        counts.append((rule.rule, len(rows) - len(kept)))
        rows = kept
    if not rows and rules:
        raise ValueError(f"the exclusions {'; '.join(rule.rule for rule in rules)} remove every run of {path}; "
                         "loosen them")
    return rows, counts


def _done_rows(rows: Rows, path: Path) -> Rows:
    done = [(line, row) for line, row in rows
            if row["status"] == "done" and row.get("role") not in NOT_A_POINT_ROLES]
    if not done:
        states = sorted({row["status"] for _, row in rows})
        raise ValueError(f"{path} has no finished run (status done; found {', '.join(states)}); "
                         "finish runs with `scaletrain sweep run` first")
    return done


def _point(row: dict[str, str], line: int, path: Path, params_column: str, loss_column: str,
           unique_tokens: float | None) -> Point:
    """One run; FLOPs default to 6ND (Kaplan et al. 2020, sec. 2.1) where the row has none. A row's own
    unique_tokens (a CSV's column) wins over the sweep's train_tokens."""
    if not row.get(params_column):
        params_column = total_column(params_column)  # written before active counts were recorded: dense
    params, tokens, loss = (_positive(row, column, path, line) for column in (params_column, "tokens", loss_column))
    flops = _positive(row, "flops", path, line) if row.get("flops") else 6.0 * params * tokens
    budget = _positive(row, "budget", path, line) if row.get("budget") else None
    if row.get("unique_tokens"):
        unique_tokens = _positive(row, "unique_tokens", path, line)
    seed = None
    if row.get("seed"):
        seed = _positive(row, "seed", path, line, allow_zero=True)
        if not seed.is_integer():
            raise ValueError(f"{path}, row at line {line}: seed={row['seed']!r} is not an integer; "
                             "fix or remove the row")
    return Point(params, tokens, flops, loss, budget, unique_tokens, None if seed is None else int(seed))


def _task_values(rows: Rows, path: Path) -> list[dict[str, float]]:
    """Each row's filled downstream/TASK/METRIC cells as {TASK/METRIC: value}; an empty cell is a metric the
    run did not record."""
    values = []
    for line, row in rows:
        columns = [column for column, cell in row.items() if column and column.startswith(DOWNSTREAM_PREFIX)
                   and (cell or "").strip()]
        values.append({column.removeprefix(DOWNSTREAM_PREFIX): _finite(row, column, path, line)
                       for column in columns})
    return values


def _finite(row: dict[str, str], column: str, path: Path, line: int) -> float:
    try:
        value = float(row[column])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{path}, row at line {line}: {column}={row[column]!r} is not a number; fix the cell or "
                         "empty it (a metric the run did not record)")
    return value


def total_column(params_column: str) -> str:
    """The total count an active column falls back to: active_params -> params."""
    return params_column.removeprefix("active_")


def _labels(rows: list[tuple[int, dict[str, str]]]) -> list[str]:
    return [row.get("name") or f"line {line}" for line, row in rows]


def _fingerprints(rows: list[tuple[int, dict[str, str]]]) -> list[str | None]:
    return [(row.get("data_fingerprint") or "").strip() or None for _, row in rows]


def _train_tokens(sweep_dir: Path) -> float | None:
    """The sweep's training-split tokens (plan.json, plan.py's _train_tokens): the unique tokens a run
    can read, which the data-constrained law (Muennighoff et al. 2023) needs; None when not recorded."""
    plan = sweep_dir / PLAN_FILE
    if not plan.is_file():
        return None
    try:
        tokens = json.loads(plan.read_text()).get("train_tokens")
    except (json.JSONDecodeError, AttributeError):
        return None
    return float(tokens) if isinstance(tokens, (int, float)) and tokens > 0 else None


def check_fingerprints(labels: list[str], fingerprints: list[str | None], where: Path | str) -> None:
    """Refuse runs trained on different data: a loss on another tokenizer or validation set is in other
    units, and one law through both fits neither. Rows that record no fingerprint are accepted."""
    groups: dict[str, list[str]] = {}
    for label, value in zip(labels, fingerprints, strict=True):
        if value:
            groups.setdefault(value, []).append(label)
    if len(groups) > 1:
        described = ", ".join(f"rows {_row_names(names)} have {value[:16]}" for value, names in groups.items())
        raise ValueError(f"{where}: these runs were trained on different data (tokenizer/manifest/validation "
                         f"set): {described}; refit each group separately or re-run the stale runs")


def _row_names(names: list[str], shown: int = 6) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _training_curve(metrics: Path, params: float, flops_per_token: float) -> Curve | None:
    """The run's training records (those with loss and tokens; a step logged again after a resume
    replaces the first), smoothed (fit.smooth_training_curve); None without any."""
    records: dict[int, tuple[float, float]] = {}
    if metrics.is_file():
        for text in metrics.read_text().splitlines():
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and "loss" in record and "tokens" in record and "step" in record:
                records[record["step"]] = (float(record["tokens"]), float(record["loss"]))
    kept = [(tokens, loss) for _, (tokens, loss) in sorted(records.items())
            if tokens > 0 and math.isfinite(tokens) and math.isfinite(loss)]
    if not kept:
        return None
    tokens, losses = smooth_training_curve(*zip(*kept, strict=True))
    return Curve(params, tokens * flops_per_token, tokens, losses)


def _csv_rows(path: Path, required: tuple[str, ...], hint: str) -> tuple[list[tuple[int, dict[str, str]]], list[str]]:
    """((line number as an editor shows it, row) for every row, the header); the header must hold `required`."""
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        header = list(reader.fieldnames or [])
        missing = [column for column in required if column not in header]
        if missing:
            raise ValueError(f"{path} lacks column(s) {', '.join(missing)} (found: {', '.join(header) or 'none'}); "
                             f"{hint}")
        rows = [(reader.line_num, row) for row in reader]
    if not rows:
        raise ValueError(f"{path} has a header but no rows; add one row per run")
    return rows, header


def _positive(row: dict[str, str], column: str, path: Path, line: int, allow_zero: bool = False) -> float:
    text = row.get(column)
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{path}, row at line {line}: {column}={text!r} is not {kind} number; "
                         "fix or remove the row")
    return value
