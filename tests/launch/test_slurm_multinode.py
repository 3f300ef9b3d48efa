"""launch/slurm.sbatch across hosts (issue 23): a real SLURM cluster of three nodes, one per namespace host
(tests/hosts.py, tests/slurm_cluster.py's start_slurm_on_hosts), CPU ranks on gloo, the script unchanged.

- a 2-node job, two ranks per node, TP2 inside each node x DP2 across, trains the single-rank model;
- the same job preempted by its time-limit signal (--signal=B:USR1@N) checkpoints at the step it
  stopped on both nodes, requeues and finishes bit for bit like the uninterrupted 2-node job;
- a 2-node job stopped (scancel --batch --signal=USR1) and requeued onto 3 nodes resumes by resharding
  (TP2 x DP2 -> TP2 x DP3) and trains the single-rank model.

Every process of a job is a warm fork (tests/warm.py) that entered its node's namespaces: the job's PATH
starts with warm_bin(); but for the first start of the preempted job, whose signal comes as its fresh
ranks start up.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hosts import Hosts, make_hosts, missing_requirement
from tests.launch.slurm_jobs import (
    STEPS,
    TIME_LIMIT,
    assert_same_losses,
    checkpoint_steps,
    overrides,
    submit_before_a_time_limit_check,
    submit_training,
    wait_for_requeue,
    wait_for_slurm_step,
    warm_later_starts,
)
from tests.scaling.sweeps import TINY_SHAPES, tiny_spec, write_spec
from tests.slurm_cluster import SlurmCluster, start_slurm_on_hosts
from tests.slurm_cluster import missing_requirement as missing_slurm
from tests.train.runs import DEMO_CONFIG, REPO, WARM_CLIENT, read_metrics, run_scaletrain, wait_for_checkpoint
from tests.warm import warm_bin, warm_environment

pytestmark = [pytest.mark.slow, pytest.mark.serial]

TWO_NODES = ["--nodes=2", "--ntasks-per-node=2"]
TENSOR_PARALLEL = ["parallel.tensor=2"]
# Global batch 12 = micro 2 x DP x grad_accum: 3 on 2 nodes (DP2), 2 on 3 nodes (DP3), 6 on one rank; every
# layout evaluates the same 12 validation sequences (the train.eval_seed sample, each counted once).
RESIZABLE = ["parallel.tensor=2", "train.micro_batch_size=2", "train.global_batch_size=12", "train.eval_samples=12"]
JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    reason = missing_requirement() or missing_slurm()
    if reason is not None:
        pytest.skip(reason)
    with make_hosts(3, tmp_path_factory.mktemp("hosts")) as made:
        yield made


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory):
    with start_slurm_on_hosts(hosts, tmp_path_factory.mktemp("slurm")) as started:
        yield started


def single_rank(data_dir: Path, run_dir: Path, extra: list[str]) -> Path:
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(data_dir, run_dir), *extra])
    return run_dir


@pytest.fixture(scope="module")
def two_node_job(cluster: SlurmCluster, small_dataset: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[Path, str]:
    """An uninterrupted 2-node TP2 x DP2 job: its run directory and its log."""
    directory = tmp_path_factory.mktemp("two_nodes")
    run_dir, log = directory / "run", directory / "job.out"
    started = time.monotonic()
    job_id = submit_training(cluster, small_dataset, run_dir, log, TWO_NODES, TENSOR_PARALLEL)
    assert cluster.wait(job_id, timeout=JOB_TIMEOUT_S) == {0: "COMPLETED"}, log.read_text()[-3000:]
    print(f"2-node SLURM job of {STEPS} steps: {time.monotonic() - started:.0f} s from sbatch to COMPLETED")
    return run_dir, log.read_text()


def rank_hosts(log: str) -> dict[int, str]:
    """Rank -> host from rank 0's start-up lines (srun --label puts the task id first)."""
    return {int(rank): host for rank, host in
            re.findall(r"^\s*0: train: rank (\d+) \(local \d\) on (n\d), cpu;", log, flags=re.MULTILINE)}


def test_a_two_node_job_tp2_inside_dp2_across_trains_the_single_rank_model(
    two_node_job: tuple[Path, str], small_dataset: Path, tmp_path: Path
) -> None:
    run_dir, log = two_node_job
    reference = single_rank(small_dataset, tmp_path / "single", [])
    assert_same_losses(run_dir, reference, tolerance=1e-4)
    assert "4 ranks (2 nodes x 2)" in log and "nodes: n1 n2;" in log
    assert "world 4 = TP 2 x DP 2 x PP 1" in log, "scaletrain check ran, with the ranks per node"
    assert rank_hosts(log) == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}, log[-3000:]
    assert re.search(r"^\s*3: ", log, flags=re.MULTILINE), "every rank's lines carry its rank"
    assert checkpoint_steps(run_dir) == [STEPS] and "training finished" in log


@pytest.mark.long_job  # waits for slurmctld's 30 s time-limit check, then a requeue
def test_a_preempted_two_node_job_requeues_and_finishes_like_the_uninterrupted_one(
    cluster: SlurmCluster, two_node_job: tuple[Path, str], small_dataset: Path, tmp_path: Path
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job_id = submit_before_a_time_limit_check(
        cluster, lambda: submit_training(cluster, small_dataset, run_dir, log, [*TWO_NODES, *TIME_LIMIT],
                                         TENSOR_PARALLEL, warm=False))
    wait_for_requeue(cluster, job_id, log, JOB_TIMEOUT_S)
    warm_later_starts(log)  # fresh ranks for the signal at start-up; the resumed start need not be
    stopped_at = max(read_metrics(run_dir)[0])
    assert 1 <= stopped_at < STEPS and checkpoint_steps(run_dir) == [stopped_at]
    cluster.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=30"])  # finish in the second start

    assert cluster.wait(job_id, timeout=JOB_TIMEOUT_S) == {0: "COMPLETED"}, log.read_text()[-3000:]
    text = log.read_text()
    assert f"stopped early (signal SIGUSR1) at step {stopped_at}/{STEPS}" in text
    assert f"resuming at step {stopped_at}" in text and "training finished" in text
    assert cluster.job_fields(job_id)["Restarts"] == "1"
    assert_same_losses(run_dir, two_node_job[0])


@pytest.mark.long_job  # two starts of a multi-host SLURM job, 4 and 6 fresh ranks
def test_a_job_requeued_onto_three_nodes_reshards_and_trains_the_single_rank_model(
    cluster: SlurmCluster, small_dataset: Path, tmp_path: Path
) -> None:
    """Stopped the way a user stops a run (scancel --batch --signal=USR1) once it trains on 2 nodes, given a
    third node while it waits to start again (scontrol update NumNodes=3-3 NumTasks=6), it resumes its TP2 x DP2
    checkpoint as TP2 x DP3 and ends with the single-rank run's losses."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job_id = submit_training(cluster, small_dataset, run_dir, log, TWO_NODES, RESIZABLE)
    wait_for_slurm_step(cluster, job_id, run_dir, log, 1, JOB_TIMEOUT_S)
    cluster.run(["scancel", "--batch", "--signal=USR1", str(job_id)])
    wait_for_requeue(cluster, job_id, log, JOB_TIMEOUT_S)
    stopped_at = max(read_metrics(run_dir)[0])
    assert 1 <= stopped_at < STEPS and checkpoint_steps(run_dir) == [stopped_at]
    cluster.run(["scontrol", "update", f"JobId={job_id}", "NumNodes=3-3", "NumTasks=6"])

    assert cluster.wait(job_id, timeout=JOB_TIMEOUT_S) == {0: "COMPLETED"}, log.read_text()[-3000:]
    text = log.read_text()
    assert "6 ranks (3 nodes x 2)" in text and "world 6 = TP 2 x DP 3 x PP 1" in text
    assert f"resumes at step {stopped_at} of {STEPS}" in text and "(resharded from TP2xDP2 ZeRO-1)" in text
    assert rank_hosts(text[text.index("start 2)"):]) == {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3", 5: "n3"}
    assert_same_losses(run_dir, single_rank(small_dataset, tmp_path / "single", RESIZABLE[1:]), tolerance=1e-4)


def test_a_two_node_job_whose_ranks_on_one_node_are_killed_requeues_and_finishes_like_the_uninterrupted_one(
    cluster: SlurmCluster, hosts: Hosts, two_node_job: tuple[Path, str], small_dataset: Path, tmp_path: Path
) -> None:
    """n2's ranks are SIGKILLed after the checkpoint of step 10 (the OOM killer, a crash): n1's ranks
    exit 76 naming n2, srun reports the killed ones (128 + 9), the script requeues the job, and the
    second start resumes from step 10 and ends with the uninterrupted job's losses, bit for bit."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job_id = submit_training(cluster, small_dataset, run_dir, log, TWO_NODES, [*TENSOR_PARALLEL, "checkpoint.every=10"])
    wait_for_slurm_step(cluster, job_id, run_dir, log, 12, JOB_TIMEOUT_S)
    wait_for_checkpoint(run_dir, 10)
    assert hosts.kill(hosts[1], is_rank), "no rank on n2"
    wait_for_requeue(cluster, job_id, log, JOB_TIMEOUT_S)

    assert cluster.wait(job_id, timeout=JOB_TIMEOUT_S) == {0: "COMPLETED"}, log.read_text()[-3000:]
    text = log.read_text()
    assert re.search(r"^\s*0: scaletrain train: error: rank 0 on n1: lost contact with n2 \(10\.77\.0\.2, ranks 2, 3\)",
                     text, flags=re.MULTILINE), text[-3000:]
    assert "a rank was lost (srun exit 137" in text and "resuming at step 10" in text
    assert_same_losses(run_dir, two_node_job[0])


def is_rank(argv: list[bytes]) -> bool:
    """A job's rank as the script starts it, `python -m scaletrain train`, or, warm, the client that stands
    for it (its fork ends with it)."""
    return argv[1:4] == [b"-m", b"scaletrain", b"train"] or argv[1:3] == [str(WARM_CLIENT).encode(), b"train"]


@pytest.mark.long_job  # a sweep's SLURM array task that spans two hosts, then its finalize job
def test_a_sweep_run_spans_two_nodes_as_one_array_task(
    cluster: SlurmCluster, small_dataset: Path, tmp_path: Path
) -> None:
    """slurm.nodes=2: the array task of the sweep's one run is a 2-node job whose run-one starts a rank on
    each node with srun (DP2 across the hosts); the run is done and trains the single-rank model."""
    sweep_dir = tmp_path / "sweep"
    spec = tiny_spec(small_dataset, sweep_dir, budgets=[1.2e10], fit={"bootstrap": 0},
                     models={"shapes": [TINY_SHAPES[2]]},
                     slurm={"max_concurrent": 1, "cpus_per_task": 1, "time": "00:20:00", "nodes": 2})
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    environment = warm_environment({**cluster.env, "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}",
                                    "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"})
    submitted = subprocess.run(cluster.client([str(warm_bin() / "python"), "-m", "scaletrain", "sweep", "run",
                                               str(spec_path), "--executor", "slurm"]),
                               cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    array_job, finalize_job = (int(job) for job in
                               re.search(r"job array (\d+) .* finalize job (\d+)", submitted.stdout).groups())
    (script,) = (sweep_dir / "slurm").glob("array-*.sbatch")
    assert "#SBATCH --nodes=2" in script.read_text() and "--nodes 2" in script.read_text()

    assert cluster.wait(array_job, timeout=JOB_TIMEOUT_S) == {0: "COMPLETED"}
    assert cluster.wait(finalize_job, timeout=300) == {0: "FAILED"}  # one run: nothing to fit, results written
    with (sweep_dir / "results.csv").open() as file:
        (row,) = list(csv.DictReader(file))
    assert row["status"] == "done"
    run_dir = sweep_dir / "runs" / row["name"]
    log = (run_dir / "train.log").read_text()
    assert "train: rank 0 (local 0) on n1, cpu" in log and "train: rank 1 (local 0) on n2, cpu" in log, log[-3000:]
    reference = tmp_path / "single"
    run_scaletrain("train", [str(run_dir / "run.yaml"), f"run.dir={reference}"])  # the sweep's config of the run
    ours, expected = read_metrics(run_dir)[0], read_metrics(reference)[0]
    assert sorted(ours) == sorted(expected)
    for step, record in expected.items():
        assert abs(ours[step]["loss"] - record["loss"]) <= 1e-4 * record["loss"], f"step {step}"


@pytest.mark.long_job  # waits for SLURM to find a node DOWN (SlurmdTimeout=10 on the test cluster)
def test_a_node_cut_off_mid_job_is_marked_down_and_the_job_finishes_on_another_node(
    cluster: SlurmCluster, hosts: Hosts, two_node_job: tuple[Path, str], small_dataset: Path, tmp_path: Path
) -> None:
    """n2's link goes down after the checkpoint of step 10 (a node gone: power, kernel, network). n1's
    ranks give up after parallel.timeout_s=10 naming n2; slurmctld marks n2 DOWN and, the job being
    --requeue, starts it again on n1 and n3, where it resumes from step 10 and ends with the
    uninterrupted job's losses, bit for bit. Last in this module: n2 stays down until it ends."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job_id = submit_training(cluster, small_dataset, run_dir, log, TWO_NODES,
                             [*TENSOR_PARALLEL, "checkpoint.every=10", "parallel.timeout_s=10"])
    wait_for_slurm_step(cluster, job_id, run_dir, log, 12, JOB_TIMEOUT_S)
    wait_for_checkpoint(run_dir, 10)
    cut_at = time.monotonic()
    hosts.set_link(hosts[1], up=False)
    try:
        wait_for_requeue(cluster, job_id, log, timeout=120)
        requeued_after = time.monotonic() - cut_at
        assert cluster.wait(job_id, timeout=JOB_TIMEOUT_S) == {0: "COMPLETED"}, log.read_text()[-3000:]
        print(f"link down -> n2 DOWN and the job requeued after {requeued_after:.1f} s; "
              f"finished on n1, n3 {time.monotonic() - cut_at:.1f} s after the cut")
        assert "n2" in cluster.run(["sinfo", "-h", "-t", "down", "-o", "%N"])
    finally:
        hosts.set_link(hosts[1], up=True)
    text = log.read_text()
    assert re.search(r"^\s*0: scaletrain train: error: rank 0 on n1: lost contact with n2 \(10\.77\.0\.2, ranks 2, 3\)",
                     text, flags=re.MULTILINE), text[-3000:]
    second_start = text[text.index("start 2)"):]
    assert "nodes: n1 n3;" in second_start and "resuming at step 10" in second_start
    assert rank_hosts(second_start) == {0: "n1", 1: "n1", 2: "n3", 3: "n3"}
    assert_same_losses(run_dir, two_node_job[0])

