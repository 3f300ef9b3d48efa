"""A run's config as its checkpoints hold it: what `generate`, `evaluate` and `export` start from
(whatever layout trained the run), and what a resume may change from it (resume_rules, the one
function `train` and `check` both call)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from scaletrain.checkpoint.manager import (
    META_FILE,
    CheckpointError,
    CheckpointMeta,
    checkpoint_root,
    complete_checkpoints,
    first_loadable,
    flatten_config,
    latest_checkpoint,
    read_meta,
    started_from_key,
    translate_load_errors,
)
from scaletrain.config import Config, ConfigError, ParallelConfig, config_yaml, resolve_for_world
from scaletrain.config_loader import load_config


def run_config(run_dir: Path, checkpoint: Path | None = None) -> Config:
    """The run's model in one process, from the config of `checkpoint` or of the run's newest complete
    checkpoint (a run's checkpoints share one model; which of them loads is first_loadable's choice)."""
    return single_process_config(stored_config(run_dir, checkpoint))


def stored_config(run_dir: Path, checkpoint: Path | None = None) -> Config:
    """The config `checkpoint` (default: the run's newest complete one) was saved with, in the layout that
    trained it."""
    checkpoint = checkpoint or latest_checkpoint(run_dir)
    if checkpoint is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint; train first with `scaletrain train CONFIG`")
    return load_config(checkpoint / "config.yaml", to_train=False)


def chosen_checkpoint(run_dir: Path, checkpoint: str | Path) -> Path:
    """A command's --checkpoint: a checkpoint directory, its name under RUN/checkpoints (step_00000300)
    or its step (300)."""
    candidates = [Path(checkpoint), checkpoint_root(run_dir) / checkpoint]
    if str(checkpoint).isdigit():
        candidates.append(checkpoint_root(run_dir) / f"step_{int(checkpoint):08d}")
    for path in candidates:
        if (path / META_FILE).is_file():
            return path
    steps = ", ".join(str(int(path.name.removeprefix("step_"))) for path in complete_checkpoints(run_dir)) or "none"
    raise CheckpointError(
        f"--checkpoint {checkpoint} is not a complete checkpoint (no {META_FILE} there or under "
        f"{checkpoint_root(run_dir)}; its complete checkpoints are at steps {steps}); give a step, a name "
        "step_NNNNNNNN or a checkpoint directory"
    )


T = TypeVar("T")


def load_chosen(run_dir: Path, checkpoint: Path | None, load: Callable[[Path], T]) -> tuple[Path, T]:
    """`load` of the chosen checkpoint, or of the run's newest that loads (each one skipped is named)."""
    if checkpoint is None:
        return first_loadable(run_dir, load)
    return checkpoint, translate_load_errors(checkpoint, "its files", lambda: load(checkpoint))


def single_process_config(config: Config) -> Config:
    """The run's model in one process: TP=PP=DP=1, whatever layout trained it."""
    single = dataclasses.replace(config, parallel=ParallelConfig(tensor=1, pipeline=1, data=None, zero_stage=0))
    return resolve_for_world(single, world_size=1)


def announce_checkpoint(checkpoint: Path, step: int | None = None) -> None:
    """One line on stderr naming the checkpoint a command read and its step: the newest one that loads
    may not be the newest one written (first_loadable skips broken ones), and stdout stays the output.
    `step` as the command read it; without it meta.json is read again, which fails if a training run
    has pruned the checkpoint since."""
    step = read_meta(checkpoint).step if step is None else step
    print(f"using checkpoint {checkpoint} (step {step})", file=sys.stderr, flush=True)


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
    mean, and the explicit train.resume the run started from (manager.resume_candidates)."""
    resume = config.train.resume
    started = {} if resume in ("auto", "never") else {"started_from": started_from_key(Path(resume))}
    return {"tokenizer_sha256": tokenizer_sha256, **started}


def resume_rules(config: Config, candidates: list[Path], tokenizer_sha256: str,
                 warn: Callable[[str], None] | None = None) -> Resumption | None:
    """What `train` refuses before its first step, for `check` too: the first of `candidates`
    (manager.resume_candidates) whose meta.json reads, checked by resumption_from; None for a run
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
    batch_there, batch_here = _global_batch(stored), _global_batch(ours)
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


def _global_batch(flat: dict[str, Any]) -> int | None:
    """micro-batch x grad_accum x data-parallel size, of a config resolved for its world (as saved)."""
    try:
        return flat["train.micro_batch_size"] * flat["train.grad_accum"] * (flat.get("parallel.data") or 1)
    except (KeyError, TypeError):
        return None
