"""GPT decoder (Radford et al. 2018/2019, Brown et al. 2020): learned positions, pre-LN blocks with
biases and GELU, final LayerNorm, output layer tied to the word embedding. What every causal decoder
shares (its config keys, block runner, loss and forward) is model/decoder.py's."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from torch import nn

from scaletrain.config import Config, ModelConfig
from scaletrain.model.attention_masks import DocumentAttention, positions_in_document
from scaletrain.model.chunked_cross_entropy import defer_lm_logits
from scaletrain.model.counts import MLPCounts, ModelCounts, mlp_counts
from scaletrain.model.decoder import (
    NO_DOCUMENTS,
    DecoderConfig,
    DecoderLM,
    decoder_block_runner,
    decoder_extras,
    run_final_norm,
    sequence_parallel_region,
    validate_decoder,
)
from scaletrain.model.family import PipelineLayer
from scaletrain.model.init import normal_init, residual_std
from scaletrain.model.layers import KVCache, ParallelAttention, TransformerBlock, gelu_tanh, parallel_lm_logits
from scaletrain.model.moe import MoEConfig, block_mlp
from scaletrain.model.parallel_config import model_parallel_config
from scaletrain.parallel.context_parallel import context_parallel_size, local_positions, local_tokens
from scaletrain.parallel.sequence_parallel import scatter_to_sequence_parallel


@dataclass
class GPTConfig(DecoderConfig):
    """GPT has no keys beyond the shared decoder ones."""


class GPTEmbedding(nn.Module):
    """Vocab-parallel token embedding + learned absolute positions; output [seq, batch, hidden]."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        model, seed = config.model, config.train.seed
        self.word = tensor_parallel.VocabParallelEmbedding(
            config.padded_vocab_size, model.hidden_size,
            init_method=normal_init(model.init_std, seed, "embedding.word"), config=model_parallel_config(config),
        )
        self.position = nn.Embedding(model.seq_length, model.hidden_size)
        with torch.no_grad():
            normal_init(model.init_std, seed, "embedding.position")(self.position.weight)
        self.dropout = nn.Dropout(model.dropout)
        self.sequence_parallel = config.parallel.sequence_parallel

    def forward(self, tokens: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """positions [batch, seq] when not start..start+seq-1 (restarting at every packed document)."""
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        embedded = (self.word(tokens) + self.position(positions)).transpose(0, 1).contiguous()
        if self.sequence_parallel:
            embedded = scatter_to_sequence_parallel(embedded)
        return self.dropout(embedded)


def build_block(config: Config, layer: int) -> TransformerBlock:
    model, seed = config.model, config.train.seed
    output_std = residual_std(model.init_std, model.num_layers)
    prefix = f"blocks.{layer}"

    def init(part: str, sublayer: str):
        # a residual branch's output projection (an expert's too: "experts.3.proj")
        std = output_std if part.rsplit(".", 1)[-1] in ("output", "proj") else model.init_std
        return normal_init(std, seed, f"{prefix}.{sublayer}.{part}")

    mp_config = model_parallel_config(config)
    attention = ParallelAttention(
        model.hidden_size, model.num_heads, mp_config, lambda part: init(part, "attention"),
        causal=True, dropout=model.dropout, layer_index=layer, sliding_window=model.sliding_window,
    )
    mlp = block_mlp(model.moe, layer, model.hidden_size, model.ffn_size, mp_config, lambda part: init(part, "mlp"),
                    config.train.grad_accum, activation=gelu_tanh)
    return sequence_parallel_region(config, TransformerBlock(
        attention, mlp, lambda: nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps), dropout=model.dropout
    ))


def _embed(embedding: GPTEmbedding, activations: tuple, cache: KVCache | None = None,
           documents: DocumentAttention = NO_DOCUMENTS, **_) -> tuple:
    """Under context parallelism this rank's chunks of the tokens, at their global positions."""
    tokens, *rest = activations
    _, document_ids = decoder_extras(rest)
    positions = None
    if documents.positions and document_ids is not None:
        positions = local_tokens(positions_in_document(document_ids))
    elif context_parallel_size() > 1:
        positions = local_positions(tokens.shape[1], tokens.device)
    return (embedding(local_tokens(tokens), start=cache.length if cache is not None else 0, positions=positions),
            *rest)


def _tied_output(embedding: GPTEmbedding, activations: tuple, loss_chunk_size: int = 0, **_) -> tuple:
    """Logits with the word embedding; with train.loss_chunk_size, its input and weight for the chunked loss."""
    if loss_chunk_size:
        return (defer_lm_logits(activations[0], embedding.word.weight, embedding.sequence_parallel, loss_chunk_size),)
    return (parallel_lm_logits(activations[0], embedding.word.weight, embedding.sequence_parallel),)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    model = config.model
    run_block = decoder_block_runner(config)
    return [
        PipelineLayer("embedding", lambda: GPTEmbedding(config),
                      functools.partial(_embed, documents=model.document_attention)),
        *(PipelineLayer(f"blocks.{layer}", lambda layer=layer: build_block(config, layer), run_block,
                        is_block=True) for layer in range(model.num_layers)),
        PipelineLayer("final_norm", lambda: sequence_parallel_region(
            config, nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps)), run_final_norm),
        PipelineLayer("output", lambda: GPTEmbedding(config),
                      functools.partial(_tied_output, loss_chunk_size=config.train.loss_chunk_size),
                      tied_to="embedding", tied_weight="word.weight"),
    ]


def build(config: Config) -> DecoderLM:
    return DecoderLM(pipeline_layers(config), config.train.full_recompute_interval)


def model_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Forward + backward FLOPs per token, without recomputation (model FLOPs, as MFU uses).

    Per layer and token the forward pass does 2 FLOPs per weight, 8h^2 (QKV + output) +
    4h*ffn (MLP), plus 4hs for attention scores and values; the logits add 2hV. Backward
    doubles it. With ffn=4h this is Narayanan et al. 2021's 72*l*h^2*(1 + s/6h) + 6hV, and
    equals PaLM's 6N + 12*l*h*s (Chowdhery et al. 2022, app. B) with N the matmul weights.
    A MoE layer's MLP counts its router and top_k experts (model/counts.py mlp_counts).
    """
    hidden, seq = model.hidden_size, model.seq_length
    forward = sum(8 * hidden * hidden + 4 * hidden * seq + _mlp(model, layer).forward_flops
                  for layer in range(model.num_layers))
    return 3.0 * (forward + 2 * hidden * vocab_size)


def _mlp(model: GPTConfig, layer: int) -> MLPCounts:
    ffn = model.moe.layer_ffn(layer, model.ffn_size)
    return mlp_counts(model.moe, layer, model.hidden_size, 2 * model.hidden_size * ffn, ffn + model.hidden_size)


def counts(config: Config) -> ModelCounts:
    """The tied output layer computes logits at every position: Narayanan et al. 2021, eq. 3 (6hV
    for the head). Embedding parameters: the word and position tables. A block is QKV and output
    (4h² + 4h with biases) and two LayerNorms (4h) besides its MLP (fc and proj, 2h·ffn + ffn + h)."""
    model, vocab = config.model, config.padded_vocab_size
    hidden = model.hidden_size
    mlps = [_mlp(model, layer) for layer in range(model.num_layers)]
    attention = model.num_layers * (4 * hidden * hidden + 8 * hidden)
    embedding = vocab * hidden + model.seq_length * hidden
    return ModelCounts(
        total_params=embedding + attention + sum(mlp.params for mlp in mlps) + 2 * hidden,
        active_params=embedding + attention + sum(mlp.active_params for mlp in mlps) + 2 * hidden,
        embedding_params=embedding,
        flops_per_token=model_flops_per_token(model, vocab),
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + 2h·V) = 6N + 12·l·h·s + 6h·V with N the block weights "
                      "(Narayanan et al. 2021, eq. 3; PaLM app. B)" + _moe_formula(model.moe),
    )


def _moe_formula(moe: MoEConfig) -> str:
    if not moe.enabled:
        return ""
    return (f"; a MoE layer's 4h·ffn is top_k·4h·ffn_expert + 2h·E (k={moe.top_k} of E={moe.num_experts} "
            "experts and the router)")


def validate(config: Config) -> None:
    validate_decoder(config)
