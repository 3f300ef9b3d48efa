"""W&B after a graceful stop: the resumed job continues the same run, every step once, no gap, namespaced names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tracking.wandb_records import read_records, run_record
from tests.train.runs import DEMO_CONFIG, read_metrics, run_scaletrain, tiny_overrides

STEPS = 12


def history(run_file: Path) -> dict[int, dict[str, object]]:
    """step -> logged values of one offline run file."""
    rows = {}
    for record in read_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows[record.history.step.num] = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                             for item in record.history.item}
    return rows


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run_without_gaps(small_dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), f"train.steps={STEPS}", "train.eval_every=4",
            "tracking.wandb=offline"]
    run_scaletrain("train", [*args, "train.exit_after=6"], stopped_early=True)
    run_scaletrain("train", args)
    run_files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2, "one offline run file per job"
    assert len({run_record(path).run_id for path in run_files}) == 1, "both jobs log to the same W&B run"
    first, second = (history(path) for path in run_files)
    assert sorted(first) == list(range(0, 7)) and sorted(second) == list(range(7, STEPS + 1))
    training, validation = read_metrics(run_dir)
    logged = {**first, **second}
    assert all(logged[step]["train/loss"] == training[step]["loss"] for step in range(1, STEPS + 1))
    assert all(logged[step]["train/tokens"] == training[step]["tokens"] for step in range(1, STEPS + 1))
    assert all(logged[step]["perf/step_time_s"] == training[step]["step_time_s"] for step in range(1, STEPS + 1))
    assert all(logged[step]["eval/loss"] == value for step, value in validation.items())
    assert not any(name in row for row in logged.values() for name in ("loss", "val_loss", "tokens_per_s")), \
        "W&B names are namespaced (train/, eval/, perf/); only metrics.jsonl keeps the flat ones"
