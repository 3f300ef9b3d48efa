"""Packed next-token sequences read straight from the shards' bytes, and their global-index view.

A split's documents, in index order, are joined with an eos after each into
one token stream; sample i is stream[i*S : i*S + S + 1], the +1 overlap giving
next-token labels (as nanoGPT and Megatron's GPTDataset do).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch.utils.data

from scaletrain.data.errors import DataError
from scaletrain.data.sampler import GlobalSampleOrder
from scaletrain.data.shards import ShardReader, SplitIndex
from scaletrain.data.storage import DatasetLocation, ShardCacheSettings, open_location


class PackedSequenceDataset:
    """Sample i of a split's packed stream, reading only the documents that overlap it.

    Shards are opened lazily, per process (files opened before a fork are not reused after it), and
    checked against the manifest on first open and whenever they change. `location` is a local
    directory, a URL or `pipe:` command (remote shards come through the cache `cache`; see
    data/storage.py), or a DatasetLocation; the samples are the same wherever the dataset lives.
    """

    def __init__(self, location: Path | str | DatasetLocation, split: str, seq_length: int, *,
                 cache: ShardCacheSettings | None = None) -> None:
        if seq_length < 1:
            raise DataError(f"seq_length={seq_length} must be positive")
        self.location = open_location(location, cache)
        manifest = self.location.load_manifest()
        self.split, self.seq_length = split, seq_length
        self._split_info = manifest.split(split)
        self._dtype = np.dtype(manifest.token_dtype)
        self.eos_id, self.vocab_size = manifest.eos_id, manifest.vocab_size
        index = SplitIndex.load(self.location.local_file(self._split_info.index_file, self._split_info.index_sha256))
        self._shard_ids, self._byte_offsets, self._num_tokens = index.shard_ids, index.byte_offsets, index.num_tokens
        self._doc_ids = index.doc_ids
        # Stream position of each document's first token: the tokens before it plus one eos per earlier document.
        self._doc_starts = index.cum_tokens[:-1] + np.arange(len(index.num_tokens), dtype=np.int64)
        self.stream_length = int(index.cum_tokens[-1]) + len(index.num_tokens)
        self.num_samples = (self.stream_length - 1) // seq_length
        if self.num_samples == 0:
            raise DataError(
                f"the {split!r} split holds {self.stream_length} tokens, fewer than seq_length + 1 = {seq_length + 1}; "
                "use a shorter seq_length, or more data (for val: a larger val_fraction)"
            )
        self._shards: dict[int, ShardReader] = {}
        self._shards_pid = os.getpid()

    def __len__(self) -> int:
        return self.num_samples

    @property
    def data_dir(self) -> Path:
        """A local directory `Tokenizer.load` reads this dataset's tokenizer from (the cache's copy if remote)."""
        return self.location.tokenizer_path().parent

    @property
    def num_docs(self) -> int:
        return len(self._num_tokens)

    def sample(self, i: int) -> np.ndarray:
        """Tokens stream[i*S : i*S + S + 1] as int64."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples}) of the {self.split!r} split")
        begin, end = i * self.seq_length, (i + 1) * self.seq_length + 1
        out = np.empty(end - begin, dtype=np.int64)
        doc = int(np.searchsorted(self._doc_starts, begin, side="right")) - 1
        position = begin
        while position < end:
            start, length = int(self._doc_starts[doc]), int(self._num_tokens[doc])
            first, last = position - start, min(end - start, length + 1)  # document + its eos: [0, length]
            if first < length:
                out[position - begin:start + min(last, length) - begin] = self.document_tokens(doc, first, last)
            if last == length + 1:
                out[start + length - begin] = self.eos_id
            position, doc = start + last, doc + 1
        return out

    def document_tokens(self, doc: int, first: int = 0, last: int | None = None) -> np.ndarray:
        """Tokens [first, last) of document `doc` of the split (index order; default all), read from its shard.

        A token id outside the vocabulary is damage the manifest's checks could not see (the bytes changed
        in memory or on a disk that kept the file's mtime), and a DataError naming the shard: left alone it
        is an IndexError deep inside the model.
        """
        shard = self._shard(int(self._shard_ids[doc]))
        count = int(self._num_tokens[doc])
        first, last = min(first, count), count if last is None else min(last, count)
        offset = int(self._byte_offsets[doc]) + first * self._dtype.itemsize
        tokens = shard.read(offset, (last - first) * self._dtype.itemsize).view(self._dtype)
        if tokens.size and tokens.max() >= self.vocab_size:
            raise DataError(f"shard {shard.path} is corrupt: document {int(self._doc_ids[doc])} holds token id "
                            f"{int(tokens.max())}, outside the vocabulary of {self.vocab_size}; "
                            "re-run `scaletrain prepare CONFIG`")
        return tokens

    def _shard(self, shard_id: int) -> ShardReader:
        if self._shards_pid != os.getpid():
            self._shards, self._shards_pid = {}, os.getpid()
        if shard_id not in self._shards:
            self._shards[shard_id] = self.location.open_shard(self._split_info.shards[shard_id])
        return self._shards[shard_id]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_shards"] = {}
        return state


class GlobalIndexDataset(torch.utils.data.Dataset):
    """Map-style dataset keyed by global sample index (epochs concatenated), not by sample id.

    Keying by global index lets objectives seed per-sequence randomness (BERT
    masks, T5 spans) from (seed, global_index): resuming reproduces them exactly,
    and a sequence seen again in a later epoch gets fresh noise.
    """

    def __init__(self, packed: PackedSequenceDataset, order: GlobalSampleOrder) -> None:
        if order.num_samples != packed.num_samples:
            raise DataError(f"order covers {order.num_samples} samples but the dataset has {packed.num_samples}")
        self.packed, self.order = packed, order

    @property
    def sequence_length(self) -> int:
        return self.packed.seq_length

    def __getitem__(self, global_index: int) -> dict:
        sample_id = self.order.sample_id(global_index)
        return {"global_index": global_index, "sample_id": sample_id, "tokens": self.packed.sample(sample_id)}
