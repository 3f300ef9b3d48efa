"""`scaletrain eval`: a checkpoint's validation metrics without training, in one process whatever
layout trained it.

The model is built and loaded as `generate` builds it (TP=PP=DP=1, no DeepSpeed); the metrics are
the training loop's own (train/evaluation.py, train/step.py), over the sequences its evaluations
read, so the val_loss printed for a step is the one the run logged at that step (equal up to the
order of float additions, which TP splits change).

A training run may prune the checkpoint while eval reads or evaluates it: eval reads its meta.json
and weights once, from one directory, before it evaluates (one that vanishes meanwhile gives way to
the next newest, as in generate and export), and never goes back to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from scaletrain.checkpoint.manager import (
    META_FILE,
    CheckpointError,
    CheckpointMeta,
    checkpoint_root,
    first_loadable,
    translate_load_errors,
)
from scaletrain.checkpoint.run_config import announce_checkpoint, run_config, single_process_config
from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import load_config
from scaletrain.generate import load_snapshot
from scaletrain.model.registry import get_family
from scaletrain.parallel.groups import destroy_distributed, init_distributed
from scaletrain.train.evaluation import evaluation_samples, validation_metrics
from scaletrain.train.objective import build_objective
from scaletrain.train.step import model_evaluation_metrics


@dataclass(frozen=True)
class Evaluation:
    checkpoint: Path
    step: int
    samples: dict[str, int]  # validation sequences read, per dataset of the blend
    seq_length: int
    metrics: dict[str, float]

    def summary(self) -> str:
        """`step N: ...` then one `name value` line per metric (val_loss first)."""
        read = " + ".join(f"{count} ({name})" for name, count in self.samples.items())
        if len(self.samples) == 1:
            read = str(next(iter(self.samples.values())))
        lines = [f"step {self.step} ({self.checkpoint}): {read} validation sequences of {self.seq_length} tokens"]
        lines += [f"{name} {value:.6f}" for name, value in sorted(self.metrics.items(), key=_val_loss_first)]
        return "\n".join(lines)


def evaluate_checkpoint(run_dir: Path, checkpoint: Path | None = None, samples: int | None = None) -> Evaluation:
    """The validation metrics of `checkpoint` (a directory, or its name under RUN/checkpoints), or of
    the run's newest checkpoint that loads; over train.eval_samples sequences, or `samples`."""
    path = _checkpoint_path(run_dir, checkpoint) if checkpoint is not None else None
    config = _with_samples(run_config(run_dir) if path is None else _checkpoint_config(path), samples)
    topology = init_distributed(config)
    try:
        path, (meta, model) = _load(run_dir, path, config)
        announce_checkpoint(path, meta.step)
        model.to(topology.device)
        # The training run's DP size: its evaluations read whole steps of micro_batch_size x DP sequences.
        trained_data_parallel = meta.layout["data"]
        family, objective = get_family(config.model.family), build_objective(config)
        metrics = validation_metrics(lambda batches: model_evaluation_metrics(model, model, batches, family),
                                     objective, topology, trained_data_parallel)
        read = {validation.name: evaluation_samples(config, validation, trained_data_parallel)
                for validation in objective.validation_sets}
    finally:
        destroy_distributed()
    return Evaluation(path, meta.step, read, config.model.seq_length, metrics)


def _load(run_dir: Path, checkpoint: Path | None, config: Config
          ) -> tuple[Path, tuple[CheckpointMeta, torch.nn.Module]]:
    """The given checkpoint's meta and model, or the newest of the run's that loads (each one skipped is named)."""
    if checkpoint is None:
        return first_loadable(run_dir, partial(load_snapshot, config))
    return checkpoint, translate_load_errors(checkpoint, "its files", partial(load_snapshot, config, checkpoint))


def _checkpoint_path(run_dir: Path, checkpoint: Path) -> Path:
    """--checkpoint as given, or as a name under RUN/checkpoints (e.g. step_00000300)."""
    for path in (checkpoint, checkpoint_root(run_dir) / checkpoint):
        if (path / META_FILE).is_file():
            return path
    raise CheckpointError(
        f"--checkpoint {checkpoint} is not a complete checkpoint (no {META_FILE} there or under "
        f"{checkpoint_root(run_dir)}); give a directory RUN/checkpoints/step_NNNNNNNN or its name"
    )


def _checkpoint_config(checkpoint: Path) -> Config:
    return single_process_config(load_config(checkpoint / "config.yaml", to_train=False))


def _with_samples(config: Config, samples: int | None) -> Config:
    if samples is None:
        return config
    if samples < 1:
        raise ConfigError(f"--samples {samples} must be >= 1 (validation sequences to read)")
    return dataclasses.replace(config, train=dataclasses.replace(config.train, eval_samples=samples))


def _val_loss_first(item: tuple[str, float]) -> tuple[bool, str]:
    return item[0] != "val_loss", item[0]
