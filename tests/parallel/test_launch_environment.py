"""Who a rank is, from its launcher's variables: torchrun's as they are, srun's tasks read from
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, and a lone process (a SLURM batch script too) is a world of one."""

from __future__ import annotations

import os

import pytest

from scaletrain.config import ConfigError
from scaletrain.parallel.groups import _default_single_process_environment, world_size_from_environment

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
SRUN_TASK = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launch variables during a test, and after it the test process's own again: the code under
    test sets RANK and WORLD_SIZE in os.environ, and a leaked RANK=3 makes every later subprocess
    a rank of a world that never forms. (delenv of an absent name records nothing to undo;
    setenv first does.)"""
    for name in LAUNCH_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def launch_environment() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}


def test_srun_task(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**SRUN_TASK, "MASTER_ADDR": "node1", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(name, value)

    assert world_size_from_environment() == 4
    _default_single_process_environment()
    assert launch_environment() == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node1", "29511")


def test_srun_tasks_need_the_first_node_as_master(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SRUN_TASK.items():
        monkeypatch.setenv(name, value)

    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT are not both set"):
        _default_single_process_environment()


def test_torchrun_wins_over_the_srun_task_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**SRUN_TASK, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)

    assert world_size_from_environment() == 2
    _default_single_process_environment()
    assert launch_environment() == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}


def test_a_batch_script_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch gives its script the job's task count but no step: it is one process, not rank 0 of 4."""
    for name, value in SRUN_TASK.items():
        if name != "SLURM_STEP_ID":
            monkeypatch.setenv(name, value)

    assert world_size_from_environment() == 1
    _default_single_process_environment()
    assert launch_environment() == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
