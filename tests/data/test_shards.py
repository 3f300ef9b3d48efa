"""Prepared data: shards + index read back the raw tokenization; manifest totals; splits; atomic prepare."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import webdataset

from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.documents import assign_splits, iter_texts, list_documents, resolve_raw_paths
from scaletrain.data.errors import DataError
from scaletrain.data.prepare import prepare_dataset
from scaletrain.data.shards import SplitIndex
from scaletrain.data.storage import load_manifest
from scaletrain.data.tokenizer import Tokenizer
from tests.conftest import SMALL_DATASET_SETTINGS


def documents_by_split(data_dir: Path) -> dict[str, list[np.ndarray]]:
    """Every document's tokens, per split in index order, read through the byte-offset index."""
    manifest = load_manifest(data_dir)
    return {
        split: [dataset.document_tokens(doc) for doc in range(dataset.num_docs)]
        for split in manifest.splits
        for dataset in [PackedSequenceDataset(data_dir, split, seq_length=1)]
    }


def test_index_reads_back_the_tokenization_of_the_raw_files(small_dataset: Path, small_dataset_raw: list[Path]) -> None:
    tokenizer = Tokenizer.load(small_dataset)
    documents = list_documents(resolve_raw_paths(small_dataset_raw))
    expected = [np.asarray(tokenizer.encode(text)) for text in iter_texts(documents)]
    splits = assign_splits([doc.name for doc in documents], SMALL_DATASET_SETTINGS["val_fraction"],
                           SMALL_DATASET_SETTINGS["seed"])
    read_back = documents_by_split(small_dataset)
    for split, arrays in read_back.items():
        doc_ids = SplitIndex.load(small_dataset / f"{split}.index.npz").doc_ids
        assert [splits[i] for i in doc_ids] == [split] * len(doc_ids)
        for doc_id, tokens in zip(doc_ids, arrays, strict=True):
            np.testing.assert_array_equal(tokens, expected[doc_id])
    everything = np.concatenate([tokens for split in ("train", "val") for tokens in read_back[split]])
    assert len(everything) == sum(len(tokens) for tokens in expected)


def test_plain_webdataset_reads_the_shards(small_dataset: Path) -> None:
    manifest = load_manifest(small_dataset)
    for split, info in manifest.splits.items():
        urls = [str(small_dataset / shard.name) for shard in info.shards]
        samples = list(webdataset.WebDataset(urls, shardshuffle=False).decode())
        doc_ids = SplitIndex.load(small_dataset / info.index_file).doc_ids
        assert [int(sample["__key__"]) for sample in samples] == doc_ids.tolist()
        for sample, tokens in zip(samples, documents_by_split(small_dataset)[split], strict=True):
            assert sample["tokens.npy"].dtype == np.uint16
            np.testing.assert_array_equal(sample["tokens.npy"], tokens)


def test_manifest_totals_match_the_files(small_dataset: Path, small_dataset_raw: list[Path]) -> None:
    manifest = load_manifest(small_dataset)
    assert set(manifest.splits) == {"train", "val"}
    assert sum(info.num_docs for info in manifest.splits.values()) == len(small_dataset_raw)
    assert manifest.vocab_size == 1024 and manifest.token_dtype == "uint16" and manifest.eos_id == 3
    for info in manifest.splits.values():
        assert info.num_docs == sum(shard.num_docs for shard in info.shards)
        assert info.num_tokens == sum(shard.num_tokens for shard in info.shards)
        assert info.num_tokens == int(SplitIndex.load(small_dataset / info.index_file).cum_tokens[-1])
        for shard in info.shards:
            assert (small_dataset / shard.name).stat().st_size == shard.num_bytes
            assert shard.num_tokens <= SMALL_DATASET_SETTINGS["max_tokens_per_shard"] or shard.num_docs == 1
    assert [shard.name for shard in manifest.splits["train"].shards][:2] == ["train-00000.tar", "train-00001.tar"]
    assert any(shard.num_docs > 1 for info in manifest.splits.values() for shard in info.shards)


def test_split_assignment_is_seeded_stable_and_never_empty() -> None:
    names = [f"work_{i}.txt" for i in range(200)]
    splits = assign_splits(names, 0.1, seed=3)
    assert splits == assign_splits(names, 0.1, seed=3)
    assert splits != assign_splits(names, 0.1, seed=4)
    assert 5 <= splits.count("val") <= 40
    assert assign_splits([*names, "new.txt"], 0.1, seed=3)[:200] == splits  # growing the corpus moves nothing
    assert assign_splits(names[:2], 0.001, seed=3).count("val") == 1
    assert "val" not in assign_splits(names, 0.0, seed=3)
    assert sorted(assign_splits(names[:2], 0.99, seed=3)) == ["train", "val"]
    with pytest.raises(DataError, match="1 document.s. cannot make both a train and a val split"):
        assign_splits(names[:1], 0.5, seed=3)


def test_jsonl_lines_are_documents_and_prepare_is_reproducible(small_dataset_raw: list[Path], tmp_path: Path) -> None:
    sonnets = next(p for p in small_dataset_raw if p.name == "sonnets_gut.txt").read_text().split("\n\n\n")
    raw = tmp_path / "raw" / "sonnets.jsonl"
    raw.parent.mkdir()
    raw.write_text("".join(json.dumps({"text": sonnet}) + "\n" for sonnet in sonnets if sonnet.strip()))
    settings = {**SMALL_DATASET_SETTINGS, "vocab_size": 400, "num_sentinels": 8, "max_tokens_per_shard": 5000}
    first = prepare_dataset([tmp_path / "raw"], tmp_path / "a", **settings)
    second = prepare_dataset([str(tmp_path / "raw" / "*.jsonl")], tmp_path / "b", **{**settings, "num_workers": 1})
    assert first == second  # same tokenizer, shards and index checksums, with or without a worker pool
    assert sum(info.num_docs for info in first.splits.values()) == sum(1 for s in sonnets if s.strip())
    assert len(first.splits["train"].shards) > 1


def test_prepare_errors_leave_nothing_behind(small_dataset: Path, small_dataset_raw: list[Path],
                                             tmp_path: Path) -> None:
    with pytest.raises(DataError, match="match no .txt or .jsonl files"):
        prepare_dataset([tmp_path / "nothing-*.txt"], tmp_path / "out", **SMALL_DATASET_SETTINGS)
    with pytest.raises(DataError, match="Lower vocab_size"):  # fails inside the staging dir, after it is made
        prepare_dataset(small_dataset_raw[-2:], tmp_path / "out", **{**SMALL_DATASET_SETTINGS, "vocab_size": 50_000})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="already holds a prepared dataset"):
        prepare_dataset(small_dataset_raw, small_dataset, **SMALL_DATASET_SETTINGS)
    not_a_dataset = tmp_path / "mine"
    not_a_dataset.mkdir()
    (not_a_dataset / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="exists and is not a prepared dataset"):
        prepare_dataset(small_dataset_raw, not_a_dataset, **SMALL_DATASET_SETTINGS, overwrite=True)
