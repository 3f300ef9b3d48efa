"""T5's objectives (Raffel et al. 2020): span corruption against the reference algorithm, and the prefix LM."""

from __future__ import annotations

import pickle
from math import comb
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.batch import IGNORE_INDEX
from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import TokenizerInfo, prefix_lm_collator
from scaletrain.data.sampler import GlobalSampleOrder
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.families.t5.span_corruption import (
    noise_span_counts,
    random_spans_helper,
    random_spans_noise_mask,
    t5_span_corruption_collator,
)

ENCODER_LENGTH = 128


@pytest.fixture(scope="module")
def info(small_dataset: Path) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset))


def packed_items(data_dir: Path, packed_seq_length: int, count: int) -> list[dict]:
    packed = PackedSequenceDataset(data_dir, "train", packed_seq_length)
    dataset = GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed=0))
    return [dataset[g] for g in range(count)]


def runs(mask: np.ndarray) -> list[tuple[bool, int]]:
    """(value, length) of each run of equal values."""
    boundaries = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    return [(bool(part[0]), len(part)) for part in np.split(mask, boundaries)]


@pytest.mark.parametrize(("inputs_length", "noise_density", "expected"), [
    (512, 0.15, (568, 114)),  # T5's pretraining lengths, as the reference prints them
    (128, 0.15, (141, 29)),   # 141 -> 21 noise in 7 spans: 120 + 7 + 1 = 128; 142 would give 129
    (64, 0.15, (70, 14)),     # 70 * 0.15 = 10.5 rounds to even 10 (Python's round, as the reference)
    (512, 0.5, (766, 512)),   # 767 gives targets 513 > 512: the reference's density-0.5 tweak takes one off
])
def test_random_spans_helper_matches_the_reference(inputs_length: int, noise_density: float,
                                                    expected: tuple[int, int]) -> None:
    assert random_spans_helper(inputs_length, noise_density, 3.0) == expected


@pytest.mark.parametrize(("length", "expected"), [(568, (85, 28)), (141, (21, 7)), (70, (10, 3)),
                                                  (1000, (150, 50)), (3, (1, 1)), (2, (1, 1))])
def test_noise_masks_have_the_reference_counts(length: int, expected: tuple[int, int]) -> None:
    assert noise_span_counts(length, 0.15, 3.0) == expected
    num_noise_tokens, num_noise_spans = expected
    for seed in range(20):
        mask = random_spans_noise_mask(np.random.default_rng(seed), length, 0.15, 3.0)
        assert len(mask) == length and mask.sum() == num_noise_tokens
        spans = runs(mask)
        assert spans[0][0] is False and spans[-1][0] is True  # non-noise first, noise last
        assert sum(is_noise for is_noise, _ in spans) == num_noise_spans


def test_all_masks_with_the_reference_counts_are_equally_likely() -> None:
    # length 40: 6 noise tokens in 2 spans, 34 non-noise in 2: 5 * 33 = 165 masks.
    num_masks = comb(6 - 1, 2 - 1) * comb(34 - 1, 2 - 1)
    draws = 200 * num_masks
    rng = np.random.default_rng(0)
    counts: dict[bytes, int] = {}
    for _ in range(draws):
        key = np.packbits(random_spans_noise_mask(rng, 40, 0.15, 3.0)).tobytes()
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == num_masks
    observed = np.array(list(counts.values()))
    chi_square = float(((observed - 200) ** 2 / 200).sum())
    degrees = num_masks - 1
    assert chi_square < degrees + 5 * (2 * degrees) ** 0.5, chi_square


def test_span_lengths_and_noise_fraction_over_many_draws() -> None:
    noise_lengths, num_noise, total = [], 0, 0
    for seed in range(300):
        length = 400 + seed  # varying lengths so the counts' rounding averages out
        mask = random_spans_noise_mask(np.random.default_rng(seed), length, 0.15, 3.0)
        noise_lengths += [n for is_noise, n in runs(mask) if is_noise]
        num_noise, total = num_noise + int(mask.sum()), total + length
    assert abs(np.mean(noise_lengths) - 3.0) <= 0.1
    assert abs(num_noise / total - 0.15) <= 0.001
    print(f"T5 spans: mean noise span length {np.mean(noise_lengths):.4f} over {len(noise_lengths)} spans, "
          f"noise fraction {num_noise / total:.4f}")


def test_collator_batches_reconstruct_the_original_exactly(small_dataset: Path, info: TokenizerInfo) -> None:
    collator = t5_span_corruption_collator(info, seed=1, encoder_length=ENCODER_LENGTH)
    assert (collator.raw_length, collator.decoder_length, collator.packed_seq_length) == (141, 29, 140)
    items = packed_items(small_dataset, collator.packed_seq_length, 64)
    batch = collator(items)
    assert set(batch) == {"encoder_tokens", "decoder_tokens", "labels", "encoder_padding_mask",
                          "decoder_padding_mask", "global_index"}
    assert batch["encoder_tokens"].shape == (64, ENCODER_LENGTH) and batch["labels"].shape == (64, 29)
    num_noise_tokens, num_spans = noise_span_counts(collator.raw_length, 0.15, 3.0)
    for row, item in enumerate(items):
        inputs = batch["encoder_tokens"][row][batch["encoder_padding_mask"][row].bool()].tolist()
        targets = batch["labels"][row][batch["decoder_padding_mask"][row].bool()].tolist()
        assert IGNORE_INDEX not in targets and (batch["labels"][row] == IGNORE_INDEX).sum() == 29 - len(targets)
        assert inputs[-1] == info.eos_id and targets[-1] == info.eos_id
        assert len(inputs) == collator.raw_length - num_noise_tokens + num_spans + 1 == ENCODER_LENGTH
        sentinels = [info.vocab_size - 1 - i for i in range(num_spans)]  # <extra_id_i>, down from the end
        assert [t for t in inputs if t >= sentinels[-1]] == sentinels == [t for t in targets if t >= sentinels[-1]]
        assert reconstruct(inputs[:-1], targets[:-1], set(sentinels)) == item["tokens"].tolist()
        decoder = batch["decoder_tokens"][row].tolist()
        assert decoder[0] == info.pad_id and decoder[1:len(targets)] == targets[:-1]


def reconstruct(inputs: list[int], targets: list[int], sentinels: set[int]) -> list[int]:
    """Put each sentinel's span from the targets back in place of that sentinel in the inputs."""
    spans: dict[int, list[int]] = {}
    for token in targets:
        if token in sentinels:
            current = spans.setdefault(token, [])
        else:
            current.append(token)
    return [piece for token in inputs for piece in (spans[token] if token in sentinels else [token])]


def test_collator_noise_follows_seed_and_global_index(small_dataset: Path, info: TokenizerInfo) -> None:
    collator = t5_span_corruption_collator(info, seed=2, encoder_length=ENCODER_LENGTH)
    items = packed_items(small_dataset, collator.packed_seq_length, 8)
    first, again = collator(items), pickle.loads(pickle.dumps(collator))(items)
    for key in first:
        torch.testing.assert_close(first[key], again[key])
    later = collator([{**item, "global_index": item["global_index"] + 10_000} for item in items])
    reseeded = t5_span_corruption_collator(info, seed=3, encoder_length=ENCODER_LENGTH)(items)
    for other in (later, reseeded):
        assert (other["encoder_tokens"] != first["encoder_tokens"]).any(dim=1).all()


def test_collator_refuses_more_spans_than_sentinels_and_wrong_lengths(small_dataset: Path,
                                                                     info: TokenizerInfo) -> None:
    with pytest.raises(DataError, match="28 noise spans per sequence but the tokenizer has 16 sentinels"):
        t5_span_corruption_collator(info, seed=0, encoder_length=512)
    collator = t5_span_corruption_collator(info, seed=0, encoder_length=ENCODER_LENGTH)
    with pytest.raises(DataError, match="seq_length=packed_seq_length=140"):
        collator(packed_items(small_dataset, ENCODER_LENGTH, 2))


def test_prefix_lm_labels_only_the_tokens_after_the_prefix(small_dataset: Path) -> None:
    seq = 64
    collator = prefix_lm_collator(seed=0, seq_length=seq)
    items = packed_items(small_dataset, collator.packed_seq_length, 400)
    batch = collator(items)
    assert set(batch) == {"tokens", "labels", "prefix_lengths", "global_index"}
    samples = np.stack([item["tokens"] for item in items])
    np.testing.assert_array_equal(batch["tokens"].numpy(), samples[:, :-1])
    prefix = batch["prefix_lengths"].numpy()
    assert prefix.min() >= 1 and prefix.max() <= seq - 1
    assert prefix.min() <= 3 and prefix.max() >= seq - 3, "split points should cover [1, S - 1]"
    labels = batch["labels"].numpy()
    for row, length in enumerate(prefix):
        # Position t predicts token t + 1: unlabelled exactly while token t + 1 lies in the prefix.
        assert (labels[row, :length - 1] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(labels[row, length - 1:], samples[row, length:])
    again = prefix_lm_collator(seed=0, seq_length=seq)(items)
    torch.testing.assert_close(again["prefix_lengths"], batch["prefix_lengths"])
    assert (prefix_lm_collator(seed=1, seq_length=seq)(items)["prefix_lengths"] != batch["prefix_lengths"]).any()
