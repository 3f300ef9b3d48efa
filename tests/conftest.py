"""Shared fixtures. Data: the real Shakespeare corpus (built once into .cache/) and a small prepared dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

# A few works of different lengths (the Phoenix is 70 lines) keep tokenizer training to seconds.
SMALL_DATASET_WORKS = ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt", "sonnets_gut.txt",
                       "julius_caesar_gut.txt", "phoenix_and_the_turtle_gut.txt")
SMALL_DATASET_SETTINGS = {"vocab_size": 1024, "num_sentinels": 16, "val_fraction": 0.3,
                          "max_tokens_per_shard": 60_000, "num_workers": 2, "seed": 0}


@pytest.fixture(scope="session")
def shakespeare_corpus() -> list[Path]:
    """The full deduplicated corpus, one .txt per work; built into .cache/ on first use, then reused."""
    from data_pipelines.shakespeare import DEFAULT_CACHE_DIR, build_corpus

    return build_corpus(DEFAULT_CACHE_DIR / "shakespeare", DEFAULT_CACHE_DIR)


@pytest.fixture(scope="session")
def small_dataset_raw(shakespeare_corpus: list[Path]) -> list[Path]:
    """The raw .txt files of SMALL_DATASET_WORKS."""
    by_name = {path.name: path for path in shakespeare_corpus}
    return [by_name[name] for name in SMALL_DATASET_WORKS]


@pytest.fixture(scope="session")
def small_dataset(small_dataset_raw: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset (tokenizer, train + val shards, manifest) of SMALL_DATASET_WORKS; treat as read-only."""
    from scaletrain.data.prepare import prepare_dataset

    data_dir = tmp_path_factory.mktemp("small_dataset") / "data"
    prepare_dataset(small_dataset_raw, data_dir, **SMALL_DATASET_SETTINGS)
    return data_dir
