"""Each step's record to metrics.jsonl and the trackers (tracking/metrics.py's sinks)."""

from __future__ import annotations

from scaletrain.tracking.metrics import MetricsLogger
from scaletrain.train.hooks import Hook
from scaletrain.train.state import TrainState


class StepMetrics(Hook):
    """Logs the record as the hooks listed before it left it (the speed monitor's fields included)."""

    def __init__(self, logger: MetricsLogger) -> None:
        self._logger = logger

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        self._logger.log(record)
