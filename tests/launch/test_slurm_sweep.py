"""`scaletrain sweep run --executor slurm` on a real one-node SLURM: a throttled job array with one task
per run, a failed run recorded while the others finish, and a dependent job that writes the results."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scaling.sweeps import tiny_spec, write_spec
from tests.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401 (registers the fixture)
from tests.train.runs import REPO

pytestmark = pytest.mark.slow


def test_slurm_executor_trains_the_sweep_as_a_job_array(
    slurm_cluster: SlurmCluster, small_dataset: Path, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    spec = tiny_spec(small_dataset, sweep_dir, budgets=[1.2e10], fit={"bootstrap": 0},
                     slurm={"max_concurrent": 1, "cpus_per_task": 2, "time": "00:20:00"})
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    plan = subprocess.run([sys.executable, "-m", "scaletrain", "sweep", "plan", str(spec_path)], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in plan.splitlines() if line.startswith("c1.2e10-")]
    assert len(names) == 3
    broken = sweep_dir / "runs" / names[1] / "checkpoints" / "step_00000001"
    broken.mkdir(parents=True)
    (broken / "meta.json").write_text("{")  # its resume fails with a clear error: the array must go on

    submitted = subprocess.run(
        [sys.executable, "-m", "scaletrain", "sweep", "run", str(spec_path), "--executor", "slurm"],
        cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=120, check=True).stdout
    array_job, finalize_job = (int(job) for job in
                               re.search(r"job array (\d+) .* finalize job (\d+)", submitted).groups())
    (script,) = (sweep_dir / "slurm").glob("array-*.sbatch")
    assert "#SBATCH --array=0-2%1" in script.read_text() and "srun" in script.read_text()

    assert slurm_cluster.wait(array_job, timeout=900) == {0: "COMPLETED", 1: "FAILED", 2: "COMPLETED"}
    assert slurm_cluster.wait(finalize_job, timeout=300) == {0: "COMPLETED"}
    with (sweep_dir / "results.csv").open() as file:
        rows = {row["name"]: row for row in csv.DictReader(file)}
    assert [rows[name]["status"] for name in names] == ["done", "failed", "done"]
    assert float(rows[names[0]]["val_loss"]) > 0 and rows[names[1]]["val_loss"] == ""
    assert "corrupt" in (sweep_dir / "runs" / names[1] / "train.log").read_text()

    status = subprocess.run([sys.executable, "-m", "scaletrain", "sweep", "status", str(sweep_dir)], cwd=REPO,
                            env=slurm_cluster.env, capture_output=True, text=True, check=True).stdout
    assert "2 done, 1 failed" in status
