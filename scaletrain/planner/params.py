"""Exact parameter counts of any model family, total and per pipeline stage and TP rank.

Counted from the modules themselves, never by a per-family formula: each of the family's
pipeline layers (model/family.py `PipelineLayer`) is built at TP=1 on the meta device (shapes
only: no memory, and our init, model/init.py, and megatron's CPU initialisation run on meta
tensors as no-ops), and every parameter tensor is counted:
- a tensor megatron marks `tensor_model_parallel` (column/row-parallel weights, column-parallel
  biases, the vocab-parallel word table, T5's relative-position table) is split over TP: each
  rank holds elements / TP;
- every other tensor (norms, row-parallel biases, learned positions) is replicated on every rank.

Stages (model/pipeline.py with parallel.pipeline_partition=blocks): the blocks are split evenly,
num_blocks / PP per stage; the layers before the first block sit on stage 0, those after the last
block on the last stage. A tied layer (`tied_to`, e.g. GPT's output layer sharing the word table)
adds nothing at PP=1; with PP>1 DeepSpeed's TiedLayerSpec builds a copy of the tied module on the
last stage (GPT's includes a position table it never uses), which is counted, because it takes
memory.

Parameters are split into matrices (dim >= 2) and vectors (dim < 2) because that is how
train/engine.py groups them for AdamW (decay on matrices only), and DeepSpeed's ZeRO pads and
partitions each group separately. The experts of a MoE layer (model/moe.py `MoELayer.experts`; not its
router) are marked, because expert parallelism holds num_experts / EP of them on each rank and ZeRO
partitions their optimizer state over other ranks than the dense weights' (memory.py). Counts are
cached per model (planning evaluates thousands of layouts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletrain.config import Config, ConfigError
from scaletrain.families import get_family

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ParameterCount:
    """Parameter elements on one GPU, by AdamW group, and the number of parameter tensors."""

    matrices: int = 0
    vectors: int = 0
    tensors: int = 0

    @property
    def total(self) -> int:
        return self.matrices + self.vectors

    def __add__(self, other: ParameterCount) -> ParameterCount:
        return ParameterCount(
            self.matrices + other.matrices, self.vectors + other.vectors, self.tensors + other.tensors
        )

    def __sub__(self, other: ParameterCount) -> ParameterCount:
        return ParameterCount(
            self.matrices - other.matrices, self.vectors - other.vectors, self.tensors - other.tensors
        )

    def __mul__(self, times: int) -> ParameterCount:
        return ParameterCount(self.matrices * times, self.vectors * times, self.tensors * times)

    def share(self, ways: int) -> ParameterCount:
        """One of `ways` equal shares: a rank's experts when EP = `ways` splits whole experts evenly."""
        if self.matrices % ways or self.vectors % ways or self.tensors % ways:
            raise ValueError(f"{self} does not split into {ways} equal shares")
        return ParameterCount(self.matrices // ways, self.vectors // ways, self.tensors // ways)


@dataclass(frozen=True)
class TensorShape:
    """One parameter tensor at TP=1."""

    numel: int
    matrix: bool  # dim >= 2: AdamW's decayed group
    split: bool  # megatron's tensor_model_parallel: each TP rank holds numel / TP
    expert: bool = False  # a MoE layer's expert weight: each EP rank holds num_experts / EP experts


def count_tensors(tensors: tuple[TensorShape, ...], tensor_parallel: int, experts_only: bool = False) -> ParameterCount:
    """The tensors' elements on one TP rank (only the experts' if `experts_only`)."""
    matrices = vectors = 0
    tensors = tuple(tensor for tensor in tensors if tensor.expert) if experts_only else tensors
    for tensor in tensors:
        numel = tensor.numel // tensor_parallel if tensor.split else tensor.numel
        if tensor.matrix:
            matrices += numel
        else:
            vectors += numel
    return ParameterCount(matrices, vectors, len(tensors))


@dataclass(frozen=True)
class LayerParameters:
    """One pipeline layer's parameters (for a tied layer: those of the module it is tied to)."""

    name: str
    is_block: bool
    tied_to: str | None
    tensors: tuple[TensorShape, ...]
    # What ZeRO-3 gathers at once: a whole transformer block, else each module's own parameters.
    gather_units: tuple[tuple[TensorShape, ...], ...]

    def count(self, tensor_parallel: int, experts_only: bool = False) -> ParameterCount:
        return count_tensors(self.tensors, tensor_parallel, experts_only)


@dataclass(frozen=True)
class ModelParameters:
    """A model's pipeline layers in order."""

    family: str
    layers: tuple[LayerParameters, ...]
    num_blocks: int  # transformer blocks (for T5, encoder + decoder)


# Keyed by what the modules' shapes depend on (Config itself is mutable and unhashable).
_MODELS: dict[str, ModelParameters] = {}
_STAGES: dict[tuple[str, int, int, int, bool], ParameterCount] = {}


def model_parameters(config: Config) -> ModelParameters:
    """The model's parameter tensors, layer by layer, built once per model section and vocabulary."""
    key = _cache_key(config)
    if key not in _MODELS:
        _MODELS[key] = _count_model(config)
    return _MODELS[key]


def stage_parameters(
    config: Config, tensor_parallel: int, pipeline_parallel: int, stage: int, experts_only: bool = False
) -> ParameterCount:
    """Parameters held by one GPU (one TP rank) of pipeline stage `stage` without expert parallelism;
    with `experts_only`, those of its MoE layers' experts among them (all num_experts of each layer)."""
    key = (_cache_key(config), tensor_parallel, pipeline_parallel, stage, experts_only)
    if key not in _STAGES:
        count = ParameterCount()
        for layer in stage_layers(config, pipeline_parallel, stage):
            count = count + layer.count(tensor_parallel, experts_only)
        _STAGES[key] = count
    return _STAGES[key]


def expert_parameters(config: Config) -> int:
    """Parameters of all MoE layers' experts (TP=1; the routers are not experts): 0 for a dense model."""
    return stage_parameters(config, tensor_parallel=1, pipeline_parallel=1, stage=0, experts_only=True).total


def total_parameters(config: Config) -> int:
    """Unique parameters of the model (a tied output layer counted once)."""
    return stage_parameters(config, tensor_parallel=1, pipeline_parallel=1, stage=0).total


def num_blocks(config: Config) -> int:
    """Transformer blocks in the model: what activations and step time are modelled per."""
    return model_parameters(config).num_blocks


def largest_gathered_module(config: Config, tensor_parallel: int) -> ParameterCount:
    """The largest set of parameters ZeRO-3 gathers at once on one TP rank: a transformer block, or
    one other module's own parameters (e.g. the word table)."""
    return max(
        (count_tensors(unit, tensor_parallel) for layer in model_parameters(config).layers
         for unit in layer.gather_units),
        key=lambda count: count.total,
    )


def stage_layers(config: Config, pipeline_parallel: int, stage: int) -> list[LayerParameters]:
    """The layers stage `stage` builds. A tied layer stands for DeepSpeed's copy of the module it is
    tied to, which a stage builds once, and only if it does not hold that module already (T5's
    decoder embedding next to the encoder's on stage 0 shares it)."""
    model = model_parameters(config)
    if model.num_blocks % pipeline_parallel:
        raise ConfigError(f"{model.num_blocks} blocks do not split evenly into {pipeline_parallel} stages")
    per_stage = model.num_blocks // pipeline_parallel
    block, layer_stage, chosen = 0, 0, []
    for layer in model.layers:
        if layer.is_block:
            layer_stage = block // per_stage
            block += 1
        elif block == model.num_blocks:
            layer_stage = pipeline_parallel - 1  # after the last block
        if layer_stage != stage:
            continue
        if layer.tied_to is not None and (
            pipeline_parallel == 1 or any(layer.tied_to in (other.name, other.tied_to) for other in chosen)
        ):
            continue  # runs a module this stage already holds
        chosen.append(layer)
    return chosen


def _cache_key(config: Config) -> str:
    return repr((config.model, config.data.vocab_size, config.objective))


def _count_model(config: Config) -> ModelParameters:
    family = get_family(config.model.family)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tensor=1, expert=1))
    layers = family.pipeline_layers(config)
    with _meta_build_at_tensor_parallel_1():
        built: dict[str, nn.Module] = {}
        counted_layers = []
        for layer in layers:
            if layer.tied_to is None:
                built[layer.name] = layer.build()
            module = built[layer.tied_to or layer.name]
            counted_layers.append(
                LayerParameters(layer.name, layer.is_block, layer.tied_to, _tensors(module), _gather_units(module))
            )
    blocks = sum(layer.is_block for layer in layers)
    return ModelParameters(family.name, tuple(counted_layers), num_blocks=blocks)


@contextmanager
def _meta_build_at_tensor_parallel_1() -> Iterator[None]:
    """Build on the meta device as TP rank 0 of 1.

    Some layers ask megatron's parallel_state for the TP rank at construction (T5's relative-position
    table); the planner runs without torch.distributed, where that asserts. megatron's
    set_tensor_model_parallel_rank/world_size overrides answer instead, and are restored after
    (scaletrain/upstream.py reads what they were).

    torch and megatron are imported here, not at the top: `scaletrain --help` imports this module
    through the planner and must not wait for them."""
    import torch

    from scaletrain import upstream  # imports megatron-core

    with upstream.tensor_parallel_rank_override(0, 1), torch.device("meta"):
        yield


def _shape(parameter: nn.Parameter, expert: bool = False) -> TensorShape:
    split = bool(getattr(parameter, "tensor_model_parallel", False))  # megatron's attribute, absent on plain tensors
    return TensorShape(parameter.numel(), parameter.dim() >= 2, split, expert)


def _tensors(module: nn.Module) -> tuple[TensorShape, ...]:
    # Imported here for start-up speed, as in _gather_units.
    from scaletrain.model.moe import moe_layers_of

    experts = {id(parameter) for layer in moe_layers_of(module) for parameter in layer.experts.parameters()}
    return tuple(_shape(parameter, id(parameter) in experts) for parameter in module.parameters())


def _gather_units(module: nn.Module) -> tuple[tuple[TensorShape, ...], ...]:
    # Imported here for start-up speed, as torch is in _meta_build_at_tensor_parallel_1: model/layers.py
    # loads torch and megatron, and `scaletrain --help` imports this module through the planner.
    from scaletrain.model.layers import TransformerBlock

    units: list[tuple[TensorShape, ...]] = []
    seen: set[int] = set()

    def visit(child: nn.Module) -> None:
        if isinstance(child, TransformerBlock):
            units.append(tuple(_shape(p) for p in child.parameters() if id(p) not in seen))
            seen.update(id(p) for p in child.parameters())
            return
        own = tuple(_shape(p) for p in child.parameters(recurse=False) if id(p) not in seen)
        seen.update(id(p) for p in child.parameters(recurse=False))
        if own:
            units.append(own)
        for grandchild in child.children():
            visit(grandchild)

    visit(module)
    return tuple(units)
