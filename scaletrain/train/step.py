"""One optimizer step: micro-batches, backward, DeepSpeed's boundary step, and the step's metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from scaletrain.batch import GLOBAL_INDEX
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


def evaluation_metrics(
    engine: Any, batches: list[dict[str, torch.Tensor]], family: ModelFamily
) -> dict[str, float]:
    """An engine's validation metrics over this rank's micro-batches (model_evaluation_metrics, or
    pipeline_evaluation_metrics): val_loss and the family's own, the same in every layout."""
    if is_pipeline(engine):
        return pipeline_evaluation_metrics(engine, batches, family)
    engine.eval()
    metrics = model_evaluation_metrics(engine, engine.module, batches, family)
    engine.train()
    return metrics


def model_evaluation_metrics(
    forward: Callable[..., torch.Tensor], module: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
    family: ModelFamily,
) -> dict[str, float]:
    """Validation loss over this rank's micro-batches, averaged over data-parallel ranks, plus the
    family's own metrics (e.g. BERT's masked-token accuracy) from counts summed over batches and ranks.
    `forward` returns a batch's loss (a DeepSpeed engine, or the model itself in `scaletrain eval`);
    `module` is the model whose outputs the family counts."""
    with torch.no_grad():
        losses = [forward(**model_inputs(batch)).float() for batch in batches]
        metrics = {"val_loss": data_parallel_mean(torch.stack(losses).mean())}
        if family.evaluation_counts is not None:
            counts = _summed([family.evaluation_counts(module, model_inputs(batch)) for batch in batches])
            metrics.update(_data_parallel_metrics(counts, family))
    return metrics


def pipeline_evaluation_metrics(
    engine: Any, batches: list[dict[str, torch.Tensor]], family: ModelFamily
) -> dict[str, float]:
    """The pipeline's validation loss (DeepSpeed's eval_batch), plus the family's own metrics: only the
    last stage holds the model's outputs, so it counts them from what its loss function receives
    (`family.pipeline_evaluation_counts`) and sends the counts to the other stages."""
    per_batch: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    with _counting_last_stage_outputs(engine.module, family, per_batch):
        loss = engine.eval_batch(pipeline_inputs(engine, iter(batches)), num_micro_batches=len(batches))
    metrics = {"val_loss": data_parallel_mean(loss.detach().float())}
    if family.pipeline_evaluation_counts is not None:
        metrics.update(_data_parallel_metrics(_from_last_stage(_summed(per_batch), loss.device), family))
    return metrics


@contextlib.contextmanager
def _counting_last_stage_outputs(
    pipeline: Any, family: ModelFamily, per_batch: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
) -> Iterator[None]:
    """While it lasts, the pipeline's loss function (called by DeepSpeed on the last stage with each
    micro-batch's outputs and labels) also appends the family's counts of them to `per_batch`."""
    if family.pipeline_evaluation_counts is None:
        yield
        return
    loss_fn = pipeline.loss_fn

    def counting_loss(outputs: Any, labels: Any) -> torch.Tensor:
        per_batch.append(family.pipeline_evaluation_counts(_as_tuple(outputs), _as_tuple(labels)))
        return loss_fn(outputs, labels)

    pipeline.loss_fn = counting_loss
    try:
        yield
    finally:
        pipeline.loss_fn = loss_fn


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _summed(per_batch: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Each metric's (numerator, denominator) summed over this rank's micro-batches."""
    return {name: torch.stack([torch.stack(counts[name]) for counts in per_batch]).sum(dim=0).double()
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
