"""Layout-free checkpoints, written in the background, published atomically, with keep-last-k and resume.

Layout of RUN_DIR/checkpoints:
    step_00000100/model/...        the training state by parameter name at full shape, each rank
                                   writing its share (checkpoint/layout_free.py): any layout resumes it
    step_00000100/rng/rank_*.pt    per-rank RNG states (restored when the layout is the same)
    step_00000100/meta.json        step, consumed samples, layout, every file's size and CRC-32, and
                                   the CRC-32 of these fields (checkpoint/integrity.py); written last
    step_00000100/config.yaml      the full run config
    latest                         name of the newest complete checkpoint: a hint for other tools;
                                   scaletrain finds the newest by scanning
    diverged/step_...              checkpoints set aside after a divergence (never resumed from)
    rejected/step_...              checkpoints a resume could not load and fell back past (never resumed
                                   from, never counted by pruning)

A save copies this rank's share of the state off the training tensors (collective: ZeRO gathers each
parameter over its data-parallel group) and returns; a background thread writes the files into
`.staging-step_...`, and once every rank's are in, rank 0 renames it into place, so a crash mid-save
never leaves a directory that looks complete. One save is in flight at a time: the next save, a
prune and the end of the run wait for it (`finish_pending_save`); a failed write stops the run at
the next step (the loop polls `pending_save_failed` with its stop reasons), raised on every rank.
The background thread agrees with the other ranks over its own gloo group, so it never interleaves
with the training's collectives.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import yaml

from scaletrain.checkpoint import layout_free
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.integrity import FileRecord, check_meta_seal, file_checksum, save_with_checksum, seal_meta
from scaletrain.checkpoint.safe_load import CheckedFiles, UnsafeCheckpointError
from scaletrain.config import Config, ConfigError, save_config
from scaletrain.disk import write_failure
from scaletrain.parallel.groups import Topology, resolve_precision

META_FILE = "meta.json"
DIVERGED_DIR = "diverged"  # checkpoints set aside after a divergence (set_aside_from)
REJECTED_DIR = "rejected"  # checkpoints a resume fell back past (set_aside_rejected)
FORMAT = 2  # 1: DeepSpeed's own files under state/ (before layout-free checkpoints); not read any more
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    consumed_samples: int
    layout: dict[str, int]
    skipped_steps: int = 0  # steps whose update was skipped (non-finite loss or gradients), in all
    consecutive_skipped_steps: int = 0  # of those, how many in a row up to this step
    files: dict[str, FileRecord] = field(default_factory=dict)  # path under the checkpoint -> size, CRC-32
    format: int = FORMAT
    spikes: dict[str, Any] = field(default_factory=dict)  # the loss-spike rule's state (train/state.py)
    tokenizer_sha256: str | None = None  # the tokenizer whose ids the run trained on (None: not recorded)
    started_from: str | None = None  # the explicit train.resume checkpoint the run started from (resume_candidates)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def layout_of(config: Config, topology: Topology) -> dict[str, int]:
    """The layout a checkpoint records; `context` only when > 1, so earlier checkpoints still match."""
    layout = {
        "tensor": topology.tensor_parallel_size,
        "pipeline": topology.pipeline_parallel_size,
        "data": topology.data_parallel_size,
        "zero_stage": config.parallel.zero_stage,
        "bf16": int(resolve_precision(config, topology.device) == "bf16"),
    }
    if topology.context_parallel_size > 1:
        layout["context"] = topology.context_parallel_size
    return layout


def describe_layout(layout: dict[str, int]) -> str:
    """`TP2xDP2 ZeRO-1 bf16`; sizes of 1 are left out (a single rank reads `TP1`)."""
    axes = (("TP", "tensor"), ("CP", "context"), ("PP", "pipeline"), ("DP", "data"))
    sizes = [f"{axis}{layout[key]}" for axis, key in axes
             if layout.get(key, 1) > 1]
    return f"{'x'.join(sizes) or 'TP1'} ZeRO-{layout['zero_stage']}" + (" bf16" if layout.get("bf16") else "")


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


def save_checkpoint(
    engine: Any, config: Config, topology: Topology, step: int, consumed_samples: int,
    skipped_steps: int = 0, consecutive_skipped_steps: int = 0, spikes: dict[str, Any] | None = None,
    provenance: dict[str, str] | None = None,
) -> Path:
    """Copy this rank's share of the state off the training tensors and write it (in the background
    with checkpoint.async_save) into a staging directory that rank 0 publishes in one rename once all
    ranks' files are in. A failed write on any rank (a full disk) removes the staging directory and
    raises one CheckpointError naming the file, the cause and the newest checkpoint left, on every
    rank, here or at the next finish_pending_save. `provenance` goes into meta.json as it is
    (run_config.checkpoint_provenance: the tokenizer, the checkpoint the run started from)."""
    finish_pending_save()
    started = time.perf_counter()
    group = checkpoint_group()
    collected = layout_free.collect_pieces(engine, topology)
    rng = _rng_state()
    root = checkpoint_root(Path(config.run.dir))
    name = f"step_{step:08d}"
    meta = {"format": FORMAT, "step": step, "consumed_samples": consumed_samples,
            "layout": layout_of(config, topology), "skipped_steps": skipped_steps,
            "consecutive_skipped_steps": consecutive_skipped_steps, **({"spikes": spikes} if spikes else {}),
            **(provenance or {})}
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

    rng_file = staging / "rng" / f"rank_{topology.rank:05d}.pt"
    failure = _attempt_write(lambda: layout_free.write_rank_file(collected, staging, topology.rank, save),
                             staging / layout_free.rank_file(topology.rank))
    failure = failure or _attempt_write(lambda: save(rng, rng_file), rng_file)
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
    root = final.parent
    _write_atomically(root / "latest", final.name)


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


def resume_candidates(config: Config) -> list[Path]:
    """train.resume as checkpoints to try in order: `auto` every complete one, newest first (a newest
    one that fails to load gives way to the one before); `never` none, refused in a run directory that
    holds checkpoints (_refuse_used_run_directory); an explicit path that one, but a starting point
    once: the run's own checkpoints saved since it started there (their meta.json names it) come
    first, so a rerun of the same command goes on from where the run got to instead of starting
    over at the path (and then pruning it). Where `auto` or `never` leave none, a cooldown branch
    (train.branch_from) starts from its checkpoint, so an interrupted branch resumes its own
    checkpoints rather than branching again."""
    setting, run_dir = config.train.resume, Path(config.run.dir)
    if setting == "never":
        _refuse_used_run_directory(run_dir)
    if setting in ("never", "auto"):
        own = _own_checkpoints(run_dir) if setting == "auto" else []
        if own or config.train.branch_from is None:
            return own
        return [check_branch_point(Path(config.train.branch_from), config)]
    path = Path(setting)
    since = [own for own in _own_checkpoints(run_dir) if _started_from(own) == started_from_key(path)]
    if not (path / META_FILE).is_file():
        if since:
            return since
        raise CheckpointError(
            f"train.resume={setting}: no complete checkpoint there (missing {META_FILE}); "
            f"use train.resume=auto or a directory under {checkpoint_root(run_dir)}"
        )
    return [*since, path]


def _own_checkpoints(run_dir: Path) -> list[Path]:
    latest_checkpoint(run_dir)  # the warning about a wrong `latest` pointer, if any
    return complete_checkpoints(run_dir)[::-1]


def started_from_key(path: Path) -> str:
    """How a checkpoint's meta.json names the explicit train.resume its run started from."""
    return str(path.resolve())


def _started_from(checkpoint: Path) -> str | None:
    try:
        return read_meta(checkpoint).started_from
    except CheckpointError:
        return None  # a broken checkpoint names no start; resume skips it like any other


def _refuse_used_run_directory(run_dir: Path) -> None:
    """train.resume=never where a run has left checkpoints: refused, rather than trained into or moved.

    Trained into, the new run's checkpoints mixed with the old run's: keep_last pruned across both,
    metrics.jsonl was replaced, and a later train.resume=auto went on from whichever was newest,
    the old weights too. Moving the old run aside (RUN_DIR/previous-TIME/) was the other way out,
    but it moves what the user did not name (W&B and TensorBoard files, summary.json that sweeps
    read, a log a launcher is still writing into the directory) and keeps every earlier attempt's
    checkpoints on disk out of sight. A refusal loses nothing and each way on is one command."""
    complete = complete_checkpoints(run_dir)
    if complete:
        raise ConfigError(
            f"train.resume=never, but run.dir={run_dir} holds the checkpoints of a run (the newest: "
            f"{complete[-1].name}); to start a new run give a new run.dir, or move the old run aside "
            f"(mv {run_dir} {run_dir}-previous) and run again; to continue it set train.resume=auto"
        )


# Keys a cooldown branch may set apart from the run it branches from: its length and schedule,
# where it lives and reports, and how it is checkpointed, evaluated and stopped. The layout may
# differ too (the checkpoint is resharded, as any resume); the global batch may not.
BRANCH_FREE_KEYS = (
    "train.steps", "train.lr_schedule", "train.cooldown_fraction", "train.cooldown_shape", "train.branch_from",
    "train.resume", "train.eval_every", "train.eval_samples", "train.eval_seed", "train.exit_after",
    "train.exit_after_minutes", "train.stop_signals", "train.log_every", "train.micro_batch_size", "train.grad_accum",
    "train.global_batch_size", "train.activation_checkpoint", "train.loss_chunk_size", "train.compile", "run.",
    "checkpoint.", "tracking.", "parallel.",
)


def check_branch_point(path: Path, config: Config) -> Path:
    """train.branch_from, refused unless it is a complete checkpoint before train.steps of a run whose
    config is this one's apart from BRANCH_FREE_KEYS: then resuming it continues the very run that a
    fresh run of this config would be (Hägele et al. 2024, sec. 3: a cooldown of a constant-LR run)."""
    if not (path / META_FILE).is_file() or not (path / "config.yaml").is_file():
        raise CheckpointError(
            f"train.branch_from={path}: no complete checkpoint there (missing {META_FILE} or config.yaml); "
            "give a directory RUN/checkpoints/step_NNNNNNNN of the run to branch from"
        )
    step = read_meta(path).step
    if step >= config.train.steps:
        raise CheckpointError(
            f"train.branch_from={path} is at step {step}, not before train.steps={config.train.steps}; "
            "branch from an earlier checkpoint or raise train.steps"
        )
    differing = _branch_differences(yaml.safe_load((path / "config.yaml").read_text()), config)
    if differing:
        raise CheckpointError(
            f"train.branch_from={path} was trained with a different config: {'; '.join(differing)}. A branch "
            f"may change only {', '.join(BRANCH_FREE_KEYS)}; set the others as that run had them (its "
            f"config.yaml), or train this run fresh (train.branch_from=null)"
        )
    return path


def _branch_differences(stored: dict[str, Any], config: Config) -> list[str]:
    ours, theirs = flatten_config(config.to_dict()), flatten_config(stored)
    differing = [f"{key}={theirs.get(key)!r} there, {ours.get(key)!r} here"
                 for key in sorted(set(ours) | set(theirs))
                 if not key.startswith(BRANCH_FREE_KEYS) and ours.get(key) != theirs.get(key)]
    batch_here = _global_batch(config.to_dict())
    batch_there = _global_batch(stored)
    if batch_here != batch_there:
        differing.append(f"global batch size {batch_there} there, {batch_here} here")
    return differing


def _global_batch(config: dict[str, Any]) -> int:
    train = config["train"]
    return train.get("global_batch_size") or (
        train["micro_batch_size"] * train["grad_accum"] * (config["parallel"].get("data") or 1))


def flatten_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {'section.key': value}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (meta.json written), oldest first."""
    return sorted(p for p in checkpoint_root(run_dir).glob("step_*") if (p / META_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, found by scanning. `latest` is a hint for other tools (it is
    written after each save): when it is unreadable or names another checkpoint, say so and go on."""
    complete = complete_checkpoints(run_dir)
    newest = complete[-1] if complete else None
    pointer = checkpoint_root(run_dir) / "latest"
    if pointer.exists():
        try:
            named = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            named = f"unreadable ({type(error).__name__})"
        if newest is None or named != newest.name:
            found = f"using {newest}, the newest complete checkpoint" if newest else "no complete checkpoint was found"
            warn_once(f"{pointer} names {named[:40]!r}, not the newest complete checkpoint: {found} by scanning "
                      "(the pointer is only a hint; the next save rewrites it)")
    return newest


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A warning on stderr, once per process, from rank 0 only (every rank sees the same files)."""
    if message in _warned or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _warned.add(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


def first_loadable(run_dir: Path, load: Callable[[Path], T]) -> tuple[Path, T]:
    """`load` applied to the run's complete checkpoints, newest first, until one loads (for generate
    and export, one process): each that fails is named in a warning; none loading is one error."""
    checkpoints = complete_checkpoints(run_dir)[::-1]
    if not checkpoints:
        raise CheckpointError(f"{run_dir} has no complete checkpoint; train first with `scaletrain train CONFIG`")
    latest_checkpoint(run_dir)  # the warning about a wrong pointer, if any
    failures = []
    for index, path in enumerate(checkpoints):
        try:
            return path, translate_load_errors(path, "its files", partial(load, path))
        except CheckpointError as error:
            failures.append(str(error))
            if index + 1 < len(checkpoints):
                warn_once(f"skipping checkpoint {path}: {error}; trying {checkpoints[index + 1]}")
    raise CheckpointError(f"none of the {len(checkpoints)} checkpoints of {run_dir} could be loaded; the "
                          f"newest: {failures[0]}. Resume training to write a new one (train.resume=auto)")


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


def set_aside_from(run_dir: Path, step: int) -> list[Path]:
    """Move the checkpoints at `step` and after into RUN/checkpoints/diverged/ (kept for a look, never
    resumed from or pruned) and point `latest` at the newest one left: after a divergence, resuming
    with train.resume=auto then starts before the blow-up. Rank 0 only. Returns their new paths."""
    doomed = [path for path in complete_checkpoints(run_dir) if int(path.name.removeprefix("step_")) >= step]
    return _set_aside(run_dir, doomed, DIVERGED_DIR)


def set_aside_rejected(run_dir: Path, rejected: list[Path]) -> list[Path]:
    """Move checkpoints that a resume could not load, and fell back past, into RUN/checkpoints/rejected/
    (kept for a look): counted among the newest, a broken one would make keep_last prune the one the
    run resumed from, leaving nothing loadable until the next save. Rank 0 only, once every rank has
    loaded the checkpoint it resumes from. Returns their new paths."""
    return _set_aside(run_dir, rejected, REJECTED_DIR)


def _set_aside(run_dir: Path, checkpoints: list[Path], folder: str) -> list[Path]:
    """Move `checkpoints` into RUN/checkpoints/`folder`/, out of resume's and pruning's sight, and point
    `latest` at the newest one left."""
    root = checkpoint_root(run_dir)
    moved = []
    for path in checkpoints:
        target = root / folder / path.name
        target.parent.mkdir(exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(path, target)
        moved.append(target)
    remaining = complete_checkpoints(run_dir)
    if remaining:
        _write_atomically(root / "latest", remaining[-1].name)
    else:
        (root / "latest").unlink(missing_ok=True)
    return moved


def read_meta(path: Path) -> CheckpointMeta:
    """meta.json of the checkpoint `path`, refused if its fields changed since the save (its CRC-32) or
    its step is not the one its directory is named for."""
    try:
        raw = json.loads((path / META_FILE).read_text())
        files = {name: FileRecord.from_json(record) for name, record in dict(raw.get("files", {})).items()}
        meta = CheckpointMeta(int(raw["step"]), int(raw["consumed_samples"]), dict(raw["layout"]),
                              int(raw.get("skipped_steps", 0)), int(raw.get("consecutive_skipped_steps", 0)), files,
                              int(raw.get("format", 1)), dict(raw.get("spikes", {})), raw.get("tokenizer_sha256"),
                              raw.get("started_from"))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt ({error}); delete it or set train.resume to another"
        ) from None
    check_meta_seal(raw, path)
    if meta.format != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is in format {meta.format} (DeepSpeed's own files, written before scaletrain "
            f"kept layout-free checkpoints); this version reads format {FORMAT} only: finish that run "
            "with the scaletrain that wrote it, or start over in a new run.dir")
    named = re.fullmatch(r"step_(\d+)", path.name)
    if named and int(named[1]) != meta.step:
        raise CheckpointError(
            f"checkpoint {path}: meta.json says step {meta.step}, its directory is named for step {int(named[1])}: "
            "one of them changed since the save; resume from another checkpoint (train.resume=auto takes the one "
            f"before) or delete {path}")
    return meta


def check_files(path: Path, meta: CheckpointMeta) -> None:
    """Every file that meta.json lists is there with the size it was written with (a cheap check,
    stat only, that catches truncated or missing files before any rank starts loading; their contents
    are checked as each rank reads them, safe_load.CheckedFiles)."""
    for name, record in meta.files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks {name}")
        if file.stat().st_size != record.size:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {file.stat().st_size} bytes, {record.size} were written")


def load_checkpoint(engine: Any, path: Path, meta: CheckpointMeta, config: Config, topology: Topology) -> None:
    """Load a checkpoint written in any layout (`meta` from read_meta, its files checked) into `engine`:
    every parameter's master weight, working copy and Adam moments cut for this rank
    (checkpoint/layout_free.py), each file checked against its CRC-32 as it is read; in the same layout
    this rank's RNG state too (another layout reseeds it: dropout masks then differ from an
    uninterrupted run's). The weights and moments are checked finite before any is loaded (on this
    rank alone: the caller agrees on a failure over all ranks)."""
    target = layout_of(config, topology)
    same_layout = meta.layout == target
    if not same_layout and topology.is_logging_rank:
        print(f"resharding checkpoint {path} from {describe_layout(meta.layout)} to {describe_layout(target)}"
              + ("; dropout masks will differ from an uninterrupted run's" if config.model.dropout else ""),
              file=sys.stderr, flush=True)
    files = CheckedFiles(path, meta.files)
    translate_load_errors(path, layout_free.STATE_DIR, lambda: layout_free.load_into_engine(engine, path, files,
                                                                                          topology))
    if same_layout:
        rng_file = path / "rng" / f"rank_{topology.rank:05d}.pt"
        if not rng_file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks rng/{rng_file.name}")
        _restore_rng_state(translate_load_errors(path, f"rng/{rng_file.name}", lambda: files.load(rng_file)))
    engine.global_steps = meta.step
    engine.global_samples = meta.consumed_samples


def translate_load_errors(path: Path, part: str, load: Callable[[], Any]) -> Any:
    """Run `load`; a refused or unreadable file becomes a CheckpointError naming the checkpoint and part."""
    try:
        return load()
    except UnsafeCheckpointError as error:
        raise CheckpointError(str(error)) from None
    except (OSError, RuntimeError, KeyError, IndexError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(
            f"checkpoint {path}: {part} could not be loaded: {type(error).__name__}: {error}"
        ) from None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


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
