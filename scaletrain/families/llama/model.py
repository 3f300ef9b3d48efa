"""Llama-style decoder (Touvron et al. 2023, Llama 1/2; Meta 2024, Llama 3): pre-norm RMSNorm,
rotary positions, SwiGLU MLP, grouped-query attention, no biases, untied output layer.

Numerics follow Hugging Face's `LlamaForCausalLM` (rotate-half RoPE, fp32 RMS statistics), so
families/llama/hf.py maps weights one to one; with model.sliding_window the model is Mistral's
(Jiang et al. 2023), exported as `MistralForCausalLM`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from torch import nn

from scaletrain.config import Config, ConfigError, bounded
from scaletrain.model.chunked_cross_entropy import defer_lm_logits
from scaletrain.model.counts import ModelCounts, mlp_counts
from scaletrain.model.decoder import (
    DecoderConfig,
    DecoderLM,
    decoder_block_runner,
    run_final_norm,
    sequence_parallel_region,
    validate_decoder,
)
from scaletrain.model.family import PipelineLayer
from scaletrain.model.init import normal_init, residual_std
from scaletrain.model.layers import (
    ParallelAttention,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
)
from scaletrain.model.moe import block_mlp
from scaletrain.model.parallel_config import model_parallel_config
from scaletrain.parallel.context_parallel import local_tokens
from scaletrain.parallel.sequence_parallel import scatter_to_sequence_parallel


@dataclass
class LlamaConfig(DecoderConfig):
    num_kv_heads: int | None = None  # None: num_heads (multi-head); fewer: grouped-query; 1: multi-query
    rope_theta: float = bounded(10000.0, "> 0", "Llama 2: 1e4; Llama 3: 5e5")  # Llama 2: 1e4; Llama 3: 5e5
    layernorm_eps: float = bounded(1e-5, "> 0", "e.g. 1e-5")  # RMSNorm eps

    @property
    def ffn_size(self) -> int:
        """ffn_hidden_size, else Meta's rule: 2/3 of 4h rounded up to a multiple of 256."""
        return self.ffn_hidden_size or 256 * math.ceil(8 * self.hidden_size / 3 / 256)

    @property
    def num_query_groups(self) -> int:
        return self.num_kv_heads or self.num_heads


class LlamaEmbedding(nn.Module):
    """The vocab-parallel token table; positions enter in attention (rotary)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        model = config.model
        self.word = tensor_parallel.VocabParallelEmbedding(
            config.padded_vocab_size, model.hidden_size,
            init_method=normal_init(model.init_std, config.train.seed, "embedding.word"),
            config=model_parallel_config(config),
        )
        self.dropout = nn.Dropout(model.dropout)
        self.sequence_parallel = config.parallel.sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.word(tokens).transpose(0, 1).contiguous()
        if self.sequence_parallel:
            embedded = scatter_to_sequence_parallel(embedded)
        return self.dropout(embedded)


def build_block(config: Config, layer: int) -> TransformerBlock:
    """Every weight normal(init_std) as HF's initializer_range; the residual-branch outputs scaled by
    1/sqrt(2 * layers) as Megatron does for its Llama configs (Radford et al. 2019, sec. 2.3)."""
    model, seed = config.model, config.train.seed
    output_std = residual_std(model.init_std, model.num_layers)

    def init(sublayer: str):
        return lambda part: normal_init(  # a residual branch's output projection (an expert's too)
            output_std if part.rsplit(".", 1)[-1] in ("output", "proj") else model.init_std, seed,
            f"blocks.{layer}.{sublayer}.{part}",
        )

    mp_config = model_parallel_config(config)
    attention = ParallelAttention(
        model.hidden_size, model.num_heads, mp_config, init("attention"),
        num_kv_heads=model.num_query_groups, head_dim=model.attention_head_dim, bias=False, causal=True,
        dropout=model.dropout, rotary=RotaryEmbedding(model.attention_head_dim, model.rope_theta), layer_index=layer,
        sliding_window=model.sliding_window,
    )
    mlp = block_mlp(model.moe, layer, model.hidden_size, model.ffn_size, mp_config, init("mlp"),
                    config.train.grad_accum, activation=torch.nn.functional.silu, gated=True, bias=False)
    return sequence_parallel_region(config, TransformerBlock(
        attention, mlp, lambda: RMSNorm(model.hidden_size, model.layernorm_eps), dropout=model.dropout
    ))


def output_layer(config: Config) -> tensor_parallel.ColumnParallelLinear:
    """The untied vocab-parallel output projection (Megatron's output_layer)."""
    model = config.model
    return tensor_parallel.ColumnParallelLinear(
        model.hidden_size, config.padded_vocab_size, config=model_parallel_config(config), bias=False,
        gather_output=False, init_method=normal_init(model.init_std, config.train.seed, "output"),
    )


# Activations as in GPT: (hidden, *extras), the extras a prefix LM's prefix_lengths and the document ids.


def _embed(embedding: LlamaEmbedding, activations: tuple, **_) -> tuple:
    """Under context parallelism this rank's chunks of the tokens (rotary takes their global positions)."""
    tokens, *rest = activations
    return (embedding(local_tokens(tokens)), *rest)


def _output(output: tensor_parallel.ColumnParallelLinear, activations: tuple, loss_chunk_size: int = 0,
            **_) -> tuple:
    """Logits; with train.loss_chunk_size, the layer's input and weight for the chunked loss (the
    ColumnParallelLinear's own copy / SP gather, without its matmul). The weight is read outside the
    layer's forward: under ZeRO-3 DeepSpeed's engine finds it there (ZeROOrderedDict registers a partitioned
    parameter read during the engine's forward as external, and gathers it)."""
    if loss_chunk_size:
        return (defer_lm_logits(activations[0], output.weight, output.sequence_parallel, loss_chunk_size),)
    logits, _ = output(activations[0])
    return (logits,)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    model = config.model
    # rotary positions restart per document inside each block (GPT adds learned ones in its embedding)
    run_block = decoder_block_runner(config, rotary=True)
    return [
        PipelineLayer("embedding", lambda: LlamaEmbedding(config), _embed),
        *(PipelineLayer(f"blocks.{layer}", lambda layer=layer: build_block(config, layer), run_block,
                        is_block=True) for layer in range(model.num_layers)),
        PipelineLayer("final_norm", lambda: sequence_parallel_region(
            config, RMSNorm(model.hidden_size, model.layernorm_eps)), run_final_norm),
        PipelineLayer("output", lambda: output_layer(config),
                      functools.partial(_output, loss_chunk_size=config.train.loss_chunk_size)),
    ]


def build(config: Config) -> DecoderLM:
    return DecoderLM(pipeline_layers(config), config.train.full_recompute_interval)


def counts(config: Config) -> ModelCounts:
    """Per layer: q h·(n·d), k and v h·(g·d) each, o (n·d)·h, SwiGLU 3·h·f, two RMSNorm gains; plus
    the word table, the untied output layer (a matmul: non-embedding, as for T5 v1.1) and the final
    norm. FLOPs per token (Kaplan et al. 2020, table 1, per matmul): forward 2 per weight of the
    layers and the output layer, plus 4·s·(n·d) for attention scores and values; times 3. A MoE
    layer's MLP is E SwiGLU experts and the router, of which a token runs top_k (model/counts.py)."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, seq = model.hidden_size, model.seq_length
    inner, kv_inner = model.num_heads * model.attention_head_dim, model.num_query_groups * model.attention_head_dim
    attention = 2 * hidden * inner + 2 * hidden * kv_inner
    mlps = [mlp_counts(model.moe, layer, hidden, 3 * hidden * model.moe.layer_ffn(layer, model.ffn_size), 0)
            for layer in range(model.num_layers)]
    outside_mlps = 2 * vocab * hidden + model.num_layers * (attention + 2 * hidden) + hidden
    forward = sum(2 * attention + 4 * seq * inner + mlp.forward_flops for mlp in mlps) + 2 * hidden * vocab
    formula = ("3·(l·(2·(2h·n·d + 2h·g·d + 3h·f) + 4s·n·d) + 2h·V) (Kaplan et al. 2020, table 1; "
               "n query heads, g key/value heads, SwiGLU f)")
    if model.moe.enabled:
        formula += f"; a MoE layer's 3h·f is k·3h·f_expert + h·E (k={model.moe.top_k} of E={model.moe.num_experts})"
    return ModelCounts(
        total_params=outside_mlps + sum(mlp.params for mlp in mlps),
        active_params=outside_mlps + sum(mlp.active_params for mlp in mlps),
        embedding_params=vocab * hidden, flops_per_token=3.0 * forward, flops_formula=formula,
    )


def validate(config: Config) -> None:
    model, tensor = config.model, config.parallel.tensor
    groups = model.num_query_groups
    if groups < 1 or model.num_heads % groups:
        raise ConfigError(
            f"model.num_kv_heads={model.num_kv_heads} must divide model.num_heads={model.num_heads} "
            "(each key/value head serves an equal group of query heads)"
        )
    if groups % tensor and tensor % groups:
        raise ConfigError(
            f"parallel.tensor={tensor} and model.num_kv_heads={groups}: one must divide the other (key/value "
            "heads are split across TP ranks, or replicated when there are fewer of them than ranks)"
        )
    if model.attention_head_dim % 2:
        raise ConfigError(f"head dimension {model.attention_head_dim} must be even for rotary embeddings")
    validate_decoder(config)
