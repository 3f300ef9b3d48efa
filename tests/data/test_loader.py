"""Packing, sample order, rank slicing and resumption: the contract the training loop relies on."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import get_worker_info

from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.documents import iter_texts, list_documents, resolve_raw_paths
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import causal_lm_collate
from scaletrain.data.sampler import DistributedPretrainingSampler, GlobalSampleOrder
from scaletrain.data.shards import SplitIndex
from scaletrain.data.tokenizer import Tokenizer
from tests.data.loaders import train_loader

SEQ = 128


def collate_with_worker_id(items: list[dict]) -> dict[str, torch.Tensor]:
    """causal_lm_collate plus which DataLoader worker built the batch and the sample ids it holds."""
    batch = causal_lm_collate(items)
    batch["worker"] = torch.tensor(get_worker_info().id if get_worker_info() else -1)
    batch["sample_id"] = torch.tensor([item["sample_id"] for item in items])
    return batch


def test_packed_stream_is_documents_joined_by_eos(small_dataset: Path, small_dataset_raw: list[Path]) -> None:
    tokenizer = Tokenizer.load(small_dataset)
    texts = list(iter_texts(list_documents(resolve_raw_paths(small_dataset_raw))))
    doc_ids = SplitIndex.load(small_dataset / "train.index.npz").doc_ids
    documents = [tokenizer.encode(texts[i]) for i in doc_ids]
    stream = np.concatenate([document + [tokenizer.eos_id] for document in documents])
    dataset = PackedSequenceDataset(small_dataset, "train", SEQ)
    assert len(dataset) == (len(stream) - 1) // SEQ
    for i in range(len(dataset)):
        np.testing.assert_array_equal(dataset.sample(i), stream[i * SEQ:i * SEQ + SEQ + 1])
    # eos appears only as separators: once after each document that ends inside the sampled stream.
    document_ends = np.cumsum([len(document) + 1 for document in documents]) - 1
    eos_seen = sum(int((dataset.sample(i)[:-1] == tokenizer.eos_id).sum()) for i in range(len(dataset)))
    assert eos_seen == int((document_ends < len(dataset) * SEQ).sum()) >= len(documents) - 1
    with pytest.raises(IndexError):
        dataset.sample(len(dataset))


def test_one_epoch_over_two_ranks_with_two_workers_each_is_exact(small_dataset: Path) -> None:
    micro_batch, ranks = 4, 2
    num_samples = len(PackedSequenceDataset(small_dataset, "train", SEQ))
    steps = -(-num_samples // (micro_batch * ranks))
    served: list[tuple[int, int]] = []
    workers = set()
    for rank in range(ranks):
        loader = train_loader(small_dataset, SEQ, 11, micro_batch, rank, ranks, 0, 2, collate_with_worker_id)
        for batch in itertools.islice(loader, steps):
            served += zip(batch["global_index"].tolist(), batch["sample_id"].tolist(), strict=True)
            workers.add(int(batch["worker"]))
    assert workers == {0, 1}
    global_indices = [g for g, _ in served]
    assert sorted(global_indices) == list(range(steps * micro_batch * ranks))  # no duplicate, no gap
    assert sorted(sample for g, sample in served if g < num_samples) == list(range(num_samples))


def test_layouts_with_the_same_global_batch_consume_the_same_sequences(small_dataset: Path) -> None:
    consumed, steps = 32, 5

    def per_step(dp: int, grad_accum: int) -> list[set[int]]:
        loaders = [iter(train_loader(small_dataset, SEQ, 5, 4, rank, dp, consumed, 0, collate_with_worker_id))
                   for rank in range(dp)]
        return [{s for loader in loaders for _ in range(grad_accum) for s in next(loader)["sample_id"].tolist()}
                for _ in range(steps)]

    single = per_step(dp=1, grad_accum=2)
    assert single == per_step(dp=2, grad_accum=1)
    assert all(len(step) == 8 for step in single)


def test_restart_from_consumed_samples_yields_exactly_the_rest(small_dataset: Path) -> None:
    stride = 2 * 2  # micro_batch_size x data_parallel_size
    num_samples = len(PackedSequenceDataset(small_dataset, "train", SEQ))
    start = (num_samples // stride - 8) * stride  # the run crosses into the second epoch

    def run(consumed: int, batches: int) -> list[torch.Tensor]:
        loader = train_loader(small_dataset, SEQ, 3, 2, 1, 2, consumed, 2, causal_lm_collate)
        return [batch["tokens"] for batch in itertools.islice(loader, batches)]

    uninterrupted = run(start, 30)
    resumed = run(start + 12 * stride, 18)  # as if saved after 12 steps
    for expected, actual in zip(uninterrupted[12:], resumed, strict=True):
        assert torch.equal(expected, actual)


def test_order_reshuffles_each_epoch_and_follows_the_seed() -> None:
    order, same, other = GlobalSampleOrder(50, seed=1), GlobalSampleOrder(50, seed=1), GlobalSampleOrder(50, seed=2)
    epoch0 = [order.sample_id(g) for g in range(50)]
    epoch1 = [order.sample_id(g) for g in range(50, 100)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1
    assert [same.sample_id(g) for g in range(60, 40, -1)] == [order.sample_id(g) for g in range(60, 40, -1)]
    assert [other.sample_id(g) for g in range(50)] != epoch0
    assert [GlobalSampleOrder(50, seed=1, shuffle=False).sample_id(g) for g in (0, 49, 50, 51)] == [0, 49, 0, 1]


def test_sampler_slices_global_batches_like_megatron() -> None:
    sampler = DistributedPretrainingSampler(2, data_parallel_rank=1, data_parallel_size=3, consumed_samples=12,
                                            total_samples=30)
    assert list(sampler) == [[14, 15], [20, 21], [26, 27]] and len(sampler) == 3
    assert next(iter(DistributedPretrainingSampler(2, 0, 3, 6))) == [6, 7]
    with pytest.raises(DataError, match="consumed_samples=5 is not a non-negative multiple of .*=6"):
        DistributedPretrainingSampler(2, 0, 3, 5)
    with pytest.raises(DataError, match="data_parallel_rank=3 must be in"):
        DistributedPretrainingSampler(2, 3, 3, 0)


def test_a_split_shorter_than_one_sequence_says_so(small_dataset: Path) -> None:
    with pytest.raises(DataError, match="fewer than seq_length"):
        PackedSequenceDataset(small_dataset, "val", 10**7)


def test_causal_lm_collate_shifts_labels_by_one() -> None:
    items = [{"global_index": g, "tokens": np.arange(g, g + 5, dtype=np.int64)} for g in (10, 20)]
    batch = causal_lm_collate(items)
    assert batch["tokens"].tolist() == [[10, 11, 12, 13], [20, 21, 22, 23]]
    assert batch["labels"].tolist() == [[11, 12, 13, 14], [21, 22, 23, 24]]
    assert batch["global_index"].tolist() == [10, 20] and batch["tokens"].dtype == torch.long


def test_datasets_survive_pickling_after_opening_shards(small_dataset: Path) -> None:
    packed = PackedSequenceDataset(small_dataset, "train", SEQ)
    dataset = GlobalIndexDataset(packed, GlobalSampleOrder(len(packed), seed=0))
    first = dataset[7]["tokens"]
    clone = pickle.loads(pickle.dumps(dataset))  # what a spawn/forkserver DataLoader worker receives
    np.testing.assert_array_equal(clone[7]["tokens"], first)
