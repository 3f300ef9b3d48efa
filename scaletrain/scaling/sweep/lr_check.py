"""The LR check of `sweep tune` (`tune.check`): the spec's LR rule at 0.5x, 1x and 2x (its multipliers) at
the largest sizes and longest horizons, where a rule fitted on small, short runs extrapolates furthest.

The issue this answers: the first ladder's rule was tuned at 46K-363K parameters on one 2M-token horizon
and used at 2.1M parameters and 23M tokens, unchecked. Per checked (size, horizon) the seeds' losses are
averaged in ln L; the rule holds there when its 1x is within noise of the best multiplier: ln L(1x) -
ln L(best) <= 2 sigma sqrt(2/k), twice the sd of the difference of two means of k seeds (sigma, the
run-to-run sd of ln L, pooled over the grid's and the check's seed repeats, or `check.sigma` with one
seed). Otherwise the verdict names the multiplier that won, by how much, and, where it is not at the
edge, the parabola's optimum in ln(multiplier). SWEEP/tune/check.json keeps the losses, the verdict
and the rule it judged, so `sweep plan` can tell a verdict from one about a rule since re-tuned.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.scaling.sweep.hyperparams import TUNE_DIR, HyperparameterRules, with_tuned
from scaletrain.scaling.sweep.plan import PlannedRun, SweepPlan, ladder_rungs, lr_setting, shape_label
from scaletrain.scaling.sweep.spec import SweepSpec
from scaletrain.scaling.sweep.tune import GridPoint, PointRuns, grid_results, horizon_tokens, tune_runs
from scaletrain.scaling.sweep.tune_fit import GridResult, parabola_vertex, seed_sigma

CHECK_FILE = "check.json"
CHECK_LABEL = "check-"


@dataclass(frozen=True)
class CheckedPoint:
    """One checked (size, horizon): the seed-mean loss per multiplier and what they say about the rule."""

    params: int
    tokens: float
    shape: str
    rule_lr: float  # the rule's LR here (1x)
    losses: dict[float, float]  # multiplier -> loss, seeds averaged in ln L (inf: a seed failed)
    best: float  # the multiplier with the lowest loss
    gap: float  # ln L(1x) - ln L(best), >= 0
    threshold: float  # 2 sigma sqrt(2/k)
    optimum: float | None  # the parabola's vertex (a multiplier) where the best is not at the edge

    @property
    def holds(self) -> bool:
        return self.gap <= self.threshold

    def verdict(self) -> str:
        where = f"N={self.params:,}, D={self.tokens:.3g}"
        if self.holds:
            return (f"{where}: the rule's 1x is within noise of the best ({self.best:g}x, "
                    f"{100 * self.gap:.2f}% <= {100 * self.threshold:.2f}%)")
        beyond = (f"the parabola puts the optimum at {self.optimum:.2f}x" if self.optimum is not None
                  else f"the optimum may lie beyond {self.best:g}x")
        return (f"{where}: {self.best:g}x beat the rule's 1x by {100 * self.gap:.2f}% in loss (more than the "
                f"noise, {100 * self.threshold:.2f}%); {beyond}")


def judge_point(params: int, tokens: float, shape: str, rule_lr: float, losses: dict[float, list[float]],
                sigma: float) -> CheckedPoint:
    """One checked (size, horizon) from its losses per multiplier of the rule's LR (one per seed), judged
    against the run-to-run sd `sigma` of ln L."""
    means = {multiplier: math.exp(sum(map(math.log, group)) / len(group)) if all(map(math.isfinite, group))
             else math.inf for multiplier, group in losses.items()}
    keys = sorted(means)
    best = min(keys, key=lambda key: means[key])
    if not math.isfinite(means[best]) or 1.0 not in means:
        raise ConfigError(f"tune.check at {params:,} parameters, {tokens:.3g} tokens: every run failed, or the "
                          "rule's own LR (1x) is missing; see SWEEP/tune/results.csv")
    seeds = min(len(group) for group in losses.values())
    gap = math.log(means[1.0]) - math.log(means[best]) if math.isfinite(means[1.0]) else math.inf
    optimum = None
    if best not in (keys[0], keys[-1]):
        try:
            vertex, _, _ = parabola_vertex([math.log(key) for key in keys], [means[key] for key in keys], "check")
            optimum = math.exp(vertex)
        except ConfigError:  # a neighbour of the best diverged: no parabola
            optimum = None
    return CheckedPoint(params, tokens, shape, rule_lr, means, best, gap, 2 * sigma * math.sqrt(2 / seeds), optimum)


def check_rule(spec: SweepSpec, spec_path: str, grid_plan: SweepPlan, grid: list[GridResult], log: callable,
               jobs: int = 1) -> str:
    """Train the check after the grid (the grid's runs stay in SWEEP/tune's plan and results, done), judge
    it, write SWEEP/tune/check.json; returns the report's lines."""
    from scaletrain.scaling.sweep.executors import run_local  # on use for speed: the training loop
    from scaletrain.scaling.sweep.results import result_row, write_results_csv

    check = spec.tune.check
    rules = with_tuned(spec.hyperparameters, spec.dir, spec_path)
    seeds = spec.tune.tune_seeds(spec.seeds)
    check_plan, check_grid, points = plan_check(spec, rules, spec_path)
    plan = dataclasses.replace(grid_plan, runs=grid_plan.runs + check_plan.runs,
                               warnings=sorted({*grid_plan.warnings, *check_plan.warnings}))
    outcome = run_local(plan, log=log, jobs=jobs)
    rows = [result_row(run.to_row(), plan.run_dir(run)) for run in plan.runs]
    write_results_csv(plan.directory, rows)
    count = rules.lr.count if rules.lr is not None else "total"
    results = grid_results(check_plan.runs, rows[len(grid_plan.runs):], check_grid, count)
    sigma, how = _noise(check.sigma, grid + results)
    checked = [_judge(point, check_plan.runs, results, check_grid, sigma) for point in points]
    path = write_check(plan.directory, checked, spec, rules, sigma, how, seeds)
    lines = [f"LR check: trained {len(outcome.trained)} runs, {len(outcome.failed)} failed; sigma of ln L "
             f"{sigma:.4f} ({how})"]
    lines += [f"  {point.verdict()}" for point in checked]
    lines.append(f"LR check: {summary(checked)}; wrote {path}")
    return "\n".join(lines) + "\n"


def plan_check(spec: SweepSpec, rules: HyperparameterRules,
               spec_path: str = "SPEC") -> tuple[SweepPlan, dict[str, GridPoint], list[PointRuns]]:
    """The check's runs in SWEEP/tune (each checked size x horizon x seed x multiplier of the LR that `rules`
    give there), what each stands for, and its (size, horizon) points."""
    check, base = spec.tune.check, load_config(spec.base, spec.overrides)
    seeds = spec.tune.tune_seeds(spec.seeds)
    points = [PointRuns(shape, horizon, tokens, seeds, check.multipliers, [], CHECK_LABEL)
              for shape in ladder_rungs(spec, base, check.sizes, "tune.check.sizes")
              for horizon, tokens in horizon_tokens(check, base, shape)]
    return (*tune_runs(spec, rules, points, spec_path), points)


def _judge(point: PointRuns, runs: list[PlannedRun], results: list[GridResult], grid: dict[str, GridPoint],
           sigma: float) -> CheckedPoint:
    """judge_point on the check runs of one (shape, horizon)."""
    group = [(run, result, grid[run.name].lr_multiplier) for run, result in zip(runs, results, strict=True)
             if run.shape == point.shape and grid[run.name].horizon == point.horizon]
    losses = {}
    for _, result, multiplier in group:
        losses.setdefault(multiplier, []).append(result.loss)
    run, result, multiplier = group[0]
    return judge_point(result.params, point.tokens, shape_label(point.shape), run.lr / multiplier, losses, sigma)


def _noise(stated: float | None, results: list[GridResult]) -> tuple[float, str]:
    """Measured from the seed repeats of the grid and the check where there are any, else the stated sigma."""
    measured, freedom = seed_sigma(results)
    if measured is not None:
        return measured, f"pooled sd over the seed repeats of the grid and the check, {freedom} degrees of freedom"
    if stated is None:
        raise ConfigError("tune.check: no seed repeat measured the noise; set tune.check.sigma or list two seeds "
                          "in tune.seeds")
    return stated, "tune.check.sigma, as the spec states it"


def summary(checked: list[CheckedPoint]) -> str:
    off = [point for point in checked if not point.holds]
    if not off:
        return f"the rule holds at all {len(checked)} checked (size, horizon): 1x is within noise of the best"
    return (f"the rule is off at {len(off)} of {len(checked)} checked (size, horizon): "
            + "; ".join(f"N={p.params:,}, D={p.tokens:.3g}: {p.best:g}x by {100 * p.gap:.2f}%" for p in off))


def write_check(tune_dir: Path, checked: list[CheckedPoint], spec: SweepSpec, rules: HyperparameterRules, sigma: float,
                how: str, seeds: list[int]) -> Path:
    payload = {
        "rule": dataclasses.asdict(lr_setting(spec, rules)),
        "multipliers": spec.tune.check.multipliers, "seeds": seeds, "sigma": sigma, "sigma_how": how,
        "threshold_how": "ln L(1x) - ln L(best) <= 2 sigma sqrt(2/k), k seeds per point",
        "points": [{"params": p.params, "tokens": p.tokens, "shape": p.shape, "rule_lr": p.rule_lr,
                    "losses": {f"{m:g}": (loss if math.isfinite(loss) else None) for m, loss in p.losses.items()},
                    "best_multiplier": p.best, "gap_pct": 100 * p.gap if math.isfinite(p.gap) else None,
                    "threshold_pct": 100 * p.threshold, "optimum_multiplier": p.optimum, "holds": p.holds,
                    "verdict": p.verdict()} for p in checked],
        "holds": all(point.holds for point in checked),
        "verdict": summary(checked),
    }
    path = tune_dir / CHECK_FILE
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(payload, indent=2) + "\n")
    staging.replace(path)
    return path


def check_line(spec: SweepSpec, rules: HyperparameterRules, spec_path: str = "SPEC") -> str | None:
    """What `sweep plan` says about the LR check: its verdict, that it has not run, or that the rule it judged
    has changed since (None: the spec has no check)."""
    if spec.tune is None or spec.tune.check is None:
        return None
    path = Path(spec.dir) / TUNE_DIR / CHECK_FILE
    if not path.is_file():
        return f"LR check: not run yet; `scaletrain sweep tune {spec_path}` trains it after the tuning grid"
    recorded = json.loads(path.read_text())
    if recorded.get("rule") != json.loads(json.dumps(dataclasses.asdict(lr_setting(spec, rules)))):
        return (f"LR check: {path} judged another LR rule than this plan's (re-tuned since?); re-run "
                f"`scaletrain sweep tune {spec_path}`")
    return f"LR check ({path}): {recorded['verdict']}"

