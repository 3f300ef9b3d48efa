"""Stop signals from every sender a run meets: to the rank and its loader worker, to a process group
(Ctrl-C), to plain torchrun, to scaletrain-torchrun and to every process of a run. Each run stops
after a complete step with a checkpoint of it and exits 75 (torchrun itself exits 1: README)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from scaletrain.train.stopping import EXIT_STOPPED_EARLY
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    WARM_CLIENT,
    checkpoint_steps,
    logged_steps,
    scaletrain_environment,
    scaletrain_torchrun,
    start_training,
    tiny_overrides,
    wait_for_step,
)
from tests.warm import SCALETRAIN_TORCHRUN, SCRIPT


def endless(data_dir: Path, run_dir: Path) -> list[str]:
    """A run that only a stop signal ends, with no periodic checkpoint: the one it leaves is the stop's."""
    return [*tiny_overrides(data_dir, run_dir), "train.steps=100000", "train.eval_every=0",
            "checkpoint.every=100000"]


@contextlib.contextmanager
def killed_if_left(process: subprocess.Popen) -> Iterator[None]:
    """Never leave a 100,000-step run behind a failed assertion."""
    try:
        yield
    finally:
        if process.poll() is None:
            for leftover in [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    leftover.kill()
            process.wait()


def assert_checkpointed_at_the_last_step(run_dir: Path, log: str) -> None:
    assert checkpoint_steps(run_dir) == [logged_steps(run_dir)[-1]], f"a step was lost:\n{log[-3000:]}"


WORKER_SCRIPT = """
import sys
from tests.data.loaders import train_loader
batches = iter(train_loader(sys.argv[1], 32, 0, 4, 0, 1, 0, num_workers=1))
next(batches)
print("ready", flush=True)
sys.stdin.readline()  # the test signals the loader worker meanwhile
for _ in range(20):
    next(batches)
print("served 20 batches after the signals", flush=True)
raise RuntimeError("a crash with the loader running")
"""


def test_a_loader_worker_leaves_stopping_to_its_rank(small_dataset: Path):
    """Termination requests from anyone else leave the worker serving batches; its rank still ends it
    (a crash with a live loader has multiprocessing terminate it at exit: no hang)."""
    rank = subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, str(small_dataset)], cwd=REPO,
                            env=scaletrain_environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with killed_if_left(rank):
        assert rank.stdout.readline() == "ready\n", rank.stderr.read()
        (worker,) = psutil.Process(rank.pid).children()
        for request in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            worker.send_signal(request)
        stdout, stderr = rank.communicate("go\n", timeout=60)
    assert "served 20 batches after the signals" in stdout, stderr[-3000:]
    assert rank.returncode == 1 and "RuntimeError: a crash with the loader running" in stderr
    assert not worker.is_running()


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal, receivers", [(signal.SIGTERM, "the rank and its loader worker"),
                                                    (signal.SIGINT, "the process group")],
                         ids=["SIGTERM to the rank and its loader worker", "SIGINT to the process group"])
def test_one_rank_stops_at_a_checkpoint_when_its_loader_worker_is_signalled_too(
    stop_signal: signal.Signals, receivers: str, small_dataset: Path, tmp_path: Path
):
    """`kill -TERM PID $(pgrep -P PID)`, and Ctrl-C (SIGINT to the terminal's process group)."""
    run_dir, log_file = tmp_path / "run", tmp_path / "train.log"
    process = start_training(endless(small_dataset, run_dir), log=log_file, new_session=True, fresh=True)
    with killed_if_left(process):
        wait_for_step(run_dir, 3, process)
        workers = psutil.Process(process.pid).children()
        assert workers, "no loader worker to signal (tiny_overrides sets data.loader_workers=1)"
        if receivers == "the process group":
            os.killpg(process.pid, stop_signal)
        else:
            for receiver in [psutil.Process(process.pid), *workers]:
                receiver.send_signal(stop_signal)
        returncode = process.wait(timeout=120)
    log = log_file.read_text()
    assert returncode == EXIT_STOPPED_EARLY, log[-3000:]
    assert f"stopped early (signal {stop_signal.name})" in log
    assert_checkpointed_at_the_last_step(run_dir, log)


@pytest.mark.slow
def test_plain_torchrun_sigterm_has_every_rank_checkpoint_and_exit_by_itself(small_dataset: Path, tmp_path: Path):
    """torchrun passes SIGTERM to each rank's process group (loader workers included) and exits 1
    with a traceback whatever they do; the ranks stop at the same step with a checkpoint, each
    before torchrun's 30 s grace is up (none is SIGKILLed) and without an error."""
    run_dir, log_file = tmp_path / "run", tmp_path / "train.log"
    process = start_training(endless(small_dataset, run_dir), nproc=2, log=log_file, fresh=True)
    with killed_if_left(process):
        wait_for_step(run_dir, 3, process)
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=120)
    log = log_file.read_text()
    assert returncode == 1 and "SignalException: Process" in log, log[-3000:]
    assert "stopped early (signal SIGTERM)" in log, log[-3000:]
    assert log.count("Traceback (most recent call last)") == 1, f"a rank failed:\n{log[-3000:]}"
    assert "forcefully exiting" not in log, log[-3000:]
    assert_checkpointed_at_the_last_step(run_dir, log)


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal, receivers", [(signal.SIGUSR1, "the launcher"),
                                                    (signal.SIGTERM, "every process of the run")],
                         ids=["SIGUSR1 to the launcher", "SIGTERM to every process of the run"])
def test_scaletrain_torchrun_exits_75_when_its_ranks_stopped_at_a_checkpoint(
    stop_signal: signal.Signals, receivers: str, small_dataset: Path, tmp_path: Path
):
    """scaletrain-torchrun passes the signal to its ranks; SIGTERM to every process (the launcher,
    the ranks, their loader workers) is what SLURM sends a job step. The launcher is a fresh process, whose
    children are the ranks; they are fresh too where the test signals their loader workers, else warm
    clients (tests/warm.py), which pass the launcher's signal on to their forks."""
    run_dir, log_file = tmp_path / "run", tmp_path / "train.log"
    launch = scaletrain_torchrun(2, fresh=True)
    if receivers == "the launcher":  # `-m scaletrain` replaced by the client
        launch = [*launch[:-2], str(WARM_CLIENT)]
    process = start_training(endless(small_dataset, run_dir), log=log_file, launch=launch)
    with killed_if_left(process):
        wait_for_step(run_dir, 3, process)
        launcher = psutil.Process(process.pid)
        ranks = launcher.children()
        assert len(ranks) == 2
        for receiver in [launcher] if receivers == "the launcher" else [launcher, *launcher.children(True)]:
            receiver.send_signal(stop_signal)
        started = time.monotonic()
        returncode = process.wait(timeout=120)
    log = log_file.read_text()
    assert returncode == EXIT_STOPPED_EARLY, log[-3000:]
    assert f"the ranks stopped early at a checkpoint (exit {EXIT_STOPPED_EARLY})" in log
    assert "FAILED" not in log and "Traceback" not in log, log[-3000:]
    assert f"stopped early (signal {stop_signal.name})" in log
    assert_checkpointed_at_the_last_step(run_dir, log)
    print(f"{receivers}: {time.monotonic() - started:.1f} s from the signal to the launcher's exit")


@pytest.mark.parametrize("rank_exit, launcher_exit, output", [
    (EXIT_STOPPED_EARLY, EXIT_STOPPED_EARLY, "scaletrain-torchrun: the ranks stopped early at a checkpoint (exit 75)"),
    (3, 1, "exitcode  : 3"),
    (2, 1, "exitcode  : 2"),
], ids=["every rank 75", "a rank 3", "a rank 2 that is not scaletrain's user error"])
def test_scaletrain_torchrun_exit_code_follows_its_ranks(rank_exit: int, launcher_exit: int, output: str):
    """Ranks that all stopped early make exit 75 and one line; scaletrain's user error exit 2 and its
    line (tests/test_cli.py); any other failure torchrun's report and 1. The launcher is a warm fork (tests/warm.py):
    its ranks are `sh`, and what it reports of them is the same."""
    result = subprocess.run([sys.executable, str(WARM_CLIENT), SCALETRAIN_TORCHRUN, "--standalone",
                             "--nproc_per_node=2", "--no-python", "sh", "-c", f"exit {rank_exit}"],
                            cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == launcher_exit, result.stderr[-3000:]
    assert output in result.stderr
    assert ("FAILED" in result.stderr) == (launcher_exit == 1)


LIBRARY_RUN = """
import os, signal, sys
from scaletrain.config_loader import load_config
from scaletrain.parallel.groups import destroy_distributed
from scaletrain.train.loop import train
from scaletrain.train.stopping import StopSignals

def callers_handler(number, frame):
    pass

config = load_config(sys.argv[1], sys.argv[2:])
signal.signal(signal.SIGTERM, callers_handler)
kept = StopSignals(config.train.stop_signals)
os.kill(os.getpid(), signal.SIGUSR1)  # while the run starts
state = train(config, kept)
destroy_distributed()
print("kept:", state.step, state.stopped_by, signal.getsignal(signal.SIGTERM) is not callers_handler)
kept.restore()
state = train(config)
destroy_distributed()
print("own:", state.step, state.stopped_by, signal.getsignal(signal.SIGTERM) is callers_handler)
"""


@pytest.mark.slow
def test_train_keeps_a_signal_from_start_up_and_restores_handlers_it_installed(small_dataset: Path, tmp_path: Path):
    """train(config, stop_signals) stops after its first step on a signal that came before it
    started and leaves the caller's handlers in place; train(config) restores those it replaced. The script
    runs in a warm fork (tests/warm.py): the signal comes after the imports, while train() starts."""
    run_dir, script = tmp_path / "run", tmp_path / "library_run.py"
    script.write_text(LIBRARY_RUN)
    result = subprocess.run(
        [sys.executable, str(WARM_CLIENT), SCRIPT, str(script), str(DEMO_CONFIG), *endless(small_dataset, run_dir),
         "train.exit_after=1"], cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kept: 1 signal SIGUSR1 True" in result.stdout and "own: 2 exit_after True" in result.stdout, result.stdout


def test_a_helper_process_started_while_signals_are_held_survives_them_and_the_signal_is_kept():
    """SLURM's scancel --signal=USR1 reaches every process of the step; a child started while the rank
    builds its engine (DeepSpeed's ninja) inherits the block instead of USR1's default action, death,
    and the rank's handler still takes the signal (at once if another thread of the process does not
    block it, else when the block ends)."""
    from scaletrain.train.stopping import StopSignals

    signals = StopSignals(["SIGUSR1"])
    try:
        with signals.held():
            child = subprocess.Popen(["sleep", "2"])
            os.kill(child.pid, signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
        assert child.wait(timeout=10) == 0  # not killed by the signal
        assert signals.received == "SIGUSR1"
    finally:
        signals.restore()
    unheld = subprocess.Popen(["sleep", "2"])
    os.kill(unheld.pid, signal.SIGUSR1)
    assert unheld.wait(timeout=10) == -signal.SIGUSR1  # what happened to ninja without the block
