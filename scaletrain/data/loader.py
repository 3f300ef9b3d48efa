"""DataLoaders for training (shuffled, resumable from consumed_samples) and evaluation (fixed order)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch.utils.data import DataLoader, Dataset

from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.objectives import causal_lm_collate
from scaletrain.data.sampler import DistributedPretrainingSampler, GlobalSampleOrder
from scaletrain.data.storage import DatasetLocation, ShardCacheSettings


def build_train_loader(
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
    """Endless micro-batches of this rank's slice of the train split, from `consumed_samples` on.

    Deterministic for any num_workers: the batch sampler fixes every batch's
    global indices in the main process and DataLoader deals whole batches to
    workers and returns them in order, so nothing is duplicated or lost. `data_dir` may be
    remote (see data/storage.py); `cache` says where its shards are cached.
    """
    packed = PackedSequenceDataset(data_dir, "train", seq_length, cache=cache)
    dataset = GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed))
    sampler = DistributedPretrainingSampler(micro_batch_size, data_parallel_rank, data_parallel_size, consumed_samples)
    return batch_loader(dataset, sampler, num_workers, collate_fn)


def build_eval_loader(
    data_dir: Path | str | DatasetLocation,
    seq_length: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_samples: int | None = None,
    num_workers: int = 0,
    collate_fn: Callable = causal_lm_collate,
    *,
    cache: ShardCacheSettings | None = None,
) -> DataLoader:
    """The val split's first `num_samples` sequences (all if None) in fixed order, sliced by rank.

    The count is rounded down to whole global micro-batches (mbs * dp) so every
    rank runs the same number of eval steps.
    """
    packed = PackedSequenceDataset(data_dir, "val", seq_length, cache=cache)
    requested = packed.num_samples if num_samples is None else num_samples
    if requested > packed.num_samples:
        raise DataError(f"num_samples={requested} eval sequences requested; the val split has {packed.num_samples} "
                        f"of seq_length={seq_length}: ask for fewer or prepare with a larger val_fraction")
    stride = micro_batch_size * data_parallel_size
    total = requested - requested % stride
    if total == 0:
        raise DataError(f"{requested} eval sequences make no full global micro-batch of "
                        f"micro_batch_size*data_parallel_size={stride}; evaluate on more sequences")
    dataset = GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed=0, shuffle=False))
    sampler = DistributedPretrainingSampler(micro_batch_size, data_parallel_rank, data_parallel_size, 0, total)
    return batch_loader(dataset, sampler, num_workers, collate_fn)


def batch_loader(dataset: Dataset, sampler: DistributedPretrainingSampler, num_workers: int,
                 collate_fn: Callable) -> DataLoader:
    """A loader over any dataset keyed by global index (packed sequences, sentence pairs)."""
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_fn,
                      persistent_workers=False, pin_memory=False)
