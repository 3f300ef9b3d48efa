"""One optimizer step: micro-batches, backward, DeepSpeed's boundary step, and the step's metrics."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from scaletrain.batch import GLOBAL_INDEX, Batch
from scaletrain.model.family import ModelFamily
from scaletrain.train.nonfinite import NonFiniteGuard


def train_step(
    engine: Any, guard: NonFiniteGuard, batches: Iterator[dict[str, torch.Tensor]], grad_accum: int, lr: float
) -> dict[str, float]:
    """One optimizer step at learning rate `lr` over grad_accum micro-batches; DeepSpeed scales each
    loss by 1/grad_accum and all-reduces gradients across data-parallel ranks at the boundary.
    The guard sees every micro-batch loss and skips the update if any is non-finite (guard.skipped)."""
    for group in engine.optimizer.param_groups:  # DeepSpeed's ZeRO optimizers share torch's groups
        group["lr"] = lr
    if is_pipeline(engine):
        # The pipeline engine runs the 1F1B schedule over grad_accum micro-batches itself and
        # returns the loss averaged over them and over data-parallel ranks.
        loss = float(engine.train_batch(data_iter=pipeline_inputs(engine, batches)))
        return _with_grad_norm(engine, {"loss": loss, "lr": lr})
    losses = []
    for _ in range(grad_accum):
        batch = next(batches)
        loss = guard.watch_loss(engine(**model_inputs(batch)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return _with_grad_norm(engine, {"loss": data_parallel_mean(torch.stack(losses).mean()), "lr": lr})


@dataclass(frozen=True)
class BatchWeight:
    """What one evaluation micro-batch counts for (data/sampler.py evaluation_micro_batches): the share
    of its rows that count (1; 1/micro_batch_size for copies of one sequence; 0 for a filler), which
    scales the family's counts, and the loss targets it counts (share x its labels not IGNORE_INDEX),
    which weigh its loss."""

    share: float
    targets: float


class WeightedBatches(Protocol):
    """This rank's evaluation micro-batches with what each counts for, loaded as they are evaluated
    (a whole validation split need not fit in memory at once)."""

    def __iter__(self) -> Iterator[tuple[Batch, BatchWeight]]: ...

    def __len__(self) -> int: ...


def evaluation_metrics(engine: Any, batches: WeightedBatches, family: ModelFamily) -> dict[str, float]:
    """An engine's validation metrics over this rank's micro-batches (model_evaluation_metrics, or
    pipeline_evaluation_metrics): val_loss, val_tokens and the family's own, the same in every layout."""
    if is_pipeline(engine):
        return pipeline_evaluation_metrics(engine, batches, family)
    engine.eval()
    metrics = model_evaluation_metrics(engine, engine.module, batches, family)
    engine.train()
    return metrics


def model_evaluation_metrics(
    forward: Callable[..., torch.Tensor], module: torch.nn.Module, batches: WeightedBatches, family: ModelFamily
) -> dict[str, float]:
    """The token-weighted validation loss over every data-parallel rank's micro-batches
    (token_weighted_loss), plus the family's own metrics (e.g. BERT's masked-token accuracy) from
    counts summed over batches and ranks. `forward` returns a batch's loss (a DeepSpeed engine, or the
    model itself in `scaletrain eval`); `module` is the model whose outputs the family counts."""
    weighted_losses, weights, per_batch = [], [], []
    with torch.no_grad():
        for batch, weight in batches:
            inputs = model_inputs(batch)
            weighted_losses.append(forward(**inputs).double() * weight.targets)
            weights.append(weight)
            if family.evaluation_counts is not None:
                per_batch.append(family.evaluation_counts(module, inputs))
    metrics = token_weighted_loss(torch.stack(weighted_losses).sum(), sum(weight.targets for weight in weights))
    if family.evaluation_counts is not None:
        metrics.update(_data_parallel_metrics(_summed(per_batch, weights), family))
    return metrics


def pipeline_evaluation_metrics(engine: Any, batches: WeightedBatches, family: ModelFamily) -> dict[str, float]:
    """The pipeline's validation loss (DeepSpeed's eval_batch) and the family's own metrics. Only the
    last stage holds the model's outputs (and only the first and last read the batches), so its loss
    function records each micro-batch's loss and the family's counts of what it receives
    (`family.pipeline_evaluation_counts`), and the last stage sends the sums to the other stages."""
    weights: list[BatchWeight] = []
    losses: list[torch.Tensor] = []
    per_batch: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []

    def read() -> Iterator[Batch]:
        for batch, weight in batches:
            weights.append(weight)
            yield batch

    with _recording_last_stage(engine.module, family, losses, per_batch):
        engine.eval_batch(pipeline_inputs(engine, read()), num_micro_batches=len(batches))
    device = next(engine.module.parameters()).device
    sums = {_LOSS_SUM: torch.zeros((), dtype=torch.float64, device=device),
            _TARGETS: torch.zeros((), dtype=torch.float64, device=device)}
    if losses:  # the last stage
        targets = torch.tensor([weight.targets for weight in weights], dtype=torch.float64, device=device)
        sums = {_LOSS_SUM: (torch.stack(losses).double() * targets).sum(), _TARGETS: targets.sum(),
                **_summed(per_batch, weights)}
    received = _from_last_stage(sums, device)
    metrics = token_weighted_loss(received.pop(_LOSS_SUM), float(received.pop(_TARGETS)))
    if family.pipeline_evaluation_counts is not None:
        metrics.update(_data_parallel_metrics(received, family))
    return metrics


# beside the family's counts in what the last pipeline stage sends
_LOSS_SUM, _TARGETS = "weighted_loss_sum", "loss_targets"


def token_weighted_loss(loss_sum: torch.Tensor, targets: float) -> dict[str, float]:
    """val_loss: this rank's sum of micro-batch loss x the loss targets it counts, summed over the
    replica group (DP x CP) and divided by their targets: the mean over every target token evaluated,
    whichever ranks and micro-batches held them (each micro-batch loss is the mean over its targets; a
    loss with other terms, BERT's sentence order or ELECTRA's discriminator, is weighted by the same
    targets). Under context parallelism each rank's loss is its share of the replica's (data_parallel_mean) and
    every CP rank counts the same targets, so the ratio is exact. val_tokens: the targets, each once."""
    totals = torch.stack([loss_sum.double(), torch.tensor(targets, dtype=torch.float64, device=loss_sum.device)])
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    loss_sum, targets = (float(total) for total in totals)
    return {"val_loss": loss_sum / targets if targets else math.nan,
            "val_tokens": round(targets / parallel_state.get_context_parallel_world_size())}


@contextlib.contextmanager
def _recording_last_stage(
    pipeline: Any, family: ModelFamily, losses: list[torch.Tensor],
    per_batch: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
) -> Iterator[None]:
    """While it lasts, the pipeline's loss function (called by DeepSpeed on the last stage with each
    micro-batch's outputs and labels) also appends the loss to `losses` and, if the family has its own
    metrics, its counts of them to `per_batch`."""
    loss_fn = pipeline.loss_fn

    def recording_loss(outputs: Any, labels: Any) -> torch.Tensor:
        if family.pipeline_evaluation_counts is not None:
            per_batch.append(family.pipeline_evaluation_counts(_as_tuple(outputs), _as_tuple(labels)))
        loss = loss_fn(outputs, labels)
        losses.append(loss.detach().float())
        return loss

    pipeline.loss_fn = recording_loss
    try:
        yield
    finally:
        pipeline.loss_fn = loss_fn


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _summed(
    per_batch: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], weights: list[BatchWeight]
) -> dict[str, torch.Tensor]:
    """Each metric's (numerator, denominator) summed over this rank's micro-batches, each batch's
    scaled by the share of its rows that count."""
    return {name: torch.stack([torch.stack(counts[name]).double() * weight.share
                               for counts, weight in zip(per_batch, weights, strict=True)]).sum(dim=0)
            for name in (per_batch[0] if per_batch else ())}


def _from_last_stage(counts: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The last pipeline stage's counts on every stage of its pipeline (the others have none)."""
    message = [{name: value.tolist() for name, value in counts.items()}]
    dist.broadcast_object_list(message, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return {name: torch.tensor(value, dtype=torch.float64, device=device) for name, value in message[0].items()}


def _data_parallel_metrics(counts: dict[str, torch.Tensor], family: ModelFamily) -> dict[str, float]:
    """Each metric from its counts summed over data-parallel ranks: numerator / denominator, or the
    family's own `evaluation_values`."""
    for value in counts.values():
        dist.all_reduce(value, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if family.evaluation_values is not None:
        return family.evaluation_values(counts)
    return {name: float(value[0] / value[1]) for name, value in counts.items()}


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch keys are the model's forward arguments, but for the loader's bookkeeping."""
    return {key: value for key, value in batch.items() if key != GLOBAL_INDEX}


def is_pipeline(engine: Any) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def pipeline_inputs(engine: Any, batches: Iterator[dict[str, torch.Tensor]]) -> Iterator[tuple]:
    """DeepSpeed's pipeline feeds `inputs` to the first stage and `labels` to the loss on the last;
    the family's batch schema, held by the pipelined model, says which batch keys are which."""
    for batch in batches:
        yield engine.module.split_batch(batch)


def _with_grad_norm(engine: Any, record: dict[str, float]) -> dict[str, float]:
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    return record


def data_parallel_mean(value: torch.Tensor) -> float:
    """The mean over the ranks holding the same weights (DP x CP): under context parallelism each rank's
    loss is its share of its replica's mean, scaled so that this average is exact."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    value = value.clone()
    dist.all_reduce(value, group=group)
    return float(value) / dist.get_world_size(group)
