"""prepare at corpus scale: exact dedup, a reused tokenizer, a sampled tokenizer training, threaded tokenization."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.data import prepare
from scaletrain.data.dedup import find_exact_duplicates, normalise_for_dedup
from scaletrain.data.documents import iter_texts, list_documents
from scaletrain.data.errors import DataError
from scaletrain.data.prepare import prepare_dataset, tokenize_texts
from scaletrain.data.tokenizer import Tokenizer, tokenizer_training_lines, train_tokenizer
from tests.conftest import SMALL_DATASET_SETTINGS
from tests.data.test_shards import documents_by_split

# A small vocabulary on three short works keeps each prepare to about a second.
TINY_SETTINGS = {**SMALL_DATASET_SETTINGS, "vocab_size": 400, "num_sentinels": 8, "val_fraction": 0.2}
GPT_TINY = Path(__file__).resolve().parents[2] / "configs" / "gpt_tiny.yaml"
TINY_WORKS = ("sonnets_gut.txt", "phoenix_and_the_turtle_gut.txt", "julius_caesar_gut.txt")


@pytest.fixture
def raw_dir(small_dataset_raw: list[Path], tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    for path in small_dataset_raw:
        if path.name in TINY_WORKS:
            shutil.copy(path, raw / path.name)
    return raw


def all_documents(data_dir: Path) -> list[np.ndarray]:
    return [tokens for arrays in documents_by_split(data_dir).values() for tokens in arrays]


def test_normalisation_undoes_encoding_accidents_only() -> None:
    assert normalise_for_dedup("  The ﬁrst\r\nＬＩＮＥ\t of  it \n") == "the first line of it"
    texts = ["To be, or not to be", "TO BE,  or not\nto be\n", "To be, or not to be!", "To be, or not to bee", ""]
    assert find_exact_duplicates(texts) == [False, True, False, False, False]
    assert find_exact_duplicates(["Act 1", "Act 2", "act 1", " \n", ""]) == [False, False, True, False, True]


def test_dedup_drops_later_copies_and_counts_them(raw_dir: Path, tmp_path: Path) -> None:
    phoenix = (raw_dir / "phoenix_and_the_turtle_gut.txt").read_text()
    (raw_dir / "zz_phoenix_copy.txt").write_text(phoenix.upper().replace("\n", "  \r\n"))  # same text, mangled
    (raw_dir / "zz_phoenix_edited.txt").write_text(phoenix.replace("turtle", "dove"))  # a different text
    manifest = prepare_dataset([raw_dir], tmp_path / "data", **TINY_SETTINGS)
    assert manifest.settings["dedup"] is True and manifest.settings["duplicates_dropped"] == 1
    assert sum(split.num_docs for split in manifest.splits.values()) == len(TINY_WORKS) + 1
    tokenizer = Tokenizer.load(tmp_path / "data")
    stored = [tokens.tolist() for tokens in all_documents(tmp_path / "data")]
    assert stored.count(tokenizer.encode(phoenix)) == 1  # the first occurrence is kept
    assert tokenizer.encode((raw_dir / "zz_phoenix_copy.txt").read_text()) not in stored
    assert tokenizer.encode((raw_dir / "zz_phoenix_edited.txt").read_text()) in stored

    kept_all = prepare_dataset([raw_dir], tmp_path / "all", **TINY_SETTINGS, dedup=False)
    assert kept_all.settings["duplicates_dropped"] is None
    assert sum(split.num_docs for split in kept_all.splits.values()) == len(TINY_WORKS) + 2


def test_reused_tokenizer_gives_the_same_ids_and_checksum(small_dataset: Path, small_dataset_raw: list[Path],
                                                          tmp_path: Path) -> None:
    source = small_dataset / "tokenizer.model"
    reused = prepare_dataset(small_dataset_raw, tmp_path / "data", **SMALL_DATASET_SETTINGS, tokenizer_file=source)
    original = prepare.load_manifest(small_dataset)
    assert reused.tokenizer_sha256 == original.tokenizer_sha256
    assert reused.splits == original.splits  # the same shards, byte for byte: the same token ids
    assert reused.settings["tokenizer_source"] == str(source.resolve())
    assert original.settings["tokenizer_source"] == "trained"
    text = "Cæsar, thou art revenged"
    assert Tokenizer.load(tmp_path / "data").encode(text) == Tokenizer.load(small_dataset).encode(text)


def test_a_tokenizer_that_does_not_fit_is_refused_before_anything_is_written(small_dataset: Path, raw_dir: Path,
                                                                             tmp_path: Path) -> None:
    source = small_dataset / "tokenizer.model"
    out = tmp_path / "out"

    def refused(model: Path, match: str, **settings: int) -> None:
        with pytest.raises(DataError, match=match):
            prepare_dataset([raw_dir], out, **{**SMALL_DATASET_SETTINGS, **settings}, tokenizer_file=model)
        assert not out.exists() and not list(tmp_path.glob(".out.staging-*"))

    fix = "set data.vocab_size=1024 data.num_sentinels=16 to reuse it"
    refused(source, f"data.tokenizer={source} has 1008 sentencepiece pieces.*not fit data.vocab_size=2048.*{fix}",
            vocab_size=2048)
    refused(source, f"made with num_sentinels=16.*{fix}", vocab_size=1016, num_sentinels=8)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(source, alone / "tokenizer.model")  # no layout beside it: the config's num_sentinels count
    refused(alone / "tokenizer.model", "set data.vocab_size=1016 data.num_sentinels=8", num_sentinels=8)
    (alone / "notes.model").write_text("not a model")
    refused(alone / "notes.model", "is not a sentencepiece model")
    refused(alone / "missing.model", "is not a file.*remove it to train a new tokenizer")
    spm.SentencePieceTrainer.train(sentence_iterator=iter((raw_dir / "sonnets_gut.txt").read_text().split("\n")),
                                   model_prefix=str(alone / "plain"), vocab_size=300, minloglevel=2)
    refused(alone / "plain.model", "lacks scaletrain's id layout", vocab_size=300 + 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "raw"]


def test_sampled_tokenizer_training_is_seeded_and_keeps_to_its_byte_budget(raw_dir: Path, tmp_path: Path) -> None:
    documents = list_documents(sorted(raw_dir.iterdir()))
    corpus_bytes = sum(len(text.encode()) for text in iter_texts(documents))
    budget = 60_000
    for seed in (0, 1, 2):
        lines = tokenizer_training_lines(documents, seed, sample_bytes=budget)
        assert 0.8 * budget <= sum(len(line.encode()) for line in lines) <= budget < corpus_bytes / 2
    assert tokenizer_training_lines(documents, 1, sample_bytes=budget) == tokenizer_training_lines(
        documents, 1, sample_bytes=budget)
    assert tokenizer_training_lines(documents, 1, sample_bytes=budget) != tokenizer_training_lines(
        documents, 2, sample_bytes=budget)

    def trained(name: str, seed: int) -> bytes:
        return train_tokenizer(documents, tmp_path / name / "tok", 400, num_sentinels=8, seed=seed,
                               sample_bytes=budget).read_bytes()

    assert trained("a", seed=1) == trained("b", seed=1)
    assert trained("c", seed=2) != trained("a", seed=1)
    first = prepare_dataset([raw_dir], tmp_path / "d1", **TINY_SETTINGS, tokenizer_train_bytes=budget)
    second = prepare_dataset([raw_dir], tmp_path / "d2", **TINY_SETTINGS, tokenizer_train_bytes=budget)
    assert first == second and first.settings["tokenizer_train_bytes"] == budget
    whole = prepare_dataset([raw_dir], tmp_path / "d3", **TINY_SETTINGS)
    assert whole.tokenizer_sha256 != first.tokenizer_sha256


def test_threaded_tokenization_matches_a_serial_encode(small_dataset: Path, small_dataset_raw: list[Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = Tokenizer.load(small_dataset)
    works = [path.read_text() for path in small_dataset_raw]
    texts = [*works, "", "Ay", *(line for line in works[0].split("\n")[:300]), works[1]]
    expected = [tokenizer.encode(text) for text in texts]
    monkeypatch.setattr(prepare, "BATCH_CHARS_PER_THREAD", 20_000)  # many batches, each with several texts
    model = small_dataset / "tokenizer.model"
    for num_workers in (1, 2, 3):
        arrays = list(tokenize_texts(model, iter(texts), num_workers, np.dtype(np.uint16)))
        assert all(array.dtype == np.uint16 for array in arrays)
        assert [array.tolist() for array in arrays] == expected, num_workers


def test_config_takes_either_a_tokenizer_or_a_training_budget() -> None:
    config = load_config(GPT_TINY, ["data.tokenizer_train_bytes=1000000"])
    assert config.data.dedup is True and config.data.tokenizer is None
    with pytest.raises(ConfigError, match="data.tokenizer=x.model reuses a tokenizer.*set one of them"):
        load_config(GPT_TINY, ["data.tokenizer=x.model", "data.tokenizer_train_bytes=100"])
    with pytest.raises(ConfigError, match="data.tokenizer_train_bytes=0 must be >= 1"):
        load_config(GPT_TINY, ["data.tokenizer_train_bytes=0"])
