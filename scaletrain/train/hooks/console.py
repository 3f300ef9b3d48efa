"""What a person watching a run reads: a progress bar on a terminal, plain lines in a log file."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from scaletrain.config import Config
from scaletrain.parallel.groups import Topology
from scaletrain.tracking.durations import format_duration
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.state import TrainState


class ProgressBar(Hook):
    """tqdm's bar with the loss and tokens/s, on the logging rank when stderr is a terminal;
    `write` prints a line above it (evaluation results)."""

    order = 70  # draws the step after it is saved and logged

    @classmethod
    def from_run(cls, run: TrainingRun) -> ProgressBar:
        return cls(run.config, run.topology)

    def __init__(self, config: Config, topology: Topology) -> None:
        self._config, self._topology = config, topology
        self._bar: tqdm | None = None

    def on_train_start(self, state: TrainState) -> None:
        self._bar = tqdm(
            total=self._config.train.steps, initial=state.step,
            disable=not (self._topology.is_logging_rank and sys.stderr.isatty()),
            desc="train", unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
        )

    def on_rewind(self, state: TrainState) -> None:
        self._bar.n = state.step
        self._bar.refresh()

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)

    def write(self, line: str) -> None:
        self._bar.write(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class LogLines(Hook):
    """SLURM and CI logs: on the logging rank, when stderr is not a terminal, a plain line every
    train.log_every steps, no carriage returns."""

    order = 40  # prints the logged record

    @classmethod
    def from_run(cls, run: TrainingRun) -> LogLines:
        return cls(run.config, run.topology)

    def __init__(self, config: Config, topology: Topology) -> None:
        self._config = config
        self._enabled = topology.is_logging_rank and not sys.stderr.isatty()
        self._started = 0.0

    def on_step_start(self, state: TrainState) -> None:
        if state.steps_this_run == 0:  # the clock starts at this invocation's first step, after step 0's evaluation
            self._started = time.perf_counter()

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        if self._enabled and log_line_due(state.step, state.steps_this_run, self._config):
            print(log_line(record, self._config.train.steps, time.perf_counter() - self._started,
                           state.steps_this_run), file=sys.stderr, flush=True)


def log_line_due(step: int, steps_this_run: int, config: Config) -> bool:
    """Every train.log_every steps (Megatron's --log-interval), and the first step of an invocation (it
    shows the run is training and how fast) and the last one (the run's final loss)."""
    return step % config.train.log_every == 0 or steps_this_run == 1 or step == config.train.steps


def log_line(record: dict[str, float], total_steps: int, elapsed_s: float, steps_this_run: int) -> str:
    """The plain progress line; the ETA is this invocation's mean step time so far (evaluations and
    checkpoints included, as the steps left will have them) times the steps left."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3e}"]
    if "grad_norm" in record:
        parts.append(f"grad_norm {record['grad_norm']:.3f}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    eta_s = elapsed_s / steps_this_run * (total_steps - record["step"])
    parts.extend([f"elapsed {format_duration(elapsed_s)}", f"eta {format_duration(eta_s)}"])
    return "train: " + ", ".join(parts)
