"""Ladder sweeps: the plan's stable runs and branch points, its refusals, and a tiny ladder through the
CLI whose branches equal fresh WSD runs exactly, also after the sweep was killed mid-way."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.config import ConfigError
from scaletrain.scaling.sweep.commands import format_plan
from scaletrain.scaling.sweep.ladder import ladder_flops
from scaletrain.scaling.sweep.plan import plan_sweep
from scaletrain.scaling.sweep.spec import load_sweep_spec
from tests.scaling.sweeps import TINY_BUDGETS, TINY_SHAPES, tiny_spec, write_spec
from tests.train.runs import REPO, launcher, read_metrics, run_scaletrain, scaletrain_environment

LADDER = {"mode": "ladder", "name": "tiny-ladder", "warmup": {"steps": 2, "fraction": 0.0}, "guards": {"min_steps": 1}}


def ladder_spec(data_dir: Path, sweep_dir: Path, **changes: object) -> dict:
    return tiny_spec(data_dir, sweep_dir, **{**LADDER, **changes})


def plan_of(tmp_path: Path, spec: dict):
    return plan_sweep(load_sweep_spec(write_spec(tmp_path / "spec.yaml", spec)))


def overrides_of(run) -> dict[str, str]:
    return dict(override.split("=", 1) for override in run.overrides)


ONE_SIZE = {"models": {"shapes": [TINY_SHAPES[2]]}}  # stable 73 steps; branches of 45 and 91 steps


def test_ladder_plan_branches_off_one_stable_run_per_size(small_dataset: Path, tmp_path: Path) -> None:
    spec = ladder_spec(small_dataset, tmp_path / "sweep", models={"shapes": TINY_SHAPES[1:]})
    plan = plan_of(tmp_path, spec)
    isoflop = {run.name: run for run in plan_of(tmp_path, {**spec, "mode": "isoflop"}).runs}
    stables = [run for run in plan.runs if run.role == "stable"]
    branches = [run for run in plan.runs if run.role == "branch"]
    assert plan.runs == stables + branches and len(stables) == 2 and len(branches) == 4
    for branch in branches:
        assert branch.steps == isoflop[branch.name].steps and branch.budget == isoflop[branch.name].budget
        assert branch.branch_step == branch.steps - round(0.2 * branch.steps)
        settings = overrides_of(branch)
        assert settings["train.lr_schedule"] == "wsd" and settings["train.cooldown_fraction"] == "0.2"
        assert settings["train.branch_from"].endswith(f"runs/{branch.stable_run}/checkpoints/"
                                                      f"step_{branch.branch_step:08d}")
    for stable in stables:
        points = sorted(run.branch_step for run in branches if run.stable_run == stable.name)
        settings = overrides_of(stable)
        assert stable.budget is None and stable.steps == points[-1]
        assert settings["checkpoint.keep_steps"] == f"[{', '.join(map(str, points))}]"
        assert settings["train.cooldown_fraction"] == "0" and settings["train.steps"] == str(points[-1])
    trained, independent = ladder_flops(plan.runs)
    assert independent == pytest.approx(sum(run.flops for run in branches))
    cooldowns = sum(run.flops * (run.steps - run.branch_step) / run.steps for run in branches)
    assert trained == pytest.approx(sum(run.flops for run in stables) + cooldowns) and trained < 0.8 * independent
    printed = format_plan(plan)
    assert f"saves {independent - trained:.3g}" in printed and "stable-l2-h64-a4-s7: 73 steps" in printed


def test_ladder_refuses_length_dependent_warmup_and_rules(small_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"warmup.fraction=0.05 .* use warmup.steps \(fraction 0\) in mode=ladder"):
        plan_of(tmp_path, ladder_spec(small_dataset, tmp_path / "sweep", warmup={"steps": 2, "fraction": 0.05}))
    timescale = {"weight_decay": {"rule": "timescale", "timescale_fraction": 0.2}}
    with pytest.raises(ConfigError, match=r"train.weight_decay differs .*hyperparameters.weight_decay depends on the "
                                          r"run's length"):
        plan_of(tmp_path, ladder_spec(small_dataset, tmp_path / "sweep", hyperparameters=timescale))
    with pytest.raises(ConfigError, match=r"ladder.cooldown_fraction=0.0 must be in \(0, 1\)"):
        plan_of(tmp_path, ladder_spec(small_dataset, tmp_path / "sweep", ladder={"cooldown_fraction": 0}))
    # One branch of 45 steps from step 36: a 36-step warmup fits the branch (36 + 9 cooldown) but would be
    # cut in the 36-step stable run, whose schedule the branch continues.
    one_branch = {**ONE_SIZE, "budgets": [1.2e10]}
    plan_of(tmp_path, ladder_spec(small_dataset, tmp_path / "sweep", **one_branch, warmup={"steps": 35, "fraction": 0}))
    with pytest.raises(ConfigError, match=r"run stable-l2-h64-a4-s7: the warmup of 36 steps does not fit the stable "
                                          r"run's 36 steps"):
        plan_of(tmp_path, ladder_spec(small_dataset, tmp_path / "sweep", **one_branch,
                                      warmup={"steps": 36, "fraction": 0}))


def test_a_ladder_reads_a_rule_in_d_once_per_size_at_its_stable_runs_horizon(small_dataset: Path,
                                                                             tmp_path: Path) -> None:
    """A rule in D (as `tuned` reads a law fitted at two horizons) is evaluated at the tokens of each size's
    longest branch, the horizon its stable run's constant LR is for; every branch of the size uses that LR."""
    in_tokens = {"lr": {"rule": "power", "value": 3e-3, "reference_params": 1e5, "exponent": -0.3,
                        "reference_tokens": 1e4, "tokens_exponent": -0.2}}
    spec = ladder_spec(small_dataset, tmp_path / "sweep", models={"shapes": TINY_SHAPES[1:]},
                       hyperparameters=in_tokens)
    del spec["learning_rate"]
    plan = plan_of(tmp_path, spec)
    printed = format_plan(plan)
    stables = [run for run in plan.runs if run.role == "stable"]
    assert len(stables) == 2
    for stable in stables:
        branches = [run for run in plan.runs if run.stable_run == stable.name]
        horizon = max(run.budget for run in branches) / stable.counts.flops_per_token
        rule = 3e-3 * (stable.counts.total_params / 1e5) ** -0.3 * (horizon / 1e4) ** -0.2
        assert len(branches) == 2 and stable.rule_tokens == pytest.approx(horizon)
        assert stable.lr == pytest.approx(rule) and all(run.lr == stable.lr for run in branches)
        assert all(run.rule_tokens == stable.rule_tokens for run in branches)
        assert f"constant LR {stable.lr:.3g} (batch {stable.batch_size}, the rules at its horizon D={horizon:.3g}" \
            in printed
    # an IsoFLOP run reads its own D: there the shorter budget's run gets a higher LR
    isoflop = {run.name: run for run in plan_of(tmp_path, {**spec, "mode": "isoflop"}).runs}
    short = next(run for run in plan.runs if run.budget == min(TINY_BUDGETS))
    assert isoflop[short.name].lr == pytest.approx(short.lr * 2 ** 0.2)


def run_sweep(spec_path: Path) -> str:
    """`sweep run`; a fit of two points may fail (exit 1) after every run trained: training is what counts."""
    result = subprocess.run([*launcher(1), "sweep", "run", str(spec_path)], cwd=REPO,
                            env=scaletrain_environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 or "fit failed" in result.stdout, result.stderr[-3000:]
    return result.stdout


def read_results(sweep_dir: Path) -> dict[str, dict[str, str]]:
    with (sweep_dir / "results.csv").open() as file:
        return {row["name"]: row for row in csv.DictReader(file)}


@pytest.fixture(scope="module")
def ladder_sweep(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("ladder")
    spec_path = write_spec(root / "spec.yaml", ladder_spec(small_dataset, root / "sweep", **ONE_SIZE))
    return root / "sweep", run_sweep(spec_path)


@pytest.mark.slow
def test_ladder_branches_equal_fresh_wsd_runs(ladder_sweep: tuple[Path, str], tmp_path: Path) -> None:
    sweep_dir, output = ladder_sweep
    assert "trained 3 runs, skipped 0 already done, 0 failed" in output
    results = read_results(sweep_dir)
    assert {name: row["role"] for name, row in results.items()} == {
        "stable-l2-h64-a4-s7": "stable", "c1.2e10-l2-h64-a4-s7": "branch", "c2.4e10-l2-h64-a4-s7": "branch"}
    assert results["stable-l2-h64-a4-s7"]["budget"] == "" and results["stable-l2-h64-a4-s7"]["status"] == "done"
    branch = "c1.2e10-l2-h64-a4-s7"
    assert results[branch]["status"] == "done" and int(results[branch]["steps"]) == 45
    fresh = tmp_path / "fresh"
    run_scaletrain("train", [str(sweep_dir / "runs" / branch / "run.yaml"), "train.branch_from=", f"run.dir={fresh}"])
    fresh_train, fresh_val = read_metrics(fresh)
    branch_train, branch_val = read_metrics(sweep_dir / "runs" / branch)
    assert sorted(branch_train) == list(range(37, 46))  # the cooldown, after the stable run's step 36
    assert all(branch_train[step]["loss"] == fresh_train[step]["loss"] for step in branch_train)
    assert float(results[branch]["val_loss"]) == fresh_val[45] == branch_val[45]
    # the ladder's figure: the stable run's curve and its branches, a real PNG
    assert f"wrote {sweep_dir / 'ladder.png'}" in output
    assert (sweep_dir / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_an_interrupted_ladder_resumes(
    ladder_sweep: tuple[Path, str], small_dataset: Path, tmp_path: Path
) -> None:
    reference_dir, _ = ladder_sweep
    sweep_dir = tmp_path / "sweep"
    spec_path = write_spec(tmp_path / "spec.yaml", ladder_spec(small_dataset, sweep_dir, **ONE_SIZE))
    stable_dir = sweep_dir / "runs" / "stable-l2-h64-a4-s7"
    sweep = subprocess.Popen([sys.executable, "-m", "scaletrain", "sweep", "run", str(spec_path)], cwd=REPO,
                             env=scaletrain_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 600
    while not (stable_dir / "checkpoints" / "latest").exists() and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    # the sweep and the stable run's trainer, as a preemption would: fresh processes, one process group
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
    assert not (stable_dir / "summary.json").exists(), "the kill should land in the stable run"

    output = run_sweep(spec_path)
    assert "trained 3 runs, skipped 0 already done, 0 failed" in output
    assert "resuming at step" in (stable_dir / "train.log").read_text()
    assert json.loads((stable_dir / "status.json").read_text())["attempts"] == 2
    reference, results = read_results(reference_dir), read_results(sweep_dir)
    for name, row in results.items():
        assert (row["status"], row["val_loss"], row["steps"]) == (
            "done", reference[name]["val_loss"], reference[name]["steps"]), name


def archive_cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(1), "sweep", *arguments], cwd=REPO, env=scaletrain_environment(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_an_archived_ladder_restores_on_a_new_machine_with_the_same_results(
    ladder_sweep: tuple[Path, str], small_dataset: Path, tmp_path: Path
) -> None:
    """`sweep archive` keeps the finished runs' records without checkpoints; restored into an empty directory
    (a new machine: the sweep directory gone), `sweep run` trains nothing and results.csv is the same, number
    for number. Archiving again writes nothing new."""
    reference_dir, _ = ladder_sweep
    archive = tmp_path / "records"
    spec_path = write_spec(tmp_path / "spec.yaml", ladder_spec(small_dataset, reference_dir, **ONE_SIZE))
    archived = archive_cli("archive", str(spec_path), str(archive))
    assert archived.returncode == 0, archived.stderr[-2000:]
    assert "archived 3 finished runs of sweep tiny-ladder" in archived.stdout
    assert not list(archive.rglob("checkpoints"))
    assert sum(path.stat().st_size for path in archive.rglob("*") if path.is_file()) < sum(
        (reference_dir / "runs" / name / "metrics.jsonl").stat().st_size for name in read_results(reference_dir)) / 3
    again = archive_cli("archive", str(reference_dir), str(archive))
    assert "archived 0 finished runs" in again.stdout and "3 already there unchanged" in again.stdout, again.stderr

    new_machine = tmp_path / "sweep"
    restored = archive_cli("restore", str(archive), "--to", str(new_machine))
    assert restored.returncode == 0 and f"restored 3 finished runs into {new_machine}" in restored.stdout, \
        restored.stderr[-2000:]
    output = run_sweep(write_spec(tmp_path / "moved.yaml", ladder_spec(small_dataset, new_machine, **ONE_SIZE)))
    assert "trained 0 runs, skipped 3 already done, 0 failed" in output
    reference, results = read_results(reference_dir), read_results(new_machine)
    assert set(results) == set(reference)
    for name, row in results.items():
        assert {key: value for key, value in row.items()} == reference[name], name


def test_archive_keeps_back_a_stable_run_with_a_branch_to_go(ladder_sweep: tuple[Path, str], tmp_path: Path) -> None:
    """A stable run whose branch has not finished is not archived (its branch needs its checkpoints, which
    the archive does not keep); its finished branch is. Once the branch is done, the next archive adds it."""
    from scaletrain.scaling.sweep.archive import archive_sweep, restore_sweep

    reference_dir, _ = ladder_sweep
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(reference_dir, sweep_dir)
    unfinished = sweep_dir / "runs" / "c2.4e10-l2-h64-a4-s7" / "summary.json"
    kept = unfinished.read_bytes()
    unfinished.unlink()
    outcome = archive_sweep(sweep_dir, tmp_path / "records", "tiny-ladder")
    assert outcome.archived == ["runs/c1.2e10-l2-h64-a4-s7"] and outcome.unfinished == 1
    assert list(outcome.kept_back) == ["runs/stable-l2-h64-a4-s7"]
    assert "1 of its branches (c2.4e10-l2-h64-a4-s7) start from its checkpoints" in \
        outcome.kept_back["runs/stable-l2-h64-a4-s7"]
    unfinished.write_bytes(kept)
    outcome = archive_sweep(sweep_dir, tmp_path / "records", "tiny-ladder")
    assert sorted(outcome.archived) == ["runs/c2.4e10-l2-h64-a4-s7", "runs/stable-l2-h64-a4-s7"]
    assert outcome.unchanged == ["runs/c1.2e10-l2-h64-a4-s7"] and not outcome.kept_back
    # a restore leaves a run that finished where it goes as it is, and puts the others back
    shutil.rmtree(sweep_dir / "runs" / "stable-l2-h64-a4-s7")
    _, restored, left = restore_sweep(tmp_path / "records", sweep_dir)
    assert restored == ["runs/stable-l2-h64-a4-s7"] and len(left) == 2


def test_archive_and_restore_refuse_what_is_not_a_sweep_or_an_archive(tmp_path: Path) -> None:
    not_a_sweep = tmp_path / "empty"
    not_a_sweep.mkdir()
    result = archive_cli("archive", str(not_a_sweep), str(tmp_path / "records"))
    assert result.returncode != 0 and not (tmp_path / "records").exists()
    assert f"{not_a_sweep} holds no planned sweep" in result.stderr and "give its spec" in result.stderr
    result = archive_cli("restore", str(not_a_sweep), "--to", str(tmp_path / "sweep"))
    assert result.returncode != 0 and not (tmp_path / "sweep").exists()
    assert f"{not_a_sweep} is no sweep archive (archive.json is missing)" in result.stderr


def test_a_ladder_trains_each_stable_run_then_its_branches(small_dataset: Path, tmp_path: Path) -> None:
    """The plan lists the stable runs first (SLURM's waves); the local executor trains one size at a time."""
    from scaletrain.scaling.sweep.executors import execution_order

    plan = plan_of(tmp_path, ladder_spec(small_dataset, tmp_path / "sweep", models={"shapes": TINY_SHAPES[1:]}))
    assert [run.role for run in plan.runs] == ["stable", "stable", "branch", "branch", "branch", "branch"]
    order = execution_order(plan.runs)
    assert sorted(run.name for run in order) == sorted(run.name for run in plan.runs)
    assert [run.role for run in order] == ["stable", "branch", "branch"] * 2
    assert all(branch.stable_run == order[index].name for index in (0, 3) for branch in order[index + 1:index + 3])


@pytest.mark.slow
def test_a_ladder_two_runs_at_a_time_waits_for_the_stable_run(
    ladder_sweep: tuple[Path, str], small_dataset: Path, tmp_path: Path
) -> None:
    """--jobs 2 on a ladder of one size: its stable run trains alone, its two branches then side by side (they
    start from its checkpoints), and every result is the one-at-a-time ladder's."""
    reference_dir, _ = ladder_sweep
    spec_path = write_spec(tmp_path / "spec.yaml", ladder_spec(small_dataset, tmp_path / "sweep", **ONE_SIZE))
    result = subprocess.run([*launcher(1), "sweep", "run", str(spec_path), "--jobs", "2"], cwd=REPO,
                            env=scaletrain_environment(), capture_output=True, text=True, timeout=900)
    assert "trained 3 runs, skipped 0 already done, 0 failed" in result.stdout, result.stderr[-3000:]
    events = [line.split()[0] if line.startswith("[") else line.split()[0] + " done"
              for line in result.stdout.splitlines() if line.startswith("[") or line.endswith(" done")]
    assert events[:3] == ["[1/3]", "stable-l2-h64-a4-s7 done", "[2/3]"] and events[3] == "[3/3]"
    reference, results = read_results(reference_dir), read_results(tmp_path / "sweep")
    for name, row in results.items():
        assert (row["status"], row["val_loss"], row["train_loss"]) == (
            "done", reference[name]["val_loss"], reference[name]["train_loss"]), name
