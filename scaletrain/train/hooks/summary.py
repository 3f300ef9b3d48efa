"""The end of a run: RUN_DIR/summary.json once every step is trained, and the last line on stderr."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from scaletrain.checkpoint.format import latest_checkpoint
from scaletrain.config import Config
from scaletrain.parallel.groups import Topology
from scaletrain.train.evaluation import metrics_text
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.hooks.downstream import PREFIX as DOWNSTREAM_PREFIX
from scaletrain.train.hooks.evaluation import PeriodicEvaluation
from scaletrain.train.hooks.speed import SpeedMonitor
from scaletrain.train.state import TrainState
from scaletrain.train.stopping import EXIT_STOPPED_EARLY

RUN_SUMMARY_FILE = "summary.json"


class RunSummary(Hook):
    """On the logging rank: the summary file after the last step's checkpoint (list it after
    Checkpointing), and a line saying how the invocation ended: finished, or stopped early and how to resume.
    The summary holds the final validation metrics and, listed after DownstreamTasks, the last step's
    downstream ones, which that hook adds to the step's record (eval/downstream/<task>/<metric>, as metrics.jsonl
    names them and scaling/sweep/results.py reads them)."""

    order = 100  # last: it follows the last checkpoint and reads the others' figures

    @classmethod
    def from_run(cls, run: TrainingRun) -> RunSummary:
        return cls(run.config, run.topology, run.hook(SpeedMonitor), run.hook(PeriodicEvaluation))

    def __init__(self, config: Config, topology: Topology, speed: SpeedMonitor, evaluation: PeriodicEvaluation) -> None:
        self._config, self._speed, self._evaluation = config, speed, evaluation
        self._enabled = topology.is_logging_rank
        self._started = 0.0
        self._downstream: dict[str, float] = {}

    def on_train_start(self, state: TrainState) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        if state.step == self._config.train.steps:
            self._downstream = {key: value for key, value in record.items() if key.startswith(DOWNSTREAM_PREFIX)}

    def after_stop_check(self, state: TrainState) -> None:
        if self._enabled and state.step == self._config.train.steps:
            write_run_summary(Path(self._config.run.dir), state, self._speed,
                              {**self._evaluation.final_metrics, **self._downstream})

    def on_train_end(self, state: TrainState) -> None:
        if self._enabled:
            print(self._end_line(state, time.perf_counter() - self._started), file=sys.stderr)

    def _end_line(self, state: TrainState, wall_s: float) -> str:
        latest, steps = latest_checkpoint(Path(self._config.run.dir)), self._config.train.steps
        if state.stopped_by:
            return (f"stopped early ({state.stopped_by}) at step {state.step}/{steps} after {wall_s:.0f} s; "
                    f"checkpoint {latest}; run the same command again to resume (exit code {EXIT_STOPPED_EARLY})")
        final = self._evaluation.final_metrics
        val = metrics_text(final) or "no evaluation (eval_every=0)"
        return (f"finished: {state.step} steps, {state.step * self._speed.tokens_per_step:,} tokens, {wall_s:.0f} s "
                f"in this invocation; final {val}; checkpoint {latest}")


def write_run_summary(run_dir: Path, state: TrainState, speed: SpeedMonitor, metrics: dict[str, float]) -> None:
    """RUN_DIR/summary.json, written once a run has trained all its steps: what sweeps and scripts
    read to tell a finished run, its training time over all its invocations (train_time_s, SpeedMonitor's)
    and its final validation and downstream metrics (written atomically)."""
    summary = {"step": state.step, "consumed_samples": state.consumed_samples,
               "tokens": state.step * speed.tokens_per_step, "flops": state.step * speed.flops_per_step,
               "train_time_s": speed.train_time_s, **metrics}
    staging = run_dir / f".{RUN_SUMMARY_FILE}.tmp"
    staging.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(staging, run_dir / RUN_SUMMARY_FILE)
