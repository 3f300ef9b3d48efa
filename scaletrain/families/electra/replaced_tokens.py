"""ELECTRA's replaced token detection batches (Clark et al. 2020): BERT's masked-LM batch plus the
uniform noise with which the model samples the generator's replacements.

Masking: 15% of the non-special tokens, as BERT (data/masking.py), replaced 85% by [MASK] and 15%
kept, none by a random token. That is ELECTRA's own split (google-research/electra,
pretrain_helpers.mask: 85% [MASK]), not BERT's 80/10/10: the generator's samples already put other
tokens at the chosen positions for the discriminator, so BERT's random replacements would only add
unlabelled noise to the generator's input.

Sampling noise: one uniform in [0, 1) per position, drawn from (seed, global index) like the
masking noise, so a resumed run and every layout (TP, DP/ZeRO) sample the same replacement tokens;
the model uses the uniforms at the masked positions (families/electra/model.py sample_from_vocab_parallel).

REPLACED_TOKEN_DETECTION is the objective ELECTRA's spec owns, masking as the objective: section says.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from scaletrain.config import Config
from scaletrain.data.masking import MaskedLMCollator, MaskingConfig
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng
from scaletrain.model.family import ModelFamily, TrainingObjective

ELECTRA_MASK_TOKEN_PROB = 0.85  # google-research/electra pretrain_helpers.mask
ELECTRA_RANDOM_TOKEN_PROB = 0.0
REPLACEMENT_UNIFORMS = "replacement_uniforms"  # the batch key the model samples with


class ReplacedTokenDetectionCollator:
    """MaskedLMCollator's batch (tokens, token_types, padding_mask, labels, global_index) plus
    `replacement_uniforms` [batch, seq] float64."""

    def __init__(self, masked_lm: MaskedLMCollator) -> None:
        self.masked_lm = masked_lm
        self.packed_seq_length = masked_lm.packed_seq_length

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = self.masked_lm(items)
        seed, seq_length = self.masked_lm.seed, batch["tokens"].shape[1]
        uniforms = np.stack([
            sequence_rng(seed, item["global_index"], NoiseTag.REPLACED_TOKEN_SAMPLING).random(seq_length)
            for item in items
        ])
        batch[REPLACEMENT_UNIFORMS] = torch.from_numpy(uniforms)
        return batch


def replaced_token_detection_collator(tokenizer_info: TokenizerInfo, seed: int, seq_length: int, *,
                                      mask_prob: float = 0.15, whole_word_masking: bool = False,
                                      span_masking: bool = False) -> ReplacedTokenDetectionCollator:
    """ELECTRA's collator: packed `[CLS] text [SEP]` sequences masked with ELECTRA's 85/0/15 split."""
    masking = MaskingConfig(mask_prob=mask_prob, mask_token_prob=ELECTRA_MASK_TOKEN_PROB,
                            random_token_prob=ELECTRA_RANDOM_TOKEN_PROB, whole_word_masking=whole_word_masking,
                            span_masking=span_masking)
    return ReplacedTokenDetectionCollator(MaskedLMCollator(tokenizer_info, seed, seq_length, masking))


def _replaced_token_detection(config: Config, info: TokenizerInfo,
                              family: ModelFamily) -> ReplacedTokenDetectionCollator:
    objective = config.objective
    return replaced_token_detection_collator(
        info, config.train.seed, config.model.seq_length, mask_prob=objective.mask_prob,
        whole_word_masking=objective.whole_word_masking, span_masking=objective.span_masking,
    )


REPLACED_TOKEN_DETECTION = TrainingObjective("replaced_token_detection", _replaced_token_detection)
