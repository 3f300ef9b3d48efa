"""BART's noising functions (Lewis et al. 2020, sec. 2.2): their statistics, and the collator's batches."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from scaletrain.config import ConfigError
from scaletrain.config_loader import config_from_dict, validate
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.families.bart.noising import (
    NOISING_FUNCTIONS,
    DenoisingCollator,
    DenoisingNoise,
    delete_tokens,
    infilling_spans,
    permute_sentences,
    poisson_span_lengths,
    replace_spans,
    rotate_document,
)
from tests.data.test_span_corruption import packed_items

SEQ_LENGTH = 128
MASK = 4
P_VALUE = 1e-3  # a correct sampler fails a goodness-of-fit test this rarely; the draws are seeded anyway


@pytest.fixture(scope="module")
def info(small_dataset: Path) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset))


def rngs(count: int, seed: int = 0):
    return (sequence_rng(seed, index, NoiseTag.DENOISING) for index in range(count))


def chi_square_p(observed: np.ndarray, expected_probabilities: np.ndarray) -> float:
    expected = expected_probabilities / expected_probabilities.sum() * observed.sum()
    return stats.chisquare(observed, expected).pvalue


def test_span_lengths_are_poisson_3():
    """Every span but the last of a text (cut to the budget's remainder) is a Poisson(3) draw;
    0-length spans (insertions) included."""
    lengths = np.concatenate([poisson_span_lengths(rng, 300, 3.0)[:-1] for rng in rngs(300)])
    top = 9  # bins 0..8 and >= 9
    observed = np.bincount(np.minimum(lengths, top), minlength=top + 1)
    probabilities = np.append(stats.poisson.pmf(np.arange(top), 3.0), stats.poisson.sf(top - 1, 3.0))
    assert len(lengths) > 20_000
    assert chi_square_p(observed, probabilities) > P_VALUE
    assert abs(lengths.mean() - 3.0) < 0.05


@pytest.mark.parametrize("budget", [0, 1, 7, 38])
def test_span_lengths_cover_the_budget_exactly(budget: int):
    for rng in rngs(50):
        lengths = poisson_span_lengths(rng, budget, 3.0)
        assert lengths.sum() == budget
        assert len(lengths) == 0 or lengths[-1] > 0


def test_infilling_covers_30_percent_with_one_mask_per_span():
    length = 127
    total_masks = total_inserts = 0
    for rng in rngs(400):
        starts, lengths = infilling_spans(rng, length, 0.3, 3.0)
        assert lengths.sum() == round(0.3 * length)  # 38 of 127 tokens
        ends = starts + lengths
        assert np.all(starts[1:] >= ends[:-1]) and ends[-1] <= length  # in order, never overlapping
        tokens = np.arange(100, 100 + length)
        infilled = replace_spans(tokens, starts, lengths, MASK)
        assert (infilled == MASK).sum() == len(lengths)
        assert len(infilled) <= length
        covered = np.zeros(length, dtype=bool)
        for start, span in zip(starts, lengths, strict=True):
            covered[start:start + span] = True
        np.testing.assert_array_equal(infilled[infilled != MASK], tokens[~covered])
        total_masks += len(lengths)
        total_inserts += int((lengths == 0).sum())
    assert total_inserts > 0, "0-length spans must insert a mask"
    assert total_masks / 400 == pytest.approx(38 / 3.0 * (1 + stats.poisson.pmf(0, 3.0)), rel=0.1)


def test_span_positions_are_uniform_over_the_text():
    """Away from the text's ends every token is equally likely to be covered (30%); whole spans
    reach the first and last tokens less often (the first is covered only if a span comes first)."""
    length, samples = 64, 4000
    covered = np.zeros(length)
    for rng in rngs(samples):
        for start, span in zip(*infilling_spans(rng, length, 0.3, 3.0), strict=True):
            covered[start:start + span] += 1
    interior = covered[8:-8] / samples
    assert np.abs(interior - round(0.3 * length) / length).max() < 0.04
    assert covered[0] < covered[length // 2] and covered[-1] < covered[length // 2]


def test_sentence_permutation_shuffles_whole_sentences(info: TokenizerInfo, small_dataset: Path):
    """The permuted text is the same sentences (multiset of tokens kept), in an order that changes."""
    items = packed_items(small_dataset, SEQ_LENGTH, 40)
    reordered = 0
    for item, rng in zip(items, rngs(40), strict=True):
        tokens = np.asarray(item["tokens"])
        ends = np.flatnonzero(info.ends_sentence[tokens][:-1]) + 1
        sentences = [tuple(sentence.tolist()) for sentence in np.split(tokens, ends)]
        permuted = permute_sentences(rng, tokens, info.ends_sentence)
        assert Counter(permuted.tolist()) == Counter(tokens.tolist())
        pieces = _sentences_of(permuted, sentences)
        assert Counter(pieces) == Counter(sentences)
        reordered += pieces != sentences
    assert reordered > 30, "sentences were rarely reordered"


def _sentences_of(permuted: np.ndarray, sentences: list[tuple]) -> list[tuple]:
    """Cut `permuted` into the given sentences (greedy by matching prefix); fails if it cannot."""
    remaining, pieces = Counter(sentences), []
    cursor = 0
    while cursor < len(permuted):
        match = next((s for s in remaining if remaining[s] and tuple(permuted[cursor:cursor + len(s)]) == s), None)
        assert match is not None, "the permuted text is not a concatenation of the sentences"
        remaining[match] -= 1
        pieces.append(match)
        cursor += len(match)
    return pieces


def test_sentence_ends_are_pieces_ending_in_terminal_punctuation(small_dataset: Path, info: TokenizerInfo):
    tokenizer = Tokenizer.load(small_dataset)
    text = "Now is the winter. Shall I compare thee? Away!\nSo"
    ids = tokenizer.encode(text)
    ends = [tokenizer.decode(ids[:index + 1]) for index in np.flatnonzero(info.ends_sentence[ids])]
    assert [end[-1] for end in ends] == [".", "?", "!", "\n"][:len(ends)] and len(ends) >= 3
    assert info.ends_sentence[info.eos_id] and not info.ends_sentence[info.pad_id]


def test_token_deletion_removes_the_ratio(info: TokenizerInfo):
    tokens = np.arange(100, 200)
    kept_counts = np.zeros(100)
    for rng in rngs(500):
        kept = delete_tokens(rng, tokens, 0.15)
        assert len(kept) == 85 and np.all(np.diff(kept) > 0)  # a subsequence, 15 of 100 removed
        kept_counts[kept - 100] += 1
    assert np.abs(kept_counts / 500 - 0.85).max() < 0.08


def test_rotation_is_a_rotation_starting_at_a_uniform_token():
    tokens = np.arange(100, 132)
    starts = []
    for rng in rngs(3200):
        rotated = rotate_document(rng, tokens)
        start = int(rotated[0]) - 100
        np.testing.assert_array_equal(rotated, np.roll(tokens, -start))
        starts.append(start)
    assert chi_square_p(np.bincount(starts, minlength=32), np.ones(32)) > P_VALUE


def collator(info: TokenizerInfo, functions: tuple[str, ...] = ("text_infilling", "sentence_permutation"),
             seed: int = 5) -> DenoisingCollator:
    return DenoisingCollator(info, seed, SEQ_LENGTH, DenoisingNoise(functions))


def test_batches_reconstruct_the_text_behind_eos(info: TokenizerInfo, small_dataset: Path):
    collate = collator(info)
    items = packed_items(small_dataset, collate.packed_seq_length, 8)
    batch = collate(items)
    for key in ("encoder_tokens", "decoder_tokens", "labels", "encoder_padding_mask", "decoder_padding_mask"):
        assert batch[key].shape == (8, SEQ_LENGTH)
    for row, item in enumerate(items):
        text = np.asarray(item["tokens"])
        assert batch["labels"][row].tolist() == [*text.tolist(), info.eos_id]  # the original text + eos
        assert batch["decoder_tokens"][row].tolist() == [info.eos_id, *text.tolist()]  # shifted behind eos
        encoder = batch["encoder_tokens"][row][batch["encoder_padding_mask"][row].bool()].numpy()
        assert encoder[-1] == info.eos_id and (encoder == info.mask_id).sum() > 0
        unmasked = Counter(encoder[encoder != info.mask_id][:-1].tolist())
        assert not unmasked - Counter(text.tolist())  # permuted and infilled: only the text's tokens
        assert len(text) - unmasked.total() == round(0.3 * len(text))
    assert batch["decoder_padding_mask"].all()


def test_noise_is_a_function_of_seed_and_global_index(info: TokenizerInfo, small_dataset: Path):
    collate = collator(info, NOISING_FUNCTIONS)
    items = packed_items(small_dataset, collate.packed_seq_length, 4)
    batch = collate(items)
    again = pickle.loads(pickle.dumps(collate))([items[2], items[0]])  # another batch, another process
    assert batch["encoder_tokens"][2].tolist() == again["encoder_tokens"][0].tolist()
    assert batch["encoder_tokens"][0].tolist() == again["encoder_tokens"][1].tolist()
    other_seed = collator(info, seed=6)(items)["encoder_tokens"]
    assert not (other_seed == collator(info)(items)["encoder_tokens"]).all()
    moved = [{**items[0], "global_index": 99}]
    assert collate(moved)["encoder_tokens"][0].tolist() != batch["encoder_tokens"][0].tolist()


def test_every_function_keeps_the_encoder_length(info: TokenizerInfo, small_dataset: Path):
    collate = collator(info, ("sentence_permutation", "document_rotation", "token_masking", "text_infilling"))
    items = packed_items(small_dataset, collate.packed_seq_length, 64)
    batch = collate(items)
    assert (batch["encoder_padding_mask"].sum(dim=1) <= SEQ_LENGTH).all()


def test_bad_noising_is_one_clear_error(info: TokenizerInfo):
    with pytest.raises(DataError, match="'shuffle'.*not known; list one or more of sentence_permutation"):
        DenoisingNoise(("text_infilling", "shuffle"))
    with pytest.raises(DataError, match="items of 127 tokens, got 10"):
        collator(info)([{"tokens": np.arange(10), "global_index": 0}])
    config = config_from_dict({"model": {"family": "bart"}, "objective": {"noising": ["text_infiling"]}})
    with pytest.raises(ConfigError, match="objective.noising: .*'text_infiling'"):
        validate(config)
    with pytest.raises(ConfigError, match="objective.infilling_ratio=1.5 must be in"):
        validate(config_from_dict({"model": {"family": "bart"}, "objective": {"infilling_ratio": 1.5}}))
