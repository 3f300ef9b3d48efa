"""Sharded checkpoints through DeepSpeed, published atomically, with keep-last-k and resume.

Layout of RUN_DIR/checkpoints:
    step_00000100/state/...        DeepSpeed's sharded model + optimizer files (its "tag" dir)
    step_00000100/rng/rank_*.pt    per-rank RNG states
    step_00000100/meta.json        step, consumed samples, layout, every file's size and CRC-32
                                   (checkpoint/integrity.py); written last
    step_00000100/config.yaml      the full run config
    latest                         name of the newest complete checkpoint: a hint for other tools;
                                   scaletrain finds the newest by scanning
    diverged/step_...              checkpoints set aside after a divergence (never resumed from)
Every rank writes into `.staging-step_...`; after a barrier rank 0 renames it into place, so
a crash mid-save never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import yaml

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.integrity import FileRecord, check_finite, file_checksum, loaded_state, save_with_checksum
from scaletrain.checkpoint.safe_load import (
    CheckedFiles,
    UnsafeCheckpointError,
    checked_reads,
    take_checksums,
    take_write_failure,
)
from scaletrain.config import Config, save_config
from scaletrain.disk import write_failure
from scaletrain.parallel.groups import Topology

DEEPSPEED_TAG = "state"
META_FILE = "meta.json"
DIVERGED_DIR = "diverged"  # checkpoints set aside after a divergence (set_aside_from)
T = TypeVar("T")


class LayoutMismatchError(CheckpointError):
    """A checkpoint that cannot be resumed in this run's parallel layout; the message names those that can."""


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    consumed_samples: int
    layout: dict[str, int]
    skipped_steps: int = 0  # steps whose update was skipped (non-finite loss or gradients), in all
    consecutive_skipped_steps: int = 0  # of those, how many in a row up to this step
    files: dict[str, FileRecord] = field(default_factory=dict)  # path under the checkpoint -> size, CRC-32


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def layout_of(config: Config, topology: Topology) -> dict[str, int]:
    return {
        "tensor": topology.tensor_parallel_size,
        "pipeline": topology.pipeline_parallel_size,
        "data": topology.data_parallel_size,
        "zero_stage": config.parallel.zero_stage,
    }


def save_checkpoint(
    engine: Any, config: Config, topology: Topology, step: int, consumed_samples: int,
    skipped_steps: int = 0, consecutive_skipped_steps: int = 0,
) -> Path:
    """Write every rank's files into a staging directory, then publish it in one rename. A failed
    write on any rank (a full disk) removes the staging directory on all and raises one
    CheckpointError naming the file and the cause; the previous checkpoints stay as they were."""
    root = checkpoint_root(Path(config.run.dir))
    name = f"step_{step:08d}"
    staging, final = root / f".staging-{name}", root / name
    failure = None
    if topology.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        failure = _attempt_write(lambda: (staging / "rng").mkdir(parents=True), staging)
    _raise_if_any_failed(failure, staging, topology)
    # DeepSpeed's writes go through the checkpoint engine, which records a failure instead of
    # raising it between DeepSpeed's barriers (checkpoint/safe_load.py); what else fails is caught
    # here, which is enough on one rank (on several, the others wait in DeepSpeed's last barrier).
    failure = _attempt_write(lambda: engine.save_checkpoint(str(staging), tag=DEEPSPEED_TAG, save_latest=False),
                             staging)
    failure = take_write_failure(engine) or failure
    checksums = take_checksums(engine)
    if failure is None:
        rng_file = staging / "rng" / f"rank_{topology.rank:05d}.pt"
        failure = _attempt_write(lambda: checksums.update({str(rng_file): save_with_checksum(_rng_state(), rng_file)}),
                                 rng_file)
    checksums = _raise_if_any_failed(failure, staging, topology, checksums)
    if topology.rank == 0:
        meta = {"step": step, "consumed_samples": consumed_samples, "layout": layout_of(config, topology),
                "skipped_steps": skipped_steps, "consecutive_skipped_steps": consecutive_skipped_steps}
        failure = _attempt_write(lambda: _publish(staging, final, config, meta, checksums), staging)
    _raise_if_any_failed(failure, staging, topology)
    return final


def _publish(staging: Path, final: Path, config: Config, meta: dict[str, Any], checksums: dict[str, str]) -> None:
    """Rank 0, once every rank's files are in: config, meta.json (last, with every file's size and
    CRC-32: the ranks' own from `checksums`, by path under `staging`, the rest hashed here), rename,
    `latest`."""
    save_config(config, staging / "config.yaml")
    files = {}
    for path in sorted(staging.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(staging))
            files[name] = FileRecord(path.stat().st_size, checksums.get(name) or file_checksum(path)).to_json()
    (staging / META_FILE).write_text(json.dumps({**meta, "files": files}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    root = final.parent
    _write_atomically(root / "latest", final.name)


def _attempt_write(write: Callable[[], Any], path: Path) -> str | None:
    try:
        write()
    except (OSError, RuntimeError) as error:
        return str(write_failure(path, error))
    return None


def _raise_if_any_failed(
    failure: str | None, staging: Path, topology: Topology, checksums: dict[str, str] | None = None
) -> dict[str, str]:
    """Every rank learns the first rank's failure (a barrier too): all raise it, none waits forever.
    Without one, returns the CRC-32 of every file the ranks wrote (`checksums`: one gather for both)."""
    gathered: list[tuple[str | None, dict[str, str]]] = [(None, {})] * topology.world_size
    dist.all_gather_object(gathered, (failure, checksums or {}))
    first = next((message for message, _ in gathered if message), None)
    if first is None:
        return _merge_checksums([written for _, written in gathered], staging)
    if topology.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise CheckpointError(f"checkpoint not saved: {first}; the previous checkpoints are intact")


def _merge_checksums(per_rank: list[dict[str, str]], staging: Path) -> dict[str, str]:
    """Each rank's {path as written: CRC-32} as one {path under `staging`: CRC-32}; a file that two
    ranks wrote with different contents is left out, for rank 0 to hash as it ended up."""
    merged: dict[str, str] = {}
    conflicting = set()
    for written in per_rank:
        for path, crc in written.items():
            name = os.path.relpath(os.path.abspath(path), os.path.abspath(staging))
            if merged.setdefault(name, crc) != crc:
                conflicting.add(name)
    return {name: crc for name, crc in merged.items() if name not in conflicting}


def resume_candidates(config: Config) -> list[Path]:
    """train.resume as checkpoints to try in order: `never` none; `auto` every complete one, newest
    first (a newest one that fails to load gives way to the one before); an explicit path that one.
    Where that leaves none, a cooldown branch (train.branch_from) starts from its checkpoint, so an
    interrupted branch resumes its own checkpoints rather than branching again."""
    setting = config.train.resume
    if setting in ("never", "auto"):
        own = _own_checkpoints(Path(config.run.dir)) if setting == "auto" else []
        if own or config.train.branch_from is None:
            return own
        return [check_branch_point(Path(config.train.branch_from), config)]
    path = Path(setting)
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"train.resume={setting}: no complete checkpoint there (missing {META_FILE}); "
            f"use train.resume=auto or a directory under {checkpoint_root(Path(config.run.dir))}"
        )
    return [path]


def _own_checkpoints(run_dir: Path) -> list[Path]:
    latest_checkpoint(run_dir)  # the warning about a wrong `latest` pointer, if any
    return complete_checkpoints(run_dir)[::-1]


# Keys a cooldown branch may set apart from the run it branches from: its length and schedule,
# where it lives and reports, and how it is checkpointed, evaluated and stopped. The layout may
# differ too (the checkpoint is resharded, as any resume); the global batch may not.
BRANCH_FREE_KEYS = (
    "train.steps", "train.lr_schedule", "train.cooldown_fraction", "train.cooldown_shape", "train.branch_from",
    "train.resume", "train.eval_every", "train.eval_samples", "train.exit_after", "train.exit_after_minutes",
    "train.stop_signals", "train.log_every", "train.micro_batch_size", "train.grad_accum",
    "train.global_batch_size", "run.", "checkpoint.", "tracking.", "parallel.",
)


def check_branch_point(path: Path, config: Config) -> Path:
    """train.branch_from, refused unless it is a complete checkpoint before train.steps of a run whose
    config is this one's apart from BRANCH_FREE_KEYS: then resuming it continues the very run that a
    fresh run of this config would be (Hägele et al. 2024, sec. 3: a cooldown of a constant-LR run)."""
    if not (path / META_FILE).is_file() or not (path / "config.yaml").is_file():
        raise CheckpointError(
            f"train.branch_from={path}: no complete checkpoint there (missing {META_FILE} or config.yaml); "
            "give a directory RUN/checkpoints/step_NNNNNNNN of the run to branch from"
        )
    step = read_meta(path).step
    if step >= config.train.steps:
        raise CheckpointError(
            f"train.branch_from={path} is at step {step}, not before train.steps={config.train.steps}; "
            "branch from an earlier checkpoint or raise train.steps"
        )
    differing = _branch_differences(yaml.safe_load((path / "config.yaml").read_text()), config)
    if differing:
        raise CheckpointError(
            f"train.branch_from={path} was trained with a different config: {'; '.join(differing)}. A branch "
            f"may change only {', '.join(BRANCH_FREE_KEYS)}; set the others as that run had them (its "
            f"config.yaml), or train this run fresh (train.branch_from=null)"
        )
    return path


def _branch_differences(stored: dict[str, Any], config: Config) -> list[str]:
    ours, theirs = flatten_config(config.to_dict()), flatten_config(stored)
    differing = [f"{key}={theirs.get(key)!r} there, {ours.get(key)!r} here"
                 for key in sorted(set(ours) | set(theirs))
                 if not key.startswith(BRANCH_FREE_KEYS) and ours.get(key) != theirs.get(key)]
    batch_here = _global_batch(config.to_dict())
    batch_there = _global_batch(stored)
    if batch_here != batch_there:
        differing.append(f"global batch size {batch_there} there, {batch_here} here")
    return differing


def _global_batch(config: dict[str, Any]) -> int:
    train = config["train"]
    return train.get("global_batch_size") or (
        train["micro_batch_size"] * train["grad_accum"] * (config["parallel"].get("data") or 1))


def flatten_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {'section.key': value}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


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


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove what a killed save or prune left (a staging or half-removed directory, a step_*
    directory without meta.json) before the run writes new checkpoints; rank 0, under the run lock,
    so no save is in flight. Returns what it removed."""
    root = checkpoint_root(run_dir)
    leftovers = [*root.glob(".staging-step_*"), *root.glob(".pruning-step_*"),
                 *(p for p in root.glob("step_*") if p.is_dir() and not (p / META_FILE).is_file())]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def set_aside_from(run_dir: Path, step: int) -> list[Path]:
    """Move the checkpoints at `step` and after into RUN/checkpoints/diverged/ (kept for a look, never
    resumed from or pruned) and point `latest` at the newest one left: after a divergence, resuming
    with train.resume=auto then starts before the blow-up. Rank 0 only. Returns their new paths."""
    root = checkpoint_root(run_dir)
    moved = []
    for path in complete_checkpoints(run_dir):
        if int(path.name.removeprefix("step_")) >= step:
            target = root / DIVERGED_DIR / path.name
            target.parent.mkdir(exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
            moved.append(target)
    remaining = complete_checkpoints(run_dir)
    if remaining:
        _write_atomically(root / "latest", remaining[-1].name)
    else:
        (root / "latest").unlink(missing_ok=True)
    return moved


def read_meta(path: Path) -> CheckpointMeta:
    try:
        raw = json.loads((path / META_FILE).read_text())
        files = {name: FileRecord.from_json(record) for name, record in dict(raw.get("files", {})).items()}
        return CheckpointMeta(int(raw["step"]), int(raw["consumed_samples"]), dict(raw["layout"]),
                              int(raw.get("skipped_steps", 0)), int(raw.get("consecutive_skipped_steps", 0)), files)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt ({error}); delete it or set train.resume to another"
        ) from None


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


def load_checkpoint(engine: Any, path: Path, meta: CheckpointMeta, config: Config, topology: Topology) -> None:
    """Load a checkpoint written by this run's layout (`meta` from read_meta, its files checked):
    DeepSpeed's sharded state through its own loader, then this rank's RNG state, each file checked
    against its CRC-32 as it is read; then the loaded weights and Adam moments are checked finite (on
    this rank alone: the caller agrees on a failure over all ranks). Another layout's checkpoint goes
    through checkpoint/reshard.py instead."""
    expected = layout_of(config, topology)
    if meta.layout != expected:
        raise LayoutMismatchError(
            f"checkpoint {path} was saved with layout {meta.layout}, this run uses {expected}; "
            "load it with checkpoint.reshard.load_resharded"
        )
    files = CheckedFiles(path, meta.files)
    with checked_reads(engine, files):
        loaded_path, _ = translate_load_errors(
            path, DEEPSPEED_TAG, lambda: engine.load_checkpoint(
                str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        )
    if loaded_path is None:
        raise CheckpointError(f"checkpoint {path} has no DeepSpeed state under {DEEPSPEED_TAG}/")
    rng_file = path / "rng" / f"rank_{topology.rank:05d}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"checkpoint {path} lacks rng/{rng_file.name}; it was not written by this layout")
    _restore_rng_state(translate_load_errors(path, f"rng/{rng_file.name}", lambda: files.load(rng_file)))
    check_finite(path, loaded_state(engine))


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


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def prune_checkpoints(run_dir: Path, keep_last: int, keep_steps: list[int]) -> None:
    """Remove all but the newest keep_last checkpoints, and those at checkpoint.keep_steps (branch
    points). The loop calls it once the step after a save has trained with finite loss and gradients,
    so the checkpoint before a blow-up is never pruned in favour of one holding the blown-up weights.
    Each is renamed out of the `step_*` namespace first, so a kill mid-removal leaves no directory that
    looks like a checkpoint (clean_leftovers removes the rest at the next start)."""
    root = checkpoint_root(run_dir)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        if int(old.name.removeprefix("step_")) not in keep_steps:
            doomed = root / f".pruning-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed)
