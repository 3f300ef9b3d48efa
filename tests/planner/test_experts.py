"""The planner under expert parallelism: Mixtral 8x7B's memory per GPU by hand, the all-to-all term,
and the layout search offering EP to MoE models only, never with ZeRO-3."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from scaletrain.config_loader import load_config
from scaletrain.families import model_counts
from scaletrain.planner.activations import ActivationSettings
from scaletrain.planner.layouts import Candidate, layout_settings
from scaletrain.planner.memory import MIXED_BF16, stage_memory
from scaletrain.planner.params import expert_parameters, total_parameters
from scaletrain.planner.report import format_plan
from scaletrain.planner.search import plan
from scaletrain.planner.step_time import Hardware, predict_step_time

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
# Mixtral 8x7B's tensors (configs/mixtral_8x7b.yaml): 32 layers, h 4096, 8 kv heads of 128, 8 SwiGLU
# experts of 14336 per layer, an untied 32000-row vocabulary.
LAYERS, HIDDEN, KV, FFN, EXPERTS, VOCAB = 32, 4096, 1024, 14336, 8, 32000
EXPERT_WEIGHTS = LAYERS * EXPERTS * 3 * HIDDEN * FFN
DENSE_MATRICES = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + EXPERTS * HIDDEN) + 2 * VOCAB * HIDDEN
NORMS = LAYERS * 2 * HIDDEN + HIDDEN


@pytest.fixture(scope="module")
def mixtral():
    return load_config(REPO / "configs" / "mixtral_8x7b.yaml")


@pytest.fixture(scope="module")
def mixtral_plan(mixtral):
    return plan(mixtral, gpus=64, gpu_memory=80 * GIB, hardware=Hardware(989e12))


def test_mixtral_experts_are_counted_apart(mixtral):
    assert expert_parameters(mixtral) == EXPERT_WEIGHTS
    assert total_parameters(mixtral) == EXPERT_WEIGHTS + DENSE_MATRICES + NORMS == 46_702_792_704
    assert model_counts(mixtral).active_params == EXPERT_WEIGHTS // 4 + DENSE_MATRICES + NORMS


def test_ep8_on_8_gpus_holds_an_eighth_of_the_experts(mixtral):
    """ZeRO-1, DP = EP = 8: dense optimizer state over 8 ranks, the experts' over DP/EP = 1 (each expert
    lives on one rank only), bf16 weights and gradients of the dense weights and 1/8 of the experts."""
    layout = Candidate(tensor=1, pipeline=1, data=8, zero_stage=1, micro_batch=1, recompute=True, expert=8)
    memory = stage_memory(mixtral, layout, 0, 128, MIXED_BF16, ActivationSettings())
    on_rank = DENSE_MATRICES + NORMS + EXPERT_WEIGHTS // 8
    assert memory.weights == memory.gradients == 2 * on_rank

    def partition(numel: int, ranks: int) -> int:  # DeepSpeed pads a flat group to 2 * ranks elements
        return math.ceil(numel / (2 * ranks)) * 2

    groups = [partition(DENSE_MATRICES, 8), partition(NORMS, 8), partition(EXPERT_WEIGHTS // 8, 1)]
    assert memory.optimizer == sum(12 * numel + 4 for numel in groups)
    zero_2 = stage_memory(mixtral, Candidate(data=8, zero_stage=2, recompute=True, expert=8), 0, 128, MIXED_BF16,
                          ActivationSettings())
    assert zero_2.gradients == 2 * (math.ceil((DENSE_MATRICES + NORMS) / 8) + EXPERT_WEIGHTS // 8)


def test_expert_state_partitions_over_the_expert_data_parallel_ranks(mixtral):
    """DP 32, EP 4: 2 experts per layer on a rank, their optimizer state over the 8 ranks holding them."""
    layout = Candidate(tensor=2, pipeline=1, data=32, zero_stage=1, micro_batch=1, recompute=True, expert=4)
    memory = stage_memory(mixtral, layout, 0, 32, MIXED_BF16, ActivationSettings())
    experts_on_rank = EXPERT_WEIGHTS // 4 // 2  # EP 4, then TP 2 splits every expert matrix
    router = LAYERS * EXPERTS * HIDDEN  # replicated over TP, like the norms
    dense_on_rank = (DENSE_MATRICES - router) // 2 + router  # attention and both vocabulary tables split
    assert memory.weights == 2 * (dense_on_rank + NORMS + experts_on_rank)
    assert memory.optimizer == 12 * (math.ceil(dense_on_rank / 64) * 2 + math.ceil(NORMS / 64) * 2
                                     + math.ceil(experts_on_rank / 16) * 2) + 3 * 4
    no_ep = stage_memory(mixtral, Candidate(tensor=2, data=32, zero_stage=1, recompute=True), 0, 32, MIXED_BF16,
                         ActivationSettings())
    assert no_ep.weights - memory.weights == 2 * (EXPERT_WEIGHTS // 2 - experts_on_rank)


def test_all_to_all_time_is_four_per_moe_layer(mixtral):
    """Per micro-batch, 4 all-to-alls per MoE layer (6 recomputing) of top_k*s*b*h bf16 activations, (EP-1)/EP
    of them over NVLink within a node."""
    hardware = Hardware(989e12)
    for recompute, per_layer in ((False, 4), (True, 6)):
        layout = Candidate(data=8, zero_stage=1, grad_accum=64 // 8, recompute=recompute, expert=8)
        time = predict_step_time(mixtral, layout, hardware, 2, 2)
        dispatched = 2 * 4096 * HIDDEN * 2
        assert time.expert_parallel == pytest.approx(8 * LAYERS * per_layer * 7 / 8 * dispatched / 360e9, rel=1e-12)
    dense = Candidate(data=8, zero_stage=1, grad_accum=64 // 8)
    assert predict_step_time(mixtral, dense, hardware, 2, 2).expert_parallel == 0


def test_plan_offers_expert_parallelism_for_moe_never_with_zero_3(mixtral_plan):
    layouts = [planned.layout for planned in mixtral_plan.layouts]
    assert {layout.expert for layout in layouts} == {1, 2, 4, 8}
    assert all(layout.data % layout.expert == 0 and EXPERTS % layout.expert == 0 for layout in layouts)
    assert not [layout for layout in layouts if layout.expert > 1 and layout.zero_stage == 3]
    # bf16 (plan's default): no ZeRO-0 beside EP either, which the engine refuses (its clipping norm)
    assert not [layout for layout in layouts if layout.expert > 1 and layout.zero_stage == 0]
    assert any(layout.expert > 1 and layout.zero_stage in (1, 2) for layout in layouts)
    assert any(layout.zero_stage == 3 for layout in layouts)  # offered without EP
    fastest = mixtral_plan.feasible[0].layout
    assert fastest.expert > 1  # holding 1/EP of the experts beats model parallelism for Mixtral on 64 GPUs
    assert layout_settings(mixtral_plan.config, fastest)["parallel.expert"] == fastest.expert
    report = format_plan(mixtral_plan, "configs/mixtral_8x7b.yaml", top=3)
    assert " EP ZeRO " in report and "    a2a " in report
    assert "active parameters per token: 12,879,925,248" in report
    assert "from the 12.88 B active parameters" in report
    assert "parallel.expert=" in report.split("chosen layout:")[1]


def test_plan_never_offers_expert_parallelism_for_dense_models():
    dense = plan(load_config(REPO / "configs" / "gpt3_125m.yaml"), 8, 80 * GIB, Hardware(989e12))
    assert {planned.layout.expert for planned in dense.layouts} == {1}
    assert all(planned.step_time.expert_parallel == 0 for planned in dense.layouts)
    report = format_plan(dense, "configs/gpt3_125m.yaml", top=3)
    assert "parallel.expert" not in report and " EP " not in report and "a2a" not in report
