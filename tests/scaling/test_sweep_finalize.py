"""The spec's `fit:` section reaches `sweep finalize`: its forms, objective, Huber delta and exclusions are the
ones fit.json records, on a sweep whose runs' summaries follow a known law (no training); and the W&B summary
run's results table holds a failed run beside runs that scored downstream tasks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scaletrain.scaling.fit_inputs import read_runs
from scaletrain.scaling.sweep.commands import finalize_sweep
from scaletrain.scaling.sweep.executors import materialize
from scaletrain.scaling.sweep.plan import PlannedRun, plan_sweep
from scaletrain.scaling.sweep.results import planned_rows, write_results_csv, write_status_file
from scaletrain.scaling.sweep.spec import load_sweep_spec
from tests.scaling.sweeps import TINY_SHAPES, tiny_spec, write_spec

SHAPES = [*TINY_SHAPES, {"num_layers": 3, "hidden_size": 64, "num_heads": 4},
          {"num_layers": 2, "hidden_size": 96, "num_heads": 4}]
BUDGETS = [1.2e10, 2.4e10, 4.8e10]


def chinchilla_loss(params: float, tokens: float) -> float:
    """Hoffmann et al. 2022's form with constants that put every budget's optimum inside the ladder."""
    return 1.8 + 60.0 / params ** 0.34 + 120.0 / tokens ** 0.28


@pytest.mark.parametrize(
    "fit, recorded_delta",
    [
        ({"forms": ["chinchilla", "kaplan"], "objective": "huber", "huber_delta": 2.0e-3,
          "exclude": ["num_layers < 2"]}, 2.0e-3),
        ({"forms": ["kaplan_e"], "objective": "least_squares", "exclude": ["num_layers < 2", "hidden_size >= 96"]},
         "auto"),
    ],
)
def test_the_spec_fit_section_reaches_finalize(tmp_path: Path, fit: dict, recorded_delta: object) -> None:
    spec = tiny_spec(tmp_path / "unprepared", tmp_path / "sweep", budgets=BUDGETS, models={"shapes": SHAPES},
                     fit={"bootstrap": 0, **fit})
    plan = plan_sweep(load_sweep_spec(write_spec(tmp_path / "spec.yaml", spec)))
    materialize(plan)
    for run in plan.runs:
        (plan.run_dir(run) / "summary.json").write_text(json.dumps({
            "step": run.steps, "tokens": run.tokens, "flops": run.flops,
            "val_loss": chinchilla_loss(run.counts.active_params, run.tokens)}))
    output = finalize_sweep(plan.directory)
    document = json.loads((plan.directory / "fit" / "fit.json").read_text())
    assert document["objective"] == fit["objective"] and document["huber_delta"] == recorded_delta
    removed = {"num_layers < 2": len(BUDGETS), "hidden_size >= 96": len(BUDGETS)}
    assert document["exclusions"] == [{"rule": rule, "removed": removed[rule]} for rule in fit["exclude"]]
    assert document["num_points"] == len(plan.runs) - sum(removed[rule] for rule in fit["exclude"])
    assert set(document["laws"]) | set(document.get("law_skipped") or {}) == set(fit["forms"])
    assert document["laws"], output  # at least one of the spec's forms was fitted


def test_the_summary_table_holds_a_failed_run_beside_task_scores(tmp_path: Path) -> None:
    """Every run but one scored a task; that one failed, so it has no task column. The W&B summary run's
    results table (W&B offline) has the task's column with the failed run's cell empty, as results.csv
    has: a table built from one row's keys stopped the second English ladder's finalize with a KeyError."""
    spec = tiny_spec(tmp_path / "unprepared", tmp_path / "sweep", wandb="offline", budgets=BUDGETS,
                     models={"shapes": SHAPES}, fit={"bootstrap": 0})
    plan = plan_sweep(load_sweep_spec(write_spec(tmp_path / "spec.yaml", spec)))
    materialize(plan)
    failed, *trained = plan.runs
    write_status_file(plan.run_dir(failed), {"state": "failed", "returncode": 3})
    bits_per_byte = {}
    for index, run in enumerate(trained):
        bits_per_byte[run.name] = 2.0 + index / 100
        (plan.run_dir(run) / "summary.json").write_text(json.dumps({
            "step": run.steps, "tokens": run.tokens, "flops": run.flops,
            "val_loss": chinchilla_loss(run.counts.active_params, run.tokens),
            "eval/downstream/passages/bits_per_byte": bits_per_byte[run.name]}))
    output = finalize_sweep(plan.directory)
    assert "logged W&B summary run" in output
    (table_file,) = (plan.directory / "wandb").glob("offline-run-*/files/media/table/results_*.table.json")
    table = json.loads(table_file.read_text())
    name, task = table["columns"].index("name"), table["columns"].index("downstream/passages/bits_per_byte")
    logged = {row[name]: row[task] for row in table["data"]}
    assert logged == {failed.name: None, **bits_per_byte}


def test_fit_reads_the_runs_finished_since_results_csv_was_written(tmp_path: Path) -> None:
    """`fit SWEEP` (and `--check SWEEP`) rewrites results.csv from the run directories first, as `sweep status`
    does: a results.csv written while the last runs trained left them out without a word (the second English
    ladder's 3x check read "no finished run"). A sweep put back from an archive, where the unfinished runs have
    no directory, is read as its results.csv says."""
    spec = tiny_spec(tmp_path / "unprepared", tmp_path / "sweep", budgets=BUDGETS, models={"shapes": SHAPES})
    plan = plan_sweep(load_sweep_spec(write_spec(tmp_path / "spec.yaml", spec)))
    materialize(plan)
    earlier, later = plan.runs[:-3], plan.runs[-3:]
    for run in earlier:
        write_summary(plan.run_dir(run), run)
    write_results_csv(plan.directory, planned_rows(plan.directory))  # `sweep status` while the last three train
    for run in later:
        write_summary(plan.run_dir(run), run)
    runs = read_runs(plan.directory)
    assert sorted(point.params for point in runs.data.points) == sorted(run.counts.active_params for run in plan.runs)
    assert [row["status"] for row in planned_rows(plan.directory)] == ["done"] * len(plan.runs)

    write_results_csv(plan.directory, [{**row, "status": "pending"} if row["name"] == later[0].name else row
                                       for row in planned_rows(plan.directory)])
    shutil.rmtree(plan.run_dir(later[0]))  # as `sweep restore` leaves a run that had not finished
    assert len(read_runs(plan.directory).data.points) == len(plan.runs) - 1


def write_summary(run_dir: Path, run: PlannedRun) -> None:
    (run_dir / "summary.json").write_text(json.dumps({
        "step": run.steps, "tokens": run.tokens, "flops": run.flops,
        "val_loss": chinchilla_loss(run.counts.active_params, run.tokens)}))
