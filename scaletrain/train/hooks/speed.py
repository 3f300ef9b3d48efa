"""Throughput and MFU of every step, and how long it waited for data."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from scaletrain.config import Config
from scaletrain.families import model_counts
from scaletrain.parallel.groups import Topology
from scaletrain.tracking.flops import device_peak_flops
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.state import TrainState


class TimedBatches:
    """The training batches, counting the wall time a step spends waiting for the next one: the
    loader (its workers, tokenization-free packed reads, collation) is off the critical path when
    `data_wait_fraction` in metrics.jsonl stays near 0."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]) -> None:
        self._batches = batches
        self.waited_s = 0.0

    def __iter__(self) -> TimedBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            self.waited_s += time.perf_counter() - started

    def replace(self, batches: Iterator[dict[str, torch.Tensor]]) -> None:
        """Read from `batches` from now on (a rewind's loader); the old loader's workers are shut down."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()
        self._batches = batches

    def take_waited(self) -> float:
        waited, self.waited_s = self.waited_s, 0.0
        return waited


class SpeedMonitor(Hook):
    """Adds tokens, step_time_s, tokens_per_s, data_wait_fraction and (where the device's peak is
    known) mfu to each step's record: model FLOPs per step (model/counts.py) over the step's wall
    time and the cluster's peak; and train_time_s, the step times summed over the steps the run has
    trained to this one, across its resumes (kept in each checkpoint: the steps an interrupted
    invocation trained after its last checkpoint are trained again and counted once)."""

    order = 10  # first: a step's record gets its speed fields before it is logged and printed

    @classmethod
    def from_run(cls, run: TrainingRun) -> SpeedMonitor:
        return cls(run.config, run.topology, run.batches)

    def __init__(self, config: Config, topology: Topology, batches: TimedBatches) -> None:
        self.tokens_per_step = topology.layout.global_batch * config.model.seq_length
        self.flops_per_step = model_counts(config).flops_per_token * self.tokens_per_step
        self._peak_flops = cluster_peak_flops(config, topology)
        self._batches = batches
        self._step_started = 0.0
        self.train_time_s = 0.0

    def on_step_start(self, state: TrainState) -> None:
        self._batches.take_waited()  # waits outside steps (evaluation's loader) are not the step's
        self._step_started = time.perf_counter()

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        elapsed = time.perf_counter() - self._step_started
        self.train_time_s += elapsed
        record.update(tokens=state.step * self.tokens_per_step, step_time_s=elapsed, train_time_s=self.train_time_s,
                      tokens_per_s=self.tokens_per_step / elapsed,
                      data_wait_fraction=self._batches.take_waited() / elapsed)
        if self._peak_flops:
            record["mfu"] = self.flops_per_step / elapsed / self._peak_flops

    def state_dict(self) -> dict[str, float]:
        return {"train_time_s": self.train_time_s}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.train_time_s = float(state["train_time_s"])


def cluster_peak_flops(config: Config, topology: Topology) -> float | None:
    name = torch.cuda.get_device_name() if topology.device.type == "cuda" else "cpu"
    peak = device_peak_flops(name, config.tracking.peak_tflops)
    return peak * topology.world_size if peak else None
