"""Stop a run whose updates were skipped too many times in a row: train.max_skipped_steps non-finite (or
spiking) steps (train/nonfinite.py), or train.spike.patience loss spikes (train/spikes.py); with
train.spike.rewind, a run of spikes rewinds to the last good checkpoint instead (train/loop.py)."""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.parallel.groups import Topology
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.hooks.checkpointing import set_aside_blown_up
from scaletrain.train.nonfinite import TrainingDiverged
from scaletrain.train.spikes import Rewind
from scaletrain.train.state import TrainState


class DivergenceStop(Hook):
    """Raises TrainingDiverged (or Rewind) at the end of the streak's last step, before anything is pruned
    or saved. Every rank counts the same skips, so every rank stops at the same step."""

    order = 50  # a diverged run stops before Checkpointing prunes anything

    @classmethod
    def from_run(cls, run: TrainingRun) -> DivergenceStop:
        return cls(run.config, run.topology)

    def __init__(self, config: Config, topology: Topology) -> None:
        self._config, self._topology = config, topology

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        spike = self._config.train.spike
        if state.consecutive_spike_steps >= spike.patience:
            self._spiked(state, record)
        limit = self._config.train.max_skipped_steps
        if state.consecutive_skipped_steps < limit:
            return
        first = state.step - state.consecutive_skipped_steps + 1
        what = "non-finite or spiking" if state.consecutive_spike_steps else "non-finite"
        raise TrainingDiverged(
            f"training diverged: the loss or gradient norm was {what} at {limit} steps in a row (steps "
            f"{first}-{state.step}, train.max_skipped_steps={limit}); their updates were skipped and the run "
            f"stopped at step {state.step}. {set_aside_blown_up(self._config, self._topology, blown_up_at=first - 1)}"
        )

    def _spiked(self, state: TrainState, record: dict[str, float]) -> None:
        spike, streak = self._config.train.spike, state.consecutive_spike_steps
        first = state.step - streak + 1
        if spike.rewind and state.rewinds < spike.max_rewinds:
            raise Rewind(first, state.step)
        exhausted = (f" after {state.rewinds} rewinds (train.spike.max_rewinds={spike.max_rewinds})"
                     if spike.rewind else "")
        raise TrainingDiverged(
            f"training diverged: the loss stayed above its trailing window for {streak} steps in a row (steps "
            f"{first}-{state.step}, loss {record.get('loss', float('nan')):.4g} at {record.get('spike/loss_z', 0):.0f} "
            f"deviations above the window's median; train.spike.patience={spike.patience}){exhausted}; their "
            f"updates were skipped and the run stopped at step {state.step}. "
            f"{set_aside_blown_up(self._config, self._topology, blown_up_at=first - 1)}"
        )
