"""Resume a checkpoint in another parallel layout: weights and Adam state regathered by parameter name.

DeepSpeed's own loader only reads a checkpoint into the layout that wrote it. Here the old files are
read offline into a layout-free state (for every parameter of the plain, unpipelined model: the full
fp32 master weight, Adam's exp_avg and exp_avg_sq, and Adam's step count), which is then cut for
the new layout and written into the freshly built engine. Source formats (DeepSpeed 0.19, fp32):
  ZeRO-1/2   zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt: per param group one flat fp32
             partition and flat exp_avg/exp_avg_sq; the parameters lie in the order of the
             model-states file's `param_shapes`, padding at the group's end (as in
             deepspeed/utils/zero_to_fp32.py). With pipeline stages mp = stage x TP + tensor rank.
  ZeRO-0     mp_rank_{tp:02d}_model_states.pt: the weights (`module`) and the torch optimizer's
             state dict, parameters by index in engine.build_optimizer's group order.
Tensor-parallel shards are merged with megatron's partition attributes (parallel/sharding.py).
Not mapped: ZeRO-3 (parameters partitioned too), bf16 checkpoints (other file names and a
separate master copy) and pipelined ZeRO-0 sources (their files do not name the parameters).

Data order depends only on (seed, consumed_samples), so the loader needs nothing. The per-rank
dropout RNG cannot map across layouts: a resharded run reseeds it, so with dropout > 0 the masks
after the resume differ from an uninterrupted run's.

Cost at scale: every rank reads every model and optimizer file of the old checkpoint, one file at
a time (a flat ZeRO partition spans many parameters, so there is no cheaper cut), and keeps the
merged fp32 weight and both moments of its own pipeline stage's parameters: 12 bytes per parameter
of the stage, plus one source file. I/O is world-size times that of a same-layout resume. With
billions of parameters per stage that needs a large-memory node; resume there once and save.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.checkpoint.integrity import ADAM_MOMENTS as MOMENTS
from scaletrain.checkpoint.integrity import check_finite, loaded_state
from scaletrain.checkpoint.manager import (
    DEEPSPEED_TAG,
    CheckpointError,
    CheckpointMeta,
    LayoutMismatchError,
    layout_of,
    read_meta,
    translate_load_errors,
)
from scaletrain.checkpoint.safe_load import CheckedFiles
from scaletrain.config import Config
from scaletrain.parallel.groups import Topology
from scaletrain.parallel.sharding import is_tensor_parallel, merge_shards, split_for_rank

RESHARDABLE_ZERO_STAGES = (0, 1, 2)


@dataclass
class LayoutFreeState:
    """Per parameter name of the plain model: full fp32 `weight`, `exp_avg` and `exp_avg_sq`."""

    parameters: dict[str, dict[str, torch.Tensor]]
    optimizer_step: int


def describe_layout(layout: dict[str, int]) -> str:
    """`TP2xDP2 ZeRO-1`; sizes of 1 are left out (a single rank reads `TP1`)."""
    sizes = [f"{axis}{layout[key]}" for axis, key in (("TP", "tensor"), ("PP", "pipeline"), ("DP", "data"))
             if layout[key] > 1]
    return f"{'x'.join(sizes) or 'TP1'} ZeRO-{layout['zero_stage']}"


def check_reshardable(path: Path, source: dict[str, int], target: dict[str, int]) -> None:
    """Refuse, naming the layouts that can resume, a pair this module does not map."""
    into = f"resharding checkpoint {path} from {describe_layout(source)} into {describe_layout(target)}"
    if source["zero_stage"] not in RESHARDABLE_ZERO_STAGES:
        raise LayoutMismatchError(
            f"{into} is not supported: ZeRO-3 partitions the weights as well; resume it in its own layout "
            f"({describe_layout(source)}: parallel.tensor={source['tensor']}, parallel.pipeline="
            f"{source['pipeline']}, {source['data']} data-parallel ranks, parallel.zero_stage=3)"
        )
    if target["zero_stage"] not in RESHARDABLE_ZERO_STAGES:
        raise LayoutMismatchError(
            f"{into} is not supported: resume with parallel.zero_stage=0, 1 or 2 (any tensor, pipeline and "
            f"data-parallel sizes), or in the checkpoint's own layout {describe_layout(source)}"
        )
    if source["pipeline"] > 1 and source["zero_stage"] == 0:
        raise LayoutMismatchError(
            f"{into} is not supported: a pipelined ZeRO-0 checkpoint does not name its optimizer's parameters; "
            f"resume it in its own layout {describe_layout(source)}"
        )


def load_resharded(engine: Any, path: Path, meta: CheckpointMeta, config: Config, topology: Topology) -> None:
    """Load a checkpoint of another layout into `engine`: weights, Adam moments and step count. Each
    file is checked against its CRC-32 as it is read, and what this rank loaded is checked finite
    (locally: the caller agrees on a failure over all ranks)."""
    target = layout_of(config, topology)
    check_reshardable(path, meta.layout, target)
    if topology.is_logging_rank:
        print(f"resharding checkpoint {path} from {describe_layout(meta.layout)} to {describe_layout(target)}"
              + ("; dropout masks will differ from an uninterrupted run's" if config.model.dropout else ""),
              file=sys.stderr, flush=True)
    local = dict(_local_parameters(engine.module, topology))
    state = translate_load_errors(
        path, f"{DEEPSPEED_TAG}/ (for resharding)", lambda: read_layout_free_state(path, meta.layout, local)
    )
    _write_into_engine(engine, state, local, topology)
    check_finite(path, loaded_state(engine))
    engine.global_steps = meta.step
    engine.global_samples = meta.consumed_samples


def read_layout_free_state(
    path: Path, source: dict[str, int], wanted: dict[str, nn.Parameter]
) -> LayoutFreeState:
    """The full state of the `wanted` parameters (model names -> a parameter of any TP size that
    carries the partition attributes) from checkpoint `path` saved in layout `source`, each file
    checked against the CRC-32 that meta.json recorded for it."""
    checked = CheckedFiles(path, read_meta(path).files)
    per_rank, steps = [], set()
    for tensor_rank in range(source["tensor"]):
        shards: dict[str, dict[str, torch.Tensor]] = {}
        for stage in range(source["pipeline"]):
            mp_rank = stage * source["tensor"] + tensor_rank
            for name, parameter_state, step in _read_model_parallel_rank(checked, source, mp_rank):
                if name in wanted:
                    shards.setdefault(name, parameter_state)  # a tied weight: the first stage's copy
                    steps.add(step)
        per_rank.append(shards)
    missing = [name for name in wanted if name not in per_rank[0]]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no state for {missing[0]} (and {len(missing) - 1} more); "
                              "it holds a different model")
    if len(steps) != 1:
        raise CheckpointError(f"checkpoint {path}: its optimizer files disagree on Adam's step count ({steps})")
    merged = {name: _merge_tensor_ranks([shards[name] for shards in per_rank], parameter)
              for name, parameter in wanted.items()}
    return LayoutFreeState(merged, steps.pop())


def _merge_tensor_ranks(shards: list[dict[str, torch.Tensor]], parameter: nn.Parameter) -> dict[str, torch.Tensor]:
    if not is_tensor_parallel(parameter) or len(shards) == 1:
        return shards[0]
    return {key: merge_shards([shard[key] for shard in shards], parameter.partition_dim, parameter.partition_stride)
            for key in shards[0]}


def _read_model_parallel_rank(
    checked: CheckedFiles, source: dict[str, int], mp_rank: int
) -> Iterator[tuple[str, dict[str, torch.Tensor], int]]:
    """(model name, its shard's weight and moments, Adam step) for one model-parallel rank's files."""
    model_states = checked.load(checked.checkpoint / DEEPSPEED_TAG / f"mp_rank_{mp_rank:02d}_model_states.pt")
    if source["zero_stage"] == 0:
        entries = _zero0_entries(model_states)
    else:
        entries = _partitioned_entries(checked, model_states["param_shapes"], mp_rank, source["data"])
    for name, parameter_state, step in entries:
        yield name if source["pipeline"] == 1 else pipeline_to_model_name(name), parameter_state, step


def _partitioned_entries(
    checked: CheckedFiles, param_shapes: list[dict[str, Any]], mp_rank: int, data_size: int
) -> Iterator[tuple[str, dict[str, torch.Tensor], int]]:
    """ZeRO-1/2: concatenate the DP partitions of each group, then cut parameters off in order."""
    state_dir = checked.checkpoint / DEEPSPEED_TAG
    files = [state_dir / f"zero_pp_rank_{dp}_mp_rank_{mp_rank:02d}_optim_states.pt" for dp in range(data_size)]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        bf16 = any(state_dir.glob("bf16_zero_pp_rank_*"))
        raise CheckpointError(f"{state_dir} lacks {missing[0]}" + (
            "; it is a bf16 checkpoint, which resumes only in its own layout" if bf16 else ""))
    partitions = [checked.load(file)["optimizer_state_dict"] for file in files]
    step = int(partitions[0]["base_optimizer_state"]["state"][0]["step"])
    for group, shapes in enumerate(param_shapes):
        flat = {"weight": torch.cat([part["single_partition_of_fp32_groups"][group] for part in partitions])}
        for key in MOMENTS:
            flat[key] = torch.cat([part["base_optimizer_state"]["state"][group][key] for part in partitions])
        offset = 0
        for name, shape in shapes.items():
            numel = int(torch.Size(shape).numel())
            yield name, {key: tensor[offset:offset + numel].view(shape).clone() for key, tensor in flat.items()}, step
            offset += numel


def _zero0_entries(model_states: dict[str, Any]) -> Iterator[tuple[str, dict[str, torch.Tensor], int]]:
    """ZeRO-0: torch's optimizer state by index; the indices follow engine.build_optimizer's groups
    (matrices first, then vectors, each in module order), recomputed from the saved weights."""
    buffers = set(model_states.get("buffer_names") or ())
    weights = {name: value for name, value in model_states["module"].items()
               if isinstance(value, torch.Tensor) and name not in buffers}
    order = [name for name, value in weights.items() if value.dim() >= 2]
    order += [name for name, value in weights.items() if value.dim() < 2]
    optimizer_state = model_states["optimizer"]["state"]
    for index, name in enumerate(order):
        moments = optimizer_state[index]
        yield name, {"weight": weights[name].float(), **{key: moments[key] for key in MOMENTS}}, int(moments["step"])


def pipeline_to_model_name(name: str) -> str:
    """`3.blocks.2.mlp.fc.bias` or `tied_modules.embedding.embedding.word.weight` (a PipelineModule's
    names: layer index or tied key, then the layer's own names, which are the model's; see
    parallel/pipeline.py) as the plain model's name."""
    if name.startswith("tied_modules."):
        return name.removeprefix("tied_modules.").partition(".")[2]
    return name.partition(".")[2]


def _local_parameters(module: nn.Module, topology: Topology) -> Iterator[tuple[str, nn.Parameter]]:
    """This rank's parameters by model name (a pipeline stage's only; tied copies each)."""
    for name, parameter in module.named_parameters():
        if topology.pipeline_parallel_size == 1:
            yield name, parameter
            continue
        yield pipeline_to_model_name(name), parameter


def _write_into_engine(
    engine: Any, state: LayoutFreeState, local: dict[str, nn.Parameter], topology: Topology
) -> None:
    """Each parameter's TP shard into the model, the ZeRO fp32 partition and the Adam moments."""
    zero = engine.zero_optimization_stage() > 0
    if zero:
        _prime_zero_optimizer_state(engine.optimizer, state.optimizer_step)
    else:
        _set_group_steps(engine.optimizer, state.optimizer_step)
    with torch.no_grad():
        for name, parameter in local.items():
            shard = {key: _tensor_rank_slice(full, parameter, topology) for key, full in state.parameters[name].items()}
            parameter.copy_(shard["weight"])
            if zero:
                _set_zero_state(parameter, shard)
            else:
                engine.optimizer.state[parameter] = {
                    "step": _step_tensor(state.optimizer_step, parameter, engine.optimizer),
                    **{key: shard[key].to(parameter.device).clone() for key in MOMENTS},
                }


def _tensor_rank_slice(full: torch.Tensor, parameter: nn.Parameter, topology: Topology) -> torch.Tensor:
    if is_tensor_parallel(parameter) and topology.tensor_parallel_size > 1:
        full = split_for_rank(full, parameter.partition_dim, parameter.partition_stride,
                              topology.tensor_parallel_rank, topology.tensor_parallel_size)
    if full.shape != parameter.shape:
        raise CheckpointError(f"a resharded tensor has shape {tuple(full.shape)}, the model's {tuple(parameter.shape)}")
    return full


def _prime_zero_optimizer_state(zero_optimizer: Any, step: int) -> None:
    """A fresh ZeRO-1/2 optimizer has no Adam state until its first step. Create it for every flat
    fp32 partition and let DeepSpeed link each parameter's fragment to it, so that
    `safe_set_full_optimizer_state` has somewhere to write."""
    for flat in zero_optimizer.single_partition_of_fp32_groups:
        zero_optimizer.optimizer.state[flat] = {
            "step": _step_tensor(step, flat, zero_optimizer.optimizer),
            **{key: torch.zeros_like(flat) for key in MOMENTS},
        }
    _set_group_steps(zero_optimizer.optimizer, step)
    zero_optimizer._lazy_init_hp_params_optimizer_state()


def _set_zero_state(parameter: nn.Parameter, shard: dict[str, torch.Tensor]) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    device = parameter.device
    safe_set_full_fp32_param(parameter, shard["weight"].to(device))
    for key in MOMENTS:
        safe_set_full_optimizer_state(parameter, shard[key].to(device), key)


def _set_group_steps(optimizer: torch.optim.Optimizer, step: int) -> None:
    """apex's FusedAdam counts steps per group, torch's AdamW per parameter: set both."""
    for group in optimizer.param_groups:
        group["step"] = step


def _step_tensor(step: int, parameter: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """torch's AdamW keeps `step` as a float32 scalar, on the parameter's device when fused or capturable."""
    group = optimizer.param_groups[0]
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=parameter.device if on_device else "cpu")
