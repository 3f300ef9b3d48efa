"""Split and merge tensor-parallel shards using megatron's per-parameter partition attributes.

megatron-core marks each sharded parameter with `partition_dim` and `partition_stride`: the
master weight is cut into `stride * world` chunks along that dim and rank r keeps chunks
r, r + world, ... (see `_initialize_affine_weight_cpu`). These helpers invert and redo that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def gather_last_dim(local: torch.Tensor) -> torch.Tensor:
    """Every TP rank's shard [..., n / TP] concatenated in rank order along the last dim (vocabulary
    shards of logits, heads of T5's position bias). On CPU too: megatron's own gather allocates on
    CUDA. No autograd: callers that need a backward wrap it."""
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    if world_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def merge_shards(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    world = len(shards)
    chunks_per_shard = [torch.chunk(shard, stride, dim=dim) for shard in shards]
    ordered = [chunks_per_shard[rank][index] for index in range(stride) for rank in range(world)]
    return torch.cat(ordered, dim=dim)


def split_for_rank(full: torch.Tensor, dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    chunks = torch.chunk(full, stride * world, dim=dim)
    return torch.cat(chunks[rank::world], dim=dim).clone()
