"""The training loop's side concerns as named hooks, called at fixed points of every step.

The loop (train/loop.py) trains steps and decides whether to stop; everything else a step does
(speed and MFU, metrics, console and log lines, divergence, evaluation, checkpoints, the run
summary) is a `Hook` here, each in its own module (OLMo-core's trainer callbacks, allenai/OLMo-core
`olmo_core/train/callbacks/`). A hook registers itself: a subclass with an `order` is registered when its
module is imported, `build_hooks` imports every module of this package and asks each registered hook
to build itself from the run (`from_run`; None where the config leaves it out), and calls them in
`order` (OLMo-core's callback `priority`), so adding a hook is adding a module. A hook that keeps state
across a resume says so in state_dict: each checkpoint's meta.json holds it under `hooks`, by the hook's
name, and a run resumed (or rewound) from that checkpoint hands it back before its first step, as
OLMo-core's callbacks carry theirs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from scaletrain.config import Config
    from scaletrain.parallel.groups import Topology
    from scaletrain.tracking.metrics import MetricsLogger
    from scaletrain.train.hooks.speed import TimedBatches
    from scaletrain.train.objective import Objective
    from scaletrain.train.state import TrainState

HookType = TypeVar("HookType", bound="Hook")
_REGISTERED: list[type[Hook]] = []


class Hook:
    """One side concern of the loop; each point is a no-op unless the hook needs it.

    Per invocation: on_train_start, then per step on_step_start, on_step_end (the step's record is
    complete) and after_stop_check (the loop has set state.stopped_by: whether the run stops after
    this step), then on_train_end if the loop ended normally; close always, an exception too.

    A concrete hook sets `order`, its place at every point (lower first; the orders below say why each
    comes where it does), and `from_run`.
    """

    order: ClassVar[int | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.order is not None:
            _REGISTERED.append(cls)

    @classmethod
    def from_run(cls: type[HookType], run: TrainingRun) -> HookType | None:
        """This hook for `run`, or None where its config leaves it out."""
        raise NotImplementedError(f"{cls.__name__} sets an order but not from_run")

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
    """Several hooks as one: each point calls them in the order given (their `order`)."""

    def __init__(self, hooks: list[Hook]) -> None:
        self._hooks = hooks

    def append(self, hook: Hook) -> None:
        self._hooks.append(hook)

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


@dataclass
class TrainingRun:
    """What a hook builds itself from: the run's engine, objective, config, topology, metrics logger, timed
    batches, the provenance its checkpoints record, and the hooks' state at a save (for Checkpointing)."""

    engine: Any
    objective: Objective
    config: Config
    topology: Topology
    logger: MetricsLogger
    batches: TimedBatches
    provenance: dict[str, str]
    hook_states: Callable[[], dict[str, Any]]
    _built: dict[type[Hook], Hook | None] = field(default_factory=dict)

    def hook(self, kind: type[HookType]) -> HookType | None:
        """The run's hook of this class, built on first ask: a hook another one reads (the progress bar,
        the speed monitor) is built once, whichever asks first."""
        if kind not in self._built:
            self._built[kind] = kind.from_run(self)
        return self._built[kind]


def registered_hooks() -> list[type[Hook]]:
    """Every hook of this package, in order: each module is imported, which registers the hooks it defines."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return sorted(_REGISTERED, key=lambda kind: kind.order)


def build_hooks(engine: Any, objective: Objective, config: Config, topology: Topology, logger: MetricsLogger,
                batches: TimedBatches, provenance: dict[str, str]) -> Hooks:
    """Every registered hook this run has, in order; built in that order too, so every rank makes the
    collectives some constructors make (the MoE statistics' all-gather, the checkpoint group) alike."""
    hooks = Hooks([])
    run = TrainingRun(engine, objective, config, topology, logger, batches, provenance, hooks.state_dict)
    for kind in registered_hooks():
        hook = run.hook(kind)
        if hook is not None:
            hooks.append(hook)
    return hooks
