"""The training loop's side concerns as named hooks, called at fixed points of every step.

The loop (train/loop.py) trains steps and decides whether to stop; everything else a step does
(speed and MFU, metrics, console and log lines, divergence, evaluation, checkpoints, the run
summary) is a `Hook` here, each in its own module, called in the order the loop lists them
(OLMo-core's trainer callbacks, allenai/OLMo-core `olmo_core/train/callbacks/`). A hook that keeps state
across a resume says so in state_dict: each checkpoint's meta.json holds it under `hooks`, by the hook's
name, and a run resumed (or rewound) from that checkpoint hands it back before its first step, as
OLMo-core's callbacks carry theirs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.train.state import TrainState


class Hook:
    """One side concern of the loop; each point is a no-op unless the hook needs it.

    Per invocation: on_train_start, then per step on_step_start, on_step_end (the step's record is
    complete) and after_stop_check (the loop has set state.stopped_by: whether the run stops after
    this step), then on_train_end if the loop ended normally; close always, an exception too.
    """

    def on_train_start(self, state: TrainState) -> None:
        """Before the first step of this invocation (a resumed run's too)."""

    def on_step_start(self, state: TrainState) -> None:
        """Before a step's micro-batches are read."""

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        """After a step: state counts it; `record` is its metrics, which hooks listed earlier extend."""

    def after_stop_check(self, state: TrainState) -> None:
        """After the loop has agreed on every rank whether the run stops after this step."""

    def on_rewind(self, state: TrainState) -> None:
        """After the loop rewound to an earlier checkpoint (train.spike.rewind): `state` is that checkpoint's."""

    def on_train_end(self, state: TrainState) -> None:
        """After the last step of this invocation, when the loop ended without an exception."""

    def close(self) -> None:
        """However the loop ended."""

    def state_dict(self) -> dict[str, Any]:
        """What this hook carries across a resume, JSON-serialisable, as of the step being checkpointed; {}:
        nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed or rewound run's: what state_dict returned at the checkpoint it starts from (called only
        for a hook that checkpoint holds state of)."""


class Hooks(Hook):
    """Several hooks as one: each point calls them in the order given (the loop's `_hooks` says why
    that order)."""

    def __init__(self, hooks: list[Hook]) -> None:
        self._hooks = hooks

    def on_train_start(self, state: TrainState) -> None:
        self.load_state_dict(state.hook_states)
        for hook in self._hooks:
            hook.on_train_start(state)

    def on_step_start(self, state: TrainState) -> None:
        for hook in self._hooks:
            hook.on_step_start(state)

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        for hook in self._hooks:
            hook.on_step_end(state, record)

    def after_stop_check(self, state: TrainState) -> None:
        for hook in self._hooks:
            hook.after_stop_check(state)

    def on_rewind(self, state: TrainState) -> None:
        self.load_state_dict(state.hook_states)
        for hook in self._hooks:
            hook.on_rewind(state)

    def on_train_end(self, state: TrainState) -> None:
        for hook in self._hooks:
            hook.on_train_end(state)

    def close(self) -> None:
        for hook in self._hooks:
            hook.close()

    def state_dict(self) -> dict[str, Any]:
        """{hook name: its state} of the hooks that keep any: what a checkpoint's meta.json holds under `hooks`."""
        states = {type(hook).__name__: hook.state_dict() for hook in self._hooks}
        return {name: state for name, state in states.items() if state}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for hook in self._hooks:
            if type(hook).__name__ in states:
                hook.load_state_dict(states[type(hook).__name__])
