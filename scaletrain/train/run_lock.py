"""A run owns its directory: one `train` at a time, or two would interleave metrics, delete each
other's checkpoint staging and overwrite config.yaml.

The lock is a POSIX record lock (fcntl F_SETLK via lockf) on RUN_DIR/.lock, held by rank 0 for the
run's lifetime. The kernel drops it when the process dies, however it dies, so a killed run never
leaves its directory locked; the file itself only says who held it last. Not flock(2): an flock
belongs to the open file, which forked children share, so a DataLoader worker orphaned by a kill -9
kept the directory locked until it noticed (seconds later); a record lock belongs to the process.
It is also released when the process closes any descriptor of the file, so nothing else opens it.

A start that fails before its first step (a missing train.init_from, a checkpoint that does not load)
takes back what it made in the directory (`RunDirectoryStart`): an empty run directory holding .lock,
or a config.yaml of a run that never trained, looks like a run to `ls`, to sweeps and to `check`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path
from typing import IO

from scaletrain.train.state import TrainState

LOCK_FILE = ".lock"


class RunDirectoryBusy(RuntimeError):
    """Another process trains in this run directory."""


class RunDirectoryLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EAGAIN or EACCES, as POSIX allows either
            handle.seek(0)
            holder = handle.read().strip() or "an unknown process"
            handle.close()
            raise RunDirectoryBusy(
                f"run.dir={self.path.parent} is in use by {holder}; wait for it to finish, stop it, "
                "or set run.dir to another directory"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        self._file = handle

    def holder(self) -> str | None:
        """Who holds the lock now (what the lock file says), or None if nobody does; leaves the
        directory and the file as they are (for `scaletrain check`, in a process that does not
        hold the lock: closing the file would drop a lock this process held)."""
        if not self.path.is_file():
            return None
        with self.path.open("r", encoding="utf-8") as handle:
            try:  # a shared record lock is refused while another process holds the exclusive one
                fcntl.lockf(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return handle.read().strip() or "an unknown process"
            fcntl.lockf(handle, fcntl.LOCK_UN)
        return None

    def release(self) -> None:
        if self._file is not None:
            fcntl.lockf(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


class RunDirectoryStart:
    """The run directory as this invocation found it, so that a start that fails before training a
    step leaves it so: what the start made is removed, the directory too if it made it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.found = set(os.listdir(run_dir)) if run_dir.is_dir() else None  # None: no directory yet
        self.state: TrainState | None = None  # the run's, once it has one: whether it trained a step

    @property
    def trained(self) -> bool:
        return self.state is not None and self.state.steps_this_run > 0

    def take_back(self) -> None:
        """Remove what appeared in the run directory since this start (the caller holds its lock)."""
        if self.found is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        if not self.run_dir.is_dir():
            return
        for name in set(os.listdir(self.run_dir)) - self.found:
            path = self.run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
