"""A Mixtral-style MoE decoder (configs/mixtral_tiny.yaml, tiny shapes) trains, logs its routing, resumes
bit-identically, and matches the single rank in TP2, DP2 ZeRO-1, DP2 ZeRO-3 and PP2, and with its experts
split over two ranks (parallel.expert=2) alone (ZeRO-0), beside TP2 (ZeRO-1) and over four data-parallel
ranks (ZeRO-2, two ranks per expert). Capacity factor 1.0,
so assignments are dropped: routing and capacity are per micro-batch, which every layout shares with the
single rank (micro-batch 4, two of them per step there); the auxiliary losses train in every stage.

Same protocol as test_layouts.py (20 steps straight vs 10 + resume + 10, global batch 8).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.train.runs import REPO, TrainedAhead, launcher, read_metrics, scaletrain_environment, tiny_overrides
from tests.train.test_layouts import (
    EXPERT_LAYOUTS,
    LAYOUTS,
    STEPS,
    assert_matches_single_rank,
    assert_resume_is_exact,
    cached_runs_by_model,
    in_asking_order,
)

CONFIG = str(REPO / "configs" / "mixtral_tiny.yaml")
# tiny_overrides' 2 layers of hidden 64; 4 experts of width 32, top-2
TINY = ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=32", "model.moe.capacity_factor=1.0",
        "model.moe.aux_loss_coeff=0.05"]
LAYOUT_NAMES = ["tp2", "dp2_zero1", "dp2_zero3", "pp2", "ep2_zero0", "ep2_tp2", "ep2_dp2_zero2", "ep2_pp2"]
# four data-parallel ranks of micro-batch 4 take a global batch of 16; the reference then takes
# the same micro-batches (4 x 4 accumulated), so capacity and the balancing loss see the same tokens
MODELS = {"moe": (CONFIG, TINY), "moe16": (CONFIG, [*TINY, "train.global_batch_size=16"])}


def model_of(layout: str) -> str:
    return "moe16" if layout == "ep2_dp2_zero2" else "moe"


@pytest.fixture(scope="module")
def runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    """runs(model, layout) of the MODELS."""
    trained = cached_runs_by_model(small_dataset, tmp_path_factory, MODELS, layouts=LAYOUTS | EXPERT_LAYOUTS,
                                   order=in_asking_order([("moe", "single"),
                                                          *((model_of(layout), layout) for layout in LAYOUT_NAMES)]))
    yield trained
    trained.close()


def routing_records(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record for record in records if "moe/aux_loss" in record}


@pytest.mark.slow
def test_single_rank_learns_resumes_and_logs_its_routing(runs):
    reference = runs("moe", "single")
    assert_resume_is_exact(reference)
    training, _ = read_metrics(reference.straight)
    assert training[STEPS]["loss"] < training[1]["loss"] - 0.5, "the MoE model did not learn"
    routing = routing_records(reference.straight)
    assert sorted(routing) == list(range(1, STEPS + 1))  # every step's record
    for record in routing.values():
        for layer in (0, 1):
            loads = [record[f"moe/blocks.{layer}/load_{expert}"] for expert in range(4)]
            assert sum(loads) == pytest.approx(1.0)
            assert 0.5 < record[f"moe/blocks.{layer}/aux_loss"] < 4.0  # 1 when balanced, E=4 when collapsed
        assert 0 < record["moe/dropped_fraction"] < 0.5
        assert record["moe/z_loss"] > 0
    records = [json.loads(line) for line in (reference.straight / "metrics.jsonl").read_text().splitlines()]
    evaluations = [record for record in records if "val_loss" in record]
    assert evaluations and not any("moe/aux_loss" in record for record in evaluations)  # evaluation trains nothing


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_resumes_exactly_and_matches_single_rank(runs, layout: str):
    ours = runs(model_of(layout), layout)
    assert_resume_is_exact(ours)
    assert_matches_single_rank(ours, runs(model_of(layout), "single"))
    reference = routing_records(runs(model_of(layout), "single").straight)
    for step, record in routing_records(ours.straight).items():
        assert record["moe/aux_loss"] == pytest.approx(reference[step]["moe/aux_loss"], rel=1e-4), step
        assert record["moe/dropped_fraction"] == pytest.approx(reference[step]["moe/dropped_fraction"], abs=5e-3)


@pytest.mark.slow
def test_bf16_without_zero_is_refused_under_expert_parallelism(small_dataset: Path, tmp_path: Path):
    """DeepSpeed's bf16 optimizer without ZeRO clips with the dense parameters' norm only; the run refuses
    that layout before its first step, naming the fix."""
    result = subprocess.run(
        [*launcher(2), "train", CONFIG, *tiny_overrides(small_dataset, tmp_path), *TINY, "train.steps=2",
         "parallel.expert=2", "parallel.zero_stage=0", "train.precision=bf16"],
        cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "leaves split experts out of the clipping norm; use parallel.zero_stage=1 or 2" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
