"""Damaged data is caught with an error that names the file: corrupt or truncated shards, bad checksums."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.manifest import MANIFEST_NAME
from scaletrain.data.storage import load_manifest


@pytest.fixture
def dataset_copy(small_dataset: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(small_dataset, tmp_path / "data"))


def read_every_sample(data_dir: Path) -> None:
    dataset = PackedSequenceDataset(data_dir, "train", seq_length=512)
    for i in range(len(dataset)):
        dataset.sample(i)


def test_flipped_bytes_in_a_shard_are_a_sha_mismatch_naming_it(dataset_copy: Path) -> None:
    shard = dataset_copy / "train-00001.tar"
    expected = next(s.sha256 for s in load_manifest(dataset_copy).splits["train"].shards if s.name == shard.name)
    with open(shard, "r+b") as stream:
        stream.seek(shard.stat().st_size // 2)
        original = stream.read(8)
        stream.seek(-8, os.SEEK_CUR)
        stream.write(bytes(b ^ 0xFF for b in original))
    with pytest.raises(DataError, match=f"shard {shard} is corrupt: sha256 mismatch, manifest expects {expected}, "
                                        "file has [0-9a-f]{64}"):
        read_every_sample(dataset_copy)


def test_truncated_shard_names_the_file_and_the_fix(dataset_copy: Path) -> None:
    shard = dataset_copy / "train-00000.tar"
    os.truncate(shard, shard.stat().st_size - 1024)
    with pytest.raises(DataError, match=f"shard {shard} is .* bytes, the manifest says .*truncated.*prepare"):
        read_every_sample(dataset_copy)


def test_shard_changed_after_first_check_is_checked_again(dataset_copy: Path) -> None:
    read_every_sample(dataset_copy)  # verified and remembered in this process
    shard = dataset_copy / "train-00000.tar"
    payload = bytearray(shard.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    shard.write_bytes(bytes(payload))
    os.utime(shard, ns=(0, 1))  # a rewrite moves mtime, which keys the per-process cache
    with pytest.raises(DataError, match="sha256 mismatch"):
        read_every_sample(dataset_copy)


@pytest.mark.parametrize("name", ["train.index.npz", "tokenizer.model"])
def test_manifest_checksum_mismatch_is_detected(dataset_copy: Path, name: str) -> None:
    with open(dataset_copy / name, "ab") as stream:
        stream.write(b"\0")
    with pytest.raises(DataError, match=f"checksum mismatch for {dataset_copy / name}: manifest expects sha256"):
        load_manifest(dataset_copy)


def test_missing_files_are_clear_errors(dataset_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"no manifest.json in {tmp_path}: .* run `scaletrain prepare CONFIG` first"):
        load_manifest(tmp_path)
    (dataset_copy / "val-00000.tar").unlink()
    with pytest.raises(DataError, match="shard .*val-00000.tar is missing"):
        PackedSequenceDataset(dataset_copy, "val", seq_length=64).sample(0)
    (dataset_copy / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(DataError, match="manifest.json is unreadable"):
        load_manifest(dataset_copy)


def test_a_loader_worker_error_reaches_the_user_as_its_one_line_message(dataset_copy: Path) -> None:
    from tests.data.loaders import train_loader

    for shard in dataset_copy.glob("train-*.tar"):
        os.truncate(shard, shard.stat().st_size - 1024)
    loader = train_loader(dataset_copy, seq_length=64, seed=0, micro_batch_size=2, data_parallel_rank=0,
                                data_parallel_size=1, consumed_samples=0, num_workers=1)
    with pytest.raises(DataError) as error:
        next(iter(loader))
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert re.fullmatch(r"shard .*train-0000\d\.tar is \d+ bytes, the manifest says \d+: truncated or overwritten; "
                        r"re-run `scaletrain prepare CONFIG` \(in DataLoader worker process 0\)", message), message


def loader_mid_run(data_dir: Path) -> Iterator[dict]:
    """A train loader with one worker that has served a few batches (its shards are open)."""
    from tests.data.loaders import train_loader

    batches = iter(train_loader(data_dir, seq_length=64, seed=0, micro_batch_size=8, data_parallel_rank=0,
                                data_parallel_size=1, consumed_samples=0, num_workers=1))
    for _ in range(3):
        next(batches)
    return batches


def first_error(batches: Iterator[dict]) -> str:
    with pytest.raises(DataError) as error:
        for _ in range(20):  # past the batches the worker fetched before the damage
            next(batches)
    return str(error.value)


def test_a_shard_truncated_while_the_loader_reads_it_is_one_line_naming_it(dataset_copy: Path) -> None:
    """It was SIGBUS in the worker (a page of the memory map past the new end): 80 lines ending in
    "Bus error ... raise your shared memory limit", or, without workers, the rank dead with exit 135."""
    batches = loader_mid_run(dataset_copy)
    for shard in dataset_copy.glob("train-*.tar"):
        os.truncate(shard, shard.stat().st_size // 2)
    message = first_error(batches)
    assert re.fullmatch(r"shard .*train-0000\d\.tar (changed while the run read it: it )?is \d+ bytes, the manifest "
                        r"says \d+: truncated or overwritten; re-run `scaletrain prepare CONFIG` "
                        r"\(in DataLoader worker process 0\)", message), message


def test_a_shard_rewritten_while_the_loader_reads_it_is_one_line_naming_it(dataset_copy: Path) -> None:
    batches = loader_mid_run(dataset_copy)
    for shard in dataset_copy.glob("train-*.tar"):
        with open(shard, "r+b") as stream:
            stream.seek(shard.stat().st_size // 2)
            original = stream.read(64)
            stream.seek(-64, os.SEEK_CUR)
            stream.write(bytes(b ^ 0xFF for b in original))
    message = first_error(batches)
    assert re.fullmatch(r"shard .*train-0000\d\.tar (changed while the run read it: it )?is corrupt: sha256 "
                        r"mismatch, .*\(in DataLoader worker process 0\)", message), message


def test_a_token_outside_the_vocabulary_names_the_shard(dataset_copy: Path) -> None:
    """Damage that keeps the file's size and mtime (a disk, a copy that kept them) was an IndexError in
    the model's embedding."""
    dataset = PackedSequenceDataset(dataset_copy, "train", seq_length=64)
    dataset.sample(0)  # shard 0 is checked and open
    shard, offset = dataset_copy / "train-00000.tar", int(dataset._byte_offsets[0])
    stat = shard.stat()
    with open(shard, "r+b") as stream:
        stream.seek(offset + 1)  # the high byte of the first token (uint16, little-endian)
        stream.write(b"\xff")
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DataError, match=f"shard {shard} is corrupt: document 0 holds token id \\d+, outside the "
                                        "vocabulary of 1024; re-run `scaletrain prepare CONFIG`"):
        dataset.sample(0)
