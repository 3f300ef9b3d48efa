"""Which validation sequences an evaluation reads and how it averages them (train/evaluation.py,
data/sampler.py): the whole split, or a sample fixed by train.eval_seed alone; every sequence counted
once in any layout; the loss the token-weighted mean, equal to a plain PyTorch loop over the split."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import config_from_dict
from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.sampler import evaluation_micro_batches, validation_sample
from scaletrain.train.evaluation import evaluated_indices
from scaletrain.train.objective import build_objective
from tests.distributed.harness import run_on_ranks

SEQ_LENGTH = 128


def _config(data_dir: Path, **train: object) -> Config:
    return config_from_dict({
        "data": {"dir": str(data_dir), "vocab_size": 1024, "num_sentinels": 16, "loader_workers": 0},
        # init_std 10x GPT-2's: sequences' losses spread 7x wider, so a sequence weighted wrongly shows
        "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": SEQ_LENGTH, "init_std": 0.2},
        "train": train,
    })


def test_a_sample_is_sorted_distinct_and_fixed_by_the_eval_seed_alone(small_dataset: Path) -> None:
    sample = validation_sample(1000, 64, seed=0)
    assert len(sample) == len(set(sample.tolist())) == 64 and np.all(np.diff(sample) > 0) and sample[-1] < 1000
    assert not np.array_equal(sample, np.arange(64)), "a random sample, not the prefix"
    assert np.array_equal(sample, validation_sample(1000, 64, seed=0))
    assert not np.array_equal(sample, validation_sample(1000, 64, seed=1))
    assert set(sample.tolist()) <= set(validation_sample(1000, 128, seed=0).tolist()), "a larger sample holds it"
    assert np.array_equal(validation_sample(1000, 1000, seed=0), np.arange(1000))
    assert np.array_equal(validation_sample(1000, None, seed=5), np.arange(1000))

    # the run's seed and layout do not move it; train.eval_seed does
    config = _config(small_dataset, eval_samples=16, micro_batch_size=3)
    (validation,) = build_objective(config).validation_sets
    chosen = evaluated_indices(config, validation)
    other_run = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=7, micro_batch_size=5))
    assert np.array_equal(evaluated_indices(other_run, validation), chosen)
    other_sample = dataclasses.replace(config, train=dataclasses.replace(config.train, eval_seed=1))
    assert not np.array_equal(evaluated_indices(other_sample, validation), chosen)
    whole = dataclasses.replace(config, train=dataclasses.replace(config.train, eval_samples="all"))
    assert np.array_equal(evaluated_indices(whole, validation), np.arange(validation.num_samples))


@pytest.mark.parametrize(("num_sequences", "micro_batch_size", "data_parallel_size"),
                         [(16, 4, 2), (11, 2, 2), (7, 4, 3), (3, 8, 2), (5, 1, 4)])
def test_every_sequence_is_counted_once_in_micro_batches_of_the_training_shape(
    num_sequences: int, micro_batch_size: int, data_parallel_size: int
) -> None:
    indices = np.arange(100, 100 + num_sequences)
    plan = evaluation_micro_batches(indices, micro_batch_size, data_parallel_size)
    assert len(plan) % data_parallel_size == 0, "every rank runs as many forwards"
    assert all(len(micro_batch.indices) == micro_batch_size for micro_batch in plan)
    counted: dict[int, float] = {}
    for micro_batch in plan:
        for index in micro_batch.indices:
            counted[index] = counted.get(index, 0.0) + micro_batch.share
    assert {index: round(count, 12) for index, count in counted.items() if count} == dict.fromkeys(indices.tolist(), 1)
    # whole micro-batches first, sliced by rank as the training sampler slices (rank r: r, r + dp, ...)
    whole = num_sequences // micro_batch_size
    assert [micro_batch.indices for micro_batch in plan[:whole]] == [
        indices[start:start + micro_batch_size].tolist() for start in range(0, whole * micro_batch_size,
                                                                           micro_batch_size)]


def test_eval_samples_takes_a_number_or_all() -> None:
    assert config_from_dict({"train": {"eval_samples": "all"}}).train.eval_samples == "all"
    assert config_from_dict({}).train.eval_samples == 64 and config_from_dict({}).train.eval_seed == 0
    from scaletrain.config import validate_keys

    with pytest.raises(ConfigError, match="train.eval_samples='most'; use a number .* or all"):
        validate_keys(config_from_dict({"train": {"eval_samples": "most"}}))
    with pytest.raises(ConfigError, match="train.eval_samples=0 must be >= 1"):
        validate_keys(config_from_dict({"train": {"eval_samples": 0}}))
    with pytest.raises(ConfigError, match="train.eval_seed=-1 must be >= 0"):
        validate_keys(config_from_dict({"train": {"eval_seed": -1}}))


def _whole_split_losses(rank: int, world_size: int, data_dir: Path, micro_batch_size: int) -> dict[str, float]:
    """The evaluation's metrics over the whole split on `world_size` data-parallel ranks, and on the
    first rank the same model's token-weighted loss over every sequence, one at a time, in plain PyTorch."""
    from scaletrain.families import build_model, get_family
    from scaletrain.parallel.groups import init_distributed
    from scaletrain.parallel.layout import resolve_for_world
    from scaletrain.train.evaluation import validation_metrics
    from scaletrain.train.step import model_evaluation_metrics

    config = resolve_for_world(_config(data_dir, eval_samples="all", micro_batch_size=micro_batch_size), world_size)
    topology = init_distributed(config)
    torch.manual_seed(0)
    model = build_model(config).eval()
    family = get_family(config.model.family)
    metrics = validation_metrics(lambda batches: model_evaluation_metrics(model, model, batches, family),
                                 build_objective(config), topology)
    if rank == 0:
        split = PackedSequenceDataset(data_dir, "val", SEQ_LENGTH)
        loss_sum, tokens = 0.0, 0
        with torch.no_grad():
            for index in range(split.num_samples):
                sequence = torch.as_tensor(split.sample(index), dtype=torch.long)
                logits = model(sequence[None, :-1])[0].float()  # [seq, vocab]: labels=None gives the logits
                loss_sum += float(F.cross_entropy(logits, sequence[1:], reduction="sum", ignore_index=-100).double())
                tokens += SEQ_LENGTH
        metrics["direct_loss"], metrics["direct_tokens"] = loss_sum / tokens, tokens
    return metrics


@pytest.mark.slow  # two forwards over a ~100-sequence split on one rank, then on two (~20 s on 2 cores)
def test_the_whole_split_evaluation_equals_a_direct_computation_on_one_and_two_ranks(small_dataset: Path) -> None:
    num_sequences = PackedSequenceDataset(small_dataset, "val", SEQ_LENGTH).num_samples
    # a micro-batch size that leaves sequences past the last whole micro-batch, and uneven ranks at DP2
    micro_batch_size = next(size for size in range(3, 12)
                            if num_sequences % size and (num_sequences // size + num_sequences % size) % 2)
    single = run_on_ranks(_whole_split_losses, 1, small_dataset, micro_batch_size)[0]
    pair = run_on_ranks(_whole_split_losses, 2, small_dataset, micro_batch_size)
    direct = single["direct_loss"]
    assert math.isfinite(direct) and direct > 1.0
    for metrics in (single, *pair):
        assert metrics["val_loss"] == pytest.approx(direct, rel=1e-6)
        assert metrics["val_sequences"] == metrics["val_split_sequences"] == num_sequences
        assert metrics["val_tokens"] == metrics["val_split_tokens"] == single["direct_tokens"]
    assert pair[0]["val_loss"] == pair[1]["val_loss"]
