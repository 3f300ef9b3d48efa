"""Context parallelism trains the single-rank model on a long sequence and resumes exactly (test_layouts.py's
protocol: 20 steps straight vs 10 + resume + 10, global batch 8, losses within 1e-4 of one rank).

Sequences of 256 tokens, each split over the context-parallel ranks in 2·CP zigzag chunks, attention by
ring attention (parallel/context_parallel.py); alone (CP2), with tensor parallelism (TP2 x CP2) and with
ZeRO data parallelism (CP2 x DP2). Llama runs with grouped-query attention, document masking and
positions and a sliding window, which the ring applies by global position.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.train.runs import DEMO_CONFIG, REPO, TrainedAhead
from tests.train.test_layouts import (
    assert_matches_single_rank,
    assert_resume_is_exact,
    cached_runs_by_model,
    in_asking_order,
)

LONG_SEQUENCE = ["model.seq_length=256", "train.eval_samples=8"]
CONFIGS = {
    "gpt": (DEMO_CONFIG, LONG_SEQUENCE),
    "llama": (REPO / "configs" / "llama_tiny.yaml", [
        *LONG_SEQUENCE, "model.num_layers=2", "model.ffn_hidden_size=176", "model.num_kv_heads=2",
        "model.document_masking=true", "model.document_positions=true", "model.sliding_window=96"]),
}
CONTEXT_LAYOUTS = {
    "cp2": (2, ["parallel.context=2"]),
    "tp2_cp2": (4, ["parallel.tensor=2", "parallel.context=2"]),
    "cp2_dp2_zero1": (4, ["parallel.context=2", "parallel.zero_stage=1"]),
}
CASES = [("gpt", "cp2"), ("gpt", "tp2_cp2"), ("gpt", "cp2_dp2_zero1"), ("llama", "cp2")]


@pytest.fixture(scope="module")
def runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    trained = cached_runs_by_model(small_dataset, tmp_path_factory, CONFIGS, "context_", CONTEXT_LAYOUTS,
                                   in_asking_order(CASES))
    yield trained
    trained.close()


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", CASES)
def test_context_parallel_matches_single_rank_and_resumes_exactly(runs, name: str, layout: str):
    assert_resume_is_exact(runs(name, layout))
    assert_matches_single_rank(runs(name, layout), runs(name, "single"))
