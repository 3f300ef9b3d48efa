"""Document masking, per-document positions and sliding windows train the single-rank model in TP, PP,
sequence-parallel and ZeRO layouts and resume exactly (test_layouts.py's protocol: 20 steps straight vs
10 + resume + 10, global batch 8, losses within 1e-4 of one rank).

The shared test dataset packs whole plays, so a 32-token sequence almost never holds a document boundary;
these runs train on the same works cut into two-line documents (one .jsonl line each, tokenized with the
shared dataset's tokenizer), so nearly every sequence holds a document start and the masks change the losses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.prepare import prepare_dataset
from tests.conftest import SMALL_DATASET_SETTINGS
from tests.train.runs import DEMO_CONFIG, REPO, TrainedAhead, read_metrics, run_scaletrain, tiny_overrides
from tests.train.test_layouts import (
    assert_matches_single_rank,
    assert_resume_is_exact,
    cached_runs_by_model,
    in_asking_order,
)

LINES_PER_DOCUMENT = 2  # about 20 tokens: most 32-token sequences hold one or two document starts
LONG_SEQUENCE_OPTIONS = ["model.document_masking=true", "model.document_positions=true"]
CONFIGS = {
    "gpt": (DEMO_CONFIG, [*LONG_SEQUENCE_OPTIONS, "model.sliding_window=8"]),
    "llama": (REPO / "configs" / "llama_tiny.yaml", [*LONG_SEQUENCE_OPTIONS, "model.sliding_window=8",
                                                     "model.num_layers=2", "model.ffn_hidden_size=176"]),
    "gpt_prefix_lm": (DEMO_CONFIG, [*LONG_SEQUENCE_OPTIONS, "objective.kind=prefix_lm"]),
}
CASES = [
    ("llama", "tp2"), ("llama", "pp2"), ("llama", "dp2_zero3"), ("llama", "tp2_sequence_parallel"),
    ("gpt", "tp2_pp2"), ("gpt", "dp2_zero1"), ("gpt_prefix_lm", "pp2"),
]


@pytest.fixture(scope="module")
def short_documents(small_dataset: Path, small_dataset_raw: list[Path], tmp_path_factory: pytest.TempPathFactory
                    ) -> Path:
    """The small dataset's works cut into documents of LINES_PER_DOCUMENT lines, its tokenizer reused."""
    raw = tmp_path_factory.mktemp("short_documents_raw") / "documents.jsonl"
    with raw.open("w") as out:
        for work in small_dataset_raw:
            lines = [line.strip() for line in work.read_text().splitlines() if line.strip()]
            for first in range(0, len(lines), LINES_PER_DOCUMENT):
                out.write(json.dumps({"text": "\n".join(lines[first:first + LINES_PER_DOCUMENT])}) + "\n")
    data_dir = tmp_path_factory.mktemp("short_documents") / "data"
    prepare_dataset([raw], data_dir, **SMALL_DATASET_SETTINGS, tokenizer_file=small_dataset / "tokenizer.model")
    return data_dir


@pytest.fixture(scope="module")
def runs(short_documents: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    trained = cached_runs_by_model(short_documents, tmp_path_factory, CONFIGS, order=in_asking_order(CASES))
    yield trained
    trained.close()


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", CASES)
def test_layout_matches_single_rank_and_resumes_exactly(runs, name: str, layout: str):
    assert_resume_is_exact(runs(name, layout))
    assert_matches_single_rank(runs(name, layout), runs(name, "single"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_single_rank_learns_and_resumes_exactly(runs, name: str):
    reference = runs(name, "single")
    assert_resume_is_exact(reference)
    _, validation = read_metrics(reference.straight)
    assert validation[20] < validation[0] - 0.2, f"{name} validation loss did not fall: {validation}"


def test_nearly_every_training_sequence_holds_a_document_boundary(short_documents: Path):
    packed = PackedSequenceDataset(short_documents, "train", 32)
    crossing = sum(packed.eos_id in packed.sample(index)[:-1] for index in range(packed.num_samples))
    assert crossing / packed.num_samples > 0.8


@pytest.mark.slow
def test_documents_change_the_loss(runs, short_documents: Path, tmp_path: Path):
    """The same first batch without document masking and positions (a prefix LM, so no window either)
    has another loss: the layouts above really attended within documents."""
    config, options = CONFIGS["gpt_prefix_lm"]
    plain = [option for option in options if option not in LONG_SEQUENCE_OPTIONS]
    run_scaletrain("train", [str(config), *tiny_overrides(short_documents, tmp_path), *plain, "train.steps=1",
                             "train.eval_every=1"])
    masked, _ = read_metrics(runs("gpt_prefix_lm", "single").straight)
    unmasked, _ = read_metrics(tmp_path)
    assert abs(masked[1]["loss"] - unmasked[1]["loss"]) > 1e-3
