"""Recomputation in the planner: selective's bytes and FLOPs, the three-way layouts, and auto's decision."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from scaletrain.config_loader import load_config
from scaletrain.parallel.layout import resolve_for_world
from scaletrain.planner.activations import (
    RECOMPUTE_BY_COST,
    ActivationSettings,
    Recompute,
    block_activations,
    stage_activations,
)
from scaletrain.planner.flops import blocks_forward_flops_per_token, hardware_flops_per_token, model_flops_per_token
from scaletrain.planner.layouts import Candidate, layout_settings
from scaletrain.planner.recompute import decide_recompute, resolve_recompute, run_peak_memory
from scaletrain.planner.report import format_plan
from scaletrain.planner.search import DEFAULT_MEMORY_RESERVE, plan
from scaletrain.planner.step_time import Hardware

REPO = Path(__file__).resolve().parents[2]
KORTHIKANTI = ActivationSettings(activation_bytes=2, dropout_mask_bytes=1, attention="math")
GIB = 2**30


@pytest.fixture(scope="module")
def gpt3_1_3b():
    config = load_config(REPO / "configs" / "gpt3_1.3b.yaml", ["model.dropout=0.1"])
    return config


@pytest.mark.parametrize("tensor_parallel", [1, 8])
def test_selective_keeps_korthikanti_sec_4_3(gpt3_1_3b, tensor_parallel):
    """s*b*h*(10 + 24/t) per block: eq. 2 without the recomputed 5as/(ht); the working set is one core's."""
    model, t = gpt3_1_3b.model, tensor_parallel
    s, b, h = model.seq_length, 2, model.hidden_size
    block = block_activations(model, b, t, KORTHIKANTI)
    stage = stage_activations(model, 50304, b, t, 4, first_stage=False, last_stage=False,
                              recompute=Recompute.SELECTIVE, settings=KORTHIKANTI)
    assert stage.stored == pytest.approx(4 * (s * b * h * (10 + 24 / t) + block.norm_statistics), rel=1e-12)
    assert stage.recompute_working_set == block.attention
    full = stage_activations(model, 50304, b, t, 4, first_stage=False, last_stage=False,
                             recompute=Recompute.FULL, settings=KORTHIKANTI)
    assert full.stored < stage.stored < 4 * block.total


def test_selective_recomputes_the_attention_cores_forward(gpt3_1_3b):
    """4*s*h FLOPs per token and block (QK^T and the weighted values), between none and full."""
    model = gpt3_1_3b.model
    core = 4 * model.seq_length * model.hidden_size * model.num_layers
    selective = hardware_flops_per_token(gpt3_1_3b, Recompute.SELECTIVE)
    assert selective - model_flops_per_token(gpt3_1_3b) == core
    assert hardware_flops_per_token(gpt3_1_3b, Recompute.NONE) < selective < hardware_flops_per_token(
        gpt3_1_3b, Recompute.FULL) == model_flops_per_token(gpt3_1_3b) + blocks_forward_flops_per_token(gpt3_1_3b)


def test_layouts_offer_all_three_and_fastest_first_at_equal_shape():
    config = load_config(REPO / "configs" / "gpt3_350m.yaml", ["train.global_batch_size=16"])
    result = plan(config, 1, 80 * GIB, Hardware(989e12), max_micro_batch=2)
    by_shape: dict[Candidate, list[Recompute]] = {}
    for planned in result.feasible:
        by_shape.setdefault(dataclasses.replace(planned.layout, recompute=Recompute.NONE), []).append(
            planned.layout.recompute)
    assert by_shape and all(order == list(RECOMPUTE_BY_COST) for order in by_shape.values())
    report = format_plan(result, "configs/gpt3_350m.yaml", top=len(result.layouts))
    assert "selective = each block's attention core" in report and " selective |" in report
    assert result.chosen.layout.recompute == Recompute.NONE


@pytest.mark.parametrize("recompute", list(Recompute))
def test_layout_settings_name_the_mode_and_clear_an_interval_it_cannot_take(recompute):
    config = load_config(REPO / "configs" / "gpt3_350m.yaml", ["train.activation_checkpoint_interval=4"])
    settings = layout_settings(config, Candidate(recompute=recompute))
    assert settings["train.activation_checkpoint"] == recompute.setting
    assert settings["train.activation_checkpoint_interval"] == (1 if recompute == Recompute.FULL else 0)
    pasted = [f"{key}={value}" for key, value in settings.items()]
    assert load_config(REPO / "configs" / "gpt3_350m.yaml", pasted).train.recompute == recompute.setting


@pytest.fixture(scope="module")
def gpt3_350m_one_gpu():
    return resolve_for_world(load_config(REPO / "configs" / "gpt3_350m.yaml", ["train.global_batch_size=8",
                                                                              "train.micro_batch_size=8"]), 1)


def test_auto_picks_the_least_recomputation_that_fits(gpt3_350m_one_gpu):
    """At three memory sizes, against plan's estimate of the run's own layout: none, selective, full."""
    peaks = {mode: run_peak_memory(gpt3_350m_one_gpu, mode) for mode in Recompute}
    assert peaks[Recompute.NONE] > peaks[Recompute.SELECTIVE] > peaks[Recompute.FULL]

    def gpu_memory(usable: float) -> int:
        return math.ceil(usable / (1 - DEFAULT_MEMORY_RESERVE))

    cases = {
        Recompute.NONE: gpu_memory(peaks[Recompute.NONE]) + 1,
        Recompute.SELECTIVE: gpu_memory((peaks[Recompute.NONE] + peaks[Recompute.SELECTIVE]) / 2),
        Recompute.FULL: gpu_memory((peaks[Recompute.SELECTIVE] + peaks[Recompute.FULL]) / 2),
    }
    for expected, memory in cases.items():
        decision = decide_recompute(gpt3_350m_one_gpu, memory)
        assert decision.recompute == expected, (expected, memory, decision)
        assert decision.describe().startswith(f"recompute {expected.setting} (auto: plan's estimate none ")
    too_small = decide_recompute(gpt3_350m_one_gpu, gpu_memory(peaks[Recompute.FULL]) // 2)
    assert too_small.recompute == Recompute.FULL and "none fits" in too_small.reason
    assert decide_recompute(gpt3_350m_one_gpu, None).describe() == \
        "recompute none (auto: no GPU memory to fit on a CPU)"


def test_auto_is_replaced_by_its_decision_and_keeps_the_interval_for_full(gpt3_350m_one_gpu):
    config = dataclasses.replace(gpt3_350m_one_gpu, train=dataclasses.replace(
        gpt3_350m_one_gpu.train, activation_checkpoint_interval=2))
    assert config.train.activation_checkpoint == "auto"
    full, decision = resolve_recompute(config, GIB)
    assert (full.train.activation_checkpoint, full.train.full_recompute_interval) == ("full", 2)
    assert decision.recompute == Recompute.FULL
    roomy, _ = resolve_recompute(config, 1000 * GIB)
    assert (roomy.train.activation_checkpoint, roomy.train.activation_checkpoint_interval) == ("none", 0)
    named = dataclasses.replace(config, train=dataclasses.replace(config.train, activation_checkpoint="selective",
                                                                  activation_checkpoint_interval=0))
    assert resolve_recompute(named, GIB) == (named, decide_recompute(named, GIB))
    assert decide_recompute(named, GIB).describe() == "recompute selective"


def test_auto_leaves_out_what_the_config_refuses():
    """ALBERT's shared block in pipeline stages cannot be recomputed fully: selective is the least it keeps."""
    config = resolve_for_world(load_config(REPO / "configs" / "albert_tiny.yaml",
                                           ["parallel.pipeline=2", "train.activation_checkpoint=auto"]), 2)
    decision = decide_recompute(config, 1)
    assert decision.recompute == Recompute.SELECTIVE and "full" not in decision.reason
