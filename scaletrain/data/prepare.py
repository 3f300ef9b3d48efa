"""`prepare_dataset`: raw text -> tokenizer, webdataset shards, index and manifest, published atomically."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from scaletrain.data.documents import assign_splits, iter_texts, list_documents, resolve_raw_paths
from scaletrain.data.errors import DataError
from scaletrain.data.manifest import MANIFEST_NAME, Manifest, SplitInfo, file_sha256, load_manifest, write_manifest
from scaletrain.data.shards import SplitShardWriter, token_dtype
from scaletrain.data.tokenizer import Tokenizer, train_tokenizer

SPLITS = ("train", "val")
TOKENIZER_PREFIX = "tokenizer"


def prepare_dataset(
    raw_paths: Sequence[Path | str],
    data_dir: Path,
    vocab_size: int,
    num_sentinels: int,
    val_fraction: float,
    max_tokens_per_shard: int,
    num_workers: int,
    seed: int,
    overwrite: bool = False,
    show_progress: bool = False,
) -> Manifest:
    """Train the tokenizer on `raw_paths`, tokenize every document, write shards + index + manifest.

    Everything is built in a staging directory beside `data_dir` and renamed
    into place at the end, so an interrupted or failed prepare leaves either
    the previous dataset or nothing, never a half-written one. `show_progress` reports each stage
    and the documents tokenized on stderr (a bar on a terminal, plain lines in job logs).
    """
    data_dir = Path(data_dir)
    _check_target(data_dir, overwrite)
    files = resolve_raw_paths(raw_paths)
    documents = list_documents(files)
    splits = assign_splits([doc.name for doc in documents], val_fraction, seed)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=data_dir.parent, prefix=f".{data_dir.name}.staging-"))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the dataset from other users' jobs
        progress = PrepareProgress(len(documents), show_progress)
        progress.note(f"training a {vocab_size:,}-token sentencepiece model on {len(files)} files")
        model_path = train_tokenizer(files, staging / TOKENIZER_PREFIX, vocab_size, num_sentinels, seed=seed)
        tokenizer = Tokenizer.load(model_path)
        dtype = token_dtype(tokenizer.vocab_size)
        writers = {split: SplitShardWriter(staging, split, max_tokens_per_shard, dtype) for split in SPLITS}
        token_arrays = tokenize_texts(model_path, iter_texts(documents), num_workers, dtype)
        progress.note(f"tokenizing {len(documents):,} documents with {num_workers} workers")
        for doc_id, (split, tokens) in enumerate(zip(splits, token_arrays, strict=True)):
            writers[split].add(doc_id, tokens)
            progress.update(len(tokens))
        progress.close()
        manifest = Manifest(
            tokenizer_file=model_path.name,
            tokenizer_sha256=file_sha256(model_path),
            vocab_size=tokenizer.vocab_size,
            num_sentinels=tokenizer.num_sentinels,
            eos_id=tokenizer.eos_id,
            token_dtype=dtype.name,
            splits=_finish_splits(writers, staging),
            settings={"seed": seed, "val_fraction": val_fraction, "max_tokens_per_shard": max_tokens_per_shard,
                      "num_raw_files": len(files)},
        )
        write_manifest(manifest, staging)
        _publish(staging, data_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return load_manifest(data_dir)


class PrepareProgress:
    """Documents tokenized so far: a tqdm bar on a terminal; elsewhere (SLURM, CI) a plain line at
    every tenth of the documents, as the training loop logs without carriage returns."""

    def __init__(self, num_documents: int, enabled: bool) -> None:
        self.enabled, self.num_documents = enabled, num_documents
        self.documents = self.tokens = 0
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=num_documents, desc="tokenize", unit="doc", file=sys.stderr, dynamic_ncols=True,
                        disable=not (enabled and self.interactive), mininterval=0.5)
        self.next_line = 1

    def note(self, stage: str) -> None:
        if self.enabled:
            self.bar.write(f"prepare: {stage}", file=sys.stderr)

    def update(self, num_tokens: int) -> None:
        self.documents += 1
        self.tokens += num_tokens
        self.bar.update(1)
        if self.enabled and not self.interactive and self.documents * 10 >= self.next_line * self.num_documents:
            print(f"prepare: tokenized {self.documents:,}/{self.num_documents:,} documents, {self.tokens:,} tokens",
                  file=sys.stderr, flush=True)
            self.next_line = self.documents * 10 // self.num_documents + 1

    def close(self) -> None:
        self.bar.close()


def _finish_splits(writers: dict[str, SplitShardWriter], staging: Path) -> dict[str, SplitInfo]:
    splits: dict[str, SplitInfo] = {}
    for split, writer in writers.items():
        shards, index = writer.close()
        if not shards:
            continue
        index_path = staging / f"{split}.index.npz"
        index.save(index_path)
        splits[split] = SplitInfo(
            shards=tuple(shards),
            num_docs=sum(shard.num_docs for shard in shards),
            num_tokens=sum(shard.num_tokens for shard in shards),
            index_file=index_path.name,
            index_sha256=file_sha256(index_path),
        )
    return splits


def _check_target(data_dir: Path, overwrite: bool) -> None:
    if not data_dir.exists() or not any(data_dir.iterdir()):
        return
    if not (data_dir / MANIFEST_NAME).exists():
        raise DataError(f"{data_dir} exists and is not a prepared dataset; choose another data_dir or empty it")
    if not overwrite:
        raise DataError(f"{data_dir} already holds a prepared dataset; delete it or pass overwrite=True to replace it")


def _publish(staging: Path, data_dir: Path) -> None:
    """Swap the finished staging dir in; the old dataset (if any) goes only after the new one is in place."""
    retired = None
    if data_dir.exists():
        retired = data_dir.with_name(f".{data_dir.name}.retired-{os.getpid()}")
        os.rename(data_dir, retired)
    os.rename(staging, data_dir)
    if retired is not None:
        shutil.rmtree(retired)


_worker_tokenizer: Tokenizer | None = None
_DOCS_IN_FLIGHT_PER_WORKER = 64


def _load_worker_tokenizer(model_path: Path) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.load(model_path)


def _encode_in_worker(job: tuple[str, str]) -> np.ndarray:
    text, dtype = job
    return np.asarray(_worker_tokenizer.encode(text), dtype=dtype)


def tokenize_texts(model_path: Path, texts: Iterable[str], num_workers: int, dtype: np.dtype) -> Iterator[np.ndarray]:
    """Token arrays of `texts`, in order; with num_workers > 1 a process pool does the work.

    Each worker loads the sentencepiece model once (pool initializer). Workers
    are forked where the OS allows: they run only sentencepiece and numpy (no
    OpenMP, no torch), and fork spares callers the `if __name__ == "__main__"`
    guard that spawn demands of every script. Texts go out in bounded batches
    because `Pool.imap` would otherwise read the whole corpus into its queue.
    """
    dtype_name = np.dtype(dtype).name
    if num_workers <= 1:
        tokenizer = Tokenizer.load(model_path)
        yield from (np.asarray(tokenizer.encode(text), dtype=dtype_name) for text in texts)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with context.Pool(num_workers, initializer=_load_worker_tokenizer, initargs=(model_path,)) as pool:
        for batch in batched(texts, num_workers * _DOCS_IN_FLIGHT_PER_WORKER):
            yield from pool.imap(_encode_in_worker, [(text, dtype_name) for text in batch], chunksize=4)


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
