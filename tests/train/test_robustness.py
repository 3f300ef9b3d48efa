"""Runs that survive what clusters do to them: preemption signals, kill -9, a second process on the
same run directory, a broken newest checkpoint, a changed LR on resume. Every interrupted run is
checked against an uninterrupted one, step by step, bit for bit (CPU, fp32)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scaletrain.config import TrainConfig
from scaletrain.train.schedule import learning_rate
from scaletrain.train.stopping import EXIT_STOPPED_EARLY
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    checkpoint_steps,
    launcher,
    logged_steps,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    start_training,
    tiny_overrides,
    wait_for_checkpoint,
    wait_for_step,
)

STEPS = 30


def overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=10",
            "checkpoint.every=10", "checkpoint.keep_last=3", *extra]


@pytest.fixture(scope="module")
def straight_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir)])
    return run_dir


@pytest.fixture(scope="module")
def straight_run_two_ranks(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight_dp2") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "parallel.zero_stage=1")], nproc=2)
    return run_dir


def assert_same_trajectory(run_dir: Path, reference: Path) -> None:
    """Every step logged exactly once, and each loss, LR and validation loss equal to the reference's."""
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    training, validation = read_metrics(run_dir)
    reference_training, reference_validation = read_metrics(reference)
    for step in range(1, STEPS + 1):
        assert training[step]["loss"] == reference_training[step]["loss"], f"step {step}"
        assert training[step]["lr"] == reference_training[step]["lr"], f"step {step}"
    assert validation == reference_validation


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_preemption_signal_checkpoints_at_the_step_and_resume_is_exact(
    nproc: int, small_dataset: Path, straight_run: Path, straight_run_two_ranks: Path, tmp_path: Path
):
    """SIGTERM (1 rank) or SIGUSR1 (to every rank, as SLURM's --signal does): the run stops after a
    complete step, checkpoints there and exits 75; resuming trains the remaining steps exactly. One rank is a
    warm fork (tests/warm.py), to which its client passes the SIGTERM on; two are fresh, found by command line."""
    run_dir = tmp_path / "run"
    extra = ["parallel.zero_stage=1"] if nproc == 2 else []
    process = start_training(overrides(small_dataset, run_dir, *extra), nproc, log=tmp_path / "train.log",
                             fresh=nproc == 2)
    wait_for_step(run_dir, 4, process)
    signalled = time.monotonic()
    if nproc == 1:
        process.send_signal(signal.SIGTERM)
    else:
        # to the ranks, not the torchrun launcher (whose default action on SIGUSR1 is to die)
        subprocess.run(["pkill", "-USR1", "-f", "--", f"-u -m scaletrain train .*run.dir={run_dir}"], check=True)
    returncode = process.wait(timeout=120)
    stop_seconds = time.monotonic() - signalled
    log = (tmp_path / "train.log").read_text()
    if nproc == 1:
        assert returncode == EXIT_STOPPED_EARLY, log[-3000:]
    else:  # each rank's own 75, none turned into a death by the SIGTERM torchrun sends once one has exited
        assert log.count(f"exitcode  : {EXIT_STOPPED_EARLY}") == nproc and "exitcode  : -15" not in log, log[-3000:]
    stopped_at = logged_steps(run_dir)[-1]
    assert 4 <= stopped_at < STEPS
    assert checkpoint_steps(run_dir)[-1] == stopped_at, "no step lost: the checkpoint is at the last logged step"
    assert "stopped early (signal" in log and "run the same command again to resume" in log
    assert "parameters" in log and f"world {nproc} = TP 1 x DP {nproc} x PP 1" in log and "starting at step 0" in log
    print(f"{nproc} rank(s): stopped at step {stopped_at}, {stop_seconds:.2f} s from signal to exit")
    resumed = subprocess.run([*launcher(nproc), "train", str(DEMO_CONFIG), *overrides(small_dataset, run_dir, *extra)],
                             cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {stopped_at} from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in resumed.stderr
    assert f"finished: {STEPS} steps" in resumed.stderr and "final val_loss" in resumed.stderr
    assert_same_trajectory(run_dir, straight_run_two_ranks if nproc == 2 else straight_run)
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS


@pytest.mark.slow
def test_kill_9_then_resume_logs_every_step_once(small_dataset: Path, straight_run: Path, tmp_path: Path):
    """A hard kill after the step-10 checkpoint: the steps after it are trained and logged again,
    and metrics.jsonl ends with each step once (the resumed run drops the replayed records)."""
    run_dir = tmp_path / "run"
    process = start_training(overrides(small_dataset, run_dir))
    wait_for_step(run_dir, 13, process)
    wait_for_checkpoint(run_dir, 10)
    process.kill()
    process.wait()
    assert checkpoint_steps(run_dir)[-1] == 10 and logged_steps(run_dir)[-1] >= 13
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir)])
    assert_same_trajectory(run_dir, straight_run)


@pytest.mark.slow
def test_exit_after_and_wall_clock_budget_stop_with_exit_code_75(small_dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "train.exit_after=3")],
                   stopped_early=True)
    assert checkpoint_steps(run_dir) == [3] and not (run_dir / "summary.json").exists()
    # a budget that has run out after the first step of this invocation
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "train.exit_after_minutes=1e-6")],
                   stopped_early=True)
    assert checkpoint_steps(run_dir) == [3, 4]


@pytest.mark.slow
def test_a_changed_learning_rate_on_resume_takes_effect(small_dataset: Path, tmp_path: Path):
    """The schedule is recomputed from the config at the resumed step, never scaled by the old LR."""
    run_dir = tmp_path / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "train.exit_after=10")],
                   stopped_early=True)
    changed = ["train.lr=1e-4", "train.min_lr=2e-5", "train.warmup_steps=12"]
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, *changed)])
    training, _ = read_metrics(run_dir)
    written = TrainConfig(steps=STEPS, lr=1e-4, min_lr=2e-5, warmup_steps=12)
    original = TrainConfig(steps=STEPS, lr=3e-3, min_lr=3e-4, warmup_steps=2)
    assert [training[step]["lr"] for step in range(1, 11)] == [learning_rate(s, original) for s in range(10)]
    assert [training[step]["lr"] for step in range(11, STEPS + 1)] == [
        learning_rate(s, written) for s in range(10, STEPS)]


@pytest.mark.slow
def test_a_second_train_on_the_same_run_dir_is_refused(small_dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    first = start_training(overrides(small_dataset, run_dir, "train.steps=100000", "train.eval_every=0"), fresh=True)
    try:
        wait_for_step(run_dir, 2, first)
        second = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *overrides(small_dataset, run_dir)],
                                cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        assert f"run.dir={run_dir} is in use by pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.wait()
    # a killed holder leaves no stale lock: the next run starts (and trains a step)
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "train.steps=100000",
                                                          "train.eval_every=0", "train.exit_after=1")],
                   stopped_early=True)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_resume_auto_falls_back_past_a_broken_newest_checkpoint(
    damage: str, small_dataset: Path, straight_run: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "train.exit_after=20")],
                   stopped_early=True)
    broken = run_dir / "checkpoints" / "step_00000020" / "model" / "rank_00000.pt"
    content = broken.read_bytes()
    broken.write_bytes(content[: len(content) // 2] if damage == "truncated" else bytes(len(content)))
    result = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *overrides(small_dataset, run_dir)],
                            cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"skipping checkpoint {broken.parents[1]}" in result.stderr
    assert "resuming at step 10" in result.stderr
    assert_same_trajectory(run_dir, straight_run)


@pytest.mark.slow
def test_workers_stop_when_the_torchrun_launcher_is_killed(small_dataset: Path, tmp_path: Path):
    """SIGKILL to torchrun alone: its ranks get SIGTERM from the kernel, checkpoint and exit."""
    run_dir = tmp_path / "run"
    launcher_process = start_training(
        overrides(small_dataset, run_dir, "parallel.zero_stage=1", "train.steps=100000", "train.eval_every=0"), 2,
        fresh=True)
    workers: list[str] = []
    try:
        wait_for_step(run_dir, 3, launcher_process)
        workers = subprocess.run(["pgrep", "-P", str(launcher_process.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) == 2
        launcher_process.kill()
        launcher_process.wait()
        deadline = time.monotonic() + 120
        while any(map(running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(running, workers)), "orphaned workers train on"
        assert checkpoint_steps(run_dir)[-1] == logged_steps(run_dir)[-1], "they stopped at a checkpoint"
    finally:  # never leave a 100,000-step run behind
        launcher_process.kill()
        subprocess.run(["kill", "-9", *workers], capture_output=True)


def running(pid: str) -> bool:
    """The process exists and is not a zombie waiting for its new parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 3 MiB tmpfs (room for one 2.1 MB checkpoint of the tiny model, not two); root only."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mounted.stderr.strip()}); needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_names_the_file_keeps_the_last_checkpoint_and_resumes(
    small_dataset: Path, straight_run: Path, small_disk: Path
):
    """The step-20 checkpoint does not fit: the run stops with one message naming the file and the
    full disk, leaves no staging directory, and resumes exactly from step 10 once there is room."""
    run_dir = small_disk / "run"
    result = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *overrides(small_dataset, run_dir)],
                            cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    staging = run_dir / "checkpoints" / ".staging-step_00000020"
    assert f"checkpoint not saved: could not write {staging}/" in errors[0], errors[0]
    assert "no space left on device" in errors[0]
    assert f"the newest complete checkpoint left is {run_dir / 'checkpoints' / 'step_00000010'}" in errors[0]
    assert 20 < logged_steps(run_dir)[-1] < 25, "it stopped a step or so after the failed save, not at the end"
    assert checkpoint_steps(run_dir) == [10] and not staging.exists()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000010"
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir)])
    assert resumed is not None
    assert_same_trajectory(run_dir, straight_run)


@pytest.mark.slow
def test_an_unwritable_checkpoint_directory_stops_the_run_before_its_first_step_or_at_the_next(
    small_dataset: Path, tmp_path: Path
):
    """A plain file in place of checkpoints/ (root writes through a read-only mode, not through this):
    `train` used to train on, learn of its failed background save only at the save after, and exit
    saying "the previous checkpoints are intact" with none saved. It is refused before the first step
    now, and a directory that goes bad mid-run stops the run at the step after the failed save."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    args = overrides(small_dataset, run_dir, "train.eval_every=0", "train.steps=60", "checkpoint.every=20")
    checkpoints.parent.mkdir()
    checkpoints.write_text("in the way")
    refused = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *args], cwd=REPO, env=scaletrain_environment(),
                             capture_output=True, text=True, timeout=300)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("scaletrain train: error:")]
    assert refused.returncode == 2 and errors == [
        f"scaletrain train: error: {checkpoints} is not a writable directory (not a directory), so no checkpoint "
        "could be saved; make it one (move away what is there) or set run.dir to another directory"
    ], refused.stderr[-3000:]
    assert not (run_dir / "metrics.jsonl").exists(), "no step trained"

    checkpoints.unlink()
    process = start_training(args, log=tmp_path / "train.log")
    try:
        wait_for_step(run_dir, 1, process)
        checkpoints.write_text("in the way")  # the first save, at step 20, fails
        assert process.wait(timeout=300) == 2
    finally:
        process.kill()
    log = (tmp_path / "train.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("scaletrain train: error:")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert f"checkpoint not saved: could not write {checkpoints / '.staging-step_00000020'}" in errors[0]
    assert f"no complete checkpoint of this run is left under {checkpoints}" in errors[0]
    assert "intact" not in errors[0]
    assert 20 < logged_steps(run_dir)[-1] < 25, "it stopped a step or so after the failed save, not at the next (40)"
