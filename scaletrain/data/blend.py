"""Weighted blends of prepared datasets, as Megatron's `--data-path 0.3 A 0.7 B`.

Which dataset serves global sample g is Megatron's greedy choice by largest error
(megatron/core/datasets/helpers.cpp, `build_blending_indices`): each sample goes to the dataset
whose realised count lags its weight the most, so at every prefix each dataset's count stays
within about one sample of weight x prefix length. Megatron tabulates that choice for every
sample of the run (and caches the table on disk); here it is tabulated once for a period of
BLEND_PERIOD samples and repeated, so g -> (dataset, index within it) costs O(1) for any g, a
resume needs only `consumed_samples`, and the table is a few hundred kB whatever the run's
length. The weights a blend realises are its period's counts / BLEND_PERIOD, within 1/65536 of
the ones asked for.

Each dataset keeps its own epoch order (a GlobalSampleOrder with its own seed stream), drawn
from the index within that dataset: within a dataset's epoch no sample repeats or goes missing,
however the blend interleaves it. Items keep the blended global index, from which objectives
draw their per-sequence noise (BERT masks, T5 spans), so a resumed run redraws the same noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch.utils.data

from scaletrain.data.errors import DataError
from scaletrain.data.manifest import Manifest

BLEND_PERIOD = 1 << 16


class BlendSchedule:
    """global index -> (dataset, index within that dataset), a function of the weights alone."""

    def __init__(self, weights: Sequence[float], period: int = BLEND_PERIOD) -> None:
        weights = np.asarray(weights, dtype=np.float64)
        if len(weights) == 0 or not np.all(np.isfinite(weights)) or np.any(weights <= 0):
            raise DataError(f"blend weights {weights.tolist()} must be positive numbers, at least one")
        self.weights = weights / weights.sum()
        self.period = period
        self.dataset_of, self.rank_in_period = _largest_error_pattern(self.weights, period)
        self.counts_per_period = np.bincount(self.dataset_of, minlength=len(weights)).astype(np.int64)

    @property
    def num_datasets(self) -> int:
        return len(self.weights)

    @property
    def realised_weights(self) -> np.ndarray:
        return self.counts_per_period / self.period

    def locate(self, global_index: int) -> tuple[int, int]:
        if global_index < 0:
            raise IndexError(f"global index {global_index} is negative")
        periods, position = divmod(int(global_index), self.period)
        dataset = int(self.dataset_of[position])
        return dataset, periods * int(self.counts_per_period[dataset]) + int(self.rank_in_period[position])

    def counts_before(self, global_index: int) -> np.ndarray:
        """Samples each dataset has served among global indices [0, global_index)."""
        periods, position = divmod(int(global_index), self.period)
        return periods * self.counts_per_period + np.bincount(self.dataset_of[:position],
                                                              minlength=self.num_datasets)


def _largest_error_pattern(weights: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's build_blending_indices for `length` samples: the dataset of each sample and how
    many earlier samples of the pattern that dataset served (its index within the pattern)."""
    weights_list = weights.tolist()
    datasets = range(len(weights_list))
    served = [0] * len(weights_list)
    dataset_of = np.empty(length, dtype=np.int16 if len(weights_list) < 1 << 15 else np.int64)
    rank = np.empty(length, dtype=np.int64)
    for i in range(length):
        target = max(i, 1)  # Megatron's sample_idx_double = max(sample_idx, 1.0)
        chosen = max(datasets, key=lambda d: weights_list[d] * target - served[d])
        dataset_of[i], rank[i] = chosen, served[chosen]
        served[chosen] += 1
    return dataset_of, rank


class BlendedDataset(torch.utils.data.Dataset):
    """Map-style dataset keyed by global index over several datasets keyed by their own global index.

    Every dataset must serve samples of one length (mixing seq_lengths would make batches that do
    not stack); the item says which dataset it came from under "dataset".
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float],
                 names: Sequence[str]) -> None:
        if not len(datasets) == len(weights) == len(names):
            raise DataError(f"a blend needs one weight and name per dataset: {len(datasets)} datasets, "
                            f"{len(weights)} weights, {len(names)} names")
        lengths = {name: dataset.sequence_length for name, dataset in zip(names, datasets, strict=True)}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{name}: {length}" for name, length in lengths.items())
            raise DataError(f"the blended datasets serve sequences of different lengths ({listed}); "
                            "build every one with the run's seq_length")
        self.datasets, self.names = list(datasets), list(names)
        self.schedule = BlendSchedule(weights)
        self.sequence_length = next(iter(lengths.values()))

    def __getitem__(self, global_index: int) -> dict:
        dataset, index = self.schedule.locate(global_index)
        item = dict(self.datasets[dataset][index])
        item["global_index"], item["dataset"] = global_index, dataset
        return item


def check_same_tokenizer(manifests: dict[str, Manifest]) -> None:
    """Refuse a blend whose datasets were tokenized differently: their token ids would mean different things."""
    (first_name, first), *others = manifests.items()
    for name, manifest in others:
        if manifest.tokenizer_sha256 != first.tokenizer_sha256:
            raise DataError(
                f"blend datasets {first_name!r} and {name!r} were prepared with different tokenizers "
                f"(sha256 {first.tokenizer_sha256[:12]}... vs {manifest.tokenizer_sha256[:12]}...); prepare every "
                f"dataset of a blend with one tokenizer: data.tokenizer=<{first_name}>/{first.tokenizer_file}"
            )
        if manifest.token_dtype != first.token_dtype or manifest.eos_id != first.eos_id:
            raise DataError(f"blend datasets {first_name!r} and {name!r} disagree on token dtype or eos id "
                            f"({first.token_dtype}/{first.eos_id} vs {manifest.token_dtype}/{manifest.eos_id})")
