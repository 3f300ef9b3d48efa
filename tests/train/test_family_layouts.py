"""BERT, T5, Llama and the prefix LMs (GPT, T5): train, resume exactly, and match a single rank in TP/ZeRO layouts.

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
    cached_runs_by_model,
)

FAMILIES = {
    "bert": [f"base={REPO / 'configs' / 'bert_tiny.yaml'}"],
    "t5": [f"base={REPO / 'configs' / 't5_tiny.yaml'}", "model.num_decoder_layers=2", "model.ffn_hidden_size=128"],
    "gpt_prefix_lm": ["objective.kind=prefix_lm"],
    "llama": [f"base={REPO / 'configs' / 'llama_tiny.yaml'}", "model.num_layers=2", "model.ffn_hidden_size=176"],
    "t5_prefix_lm": [f"base={REPO / 'configs' / 't5_tiny.yaml'}", "model.num_decoder_layers=2",
                     "model.ffn_hidden_size=128", "objective.kind=prefix_lm"],
}
CASES = [
    ("llama", "tp2"), ("llama", "pp2"), ("llama", "tp2_pp2"), ("llama", "dp2_zero3"), ("llama", "dp2_zero1"),
    ("bert", "tp2"), ("bert", "dp2_zero3"), ("bert", "pp2"), ("bert", "tp2_pp2"), ("t5", "tp2"), ("t5", "dp2_zero3"),
    ("t5", "pp2"), ("t5", "tp2_pp2"), ("t5", "pp2_recompute"), ("t5", "pp2_selective"), ("t5_prefix_lm", "pp2"),
]


def family_overrides(family: str) -> list[str]:
    """train_twice takes overrides; the family's tiny config is chosen through a base file."""
    return [override for override in FAMILIES[family] if not override.startswith("base=")]


def family_config(family: str) -> str:
    bases = [override.removeprefix("base=") for override in FAMILIES[family] if override.startswith("base=")]
    return bases[0] if bases else str(REPO / "configs" / "gpt_tiny.yaml")


@pytest.fixture(scope="module")
def runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    models = {family: (family_config(family), family_overrides(family)) for family in FAMILIES}
    trained = cached_runs_by_model(small_dataset, tmp_path_factory, models,
                                   order=[*((family, "single") for family in sorted(FAMILIES)), *CASES])
    yield trained
    trained.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_single_rank_learns_and_resumes_exactly(runs, family):
    reference = runs(family, "single")
    assert_resume_is_exact(reference)
    _, validation = read_metrics(reference.straight)
    assert validation[STEPS] < validation[0] - 0.2, f"{family} validation loss did not fall: {validation}"


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", CASES)
def test_layout_resumes_exactly_and_matches_single_rank(runs, family, layout):
    ours = runs(family, layout)
    assert_resume_is_exact(ours)
    assert_matches_single_rank(ours, runs(family, "single"))
