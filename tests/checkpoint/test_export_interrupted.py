"""`scaletrain export` stopped by Ctrl-C or SIGTERM while it writes (export.py): one line, exit
128 + the signal, and nothing left beside the out path (it used to leave a 29 MB `.out.partial-PID`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.train.runs import DEMO_CONFIG, REPO, launcher, run_scaletrain, scaletrain_environment, tiny_overrides


@pytest.fixture(scope="module")
def trained_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), "train.steps=1",
                             "train.eval_every=0", "checkpoint.every=1"])
    return run_dir


def _stopped_while_writing(out_dir: Path, process: subprocess.Popen) -> int:
    """The pid of the export, stopped (SIGSTOP) once its staging directory is there and before it is
    renamed to `out_dir`: the signal under test then arrives while the files are being written."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        for staging in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
            pid = int(staging.name.rsplit("-", 1)[1])
            os.kill(pid, signal.SIGSTOP)
            assert staging.exists() and not out_dir.exists(), "stopped after the export had finished"
            return pid
        time.sleep(0.001)
    raise AssertionError(f"no staging directory appeared beside {out_dir}: {process.communicate()}")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda stop: stop.name)
def test_a_stopped_export_leaves_nothing_and_says_so(trained_run: Path, tmp_path: Path, stop: signal.Signals):
    out_dir = tmp_path / "hf"
    process = subprocess.Popen([*launcher(1), "export", str(trained_run), str(out_dir)], cwd=REPO,
                               env=scaletrain_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = _stopped_while_writing(out_dir, process)
        os.kill(pid, stop)
        os.kill(pid, signal.SIGCONT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + stop, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == (
        f"scaletrain export: stopped by {stop.name}; nothing was written at {out_dir}"), stderr[-3000:]
    assert list(tmp_path.iterdir()) == []
