"""A train loader over one prepared dataset, composed of the parts the trainer's loader is made of
(train/objective.py: packed sequences, global sample order, rank sampler, batch_loader), for tests
of those parts without a config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch.utils.data import DataLoader

from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.loader import batch_loader
from scaletrain.data.objectives import causal_lm_collate
from scaletrain.data.sampler import DistributedPretrainingSampler, GlobalSampleOrder
from scaletrain.data.storage import DatasetLocation, ShardCacheSettings


def train_loader(
    data_dir: Path | str | DatasetLocation,
    seq_length: int,
    seed: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int,
    num_workers: int,
    collate_fn: Callable = causal_lm_collate,
    *,
    cache: ShardCacheSettings | None = None,
) -> DataLoader:
    """Endless micro-batches of this rank's slice of the train split, from `consumed_samples` on."""
    packed = PackedSequenceDataset(data_dir, "train", seq_length, cache=cache)
    dataset = GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed))
    sampler = DistributedPretrainingSampler(micro_batch_size, data_parallel_rank, data_parallel_size, consumed_samples)
    return batch_loader(dataset, sampler, num_workers, collate_fn)
