"""Where a run is: the step counters that, with the engine's state, make a resume exact."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


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
    # loss spikes (train/spikes.py): skipped steps that were spikes, in all and in a row; the trailing
    # windows of accepted losses and gradient norms; rewinds to an earlier checkpoint so far
    spike_steps: int = 0
    consecutive_spike_steps: int = 0
    loss_window: list[float] = field(default_factory=list)
    grad_norm_window: list[float] = field(default_factory=list)
    rewinds: int = 0
    # the hooks' state as of the checkpoint this invocation started from (meta.json "hooks"; train/hooks/)
    hook_states: dict[str, Any] = field(default_factory=dict)

    def count_step(self, global_batch_size: int, skipped: bool, spiked: bool = False) -> None:
        """One more step trained; a skipped step (non-finite, or a spike) consumes its batch too (as
        Megatron's and OLMo-core's)."""
        self.step += 1
        self.consumed_samples += global_batch_size
        self.skipped_steps += skipped
        self.consecutive_skipped_steps = self.consecutive_skipped_steps + 1 if skipped else 0
        self.spike_steps += spiked
        self.consecutive_spike_steps = self.consecutive_spike_steps + 1 if spiked else 0
        self.steps_this_run += 1

    def spike_record(self) -> dict[str, Any]:
        """The loss-spike rule's state, as checkpoints keep it (meta.json "spikes")."""
        return {"steps": self.spike_steps, "consecutive": self.consecutive_spike_steps,
                "loss_window": self.loss_window, "grad_norm_window": self.grad_norm_window, "rewinds": self.rewinds}

    def restore_spikes(self, record: dict[str, Any]) -> None:
        """spike_record's inverse; a checkpoint from before the rule has none (an empty window)."""
        self.spike_steps, self.consecutive_spike_steps = int(record.get("steps", 0)), int(record.get("consecutive", 0))
        self.loss_window = [float(value) for value in record.get("loss_window", [])]
        self.grad_norm_window = [float(value) for value in record.get("grad_norm_window", [])]
        self.rewinds = int(record.get("rewinds", 0))

    def rewind_to(self, earlier: TrainState, skipped_samples: int) -> None:
        """Become `earlier` (a checkpoint's state) with the `skipped_samples` after it left unread, as a
        rewind does (train.spike.rewind); this invocation's step count goes on and the rewind is counted."""
        rewinds, steps_this_run = self.rewinds + 1, self.steps_this_run
        for item in dataclasses.fields(self):
            setattr(self, item.name, getattr(earlier, item.name))
        self.consumed_samples += skipped_samples
        self.rewinds, self.steps_this_run = rewinds, steps_this_run
