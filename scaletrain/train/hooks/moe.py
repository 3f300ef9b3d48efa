"""Mixture-of-experts routing metrics in each step's record: per MoE layer, each expert's share of the
assignments, the share dropped at capacity, and the auxiliary losses (model/moe.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from scaletrain.model.moe import MoELayer, moe_layers_of
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.state import TrainState


class ExpertStatistics(Hook):
    """Adds to the step's record, summed over every rank's micro-batches of the step:

        moe/aux_loss, moe/z_loss, moe/dropped_fraction       over all MoE layers
        moe/blocks.L/aux_loss, .../z_loss, .../dropped_fraction
        moe/blocks.L/load_E                                   expert E's share of layer L's assignments

    Loads are shares of the k·T assignments the router made (before capacity), so a balanced layer
    has 1/E everywhere. Each MoE layer lives on one pipeline stage and is replicated over tensor-
    parallel ranks (which route alike): tensor-parallel rank 0 of every stage and data-parallel
    replica contributes its layers' sums, and one all-reduce over the world adds them up.
    """

    order = 20  # the routing fields join the record before it is logged

    @classmethod
    def from_run(cls, run: TrainingRun) -> ExpertStatistics | None:
        return cls.for_model(run.engine.module, run.topology.device)  # None without MoE layers

    def __init__(self, local: dict[int, MoELayer], layers: list[int], num_experts: int, device: torch.device) -> None:
        self._local, self._layers, self._num_experts, self._device = local, layers, num_experts, device

    @classmethod
    def for_model(cls, model: nn.Module, device: torch.device) -> ExpertStatistics | None:
        """The hook if any rank holds a MoE layer, else None. Every rank asks (a collective): each names its
        layers (a pipeline stage holds its own), so all agree on the rows of the step's all-reduce."""
        local = {layer.layer_index: layer for layer in moe_layers_of(model)}
        experts = next(iter(local.values())).moe.num_experts if local else 0
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (sorted(local), experts))
        layers = sorted({index for indices, _ in everyone for index in indices})
        return cls(local, layers, max(experts for _, experts in everyone), device) if layers else None

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        sums = torch.zeros(len(self._layers), self._num_experts + 4, dtype=torch.float64, device=self._device)
        counts_here = parallel_state.get_tensor_model_parallel_rank() == 0
        for row, index in enumerate(self._layers):
            if index in self._local:
                taken = self._local[index].statistics.take(self._device)  # every rank resets its sums
                if counts_here:
                    sums[row] = taken
        dist.all_reduce(sums)
        record.update(routing_metrics(sums, self._layers))


def routing_metrics(sums: torch.Tensor, layers: list[int]) -> dict[str, float]:
    """The record's moe/ fields from per-layer rows [aux_loss, z_loss, assigned per expert..., dropped,
    forwards] (model/moe.py RoutingStatistics), summed over ranks."""
    metrics: dict[str, float] = {}
    forwards, assigned, dropped = sums[:, -1], sums[:, 2:-2], sums[:, -2]
    trained = forwards > 0
    if not trained.any():  # a step every micro-batch of which was skipped has nothing to report
        return metrics
    for row, layer in enumerate(layers):
        if not trained[row]:
            continue
        prefix = f"moe/blocks.{layer}/"
        total = assigned[row].sum()
        metrics[prefix + "aux_loss"] = float(sums[row, 0] / forwards[row])
        metrics[prefix + "z_loss"] = float(sums[row, 1] / forwards[row])
        metrics[prefix + "dropped_fraction"] = float(dropped[row] / total)
        for expert, count in enumerate(assigned[row].tolist()):
            metrics[prefix + f"load_{expert}"] = count / float(total)
    metrics["moe/aux_loss"] = float((sums[trained, 0] / forwards[trained]).mean())
    metrics["moe/z_loss"] = float((sums[trained, 1] / forwards[trained]).mean())
    metrics["moe/dropped_fraction"] = float(dropped[trained].sum() / assigned[trained].sum())
    return metrics
