"""Sample order as a function of (seed, global index) alone, Megatron-style data-parallel slicing, and
which validation sequences an evaluation reads, in which micro-batches.

The whole position in the data is one number, `consumed_samples`: the order
never depends on worker count, rank layout or what happened before a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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


# Second seed word of the validation sample's generator, so it never shares a stream with a training order
# (default_rng([seed, epoch])) whatever the two seeds are.
VALIDATION_SAMPLE_STREAM = 0x5EED_E7A1


def validation_sample(num_samples: int, requested: int | None, seed: int) -> np.ndarray:
    """The global indices of a validation split that an evaluation reads, sorted (shards read in order).

    requested=None, or at least the split: all of it. Fewer: that many drawn without replacement, the
    first `requested` of a permutation from `default_rng([seed, VALIDATION_SAMPLE_STREAM])`, so the draw
    depends on (seed, split size, requested) alone (every run, layout and resume reads the same
    sequences) and a larger sample holds every smaller one of the same seed."""
    if num_samples < 1:
        raise DataError(f"the validation split has num_samples={num_samples}; it must hold at least one sequence")
    if requested is None or requested >= num_samples:
        return np.arange(num_samples)
    if requested < 1:
        raise DataError(f"requested={requested} validation sequences must be >= 1")
    permutation = np.random.default_rng([seed, VALIDATION_SAMPLE_STREAM]).permutation(num_samples)
    return np.sort(permutation[:requested])


@dataclass(frozen=True)
class EvaluationMicroBatch:
    """One forward pass of an evaluation: `indices` (micro_batch_size of them) and the share of its rows
    that count, 1 (distinct sequences), 1/micro_batch_size (copies of one sequence) or 0 (a filler)."""

    indices: list[int]
    share: float


def evaluation_micro_batches(
    indices: np.ndarray, micro_batch_size: int, data_parallel_size: int
) -> list[EvaluationMicroBatch]:
    """Every sequence of `indices` once, in micro-batches of the training shape, a whole number per rank.

    Rank r evaluates micro-batches r, r + dp, r + 2 dp... (DistributedPretrainingSampler's slicing). The
    sequences past the last whole micro-batch each fill one micro-batch with copies of themselves, so
    every forward has the shape the layout expects (pipeline stages exchange fixed shapes; ZeRO-3 and
    expert parallelism need every rank to run as many forwards) and the micro-batch mean of any loss
    is that sequence's own (with expert capacity, model.moe.capacity_factor, copies compete for it, as any
    micro-batch's tokens do); filler micro-batches even out the ranks and count for nothing. Apart from
    the fillers the list does not depend on the data-parallel size, so every layout averages the same losses."""
    if micro_batch_size < 1 or data_parallel_size < 1:
        raise DataError(f"micro_batch_size={micro_batch_size} and data_parallel_size={data_parallel_size} "
                        "must be positive")
    if len(indices) < 1:
        raise DataError("an evaluation needs at least one sequence")
    ids = [int(index) for index in indices]
    whole = len(ids) // micro_batch_size * micro_batch_size
    batches = [EvaluationMicroBatch(ids[start:start + micro_batch_size], 1.0)
               for start in range(0, whole, micro_batch_size)]
    batches += [EvaluationMicroBatch([index] * micro_batch_size, 1 / micro_batch_size) for index in ids[whole:]]
    filler = EvaluationMicroBatch(batches[0].indices, 0.0)
    return batches + [filler] * (-len(batches) % data_parallel_size)
