"""Sweep specs expand into the runs the method asks for, and bad specs fail with one clear message."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.families import model_counts
from scaletrain.scaling.sweep.commands import format_plan
from scaletrain.scaling.sweep.plan import plan_sweep, shape_label
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
        ({"fit": {"forms": ["chinchilla", "hoffmann"]}},
         "fit.forms=['chinchilla', 'hoffmann']: unknown form(s) hoffmann; list some of chinchilla, kaplan, kaplan_e, "
         "muennighoff"),
        ({"fit": {"objective": "l1"}}, "fit.objective='l1'; use huber or least_squares"),
        ({"fit": {"huber_delta": "small"}}, "fit.huber_delta='small'; use a positive number in ln L"),
        ({"fit": {"huber_delta": 1e-3, "objective": "least_squares"}}, "applies to objective huber only"),
        ({"fit": {"exclude": ["num_layers < 2", "layers < 2"]}},
         "fit.exclude[1]='layers < 2': results.csv has no column 'layers'; name one of name, status"),
        ({"fit": {"exclude": ["num_layers is 1"]}}, "fit.exclude[0]: exclusion 'num_layers is 1' is not a rule"),
        ({"fit": {"forms": ["kaplan"], "objective": "least_squares", "exclude": ["num_layers < 2"]}}, None),
        ({"tune": {"sizes": [0, 2], "tokens": [1e4, 1e4]}}, "tune needs exactly one of `tokens`"),
        ({"tune": {"sizes": [0, 2], "tokens": 1e4, "tokens_per_param": [1, 2]}}, "tune needs exactly one of"),
        ({"tune": {"sizes": [0, 2], "tokens": [1e4, 2e4], "seeds": [3, 3]}}, "tune.seeds=[3, 3] repeats a seed"),
        ({"tune": {"sizes": [0, 2], "tokens": 1e4, "unstable_neighbour": "skip"}},
         "tune.unstable_neighbour='skip'; use refuse or best_point"),
        ({"tune": {"sizes": [0, 2], "tokens": 1e4, "unstable_neighbour": "best_point"}}, None),
        ({"tune": {"sizes": [0, 2], "tokens": 1e4, "check": {"sizes": [2], "tokens": 2e4}}},
         "tune.check: judging the rule needs the run-to-run noise: list two seeds or more in tune.seeds"),
        ({"tune": {"sizes": [0, 2], "tokens": 1e4, "seeds": [1, 2], "check": {"sizes": [2], "tokens": 2e4,
                                                                            "multipliers": [0.5, 2]}}},
         "tune.check.multipliers=[0.5, 2.0]; list distinct positive multipliers of the rule's LR that include 1"),
        ({"tune": {"sizes": [0, 2], "tokens": 1e4, "check": {"sizes": [], "tokens": 2e4, "sigma": 0.002}}},
         "tune.check needs `sizes`"),
        ({"models": {"rule": {"params": [1e5], "min_layers": 3, "max_layers": 2}}}, "1 <= min_layers <= max_layers"),
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
    grid, points = tune_plan(spec, str(spec_path))
    assert len(grid.runs) == 3 * 5
    assert sorted({(p.lr_multiplier, p.batch_multiplier) for p in points.values()}) == [
        (m, 1.0) for m in (0.25, 0.5, 1, 2, 4)]
    assert all(run.steps >= spec.guards.min_steps for run in grid.runs)
    # one horizon and one seed: the grid the committed experiment trained, run for run (so its runs stay done)
    committed = json.loads((REPO / "experiments" / "ladder_english" / "tune" / "plan.json").read_text())["runs"]
    keys = ("name", "lr", "steps", "tokens", "batch_size", "warmup_steps", "beta2", "seed")
    assert [{key: run[key] for key in keys} for run in committed] == [
        {key: run.to_row()[key] for key in keys} for run in grid.runs]


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


def test_spec_law_forms_are_the_fits_forms() -> None:
    """The spec lists the forms without importing scipy; they must be the ones the fit knows."""
    from scaletrain.scaling.laws import LAW_FORMS
    from scaletrain.scaling.sweep.spec import LAW_FORM_NAMES

    assert tuple(LAW_FORMS) == LAW_FORM_NAMES


def test_smooth_depth_shapes_step_one_layer_at_most(small_dataset: Path, tmp_path: Path) -> None:
    """~46K to 1M parameters 10^0.125 apart at a 512-piece vocabulary: depth 2 to at most 7, never falling
    and +1 at most between neighbours, width never falling, every count within 10% of its target; the plain
    aspect-ratio rule on the same targets has sizes with fewer layers than their smaller neighbour's or
    repeats a shape."""
    from scaletrain.scaling.sweep.shapes import rule_shapes, shape_counts
    from scaletrain.scaling.sweep.spec import ShapeRule

    base = load_config(REPO / "configs" / "gpt_english_512.yaml")
    targets = [46e3 * 10 ** (0.125 * k) for k in range(11)]
    rule = ShapeRule(params=targets, count="total", aspect_ratio=20, head_dim=8, smooth_depth=True, min_layers=2)
    shapes = rule_shapes(base, rule)
    depths = [shape.num_layers for shape in shapes]
    assert depths[0] == 2 and depths[-1] <= 7 and len(set(map(str, shapes))) == len(shapes)
    assert all(0 <= later - earlier <= 1 for earlier, later in zip(depths, depths[1:], strict=False))
    assert all(a.hidden_size <= b.hidden_size for a, b in zip(shapes, shapes[1:], strict=False))
    for shape, target in zip(shapes, targets, strict=True):
        assert shape.hidden_size == 8 * shape.num_heads
        assert 0.9 < shape_counts(base, shape).total_params / target < 1.1
    plain = rule_shapes(base, ShapeRule(params=targets, count="total", aspect_ratio=20, head_dim=8))
    assert len(set(map(str, plain))) < len(plain) or any(
        later.num_layers - earlier.num_layers > 1 for earlier, later in zip(plain, plain[1:], strict=False))
    # the plan of such a ladder names every shape, smallest first
    spec = tiny_spec(small_dataset, tmp_path / "sweep", budgets=[1e12],
                     models={"rule": {"params": [2e4, 4e4, 8e4], "head_dim": 8, "aspect_ratio": 16,
                                      "smooth_depth": True, "min_layers": 2}})
    plan = plan_of(tmp_path, spec)
    lines = format_plan(plan).splitlines()
    rows = [line.split() for line in lines[lines.index("shapes (smallest first):") + 1:] if line.startswith("  l")]
    assert sorted(row[0] for row in rows) == sorted({shape_label(run.shape) for run in plan.runs})
    counts = [int(row[row.index("parameters") - 1].replace(",", "")) for row in rows]
    assert len(rows) == 3 and counts == sorted(counts)


def tune_spec(data_dir: Path, sweep_dir: Path, **tune: object) -> dict:
    """The tiny sweep with its LR rule `tuned` (grid centre 3e-3 (N/1e5)^-0.25) and a `tune:` section."""
    spec = tiny_spec(data_dir, sweep_dir)
    del spec["learning_rate"]
    spec["hyperparameters"] = {"lr": {"rule": "tuned", "value": 3e-3, "reference_params": 1e5, "exponent": -0.25}}
    spec["tune"] = {"sizes": [0, 2], "lr_multipliers": [0.5, 1.0, 2.0], **tune}
    return spec


def test_tune_grid_trains_every_size_horizon_and_seed(small_dataset: Path, tmp_path: Path) -> None:
    spec = load_sweep_spec(write_spec(tmp_path / "spec.yaml", tune_spec(
        small_dataset, tmp_path / "sweep", tokens=[40 * 256, 80 * 256], seeds=[7, 8])))
    grid, points = tune_plan(spec)
    assert len(grid.runs) == 2 * 2 * 2 * 3 == len(points) == len({run.name for run in grid.runs})
    assert {(run.seed, points[run.name].tokens) for run in grid.runs} == {
        (seed, tokens) for seed in (7, 8) for tokens in (40 * 256, 80 * 256)}
    for run in grid.runs:
        centre = 3e-3 * (run.counts.total_params / 1e5) ** -0.25
        assert run.lr == pytest.approx(centre * points[run.name].lr_multiplier)
        assert abs(run.tokens - points[run.name].tokens) <= run.batch_size * 32 / 2  # whole steps
    per_param = load_sweep_spec(write_spec(tmp_path / "spec.yaml", tune_spec(
        small_dataset, tmp_path / "sweep", tokens_per_param=[0.1, 0.2])))
    grid, points = tune_plan(per_param)
    for run in grid.runs:
        assert points[run.name].tokens == pytest.approx(points[run.name].horizon * run.counts.total_params)


def test_plan_shows_the_lr_check_verdict_or_that_it_has_not_run(small_dataset: Path, tmp_path: Path) -> None:
    from scaletrain.scaling.sweep.hyperparams import tuned_path, with_tuned
    from scaletrain.scaling.sweep.lr_check import judge_point, write_check

    sweep_dir = tmp_path / "sweep"
    spec_path = write_spec(tmp_path / "spec.yaml", tune_spec(
        small_dataset, sweep_dir, tokens=40 * 256, check={"sizes": [2], "tokens": 80 * 256, "sigma": 0.002}))
    tuned_path(sweep_dir).parent.mkdir(parents=True)
    tuned_path(sweep_dir).write_text(json.dumps({"lr": {"value": 5e-3, "reference_params": 1e5, "exponent": -0.3}}))
    spec = load_sweep_spec(spec_path)
    assert "LR check: not run yet; `scaletrain sweep tune SPEC` trains it" in format_plan(plan_sweep(spec))
    point = judge_point(100_000, 80 * 256, "l2-h64-a4", 5e-3, {0.5: [4.2], 1.0: [4.1], 2.0: [4.0]}, 0.002)
    write_check(sweep_dir / "tune", [point], spec, with_tuned(spec.hyperparameters, sweep_dir), 0.002, "stated",
                [7])
    assert f"LR check ({sweep_dir / 'tune' / 'check.json'}): the rule is off at 1 of 1" in format_plan(
        plan_sweep(spec))
    tuned_path(sweep_dir).write_text(json.dumps({"lr": {"value": 4e-3, "reference_params": 1e5, "exponent": -0.3}}))
    assert "judged another LR rule than this plan's" in format_plan(plan_sweep(spec))


def test_sweep_plan_shows_a_tuned_rules_prior_before_tuning_and_tune_plans_its_grid_and_check(
    small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before `sweep tune`: `sweep plan` shows the LR of the rule's prior and says so (training refuses);
    `sweep tune --plan` lists the grid and the check and trains nothing."""
    from scaletrain.cli import main

    sweep_dir = tmp_path / "sweep"
    spec_path = write_spec(tmp_path / "spec.yaml", tune_spec(
        small_dataset, sweep_dir, tokens=[40 * 256, 80 * 256], seeds=[7, 8],
        check={"sizes": [2], "tokens": 80 * 256}))
    spec = load_sweep_spec(spec_path)
    with pytest.raises(ConfigError, match="sweep tune"):
        plan_sweep(spec)
    shown = plan_sweep(spec, spec_path=str(spec_path), to_show=True)
    assert all(run.lr == pytest.approx(3e-3 * (run.counts.total_params / 1e5) ** -0.25) for run in shown.runs)
    assert any("tuned.json does not exist yet" in warning and "`sweep run` refuses to train until it has" in warning
               for warning in shown.warnings)
    assert main(["sweep", "plan", str(spec_path)]) == 0
    assert "LR check: not run yet" in capsys.readouterr().out
    assert main(["sweep", "tune", "--plan", str(spec_path)]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert sum(line.startswith("d") and "-lr" in line and "check-" not in line for line in lines) == 2 * 2 * 2 * 3
    assert sum("-check-lr" in line for line in lines) == 2 * 3  # the largest size, one horizon, 2 seeds x 3
    assert "LR check (trained after the grid at 0.5x, 1x, 2x the rule's LR):" in printed
    assert "tune total: 30 runs, predicted" in printed
    assert not sweep_dir.exists()


def test_predicted_time_counts_every_evaluation(small_dataset: Path, tmp_path: Path) -> None:
    """A run evaluates at step 0, every eval_every steps and at its end; a ladder's branch only where its
    cooldown passes; each evaluation forwards the sequences it reads, in micro-batches."""
    from scaletrain.scaling.sweep.timing import evaluations

    assert [evaluations(0, 100, 100), evaluations(0, 100, 30), evaluations(80, 100, 100), evaluations(0, 5, 0)] == [
        2, 5, 1, 0]
    spec = tiny_spec(small_dataset, tmp_path / "sweep")
    few = {run.name: run for run in plan_of(tmp_path, spec).runs}
    spec["overrides"] = [*spec["overrides"], "train.eval_samples=all"]
    whole = {run.name: run for run in plan_of(tmp_path, spec).runs}
    throughput = load_sweep_spec(tmp_path / "spec.yaml").throughput
    for name, run in whole.items():
        forward_s = 4 * 32 * run.counts.flops_per_token / 3 / throughput.flops_per_s  # micro-batches of 4
        assert few[name].timing.evaluation_s == pytest.approx(32 / 4 * (throughput.step_overhead_s + forward_s))
        assert run.timing.evaluation_s > few[name].timing.evaluation_s
        every = int(dict(override.split("=", 1) for override in run.overrides)["train.eval_every"])
        count = 1 + run.steps // every + (run.steps % every != 0)
        assert run.predicted_s == pytest.approx(throughput.startup_s + run.steps * run.timing.step_s
                                                + count * run.timing.evaluation_s)
    ladder = plan_of(tmp_path, {**spec, "mode": "ladder", "warmup": {"steps": 2, "fraction": 0.0}})
    for run in ladder.runs:
        every = int(dict(override.split("=", 1) for override in run.overrides)["train.eval_every"])
        start = 0 if run.role == "stable" else run.branch_step
        assert run.predicted_s == pytest.approx(throughput.startup_s + (run.steps - start) * run.timing.step_s
                                                + evaluations(start, run.steps, every) * run.timing.evaluation_s)


def test_downstream_tasks_reach_every_planned_run_but_not_the_tunes_and_are_found_at_plan(
        small_dataset: Path, tmp_path: Path) -> None:
    """downstream: each run of the plan scores the tasks at its last step (its eval section), the tune's grid does
    not; a task whose data file is missing is refused once, when the sweep is planned, naming the file (an unknown
    task gets selected_tasks' message, tests/evaluation/test_in_loop.py, with downstream. for eval.)."""
    data, task = tmp_path / "cloze.jsonl", tmp_path / "tiny_cloze.yaml"
    task.write_text(f"include: {REPO / 'configs' / 'eval_tasks' / 'shakespeare_cloze.yaml'}\ntask: tiny_cloze\n"
                    f"dataset_kwargs: {{data_files: {{test: {data}}}}}\n")
    downstream = {"tasks": [str(task)], "limit": 5}
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(small_dataset, tmp_path / "sweep", downstream=downstream))
    with pytest.raises(ConfigError) as error:
        plan_sweep(load_sweep_spec(spec_path))
    assert str(error.value).startswith(f"sweep tiny-isoflop: downstream.tasks {task}: its data file {data} does not "
                                       "exist (relative to ")
    data.write_text('{"document": 0, "context": "to be or not to ", "target": "be"}\n')
    spec = load_sweep_spec(spec_path)
    plan = plan_sweep(spec)
    assert len(plan.runs) == len(TINY_BUDGETS) * len(TINY_SHAPES)
    for run in plan.runs:
        config = load_config(spec.base, [*spec.overrides, *run.overrides])
        assert (config.eval.tasks, config.eval.every, config.eval.limit) == ([str(task)], 0, 5.0)
    tuned = load_sweep_spec(write_spec(tmp_path / "tune.yaml", {
        **tune_spec(small_dataset, tmp_path / "tuned", tokens=[40 * 256]), "downstream": downstream}))
    grid, _ = tune_plan(tuned)
    assert grid.runs and all(
        load_config(tuned.base, [*tuned.overrides, *run.overrides]).eval.tasks == [] for run in grid.runs)
