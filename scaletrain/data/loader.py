"""The DataLoader over any dataset keyed by global index, and its workers' signal handling.

The trainer's loaders (train/objective.py) are this loader over the objective's dataset: the batch
sampler fixes every batch's global indices in the main process and DataLoader deals whole batches
to workers and returns them in order, so nothing is duplicated or lost for any num_workers.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable

from torch.utils.data import DataLoader, Dataset


def batch_loader(dataset: Dataset, sampler: Iterable[list[int]], num_workers: int,
                 collate_fn: Callable) -> DataLoader:
    """A loader over any dataset keyed by global index (packed sequences, sentence pairs): `sampler`
    gives each micro-batch's global indices (a DistributedPretrainingSampler, or an evaluation's list)."""
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_fn,
                      persistent_workers=False, pin_memory=False, worker_init_fn=leave_stopping_to_the_rank)


# The signals that ask a process to end (their default action terminates it): those the CLI and the
# launchers use to stop a run (train.stop_signals), and the rest a scheduler or a terminal may send.
TERMINATION_REQUESTS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def leave_stopping_to_the_rank(worker_id: int) -> None:
    """DataLoader worker_init_fn: the worker takes termination requests from its rank only.

    torchrun (to each rank's process group), SLURM (to every process of a job step), Ctrl-C (to the
    terminal's process group) and `kill PID $(pgrep -P PID)` reach the loader workers as well as the
    ranks. PyTorch's worker dies of SIGTERM (and the other default actions kill it), and its rank
    then fails with "DataLoader worker ... is killed by signal" instead of checkpointing at the next
    step and exiting 75 (train/stopping.py). Ignoring them (SIG_IGN) would not do either: the rank
    ends its workers with SIGTERM itself, from multiprocessing's exit handler when it exits with a
    live loader (a crash), and would wait for them forever. So the signals are blocked here and a
    thread takes them (sigwaitinfo, which names the sender) and ends the worker only when its rank
    sent one. A rank that dies takes its workers with it (die_with_the_rank).
    """
    rank_pid = multiprocessing.parent_process().pid  # recorded before the fork, so right even if the rank died since
    die_with_the_rank(rank_pid)
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINATION_REQUESTS)  # threads started later inherit the mask
    threading.Thread(target=_end_when_the_rank_asks, args=(rank_pid,), name="termination-requests",
                     daemon=True).start()


def die_with_the_rank(rank_pid: int) -> None:
    """Have the kernel SIGKILL this worker when its rank dies (Linux prctl PR_SET_PDEATHSIG).

    PyTorch's own watchdog checks the parent only between batches, so a worker blocked in a read (a
    stalled shard server) outlived a SIGKILLed rank under PID 1, holding the cache's file lock. SIGKILL:
    the worker has nothing to save, and its termination requests are blocked. The kernel sends it when
    the thread that forked the worker ends, so a loader is iterated from the rank's main thread (the
    training loop does).
    """
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != rank_pid:  # the rank died before the call above
        os._exit(1)


def _end_when_the_rank_asks(rank_pid: int) -> None:
    while signal.sigwaitinfo(TERMINATION_REQUESTS).si_pid != rank_pid:
        pass
    os._exit(0)  # as the rank asked; nothing of the worker's needs saving
