"""Run `scaletrain train` as a user does (a subprocess, under torchrun for several ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from scaletrain.train.stopping import EXIT_STOPPED_EARLY
from tests.warm import SCALETRAIN_TORCHRUN, SOCKET_VARIABLE, TORCHRUN, warm_socket

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "gpt_tiny.yaml"
WARM_CLIENT = REPO / "tests" / "warm_client.py"


def tiny_overrides(data_dir: Path, run_dir: Path) -> list[str]:
    """A 2-layer GPT on the small test dataset (see tests/conftest.py), global batch 8."""
    return [
        f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", "data.loader_workers=1",
        f"run.dir={run_dir}",
        "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=32",
        "train.micro_batch_size=4", "train.global_batch_size=8", "train.grad_accum=1",
        "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=2", "train.eval_samples=16",
        "tracking.wandb=disabled",
    ]


def launcher(nproc: int, fresh: bool = False) -> list[str]:
    """`python -m scaletrain`, under torchrun for several ranks. Each scaletrain process, and torchrun, is
    a fork of the warm test server (tests/warm.py) unless `fresh`: tests of what happens while a process
    imports, or of a launcher's process tree (pkill by command line, a rank's parent), need fresh ones."""
    scaletrain = [sys.executable, "-m", "scaletrain"] if fresh else [sys.executable, str(WARM_CLIENT)]
    if nproc == 1:
        return scaletrain
    options = ["--standalone", f"--nproc_per_node={nproc}"]
    if fresh:
        return [sys.executable, "-m", "torch.distributed.run", *options, "-m", "scaletrain"]
    return [sys.executable, str(WARM_CLIENT), TORCHRUN, *options, str(WARM_CLIENT)]


def scaletrain_environment() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
            SOCKET_VARIABLE: str(warm_socket())}


def run_scaletrain(
    command: str, args: list[str], nproc: int = 1, timeout: int = 600, stopped_early: bool = False
) -> str:
    """Run a scaletrain command; fail the test with the tail of its output if it fails.

    stopped_early: the run must stop at a checkpoint before its last step (train.exit_after...),
    with exit code 75; under torchrun, which reports any non-zero worker as its own exit 1, each
    rank's 75 is read from torchrun's failure report.
    """
    result = subprocess.run(
        [*launcher(nproc), command, *args], cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True,
        timeout=timeout,
    )
    if stopped_early:
        expected = EXIT_STOPPED_EARLY if nproc == 1 else 1
        if result.returncode != expected or (nproc > 1 and f"exitcode  : {EXIT_STOPPED_EARLY}" not in result.stderr):
            raise AssertionError(f"scaletrain {command} should have stopped early (exit {EXIT_STOPPED_EARLY}), "
                                 f"got {result.returncode}:\n{result.stderr[-4000:]}")
    elif result.returncode != 0:
        raise AssertionError(f"scaletrain {command} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def read_metrics(run_dir: Path, while_written: bool = False) -> tuple[dict[int, dict], dict[int, float]]:
    """(training records by step, val_loss by step); a later record of a step replaces an earlier one.
    `while_written`: the run is still writing, so a last line without its newline is a record half written
    (left out; read it next time), not a broken file."""
    text = (run_dir / "metrics.jsonl").read_text()
    if while_written:
        text = text[:text.rfind("\n") + 1]
    training, validation = {}, {}
    for line in text.splitlines():
        record = json.loads(line)
        if "val_loss" in record:
            validation[record["step"]] = record["val_loss"]
        else:
            training[record["step"]] = record
    return training, validation


def scaletrain_torchrun(nproc: int, fresh: bool = False) -> list[str]:
    """`scaletrain-torchrun` (scaletrain/torchrun.py), given the arguments launcher(nproc) gives torchrun. It
    and its ranks are warm forks, as in launcher(), unless `fresh`: a test of the launcher's process tree
    (its children, the loader workers of its ranks) needs fresh ones."""
    options = ["--standalone", f"--nproc_per_node={nproc}"]
    if fresh:
        return [sys.executable, "-m", "scaletrain.torchrun", *options, "-m", "scaletrain"]
    return [sys.executable, str(WARM_CLIENT), SCALETRAIN_TORCHRUN, *options, str(WARM_CLIENT)]


def start_training(args: list[str], nproc: int = 1, log: Path | None = None, launch: list[str] | None = None,
                   new_session: bool = False, fresh: bool = False) -> subprocess.Popen:
    """`scaletrain train` in the background, its output in `log`; `launch` replaces launcher(nproc, fresh)
    (e.g. scaletrain_torchrun(2)); `new_session`: in a process group of its own, to signal as a whole."""
    output = log.open("w") if log else subprocess.DEVNULL
    return subprocess.Popen([*(launch or launcher(nproc, fresh)), "train", str(DEMO_CONFIG), *args], cwd=REPO,
                            env=scaletrain_environment(), stdout=output, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until metrics.jsonl holds a training record of `step` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before step {step}"
        training, _ = read_metrics(run_dir, while_written=True) if (run_dir / "metrics.jsonl").exists() else ({}, {})
        if training and max(training) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout} s")


def wait_for_checkpoint(run_dir: Path, step: int, timeout: float = 120) -> None:
    """Until the checkpoint of `step` is published (its meta.json written): a save is written in the
    background (checkpoint.async_save), so a step logged after it does not mean it is on disk yet. A
    test that breaks a run "after the checkpoint of step N" waits for this first."""
    meta = run_dir / "checkpoints" / f"step_{step:08d}" / "meta.json"
    deadline = time.monotonic() + timeout
    while not meta.is_file():
        assert time.monotonic() < deadline, f"the checkpoint of step {step} was not published within {timeout} s"
        time.sleep(0.02)


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("step_")) for path in (run_dir / "checkpoints").glob("step_*"))


class TrainedAhead:
    """Runs by key (a tuple: runs(name, layout)), each trained once, `train(key, directory(key))`, and kept.
    Given the order in which the module's tests ask for them, the next one trains in the background while
    a test waits for or checks its own: a tiny run leaves much of the 2-core box idle (start-up,
    rendezvous, exit), so two at a time take about a fifth less wall time than one after the other.
    Close it at the module's end."""

    def __init__(self, train: Callable[[tuple, Path], Any], directory: Callable[[tuple], Path],
                 order: Sequence[tuple] = ()) -> None:
        self.train, self.directory, self.order = train, directory, list(order)
        self.futures: dict[tuple, Future] = {}
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trained-ahead")
        self.lock = threading.Lock()  # a run trained ahead may ask another TrainedAhead for its source

    def __call__(self, *key: str) -> Any:
        self._start(key)
        if key in self.order:
            for ahead in self.order[self.order.index(key) + 1:][:1]:
                self._start(ahead)
        return self.futures[key].result()

    def _start(self, key: tuple) -> None:
        with self.lock:
            if key not in self.futures:
                self.futures[key] = self.pool.submit(self.train, key, self.directory(key))

    def close(self) -> None:
        """Wait for a run in progress (one trained ahead for a test that did not run), drop the rest."""
        self.pool.shutdown(wait=True, cancel_futures=True)
