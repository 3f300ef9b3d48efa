"""Shared fixtures. Data: the real Shakespeare corpus (built once into .cache/) and a small prepared dataset."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from pathlib import Path

import pytest

# A few works of different lengths (the Phoenix is 70 lines) keep tokenizer training to seconds.
SMALL_DATASET_WORKS = ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt", "sonnets_gut.txt",
                       "julius_caesar_gut.txt", "phoenix_and_the_turtle_gut.txt")
SMALL_DATASET_SETTINGS = {"vocab_size": 1024, "num_sentinels": 16, "val_fraction": 0.3,
                          "max_tokens_per_shard": 60_000, "num_workers": 2, "seed": 0}


def pytest_sessionstart(session: pytest.Session) -> None:
    """A run over whole directories (`make test`) starts the warm test server (tests/warm.py
    warm_socket) in the background now instead of at its first use: it imports torch, megatron-core,
    DeepSpeed and transformers (about 6 s of CPU), which then overlaps the single-threaded collection on
    the other core instead of holding up the first test that runs a scaletrain command. (Its output goes
    to its own log and each fork takes its client's stdin/stdout/stderr, so starting it outside pytest's
    capture changes no test's output; the multiprocessing fork server, whose ranks print to the fds it
    started with, still starts on first use, inside the capture.) A run of chosen files or tests starts
    it as before, on first use: it may need none."""
    if session.config.option.collectonly or not any(Path(arg).is_dir() for arg in session.config.args):
        return
    if _is_xdist_controller(session.config):  # pytest-xdist's controller runs no tests; each worker starts its own
        return
    threading.Thread(target=_start_warm_server, name="start-warm-server", daemon=True).start()


def _is_xdist_controller(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def _start_warm_server() -> None:
    from tests.warm import warm_socket

    with contextlib.suppress(Exception):  # where it fails to start, the first test needing it says why
        warm_socket()


@pytest.fixture(scope="session")
def shakespeare_corpus() -> list[Path]:
    """The full deduplicated corpus, one .txt per work; built into .cache/ on first use, then reused. Under a
    lock: the workers of a parallel run (`make test`) would otherwise build it at once into the same place."""
    from data_pipelines.shakespeare import DEFAULT_CACHE_DIR, build_corpus

    DEFAULT_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with (DEFAULT_CACHE_DIR / "shakespeare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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


# ---------------------------------------------------------------------------------------------
# The time budget (issue 22): every run ends with the ten slowest tests, the time by directory and the
# total, and names any test over PER_TEST_BUDGET_S that is not a real multi-host or SLURM job
# (@pytest.mark.long_job), so growth is seen when it happens. Printed, not failed: timings on a shared
# box are noise for a pass/fail decision (speed goals are checked by benchmarks/).

PER_TEST_BUDGET_S = 90.0
_durations: dict[str, float] = {}
_long_jobs: set[str] = set()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _long_jobs.update(item.nodeid for item in items if item.get_closest_marker("long_job"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


# SCALETRAIN_TEST_TIMES=FILE: each test's wall time and the machine's busy CPU time meanwhile (every process, from
# /proc/stat: on a quiet machine, what the test and the processes it started used), as JSON at the end. A test whose
# CPU time is well below its wall time waits (a timeout, a stall, a scheduler) more than it computes. A pytest-xdist
# worker writes FILE.gw0, FILE.gw1, ...; there the busy CPU includes what the other workers' tests used meanwhile.
_machine_times: dict[str, tuple[float, float]] = {}


def _busy_cpu_s() -> float:
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not os.environ.get("SCALETRAIN_TEST_TIMES"):
        yield
        return
    wall, busy = time.monotonic(), _busy_cpu_s()
    yield
    _machine_times[item.nodeid] = (time.monotonic() - wall, _busy_cpu_s() - busy)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("SCALETRAIN_TEST_TIMES")
    if path and _machine_times:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        Path(f"{path}.{worker}" if worker else path).write_text(json.dumps(_machine_times, indent=1))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _durations:
        return
    write = terminalreporter.write_line
    terminalreporter.section("time budget")
    write("ten slowest tests (setup + call + teardown):")
    for nodeid, seconds in sorted(_durations.items(), key=lambda item: -item[1])[:10]:
        write(f"  {seconds:7.1f} s  {nodeid}")
    by_directory: dict[str, float] = {}
    for nodeid, seconds in _durations.items():
        directory = nodeid.split("::")[0].rsplit("/", 1)[0]
        by_directory[directory] = by_directory.get(directory, 0.0) + seconds
    write("by directory: " + ", ".join(f"{name} {seconds / 60:.1f} min"
                                       for name, seconds in sorted(by_directory.items(), key=lambda item: -item[1])))
    write(f"total: {sum(_durations.values()) / 60:.1f} min in {len(_durations)} tests")
    over = [nodeid for nodeid, seconds in _durations.items()
            if seconds > PER_TEST_BUDGET_S and nodeid not in _long_jobs]
    for nodeid in over:
        write(f"over the {PER_TEST_BUDGET_S:.0f} s budget: {nodeid} ({_durations[nodeid]:.0f} s); make it cheaper, "
              "or mark it long_job if it is a real multi-host or SLURM job")
