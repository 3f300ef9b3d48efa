"""manifest.json: what a prepared dataset holds (tokenizer, shards, index) with checksums; written last.

Reading one from wherever a dataset lives (a directory, a URL, a `pipe:` command) is data/storage.py's
`load_manifest`: storage builds on this module.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scaletrain.data.errors import DataError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class ShardInfo:
    """One webdataset tar shard; `num_bytes` and `sha256` are checked when a reader first opens it."""

    name: str
    num_docs: int
    num_tokens: int
    num_bytes: int
    sha256: str


@dataclass(frozen=True)
class SplitInfo:
    """A split's shards (in document order) and its byte-offset index file."""

    shards: tuple[ShardInfo, ...]
    num_docs: int
    num_tokens: int
    index_file: str
    index_sha256: str


@dataclass(frozen=True)
class Manifest:
    """The record `prepare_dataset` writes last; a directory without it is not a dataset."""

    tokenizer_file: str
    tokenizer_sha256: str
    vocab_size: int
    num_sentinels: int
    eos_id: int
    token_dtype: str
    splits: dict[str, SplitInfo]
    settings: dict = field(default_factory=dict)  # how it was prepared: seed, val_fraction, ...
    format_version: int = FORMAT_VERSION

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise DataError(
                f"the dataset has no {name!r} split (it has {sorted(self.splits)}); "
                "for a val split re-run `scaletrain prepare` with val_fraction > 0"
            )
        return self.splits[name]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        splits = {
            name: SplitInfo(**{**split, "shards": tuple(ShardInfo(**shard) for shard in split["shards"])})
            for name, split in raw.pop("splits").items()
        }
        return cls(**raw, splits=splits)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(manifest: Manifest, data_dir: Path) -> Path:
    """Write atomically (temp file + os.replace): readers see the old manifest or the new, never half."""
    path = Path(data_dir) / MANIFEST_NAME
    partial = path.with_name(f".{MANIFEST_NAME}.partial-{os.getpid()}")
    partial.write_text(manifest.to_json())
    os.replace(partial, path)
    return path


def parse_manifest(text: str, path: str, data_dir: str) -> Manifest:
    """The manifest in `text` (read from `path` of the dataset at `data_dir`), or a DataError saying how to fix it."""
    try:
        manifest = Manifest.from_json(text)
    except (ValueError, TypeError, KeyError) as error:
        raise DataError(
            f"{path} is unreadable ({error}); delete {data_dir} and re-run `scaletrain prepare CONFIG`"
        ) from error
    if manifest.format_version != FORMAT_VERSION:
        raise DataError(
            f"{path} has format_version {manifest.format_version}, this scaletrain reads {FORMAT_VERSION}; "
            "re-run `scaletrain prepare CONFIG` into a new data_dir"
        )
    return manifest


_VERIFIED_FILES: set[tuple[str, str, int, int]] = set()


def verify_file(path: Path, expected_sha256: str) -> None:
    """Raise DataError naming `path` unless it exists with the expected sha256.

    Hashed once per process while the file keeps its size and mtime: every loader of a run (train,
    val, the tokenizer) checks the same files, and the index of a large corpus is gigabytes.
    """
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{path} is listed in the manifest but missing; re-run `scaletrain prepare CONFIG`") from None
    key = (os.path.realpath(path), expected_sha256, stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED_FILES:
        return
    actual = file_sha256(path)
    if actual != expected_sha256:
        raise DataError(
            f"checksum mismatch for {path}: manifest expects sha256 {expected_sha256}, file has {actual}; "
            "it was modified or corrupted after prepare: re-run `scaletrain prepare CONFIG`"
        )
    _VERIFIED_FILES.add(key)
