"""GPT decoder (Radford et al. 2018/2019, Brown et al. 2020): learned positions, pre-LN blocks with
biases and GELU, final LayerNorm, output layer tied to the word embedding."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import tensor_parallel
from torch import nn

from scaletrain.batch import BatchSchema
from scaletrain.config import Config, ConfigError, ModelConfig
from scaletrain.model.counts import MLPCounts, ModelCounts, mlp_counts
from scaletrain.model.family import LayeredModel, ModelFamily, PipelineLayer, lazy
from scaletrain.model.init import normal_init, residual_std
from scaletrain.model.layers import (
    KVCache,
    ParallelAttention,
    TransformerBlock,
    full_sequence_length,
    gelu_tanh,
    masked_vocab_parallel_loss,
    parallel_lm_logits,
)
from scaletrain.model.moe import MoEConfig, block_mlp, validate_moe
from scaletrain.model.parallel_config import model_parallel_config
from scaletrain.parallel.sequence_parallel import mark_sequence_parallel, scatter_to_sequence_parallel

DECODER_BATCH = BatchSchema(inputs=("tokens",), labels=("labels",), optional_inputs=("prefix_lengths",))


@dataclass
class GPTConfig(ModelConfig):
    """GPT's keys beyond the shared ones: its MLPs may be mixtures of experts (Switch-style GELU experts)."""

    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts MLPs (model/moe.py)


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

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
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
        causal=True, dropout=model.dropout, layer_index=layer,
    )
    mlp = block_mlp(model.moe, layer, model.hidden_size, model.ffn_size, mp_config, lambda part: init(part, "mlp"),
                    config.train.grad_accum, activation=gelu_tanh)
    return sequence_parallel_region(config, TransformerBlock(
        attention, mlp, lambda: nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps), dropout=model.dropout
    ))


def sequence_parallel_region(config: Config, module: nn.Module) -> nn.Module:
    """Under sequence parallelism a block's (and the final norm's) replicated parameters see one
    sequence slice per TP rank: mark them, so their gradients are summed over TP ranks."""
    if config.parallel.sequence_parallel:
        mark_sequence_parallel(module)
    return module


def prefix_lm_attention_mask(prefix_lengths: torch.Tensor, seq_length: int) -> torch.Tensor:
    """SDPA boolean mask [batch, 1, seq, seq]: query i sees key j if j <= i (causal) or j is in the prefix
    (a prefix LM, Raffel et al. 2020, sec. 3.2.3)."""
    positions = torch.arange(seq_length, device=prefix_lengths.device)
    causal = positions[None, :] <= positions[:, None]
    in_prefix = positions[None, None, :] < prefix_lengths[:, None, None]
    return (causal[None] | in_prefix)[:, None]


# Activations between layers: (hidden [seq, batch, h],) or (hidden, prefix_lengths) for a prefix LM.


def _embed(embedding: GPTEmbedding, activations: tuple, cache: KVCache | None = None, **_) -> tuple:
    tokens, *rest = activations
    return (embedding(tokens, start=cache.length if cache is not None else 0), *rest)


def run_decoder_block(block: TransformerBlock, activations: tuple, cache: KVCache | None = None, **_) -> tuple:
    """A causal block on (hidden, [prefix_lengths]); shared by every decoder family."""
    hidden, *rest = activations
    seq_length = full_sequence_length(hidden, block.attention.sequence_parallel)
    mask = prefix_lm_attention_mask(rest[0], seq_length) if rest else None
    return (block(hidden, mask, cache=cache), *rest)


def run_final_norm(norm: nn.Module, activations: tuple, **_) -> tuple:
    """The final norm on the hidden state; whatever travelled beside it (masks) ends here."""
    return (norm(activations[0]),)


def _tied_output(embedding: GPTEmbedding, activations: tuple, cache: KVCache | None = None, **_) -> tuple:
    return (parallel_lm_logits(activations[0], embedding.word.weight, embedding.sequence_parallel),)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    model = config.model
    return [
        PipelineLayer("embedding", lambda: GPTEmbedding(config), _embed),
        *(PipelineLayer(f"blocks.{layer}", lambda layer=layer: build_block(config, layer), run_decoder_block,
                        is_block=True) for layer in range(model.num_layers)),
        PipelineLayer("final_norm", lambda: sequence_parallel_region(
            config, nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps)), run_final_norm),
        PipelineLayer("output", lambda: GPTEmbedding(config), _tied_output, tied_to="embedding",
                      tied_weight="word.weight"),
    ]


def lm_loss(outputs: tuple, labels: tuple) -> torch.Tensor:
    """Mean next-token cross-entropy over labels != -100."""
    return masked_vocab_parallel_loss(outputs[0], labels[0])


class DecoderLM(LayeredModel):
    """A causal LM's forward: loss with labels, vocab-parallel logits [batch, seq, vocab / TP] without.
    With prefix_lengths [batch] it is a prefix LM; with a KVCache it decodes incrementally."""

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        prefix_lengths: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        inputs = (tokens,) if prefix_lengths is None else (tokens, prefix_lengths)
        (logits,) = self.run_layers(inputs, cache=cache)
        if cache is not None:
            cache.length += tokens.shape[1]
        if labels is None:
            return logits.transpose(0, 1)
        return masked_vocab_parallel_loss(logits, labels)


def build(config: Config) -> DecoderLM:
    return DecoderLM(pipeline_layers(config), config.train.activation_checkpoint_interval)


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
    ffn = (model.moe.ffn_hidden_size or model.ffn_size) if model.moe.is_moe_layer(layer) else model.ffn_size
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
    if config.model.ffn_size < 1:
        raise ConfigError(f"model.ffn_hidden_size={config.model.ffn_hidden_size} must be >= 1")
    problems = validate_moe(config.model.moe, config.parallel.sequence_parallel)
    if problems:
        raise ConfigError(problems[0])


FAMILY = ModelFamily(
    name="gpt",
    config_class=GPTConfig,
    build=build,
    pipeline_layers=pipeline_layers,
    loss=lm_loss,
    objectives=("causal_lm", "prefix_lm"),
    pipeline_objectives=("causal_lm", "prefix_lm"),
    sequence_parallel=True,
    batch_schema=lambda config: DECODER_BATCH,
    counts=counts,
    validate=validate,
    hf=lazy("scaletrain.checkpoint.hf.gpt:ADAPTER"),
    generation="causal",
)
