"""Split and merge tensor-parallel shards using megatron's per-parameter partition attributes.

megatron-core marks each sharded parameter with `partition_dim` and `partition_stride`: the
master weight is cut into `stride * world` chunks along that dim and rank r keeps chunks
r, r + world, ... (see `_initialize_affine_weight_cpu`). These helpers invert and redo that.
"""

from __future__ import annotations

import torch


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
