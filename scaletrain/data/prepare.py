"""`prepare_dataset`: raw text -> tokenizer, webdataset shards, index and manifest, published atomically."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from scaletrain.data.dedup import find_exact_duplicates
from scaletrain.data.documents import Document, assign_splits, iter_texts, list_documents, resolve_raw_paths
from scaletrain.data.errors import DataError
from scaletrain.data.manifest import MANIFEST_NAME, Manifest, SplitInfo, file_sha256, write_manifest
from scaletrain.data.shards import SplitShardWriter, token_dtype
from scaletrain.data.storage import load_manifest
from scaletrain.data.tokenizer import Tokenizer, read_reusable_model, train_tokenizer, write_tokenizer
from scaletrain.disk import replace_directory

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
    dedup: bool = True,
    tokenizer_file: Path | str | None = None,
    tokenizer_train_bytes: int | None = None,
) -> Manifest:
    """Deduplicate the documents of `raw_paths`, train (or reuse) the tokenizer, write shards + index + manifest.

    `dedup` drops every document whose normalised text an earlier one has
    (scaletrain.data.dedup); the manifest's settings count them. `tokenizer_file`
    reuses an existing sentencepiece model (checked against vocab_size and
    num_sentinels before anything is written) instead of training one;
    `tokenizer_train_bytes` trains on a seeded sample of about that many bytes.
    Everything is built in a staging directory beside `data_dir` and renamed
    into place at the end, so an interrupted or failed prepare leaves either
    the previous dataset or nothing, never a half-written one. `show_progress` reports each stage
    and the documents tokenized on stderr (a bar on a terminal, plain lines in job logs).
    """
    data_dir = Path(data_dir)
    _check_target(data_dir, overwrite)
    reused_model = None if tokenizer_file is None else read_reusable_model(Path(tokenizer_file), vocab_size,
                                                                            num_sentinels)
    files = resolve_raw_paths(raw_paths)
    documents = list_documents(files)
    progress = PrepareProgress(show_progress)
    num_duplicates = None
    if dedup:
        documents, num_duplicates = _drop_duplicates(documents, progress)
    splits = assign_splits([doc.name for doc in documents], val_fraction, seed)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=data_dir.parent, prefix=f".{data_dir.name}.staging-"))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the dataset from other users' jobs
        if reused_model is None:
            sample = "" if tokenizer_train_bytes is None else f" (a sample of {tokenizer_train_bytes:,} bytes)"
            progress.note(f"training a {vocab_size:,}-token sentencepiece model on {len(files)} files{sample}")
            model_path = train_tokenizer(documents, staging / TOKENIZER_PREFIX, vocab_size, num_sentinels, seed=seed,
                                         sample_bytes=tokenizer_train_bytes)
        else:
            progress.note(f"reusing the sentencepiece model {tokenizer_file}")
            model_path = write_tokenizer(staging / TOKENIZER_PREFIX, reused_model, num_sentinels)
        tokenizer = Tokenizer.load(model_path)
        dtype = token_dtype(tokenizer.vocab_size)
        progress.note(f"tokenizing {len(documents):,} documents with {num_workers} workers")
        writers = _write_shards(staging, documents, splits, model_path, dtype, max_tokens_per_shard, num_workers,
                                progress)
        source = "trained" if tokenizer_file is None else str(Path(tokenizer_file).resolve())
        manifest = Manifest(
            tokenizer_file=model_path.name,
            tokenizer_sha256=file_sha256(model_path),
            vocab_size=tokenizer.vocab_size,
            num_sentinels=tokenizer.num_sentinels,
            eos_id=tokenizer.eos_id,
            token_dtype=dtype.name,
            splits=_finish_splits(writers, staging),
            settings={"seed": seed, "val_fraction": val_fraction, "max_tokens_per_shard": max_tokens_per_shard,
                      "num_raw_files": len(files), "dedup": dedup, "duplicates_dropped": num_duplicates,
                      "tokenizer_source": source, "tokenizer_train_bytes": tokenizer_train_bytes},
        )
        write_manifest(manifest, staging)
        replace_directory(staging, data_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return load_manifest(data_dir)


def _write_shards(staging: Path, documents: list[Document], splits: list[str], model_path: Path, dtype: np.dtype,
                  max_tokens_per_shard: int, num_workers: int,
                  progress: PrepareProgress) -> dict[str, SplitShardWriter]:
    """Tokenize the documents in order into each split's shards; doc ids count the kept documents."""
    writers = {split: SplitShardWriter(staging, split, max_tokens_per_shard, dtype) for split in SPLITS}
    progress.start(len(documents))
    token_arrays = tokenize_texts(model_path, iter_texts(documents), num_workers, dtype)
    for doc_id, (split, tokens) in enumerate(zip(splits, token_arrays, strict=True)):
        writers[split].add(doc_id, tokens)
        progress.update(len(tokens))
    progress.close()
    return writers


def _drop_duplicates(documents: list[Document], progress: PrepareProgress) -> tuple[list[Document], int]:
    """The documents whose normalised text no earlier one has, and how many were dropped."""
    progress.note(f"deduplicating {len(documents):,} documents (exact, normalised text)")
    duplicates = find_exact_duplicates(iter_texts(documents))
    kept = [doc for doc, duplicate in zip(documents, duplicates, strict=True) if not duplicate]
    progress.note(f"dropped {len(documents) - len(kept):,} exact duplicates, kept {len(kept):,} documents")
    return kept, len(documents) - len(kept)


class PrepareProgress:
    """Documents tokenized so far: a tqdm bar on a terminal; elsewhere (SLURM, CI) a plain line at
    every tenth of the documents, as the training loop logs without carriage returns."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.interactive = sys.stderr.isatty()
        self.bar: tqdm | None = None

    def start(self, num_documents: int) -> None:
        """Begin counting the `num_documents` that will be tokenized (known once duplicates are dropped)."""
        self.num_documents = num_documents
        self.documents = self.tokens = 0
        self.bar = tqdm(total=num_documents, desc="tokenize", unit="doc", file=sys.stderr, dynamic_ncols=True,
                        disable=not (self.enabled and self.interactive), mininterval=0.5)
        self.next_line = 1

    def note(self, stage: str) -> None:
        if self.enabled:
            tqdm.write(f"prepare: {stage}", file=sys.stderr)

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


# Texts per sentencepiece call: enough for every thread to stay busy to the end of a batch
# (documents are not split), small enough that a batch's texts and ids fit easily in memory.
BATCH_CHARS_PER_THREAD = 4 << 20


def tokenize_texts(model_path: Path, texts: Iterable[str], num_workers: int, dtype: np.dtype) -> Iterator[np.ndarray]:
    """Token arrays of `texts`, in order, encoded by sentencepiece on `num_workers` C++ threads.

    Threads, not processes: sentencepiece's batched encode splits a list of
    texts over its own threads on one loaded model, so nothing is pickled to
    workers and back, as a process pool must for every text and token list.
    Measured on 2 shared cores (benchmarks/tokenize_throughput.py): one thread
    costs the same CPU time as a plain `encode` loop, two run up to 1.9x faster
    when the second core is free, where a 2-process pool with per-document
    pickling ran slower than the plain loop. A batch is split between threads by
    whole documents, so one huge document keeps one thread busy alone.
    """
    tokenizer = Tokenizer.load(model_path)
    for batch in batched_by_size(texts, num_workers * BATCH_CHARS_PER_THREAD):
        yield from (np.asarray(ids, dtype=dtype) for ids in tokenizer.encode_batch(batch, num_workers))


def batched_by_size(texts: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    """Consecutive runs of texts holding about `max_chars` characters (at least one text each)."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
