"""GPT as a DeepSpeed `PipelineModule`: embedding, blocks and head as layer specs.

The layer list is `GPT` as a flat sequence (see `gpt.flat_layer_parameter_name`), built from
the same constructors, so a pipelined model has exactly the weights of the plain one
(initialisation is keyed by parameter name) and its checkpoints map back to GPT names.
The output layer reuses the first stage's word embedding through DeepSpeed's TiedLayerSpec;
DeepSpeed all-reduces the tied weight's gradient between the first and last stage.
"""

from __future__ import annotations

import functools

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain.config import Config
from scaletrain.model import model_parallel_config
from scaletrain.model.gpt import GPTEmbedding, build_block, causal_lm_loss
from scaletrain.model.layers import parallel_lm_logits
from scaletrain.parallel.groups import Topology

TIED_EMBEDDING = "embedding"


class PipelineBlock(nn.Module):
    """One GPT block as a pipeline layer, built exactly as `GPT` builds it."""

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__()
        self.block = build_block(config.model, model_parallel_config(config), config.train.seed, layer)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block(hidden)


class PipelineEmbedding(GPTEmbedding):
    def __init__(self, config: Config) -> None:
        super().__init__(config.model, config.padded_vocab_size, model_parallel_config(config), config.train.seed)


def _output_logits(embedding: PipelineEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return parallel_lm_logits(hidden, embedding.word.weight)


class GPTPipeline(PipelineModule):
    """DeepSpeed's PipelineModule, plus partitioning by an explicit blocks-per-stage list."""

    def __init__(self, config: Config, topology: Topology) -> None:
        self._blocks_per_stage = _parse_stage_sizes(config.parallel.pipeline_partition)
        specs = [TiedLayerSpec(TIED_EMBEDDING, PipelineEmbedding, config, tied_weight_attr="word.weight")]
        specs += [LayerSpec(PipelineBlock, config, layer) for layer in range(config.model.num_layers)]
        specs += [
            LayerSpec(nn.LayerNorm, config.model.hidden_size, eps=config.model.layernorm_eps),
            TiedLayerSpec(
                TIED_EMBEDDING, PipelineEmbedding, config, forward_fn=_output_logits, tied_weight_attr="word.weight"
            ),
        ]
        method = config.parallel.pipeline_partition
        super().__init__(
            layers=specs,
            topology=PipeModelDataParallelTopology(
                num_pp=topology.pipeline_parallel_size,
                num_mp=topology.tensor_parallel_size,
                num_dp=topology.data_parallel_size,
            ),
            loss_fn=causal_lm_loss,
            partition_method="uniform" if self._blocks_per_stage else _deepspeed_method(method),
            activation_checkpoint_interval=config.train.activation_checkpoint_interval,
            activation_checkpoint_func=functools.partial(checkpoint, use_reentrant=False),
            checkpointable_layers=[PipelineBlock.__name__],
        )

    def _partition_layers(self, method: str = "uniform") -> None:
        """With a blocks-per-stage list, stage i holds that many blocks; the embedding joins the
        first stage and the final LayerNorm and output layer the last."""
        if not self._blocks_per_stage:
            super()._partition_layers(method)
            return
        boundaries = [0]
        for blocks in self._blocks_per_stage:
            boundaries.append(boundaries[-1] + blocks)
        boundaries = [0] + [1 + b for b in boundaries[1:-1]] + [len(self._layer_specs)]
        self.parts = boundaries
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def _parse_stage_sizes(partition: str) -> list[int] | None:
    if "," not in partition and not partition.isdigit():
        return None
    return [int(part) for part in partition.split(",")]


def _deepspeed_method(partition: str) -> str:
    return f"type:{PipelineBlock.__name__}" if partition == "blocks" else partition

