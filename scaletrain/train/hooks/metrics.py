"""Each step's record to metrics.jsonl and the trackers (tracking/metrics.py's sinks)."""

from __future__ import annotations

from scaletrain.tracking.metrics import MetricsLogger
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.state import TrainState


class StepMetrics(Hook):
    """Logs the record as the hooks listed before it left it (the speed monitor's fields included)."""

    order = 30  # logs the record the hooks before it completed

    @classmethod
    def from_run(cls, run: TrainingRun) -> StepMetrics:
        return cls(run.logger)

    def __init__(self, logger: MetricsLogger) -> None:
        self._logger = logger

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        self._logger.log(record)
