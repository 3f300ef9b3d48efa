"""The run directory's lock: held while a run lives, free the moment it is killed, even when the
run has forked children (DataLoader workers) that outlive it for a while."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.train.run_lock import RunDirectoryBusy, RunDirectoryLock

HOLDER = """
import os, sys, time
from pathlib import Path
from scaletrain.train.run_lock import RunDirectoryLock
lock = RunDirectoryLock(Path(sys.argv[1]))
lock.acquire()
if os.fork() == 0:  # a child like a DataLoader worker: it shares the parent's open files
    time.sleep(30)
    os._exit(0)
print("locked", flush=True)
time.sleep(30)
"""


def test_a_killed_holder_frees_the_run_directory_though_its_child_lives_on(tmp_path: Path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = None
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirectoryBusy, match=f"is in use by pid {holder.pid}"):
            RunDirectoryLock(tmp_path).acquire()
        child = subprocess.run(["pgrep", "-P", str(holder.pid)], capture_output=True, text=True).stdout.split()
        assert len(child) == 1
        holder.kill()
        holder.wait()
        lock = RunDirectoryLock(tmp_path)
        lock.acquire()  # at once, while the orphaned child still runs
        lock.release()
    finally:
        holder.kill()
        subprocess.run(["kill", "-9", *(child or [])], capture_output=True)
