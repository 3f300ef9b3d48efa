"""The DataLoader over any dataset keyed by global index, and its workers' signal handling.

The trainer's loaders (train/objective.py) are this loader over the objective's dataset: the batch
sampler fixes every batch's global indices in the main process and DataLoader deals whole batches
to workers and returns them in order, so nothing is duplicated or lost for any num_workers.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from torch.utils.data import DataLoader, Dataset

from scaletrain.data.sampler import DistributedPretrainingSampler


def batch_loader(dataset: Dataset, sampler: DistributedPretrainingSampler, num_workers: int,
                 collate_fn: Callable) -> DataLoader:
    """A loader over any dataset keyed by global index (packed sequences, sentence pairs)."""
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_fn,
                      persistent_workers=False, pin_memory=False, worker_init_fn=leave_stopping_to_the_rank)


# The signals that ask a process to end (their default action terminates it): those the CLI and the
# launchers use to stop a run (train.stop_signals), and the rest a scheduler or a terminal may send.
TERMINATION_REQUESTS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)


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
    sent one. A rank that dies leaves the worker to PyTorch's watchdog (it exits once orphaned).
    """
    rank_pid = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINATION_REQUESTS)  # threads started later inherit the mask
    threading.Thread(target=_end_when_the_rank_asks, args=(rank_pid,), name="termination-requests",
                     daemon=True).start()


def _end_when_the_rank_asks(rank_pid: int) -> None:
    while signal.sigwaitinfo(TERMINATION_REQUESTS).si_pid != rank_pid:
        pass
    os._exit(0)  # as the rank asked; nothing of the worker's needs saving
