"""One optimizer step: micro-batches, backward, DeepSpeed's boundary step, and the step's metrics."""

from __future__ import annotations

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
    """An engine's validation metrics over this rank's micro-batches (model_evaluation_metrics);
    a pipeline reports the loss alone, the only number its last stage returns."""
    if is_pipeline(engine):
        loss = engine.eval_batch(pipeline_inputs(engine, iter(batches)), num_micro_batches=len(batches))
        return {"val_loss": data_parallel_mean(loss.detach().float())}
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
            per_batch = [family.evaluation_counts(module, model_inputs(batch)) for batch in batches]
            for name in per_batch[0] if per_batch else ():
                counts = torch.stack([torch.stack(counts[name]) for counts in per_batch]).sum(dim=0).double()
                dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
                metrics[name] = float(counts[0] / counts[1])
    return metrics


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
    group = parallel_state.get_data_parallel_group()
    value = value.clone()
    dist.all_reduce(value, group=group)
    return float(value) / dist.get_world_size(group)
