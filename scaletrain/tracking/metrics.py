"""Metric sinks: a local metrics.jsonl (always), Weights & Biases (offline by default) and TensorBoard."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from scaletrain.config import Config
from scaletrain.disk import write_failure
from scaletrain.tracking.names import tracker_values
from scaletrain.tracking.tensorboard_sink import TensorBoardSink


class Sink(Protocol):
    """Where records go: each takes the flat metrics.jsonl record of one step."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line and flushes, so a killed run keeps every logged step.

    The file is strict JSON (RFC 8259): a non-finite value (a diverged loss, an infinite gradient
    norm) is written as null, never as the bare NaN/Infinity that Python's json emits by default.
    A resumed run first drops the records after its checkpoint's step, which the run is about to
    train again, so every step appears exactly once however often the run was killed.
    """

    def __init__(self, path: Path, resumed_step: int = 0) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                _truncate_after_step(path, resumed_step)
            self._file = path.open("a", encoding="utf-8")
        except OSError as error:
            raise write_failure(path, error, "this start trained nothing; run the same command again once the disk has "
                                "room") from None
        self._path = path

    def log(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(strict_json_values(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as error:
            raise write_failure(self._path, error, "the run stopped; resume it once the disk has room") from None

    def close(self) -> None:
        self._file.close()


def strict_json_values(record: dict[str, Any]) -> dict[str, Any]:
    """The record with non-finite floats replaced by None (JSON null)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


def _truncate_after_step(path: Path, step: int) -> None:
    """Keep the records up to `step` (none when the run starts over at step 0), written atomically;
    a line cut short by a kill is dropped too."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if step > 0 and isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    staging = path.with_name(f".{path.name}.tmp")
    try:
        staging.write_text("".join(kept), encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)  # a full disk fails the write: the old file stays whole, alone


class WandbSink:
    """One W&B run per run directory; `run_facts` (N, D, C...) join the config so runs can be
    compared and grouped by scale in the W&B UI. Metrics go by their namespaced names
    (tracking/names.py) at W&B's step = the training step; `train/tokens` is there to plot against
    instead, to compare runs of different batch sizes."""

    def __init__(self, config: Config, run_dir: Path, run_facts: dict[str, Any]) -> None:
        import wandb  # deferred: importing wandb costs seconds and only rank 0 needs it

        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=config.tracking.project,
            name=config.tracking.name or run_dir.name,
            dir=str(run_dir),
            mode=config.tracking.wandb,
            group=config.tracking.group,
            job_type=config.tracking.job_type,
            tags=config.tracking.tags or None,
            config={**config.to_dict(), **run_facts},
            # One W&B run per run directory: a resumed job continues the same curves.
            id=_stable_run_id(run_dir),
            resume="allow",
        )

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(tracker_values(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Fans each record out to every sink; a no-op on ranks other than the logging rank."""

    def __init__(self, sinks: list[Sink]) -> None:
        self._sinks = sinks

    @classmethod
    def for_run(
        cls, config: Config, run_dir: Path, is_logging_rank: bool, run_facts: dict[str, Any] | None = None,
        resumed_step: int = 0,
    ) -> MetricsLogger:
        """The sinks of a run starting (or resuming) at `resumed_step`."""
        if not is_logging_rank:
            return cls([])
        sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resumed_step)]
        if config.tracking.wandb != "disabled":
            sinks.append(WandbSink(config, run_dir, run_facts or {}))
        if config.tracking.tensorboard:
            sinks.append(TensorBoardSink(run_dir, resumed_step))
        return cls(sinks)

    def log(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def _stable_run_id(run_dir: Path) -> str:
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
