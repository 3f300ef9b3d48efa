"""Every use of a private DeepSpeed or megatron-core API, in one place.

Each function says what it reaches into, why no public API does the job, and the versions it was
checked on; tests/test_upstream_contracts.py fails when one of these targets disappears or stops
being used by DeepSpeed the way we rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def bf16_ddp_master_views(optimizer: Any, parameter: nn.Parameter) -> Callable[[str], torch.Tensor] | None:
    """Under bf16 without ZeRO or pipeline, DeepSpeed wraps our AdamW in FP16_UnfusedOptimizer (in bf16
    mode: engine._do_optimizer_sanity_check's DDP_BFLOAT16; FP16_Optimizer when the optimizer is a
    fused one DeepSpeed knows). Their fp32 master weights are `fp32_groups[i][j]` (one per parameter of
    `fp16_groups[i][j]`) or one flat `fp32_groups_flat[i]` per group, and Adam's state is keyed by them.
    Neither has `_hp_mapping`, so deepspeed.utils' safe_get_full_* return None. Returns key -> this
    parameter's view ("weight", "exp_avg", "exp_avg_sq"), or None for any other optimizer. Checked on
    deepspeed 0.19.8 (runtime/fp16/unfused_optimizer.py, fused_optimizer.py)."""
    if not hasattr(optimizer, "fp16_groups"):
        return None
    places = getattr(optimizer, "_scaletrain_places", None)
    if places is None:
        places = {}
        for group, parameters in enumerate(optimizer.fp16_groups):
            offset = 0
            for index, member in enumerate(parameters):
                places[id(member)] = (group, index, offset)
                offset += member.numel()
        optimizer._scaletrain_places = places
    group, index, offset = places[id(parameter)]
    if hasattr(optimizer, "fp32_groups_flat"):
        master = optimizer.fp32_groups_flat[group]
        cut = (lambda tensor: tensor.narrow(0, offset, parameter.numel()).view(parameter.shape))
    else:
        master = optimizer.fp32_groups[group][index]
        cut = (lambda tensor: tensor.view(parameter.shape))

    def view(key: str) -> torch.Tensor:
        if key == "weight":
            return cut(master)
        state = optimizer.optimizer.state[master]
        if key not in state:  # before the first step
            state[key] = torch.zeros_like(master, dtype=torch.float32)
        return cut(state[key])

    return view


def set_working_weight(parameter: nn.Parameter, weight: torch.Tensor) -> None:
    """The copy the forward pass uses (bf16 under bf16) from the fp32 master `weight`. DeepSpeed's
    safe_set_full_fp32_param sets the master only. Under ZeRO-3 the working copy is this rank's flat
    partition `ds_tensor` (rank r holds elements [r*n, (r+1)*n) of the flattened parameter, zero
    padded at the end: zero/partition_parameters.py); elsewhere the parameter itself. Checked on
    deepspeed 0.19.8."""
    with torch.no_grad():
        if not hasattr(parameter, "ds_tensor"):
            parameter.copy_(weight.to(parameter.device, parameter.dtype))
            return
        partition = parameter.ds_tensor
        size = partition.numel()
        rank = dist.get_rank(group=parameter.ds_process_group)
        flat = weight.reshape(-1)
        padded = torch.zeros(size * dist.get_world_size(group=parameter.ds_process_group), dtype=flat.dtype)
        padded[:flat.numel()] = flat
        partition.copy_(padded.narrow(0, rank * size, size).to(partition.device, partition.dtype))


# Where each of DeepSpeed's optimizer wrappers keeps the flat fp32 tensors that Adam's state is keyed
# by (deepspeed 0.19.8): ZeRO-3, ZeRO-1/2, BF16_Optimizer, FP16_Optimizer (also in bf16 mode).
_MASTER_FLATS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition",
                 "fp32_groups_flat", "fp32_groups")


def adam_state_owners(optimizer: Any) -> list[torch.Tensor]:
    """The tensors whose entries in the torch optimizer's `state` hold Adam's moments: our AdamW's own
    parameters, or a DeepSpeed wrapper's flat fp32 master partitions. The wrappers put those into the
    torch optimizer's param_groups only while they step (ZeRO-1/2 one group at a time, ZeRO-3 one
    sub-group at a time), so param_groups cannot say. Checked on deepspeed 0.19.8."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for attribute in _MASTER_FLATS:
        flats = getattr(optimizer, attribute, None)
        if flats is not None:
            return [tensor for entry in flats for tensor in (entry if isinstance(entry, list) else [entry])]
    raise RuntimeError(f"{type(optimizer).__name__}: none of {_MASTER_FLATS} found; scaletrain knows DeepSpeed "
                       "0.19's optimizer wrappers only")


def link_fragments_to_optimizer_state(optimizer: Any) -> None:
    """ZeRO-1/2 and BF16_Optimizer point each parameter's `_hp_mapping.optim_fragment` into Adam's state
    (`_lazy_init_hp_params_optimizer_state`), which deepspeed.utils' safe_get/set_full_optimizer_state
    go through. They link once, after the first step of the first parameter group, when the second
    group has no state yet (ZeRO-1/2 step one group at a time), so its parameters' fragments stay
    empty; and a resume before the first step has nothing linked. Relink now that every group has
    state. No public call does it. Checked on deepspeed 0.19.8 (zero/stage_1_and_2.py, bf16_optimizer.py)."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        optimizer._hp_optimizer_states_linked = False
        link()
