"""Validation metrics over the whole validation split, or a fixed random sample of it.

The training loop's periodic evaluation and `scaletrain eval` both go through `validation_metrics`,
so a checkpoint's val_loss is the same number whichever computes it, in whatever layout.

Which sequences: train.eval_samples=all reads every sequence of the split; a number below the split's
size reads that many drawn without replacement by a generator seeded with train.eval_seed alone
(data/sampler.py validation_sample), so every run of a sweep, every layout and every resume reads the
same ones. Every one of them is counted once, in any layout: the sequences past the last whole
micro-batch are evaluated in micro-batches of copies (evaluation_micro_batches), and the loss is the
mean over every target token read (train/step.py token_weighted_loss). Each evaluation reports its
size: val_sequences and val_tokens (the loss targets averaged over), val_split_sequences and
val_split_tokens (the tokens the split's sequences hold).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from scaletrain.batch import IGNORE_INDEX, Batch
from scaletrain.config import EVAL_ALL, Config
from scaletrain.data.sampler import EvaluationMicroBatch, evaluation_micro_batches, validation_sample
from scaletrain.families import get_family
from scaletrain.parallel.groups import Topology
from scaletrain.train.objective import Objective, ValidationSet
from scaletrain.train.step import BatchWeight, WeightedBatches

# This rank's micro-batches of one validation set, each with what it counts for -> val_loss, val_tokens and
# the family's own metrics, reduced over data-parallel ranks (train/step.py evaluation_metrics or
# model_evaluation_metrics).
BatchMetrics = Callable[[WeightedBatches], dict[str, float]]

# The sizes an evaluation reports: a blend's are the sums over its datasets, not a weighted mean.
SIZE_KEYS = ("val_sequences", "val_tokens", "val_split_sequences", "val_split_tokens")


def validation_metrics(metrics_of: BatchMetrics, objective: Objective, topology: Topology) -> dict[str, float]:
    """Validation metrics over the evaluated sequences of the validation split, identical for every layout.

    A blend reports each dataset's metrics (val_loss/NAME) and, under the plain names, their
    weighted mean: the loss expected under the blend's mixture, free of sampling noise; its sizes are
    the sums over its datasets."""
    sets = objective.validation_sets
    if len(sets) == 1:
        return _evaluate_set(metrics_of, objective, topology, sets[0])
    per_set = {validation.name: _evaluate_set(metrics_of, objective, topology, validation) for validation in sets}
    metrics: dict[str, float] = {}
    for validation in sets:
        for key, value in per_set[validation.name].items():
            metrics[key] = metrics.get(key, 0) + (value if key in SIZE_KEYS else validation.weight * value)
    for name, values in per_set.items():
        metrics.update({f"{key}/{name}": value for key, value in values.items()})
    return metrics


def evaluated_indices(config: Config, validation: ValidationSet) -> np.ndarray:
    """The global indices of the split an evaluation reads, sorted: all of them with train.eval_samples=all
    (or a number at least the split's size), else the train.eval_seed sample of that many."""
    requested = None if config.train.eval_samples == EVAL_ALL else int(config.train.eval_samples)
    return validation_sample(validation.num_samples, requested, config.train.eval_seed)


def _evaluate_set(
    metrics_of: BatchMetrics, objective: Objective, topology: Topology, validation: ValidationSet
) -> dict[str, float]:
    indices = evaluated_indices(objective.config, validation)
    rank, ranks = topology.data_parallel_rank, topology.data_parallel_size
    plan = evaluation_micro_batches(indices, objective.config.train.micro_batch_size, ranks)[rank::ranks]
    label = get_family(objective.config.model.family).batch_schema(objective.config).labels[0]
    batches = _RankBatches(objective, validation, plan, label, topology.device)
    metrics = metrics_of(batches)
    sizes = {"val_sequences": len(indices), "val_tokens": metrics.pop("val_tokens"),
             "val_split_sequences": validation.num_samples, "val_split_tokens": validation.num_tokens}
    return {**metrics, **sizes}


@dataclass(frozen=True)
class _RankBatches:
    """This rank's micro-batches of a validation set with what each counts for (step.py WeightedBatches),
    loaded as they are evaluated."""

    objective: Objective
    validation: ValidationSet
    plan: list[EvaluationMicroBatch]
    label: str  # the batch key of the loss targets (the family's first label)
    device: torch.device

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[tuple[Batch, BatchWeight]]:
        loader = self.objective.eval_loader(self.validation, [micro_batch.indices for micro_batch in self.plan])
        for micro_batch, batch in zip(self.plan, loader, strict=True):
            # the loss targets it counts: its labels that are not IGNORE_INDEX, times its share
            targets = micro_batch.share * int((batch[self.label] != IGNORE_INDEX).sum())
            yield ({key: value.to(self.device, non_blocking=True) for key, value in batch.items()},
                   BatchWeight(micro_batch.share, targets))


def metrics_text(metrics: dict[str, float]) -> str:
    """`val_loss 3.1416, val_masked_accuracy 0.1234 (64 of 1620 validation sequences, 8192 loss tokens)`:
    for a progress line; the sizes of a blend's datasets are in metrics.jsonl."""
    text = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items() if not is_size_key(key))
    if "val_sequences" not in metrics:
        return text
    return (f"{text} ({metrics['val_sequences']} of {metrics['val_split_sequences']} validation sequences, "
            f"{metrics['val_tokens']} loss tokens)")


def is_size_key(key: str) -> bool:
    """val_sequences, val_tokens/wiki...: a count, not a loss or a rate."""
    return key.split("/")[0] in SIZE_KEYS
