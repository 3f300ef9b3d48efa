"""The test SLURM cluster runs real jobs: a throttled array one task at a time, failures reported, clean stop."""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

import pytest

from tests.slurm_cluster import (
    SlurmCluster,
    processes_with_environment,
    slurm_cluster_fixture,  # noqa: F401 (registers the `slurm_cluster` fixture here)
    start_slurm_cluster,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # real daemons and jobs: about 10 s for the module

# Each array task records its id, then when it started and when it ended, in a file of its own.
TIMED_TASK = """#!/bin/bash
echo "$SLURM_ARRAY_TASK_ID $(date +%s.%N)" > "{directory}/task_$SLURM_ARRAY_TASK_ID.txt"
sleep 0.5
date +%s.%N >> "{directory}/task_$SLURM_ARRAY_TASK_ID.txt"
"""


def test_throttled_array_runs_every_task_one_at_a_time(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "timed_task.sh"
    script.write_text(TIMED_TASK.format(directory=tmp_path))
    job_id = slurm_cluster.submit(["--array=0-2%1", f"--output={tmp_path}/slurm-%A_%a.out", str(script)],
                                  cwd=tmp_path)

    assert slurm_cluster.wait(job_id, timeout=60) == {0: "COMPLETED", 1: "COMPLETED", 2: "COMPLETED"}
    intervals = []
    for task_id in range(3):
        first_line, second_line = (tmp_path / f"task_{task_id}.txt").read_text().splitlines()
        task, started = first_line.split()
        assert int(task) == task_id
        intervals.append((float(started), float(second_line)))
    intervals.sort()
    for (_, previous_end), (next_start, _) in pairwise(intervals):
        assert next_start >= previous_end, f"throttle %1 broken: tasks overlapped in time {intervals}"


def test_failed_task_is_reported_failed(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = slurm_cluster.submit(["--array=0-1", "--wrap=exit $((3 * SLURM_ARRAY_TASK_ID))"], cwd=tmp_path)

    assert slurm_cluster.wait(job_id, timeout=60) == {0: "COMPLETED", 1: "FAILED"}


def test_second_cluster_stops_everything_it_started(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    with start_slurm_cluster(tmp_path) as second:
        assert second.conf != slurm_cluster.conf
        job_id = second.submit(["--wrap=sleep 300"], cwd=tmp_path)
        deadline = time.monotonic() + 30
        while second.job_records(job_id) != [("0", "RUNNING")]:
            assert time.monotonic() < deadline, f"job never started: {second.job_records(job_id)}"
            time.sleep(0.2)

    assert all(daemon.poll() is not None for daemon in second.daemons.values())
    assert processes_with_environment(f"SLURM_CONF={second.conf}".encode()) == {}
    # The first cluster never noticed the second come and go.
    assert slurm_cluster.wait(slurm_cluster.submit(["--wrap=true"], cwd=tmp_path), timeout=60) == {0: "COMPLETED"}
