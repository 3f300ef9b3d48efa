"""A run whose data goes wrong under it: a shard server that stalls, a shard damaged on disk mid-run.
Each ends promptly with one line saying why, never a hang, a crash by signal or a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from scaletrain.train import stopping
from scaletrain.train.stopping import EXIT_STOPPED_EARLY, StoppedWaitingForData, StopSignals
from tests.data.test_storage import serve, shard_names
from tests.train.runs import start_training, wait_for_step
from tests.train.test_signals import endless, killed_if_left


@pytest.mark.serial  # a wall-clock window (0.4-5 s), which load stretches
def test_a_stop_signal_ends_a_wait_for_data_only_once_it_has_stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait that ends within STALLED_WAIT_S of the signal ends by itself (the run then stops at the step
    boundary); one still blocked then is ended, even inside a blocking system call."""
    monkeypatch.setattr(stopping, "STALLED_WAIT_S", 0.5)
    signals = StopSignals(["SIGUSR1"])
    read_end, write_end = os.pipe()
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with signals.waiting_for_data():
            time.sleep(0.3)  # a slow batch, not a stalled one
        assert signals.received == "SIGUSR1"
        started = time.monotonic()
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        stalled = pytest.raises(StoppedWaitingForData, match=r"^signal SIGUSR1 after \d+ s waiting for training data$")
        with stalled, signals.waiting_for_data():
            os.read(read_end, 1)  # a read that never returns
        assert 0.4 < time.monotonic() - started < 5
    finally:
        signals.restore()
        os.close(read_end)
        os.close(write_end)


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_shard_server_stalled(small_dataset: Path, tmp_path: Path) -> None:
    """The server accepts and sends nothing: the loader worker waits on its read, the rank on the worker.
    Before, SIGTERM did not stop the run within 45 s (nor at all, before the read timed out)."""
    run_dir, log_file = tmp_path / "run", tmp_path / "train.log"
    shards = shard_names(small_dataset)
    with serve(small_dataset, always=dict.fromkeys(shards, "stall")) as (url, requests):
        process = start_training([*endless(url, run_dir), f"data.cache_dir={tmp_path / 'cache'}"], log=log_file)
        with killed_if_left(process):
            deadline = time.monotonic() + 300
            while not any(requests[name] for name in shards):
                assert process.poll() is None and time.monotonic() < deadline, log_file.read_text()[-3000:]
                time.sleep(0.1)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            returncode = process.wait(timeout=120)
        stopped_after = time.monotonic() - signalled
    log = log_file.read_text()
    assert returncode == EXIT_STOPPED_EARLY, log[-3000:]
    assert stopped_after < stopping.STALLED_WAIT_S + 20, log[-3000:]
    assert "stopped early (signal SIGTERM after " in log and " waiting for training data) at step 0/" in log, log
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow
def test_a_shard_truncated_mid_run_ends_the_rank_with_one_line_naming_it(small_dataset: Path, tmp_path: Path) -> None:
    """Without loader workers the rank read the truncated shard through a memory map and died of SIGBUS
    (exit 135) without a word; now it exits 2 with the shard and the fix."""
    data_dir, run_dir, log_file = Path(shutil.copytree(small_dataset, tmp_path / "data")), tmp_path / "run", \
        tmp_path / "train.log"
    process = start_training([*endless(data_dir, run_dir), "data.loader_workers=0"], log=log_file)
    with killed_if_left(process):
        wait_for_step(run_dir, 2, process)
        for shard in data_dir.glob("train-*.tar"):
            os.truncate(shard, shard.stat().st_size // 2)
        returncode = process.wait(timeout=120)
    log = log_file.read_text()
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert returncode == 2, log[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"scaletrain train: error: shard {data_dir}/train-0000"), log
    assert "changed while the run read it: it is " in errors[0] and "re-run `scaletrain prepare CONFIG`" in errors[0]
    assert "Traceback" not in log, log[-3000:]
