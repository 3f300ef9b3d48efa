"""BERT masked LM: the 15% budget, the 80/10/10 split, whole words, SpanBERT spans, dynamic masking."""

from __future__ import annotations

import itertools
import pickle
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.batch import IGNORE_INDEX
from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.masking import (
    MaskingConfig,
    choose_unit_spans,
    mask_sequence,
    masking_budget,
    masking_units,
    mlm_collator,
    span_length_distribution,
)
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng
from scaletrain.data.sampler import GlobalSampleOrder
from scaletrain.data.tokenizer import Tokenizer
from tests.data.loaders import train_loader

SEQ = 128
NUM_SEQUENCES = 400
BATCH = 50


@pytest.fixture(scope="module")
def info(small_dataset: Path) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset))


def packed_items(data_dir: Path, packed_seq_length: int, count: int, seed: int = 0) -> list[dict]:
    packed = PackedSequenceDataset(data_dir, "train", packed_seq_length)
    dataset = GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed))
    return [dataset[g] for g in range(count)]


def collate_all(collator, items: list[dict]) -> dict[str, torch.Tensor]:
    batches = [collator(items[i:i + BATCH]) for i in range(0, len(items), BATCH)]
    return {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}


def originals(batch: dict[str, torch.Tensor]) -> np.ndarray:
    """The unmasked sequences: labels where chosen, inputs elsewhere."""
    chosen = batch["labels"] != IGNORE_INDEX
    return torch.where(chosen, batch["labels"], batch["tokens"]).numpy()


def within_binomial_error(count: int, total: int, probability: float, standard_errors: float = 4.0) -> bool:
    return abs(count / total - probability) <= standard_errors * np.sqrt(probability * (1 - probability) / total)


def test_roberta_sequences_choose_15_percent_of_text_and_split_80_10_10(small_dataset: Path,
                                                                         info: TokenizerInfo) -> None:
    collator = mlm_collator(info, seed=7, seq_length=SEQ)
    items = packed_items(small_dataset, collator.packed_seq_length, NUM_SEQUENCES)
    batch = collate_all(collator, items)
    original, inputs = originals(batch), batch["tokens"].numpy()
    np.testing.assert_array_equal(original[:, 1:-1], np.stack([item["tokens"] for item in items]))
    assert (original[:, 0] == info.cls_id).all() and (original[:, -1] == info.sep_id).all()
    assert (batch["token_types"] == 0).all() and (batch["padding_mask"] == 1).all()
    assert set(batch) == {"tokens", "token_types", "padding_mask", "labels", "global_index"}

    chosen = (batch["labels"] != IGNORE_INDEX).numpy()
    candidates = ~info.is_special(original)
    assert not (chosen & ~candidates).any(), "a special token (cls, sep, eos) was chosen"
    budgets = [masking_budget(int(n), 0.15) for n in candidates.sum(axis=1)]
    np.testing.assert_array_equal(chosen.sum(axis=1), budgets)
    fraction = chosen.sum() / candidates.sum()
    assert abs(fraction - 0.15) <= 0.005, fraction

    num_chosen = int(chosen.sum())
    masked = inputs[chosen] == info.mask_id
    unchanged = inputs[chosen] == original[chosen]
    replaced = ~masked & ~unchanged
    # A random replacement equals the original with probability 1/|ordinary ids|: it then reads as unchanged.
    same_by_chance = 1 / len(info.ordinary_ids())
    assert within_binomial_error(int(masked.sum()), num_chosen, 0.8)
    assert within_binomial_error(int(replaced.sum()), num_chosen, 0.1 * (1 - same_by_chance))
    assert within_binomial_error(int(unchanged.sum()), num_chosen, 0.1 + 0.1 * same_by_chance)
    assert not info.is_special(inputs[chosen][replaced]).any(), "random replacements must be ordinary text"
    print(f"MLM: chosen {fraction:.4f} of {int(candidates.sum())} candidates; of {num_chosen} chosen: "
          f"[MASK] {masked.mean():.4f}, random {replaced.mean():.4f}, unchanged {unchanged.mean():.4f}")


def test_masks_follow_seed_and_global_index_and_survive_loader_workers(small_dataset: Path,
                                                                        info: TokenizerInfo) -> None:
    collator = mlm_collator(info, seed=3, seq_length=SEQ)
    items = packed_items(small_dataset, collator.packed_seq_length, 8)
    first = collator(items)
    again = pickle.loads(pickle.dumps(collator))(items)
    for key in first:
        torch.testing.assert_close(first[key], again[key])
    # The same sequence under a later epoch's global index (RoBERTa's dynamic masking), or another seed.
    later = collator([{**item, "global_index": item["global_index"] + 10_000} for item in items])
    reseeded = mlm_collator(info, seed=4, seq_length=SEQ)(items)
    for other in (later, reseeded):
        torch.testing.assert_close(originals(other), originals(first))
        assert ((other["labels"] != IGNORE_INDEX) != (first["labels"] != IGNORE_INDEX)).any(dim=1).all()
    # Two DataLoader workers (pickled collator, seed 0 order as in packed_items) build the same batches.
    loader = train_loader(small_dataset, collator.packed_seq_length, 0, 4, 0, 1, 0, 2, collator)
    for step, batch in enumerate(itertools.islice(loader, 2)):
        expected = collator(items[4 * step:4 * step + 4])
        for key in expected:
            torch.testing.assert_close(batch[key], expected[key])


def test_collator_rejects_items_of_the_wrong_length(small_dataset: Path, info: TokenizerInfo) -> None:
    collator = mlm_collator(info, seed=0, seq_length=SEQ)
    with pytest.raises(DataError, match="packed_seq_length=125"):
        collator(packed_items(small_dataset, SEQ, 2))


def test_word_boundaries_follow_sentencepiece_and_line_breaks(small_dataset: Path, info: TokenizerInfo) -> None:
    tokenizer = Tokenizer.load(small_dataset)
    words = ["To", " be,", " or", " not", "\n", "to", " be"]
    tokens = np.array([info.cls_id, *tokenizer.encode("".join(words)), info.sep_id])
    starts, ends = masking_units(tokens, ~info.is_special(tokens), info, whole_words=True)
    # decode drops a leading space, so compare with the words' text after it.
    assert [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)] == [
        word.lstrip(" ") for word in words]
    token_starts, token_ends = masking_units(tokens, ~info.is_special(tokens), info, whole_words=False)
    np.testing.assert_array_equal(token_starts, np.arange(1, len(tokens) - 1))
    np.testing.assert_array_equal(token_ends, token_starts + 1)


def test_whole_word_masking_takes_every_word_entirely_or_not_at_all(small_dataset: Path,
                                                                   info: TokenizerInfo) -> None:
    collator = mlm_collator(info, seed=11, seq_length=SEQ, whole_word_masking=True)
    batch = collate_all(collator, packed_items(small_dataset, collator.packed_seq_length, NUM_SEQUENCES))
    original, chosen = originals(batch), (batch["labels"] != IGNORE_INDEX).numpy()
    candidates = ~info.is_special(original)
    # Token i+1 continues token i's word when both are text and i+1 neither starts a word nor follows a line break.
    continues = (candidates[:, :-1] & candidates[:, 1:] & ~info.starts_word[original[:, 1:]]
                 & ~info.ends_word[original[:, :-1]])
    assert continues.sum() > 1000, "the data should hold many multi-piece words"
    assert (chosen[:, :-1] == chosen[:, 1:])[continues].all(), "a word was chosen only in part"
    assert not (chosen & ~candidates).any()
    budgets = np.array([masking_budget(int(n), 0.15) for n in candidates.sum(axis=1)])
    assert (chosen.sum(axis=1) <= budgets).all()
    fraction = chosen.sum() / candidates.sum()
    assert abs(fraction - 0.15) <= 0.005, fraction
    print(f"whole-word MLM: chosen {fraction:.4f} of candidates")


def test_span_length_distribution_is_spanbert_truncated_geometric() -> None:
    p, lengths = Fraction(1, 5), range(1, 11)
    weights = [p * (1 - p) ** (k - 1) for k in lengths]
    probabilities = [w / sum(weights) for w in weights]
    exact_mean = float(sum(k * q for k, q in zip(lengths, probabilities, strict=True)))
    exact_std = float(sum(k * k * q for k, q in zip(lengths, probabilities, strict=True)) - exact_mean**2) ** 0.5
    assert abs(exact_mean - 3.8) < 0.01  # SpanBERT sec. 3.1: "a mean span length of 3.8"
    distribution = span_length_distribution(0.2, 10)
    np.testing.assert_allclose(distribution, [float(q) for q in probabilities])

    # First span of many long sequences with a budget of one span: its length is the drawn one, unless the
    # start is near the end (the start is drawn independently of the length, so excluding those is unbiased).
    num_units, drawn = 1000, []
    starts = np.arange(num_units)
    for seed in range(6000):
        spans = choose_unit_spans(np.random.default_rng(seed), starts, starts + 1, 10, distribution)
        first, end = spans[0]
        if first <= num_units - 10:
            drawn.append(end - first)
    standard_error = exact_std / len(drawn) ** 0.5
    assert abs(np.mean(drawn) - exact_mean) <= 4 * standard_error
    assert max(drawn) == 10 and min(drawn) == 1
    print(f"SpanBERT span lengths: mean {np.mean(drawn):.4f} over {len(drawn)} spans, "
          f"exact {exact_mean:.4f} (4 SE = {4 * standard_error:.4f})")


@pytest.mark.parametrize("whole_words", [False, True])
def test_span_masking_decides_80_10_10_per_span(small_dataset: Path, info: TokenizerInfo, whole_words: bool) -> None:
    config = MaskingConfig(span_masking=True, whole_word_masking=whole_words)
    ordinary_ids = info.ordinary_ids()
    items = packed_items(small_dataset, SEQ - 3, NUM_SEQUENCES)
    num_spans = num_all_masked = num_chosen = num_candidates = 0
    for item in items:
        tokens = np.concatenate([[info.cls_id], item["tokens"], [info.sep_id]])
        rng = sequence_rng(5, item["global_index"], NoiseTag.MLM)
        masked = mask_sequence(rng, tokens, info, config, ordinary_ids)
        chosen = masked.labels != IGNORE_INDEX
        covered = np.zeros(len(tokens), dtype=bool)
        for start, end in masked.spans:
            assert not covered[start:end].any(), "spans overlap"
            covered[start:end] = True
            is_mask = masked.inputs[start:end] == info.mask_id
            assert is_mask.all() or not is_mask.any(), "one span mixes [MASK] with other tokens"
            num_all_masked += int(is_mask.all())
        np.testing.assert_array_equal(covered, chosen)
        assert not (chosen & info.is_special(tokens)).any()
        num_spans += len(masked.spans)
        num_chosen += int(chosen.sum())
        num_candidates += int((~info.is_special(tokens)).sum())
    assert within_binomial_error(num_all_masked, num_spans, 0.8)
    assert abs(num_chosen / num_candidates - 0.15) <= 0.005
    print(f"span MLM (whole words={whole_words}): chosen {num_chosen / num_candidates:.4f}, "
          f"{num_all_masked / num_spans:.4f} of {num_spans} spans all [MASK], "
          f"{num_chosen / num_spans:.3f} tokens per span")


def test_masking_config_rejects_impossible_probabilities() -> None:
    with pytest.raises(DataError, match="mask_prob=1.5"):
        MaskingConfig(mask_prob=1.5)
    with pytest.raises(DataError, match="random_token_prob=0.3"):
        MaskingConfig(mask_token_prob=0.8, random_token_prob=0.3)
    assert masking_budget(0, 0.15) == 0 and masking_budget(3, 0.15) == 1 and masking_budget(10, 0.25) == 2
