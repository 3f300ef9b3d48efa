"""`scaletrain sweep run --executor slurm` on a real one-node SLURM: a throttled job array with one task
per run, a failed run recorded while the others finish, and a dependent job that writes the results;
a ladder as two arrays, the branches after the stable runs."""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.scaling.sweeps import TINY_SHAPES, tiny_spec, write_spec
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 (registers the fixture)
from tests.train.runs import REPO, launcher, read_metrics, run_scaletrain
from tests.warm import SOCKET_VARIABLE, warm_socket

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def warm(cluster: SlurmCluster) -> dict[str, str]:
    """The cluster's environment for a warm `scaletrain sweep run`: sbatch exports it to the array tasks,
    whose `python -m scaletrain` (tests/warm_python, a warm fork's sys.executable) are warm forks too."""
    return {**cluster.env, SOCKET_VARIABLE: str(warm_socket())}


def test_slurm_executor_trains_the_sweep_as_a_job_array(
    slurm_cluster: SlurmCluster, small_dataset: Path, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    spec = tiny_spec(small_dataset, sweep_dir, budgets=[1.2e10], fit={"bootstrap": 0},
                     slurm={"max_concurrent": 1, "cpus_per_task": 2, "time": "00:20:00"})
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    plan = run_scaletrain("sweep", ["plan", str(spec_path)])
    names = [line.split()[0] for line in plan.splitlines() if line.startswith("c1.2e10-")]
    assert len(names) == 3
    broken = sweep_dir / "runs" / names[1] / "checkpoints" / "step_00000001"
    broken.mkdir(parents=True)
    (broken / "meta.json").write_text("{")  # its resume fails with a clear error: the array must go on

    submitted = subprocess.run(
        [*launcher(1), "sweep", "run", str(spec_path), "--executor", "slurm"],
        cwd=REPO, env=warm(slurm_cluster), capture_output=True, text=True, timeout=120, check=True).stdout
    array_job, finalize_job = (int(job) for job in
                               re.search(r"job array (\d+) .* finalize job (\d+)", submitted).groups())
    (script,) = (sweep_dir / "slurm").glob("array-*.sbatch")
    assert "#SBATCH --array=0-2%1" in script.read_text() and "srun" in script.read_text()

    assert slurm_cluster.wait(array_job, timeout=900) == {0: "COMPLETED", 1: "FAILED", 2: "COMPLETED"}
    # two finished runs are too few for any fit: the finalize job writes results.csv, says why the fit
    # failed and exits 1, so SLURM (and anything depending on the job) sees that the sweep did not succeed
    assert slurm_cluster.wait(finalize_job, timeout=300) == {0: "FAILED"}
    (finalize_log,) = (sweep_dir / "slurm").glob(f"*-finalize-{finalize_job}.out")
    assert "the fit failed (2 of 3 runs done)" in finalize_log.read_text()
    with (sweep_dir / "results.csv").open() as file:
        rows = {row["name"]: row for row in csv.DictReader(file)}
    assert [rows[name]["status"] for name in names] == ["done", "failed", "done"]
    assert float(rows[names[0]]["val_loss"]) > 0 and rows[names[1]]["val_loss"] == ""
    assert "corrupt" in (sweep_dir / "runs" / names[1] / "train.log").read_text()

    status = subprocess.run([*launcher(1), "sweep", "status", str(sweep_dir)], cwd=REPO,
                            env=warm(slurm_cluster), capture_output=True, text=True, check=True).stdout
    assert "2 done, 1 failed" in status


def test_slurm_executor_trains_a_ladder_as_two_dependent_arrays(
    slurm_cluster: SlurmCluster, small_dataset: Path, tmp_path: Path
) -> None:
    """A ladder on SLURM: the stable run's array, then the branches' array once it succeeded (afterok),
    each branch starting from the stable run's checkpoint at its branch point."""
    sweep_dir = tmp_path / "sweep"
    spec = tiny_spec(small_dataset, sweep_dir, mode="ladder", name="tiny-ladder", fit={"bootstrap": 0},
                     warmup={"steps": 2, "fraction": 0.0}, models={"shapes": [TINY_SHAPES[2]]},
                     slurm={"max_concurrent": 2, "cpus_per_task": 1, "time": "00:20:00"})
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    submitted = subprocess.run(
        [*launcher(1), "sweep", "run", str(spec_path), "--executor", "slurm"],
        cwd=REPO, env=warm(slurm_cluster), capture_output=True, text=True, timeout=120, check=True).stdout
    stable_job, branch_job, finalize_job = (int(job) for job in re.search(
        r"job array (\d+) \(1 runs\); job array (\d+) \(2 runs\).* finalize job (\d+)", submitted).groups())
    assert slurm_cluster.wait(stable_job, timeout=600) == {0: "COMPLETED"}
    assert slurm_cluster.wait(branch_job, timeout=600) == {0: "COMPLETED", 1: "COMPLETED"}
    # two points cannot be fitted: the finalize job writes results.csv, then exits 1
    assert slurm_cluster.wait(finalize_job, timeout=300) == {0: "FAILED"}
    with (sweep_dir / "results.csv").open() as file:
        rows = {row["name"]: row for row in csv.DictReader(file)}
    assert sorted((row["role"], row["status"]) for row in rows.values()) == [
        ("branch", "done"), ("branch", "done"), ("stable", "done")]
    plan = json.loads((sweep_dir / "plan.json").read_text())["runs"]
    for branch in (run for run in plan if run["role"] == "branch"):
        train, _ = read_metrics(sweep_dir / "runs" / branch["name"])
        assert min(train) == branch["branch_step"] + 1 and max(train) == branch["steps"]  # only its cooldown
