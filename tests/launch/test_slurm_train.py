"""launch/slurm.sbatch on a real one-node SLURM, CPU ranks on gloo: two ranks started by srun train
bit for bit like torchrun's, and a job that gets its time-limit signal checkpoints at the step it
stopped, requeues itself and finishes with the losses of an uninterrupted run, bit for bit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.launch.slurm_jobs import (
    STEPS,
    TIME_LIMIT,
    assert_same_losses,
    checkpoint_steps,
    overrides,
    script_log_time,
    submit_before_a_time_limit_check,
    submit_training,
    wait_for_requeue,
    warm_later_starts,
)
from tests.slurm_cluster import (  # noqa: F401 (slurm_cluster_fixture registers the fixture)
    FINAL_STATES,
    SlurmCluster,
    slurm_cluster_fixture,
)
from tests.train.runs import DEMO_CONFIG, read_metrics, run_scaletrain

pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def torchrun_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir)], nproc=2)
    return run_dir


def test_two_ranks_started_by_srun_train_like_torchrun(
    slurm_cluster: SlurmCluster, small_dataset: Path, torchrun_run: Path, tmp_path: Path
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    started = time.monotonic()
    job_id = submit_training(slurm_cluster, small_dataset, run_dir, log, [])

    assert slurm_cluster.wait(job_id, timeout=600) == {0: "COMPLETED"}, log.read_text()[-3000:]
    print(f"SLURM job of {STEPS} steps: {time.monotonic() - started:.0f} s from sbatch to COMPLETED")
    fields = slurm_cluster.job_fields(job_id)
    assert (fields["ExitCode"], fields["Restarts"]) == ("0:0", "0")
    text = log.read_text()
    assert "2 ranks (1 nodes x 2)" in text and "ok: gpt" in text, "scaletrain check ran before srun"
    assert "world 2 = TP 1 x DP 2 x PP 1" in text and "starting at step 0" in text
    assert "training finished" in text
    assert checkpoint_steps(run_dir) == [STEPS]
    assert_same_losses(run_dir, torchrun_run)


@pytest.mark.long_job  # a real SLURM job that waits for slurmctld's 30 s time-limit check, then a requeue
def test_time_limit_signal_checkpoints_at_the_step_requeues_and_resumes_exactly(
    slurm_cluster: SlurmCluster, small_dataset: Path, torchrun_run: Path, tmp_path: Path
) -> None:
    """slurmctld sends --signal only at its time-limit checks, every 30 s: the signal is placed at a
    check just after the job starts, while the ranks start up, so it is the same on any host. The ranks
    ignore USR1 until their handler is in; the script repeats it every STOP_REPEAT_S (1 s here). Only
    the first start tests the start-up: the second, which resumes, runs warm forks (tests/warm.py)."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    started = time.monotonic()
    job_id = submit_before_a_time_limit_check(
        slurm_cluster, lambda: submit_training(slurm_cluster, small_dataset, run_dir, log, TIME_LIMIT, warm=False))

    wait_for_requeue(slurm_cluster, job_id, log)
    warm_later_starts(log)
    first_start = log.read_text()
    stopped_at = max(read_metrics(run_dir)[0])
    assert 1 <= stopped_at < STEPS
    assert checkpoint_steps(run_dir) == [stopped_at], "no step lost: the checkpoint is at the last logged step"
    assert f"stopped early (signal SIGUSR1) at step {stopped_at}/{STEPS}" in first_start
    assert "requeueing the job" in first_start
    signal_to_exit = script_log_time(first_start, "requeueing") - script_log_time(first_start, "USR1")
    # Each start has the full time limit again, so a run longer than one limit is requeued once per
    # limit; lifting the limit while the job waits to start again lets this one finish in its second.
    slurm_cluster.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=30"])

    assert slurm_cluster.wait(job_id, timeout=600) == {0: "COMPLETED"}, log.read_text()[-3000:]
    print(f"time-limit signal at start-up -> ranks stopped at step {stopped_at} and exited: {signal_to_exit:.1f} s; "
          f"sbatch to COMPLETED after one requeue: {time.monotonic() - started:.0f} s")
    fields = slurm_cluster.job_fields(job_id)
    assert (fields["ExitCode"], fields["Restarts"]) == ("0:0", "1")
    text = log.read_text()
    assert text.startswith(first_start), "--open-mode=append keeps the first start's log"
    assert f"resuming at step {stopped_at} from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in text
    assert "training finished" in text
    assert_same_losses(run_dir, torchrun_run)
