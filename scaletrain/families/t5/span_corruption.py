"""T5 span corruption (Raffel et al. 2020, sec. 3.1.4 and 3.3.4), its collator and the objective T5's spec owns
(SPAN_CORRUPTION, with the objective: section's noise_density and mean_noise_span_length).

`random_spans_noise_mask`, `random_spans_helper` and the sentinel substitution
(`noise_span_to_unique_sentinel`) are ports of google-research/
text-to-text-transfer-transformer, t5/data/preprocessors.py (Apache-2.0), with
numpy in place of TensorFlow. The counts are computed in float32 with
round-half-to-even, as the reference's `tf.round(to_float(...))` does; the random
draws differ (numpy's generator, not TF's stateless ops), the distribution not.

Example (noise in capitals): "a B C d e F g" -> inputs "a <X> d e <Y> g </s>",
targets "<X> B C <Y> F </s>", with <X> = <extra_id_0> = vocab_size - 1,
<Y> = <extra_id_1> = vocab_size - 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from scaletrain.config import Config
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng
from scaletrain.data.seq2seq import encoder_decoder_batch
from scaletrain.model.family import ModelFamily, TrainingObjective


def noise_span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(num_noise_tokens, num_noise_spans) that `random_spans_noise_mask` uses for a sequence of `length`.

    num_noise_tokens = round(length * density) clipped to [1, length - 1];
    num_noise_spans = max(1, round(num_noise_tokens / mean_noise_span_length)); lengths below 2 count as 2.
    """
    length = max(length, 2)
    num_noise_tokens = int(np.rint(np.float32(length) * np.float32(noise_density)))
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = int(np.rint(np.float32(num_noise_tokens) / np.float32(mean_noise_span_length)))
    return num_noise_tokens, max(num_noise_spans, 1)


def random_segmentation(rng: np.random.Generator, num_items: int, num_segments: int) -> np.ndarray:
    """Lengths of a uniformly random split of num_items into num_segments positive parts (`_random_segmentation`).

    Stars and bars: a random permutation of (num_segments - 1) segment starts among
    the num_items - 1 gaps between items.
    """
    first_in_segment = np.zeros(num_items, dtype=np.int64)
    first_in_segment[1:] = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
    return np.bincount(np.cumsum(first_in_segment), minlength=num_segments)


def random_spans_noise_mask(rng: np.random.Generator, length: int, noise_density: float,
                            mean_noise_span_length: float = 3.0) -> np.ndarray:
    """Boolean noise mask of `length`: spans alternate non-noise, noise, ..., beginning with non-noise.

    Given the counts of `noise_span_counts`, all such masks are equally likely.
    """
    original_length, length = length, max(length, 2)
    num_noise_tokens, num_noise_spans = noise_span_counts(length, noise_density, mean_noise_span_length)
    noise_span_lengths = random_segmentation(rng, num_noise_tokens, num_noise_spans)
    nonnoise_span_lengths = random_segmentation(rng, length - num_noise_tokens, num_noise_spans)
    interleaved_span_lengths = np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1).reshape(-1)
    span_start_indicator = np.zeros(length, dtype=np.int64)
    np.add.at(span_start_indicator, np.cumsum(interleaved_span_lengths)[:-1], 1)
    return (np.cumsum(span_start_indicator) % 2 == 1)[:original_length]


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, first_sentinel_id: int) -> np.ndarray:
    """Each run of noise tokens becomes one sentinel, counting down from `first_sentinel_id` (vocab_size - 1)."""
    previous_is_noise = np.concatenate([[False], noise_mask[:-1]])
    first_noise_tokens = noise_mask & ~previous_is_noise
    subsequent_noise_tokens = noise_mask & previous_is_noise
    sentinels = first_sentinel_id + 1 - np.cumsum(first_noise_tokens)
    return np.where(first_noise_tokens, sentinels, tokens)[~subsequent_noise_tokens]


def random_spans_helper(inputs_length: int, noise_density: float, mean_noise_span_length: float,
                        extra_tokens_per_span_inputs: int = 1,
                        extra_tokens_per_span_targets: int = 1) -> tuple[int, int]:
    """(tokens_length, targets_length): raw tokens whose corrupted inputs, eos included, fill inputs_length.

    The reference's search (in float64, as it is Python there): the largest
    tokens_length whose inputs fit, and the targets' length for it; at density 0.5
    both shrink by one so targets match inputs. 512, 0.15, 3.0 -> (568, 114).
    """
    def inputs_and_targets_length(tokens_length: int) -> tuple[int, int]:
        num_noise_tokens = int(round(tokens_length * noise_density))
        num_nonnoise_tokens = tokens_length - num_noise_tokens
        num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
        return (num_nonnoise_tokens + num_noise_spans * extra_tokens_per_span_inputs + 1,
                num_noise_tokens + num_noise_spans * extra_tokens_per_span_targets + 1)

    tokens_length = inputs_length - 1
    while inputs_and_targets_length(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs_length, targets_length = inputs_and_targets_length(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def corrupt_spans(rng: np.random.Generator, tokens: np.ndarray, noise_density: float, mean_noise_span_length: float,
                  first_sentinel_id: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one sequence: T5's span_corruption, eos appended to both."""
    noise_mask = random_spans_noise_mask(rng, len(tokens), noise_density, mean_noise_span_length)
    inputs = noise_span_to_unique_sentinel(tokens, noise_mask, first_sentinel_id)
    targets = noise_span_to_unique_sentinel(tokens, ~noise_mask, first_sentinel_id)
    return np.append(inputs, eos_id), np.append(targets, eos_id)


class SpanCorruptionCollator:
    """Batches for T5: encoder_tokens, decoder_tokens, labels, encoder/decoder padding masks.

    Each item's `raw_length` tokens (from `random_spans_helper`) are corrupted so the
    inputs fill `encoder_length` (or one less, padded) and the targets fit the
    reference's targets_length, the decoder length. Items carry S + 1 tokens and all
    are used, so the loader's seq_length must be `packed_seq_length` = raw_length - 1.
    Decoder inputs are the targets shifted right behind pad (T5's decoder_start_token_id).
    """

    def __init__(self, tokenizer_info: TokenizerInfo, seed: int, encoder_length: int, noise_density: float = 0.15,
                 mean_noise_span_length: float = 3.0) -> None:
        if not 0.0 < noise_density < 1.0 or mean_noise_span_length < 1.0 or encoder_length < 3:
            raise DataError(f"noise_density={noise_density} must lie in (0, 1), mean_noise_span_length="
                            f"{mean_noise_span_length} be >= 1 and encoder_length={encoder_length} >= 3; "
                            "T5 uses 0.15, 3.0 and 512")
        self.tokenizer_info, self.seed, self.encoder_length = tokenizer_info, seed, encoder_length
        self.noise_density, self.mean_noise_span_length = noise_density, mean_noise_span_length
        self.raw_length, self.decoder_length = random_spans_helper(encoder_length, noise_density,
                                                                   mean_noise_span_length)
        self.packed_seq_length = self.raw_length - 1
        self._check_lengths()

    def _check_lengths(self) -> None:
        """Fail at construction if the sentinels run out or the float32 counts overflow the helper's lengths."""
        num_noise_tokens, num_noise_spans = noise_span_counts(self.raw_length, self.noise_density,
                                                              self.mean_noise_span_length)
        num_sentinels = len(self.tokenizer_info.sentinel_ids)
        if num_noise_spans > num_sentinels:
            raise DataError(f"T5 span corruption with encoder_length={self.encoder_length} makes {num_noise_spans} "
                            f"noise spans per sequence but the tokenizer has {num_sentinels} sentinels; "
                            f"prepare the data with num_sentinels >= {num_noise_spans} or shorten encoder_length")
        inputs_length = self.raw_length - num_noise_tokens + num_noise_spans + 1
        targets_length = num_noise_tokens + num_noise_spans + 1
        if inputs_length > self.encoder_length or targets_length > self.decoder_length:
            raise DataError(f"noise_density={self.noise_density} with mean_noise_span_length="
                            f"{self.mean_noise_span_length} makes inputs of {inputs_length} and targets of "
                            f"{targets_length} tokens from {self.raw_length}, beyond encoder_length="
                            f"{self.encoder_length} or decoder_length={self.decoder_length}; "
                            "nudge noise_density or encoder_length")

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        info = self.tokenizer_info
        pairs = []
        for item in items:
            tokens = np.asarray(item["tokens"], dtype=np.int64)
            if len(tokens) != self.raw_length:
                raise DataError(f"T5 span corruption for encoder_length={self.encoder_length} needs items of "
                                f"raw_length={self.raw_length} tokens, got {len(tokens)}: build the loader with "
                                f"seq_length=packed_seq_length={self.packed_seq_length}")
            rng = sequence_rng(self.seed, item["global_index"], NoiseTag.SPAN_CORRUPTION)
            pairs.append(corrupt_spans(rng, tokens, self.noise_density, self.mean_noise_span_length,
                                       info.sentinel_ids[0], info.eos_id))
        return encoder_decoder_batch(pairs, items, self.encoder_length, self.decoder_length, info.pad_id)


def t5_span_corruption_collator(tokenizer_info: TokenizerInfo, seed: int, encoder_length: int,
                                noise_density: float = 0.15,
                                mean_noise_span_length: float = 3.0) -> SpanCorruptionCollator:
    """T5's pretraining collator; read `.raw_length`, `.packed_seq_length` and `.decoder_length` from it."""
    return SpanCorruptionCollator(tokenizer_info, seed, encoder_length, noise_density, mean_noise_span_length)


def _span_corruption(config: Config, info: TokenizerInfo, family: ModelFamily) -> SpanCorruptionCollator:
    objective = config.objective
    return t5_span_corruption_collator(info, config.train.seed, config.model.seq_length, objective.noise_density,
                                       objective.mean_noise_span_length)


SPAN_CORRUPTION = TrainingObjective("span_corruption", _span_corruption)
