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

from scaletrain.model.init import InitMethod, normal_init

FFN_ACTIVATIONS = ("relu", "gated-gelu")


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


class T5LayerNorm(nn.Module):
    """RMS norm (Zhang & Sennrich 2019) as T5 uses it: scale only, no mean subtraction, no bias.
    The mean square is taken in fp32 so bf16 activations keep their dynamic range."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden32 = hidden.float()
        normed = hidden32 * torch.rsqrt(hidden32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(hidden.dtype)


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

    def forward(self, query_length: int, key_length: int) -> torch.Tensor:
        """Bias [1, local heads, query_length, key_length]."""
        positions = torch.arange(max(query_length, key_length), device=self.weight.device)
        relative = positions[None, :key_length] - positions[:query_length, None]
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0)


class T5SelfAttention(nn.Module):
    """Self-attention, heads split across TP ranks; fused [Q; K; V] with stride 3 as in layers.py."""

    def __init__(
        self, architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, prefix: str
    ) -> None:
        super().__init__()
        hidden, inner = architecture.hidden_size, architecture.attention_size
        self.head_dim = architecture.head_dim
        self.dropout = architecture.dropout
        self.qkv = tensor_parallel.ColumnParallelLinear(
            hidden, 3 * inner, config=mp_config, bias=False, gather_output=False, stride=3,
            init_method=_stacked_init([_query_init(architecture, seed, f"{prefix}.q"),
                                       _key_value_init(architecture, seed, f"{prefix}.k"),
                                       _key_value_init(architecture, seed, f"{prefix}.v")]),
        )
        self.output = _output_projection(architecture, mp_config, seed, prefix)

    def forward(self, hidden: torch.Tensor, attention_bias: torch.Tensor | None) -> torch.Tensor:
        qkv, _ = self.qkv(hidden)
        query, key, value = (_split_heads(part, self.head_dim) for part in qkv.chunk(3, dim=-1))
        context = _attend(query, key, value, attention_bias, self.dropout if self.training else 0.0)
        output, _ = self.output(context)
        return output


class T5CrossAttention(nn.Module):
    """Decoder-to-encoder attention: Q from the decoder, fused [K; V] (stride 2) from the encoder output."""

    def __init__(
        self, architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, prefix: str
    ) -> None:
        super().__init__()
        hidden, inner = architecture.hidden_size, architecture.attention_size
        self.head_dim = architecture.head_dim
        self.dropout = architecture.dropout
        self.query = tensor_parallel.ColumnParallelLinear(
            hidden, inner, config=mp_config, bias=False, gather_output=False,
            init_method=_query_init(architecture, seed, f"{prefix}.q"),
        )
        self.key_value = tensor_parallel.ColumnParallelLinear(
            hidden, 2 * inner, config=mp_config, bias=False, gather_output=False, stride=2,
            init_method=_stacked_init([_key_value_init(architecture, seed, f"{prefix}.k"),
                                       _key_value_init(architecture, seed, f"{prefix}.v")]),
        )
        self.output = _output_projection(architecture, mp_config, seed, prefix)

    def forward(
        self, hidden: torch.Tensor, encoder_output: torch.Tensor, attention_bias: torch.Tensor | None
    ) -> torch.Tensor:
        query, _ = self.query(hidden)
        key_value, _ = self.key_value(encoder_output)
        key, value = (_split_heads(part, self.head_dim) for part in key_value.chunk(2, dim=-1))
        context = _attend(_split_heads(query, self.head_dim), key, value, attention_bias,
                          self.dropout if self.training else 0.0)
        output, _ = self.output(context)
        return output


class T5FeedForward(nn.Module):
    """ReLU FFN (T5) or gated-GELU FFN (v1.1; Shazeer 2020, "GLU Variants Improve Transformer").

    Gated: the master `wi` is [wi_0; wi_1] (gate; linear) with stride 2, so each rank's local
    output splits into its own columns of both and one GEMM serves both projections.
    """

    def __init__(
        self, architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, prefix: str
    ) -> None:
        super().__init__()
        hidden, ffn = architecture.hidden_size, architecture.ffn_hidden_size
        self.gated = architecture.ffn_activation == "gated-gelu"
        in_std = hidden**-0.5  # fan-in init of Mesh TF / HF `_init_weights`
        wi_parts = ["wi_0", "wi_1"] if self.gated else ["wi"]
        self.wi = tensor_parallel.ColumnParallelLinear(
            hidden, len(wi_parts) * ffn, config=mp_config, bias=False, gather_output=False, stride=len(wi_parts),
            init_method=_stacked_init([normal_init(in_std, seed, f"{prefix}.{part}") for part in wi_parts]),
        )
        self.wo = tensor_parallel.RowParallelLinear(
            ffn, hidden, config=mp_config, bias=False, input_is_parallel=True, skip_bias_add=False,
            init_method=normal_init(ffn**-0.5, seed, f"{prefix}.wo"),
        )
        self.dropout = nn.Dropout(architecture.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.wi(hidden)
        if self.gated:
            gate, linear = intermediate.chunk(2, dim=-1)
            # HF "gelu_new": the tanh approximation used by the v1.1 checkpoints.
            intermediate = F.gelu(gate, approximate="tanh") * linear
        else:
            intermediate = F.relu(intermediate)
        output, _ = self.wo(self.dropout(intermediate))
        return output


class T5Layer(nn.Module):
    """Pre-norm block: x + SelfAttn(LN(x)), [x + CrossAttn(LN(x), enc)] in the decoder, x + FFN(LN(x))."""

    def __init__(
        self, architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, prefix: str, decoder: bool
    ) -> None:
        super().__init__()
        hidden, eps = architecture.hidden_size, architecture.layernorm_eps
        self.self_attention_norm = T5LayerNorm(hidden, eps)
        self.self_attention = T5SelfAttention(architecture, mp_config, seed, f"{prefix}.self_attention")
        if decoder:
            self.cross_attention_norm = T5LayerNorm(hidden, eps)
            self.cross_attention = T5CrossAttention(architecture, mp_config, seed, f"{prefix}.cross_attention")
        self.ffn_norm = T5LayerNorm(hidden, eps)
        self.ffn = T5FeedForward(architecture, mp_config, seed, f"{prefix}.ffn")
        self.dropout = nn.Dropout(architecture.dropout)
        self.decoder = decoder

    def forward(
        self,
        hidden: torch.Tensor,
        self_attention_bias: torch.Tensor | None,
        encoder_output: torch.Tensor | None = None,
        cross_attention_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = hidden + self.dropout(self.self_attention(self.self_attention_norm(hidden), self_attention_bias))
        if self.decoder:
            attended = self.cross_attention(self.cross_attention_norm(hidden), encoder_output, cross_attention_bias)
            hidden = hidden + self.dropout(attended)
        return hidden + self.dropout(self.ffn(self.ffn_norm(hidden)))


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
            T5Layer(architecture, mp_config, seed, f"{name}.layers.{index}", decoder) for index in range(num_layers)
        )
        self.final_norm = T5LayerNorm(architecture.hidden_size, architecture.layernorm_eps)
        self.dropout = nn.Dropout(architecture.dropout)

    def self_attention_bias(self, seq_length: int, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Position bias plus padding (and, in the decoder, causal) mask: [batch or 1, heads, seq, seq]."""
        bias = self.relative_position_bias(seq_length, seq_length)
        allowed = _key_padding_allowed(padding_mask)
        if self.decoder:
            causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=bias.device).tril()
            allowed = causal if allowed is None else allowed & causal
        return _mask_bias(bias, allowed)

    def forward(
        self,
        embedded: torch.Tensor,
        padding_mask: torch.Tensor | None,
        encoder_output: torch.Tensor | None = None,
        encoder_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self_bias = self.self_attention_bias(embedded.shape[0], padding_mask)
        cross_bias = None
        if self.decoder and encoder_padding_mask is not None:
            # T5's cross-attention has no position bias, only the encoder padding mask.
            cross_bias = _mask_bias(embedded.new_zeros(1, 1, 1, 1), _key_padding_allowed(encoder_padding_mask))
        hidden = self.dropout(embedded)
        for layer in self.layers:
            hidden = layer(hidden, self_bias, encoder_output, cross_bias)
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
        return seq2seq_lm_loss(logits, labels)

    def encode(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] -> encoder output [seq, batch, hidden]."""
        return self.encoder(self.embedding(tokens).transpose(0, 1), padding_mask)

    def decode(
        self,
        tokens: torch.Tensor,
        encoder_output: torch.Tensor,
        encoder_padding_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder input tokens [batch, seq] (shifted right) -> decoder output [seq, batch, hidden]."""
        embedded = self.embedding(tokens).transpose(0, 1)
        return self.decoder(embedded, padding_mask, encoder_output, encoder_padding_mask)

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


def seq2seq_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of vocab-parallel logits [seq, batch, vocab/TP] over labels [batch, seq] != -100."""
    labels = labels.transpose(0, 1)
    keep = labels != -100
    # -100 is no vocabulary index: give those positions a valid one and drop their loss after.
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.masked_fill(~keep, 0).contiguous())
    return (losses * keep).sum() / keep.sum().clamp(min=1)


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


def _split_heads(projected: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[seq, batch, local heads * head_dim] -> [batch, local heads, seq, head_dim]."""
    seq_length, batch_size, _ = projected.shape
    return projected.reshape(seq_length, batch_size, -1, head_dim).permute(1, 2, 0, 3)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_bias: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """softmax(QK^T + bias) V without the 1/sqrt(d) factor: T5 folds it into the query init."""
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_bias, dropout_p=dropout, scale=1.0)
    batch_size, _, seq_length, _ = context.shape
    return context.permute(2, 0, 1, 3).reshape(seq_length, batch_size, -1)


def _key_padding_allowed(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[batch, keys] (1 = real token) -> boolean [batch, 1, 1, keys]."""
    return None if padding_mask is None else padding_mask.bool()[:, None, None, :]


def _mask_bias(bias: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Masked positions get the dtype's most negative value rather than -inf, so a query with no
    visible key (an all-padding row) gets uniform weights instead of NaN."""
    if allowed is None:
        return bias
    return torch.where(allowed, bias, torch.finfo(bias.dtype).min)


def _query_init(architecture: T5Architecture, seed: int, name: str) -> InitMethod:
    """Mesh TF's std (d_model * d_kv)**-0.5 for Q: the 1/sqrt(d_kv) attention scale lives here."""
    return normal_init((architecture.hidden_size * architecture.head_dim) ** -0.5, seed, name)


def _key_value_init(architecture: T5Architecture, seed: int, name: str) -> InitMethod:
    return normal_init(architecture.hidden_size**-0.5, seed, name)


def _output_projection(
    architecture: T5Architecture, mp_config: ModelParallelConfig, seed: int, prefix: str
) -> tensor_parallel.RowParallelLinear:
    return tensor_parallel.RowParallelLinear(
        architecture.attention_size, architecture.hidden_size, config=mp_config, bias=False,
        input_is_parallel=True, skip_bias_add=False,
        init_method=normal_init(architecture.attention_size**-0.5, seed, f"{prefix}.o"),
    )


def _stacked_init(parts: list[InitMethod]) -> InitMethod:
    """Initialise a fused master weight as equal row blocks, each from its own named stream, so a
    fused weight equals its unfused parts (HF's q, k, v or wi_0, wi_1) in every layout."""

    def init(tensor: torch.Tensor) -> torch.Tensor:
        for part, rows in zip(parts, tensor.chunk(len(parts), dim=0), strict=True):
            part(rows)
        return tensor

    return init
