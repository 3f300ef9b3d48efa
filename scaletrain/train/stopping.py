"""When a run stops before its last step: a preemption signal, `train.exit_after` steps, or the
wall-clock budget `train.exit_after_minutes`. Every rank must stop after the same step, so the
reasons are agreed with one all-reduce per step (Megatron-LM does the same for its
`--exit-signal-handler` and `--exit-duration-in-mins`, megatron/training/training.py).

A run that stops early checkpoints at that step and exits with EXIT_STOPPED_EARLY, which tells a
job script to requeue or resubmit the same command (`train.resume=auto` continues from there);
a run that trained all its steps exits 0.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from types import FrameType

import torch
import torch.distributed as dist

from scaletrain.config import TrainConfig

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". Used by the SLURM
# job script (launch/slurm.sbatch) to requeue itself.
EXIT_STOPPED_EARLY = 75

REASONS = ("signal", "exit_after", "exit_after_minutes")


class StopConditions:
    """Watches the early-stop reasons of one invocation; `poll` is a collective on the world group.

    Signal handlers only set a flag, so a signal that arrives mid-step (or mid-checkpoint) takes
    effect at the next step boundary, after a complete optimizer step.
    """

    def __init__(self, train: TrainConfig) -> None:
        self._train = train
        self._started = time.monotonic()
        self.received: str | None = None
        self._previous_handlers = {}
        for name in train.stop_signals:
            number = signal.Signals[name]
            self._previous_handlers[number] = signal.signal(number, self._on_signal)

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(number).name

    def poll(self, steps_this_run: int, device: torch.device) -> str | None:
        """The first reason that holds on any rank, or None; the same answer on every rank."""
        train = self._train
        local = [
            self.received is not None,
            train.exit_after is not None and steps_this_run >= train.exit_after,
            train.exit_after_minutes is not None and time.monotonic() - self._started >= 60 * train.exit_after_minutes,
        ]
        flags = torch.tensor(local, dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for reason, raised in zip(REASONS, flags.tolist(), strict=True):
            if raised:
                return f"{reason} {self.received}" if reason == "signal" and self.received else reason
        return None

    def close(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers = {}


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
