"""SpanBERT's span boundaries from the MLM collator: each masked position's boundaries are the unmasked
neighbours of its contiguous masked run, relative positions run 1..len, the noise is the span masking's
own (a function of seed and global index), and runs never reach the sequence's edges."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.batch import IGNORE_INDEX
from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.masking import SPAN_BOUNDARY_KEYS, MaskingConfig, mask_sequence, mlm_collator, span_boundaries
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng
from scaletrain.data.sentence_pairs import SentencePairDataset
from scaletrain.data.tokenizer import Tokenizer
from tests.data.test_masking import NUM_SEQUENCES, SEQ, collate_all, packed_items


@pytest.fixture(scope="module")
def info(small_dataset: Path) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset))


def masked_runs(masked: np.ndarray) -> list[tuple[int, int]]:
    """Half-open ranges of consecutive True, by a plain scan."""
    runs, start = [], None
    for position, is_masked in enumerate([*masked, False]):
        if is_masked and start is None:
            start = position
        elif not is_masked and start is not None:
            runs.append((start, position))
            start = None
    return runs


def test_boundaries_are_the_unmasked_neighbours_of_each_run() -> None:
    labels = np.full(12, IGNORE_INDEX)
    labels[[2, 3, 4, 6, 9, 10]] = 7  # runs 2..4, 6, 9..10
    left, right, position = span_boundaries(labels)
    np.testing.assert_array_equal(left, [0, 0, 1, 1, 1, 0, 5, 0, 0, 8, 8, 0])
    np.testing.assert_array_equal(right, [0, 0, 5, 5, 5, 0, 7, 0, 0, 11, 11, 0])
    np.testing.assert_array_equal(position, [0, 0, 1, 2, 3, 0, 1, 0, 0, 1, 2, 0])
    for edge in (0, 11):
        touching = np.full(12, IGNORE_INDEX)
        touching[edge] = 7
        with pytest.raises(DataError, match="touches the sequence's edge"):
            span_boundaries(touching)


@pytest.mark.parametrize("whole_words", [False, True])
def test_collator_boundaries_and_positions_over_many_sequences(small_dataset: Path, info: TokenizerInfo,
                                                               whole_words: bool) -> None:
    options = {"span_masking": True, "whole_word_masking": whole_words}
    collator = mlm_collator(info, seed=5, seq_length=SEQ, span_boundary=True, **options)
    items = packed_items(small_dataset, collator.packed_seq_length, NUM_SEQUENCES)
    batch = collate_all(collator, items)
    plain = collate_all(mlm_collator(info, seed=5, seq_length=SEQ, **options), items)
    for key in plain:  # the boundaries add keys; the noise is the span masking's own
        torch.testing.assert_close(batch[key], plain[key])
    assert set(batch) == set(plain) | set(SPAN_BOUNDARY_KEYS)

    labels, left, right, position = (batch[key].numpy() for key in ("labels", *SPAN_BOUNDARY_KEYS))
    masked = labels != IGNORE_INDEX
    lengths = []
    for row in range(len(labels)):
        for start, end in masked_runs(masked[row]):
            assert start > 0 and end < SEQ, "a masked run reaches the sequence's edge"
            assert (left[row, start:end] == start - 1).all() and (right[row, start:end] == end).all()
            np.testing.assert_array_equal(position[row, start:end], np.arange(1, end - start + 1))
            assert not masked[row, start - 1] and not masked[row, end]
            lengths.append(end - start)
    assert not (left[~masked] | right[~masked] | position[~masked]).any(), "unmasked positions carry boundaries"
    assert (position[masked] >= 1).all() and position.max() <= masked.sum(axis=1).max()
    # The runs are the masking's own spans, merged where two touch (SpanBERT's merge_intervals).
    merged_spans = []
    for item in items:
        sequence = np.concatenate([[info.cls_id], item["tokens"], [info.sep_id]])
        rng = sequence_rng(5, item["global_index"], NoiseTag.MLM)
        spans = sorted(mask_sequence(rng, sequence, info, MaskingConfig(**options), info.ordinary_ids()).spans.tolist())
        merged = [list(spans[0])]
        for start, end in spans[1:]:
            if start == merged[-1][1]:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        merged_spans.append([tuple(span) for span in merged])
    assert merged_spans == [masked_runs(row) for row in masked]
    num_spans = sum(len(mask_sequence(sequence_rng(5, item["global_index"], NoiseTag.MLM),
                                      np.concatenate([[info.cls_id], item["tokens"], [info.sep_id]]), info,
                                      MaskingConfig(**options), info.ordinary_ids()).spans) for item in items)
    print(f"span boundaries (whole words={whole_words}): {num_spans} spans merged into {len(lengths)} runs, "
          f"mean run length {np.mean(lengths):.2f}, longest {max(lengths)}")


def test_sentence_pair_boundaries_stay_inside_the_real_tokens(small_dataset: Path, info: TokenizerInfo) -> None:
    """Padded [CLS] A [SEP] B [SEP] pairs: every boundary is a real token (the [SEP]s are never masked)."""
    documents = PackedSequenceDataset(small_dataset, "train", SEQ)
    pairs = SentencePairDataset(documents, info, SEQ, seed=0, task="sop")
    items = [pairs[index] for index in range(64)]
    batch = mlm_collator(info, seed=2, seq_length=SEQ, sentence_pairs=True, span_masking=True,
                         span_boundary=True)(items)
    masked = batch["labels"] != IGNORE_INDEX
    for key in ("left_boundary", "right_boundary"):
        boundary = batch[key][masked]
        rows = masked.nonzero()[:, 0]
        assert (batch["padding_mask"][rows, boundary] == 1).all()
        assert not masked[rows, boundary].any()
