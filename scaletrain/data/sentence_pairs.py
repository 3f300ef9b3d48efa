"""Segment pairs `[CLS] A [SEP] B [SEP]` for next-sentence (BERT) or sentence-order (ALBERT) prediction.

As Google BERT's create_pretraining_data.py: documents are split into sentences
(here lines: after newline tokens, the byte piece <0x0A>), consecutive sentences are
grouped into chunks of about seq_length - 3 tokens, and a chunk is cut at a
random sentence boundary into A and B. NSP (Devlin et al. 2019, sec. 3.1):
half the time B is replaced by text from a random other document. SOP (Lan et
al. 2020, sec. 4.1): half the time A and B swap places. Label 0 means "in
order, true continuation", 1 "random B" (NSP) or "swapped" (SOP), as Hugging
Face's next_sentence_label and sentence_order_label.

Unlike Google's code, an over-long pair is truncated from the outer ends only
(the earlier segment loses its front, the later one its back, the longer one
first), so a true continuation stays exactly contiguous in its document.
"""

from __future__ import annotations

import numpy as np
import torch.utils.data

from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import NoiseTag, TokenizerInfo, sequence_rng
from scaletrain.data.sampler import GlobalSampleOrder

TASKS = ("nsp", "sop")


class SentencePairDataset(torch.utils.data.Dataset):
    """Map-style dataset keyed by global index, like GlobalIndexDataset, so the pretraining sampler applies.

    Sample ids are chunks (fixed at construction, one pass over the documents);
    the split point, the random document and the swap are drawn per global index,
    so each epoch pairs the chunks afresh and a resumed run redraws the same pairs.
    Items: {"global_index", "sample_id", "tokens", "token_types", "sentence_order_label"},
    unpadded; `MaskedLMCollator(..., sentence_pairs=True)` pads and masks them.
    """

    def __init__(self, documents: PackedSequenceDataset, tokenizer_info: TokenizerInfo, seq_length: int, seed: int,
                 task: str = "sop", shuffle: bool = True, stream: int | None = None) -> None:
        if task not in TASKS:
            raise DataError(f"sentence-pair task {task!r} is unknown; use 'nsp' (BERT) or 'sop' (ALBERT)")
        if seq_length < 5:
            raise DataError(f"seq_length={seq_length} leaves no room for two segments in [CLS] A [SEP] B [SEP]")
        self.documents, self.tokenizer_info, self.seed, self.task = documents, tokenizer_info, seed, task
        self.sequence_length = seq_length
        self.max_num_tokens = seq_length - 3  # [CLS], [SEP], [SEP]
        self._index_sentences()
        self._index_chunks()
        if len(self.chunk_document) == 0:
            raise DataError(f"the {documents.split!r} split has no document of two or more tokens to pair")
        self._nonempty_documents = np.flatnonzero(np.diff(self.document_first_sentence) > 0)
        if task == "nsp" and len(self._nonempty_documents) < 2:
            raise DataError(f"NSP draws B from another document, but the {documents.split!r} split has "
                            f"{len(self._nonempty_documents)} non-empty; use task='sop' or more documents")
        self.order = GlobalSampleOrder(len(self.chunk_document), seed, shuffle, stream)

    @property
    def num_samples(self) -> int:
        return len(self.chunk_document)

    def _index_sentences(self) -> None:
        """Token ranges of every document's sentences: lines, each with its newline and any blank lines after it.

        Blank lines stay attached so that no segment is a bare newline.
        """
        starts, ends, first_sentence = [], [], [0]
        for doc in range(self.documents.num_docs):
            is_newline = self.documents.document_tokens(doc) == self.tokenizer_info.newline_id
            sentence_ends = np.flatnonzero(is_newline[:-1] & ~is_newline[1:]) + 1
            if len(is_newline):
                sentence_ends = np.append(sentence_ends, len(is_newline))
            starts.append(np.concatenate([[0], sentence_ends[:-1]]).astype(np.int64)[:len(sentence_ends)])
            ends.append(sentence_ends.astype(np.int64))
            first_sentence.append(first_sentence[-1] + len(sentence_ends))
        self.sentence_start, self.sentence_end = np.concatenate(starts), np.concatenate(ends)
        self.document_first_sentence = np.array(first_sentence, dtype=np.int64)

    def _index_chunks(self) -> None:
        """Greedy groups of consecutive sentences, each closed once it holds max_num_tokens or its document ends."""
        documents, firsts, lasts = [], [], []
        for doc in range(self.documents.num_docs):
            begin, end = self.document_first_sentence[doc], self.document_first_sentence[doc + 1]
            first = begin
            for sentence in range(begin, end):
                length = self.sentence_end[sentence] - self.sentence_start[first]
                if length >= self.max_num_tokens or sentence == end - 1:
                    if length >= 2:
                        documents.append(doc)
                        firsts.append(first)
                        lasts.append(sentence + 1)
                    first = sentence + 1
        self.chunk_document = np.array(documents, dtype=np.int64)
        self.chunk_first_sentence = np.array(firsts, dtype=np.int64)
        self.chunk_last_sentence = np.array(lasts, dtype=np.int64)  # exclusive

    def __getitem__(self, global_index: int) -> dict:
        sample_id = self.order.sample_id(global_index)
        rng = sequence_rng(self.seed, global_index, NoiseTag.SENTENCE_PAIRS)
        doc = int(self.chunk_document[sample_id])
        tokens = np.asarray(self.documents.document_tokens(doc), dtype=np.int64)
        begin, split, end = self._split_chunk(rng, sample_id)
        first, second = tokens[begin:split], tokens[split:end]
        label = int(rng.random() < 0.5)
        if label and self.task == "nsp":
            second = self._random_continuation(rng, doc, self.max_num_tokens - len(first))
        first, second = truncate_pair(first, second, self.max_num_tokens)
        if label and self.task == "sop":
            first, second = second, first
        info = self.tokenizer_info
        sequence = np.concatenate([[info.cls_id], first, [info.sep_id], second, [info.sep_id]]).astype(np.int64)
        token_types = np.zeros(len(sequence), dtype=np.int64)
        token_types[len(first) + 2:] = 1
        return {"global_index": global_index, "sample_id": sample_id, "tokens": sequence,
                "token_types": token_types, "sentence_order_label": label}

    def _split_chunk(self, rng: np.random.Generator, sample_id: int) -> tuple[int, int, int]:
        """(begin, split, end) token offsets: A = [begin, split), B = [split, end).

        The split is a uniformly random sentence boundary inside the chunk, or a
        random token boundary if the chunk is a single sentence.
        """
        first, last = int(self.chunk_first_sentence[sample_id]), int(self.chunk_last_sentence[sample_id])
        begin, end = int(self.sentence_start[first]), int(self.sentence_end[last - 1])
        if last - first >= 2:
            return begin, int(self.sentence_start[rng.integers(first + 1, last)]), end
        return begin, int(rng.integers(begin + 1, end)), end

    def _random_continuation(self, rng: np.random.Generator, doc: int, target_length: int) -> np.ndarray:
        """Whole sentences of another random document from a random one on, until target_length tokens (BERT)."""
        candidates = self._nonempty_documents
        position = int(rng.integers(len(candidates) - 1))
        other = int(candidates[position + (position >= np.searchsorted(candidates, doc))])
        begin, end = self.document_first_sentence[other], self.document_first_sentence[other + 1]
        first = int(rng.integers(begin, end))
        start = int(self.sentence_start[first])
        last = first + int(np.searchsorted(self.sentence_end[first:end], start + max(target_length, 1)))
        stop = int(self.sentence_end[min(last, end - 1)])
        return np.asarray(self.documents.document_tokens(other)[start:stop], dtype=np.int64)


def truncate_pair(earlier: np.ndarray, later: np.ndarray, max_num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Shorten the longer segment one token at a time until both fit (BERT's truncate_seq_pair, ties cut `later`).

    `earlier` loses tokens at its front and `later` at its back, keeping the text
    around their boundary. Computed in closed form rather than token by token.
    """
    excess = len(earlier) + len(later) - max_num_tokens
    if excess <= 0:
        return earlier, later
    keep_earlier, keep_later = len(earlier), len(later)
    if abs(keep_earlier - keep_later) >= excess:
        if keep_earlier > keep_later:
            keep_earlier -= excess
        else:
            keep_later -= excess
    else:
        keep_earlier, keep_later = (max_num_tokens + 1) // 2, max_num_tokens // 2
    return earlier[len(earlier) - keep_earlier:], later[:keep_later]
