"""DeepSpeed's JIT-built ops: one build root per environment, and no hang on a killed build's lock."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.utils.cpp_extension import get_default_build_root

from scaletrain.train.jit_ops import clear_stale_build_locks, environment_build_root, pin_build_root, pin_ninja


def test_each_environment_builds_in_a_root_of_its_own_unless_the_user_chose_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Two venvs sharing torch's default root rebuild each other's op (issue 21)."""
    first, second = environment_build_root("/work/a/.venv"), environment_build_root("/work/b/.venv")
    assert first != second and first == environment_build_root("/work/a/.venv")
    assert first.parent == second.parent == Path(get_default_build_root())
    monkeypatch.setenv("PATH", os.environ["PATH"])  # recorded: pinning puts this environment's ninja first
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")  # recorded, so that the value pinned below is undone
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert pin_build_root() == environment_build_root(sys.prefix)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(environment_build_root(sys.prefix))  # where torch builds
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert pin_build_root() == tmp_path


def test_the_environment_s_ninja_builds_whatever_path_the_run_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """pip's ninja and the system's keep their build logs in different versions: alternating them
    rebuilt the op every time (~50 s), so the environment's own ninja goes first on PATH."""
    environment = tmp_path / "venv"
    (environment / "bin").mkdir(parents=True)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    pin_ninja(str(environment))
    assert os.environ["PATH"] == "/usr/bin:/bin"  # no ninja of its own: PATH as it was
    (environment / "bin" / "ninja").write_text("#!/bin/sh\necho 1.13\n")
    (environment / "bin" / "ninja").chmod(0o755)
    for _ in range(2):  # once, however often it is pinned
        pin_ninja(str(environment))
        assert os.environ["PATH"] == f"{environment / 'bin'}:/usr/bin:/bin"
    assert shutil.which("ninja") == str(environment / "bin" / "ninja")


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
