"""Hooks register themselves (train/hooks/__init__.py): every hook module's hook is found, each has its own
place, and the places keep the order the loop's points rely on."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import scaletrain.train.hooks as hooks_package
from scaletrain.train.hooks import _REGISTERED, Hook, Hooks, registered_hooks


def _registered() -> list[str]:
    return [kind.__name__ for kind in registered_hooks()]


def test_every_hook_of_the_package_registers_itself_with_its_own_place():
    order = _registered()
    defined = {name for module in pkgutil.iter_modules(hooks_package.__path__)
               for name, value in inspect.getmembers(importlib.import_module(f"{hooks_package.__name__}.{module.name}"),
                                                     inspect.isclass)
               if issubclass(value, Hook) and value not in (Hook, Hooks)}
    assert set(order) == defined and len(order) == len(defined)
    assert len({kind.order for kind in registered_hooks()}) == len(order)


@pytest.mark.parametrize(("first", "then", "why"), [
    ("SpeedMonitor", "StepMetrics", "the record gets its speed fields before it is logged"),
    ("ExpertStatistics", "StepMetrics", "the routing fields are logged with the step"),
    ("StepMetrics", "LogLines", "the log line prints what was logged"),
    ("DivergenceStop", "Checkpointing", "a diverged run stops before anything is pruned"),
    ("Checkpointing", "PeriodicEvaluation", "evaluations score the model the step's checkpoint holds"),
    ("Checkpointing", "DownstreamTasks", "evaluations score the model the step's checkpoint holds"),
    ("PeriodicEvaluation", "RunSummary", "the summary follows the last evaluation"),
    ("DownstreamTasks", "RunSummary", "summary.json holds the last step's downstream metrics"),
])
def test_the_places_keep_the_order_the_points_rely_on(first: str, then: str, why: str):
    order = _registered()
    assert order.index(first) < order.index(then), why


def test_a_hook_with_a_place_and_no_way_to_build_itself_is_refused():
    class Placed(Hook):
        order = 10_000

    try:
        with pytest.raises(NotImplementedError, match="Placed sets an order but not from_run"):
            Placed.from_run(None)
    finally:
        _REGISTERED.remove(Placed)
