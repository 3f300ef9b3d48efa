"""`scaletrain-torchrun` (or `python -m scaletrain.torchrun`): torchrun, with its arguments, that
stops a run at a checkpoint on SIGTERM, SIGINT or SIGUSR1 and exits 75 when its ranks did.

Plain torchrun answers SIGTERM and SIGINT by sending them to each rank's process group, waiting
up to --shutdown-timeout (30 s) and exiting 1 with a traceback whatever the ranks did, and dies of
SIGUSR1; when the ranks stop early by themselves (train.exit_after) it reports each rank's 75 as a
failure and exits 1. A job script cannot tell either from a crash. This launcher takes the stop
signals itself, passes each to its ranks (which checkpoint at the next step and exit 75:
train.stop_signals) and exits 75 when every rank that ended non-zero ended with 75.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType

import psutil
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

from scaletrain.train.stopping import EXIT_STOPPED_EARLY

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun's agent would answer these with its own shutdown; it keeps the others (SIGHUP, SIGQUIT).
    stop_names = {number.name for number in STOP_SIGNALS}
    args.signals_to_handle = ",".join(
        name for name in args.signals_to_handle.split(",") if name.strip() not in stop_names)
    for number in STOP_SIGNALS:
        signal.signal(number, _pass_to_ranks)
    try:
        record(run)(args)  # record: the root cause's error file reaches the scheduler, as under torchrun
    except ChildFailedError as error:
        return _exit_code(error)
    return 0


def _exit_code(error: ChildFailedError) -> int:
    """75 with one line when every failed rank stopped early at a checkpoint; else torchrun's report, 1."""
    if {failure.exitcode for failure in error.failures.values()} == {EXIT_STOPPED_EARLY}:
        print(f"scaletrain-torchrun: the ranks stopped early at a checkpoint (exit {EXIT_STOPPED_EARLY}); "
              "run the same command again to resume", file=sys.stderr)
        return EXIT_STOPPED_EARLY
    print(error.format_msg(), file=sys.stderr)
    return 1


def _pass_to_ranks(number: int, frame: FrameType | None) -> None:
    """To the ranks (this process's children) alone: their loader workers are theirs to stop, and a
    rank checkpoints before it exits. Before any rank has started (a rendezvous waiting for other
    nodes) the launcher stops as torchrun does."""
    ranks = psutil.Process().children()
    if not ranks:
        raise SignalException(f"Process {os.getpid()} got signal: {number}", sigval=signal.Signals(number))
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):  # it has just exited
            rank.send_signal(number)


if __name__ == "__main__":
    sys.exit(main())
