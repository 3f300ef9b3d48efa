"""Read the run record of an offline W&B run file (run-ID.wandb), to check what the tracker was told.

The file is a LevelDB-style log (W&B's `datastore`): a 7-byte header (":W&B", magic 0xBEE1,
version 0), then 32 KiB blocks of chunks, each with a CRC32 (4 bytes), a little-endian length
(2 bytes) and a type (1 byte: full, first, middle, last), holding protobuf `Record`s. wandb 0.31
no longer ships a Python reader, so this is one, for tests.
"""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
BLOCK_SIZE = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data.startswith(HEADER), f"{path} is not a W&B run file"
    records, pending, offset = [], b"", len(HEADER)
    while offset + CHUNK_HEADER <= len(data):
        space = BLOCK_SIZE - offset % BLOCK_SIZE
        if space < CHUNK_HEADER:  # the writer pads the tail of a block with zeros
            offset += space
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        if kind == 0:
            break
        chunk = data[offset + CHUNK_HEADER: offset + CHUNK_HEADER + length]
        offset += CHUNK_HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def run_record(path: Path) -> wandb_internal_pb2.RunRecord:
    """The first `run` record of a run file: its run_group, job_type, tags, display_name and config."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"{path} holds no run record")
