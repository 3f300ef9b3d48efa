"""A run's config as its checkpoints hold it: what `generate`, `evaluate` and `export` start from
(whatever layout trained the run). What a resume may change from it is checkpoint/resume_policy.py's;
the checkpoints are found and read by checkpoint/format.py."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import (
    META_FILE,
    checkpoint_root,
    complete_checkpoints,
    first_loadable,
    latest_checkpoint,
    read_meta,
    translate_load_errors,
)
from scaletrain.config import Config, ParallelConfig
from scaletrain.config_loader import load_config
from scaletrain.parallel.layout import resolve_for_world


def run_config(run_dir: Path, checkpoint: Path | None = None) -> Config:
    """The run's model in one process, from the config of `checkpoint` or of the run's newest complete
    checkpoint (a run's checkpoints share one model; which of them loads is first_loadable's choice)."""
    return single_process_config(stored_config(run_dir, checkpoint))


def stored_config(run_dir: Path, checkpoint: Path | None = None) -> Config:
    """The config `checkpoint` (default: the run's newest complete one) was saved with, in the layout that
    trained it."""
    checkpoint = checkpoint or latest_checkpoint(run_dir)
    if checkpoint is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint; train first with `scaletrain train CONFIG`")
    return load_config(checkpoint / "config.yaml", to_train=False)


def chosen_checkpoint(run_dir: Path, checkpoint: str | Path) -> Path:
    """A command's --checkpoint: a checkpoint directory, its name under RUN/checkpoints (step_00000300)
    or its step (300)."""
    candidates = [Path(checkpoint), checkpoint_root(run_dir) / checkpoint]
    if str(checkpoint).isdigit():
        candidates.append(checkpoint_root(run_dir) / f"step_{int(checkpoint):08d}")
    for path in candidates:
        if (path / META_FILE).is_file():
            return path
    steps = ", ".join(str(int(path.name.removeprefix("step_"))) for path in complete_checkpoints(run_dir)) or "none"
    raise CheckpointError(
        f"--checkpoint {checkpoint} is not a complete checkpoint (no {META_FILE} there or under "
        f"{checkpoint_root(run_dir)}; its complete checkpoints are at steps {steps}); give a step, a name "
        "step_NNNNNNNN or a checkpoint directory"
    )


T = TypeVar("T")


def load_chosen(run_dir: Path, checkpoint: Path | None, load: Callable[[Path], T]) -> tuple[Path, T]:
    """`load` of the chosen checkpoint, or of the run's newest that loads (each one skipped is named)."""
    if checkpoint is None:
        return first_loadable(run_dir, load)
    return checkpoint, translate_load_errors(checkpoint, "its files", lambda: load(checkpoint))


def single_process_config(config: Config) -> Config:
    """The run's model in one process: TP=PP=DP=1, whatever layout trained it."""
    single = dataclasses.replace(config, parallel=ParallelConfig(tensor=1, pipeline=1, data=None, zero_stage=0))
    return resolve_for_world(single, world_size=1)


def announce_checkpoint(checkpoint: Path, step: int | None = None) -> None:
    """One line on stderr naming the checkpoint a command read and its step: the newest one that loads
    may not be the newest one written (first_loadable skips broken ones), and stdout stays the output.
    `step` as the command read it; without it meta.json is read again, which fails if a training run
    has pruned the checkpoint since."""
    step = read_meta(checkpoint).step if step is None else step
    print(f"using checkpoint {checkpoint} (step {step})", file=sys.stderr, flush=True)
