"""BART's noising functions (Lewis et al. 2020, sec. 2.2) and its denoising collator.

The encoder reads a corrupted text, the decoder reproduces the original. Each function is a
function of the sample's generator alone (`sequence_rng(seed, global index, DENOISING)`), so the
noise is resumable and the same in every layout. They run in NOISING_FUNCTIONS' order:

    sentence_permutation  split the text after every sentence-end piece (TokenizerInfo.ends_sentence:
                          a piece ending in . ! ? or a line break, and eos) and shuffle the sentences
    document_rotation     rotate the text so that a uniformly chosen token starts it
    token_masking         replace round(mask_prob · n) uniformly chosen tokens by [MASK] (BERT's masking)
    token_deletion        delete round(deletion_ratio · n) uniformly chosen tokens
    text_infilling        spans with Poisson(λ = 3) lengths cover round(0.3 · n) tokens; each span
                          becomes ONE [MASK], and a 0-length span inserts one (sec. 2.2, 5.1)

The paper fixes no order; fairseq's implementation (fairseq/data/denoising_dataset.py) permutes
first and rotates last, after masking; here the text is rotated before the token-level noise, so
"a uniformly chosen token" is a token of the text. The paper's best (sec. 5.1, table 1) and the
default is text_infilling + sentence_permutation.

Example (spans in capitals): "a B C d. e f!" -> permuted "e f! a B C d." -> infilled "e f! a [MASK] d.",
target "a B C d. e f! </s>", decoder input "</s> a B C d. e f!".

DENOISING is the objective BART's spec owns, noising as the objective: section says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scaletrain.config import Config
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng
from scaletrain.data.seq2seq import encoder_decoder_batch
from scaletrain.model.family import ModelFamily, TrainingObjective

NOISING_FUNCTIONS = ("sentence_permutation", "document_rotation", "token_masking", "token_deletion", "text_infilling")


@dataclass(frozen=True)
class DenoisingNoise:
    """Which noising functions run and their rates (the objective: section, families/bart/model.py
    DenoisingObjective)."""

    functions: tuple[str, ...] = ("text_infilling", "sentence_permutation")
    infilling_ratio: float = 0.3
    poisson_lambda: float = 3.0
    masking_ratio: float = 0.15
    deletion_ratio: float = 0.15

    def __post_init__(self) -> None:
        unknown = [name for name in self.functions if name not in NOISING_FUNCTIONS]
        if unknown or not self.functions:
            raise DataError(f"BART noising functions {list(self.functions)}: {unknown or 'none'} not known; "
                            f"list one or more of {', '.join(NOISING_FUNCTIONS)}")


def token_budget(length: int, ratio: float) -> int:
    """Tokens a ratio of `length` covers: round half to even, as Python's round."""
    return round(ratio * length)


def permute_sentences(rng: np.random.Generator, tokens: np.ndarray, ends_sentence: np.ndarray) -> np.ndarray:
    """The sentences (each up to and including a sentence-end piece; the text's start and end may
    be cut mid-sentence) in a uniformly random order."""
    boundaries = np.flatnonzero(ends_sentence[tokens][:-1]) + 1
    sentences = np.split(tokens, boundaries)
    return np.concatenate([sentences[index] for index in rng.permutation(len(sentences))])


def rotate_document(rng: np.random.Generator, tokens: np.ndarray) -> np.ndarray:
    """The text rotated so that the token at a uniform position in [0, n) comes first."""
    return np.roll(tokens, -int(rng.integers(len(tokens))))


def mask_tokens(rng: np.random.Generator, tokens: np.ndarray, ratio: float, mask_id: int) -> np.ndarray:
    masked = tokens.copy()
    masked[rng.choice(len(tokens), token_budget(len(tokens), ratio), replace=False)] = mask_id
    return masked


def delete_tokens(rng: np.random.Generator, tokens: np.ndarray, ratio: float) -> np.ndarray:
    kept = np.ones(len(tokens), dtype=bool)
    kept[rng.choice(len(tokens), token_budget(len(tokens), ratio), replace=False)] = False
    return tokens[kept]


def poisson_span_lengths(rng: np.random.Generator, budget: int, poisson_lambda: float) -> np.ndarray:
    """Span lengths drawn from Poisson(λ) until they cover `budget` tokens; the last is cut to
    what remains (as fairseq's add_whole_word_mask), so they sum to the budget exactly. Zeros
    before it are insertions."""
    if budget == 0:
        return np.zeros(0, dtype=np.int64)
    draws = [rng.poisson(poisson_lambda, size=budget)]
    while sum(int(chunk.sum()) for chunk in draws) < budget:
        draws.append(rng.poisson(poisson_lambda, size=budget))
    lengths = np.concatenate(draws).astype(np.int64)
    covered = np.cumsum(lengths)
    last = int(np.searchsorted(covered, budget))  # the first draw that reaches the budget
    lengths = lengths[:last + 1]
    lengths[last] = budget - (covered[last - 1] if last else 0)
    return lengths


def infilling_spans(rng: np.random.Generator, length: int, ratio: float,
                    poisson_lambda: float) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of text infilling's spans over a text of `length`, in text order.

    The spans and the length - budget uncovered tokens are arranged in a uniformly random order,
    so spans never overlap and cover exactly the budget (tokens near the text's ends are covered
    less often: the first only when a span comes first). Insertions (0-length spans) are capped
    at the tokens the other spans save (sum of length - 1), so the input never outgrows the text:
    the encoder length is fixed. At λ = 3 that cap almost never binds.
    """
    lengths = poisson_span_lengths(rng, token_budget(length, ratio), poisson_lambda)
    covering = lengths[lengths > 0]
    inserts = min(int((lengths == 0).sum()), int((covering - 1).sum()))
    spans = rng.permutation(np.concatenate([covering, np.zeros(inserts, dtype=np.int64)]))
    slots = length - int(covering.sum()) + len(spans)
    is_span = np.zeros(slots, dtype=bool)
    is_span[rng.choice(slots, len(spans), replace=False)] = True
    consumed = np.ones(slots, dtype=np.int64)
    consumed[is_span] = spans
    return (np.cumsum(consumed) - consumed)[is_span], spans


def replace_spans(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, mask_id: int) -> np.ndarray:
    """Each span (ascending, non-overlapping) becomes one mask token."""
    pieces, cursor = [], 0
    for start, span_length in zip(starts.tolist(), lengths.tolist(), strict=True):
        pieces += [tokens[cursor:start], np.array([mask_id], dtype=tokens.dtype)]
        cursor = start + span_length
    pieces.append(tokens[cursor:])
    return np.concatenate(pieces)


def infill_text(rng: np.random.Generator, tokens: np.ndarray, ratio: float, poisson_lambda: float,
                mask_id: int) -> np.ndarray:
    starts, lengths = infilling_spans(rng, len(tokens), ratio, poisson_lambda)
    return replace_spans(tokens, starts, lengths, mask_id)


def add_noise(rng: np.random.Generator, tokens: np.ndarray, noise: DenoisingNoise, info: TokenizerInfo) -> np.ndarray:
    """The encoder input for `tokens`: noise.functions applied in NOISING_FUNCTIONS' order."""
    apply = {
        "sentence_permutation": lambda text: permute_sentences(rng, text, info.ends_sentence),
        "document_rotation": lambda text: rotate_document(rng, text),
        "token_masking": lambda text: mask_tokens(rng, text, noise.masking_ratio, info.mask_id),
        "token_deletion": lambda text: delete_tokens(rng, text, noise.deletion_ratio),
        "text_infilling": lambda text: infill_text(rng, text, noise.infilling_ratio, noise.poisson_lambda,
                                                   info.mask_id),
    }
    for name in NOISING_FUNCTIONS:
        if name in noise.functions:
            tokens = apply[name](tokens)
    return tokens


class DenoisingCollator:
    """Batches for BART: encoder_tokens (noised text + eos), labels (the text + eos), decoder_tokens
    (the labels shifted right behind eos, BART's decoder_start_token_id), and the padding masks.

    Items hold seq_length - 1 tokens, so with eos both sides fit seq_length (no noising function
    lengthens a text) and the loader's seq_length is packed_seq_length = seq_length - 2.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, seed: int, seq_length: int, noise: DenoisingNoise) -> None:
        if seq_length < 3:
            raise DataError(f"BART denoising with seq_length={seq_length} leaves no text besides eos; use >= 3")
        self.tokenizer_info, self.seed, self.noise = tokenizer_info, seed, noise
        self.encoder_length = self.decoder_length = seq_length
        self.packed_seq_length = seq_length - 2

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        info = self.tokenizer_info
        pairs = []
        for item in items:
            tokens = np.asarray(item["tokens"], dtype=np.int64)
            if len(tokens) != self.encoder_length - 1:
                raise DataError(f"BART denoising for seq_length={self.encoder_length} needs items of "
                                f"{self.encoder_length - 1} tokens, got {len(tokens)}: build the loader with "
                                f"seq_length=packed_seq_length={self.packed_seq_length}")
            noised = add_noise(sequence_rng(self.seed, item["global_index"], NoiseTag.DENOISING), tokens, self.noise,
                               info)
            pairs.append((np.append(noised, info.eos_id), np.append(tokens, info.eos_id)))
        return encoder_decoder_batch(pairs, items, self.encoder_length, self.decoder_length, info.pad_id,
                                     decoder_start_id=info.eos_id)


def _denoising(config: Config, info: TokenizerInfo, family: ModelFamily) -> DenoisingCollator:
    """BART's denoising (Lewis et al. 2020, sec. 2.2): token masking draws at objective.mask_prob."""
    objective = config.objective
    noise = DenoisingNoise(tuple(objective.noising), objective.infilling_ratio, objective.infilling_poisson_lambda,
                           objective.mask_prob, objective.deletion_ratio)
    return DenoisingCollator(info, config.train.seed, config.model.seq_length, noise)


DENOISING = TrainingObjective("denoising", _denoising)
