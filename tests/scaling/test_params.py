"""The planner's parameter counts equal what our real GPT (and its pipeline stages) allocate."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.config import config_from_dict, load_config
from scaletrain.scaling.params import (
    position_embedding_parameters,
    stage_parameters,
    total_parameters,
    word_embedding_parameters,
)
from tests.scaling.measure import ACTIVATION_MODEL, PARAMETER_CONFIGS, PIPELINE_MODEL, case_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARAMETER_CONFIGS))
def test_count_equals_real_model(name, single_rank_measurements):
    measured = single_rank_measurements["parameters"][name]
    predicted = stage_parameters(config_from_dict(PARAMETER_CONFIGS[name]), 1, 1, 0)
    assert predicted.total == total_parameters(config_from_dict(PARAMETER_CONFIGS[name]))
    assert (predicted.total, predicted.matrices, predicted.vectors, predicted.tensors) == (
        measured["total"], measured["matrices"], measured["vectors"], measured["tensors"]
    )


@pytest.mark.slow
def test_per_rank_count_at_tensor_parallel_2(two_rank_measurements):
    """Split QKV/fc/vocab shards, replicated LayerNorms and row-parallel biases, rank by rank (fp32)."""
    predicted = stage_parameters(case_config(ACTIVATION_MODEL, {"tensor": 2}, {}, 2), 2, 1, 0)
    for rank in two_rank_measurements:
        assert rank["tp2"]["weights"] == 4 * predicted.total


@pytest.mark.slow
def test_pipeline_stage_counts_equal_real_pipeline_module(two_rank_measurements):
    """Stage 0: embedding + blocks; stage 1: blocks + final LayerNorm + the tied output layer's module."""
    config = case_config(PIPELINE_MODEL, {"pipeline": 2}, {}, 2)
    for rank in two_rank_measurements:
        measured = rank["pp2"]
        assert "error" not in measured, measured.get("error")
        assert measured["parameters"] == stage_parameters(config, 1, 2, measured["stage"]).total


def test_stages_add_up_to_the_model_plus_the_output_copy():
    config = load_config(REPO / "configs" / "gpt3_1.3b.yaml")
    model = config.model
    copy = word_embedding_parameters(config.padded_vocab_size, model.hidden_size, 1).total
    copy += position_embedding_parameters(model).total
    for pipeline in (2, 4, 8):
        stages = sum(stage_parameters(config, 1, pipeline, stage).total for stage in range(pipeline))
        assert stages == total_parameters(config) + copy


def test_tensor_parallel_shards_add_up_except_replicated_vectors():
    config = load_config(REPO / "configs" / "gpt3_1.3b.yaml")
    single, sharded = stage_parameters(config, 1, 1, 0), stage_parameters(config, 8, 1, 0)
    assert sharded.matrices * 8 == single.matrices + 7 * position_embedding_parameters(config.model).total
    assert sharded.vectors > single.vectors / 8  # LayerNorms and row-parallel biases are replicated


def test_gpt3_175b_has_175b_parameters():
    total = total_parameters(load_config(REPO / "configs" / "gpt3_175b.yaml"))
    assert 174.6e9 <= total <= 175.2e9
