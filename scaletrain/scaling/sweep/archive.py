"""`sweep archive` and `sweep restore`: a sweep's finished runs without their checkpoints, small enough to keep
under version control or copy off a machine that will not last, and put back so `sweep run` and `sweep tune`
skip them and the fit reads the same results.

A sweep directory holds, per run, its checkpoints (megabytes to terabytes) and a few records (kilobytes). Once a
run is done only the records are read again: results.py builds its results.csv row from RUN/summary.json,
RUN/status.json (wall time, data fingerprint) and RUN/metrics.jsonl (the smoothed final training loss, the
downstream metrics of the last step), and materialize() compares RUN/run.yaml with the spec. The archive keeps
those four files of every finished run, the sweep's own and its `sweep tune` grid's (SWEEP/tune), as

    ARCHIVE/archive.json                       the sweep's name and directory, and the runs archived
    ARCHIVE/[tune/]runs/NAME/run.yaml, summary.json, status.json
    ARCHIVE/[tune/]runs/NAME/metrics.jsonl.gz  every record the results read (see _kept_record)

metrics.jsonl.gz keeps each evaluation record whole and, of each training record, the step and the loss: the
loss curve and every number results.csv takes from it, without the per-step diagnostics (learning rate,
gradient norm, timings), which are 90% of the file. gzip without a timestamp, so archiving a run twice writes
the same bytes.

A ladder's stable run is archived only once every branch off it is done: a branch starts from the stable run's
checkpoint, which the archive does not keep, so a restored stable run with a branch to go would leave that branch
nothing to start from. Left out, the stable run trains again after a restore (the same run: data order and
initial weights follow from the seed) and writes the checkpoints its branches need.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scaletrain.config import ConfigError
from scaletrain.disk import replace_directory, write_atomically
from scaletrain.scaling.sweep.hyperparams import TUNE_DIR
from scaletrain.scaling.sweep.layout import METRIC_PREFIX, PLAN_FILE, RUN_CONFIG_FILE, RUNS_DIR, STATUS_FILE
from scaletrain.scaling.sweep.results import run_status
from scaletrain.train.loop import RUN_SUMMARY_FILE

ARCHIVE_FILE = "archive.json"
ARCHIVE_FORMAT = 1
METRICS_FILE = "metrics.jsonl"
ARCHIVED_METRICS = METRICS_FILE + ".gz"
COPIED_FILES = (RUN_CONFIG_FILE, RUN_SUMMARY_FILE, STATUS_FILE)
# The settings of a run's config that name a path in its sweep directory (ladder.py writes train.branch_from).
MOVED_PATHS = (("run", "dir"), ("train", "branch_from"))
# What a training record keeps: results.py's smoothed_train_loss reads these two of every record, and an
# evaluation's numbers, were one logged in the same record.
KEPT_TRAINING_KEYS = ("step", "loss")
EVALUATION_KEY_PREFIXES = ("val_", METRIC_PREFIX)


@dataclass(frozen=True)
class ArchiveOutcome:
    archived: list[str]  # [tune/]runs/NAME, newly written or rewritten
    unchanged: list[str]  # already in the archive with the same records
    kept_back: dict[str, str]  # finished runs left out, and why
    unfinished: int


def sweep_parts(sweep_dir: Path) -> list[Path]:
    """The planned sweeps in a sweep directory, relative to it: the sweep itself (`.`) and its tuning grid
    (`tune`), where each has been planned."""
    return [part for part in (Path("."), Path(TUNE_DIR)) if (sweep_dir / part / PLAN_FILE).is_file()]


def archive_sweep(sweep_dir: Path, archive_dir: Path, sweep_name: str) -> ArchiveOutcome:
    """Write or extend the archive of `sweep_dir`'s finished runs in `archive_dir` (see the module docstring).
    Each run is written to a temporary directory and renamed, and archive.json last, so an interrupted archive
    leaves whole runs and an index of the runs it had before."""
    parts = sweep_parts(sweep_dir)
    if not parts:
        raise ConfigError(f"{sweep_dir} holds no planned sweep (no {PLAN_FILE}, nor {TUNE_DIR}/{PLAN_FILE}): "
                          "archive a sweep directory that `sweep run` or `sweep tune` has started")
    index = _read_index(archive_dir) if (archive_dir / ARCHIVE_FILE).is_file() else None
    if index is not None and index["sweep"] != sweep_name:
        raise ConfigError(f"{archive_dir} archives sweep {index['sweep']!r}, not {sweep_name!r}: archive each sweep "
                          "in a directory of its own")
    archived, unchanged, kept_back, unfinished = [], [], {}, 0
    runs = set(index["runs"]) if index else set()
    for part in parts:
        planned = json.loads((sweep_dir / part / PLAN_FILE).read_text())["runs"]
        states = {row["name"]: run_status(sweep_dir / part / RUNS_DIR / row["name"]).state for row in planned}
        for row in planned:
            name = (part / RUNS_DIR / row["name"]).as_posix()
            if states[row["name"]] != "done":
                unfinished += 1
                continue
            waiting = [branch["name"] for branch in planned
                       if branch.get("stable_run") == row["name"] and states[branch["name"]] != "done"]
            if waiting:
                kept_back[name] = (f"{len(waiting)} of its branches ({', '.join(waiting[:3])}"
                                   f"{', ...' if len(waiting) > 3 else ''}) start from its checkpoints")
                if name in runs:  # archived before these branches were planned: it trains again
                    runs.discard(name)
                    shutil.rmtree(archive_dir / name, ignore_errors=True)
                continue
            records = _run_records(sweep_dir / name)
            if _archived_records(archive_dir / name) == records:
                unchanged.append(name)
            else:
                _write_run(archive_dir / name, records)
                archived.append(name)
            runs.add(name)
    archive_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(archive_dir / ARCHIVE_FILE, json.dumps(
        {"format": ARCHIVE_FORMAT, "sweep": sweep_name, "dir": str(sweep_dir), "runs": sorted(runs)},
        indent=2).encode() + b"\n")
    return ArchiveOutcome(archived, unchanged, kept_back, unfinished)


def restore_sweep(archive_dir: Path, sweep_dir: Path | None = None) -> tuple[Path, list[str], list[str]]:
    """Put the archived runs back into `sweep_dir` (default: the directory the archive was made from; elsewhere,
    each run.yaml's paths into the sweep move with it). A run already finished there is left as it is; any
    other gets the archived records, which mark it done.
    Returns the sweep directory, the runs restored and the runs left as they were."""
    index = _read_index(archive_dir)
    archived_from = Path(index["dir"])
    sweep_dir = archived_from if sweep_dir is None else sweep_dir
    restored, kept = [], []
    for name in index["runs"]:
        run_dir = sweep_dir / name
        if run_status(run_dir).state == "done":
            kept.append(name)
            continue
        records = _archived_records(archive_dir / name)
        if records is None:
            raise ConfigError(f"{archive_dir / name}: the archive lists this run but its records are missing or "
                              f"incomplete ({', '.join((*COPIED_FILES, ARCHIVED_METRICS))}); archive the sweep again")
        if sweep_dir != archived_from:
            records[RUN_CONFIG_FILE] = _moved_config(records[RUN_CONFIG_FILE], archived_from, sweep_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # summary.json last: until it is there the run reads as not done, whatever else was written
        for file in (RUN_CONFIG_FILE, STATUS_FILE, METRICS_FILE, RUN_SUMMARY_FILE):
            write_atomically(run_dir / file, records[file])
        restored.append(name)
    return sweep_dir, restored, kept


def _moved_config(run_yaml: bytes, archived_from: Path, sweep_dir: Path) -> bytes:
    """RUN/run.yaml with the paths into the sweep directory (the run's own, a branch's stable checkpoint) moved
    to where the sweep is restored; the rest as it was, so materialize() compares it with the spec's."""
    config = yaml.safe_load(run_yaml)
    for section, key in MOVED_PATHS:
        value = config.get(section, {}).get(key)
        if isinstance(value, str) and Path(value).is_relative_to(archived_from):
            config[section][key] = str(sweep_dir / Path(value).relative_to(archived_from))
    return yaml.safe_dump(config, sort_keys=False).encode()


def _read_index(archive_dir: Path) -> dict[str, Any]:
    path = archive_dir / ARCHIVE_FILE
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{archive_dir} is no sweep archive ({ARCHIVE_FILE} is missing): give the directory "
                          "`scaletrain sweep archive` wrote") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); archive the sweep again") from None
    if not isinstance(index, dict) or index.get("format") != ARCHIVE_FORMAT or not {"sweep", "dir", "runs"} <= set(
            index):
        raise ConfigError(f"{path} is not an archive index of format {ARCHIVE_FORMAT} (keys format, sweep, dir, "
                          "runs); archive the sweep again with this version")
    return index


def _run_records(run_dir: Path) -> dict[str, bytes]:
    """The run's records as the archive holds them: the files results.py reads, metrics.jsonl reduced."""
    records = {file: (run_dir / file).read_bytes() for file in COPIED_FILES}
    lines = []
    for line in (run_dir / METRICS_FILE).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill; the step was logged again on resume (results.py skips it too)
        lines.append(json.dumps(_kept_record(record)) + "\n")
    records[METRICS_FILE] = "".join(lines).encode()
    return records


def _kept_record(record: dict[str, Any]) -> dict[str, Any]:
    """A training record (it has a loss) keeps its step, its loss and any evaluation numbers; an evaluation record
    (validation, downstream tasks) is kept whole."""
    if "loss" not in record:
        return record
    return {key: value for key, value in record.items()
            if key in KEPT_TRAINING_KEYS or key.startswith(EVALUATION_KEY_PREFIXES)}


def _archived_records(run_archive: Path) -> dict[str, bytes] | None:
    """The records an archived run holds, metrics.jsonl decompressed; None where any is missing."""
    try:
        records = {file: (run_archive / file).read_bytes() for file in COPIED_FILES}
        records[METRICS_FILE] = gzip.decompress((run_archive / ARCHIVED_METRICS).read_bytes())
    except (FileNotFoundError, gzip.BadGzipFile, EOFError):
        return None
    return records


def _write_run(run_archive: Path, records: dict[str, bytes]) -> None:
    run_archive.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{run_archive.name}.", dir=run_archive.parent))
    try:
        for file in COPIED_FILES:
            (staging / file).write_bytes(records[file])
        (staging / ARCHIVED_METRICS).write_bytes(gzip.compress(records[METRICS_FILE], compresslevel=9, mtime=0))
        replace_directory(staging, run_archive)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
