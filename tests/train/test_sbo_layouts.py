"""BERT with SpanBERT's span boundary objective: trains, resumes exactly, and matches a single rank at
TP2, DP2 ZeRO-3 and PP2 (the span boundaries travel beside the hidden state through the stages).

Same protocol as test_layouts.py (20 steps straight vs 10 + resume + 10, global batch 8).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.train.runs import REPO, TrainedAhead, read_metrics
from tests.train.test_layouts import (
    STEPS,
    assert_matches_single_rank,
    assert_resume_is_exact,
    cached_layout_runs,
)

CONFIG = str(REPO / "configs" / "bert_tiny.yaml")
SPAN_BOUNDARY = ["objective.span_masking=true", "objective.span_boundary=true"]
LAYOUT_NAMES = ["tp2", "dp2_zero3", "pp2"]


@pytest.fixture(scope="module")
def runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    trained = cached_layout_runs(small_dataset, tmp_path_factory, CONFIG, SPAN_BOUNDARY, "sbo",
                                 order=["single", *LAYOUT_NAMES])
    yield trained
    trained.close()


@pytest.mark.slow
def test_single_rank_learns_and_resumes_exactly(runs):
    reference = runs("single")
    assert_resume_is_exact(reference)
    _, validation = read_metrics(reference.straight)
    assert validation[STEPS] < validation[0] - 0.2, f"validation loss (MLM + SBO) did not fall: {validation}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_resumes_exactly_and_matches_single_rank(runs, layout: str):
    ours = runs(layout)
    assert_resume_is_exact(ours)
    assert_matches_single_rank(ours, runs("single"))
