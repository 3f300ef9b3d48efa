"""The planner's answers: GPT-3 175B on 1024 x 80 GiB GPUs, a small model, and its user errors."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.parallel.layout import resolve_for_world
from scaletrain.planner.activations import ActivationSettings, Recompute
from scaletrain.planner.command import add_plan_arguments, parse_memory_size, plan_from_args, run_plan
from scaletrain.planner.layouts import Candidate, layout_settings
from scaletrain.planner.memory import MIXED_BF16, peak_memory
from scaletrain.planner.params import total_parameters
from scaletrain.planner.report import format_plan, stage_lines
from scaletrain.planner.search import plan
from scaletrain.planner.step_time import Hardware

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
        assert layout.tensor * layout.context * layout.pipeline * layout.data == 1024
        assert layout.tensor * layout.context <= 8 and (layout.context == 1 or layout.pipeline == 1)
        assert layout.model_parallel > 1
        # Bounds that hold whatever activations cost: bf16 weights + gradients (ZeRO-0/1) or
        # weights alone (ZeRO-2) must fit (CP splits no weights); ZeRO-3 needs DP | 1536, so DP <= 512.
        model_parallel = layout.tensor * layout.pipeline
        if layout.zero_stage <= 1:
            assert model_parallel >= 4 * params / plan_175b.memory_budget
        elif layout.zero_stage == 2:
            assert model_parallel >= 2 * params / plan_175b.memory_budget
        else:
            assert layout.model_parallel >= 2
    assert min(p.layout.tensor * p.layout.pipeline for p in feasible if p.layout.zero_stage <= 1) >= 16


def test_175b_megatron_layout_fits(plan_175b):
    """Narayanan et al. 2021 trained 175B with TP 8 x PP 16 (ZeRO-free, recomputing) on 1024 A100-80GB."""
    fitting = {planned.layout for planned in plan_175b.feasible}
    for zero_stage in (1, 0):  # the global batch of 1,536 sequences: 192 micro-batches per pipeline
        assert Candidate(tensor=8, pipeline=16, data=8, zero_stage=zero_stage, micro_batch=1, grad_accum=192,
                         recompute=True) in fitting


def test_175b_without_model_parallelism_needs_more_than_80gib():
    """TP = PP = 1 is also excluded by the batch (1536 is not a multiple of DP = 1024); memory alone rules out
    ZeRO-0/1/2 there: 2 bytes of bf16 weights per parameter are already 325 GiB."""
    config = load_config(GPT3_175B)
    for zero_stage in (0, 1, 2):
        for recompute in (False, True):
            layout = Candidate(data=1024, zero_stage=zero_stage, recompute=recompute)
            _, memory = peak_memory(config, layout, 2, MIXED_BF16, ActivationSettings())
            assert memory.total > 80 * GIB
    assert all(p.layout.model_parallel > 1 for p in plan(
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
    assert first[1:7] == [str(v) for v in (layout.tensor, layout.context, layout.pipeline, layout.data,
                                           layout.zero_stage, layout.micro_batch)]
    assert f"{best.step_time.total:.2f}" in first
    assert len([line for line in lines[header + 1:] if " | " in line]) == 5


def _listed_stages(lines: list[str]) -> list[int]:
    """The stage numbers that `stage N:` and `stages A-B, each:` lines name, in order."""
    stages = []
    for line in lines:
        match = re.match(r"\s*stages? (\d+)(?:-(\d+), each)?: ", line)
        if match:
            stages.extend(range(int(match.group(1)), int(match.group(2) or match.group(1)) + 1))
    return stages


def test_every_pipeline_stage_is_listed(plan_175b):
    """The chosen 175B layout on 1024 GPUs has PP > 2; stage 1 used to be missing (only the first, the
    middle and the last stage were printed). The middle stages hold the same blocks and share a line."""
    pipeline = plan_175b.chosen.layout.pipeline
    assert pipeline > 2
    lines = format_plan(plan_175b, str(GPT3_175B), top=3).splitlines()
    assert _listed_stages(lines) == list(range(pipeline))
    assert any(line.strip().startswith(f"stages 1-{pipeline - 2}, each: ") for line in lines)
    sixteen = stage_lines(plan_175b.config, Candidate(tensor=8, pipeline=16, data=8, zero_stage=1, recompute=True))
    assert len(sixteen) == 3 and _listed_stages(sixteen) == list(range(16))


@pytest.mark.parametrize("config_name, overrides, gpus", [
    ("gpt3_175b.yaml", [], 1024),  # train.global_batch_size set: the line keeps it
    ("gpt_tiny.yaml", ["parallel.data=8"], 8),  # a batch of micro-batch x grad_accum x DP: the line sets grad_accum
])
def test_overrides_line_loads_into_the_chosen_layout(config_name, overrides, gpus):
    config_path = REPO / "configs" / config_name
    report = run_plan(config_path, overrides, gpus, "80GiB", top=3)
    lines = report.splitlines()
    heading = next(index for index, line in enumerate(lines) if line.startswith("chosen layout: #"))
    pasted = lines[heading + 1].split()
    chosen = plan(load_config(config_path, overrides), gpus, 80 * GIB, Hardware(989e12)).chosen.layout
    config = resolve_for_world(load_config(config_path, [*overrides, *pasted]), gpus)
    parallel, train = config.parallel, config.train
    assert (parallel.tensor, parallel.pipeline, parallel.data) == (chosen.tensor, chosen.pipeline, chosen.data)
    assert parallel.zero_stage == chosen.zero_stage or (chosen.data, chosen.pipeline, parallel.zero_stage) == (1, 1, 0)
    global_batch = 1536 if config_name == "gpt3_175b.yaml" else 16 * 8
    assert (train.micro_batch_size, train.grad_accum) == (chosen.micro_batch, chosen.grad_accum)
    assert chosen.global_batch == global_batch  # the global batch the layouts were compared at
    assert train.recompute == Recompute(chosen.recompute).setting
    assert train.full_recompute_interval == (1 if chosen.recompute == Recompute.FULL else 0)
    launch = lines[heading + 3].split()
    assert launch[launch.index(str(config_path)) + 1:] == pasted  # the plan's overrides are all in the line


def test_help_shows_every_default():
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    with_defaults = [action for action in parser._actions
                     if action.option_strings and action.default not in (None, argparse.SUPPRESS)]
    assert {"--device", "--intra-node-gbps", "--inter-node-gbps", "--memory-reserve", "--top"} <= {
        action.option_strings[0] for action in with_defaults}
    for action in with_defaults:
        default = f"{action.default:g}" if isinstance(action.default, (int, float)) else action.default
        assert f"(default: {default})" in action.help, action.option_strings


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
    with pytest.raises(ConfigError, match="--device 'a100' is unknown; use one of h100, h200"):
        run_plan(GPT3_175B, [], 1024, "80GiB", device="a100")
    with pytest.raises(ConfigError, match="--hbm-gbps -1"):
        run_plan(GPT3_175B, [], 1024, "80GiB", hbm_gbps=-1)


def test_a_bare_gpu_memory_number_is_refused():
    """80 read as bytes fits nothing; the error names the flag and both units."""
    with pytest.raises(ConfigError, match=r"--gpu-memory '80' has no unit; use 80GB or 80GiB"):
        parse_memory_size("80")
    with pytest.raises(ConfigError, match=r"use 141GB or 141GiB"):
        run_plan(GPT3_175B, [], 1024, "141")


def test_context_parallelism_divides_activation_memory_and_is_offered():
    """A CP rank keeps 1/CP of each sequence's activations; weights and optimizer state are not split by
    it. The search offers CP for a family that runs it, and its overrides set parallel.context."""
    config = load_config(GPT3_175B)
    alone, split = (peak_memory(config, Candidate(tensor=8, data=16, zero_stage=1, context=context), 12, MIXED_BF16,
                                ActivationSettings())[1] for context in (1, 4))
    assert split.activations == pytest.approx(alone.activations / 4)
    assert (split.weights, split.optimizer) == (alone.weights, alone.optimizer)
    assert layout_settings(config, Candidate(tensor=8, data=16, zero_stage=1, context=4))["parallel.context"] == 4
    small = plan(load_config(REPO / "configs" / "gpt3_125m.yaml"), 8, 80 * GIB, Hardware(989e12))
    assert {planned.layout.context for planned in small.layouts} == {1, 2, 4, 8}
    assert all(planned.layout.pipeline == 1 for planned in small.layouts if planned.layout.context > 1)
