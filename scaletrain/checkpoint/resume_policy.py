"""Resume policy: which checkpoints a run resumes from, in what order, and what its config may change
since they were saved, each refusal one line naming the key and the way on.

Every compatibility rule is here: RESUME_FREE_KEYS (what a resume may change; resume_rules, the one
function `train` and `check` both call), BRANCH_FREE_KEYS (what a cooldown branch may change from the
run it branches from; check_branch_point) and SCHEDULE_KEYS (the LR schedule's, which the start line
reports). The checkpoints themselves are read by checkpoint/format.py; run_config.py gives the
config they were saved with to `generate`, `evaluate` and `export`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import (
    META_FILE,
    CheckpointMeta,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
    read_meta,
)
from scaletrain.config import Config, ConfigError, config_yaml
from scaletrain.parallel.layout import Layout, requested_global_batch

# The keys the LR schedule reads (train/schedule.py): a resume that changes one says the LR it gives.
SCHEDULE_KEYS = ("train.steps", "train.lr", "train.min_lr", "train.warmup_steps", "train.warmup_fraction",
                 "train.lr_schedule", "train.cooldown_fraction", "train.cooldown_shape")
# What a resume may change from the config its checkpoint was saved with (CHECKPOINT/config.yaml);
# any other difference is refused, naming it. An entry ending in "." is a whole section.
RESUME_FREE_KEYS = (
    # the length of the run and its LR schedule: the LR is a function of (step, config), so the new
    # schedule takes over at the resumed step (the start line says the LR there before and after)
    *SCHEDULE_KEYS,
    # where the run starts from and when this invocation stops
    "train.resume", "train.init_from", "train.branch_from", "train.exit_after", "train.exit_after_minutes",
    "train.stop_signals",
    # cadence of evaluation, logging and checkpoints; tracking; where the run lives (a resume from
    # another run's checkpoint, train.resume=PATH, has another run.dir)
    "train.eval_every", "train.eval_samples", "train.eval_seed", "train.log_every", "checkpoint.", "tracking.", "run.",
    # in-loop downstream evaluation: what it scores and when, never what trains
    "eval.",
    # a reshard: the layout and how the same global batch is cut into micro-batches (the global batch
    # itself is compared on its own, resume_rules); how a step is computed, not what: memory and speed
    "parallel.", "train.micro_batch_size", "train.grad_accum", "train.global_batch_size",
    "train.activation_checkpoint", "train.activation_checkpoint_interval", "train.loss_chunk_size", "train.compile",
    "train.precision", "model.attention_backend",
    # how the prepared data is read, not which data (its tokenizer is compared on its own)
    "data.loader_workers", "data.prepare_workers", "data.cache_dir", "data.cache_limit_gb", "data.download_retries",
    "data.download_backoff_s", "data.download_timeout_s",
    # what to do when a step goes wrong: the usual thing to change before resuming a stopped run
    "train.max_skipped_steps", "train.spike.", "train.inject_nonfinite_loss_at",
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
    batch_here, batch_there = requested_global_batch(config, data_parallel=1), _global_batch(stored)
    if batch_here != batch_there:
        differing.append(f"global batch size {batch_there} there, {batch_here} here")
    return differing


def flatten_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {'section.key': value}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class NothingToTrain(Exception):  # noqa: N818 - not an error: the CLI says it and exits 0
    """The run is already at or past train.steps."""


@dataclass(frozen=True)
class Resumption:
    """The checkpoint a run resumes from and what the config changes since it was saved."""

    checkpoint: Path
    meta: CheckpointMeta
    changes: list[tuple[str, Any, Any]]  # (key, the checkpoint's value, this config's), keys of RESUME_FREE_KEYS
    stored: dict[str, Any]  # the checkpoint's config, flattened ({} when it has no config.yaml)

    @property
    def step(self) -> int:
        return self.meta.step

    def changed_since(self) -> str:
        if not self.stored:
            return "no config.yaml in it to compare"
        if not self.changes:
            return "config unchanged"
        return "changed since: " + ", ".join(f"{key} {show(there)} -> {show(here)}"
                                             for key, there, here in self.changes)


def checkpoint_provenance(config: Config, tokenizer_sha256: str) -> dict[str, str]:
    """What the run's checkpoints record for the next resume's rules: the tokenizer their token ids
    mean, and the explicit train.resume the run started from (resume_candidates)."""
    resume = config.train.resume
    started = {} if resume in ("auto", "never") else {"started_from": started_from_key(Path(resume))}
    return {"tokenizer_sha256": tokenizer_sha256, **started}


def resume_rules(config: Config, candidates: list[Path], tokenizer_sha256: str,
                 warn: Callable[[str], None] | None = None) -> Resumption | None:
    """What `train` refuses before its first step, for `check` too: the first of `candidates`
    (resume_candidates) whose meta.json reads, checked by resumption_from; None for a run
    that starts at step 0. A candidate whose meta.json does not read is skipped (`warn` names it), as
    train falls back past it; none reading is one error."""
    for index, path in enumerate(candidates):
        try:
            meta = read_meta(path)
        except CheckpointError as error:
            if index + 1 == len(candidates):
                raise CheckpointError(
                    f"no checkpoint of {config.run.dir} could be loaded; the last tried: {error}. Delete the "
                    "broken checkpoints, or start a new run (a new run.dir)") from None
            if warn:
                warn(f"skipping checkpoint {path}: {error}; trying {candidates[index + 1]}")
            continue
        return resumption_from(config, path, meta, tokenizer_sha256)
    return None


def resumption_from(config: Config, path: Path, meta: CheckpointMeta, tokenizer_sha256: str) -> Resumption:
    """Resuming `path` with `config`, or one line saying why not: a key outside RESUME_FREE_KEYS that
    differs (another model shape, objective, data, seed, optimizer...), another global batch, another
    tokenizer; NothingToTrain when the checkpoint is at or past train.steps."""
    stored = _stored_config(path)
    ours = flatten_config(yaml.safe_load(config_yaml(config)))
    differing = [(key, stored[key], value) for key, value in ours.items() if key in stored and stored[key] != value]
    refused = [f"{key} {show(there)} there, {show(here)} here" for key, there, here in differing if not _free(key)]
    batch_there, batch_here = _global_batch(stored), requested_global_batch(config, data_parallel=1)
    if batch_there is not None and batch_there != batch_here:
        refused.append(f"global batch {batch_there} there, {batch_here} here (set train.global_batch_size="
                       f"{batch_there} to cut it for this layout)")
    if refused:
        raise ConfigError(
            f"cannot resume from {path}: {'; '.join(refused)}; a resume may change the LR schedule and length, "
            "cadence, tracking and layout, not these. Set them back as the run had them "
            f"({path / 'config.yaml'}), or train this config as a new run (a new run.dir)")
    if meta.tokenizer_sha256 and meta.tokenizer_sha256 != tokenizer_sha256:
        data = config.data.dir if not config.data.blend else "data.blend"
        raise ConfigError(
            f"cannot resume from {path}: it was trained on tokens of tokenizer sha256 {meta.tokenizer_sha256[:12]}..., "
            f"but {data} is now prepared with tokenizer sha256 {tokenizer_sha256[:12]}... (prepared again?), whose "
            "token ids mean other text; resume on the data the run was prepared with, or train this data as a new "
            "run (a new run.dir)")
    if meta.step >= config.train.steps:
        run_dir = Path(config.run.dir)
        where = run_dir if path.parent == checkpoint_root(run_dir) else path
        raise NothingToTrain(f"nothing to train: {where} is at step {meta.step} of {config.train.steps}; "
                             "raise train.steps to train on")
    return Resumption(path, meta, [change for change in differing if _free(change[0])], stored)


def show(value: Any) -> str:
    """A config value as a user writes it in an override."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return f"{value:g}" if isinstance(value, float) else str(value)


def _free(key: str) -> bool:
    return any(key == free or (free.endswith(".") and key.startswith(free)) for free in RESUME_FREE_KEYS)


def _stored_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config, flattened; {} without one to compare (a checkpoint saved without it
    fails its file check when it loads)."""
    try:
        stored = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return flatten_config(stored) if isinstance(stored, dict) else {}


def _global_batch(config: dict[str, Any]) -> int | None:
    """The global batch of a saved config (nested or flattened): train.global_batch_size where it sets one, else
    its layout's (every saved config is resolved for its world); None where it lacks the keys."""
    train = config.get("train")
    explicit = train.get("global_batch_size") if isinstance(train, dict) else config.get("train.global_batch_size")
    if explicit:
        return int(explicit)
    layout = Layout.stored(config)
    return None if layout is None else layout.global_batch
