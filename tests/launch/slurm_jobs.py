"""SLURM jobs of launch/slurm.sbatch for the tests on one node (test_slurm_train.py) and across the
namespace hosts (test_slurm_multinode.py): the tiny GPT's overrides, submission, and the checks that a
job's losses are those of a reference run."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from tests.slurm_cluster import FINAL_STATES, SlurmCluster
from tests.train.runs import DEMO_CONFIG, REPO, read_metrics, tiny_overrides
from tests.warm import warm_bin, warm_environment

STEPS = 40
SCRIPT = REPO / "launch" / "slurm.sbatch"
# The script header's overrides for a node without GPUs: two ranks, one core each.
CPU_NODE = ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1"]
# --time=3 with --signal=B:USR1@170: the signal is due once fewer than 170 + 30 s are left, that is at
# the first time-limit check after the job starts; the 3 minutes leave a busy host time to start the
# ranks and stop them before the limit itself.
TIME_LIMIT = ["--time=3", "--signal=B:USR1@170"]


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    # No periodic checkpoint before the last step: a checkpoint mid-run can only come from the signal.
    return [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", f"train.eval_every={STEPS // 2}",
            f"checkpoint.every={STEPS}", "parallel.zero_stage=1"]


def submit_training(cluster: SlurmCluster, data_dir: Path, run_dir: Path, log: Path, sbatch_args: list[str],
                    extra: Sequence[str] = (), warm: bool = True) -> int:
    """sbatch launch/slurm.sbatch from the repository; `extra` overrides follow the tiny run's. With
    `warm`, warm_bin() (tests/warm.py) is first on the job's PATH, so its `python -m scaletrain` processes
    are warm forks, each in its node's namespaces. Else every process of the job's first start is a fresh
    interpreter (a test of a signal that comes while the ranks start up needs a real start-up): first on
    its PATH is a directory that is empty until warm_later_starts(log) puts warm_bin()'s programs in it."""
    python_path = f"{Path(sys.executable).parent}:{cluster.env['PATH']}"
    environment = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", "STOP_REPEAT_S": "1"}
    if warm:
        environment = warm_environment({**environment, "PATH": python_path})
    else:
        later_bin(log).mkdir()
        environment = {**warm_environment(environment), "PATH": f"{later_bin(log)}:{python_path}"}
    return cluster.submit([*CPU_NODE, *sbatch_args, f"--output={log}", str(SCRIPT), str(DEMO_CONFIG),
                           *overrides(data_dir, run_dir), *extra], cwd=REPO, env=environment)


def later_bin(log: Path) -> Path:
    """The first directory on the PATH of a job submitted with warm=False, beside its log."""
    return log.with_name(f"{log.stem}-later-bin")


def warm_later_starts(log: Path) -> None:
    """From now on, the job submitted with warm=False and logging to `log` starts warm forks, as a warm
    job does: for a requeued job's next start, which does not test the start-up."""
    for program in warm_bin().iterdir():
        (later_bin(log) / program.name).symlink_to(program)


def assert_same_losses(run_dir: Path, reference: Path, tolerance: float = 0.0) -> None:
    """Every step logged once, each loss and LR and every validation loss equal to the reference's:
    bit for bit, or within a relative `tolerance` (another layout's sums in another order)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "loss" in record] == list(range(1, STEPS + 1)), "each step once"
    training, validation = read_metrics(run_dir)
    reference_training, reference_validation = read_metrics(reference)
    assert sorted(training) == list(range(1, STEPS + 1))
    for step in training:
        loss, reference_loss = training[step]["loss"], reference_training[step]["loss"]
        assert abs(loss - reference_loss) <= tolerance * reference_loss, f"step {step}: {loss} vs {reference_loss}"
        assert training[step]["lr"] == reference_training[step]["lr"], f"step {step}"
    assert validation.keys() == reference_validation.keys()
    for step, value in reference_validation.items():
        assert abs(validation[step] - value) <= tolerance * value, f"validation at step {step}"


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("step_")) for path in (run_dir / "checkpoints").glob("step_*"))


def script_log_time(log: str, event: str) -> float:
    """When the job script logged `event` (its lines start with a [date time.ms] stamp)."""
    line = next(line for line in log.splitlines() if "slurm.sbatch" in line and event in line)
    return datetime.fromisoformat(line[1:line.index("]")]).timestamp()


def submit_before_a_time_limit_check(cluster: SlurmCluster, submit: Callable[[], int],
                                     lead_s: tuple[float, float] = (2, 6)) -> int:
    """Submit when slurmctld's next time-limit check is lead_s seconds away (or up to a second more), so
    the job's signal comes at that check, while the job script starts up, on a fast host as on a slow one."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if lead_s[0] <= cluster.next_time_limit_check() - time.time() <= lead_s[1]:
            return submit()
        time.sleep(0.2)
    raise AssertionError(f"no time-limit check logged in 90 s\n{cluster.log_tails()}")


def wait_for_slurm_step(cluster: SlurmCluster, job_id: int, run_dir: Path, log: Path, step: int,
                        timeout: float = 600.0) -> None:
    """Until the job's run has logged training step `step` (or later); fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").exists()
               and max(read_metrics(run_dir, while_written=True)[0], default=0) >= step):
        assert cluster.job_fields(job_id)["JobState"] not in FINAL_STATES, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} in {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.02)


def wait_for_requeue(cluster: SlurmCluster, job_id: int, log: Path, timeout: float = 600.0) -> None:
    """Until SLURM counts a restart of the job (the script, or slurmctld after a node failure, requeued
    it); fails if the job ends first or `timeout` passes. The state may be RUNNING, or SIGNALING while
    slurmctld sends a --signal."""
    deadline = time.monotonic() + timeout
    while (fields := cluster.job_fields(job_id))["Restarts"] == "0":
        state = fields["JobState"]
        assert state not in FINAL_STATES, f"{state} before a requeue:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no requeue in {timeout:.0f} s:\n{log.read_text()[-3000:]}\n" \
                                            f"{cluster.log_tails()}"
        time.sleep(0.2)
