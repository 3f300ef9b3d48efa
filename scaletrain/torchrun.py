"""`scaletrain-torchrun` (or `python -m scaletrain.torchrun`): torchrun, with its arguments, that
stops a run at a checkpoint on SIGTERM, SIGINT or SIGUSR1 and exits 75 when its ranks did.

Plain torchrun answers SIGTERM and SIGINT by sending them to each rank's process group, waiting
up to --shutdown-timeout (30 s) and exiting 1 with a traceback whatever the ranks did, and dies of
SIGUSR1; when the ranks stop early by themselves (train.exit_after) it reports each rank's 75 as a
failure and exits 1. A job script cannot tell either from a crash. This launcher takes the stop
signals itself, passes each to its ranks (which checkpoint at the next step and exit 75:
train.stop_signals) and exits 75 when every rank that ended non-zero ended with 75.

A user error (a bad override, a missing file) makes every rank exit 2 with one line from rank 0;
torchrun adds its agent's log lines and a ~30-line failure report with a traceback of itself. This
launcher exits 2 and adds nothing, or the line itself when rank 0 could not print it. It says the
outcome once, at the end: its agent's lines about a rank's exit and the signal it sends the others
are left out (the failure report of any other failure names both), and so is torchrun's banner on
OMP_NUM_THREADS, which it sets to torchrun's value.

A restarted job (--max-restarts) meets afresh. By default the ranks of every rendezvous round share the
c10d agent's store under the prefix /worker/attempt_{TORCHELASTIC_RESTART_COUNT}, but an agent that
restarts its ranks because another node's failed (a membership change) does not count it as a restart
(elastic/agent/server/api.py), so after a rank is lost the nodes' new ranks use different prefixes, or
the old round's keys: they read addresses of ranks that are gone and fail to connect (seen on the
namespace hosts: "Gloo connectFullMesh failed ... Connection refused"). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(set here unless the user set it) makes rank 0 of each round host a store of its own on a new port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from types import FrameType

import psutil
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.run import determine_local_world_size, parse_args, run

from scaletrain.cli import EXIT_USER_ERROR, USER_ERROR
from scaletrain.parallel.peer_loss import EXIT_RANK_LOST
from scaletrain.train.stopping import EXIT_STOPPED_EARLY

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# torch 2.13 elastic: the agent's lines on a rank's exit and on stopping the other ranks
# (multiprocessing/api.py), and `record`'s when no scheduler gave the launcher an error file to
# copy the rank's into (multiprocessing/errors/error_handler.py).
AGENT_LINES = {
    "torch.distributed.elastic.multiprocessing.api": ("failed (exitcode: ", "Sending process "),
    "torch.distributed.elastic.multiprocessing.errors.error_handler": ("no error file defined for parent",),
}
# how the agent stops the other ranks once one has failed: SIGTERM, then SIGKILL after a timeout
STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun's agent would answer these with its own shutdown; it keeps the others (SIGHUP, SIGQUIT).
    stop_names = {number.name for number in STOP_SIGNALS}
    args.signals_to_handle = ",".join(
        name for name in args.signals_to_handle.split(",") if name.strip() not in stop_names)
    for number in STOP_SIGNALS:
        signal.signal(number, _pass_to_ranks)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see the module docstring
    if "OMP_NUM_THREADS" not in os.environ and determine_local_world_size(args.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's choice for ranks that share a node, without its banner
    for name, starts in AGENT_LINES.items():
        logging.getLogger(name).addFilter(lambda record, starts=starts: not str(record.msg).startswith(starts))
    try:
        record(run)(args)  # record: the root cause's error file reaches the scheduler, as under torchrun
    except ChildFailedError as error:
        return _exit_code(error)
    except RendezvousConnectionError as error:
        # Several nodes: the agent that hosts the c10d store ended (its ranks failed, say, with a user
        # error that rank 0 printed on that node), and this one lost it mid-run or while shutting down.
        print(f"scaletrain-torchrun: lost the rendezvous store at {args.rdzv_endpoint or 'the master node'}: "
              f"the node that hosts it has ended, and its output says why ({error.__cause__ or error})",
              file=sys.stderr)
        return 1
    return 0


def _exit_code(error: ChildFailedError) -> int:
    """75 with one line when every failed rank stopped early at a checkpoint; 76 with one line when the
    ranks stopped because another was lost (parallel/peer_loss.py); 2 when the ranks met a user error
    (_user_error_line); else torchrun's report, 1."""
    exit_codes = {failure.exitcode for failure in error.failures.values()}
    if exit_codes == {EXIT_STOPPED_EARLY}:
        print(f"scaletrain-torchrun: the ranks stopped early at a checkpoint (exit {EXIT_STOPPED_EARLY}); "
              "run the same command again to resume", file=sys.stderr)
        return EXIT_STOPPED_EARLY
    if EXIT_RANK_LOST in exit_codes and exit_codes <= {EXIT_RANK_LOST, *STOPPED_BY_AGENT}:
        print(f"scaletrain-torchrun: a rank was lost and the others stopped (exit {EXIT_RANK_LOST}; the ranks' "
              "output names it); run the same command again to resume from the last checkpoint, or let "
              "--max-restarts restart the ranks", file=sys.stderr)
        return EXIT_RANK_LOST
    line = _user_error_line(error.failures)
    if line is not None:
        if line:
            print(line, file=sys.stderr)
        return EXIT_USER_ERROR
    print(error.format_msg(), file=sys.stderr)
    return 1


def _user_error_line(failures: dict[int, ProcessFailure]) -> str | None:
    """None unless a rank exited 2 having left scaletrain's error file (cli.py _leave_for_launcher)
    and every other failed rank did so too or was stopped by the agent; then the line to print: ""
    when rank 0 left the file, because it printed the line first (the agent may have stopped it
    while it exited), else the line from a file."""
    exit_codes = {failure.exitcode for failure in failures.values()}
    left_line = {rank: failure for rank, failure in failures.items()
                 if failure.error_file_data.get("errorTraits", {}).get("category") == USER_ERROR}
    if EXIT_USER_ERROR not in exit_codes or not exit_codes <= {EXIT_USER_ERROR, *STOPPED_BY_AGENT}:
        return None
    if not any(failure.exitcode == EXIT_USER_ERROR for failure in left_line.values()):
        return None
    return "" if 0 in left_line else next(iter(left_line.values())).message["message"]


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
