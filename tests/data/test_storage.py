"""Datasets behind URLs and pipe commands: same samples as local, a verified size-limited cache, retries, errors.

Real HTTP servers on 127.0.0.1 serve the small prepared dataset; some of them misbehave on purpose
(drop the connection mid-shard, answer 503, serve flipped bytes, accept and then send nothing).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import http.server
import importlib.util
import itertools
import multiprocessing
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.data.dataset import PackedSequenceDataset
from scaletrain.data.errors import DataError
from scaletrain.data.manifest import MANIFEST_NAME
from scaletrain.data.storage import ShardCacheSettings, load_manifest, open_location, upload_dataset
from scaletrain.data.tokenizer import Tokenizer
from tests.data.loaders import train_loader

SEQ = 128
REPO = Path(__file__).resolve().parents[2]


class DatasetHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a directory; `faults` maps a file name to what goes wrong on its next requests."""

    faults: dict[str, list[str]]  # name -> per-request behaviours, popped in order:
    #                               drop | 503 | corrupt | slow | stall | stall_body | ok
    always: dict[str, str]  # name -> behaviour on every request
    requests: collections.Counter
    closing: threading.Event  # set when the server shuts down: ends the stalls

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        self.requests[name] += 1
        pending = self.faults.get(name)
        fault = pending.pop(0) if pending else self.always.get(name, "ok")
        if fault == "slow":  # long enough for every concurrent reader to be waiting for this one
            time.sleep(0.5)
        if fault in ("ok", "slow"):
            return super().do_GET()
        if fault == "503":
            return self.send_error(503)
        if fault == "stall":  # the connection is accepted, then nothing comes
            self.closing.wait()
            return None
        payload = (Path(self.directory) / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if fault == "stall_body":  # headers and half the body, then nothing
            self.wfile.write(payload[:len(payload) // 2])
            self.wfile.flush()
            self.closing.wait()
        elif fault == "corrupt":
            self.wfile.write(payload[:100] + bytes([payload[100] ^ 0xFF]) + payload[101:])
        else:  # drop: half the body, then the connection goes away
            self.wfile.write(payload[:len(payload) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)


@contextlib.contextmanager
def serve(directory: Path, faults: dict[str, list[str]] | None = None,
          always: dict[str, str] | None = None) -> Iterator[tuple[str, collections.Counter]]:
    """A ThreadingHTTPServer on a free port; yields its base URL and the request count per file."""
    requests: collections.Counter = collections.Counter()
    closing = threading.Event()
    handler = type("Handler", (DatasetHandler,), {"faults": faults or {}, "always": always or {},
                                                  "requests": requests, "closing": closing})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", requests
    finally:
        closing.set()
        server.shutdown()
        server.server_close()


def cache_settings(directory: Path, limit_bytes: int = 1 << 30, retries: int = 2,
                   read_timeout_s: float = 60.0) -> ShardCacheSettings:
    return ShardCacheSettings(directory, limit_bytes, download_retries=retries, retry_backoff_s=0.01,
                              read_timeout_s=read_timeout_s)


def cached_files(cache_dir: Path) -> list[Path]:
    return [path for path in cache_dir.glob("datasets/*/*/*") if not path.name.endswith(".lock")]


def shard_names(data_dir: Path, split: str = "train") -> list[str]:
    return [shard.name for shard in load_manifest(data_dir).split(split).shards]


def assert_same_samples(local: PackedSequenceDataset, remote: PackedSequenceDataset) -> None:
    assert len(local) == len(remote)
    for i in range(len(local)):
        np.testing.assert_array_equal(local.sample(i), remote.sample(i))


def one_epoch_with_two_workers(location: Path | str, cache: ShardCacheSettings | None = None) -> torch.Tensor:
    num_samples = len(PackedSequenceDataset(location, "train", SEQ, cache=cache))
    loader = train_loader(location, SEQ, seed=3, micro_batch_size=8, data_parallel_rank=0, data_parallel_size=1,
                                consumed_samples=0, num_workers=2, cache=cache)
    return torch.cat([batch["tokens"] for batch in itertools.islice(loader, -(-num_samples // 8))])


def test_http_dataset_reads_the_local_samples_through_the_cache(small_dataset: Path, tmp_path: Path) -> None:
    cache = cache_settings(tmp_path / "cache")
    with serve(small_dataset) as (url, requests):
        for split in ("train", "val"):
            assert_same_samples(PackedSequenceDataset(small_dataset, split, SEQ),
                                PackedSequenceDataset(url, split, SEQ, cache=cache))
        assert torch.equal(one_epoch_with_two_workers(small_dataset), one_epoch_with_two_workers(url, cache))
        # shards were each downloaded once, by whichever process got there first, then reused from the cache
        assert all(requests[name] == 1 for name in shard_names(small_dataset)), requests
        tokenizer = Tokenizer.load(open_location(url, cache).tokenizer_path())
    assert tokenizer.encode("To be") == Tokenizer.load(small_dataset).encode("To be")
    names = {path.name for path in cached_files(tmp_path / "cache")}
    assert set(shard_names(small_dataset)) | {"train.index.npz", "tokenizer.model"} <= names
    assert not any(name.endswith(".partial") for name in names)


def first_document_of_shard(remote: PackedSequenceDataset, shard_id: int) -> bytes:
    doc = int(np.flatnonzero(remote._shard_ids == shard_id)[0])
    return remote.document_tokens(doc).tobytes()


def test_processes_reading_one_shard_at_once_download_it_once(small_dataset: Path, tmp_path: Path) -> None:
    shard = shard_names(small_dataset)[1]
    with serve(small_dataset, always={shard: "slow"}) as (url, requests):
        remote = PackedSequenceDataset(url, "train", SEQ, cache=cache_settings(tmp_path / "cache"))
        with multiprocessing.get_context("fork").Pool(4) as pool:
            read = pool.starmap(first_document_of_shard, [(remote, 1)] * 4)
    expected = first_document_of_shard(PackedSequenceDataset(small_dataset, "train", SEQ), 1)
    assert read == [expected] * 4
    assert requests[shard] == 1


def test_a_small_cache_evicts_the_least_recently_used_and_reads_still_succeed(small_dataset: Path,
                                                                             tmp_path: Path) -> None:
    largest = max(path.stat().st_size for path in small_dataset.glob("train-*.tar"))
    cache = cache_settings(tmp_path / "cache", limit_bytes=largest + 200_000)  # one shard and the small files
    with serve(small_dataset) as (url, requests):
        assert torch.equal(one_epoch_with_two_workers(small_dataset), one_epoch_with_two_workers(url, cache))
    shards = shard_names(small_dataset)
    assert sum(requests[name] for name in shards) > len(shards), "nothing was evicted and fetched again"
    assert sum(path.stat().st_size for path in cached_files(tmp_path / "cache")) <= cache.limit_bytes


@pytest.mark.parametrize("fault", ["drop", "503"])
def test_a_transfer_that_fails_twice_is_retried(small_dataset: Path, tmp_path: Path, fault: str) -> None:
    shard = shard_names(small_dataset)[1]
    with serve(small_dataset, faults={shard: [fault, fault]}) as (url, requests):
        remote = PackedSequenceDataset(url, "train", SEQ, cache=cache_settings(tmp_path / "cache", retries=2))
        assert_same_samples(PackedSequenceDataset(small_dataset, "train", SEQ), remote)
    assert requests[shard] == 3


def test_a_shard_that_never_arrives_whole_is_one_error_naming_its_url(small_dataset: Path, tmp_path: Path) -> None:
    shard = shard_names(small_dataset)[0]
    with serve(small_dataset, always={shard: "drop"}) as (url, requests):
        remote = PackedSequenceDataset(url, "train", SEQ, cache=cache_settings(tmp_path / "cache", retries=2))
        with pytest.raises(DataError, match=rf"could not download {url}/{shard} after 3 tries; last error "
                                            r"ClientPayloadError: .*"):
            remote.sample(0)
    assert requests[shard] == 3
    assert not [path for path in cached_files(tmp_path / "cache") if path.name.startswith(shard)]


@pytest.mark.serial  # a wall-clock bound (< 5 s for two 0.3 s timeouts), which load stretched to 7.9 s
@pytest.mark.parametrize("stall", ["stall", "stall_body"])
def test_a_server_that_stops_sending_is_given_up_after_the_read_timeout(small_dataset: Path, tmp_path: Path,
                                                                       stall: str) -> None:
    """Before the fix a stalled server hung the job for good (aiohttp waits forever on a silent body)."""
    shard = shard_names(small_dataset)[0]
    with serve(small_dataset, always={shard: stall}) as (url, requests):
        remote = PackedSequenceDataset(url, "train", SEQ, cache=cache_settings(tmp_path / "cache", retries=1,
                                                                                read_timeout_s=0.3))
        started = time.monotonic()
        with pytest.raises(DataError, match=rf"could not download {url}/{shard} after 2 tries; last error "
                                            r"TransferStalled: no data for 0.3 s$"):
            remote.sample(0)
        assert time.monotonic() - started < 5
    assert requests[shard] == 2
    assert not [path for path in cached_files(tmp_path / "cache") if path.name.startswith(shard)]


@pytest.mark.serial  # a wall-clock bound, as above
def test_a_pipe_command_that_stops_writing_is_killed_after_the_read_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    location = f"pipe:echo $$ > {pid_file}; exec sleep 60 # {{file}}"
    started = time.monotonic()
    with pytest.raises(DataError, match=r"could not download pipe:echo .* after 1 tries; last error TransferStalled: "
                                        r"the command wrote nothing for 0.3 s$"):
        load_manifest(location, cache=cache_settings(tmp_path / "cache", retries=0, read_timeout_s=0.3))
    assert time.monotonic() - started < 5
    assert not psutil.pid_exists(int(pid_file.read_text())), "the stalled command was left running"


RANK_SCRIPT = """
import sys
from pathlib import Path
from scaletrain.data.storage import ShardCacheSettings
from tests.data.loaders import train_loader
loader = train_loader(sys.argv[1], 128, 3, 8, 0, 1, 0, num_workers=1, cache=ShardCacheSettings(Path(sys.argv[2])))
next(iter(loader))  # its worker blocks on a stalled shard
"""


def test_a_loader_worker_blocked_in_a_read_dies_with_its_rank(small_dataset: Path, tmp_path: Path) -> None:
    """SIGKILL to the rank: its worker, blocked on a server that accepted and went silent, used to live
    on under PID 1 (PyTorch's watchdog checks the parent only between batches)."""
    shards = shard_names(small_dataset)
    with serve(small_dataset, always=dict.fromkeys(shards, "stall")) as (url, requests):
        rank = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, url, str(tmp_path / "cache")], cwd=REPO,
                                stderr=subprocess.PIPE, text=True)
        workers: list[psutil.Process] = []
        try:
            deadline = time.monotonic() + 120
            while not any(requests[name] for name in shards):
                assert rank.poll() is None and time.monotonic() < deadline, rank.stderr.read()
                time.sleep(0.05)
            workers = psutil.Process(rank.pid).children()
            assert len(workers) == 1
            rank.kill()
            rank.wait()
            deadline = time.monotonic() + 10
            while is_running(workers[0]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not is_running(workers[0]), "the loader worker outlived its rank"
        finally:
            rank.kill()
            rank.wait()
            for worker in workers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.kill()


def is_running(process: psutil.Process) -> bool:
    """It exists and is not a zombie waiting for its new parent to reap it."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_corrupt_shard_is_fetched_again_once_then_refused(small_dataset: Path, tmp_path: Path) -> None:
    shard = shard_names(small_dataset)[0]
    with serve(small_dataset, always={shard: "corrupt"}) as (url, requests):
        remote = PackedSequenceDataset(url, "train", SEQ, cache=cache_settings(tmp_path / "cache"))
        with pytest.raises(DataError, match=rf"{url}/{shard} is corrupt: sha256 mismatch after 2 downloads"):
            remote.sample(0)
    assert requests[shard] == 2
    assert not [path for path in cached_files(tmp_path / "cache") if path.name.startswith(shard)]


def test_a_pipe_command_reads_the_same_samples(small_dataset: Path, tmp_path: Path) -> None:
    location = f"pipe:cat {small_dataset}/{{file}}"
    remote = PackedSequenceDataset(location, "val", SEQ, cache=cache_settings(tmp_path / "cache"))
    assert_same_samples(PackedSequenceDataset(small_dataset, "val", SEQ), remote)


def test_a_failing_pipe_command_says_which_command_and_why(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=rf"could not download pipe:cat {missing}/manifest.json after 2 tries; "
                                        rf"last error OSError: `cat {missing}/manifest.json` exited with status 1: "
                                        r"cat: .*No such file or directory"):
        load_manifest(f"pipe:cat {missing}/{{file}}", cache=cache_settings(tmp_path / "cache", retries=1))
    with pytest.raises(DataError, match=r"has no \{file\} placeholder"):
        load_manifest("pipe:aws s3 cp s3://bucket/data -")


def test_upload_to_an_fsspec_location_then_read_back(small_dataset: Path, tmp_path: Path) -> None:
    local = PackedSequenceDataset(small_dataset, "train", SEQ)
    for location in (f"file://{tmp_path}/uploaded", "memory://scaletrain-test/uploaded"):
        assert upload_dataset(small_dataset, location) == location
        assert_same_samples(local, PackedSequenceDataset(location, "train", SEQ,
                                                         cache=cache_settings(tmp_path / "cache")))
    assert sorted(path.name for path in (tmp_path / "uploaded").iterdir()) == sorted(
        path.name for path in small_dataset.iterdir())


def test_an_interrupted_upload_publishes_no_manifest(small_dataset: Path, tmp_path: Path) -> None:
    damaged = Path(shutil.copytree(small_dataset, tmp_path / "local"))
    (damaged / shard_names(damaged, "val")[0]).unlink()
    with pytest.raises(FileNotFoundError):
        upload_dataset(damaged, f"file://{tmp_path}/uploaded")
    assert not (tmp_path / "uploaded" / MANIFEST_NAME).exists()
    assert (tmp_path / "uploaded" / shard_names(damaged)[0]).exists()


@pytest.mark.parametrize("location", ["https://example.org/data", "pipe:aws s3 cp s3://b/data/{file} -"])
def test_read_only_locations_refuse_uploads(small_dataset: Path, location: str) -> None:
    with pytest.raises(DataError, match="prepare the dataset locally and upload the directory with"):
        upload_dataset(small_dataset, location)


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None or importlib.util.find_spec("gcsfs") is not None,
                    reason="a cloud back-end is installed")
@pytest.mark.parametrize(("location", "extra"), [("s3://bucket/data", "s3"), ("gs://bucket/data", "gcs")])
def test_a_missing_cloud_back_end_names_the_extra(location: str, extra: str, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"needs the .*:// back-end, .*pip install 'scaletrain\[{extra}\]'"):
        PackedSequenceDataset(location, "train", SEQ, cache=cache_settings(tmp_path))


def test_config_checks_the_cache_settings() -> None:
    config = REPO / "configs" / "gpt_tiny.yaml"
    assert load_config(config, ["data.cache_limit_gb=0.5"]).data.cache_limit_gb == 0.5
    with pytest.raises(ConfigError, match="data.cache_limit_gb=0.0 must be > 0"):
        load_config(config, ["data.cache_limit_gb=0"])
    with pytest.raises(ConfigError, match="data.download_retries=-1 must be >= 0"):
        load_config(config, ["data.download_retries=-1"])
    with pytest.raises(ConfigError, match=r"without the \{file\} placeholder"):
        load_config(config, ["data.dir=pipe:cat /data/x"])


def test_a_run_config_with_a_remote_data_dir_trains_on_the_same_batches(small_dataset: Path, tmp_path: Path) -> None:
    from scaletrain.train.objective import build_objective
    from scaletrain.train.preflight import check_data_matches

    def first_batches(data_dir: str) -> list[torch.Tensor]:
        config = load_config(REPO / "configs" / "gpt_tiny.yaml", [
            f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", f"data.cache_dir={tmp_path}",
            "model.seq_length=32", "train.micro_batch_size=4", "data.loader_workers=0"])
        assert check_data_matches(config).vocab_size == 1024
        loader = build_objective(config).train_loader(0, 1, consumed_samples=0)
        return [batch["tokens"] for batch in itertools.islice(loader, 3)]

    with serve(small_dataset) as (url, _):
        remote = first_batches(url)
    assert all(torch.equal(a, b) for a, b in zip(first_batches(str(small_dataset)), remote, strict=True))
    assert cached_files(tmp_path)
