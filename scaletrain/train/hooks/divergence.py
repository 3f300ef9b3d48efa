"""Stop a run whose updates were skipped train.max_skipped_steps times in a row (train/nonfinite.py)."""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.parallel.groups import Topology
from scaletrain.train.hooks import Hook
from scaletrain.train.hooks.checkpointing import set_aside_blown_up
from scaletrain.train.nonfinite import TrainingDiverged
from scaletrain.train.state import TrainState


class DivergenceStop(Hook):
    """Raises TrainingDiverged at the end of the streak's last step, before anything is pruned or
    saved. Every rank counts the same skips, so every rank stops at the same step."""

    def __init__(self, config: Config, topology: Topology) -> None:
        self._config, self._topology = config, topology

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        limit = self._config.train.max_skipped_steps
        if state.consecutive_skipped_steps < limit:
            return
        first = state.step - state.consecutive_skipped_steps + 1
        raise TrainingDiverged(
            f"training diverged: the loss or gradient norm was non-finite at {limit} steps in a row (steps "
            f"{first}-{state.step}, train.max_skipped_steps={limit}); their updates were skipped and the run "
            f"stopped at step {state.step}. {set_aside_blown_up(self._config, self._topology, blown_up_at=first - 1)}"
        )
