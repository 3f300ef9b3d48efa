"""A resumed run whose disk is full: metrics.jsonl's truncation (tracking/metrics.py) stops it with one
message naming the file and the full disk, and leaves the old file whole and no staging file beside it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from scaletrain.disk import DiskWriteError
from scaletrain.tracking.metrics import JsonlSink


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 64 KiB tmpfs; root only."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mounted.stderr.strip()}); needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_a_full_disk_at_resume_is_one_message_and_leaves_no_staging_file(tiny_disk: Path):
    path = tiny_disk / "run" / "metrics.jsonl"
    path.parent.mkdir()
    records = "".join(json.dumps({"step": step, "loss": 1.0 / step, "pad": "x" * 200}) + "\n" for step in range(1, 200))
    path.write_text(records)  # ~45 KiB of the 64: a copy of most of it does not fit beside it
    with pytest.raises(DiskWriteError) as raised:
        JsonlSink(path, resumed_step=190)
    message = str(raised.value)
    assert message.startswith(f"could not write {path}: no space left on device"), message
    assert "\n" not in message and "this start trained nothing" in message
    assert sorted(entry.name for entry in path.parent.iterdir()) == ["metrics.jsonl"]
    assert path.read_text() == records
