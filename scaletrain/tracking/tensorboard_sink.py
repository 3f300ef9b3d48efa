"""TensorBoard event files, for clusters without W&B: the same namespaced scalars, one file per job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.tracking.names import tracker_values

TENSORBOARD_DIR = "tensorboard"


class TensorBoardSink:
    """Scalars under RUN_DIR/tensorboard/, at the training step.

    Every job of a run appends its own event file to the same directory. A job resuming at step k
    logs again from step k + 1 (from step 0 when it starts over), so it opens with a purge event
    there (SummaryWriter's purge_step): TensorBoard hides the earlier jobs' events from that step
    on, and each step shows once, as metrics.jsonl and W&B hold it. Each record is flushed, so a
    killed job keeps every step it logged, as metrics.jsonl does. Values are stored as TensorBoard's
    classic float32 scalars, which every reader of event files understands.
    """

    def __init__(self, run_dir: Path, resumed_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # deferred: only tracking.tensorboard runs need it

        first_step = resumed_step + 1 if resumed_step else 0
        self._writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=first_step)

    def log(self, record: dict[str, Any]) -> None:
        for name, value in tracker_values(record).items():
            self._writer.add_scalar(name, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
