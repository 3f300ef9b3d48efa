"""The planner's answers: GPT-3 175B on 1024 x 80 GiB GPUs, a small model, and its user errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scaletrain.config import ConfigError, load_config
from scaletrain.scaling.activations import ActivationSettings
from scaletrain.scaling.layouts import Layout
from scaletrain.scaling.memory import MIXED_BF16, peak_memory
from scaletrain.scaling.params import total_parameters
from scaletrain.scaling.planner import add_plan_arguments, parse_memory_size, plan_from_args, run_plan
from scaletrain.scaling.search import plan
from scaletrain.scaling.step_time import Hardware

REPO = Path(__file__).resolve().parents[2]
GPT3_175B = REPO / "configs" / "gpt3_175b.yaml"
GIB = 2**30


@pytest.fixture(scope="module")
def plan_175b():
    return plan(load_config(GPT3_175B), gpus=1024, gpu_memory=80 * GIB, hardware=Hardware(989e12))


def test_175b_fits_only_with_model_parallelism(plan_175b):
    feasible = plan_175b.feasible
    assert feasible
    params = total_parameters(plan_175b.config)
    for planned in feasible:
        layout = planned.layout
        assert layout.tensor <= 8 and 96 % layout.tensor == 0 and 96 % layout.pipeline == 0
        assert layout.tensor * layout.pipeline * layout.data == 1024
        assert (layout.tensor, layout.pipeline) != (1, 1)
        # Bounds that hold whatever activations cost: bf16 weights + gradients (ZeRO-0/1) or
        # weights alone (ZeRO-2) must fit; ZeRO-3 needs DP | 1536, so DP <= 512.
        model_parallel = layout.tensor * layout.pipeline
        if layout.zero_stage <= 1:
            assert model_parallel >= 4 * params / plan_175b.memory_budget
        elif layout.zero_stage == 2:
            assert model_parallel >= 2 * params / plan_175b.memory_budget
        else:
            assert model_parallel >= 2
    assert min(p.layout.tensor * p.layout.pipeline for p in feasible if p.layout.zero_stage <= 1) >= 16


def test_175b_megatron_layout_fits(plan_175b):
    """Narayanan et al. 2021 trained 175B with TP 8 x PP 16 (ZeRO-free, recomputing) on 1024 A100-80GB."""
    fitting = {planned.layout for planned in plan_175b.feasible}
    assert Layout(tensor=8, pipeline=16, data=8, zero_stage=1, micro_batch=1, recompute=True) in fitting
    assert Layout(tensor=8, pipeline=16, data=8, zero_stage=0, micro_batch=1, recompute=True) in fitting


def test_175b_without_model_parallelism_needs_more_than_80gib():
    """TP = PP = 1 is also excluded by the batch (1536 is not a multiple of DP = 1024); memory alone rules out
    ZeRO-0/1/2 there: 2 bytes of bf16 weights per parameter are already 325 GiB."""
    config = load_config(GPT3_175B)
    for zero_stage in (0, 1, 2):
        for recompute in (False, True):
            layout = Layout(1, 1, 1024, zero_stage, 1, recompute)
            _, memory = peak_memory(config, layout, 2, MIXED_BF16, ActivationSettings())
            assert memory.total > 80 * GIB
    assert all((p.layout.tensor, p.layout.pipeline) != (1, 1) for p in plan(
        config, 1024, 80 * GIB, Hardware(989e12)).layouts)


def test_ranking_is_fastest_first_and_report_lists_it(plan_175b):
    times = [planned.step_time.total for planned in plan_175b.feasible]
    assert times == sorted(times)
    report = run_plan(GPT3_175B, [], 1024, "80GiB", 989.0, top=5)
    assert "174,604,836,864" in report
    infeasible = len(plan_175b.layouts) - len(plan_175b.feasible)
    assert f"{infeasible} are infeasible by memory" in report
    lines = report.splitlines()
    header = next(index for index, line in enumerate(lines) if line.lstrip().startswith("#"))
    first = lines[header + 1].split()
    best = plan_175b.feasible[0]
    layout = best.layout
    assert first[1:6] == [str(v) for v in (layout.tensor, layout.pipeline, layout.data, layout.zero_stage,
                                           layout.micro_batch)]
    assert f"{best.step_time.total:.2f}" in first
    assert len([line for line in lines[header + 1:] if " | " in line]) == 5


def test_small_model_prefers_pure_data_parallelism():
    report_plan = plan(load_config(REPO / "configs" / "gpt3_125m.yaml"), 8, 80 * GIB, Hardware(989e12))
    best = report_plan.feasible[0].layout
    assert (best.tensor, best.pipeline, best.data) == (1, 1, 8)


def test_fewer_gpus_cannot_hold_175b():
    result = plan(load_config(GPT3_175B), gpus=8, gpu_memory=80 * GIB, hardware=Hardware(989e12))
    assert not result.feasible
    assert "no layout fits; the smallest ones" in run_plan(GPT3_175B, [], 8, "80GiB")


def test_cli_arguments_reach_the_planner():
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args([str(GPT3_175B), "--gpus", "1024", "--gpu-memory", "80GiB", "--top", "3",
                              "--attention", "math"])
    report = plan_from_args(args)
    assert "5as/(ht)) with the s x s softmax" in report


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * GIB), ("40GB", 40 * 10**9), ("0.5 TiB", 2**39)])
def test_memory_sizes(text, expected):
    assert parse_memory_size(text) == expected


def test_errors_name_the_culprit_and_the_fix():
    with pytest.raises(ConfigError, match=r"--gpu-memory '80 parsecs'.*e\.g\. 80GiB"):
        parse_memory_size("80 parsecs")
    with pytest.raises(ConfigError, match="no layout of 7 GPUs"):
        run_plan(GPT3_175B, [], 7, "80GiB")
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        run_plan(REPO / "configs" / "gpt_tiny.yaml", [], 8, "80GiB")
    with pytest.raises(ConfigError, match="--compute-efficiency 1.5"):
        run_plan(GPT3_175B, [], 1024, "80GiB", compute_efficiency=1.5)
