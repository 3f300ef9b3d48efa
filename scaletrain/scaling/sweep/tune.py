"""`scaletrain sweep tune`: find the optimal LR (and optionally batch) at a few sizes and horizons, fit its
power law in N (or in N and D), then check the rule at the largest sizes and longest horizons.

Porian et al. 2024 ("Resolving Discrepancies in Compute-Optimal Scaling of Language Models") show that
LR and batch tuned per size are what make compute-optimal fits agree; OLMo-core's ladder and DeepSeek
LLM 2024 (sec. 3.1) both fit the optimum as a power law. Here each (size, horizon, seed, LR[, batch]) of
the spec's `tune:` grid trains as an ordinary sweep run under SWEEP/tune/runs/ (finished runs are skipped
on a re-run); tune_fit.py turns the final losses into eta*(N) or eta*(N, D). The result,
SWEEP/tune/tuned.json, is what a spec's `hyperparameters.lr: {rule: tuned}` plans with. With
`tune.check`, the rule is then trained at 0.5x/1x/2x where it extrapolates furthest (lr_check.py,
SWEEP/tune/check.json), before any ladder run relies on it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import load_config
from scaletrain.scaling.sweep.hyperparams import (
    TUNE_DIR,
    BatchSetting,
    HyperparameterRules,
    LearningRateSetting,
    as_prior,
    tuned_path,
)
from scaletrain.scaling.sweep.plan import PlannedRun, SweepPlan, ladder_rungs, plan_sweep
from scaletrain.scaling.sweep.shapes import shape_counts
from scaletrain.scaling.sweep.spec import (
    DownstreamOptions,
    Horizons,
    ModelLadder,
    ModelShape,
    SeedRepeats,
    SweepSpec,
    load_sweep_spec,
)
from scaletrain.scaling.sweep.tune_fit import GridResult, TuningFit, fit_tuning

TUNING_PLOT = "lr_tuning.png"


@dataclass(frozen=True)
class GridPoint:
    """What one run of SWEEP/tune stands for: its multipliers of the centre's LR and batch, the spec's
    horizon it trains at and its planned tokens (the D of the rule)."""

    lr_multiplier: float
    batch_multiplier: float
    horizon: float
    tokens: float


@dataclass(frozen=True)
class PointRuns:
    """The runs of one (shape, horizon) around a centre rule, for tune_runs: each seed x batch x LR multiplier."""

    shape: ModelShape
    horizon: float
    tokens: float
    seeds: list[int]
    lr_multipliers: list[float]
    batch_multipliers: list[float]  # empty: the rule's batch
    label: str = ""  # before each run name's multipliers ("check-": the LR check's runs)


def tune_plan(spec: SweepSpec, spec_path: str = "SPEC") -> tuple[SweepPlan, dict[str, GridPoint]]:
    """The grid as one sweep in SWEEP/tune, and what each run stands for."""
    if spec.tune is None:
        raise ConfigError(f"sweep {spec.name} has no `tune:` section; add one (sizes, lr_multipliers, tokens or "
                          "tokens_per_param) to tune its LR")
    base = load_config(spec.base, spec.overrides)
    seeds = spec.tune.tune_seeds(spec.seeds)
    points = [PointRuns(shape, horizon, tokens, seeds, spec.tune.lr_multipliers, spec.tune.batch_multipliers)
              for shape in _tune_shapes(spec, base) for horizon, tokens in horizon_tokens(spec.tune, base, shape)]
    return tune_runs(spec, as_prior(spec.hyperparameters), points, spec_path)


def horizon_tokens(horizons: Horizons, base: Config, shape: ModelShape) -> list[tuple[float, float]]:
    """(horizon, planned tokens) of each horizon at this shape: tokens, or tokens_per_param x N (total)."""
    key, values = horizons.horizons()
    total = shape_counts(base, shape).total_params
    return [(value, value if key == "tokens" else value * total) for value in values]


def tune_runs(spec: SweepSpec, rules: HyperparameterRules, points: list[PointRuns],
              spec_path: str = "SPEC") -> tuple[SweepPlan, dict[str, GridPoint]]:
    """The runs of `points` as one sweep in SWEEP/tune: each at the LR (and batch) that `rules` give its shape
    and tokens, times its multipliers. `rules` must hold no `tuned` rule (as_prior, or with_tuned)."""
    runs, grid, warnings, first = [], {}, set(), None
    for point in points:
        centre = plan_sweep(_point_spec(spec, point.shape, point.tokens, rules, point.seeds[0]),
                            spec_path=spec_path).runs[0]
        for seed in point.seeds:
            for batch_multiplier in point.batch_multipliers or [1.0]:
                for lr_multiplier in point.lr_multipliers:
                    scaled = _scaled_rules(spec, rules, centre, lr_multiplier, batch_multiplier,
                                           bool(point.batch_multipliers))
                    label = point.label + f"lr{lr_multiplier:g}" + (
                        f"-b{batch_multiplier:g}" if point.batch_multipliers else "")
                    plan = plan_sweep(_point_spec(spec, point.shape, point.tokens, scaled, seed), label=label,
                                      spec_path=spec_path)
                    first = first or plan
                    if plan.runs[0].name in grid:
                        raise ConfigError(f"sweep {spec.name}: tune: two runs are both named {plan.runs[0].name}; "
                                          "horizons this close share a name: spread them apart")
                    runs.extend(plan.runs)
                    warnings.update(plan.warnings)
                    grid[plan.runs[0].name] = GridPoint(lr_multiplier, batch_multiplier, point.horizon, point.tokens)
    # SWEEP/tune/sweep.json stores the first point's spec (a valid grid spec); plan.json lists every run
    return dataclasses.replace(first, runs=runs, warnings=sorted(warnings)), grid


def _tune_shapes(spec: SweepSpec, base: Config) -> list[ModelShape]:
    if spec.tune.shapes:
        return spec.tune.shapes
    return ladder_rungs(spec, base, spec.tune.sizes, "tune.sizes")


def _point_spec(spec: SweepSpec, shape: ModelShape, tokens: float, rules: HyperparameterRules,
                seed: int) -> SweepSpec:
    """One grid point as a grid-mode sweep of one run in SWEEP/tune, without the downstream tasks (the LR fit
    reads the loss only)."""
    return dataclasses.replace(spec, mode="grid", budgets=[], tokens=[tokens], dir=str(Path(spec.dir) / TUNE_DIR),
                               models=ModelLadder(shapes=[shape]), seeds=[seed], repeat_seeds=SeedRepeats(),
                               hyperparameters=rules, tune=None, downstream=DownstreamOptions())


def _scaled_rules(spec: SweepSpec, rules: HyperparameterRules, centre: PlannedRun, lr_multiplier: float,
                  batch_multiplier: float, scale_batch: bool) -> HyperparameterRules:
    """The rules with LR (and batch) fixed at the grid point: the centre's value times the multiplier."""
    min_lr_ratio = rules.lr.min_lr_ratio if rules.lr is not None else spec.learning_rate.min_lr_ratio
    changes = {"lr": LearningRateSetting(rule="fixed", value=centre.lr * lr_multiplier, min_lr_ratio=min_lr_ratio)}
    if scale_batch:
        changes["batch_size"] = BatchSetting(rule="fixed", value=centre.batch_size * batch_multiplier)
    return dataclasses.replace(rules, **changes)


def tune_sweep(spec_path: Path, log: callable = print, jobs: int = 1) -> str:
    """Train the grid's unfinished runs, fit, write SWEEP/tune/tuned.json and the plot, then (with
    `tune.check`) train and judge the LR check; returns the report."""
    # Imported on use for speed: they load the training loop (torch, DeepSpeed), which planning and
    # fitting a grid (tune_plan, fit_tuning) do not need.
    from scaletrain.scaling.sweep.executors import run_local
    from scaletrain.scaling.sweep.lr_check import check_rule
    from scaletrain.scaling.sweep.results import result_row, write_results_csv
    from scaletrain.scaling.sweep.tune_plot import plot_tuning

    spec = load_sweep_spec(spec_path)
    plan, grid = tune_plan(spec, str(spec_path))
    for warning in plan.warnings:
        log(f"warning: {warning}")
    outcome = run_local(plan, log=log, jobs=jobs)
    rows = [result_row(run.to_row(), plan.run_dir(run)) for run in plan.runs]
    results_path = write_results_csv(plan.directory, rows)
    count = spec.hyperparameters.lr.count if spec.hyperparameters.lr is not None else "total"
    results = grid_results(plan.runs, rows, grid, count)
    try:
        fit = fit_tuning(results, bool(spec.tune.batch_multipliers), spec.tune.unstable_neighbour)
    except ConfigError as error:
        raise ConfigError(f"sweep {spec.name}: tuning: {error} (grid losses in {results_path})") from None
    path = write_tuned(plan.directory, fit, results, grid, count, spec.tune.horizons()[0])
    plot = plot_tuning(results, fit, plan.directory / TUNING_PLOT)
    report = _report(spec, spec_path, outcome, fit, path, plot)
    if spec.tune.check is not None:
        report += check_rule(spec, str(spec_path), plan, results, log, jobs)
    return report


def grid_results(runs: list[PlannedRun], rows: list[dict], grid: dict[str, GridPoint], count: str) -> list[GridResult]:
    """The runs' final validation losses (inf where a run failed or diverged), with what each stands for."""
    results = []
    for run, row in zip(runs, rows, strict=True):
        loss = row["val_loss"] if row["status"] == "done" and row["val_loss"] is not None else math.inf
        params = run.counts.non_embedding_params if count == "non_embedding" else run.counts.total_params
        point = grid[run.name]
        results.append(GridResult(params=params, tokens=point.tokens, lr=run.lr, batch_size=run.batch_size,
                                  loss=loss if math.isfinite(loss) else math.inf, seed=run.seed, name=run.name,
                                  horizon=point.horizon))
    return results


def write_tuned(tune_dir: Path, fit: TuningFit, results: list[GridResult], grid: dict[str, GridPoint], count: str,
                horizon_key: str) -> Path:
    """SWEEP/tune/tuned.json: the fitted laws (what a `tuned` rule reads: tokens_exponent null where one horizon
    fits N alone), the horizons and seeds trained, the optimum per (size, horizon), the grid."""
    payload = {
        "lr": {**dataclasses.asdict(fit.lr), "count": count},
        **({"batch_size": {**dataclasses.asdict(fit.batch_size), "count": count}} if fit.batch_size else {}),
        "horizons": {horizon_key: fit.horizons},
        "seeds": fit.seeds,
        "optima": [{key: value for key, value in dataclasses.asdict(o).items() if key != "parabola"}
                   for o in fit.optima],
        "grid": [{**dataclasses.asdict(r), "loss": r.loss if math.isfinite(r.loss) else None,
                  "lr_multiplier": grid[r.name].lr_multiplier, "batch_multiplier": grid[r.name].batch_multiplier}
                 for r in results],
    }
    path = tuned_path(tune_dir.parent)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(payload, indent=2) + "\n")
    staging.replace(path)
    return path


def _report(spec: SweepSpec, spec_path: Path, outcome: object, fit: TuningFit, path: Path, plot: Path) -> str:
    lines = [f"sweep {spec.name} tune: trained {len(outcome.trained)} runs, skipped {len(outcome.skipped)} "
             f"already done, {len(outcome.failed)} failed"]
    lines += [f"  N={o.params:,}, D={o.tokens:.4g}: eta*={o.lr:.4g} (loss {o.loss:.4f}), batch {o.batch_size}"
              + (" (stability-limited: the next LR up diverged)" if o.stability_limited else "")
              for o in fit.optima]
    lines.append(f"lr: {fit.lr.formula('eta*')}" + (f" (seeds {', '.join(map(str, fit.seeds))} averaged in ln L)"
                                                    if len(fit.seeds) > 1 else ""))
    if fit.batch_size is not None:
        lines.append(f"batch: {fit.batch_size.formula('B*', 'sequences')}")
    lines.append(f"wrote {path} and {plot}; a spec with `hyperparameters: {{lr: {{rule: tuned}}}}` now plans with "
                 f"this LR: `scaletrain sweep plan {spec_path}`")
    return "\n".join(lines) + "\n"
