"""Exact parameter counts of our GPT (scaletrain/model/gpt.py), total and per pipeline stage and TP rank.

The counts mirror what `GPT` builds, tensor by tensor, so memory predictions can be exact:
- embedding: vocab-parallel word table (padded vocabulary / TP rows per rank) and learned
  positions (replicated on every TP rank);
- per block: two LayerNorms (gain + bias, replicated), fused QKV weight and bias
  (column-parallel: split), attention output weight (row-parallel: split) and bias (replicated,
  megatron's RowParallelLinear adds the full bias after the all-reduce), MLP fc weight and bias
  (column-parallel), MLP proj weight (row-parallel) and bias (replicated);
- final LayerNorm; the output layer is tied to the word table, so it adds nothing at PP=1.
  With PP>1 the last stage holds its own copy of the word table for the logits, as Megatron
  does (its gradient is all-reduced with the first stage's). Our pipeline
  (parallel/pipeline.py) builds that copy as a second `GPTPipelineEmbedding` through DeepSpeed's
  TiedLayerSpec, so the last stage also allocates a position table it never uses; it is
  counted, because it takes memory.

Parameters are split into matrices (dim >= 2) and vectors (dim < 2) because that is how
train/engine.py groups them for AdamW (decay on matrices only), and DeepSpeed's ZeRO pads and
partitions each group separately.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import Config, ModelConfig


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

    def __mul__(self, times: int) -> ParameterCount:
        return ParameterCount(self.matrices * times, self.vectors * times, self.tensors * times)


def word_embedding_parameters(vocab_size: int, hidden_size: int, tensor_parallel: int) -> ParameterCount:
    """The vocab-parallel word table on one TP rank (also the tied output layer)."""
    return ParameterCount(matrices=vocab_size // tensor_parallel * hidden_size, tensors=1)


def position_embedding_parameters(model: ModelConfig) -> ParameterCount:
    return ParameterCount(matrices=model.seq_length * model.hidden_size, tensors=1)


def layer_norm_parameters(hidden_size: int) -> ParameterCount:
    return ParameterCount(vectors=2 * hidden_size, tensors=2)


def block_parameters(model: ModelConfig, tensor_parallel: int) -> ParameterCount:
    """One pre-LN block on one TP rank (see the module docstring for what is split)."""
    hidden, ffn, tp = model.hidden_size, model.ffn_size, tensor_parallel
    qkv = ParameterCount(matrices=3 * hidden * hidden // tp, vectors=3 * hidden // tp, tensors=2)
    attention_output = ParameterCount(matrices=hidden * hidden // tp, vectors=hidden, tensors=2)
    fc = ParameterCount(matrices=hidden * ffn // tp, vectors=ffn // tp, tensors=2)
    proj = ParameterCount(matrices=ffn * hidden // tp, vectors=hidden, tensors=2)
    return layer_norm_parameters(hidden) * 2 + qkv + attention_output + fc + proj


def stage_parameters(config: Config, tensor_parallel: int, pipeline_parallel: int, stage: int) -> ParameterCount:
    """Parameters held by one GPU (one TP rank) of pipeline stage `stage`; layers split evenly."""
    model = config.model
    layers = model.num_layers // pipeline_parallel
    count = block_parameters(model, tensor_parallel) * layers
    word = word_embedding_parameters(config.padded_vocab_size, model.hidden_size, tensor_parallel)
    if stage == 0:
        count = count + word + position_embedding_parameters(model)
    if stage == pipeline_parallel - 1:
        count = count + layer_norm_parameters(model.hidden_size)
        if pipeline_parallel > 1:  # the tied output layer's own embedding module
            count = count + word + position_embedding_parameters(model)
    return count


def total_parameters(config: Config) -> int:
    """Unique parameters of the model (the tied output layer counted once)."""
    return stage_parameters(config, tensor_parallel=1, pipeline_parallel=1, stage=0).total
