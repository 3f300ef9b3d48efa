"""The evaluated prefix of a validation split (train/evaluation.py, Objective.eval_loader): fixed order,
sliced by data-parallel rank, a whole number of evaluation steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scaletrain.config import ConfigError
from scaletrain.config_loader import config_from_dict
from scaletrain.train.evaluation import evaluation_samples
from scaletrain.train.objective import build_objective


def test_the_prefix_is_fixed_order_sliced_by_rank_in_whole_steps(small_dataset: Path) -> None:
    config = config_from_dict({"data": {"dir": str(small_dataset), "vocab_size": 1024, "num_sentinels": 16},
                               "model": {"seq_length": 128}, "train": {"micro_batch_size": 2, "eval_samples": 11}})
    objective = build_objective(config)
    (validation,) = objective.validation_sets
    num_samples = evaluation_samples(config, validation, data_parallel_size=2)
    assert num_samples == 8  # 11 rounded down to whole evaluation steps of 2 x 2
    rank_batches = [list(objective.eval_loader(validation, rank, 2, num_samples)) for rank in range(2)]
    order = [index for step in zip(*rank_batches, strict=True) for batch in step
             for index in batch["global_index"].tolist()]
    assert order == list(range(8))
    whole_split = dataclasses.replace(config, train=dataclasses.replace(config.train, eval_samples=10**6))
    assert evaluation_samples(whole_split, validation, data_parallel_size=1) == validation.num_samples // 2 * 2


def test_a_split_smaller_than_one_step_names_the_fix(small_dataset: Path) -> None:
    config = config_from_dict({"data": {"dir": str(small_dataset), "vocab_size": 1024, "num_sentinels": 16},
                               "model": {"seq_length": 128}, "train": {"micro_batch_size": 10**6}})
    (validation,) = build_objective(config).validation_sets
    with pytest.raises(ConfigError, match="fewer than one evaluation step.*raise data.val_fraction"):
        evaluation_samples(config, validation, data_parallel_size=1)
