"""Validation metrics over a fixed prefix of each validation set.

The training loop's periodic evaluation and `scaletrain eval` both go through `validation_metrics`,
so a checkpoint's val_loss is the same number whichever computes it, in whatever layout.
"""

from __future__ import annotations

from collections.abc import Callable

from scaletrain.batch import Batch
from scaletrain.config import Config, ConfigError
from scaletrain.parallel.groups import Topology
from scaletrain.train.objective import Objective, ValidationSet

# This rank's micro-batches of one validation set -> val_loss and the family's own metrics, reduced
# over data-parallel ranks (train/step.py evaluation_metrics or model_evaluation_metrics).
BatchMetrics = Callable[[list[Batch]], dict[str, float]]


def validation_metrics(
    metrics_of: BatchMetrics, objective: Objective, topology: Topology, data_parallel_size: int | None = None
) -> dict[str, float]:
    """Validation metrics over a fixed prefix of the validation split, identical for every layout.

    A blend reports each dataset's metrics (val_loss/NAME) and, under the plain names, their
    weighted mean: the loss expected under the blend's mixture, free of sampling noise.
    `data_parallel_size`: whose evaluation steps the prefix is a whole number of (default: this
    process's); `scaletrain eval` gives the training run's, so one process reads the same sequences."""
    sets = objective.validation_sets
    if len(sets) == 1:
        return _evaluate_set(metrics_of, objective, topology, sets[0], data_parallel_size)
    per_set = {validation.name: _evaluate_set(metrics_of, objective, topology, validation, data_parallel_size)
               for validation in sets}
    metrics: dict[str, float] = {}
    for validation in sets:
        for key, value in per_set[validation.name].items():
            metrics[key] = metrics.get(key, 0.0) + validation.weight * value
    for name, values in per_set.items():
        metrics.update({f"{key}/{name}": value for key, value in values.items()})
    return metrics


def evaluation_samples(config: Config, validation: ValidationSet, data_parallel_size: int) -> int:
    """The prefix evaluated: train.eval_samples sequences, fewer if the split is smaller, rounded down to
    whole evaluation steps (micro_batch_size x data-parallel size). Layouts whose steps both divide
    eval_samples read the same prefix; a run resumed at another DP size that does not (16 samples, micro 2,
    DP3: 12) evaluates fewer sequences from then on, and its val_loss moves with them."""
    per_step = config.train.micro_batch_size * data_parallel_size
    num_samples = min(config.train.eval_samples, validation.num_samples) // per_step * per_step
    if num_samples == 0:
        raise ConfigError(
            f"the validation split of {validation.name} holds {validation.num_samples} sequences of "
            f"{config.model.seq_length} tokens, fewer than one evaluation step (micro_batch_size x data-parallel "
            f"size = {per_step}); raise data.val_fraction and re-prepare, or set train.eval_every=0"
        )
    return num_samples


def _evaluate_set(
    metrics_of: BatchMetrics, objective: Objective, topology: Topology, validation: ValidationSet,
    data_parallel_size: int | None,
) -> dict[str, float]:
    num_samples = evaluation_samples(objective.config, validation, data_parallel_size or topology.data_parallel_size)
    loader = objective.eval_loader(validation, topology.data_parallel_rank, topology.data_parallel_size, num_samples)
    batches = [{key: value.to(topology.device, non_blocking=True) for key, value in batch.items()} for batch in loader]
    return metrics_of(batches)
