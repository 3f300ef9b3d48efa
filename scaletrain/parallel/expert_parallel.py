"""Expert parallelism: a MoE layer's experts split over data-parallel ranks, which exchange tokens.

Each rank of an expert-parallel group of size P holds E/P of a layer's E experts: rank r the experts
r·E/P .. (r+1)·E/P - 1. A rank routes its own tokens, then one all-to-all sends every kept
assignment to the rank holding its expert and a second brings the expert outputs back (GShard,
Lepikhin et al. 2021, sec. 3.2; DeepSpeed-MoE, Rajbhandari et al. 2022; Megatron-core's
MoEAlltoAllTokenDispatcher). Backward runs the same two exchanges the other way round.

The group is megatron's expert-model-parallel group: data-parallel ranks k·P .. k·P+P-1 of one
tensor-parallel rank and pipeline stage, the same ranks DeepSpeed's `ep_size_P` groups hold
(upstream.expert_parallel_engine hands these very groups to DeepSpeed). The ranks holding the same experts
form the expert-data-parallel group, over which the experts' gradients are averaged.

gloo has `all_to_all_single` with uneven splits (torch 2.13), so CPU and GPU run the same exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from scaletrain.parallel.sharding import is_tensor_parallel


@dataclass(frozen=True)
class ExpertParallelGroup:
    """This rank's expert-parallel group: its size, this rank's place in it, and the process group
    (None for a group of one, where the exchanges are the identity)."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    def local_experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def expert_parallel_group() -> ExpertParallelGroup:
    """Megatron's expert-model-parallel group, or a group of one when there is none (a model built
    outside a run, or parallel.expert=1)."""
    if not parallel_state.model_parallel_is_initialized():
        return ExpertParallelGroup()
    size = parallel_state.get_expert_model_parallel_world_size()
    if size == 1:
        return ExpertParallelGroup()
    return ExpertParallelGroup(size, parallel_state.get_expert_model_parallel_rank(),
                               parallel_state.get_expert_model_parallel_group())


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send_counts), ...] out, rows [sum(receive_counts), ...] in; backward sends the
    gradient back along the same routes."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_counts: list[int], receive_counts: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send_counts, ctx.receive_counts, ctx.group = send_counts, receive_counts, group
        return _exchange(rows, send_counts, receive_counts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.receive_counts, ctx.send_counts, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send_counts: list[int], receive_counts: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    received = rows.new_empty((sum(receive_counts), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), receive_counts, send_counts, group=group)
    return received


def all_to_all(rows: torch.Tensor, send_counts: list[int], receive_counts: list[int],
               group: ExpertParallelGroup) -> torch.Tensor:
    """Send rows[sum(send_counts[:i]) : ...] to rank i of the group; the received rows in rank order."""
    if group.size == 1:
        return rows
    return _AllToAll.apply(rows, send_counts, receive_counts, group.group)


def exchange_counts(per_expert: torch.Tensor, group: ExpertParallelGroup) -> torch.Tensor:
    """Every rank's assignment counts to this rank's experts: [P sources, E/P local experts] from this
    rank's counts per global expert [E] (int64)."""
    outgoing = per_expert.reshape(group.size, -1)
    if group.size == 1:
        return outgoing
    incoming = torch.empty_like(outgoing)
    dist.all_to_all_single(incoming, outgoing.contiguous(), group=group.group)
    return incoming


def is_expert_parameter(parameter: torch.Tensor) -> bool:
    """A parameter that expert parallelism splits: megatron's mark (`allreduce = False`, as its MoE
    layers set on experts when the expert-parallel size exceeds 1)."""
    return not getattr(parameter, "allreduce", True)


def mark_expert_parameters(module: torch.nn.Module) -> None:
    for parameter in module.parameters():
        parameter.allreduce = False


def global_gradient_norm(parameters: list[torch.nn.Parameter], expert_group: ExpertParallelGroup) -> torch.Tensor:
    """The 2-norm of the whole model's gradient when experts are split over `expert_group`: the dense
    parameters' squared norm (the same on every rank of the group) plus every rank's experts' squared
    norms, each tensor-parallel piece counted once (a replicated parameter on tensor rank 0 only)."""
    tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    dense, experts = [], []
    for parameter in parameters:
        if parameter.grad is None or not (is_tensor_parallel(parameter) or tensor_rank == 0):
            continue
        (experts if is_expert_parameter(parameter) else dense).append(parameter.grad.detach().float())
    device = parameters[0].device
    dense_squares = sum((grad.square().sum() for grad in dense), torch.zeros((), device=device))
    expert_squares = sum((grad.square().sum() for grad in experts), torch.zeros((), device=device))
    if expert_group.size > 1:
        dist.all_reduce(expert_squares, group=expert_group.group)
    total = dense_squares + expert_squares
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    return total.sqrt()
