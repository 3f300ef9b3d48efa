"""`scaletrain sweep tune`: find the optimal LR (and optionally batch) at a few sizes and fit its power law in N.

Porian et al. 2024 ("Resolving Discrepancies in Compute-Optimal Scaling of Language Models") show that
LR and batch tuned per size are what make compute-optimal fits agree; OLMo-core's ladder and DeepSeek
LLM 2024 (sec. 3.1) both fit the optimum as a power law. Here each (size, LR[, batch]) of the spec's
`tune:` grid trains as an ordinary sweep run under SWEEP/tune/runs/ (finished runs are skipped on a
re-run); per size the final val_loss is fitted in ln(lr) by the parabola through the best grid point and
its two neighbours, whose vertex is eta*(N) (DeepSeek LLM fits its LR and batch optima on such grids);
then eta*(N) = c N^k by least squares in log-log. The result, SWEEP/tune/tuned.json, is what a spec's
`hyperparameters.lr: {rule: tuned}` plans with.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import load_config
from scaletrain.model.counts import model_counts
from scaletrain.scaling.sweep.hyperparams import (
    TUNE_DIR,
    BatchSetting,
    HyperparameterRules,
    LearningRateSetting,
    as_prior,
    tuned_path,
)
from scaletrain.scaling.sweep.plan import PlannedRun, SweepPlan, ladder_rungs, plan_sweep
from scaletrain.scaling.sweep.spec import ModelLadder, ModelShape, SeedRepeats, SweepSpec, load_sweep_spec

TUNING_PLOT = "lr_tuning.png"


@dataclass(frozen=True)
class GridResult:
    """One trained grid point: its size, LR, batch and final validation loss (inf where it failed or diverged)."""

    params: int
    lr: float
    batch_size: int
    loss: float
    name: str = ""


@dataclass(frozen=True)
class PowerLaw:
    """value x (N / reference_params)^exponent: the form `power` rules take (hyperparams.py)."""

    value: float
    reference_params: float
    exponent: float

    def __call__(self, params: float) -> float:
        return self.value * (params / self.reference_params) ** self.exponent


@dataclass(frozen=True)
class SizeOptimum:
    params: int
    lr: float  # the parabola's vertex
    loss: float  # the parabola's minimum
    batch_size: int
    parabola: tuple[float, float, float]  # loss = a ln(lr)^2 + b ln(lr) + c, through the best point's neighbours


@dataclass(frozen=True)
class TuningFit:
    lr: PowerLaw
    batch_size: PowerLaw | None
    optima: list[SizeOptimum]


def parabola_vertex(xs: list[float], losses: list[float], what: str) -> tuple[float, float, tuple]:
    """The vertex (x*, loss*) of the parabola through the lowest loss and its two neighbours on the grid `xs`
    (ascending), and the parabola's coefficients; refuses a best point at the grid's edge, where the optimum
    may lie outside it, and a neighbour that diverged."""
    best = int(np.argmin(losses))
    if best in (0, len(xs) - 1):
        side = "below" if best == 0 else "above"
        raise ConfigError(f"{what}: the lowest loss is at the {side}most grid point ({math.exp(xs[best]):.3g}); "
                          f"the optimum may lie {side} the grid: widen lr_multipliers (or batch_multipliers) {side}")
    window = slice(best - 1, best + 2)
    if not all(math.isfinite(loss) for loss in losses[window]):
        raise ConfigError(f"{what}: a neighbour of the best grid point failed or diverged; use finer multipliers "
                          "around the best one")
    a, b, c = np.polyfit(xs[window], losses[window], 2)
    vertex = -b / (2 * a)
    return float(vertex), float(c - b * b / (4 * a)), (float(a), float(b), float(c))


def fit_power_law(params: list[float], values: list[float]) -> PowerLaw:
    """ln value = ln c + k ln N by least squares, stated at the geometric mean of N (where value and
    exponent are least correlated)."""
    log_n, log_v = np.log(params), np.log(values)
    exponent, intercept = np.polyfit(log_n, log_v, 1)
    reference = float(np.exp(log_n.mean()))
    return PowerLaw(value=float(np.exp(intercept) * reference ** exponent), reference_params=reference,
                    exponent=float(exponent))


def fit_tuning(results: list[GridResult], tune_batch: bool) -> TuningFit:
    """Per size the LR optimum (at each batch, then the batch optimum in ln B over those minima), and the
    power laws in N through them."""
    optima = [_size_optimum([r for r in results if r.params == params], tune_batch)
              for params in sorted({r.params for r in results})]
    if len(optima) < 2:
        raise ConfigError("a power law in N needs grid results at two sizes at least; add sizes to `tune:`")
    params = [optimum.params for optimum in optima]
    batch = fit_power_law(params, [o.batch_size for o in optima]) if tune_batch else None
    return TuningFit(lr=fit_power_law(params, [o.lr for o in optima]), batch_size=batch, optima=optima)


def _size_optimum(results: list[GridResult], tune_batch: bool) -> SizeOptimum:
    per_batch = []
    for batch_size in sorted({r.batch_size for r in results}):
        grid = sorted((r for r in results if r.batch_size == batch_size), key=lambda r: r.lr)
        what = f"{results[0].params:,} parameters, batch {batch_size}"
        x, loss, parabola = parabola_vertex([math.log(r.lr) for r in grid], [r.loss for r in grid], what)
        per_batch.append(SizeOptimum(results[0].params, math.exp(x), loss, batch_size, parabola))
    if not tune_batch:
        return per_batch[0]
    batch_x, _, _ = parabola_vertex([math.log(o.batch_size) for o in per_batch], [o.loss for o in per_batch],
                                    f"{results[0].params:,} parameters, batch")
    nearest = min(per_batch, key=lambda o: abs(math.log(o.batch_size) - batch_x))
    return dataclasses.replace(nearest, batch_size=round(math.exp(batch_x)))


def tune_plan(spec: SweepSpec, spec_path: str = "SPEC") -> tuple[SweepPlan, dict[str, tuple[float, float]]]:
    """The grid as one sweep in SWEEP/tune, and each run's (lr multiplier, batch multiplier)."""
    if spec.tune is None:
        raise ConfigError(f"sweep {spec.name} has no `tune:` section; add one (sizes, lr_multipliers, tokens or "
                          "tokens_per_param) to tune its LR")
    base = load_config(spec.base, spec.overrides)
    runs, multipliers, warnings, first = [], {}, set(), None
    for shape in _tune_shapes(spec, base):
        tokens = spec.tune.tokens or spec.tune.tokens_per_param * model_counts(
            dataclasses.replace(base, model=dataclasses.replace(base.model, **dataclasses.asdict(shape)))).total_params
        point_spec = _point_spec(spec, shape, tokens, as_prior(spec.hyperparameters))
        centre = plan_sweep(point_spec, spec_path=spec_path).runs[0]
        for batch_multiplier in spec.tune.batch_multipliers or [1.0]:
            for lr_multiplier in spec.tune.lr_multipliers:
                rules = _scaled_rules(spec, centre, lr_multiplier, batch_multiplier)
                label = f"lr{lr_multiplier:g}" + (f"-b{batch_multiplier:g}" if spec.tune.batch_multipliers else "")
                plan = plan_sweep(_point_spec(spec, shape, tokens, rules), label=label, spec_path=spec_path)
                first = first or plan
                runs.extend(plan.runs)
                warnings.update(plan.warnings)
                multipliers[plan.runs[0].name] = (lr_multiplier, batch_multiplier)
    # SWEEP/tune/sweep.json stores the first point's spec (a valid grid spec); plan.json lists every run
    return dataclasses.replace(first, runs=runs, warnings=sorted(warnings)), multipliers


def _tune_shapes(spec: SweepSpec, base: Config) -> list[ModelShape]:
    if spec.tune.shapes:
        return spec.tune.shapes
    return ladder_rungs(spec, base, spec.tune.sizes, "tune.sizes")


def _point_spec(spec: SweepSpec, shape: ModelShape, tokens: float, rules: HyperparameterRules) -> SweepSpec:
    """One grid point as a grid-mode sweep of one run in SWEEP/tune."""
    return dataclasses.replace(spec, mode="grid", budgets=[], tokens=[tokens], dir=str(Path(spec.dir) / TUNE_DIR),
                               models=ModelLadder(shapes=[shape]), seeds=spec.seeds[:1], repeat_seeds=SeedRepeats(),
                               hyperparameters=rules, tune=None)


def _scaled_rules(spec: SweepSpec, centre: PlannedRun, lr_multiplier: float,
                  batch_multiplier: float) -> HyperparameterRules:
    """The rules with LR (and batch) fixed at the grid point: the centre's value times the multiplier."""
    rules = as_prior(spec.hyperparameters)
    min_lr_ratio = rules.lr.min_lr_ratio if rules.lr is not None else spec.learning_rate.min_lr_ratio
    changes = {"lr": LearningRateSetting(rule="fixed", value=centre.lr * lr_multiplier, min_lr_ratio=min_lr_ratio)}
    if spec.tune.batch_multipliers:
        changes["batch_size"] = BatchSetting(rule="fixed", value=centre.batch_size * batch_multiplier)
    return dataclasses.replace(rules, **changes)


def tune_sweep(spec_path: Path, log: callable = print) -> str:
    """Train the grid's unfinished runs, fit, write SWEEP/tune/tuned.json and the plot; returns the report."""
    # Imported on use for speed: they load the training loop (torch, DeepSpeed), which planning and
    # fitting a grid (tune_plan, fit_tuning) do not need.
    from scaletrain.scaling.sweep.executors import run_local
    from scaletrain.scaling.sweep.results import result_row, write_results_csv

    spec = load_sweep_spec(spec_path)
    plan, multipliers = tune_plan(spec, str(spec_path))
    for warning in plan.warnings:
        log(f"warning: {warning}")
    outcome = run_local(plan, log=log)
    rows = [result_row(run.to_row(), plan.run_dir(run)) for run in plan.runs]
    results_path = write_results_csv(plan.directory, rows)
    count = spec.hyperparameters.lr.count if spec.hyperparameters.lr is not None else "total"
    results = [_grid_result(run, row, count) for run, row in zip(plan.runs, rows, strict=True)]
    try:
        fit = fit_tuning(results, bool(spec.tune.batch_multipliers))
    except ConfigError as error:
        raise ConfigError(f"sweep {spec.name}: tuning: {error} (grid losses in {results_path})") from None
    path = write_tuned(plan.directory, fit, results, multipliers, count)
    plot = plot_tuning(results, fit, plan.directory / TUNING_PLOT)
    return _report(spec, spec_path, outcome, fit, path, plot)


def _grid_result(run: PlannedRun, row: dict, count: str) -> GridResult:
    loss = row["val_loss"] if row["status"] == "done" and row["val_loss"] is not None else math.inf
    params = run.counts.non_embedding_params if count == "non_embedding" else run.counts.total_params
    return GridResult(params=params, lr=run.lr, batch_size=run.batch_size,
                      loss=loss if math.isfinite(loss) else math.inf, name=run.name)


def write_tuned(tune_dir: Path, fit: TuningFit, results: list[GridResult], multipliers: dict[str, tuple],
                count: str) -> Path:
    """SWEEP/tune/tuned.json: the fitted laws (what a `tuned` rule reads), the per-size optima, the grid."""
    payload = {
        "lr": {**dataclasses.asdict(fit.lr), "count": count},
        **({"batch_size": {**dataclasses.asdict(fit.batch_size), "count": count}} if fit.batch_size else {}),
        "optima": [{key: value for key, value in dataclasses.asdict(o).items() if key != "parabola"}
                   for o in fit.optima],
        "grid": [{**dataclasses.asdict(r), "loss": r.loss if math.isfinite(r.loss) else None,
                  "lr_multiplier": multipliers[r.name][0], "batch_multiplier": multipliers[r.name][1]}
                 for r in results],
    }
    path = tuned_path(tune_dir.parent)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(payload, indent=2) + "\n")
    staging.replace(path)
    return path


def plot_tuning(results: list[GridResult], fit: TuningFit, path: Path) -> Path:
    """Loss against LR per size (at its best batch), the parabolas, and the fitted law's eta*(N)."""
    import matplotlib  # imported on use for speed: matplotlib costs seconds

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for index, optimum in enumerate(fit.optima):
        color = f"C{index}"
        grid = sorted((r for r in results if r.params == optimum.params and math.isfinite(r.loss)
                       and r.batch_size == _nearest_batch(results, optimum)), key=lambda r: r.lr)
        axes.plot([r.lr for r in grid], [r.loss for r in grid], "o", color=color,
                  label=f"N={optimum.params:.3g}: eta*={optimum.lr:.3g}")
        x = np.linspace(math.log(grid[0].lr), math.log(grid[-1].lr), 100)
        axes.plot(np.exp(x), np.polyval(optimum.parabola, x), "-", color=color, alpha=0.6)
        axes.axvline(fit.lr(optimum.params), color=color, linestyle=":", alpha=0.8)
    axes.set_xscale("log")
    axes.set(xlabel="peak learning rate", ylabel="final validation loss",
             title=f"LR tuning: eta*(N) = {fit.lr.value:.3g} (N/{fit.lr.reference_params:.3g})^{fit.lr.exponent:.3f} "
                   "(dotted)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _nearest_batch(results: list[GridResult], optimum: SizeOptimum) -> int:
    batches = {r.batch_size for r in results if r.params == optimum.params}
    return min(batches, key=lambda b: abs(math.log(b / optimum.batch_size)))


def _report(spec: SweepSpec, spec_path: Path, outcome: object, fit: TuningFit, path: Path, plot: Path) -> str:
    lines = [f"sweep {spec.name} tune: trained {len(outcome.trained)} runs, skipped {len(outcome.skipped)} "
             f"already done, {len(outcome.failed)} failed"]
    lines += [f"  N={o.params:,}: eta*={o.lr:.4g} (loss {o.loss:.4f}), batch {o.batch_size}" for o in fit.optima]
    lines.append(f"lr: eta*(N) = {fit.lr.value:.4g} x (N / {fit.lr.reference_params:.4g})^{fit.lr.exponent:.4f}")
    if fit.batch_size is not None:
        law = fit.batch_size
        lines.append(f"batch: B*(N) = {law.value:.4g} x (N / {law.reference_params:.4g})^{law.exponent:.4f} sequences")
    lines.append(f"wrote {path} and {plot}; a spec with `hyperparameters: {{lr: {{rule: tuned}}}}` now plans with "
                 f"this LR: `scaletrain sweep plan {spec_path}`")
    return "\n".join(lines) + "\n"
