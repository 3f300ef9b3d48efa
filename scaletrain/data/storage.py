"""Where a prepared dataset lives: a local directory, any fsspec URL, or a `pipe:` command; remote shards
go through a verified, size-limited local cache so training still reads them at random.

A location is one of
  /data/fineweb              local directory: shards are read in place (no copy)
  https://host/ds, s3://bucket/ds, gs://bucket/ds, file:///data/ds
                             any fsspec URL; s3:// and gs:// need `pip install 'scaletrain[s3]'` / `[gcs]`
  pipe:aws s3 cp s3://bucket/ds/{file} -
                             webdataset-style shell command writing one file to stdout; `{file}` stands
                             for the file's name inside the dataset (`manifest.json`, `train-00000.tar`, ...)

Remote files are downloaded whole into `<cache dir>/datasets/<hash of the location>/<sha256 prefix>/<name>`:
content-addressed, so a dataset re-prepared at the same URL never reads a stale copy. A file is
written to a `.partial` beside its place, checked against the manifest's size and sha256, and renamed
into place, so the cache only ever holds verified files; later opens check only the size. One
flock per file makes one process of a node download it while the other DataLoader workers and
ranks wait, then read the same copy. A transfer that receives nothing for `read_timeout_s` (a server
that accepts and then stalls, a hung pipe command) is abandoned and tried again like a dropped one.
The cache keeps under its size limit by evicting the files used longest ago (the mtime of each
file's lock, touched on every open: the file's own mtime stays as written, since readers take a
changed one for a damaged shard); a file another process has open may be evicted, Linux keeps its
pages until that process closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
import fsspec.callbacks

from scaletrain.config import ConfigError, DataConfig
from scaletrain.data.errors import DataError
from scaletrain.data.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    file_sha256,
    parse_manifest,
    verify_file,
)
from scaletrain.data.shards import ShardReader, open_shard

PIPE_PREFIX = "pipe:"
PIPE_FILE_PLACEHOLDER = "{file}"
CACHE_ENV_VARIABLE = "SCALETRAIN_CACHE"
TOKENIZER_LAYOUT_SUFFIX = ".layout.json"  # tokenizer.model's companion, see data/tokenizer.py
# fsspec's protocols whose back-end is a scaletrain extra (pyproject.toml [project.optional-dependencies])
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_DOWNLOADS_OF_A_CORRUPT_FILE = 2  # a proxy or a disk may garble one download; twice is the source's fault
_Opened = TypeVar("_Opened")


def default_cache_dir() -> Path:
    """$SCALETRAIN_CACHE, else ~/.cache/scaletrain: the one place the shard cache's default is decided."""
    return Path(os.environ.get(CACHE_ENV_VARIABLE) or Path.home() / ".cache" / "scaletrain")


@dataclass(frozen=True)
class ShardCacheSettings:
    """Where remote files are cached, how much disk the cache may hold, and how hard a download tries."""

    directory: Path
    limit_bytes: int = 100 << 30
    download_retries: int = 4  # tries after the first, for a dropped connection, HTTP 5xx or short body
    retry_backoff_s: float = 1.0  # the first wait; each later one doubles
    read_timeout_s: float = 60.0  # a transfer that receives no byte for this long is abandoned (then retried)

    @classmethod
    def from_data_config(cls, data: DataConfig) -> ShardCacheSettings:
        return cls(Path(data.cache_dir) if data.cache_dir else default_cache_dir(),
                   int(data.cache_limit_gb * (1 << 30)), data.download_retries, data.download_backoff_s,
                   data.download_timeout_s)


def validate_locations(data: DataConfig) -> None:
    """Refuse, when a config is loaded, a `pipe:` data.dir or blend entry without the `{file}` placeholder
    (config_loader.validate runs it; PipeSource refuses one given directly)."""
    for key, location in [("data.dir", data.dir)] + [(f"data.blend[{i}].dir", e.dir) for i, e in enumerate(data.blend)]:
        if location.startswith(PIPE_PREFIX) and PIPE_FILE_PLACEHOLDER not in location:
            raise ConfigError(f"{key}={location!r} is a pipe: command without the {PIPE_FILE_PLACEHOLDER} placeholder "
                              "for the file name; write e.g. 'pipe:aws s3 cp s3://bucket/dataset/{file} -'")


def is_local(location: Path | str) -> bool:
    """A plain path (no scheme, not a pipe command): used in place, without the cache."""
    return isinstance(location, Path) or not (str(location).startswith(PIPE_PREFIX) or "://" in str(location))


def dataset_location(data: DataConfig, location: str | None = None) -> DatasetLocation:
    """A dataset the run reads (`location`: one of data.blend's; default: data.dir, or the blend's first,
    which holds the tokenizer all of a blend share), with the cache the config describes."""
    return open_location(location or data.sources()[0].dir, ShardCacheSettings.from_data_config(data))


def load_manifest(location: Path | str | DatasetLocation, *, cache: ShardCacheSettings | None = None) -> Manifest:
    """Read and check a prepared dataset's manifest: format, tokenizer and index checksums.

    `location` is a local directory, an fsspec URL, a `pipe:` command or a DatasetLocation;
    remote files are checked as they enter the cache `cache` (ShardCacheSettings, None for the
    default). Shards are checked lazily by the reader (size and sha256 on first open, per process),
    since hashing every shard here would cost a full read of the data.
    """
    return open_location(location, cache).load_manifest()


def open_location(location: Path | str | DatasetLocation, cache: ShardCacheSettings | None = None
                  ) -> DatasetLocation:
    """A local path, fsspec URL or `pipe:` command as a DatasetLocation (one already made is returned as is).

    `cache` matters only for remote locations; None means the default directory and limits.
    """
    if isinstance(location, DatasetLocation):
        return location
    if is_local(location):
        return LocalDataset(Path(location))
    settings = cache or ShardCacheSettings(default_cache_dir())
    source_type = PipeSource if str(location).startswith(PIPE_PREFIX) else FsspecSource
    source = source_type(str(location), settings.read_timeout_s)
    return RemoteDataset(source, ShardCache(settings, str(location)))


class DatasetLocation(ABC):
    """A prepared dataset wherever it lives: its manifest, verified local copies of its files, its shards."""

    @abstractmethod
    def describe(self, name: str = "") -> str:
        """The location (or file `name` in it) as a user would type it, for messages."""

    @abstractmethod
    def is_prepared(self) -> bool:
        """Whether the location holds a manifest.json (without fetching or checking anything else)."""

    @abstractmethod
    def read_manifest_text(self) -> str: ...

    @abstractmethod
    def local_file(self, name: str, sha256: str) -> Path:
        """A local path of file `name` whose content has the manifest's sha256."""

    @abstractmethod
    def open_shard(self, info: ShardInfo) -> ShardReader:
        """Shard `info` for reading, checked against the manifest."""

    def load_manifest(self) -> Manifest:
        """The manifest, with the tokenizer and every split index verified (shards are checked on first open)."""
        manifest = parse_manifest(self.read_manifest_text(), self.describe(MANIFEST_NAME), self.describe())
        self.local_file(manifest.tokenizer_file, manifest.tokenizer_sha256)
        for split in manifest.splits.values():
            self.local_file(split.index_file, split.index_sha256)
        return manifest

    def tokenizer_path(self) -> Path:
        """The verified tokenizer model, a local file; `Tokenizer.load` finds its layout file beside it."""
        manifest = self.load_manifest()
        return self.local_file(manifest.tokenizer_file, manifest.tokenizer_sha256)

    def tokenizer_files(self) -> tuple[Path, Path]:
        """The tokenizer model and its layout file, local, for copying beside an exported model."""
        model = self.tokenizer_path()
        return model, model.with_name(tokenizer_layout_name(model.name))


class LocalDataset(DatasetLocation):
    """A directory on this machine: every file is used in place."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def describe(self, name: str = "") -> str:
        return str(self.directory / name) if name else str(self.directory)

    def is_prepared(self) -> bool:
        return (self.directory / MANIFEST_NAME).is_file()

    def read_manifest_text(self) -> str:
        path = self.directory / MANIFEST_NAME
        if not path.is_file():
            raise DataError(f"no {MANIFEST_NAME} in {self.directory}: it is not a prepared dataset; "
                            "run `scaletrain prepare CONFIG` first")
        return path.read_text()

    def local_file(self, name: str, sha256: str) -> Path:
        verify_file(self.directory / name, sha256)
        return self.directory / name

    def open_shard(self, info: ShardInfo) -> ShardReader:
        return open_shard(self.directory / info.name, info)


class RemoteDataset(DatasetLocation):
    """A dataset behind a URL or pipe command, read through the local shard cache."""

    def __init__(self, source: FileSource, cache: ShardCache) -> None:
        self.source, self.cache = source, cache

    def describe(self, name: str = "") -> str:
        return self.source.url(name) if name else self.source.location

    def is_prepared(self) -> bool:
        return self.source.exists(MANIFEST_NAME)

    def read_manifest_text(self) -> str:
        try:
            return retrying(self.cache.settings, self.source.url(MANIFEST_NAME),
                            lambda: self.source.read_bytes(MANIFEST_NAME)).decode()
        except FileNotFoundError:
            raise DataError(f"no {MANIFEST_NAME} at {self.source.location}: it is not a prepared dataset; "
                            "prepare it locally and upload it (scaletrain.data.storage.upload_dataset)") from None

    def local_file(self, name: str, sha256: str) -> Path:
        path = self.cache.open(name, sha256, None, self.source, lambda path: path)
        if name.endswith(".model"):  # the tokenizer: Tokenizer.load checks the model against this layout file
            self.cache.companion(path, tokenizer_layout_name(name), self.source)
        return path

    def open_shard(self, info: ShardInfo) -> ShardReader:
        return self.cache.open(info.name, info.sha256, info.num_bytes, self.source,
                               lambda path: open_shard(path, info, sha256_checked=True))


# ---------------------------------------------------------------------------------------------
# Sources: how the bytes of one file of a remote dataset are fetched


class TransferStalled(OSError):
    """No byte arrived for `read_timeout_s`: the transfer is abandoned, and retried like a dropped one.
    (Not a TimeoutError: fsspec replaces those with a bare FSTimeoutError, which would lose the message.)"""


class FileSource(ABC):
    location: str

    @abstractmethod
    def url(self, name: str) -> str: ...

    @abstractmethod
    def download(self, name: str, destination: Path) -> None:
        """Write file `name` to `destination`; FileNotFoundError if it does not exist, another error to retry."""

    def exists(self, name: str) -> bool:
        try:
            self.read_bytes(name)
        except Exception:  # a pipe command's failure does not say whether the file is missing or unreachable
            return False
        return True

    def read_bytes(self, name: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="scaletrain-") as scratch:
            self.download(name, Path(scratch) / name)
            return (Path(scratch) / name).read_bytes()


class FsspecSource(FileSource):
    """Any fsspec URL; the filesystem is made per process, since fsspec's async sessions do not survive fork.

    The remote back-ends (http, s3, gcs) are fsspec's async ones: a transfer runs as a task on fsspec's
    event loop and is cancelled once `read_timeout_s` pass without a byte, the same for every back-end
    (aiohttp's own default waits 5 minutes, and on a stalled body forever).
    """

    def __init__(self, location: str, read_timeout_s: float = ShardCacheSettings.read_timeout_s) -> None:
        self.location = location.rstrip("/")
        self.read_timeout_s = read_timeout_s
        self._filesystem, self._pid = None, None
        self.filesystem()  # a missing back-end is reported now, not in a DataLoader worker

    def url(self, name: str) -> str:
        return f"{self.location}/{name}"

    def filesystem(self):
        if self._pid != os.getpid():
            self._filesystem, self._pid = filesystem_for(self.location), os.getpid()
        return self._filesystem

    def download(self, name: str, destination: Path) -> None:
        filesystem = self.filesystem()
        if not filesystem.async_impl:  # file://, memory://: nothing on the way can stall
            filesystem.get_file(self.url(name), str(destination))
            return
        progress = fsspec.callbacks.Callback()
        fsspec.asyn.sync(filesystem.loop, _until_stalled, lambda: filesystem._get_file(
            self.url(name), str(destination), callback=progress), progress, self.read_timeout_s)

    def exists(self, name: str) -> bool:
        filesystem = self.filesystem()
        if not filesystem.async_impl:
            return filesystem.exists(self.url(name))
        try:
            return fsspec.asyn.sync(filesystem.loop, _until_stalled, lambda: filesystem._exists(self.url(name)),
                                    fsspec.callbacks.Callback(), self.read_timeout_s)
        except TransferStalled as error:
            raise DataError(f"{self.url(name)} did not answer: {error}; check that the server is up") from None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_filesystem": None, "_pid": None}


async def _until_stalled(start: Callable[[], Coroutine[Any, Any, _Opened]], progress: fsspec.callbacks.Callback,
                         read_timeout_s: float) -> _Opened:
    """start()'s result, or TransferStalled once `read_timeout_s` pass in which `progress` counted no byte
    (its task is cancelled, which closes the connection)."""
    transfer = asyncio.ensure_future(start())
    received = progress.value
    while True:
        done, _ = await asyncio.wait({transfer}, timeout=read_timeout_s)
        if done:
            return transfer.result()
        if progress.value == received:
            transfer.cancel()
            raise TransferStalled(f"no data for {read_timeout_s:g} s")
        received = progress.value


class PipeSource(FileSource):
    """`pipe:COMMAND`: COMMAND, with `{file}` replaced by the (shell-quoted) file name, writes the file to stdout."""

    def __init__(self, location: str, read_timeout_s: float = ShardCacheSettings.read_timeout_s) -> None:
        self.location, self.read_timeout_s = location, read_timeout_s
        self.template = location.removeprefix(PIPE_PREFIX).strip()
        if PIPE_FILE_PLACEHOLDER not in self.template:
            raise DataError(f"data location {location!r} has no {PIPE_FILE_PLACEHOLDER} placeholder for the file "
                            f"name; write e.g. 'pipe:aws s3 cp s3://bucket/dataset/{PIPE_FILE_PLACEHOLDER} -'")

    def url(self, name: str) -> str:
        return PIPE_PREFIX + self.command(name)

    def command(self, name: str) -> str:
        return self.template.replace(PIPE_FILE_PLACEHOLDER, shlex.quote(name))

    def download(self, name: str, destination: Path) -> None:
        """The command's stdout into `destination`; a command that writes nothing for `read_timeout_s` is
        killed, with the shell's children (its own process group), and the transfer fails."""
        with open(destination, "wb") as stdout, tempfile.TemporaryFile() as stderr:
            command = subprocess.Popen(self.command(name), shell=True, stdout=stdout, stderr=stderr,
                                       start_new_session=True)
            status = self._wait_while_writing(command, destination)
            if status:
                stderr.seek(0)
                message = stderr.read().decode(errors="replace").strip().splitlines()
                raise OSError(f"`{self.command(name)}` exited with status {status}"
                              + (f": {message[-1]}" if message else ""))

    def _wait_while_writing(self, command: subprocess.Popen, destination: Path) -> int:
        written, last_written_at = 0, time.monotonic()
        try:
            while (status := command.poll()) is None:
                if (size := destination.stat().st_size) != written:
                    written, last_written_at = size, time.monotonic()
                elif time.monotonic() - last_written_at > self.read_timeout_s:
                    raise TransferStalled(f"the command wrote nothing for {self.read_timeout_s:g} s")
                time.sleep(min(0.1, self.read_timeout_s / 10))
            return status
        finally:
            if command.poll() is None:
                os.killpg(command.pid, signal.SIGKILL)
                command.wait()


def tokenizer_layout_name(model_name: str) -> str:
    """`tokenizer.model` -> `tokenizer.layout.json`, the file `train_tokenizer` writes beside the model."""
    return model_name.removesuffix(".model") + TOKENIZER_LAYOUT_SUFFIX


def filesystem_for(url: str):
    """fsspec's filesystem for `url`, or a DataError naming the extra that installs its back-end."""
    protocol = url.split("://", 1)[0]
    try:
        return fsspec.filesystem(protocol)
    except ImportError as error:
        extra = _EXTRAS.get(protocol)
        fix = f"pip install 'scaletrain[{extra}]'" if extra else f"install fsspec's back-end for {protocol}://"
        raise DataError(f"data location {url} needs the {protocol}:// back-end, which is not installed ({error}); "
                        f"{fix}") from None
    except ValueError as error:
        raise DataError(f"data location {url}: {error}; use a local path, an fsspec URL (https://, s3://, gs://, "
                        f"file://) or 'pipe:COMMAND {PIPE_FILE_PLACEHOLDER}'") from None


def retrying(settings: ShardCacheSettings, url: str, attempt: Callable[[], _Opened]) -> _Opened:
    """attempt(), tried again after a transfer error with exponential backoff; then one DataError naming `url`.

    FileNotFoundError and PermissionError are answers, not accidents, and are raised at once.
    """
    for number in range(settings.download_retries + 1):
        try:
            return attempt()
        except (FileNotFoundError, PermissionError, DataError):
            raise
        except Exception as error:  # back-ends raise their own types (aiohttp, botocore, OSError from pipes)
            failure = f"{type(error).__name__}: {error}"
            if number < settings.download_retries:
                time.sleep(settings.retry_backoff_s * 2**number)
    raise DataError(f"could not download {url} after {settings.download_retries + 1} tries; last error {failure}")


# ---------------------------------------------------------------------------------------------
# The cache


class ShardCache:
    """Verified copies of one remote dataset's files under `<directory>/<hash of location>/`."""

    def __init__(self, settings: ShardCacheSettings, location: str) -> None:
        self.settings = settings
        self.root = Path(settings.directory) / "datasets"
        self.directory = self.root / hashlib.sha256(location.encode()).hexdigest()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        label = self.directory / "location.txt"  # which dataset this directory caches, for people
        if not label.exists():
            label.write_text(location + "\n")

    def entry(self, name: str, sha256: str) -> Path:
        return self.directory / sha256[:16] / name

    def open(self, name: str, sha256: str, num_bytes: int | None, source: FileSource,
             open_file: Callable[[Path], _Opened]) -> _Opened:
        """open_file(path of the verified copy), downloading it first if it is not cached; under the file's lock,
        so concurrent processes download it once and eviction never removes it between check and open."""
        path = self.entry(name, sha256)
        with self._locked(path):
            if not (path.is_file() and (num_bytes is None or path.stat().st_size == num_bytes)):
                self._download(name, sha256, num_bytes, source, path)
            opened = open_file(path)
            os.utime(_lock_path(path))  # last use, for eviction
        return opened

    def companion(self, beside: Path, name: str, source: FileSource) -> Path:
        """A file without a checksum in the manifest (the tokenizer's layout, which checks the model itself)."""
        path = beside.with_name(name)
        with self._locked(path):
            if not path.is_file():
                partial = path.with_name(path.name + ".partial")
                retrying(self.settings, source.url(name), lambda: source.download(name, partial))
                os.replace(partial, path)
        return path

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(_lock_path(path), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _download(self, name: str, sha256: str, num_bytes: int | None, source: FileSource, path: Path) -> None:
        """Fetch into `<name>.partial`, check size and sha256, rename into place; a wrong sha256 is fetched once
        more (a proxy or disk may have garbled it) and then refused. Nothing partial is left on failure."""
        url, partial = source.url(name), path.with_name(path.name + ".partial")
        try:
            for _ in range(_DOWNLOADS_OF_A_CORRUPT_FILE):
                retrying(self.settings, url, lambda: self._fetch_complete(source, name, partial, num_bytes))
                actual = file_sha256(partial)
                if actual == sha256:
                    self._make_room(partial.stat().st_size)
                    os.replace(partial, path)
                    return
            raise DataError(f"{url} is corrupt: sha256 mismatch after {_DOWNLOADS_OF_A_CORRUPT_FILE} downloads, "
                            f"manifest expects "
                            f"{sha256}, the download has {actual}; re-upload the dataset")
        except FileNotFoundError:
            raise DataError(f"{url} is listed in the manifest of {source.location} but missing there; "
                            "re-upload the dataset") from None
        finally:
            partial.unlink(missing_ok=True)

    @staticmethod
    def _fetch_complete(source: FileSource, name: str, partial: Path, num_bytes: int | None) -> None:
        source.download(name, partial)
        received = partial.stat().st_size
        if num_bytes is not None and received != num_bytes:
            raise OSError(f"received {received} of {num_bytes} bytes (truncated transfer)")

    def _make_room(self, incoming: int) -> None:
        """Evict cached files, least recently used first, until `incoming` more bytes fit in the limit.

        Files locked by another process (being downloaded or opened) are skipped; a file larger than the
        whole limit is still admitted, since training cannot read it otherwise.
        """
        entries = []
        for path in self.root.glob("*/*/*"):
            if path.suffix in (".lock", ".partial"):
                continue
            with contextlib.suppress(FileNotFoundError):
                entries.append((_lock_path(path).stat().st_mtime_ns, path.stat().st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total + incoming <= self.settings.limit_bytes:
                return
            if self._evict(path):
                total -= size

    @staticmethod
    def _evict(path: Path) -> bool:
        with open(_lock_path(path), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            path.unlink(missing_ok=True)
            return True


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


# ---------------------------------------------------------------------------------------------
# Writing


def upload_dataset(local_dir: Path, location: str) -> str:
    """Copy the prepared dataset in `local_dir` to a writable fsspec location; returns the location.

    Order: shards, split indexes, tokenizer files, then manifest.json last, so a reader never finds a
    manifest whose files are not all there (it is what makes a directory a dataset).
    """
    url = writable_url(location)
    source = LocalDataset(Path(local_dir))
    manifest = source.load_manifest()
    filesystem = filesystem_for(url)
    target = url.rstrip("/")
    filesystem.makedirs(target, exist_ok=True)
    shards = [shard.name for split in manifest.splits.values() for shard in split.shards]
    indexes = [split.index_file for split in manifest.splits.values()]
    layout = tokenizer_layout_name(manifest.tokenizer_file)
    for name in [*shards, *indexes, manifest.tokenizer_file, layout, MANIFEST_NAME]:
        filesystem.put_file(str(Path(local_dir) / name), f"{target}/{name}")
    return str(location)


def writable_url(location: str | Path) -> str:
    """The fsspec URL `upload_dataset` writes to; refuses, before any work is done, a location that
    is read-only here (a pipe: command, plain HTTP)."""
    if str(location).startswith(PIPE_PREFIX) or str(location).split("://", 1)[0] in ("http", "https"):
        raise DataError(f"cannot write a dataset to {location}: it is read-only here; prepare the dataset locally "
                        "and upload the directory with that service's own tool (aws s3 cp --recursive, gsutil, "
                        "rsync), or give a writable fsspec URL (s3://, gs://, file://)")
    return str(location) if "://" in str(location) else f"file://{Path(location).resolve()}"
