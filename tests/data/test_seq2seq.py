"""The T5 prefix LM: every sequence splits into an encoder prefix and a decoder continuation."""

from __future__ import annotations

import numpy as np

from scaletrain.batch import IGNORE_INDEX
from scaletrain.data.objectives import TokenizerInfo
from scaletrain.data.seq2seq import EncoderDecoderPrefixLMCollator
from scaletrain.data.tokenizer import Tokenizer


def _items(count: int, length: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"global_index": index, "tokens": rng.integers(300, 900, length)} for index in range(count)]


def test_prefix_and_continuation_rebuild_the_sequence(small_dataset):
    info = TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset))
    collate = EncoderDecoderPrefixLMCollator(info, seed=3, encoder_length=32)
    items = _items(200, 32)
    batch = collate(items)
    assert batch["encoder_tokens"].shape == (200, 32) and batch["labels"].shape == (200, 32)
    splits = []
    for row, item in enumerate(items):
        encoder = batch["encoder_tokens"][row][batch["encoder_padding_mask"][row].bool()].numpy()
        target = batch["labels"][row][batch["labels"][row] != IGNORE_INDEX].numpy()
        assert encoder[-1] == info.eos_id and target[-1] == info.eos_id
        assert np.array_equal(np.concatenate([encoder[:-1], target[:-1]]), item["tokens"])
        assert batch["decoder_tokens"][row, 0] == info.pad_id
        assert np.array_equal(batch["decoder_tokens"][row, 1:len(target)].numpy(), target[:-1])
        splits.append(len(encoder) - 1)
    assert min(splits) >= 1 and max(splits) <= 31
    assert abs(np.mean(splits) - 16) < 2.0, "split points should be uniform over [1, 31]"


def test_splits_are_fixed_by_seed_and_global_index(small_dataset):
    info = TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset))
    items = _items(8, 32)
    first = EncoderDecoderPrefixLMCollator(info, seed=3, encoder_length=32)(items)
    again = EncoderDecoderPrefixLMCollator(info, seed=3, encoder_length=32)(items)
    other = EncoderDecoderPrefixLMCollator(info, seed=4, encoder_length=32)(items)
    assert all(first[key].equal(again[key]) for key in first)
    assert not first["encoder_padding_mask"].equal(other["encoder_padding_mask"])
