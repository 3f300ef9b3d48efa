"""Collators per training objective: turn a list of GlobalIndexDataset items into model inputs.

Each collator receives items carrying `global_index`, so objectives with
their own noise (BERT masking, T5 span corruption) can seed it from
(seed, global_index) and stay exactly resumable.

Here: causal LM and prefix LM, plus what every objective's collator shares
(`sequence_rng`, `TokenizerInfo`). BERT's lives in `masking`, NSP/SOP pairs in
`sentence_pairs`; a collator only one family uses lives in its folder (T5's span
corruption, ELECTRA's replaced tokens, BART's noising). Collators are top-level
classes, so DataLoader workers can pickle them; each one exposes
`packed_seq_length`, the seq_length to build the loader with.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from scaletrain.batch import DOCUMENT_IDS, IGNORE_INDEX
from scaletrain.data.errors import DataError
from scaletrain.data.tokenizer import Tokenizer


class Collator(Protocol):
    """What every objective's collator is: items (each with its global_index) -> a batch of model
    inputs, and `packed_seq_length`, the seq_length to build its loader with (None: whole documents)."""

    packed_seq_length: int | None

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]: ...


def causal_lm_collate(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Next-token prediction: tokens = sample[:-1], labels = sample[1:] (samples hold S + 1 tokens)."""
    samples = torch.from_numpy(np.stack([item["tokens"] for item in items]))
    return {
        "tokens": samples[:, :-1].contiguous(),
        "labels": samples[:, 1:].contiguous(),
        "global_index": torch.tensor([item["global_index"] for item in items], dtype=torch.long),
    }


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[batch, seq] int64: which packed document each input token is in, counting from 0 per sequence.

    The loader joins documents with an eos after each (data/dataset.py). The eos opens the document
    after it rather than closing the one before: its label is that document's first token, which it
    then predicts from itself alone, as `scaletrain generate` starts a text from [eos, prompt...]; and
    the eos is still every document's last label, predicted from within it. A sequence's first ids
    belong to the tail of a document cut by the packing (0).
    """
    return torch.cumsum(tokens == eos_id, dim=1)


class CausalLMCollator:
    """causal_lm_collate for a loader of seq_length tokens per sequence (it reads S + 1); with an
    `eos_id`, also the `document_ids` of the packed documents, for models that mask or position by them."""

    def __init__(self, seq_length: int, eos_id: int | None = None) -> None:
        self.packed_seq_length, self.eos_id = seq_length, eos_id

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = causal_lm_collate(items)
        if self.eos_id is not None:
            batch[DOCUMENT_IDS] = document_ids(batch["tokens"], self.eos_id)
        return batch


class NoiseTag(enum.IntEnum):
    """Third word of each per-sequence seed, so objectives sharing (seed, global_index) draw independent noise."""

    MLM = 1
    SENTENCE_PAIRS = 2
    SPAN_CORRUPTION = 3
    PREFIX_LM = 4
    DENOISING = 5
    REPLACED_TOKEN_SAMPLING = 6  # ELECTRA's generator samples (families/electra/replaced_tokens.py)


def sequence_rng(seed: int, global_index: int, tag: NoiseTag) -> np.random.Generator:
    """The generator for one sequence's noise: a function of (seed, global index, objective) alone.

    Resuming from consumed_samples therefore redraws exactly the same noise, and a
    sample seen again in a later epoch (a new global index) gets fresh noise,
    RoBERTa's dynamic masking (Liu et al. 2019, sec. 4.1).
    """
    return np.random.default_rng([int(seed), int(global_index), int(tag)])


@dataclass(frozen=True)
class TokenizerInfo:
    """What collators need from the tokenizer, small and picklable (no sentencepiece in DataLoader workers).

    `starts_word[id]`: the piece begins a word (it decodes with leading whitespace,
    sentencepiece's "▁"). `ends_word[id]`: the next piece begins a new word even
    without "▁" (the piece ends in a line break or tab: after a newline byte,
    sentencepiece writes the next word with no "▁"). Both feed whole-word masking.
    `ends_sentence[id]`: the piece ends a sentence (`_sentence_end_table`): where BART's
    sentence permutation splits a text.
    """

    vocab_size: int
    pad_id: int
    eos_id: int
    mask_id: int
    cls_id: int
    sep_id: int
    newline_id: int
    special_ids: tuple[int, ...]
    sentinel_ids: tuple[int, ...]
    starts_word: np.ndarray = field(compare=False, repr=False)
    ends_word: np.ndarray = field(compare=False, repr=False)
    ends_sentence: np.ndarray = field(compare=False, repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> TokenizerInfo:
        starts_word, ends_word = _word_boundary_tables(tokenizer)
        newline = tokenizer.encode("\n")[-1]
        if tokenizer.decode([newline]) != "\n":
            raise DataError(f"the tokenizer encodes '\\n' as {tokenizer.encode(chr(10))}, not as one newline piece; "
                            "sentence splitting needs byte fallback for '\\n' (train it with train_tokenizer)")
        return cls(
            vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
            mask_id=tokenizer.mask_id, cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, newline_id=newline,
            special_ids=tuple(sorted(tokenizer.special_ids)),
            sentinel_ids=tuple(tokenizer.sentinel_id(i) for i in range(tokenizer.num_sentinels)),
            starts_word=starts_word, ends_word=ends_word, ends_sentence=_sentence_end_table(tokenizer),
        )

    def is_special(self, tokens: np.ndarray) -> np.ndarray:
        """Elementwise: is the token a special id (pad..sep or a sentinel), never ordinary text."""
        return np.isin(tokens, self.special_ids)

    def ordinary_ids(self) -> np.ndarray:
        """Every id that is ordinary text: BERT's random replacements are drawn from these."""
        return np.setdiff1d(np.arange(self.vocab_size), self.special_ids)


def _word_boundary_tables(tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Per-id word-boundary flags, read from how each piece decodes after a letter.

    Decoding the piece alone would drop a leading "▁" (sentencepiece strips it
    at the start of a text), so each piece is decoded after the pieces of "a".
    """
    prefix = tokenizer.encode("a")
    prefix_length = len(tokenizer.decode(prefix))
    starts_word = np.zeros(tokenizer.vocab_size, dtype=bool)
    ends_word = np.zeros(tokenizer.vocab_size, dtype=bool)
    for token in range(tokenizer.vocab_size):
        if token in tokenizer.special_ids:
            continue
        text = tokenizer.decode([*prefix, token])[prefix_length:]
        starts_word[token] = text[:1].isspace()
        ends_word[token] = text[-1:].isspace() and text[-1:] != " "
    starts_word.setflags(write=False)
    ends_word.setflags(write=False)
    return starts_word, ends_word


SENTENCE_END_MARKS = (".", "!", "?")
CLOSING_MARKS = "\"')]\u201d\u2019"


def _sentence_end_table(tokenizer: Tokenizer) -> np.ndarray:
    """Per-id flag: the piece ends a sentence. Its text (decoded after "a", as in
    `_word_boundary_tables`) ends in a line break, or, past closing quotes and brackets, in
    . ! or ?; and eos, which ends every document in packed samples. An abbreviation's period
    ("Mr.") counts too: tokenized text keeps no more than its pieces to tell them apart."""
    prefix = tokenizer.encode("a")
    prefix_length = len(tokenizer.decode(prefix))
    ends_sentence = np.zeros(tokenizer.vocab_size, dtype=bool)
    for token in range(tokenizer.vocab_size):
        if token in tokenizer.special_ids:
            continue
        text = tokenizer.decode([*prefix, token])[prefix_length:]
        ends_sentence[token] = text.endswith("\n") or text.rstrip().rstrip(CLOSING_MARKS).endswith(SENTENCE_END_MARKS)
    ends_sentence[tokenizer.eos_id] = True
    ends_sentence.setflags(write=False)
    return ends_sentence


class PrefixLMCollator:
    """Prefix LM (Raffel et al. 2020, sec. 3.2.3) for decoder-only models: tokens, labels, prefix_lengths.

    Each sequence splits at P, uniform over [1, S - 1]: positions [0, P) form the
    prefix, which the model attends bidirectionally; the loss covers the rest.
    tokens = item[:-1] and labels = item[1:] as for causal LM (the loader's
    seq_length is S), with labels[t] = -100 for t < P - 1: those predict prefix
    tokens, which the prefix's bidirectional attention lets position t see.
    Position P - 1 keeps its label, the first target token, still unseen there. With an `eos_id` the
    batch also holds `document_ids`, as CausalLMCollator's.
    """

    def __init__(self, seed: int, seq_length: int, eos_id: int | None = None) -> None:
        if seq_length < 2:
            raise DataError(f"seq_length={seq_length} leaves no split point for a prefix LM; use >= 2")
        self.seed, self.seq_length, self.packed_seq_length = seed, seq_length, seq_length
        self.eos_id = eos_id

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = causal_lm_collate(items)
        if batch["tokens"].shape[1] != self.seq_length:
            raise DataError(f"prefix LM with seq_length={self.seq_length} got items of {batch['tokens'].shape[1] + 1} "
                            f"tokens; build the loader with seq_length={self.seq_length}")
        prefix_lengths = torch.tensor([
            int(sequence_rng(self.seed, item["global_index"], NoiseTag.PREFIX_LM).integers(1, self.seq_length))
            for item in items
        ], dtype=torch.long)
        positions = torch.arange(self.seq_length)
        batch["labels"] = batch["labels"].masked_fill(positions[None, :] < prefix_lengths[:, None] - 1, IGNORE_INDEX)
        batch["prefix_lengths"] = prefix_lengths
        if self.eos_id is not None:
            batch[DOCUMENT_IDS] = document_ids(batch["tokens"], self.eos_id)
        return batch


def prefix_lm_collator(seed: int, seq_length: int, eos_id: int | None = None) -> PrefixLMCollator:
    """The prefix-LM collator; `.packed_seq_length` is the loader's seq_length (equal to seq_length)."""
    return PrefixLMCollator(seed, seq_length, eos_id)
