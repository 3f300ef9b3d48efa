"""BERT encoder (Devlin et al. 2019): word + position + segment embeddings, post-LN blocks (pre-LN
selectable), the masked-LM head tied to the word embedding, an optional sentence-order head and
SpanBERT's optional span boundary head (Joshi et al. 2020, sec. 3.2). Its embedding, heads, runners,
loss and forward are model/encoder.py's, which ALBERT and ELECTRA share; here are its config, blocks,
layers and counts."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from scaletrain.batch import BatchSchema
from scaletrain.config import Config, ConfigError, ModelConfig
from scaletrain.data.masking import SPAN_BOUNDARY_KEYS
from scaletrain.model.chunked_cross_entropy import refuse_loss_chunking
from scaletrain.model.counts import ModelCounts, transformer_block_flops
from scaletrain.model.encoder import (
    BERT,
    BertEmbedding,
    BertHeads,
    DecoderBias,
    MaskedLMObjective,
    SpanBoundaryDecoderBias,
    labelled_positions,
    run_block,
    run_decoder_bias,
    run_embedding,
    run_final_norm,
    run_heads,
    run_span_boundary_decoder_bias,
    run_tied_decoder,
)
from scaletrain.model.family import PipelineLayer
from scaletrain.model.init import normal_init, residual_std
from scaletrain.model.layers import ParallelAttention, ParallelMLP, TransformerBlock, gelu_erf
from scaletrain.model.parallel_config import model_parallel_config

LAYERNORM_POSITIONS = ("post", "pre")


@dataclass
class BertConfig(ModelConfig):
    objective_section = MaskedLMObjective

    layernorm_position: str = "post"  # post (BERT) | pre (GPT-2 style, with a final LayerNorm)
    type_vocab_size: int = 2  # segment embeddings


def build_block(config: Config, layer: int) -> TransformerBlock:
    """BERT initialises every weight with std 0.02 (Devlin et al. 2019, HF's initializer_range).
    A pre-LN stack's residual stream grows with depth, so there the output projections take
    GPT-2's 1/sqrt(2 * layers) scaling (Radford et al. 2019, sec. 2.3); post-LN renormalises it."""
    model, seed = config.model, config.train.seed
    pre_norm = model.layernorm_position == "pre"
    output_std = residual_std(model.init_std, model.num_layers) if pre_norm else model.init_std

    def init(sublayer: str):
        return lambda part: normal_init(
            output_std if part in ("output", "proj") else model.init_std, seed, f"blocks.{layer}.{sublayer}.{part}"
        )

    mp_config = model_parallel_config(config)
    attention = ParallelAttention(model.hidden_size, model.num_heads, mp_config, init("attention"),
                                  dropout=model.dropout, layer_index=layer)
    mlp = ParallelMLP(model.hidden_size, model.ffn_size, mp_config, init("mlp"), activation=gelu_erf)
    return TransformerBlock(attention, mlp, lambda: nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps),
                            pre_norm=pre_norm, dropout=model.dropout)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    model = config.model
    pre_norm = model.layernorm_position == "pre"
    sentence_order = config.objective.sentence_pairs != "none"
    span_boundary = [PipelineLayer("span_boundary_head", lambda: SpanBoundaryDecoderBias(config),
                                   functools.partial(run_span_boundary_decoder_bias, sentence_order=sentence_order))]
    return [
        PipelineLayer("embedding", lambda: BertEmbedding(config), run_embedding),
        *(PipelineLayer(f"blocks.{layer}", lambda layer=layer: build_block(config, layer), run_block, is_block=True)
          for layer in range(model.num_layers)),
        PipelineLayer(
            "final_norm",
            lambda: nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps) if pre_norm else nn.Identity(),
            run_final_norm,
        ),
        PipelineLayer("", lambda: BertHeads(config), run_heads),
        PipelineLayer("decoder", lambda: BertEmbedding(config),
                      functools.partial(run_tied_decoder, sentence_order=sentence_order), tied_to="embedding",
                      tied_weight="word.weight"),
        PipelineLayer("lm_head", lambda: DecoderBias(config), run_decoder_bias),
        *(span_boundary if config.objective.span_boundary else []),
    ]


def build(config: Config) -> BERT:
    return BERT(pipeline_layers(config), config.train.full_recompute_interval)


def counts(config: Config, labelled: float | None = None) -> ModelCounts:
    """BERT's encoder blocks as GPT's (Kaplan et al. 2020, table 1, without the causal mask); the MLM
    head (transform 2h² + decoder 2h·V) runs only at labelled positions (`labelled_positions`, or
    `labelled` per sample of one batch), the sentence-order head (pooler 2h² + classifier 4h)
    once per sample, and the span boundary head (W1 on [x_{s-1}; x_{e+1}; p] 6h², W2 2h², decoder 2h·V)
    at the labelled positions too; its relative-position table is a lookup table (embedding)."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, ffn, layers, seq = model.hidden_size, model.ffn_size, model.num_layers, model.seq_length
    pairs = config.objective.sentence_pairs != "none"
    block = 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn  # QKV, output, fc, proj (+ biases), 2 LNs
    embedding = (vocab + seq + model.type_vocab_size) * hidden
    final_norm = 2 * hidden if model.layernorm_position == "pre" else 0
    head = hidden * hidden + 3 * hidden + vocab  # transform dense + bias, LayerNorm, decoder bias
    sentence_order = hidden * hidden + hidden + 2 * hidden + 2 if pairs else 0
    span_boundary = config.objective.span_boundary
    if span_boundary:
        embedding += labelled_positions(config) * hidden  # relative positions 1..the longest masked run
    # W1 [3h -> h] and W2 + biases, two LayerNorms, its own decoder bias
    span_boundary_head = 4 * hidden * hidden + 6 * hidden + vocab if span_boundary else 0
    total = embedding + 2 * hidden + layers * block + final_norm + head + sentence_order + span_boundary_head
    labelled = labelled_positions(config) if labelled is None else labelled
    sample_flops = seq * layers * transformer_block_flops(hidden, ffn, seq)
    sample_flops += labelled * (2 * hidden * hidden + 2 * hidden * vocab)
    if pairs:
        sample_flops += 2 * hidden * hidden + 4 * hidden
    if span_boundary:
        sample_flops += labelled * (8 * hidden * hidden + 2 * hidden * vocab)
    return ModelCounts(
        total_params=total, embedding_params=embedding, flops_per_token=3.0 * sample_flops / seq,
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + (m/s)·(2h² + 2h·V) [+ (2h² + 4h)/s with NSP/SOP] "
                      "[+ (m/s)·(8h² + 2h·V) with SBO]) with m the labelled positions per sample "
                      "(Kaplan et al. 2020, table 1)",
    )


def validate(config: Config) -> None:
    refuse_loss_chunking(config, "its masked-LM logits are made at the masked positions only (about 15% of the "
                                 "tokens) and take a bias after the output layer")
    model = config.model
    if model.layernorm_position not in LAYERNORM_POSITIONS:
        raise ConfigError(f"model.layernorm_position={model.layernorm_position!r}; use post (BERT) or pre")
    minimum_types = 2 if config.objective.sentence_pairs != "none" else 1
    if model.type_vocab_size < minimum_types:
        raise ConfigError(
            f"model.type_vocab_size={model.type_vocab_size}; sentence pairs need segment ids 0 and 1, "
            f"so use >= {minimum_types}"
        )


def batch_schema(config: Config) -> BatchSchema:
    span_boundaries = SPAN_BOUNDARY_KEYS if config.objective.span_boundary else ()
    return BatchSchema(inputs=("tokens", "token_types", "padding_mask", *span_boundaries), labels=("labels",),
                       optional_labels=("sentence_order_labels",))
