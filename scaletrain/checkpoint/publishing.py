"""Publishing checkpoints: written in the background into a staging directory, renamed into place
once every rank's files are in, and pruned to checkpoint.keep_last.

A save (manager.save_checkpoint) copies this rank's share of the state off the training tensors and
hands it here; a background thread writes the files into `.staging-step_...` (their format:
checkpoint/format.py, layout_free.py, integrity.py), and once every rank's are in, rank 0 renames it
into place, so a crash mid-save never leaves a directory that looks complete. One save is in flight
at a time: the next save, a prune and the end of the run wait for it (`finish_pending_save`); a
failed write stops the run at the next step (the loop polls `pending_save_failed` with its stop
reasons), raised on every rank. The background thread agrees with the other ranks over its own gloo
group, so it never interleaves with the training's collectives. Setting checkpoints aside, out of
pruning's sight, is checkpoint/divergence.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scaletrain.checkpoint import layout_free
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import (
    META_FILE,
    checkpoint_root,
    complete_checkpoints,
    read_meta,
    rng_file,
    write_latest,
)
from scaletrain.checkpoint.integrity import FileRecord, file_checksum, save_with_checksum, seal_meta
from scaletrain.config import Config, save_config
from scaletrain.disk import write_failure
from scaletrain.parallel.groups import Topology


@dataclass
class SaveTimes:
    """Seconds of the newest save: `stall_s` training waited (copying the state off), `write_s` the
    background write took up to publishing; bytes written by all ranks."""

    stall_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0


class _PendingSave:
    """The background write of one checkpoint: its thread, the error it ended with, and what is to
    run after it succeeds (a prune, which must count the new checkpoint)."""

    def __init__(self, write: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = False
        self._after: list[Callable[[], None]] = []
        self.thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-write", daemon=True)
        self.thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
            while True:
                with self._lock:
                    if not self._after:
                        self._done = True
                        return
                    after = self._after.pop(0)
                after()
        except BaseException as error:  # noqa: BLE001 - raised again in the training thread
            self.error = error
            with self._lock:
                self._done = True

    def run_after_write(self, action: Callable[[], None]) -> bool:
        """Queue `action` behind the write; False when the write has ended (run it yourself then)."""
        with self._lock:
            if self._done:
                return False
            self._after.append(action)
            return True


_pending: _PendingSave | None = None
_save_group: Any = None
last_save = SaveTimes()


def finish_pending_save() -> None:
    """Wait for the checkpoint being written, if any; its failure is raised here (on every rank)."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    pending.thread.join()
    if pending.error is not None:
        raise pending.error


def pending_save_failed() -> bool:
    """Whether the checkpoint being written has failed, without waiting for it: the loop stops at the
    next step instead of training on until the next save finds out (and its checkpoint with it)."""
    return _pending is not None and _pending.error is not None


def abandon_pending_save() -> None:
    """After a failure elsewhere (a lost rank), leave the write behind: its agreement with the other
    ranks may never come. The staging directory it leaves is removed at the next start."""
    global _pending
    _pending = None


def checkpoint_group() -> Any:
    """A gloo group of the whole world for the background writes' agreement (a collective on the
    training's group from another thread could interleave with the training's own). Collective the
    first time: the loop makes it at the start, while the rendezvous store is surely there (torchrun's
    agent hosts it; ranks whose launcher was killed still checkpoint on their way out)."""
    global _save_group
    if _save_group is None:
        _save_group = dist.new_group(backend="gloo")
    return _save_group



def publish(
    collected: layout_free.RankPieces, rng: dict[str, Any], config: Config, topology: Topology,
    meta: dict[str, Any], group: Any, started: float,
) -> Path:
    """Write this rank's `collected` pieces and `rng` state with `meta` (in the background with
    checkpoint.async_save) into a staging directory that rank 0 publishes in one rename once all
    ranks' files are in; returns the checkpoint's path. `group`: checkpoint_group(); `started`: when
    the save began (perf_counter), for last_save's times."""
    root = checkpoint_root(Path(config.run.dir))
    name = f"step_{meta['step']:08d}"
    write = partial(_write_and_publish, collected, rng, config, topology, meta, root / f".staging-{name}",
                    root / name, group, started)
    if config.checkpoint.async_save:
        global _pending
        _pending = _PendingSave(write)
        last_save.stall_s = time.perf_counter() - started
    else:
        write()
        last_save.stall_s = last_save.write_s
    return root / name


def _write_and_publish(
    collected: layout_free.RankPieces, rng: dict[str, Any], config: Config, topology: Topology,
    meta: dict[str, Any], staging: Path, final: Path, group: Any, started: float,
) -> None:
    failure = None
    if topology.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        failure = _attempt_write(lambda: [(staging / sub).mkdir(parents=True) for sub in ("rng", "model")], staging)
    _agree(failure, staging, topology, group)
    checksums: dict[str, str] = {}

    def save(state: Any, path: Path) -> None:
        checksums[str(path)] = save_with_checksum(state, path)

    rng_path = rng_file(staging, topology.rank)
    failure = _attempt_write(lambda: layout_free.write_rank_file(collected, staging, topology.rank, save),
                             staging / layout_free.rank_file(topology.rank))
    failure = failure or _attempt_write(lambda: save(rng, rng_path), rng_path)
    gathered = _agree(failure, staging, topology, group, (checksums, collected.manifest(), collected.adam_step))
    if topology.rank == 0:
        merged = _merge_checksums([written for written, _, _ in gathered], staging)
        index = layout_free.build_index([manifest for _, manifest, _ in gathered], [step for _, _, step in gathered])
        failure = _attempt_write(lambda: _publish(staging, final, config, meta, merged, index), staging)
    _agree(failure, staging, topology, group)
    last_save.write_s = time.perf_counter() - started
    last_save.bytes = sum(record.size for record in read_meta(final).files.values()) if topology.rank == 0 else 0


def _publish(
    staging: Path, final: Path, config: Config, meta: dict[str, Any], checksums: dict[str, str],
    index: dict[str, Any],
) -> None:
    """Rank 0, once every rank's files are in: the index, config, meta.json (last, with every file's size
    and CRC-32: the ranks' own from `checksums`, by path under `staging`, the rest hashed here), rename,
    `latest`."""
    (staging / layout_free.INDEX_FILE).write_text(json.dumps(index))
    save_config(config, staging / "config.yaml")
    files = {}
    for path in sorted(staging.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(staging))
            files[name] = FileRecord(path.stat().st_size, checksums.get(name) or file_checksum(path)).to_json()
    (staging / META_FILE).write_text(json.dumps(seal_meta({**meta, "files": files}), indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    write_latest(final.parent, final.name)


def _attempt_write(write: Callable[[], Any], path: Path) -> str | None:
    try:
        write()
    except (OSError, RuntimeError) as error:
        return str(write_failure(path, error))
    return None


def _agree(failure: str | None, staging: Path, topology: Topology, group: Any, payload: Any = None) -> list[Any]:
    """Every rank learns the first rank's failure (a barrier too): all raise it, none waits forever.
    Without one, returns every rank's `payload` (one gather for both)."""
    gathered: list[Any] = [None] * topology.world_size
    dist.all_gather_object(gathered, (failure, payload), group=group)
    first = next((message for message, _ in gathered if message), None)
    if first is None:
        return [payload for _, payload in gathered]
    if topology.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise CheckpointError(f"checkpoint not saved: {first}; {_checkpoints_left(staging.parent)}")


def _checkpoints_left(root: Path) -> str:
    """What a run can resume from after a failed save, as found on disk now (the save may have failed
    in a directory that holds none, or after removing an older checkpoint of the same step)."""
    try:
        complete = complete_checkpoints(root.parent)
    except OSError:
        complete = []
    if not complete:
        return (f"no complete checkpoint of this run is left under {root}; once it is a writable directory "
                "with room, run again (it starts over)")
    return (f"the newest complete checkpoint left is {complete[-1]}; once {root} is writable with room, run "
            "again to resume from it")


def _merge_checksums(per_rank: list[dict[str, str]], staging: Path) -> dict[str, str]:
    """Each rank's {path as written: CRC-32} as one {path under `staging`: CRC-32}."""
    merged: dict[str, str] = {}
    for written in per_rank:
        for path, crc in written.items():
            merged[os.path.relpath(os.path.abspath(path), os.path.abspath(staging))] = crc
    return merged


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove what a killed save or prune left (a staging or half-removed directory, a step_*
    directory without meta.json) before the run writes new checkpoints; rank 0, under the run lock,
    so no save is in flight. Returns what it removed."""
    root = checkpoint_root(run_dir)
    leftovers = [*root.glob(".staging-step_*"), *root.glob(".pruning-step_*"),
                 *(p for p in root.glob("step_*") if p.is_dir() and not (p / META_FILE).is_file())]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def prune_checkpoints(run_dir: Path, keep_last: int, keep_steps: list[int], keep: Path | None = None) -> None:
    """Remove all but the newest keep_last checkpoints, those at checkpoint.keep_steps (branch points)
    and `keep`: the checkpoint the run resumed from or last saved itself, its newest known to load,
    which newer ones it did not write (behind a train.resume=PATH) must not push out. The loop calls
    it once the step after a save has trained with finite loss and gradients, so the checkpoint
    before a blow-up is never pruned in favour of one holding the blown-up weights; while that save
    is still being written, the prune runs once it is published. Each is renamed out
    of the `step_*` namespace first, so a kill mid-removal leaves no directory that looks like a
    checkpoint (clean_leftovers removes the rest at the next start)."""
    prune = partial(_prune_now, run_dir, keep_last, keep_steps, keep)
    pending = _pending
    if pending is None or not pending.run_after_write(prune):
        prune()


def _prune_now(run_dir: Path, keep_last: int, keep_steps: list[int], keep: Path | None) -> None:
    root = checkpoint_root(run_dir)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        if int(old.name.removeprefix("step_")) not in keep_steps and old != keep:
            doomed = root / f".pruning-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed)
