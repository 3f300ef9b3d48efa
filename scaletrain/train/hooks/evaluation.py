"""Validation at step 0, every train.eval_every steps and at the last step."""

from __future__ import annotations

from typing import Any

from scaletrain.config import Config
from scaletrain.families import get_family
from scaletrain.parallel.groups import Topology
from scaletrain.tracking.metrics import MetricsLogger
from scaletrain.train.evaluation import metrics_text, validation_metrics
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.hooks.console import ProgressBar
from scaletrain.train.objective import Objective
from scaletrain.train.state import TrainState
from scaletrain.train.step import evaluation_metrics


class PeriodicEvaluation(Hook):
    """Every run ends with an evaluation, so its final validation loss is always measured on the same
    fixed set (scaling-law fits read it); `final_metrics` holds it for the summary. A run starting at
    step 0 is evaluated before its first step too. Nothing with train.eval_every=0."""

    order = 80  # after the progress bar has drawn the step

    @classmethod
    def from_run(cls, run: TrainingRun) -> PeriodicEvaluation:
        return cls(run.engine, run.objective, run.config, run.topology, run.logger, run.hook(ProgressBar))

    def __init__(self, engine: Any, objective: Objective, config: Config, topology: Topology,
                 logger: MetricsLogger, progress: ProgressBar) -> None:
        self._engine, self._objective, self._config, self._topology = engine, objective, config, topology
        self._logger, self._progress = logger, progress
        self.final_metrics: dict[str, float] = {}

    def on_train_start(self, state: TrainState) -> None:
        if state.step == 0 and self._config.train.eval_every:
            self._logger.log({"step": 0, **evaluate(self._engine, self._objective, self._topology)})

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        every, finished = self._config.train.eval_every, state.step == self._config.train.steps
        if not every or (state.step % every and not finished):
            return
        metrics = evaluate(self._engine, self._objective, self._topology)
        self._logger.log({"step": state.step, **metrics})
        if self._topology.is_logging_rank:
            self._progress.write(f"step {state.step}: {metrics_text(metrics)}")
        if finished:
            self.final_metrics = metrics


def evaluate(engine: Any, objective: Objective, topology: Topology) -> dict[str, float]:
    """The engine's validation metrics (train/evaluation.py: which sequences, a blend's weighting)."""
    family = get_family(objective.config.model.family)
    return validation_metrics(lambda batches: evaluation_metrics(engine, batches, family), objective, topology)
