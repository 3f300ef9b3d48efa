"""BART (Lewis et al. 2020): a denoising encoder-decoder with learned positions and post-norm blocks.

As Hugging Face's `BartForConditionalGeneration` (families/bart/hf.py maps the names): one
vocab-parallel token embedding shared by the encoder, the decoder and the tied output layer;
learned positions per stack (HF's table has 2 rows more, its position offset, kept here so the
tables match row for row); LayerNorm over each stack's embedded input (`layernorm_embedding`);
post-norm blocks with biases and exact GELU (the Transformer's, Vaswani et al. 2017, which
BART's base follows, sec. 2.1); no final norm; a zero logits bias (HF's `final_logits_bias`, a
buffer, not a parameter). One `model.dropout` is BART's dropout, attention and activation dropout.

Pipeline layers, with T5's activations (families/t5/model.py) between them, so `EncoderDecoderLM` runs,
encodes, decodes with a KV cache and generates it as it does T5:

    embedding ........................ (encoder_tokens, decoder_tokens, encoder_mask, decoder_mask)
                                       -> (hidden, encoder_mask, decoder_tokens, decoder_mask)
    encoder.positions, .embedding_norm, encoder.layers.{i} ... same
    decoder.embedding (tied) ......... -> (hidden, encoder_output, encoder_mask, decoder_mask)
    decoder.positions, .embedding_norm, decoder.layers.{i} ... same
    output (tied) .................... -> (logits [seq, batch, vocab / TP],)
    final_logits_bias ................ same
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from scaletrain.config import Config, ConfigError, ModelConfig, ObjectiveConfig, bounded
from scaletrain.data.errors import DataError
from scaletrain.families.bart.noising import DenoisingNoise
from scaletrain.model.chunked_cross_entropy import refuse_loss_chunking
from scaletrain.model.counts import ModelCounts
from scaletrain.model.encoder_decoder import (
    DECODER_EMBEDDING,
    EncoderDecoderLM,
    check_split_evenly,
    encoder_decoder_flops_per_token,
)
from scaletrain.model.family import PipelineLayer
from scaletrain.model.init import normal_init
from scaletrain.model.layers import (
    KVCache,
    ParallelAttention,
    ParallelMLP,
    TransformerBlock,
    gelu_erf,
    key_padding_attention_mask,
    parallel_lm_logits,
)
from scaletrain.model.parallel_config import model_parallel_config

POSITION_OFFSET = 2  # HF's BartLearnedPositionalEmbedding looks up position + 2 (fairseq's padding_idx legacy)


@dataclass
class DenoisingObjective(ObjectiveConfig):
    """BART's `objective:` section: its denoising (Lewis et al. 2020, sec. 2.2). The default is the paper's best
    (sec. 5.1): text_infilling + sentence_permutation."""

    # the noising functions: any of sentence_permutation, document_rotation, token_masking, token_deletion,
    # text_infilling, which run in that order (families/bart/noising.py)
    noising: list[str] = field(default_factory=lambda: ["text_infilling", "sentence_permutation"])
    # the share of tokens the infilled spans cover (sec. 5.1)
    infilling_ratio: float = bounded(0.3, "[0, 1)", "BART infills 0.3")
    infilling_poisson_lambda: float = bounded(3.0, "> 0", "BART: 3.0")  # spans ~ Poisson(lambda) (sec. 2.2)
    mask_prob: float = bounded(0.15, "(0, 1)")  # token_masking's share of tokens
    deletion_ratio: float = bounded(0.15, "[0, 1)")  # share of tokens token_deletion removes


@dataclass
class BartConfig(ModelConfig):
    """model.seq_length is the encoder's and the decoder's length (families/bart/noising.py)."""

    objective_section = DenoisingObjective

    num_decoder_layers: int | None = bounded(None, ">= 1", "or null: model.num_layers")  # None: model.num_layers
    max_position_embeddings: int | None = None  # learned positions per stack; None: model.seq_length


@dataclass(frozen=True)
class BartArchitecture:
    """Shapes of one BART. `vocab_size` is the padded vocabulary (every TP shard gets equal rows)."""

    vocab_size: int
    hidden_size: int  # d_model
    num_heads: int
    ffn_hidden_size: int
    num_encoder_layers: int
    num_decoder_layers: int
    max_position_embeddings: int
    layernorm_eps: float = 1e-5
    init_std: float = 0.02  # every weight, as HF's init_std
    dropout: float = 0.0


class FinalLogitsBias(nn.Module):
    """HF's `final_logits_bias`: a zero buffer over this rank's vocabulary shard, never trained."""

    def __init__(self, local_vocab_size: int) -> None:
        super().__init__()
        self.register_buffer("bias", torch.zeros(local_vocab_size), persistent=False)


def build_layer(architecture: BartArchitecture, mp_config: ModelParallelConfig, seed: int, prefix: str,
                decoder: bool, index: int) -> TransformerBlock:
    """Post-norm block: x = N(x + SelfAttn(x)), [x = N(x + CrossAttn(x, enc))], x = N(x + FFN(x)),
    with biases, 1/sqrt(head_dim) score scale and exact GELU (HF's BartEncoderLayer / BartDecoderLayer)."""
    hidden, std, dropout = architecture.hidden_size, architecture.init_std, architecture.dropout

    def init(sublayer: str):
        return lambda part: normal_init(std, seed, f"{prefix}.{sublayer}.{part}")

    attention = ParallelAttention(hidden, architecture.num_heads, mp_config, init("self_attention"),
                                  causal=decoder, dropout=dropout, layer_index=index)
    cross = None
    if decoder:
        cross = ParallelAttention(hidden, architecture.num_heads, mp_config, init("cross_attention"), cross=True,
                                  dropout=dropout)
    mlp = ParallelMLP(hidden, architecture.ffn_hidden_size, mp_config, init("mlp"), activation=gelu_erf,
                      inner_dropout=dropout)
    return TransformerBlock(attention, mlp, lambda: nn.LayerNorm(hidden, eps=architecture.layernorm_eps),
                            pre_norm=False, cross_attention=cross, dropout=dropout)


def _embed(embedding: nn.Module, activations: tuple, **_) -> tuple:
    encoder_tokens, decoder_tokens, encoder_mask, decoder_mask = activations
    return embedding(encoder_tokens).transpose(0, 1).contiguous(), encoder_mask, decoder_tokens, decoder_mask


def _add_positions(positions: nn.Embedding, activations: tuple, cache: KVCache | None = None, **_) -> tuple:
    """Positions start past the cached ones when decoding incrementally."""
    hidden, *rest = activations
    start = (cache.length if cache is not None else 0) + POSITION_OFFSET
    indices = torch.arange(start, start + hidden.shape[0], device=hidden.device)
    return hidden + positions(indices)[:, None, :], *rest


def _embedding_norm(norm: nn.LayerNorm, activations: tuple, dropout: float, **_) -> tuple:
    hidden, *rest = activations
    return F.dropout(norm(hidden), dropout, norm.training), *rest


def _encoder_block(block: TransformerBlock, activations: tuple, **_) -> tuple:
    hidden, encoder_mask, *rest = activations
    return block(hidden, _padding_allowed(encoder_mask)), encoder_mask, *rest


def _decoder_embed(embedding: nn.Module, activations: tuple, **_) -> tuple:
    encoder_output, encoder_mask, decoder_tokens, decoder_mask = activations
    return embedding(decoder_tokens).transpose(0, 1).contiguous(), encoder_output, encoder_mask, decoder_mask


def _decoder_block(block: TransformerBlock, activations: tuple, cache: KVCache | None = None, **_) -> tuple:
    """Causal self-attention (the attention's own causal mask when no decoder padding is given),
    cross-attention over the unpadded encoder positions."""
    hidden, encoder_output, encoder_mask, decoder_mask = activations
    self_mask = None
    if decoder_mask is not None:
        keys = torch.arange(decoder_mask.shape[1], device=hidden.device)
        self_mask = (keys[None, :] <= keys[-hidden.shape[0]:, None]) & _padding_allowed(decoder_mask)
    hidden = block(hidden, self_mask, encoder_output=encoder_output, cross_mask=_padding_allowed(encoder_mask),
                   cache=cache)
    return hidden, encoder_output, encoder_mask, decoder_mask


def _tied_output(embedding: nn.Module, activations: tuple, **_) -> tuple:
    return (parallel_lm_logits(activations[0], embedding.weight),)


def _add_logits_bias(bias: FinalLogitsBias, activations: tuple, **_) -> tuple:
    return (activations[0] + bias.bias,)


def _padding_allowed(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if padding_mask is None else key_padding_attention_mask(padding_mask)


def bart_layers(architecture: BartArchitecture, mp_config: ModelParallelConfig, seed: int) -> list[PipelineLayer]:
    """BART as pipeline layers (the module docstring lists them); the decoder embedding and the
    output layer reuse the shared `embedding`."""
    check_split_evenly(architecture, mp_config.tensor_model_parallel_size)
    hidden, std = architecture.hidden_size, architecture.init_std
    dropout = {"dropout": architecture.dropout}

    def embedding() -> nn.Module:
        return tensor_parallel.VocabParallelEmbedding(
            architecture.vocab_size, hidden, init_method=normal_init(std, seed, "embedding"), config=mp_config)

    def stack(name: str, decoder: bool, count: int, block_run) -> list[PipelineLayer]:
        def positions() -> nn.Embedding:
            table = nn.Embedding(architecture.max_position_embeddings + POSITION_OFFSET, hidden)
            with torch.no_grad():
                normal_init(std, seed, f"{name}.positions")(table.weight)
            return table

        return [
            PipelineLayer(f"{name}.positions", positions, _add_positions),
            PipelineLayer(f"{name}.embedding_norm", lambda: nn.LayerNorm(hidden, eps=architecture.layernorm_eps),
                          partial(_embedding_norm, **dropout)),
            *(PipelineLayer(f"{name}.layers.{index}", lambda index=index: build_layer(
                architecture, mp_config, seed, f"{name}.layers.{index}", decoder, index), block_run, is_block=True)
              for index in range(count)),
        ]

    return [
        PipelineLayer("embedding", embedding, _embed),
        *stack("encoder", False, architecture.num_encoder_layers, _encoder_block),
        PipelineLayer(DECODER_EMBEDDING, embedding, _decoder_embed, tied_to="embedding", tied_weight="weight"),
        *stack("decoder", True, architecture.num_decoder_layers, _decoder_block),
        PipelineLayer("output", embedding, _tied_output, tied_to="embedding", tied_weight="weight"),
        PipelineLayer("final_logits_bias", lambda: FinalLogitsBias(
            architecture.vocab_size // mp_config.tensor_model_parallel_size), _add_logits_bias),
    ]


class BART(EncoderDecoderLM):
    """Encoder-decoder LM: shared vocab-parallel embedding, two post-norm stacks, tied output layer."""

    def __init__(self, architecture: BartArchitecture, mp_config: ModelParallelConfig, seed: int,
                 checkpoint_interval: int = 0) -> None:
        super().__init__(bart_layers(architecture, mp_config, seed), checkpoint_interval)
        self.architecture = architecture


def architecture(config: Config) -> BartArchitecture:
    model = config.model
    return BartArchitecture(
        vocab_size=config.padded_vocab_size,
        hidden_size=model.hidden_size,
        num_heads=model.num_heads,
        ffn_hidden_size=model.ffn_size,
        num_encoder_layers=model.num_layers,
        num_decoder_layers=model.num_decoder_layers or model.num_layers,
        max_position_embeddings=model.max_position_embeddings or model.seq_length,
        layernorm_eps=model.layernorm_eps,
        init_std=model.init_std,
        dropout=model.dropout,
    )


def build(config: Config) -> BART:
    return BART(architecture(config), model_parallel_config(config), config.train.seed,
                config.train.full_recompute_interval)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    return bart_layers(architecture(config), model_parallel_config(config), config.train.seed)


def counts(config: Config) -> ModelCounts:
    """Parameters as HF's BartForConditionalGeneration counts them: the shared table once, two
    position tables of max_position_embeddings + 2 rows, two embedding LayerNorms, per encoder
    layer 4h² + 4h attention, 2h·f + f + h FFN and 2 LayerNorms, per decoder layer self- and
    cross-attention and 3 LayerNorms; the tied output layer and the logits-bias buffer add none.
    FLOPs: T5's formula (encoder_decoder_flops_per_token) with attention width i = h, a 2h·f FFN,
    and encoder and decoder both over s = model.seq_length positions (families/bart/noising.py)."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, ffn, seq = model.hidden_size, model.ffn_size, model.seq_length
    encoder_layers, decoder_layers = model.num_layers, model.num_decoder_layers or model.num_layers
    attention = 4 * hidden * hidden + 4 * hidden
    mlp = 2 * hidden * ffn + ffn + hidden
    positions = 2 * ((model.max_position_embeddings or seq) + POSITION_OFFSET) * hidden
    total = (vocab * hidden + positions + 2 * 2 * hidden + encoder_layers * (attention + mlp + 2 * 2 * hidden)
             + decoder_layers * (2 * attention + mlp + 3 * 2 * hidden))
    return ModelCounts(
        total_params=total, embedding_params=vocab * hidden + positions,
        flops_per_token=encoder_decoder_flops_per_token(hidden, hidden, 2 * hidden * ffn, vocab, encoder_layers,
                                                        decoder_layers, seq, seq),
        flops_formula="3·(s·L_e·(8h² + 4h·f + 4h·s) + L_d·(s·(12h² + 4h·f + 8h·s) + 4h²·s) + 2h·V·s) / s "
                      "(Kaplan et al. 2020, table 1, per stack; encoder and decoder over s tokens)",
    )


def validate(config: Config) -> None:
    refuse_loss_chunking(config, "its logits take final_logits_bias after the output layer, which the chunked loss "
                                 "does not add")
    model, objective = config.model, config.objective
    positions = model.max_position_embeddings
    if positions is not None and positions < model.seq_length:
        raise ConfigError(f"model.max_position_embeddings={positions} < model.seq_length={model.seq_length}; "
                          f"raise it to >= {model.seq_length} or leave it unset")
    try:
        DenoisingNoise(tuple(objective.noising), objective.infilling_ratio, objective.infilling_poisson_lambda,
                       objective.mask_prob, objective.deletion_ratio)
    except DataError as error:
        raise ConfigError(f"objective.noising: {error}") from None
