"""Any family as a DeepSpeed `PipelineModule`, generated from the family's own pipeline layers.

Each `PipelineLayer` becomes one DeepSpeed layer that builds the family's module at its place in
the model (`PipelineUnit`), so a stage's parameters carry the plain model's names and DeepSpeed's
per-layer checkpoint files (layer_XX-model_YY-model_states.pt) consolidate by name. A tied layer
(an output layer reusing the word embedding) is a TiedLayerSpec: DeepSpeed builds a copy on the
last stage and all-reduces the tied weight's gradient between the first and last stage; several
layers may be tied to one owner (T5's decoder embedding and output layer, ALBERT's shared block,
whose every weight is tied: each stage that runs it holds a copy and their gradients are summed).

Between stages, a stage's floating activations travel as one tensor (`pack_activations`): DeepSpeed
sends back gradients for every floating tensor it received, but with TP > 1 it partitions only the
first across the TP ranks and asserts the others need no gradient. So several tensors with
gradients (T5's hidden state, encoder output and position bias) cross stages as one, which, being
partitioned across TP ranks, must be the same on each of them.
"""

from __future__ import annotations

import functools
import math

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain import upstream
from scaletrain.batch import Batch
from scaletrain.config import Config
from scaletrain.model.family import ModelFamily, PipelineLayer, apply_recompute, install
from scaletrain.notices import OP_BUILT, PIPELINE_LAYOUT, without_stdout_lines
from scaletrain.parallel.groups import Topology


class PipelineUnit(nn.Module):
    """One pipeline layer: the family's module installed at its model path, run by the layer's forward."""

    def __init__(self, layer: PipelineLayer) -> None:
        super().__init__()
        self._built = [layer.build()]  # a list: its parameters are registered by `install` below
        install(self, layer.name, self._built[0])
        self._layer = layer

    def forward(self, activations: tuple | torch.Tensor) -> tuple:
        return run_layer(self._layer, self, activations)

    def built(self) -> nn.Module:
        return self._built[0]


class PipelineBlock(PipelineUnit):
    """A transformer block: the unit DeepSpeed recomputes and the `blocks` partition counts."""


def run_layer(layer: PipelineLayer, unit: PipelineUnit, activations: tuple | torch.Tensor) -> tuple:
    if isinstance(activations, torch.Tensor):
        activations = (activations,)
    return layer.run(unit.built(), tuple(activations))


@upstream.partition_by_stage_boundaries
class TransformerPipeline(PipelineModule):
    """DeepSpeed's PipelineModule, plus partitioning by an explicit blocks-per-stage list and the
    family's batch schema (first-stage inputs, last-stage labels)."""

    def __init__(self, config: Config, topology: Topology, family: ModelFamily) -> None:
        layers = family.pipeline_layers(config)
        self._blocks_per_stage = _parse_stage_sizes(config.parallel.pipeline_partition)
        self._block_positions = [index for index, layer in enumerate(layers) if layer.is_block]
        self._layer_count = len(layers)
        self.batch_schema = family.batch_schema(config)
        partition = config.parallel.pipeline_partition
        super().__init__(
            layers=_layer_specs(layers),
            topology=PipeModelDataParallelTopology(
                num_pp=topology.pipeline_parallel_size,
                num_mp=topology.tensor_parallel_size,
                num_dp=topology.data_parallel_size,
            ),
            loss_fn=lambda outputs, labels: family.loss(_as_tuple(outputs), _as_tuple(labels)),
            partition_method="uniform" if self._blocks_per_stage else _deepspeed_method(partition),
            activation_checkpoint_interval=config.train.full_recompute_interval,
            activation_checkpoint_func=functools.partial(checkpoint, use_reentrant=False),
            checkpointable_layers=[PipelineBlock.__name__],
        )
        apply_recompute(self, config.train)  # selective: this stage's attention cores, tied copies included

    def forward(self, forward_input: tuple | torch.Tensor) -> tuple | torch.Tensor:
        if self.stage_id > 0:
            forward_input = unpack_activations(forward_input)
        outputs = super().forward(forward_input)
        return pack_activations(_as_tuple(outputs)) if self.stage_id < self.num_stages - 1 else outputs

    def block_modules(self) -> list[nn.Module]:
        """This stage's block modules (the family's, as LayeredModel.block_modules), each once."""
        built = [unit.built() for unit in self.modules() if isinstance(unit, PipelineBlock)]
        return list({id(module): module for module in built}.values())

    def split_batch(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return self.batch_schema.split(batch)

    def stage_boundaries(self) -> list[int] | None:
        """With a blocks-per-stage list, stage i holds that many blocks; the layers before the first
        block (embedding) join the first stage and those after the last block (head) the last.
        Without one (None), DeepSpeed's partition method applies."""
        if not self._blocks_per_stage:
            return None
        boundaries, seen = [0], 0
        for blocks in self._blocks_per_stage[:-1]:
            seen += blocks
            boundaries.append(self._block_positions[seen])
        return boundaries + [self._layer_count]


def build_pipeline(config: Config, topology: Topology, family: ModelFamily) -> TransformerPipeline:
    """This rank's stage of `family`'s model (the config's: families.get_family, which the caller looks up, as the
    model package sits below the family registry)."""
    # PipelineModule talks through DeepSpeed's comm layer, which adopts the existing torch group.
    with without_stdout_lines(OP_BUILT):  # its comm layer loads DeepSpeed's CPU op
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    with without_stdout_lines(PIPELINE_LAYOUT):  # DeepSpeed prints its partition; the start line says the layout
        return TransformerPipeline(config, topology, family)


def _layer_specs(layers: list[PipelineLayer]) -> list[LayerSpec]:
    tied_keys = {layer.tied_to for layer in layers if layer.tied_to}
    owners = {layer.name: layer for layer in layers}
    specs: list[LayerSpec] = []
    for layer in layers:
        unit = PipelineBlock if layer.is_block else PipelineUnit  # a tied block still counts as a block
        if layer.tied_to:
            owner = owners[layer.tied_to]
            specs.append(TiedLayerSpec(
                owner.name, unit, owner, tied_weight_attr=_tied_attributes(owner.name, layer),
                forward_fn=functools.partial(run_layer, layer),
            ))
        elif layer.name in tied_keys:
            tied = next(other for other in layers if other.tied_to == layer.name)
            specs.append(TiedLayerSpec(layer.name, unit, layer, tied_weight_attr=_tied_attributes(layer.name, tied)))
        else:
            specs.append(LayerSpec(unit, layer))
    return specs


def _tied_attributes(owner: str, tied: PipelineLayer) -> list[str]:
    """The tied weights as attribute paths in the PipelineUnit that holds the owner's module."""
    return [f"{owner}.{weight}" for weight in tied.tied_weights]


def pack_activations(activations: tuple) -> tuple:
    """(floats, layout, *others): the floating tensors flattened into one, and an integer layout
    [tensors, 2 + dims] of (is floating, ndim, *shape) from which `unpack_activations` restores
    the tuple in order."""
    floats = [tensor for tensor in activations if tensor.is_floating_point()]
    if not floats:
        raise ValueError("a pipeline stage must pass at least one floating activation to the next")
    width = 2 + max(tensor.dim() for tensor in activations)
    layout = torch.zeros(len(activations), width, dtype=torch.long)
    for row, tensor in zip(layout, activations, strict=True):
        row[:2 + tensor.dim()] = torch.tensor([int(tensor.is_floating_point()), tensor.dim(), *tensor.shape])
    packed = floats[0].contiguous() if len(floats) == 1 else torch.cat([tensor.reshape(-1) for tensor in floats])
    others = [tensor for tensor in activations if not tensor.is_floating_point()]
    return packed, layout.to(packed.device), *others


def unpack_activations(packed: tuple) -> tuple:
    """The tuple given to `pack_activations`, its floating tensors views of the packed one (so the
    gradient of each flows into the packed tensor DeepSpeed received)."""
    floats, layout, *others = packed
    rows = layout.tolist()  # a few integers, read on the host once per micro-batch
    shapes = [row[2:2 + row[1]] for row in rows if row[0]]
    parts = floats.reshape(-1).split([math.prod(shape) for shape in shapes])
    float_parts = iter(part.view(shape) for part, shape in zip(parts, shapes, strict=True))
    other_parts = iter(others)
    return tuple(next(float_parts) if row[0] else next(other_parts) for row in rows)


def _as_tuple(value: tuple | list | torch.Tensor) -> tuple:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def _parse_stage_sizes(partition: str) -> list[int] | None:
    if "," not in partition and not partition.isdigit():
        return None
    return [int(part) for part in partition.split(",")]


def _deepspeed_method(partition: str) -> str:
    return f"type:{PipelineBlock.__name__}" if partition == "blocks" else partition
