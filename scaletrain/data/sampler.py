"""Sample order as a function of (seed, global index) alone, and Megatron-style data-parallel slicing.

The whole position in the data is one number, `consumed_samples`: the order
never depends on worker count, rank layout or what happened before a restart.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from scaletrain.data.errors import DataError


class GlobalSampleOrder:
    """global index g -> sample id: epoch g // N, position g % N in that epoch's permutation.

    As Megatron's pretraining random sampler: each epoch is a fresh permutation
    drawn from `default_rng([seed, epoch])`, so any g is computable without
    replaying earlier epochs. With shuffle=False (evaluation) it is g % N. `stream` tells apart
    orders that share a seed: the datasets of a blend draw from `default_rng([seed, stream, epoch])`.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True, stream: int | None = None) -> None:
        if num_samples < 1:
            raise DataError(f"num_samples={num_samples} must be positive")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self._seed_words = [seed] if stream is None else [seed, stream]
        self._cached_epoch: int | None = None
        self._cached_permutation: np.ndarray | None = None

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        if self._cached_epoch != epoch:
            rng = np.random.default_rng([*self._seed_words, epoch])
            self._cached_permutation, self._cached_epoch = rng.permutation(self.num_samples), epoch
        return self._cached_permutation

    def sample_id(self, global_index: int) -> int:
        if global_index < 0:
            raise IndexError(f"global index {global_index} is negative")
        epoch, position = divmod(int(global_index), self.num_samples)
        if not self.shuffle:
            return position
        return int(self.epoch_permutation(epoch)[position])


class DistributedPretrainingSampler:
    """Batch sampler: this data-parallel rank's micro-batches of global indices.

    Micro-batch k of rank r is consumed_samples + k*mbs*dp + r*mbs + [0, mbs),
    exactly Megatron's MegatronPretrainingSampler. A step of grad_accum
    micro-batches thus covers the consecutive global indices
    [consumed, consumed + mbs*grad_accum*dp) whatever the split between
    grad_accum and dp, so layouts with the same global batch see the same
    sequences per step. Infinite unless `total_samples` is given.
    """

    def __init__(
        self,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        consumed_samples: int,
        total_samples: int | None = None,
    ) -> None:
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise DataError(f"micro_batch_size={micro_batch_size} and data_parallel_size={data_parallel_size} "
                            "must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(f"data_parallel_rank={data_parallel_rank} must be in [0, {data_parallel_size})")
        stride = micro_batch_size * data_parallel_size
        if consumed_samples < 0 or consumed_samples % stride:
            raise DataError(
                f"consumed_samples={consumed_samples} is not a non-negative multiple of "
                f"micro_batch_size*data_parallel_size={stride}; it must count whole global batches "
                "(was the checkpoint written with a different global batch size?)"
            )
        self.micro_batch_size, self.rank, self.stride = micro_batch_size, data_parallel_rank, stride
        self.consumed_samples, self.total_samples = consumed_samples, total_samples

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while self.total_samples is None or start + self.stride <= self.total_samples:
            first = start + self.rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += self.stride

    def __len__(self) -> int:
        if self.total_samples is None:
            raise TypeError("an infinite DistributedPretrainingSampler has no length; pass total_samples")
        return max(0, (self.total_samples - self.consumed_samples) // self.stride)
