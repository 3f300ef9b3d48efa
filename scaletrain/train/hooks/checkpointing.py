"""When the loop saves and prunes checkpoints: every call into checkpoint/ that a step makes is here.

A checkpoint is saved every checkpoint.every steps, at checkpoint.keep_steps, when the run stops
early and at the last step; older ones are pruned (checkpoint.keep_last) only once a step after the
newest has trained finitely, so a checkpoint that is about to blow up never costs its predecessor, and
never the checkpoint the run resumed from or last saved: the newest it knows to load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.divergence import DIVERGED_DIR, set_aside_from
from scaletrain.checkpoint.format import checkpoint_root, complete_checkpoints
from scaletrain.checkpoint.manager import save_checkpoint
from scaletrain.checkpoint.publishing import checkpoint_group, finish_pending_save, prune_checkpoints
from scaletrain.config import Config
from scaletrain.parallel.groups import Topology
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.nonfinite import TrainingDiverged, weights_are_finite
from scaletrain.train.state import TrainState


class Checkpointing(Hook):
    """Saves at the steps the config asks for, after the stop check (an early stop saves too), and
    prunes older checkpoints after the first finite step since the newest (a resumed run's first)."""

    order = 60  # saves after the stop check; before the evaluations, whose scores are of the model its checkpoint holds

    @classmethod
    def from_run(cls, run: TrainingRun) -> Checkpointing:
        return cls(run.engine, run.config, run.topology, run.provenance, run.hook_states)

    def __init__(self, engine: Any, config: Config, topology: Topology, provenance: dict[str, str],
                 hook_states: Callable[[], dict[str, Any]]) -> None:
        """`provenance`: what each checkpoint's meta.json records for the next resume's rules
        (resume_policy.checkpoint_provenance); `hook_states`: the loop's hooks' state at the save (Hooks.state_dict)."""
        self._engine, self._config, self._topology = engine, config, topology
        self._provenance, self._hook_states = provenance, hook_states
        self._prune_due = True
        self._newest_own: Path | None = None  # resumed from or saved by this run: never pruned
        checkpoint_group()  # now, not at the first save: that may come after the rendezvous store is gone

    def on_train_start(self, state: TrainState) -> None:
        self._newest_own = Path(state.resumed_from) if state.resumed_from else None

    def on_rewind(self, state: TrainState) -> None:
        self._newest_own, self._prune_due = Path(state.resumed_from), False

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        if self._prune_due and not state.consecutive_skipped_steps:
            self._prune()  # the step after the newest checkpoint trained finitely
            self._prune_due = False

    def after_stop_check(self, state: TrainState) -> None:
        checkpoint, finished = self._config.checkpoint, state.step == self._config.train.steps
        if state.step % checkpoint.every == 0 or state.step in checkpoint.keep_steps or state.stopped_by or finished:
            self._prune_due = self._save_finite_checkpoint(state) or self._prune_due
        if finished and self._prune_due:
            self._prune()

    def _save_finite_checkpoint(self, state: TrainState) -> bool:
        """A checkpoint, unless any rank's weights are non-finite: then the run stops. One written during
        a streak of skipped steps holds the weights from before the streak (skips change nothing); if the
        streak ends the run, it is set aside with them (set_aside_blown_up). Returns whether one was written."""
        if not weights_are_finite(self._engine.module, self._topology.device):
            raise TrainingDiverged(
                f"training diverged: the weights are non-finite after step {state.step}; no checkpoint was "
                f"saved. {set_aside_blown_up(self._config, self._topology, blown_up_at=state.step)}"
            )
        self._newest_own = save_checkpoint(self._engine, self._config, self._topology, state.step,
                                           state.consumed_samples, state.skipped_steps, state.consecutive_skipped_steps,
                                           spikes=state.spike_record(), provenance=self._provenance,
                                           hooks=self._hook_states())
        return True

    def _prune(self) -> None:
        if self._topology.rank == 0:
            checkpoint = self._config.checkpoint
            prune_checkpoints(Path(self._config.run.dir), checkpoint.keep_last, checkpoint.keep_steps,
                              keep=self._newest_own)


def set_aside_blown_up(config: Config, topology: Topology, blown_up_at: int) -> str:
    """After a divergence whose bad update was step `blown_up_at`: the checkpoints from that step on
    hold blown-up weights, so rank 0 moves them to checkpoints/diverged/, and resuming (train.resume=
    auto) starts from the newest one before it. The sentence that tells the user so."""
    run_dir = Path(config.run.dir)
    finish_pending_save()  # every rank stops here together: the checkpoint in flight is published first
    moved = set_aside_from(run_dir, blown_up_at) if topology.rank == 0 else []
    aside = (f"The update of step {blown_up_at} blew up the weights; checkpoints from it on were moved to "
             f"{checkpoint_root(run_dir) / DIVERGED_DIR} ({', '.join(p.name for p in moved)}). " if moved else "")
    good = [path for path in complete_checkpoints(run_dir) if int(path.name.removeprefix("step_")) < blown_up_at]
    if not good:
        return (f"{aside}No checkpoint was saved before step {blown_up_at}: lower train.lr (or raise "
                "train.warmup_steps) and run the same command again; it starts over.")
    return (f"{aside}The last good checkpoint is {good[-1]}: lower train.lr (or raise train.warmup_steps) and "
            f"run the same command again to resume from it (train.resume=auto).")
