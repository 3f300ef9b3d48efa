"""GPT and BERT as DeepSpeed `PipelineModule`s: embedding, blocks and head as layer specs.

Each family is its model as a flat layer list (see `GPT.flat_layer_parameter_name` and
`BERT.flat_layer_parameter_name`), built from the same constructors, so a pipelined model has exactly the weights of the
plain one (initialisation is keyed by parameter name) and its checkpoints map back to model names.
The output layer reuses the first stage's word embedding through DeepSpeed's TiedLayerSpec;
DeepSpeed all-reduces the tied weight's gradient between the first and last stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain.config import Config
from scaletrain.model import model_parallel_config
from scaletrain.model.bert import BertEmbedding, MaskedLMHead, SentenceOrderHead, build_bert_block
from scaletrain.model.gpt import GPTEmbedding, build_block
from scaletrain.model.layers import key_padding_attention_mask, masked_vocab_parallel_loss, parallel_lm_logits
from scaletrain.parallel.groups import Topology

TIED_EMBEDDING = "embedding"
Batch = dict[str, torch.Tensor]


class TransformerPipeline(PipelineModule):
    """DeepSpeed's PipelineModule, plus partitioning by an explicit blocks-per-stage list and the
    family's rule for splitting a batch into first-stage inputs and last-stage labels."""

    def __init__(
        self,
        config: Config,
        topology: Topology,
        specs: list[LayerSpec],
        loss_fn: Callable,
        split_batch: Callable[[Batch], tuple],
        block_class: type[nn.Module],
    ) -> None:
        self._blocks_per_stage = _parse_stage_sizes(config.parallel.pipeline_partition)
        self.split_batch = split_batch
        partition = config.parallel.pipeline_partition
        super().__init__(
            layers=specs,
            topology=PipeModelDataParallelTopology(
                num_pp=topology.pipeline_parallel_size,
                num_mp=topology.tensor_parallel_size,
                num_dp=topology.data_parallel_size,
            ),
            loss_fn=loss_fn,
            partition_method="uniform" if self._blocks_per_stage else _deepspeed_method(partition, block_class),
            activation_checkpoint_interval=config.train.activation_checkpoint_interval,
            activation_checkpoint_func=functools.partial(checkpoint, use_reentrant=False),
            checkpointable_layers=[block_class.__name__],
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
        self.parts = [0] + [1 + b for b in boundaries[1:-1]] + [len(self._layer_specs)]
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def build_pipeline(config: Config, topology: Topology) -> TransformerPipeline:
    # PipelineModule talks through DeepSpeed's comm layer, which adopts the existing torch group.
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    if config.model.family == "bert":
        return TransformerPipeline(config, topology, bert_specs(config), bert_loss, split_bert_batch, BertPipelineBlock)
    return TransformerPipeline(
        config, topology, gpt_specs(config), masked_vocab_parallel_loss, split_gpt_batch, GPTPipelineBlock
    )


# ---------------------------------------------------------------------------------------------
# GPT: [embedding (tied), blocks..., final LayerNorm, output layer (tied)]


class GPTPipelineBlock(nn.Module):
    """One GPT block as a pipeline layer, built exactly as `GPT` builds it."""

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__()
        self.block = build_block(config.model, model_parallel_config(config), config.train.seed, layer)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block(hidden)


class GPTPipelineEmbedding(GPTEmbedding):
    def __init__(self, config: Config) -> None:
        super().__init__(config.model, config.padded_vocab_size, model_parallel_config(config), config.train.seed)


def _gpt_output_logits(embedding: GPTPipelineEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return parallel_lm_logits(hidden, embedding.word.weight)


def gpt_specs(config: Config) -> list[LayerSpec]:
    return [
        TiedLayerSpec(TIED_EMBEDDING, GPTPipelineEmbedding, config, tied_weight_attr="word.weight"),
        *(LayerSpec(GPTPipelineBlock, config, layer) for layer in range(config.model.num_layers)),
        LayerSpec(nn.LayerNorm, config.model.hidden_size, eps=config.model.layernorm_eps),
        TiedLayerSpec(
            TIED_EMBEDDING, GPTPipelineEmbedding, config, forward_fn=_gpt_output_logits, tied_weight_attr="word.weight"
        ),
    ]


def split_gpt_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["tokens"], batch["labels"]


# ---------------------------------------------------------------------------------------------
# BERT: [embedding (tied), blocks..., final, heads, decoder (tied), decoder bias]. The padding mask
# travels with the activations. DeepSpeed saves no tied layer that has a forward_fn, so the last
# stage's own weights (head transform, sentence-order head, bias) sit in layers of their own.


class BertPipelineEmbedding(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        model = config.model
        self.embedding = BertEmbedding(
            model, config.padded_vocab_size, model.type_vocab_size, model_parallel_config(config), config.train.seed
        )

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, token_types, padding_mask = inputs
        return self.embedding(tokens, token_types), padding_mask


def _bert_decoder(embedding: BertPipelineEmbedding, inputs: torch.Tensor | tuple) -> torch.Tensor | tuple:
    """The MLM decoder tied to the word embedding; sentence-order logits pass through."""
    if isinstance(inputs, tuple):
        transformed, sentence_order_logits = inputs
        return parallel_lm_logits(transformed, embedding.embedding.word.weight), sentence_order_logits
    return parallel_lm_logits(inputs, embedding.embedding.word.weight)


class BertPipelineBlock(nn.Module):
    def __init__(self, config: Config, layer: int) -> None:
        super().__init__()
        self.block = build_bert_block(
            config.model, model_parallel_config(config), config.train.seed, layer,
            config.model.layernorm_position or "post",
        )

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, padding_mask = inputs
        return self.block(hidden, key_padding_attention_mask(padding_mask)), padding_mask


class BertPipelineFinal(nn.Module):
    """Drops the padding mask; pre-LN stacks end in a LayerNorm (Xiong et al. 2020), post-LN do not."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        model = config.model
        pre = model.layernorm_position == "pre"
        self.final_norm = nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps) if pre else nn.Identity()

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.final_norm(inputs[0])


class BertPipelineHeads(nn.Module):
    """The MLM head's transform (its bias comes after the tied decoder) and the sentence-order head."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        model, seed = config.model, config.train.seed
        self.lm_head = MaskedLMHead(model, config.padded_vocab_size, model_parallel_config(config), seed)
        self.lm_head.register_parameter("bias", None)  # lives in BertPipelineDecoderBias
        with_pairs = config.objective.sentence_pairs != "none"
        self.sentence_order_head = SentenceOrderHead(model, seed) if with_pairs else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        transformed = self.lm_head.transform(hidden)
        if self.sentence_order_head is None:
            return transformed
        return transformed, self.sentence_order_head(hidden)


class BertPipelineDecoderBias(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        head = MaskedLMHead(config.model, config.padded_vocab_size, model_parallel_config(config), config.train.seed)
        self.bias = head.bias  # vocab-parallel, with megatron's partition attributes

    def forward(self, inputs: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if isinstance(inputs, tuple):
            logits, sentence_order_logits = inputs
            return logits + self.bias, sentence_order_logits
        return inputs + self.bias


def bert_specs(config: Config) -> list[LayerSpec]:
    tied = "embedding.word.weight"
    return [
        TiedLayerSpec(TIED_EMBEDDING, BertPipelineEmbedding, config, tied_weight_attr=tied),
        *(LayerSpec(BertPipelineBlock, config, layer) for layer in range(config.model.num_layers)),
        LayerSpec(BertPipelineFinal, config),
        LayerSpec(BertPipelineHeads, config),
        TiedLayerSpec(TIED_EMBEDDING, BertPipelineEmbedding, config, forward_fn=_bert_decoder, tied_weight_attr=tied),
        LayerSpec(BertPipelineDecoderBias, config),
    ]


def bert_loss(outputs: torch.Tensor | tuple, labels: torch.Tensor | tuple) -> torch.Tensor:
    """Masked-LM mean over labelled tokens, plus the sentence-order cross-entropy when present."""
    if not isinstance(labels, (tuple, list)):
        return masked_vocab_parallel_loss(outputs, labels)
    (logits, sentence_order_logits), (mlm_labels, sentence_order_labels) = outputs, labels
    return masked_vocab_parallel_loss(logits, mlm_labels) + F.cross_entropy(
        sentence_order_logits.float(), sentence_order_labels
    )


def split_bert_batch(batch: Batch) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, ...]]:
    inputs = (batch["tokens"], batch["token_types"], batch["padding_mask"])
    if "sentence_order_labels" in batch:
        return inputs, (batch["labels"], batch["sentence_order_labels"])
    return inputs, batch["labels"]


def _parse_stage_sizes(partition: str) -> list[int] | None:
    if "," not in partition and not partition.isdigit():
        return None
    return [int(part) for part in partition.split(",")]


def _deepspeed_method(partition: str, block_class: type[nn.Module]) -> str:
    return f"type:{block_class.__name__}" if partition == "blocks" else partition
