"""metrics.jsonl is strict JSON and holds each step once after a resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

from scaletrain.tracking.metrics import JsonlSink


def strict_records(path: Path) -> list[dict]:
    def refuse(constant: str) -> None:
        raise AssertionError(f"bare {constant} in {path}: not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_non_finite_values_are_written_as_null(tmp_path: Path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log({"step": 3, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "skipped": -math.inf})
    sink.close()
    assert strict_records(tmp_path / "metrics.jsonl") == [
        {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3, "skipped": None}]


def test_a_resumed_run_drops_the_records_after_its_checkpoint(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "val_loss": 7.0}, *({"step": step, "loss": 1.0 / step} for step in range(1, 14)),
             {"step": 10, "val_loss": 5.0}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 14, "lo')  # cut by a kill
    sink = JsonlSink(path, resumed_step=10)
    sink.log({"step": 11, "loss": 0.5})
    sink.close()
    records = strict_records(path)
    assert [record["step"] for record in records] == [0, *range(1, 11), 10, 11]
    assert records[-1] == {"step": 11, "loss": 0.5}


def test_a_run_that_starts_over_starts_an_empty_file(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "val_loss": 7.0}\n{"step": 1, "loss": 6.9}\n')
    JsonlSink(path, resumed_step=0).close()
    assert path.read_text() == ""
