"""NSP and SOP pairs: [CLS] A [SEP] B [SEP] layout, balanced labels, true continuations, BERT truncation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.batch import IGNORE_INDEX
from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.masking import mlm_collator
from scaletrain.data.objectives import TokenizerInfo
from scaletrain.data.sentence_pairs import SentencePairDataset, truncate_pair
from scaletrain.data.tokenizer import Tokenizer

SEQ = 96
NUM_PAIRS = 1500


@pytest.fixture(scope="module")
def info(small_dataset: Path) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset))


@pytest.fixture(scope="module")
def documents(small_dataset: Path) -> PackedSequenceDataset:
    return PackedSequenceDataset(small_dataset, "train", SEQ)


def segments(item: dict, info: TokenizerInfo) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of an item, after checking the [CLS] A [SEP] B [SEP] layout and its token types."""
    tokens, types = item["tokens"], item["token_types"]
    assert len(tokens) <= SEQ and tokens[0] == info.cls_id and tokens[-1] == info.sep_id
    separators = np.flatnonzero(tokens == info.sep_id)
    assert len(separators) == 2 and not info.is_special(np.delete(tokens, [0, *separators])).any()
    np.testing.assert_array_equal(types, np.arange(len(tokens)) > separators[0])
    first, second = tokens[1:separators[0]], tokens[separators[0] + 1:-1]
    assert len(first) >= 1 and len(second) >= 1
    return first, second


def documents_containing(part: np.ndarray, texts: list[bytes]) -> set[int]:
    """Documents in which `part` occurs as a contiguous run of tokens."""
    needle = part.astype(np.int64).tobytes()
    found = set()
    for doc, text in enumerate(texts):
        start = text.find(needle)
        while start != -1 and start % 8:
            start = text.find(needle, start + 1)
        if start != -1:
            found.add(doc)
    return found


@pytest.mark.parametrize("task", ["nsp", "sop"])
def test_pairs_are_balanced_and_in_order_ones_are_true_continuations(documents: PackedSequenceDataset,
                                                                     info: TokenizerInfo, task: str) -> None:
    assert Tokenizer.load(documents.data_dir).encode("a\nb")[1] == info.newline_id == 7 + 0x0A
    dataset = SentencePairDataset(documents, info, SEQ, seed=0, task=task)
    texts = [np.asarray(documents.document_tokens(d), dtype=np.int64).tobytes() for d in range(documents.num_docs)]
    labels, checked, checked_random = [], 0, 0
    for global_index in range(NUM_PAIRS):
        item = dataset[global_index]
        first, second = segments(item, info)
        labels.append(item["sentence_order_label"])
        if global_index % 10:
            continue  # the contiguity search is slow-ish; a tenth of the pairs is plenty
        checked += 1
        in_order = np.concatenate([first, second])
        if item["sentence_order_label"] == 0:
            assert documents_containing(in_order, texts), "B does not continue A in any document"
        elif task == "sop":
            assert documents_containing(np.concatenate([second, first]), texts), "swapped pair is not B then A"
        elif min(len(first), len(second)) >= 8:  # long enough to occur in one document only
            first_in, second_in = documents_containing(first, texts), documents_containing(second, texts)
            assert first_in and second_in and first_in.isdisjoint(second_in), "B comes from A's document"
            checked_random += 1
    share = np.mean(labels)
    assert abs(share - 0.5) <= 4 * (0.25 / NUM_PAIRS) ** 0.5, share
    assert task == "sop" or checked_random >= 20
    print(f"{task}: label 1 in {share:.4f} of {NUM_PAIRS} pairs; contiguity checked on {checked}")


def test_pairs_follow_the_global_index(documents: PackedSequenceDataset, info: TokenizerInfo) -> None:
    dataset = SentencePairDataset(documents, info, SEQ, seed=0, task="nsp")
    again = SentencePairDataset(documents, info, SEQ, seed=0, task="nsp")
    for global_index in (0, 5, dataset.num_samples + 3):
        np.testing.assert_array_equal(dataset[global_index]["tokens"], again[global_index]["tokens"])
    # The same chunk in the next epoch (another global index) is split and paired afresh.
    first_epoch = {dataset[g]["sample_id"]: dataset[g]["tokens"] for g in range(50)}
    later = [dataset[g] for g in range(dataset.num_samples, 2 * dataset.num_samples)]
    redrawn = [not np.array_equal(item["tokens"], first_epoch[item["sample_id"]])
               for item in later if item["sample_id"] in first_epoch]
    assert len(redrawn) == 50 and sum(redrawn) >= 25


def test_truncation_matches_berts_token_by_token_loop() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        earlier, later = np.arange(rng.integers(1, 60)), 100 + np.arange(rng.integers(1, 60))
        limit = int(rng.integers(2, 80))
        expected_earlier, expected_later = list(earlier), list(later)
        while len(expected_earlier) + len(expected_later) > limit:  # BERT's truncate_seq_pair, ours from the outside
            if len(expected_earlier) > len(expected_later):
                expected_earlier.pop(0)
            else:
                expected_later.pop()
        got_earlier, got_later = truncate_pair(earlier, later, limit)
        assert got_earlier.tolist() == expected_earlier and got_later.tolist() == expected_later


def test_mlm_over_pairs_pads_and_never_masks_the_layout(documents: PackedSequenceDataset,
                                                        info: TokenizerInfo) -> None:
    dataset = SentencePairDataset(documents, info, SEQ, seed=0, task="sop")
    items = [dataset[g] for g in range(64)]
    batch = mlm_collator(info, seed=0, seq_length=SEQ, sentence_pairs=True)(items)
    assert set(batch) == {"tokens", "token_types", "padding_mask", "labels", "sentence_order_labels", "global_index"}
    torch.testing.assert_close(batch["sentence_order_labels"],
                               torch.tensor([item["sentence_order_label"] for item in items]))
    for row, item in enumerate(items):
        length = len(item["tokens"])
        assert batch["padding_mask"][row].tolist() == [1] * length + [0] * (SEQ - length)
        assert (batch["tokens"][row, length:] == info.pad_id).all()
        torch.testing.assert_close(batch["token_types"][row, :length], torch.from_numpy(item["token_types"]))
        labelled = batch["labels"][row] != IGNORE_INDEX
        layout = torch.from_numpy(info.is_special(item["tokens"]))
        assert not labelled[length:].any() and not (labelled[:length] & layout).any()
        assert labelled.sum() >= 1
