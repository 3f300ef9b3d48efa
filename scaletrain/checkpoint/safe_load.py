"""Load checkpoint files without running code from them.

`torch.load(..., weights_only=False)` unpickles arbitrary objects, so a crafted checkpoint file
runs code on resume, `generate` or `export` (CVE-2025-32434 is the same hole in older torch). Every
file this project reads goes through `load_tensors`, torch's restricted unpickler
(`weights_only=True`), which admits tensors, containers and primitives plus the few classes that
DeepSpeed writes into its checkpoints, listed in SAFE_DEEPSPEED_GLOBALS.
DeepSpeed's own loader (`TorchCheckpointEngine.load`) uses `weights_only=False`; the engine is given
`SafeCheckpointEngine` instead, which also keeps a failed write (a full disk) as a message to agree on
across ranks rather than an exception that leaves the other ranks waiting in DeepSpeed's barrier, and
takes each file's CRC-32 as it writes and checks it as it reads (checkpoint/integrity.py).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.integrity import FileRecord, content_mismatch, read_checked, save_with_checksum
from scaletrain.disk import write_failure


def _deepspeed_globals() -> list[Any]:
    """Classes DeepSpeed 0.19 pickles into model and ZeRO optimizer states (besides torch's own)."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed announces its accelerator on stdout
        import deepspeed  # noqa: F401
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that holds something other than tensors and plain data."""


def load_tensors(path: str | Path, map_location: Any = "cpu", content: bytes | None = None) -> Any:
    """torch.load restricted to tensors, plain containers and DeepSpeed's checkpoint classes; from
    `content`, the file's bytes when they have been read already (to check them), else from `path`.

    DeepSpeed is imported only for a file that names one of its classes (importing it costs
    seconds and prints to stdout, which `generate` keeps for the text)."""
    try:
        try:
            return _restricted_load(path, content, map_location, [])
        except pickle.UnpicklingError as error:
            if "deepspeed." not in str(error):
                raise
            return _restricted_load(path, content, map_location, _deepspeed_globals())
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path} holds objects that a checkpoint must not contain, refused without running them "
            f"({str(error).splitlines()[0]}); it was not written by scaletrain or DeepSpeed, or was "
            "tampered with: delete it or resume from another checkpoint"
        ) from None


def _restricted_load(path: str | Path, content: bytes | None, map_location: Any, allowed: list[Any]) -> Any:
    with torch.serialization.safe_globals(allowed):
        return torch.load(path if content is None else io.BytesIO(content), map_location=map_location,
                          weights_only=True)


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


def safe_checkpoint_engine(engine: Any) -> None:
    """Make a DeepSpeed engine read its checkpoints through `load_tensors` (checked against their
    CRC-32 inside `checked_reads`), record each file's CRC-32 as it writes it (`take_checksums`), and
    record, not raise, a failed write: `take_write_failure(engine)` returns it after
    `engine.save_checkpoint`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        write_failure: str | None = None
        reading: CheckedFiles | None = None  # the checkpoint being loaded, inside checked_reads
        read_failure: CheckpointError | None = None  # its first file that differs from its record

        def load(self, path: str, map_location: Any = None) -> Any:
            if self.reading is None:
                return load_tensors(path, map_location)
            content = Path(path).read_bytes()
            mismatch = content_mismatch(path, content, self.reading.checkpoint, self.reading.records)
            self.read_failure = self.read_failure or mismatch
            return load_tensors(path, map_location, content=content)

        def save(self, state_dict: Any, path: str) -> None:
            if self.write_failure is not None:  # the checkpoint is lost already; skip its other files
                return
            try:  # TorchCheckpointEngine.save's torch.save, through a writer that takes the CRC-32
                self.checksums[path] = save_with_checksum(
                    state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)
            except (OSError, RuntimeError) as error:
                self.write_failure = str(write_failure(path, error))

    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise RuntimeError(f"DeepSpeed chose {type(current).__name__}; scaletrain expects TorchCheckpointEngine")
    safe = SafeCheckpointEngine.__new__(SafeCheckpointEngine)
    safe.__dict__.update(current.__dict__)
    safe.checksums = {}  # path as DeepSpeed named it -> CRC-32, since the last take_checksums
    engine.checkpoint_engine = safe
    _record_recovery_script_failures(engine, safe)


def _record_recovery_script_failures(engine: Any, checkpoint_engine: Any) -> None:
    """Rank 0 also copies DeepSpeed's zero_to_fp32.py into a ZeRO checkpoint, outside the checkpoint
    engine (engine.py, `_copy_recovery_script`); a full disk there must be recorded the same way."""
    copy = engine._copy_recovery_script

    def copy_or_record(save_path: str) -> None:
        if checkpoint_engine.write_failure is not None:
            return
        try:
            copy(save_path)
        except OSError as error:
            checkpoint_engine.write_failure = str(write_failure(save_path, error))

    engine._copy_recovery_script = copy_or_record


def take_write_failure(engine: Any) -> str | None:
    """The first failed write of the engine's last save (None if all went well), then forget it."""
    failure, engine.checkpoint_engine.write_failure = engine.checkpoint_engine.write_failure, None
    return failure


def take_checksums(engine: Any) -> dict[str, str]:
    """The CRC-32 of each file the engine's last save wrote (by the path DeepSpeed gave), then forget them."""
    checksums, engine.checkpoint_engine.checksums = engine.checkpoint_engine.checksums, {}
    return checksums


@contextlib.contextmanager
def checked_reads(engine: Any, files: CheckedFiles) -> Iterator[None]:
    """Within it, the engine's loader checks each file of `files.checkpoint` against its record.

    A mismatch is raised when the load is over, not where DeepSpeed reads the file: the other ranks,
    whose files are intact, go on into DeepSpeed's collectives (a pipeline's broadcast of tied
    weights), and a rank that raised midway would leave them waiting there forever (seen with a bit
    flipped in stage 0's embedding file under parallel.pipeline=2). The damaged bytes load meanwhile
    if they still unpickle, and are thrown away with the error; a file that no longer unpickles
    fails at once, as before, and the mismatch, its cause, is what is raised."""
    checkpoint_engine = engine.checkpoint_engine
    checkpoint_engine.reading, checkpoint_engine.read_failure = files, None
    try:
        yield
    finally:
        failure = checkpoint_engine.read_failure
        checkpoint_engine.reading = checkpoint_engine.read_failure = None
        if failure is not None:
            raise failure
