"""A run's config for one process, read from its checkpoints: what `generate`, `evaluate` and
`export` start from, whatever layout trained the run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from scaletrain.checkpoint.manager import CheckpointError, latest_checkpoint, read_meta
from scaletrain.config import Config, ParallelConfig, resolve_for_world
from scaletrain.config_loader import load_config


def run_config(run_dir: Path) -> Config:
    """The run's model in one process, from its newest complete checkpoint's config (a run's
    checkpoints share one model; which of them loads is first_loadable's choice)."""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint; train first with `scaletrain train CONFIG`")
    return single_process_config(load_config(newest / "config.yaml", to_train=False))


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
