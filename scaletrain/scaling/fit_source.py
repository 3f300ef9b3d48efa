"""`scaletrain fit SOURCE`: read runs from a sweep directory or a CSV, fit the three approaches of
Hoffmann et al. 2022 (fit.py), write fit.json and the plots (fit_plots.py), and return the summary.

SOURCE is a sweep directory (results.csv, of which the `done` rows count, with val_loss as the
loss; and each run's runs/NAME/metrics.jsonl, whose training losses give Approach 1's curves), or
a CSV with columns params,tokens,loss (optional flops, default 6 N D, and budget) so published
data can be refitted. The output goes to a temporary directory beside --out, renamed onto it at the
end: a bad input raises one ValueError and leaves nothing on disk.

fit.json (strict JSON; null for a number that is undefined, an interval with too few refits, or a
skipped approach; every interval is [low, high], the 95% bootstrap percentile interval):
    source, params_column, num_points, num_curves, bootstrap, seed, target_flops
    approach1: {a, a_ci, b, b_ci, n_coefficient, d_coefficient, bootstrap_fits, smoothing,
                frontier: [{flops, params, tokens, loss}]}
    approach2: {a, a_ci, b, b_ci, n_coefficient, d_coefficient, bootstrap_fits,
                budgets: [{flops, budget, sizes, n_opt, d_opt, loss_min, parabola: [c2, c1, c0] in ln N,
                           parabola_tokens: [c2, c1, c0] in ln D, bracketed}],
                excluded_budgets: [{flops, reason}]}
    approach3: {E, A, B, alpha, beta, a, b and each one's _ci, huber_delta, objective, starts,
                bootstrap_starts, bootstrap_fits}
    predictions: [{flops, approach1|approach2|approach3: {n_opt, d_opt, tokens_per_param (approach3: and
                   loss), each with _ci}}]
    skipped: {approach: reason}
    published: {name: {a, b}}, the exponents the summary compares with
N_opt ∝ C^a = n_coefficient C^a and D_opt ∝ C^b = d_coefficient C^b.
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

from scaletrain.scaling.fit import (
    APPROACHES,
    BOOTSTRAP_GRID_STARTS,
    HUBER_DELTA,
    MIN_BOOTSTRAP_FITS,
    SMOOTHING_FRACTION,
    Curve,
    EnvelopeFit,
    FitData,
    IsoFlopFit,
    ParametricFit,
    Point,
    ScalingFit,
    compute_optimal,
    fit_scaling_laws,
    percentile_interval,
    smooth_training_curve,
)
from scaletrain.scaling.fit_arguments import DEFAULT_BOOTSTRAP, PARAMS_COLUMNS
from scaletrain.scaling.fit_plots import write_plots

SWEEP_COLUMNS = ("name", "status", "budget", "tokens", "flops", "flops_per_token", "val_loss")
FIT_FILE = "fit.json"
# N_opt ∝ C^a, D_opt ∝ C^b: Hoffmann et al. 2022, Table 2; Kaplan et al. 2020, sec. 6.1 (N ∝ C^0.73).
PUBLISHED = {
    "Chinchilla approach 1": {"a": 0.50, "b": 0.50}, "Chinchilla approach 2": {"a": 0.49, "b": 0.51},
    "Chinchilla approach 3": {"a": 0.46, "b": 0.54}, "Kaplan et al. 2020": {"a": 0.73, "b": 0.27},
}
APPROACH_TITLES = {"approach1": "1 envelope (sec. 3.1)", "approach2": "2 IsoFLOP (sec. 3.2)",
                   "approach3": "3 parametric (sec. 3.3)"}


def fit_from_args(args: argparse.Namespace) -> str:
    report, _, _ = run_fit(args.source, args.out, args.target_flops, args.bootstrap, args.params_column, args.seed)
    return report


def fit_sweep_directory(sweep_dir: Path, out_dir: Path, target_flops: list[float] | None, bootstrap: int,
                        params_column: str) -> tuple[str, dict[str, Any], list[Path]]:
    """The end of `scaletrain sweep run` (sweep/finalize.py): fit SWEEP into out_dir."""
    return run_fit(sweep_dir, out_dir, target_flops, bootstrap, params_column)


def run_fit(
    source: Path, out_dir: Path | None = None, target_flops: list[float] | None = None,
    bootstrap: int = DEFAULT_BOOTSTRAP, params_column: str = "params", seed: int = 0,
) -> tuple[str, dict[str, Any], list[Path]]:
    """Read, fit, write fit.json and the plots; returns (summary, fit.json's content, the plot paths)."""
    source = Path(source)
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(source)
    _check_options(out_dir, target_flops, bootstrap, params_column)
    data = read_source(source, params_column)
    targets = sorted(target_flops or default_targets(data))
    result = fit_scaling_laws(data, bootstrap, seed)
    document = fit_document(result, data, targets, str(source), params_column, bootstrap)
    plots = publish(out_dir, document, result, data, targets)
    report = format_summary(document) + f"wrote {out_dir / FIT_FILE} and {len(plots)} plots\n"
    return report, document, plots


def default_out_dir(source: Path) -> Path:
    return source / "fit" if source.is_dir() else source.with_name(f"{source.stem}_fit")


def default_targets(data: FitData) -> list[float]:
    largest = max(point.flops for point in data.points)
    return [10 * largest, 100 * largest]


def _check_options(out_dir: Path, target_flops: list[float] | None, bootstrap: int, params_column: str) -> None:
    if bootstrap < 0:
        raise ValueError(f"--bootstrap {bootstrap} must be >= 0 (0 skips the intervals)")
    if target_flops is not None and not all(math.isfinite(c) and c > 0 for c in target_flops):
        raise ValueError(f"--target-flops {' '.join(map(str, target_flops))}: every budget must be a positive "
                         "number of FLOPs, e.g. 1e23")
    if params_column not in PARAMS_COLUMNS:
        raise ValueError(f"--params-column {params_column!r} is unknown; use one of {', '.join(PARAMS_COLUMNS)}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file; pass a directory (it is replaced as a whole)")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / FIT_FILE).is_file():
        raise ValueError(f"--out {out_dir} holds files but no {FIT_FILE}, and the output replaces the directory as "
                         "a whole; pass a new directory or an earlier fit's")


# ---------------------------------------------------------------------------------------------
# Reading a source


def read_source(source: Path, params_column: str = "params") -> FitData:
    if source.is_dir():
        return _read_sweep(source, params_column)
    if not source.is_file():
        raise ValueError(f"{source} does not exist; pass a sweep directory (with results.csv) or a CSV with "
                         "columns params,tokens,loss")
    return _read_csv(source, params_column)


def _read_csv(path: Path, params_column: str) -> FitData:
    rows = _csv_rows(path, (params_column, "tokens", "loss"), "a CSV of runs needs columns params,tokens,loss "
                     "(optional flops, budget)")
    points = []
    for line, row in rows:
        params, tokens, loss = (_positive(row, column, path, line) for column in (params_column, "tokens", "loss"))
        flops = _positive(row, "flops", path, line) if row.get("flops") else 6.0 * params * tokens
        budget = _positive(row, "budget", path, line) if row.get("budget") else None
        points.append(Point(params, tokens, flops, loss, budget))
    return FitData(points, [None] * len(points))


def _read_sweep(sweep_dir: Path, params_column: str) -> FitData:
    results = sweep_dir / "results.csv"
    if not results.is_file():
        raise ValueError(f"{sweep_dir} has no results.csv; pass a sweep directory (`scaletrain sweep status` "
                         "writes results.csv) or a CSV with columns params,tokens,loss")
    rows = _csv_rows(results, (*SWEEP_COLUMNS, params_column), "a sweep's results.csv is written by "
                     "`scaletrain sweep status`")
    done = [(line, row) for line, row in rows if row["status"] == "done"]
    if not done:
        states = sorted({row["status"] for _, row in rows})
        raise ValueError(f"{results} has no finished run (status done; found {', '.join(states)}); "
                         "finish runs with `scaletrain sweep run` first")
    points, curves = [], []
    for line, row in done:
        params = _positive(row, params_column, results, line)
        budget = _positive(row, "budget", results, line) if row["budget"] else None
        points.append(Point(params, _positive(row, "tokens", results, line), _positive(row, "flops", results, line),
                            _positive(row, "val_loss", results, line), budget))
        curves.append(_training_curve(sweep_dir / "runs" / row["name"] / "metrics.jsonl", params,
                                      _positive(row, "flops_per_token", results, line)))
    return FitData(points, curves)


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


def _csv_rows(path: Path, required: tuple[str, ...], hint: str) -> list[tuple[int, dict[str, str]]]:
    """(line number as an editor shows it, row) for every row; the header must hold `required`."""
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        header = reader.fieldnames or []
        missing = [column for column in required if column not in header]
        if missing:
            raise ValueError(f"{path} lacks column(s) {', '.join(missing)} (found: {', '.join(header) or 'none'}); "
                             f"{hint}")
        rows = [(reader.line_num, row) for row in reader]
    if not rows:
        raise ValueError(f"{path} has a header but no rows; add one row per run")
    return rows


def _positive(row: dict[str, str], column: str, path: Path, line: int) -> float:
    text = row.get(column)
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}, row at line {line}: {column}={text!r} is not a positive number; "
                         "fix or remove the row")
    return value


# ---------------------------------------------------------------------------------------------
# fit.json


def fit_document(result: ScalingFit, data: FitData, targets: list[float], source: str, params_column: str,
                 bootstrap: int) -> dict[str, Any]:
    """fit.json's content (the structure is in the module docstring)."""
    document: dict[str, Any] = {
        "source": source, "params_column": params_column, "num_points": len(data.points),
        "num_curves": sum(curve is not None for curve in data.curves), "bootstrap": bootstrap,
        "seed": result.seed, "target_flops": list(targets),
    }
    for approach in APPROACHES:
        document[approach] = _approach_document(result, approach) if approach in result.fits else None
    document["predictions"] = [_prediction_document(result, flops) for flops in targets]
    document["skipped"] = dict(result.skipped)
    document["published"] = PUBLISHED
    return _strict(document)


def _with_intervals(values: dict[str, float], samples: list[dict[str, float]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in values.items():
        document[key] = value
        document[f"{key}_ci"] = percentile_interval([sample[key] for sample in samples])
    return document


def _approach_document(result: ScalingFit, approach: str) -> dict[str, Any]:
    fit, samples = result.fits[approach], result.samples(approach)
    document = _with_intervals(fit.constants(), [sample.constants() for sample in samples])
    document["bootstrap_fits"] = len(samples)
    if isinstance(fit, EnvelopeFit):
        document.update(n_coefficient=fit.n_law.coefficient, d_coefficient=fit.d_law.coefficient,
                        smoothing=f"centred rolling mean over {SMOOTHING_FRACTION:.0%} of each run's records",
                        frontier=[vars(point) for point in fit.frontier])
    elif isinstance(fit, IsoFlopFit):
        document.update(n_coefficient=fit.n_law.coefficient, d_coefficient=fit.d_law.coefficient,
                        budgets=[vars(minimum) for minimum in fit.minima],
                        excluded_budgets=[{"flops": flops, "reason": reason} for flops, reason in fit.excluded])
    elif isinstance(fit, ParametricFit):
        document.update(huber_delta=HUBER_DELTA, objective=fit.objective, starts=fit.starts,
                        bootstrap_starts=1 + BOOTSTRAP_GRID_STARTS)
    return document


def _prediction_document(result: ScalingFit, flops: float) -> dict[str, Any]:
    document: dict[str, Any] = {"flops": flops}
    for approach in APPROACHES:
        fit = result.fits.get(approach)
        document[approach] = None if fit is None else _with_intervals(
            compute_optimal(fit, flops), [compute_optimal(sample, flops) for sample in result.samples(approach)])
    return document


def _strict(tree: Any) -> Any:
    """Plain JSON types; non-finite numbers become null (fit.json is strict JSON)."""
    if isinstance(tree, dict):
        return {str(key): _strict(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_strict(value) for value in tree]
    if isinstance(tree, bool) or tree is None or isinstance(tree, str):
        return tree
    if isinstance(tree, int):
        return tree
    value = float(tree)
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------
# Writing


def publish(out_dir: Path, document: dict[str, Any], result: ScalingFit, data: FitData,
            targets: list[float]) -> list[Path]:
    """fit.json and the plots into a temporary directory beside out_dir, then renamed onto it (an
    existing out_dir is replaced). Returns the plots' final paths."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        (staging / FIT_FILE).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
        names = [path.name for path in write_plots(result, data, targets, staging)]
        staging.chmod(0o755)
        if out_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, retired / out_dir.name)
            os.replace(staging, out_dir)
            shutil.rmtree(retired)
        else:
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out_dir / name for name in names]


# ---------------------------------------------------------------------------------------------
# The printed summary


def format_summary(document: dict[str, Any]) -> str:
    """The constants with their intervals against the published ones, then the predictions."""
    lines = [f"scaling-law fit of {document['num_points']} runs from {document['source']} "
             f"(N = {document['params_column']}; {document['bootstrap']} bootstrap resamples, seed "
             f"{document['seed']}; [95% percentile intervals])",
             f"{'approach':<26}{'a: N_opt ∝ C^a':<30}{'b: D_opt ∝ C^b':<30}bootstrap refits that succeeded"]
    for approach in APPROACHES:
        values = document[approach]
        if values is None:
            lines.append(f"{APPROACH_TITLES[approach]:<26}skipped: {document['skipped'][approach]}")
        else:
            lines.append(f"{APPROACH_TITLES[approach]:<26}{_number(values, 'a'):<30}{_number(values, 'b'):<30}"
                         f"{values['bootstrap_fits']} of {document['bootstrap']}")
    if document["bootstrap"]:
        lines.append(f"(an interval needs >= {MIN_BOOTSTRAP_FITS} successful refits; a refit fails where a resample "
                     "repeats runs until an approach's minimum is not met)")
    lines.append("published: " + "; ".join(f"{name} a={v['a']:.2f} b={v['b']:.2f}" for name, v in PUBLISHED.items()))
    if document["approach3"] is not None:
        lines += _parametric_lines(document["approach3"])
    lines.append("compute-optimal allocation at the target budgets (C = 6ND):")
    lines.append(f"  {'C':<10}{'approach':<10}{'N*':<31}{'D*':<31}{'D*/N*':<24}loss")
    for prediction in document["predictions"]:
        for approach in APPROACHES:
            values = prediction[approach]
            if values is not None:
                loss = _number(values, "loss") if "loss" in values else ""
                lines.append(f"  {prediction['flops']:<10.3g}{approach[-1]:<10}{_number(values, 'n_opt'):<31}"
                             f"{_number(values, 'd_opt'):<31}{_number(values, 'tokens_per_param'):<24}{loss}")
    return "\n".join(lines) + "\n"


def _parametric_lines(values: dict[str, Any]) -> list[str]:
    constants = "  ".join(f"{key} {_number(values, key)}" for key in ("E", "A", "B", "alpha", "beta"))
    return [
        f"approach 3: L(N, D) = E + A / N^alpha + B / D^beta; Huber (delta {values['huber_delta']:g}) on ln L, "
        f"L-BFGS from {values['starts']:,} grid starts, objective {values['objective']:.4g}",
        f"  {constants}",
        "  (Chinchilla: E 1.69  A 406.4  B 410.7  alpha 0.34  beta 0.28); bootstrap refits start from the "
        f"full-data optimum and the {values['bootstrap_starts'] - 1} grid starts best on all runs",
    ]


def _number(values: dict[str, Any], key: str) -> str:
    value, interval = values.get(key), values.get(f"{key}_ci")
    text = "n/a" if value is None else f"{value:.3g}"
    return f"{text} [{interval[0]:.3g}, {interval[1]:.3g}]" if interval else text
