"""Hyperparameters that follow size and length: the rules' values, their place in the plan, the tuning fit,
and the data fingerprint that says which runs' losses may be compared."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.data.prepare import prepare_dataset
from scaletrain.scaling.sweep.commands import format_plan
from scaletrain.scaling.sweep.hyperparams import (
    Beta2Setting,
    HyperparameterRules,
    LearningRateSetting,
    RunScale,
    WeightDecaySetting,
    length_dependent,
    size_rule_value,
    tuned_path,
)
from scaletrain.scaling.sweep.plan import plan_sweep
from scaletrain.scaling.sweep.results import data_fingerprint
from scaletrain.scaling.sweep.spec import load_sweep_spec
from scaletrain.scaling.sweep.tune import GridResult, fit_tuning
from tests.conftest import SMALL_DATASET_SETTINGS
from tests.scaling.sweeps import tiny_spec, write_spec
from tests.train.runs import DEMO_CONFIG, tiny_overrides

RULES = {
    "lr": {"rule": "power", "value": 3e-3, "reference_params": 1e5, "exponent": -1 / 3},
    "batch_size": {"rule": "power", "value": 8, "reference_params": 1e5, "exponent": 2 / 3},
    "beta2": {"rule": "by_batch", "small_batch_tokens": 300},
    "warmup": {"rule": "tokens_per_param", "tokens_per_param": 0.02},
    "weight_decay": {"rule": "timescale", "timescale_fraction": 0.2},
}


def new_style_spec(data_dir: Path, sweep_dir: Path, **changes) -> dict:
    spec = tiny_spec(data_dir, sweep_dir, hyperparameters=RULES, **changes)
    del spec["learning_rate"], spec["warmup"]
    return spec


def plan_of(tmp_path: Path, spec: dict):
    return plan_sweep(load_sweep_spec(write_spec(tmp_path / "spec.yaml", spec)))


def test_rules_give_the_published_values() -> None:
    olmo = LearningRateSetting(rule="power", value=0.0047, reference_params=1.08e8, exponent=-1 / 3)
    assert size_rule_value(olmo, RunScale(8 * 108_000_000, 1, 64, 1.0)) == pytest.approx(0.0047 / 2)
    deepseek = LearningRateSetting(rule="compute", value=0.3118, exponent=-0.125)
    assert size_rule_value(deepseek, RunScale(1, 1, 64, 1e20)) == pytest.approx(0.3118 * 10 ** -2.5)
    width = LearningRateSetting(rule="width", value=1e-3, reference_hidden=128, width_exponent=1.0)
    assert size_rule_value(width, RunScale(1, 1, 256, 1.0)) == pytest.approx(5e-4)
    rules = HyperparameterRules(lr=deepseek, beta2=Beta2Setting(rule="by_batch"),
                                weight_decay=WeightDecaySetting(rule="timescale"))
    assert length_dependent(rules) == ["lr", "weight_decay"]
    assert length_dependent(HyperparameterRules(lr=olmo)) == []


def test_new_rules_reach_every_run(small_dataset: Path, tmp_path: Path) -> None:
    plan = plan_of(tmp_path, new_style_spec(small_dataset, tmp_path / "sweep"))
    assert {run.batch_size for run in plan.runs} == {4, 8, 12}  # 8 (N/1e5)^(2/3), in whole micro-batches of 4
    for run in plan.runs:
        n = run.counts.total_params
        assert run.lr == pytest.approx(3e-3 * (n / 1e5) ** (-1 / 3))
        assert abs(run.batch_size - 8 * (n / 1e5) ** (2 / 3)) <= 2
        assert run.tokens == run.steps * run.batch_size * 32
        assert run.beta2 == (0.99 if run.batch_size * 32 < 300 else 0.95)
        assert run.warmup_steps == max(1, round(0.02 * n / (run.batch_size * 32)))
        assert run.weight_decay == pytest.approx(1 / (run.lr * 0.2 * run.steps))
        config = load_config(plan.spec.base, [*plan.spec.overrides, *run.overrides])
        assert (config.train.global_batch_size, config.train.beta2, config.train.warmup_steps) == (
            run.batch_size, run.beta2, run.warmup_steps)
        assert config.train.weight_decay == pytest.approx(run.weight_decay)
        assert {"lr", "batch_size", "beta2", "warmup_steps", "weight_decay"} <= set(run.to_row())
    table = format_plan(plan)
    assert "beta2" in table and f"{plan.runs[0].weight_decay:.3g}" in table


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"learning_rate": {"lr": 1e-3}}, "both `learning_rate:` and `hyperparameters.lr:`"),
        ({"hyperparameters": {**RULES, "lr": {"rule": "power"}}}, "needs a positive `value`"),
        ({"hyperparameters": {**RULES, "lr": {"rule": "tuned", "value": 3e-3}}}, "scaletrain sweep tune"),
        ({"hyperparameters": {**RULES, "batch_size": {"rule": "fixed", "value": 1}}}, "lower train.micro_batch_size"),
        ({"hyperparameters": {**RULES, "beta2": {"rule": "sometimes"}}}, "hyperparameters.beta2 needs"),
    ],
)
def test_bad_rules_name_the_culprit(small_dataset: Path, tmp_path: Path, changes: dict, fragment: str) -> None:
    spec = new_style_spec(small_dataset, tmp_path / "sweep")
    spec.update(changes)
    with pytest.raises(ConfigError) as error:
        plan_of(tmp_path, spec)
    assert fragment in str(error.value)


def test_tuned_rule_plans_with_tuned_json(small_dataset: Path, tmp_path: Path) -> None:
    spec = new_style_spec(small_dataset, tmp_path / "sweep")
    spec["hyperparameters"] = {**RULES, "lr": {"rule": "tuned", "value": 1.0}}
    tuned_path(tmp_path / "sweep").parent.mkdir(parents=True)
    tuned_path(tmp_path / "sweep").write_text(json.dumps(
        {"lr": {"value": 2e-3, "reference_params": 1e5, "exponent": -0.5, "count": "total"}}))
    for run in plan_of(tmp_path, spec).runs:
        assert run.lr == pytest.approx(2e-3 * (run.counts.total_params / 1e5) ** -0.5)


def synthetic_grid(sizes: list[float], multipliers: list[float], curvature: float, wiggle: float) -> list[GridResult]:
    """L(N, lr) = a(N) + b (ln lr - ln eta*(N))^2 + wiggle sin(7 ln lr + ln N), eta*(N) = 0.01 (N/1e7)^-0.35,
    on a multiplicative grid around a centre rule that is off on purpose (0.008 (N/1e7)^-0.25)."""
    results = []
    for n in sizes:
        optimum, centre = 0.01 * (n / 1e7) ** -0.35, 0.008 * (n / 1e7) ** -0.25
        for multiplier in multipliers:
            lr = centre * multiplier
            x = math.log(lr)
            loss = 3.0 + 5 * n ** -0.3 + curvature * (x - math.log(optimum)) ** 2
            loss += wiggle * math.sin(7 * x + math.log(n))
            results.append(GridResult(params=int(n), lr=lr, batch_size=8, loss=loss))
    return results


def test_the_tuning_step_recovers_a_known_optimum_on_a_synthetic_loss_surface() -> None:
    sizes, multipliers, curvature, wiggle = [1e6, 8e6, 6.4e7], [0.25, 0.5, 1.0, 2.0, 4.0], 0.05, 1e-4
    fit = fit_tuning(synthetic_grid(sizes, multipliers, curvature, wiggle), tune_batch=False)
    # Tolerance: the parabola through y at x0 - h, x0, x0 + h has its vertex at x0 - h D1 / (2 D2) with
    # D1 = y+ - y-, D2 = y+ - 2 y0 + y- = 2 b h^2. A wiggle of at most w moves D1 by <= 2w and D2 by <= 4w;
    # with the true optimum within h of x0 (|D1| <= 4 b h^2) the vertex moves by at most
    # E = (h/2) (2w D2 + 4w |D1|) / (D2 (D2 - 4w)) = 5 w h / (2 b h^2 - 4 w) in ln(lr).
    h = math.log(2)
    error = 5 * wiggle * h / (2 * curvature * h * h - 4 * wiggle)
    # Least squares in ln N moves the slope by <= E sum|u - mean u| / sum (u - mean u)^2 and, at the
    # geometric mean of N (the fit's reference), the intercept by <= E.
    u = np.log(sizes) - np.log(sizes).mean()
    assert abs(fit.lr.exponent - (-0.35)) <= error * np.abs(u).sum() / (u * u).sum()
    truth_at_reference = 0.01 * (fit.lr.reference_params / 1e7) ** -0.35
    assert abs(math.log(fit.lr.value / truth_at_reference)) <= error
    for optimum in fit.optima:
        assert abs(math.log(optimum.lr / (0.01 * (optimum.params / 1e7) ** -0.35))) <= error
    assert error < 0.01  # the bound is tight enough to mean something: 1% in LR


def test_an_optimum_at_the_edge_of_the_grid_is_refused() -> None:
    results = synthetic_grid([1e6, 8e6], [0.03, 0.06, 0.125], 0.05, 0.0)  # all far below eta*
    with pytest.raises(ConfigError, match="widen lr_multipliers"):
        fit_tuning(results, tune_batch=False)


def test_data_fingerprint_follows_the_prepared_data(small_dataset: Path, small_dataset_raw: list[Path],
                                                    tmp_path: Path) -> None:
    def fingerprint(data_dir: Path, *extra: str) -> str:
        return data_fingerprint(load_config(DEMO_CONFIG, [*tiny_overrides(data_dir, tmp_path / "run"), *extra]))

    copy = tmp_path / "copy"
    shutil.copytree(small_dataset, copy)
    assert fingerprint(small_dataset) == fingerprint(copy)  # the same data, wherever it lies
    reprepared = tmp_path / "reprepared"
    prepare_dataset(small_dataset_raw[1:], reprepared, **SMALL_DATASET_SETTINGS,
                    tokenizer_file=small_dataset / "tokenizer.model")
    assert fingerprint(reprepared) != fingerprint(small_dataset)  # same tokenizer, one work fewer
    assert fingerprint(small_dataset, "train.eval_samples=8") != fingerprint(small_dataset)  # another val set
