"""T5 encoder-decoder (Raffel et al. 2020) with heads, FFN columns and vocabulary split across TP ranks.

Covers original T5 (ReLU FFN, output layer tied to the embedding) and T5 v1.1 (gated-GELU FFN,
untied output layer). Activations are [sequence, batch, hidden] as in layers.py; checkpoint/hf_t5.py
maps the parameter names onto Hugging Face's `T5ForConditionalGeneration`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from scaletrain.batch import BatchSchema
from scaletrain.config import Config, ConfigError, ModelConfig
from scaletrain.data.span_corruption import random_spans_helper
from scaletrain.model.family import HFAdapter, ModelFamily, PipelineLayer
from scaletrain.model.init import InitMethod, normal_init
from scaletrain.model.layers import (
    KVCache,
    ParallelAttention,
    ParallelMLP,
    RMSNorm,
    TransformerBlock,
    gelu_tanh,
    masked_vocab_parallel_loss,
)
from scaletrain.model.parallel_config import model_parallel_config
from scaletrain.scaling.counts import ModelCounts

FFN_ACTIVATIONS = ("relu", "gated-gelu")


@dataclass
class T5Config(ModelConfig):
    """model.seq_length is the encoder length; the decoder length follows from the objective."""

    num_decoder_layers: int | None = None  # None: model.num_layers
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
        """Bias [1, local heads, query_length, key_length] for queries at query_start.. (decoding
        with a KV cache starts past the cached positions)."""
        queries = torch.arange(query_start, query_start + query_length, device=self.weight.device)
        keys = torch.arange(key_length, device=self.weight.device)
        relative = keys[None, :] - queries[:, None]
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0)


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


class T5Stack(nn.Module):
    """Encoder (bidirectional) or decoder (causal, with cross-attention) layers and a final norm.

    As in T5, one relative-position table serves the whole stack: the bias is computed once,
    before the first layer, and every layer adds the same bias (HF stores the table in block 0).
    """

    def __init__(self, architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, decoder: bool) -> None:
        super().__init__()
        name = "decoder" if decoder else "encoder"
        num_layers = architecture.num_decoder_layers if decoder else architecture.num_encoder_layers
        self.decoder = decoder
        self.relative_position_bias = RelativePositionBias(
            architecture, bidirectional=not decoder, mp_config=mp_config,
            init_method=normal_init(architecture.hidden_size**-0.5, seed, f"{name}.relative_position_bias"),
        )
        self.layers = nn.ModuleList(
            build_layer(architecture, mp_config, seed, f"{name}.layers.{index}", decoder, index)
            for index in range(num_layers)
        )
        self.final_norm = RMSNorm(architecture.hidden_size, architecture.layernorm_eps)
        self.dropout = nn.Dropout(architecture.dropout)

    def self_attention_bias(
        self, seq_length: int, padding_mask: torch.Tensor | None, past: int = 0
    ) -> torch.Tensor:
        """Position bias plus padding (and, in the decoder, causal) mask: [batch or 1, heads, seq, past + seq]."""
        keys = past + seq_length
        bias = self.relative_position_bias(seq_length, keys, query_start=past)
        allowed = _key_padding_allowed(padding_mask)
        if self.decoder:
            positions = torch.arange(keys, device=bias.device)
            causal = positions[None, :] <= positions[past:, None]
            allowed = causal if allowed is None else allowed & causal
        return _mask_bias(bias, allowed)

    def forward(
        self,
        embedded: torch.Tensor,
        padding_mask: torch.Tensor | None,
        encoder_output: torch.Tensor | None = None,
        encoder_padding_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        self_bias = self.self_attention_bias(embedded.shape[0], padding_mask, cache.length if cache else 0)
        cross_bias = None
        if self.decoder and encoder_padding_mask is not None:
            # T5's cross-attention has no position bias, only the encoder padding mask.
            cross_bias = _mask_bias(embedded.new_zeros(1, 1, 1, 1), _key_padding_allowed(encoder_padding_mask))
        hidden = self.dropout(embedded)
        for layer in self.layers:
            hidden = layer(hidden, self_bias, encoder_output=encoder_output, cross_mask=cross_bias, cache=cache)
        return self.dropout(self.final_norm(hidden))


class T5(nn.Module):
    """Encoder-decoder LM: shared vocab-parallel embedding, two stacks, vocab-parallel output layer.

    `encode`, `decode` and `output_logits` (and the stacks' `layers`) are the pieces a pipeline
    schedule would place on stages; `forward` runs them in order.
    """

    def __init__(self, architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int) -> None:
        super().__init__()
        check_tensor_parallel(architecture, mp_config.tensor_model_parallel_size)
        self.architecture = architecture
        hidden, vocab = architecture.hidden_size, architecture.vocab_size
        # Unit-variance embedding (Mesh TF / T5X); with the d_model**-0.5 output scaling of the
        # tied head, or the fan-in init of the untied one, initial logits have unit variance.
        self.embedding = tensor_parallel.VocabParallelEmbedding(
            vocab, hidden, init_method=normal_init(1.0, seed, "embedding"), config=mp_config
        )
        self.encoder = T5Stack(architecture, mp_config, seed, decoder=False)
        self.decoder = T5Stack(architecture, mp_config, seed, decoder=True)
        self.lm_head = None
        if not architecture.tie_embeddings:
            self.lm_head = tensor_parallel.ColumnParallelLinear(
                hidden, vocab, config=mp_config, bias=False, gather_output=False,
                init_method=normal_init(hidden**-0.5, seed, "lm_head"),
            )

    def forward(
        self,
        encoder_tokens: torch.Tensor,
        decoder_tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        encoder_padding_mask: torch.Tensor | None = None,
        decoder_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens and masks [batch, seq] (mask 1 = real token) -> mean cross-entropy over labels
        != -100 if labels are given, else vocab-parallel logits [batch, dec_seq, vocab / TP]."""
        encoder_output = self.encode(encoder_tokens, encoder_padding_mask)
        decoder_output = self.decode(decoder_tokens, encoder_output, encoder_padding_mask, decoder_padding_mask)
        logits = self.output_logits(decoder_output)
        if labels is None:
            return logits.transpose(0, 1)
        return masked_vocab_parallel_loss(logits, labels)

    def encode(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] -> encoder output [seq, batch, hidden]."""
        return self.encoder(self.embedding(tokens).transpose(0, 1), padding_mask)

    def decode(
        self,
        tokens: torch.Tensor,
        encoder_output: torch.Tensor,
        encoder_padding_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Decoder input tokens [batch, seq] (shifted right) -> decoder output [seq, batch, hidden].
        With a KVCache the tokens continue the cached ones (incremental decoding)."""
        embedded = self.embedding(tokens).transpose(0, 1)
        output = self.decoder(embedded, padding_mask, encoder_output, encoder_padding_mask, cache)
        if cache is not None:
            cache.length += tokens.shape[1]
        return output

    def borrowed_parameters(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, parameter) pairs where a module uses a weight it does not own: the tied output
        layer reuses the embedding. Sharded-parameter engines (ZeRO-3) must gather it for that module."""
        return [] if self.lm_head is not None else [(self, self.embedding.weight)]

    def output_logits(self, decoder_output: torch.Tensor) -> torch.Tensor:
        """[seq, batch, hidden] -> this rank's vocabulary shard of the logits [seq, batch, vocab / TP]."""
        if self.lm_head is not None:
            logits, _ = self.lm_head(decoder_output)
            return logits
        # Mesh TF rescales before the tied output layer, since the embedding has unit variance.
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(
            decoder_output * self.architecture.hidden_size**-0.5
        )
        return F.linear(hidden, self.embedding.weight)


def check_tensor_parallel(architecture: T5Architecture, tensor_parallel_size: int) -> None:
    """Heads, FFN columns and vocabulary rows are split evenly across TP ranks."""
    for name in ("num_heads", "ffn_hidden_size", "vocab_size"):
        value = getattr(architecture, name)
        if value % tensor_parallel_size:
            sizes = ", ".join(str(size) for size in range(1, min(value, 64) + 1) if value % size == 0)
            raise ValueError(
                f"tensor parallel size {tensor_parallel_size} does not divide {name}={value}; use one of {sizes}"
            )
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
    return T5(architecture(config), model_parallel_config(config), config.train.seed)




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
    encoder_flops = encoder_length * encoder_layers * (2 * attention + 2 * ffn + 4 * inner * encoder_length)
    decoder_token = 2 * attention + 2 * 2 * hidden * inner + 2 * ffn + 4 * inner * (decoder_length + encoder_length)
    decoder_flops = decoder_layers * (decoder_length * decoder_token + encoder_length * 2 * 2 * hidden * inner)
    head_flops = decoder_length * 2 * hidden * vocab
    return ModelCounts(
        total_params=total, embedding_params=vocab * hidden + relative_tables,
        flops_per_token=3.0 * (encoder_flops + decoder_flops + head_flops) / encoder_length,
        flops_formula="3·(s_e·L_e·(8h·i + 2(g+1)h·f + 4i·s_e) + L_d·(s_d·(12h·i + 2(g+1)h·f + 4i·(s_d + s_e)) "
                      "+ 4h·i·s_e) + 2h·V·s_d) / s_e (Kaplan et al. 2020, table 1, per stack)",
    )


def target_length(config: Config) -> int:
    """Targets per sample: T5's span-corruption target length (sec. 3.1.4), or the full sequence for prefix LM."""
    objective = config.objective
    if objective.resolved_kind(config.model.family) == "prefix_lm":
        return config.model.seq_length
    return random_spans_helper(config.model.seq_length, objective.noise_density, objective.mean_noise_span_length)[1]


def validate(config: Config) -> None:
    model, tensor = config.model, config.parallel.tensor
    if model.ffn_activation not in FFN_ACTIVATIONS:
        raise ConfigError(f"model.ffn_activation={model.ffn_activation!r}; use relu or gated-gelu")
    buckets, distance = model.relative_attention_num_buckets, model.relative_attention_max_distance
    if buckets < 4 or buckets % 2 or distance <= buckets // 2:
        raise ConfigError(
            f"model.relative_attention_num_buckets={buckets} must be even and >= 4, and "
            f"model.relative_attention_max_distance={distance} > num_buckets / 2 (T5's log buckets need the room)"
        )
    if config.train.activation_checkpoint_interval:
        raise ConfigError("train.activation_checkpoint_interval is not available for t5 yet; set it to 0")
    if model.num_heads * model.attention_head_dim % tensor:
        raise ConfigError(f"parallel.tensor={tensor} must divide the T5 attention size num_heads x head_dim")


def _no_pipeline(config: Config) -> list[PipelineLayer]:
    raise ConfigError("t5 has no pipeline stages yet; train it with parallel.pipeline=1")


def _hf_adapter() -> HFAdapter:
    from scaletrain.checkpoint.hf_t5 import export_t5_hf, import_t5_hf

    return HFAdapter(
        model_class="T5ForConditionalGeneration",
        export=lambda state, config, out_dir: export_t5_hf(state, architecture(config), out_dir),
        import_=import_t5_hf,
    )


FAMILY = ModelFamily(
    name="t5",
    config_class=T5Config,
    build=build,
    pipeline_layers=_no_pipeline,
    loss=lambda outputs, labels: masked_vocab_parallel_loss(outputs[0], labels[0]),
    objectives=("span_corruption", "prefix_lm"),
    pipeline_objectives=(),
    batch_schema=lambda config: BatchSchema(
        inputs=("encoder_tokens", "decoder_tokens", "encoder_padding_mask", "decoder_padding_mask"), labels=("labels",)
    ),
    counts=counts,
    validate=validate,
    hf=_hf_adapter,
    encoder_decoder=True,
    generation="seq2seq",
)
