"""The local lm-evaluation-harness tasks' data (evaluation/task_data.py): every record is text of the prepared
dataset's held-out split and none of its training split, records are shaped as the task YAMLs under
configs/eval_tasks/ read them, and a seed draws the same records every time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.config import DataConfig
from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.evaluation.task_data import CHOICES, build_task_data, held_out_documents

COUNT = 30


def _records(files: dict[str, Path]) -> dict[str, list[dict]]:
    return {task: [json.loads(line) for line in path.read_text().splitlines()] for task, path in files.items()}


@pytest.fixture(scope="module")
def built(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], Path]:
    out = tmp_path_factory.mktemp("eval_tasks")
    return _records(build_task_data(DataConfig(dir=str(small_dataset)), out, seed=0, count=COUNT)), out


def _training_documents(data_dir: Path) -> list[str]:
    split = PackedSequenceDataset(data_dir, "train", seq_length=1)
    tokenizer = Tokenizer.load(data_dir / "tokenizer.model")
    return [tokenizer.decode(split.document_tokens(index).tolist()) for index in range(split.num_docs)]


def test_every_record_is_held_out_text_and_none_is_training_text(built, small_dataset: Path) -> None:
    records, _ = built
    held_out, training = held_out_documents(DataConfig(dir=str(small_dataset))), _training_documents(small_dataset)
    assert len(held_out) >= 2 and all(len(task_records) == COUNT for task_records in records.values())

    def held_out_only(text: str, document: int) -> bool:
        return text in held_out[document] and not any(text in other for other in training)

    assert all(held_out_only(record["text"], record["document"]) for record in records["passages"])
    for record in records["next_line"]:
        choices, label = record["choices"], record["label"]
        assert len(choices) == CHOICES == len(set(choices)) and 0 <= label < CHOICES
        assert held_out_only(record["context"] + choices[label], record["document"])
        distractors = [choice for index, choice in enumerate(choices) if index != label]
        assert all(any(choice in text for index, text in enumerate(held_out) if index != record["document"])
                   for choice in distractors)  # from the other held-out document
    for record in records["cloze"]:
        assert record["context"].endswith(" ") and record["target"].isalpha()
        assert held_out_only(record["context"] + record["target"], record["document"])


def test_a_seed_draws_the_same_records_and_another_seed_others(built, small_dataset: Path, tmp_path: Path) -> None:
    records, out = built
    again = build_task_data(DataConfig(dir=str(small_dataset)), tmp_path / "again", seed=0, count=COUNT)
    assert all(path.read_bytes() == (out / path.name).read_bytes() for path in again.values())
    other = _records(build_task_data(DataConfig(dir=str(small_dataset)), tmp_path / "other", seed=1, count=COUNT))
    assert all(other[task] != records[task] for task in records)
    provenance = json.loads((out / "tasks.json").read_text())
    assert provenance["split"] == "val" and provenance["seed"] == 0
    assert provenance["records"] == {task: COUNT for task in records}


def test_more_records_than_the_held_out_split_holds_is_one_error(small_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="the held-out split has .* passages, fewer than the 100000 asked for"):
        build_task_data(DataConfig(dir=str(small_dataset)), tmp_path, count=100_000)
