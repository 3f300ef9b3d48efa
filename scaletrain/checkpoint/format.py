"""A checkpoint on disk: its directory layout, meta.json, the layout it records, and reading it back.

Layout of RUN_DIR/checkpoints:
    step_00000100/model/...        the training state by parameter name at full shape, each rank
                                   writing its share (checkpoint/layout_free.py): any layout resumes it
    step_00000100/rng/rank_*.pt    per-rank RNG states (restored when the layout is the same)
    step_00000100/meta.json        step, consumed samples, layout, every file's size and CRC-32, and
                                   the CRC-32 of these fields (checkpoint/integrity.py); written last
    step_00000100/config.yaml      the full run config
    latest                         name of the newest complete checkpoint: a hint for other tools;
                                   scaletrain finds the newest by scanning
    diverged/step_...              checkpoints set aside after a divergence (checkpoint/divergence.py)
    rejected/step_...              checkpoints a resume could not load and fell back past (divergence.py)

Writing them is checkpoint/publishing.py's (in the background, staged, renamed into place); each
file's bytes are checked by integrity.py and unpickled by safe_load.py; manager.py loads one into
the engine.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.integrity import FileRecord, check_meta_seal
from scaletrain.checkpoint.safe_load import UnsafeCheckpointError
from scaletrain.config import Config
from scaletrain.parallel.groups import Topology, resolve_precision

META_FILE = "meta.json"
FORMAT = 2  # 1: DeepSpeed's own files under state/ (before layout-free checkpoints); not read any more
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    consumed_samples: int
    layout: dict[str, int]
    skipped_steps: int = 0  # steps whose update was skipped (non-finite loss or gradients), in all
    consecutive_skipped_steps: int = 0  # of those, how many in a row up to this step
    files: dict[str, FileRecord] = field(default_factory=dict)  # path under the checkpoint -> size, CRC-32
    format: int = FORMAT
    spikes: dict[str, Any] = field(default_factory=dict)  # the loss-spike rule's state (train/state.py)
    tokenizer_sha256: str | None = None  # the tokenizer whose ids the run trained on (None: not recorded)
    started_from: str | None = None  # the explicit train.resume checkpoint the run started from (resume_candidates)
    hooks: dict[str, Any] = field(default_factory=dict)  # the loop's hooks' state, by hook name (train/hooks/)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def layout_of(config: Config, topology: Topology) -> dict[str, int]:
    """What a checkpoint records of the run's layout (parallel/layout.py) and precision; `context` only when > 1,
    so earlier checkpoints still match."""
    layout = topology.layout
    recorded = {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data,
                "zero_stage": layout.zero_stage, "bf16": int(resolve_precision(config, topology.device) == "bf16")}
    if layout.context > 1:
        recorded["context"] = layout.context
    return recorded


def describe_layout(layout: dict[str, int]) -> str:
    """`TP2xDP2 ZeRO-1 bf16`; sizes of 1 are left out (a single rank reads `TP1`)."""
    axes = (("TP", "tensor"), ("CP", "context"), ("PP", "pipeline"), ("DP", "data"))
    sizes = [f"{axis}{layout[key]}" for axis, key in axes
             if layout.get(key, 1) > 1]
    return f"{'x'.join(sizes) or 'TP1'} ZeRO-{layout['zero_stage']}" + (" bf16" if layout.get("bf16") else "")


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (meta.json written), oldest first."""
    return sorted(p for p in checkpoint_root(run_dir).glob("step_*") if (p / META_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, found by scanning. `latest` is a hint for other tools (it is
    written after each save): when it is unreadable or names another checkpoint, say so and go on."""
    complete = complete_checkpoints(run_dir)
    newest = complete[-1] if complete else None
    pointer = checkpoint_root(run_dir) / "latest"
    if pointer.exists():
        try:
            named = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            named = f"unreadable ({type(error).__name__})"
        if newest is None or named != newest.name:
            found = f"using {newest}, the newest complete checkpoint" if newest else "no complete checkpoint was found"
            warn_once(f"{pointer} names {named[:40]!r}, not the newest complete checkpoint: {found} by scanning "
                      "(the pointer is only a hint; the next save rewrites it)")
    return newest


def write_latest(root: Path, name: str) -> None:
    """Point `latest` under the checkpoint root `root` at `name`, in one rename."""
    temporary = root / "latest.tmp"
    temporary.write_text(name)
    os.replace(temporary, root / "latest")


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A warning on stderr, once per process, from rank 0 only (every rank sees the same files)."""
    if message in _warned or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _warned.add(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


def first_loadable(run_dir: Path, load: Callable[[Path], T]) -> tuple[Path, T]:
    """`load` applied to the run's complete checkpoints, newest first, until one loads (for generate
    and export, one process): each that fails is named in a warning; none loading is one error."""
    checkpoints = complete_checkpoints(run_dir)[::-1]
    if not checkpoints:
        raise CheckpointError(f"{run_dir} has no complete checkpoint; train first with `scaletrain train CONFIG`")
    latest_checkpoint(run_dir)  # the warning about a wrong pointer, if any
    failures = []
    for index, path in enumerate(checkpoints):
        try:
            return path, translate_load_errors(path, "its files", partial(load, path))
        except CheckpointError as error:
            failures.append(str(error))
            if index + 1 < len(checkpoints):
                warn_once(f"skipping checkpoint {path}: {error}; trying {checkpoints[index + 1]}")
    raise CheckpointError(f"none of the {len(checkpoints)} checkpoints of {run_dir} could be loaded; the "
                          f"newest: {failures[0]}. Resume training to write a new one (train.resume=auto)")


def read_meta(path: Path) -> CheckpointMeta:
    """meta.json of the checkpoint `path`, refused if its fields changed since the save (its CRC-32) or
    its step is not the one its directory is named for."""
    try:
        raw = json.loads((path / META_FILE).read_text())
        files = {name: FileRecord.from_json(record) for name, record in dict(raw.get("files", {})).items()}
        meta = CheckpointMeta(int(raw["step"]), int(raw["consumed_samples"]), dict(raw["layout"]),
                              int(raw.get("skipped_steps", 0)), int(raw.get("consecutive_skipped_steps", 0)), files,
                              int(raw.get("format", 1)), dict(raw.get("spikes", {})), raw.get("tokenizer_sha256"),
                              raw.get("started_from"), dict(raw.get("hooks", {})))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt ({error}); delete it or set train.resume to another"
        ) from None
    check_meta_seal(raw, path)
    if meta.format != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is in format {meta.format} (DeepSpeed's own files, written before scaletrain "
            f"kept layout-free checkpoints); this version reads format {FORMAT} only: finish that run "
            "with the scaletrain that wrote it, or start over in a new run.dir")
    named = re.fullmatch(r"step_(\d+)", path.name)
    if named and int(named[1]) != meta.step:
        raise CheckpointError(
            f"checkpoint {path}: meta.json says step {meta.step}, its directory is named for step {int(named[1])}: "
            "one of them changed since the save; resume from another checkpoint (train.resume=auto takes the one "
            f"before) or delete {path}")
    return meta


def check_files(path: Path, meta: CheckpointMeta) -> None:
    """Every file that meta.json lists is there with the size it was written with (a cheap check,
    stat only, that catches truncated or missing files before any rank starts loading; their contents
    are checked as each rank reads them, safe_load.CheckedFiles)."""
    for name, record in meta.files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks {name}")
        if file.stat().st_size != record.size:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {file.stat().st_size} bytes, {record.size} were written")


def translate_load_errors(path: Path, part: str, load: Callable[[], Any]) -> Any:
    """Run `load`; a refused or unreadable file becomes a CheckpointError naming the checkpoint and part."""
    try:
        return load()
    except UnsafeCheckpointError as error:
        raise CheckpointError(str(error)) from None
    except (OSError, RuntimeError, KeyError, IndexError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(
            f"checkpoint {path}: {part} could not be loaded: {type(error).__name__}: {error}"
        ) from None


def rng_file(checkpoint: Path, rank: int) -> Path:
    """Where `rank`'s RNG state lives in `checkpoint` (a staging directory while it is written)."""
    return checkpoint / "rng" / f"rank_{rank:05d}.pt"


def rng_state() -> dict[str, Any]:
    """This process's RNG state as its rng/rank_*.pt holds it."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
