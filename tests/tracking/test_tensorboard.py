"""TensorBoard event files: the namespaced scalars at the training step, every step once after a resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from scaletrain.tracking.tensorboard_sink import TENSORBOARD_DIR, TensorBoardSink
from tests.train.runs import DEMO_CONFIG, read_metrics, run_scaletrain, tiny_overrides


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} as TensorBoard shows it: purged events left out, a later event of a step winning."""
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def as_float32(value: float) -> float:
    """TensorBoard's scalars are float32."""
    return float(np.float32(value))


def test_a_resumed_sink_replaces_the_steps_after_its_checkpoint(tmp_path: Path):
    first = TensorBoardSink(tmp_path)
    first.log({"step": 0, "val_loss": 7.0})
    for step in range(1, 6):
        first.log({"step": step, "loss": 10.0 - step, "tokens_per_s": 100.0})
    first.close()  # a job that logged step 5 but checkpointed at step 3
    resumed = TensorBoardSink(tmp_path, resumed_step=3)
    resumed.log({"step": 4, "loss": 0.5, "tokens_per_s": 200.0})
    resumed.close()
    logged = scalars(tmp_path)
    assert logged["train/loss"] == {1: 9.0, 2: 8.0, 3: 7.0, 4: 0.5}
    assert logged["perf/tokens_per_s"] == {1: 100.0, 2: 100.0, 3: 100.0, 4: 200.0}
    assert logged["eval/loss"] == {0: 7.0}


def test_a_run_that_starts_over_hides_the_old_events(tmp_path: Path):
    old = TensorBoardSink(tmp_path)
    old.log({"step": 0, "val_loss": 7.0})
    old.log({"step": 1, "loss": 6.9})
    old.close()
    TensorBoardSink(tmp_path, resumed_step=0).close()
    assert all(not steps for steps in scalars(tmp_path).values())


@pytest.mark.slow
def test_a_resumed_run_writes_each_step_once_to_tensorboard(small_dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), "train.steps=6", "train.eval_every=2",
            "tracking.tensorboard=true"]
    run_scaletrain("train", [*args, "train.exit_after=3"], stopped_early=True)
    run_scaletrain("train", args)
    assert len(list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2, "one event file per job"
    logged = scalars(run_dir)
    training, validation = read_metrics(run_dir)
    assert sorted(training) == list(range(1, 7))
    assert logged["train/loss"] == {step: as_float32(record["loss"]) for step, record in training.items()}
    assert logged["train/tokens"] == {step: record["tokens"] for step, record in training.items()}
    assert sorted(logged["perf/tokens_per_s"]) == list(range(1, 7))
    assert sorted(validation) == [0, 2, 4, 6]
    assert logged["eval/loss"] == {step: as_float32(value) for step, value in validation.items()}
