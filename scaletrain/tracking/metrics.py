"""Metric sinks: a local metrics.jsonl (always) and Weights & Biases (offline by default)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from scaletrain.config import Config


class JsonlSink:
    """Appends one JSON object per line and flushes, so a killed run keeps every logged step."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbSink:
    """One W&B run per run directory; `run_facts` (N, D, C...) join the config so runs can be
    compared and grouped by scale in the W&B UI."""

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
        values = {key: value for key, value in record.items() if key != "step"}
        self._run.log(values, step=record["step"])

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Fans each record out to every sink; a no-op on ranks other than the logging rank."""

    def __init__(self, sinks: list[JsonlSink | WandbSink]) -> None:
        self._sinks = sinks

    @classmethod
    def for_run(
        cls, config: Config, run_dir: Path, is_logging_rank: bool, run_facts: dict[str, Any] | None = None
    ) -> MetricsLogger:
        if not is_logging_rank:
            return cls([])
        sinks: list[JsonlSink | WandbSink] = [JsonlSink(run_dir / "metrics.jsonl")]
        if config.tracking.wandb != "disabled":
            sinks.append(WandbSink(config, run_dir, run_facts or {}))
        return cls(sinks)

    def log(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def _stable_run_id(run_dir: Path) -> str:
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
