"""DeepSpeed engine setup: the ZeRO/precision config, AdamW groups and the LR schedule, around a model that
train/parallelize.py has parallelised for the layout."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from megatron.core import parallel_state
from torch import nn

from scaletrain import upstream
from scaletrain.config import Config
from scaletrain.model.moe import MoELayer
from scaletrain.notices import OP_BUILT, without_stdout_lines
from scaletrain.parallel.expert_parallel import (
    ExpertParallelGroup,
    expert_parallel_group,
    global_gradient_norm,
    is_expert_parameter,
)
from scaletrain.parallel.groups import Topology, resolve_precision
from scaletrain.parallel.mpu import MegatronMPU
from scaletrain.parallel.sharding import is_tensor_parallel
from scaletrain.train.compile import compile_blocks
from scaletrain.train.flat_adamw import FlatAdamW


def deepspeed_config(config: Config, precision: str, flat_optimizer: bool = False) -> dict[str, Any]:
    """DeepSpeed's settings. With `flat_optimizer` (FlatAdamW) DeepSpeed sees an fp32 run without
    clipping: the optimizer holds the mixed precision, clips and reduces itself."""
    return {
        "train_micro_batch_size_per_gpu": config.train.micro_batch_size,
        "gradient_accumulation_steps": config.train.grad_accum,
        "gradient_clipping": 0.0 if flat_optimizer else config.train.grad_clip,
        "zero_optimization": {"stage": config.parallel.zero_stage},
        # Our optimizer is torch's fused AdamW; DeepSpeed only wraps it for ZeRO.
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16" and not flat_optimizer},
        "steps_per_print": 1 << 62,
        "wall_clock_breakdown": False,
    }


def build_optimizer(model: nn.Module, config: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with decay on matrices only; biases and LayerNorm gains are not decayed (GPT-3)."""
    decayed = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    not_decayed = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"name": "decayed", "params": decayed, "weight_decay": config.train.weight_decay},
        {"name": "not_decayed", "params": not_decayed, "weight_decay": 0.0},
    ]
    if any(is_expert_parameter(parameter) for parameter in model.parameters()):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        # DeepSpeed's ZeRO partitions an expert group's state over its expert-data-parallel ranks
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    betas = (config.train.beta1, config.train.beta2)
    if device.type == "cuda":
        apex_adam = _apex_fused_adam()
        if apex_adam is not None:
            return apex_adam(groups, lr=config.train.lr, betas=betas, eps=1e-8, adam_w_mode=True)
    # torch's fused AdamW (one kernel over all tensors; on CPU since torch 2.4) rather than its
    # default per-tensor loop, which CPU tensors otherwise get.
    return torch.optim.AdamW(groups, lr=config.train.lr, betas=betas, eps=1e-8, fused=True)


def uses_flat_optimizer(config: Config, topology: Topology, expert_parallel_size: int) -> bool:
    """Whether the layout steps FlatAdamW rather than DeepSpeed's optimizer wrappers: without ZeRO (as
    resolved for the world size: one data-parallel rank always), pipeline stages or split experts.
    ZeRO partitions its own flat buffers; the pipeline engine and expert parallelism reduce gradients
    through DeepSpeed's own groups."""
    return (config.parallel.zero_stage == 0 and topology.pipeline_parallel_size == 1
            and expert_parallel_size == 1)


def build_flat_optimizer(model: nn.Module, config: Config, precision: str) -> FlatAdamW:
    """FlatAdamW over the model's trainable parameters, whose storage it takes over (working weights in
    bf16 under bf16); frozen parameters are cast as DeepSpeed's bf16 mode casts them."""
    working_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for parameter in model.parameters():
        if not parameter.requires_grad:
            parameter.data = parameter.data.to(working_dtype)
    return FlatAdamW(
        [parameter for parameter in model.parameters() if parameter.requires_grad],
        lr=config.train.lr, betas=(config.train.beta1, config.train.beta2), eps=1e-8,
        weight_decay=config.train.weight_decay, max_grad_norm=config.train.grad_clip, working_dtype=working_dtype,
        is_tensor_parallel=is_tensor_parallel, tensor_parallel_group=parallel_state.get_tensor_model_parallel_group(),
        data_parallel_group=MegatronMPU.get_data_parallel_group(),
    )


def _apex_fused_adam() -> type | None:
    """NVIDIA apex's multi-tensor FusedAdam when installed (NGC images); torch's fused AdamW otherwise."""
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


def build_engine(model: nn.Module, config: Config, topology: Topology) -> Any:
    """Wrap the model build_training_model built and parallelised for the layout (train/parallelize.py) in a
    DeepSpeed engine. There is no LR scheduler object: the loop sets each step's LR from the config
    (train/schedule.py), so a resume follows the config as written.

    Without pipeline stages DeepSpeed learns megatron's groups from the mpu adapter; with them the
    PipelineModule's topology is the grid, and DeepSpeed wants no mpu.
    """
    import deepspeed

    precision = resolve_precision(config, topology.device)
    expert_group = expert_parallel_group()
    flat = uses_flat_optimizer(config, topology, expert_group.size)
    with without_stdout_lines(OP_BUILT), _expert_parallel(model, expert_group):
        # without pipeline stages, DeepSpeed's comm layer starts (and loads its CPU op) here
        optimizer = build_flat_optimizer(model, config, precision) if flat else build_optimizer(
            model, config, topology.device)
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=deepspeed_config(config, precision, flat),
            mpu=None if topology.pipeline_parallel_size > 1 else MegatronMPU,
        )
    if config.train.compile:
        compile_blocks(model, config)  # compiled at their first call, after FlatAdamW took their storage
    if flat:
        # FlatAdamW all-reduces its one flat gradient buffer itself; DeepSpeed would find no `.grad`
        # to reduce (the accumulation hooks free them) and must not try.
        upstream.turn_off_backward_allreduce(engine)
        return engine
    # Without ZeRO or bf16 DeepSpeed clips with the global gradient norm but does not keep it; the
    # step's `grad_norm` needs it.
    upstream.keep_clipping_norm(
        engine, None if expert_group.size == 1 else functools.partial(global_gradient_norm, expert_group=expert_group))
    return engine


def _expert_parallel(model: nn.Module, group: ExpertParallelGroup) -> contextlib.AbstractContextManager:
    """DeepSpeed set up to average split experts' gradients over their own ranks (upstream.py)."""
    if group.size == 1:
        return contextlib.nullcontext()
    experts = [parameter for parameter in model.parameters() if is_expert_parameter(parameter)]
    expert_data_group = parallel_state.get_expert_data_parallel_group()
    return upstream.expert_parallel_engine(experts, MoELayer, group.group, expert_data_group, group.size)
