"""One real single-rank run and one two-rank run, shared by the memory and parameter tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_on_ranks
from tests.planner.measure import measure_single_rank, measure_two_ranks


@pytest.fixture(scope="session")
def single_rank_measurements() -> dict[str, Any]:
    return run_on_ranks(measure_single_rank, 1)[0]


@pytest.fixture(scope="session")
def two_rank_measurements() -> list[dict[str, Any]]:
    return run_on_ranks(measure_two_ranks, 2)
