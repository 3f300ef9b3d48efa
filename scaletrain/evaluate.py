"""`scaletrain eval`: a checkpoint's validation metrics without training, in one process whatever
layout trained it.

The model is built and loaded as `generate` builds it (TP=PP=DP=1, no DeepSpeed); the metrics are
the training loop's own (train/evaluation.py, train/step.py), over the sequences its evaluations
read (the whole validation split or the same train.eval_seed sample, in the same micro-batches), so
the val_loss printed for a step is the one the run logged at that step, whatever its layout (equal up
to the order of float additions, which TP splits and data-parallel sums change).

A training run may prune the checkpoint while eval reads or evaluates it: eval reads its meta.json
and weights once, from one directory, before it evaluates (one that vanishes meanwhile gives way to
the next newest, as in generate and export), and never goes back to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from scaletrain.config import EVAL_ALL, Config, ConfigError
from scaletrain.families import get_family
from scaletrain.generate import load_snapshot
from scaletrain.parallel.groups import destroy_distributed, init_distributed
from scaletrain.run_config import announce_checkpoint, chosen_checkpoint, load_chosen, run_config
from scaletrain.train.evaluation import is_size_key, validation_metrics
from scaletrain.train.objective import build_objective
from scaletrain.train.step import model_evaluation_metrics


@dataclass(frozen=True)
class Evaluation:
    checkpoint: Path
    step: int
    eval_seed: int  # the seed of the sample read, if not the whole split (train/evaluation.py)
    seq_length: int
    metrics: dict[str, float]  # val_loss ..., and the sizes (train/evaluation.py SIZE_KEYS)

    def summary(self) -> str:
        """`step N (CHECKPOINT): S of SPLIT validation sequences (...), T loss tokens of SPLIT_T` then one
        `name value` line per metric (val_loss first; a blend's sizes are sums over its datasets)."""
        metrics = self.metrics
        sequences, split = metrics["val_sequences"], metrics["val_split_sequences"]
        sampling = "the whole split" if sequences == split else f"sampled with train.eval_seed={self.eval_seed}"
        lines = [f"step {self.step} ({self.checkpoint}): {sequences} of {split} validation sequences of "
                 f"{self.seq_length} tokens ({sampling}), {metrics['val_tokens']} loss tokens of the split's "
                 f"{metrics['val_split_tokens']} tokens"]
        lines += [f"{name} {value}" if is_size_key(name) else f"{name} {value:.6f}"
                  for name, value in sorted(metrics.items(), key=_val_loss_first)]
        return "\n".join(lines)


def evaluate_checkpoint(run_dir: Path, checkpoint: str | Path | None = None, samples: str | None = None
                        ) -> Evaluation:
    """The validation metrics of `checkpoint` (a directory, its name under RUN/checkpoints or its step), or of
    the run's newest checkpoint that loads; over the sequences the run's evaluations read
    (train.eval_samples, train.eval_seed), or over `samples` (a number, or all) drawn alike."""
    path = chosen_checkpoint(run_dir, checkpoint) if checkpoint is not None else None
    config = _with_samples(run_config(run_dir, path), samples)
    topology = init_distributed(config)
    try:
        path, (meta, model) = load_chosen(run_dir, path, partial(load_snapshot, config))
        announce_checkpoint(path, meta.step)
        model.to(topology.device)
        family, objective = get_family(config.model.family), build_objective(config)
        metrics = validation_metrics(lambda batches: model_evaluation_metrics(model, model, batches, family),
                                     objective, topology)
    finally:
        destroy_distributed()
    return Evaluation(path, meta.step, config.train.eval_seed, config.model.seq_length, metrics)


def _with_samples(config: Config, samples: str | None) -> Config:
    """The config with --samples as train.eval_samples: a number >= 1, or all."""
    if samples is None:
        return config
    if samples != EVAL_ALL and not (samples.isdigit() and int(samples) >= 1):
        raise ConfigError(f"--samples {samples}: give a number of validation sequences (>= 1), or {EVAL_ALL} for "
                          "the whole validation split")
    count = samples if samples == EVAL_ALL else int(samples)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, eval_samples=count))


def _val_loss_first(item: tuple[str, float]) -> tuple[bool, str]:
    return item[0] != "val_loss", item[0]
