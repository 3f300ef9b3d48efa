"""Encoder-decoder batches (T5's layout) and the encoder-decoder prefix LM (Raffel et al. 2020, sec. 3.2.3)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from scaletrain.batch import IGNORE_INDEX
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng


def encoder_decoder_batch(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], items: Sequence[dict], encoder_length: int,
    decoder_length: int, pad_id: int, decoder_start_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """Pad (inputs, targets) pairs into T5's batch; decoder inputs are the targets shifted right
    behind decoder_start_id (None: pad, T5's decoder_start_token_id; BART's is eos). Padding masks
    are explicit, never inferred from ids."""
    encoder_tokens = np.full((len(pairs), encoder_length), pad_id, dtype=np.int64)
    encoder_padding_mask = np.zeros_like(encoder_tokens)
    targets = np.full((len(pairs), decoder_length), IGNORE_INDEX, dtype=np.int64)
    for row, (inputs, target) in enumerate(pairs):
        encoder_tokens[row, :len(inputs)], targets[row, :len(target)] = inputs, target
        encoder_padding_mask[row, :len(inputs)] = 1
    decoder_padding_mask = targets != IGNORE_INDEX
    decoder_tokens = np.full_like(targets, pad_id)
    decoder_tokens[:, 0] = pad_id if decoder_start_id is None else decoder_start_id
    decoder_tokens[:, 1:] = np.where(decoder_padding_mask[:, :-1], targets[:, :-1], pad_id)
    batch = {
        "encoder_tokens": encoder_tokens, "decoder_tokens": decoder_tokens, "labels": targets,
        "encoder_padding_mask": encoder_padding_mask, "decoder_padding_mask": decoder_padding_mask,
        "global_index": np.array([item["global_index"] for item in items]),
    }
    return {key: torch.from_numpy(value).long() for key, value in batch.items()}


class EncoderDecoderPrefixLMCollator:
    """Prefix LM for T5: a text of encoder_length tokens splits at P, uniform over [1, encoder_length - 1];
    the encoder reads the prefix (+ eos), the decoder predicts the rest (+ eos).

    Items hold encoder_length tokens, so the loader's seq_length is encoder_length - 1 (it reads S + 1).
    """

    def __init__(self, tokenizer_info: TokenizerInfo, seed: int, encoder_length: int) -> None:
        if encoder_length < 3:
            raise DataError(f"encoder_length={encoder_length} leaves no split point for a prefix LM; use >= 3")
        self.tokenizer_info, self.seed, self.encoder_length = tokenizer_info, seed, encoder_length
        self.decoder_length = encoder_length
        self.packed_seq_length = encoder_length - 1

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        eos = self.tokenizer_info.eos_id
        pairs = []
        for item in items:
            tokens = np.asarray(item["tokens"], dtype=np.int64)
            if len(tokens) != self.encoder_length:
                raise DataError(f"the T5 prefix LM needs items of {self.encoder_length} tokens, got {len(tokens)}: "
                                f"build the loader with seq_length={self.packed_seq_length}")
            split = int(sequence_rng(self.seed, item["global_index"], NoiseTag.PREFIX_LM).integers(1, len(tokens)))
            pairs.append((np.append(tokens[:split], eos), np.append(tokens[split:], eos)))
        return encoder_decoder_batch(pairs, items, self.encoder_length, self.decoder_length, self.tokenizer_info.pad_id)
