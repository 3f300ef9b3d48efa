"""BERT masked-LM noise (Devlin et al. 2019; RoBERTa; SpanBERT) and its collator.

Which tokens are chosen: `round(mask_prob * n)` of a sequence's n non-special
tokens (Python's round, ties to even, at least 1), as Megatron's and Google's
`create_masked_lm_predictions` (`max(1, int(round(n * masked_lm_prob)))`),
counting only maskable tokens, not [CLS]/[SEP]/eos. Chosen tokens are drawn in
*units*: single tokens, or whole words with `whole_word_masking` (Google's BERT
whole-word release: words that no longer fit the budget are skipped).
With `span_masking` (SpanBERT, Joshi et al. 2020, sec. 3.1) units are taken in
contiguous spans of Geometric(p)-distributed length until the budget is spent.

What happens to them (Devlin et al. 2019, sec. 3.1 and app. A): 80% -> [MASK],
10% -> a uniformly random ordinary (non-special, non-sentinel) token, 10% kept;
labels hold the original id at chosen positions and -100 elsewhere. BERT and
whole-word masking decide per token; SpanBERT decides per span ("we perform
this replacement at the span level and not for each token individually").

For SpanBERT's span boundary objective (sec. 3.2) the collator also gives every
masked position the two unmasked tokens around its masked run and its 1-based
place in the run (`span_boundaries`). Spans that touch are one run, as SpanBERT's
code merges them (`merge_intervals` in pretraining/fairseq/data/masking.py), so the
boundaries are always unmasked tokens. A run never touches the sequence's edges:
[CLS] and [SEP] are special and never masked (SpanBERT's code drops such spans
from its boundary targets instead). A boundary may be a special token ([CLS],
[SEP], the eos between documents), used as is, as SpanBERT's code does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scaletrain.batch import IGNORE_INDEX
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng

# Batch keys of `span_boundaries`, [batch, seq] each, 0 at positions that are not masked.
SPAN_BOUNDARY_KEYS = ("left_boundary", "right_boundary", "span_position")


@dataclass(frozen=True)
class MaskingConfig:
    """BERT's 15% with 80/10/10 by default; SpanBERT's Geometric(0.2) clipped to 10 for spans."""

    mask_prob: float = 0.15
    mask_token_prob: float = 0.8
    random_token_prob: float = 0.1
    whole_word_masking: bool = False
    span_masking: bool = False
    span_geometric_p: float = 0.2
    max_span_length: int = 10

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_prob < 1.0:
            raise DataError(f"mask_prob={self.mask_prob} must lie in (0, 1); BERT uses 0.15")
        if self.mask_token_prob < 0 or self.random_token_prob < 0 or self.mask_token_prob + self.random_token_prob > 1:
            raise DataError(f"mask_token_prob={self.mask_token_prob} and random_token_prob={self.random_token_prob} "
                            "must be non-negative with a sum of at most 1; BERT uses 0.8 and 0.1")
        if not 0.0 < self.span_geometric_p <= 1.0 or self.max_span_length < 1:
            raise DataError(f"span_geometric_p={self.span_geometric_p} must lie in (0, 1] and max_span_length="
                            f"{self.max_span_length} be at least 1; SpanBERT uses 0.2 and 10")


@dataclass(frozen=True)
class MaskedSequence:
    """One sequence after masking: model inputs, labels, and the replacement groups (token spans) chosen."""

    inputs: np.ndarray
    labels: np.ndarray
    spans: np.ndarray  # [num_groups, 2] half-open token ranges; one 80/10/10 decision each


def masking_budget(num_candidates: int, mask_prob: float) -> int:
    """Tokens to choose: round(mask_prob * n), ties to even, at least 1 if there is any candidate (Megatron)."""
    if num_candidates == 0:
        return 0
    return max(1, round(mask_prob * num_candidates))


def span_length_distribution(geometric_p: float, max_span_length: int) -> np.ndarray:
    """P(length = k) for k = 1..max: Geometric(p) truncated at max and renormalized.

    This is SpanBERT's code (`len_distrib`, normalized by its sum), which gives the
    paper's mean of 3.8 for p=0.2, max=10; min(Geometric, 10) would give 4.46.
    """
    lengths = np.arange(1, max_span_length + 1)
    weights = geometric_p * (1.0 - geometric_p) ** (lengths - 1)
    return weights / weights.sum()


def masking_units(tokens: np.ndarray, candidates: np.ndarray, info: TokenizerInfo,
                  whole_words: bool) -> tuple[np.ndarray, np.ndarray]:
    """Half-open token ranges (starts, ends) of the units masking chooses from: tokens, or whole words.

    A word is a run of candidate tokens that starts at a piece beginning with
    whitespace ("▁"), after a line break, or after a non-candidate (special) token.
    """
    if not whole_words:
        starts = np.flatnonzero(candidates)
        return starts, starts + 1
    after_boundary = np.ones(len(tokens), dtype=bool)
    after_boundary[1:] = ~candidates[:-1] | info.ends_word[tokens[:-1]]
    is_start = candidates & (info.starts_word[tokens] | after_boundary)
    positions = np.flatnonzero(candidates)
    unit_of_position = np.cumsum(is_start)[positions]
    last_of_unit = np.flatnonzero(np.diff(np.append(unit_of_position, -1)) != 0)
    return np.flatnonzero(is_start), positions[last_of_unit] + 1


def choose_units_independently(rng: np.random.Generator, sizes: np.ndarray, budget: int) -> np.ndarray:
    """Indices of units taken in random order, each only if it still fits the budget (Google BERT's whole-word rule).

    With single tokens this is simply `budget` tokens drawn without replacement.
    """
    chosen: list[int] = []
    remaining = budget
    for unit in rng.permutation(len(sizes)):
        if remaining == 0:
            break
        if sizes[unit] <= remaining:
            chosen.append(int(unit))
            remaining -= int(sizes[unit])
    return np.array(chosen, dtype=np.int64)


def choose_unit_spans(rng: np.random.Generator, starts: np.ndarray, ends: np.ndarray, budget: int,
                      length_distribution: np.ndarray) -> list[tuple[int, int]]:
    """SpanBERT: repeatedly draw a span length in units and a uniformly random free start unit.

    The span grows over following units while they are free, adjacent (no special
    token in between) and fit the remaining budget, so spans never overlap and the
    budget is never exceeded. Returns (first_unit, last_unit + 1) per span.
    """
    sizes = ends - starts
    adjacent_to_next = np.append(ends[:-1] == starts[1:], False)
    taken = np.zeros(len(sizes), dtype=bool)
    spans: list[tuple[int, int]] = []
    remaining = budget
    while remaining > 0:
        free = np.flatnonzero(~taken & (sizes <= remaining))
        if len(free) == 0:
            break
        first = int(rng.choice(free))
        length = 1 + int(rng.choice(len(length_distribution), p=length_distribution))
        last = first
        while True:
            taken[last], remaining = True, remaining - int(sizes[last])
            nxt = last + 1
            if (nxt - first == length or not adjacent_to_next[last] or taken[nxt] or sizes[nxt] > remaining):
                break
            last = nxt
        spans.append((first, last + 1))
    return spans


def mask_sequence(rng: np.random.Generator, tokens: np.ndarray, info: TokenizerInfo, config: MaskingConfig,
                  ordinary_ids: np.ndarray) -> MaskedSequence:
    """Choose and replace tokens of one sequence; special tokens are never chosen."""
    candidates = ~info.is_special(tokens)
    starts, ends = masking_units(tokens, candidates, info, config.whole_word_masking)
    budget = masking_budget(int(candidates.sum()), config.mask_prob)
    if config.span_masking:
        distribution = span_length_distribution(config.span_geometric_p, config.max_span_length)
        unit_spans = choose_unit_spans(rng, starts, ends, budget, distribution)
        spans = np.array([(starts[a], ends[b - 1]) for a, b in unit_spans], dtype=np.int64).reshape(-1, 2)
    else:
        chosen_units = choose_units_independently(rng, ends - starts, budget)
        positions = np.concatenate([np.arange(starts[u], ends[u]) for u in chosen_units] or [np.zeros(0, np.int64)])
        spans = np.stack([positions, positions + 1], axis=1)  # BERT decides per token
    return _replace(rng, tokens, spans, config, ordinary_ids, info.mask_id)


def _replace(rng: np.random.Generator, tokens: np.ndarray, spans: np.ndarray, config: MaskingConfig,
             ordinary_ids: np.ndarray, mask_id: int) -> MaskedSequence:
    """80/10/10 per span (group): [MASK], random ordinary tokens, or unchanged; labels at every chosen token."""
    lengths = spans[:, 1] - spans[:, 0]
    positions = np.concatenate([np.arange(a, b) for a, b in spans] or [np.zeros(0, np.int64)]).astype(np.int64)
    decision = np.repeat(rng.random(len(spans)), lengths)
    random_tokens = rng.choice(ordinary_ids, size=len(positions))
    inputs = tokens.copy()
    to_mask = decision < config.mask_token_prob
    to_random = ~to_mask & (decision < config.mask_token_prob + config.random_token_prob)
    inputs[positions[to_mask]] = mask_id
    inputs[positions[to_random]] = random_tokens[to_random]
    labels = np.full_like(tokens, IGNORE_INDEX)
    labels[positions] = tokens[positions]
    return MaskedSequence(inputs=inputs, labels=labels, spans=spans)


def span_boundaries(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(left, right, position) per position of one sequence's labels: for each labelled (masked) token,
    the positions of the unmasked tokens just before and after its contiguous masked run, and its place
    in the run, 1 for the first token (SpanBERT's x_{s-1}, x_{e+1} and p_{i-s+1}); 0 elsewhere."""
    masked = labels != IGNORE_INDEX
    left, right, position = (np.zeros(len(labels), dtype=np.int64) for _ in range(3))
    starts = np.flatnonzero(masked & ~np.append(False, masked[:-1]))
    ends = np.flatnonzero(masked & ~np.append(masked[1:], False)) + 1  # half-open
    if len(starts) and (starts[0] == 0 or ends[-1] == len(labels)):
        raise DataError("a masked run touches the sequence's edge, so it has no boundary token on that side; "
                        "the MLM collator frames every sequence in [CLS] ... [SEP], which are never masked")
    for start, end in zip(starts, ends, strict=True):
        left[start:end], right[start:end] = start - 1, end
        position[start:end] = np.arange(1, end - start + 1)
    return left, right, position


class MaskedLMCollator:
    """Batches for BERT/RoBERTa MLM: tokens, token_types, padding_mask, labels (+ sentence_order_labels,
    + SPAN_BOUNDARY_KEYS with `span_boundary`).

    Packed items (the default, RoBERTa's FULL-SENTENCES, Liu et al. 2019 sec. 4.2)
    become `[CLS] item [SEP]`, exactly seq_length long, token_types all 0. The
    eos that the packed stream holds between documents stays: RoBERTa adds "an
    extra separator token between documents", and eos is special, so never masked.
    Items carry S + 1 tokens and all are used, so the loader's seq_length must be
    `packed_seq_length` = seq_length - 3. With `sentence_pairs=True` items come from
    `SentencePairDataset` ([CLS] A [SEP] B [SEP] with token types and labels) and
    are padded to seq_length.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, seed: int, seq_length: int,
                 config: MaskingConfig = MaskingConfig(), sentence_pairs: bool = False,
                 span_boundary: bool = False) -> None:
        if seq_length < 4:
            raise DataError(f"seq_length={seq_length} leaves no room for text between [CLS] and [SEP]; use >= 4")
        self.tokenizer_info, self.seed, self.seq_length, self.config = tokenizer_info, seed, seq_length, config
        self.sentence_pairs, self.span_boundary = sentence_pairs, span_boundary
        self.packed_seq_length = None if sentence_pairs else seq_length - 3
        self._ordinary_ids = tokenizer_info.ordinary_ids()

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        info = self.tokenizer_info
        tokens = np.full((len(items), self.seq_length), info.pad_id, dtype=np.int64)
        labels = np.full_like(tokens, IGNORE_INDEX)
        token_types = np.zeros_like(tokens)
        padding_mask = np.zeros_like(tokens)
        for row, item in enumerate(items):
            sequence, types = self._format(item)
            rng = sequence_rng(self.seed, item["global_index"], NoiseTag.MLM)
            masked = mask_sequence(rng, sequence, info, self.config, self._ordinary_ids)
            length = len(sequence)
            tokens[row, :length], labels[row, :length] = masked.inputs, masked.labels
            token_types[row, :length], padding_mask[row, :length] = types, 1
        batch = {"tokens": tokens, "token_types": token_types, "padding_mask": padding_mask, "labels": labels}
        if self.span_boundary:  # a function of the labels alone: no randomness of its own
            per_row = [span_boundaries(row) for row in labels]
            batch |= {key: np.stack([row[part] for row in per_row]) for part, key in enumerate(SPAN_BOUNDARY_KEYS)}
        if self.sentence_pairs:
            batch["sentence_order_labels"] = np.array([item["sentence_order_label"] for item in items])
        batch["global_index"] = np.array([item["global_index"] for item in items])
        return {key: torch.from_numpy(value).long() for key, value in batch.items()}

    def _format(self, item: dict) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, token_types) of one item, unpadded."""
        sequence = np.asarray(item["tokens"], dtype=np.int64)
        if self.sentence_pairs:
            if "token_types" not in item or len(sequence) > self.seq_length:
                raise DataError(f"sentence-pair MLM needs SentencePairDataset items of at most seq_length="
                                f"{self.seq_length} tokens with token_types; got keys {sorted(item)} and "
                                f"{len(sequence)} tokens")
            return sequence, np.asarray(item["token_types"], dtype=np.int64)
        if len(sequence) != self.seq_length - 2:
            raise DataError(f"MLM with seq_length={self.seq_length} needs packed items of {self.seq_length - 2} "
                            f"tokens, got {len(sequence)}: build the loader with seq_length=packed_seq_length="
                            f"{self.packed_seq_length}")
        info = self.tokenizer_info
        return np.concatenate([[info.cls_id], sequence, [info.sep_id]]), np.zeros(self.seq_length, dtype=np.int64)


def mlm_collator(tokenizer_info: TokenizerInfo, seed: int, seq_length: int, *, sentence_pairs: bool = False,
                 whole_word_masking: bool = False, span_masking: bool = False, mask_prob: float = 0.15,
                 span_boundary: bool = False) -> MaskedLMCollator:
    """The MLM collator for a config's options, with BERT's 80/10/10 and SpanBERT's span lengths."""
    config = MaskingConfig(mask_prob=mask_prob, whole_word_masking=whole_word_masking, span_masking=span_masking)
    return MaskedLMCollator(tokenizer_info, seed, seq_length, config, sentence_pairs, span_boundary)
