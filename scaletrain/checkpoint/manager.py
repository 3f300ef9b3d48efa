"""What the training loop calls to save and load a layout-free checkpoint; the work is its neighbours'.

A save copies this rank's share of the state off the training tensors (collective: ZeRO gathers each
parameter over its data-parallel group) with its RNG state and returns; checkpoint/publishing.py
writes them in the background and publishes them atomically (and prunes, and waits for the write in
flight). A load reads a checkpoint written in any layout into the engine (checkpoint/layout_free.py)
and, in the same layout, its RNG state. The files and meta.json are checkpoint/format.py's; which
checkpoint a run resumes from and what its config may change, checkpoint/resume_policy.py's; setting
checkpoints aside after a divergence or a failed load, checkpoint/divergence.py's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from scaletrain.checkpoint import layout_free
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import (
    FORMAT,
    CheckpointMeta,
    describe_layout,
    layout_of,
    restore_rng_state,
    rng_file,
    rng_state,
    translate_load_errors,
)
from scaletrain.checkpoint.publishing import checkpoint_group, finish_pending_save, publish
from scaletrain.checkpoint.safe_load import CheckedFiles
from scaletrain.config import Config
from scaletrain.parallel.groups import Topology


def save_checkpoint(
    engine: Any, config: Config, topology: Topology, step: int, consumed_samples: int,
    skipped_steps: int = 0, consecutive_skipped_steps: int = 0, spikes: dict[str, Any] | None = None,
    provenance: dict[str, str] | None = None, hooks: dict[str, Any] | None = None,
) -> Path:
    """Copy this rank's share of the state off the training tensors and write it (in the background
    with checkpoint.async_save) into a staging directory that rank 0 publishes in one rename once all
    ranks' files are in. A failed write on any rank (a full disk) removes the staging directory and
    raises one CheckpointError naming the file, the cause and the newest checkpoint left, on every
    rank, here or at the next finish_pending_save. `provenance` goes into meta.json as it is
    (resume_policy.checkpoint_provenance: the tokenizer, the checkpoint the run started from), and so does
    `hooks`, the loop's hooks' state (train/hooks/)."""
    finish_pending_save()
    started = time.perf_counter()
    group = checkpoint_group()
    collected = layout_free.collect_pieces(engine, topology)
    rng = rng_state()
    meta = {"format": FORMAT, "step": step, "consumed_samples": consumed_samples,
            "layout": layout_of(config, topology), "skipped_steps": skipped_steps,
            "consecutive_skipped_steps": consecutive_skipped_steps, **({"spikes": spikes} if spikes else {}),
            **({"hooks": hooks} if hooks else {}), **(provenance or {})}
    return publish(collected, rng, config, topology, meta, group, started)


def load_checkpoint(engine: Any, path: Path, meta: CheckpointMeta, config: Config, topology: Topology) -> None:
    """Load a checkpoint written in any layout (`meta` from read_meta, its files checked) into `engine`:
    every parameter's master weight, working copy and Adam moments cut for this rank
    (checkpoint/layout_free.py), each file checked against its CRC-32 as it is read; in the same layout
    this rank's RNG state too (another layout reseeds it: dropout masks then differ from an
    uninterrupted run's). The weights and moments are checked finite before any is loaded (on this
    rank alone: the caller agrees on a failure over all ranks)."""
    target = layout_of(config, topology)
    same_layout = meta.layout == target
    if not same_layout and topology.is_logging_rank:
        print(f"resharding checkpoint {path} from {describe_layout(meta.layout)} to {describe_layout(target)}"
              + ("; dropout masks will differ from an uninterrupted run's" if config.model.dropout else ""),
              file=sys.stderr, flush=True)
    files = CheckedFiles(path, meta.files)
    translate_load_errors(path, layout_free.STATE_DIR, lambda: layout_free.load_into_engine(engine, path, files,
                                                                                          topology))
    if same_layout:
        rank_rng = rng_file(path, topology.rank)
        if not rank_rng.is_file():
            raise CheckpointError(f"checkpoint {path} lacks rng/{rank_rng.name}")
        restore_rng_state(translate_load_errors(path, f"rng/{rank_rng.name}", lambda: files.load(rank_rng)))
    engine.global_steps = meta.step
    engine.global_samples = meta.consumed_samples
