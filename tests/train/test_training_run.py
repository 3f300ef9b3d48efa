"""A short real run: validation loss falls, metrics and W&B files are written, generation works."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.sampler import validation_sample
from tests.distributed.harness import run_on_ranks
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)


@pytest.fixture(scope="module")
def trained_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("short_run") / "run"
    overrides = [
        *tiny_overrides(small_dataset, run_dir), "model.seq_length=64", "model.hidden_size=96", "train.lr=4e-3",
        "train.steps=200", "train.eval_every=100",
        "train.warmup_steps=5", "checkpoint.every=100", "checkpoint.keep_last=1", "tracking.wandb=offline",
    ]
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides])
    return run_dir


def unigram_cross_entropy(data_dir: Path, seq_length: int, eval_samples: int) -> float:
    """Cross-entropy of the evaluated validation sequences (the train.eval_seed=0 sample) under
    add-one-smoothed train unigram frequencies: the loss of a model that learned token frequencies but no context."""
    train = PackedSequenceDataset(data_dir, "train", seq_length)
    val = PackedSequenceDataset(data_dir, "val", seq_length)
    counts = np.ones(1024)
    for index in range(len(train)):
        np.add.at(counts, train.sample(index)[1:], 1)
    evaluated = validation_sample(len(val), eval_samples, seed=0)
    targets = np.concatenate([val.sample(int(index))[1:] for index in evaluated])
    return float(-np.log(counts[targets] / counts.sum()).mean())


@pytest.mark.slow
def test_validation_loss_falls_on_real_text(trained_run: Path, small_dataset: Path):
    training, validation = read_metrics(trained_run)
    assert sorted(validation) == [0, 100, 200]
    assert abs(validation[0] - math.log(1024)) < 0.3, "an untrained model should be near uniform"
    assert validation[0] > validation[100] > validation[200]
    assert validation[200] < unigram_cross_entropy(small_dataset, 64, 16) - 0.15, "no better than unigram statistics"
    record = training[200]
    assert {"loss", "lr", "tokens", "tokens_per_s", "grad_norm", "step_time_s", "data_wait_fraction"} <= set(record)
    assert 0 <= record["data_wait_fraction"] < 1
    assert record["tokens"] == 200 * 8 * 64
    assert record["lr"] < training[10]["lr"], "cosine decay"


@pytest.mark.slow
def test_checkpoints_are_published_and_pruned(trained_run: Path):
    checkpoints = trained_run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000200"]
    assert (checkpoints / "latest").read_text() == "step_00000200"
    assert not list(checkpoints.glob(".staging-*"))


@pytest.mark.slow
def test_wandb_offline_run_is_written(trained_run: Path):
    runs = list((trained_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "the offline run has no data file"


@pytest.mark.slow
def test_generate_samples_text(trained_run: Path):
    text = run_scaletrain("generate", [str(trained_run), "--prompt", "HAMLET.", "--max-new-tokens", "30"])
    assert text.startswith("HAMLET.")
    assert len(text.strip()) > len("HAMLET.")
    again = run_scaletrain("generate", [str(trained_run), "--prompt", "HAMLET.", "--max-new-tokens", "30"])
    assert again == text, "sampling with the same seed must repeat"


def _consolidated_val_loss(rank: int, world_size: int, run_dir: Path) -> float:
    """The consolidated model's loss on each evaluated sequence alone, averaged (each has as many targets)."""
    from scaletrain.checkpoint.format import latest_checkpoint
    from scaletrain.config_loader import load_config
    from scaletrain.generate import load_model
    from scaletrain.run_config import single_process_config
    from scaletrain.train.evaluation import evaluated_indices
    from scaletrain.train.objective import build_objective

    checkpoint = latest_checkpoint(run_dir)
    config = single_process_config(load_config(checkpoint / "config.yaml"))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    model = load_model(config, checkpoint)
    objective = build_objective(config)
    (validation,) = objective.validation_sets
    loader = objective.eval_loader(validation, [[int(index)] for index in evaluated_indices(config, validation)])
    with torch.no_grad():
        losses = [model(batch["tokens"], batch["labels"]) for batch in loader]
    return torch.stack(losses).mean().item()


@pytest.mark.slow
def test_consolidated_weights_reproduce_the_logged_validation_loss(trained_run: Path):
    _, validation = read_metrics(trained_run)
    loss = run_on_ranks(_consolidated_val_loss, 1, trained_run)[0]
    assert abs(loss - validation[200]) < 1e-5


def test_cli_reports_config_errors_without_a_traceback(tmp_path: Path):
    result = subprocess.run(
        [*launcher(1), "train", str(DEMO_CONFIG), "parallel.tensor=3"],
        cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "parallel.tensor=3 does not divide model.num_heads=4" in result.stderr
    assert "Traceback" not in result.stderr


def test_training_on_unprepared_data_names_the_fix(tmp_path: Path):
    result = subprocess.run(
        [*launcher(1), "train", str(DEMO_CONFIG), f"data.dir={tmp_path / 'nothing'}",
         f"run.dir={tmp_path / 'run'}", "tracking.wandb=disabled"],
        cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "scaletrain prepare" in result.stderr
    assert not (tmp_path / "run").exists(), "a failed start must not leave a run directory behind"
