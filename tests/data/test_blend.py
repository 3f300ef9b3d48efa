"""Blends of prepared datasets: proportions at every prefix, each dataset's epochs intact across ranks and
workers, exact resume from consumed_samples, and refusal of datasets that cannot be mixed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.data.blend import BLEND_PERIOD, BlendedDataset, BlendSchedule
from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.loader import batch_loader
from scaletrain.data.objectives import causal_lm_collate
from scaletrain.data.sampler import DistributedPretrainingSampler, GlobalSampleOrder
from scaletrain.train.preflight import check_data_matches
from tests.conftest import SMALL_DATASET_SETTINGS
from tests.train.runs import DEMO_CONFIG

SEQ = 32
WEIGHTS = (0.3, 0.7)


@pytest.fixture(scope="module")
def other_tokenizer_dataset(shakespeare_corpus: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other works, with a tokenizer trained on them (so a different one from small_dataset's)."""
    from scaletrain.data.prepare import prepare_dataset

    works = {"othello_gut.txt", "king_lear_gut.txt", "much_ado_about_nothing_gut.txt", "venus_and_adonis_gut.txt"}
    raw = [path for path in shakespeare_corpus if path.name in works]
    data_dir = tmp_path_factory.mktemp("other_tokenizer") / "data"
    prepare_dataset(raw, data_dir, **SMALL_DATASET_SETTINGS)
    return data_dir


def blended(data_dirs: list[Path], weights=WEIGHTS, seed: int = 3, seq_length: int = SEQ) -> BlendedDataset:
    datasets = []
    for stream, data_dir in enumerate(data_dirs):
        packed = PackedSequenceDataset(data_dir, "train", seq_length)
        datasets.append(GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed, stream=stream)))
    return BlendedDataset(datasets, weights, [f"d{index}" for index in range(len(data_dirs))])


@pytest.mark.parametrize("weights", [(0.2, 0.3, 0.5), (0.7, 0.3), (1, 1, 1), (0.01, 0.99), (5, 3, 1, 1)])
def test_schedule_tracks_the_weights_at_every_prefix(weights):
    schedule = BlendSchedule(weights)
    target = np.asarray(weights, dtype=float) / sum(weights)
    served = np.zeros(len(weights), dtype=np.int64)
    located = [[] for _ in weights]
    for global_index in range(3 * BLEND_PERIOD // 2):  # past the end of one period
        dataset, index = schedule.locate(global_index)
        located[dataset].append(index)
        served[dataset] += 1
        assert np.abs(served - target * (global_index + 1)).max() < 2, (global_index, served)
    for indices in located:  # each dataset's own indices run 0, 1, 2, ... in the order it is served
        assert indices == list(range(len(indices)))
    assert np.abs(schedule.realised_weights - target).max() < 1 / BLEND_PERIOD * len(weights)
    far = 10**12 + 12345
    np.testing.assert_array_equal(schedule.counts_before(far + 1) - schedule.counts_before(far),
                                  np.eye(len(weights), dtype=np.int64)[schedule.locate(far)[0]])
    assert schedule.locate(far)[1] == schedule.counts_before(far)[schedule.locate(far)[0]]


def test_bad_weights_are_refused():
    for weights in [(), (0.5, 0.0), (1.0, -1.0), (float("nan"), 1.0)]:
        with pytest.raises(DataError, match="weights"):
            BlendSchedule(weights)


def _items(batch: list[dict]) -> list[tuple[int, int, int]]:
    return [(item["global_index"], item["dataset"], item["sample_id"]) for item in batch]


def test_epochs_of_each_dataset_are_whole_across_ranks_and_workers(small_dataset, other_tokenizer_dataset):
    dataset = blended([small_dataset, other_tokenizer_dataset])
    sizes = [part.packed.num_samples for part in dataset.datasets]
    micro_batch, ranks = 4, 2
    # enough global samples that each dataset finishes its first epoch
    total = int(max(size / weight for size, weight in zip(sizes, WEIGHTS, strict=True))) + 64
    total += -total % (micro_batch * ranks)
    seen = []
    for rank in range(ranks):
        sampler = DistributedPretrainingSampler(micro_batch, rank, ranks, 0, total)
        for batch in batch_loader(dataset, sampler, num_workers=2, collate_fn=_items):
            seen.extend(batch)
    assert sorted(global_index for global_index, _, _ in seen) == list(range(total))
    seen.sort()
    for number, size in enumerate(sizes):
        ids = [sample_id for _, dataset_number, sample_id in seen if dataset_number == number]
        assert len(ids) >= size
        assert sorted(ids[:size]) == list(range(size)), f"dataset {number}: first epoch not a permutation"
    first_thousand = np.bincount([dataset_number for _, dataset_number, _ in seen[:1000]], minlength=2) / 1000
    np.testing.assert_allclose(first_thousand, WEIGHTS, rtol=0.01)


def test_resume_mid_blend_reads_the_same_batches(small_dataset, other_tokenizer_dataset):
    dataset = blended([small_dataset, other_tokenizer_dataset])
    micro_batch, ranks, steps, resume_at = 4, 2, 12, 5

    def batches(rank: int, consumed: int) -> list[dict]:
        sampler = DistributedPretrainingSampler(micro_batch, rank, ranks, consumed, steps * micro_batch * ranks)
        return list(batch_loader(dataset, sampler, num_workers=2, collate_fn=causal_lm_collate))

    for rank in range(ranks):
        uninterrupted, resumed = batches(rank, 0), batches(rank, resume_at * micro_batch * ranks)
        assert len(resumed) == steps - resume_at
        for expected, actual in zip(uninterrupted[resume_at:], resumed, strict=True):
            for key in expected:
                torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0)


def test_a_different_seed_changes_each_dataset_order_not_the_mix(small_dataset, other_tokenizer_dataset):
    first, second = blended([small_dataset, other_tokenizer_dataset], seed=1), \
        blended([small_dataset, other_tokenizer_dataset], seed=2)
    picks = [(first[g]["dataset"], second[g]["dataset"], first[g]["sample_id"], second[g]["sample_id"])
             for g in range(64)]
    assert all(a == b for a, b, _, _ in picks)
    assert any(a != b for _, _, a, b in picks)


def test_datasets_of_different_sequence_lengths_are_refused(small_dataset):
    def packed(seq_length: int) -> GlobalIndexDataset:
        sequences = PackedSequenceDataset(small_dataset, "train", seq_length)
        return GlobalIndexDataset(sequences, GlobalSampleOrder(sequences.num_samples, 0))

    with pytest.raises(DataError, match="different lengths \\(a: 32, b: 64\\)"):
        BlendedDataset([packed(32), packed(64)], [1, 1], ["a", "b"])


def test_datasets_with_different_tokenizers_are_refused(small_dataset, other_tokenizer_dataset):
    config = load_config(DEMO_CONFIG, [
        "data.vocab_size=1024", "data.num_sentinels=16",
        f"data.blend=[{{dir: {small_dataset}, weight: 1, name: shakespeare}}, "
        f"{{dir: {other_tokenizer_dataset}, weight: 2, name: tragedies}}]",
    ])
    with pytest.raises(DataError, match="'shakespeare' and 'tragedies' were prepared with different tokenizers"):
        check_data_matches(config)


def test_blend_config_errors_name_the_entry():
    with pytest.raises(ConfigError, match=r"data.blend\[1\].weight=0.0 must be > 0"):
        load_config(DEMO_CONFIG, ["data.blend=[{dir: a, weight: 1}, {dir: b, weight: 0}]"])
    with pytest.raises(ConfigError, match="data.blend names \\['web'\\] more than one dataset"):
        load_config(DEMO_CONFIG, ["data.blend=[{dir: x/web, weight: 1}, {dir: y/web/, weight: 1}]"])
    with pytest.raises(ConfigError, match="unknown key data.blend\\[0\\].path"):
        load_config(DEMO_CONFIG, ["data.blend=[{path: a, weight: 1}]"])
