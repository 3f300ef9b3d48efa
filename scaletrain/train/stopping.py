"""When a run stops before its last step: a preemption signal, `train.exit_after` steps, the
wall-clock budget `train.exit_after_minutes`, or a checkpoint whose background write failed (the
loop raises that failure). Every rank must stop after the same step, so the
reasons are agreed with one all-reduce per step (Megatron-LM does the same for its
`--exit-signal-handler` and `--exit-duration-in-mins`, megatron/training/training.py).

A run that stops early checkpoints at that step and exits with EXIT_STOPPED_EARLY, which tells a
job script to requeue or resubmit the same command (`train.resume=auto` continues from there);
a run that trained all its steps exits 0. A rank whose data does not come (a stalled shard read)
never reaches the next step boundary, so a stop signal also ends such a wait (StopSignals.waiting_for_data).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import torch
import torch.distributed as dist

from scaletrain.config import TrainConfig

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". Used by the SLURM
# job script (launch/slurm.sbatch) to requeue itself.
EXIT_STOPPED_EARLY = 75

# A wait for a batch this long is stalled, not slow: loader workers keep batches ready, so a step waits
# milliseconds, and a stop signal lets a short wait end by itself (the ranks then stop together at
# the step boundary). Well inside the 30 s torchrun and SLURM (KillWait) give before SIGKILL.
STALLED_WAIT_S = 5.0

SAVE_FAILED = "save_failed"
REASONS = (SAVE_FAILED, "signal", "exit_after", "exit_after_minutes")  # the first that holds is the answer


class StopSignals:
    """Flag-only handlers for train.stop_signals: a stop signal never kills a rank mid-step (or
    mid-checkpoint); StopConditions reads `received` at the next step boundary.

    `scaletrain train` installs them as soon as it has read its config and never restores the
    previous handlers: a signal that comes during start-up is kept (the run stops after its first
    step), and one that comes while a rank is already exiting does not turn its exit 75 into a death
    by signal (torchrun sends SIGTERM to the ranks still running as soon as one has exited); once it
    has its exit code it ignores them (`ignore_while_exiting`). `train()` called as a library
    installs its own and `restore`s the previous handlers on return. Must be created in the main
    thread (Python runs signal handlers there only).
    """

    def __init__(self, names: list[str]) -> None:
        self.received: str | None = None
        self._waiting_since: float | None = None  # when the main thread began waiting for a batch
        self._previous_handlers = {}
        for name in names:
            number = signal.Signals[name]
            self._previous_handlers[number] = signal.signal(number, self._on_signal)

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:  # the first one says why the run stops
            self.received = signal.Signals(number).name
        if self._waiting_since is not None:
            self._end_a_stalled_wait(number)

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        """Around the main thread's wait for its next batch: a stop signal that comes when the wait has
        lasted STALLED_WAIT_S, or that is still waiting that long after the signal, raises
        StoppedWaitingForData out of it (from the handler: the wait may be a blocked read in this
        process, a file lock, or a DataLoader worker's queue)."""
        self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            self._waiting_since = None

    def _end_a_stalled_wait(self, number: int) -> None:
        waited = time.monotonic() - self._waiting_since
        if waited < STALLED_WAIT_S:  # look again then: the signal once more, to wake a blocked system call
            timer = threading.Timer(STALLED_WAIT_S - waited, self._signal_again_if_waiting, (number,))
            timer.daemon = True
            timer.start()
            return
        self._waiting_since = None
        raise StoppedWaitingForData(f"signal {self.received} after {waited:.0f} s waiting for training data")

    def _signal_again_if_waiting(self, number: int) -> None:
        if self._waiting_since is not None:
            signal.pthread_kill(threading.main_thread().ident, number)

    def restore(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers = {}

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the stop signals back (blocked, not lost) while libraries start helper processes.

        A handled signal is reset to its default action, death, in a child that exec()s; a blocked one
        stays blocked there. SLURM's `scancel --signal` reaches every process of the step, so a USR1
        sent while DeepSpeed runs `ninja` to check or build its ops killed ninja, and with it the rank
        ("Ninja is required"). Blocked in the main thread, which starts those children, it is not lost:
        another thread of the rank takes it for the handler (which runs in the main thread), or the
        handler takes it when the block ends; the run stops at its first step boundary either way."""
        numbers = set(self._previous_handlers)
        blocked_before = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked_before)

    def ignore_while_exiting(self) -> None:
        """For a process that has its exit code: a stop signal has nothing left to stop, and Python's
        finalization puts back the default action (death) of every signal it handles, though not of
        those it ignores, so a flag handler would still let a late SIGTERM replace the exit code."""
        for number in self._previous_handlers:
            signal.signal(number, signal.SIG_IGN)


class StoppedWaitingForData(BaseException):  # noqa: N818 (a stop, like KeyboardInterrupt, not an error)
    """A stop signal ended a stalled wait for data. A BaseException, as KeyboardInterrupt is, so the
    `except Exception` of a download's retries or a library does not take it for a failed read."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StopConditions:
    """Watches the early-stop reasons of one invocation; `poll` is a collective on the world group."""

    def __init__(self, train: TrainConfig, signals: StopSignals) -> None:
        self._train = train
        self._signals = signals
        self._started = time.monotonic()

    def poll(self, steps_this_run: int, device: torch.device, save_failed: bool = False) -> str | None:
        """The first reason that holds on any rank, or None; the same answer on every rank (a signal
        is named by the largest signal number any rank received, so every rank says the same even
        when the signal reached some ranks first). `save_failed`: this rank's checkpoint write has
        failed (publishing.pending_save_failed), which the ranks learn at different moments."""
        train = self._train
        received = self._signals.received
        local = [
            save_failed,
            signal.Signals[received].value if received is not None else 0,
            train.exit_after is not None and steps_this_run >= train.exit_after,
            train.exit_after_minutes is not None and time.monotonic() - self._started >= 60 * train.exit_after_minutes,
        ]
        flags = torch.tensor(local, dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for reason, raised in zip(REASONS, flags.tolist(), strict=True):
            if raised:
                return f"{reason} {signal.Signals(raised).name}" if reason == "signal" else reason
        return None


def stop_with_launcher() -> None:
    """Under torchrun, have the kernel send this rank SIGTERM when the launcher dies (Linux
    prctl PR_SET_PDEATHSIG), so a SIGKILLed torchrun does not leave its workers training on as
    orphans; with SIGTERM in train.stop_signals they checkpoint and exit like a preempted run."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the launcher died before the call above
        os.kill(os.getpid(), signal.SIGTERM)
