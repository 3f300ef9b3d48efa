"""A lock file left by a killed JIT build of a DeepSpeed op no longer hangs the next start."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from scaletrain.train.jit_ops import clear_stale_build_locks


def test_a_stale_build_lock_is_removed_and_a_live_one_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / "deepspeed_shm_comm" / "lock"  # torch's layout under TORCH_EXTENSIONS_DIR
    live = tmp_path / "cpu_adam" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir(parents=True)
        lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    # a build that finishes 1 s from now deletes its own lock
    threading.Timer(1.0, live.unlink).start()
    started = time.monotonic()
    removed = clear_stale_build_locks(stale_after_s=300, poll_s=0.05)
    assert removed == [stale]
    assert time.monotonic() - started >= 0.9, "the live build's lock was not waited for"
    assert not stale.exists() and not live.exists()
    err = capsys.readouterr().err
    assert f"removed {stale}" in err and f"waiting for {live}" in err
