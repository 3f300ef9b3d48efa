"""T5 encoder-decoder (Raffel et al. 2020) with heads, FFN columns and vocabulary split across TP ranks.

Covers original T5 (ReLU FFN, output layer tied to the embedding) and T5 v1.1 (gated-GELU FFN,
untied output layer). Activations are [sequence, batch, hidden] as in layers.py; families/t5/hf.py
maps the parameter names onto Hugging Face's `T5ForConditionalGeneration`.

The model is a list of pipeline layers (model/family.py) that `T5` runs on one device and
model/pipeline.py cuts into DeepSpeed stages. Activations between them, masks [batch, seq]
(1 = real token) as integers, so DeepSpeed passes them without gradients (None only on one device):

    embedding ........................ (encoder_tokens, decoder_tokens, encoder_mask, decoder_mask)
                                       -> (hidden, encoder_mask, decoder_tokens, decoder_mask)
    encoder.relative_position_bias ... -> (hidden, bias, encoder_mask, decoder_tokens, decoder_mask)
    encoder.layers.{i} (blocks) ...... same
    encoder.final_norm ............... -> (encoder_output, encoder_mask, decoder_tokens, decoder_mask)
    decoder.embedding (tied) ......... -> (hidden, encoder_output, encoder_mask, decoder_mask)
    decoder.relative_position_bias ... -> (hidden, bias, encoder_output, encoder_mask, decoder_mask)
    decoder.layers.{i} (blocks) ...... same
    decoder.final_norm ............... -> (decoder_output,)
    output (tied) or lm_head ......... -> (logits [seq, batch, vocab / TP],)

The decoder embedding and the original T5's output layer are tied to `embedding`: one shared
vocabulary matrix, whose gradient DeepSpeed all-reduces between the stages holding a copy. As in
T5, one relative-position table serves a whole stack: its bias is computed once, before the first
block, and every block adds the same bias (HF stores the table in block 0). The bias travels with
all heads ([queries, keys, heads], gathered across TP ranks; each block takes its own heads), so
every TP rank of a stage sends the same activations, and its gradient comes back through the pipe
to the table. The encoder output travels down the decoder's stages for cross-attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from scaletrain.config import Config, ConfigError, ModelConfig, ObjectiveConfig, bounded
from scaletrain.families.t5.span_corruption import random_spans_helper
from scaletrain.model.chunked_cross_entropy import refuse_loss_chunking
from scaletrain.model.counts import ModelCounts
from scaletrain.model.encoder_decoder import (
    DECODER_EMBEDDING,
    EncoderDecoderLM,
    check_split_evenly,
    encoder_decoder_flops_per_token,
)
from scaletrain.model.family import PipelineLayer
from scaletrain.model.init import InitMethod, normal_init
from scaletrain.model.layers import (
    KVCache,
    ParallelAttention,
    ParallelMLP,
    RMSNorm,
    TransformerBlock,
    gelu_tanh,
    parallel_lm_logits,
)
from scaletrain.model.parallel_config import model_parallel_config
from scaletrain.parallel.sharding import gather_last_dim

FFN_ACTIVATIONS = ("relu", "gated-gelu")


@dataclass
class SpanCorruptionObjective(ObjectiveConfig):
    """T5's `objective:` section: span corruption (Raffel et al. 2020, sec. 3.1.4 and 3.3.4, families/t5/
    span_corruption.py); prefix_lm takes no settings."""

    noise_density: float = bounded(0.15, "(0, 1)", "T5: 0.15")  # share of tokens corrupted
    mean_noise_span_length: float = bounded(3.0, ">= 1", "T5: 3")  # mean corrupted span, in tokens


@dataclass
class T5Config(ModelConfig):
    """model.seq_length is the encoder length; the decoder length follows from the objective."""

    objective_section = SpanCorruptionObjective

    num_decoder_layers: int | None = bounded(None, ">= 1", "or null: model.num_layers")  # None: model.num_layers
    ffn_activation: str = "gated-gelu"  # relu (T5) | gated-gelu (T5 v1.1)
    tie_embeddings: bool = True  # tied output with d_model**-0.5 scaling (original T5) or untied (v1.1)
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128


@dataclass(frozen=True)
class T5Architecture:
    """Shapes of one T5. `vocab_size` is the padded vocabulary (every TP shard gets equal rows)."""

    vocab_size: int
    hidden_size: int  # d_model
    num_heads: int
    head_dim: int  # d_kv; num_heads * head_dim may differ from hidden_size (T5-3B, T5-11B)
    ffn_hidden_size: int  # d_ff
    num_encoder_layers: int
    num_decoder_layers: int
    ffn_activation: str = "gated-gelu"  # relu (T5) | gated-gelu (T5 v1.1)
    tie_embeddings: bool = False  # True: original T5's tied output layer with d_model**-0.5 scaling
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layernorm_eps: float = 1e-6
    dropout: float = 0.0  # v1.1 pretrains without dropout

    @property
    def attention_size(self) -> int:
        return self.num_heads * self.head_dim


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5 sec. 2.1 / Mesh TensorFlow `_relative_position_bucket`: relative_position = key - query.

    Half the buckets (per direction) hold exact offsets, the other half logarithmically wider
    ranges up to `max_distance`, beyond which all offsets share the last bucket. The decoder is
    causal, so only offsets <= 0 get buckets there. The float arithmetic follows Hugging Face's
    port operation for operation, so bucket boundaries agree exactly.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """One learned scalar per (bucket, head), added to attention scores (T5 sec. 2.1).

    The [num_buckets, num_heads] table is split by heads like the attention it feeds: each rank
    holds its heads' columns, marked with megatron's partition attributes so shards merge.
    """

    def __init__(
        self, architecture: T5Architecture, bidirectional: bool, mp_config: ModelParallelConfig, init_method: InitMethod
    ) -> None:
        super().__init__()
        world = mp_config.tensor_model_parallel_size
        self.bidirectional = bidirectional
        self.num_buckets = architecture.relative_attention_num_buckets
        self.max_distance = architecture.relative_attention_max_distance
        full = init_method(torch.empty(self.num_buckets, architecture.num_heads))
        local = full.chunk(world, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
        self.weight = nn.Parameter(local.to(mp_config.params_dtype).contiguous())
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight, True, 1, 1)

    def forward(self, query_length: int, key_length: int, query_start: int = 0) -> torch.Tensor:
        """Bias [query_length, key_length, all heads] for queries at query_start.. (decoding with a
        KV cache starts past the cached positions), gathered from the TP ranks' heads."""
        queries = torch.arange(query_start, query_start + query_length, device=self.weight.device)
        keys = torch.arange(key_length, device=self.weight.device)
        relative = keys[None, :] - queries[:, None]
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return _GatherHeads.apply(F.embedding(buckets, self.weight))


class _GatherHeads(torch.autograd.Function):
    """[..., local heads] -> [..., all heads], concatenated in TP rank order; backward keeps this
    rank's heads' gradient. (megatron's gather_from_tensor_model_parallel_region allocates on CUDA.)"""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        world = parallel_state.get_tensor_model_parallel_world_size()
        return grad.chunk(world, dim=-1)[parallel_state.get_tensor_model_parallel_rank()].contiguous()


def build_layer(
    architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, prefix: str, decoder: bool, index: int
) -> TransformerBlock:
    """Pre-norm block from the kit: x + SelfAttn(N(x)), [x + CrossAttn(N(x), enc)] in the decoder,
    x + FFN(N(x)); RMSNorm, no biases, no 1/sqrt(d) score scale (T5 folds it into the query init),
    ReLU or gated-GELU FFN with dropout inside. Each weight is initialised as Mesh TF does, from the
    stream of its HF name (fused weights stacked from their parts' streams)."""
    hidden, inner, ffn = architecture.hidden_size, architecture.attention_size, architecture.ffn_hidden_size

    def attention_init(name: str):
        q = normal_init((hidden * architecture.head_dim) ** -0.5, seed, f"{name}.q")
        k, v = (normal_init(hidden**-0.5, seed, f"{name}.{part}") for part in "kv")
        return {"qkv": _stacked_init([q, k, v]), "query": q, "key_value": _stacked_init([k, v]),
                "output": normal_init(inner**-0.5, seed, f"{name}.o")}.__getitem__

    gated = architecture.ffn_activation == "gated-gelu"
    wi_parts = ["wi_0", "wi_1"] if gated else ["wi"]
    mlp_init = {"fc": _stacked_init([normal_init(hidden**-0.5, seed, f"{prefix}.ffn.{part}") for part in wi_parts]),
                "proj": normal_init(ffn**-0.5, seed, f"{prefix}.ffn.wo")}.__getitem__
    common = {"num_kv_heads": architecture.num_heads, "head_dim": architecture.head_dim, "bias": False,
              "dropout": architecture.dropout, "scale": 1.0}
    attention = ParallelAttention(hidden, architecture.num_heads, mp_config,
                                  attention_init(f"{prefix}.self_attention"), layer_index=index, **common)
    cross = None
    if decoder:
        cross = ParallelAttention(hidden, architecture.num_heads, mp_config,
                                  attention_init(f"{prefix}.cross_attention"), cross=True, **common)
    # HF "gelu_new": the tanh approximation used by the v1.1 checkpoints.
    mlp = ParallelMLP(hidden, ffn, mp_config, mlp_init, activation=gelu_tanh if gated else F.relu, gated=gated,
                      bias=False, inner_dropout=architecture.dropout)
    return TransformerBlock(attention, mlp, lambda: RMSNorm(hidden, architecture.layernorm_eps),
                            cross_attention=cross, dropout=architecture.dropout)


def _embed(embedding: nn.Module, activations: tuple, dropout: float, **_) -> tuple:
    """Each stack drops out its embedded input and its final norm's output (HF's T5Stack)."""
    encoder_tokens, decoder_tokens, encoder_mask, decoder_mask = activations
    return _embed_tokens(embedding, encoder_tokens, dropout), encoder_mask, decoder_tokens, decoder_mask


def _embed_tokens(embedding: nn.Module, tokens: torch.Tensor, dropout: float) -> torch.Tensor:
    return F.dropout(embedding(tokens).transpose(0, 1), dropout, embedding.training)


def _encoder_bias(table: RelativePositionBias, activations: tuple, **_) -> tuple:
    hidden, *rest = activations
    return hidden, table(hidden.shape[0], hidden.shape[0]), *rest


def _encoder_block(block: TransformerBlock, activations: tuple, **_) -> tuple:
    hidden, bias, encoder_mask, *rest = activations
    mask = _mask_bias(_local_heads(bias), _key_padding_allowed(encoder_mask))
    return block(hidden, mask), bias, encoder_mask, *rest


def _encoder_final_norm(norm: RMSNorm, activations: tuple, dropout: float, **_) -> tuple:
    hidden, _, *rest = activations
    return F.dropout(norm(hidden), dropout, norm.training), *rest


def _decoder_embed(embedding: nn.Module, activations: tuple, dropout: float, **_) -> tuple:
    encoder_output, encoder_mask, decoder_tokens, decoder_mask = activations
    return _embed_tokens(embedding, decoder_tokens, dropout), encoder_output, encoder_mask, decoder_mask


def _decoder_bias(table: RelativePositionBias, activations: tuple, cache: KVCache | None = None, **_) -> tuple:
    hidden, *rest = activations
    past = cache.length if cache is not None else 0
    return hidden, table(hidden.shape[0], past + hidden.shape[0], query_start=past), *rest


def _decoder_block(block: TransformerBlock, activations: tuple, cache: KVCache | None = None, **_) -> tuple:
    hidden, bias, encoder_output, encoder_mask, decoder_mask = activations
    bias_local = _local_heads(bias)
    queries, keys = bias_local.shape[-2:]
    positions = torch.arange(keys, device=bias.device)
    allowed = positions[None, :] <= positions[keys - queries:, None]  # causal, past the cached positions
    padding = _key_padding_allowed(decoder_mask)
    self_mask = _mask_bias(bias_local, allowed if padding is None else padding & allowed)
    cross_mask = None
    if encoder_mask is not None:
        # T5's cross-attention has no position bias, only the encoder padding mask.
        cross_mask = _mask_bias(hidden.new_zeros(1, 1, 1, 1), _key_padding_allowed(encoder_mask))
    hidden = block(hidden, self_mask, encoder_output=encoder_output, cross_mask=cross_mask, cache=cache)
    return hidden, bias, encoder_output, encoder_mask, decoder_mask


def _decoder_final_norm(norm: RMSNorm, activations: tuple, dropout: float, **_) -> tuple:
    return (F.dropout(norm(activations[0]), dropout, norm.training),)


def _tied_output(embedding: nn.Module, activations: tuple, **_) -> tuple:
    """Mesh TF rescales before the tied output layer by d_model**-0.5, since the embedding has unit variance."""
    (hidden,) = activations
    return (parallel_lm_logits(hidden * embedding.weight.shape[1] ** -0.5, embedding.weight),)


def _untied_output(lm_head: nn.Module, activations: tuple, **_) -> tuple:
    logits, _ = lm_head(activations[0])
    return (logits,)


def _local_heads(bias: torch.Tensor) -> torch.Tensor:
    """[queries, keys, all heads] -> this rank's heads [1, local heads, queries, keys]. The copy's
    backward sums the ranks' gradients (each nonzero on its own heads only), so the bias gradient
    is whole and the same on every TP rank."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    bias = tensor_parallel.copy_to_tensor_model_parallel_region(bias)
    local = bias.chunk(world, dim=-1)[parallel_state.get_tensor_model_parallel_rank()]
    return local.permute(2, 0, 1).unsqueeze(0)


def t5_layers(architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int) -> list[PipelineLayer]:
    """T5 as pipeline layers (the module docstring lists their activations); the decoder embedding and the tied
    output layer reuse the shared `embedding`."""
    check_tensor_parallel(architecture, mp_config.tensor_model_parallel_size)
    hidden, vocab = architecture.hidden_size, architecture.vocab_size
    dropout = {"dropout": architecture.dropout}

    def embedding() -> nn.Module:
        # Unit-variance embedding (Mesh TF / T5X); with the d_model**-0.5 output scaling of the
        # tied head, or the fan-in init of the untied one, initial logits have unit variance.
        return tensor_parallel.VocabParallelEmbedding(
            vocab, hidden, init_method=normal_init(1.0, seed, "embedding"), config=mp_config)

    def table(name: str, decoder: bool):
        # A fresh init stream per build: DeepSpeed builds a layer once more to count its parameters.
        return lambda: RelativePositionBias(
            architecture, not decoder, mp_config, normal_init(hidden**-0.5, seed, f"{name}.relative_position_bias"))

    def blocks(name: str, decoder: bool, count: int, run) -> list[PipelineLayer]:
        return [PipelineLayer(f"{name}.layers.{index}", lambda index=index: build_layer(
            architecture, mp_config, seed, f"{name}.layers.{index}", decoder, index), run, is_block=True)
            for index in range(count)]

    def final_norm() -> nn.Module:
        return RMSNorm(hidden, architecture.layernorm_eps)

    if architecture.tie_embeddings:
        output = PipelineLayer("output", embedding, _tied_output, tied_to="embedding", tied_weight="weight")
    else:
        output = PipelineLayer("lm_head", lambda: tensor_parallel.ColumnParallelLinear(
            hidden, vocab, config=mp_config, bias=False, gather_output=False,
            init_method=normal_init(hidden**-0.5, seed, "lm_head")), _untied_output)
    return [
        PipelineLayer("embedding", embedding, partial(_embed, **dropout)),
        PipelineLayer("encoder.relative_position_bias", table("encoder", False), _encoder_bias),
        *blocks("encoder", False, architecture.num_encoder_layers, _encoder_block),
        PipelineLayer("encoder.final_norm", final_norm, partial(_encoder_final_norm, **dropout)),
        PipelineLayer(DECODER_EMBEDDING, embedding, partial(_decoder_embed, **dropout), tied_to="embedding",
                      tied_weight="weight"),
        PipelineLayer("decoder.relative_position_bias", table("decoder", True), _decoder_bias),
        *blocks("decoder", True, architecture.num_decoder_layers, _decoder_block),
        PipelineLayer("decoder.final_norm", final_norm, partial(_decoder_final_norm, **dropout)),
        output,
    ]


class T5(EncoderDecoderLM):
    """Encoder-decoder LM: shared vocab-parallel embedding, two stacks, vocab-parallel output layer."""

    def __init__(
        self, architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, checkpoint_interval: int = 0
    ) -> None:
        super().__init__(t5_layers(architecture, mp_config, seed), checkpoint_interval)
        self.architecture = architecture


def check_tensor_parallel(architecture: T5Architecture, tensor_parallel_size: int) -> None:
    """Heads, FFN columns and vocabulary rows are split evenly across TP ranks."""
    check_split_evenly(architecture, tensor_parallel_size)
    if architecture.ffn_activation not in FFN_ACTIVATIONS:
        raise ValueError(f"ffn_activation={architecture.ffn_activation!r}; use one of {', '.join(FFN_ACTIVATIONS)}")


def _key_padding_allowed(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[batch, keys] (1 = real token) -> boolean [batch, 1, 1, keys]."""
    return None if padding_mask is None else padding_mask.bool()[:, None, None, :]


def _mask_bias(bias: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Masked positions get the dtype's most negative value rather than -inf, so a query with no
    visible key (an all-padding row) gets uniform weights instead of NaN."""
    if allowed is None:
        return bias
    return torch.where(allowed, bias, torch.finfo(bias.dtype).min)


def _stacked_init(parts: list[InitMethod]) -> InitMethod:
    """Initialise a fused master weight as equal row blocks, each from its own named stream, so a
    fused weight equals its unfused parts (HF's q, k, v or wi_0, wi_1) in every layout."""

    def init(tensor: torch.Tensor) -> torch.Tensor:
        for part, rows in zip(parts, tensor.chunk(len(parts), dim=0), strict=True):
            part(rows)
        return tensor

    return init


def architecture(config: Config) -> T5Architecture:
    model = config.model
    return T5Architecture(
        vocab_size=config.padded_vocab_size,
        hidden_size=model.hidden_size,
        num_heads=model.num_heads,
        head_dim=model.attention_head_dim,
        ffn_hidden_size=model.ffn_size,
        num_encoder_layers=model.num_layers,
        num_decoder_layers=model.num_decoder_layers or model.num_layers,
        ffn_activation=model.ffn_activation,
        tie_embeddings=model.tie_embeddings,
        relative_attention_num_buckets=model.relative_attention_num_buckets,
        relative_attention_max_distance=model.relative_attention_max_distance,
        layernorm_eps=model.layernorm_eps,
        dropout=model.dropout,
    )


def build(config: Config) -> T5:
    return T5(architecture(config), model_parallel_config(config), config.train.seed,
              config.train.full_recompute_interval)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    return t5_layers(architecture(config), model_parallel_config(config), config.train.seed)


def counts(config: Config) -> ModelCounts:
    """Kaplan et al. 2020's per-operation counts (table 1) over T5's two stacks (Raffel et al. 2020,
    sec. 3.2.2: encoder over the inputs, decoder over the targets): encoder layers over s_e =
    model.seq_length tokens, decoder layers over the objective's s_d targets, each with self- and
    cross-attention; every decoder layer projects the s_e encoder outputs to keys and values, and
    the output layer (tied or not) computes logits at the s_d decoder positions. FLOPs per token
    divide by s_e. Attention width i = heads · head_dim may differ from h; g = 2 for gated-GELU."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, inner = model.hidden_size, model.num_heads * model.attention_head_dim
    gates = 2 if model.ffn_activation == "gated-gelu" else 1
    encoder_layers, decoder_layers = model.num_layers, model.num_decoder_layers or model.num_layers
    encoder_length, decoder_length = model.seq_length, target_length(config)
    ffn = (gates + 1) * hidden * model.ffn_size
    attention = 4 * hidden * inner  # QKV + output
    encoder_layer = attention + ffn + 2 * hidden
    decoder_layer = 2 * attention + ffn + 3 * hidden  # self + cross attention
    relative_tables = 2 * model.relative_attention_num_buckets * model.num_heads
    head = 0 if model.tie_embeddings else hidden * vocab
    total = (vocab * hidden + relative_tables + encoder_layers * encoder_layer + decoder_layers * decoder_layer
             + 2 * hidden + head)
    return ModelCounts(
        total_params=total, embedding_params=vocab * hidden + relative_tables,
        flops_per_token=encoder_decoder_flops_per_token(hidden, inner, ffn, vocab, encoder_layers, decoder_layers,
                                                        encoder_length, decoder_length),
        flops_formula="3·(s_e·L_e·(8h·i + 2(g+1)h·f + 4i·s_e) + L_d·(s_d·(12h·i + 2(g+1)h·f + 4i·(s_d + s_e)) "
                      "+ 4h·i·s_e) + 2h·V·s_d) / s_e (Kaplan et al. 2020, table 1, per stack)",
    )


def target_length(config: Config) -> int:
    """Targets per sample: T5's span-corruption target length (sec. 3.1.4), or the full sequence for prefix LM."""
    objective = config.objective
    if objective.kind == "prefix_lm":  # auto is T5's span corruption (FAMILY.objectives[0])
        return config.model.seq_length
    return random_spans_helper(config.model.seq_length, objective.noise_density, objective.mean_noise_span_length)[1]


def validate(config: Config) -> None:
    refuse_loss_chunking(config, "its decoder's output layer still makes the logits whole")
    model, tensor = config.model, config.parallel.tensor
    if model.ffn_activation not in FFN_ACTIVATIONS:
        raise ConfigError(f"model.ffn_activation={model.ffn_activation!r}; use relu or gated-gelu")
    buckets, distance = model.relative_attention_num_buckets, model.relative_attention_max_distance
    if buckets < 4 or buckets % 2 or distance <= buckets // 2:
        raise ConfigError(
            f"model.relative_attention_num_buckets={buckets} must be even and >= 4, and "
            f"model.relative_attention_max_distance={distance} > num_buckets / 2 (T5's log buckets need the room)"
        )
    if model.num_heads * model.attention_head_dim % tensor:
        raise ConfigError(f"parallel.tensor={tensor} must divide the T5 attention size num_heads x head_dim")
