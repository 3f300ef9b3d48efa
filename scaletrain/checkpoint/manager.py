"""Sharded checkpoints through DeepSpeed, published atomically, with keep-last-k and resume.

Layout of RUN_DIR/checkpoints:
    step_00000100/state/...        DeepSpeed's sharded model + optimizer files (its "tag" dir)
    step_00000100/rng/rank_*.pt    per-rank RNG states
    step_00000100/meta.json        step, consumed samples, layout, every file's size; written last
    step_00000100/config.yaml      the full run config
    latest                         name of the newest complete checkpoint
Every rank writes into `.staging-step_...`; after a barrier rank 0 renames it into place, so
a crash mid-save never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from scaletrain.checkpoint.safe_load import UnsafeCheckpointError, load_tensors, take_write_failure
from scaletrain.config import Config, save_config
from scaletrain.disk import write_failure
from scaletrain.parallel.groups import Topology

DEEPSPEED_TAG = "state"
META_FILE = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it and what to do."""


class LayoutMismatchError(CheckpointError):
    """A checkpoint that cannot be resumed in this run's parallel layout; the message names those that can."""


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    consumed_samples: int
    layout: dict[str, int]
    skipped_steps: int = 0  # steps whose update was skipped (non-finite loss or gradients), in all
    consecutive_skipped_steps: int = 0  # of those, how many in a row up to this step
    files: dict[str, int] = field(default_factory=dict)  # path under the checkpoint -> size in bytes


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
    if failure is None:
        rng_file = staging / "rng" / f"rank_{topology.rank:05d}.pt"
        failure = _attempt_write(lambda: torch.save(_rng_state(), rng_file), rng_file)
    _raise_if_any_failed(failure, staging, topology)
    if topology.rank == 0:
        meta = {"step": step, "consumed_samples": consumed_samples, "layout": layout_of(config, topology),
                "skipped_steps": skipped_steps, "consecutive_skipped_steps": consecutive_skipped_steps}
        failure = _attempt_write(lambda: _publish(staging, final, config, meta), staging)
    _raise_if_any_failed(failure, staging, topology)
    return final


def _publish(staging: Path, final: Path, config: Config, meta: dict[str, Any]) -> None:
    """Rank 0, once every rank's files are in: config, meta.json (last, with every file's size),
    rename, `latest`, pruning."""
    save_config(config, staging / "config.yaml")
    files = {str(path.relative_to(staging)): path.stat().st_size
             for path in sorted(staging.rglob("*")) if path.is_file()}
    (staging / META_FILE).write_text(json.dumps({**meta, "files": files}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    root = final.parent
    _write_atomically(root / "latest", final.name)
    _prune(root, config.checkpoint.keep_last, config.checkpoint.keep_steps)


def _attempt_write(write: Callable[[], Any], path: Path) -> str | None:
    try:
        write()
    except (OSError, RuntimeError) as error:
        return str(write_failure(path, error))
    return None


def _raise_if_any_failed(failure: str | None, staging: Path, topology: Topology) -> None:
    """Every rank learns the first rank's failure (a barrier too): all raise it, none waits forever."""
    failures: list[str | None] = [None] * topology.world_size
    dist.all_gather_object(failures, failure)
    first = next((message for message in failures if message), None)
    if first is None:
        return
    if topology.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise CheckpointError(f"checkpoint not saved: {first}; the previous checkpoints are intact")


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
    latest = latest_checkpoint(run_dir)
    others = sorted((p for p in complete_checkpoints(run_dir) if p != latest), reverse=True)
    return [latest, *others] if latest else others


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
    ours, theirs = _flatten(config.to_dict()), _flatten(stored)
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


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def complete_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in checkpoint_root(run_dir).glob("step_*") if (p / META_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoint_root(run_dir)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / META_FILE).is_file():
            return candidate
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def read_meta(path: Path) -> CheckpointMeta:
    try:
        raw = json.loads((path / META_FILE).read_text())
        return CheckpointMeta(int(raw["step"]), int(raw["consumed_samples"]), dict(raw["layout"]),
                              int(raw.get("skipped_steps", 0)), int(raw.get("consecutive_skipped_steps", 0)),
                              dict(raw.get("files", {})))
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt ({error}); delete it or set train.resume to another"
        ) from None


def check_files(path: Path, meta: CheckpointMeta) -> None:
    """Every file that meta.json lists is there with the size it was written with (a cheap check,
    stat only, that catches truncated or missing files before any rank starts loading)."""
    for name, size in meta.files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks {name}")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path}: {name} has {file.stat().st_size} bytes, {size} were written")


def load_checkpoint(engine: Any, path: Path, meta: CheckpointMeta, config: Config, topology: Topology) -> None:
    """Load a checkpoint written by this run's layout (`meta` from read_meta, its files checked):
    DeepSpeed's sharded state through its own loader, then this rank's RNG state. Another layout's
    checkpoint goes through checkpoint/reshard.py instead."""
    expected = layout_of(config, topology)
    if meta.layout != expected:
        raise LayoutMismatchError(
            f"checkpoint {path} was saved with layout {meta.layout}, this run uses {expected}; "
            "load it with checkpoint.reshard.load_resharded"
        )
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
    _restore_rng_state(translate_load_errors(path, f"rng/{rng_file.name}", lambda: load_tensors(rng_file)))


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


def _prune(root: Path, keep_last: int, keep_steps: list[int]) -> None:
    """Remove all but the newest keep_last checkpoints, and those at checkpoint.keep_steps (branch points)."""
    complete = complete_checkpoints(root.parent)
    for old in complete[:-keep_last]:
        if int(old.name.removeprefix("step_")) not in keep_steps:
            shutil.rmtree(old)
