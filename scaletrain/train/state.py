"""Where a run is: the step counters that, with the engine's state, make a resume exact."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Everything that says where a run is; with the engine's state it makes resume exact."""

    step: int = 0
    consumed_samples: int = 0
    stopped_by: str | None = None  # why this invocation stopped before the last step (train/stopping.py)
    resumed_from: str | None = None  # the checkpoint this invocation started from
    skipped_steps: int = 0  # steps whose update was skipped for a non-finite loss or gradient norm
    consecutive_skipped_steps: int = 0
    steps_this_run: int = 0  # steps this invocation trained (not checkpointed: a resume starts at 0)

    def count_step(self, global_batch_size: int, skipped: bool) -> None:
        """One more step trained; a skipped step consumes its batch too (as Megatron's)."""
        self.step += 1
        self.consumed_samples += global_batch_size
        self.skipped_steps += skipped
        self.consecutive_skipped_steps = self.consecutive_skipped_steps + 1 if skipped else 0
        self.steps_this_run += 1
