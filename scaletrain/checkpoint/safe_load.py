"""Load checkpoint files without running code from them.

`torch.load(..., weights_only=False)` unpickles arbitrary objects, so a crafted checkpoint file
runs code on resume, `generate` or `export` (CVE-2025-32434 is the same hole in older torch). Every
file this project reads goes through `load_tensors`, torch's restricted unpickler
(`weights_only=True`), which admits tensors, containers and primitives plus the few classes that
DeepSpeed writes into its checkpoints, listed in SAFE_DEEPSPEED_GLOBALS.
DeepSpeed's own loader (`TorchCheckpointEngine.load`) uses `weights_only=False`; the engine is given
`SafeCheckpointEngine` instead, which also keeps a failed write (a full disk) as a message to agree on
across ranks rather than an exception that leaves the other ranks waiting in DeepSpeed's barrier.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

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


def load_tensors(path: str | Path, map_location: str | torch.device | None = "cpu") -> Any:
    """torch.load restricted to tensors, plain containers and DeepSpeed's checkpoint classes.

    DeepSpeed is imported only for a file that names one of its classes (importing it costs
    seconds and prints to stdout, which `generate` keeps for the text)."""
    try:
        try:
            return _restricted_load(path, map_location, [])
        except pickle.UnpicklingError as error:
            if "deepspeed." not in str(error):
                raise
            return _restricted_load(path, map_location, _deepspeed_globals())
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path} holds objects that a checkpoint must not contain, refused without running them "
            f"({str(error).splitlines()[0]}); it was not written by scaletrain or DeepSpeed, or was "
            "tampered with: delete it or resume from another checkpoint"
        ) from None


def _restricted_load(path: str | Path, map_location: str | torch.device | None, allowed: list[Any]) -> Any:
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location=map_location, weights_only=True)


def safe_checkpoint_engine(engine: Any) -> None:
    """Make a DeepSpeed engine read its checkpoints through `load_tensors` and record, not raise,
    a failed write: `take_write_failure(engine)` returns it after `engine.save_checkpoint`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        write_failure: str | None = None

        def load(self, path: str, map_location: Any = None) -> Any:
            return load_tensors(path, map_location)

        def save(self, state_dict: Any, path: str) -> None:
            if self.write_failure is not None:  # the checkpoint is lost already; skip its other files
                return
            try:
                super().save(state_dict, path)
            except (OSError, RuntimeError) as error:
                self.write_failure = str(write_failure(path, error))

    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise RuntimeError(f"DeepSpeed chose {type(current).__name__}; scaletrain expects TorchCheckpointEngine")
    safe = SafeCheckpointEngine.__new__(SafeCheckpointEngine)
    safe.__dict__.update(current.__dict__)
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
