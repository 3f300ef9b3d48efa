"""Sweep specs expand into the runs the method asks for, and bad specs fail with one clear message."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.model.counts import model_counts
from scaletrain.scaling.sweep.plan import plan_sweep
from scaletrain.scaling.sweep.spec import load_sweep_spec
from scaletrain.scaling.sweep.tune import tune_plan
from tests.scaling.sweeps import TINY_BUDGETS, TINY_SHAPES, tiny_spec, write_spec
from tests.train.runs import REPO, launcher, scaletrain_environment


def plan_of(tmp_path: Path, spec: dict):
    return plan_sweep(load_sweep_spec(write_spec(tmp_path / "spec.yaml", spec)))


def test_isoflop_runs_spend_their_budget(small_dataset: Path, tmp_path: Path) -> None:
    plan = plan_of(tmp_path, tiny_spec(small_dataset, tmp_path / "sweep"))
    assert len(plan.runs) == len(TINY_BUDGETS) * len(TINY_SHAPES)
    assert plan.tokens_per_step == 8 * 32
    for run in plan.runs:
        step_flops = plan.tokens_per_step * run.counts.flops_per_token
        assert abs(run.flops - run.budget) <= step_flops / 2  # whole steps, nearest to the budget
        assert run.tokens == run.steps * plan.tokens_per_step
        assert run.flops == pytest.approx(run.tokens * run.counts.flops_per_token)
        assert run.lr == pytest.approx(3e-3 * (64 / run.shape.hidden_size) ** 0.5)
        assert run.warmup_steps == max(2, round(0.05 * run.steps))
        assert run.epochs == pytest.approx(run.tokens / plan.train_tokens)
    # at a fixed budget, a larger model trains on fewer tokens
    for budget in TINY_BUDGETS:
        tokens = [run.tokens for run in plan.runs if run.budget == budget]
        assert tokens == sorted(tokens, reverse=True)
    assert len({run.name for run in plan.runs}) == len(plan.runs)


def test_run_configs_carry_the_schedule_and_tracking(small_dataset: Path, tmp_path: Path) -> None:
    spec = tiny_spec(small_dataset, tmp_path / "sweep")
    plan = plan_of(tmp_path, spec)
    run = plan.runs[-1]
    config = load_config(plan.spec.base, [*plan.spec.overrides, *run.overrides])
    assert (config.model.num_layers, config.model.hidden_size, config.model.num_heads) == (
        run.shape.num_layers, run.shape.hidden_size, run.shape.num_heads)
    assert config.train.steps == run.steps and config.train.lr == pytest.approx(run.lr)
    assert config.train.min_lr == pytest.approx(0.1 * run.lr)  # cosine to lr/10 at the run's own last step
    assert config.train.eval_every > 0  # so the run ends with an evaluation (train/loop.py)
    assert config.run.dir == str(tmp_path / "sweep" / "runs" / run.name)
    assert config.tracking.group == "tiny-isoflop" and config.tracking.job_type == "sweep-run"
    assert "tiny-isoflop" in config.tracking.tags
    assert model_counts(config) == run.counts


def test_shape_rule_hits_target_parameter_counts(small_dataset: Path, tmp_path: Path) -> None:
    targets = [2e4, 1e5, 4e5]
    spec = tiny_spec(small_dataset, tmp_path / "sweep", budgets=[1e12],
                     models={"rule": {"params": targets, "aspect_ratio": 16, "head_dim": 16}})
    plan = plan_of(tmp_path, spec)
    counts = sorted(run.counts.non_embedding_params for run in plan.runs)
    for target, count in zip(targets, counts, strict=True):
        assert 0.6 < count / target < 1.6
    for run in plan.runs:
        assert run.shape.hidden_size == 16 * run.shape.num_heads
        assert 0.5 <= run.shape.hidden_size / (16 * run.shape.num_layers) <= 2


def test_repeated_data_is_warned(small_dataset: Path, tmp_path: Path) -> None:
    plan = plan_of(tmp_path, tiny_spec(small_dataset, tmp_path / "sweep", budgets=[3e12]))
    assert any("repeats data" in warning for warning in plan.warnings)
    assert not plan_of(tmp_path, tiny_spec(small_dataset, tmp_path / "sweep")).warnings


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"budget": [1e10]}, "unknown key budget"),
        ({"budgets": [1e6]}, "less than one optimizer step"),
        ({"warmup": {"steps": 500}}, "no more than its warmup"),
        ({"overrides": ["parallel.tensor=3"]}, "parallel.tensor=3 does not divide"),
        ({"mode": "grid"}, "needs `tokens`"),
        ({"mode": "grid", "budgets": [], "tokens": [1e5]}, None),
        ({"models": {"shapes": TINY_SHAPES, "rule": {"params": [1e5]}}}, "exactly one of `shapes`"),
        ({"models": {"shapes": [{"num_layers": 2, "hidden_size": 48}]}}, "models.shapes[0] needs"),
        ({"seeds": [1, 1]}, "without repeats"),
        ({"base": "missing.yaml"}, "base='missing.yaml' does not exist"),
        ({"learning_rate": {"lr": -1}}, "learning_rate needs lr > 0"),
        ({"fit": {"params_column": "n"}}, "fit.params_column='n'"),
        ({"slurm": {"nodes": 0}}, "nodes >= 1"),
    ],
)
def test_bad_specs_name_the_culprit(small_dataset: Path, tmp_path: Path, changes: dict, fragment: str | None) -> None:
    spec = tiny_spec(small_dataset, tmp_path / "sweep", **changes)
    if fragment is None:
        assert plan_of(tmp_path, spec).runs
        return
    with pytest.raises(ConfigError) as error:
        plan_of(tmp_path, spec)
    assert fragment in str(error.value)


def test_cli_refuses_a_bad_spec_without_writing_anything(small_dataset: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(small_dataset, sweep_dir, budgets=[1e6]))
    result = subprocess.run([*launcher(1), "sweep", "run", str(spec_path)], cwd=REPO,
                            env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "less than one optimizer step" in result.stderr and "Traceback" not in result.stderr
    assert not sweep_dir.exists()


def test_plan_command_prints_the_table(small_dataset: Path, tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(small_dataset, tmp_path / "sweep"))
    result = subprocess.run([*launcher(1), "sweep", "plan", str(spec_path)], cwd=REPO,
                            env=scaletrain_environment(), capture_output=True, text=True, timeout=300, check=True)
    lines = result.stdout.splitlines()
    assert sum(line.startswith("c1.2e10-") or line.startswith("c2.4e10-") for line in lines) == 6
    assert any(line.startswith("total: 6 runs") and "predicted" in line for line in lines)
    assert not (tmp_path / "sweep").exists()


def test_each_budget_takes_the_sizes_nearest_its_center(small_dataset: Path, tmp_path: Path) -> None:
    shapes = [{"num_layers": layers, "hidden_size": 16 * layers, "num_heads": layers} for layers in range(1, 7)]
    spec = tiny_spec(small_dataset, tmp_path / "sweep", budgets=[3e10, 1e12, 3e13],
                     models={"shapes": shapes, "sizes_per_budget": 3, "center_tokens_per_param": 20})
    plan = plan_of(tmp_path, spec)
    chosen = {}
    for run in plan.runs:
        chosen.setdefault(run.budget, []).append(run.shape.num_layers)
    assert all(len(layers) == 3 for layers in chosen.values())
    for layers in chosen.values():  # contiguous rungs of the ladder
        assert layers == list(range(layers[0], layers[0] + 3))
    firsts = [chosen[budget][0] for budget in sorted(chosen)]
    assert firsts == sorted(firsts) and firsts[0] < firsts[-1]  # larger budgets move up the ladder
    for run in plan.runs:  # the kept sizes straddle 20 tokens per parameter, or hug the ladder's end
        others = [r for r in plan.runs if r.budget == run.budget]
        ratios = [r.tokens / r.counts.total_params for r in others]
        assert min(ratios) < 20 < max(ratios) or others[0].shape.num_layers in (1, 4)


@pytest.mark.parametrize("name", ["isoflop_english", "isoflop_shakespeare"])
def test_shipped_sweep_specs_plan(name: str) -> None:
    plan = plan_sweep(load_sweep_spec(REPO / "configs" / "sweeps" / f"{name}.yaml"))
    budgets = {run.budget for run in plan.runs}
    assert len(budgets) >= 2 and all(len([r for r in plan.runs if r.budget == b]) >= 3 for b in budgets)


def test_runs_under_min_steps_are_refused_with_the_fixes(small_dataset: Path, tmp_path: Path) -> None:
    spec = tiny_spec(small_dataset, tmp_path / "sweep", guards={"min_steps": 50})
    with pytest.raises(ConfigError) as error:
        plan_of(tmp_path, spec)
    message = str(error.value)
    short = [run for run in plan_of(tmp_path, tiny_spec(small_dataset, tmp_path / "sweep")).runs if run.steps < 50]
    assert short and all(f"{run.name} ({run.steps} steps)" in message for run in short)
    for fix in ("raise the budget", "lower the batch", "drop the largest sizes", "lower guards.min_steps"):
        assert fix in message.lower()


def test_max_epochs_sets_the_repeated_data_warning(small_dataset: Path, tmp_path: Path) -> None:
    plan = plan_of(tmp_path, tiny_spec(small_dataset, tmp_path / "sweep", guards={"min_steps": 1, "max_epochs": 0.01}))
    assert any("guards.max_epochs=0.01" in warning for warning in plan.warnings)


def test_repeat_seeds_train_one_size_again_at_every_budget(small_dataset: Path, tmp_path: Path) -> None:
    plan = plan_of(tmp_path, tiny_spec(small_dataset, tmp_path / "sweep", repeat_seeds={"sizes": [1], "seeds": [8]}))
    repeated = [run for run in plan.runs if run.seed == 8]
    assert len(plan.runs) == len(TINY_BUDGETS) * (len(TINY_SHAPES) + 1)
    assert sorted(run.budget for run in repeated) == sorted(TINY_BUDGETS)
    assert {run.shape.hidden_size for run in repeated} == {TINY_SHAPES[1]["hidden_size"]}  # the middle rung
    for run in repeated:  # the same (N, D) as the first seed's run: a seed repeat the fit measures noise from
        twin = next(r for r in plan.runs if r.seed == 7 and r.shape == run.shape and r.budget == run.budget)
        assert (run.tokens, run.counts.total_params) == (twin.tokens, twin.counts.total_params)
    for changes, fragment in (({"sizes": [3], "seeds": [8]}, "not indices of the ladder of 3 sizes"),
                              ({"sizes": [1], "seeds": [7]}, "repeat_seeds needs both"),
                              ({"sizes": [1]}, "repeat_seeds needs both")):
        with pytest.raises(ConfigError, match=fragment):
            plan_of(tmp_path, tiny_spec(small_dataset, tmp_path / "sweep", repeat_seeds=changes))


def test_shipped_ladder_spec_asks_for_tuning_and_its_grid_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the spec's sweep dir is relative to the working directory: a fresh, untuned one
    spec_path = REPO / "configs" / "sweeps" / "ladder_english.yaml"
    spec = load_sweep_spec(spec_path)
    with pytest.raises(ConfigError, match="sweep tune"):  # lr: {rule: tuned} before `sweep tune` ran
        plan_sweep(spec, spec_path=str(spec_path))
    grid, multipliers = tune_plan(spec, str(spec_path))
    assert len(grid.runs) == 3 * 5 and sorted(set(multipliers.values())) == [(m, 1.0) for m in (0.25, 0.5, 1, 2, 4)]
    assert all(run.steps >= spec.guards.min_steps for run in grid.runs)


def test_run_one_across_nodes_needs_a_slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """`sweep run-one --nodes 2` outside a SLURM allocation: one error naming the way, nothing started."""
    from scaletrain.cli import main

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["sweep", "run-one", str(tmp_path / "run"), "--nodes", "2"]) == 2
    assert "--nodes 2: a run spans several nodes only inside a SLURM job" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_mixture_of_experts_sweep_records_active_and_total(small_dataset: Path, tmp_path: Path) -> None:
    """model.moe.* (nested keys) in the spec's overrides reach every run; each run records its total and its
    active N, FLOPs per token follow the active one, and results.csv carries both."""
    from scaletrain.scaling.sweep.results import result_row

    spec = tiny_spec(small_dataset, tmp_path / "sweep")
    spec["overrides"] += ["model.moe.num_experts=4", "model.moe.top_k=1"]
    plan = plan_of(tmp_path, spec)
    for run in plan.runs:
        config = load_config(plan.spec.base, [*plan.spec.overrides, *run.overrides])
        assert (config.model.moe.num_experts, config.model.moe.top_k) == (4, 1)
        dense = model_counts(load_config(plan.spec.base, [*plan.spec.overrides, *run.overrides,
                                                          "model.moe.num_experts=0"]))
        assert run.counts.active_params < run.counts.total_params
        # top-1 of 4 experts as wide as the dense MLP: a token meets one of them, plus the router
        router = run.shape.num_layers * run.shape.hidden_size * 4
        assert run.counts.active_params == dense.total_params + router
        assert run.counts.flops_per_token == dense.flops_per_token + 6 * router
        row = result_row(run.to_row(), tmp_path / "sweep" / "runs" / run.name)
        assert (row["params"], row["active_params"]) == (run.counts.total_params, run.counts.active_params)
        assert row["active_non_embedding_params"] == run.counts.active_params - run.counts.embedding_params
