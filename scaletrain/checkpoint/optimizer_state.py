"""One parameter's training state, whatever optimizer DeepSpeed wrapped around ours.

A layout-free checkpoint (checkpoint/layout_free.py) stores, for every parameter, the fp32 master
weight and Adam's two moments at the parameter's full shape (over data parallelism; tensor
parallelism is this rank's shard, merged by the caller). Where they live depends on the layout:

    ZeRO-1/2 (fp32 or bf16),     a fragment of a flat fp32 partition per rank: DeepSpeed's public
    bf16 pipelines (BF16_Optimizer)  `safe_get_full_*` / `safe_set_full_*` (deepspeed.utils), which
    ZeRO-3                       all-reduce or all-gather over the data-parallel group
    ZeRO-0, no pipeline, no EP   scaletrain's FlatAdamW (train/flat_adamw.py): views of its flat fp32
    (fp32 or bf16)               master weights and moments
    fp32, ZeRO-0, expert parallel  the model's parameter and torch AdamW's state for it

Every function here is collective over the data-parallel group under ZeRO: all its ranks call it for
the same parameters in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)
from torch import nn

from scaletrain import upstream
from scaletrain.checkpoint.integrity import ADAM_MOMENTS

STATE_KEYS = ("weight", *ADAM_MOMENTS)  # what a layout-free checkpoint keeps per parameter


def _uses_fragment_api(parameter: nn.Parameter) -> bool:
    return hasattr(parameter, "ds_id") or hasattr(parameter, "_hp_mapping")


def is_partitioned(parameter: nn.Parameter) -> bool:
    """Whether the data-parallel ranks each hold a part of the parameter's fp32 state (ZeRO-1/2/3,
    DeepSpeed's bf16 pipeline optimizer) rather than all of it."""
    return _uses_fragment_api(parameter)


def read_local_part(parameter: nn.Parameter) -> tuple[int, dict[str, torch.Tensor]] | None:
    """This rank's part of a partitioned parameter's {weight, exp_avg, exp_avg_sq}, flat fp32, with its
    offset in the flattened (tensor-parallel shard of the) parameter; None when it holds none. No
    collective: each rank saves its own part (ZeRO-3 through DeepSpeed's public safe_get_local_*)."""
    if not hasattr(parameter, "ds_id"):
        return upstream.zero_fragment(parameter)
    start, length = upstream.zero3_partition_range(parameter)
    if length == 0:
        return None
    state = {"weight": safe_get_local_fp32_param(parameter),
             **{key: safe_get_local_optimizer_state(parameter, key) for key in ADAM_MOMENTS}}
    return start, {key: tensor.reshape(-1)[:length] for key, tensor in state.items()}


def inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer that holds Adam's state (DeepSpeed's wrappers keep it as `.optimizer`)."""
    optimizer = engine.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def read_parameter_state(engine: Any, parameter: nn.Parameter) -> dict[str, torch.Tensor]:
    """{weight, exp_avg, exp_avg_sq} of `parameter` in fp32 at its (tensor-parallel shard) shape; a
    moment the optimizer has not created yet (before the first step) reads as zeros."""
    if _uses_fragment_api(parameter):
        state = {"weight": safe_get_full_fp32_param(parameter)}
        for key in ADAM_MOMENTS:
            moment = safe_get_full_optimizer_state(parameter, key) if _has_state(engine) else None
            state[key] = moment if moment is not None else torch.zeros_like(state["weight"])
        return {key: value.reshape(parameter.ds_shape if hasattr(parameter, "ds_id") else parameter.shape)
                for key, value in state.items()}
    if _keeps_flat_state(engine):
        return engine.optimizer.parameter_state(parameter)  # views: the caller copies what it keeps
    optimizer_state = _plain_optimizer(engine).state.get(parameter, {})
    return {"weight": parameter.detach().float(),
            **{key: optimizer_state.get(key, torch.zeros_like(parameter, dtype=torch.float32)) for key in ADAM_MOMENTS}}


def write_parameter_state(engine: Any, parameter: nn.Parameter, state: dict[str, torch.Tensor]) -> None:
    """Set `parameter`'s fp32 master, its working copy (bf16 under bf16) and both moments from `state`
    (its shard shape); prepare_optimizer_state must have run first."""
    with torch.no_grad():
        if hasattr(parameter, "ds_id"):
            # ZeRO-3: this rank's partition. DeepSpeed's safe_set_full_* (0.19.8 set_full_hp_param) narrow
            # [r*n, (r+1)*n) out of the unpadded value, past its end on the last rank whenever the ranks do
            # not divide the parameter's size (ELECTRA's 1-element discriminator bias on 2 ranks).
            safe_set_local_fp32_param(parameter, _local_partition(parameter, state["weight"]))
            for key in ADAM_MOMENTS:
                safe_set_local_optimizer_state(parameter, _local_partition(parameter, state[key]), key)
            upstream.set_working_weight(parameter, state["weight"])
            return
        if _uses_fragment_api(parameter):
            device = _device_of(parameter)
            safe_set_full_fp32_param(parameter, state["weight"].to(device))
            for key in ADAM_MOMENTS:
                safe_set_full_optimizer_state(parameter, state[key].to(device), key)
            upstream.set_working_weight(parameter, state["weight"])
            return
        if _keeps_flat_state(engine):
            for key, view in engine.optimizer.parameter_state(parameter).items():
                view.copy_(state[key])
            parameter.copy_(state["weight"].to(parameter.dtype))
            return
        parameter.copy_(state["weight"].to(parameter.dtype))
        optimizer_state = _plain_optimizer(engine).state[parameter]
        for key in ADAM_MOMENTS:
            optimizer_state[key] = state[key].to(parameter.device, torch.float32).clone()


def _keeps_flat_state(engine: Any) -> bool:
    """Whether the engine steps scaletrain's FlatAdamW (train/flat_adamw.py; the train package sits above
    this one), which hands out views of a parameter's master weight and moments."""
    return hasattr(engine.optimizer, "parameter_state")


def _local_partition(parameter: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO-3 partition of `full` (the parameter's shape), zero padded as DeepSpeed pads it."""
    start, length = upstream.zero3_partition_range(parameter)
    partition = torch.zeros(parameter.ds_tensor.numel(), dtype=torch.float32, device=_device_of(parameter))
    partition[:length] = full.reshape(-1)[start:start + length].to(partition.device, torch.float32)
    return partition


def _plain_optimizer(engine: Any) -> torch.optim.Optimizer:
    """fp32 without ZeRO: DeepSpeed steps our AdamW itself, keyed by the model's parameters."""
    if not isinstance(engine.optimizer, torch.optim.Optimizer):
        raise RuntimeError(f"DeepSpeed wrapped the optimizer in {type(engine.optimizer).__name__}, which scaletrain "
                           "does not know how to checkpoint (see scaletrain/upstream.py)")
    return engine.optimizer


def _device_of(parameter: nn.Parameter) -> torch.device:
    return parameter.ds_tensor.device if hasattr(parameter, "ds_tensor") else parameter.device


def _has_state(engine: Any) -> bool:
    return bool(inner_optimizer(engine).state)


def adam_step(engine: Any) -> int:
    """How many updates Adam has made (its bias correction depends on it); 0 before the first."""
    for state in inner_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def prepare_optimizer_state(engine: Any, step: int) -> None:
    """Give a fresh engine's optimizer Adam state to load into (torch creates it at the first step;
    DeepSpeed links each parameter's fragment to it then), with Adam's step count `step`."""
    optimizer = inner_optimizer(engine)
    on_device = False
    for group in optimizer.param_groups:
        group["step"] = step  # apex's FusedAdam counts steps per group, torch's AdamW per parameter
        on_device = on_device or bool(group.get("fused") or group.get("capturable"))
    for owner in upstream.adam_state_owners(engine.optimizer):
        state = optimizer.state[owner]
        for key in ADAM_MOMENTS:
            state.setdefault(key, torch.zeros_like(owner, dtype=torch.float32))
        state["step"] = torch.tensor(float(step), dtype=torch.float32, device=owner.device if on_device else "cpu")
    upstream.link_fragments_to_optimizer_state(engine.optimizer)


def link_optimizer_state(engine: Any) -> None:
    """Before reading a trained engine's state: make every parameter's fragment point at its moments."""
    if _has_state(engine):
        upstream.link_fragments_to_optimizer_state(engine.optimizer)
