"""The planner's parameter counts equal what our real models (and GPT's pipeline stages) allocate."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.config_loader import config_from_dict, load_config
from scaletrain.families import model_counts
from scaletrain.planner.params import model_parameters, num_blocks, stage_parameters, total_parameters
from tests.distributed.harness import run_on_ranks
from tests.planner.measure import ACTIVATION_MODEL, PARAMETER_CONFIGS, PIPELINE_MODEL, case_config

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
    copy = (config.padded_vocab_size + model.seq_length) * model.hidden_size  # word and position tables
    for pipeline in (2, 4, 8):
        stages = sum(stage_parameters(config, 1, pipeline, stage).total for stage in range(pipeline))
        assert stages == total_parameters(config) + copy


def test_tensor_parallel_shards_add_up_except_replicated_vectors():
    config = load_config(REPO / "configs" / "gpt3_1.3b.yaml")
    single, sharded = stage_parameters(config, 1, 1, 0), stage_parameters(config, 8, 1, 0)
    positions = config.model.seq_length * config.model.hidden_size
    assert sharded.matrices * 8 == single.matrices + 7 * positions
    assert sharded.vectors > single.vectors / 8  # LayerNorms and row-parallel biases are replicated


def test_gpt3_175b_has_175b_parameters():
    total = total_parameters(load_config(REPO / "configs" / "gpt3_175b.yaml"))
    assert 174.6e9 <= total <= 175.2e9


FAMILY_CONFIGS = ("bert_tiny", "llama_tiny", "t5_tiny")  # llama_tiny: 4 query heads sharing 2 kv heads


def _family_config(name: str, tensor: int = 1):
    return load_config(REPO / "configs" / f"{name}.yaml", [f"parallel.tensor={tensor}"])


def _count_family_models(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    """Each family's real model at TP=2 (run_on_ranks started torch.distributed): this rank's parameters."""
    from megatron.core import parallel_state

    from scaletrain.families import build_model

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    counts = {}
    for name in FAMILY_CONFIGS:
        params = list(build_model(_family_config(name, world_size)).parameters())
        counts[name] = {
            "matrices": sum(p.numel() for p in params if p.dim() >= 2),
            "vectors": sum(p.numel() for p in params if p.dim() < 2),
            "tensors": len(params),
        }
    parallel_state.destroy_model_parallel()
    return counts


@pytest.mark.slow
def test_family_counts_equal_real_models_at_tensor_parallel_2():
    """BERT, Llama (GQA) and T5 (encoder and decoder stacks) rank by rank, as the planner counts them."""
    for measured in run_on_ranks(_count_family_models, 2):
        for name in FAMILY_CONFIGS:
            predicted = stage_parameters(_family_config(name), 2, 1, 0)
            assert (predicted.matrices, predicted.vectors, predicted.tensors) == tuple(measured[name].values()), name


@pytest.mark.parametrize("name", [*FAMILY_CONFIGS, "gpt_tiny", "t5_base", "llama2_7b", "llama3_8b"])
def test_total_equals_the_family_count(name):
    config = _family_config(name)
    assert total_parameters(config) == model_counts(config).total_params


def test_known_model_sizes():
    assert total_parameters(_family_config("llama2_7b")) == 6_738_415_616
    assert total_parameters(_family_config("llama3_8b")) == 8_030_261_248
    assert 220e6 < total_parameters(_family_config("t5_base")) < 225e6


def test_t5_stages_share_the_embedding_they_hold():
    """T5 pipelines encoder then decoder blocks (3 + 3 in t5_tiny, whose output layer is untied). At
    PP=2 the decoder's tied embedding follows the encoder onto stage 0, which holds the shared table:
    no copy, the stages add up to the model. At PP=3 it lands on stage 1 (encoder block 2, decoder
    block 0), which builds a copy of the table."""
    config = _family_config("t5_tiny")
    assert num_blocks(config) == config.model.num_layers + config.model.num_decoder_layers  # encoder, decoder
    table = config.padded_vocab_size * config.model.hidden_size
    for pipeline, copies in ((2, 0), (3, 1)):
        stages = sum(stage_parameters(config, 1, pipeline, stage).total for stage in range(pipeline))
        assert stages == total_parameters(config) + copies * table


def test_untied_output_layer_is_not_copied_and_stages_add_up():
    config = _family_config("llama_tiny")
    layers = model_parameters(config).layers
    assert all(layer.tied_to is None for layer in layers)
    assert sum(stage_parameters(config, 1, 2, stage).total for stage in range(2)) == total_parameters(config)
