"""Setting checkpoints aside, out of resume's and pruning's sight but kept for a look: those at and
after a divergence (RUN/checkpoints/diverged/, the training loop's divergence stop) and those a resume
could not load and fell back past (RUN/checkpoints/rejected/).

The directory layout is checkpoint/format.py's; pruning the rest is checkpoint/publishing.py's.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from scaletrain.checkpoint.format import checkpoint_root, complete_checkpoints, write_latest

DIVERGED_DIR = "diverged"  # checkpoints set aside after a divergence (set_aside_from)
REJECTED_DIR = "rejected"  # checkpoints a resume fell back past (set_aside_rejected)


def set_aside_from(run_dir: Path, step: int) -> list[Path]:
    """Move the checkpoints at `step` and after into RUN/checkpoints/diverged/ (kept for a look, never
    resumed from or pruned) and point `latest` at the newest one left: after a divergence, resuming
    with train.resume=auto then starts before the blow-up. Rank 0 only. Returns their new paths."""
    doomed = [path for path in complete_checkpoints(run_dir) if int(path.name.removeprefix("step_")) >= step]
    return _set_aside(run_dir, doomed, DIVERGED_DIR)


def set_aside_rejected(run_dir: Path, rejected: list[Path]) -> list[Path]:
    """Move checkpoints that a resume could not load, and fell back past, into RUN/checkpoints/rejected/
    (kept for a look): counted among the newest, a broken one would make keep_last prune the one the
    run resumed from, leaving nothing loadable until the next save. Rank 0 only, once every rank has
    loaded the checkpoint it resumes from. Returns their new paths."""
    return _set_aside(run_dir, rejected, REJECTED_DIR)


def _set_aside(run_dir: Path, checkpoints: list[Path], folder: str) -> list[Path]:
    """Move `checkpoints` into RUN/checkpoints/`folder`/, out of resume's and pruning's sight, and point
    `latest` at the newest one left."""
    root = checkpoint_root(run_dir)
    moved = []
    for path in checkpoints:
        target = root / folder / path.name
        target.parent.mkdir(exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(path, target)
        moved.append(target)
    remaining = complete_checkpoints(run_dir)
    if remaining:
        write_latest(root, remaining[-1].name)
    else:
        (root / "latest").unlink(missing_ok=True)
    return moved
