"""Webdataset tar shards of token arrays, and the byte-offset index that lets readers skip tar parsing.

One sample per document: key = zero-padded document id, `tokens.npy` = the
1-D token array. A plain `webdataset.WebDataset(url)` reads these files. For
random access we do once, at prepare time, what webdataset's `wids` does on
the fly: find where each array's raw data lies inside the tar (tar member data
offset + npy header length), so training reads exactly the token bytes it
needs (one pread each) with no tar or npy parsing.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import webdataset

from scaletrain.data.errors import DataError
from scaletrain.data.manifest import ShardInfo, file_sha256

KEY_DIGITS = 9
_HASH_CHUNK = 1 << 22
TOKENS_FIELD = "tokens.npy"
_NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: uint16 below 65536, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.tar"


@dataclass
class SplitIndex:
    """Where each document of a split lies, in split order (the order of the packed stream)."""

    doc_ids: np.ndarray  # int64, the webdataset key
    shard_ids: np.ndarray  # int32, position in the manifest's shard list
    byte_offsets: np.ndarray  # int64, first byte of the token data inside the shard file
    num_tokens: np.ndarray  # int64
    cum_tokens: np.ndarray  # int64, len n + 1: tokens before each document (eos separators not counted)

    def save(self, path: Path) -> None:
        with open(path, "wb") as stream:
            np.savez(stream, doc_ids=self.doc_ids, shard_ids=self.shard_ids, byte_offsets=self.byte_offsets,
                     num_tokens=self.num_tokens, cum_tokens=self.cum_tokens)

    @classmethod
    def load(cls, path: Path) -> SplitIndex:
        with np.load(path) as arrays:
            return cls(**{name: arrays[name] for name in arrays.files})


def locate_token_arrays(shard_path: Path, dtype: np.dtype) -> dict[str, tuple[int, int]]:
    """Map each sample key of a shard to (byte offset of its token data, token count)."""
    located: dict[str, tuple[int, int]] = {}
    with tarfile.open(shard_path) as archive, open(shard_path, "rb") as raw:
        for member in archive:
            key, _, field_name = member.name.partition(".")
            if field_name != TOKENS_FIELD:
                continue
            raw.seek(member.offset_data)
            read_header = _NPY_HEADER_READERS[np.lib.format.read_magic(raw)]
            shape, fortran_order, array_dtype = read_header(raw)
            if array_dtype != dtype or fortran_order or len(shape) != 1:
                raise DataError(f"{shard_path}:{member.name} holds {array_dtype}{shape}, expected 1-D {dtype}")
            located[key] = (raw.tell(), shape[0])
    return located


class SplitShardWriter:
    """Writes one split's documents, in order, into `<split>-NNNNN.tar` shards.

    A shard is closed before it would exceed `max_tokens_per_shard` (a longer
    document gets a shard of its own). mtime is fixed so identical inputs give
    byte-identical shards, hence identical checksums.
    """

    def __init__(self, out_dir: Path, split: str, max_tokens_per_shard: int, dtype: np.dtype) -> None:
        if max_tokens_per_shard < 1:
            raise DataError(f"max_tokens_per_shard={max_tokens_per_shard} must be positive")
        self._out_dir, self._split, self._dtype = Path(out_dir), split, np.dtype(dtype)
        self._max_tokens = max_tokens_per_shard
        self._shards: list[ShardInfo] = []
        self._writer: webdataset.TarWriter | None = None
        self._keys: list[str] = []
        self._shard_tokens = 0
        self._index: dict[str, list[int]] = {"doc_ids": [], "shard_ids": [], "byte_offsets": [], "num_tokens": []}

    def add(self, doc_id: int, tokens: np.ndarray) -> None:
        if self._writer is not None and self._shard_tokens + len(tokens) > self._max_tokens:
            self._finish_shard()
        if self._writer is None:
            self._writer = webdataset.TarWriter(str(self._current_path()), mtime=0.0)
        key = f"{doc_id:0{KEY_DIGITS}d}"
        self._writer.write({"__key__": key, TOKENS_FIELD: np.ascontiguousarray(tokens, dtype=self._dtype)})
        self._keys.append(key)
        self._shard_tokens += len(tokens)

    def close(self) -> tuple[list[ShardInfo], SplitIndex]:
        """Finish the last shard; return the shard records and the split's index."""
        if self._writer is not None:
            self._finish_shard()
        num_tokens = np.asarray(self._index["num_tokens"], dtype=np.int64)
        index = SplitIndex(
            doc_ids=np.asarray(self._index["doc_ids"], dtype=np.int64),
            shard_ids=np.asarray(self._index["shard_ids"], dtype=np.int32),
            byte_offsets=np.asarray(self._index["byte_offsets"], dtype=np.int64),
            num_tokens=num_tokens,
            cum_tokens=np.concatenate([[0], np.cumsum(num_tokens)]).astype(np.int64),
        )
        return self._shards, index

    def _current_path(self) -> Path:
        return self._out_dir / shard_name(self._split, len(self._shards))

    def _finish_shard(self) -> None:
        self._writer.close()
        self._writer = None
        path = self._current_path()
        located = locate_token_arrays(path, self._dtype)
        for key in self._keys:
            offset, count = located[key]
            self._index["doc_ids"].append(int(key))
            self._index["shard_ids"].append(len(self._shards))
            self._index["byte_offsets"].append(offset)
            self._index["num_tokens"].append(count)
        self._shards.append(ShardInfo(path.name, len(self._keys), self._shard_tokens, path.stat().st_size,
                                      file_sha256(path)))
        self._keys, self._shard_tokens = [], 0


_VERIFIED_SHARDS: set[tuple[str, str, int, int]] = set()


def open_shard(path: Path, info: ShardInfo, *, sha256_checked: bool = False) -> ShardReader:
    """A shard for reading, checked against the manifest (`sha256_checked`: its content was checked
    already, as the shard cache does on download; its size is still checked here)."""
    return ShardReader(path, info, sha256_checked)


class ShardReader:
    """Reads byte ranges of one shard, checked against the manifest when opened and again whenever the
    file changes (size or mtime) while it is read: a shard truncated or rewritten mid-run is one
    DataError naming it, not a crash.

    The size check is a stat; the sha256 check reads the file once per process (remembered by path,
    hash, size and mtime), so DataLoader workers each pay it once per shard they touch and never on
    later opens. Reads are pread(2) of the range asked for, not slices of a memory map: touching a
    mapped page past the end of a file truncated since it was mapped is SIGBUS, which killed the rank
    (exit 135) or its loader worker ("Bus error ... raise your shared memory limit") without a word
    about the file.
    """

    def __init__(self, path: Path, info: ShardInfo, sha256_checked: bool = False) -> None:
        self.path, self.info = Path(path), info
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise DataError(f"shard {path} is missing; re-run `scaletrain prepare CONFIG`") from None
        stat = os.fstat(self._fd)
        if sha256_checked:
            self._check_size(stat)
            self._checked = (stat.st_size, stat.st_mtime_ns)
        else:
            self._check(stat)

    def read(self, offset: int, num_bytes: int) -> np.ndarray:
        """Bytes [offset, offset + num_bytes) of the shard, as a read-only uint8 array."""
        stat = os.fstat(self._fd)
        if (stat.st_size, stat.st_mtime_ns) != self._checked:
            self._check(stat, "changed while the run read it: it ")
        data = os.pread(self._fd, num_bytes, offset)
        if len(data) != num_bytes:  # it shrank between the stat and the read
            self._check_size(os.fstat(self._fd), "changed while the run read it: it ")
        return np.frombuffer(data, dtype=np.uint8)

    def _check(self, stat: os.stat_result, change: str = "") -> None:
        self._check_size(stat, change)
        key = (os.path.realpath(self.path), self.info.sha256, stat.st_size, stat.st_mtime_ns)
        if key not in _VERIFIED_SHARDS:
            actual = _open_file_sha256(self._fd)
            if actual != self.info.sha256:
                raise DataError(
                    f"shard {self.path} {change}is corrupt: sha256 mismatch, manifest expects {self.info.sha256}, "
                    f"file has {actual}; re-run `scaletrain prepare CONFIG`"
                )
            _VERIFIED_SHARDS.add(key)
        self._checked = (stat.st_size, stat.st_mtime_ns)

    def _check_size(self, stat: os.stat_result, change: str = "") -> None:
        if stat.st_size != self.info.num_bytes:
            raise DataError(
                f"shard {self.path} {change}is {stat.st_size} bytes, the manifest says {self.info.num_bytes}: "
                "truncated or overwritten; re-run `scaletrain prepare CONFIG`"
            )

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)


def _open_file_sha256(fd: int) -> str:
    """sha256 of the file open as `fd`: the one this reader reads, even if its path names another since."""
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, _HASH_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()
