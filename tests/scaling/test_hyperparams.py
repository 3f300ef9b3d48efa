"""Hyperparameters that follow size and length: the rules' values, their place in the plan, the tuning fit,
and the data fingerprint that says which runs' losses may be compared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.data.prepare import prepare_dataset
from scaletrain.scaling.sweep.commands import format_plan
from scaletrain.scaling.sweep.hyperparams import (
    BatchSetting,
    Beta2Setting,
    HyperparameterRules,
    LearningRateSetting,
    RunScale,
    WeightDecaySetting,
    batch_sequences,
    length_dependent,
    size_rule_value,
    tuned_path,
    with_tuned,
)
from scaletrain.scaling.sweep.plan import plan_sweep
from scaletrain.scaling.sweep.results import data_fingerprint
from scaletrain.scaling.sweep.spec import load_sweep_spec
from tests.conftest import SMALL_DATASET_SETTINGS
from tests.scaling.sweeps import tiny_spec, write_spec
from tests.train.runs import DEMO_CONFIG, REPO, tiny_overrides

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
    assert size_rule_value(olmo, RunScale(8 * 108_000_000, 1, 64, 1.0, 1.0)) == pytest.approx(0.0047 / 2)
    deepseek = LearningRateSetting(rule="compute", value=0.3118, exponent=-0.125)
    assert size_rule_value(deepseek, RunScale(1, 1, 64, 1e20, 1.0)) == pytest.approx(0.3118 * 10 ** -2.5)
    width = LearningRateSetting(rule="width", value=1e-3, reference_hidden=128, width_exponent=1.0)
    assert size_rule_value(width, RunScale(1, 1, 256, 1.0, 1.0)) == pytest.approx(5e-4)
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
        ({"hyperparameters": {**RULES, "batch_size": {**RULES["batch_size"], "rounding": "nearest"}}},
         "batch_size.rounding='nearest'; use micro_batch or power_of_two"),
        ({"hyperparameters": {**RULES, "batch_size": {**RULES["batch_size"], "min_batch": 16, "max_batch": 8}}},
         "needs 0 < min_batch <= max_batch"),
        ({"hyperparameters": {**RULES, "lr": {"rule": "compute", "value": 0.3, "tokens_exponent": -0.1}}},
         "tokens_exponent=-0.1 belongs to rule power"),
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


def test_batch_rules_give_the_published_batches() -> None:
    """Porian et al. 2024's fitted B*(N) = 160 (N/108M)^(2/3) sequences of 2,048 tokens, in sequences or in
    tokens, and DeepSeek LLM's B_opt = 0.2920 C^0.3271 tokens as a `compute` rule."""
    at_8x = RunScale(8 * 108_000_000, 1, 64, 1.0, 1.0)
    porian = BatchSetting(rule="power", value=160, reference_params=1.08e8, exponent=2 / 3)
    assert size_rule_value(porian, at_8x) == pytest.approx(640)
    in_tokens = BatchSetting(rule="power", value=160 * 2048, reference_params=1.08e8, exponent=2 / 3, unit="tokens")
    assert batch_sequences(in_tokens, at_8x, seq_length=2048, granule=8, where="test") == 640
    deepseek = BatchSetting(rule="compute", value=0.2920, exponent=0.3271, unit="tokens")
    assert size_rule_value(deepseek, RunScale(1, 1, 64, 1e20, 1.0)) == pytest.approx(0.2920 * 1e20 ** 0.3271)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, 24),  # 22.6 -> the nearest multiple of 4 (unchanged behaviour)
        ({"rounding": "power_of_two"}, 16),  # 22.6 = 2^4.497 -> 2^4
        ({"value": 100.0, "rounding": "power_of_two"}, 128),  # 112.9 = 2^6.82 -> 2^7
        ({"max_batch": 20}, 20),  # clipped to 20, a multiple of 4
        ({"max_batch": 22}, 20),  # clipped to 22, rounded to 24 > max: steps back to 20
        ({"min_batch": 40}, 40),
        ({"min_batch": 90, "rounding": "power_of_two"}, 128),  # 90 -> 2^6.49 = 64 < min: steps up to 128
        ({"max_batch": 4 * 32, "unit": "tokens", "value": 20.0 * 32}, 4),  # bounds in tokens: 128 tokens = 4 seqs
    ],
)
def test_batch_rounding_and_bounds(changes: dict, expected: int) -> None:
    """B(N) = value (N/N0)^exponent, clipped to [min_batch, max_batch], rounded to whole micro-batches or a
    power of two: here value 20 at N = 1.2 N0 with exponent 2/3 is 22.6 sequences, micro-batches of 4."""
    setting = BatchSetting(**{"rule": "power", "value": 20.0, "reference_params": 1e5, "exponent": 2 / 3,
                              **changes})
    assert batch_sequences(setting, RunScale(120_000, 1, 64, 1.0, 1.0), seq_length=32, granule=4,
                           where="test") == expected


def test_batch_rules_that_cannot_round_name_the_fix() -> None:
    scale = RunScale(120_000, 1, 64, 1.0, 1.0)
    with pytest.raises(ConfigError, match="needs micro_batch_size x data-parallel size to be a power of two"):
        batch_sequences(BatchSetting(rule="fixed", value=24, rounding="power_of_two"), scale, 32, 6, "test")
    with pytest.raises(ConfigError, match="between min_batch=5 and max_batch=7 sequences; widen them"):
        batch_sequences(BatchSetting(rule="fixed", value=6, min_batch=5, max_batch=7), scale, 32, 4, "test")


def test_a_power_law_in_n_and_d_follows_the_runs_tokens(small_dataset: Path, tmp_path: Path) -> None:
    """A tuned.json fitted at two horizons: each run's LR follows its tokens as well as its size, and the
    rule depends on the run's length (a ladder reads it at each size's longest branch: test_sweep_ladder.py)."""
    spec = new_style_spec(small_dataset, tmp_path / "sweep", mode="grid", budgets=[], tokens=[20 * 256, 80 * 256])
    spec["hyperparameters"] = {**RULES, "lr": {"rule": "tuned", "value": 1.0}}
    tuned_path(tmp_path / "sweep").parent.mkdir(parents=True)
    law = {"value": 2e-3, "reference_params": 1e5, "exponent": -0.5, "reference_tokens": 1e4,
           "tokens_exponent": -0.25, "count": "total"}
    tuned_path(tmp_path / "sweep").write_text(json.dumps({"lr": law}))
    plan = plan_of(tmp_path, spec)
    assert len({run.tokens for run in plan.runs}) > 1
    for run in plan.runs:
        planned_tokens = 20 * 256 if run.name.startswith("d5.12e") else 80 * 256
        assert run.lr == pytest.approx(2e-3 * (run.counts.total_params / 1e5) ** -0.5 * (planned_tokens / 1e4) ** -0.25)
    rule = LearningRateSetting(rule="power", value=1.0, tokens_exponent=-0.25, reference_tokens=1e4)
    assert length_dependent(HyperparameterRules(lr=rule)) == ["lr"]


def test_a_tuned_json_of_one_horizon_still_means_a_law_in_n(small_dataset: Path, tmp_path: Path) -> None:
    """experiments/ladder_english's tuned.json (written before horizons existed, N only) gives the same LRs."""
    committed = REPO / "experiments" / "ladder_english" / "tune" / "tuned.json"
    tuned_path(tmp_path / "sweep").parent.mkdir(parents=True)
    shutil.copy(committed, tuned_path(tmp_path / "sweep"))
    law = json.loads(committed.read_text())["lr"]
    rules = with_tuned(HyperparameterRules(lr=LearningRateSetting(rule="tuned")), tmp_path / "sweep")
    assert (rules.lr.rule, rules.lr.tokens_exponent, rules.lr.value) == ("power", 0.0, law["value"])
    spec = new_style_spec(small_dataset, tmp_path / "sweep")
    spec["hyperparameters"] = {**RULES, "lr": {"rule": "tuned", "value": 1.0}}
    for run in plan_of(tmp_path, spec).runs:
        assert run.lr == pytest.approx(law["value"] * (run.counts.total_params / law["reference_params"])
                                       ** law["exponent"], rel=1e-12)


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
    assert fingerprint(small_dataset, "train.eval_seed=1") != fingerprint(small_dataset)  # another sample of it
    whole = fingerprint(small_dataset, "train.eval_samples=all")
    assert whole != fingerprint(small_dataset)
    assert fingerprint(small_dataset, "train.eval_samples=all", "train.eval_seed=1") == whole  # no sample drawn
