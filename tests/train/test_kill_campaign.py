"""A kill -9 campaign (issue 9): a run SIGKILLed at seeded-random moments, some of them while a
checkpoint is being written, and resumed each time, ends with the per-step losses of an
uninterrupted run, bit for bit, and a metrics.jsonl holding every step exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.train.runs import DEMO_CONFIG, REPO, launcher, run_scaletrain, scaletrain_environment, tiny_overrides
from tests.warm import process_tree  # torchrun starts each rank in a session of its own: found by parent

STEPS = 30
KILLS = 5
WRITE_KILLS = 2  # of the KILLS, those that wait for a checkpoint being written (.staging-step_*)
START_TIMEOUT_S = 300  # a launch waits for its ranks to import torch/DeepSpeed; slow on a busy machine


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [str(DEMO_CONFIG), *tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=10",
            "checkpoint.every=3", "checkpoint.keep_last=2"]


def metrics_records(run_dir: Path, strict: bool = False) -> list[dict]:
    """metrics.jsonl's records in file order, as JSON (RFC 8259: no NaN or Infinity). A last line
    cut short by a kill is skipped, unless `strict` (after a run that finished, none may be)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line, parse_constant=_reject_constant))
        except json.JSONDecodeError:
            if strict:
                raise
    return records


def training_records(run_dir: Path, strict: bool = False) -> list[dict]:
    return [record for record in metrics_records(run_dir, strict) if "loss" in record]


def validation_records(run_dir: Path) -> list[dict]:
    return [record for record in metrics_records(run_dir, strict=True) if "val_loss" in record]


def _reject_constant(name: str) -> None:
    raise AssertionError(f"metrics.jsonl holds {name}, which is not JSON")


def staging_directories(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    return sorted(root.glob(".staging-step_*")) if root.is_dir() else []


def process_groups(process: subprocess.Popen) -> set[int]:
    groups = set()
    for pid in process_tree(process.pid):
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    return groups


def kill_9(process: subprocess.Popen, groups: set[int] | None = None) -> None:
    """SIGKILL to every process group of the run (`groups`, found beforehand where the moment
    matters) at once: no rank gets a SIGTERM from the dying launcher first."""
    groups = process_groups(process) if groups is None else groups | process_groups(process)
    for group in sorted(groups, key=lambda group: group == process.pid):  # the launcher's group last
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    process.wait()


def start(args: list[str], nproc: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*launcher(nproc, fresh=True), "train", *args], cwd=REPO,
                            env=scaletrain_environment(), stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_until(condition, process: subprocess.Popen, log: Path, poll_s: float) -> None:
    """Poll until `condition()` holds; fail if the run ends first or nothing happens for START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        assert process.poll() is None, f"the run ended (exit {process.returncode}) first:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no progress within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(poll_s)


def kill_during_training(process: subprocess.Popen, run_dir: Path, log: Path, rng: random.Random) -> None:
    """Kill after 1-4 new steps and a random delay of up to about a step."""
    resumed_at = max((record["step"] for record in training_records(run_dir)), default=0)
    target = resumed_at + rng.randint(1, 4)
    wait_until(lambda: any(r["step"] >= target for r in training_records(run_dir)), process, log, poll_s=0.01)
    time.sleep(rng.uniform(0.0, 0.1))
    kill_9(process)


def kill_during_checkpoint_write(process: subprocess.Popen, run_dir: Path, log: Path) -> bool:
    """Kill as soon as a checkpoint's staging directory appears; True if it was left half-written
    (False: the publishing rename beat the kill)."""
    left_over = set(staging_directories(run_dir))  # from an earlier kill; the next save replaces it
    resumed_at = max((record["step"] for record in training_records(run_dir)), default=0)
    # a first step trained means every rank is up: its process groups are known before the moment
    wait_until(lambda: any(r["step"] > resumed_at for r in training_records(run_dir)), process, log, poll_s=0.01)
    groups = process_groups(process)
    wait_until(lambda: set(staging_directories(run_dir)) - left_over, process, log, poll_s=0.002)
    for group in sorted(groups, key=lambda group: group == process.pid):
        os.killpg(group, signal.SIGKILL)
    half_written = bool(set(staging_directories(run_dir)) - left_over)
    kill_9(process, groups)
    return half_written


def survivors(run_dir: Path) -> list[int]:
    """Processes of this run still alive (not zombies)."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            mine = entry.name.isdigit() and f"run.dir={run_dir}".encode() in (entry / "cmdline").read_bytes()
            if mine and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_kill_9_campaign_ends_with_the_uninterrupted_trajectory(nproc: int, small_dataset: Path, tmp_path: Path):
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    rng = random.Random(9 + nproc)
    plan = ["checkpoint_write"] * WRITE_KILLS + ["training"] * (KILLS - WRITE_KILLS)
    rng.shuffle(plan)
    args, log = overrides(small_dataset, run_dir), tmp_path / "train.log"
    kills, write_kills, process = 0, 0, None
    try:
        while kills < len(plan):
            process = start(args, nproc, log)
            if plan[kills] == "training":
                kill_during_training(process, run_dir, log, rng)
            else:
                write_kills += kill_during_checkpoint_write(process, run_dir, log)
            kills += 1
            if kills == len(plan) and write_kills == 0 and len(plan) < KILLS + 3:
                plan.append("checkpoint_write")  # the rename beat every write kill: try again
        # the uninterrupted reference trains beside the last resume, once no kill's moment is waited for
        with ThreadPoolExecutor(max_workers=1) as pool:
            reference_run = pool.submit(run_scaletrain, "train", overrides(small_dataset, reference_dir), nproc=nproc)
            run_scaletrain("train", args, nproc=nproc)
            reference_run.result()
    finally:
        if process is not None and process.poll() is None:
            kill_9(process)
    assert survivors(run_dir) == []
    assert write_kills >= 1, "no kill landed while a checkpoint was being written"
    records, reference = training_records(run_dir, strict=True), training_records(reference_dir, strict=True)
    assert [record["step"] for record in records] == list(range(1, STEPS + 1)), "every step exactly once"
    assert [(r["loss"], r["lr"]) for r in records] == [(r["loss"], r["lr"]) for r in reference]
    assert validation_records(run_dir) == validation_records(reference_dir)
    print(f"{nproc} rank(s): {kills} kills survived, {write_kills} while a checkpoint was being written")
