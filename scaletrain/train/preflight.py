"""`scaletrain check`: what `train` would refuse, found before any rank starts.

A job that waited hours in a queue should not learn of a typo in an override after its ranks have
imported DeepSpeed and joined torch.distributed. The check reads the config and overrides, the
prepared data's manifest, the layout for the world size, the run directory's lock, whether its
checkpoints can be written, and its newest checkpoint whose meta.json is intact, and builds no model
and no process group; launch/slurm.sbatch runs it before srun. `train` runs the same checks that
need no other rank's word (check_data_matches, check_checkpoints_writable, check_init_from, and the
resume rules: resume_policy.resume_rules) before its first step, so `check` refuses with train's line.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import checkpoint_root, describe_layout, warn_once
from scaletrain.checkpoint.init_weights import check_init_from
from scaletrain.checkpoint.resume_policy import SCHEDULE_KEYS, Resumption, resume_candidates, resume_rules
from scaletrain.config import Config, ConfigError, TrainConfig
from scaletrain.config_loader import load_config
from scaletrain.data.blend import check_same_tokenizer
from scaletrain.data.manifest import Manifest
from scaletrain.data.storage import dataset_location, load_manifest
from scaletrain.families import model_counts
from scaletrain.parallel.layout import Layout, resolve_for_world
from scaletrain.parallel.placement import check_tensor_parallel_within_hosts, planned_places
from scaletrain.planner.recompute import RecomputeDecision, device_memory, resolve_recompute
from scaletrain.train.run_lock import RunDirectoryLock
from scaletrain.train.schedule import learning_rate


@dataclass(frozen=True)
class Preflight:
    """What a `train` of this config on `world_size` ranks would start from."""

    config: Config  # resolved for the world size
    world_size: int
    manifest: Manifest
    resumption: Resumption | None  # None: the run starts at step 0
    resharded_from: str | None = None  # the checkpoint's own layout, when it differs from this run's
    recompute: RecomputeDecision | None = None  # what train.activation_checkpoint runs on this host's device

    def _data_line(self) -> str:
        data = self.config.data
        splits = ", ".join(f"{name} {split.num_tokens:,} tokens" for name, split in self.manifest.splits.items())
        if not data.blend:
            return f"{data.dir}, vocab {self.manifest.vocab_size}, {splits}"
        total = sum(entry.weight for entry in data.blend)
        mix = " + ".join(f"{entry.weight / total:.3f} {entry.dir}" for entry in data.blend)
        return f"blend {mix}, vocab {self.manifest.vocab_size}"

    def summary(self) -> str:
        config, counts = self.config, model_counts(self.config)
        parallel = config.parallel
        global_batch = Layout.of(config).global_batch
        tokens_per_step = global_batch * config.model.seq_length
        resumption, start = self.resumption, "starts at step 0"
        if resumption:
            start = f"resumes at step {resumption.step} of {config.train.steps} from {resumption.checkpoint}"
            if self.resharded_from:
                start += f" (resharded from {self.resharded_from})"
            start += f"; {describe_resume(resumption, config.train)}"
        return "\n".join([
            f"ok: {config.model.family}, {counts.total_params:,} parameters "
            f"({counts.non_embedding_params:,} non-embedding)",
            f"layout: world {self.world_size} = TP {parallel.tensor} x DP {parallel.data} x PP {parallel.pipeline}, "
            f"ZeRO-{parallel.zero_stage}" + (f", {self.recompute.describe()}" if self.recompute else ""),
            f"batch: global {global_batch} = micro {config.train.micro_batch_size} x grad_accum "
            f"{config.train.grad_accum} x DP {parallel.data}; {tokens_per_step:,} tokens per step, "
            f"{config.train.steps} steps, {config.train.steps * tokens_per_step:,} tokens",
            f"data: {self._data_line()}",
            f"run: {config.run.dir} {start}",
        ])


def preflight(config_path: Path, overrides: list[str], world_size: int, ranks_per_node: int | None = None
              ) -> Preflight:
    """Raise ConfigError (or the data's or checkpoint's ValueError) naming what `train` would fail on.
    With `ranks_per_node`, also a TP group that the launcher would place across nodes."""
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: give the number of ranks the job will start (1 or more)")
    config = resolve_for_world(load_config(config_path, overrides), world_size)
    # auto as train decides it on this host's first GPU (the batch script runs check on the job's first node)
    config, recompute = resolve_recompute(config, device_memory(_local_device()))
    if ranks_per_node is not None:
        check_tensor_parallel_within_hosts(planned_places(world_size, ranks_per_node), config.parallel.tensor)
    manifest = check_data_matches(config)
    run_dir = Path(config.run.dir)
    holder = RunDirectoryLock(run_dir).holder()
    if holder is not None:
        raise ConfigError(f"run.dir={run_dir} is in use by {holder}; wait for it to finish, stop it, "
                          "or set run.dir to another directory")
    check_checkpoints_writable(run_dir)
    check_init_from(config)
    resumption = resume_rules(config, resume_candidates(config), manifest.tokenizer_sha256, warn=warn_once)
    resharded_from = _resharded_from(config, resumption.meta.layout) if resumption else None
    return Preflight(config, world_size, manifest, resumption, resharded_from, recompute)


def describe_resume(resumption: Resumption, train: TrainConfig) -> str:
    """What the config changes since the checkpoint was saved; when the LR schedule changes, the LR of
    the next step before and now (a function of (step, config): train/schedule.py) and the new shape."""
    changed = {key.removeprefix("train."): there for key, there, _ in resumption.changes if key in SCHEDULE_KEYS}
    if not changed:
        return resumption.changed_since()
    before, step = dataclasses.replace(train, **changed), resumption.step
    return (f"{resumption.changed_since()}; LR at step {step + 1}: {learning_rate(step, before):.3g} before, "
            f"{learning_rate(step, train):.3g} now ({_schedule_shape(train)})")


def _schedule_shape(train: TrainConfig) -> str:
    if train.lr_schedule != "wsd":
        return f"cosine to {train.min_lr:g} at step {train.steps}"
    if not train.cooldown_steps:
        return f"constant {train.lr:g} to step {train.steps}"
    return (f"constant {train.lr:g}, then a {train.cooldown_shape} cooldown to {train.min_lr:g} over steps "
            f"{train.steps - train.cooldown_steps + 1}-{train.steps}")


def _local_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def check_checkpoints_writable(run_dir: Path) -> None:
    """Refuse a run whose checkpoints cannot be written (a plain file or a symlink loop where
    RUN/checkpoints should be, a read-only disk) before its first step: a save is written in the
    background, so its failure would come to light a checkpoint interval later, with nothing saved.
    Makes and removes a directory where the first save makes its own: the kernel's answer, root's
    too (a mode check would pass root on a read-only directory)."""
    root = checkpoint_root(run_dir)
    existing = next(path for path in (root, *root.parents) if _exists(path))
    try:
        if not stat.S_ISDIR(os.stat(existing).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".scaletrain-write-check-", dir=existing))
    except OSError as error:
        where = "" if existing == root else f" cannot be made: {existing}"
        raise CheckpointError(
            f"{root}{where} is not a writable directory ({error.strerror or error}), so no checkpoint could be "
            f"saved; make it one (move away what is there) or set run.dir to another directory") from None


def _exists(path: Path) -> bool:
    """Whether `path` names anything, a broken or looping symlink too (Path.exists follows links)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def check_data_matches(config: Config) -> Manifest:
    """The prepared datasets the run reads (their manifests and checksums; a remote one's tokenizer and
    indexes fetched into the cache), agreeing on one tokenizer and with the config's vocabulary size;
    returns the first (data.dir's, or the blend's first)."""
    manifests = {source.label: (source.dir, load_manifest(dataset_location(config.data, source.dir)))
                 for source in config.data.sources()}
    if len(manifests) > 1:
        check_same_tokenizer({label: manifest for label, (_, manifest) in manifests.items()})
    for location, manifest in manifests.values():
        if manifest.vocab_size != config.data.vocab_size:
            raise ConfigError(
                f"data.vocab_size={config.data.vocab_size} but {location} was prepared with "
                f"vocab_size={manifest.vocab_size}; set data.vocab_size={manifest.vocab_size} or re-run prepare"
            )
    return next(iter(manifests.values()))[1]


def _resharded_from(config: Config, layout: dict[str, int]) -> str | None:
    """The checkpoint's layout if it differs from this run's (any layout resumes any other:
    checkpoint/layout_free.py)."""
    parallel = config.parallel
    ours = {"tensor": parallel.tensor, "pipeline": parallel.pipeline, "data": parallel.data,
            "zero_stage": parallel.zero_stage}
    return None if all(layout.get(key) == value for key, value in ours.items()) else describe_layout(layout)
