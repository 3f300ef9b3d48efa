"""Predicted per-GPU memory vs the real model + DeepSpeed engine on CPU (fp32, gloo).

Weights and optimizer state must match byte for byte, per rank: AdamW's moments and step
counters, and under ZeRO DeepSpeed's fp32 master partitions with their padding. Activations
are the bytes autograd saves for backward in one forward pass (storages deduplicated,
parameters excluded), compared with activations.py in the variant that runs on CPU: fp32
activations, dropout masks as fp32 tensors, SDPA's fused CPU kernel ("flash": only a logsumexp
is kept) when dropout = 0, and the math kernel (s x s softmax, dropout mask and output kept)
when dropout > 0, because the CPU kernel has no dropout. The brief allows 15%; the formula is
held to 2%, so one s*b*h tensor per block missing or extra (about 4% here) fails the test.
"""

from __future__ import annotations

import pytest

from scaletrain.scaling.activations import ActivationSettings, stage_activations
from scaletrain.scaling.memory import FP32, optimizer_state_bytes
from scaletrain.scaling.params import stage_parameters
from tests.scaling.measure import MICRO_BATCH, SINGLE_RANK_CASES, TWO_RANK_CASES, case_config

pytestmark = pytest.mark.slow

ACTIVATION_TOLERANCE = 0.02


def _expected_states(case: tuple, world_size: int, tensor_parallel: int = 1) -> tuple[int, int]:
    config = case_config(*case, world_size)
    params = stage_parameters(config, tensor_parallel, 1, 0)
    optimizer = optimizer_state_bytes(params, config.parallel.zero_stage, config.parallel.data, FP32)
    return FP32.weight_bytes * params.total, optimizer


def _expected_activations(case: tuple, world_size: int, tensor_parallel: int = 1) -> float:
    config = case_config(*case, world_size)
    model = config.model
    settings = ActivationSettings(
        activation_bytes=4, dropout_mask_bytes=4, attention="math" if model.dropout > 0 else "flash"
    )
    return stage_activations(
        model, config.padded_vocab_size, MICRO_BATCH, tensor_parallel, model.num_layers,
        first_stage=True, last_stage=True, recompute=config.train.activation_checkpoint_interval > 0,
        settings=settings,
    ).stored


@pytest.mark.parametrize("case", ["zero0", "zero1", "flash", "math", "recompute"])
def test_single_rank_weights_and_optimizer_state_exact(case, single_rank_measurements):
    weights, optimizer = _expected_states(SINGLE_RANK_CASES[case], 1)
    measured = single_rank_measurements[case]
    assert (measured["weights"], measured["optimizer"]) == (weights, optimizer)


@pytest.mark.parametrize("case", ["dp2_zero1", "dp2_zero2", "tp2"])
def test_two_rank_weights_and_optimizer_state_exact_per_rank(case, two_rank_measurements):
    """DP=2 holds half of the (padded) optimizer state per rank; TP=2 holds its shards of everything."""
    tensor_parallel = 2 if case == "tp2" else 1
    weights, optimizer = _expected_states(TWO_RANK_CASES[case], 2, tensor_parallel)
    for rank in two_rank_measurements:
        assert (rank[case]["weights"], rank[case]["optimizer"]) == (weights, optimizer)


def test_zero1_data_parallel_halves_the_optimizer_state(single_rank_measurements, two_rank_measurements):
    single = single_rank_measurements["zero1"]["optimizer"]
    for rank in two_rank_measurements:
        assert abs(rank["dp2_zero1"]["optimizer"] - single / 2) <= 64  # padding + step counters


def test_gradients_without_zero_are_one_per_weight(single_rank_measurements):
    measured = single_rank_measurements["zero0"]
    assert measured["gradients_after_backward"] == measured["weights"]


@pytest.mark.parametrize("case", ["zero0", "flash", "math", "recompute"])
def test_single_rank_activations(case, single_rank_measurements):
    expected = _expected_activations(SINGLE_RANK_CASES[case], 1)
    measured = single_rank_measurements[case]["activations"]
    assert abs(measured - expected) <= ACTIVATION_TOLERANCE * measured, (case, measured, expected)


def test_tensor_parallel_activations(two_rank_measurements):
    expected = _expected_activations(TWO_RANK_CASES["tp2"], 2, tensor_parallel=2)
    for rank in two_rank_measurements:
        measured = rank["tp2"]["activations"]
        assert abs(measured - expected) <= ACTIVATION_TOLERANCE * measured, (measured, expected)
