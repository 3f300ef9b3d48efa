"""Load checkpoint files without running code from them.

`torch.load(..., weights_only=False)` unpickles arbitrary objects, so a crafted checkpoint file
runs code on resume, `generate` or `export` (CVE-2025-32434 is the same hole in older torch). Every
file this project reads goes through `load_tensors`, torch's restricted unpickler
(`weights_only=True`), which admits tensors, containers and primitives.
`CheckedFiles` also checks each file against the size and CRC-32 that meta.json recorded for it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.integrity import FileRecord, read_checked


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that holds something other than tensors and plain data."""


def load_tensors(path: str | Path, map_location: Any = "cpu", content: bytes | None = None) -> Any:
    """torch.load restricted to tensors, plain containers and primitives; from `content`, the file's
    bytes when they have been read already (to check them), else from `path`."""
    try:
        return torch.load(path if content is None else io.BytesIO(content), map_location=map_location,
                          weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path} holds objects that a checkpoint must not contain, refused without running them "
            f"({str(error).splitlines()[0]}); it was not written by scaletrain, or was "
            "tampered with: delete it or resume from another checkpoint"
        ) from None


@dataclass(frozen=True)
class CheckedFiles:
    """The files of one checkpoint with meta.json's record of each (`CheckpointMeta.files`): a file is
    read once, checked against its size and CRC-32, and those same bytes are unpickled, restricted.
    Reading into memory first holds one file's bytes beside its tensors while it loads, and cost
    0.4-0.9 s per GiB more on the dev box than hashing the file and then letting torch.load read it
    again (integrity.py has the measurements); but the bytes checked are the bytes loaded, and a
    file that the page cache cannot keep is read from the disk once, not twice."""

    checkpoint: Path
    records: Mapping[str, FileRecord]

    def load(self, file: str | Path, map_location: Any = "cpu") -> Any:
        return load_tensors(file, map_location, content=read_checked(file, self.checkpoint, self.records))
