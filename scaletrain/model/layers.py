"""The block kit every family is built from: tensor-parallel attention, MLP, norms and positions.

Activations are [sequence, batch, hidden], megatron's layout, so sequence parallelism can split
dimension 0. Attention heads and MLP columns are split across tensor-parallel ranks: column-parallel
in, row-parallel out, one all-reduce per sub-layer (Shoeybi et al. 2019, sec. 3). What differs
between families is a handful of switches:

    attention   heads, key/value heads (grouped-query: Ainslie et al. 2023; multi-query: Shazeer
                2019), head_dim, biases, score scale, positions (learned absolute in the
                embedding, T5's relative bias as an additive mask, or rotary: Su et al. 2021),
                causal with an optional sliding window (model/attention_masks.py); SDPA, or
                FlexAttention where the mask arrives as a BlockMask
    MLP         activation, gated or not (GLU variants: Shazeer 2020), biases
    norm        LayerNorm or RMSNorm (Zhang & Sennrich 2019), before (GPT-2) or after (BERT)

Every weight is initialised from (seed, its parameter name) by an `init(part)` callback the
family supplies, so a layer's master weights do not depend on the layout (see model/init.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from scaletrain.batch import IGNORE_INDEX
from scaletrain.config import ConfigError
from scaletrain.model.attention_masks import causal_mask, sliding_window_mask
from scaletrain.model.chunked_cross_entropy import DeferredLogits, chunked_vocab_parallel_cross_entropy
from scaletrain.model.init import InitMethod
from scaletrain.parallel.context_parallel import RingMask, ring_attention
from scaletrain.parallel.sequence_parallel import sequence_parallel_lm_logits

Activation = Callable[[torch.Tensor], torch.Tensor]
PartInit = Callable[[str], InitMethod]  # "qkv" | "query" | "key_value" | "output" | "fc" | "proj" -> init


def gelu_tanh(hidden: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU (Hendrycks & Gimpel 2016), HF's "gelu_new"."""
    return F.gelu(hidden, approximate="tanh")


def gelu_erf(hidden: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU, as BERT uses (Devlin et al. 2019; HF's "gelu")."""
    return F.gelu(hidden, approximate="none")


ACTIVATIONS: dict[str, Activation] = {"gelu": gelu_tanh, "gelu-erf": gelu_erf, "relu": F.relu, "silu": F.silu}


# ---------------------------------------------------------------------------------------------
# Norms


class RMSNorm(nn.Module):
    """Scale-only RMS norm (Zhang & Sennrich 2019), as T5 and Llama use it: no mean, no bias.
    The mean square is taken in fp32 so bf16 activations keep their range (HF's T5LayerNorm and
    LlamaRMSNorm compute it the same way)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden32 = hidden.float()
        normed = hidden32 * torch.rsqrt(hidden32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(hidden.dtype)


# ---------------------------------------------------------------------------------------------
# Positions


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34) in the rotate-half layout of
    GPT-NeoX and Hugging Face's Llama: dimension i of a head is paired with i + head_dim / 2.
    Applied per head after the tensor-parallel split, so it needs no communication."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """query/key [batch, heads, seq, head_dim]; positions [seq], or [batch, seq] when each sequence
        has its own (positions restarting at every packed document)."""
        angles = positions.float()[..., None] * self.inv_freq.float()
        angles = torch.cat([angles, angles], dim=-1)
        if angles.dim() == 3:
            angles = angles[:, None]  # one table per sequence, shared by its heads
        cos, sin = angles.cos().to(query.dtype), angles.sin().to(query.dtype)
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


# ---------------------------------------------------------------------------------------------
# Attention


@dataclass
class KVCache:
    """Keys and values of the positions decoded so far, one entry per attention layer, for
    incremental decoding: each new token attends to them instead of recomputing the prefix.

    The stored keys are always the newest ones: behind a sliding window of W a layer keeps only the
    last W - 1 (all the next query may see besides itself, as transformers' DynamicSlidingWindowLayer
    does), so its cache stays bounded however long the text grows."""

    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    length: int = 0  # positions already decoded (the stored keys are the last of them)

    @classmethod
    def empty(cls) -> KVCache:
        return cls({}, {})

    def extend(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, keep: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's stored keys and values followed by the new ones, for this step's attention;
        stores them all, or only the last `keep`."""
        if layer in self.keys:
            key = torch.cat([self.keys[layer], key], dim=2)
            value = torch.cat([self.values[layer], value], dim=2)
        first = 0 if keep is None else max(key.shape[2] - keep, 0)
        self.keys[layer], self.values[layer] = key[:, :, first:], value[:, :, first:]
        return key, value


class ParallelAttention(nn.Module):
    """Multi-head, grouped-query or multi-query attention with heads split across TP ranks.

    Self-attention with as many key/value heads as query heads keeps one fused master weight
    [Q; K; V] (GPT-2's c_attn layout) as `qkv`, stride 3, so each rank gets its own heads' rows
    of all three and one GEMM serves them. Otherwise (fewer key/value heads, or cross-attention
    whose keys come from the encoder) queries are `query` and keys/values a fused [K; V]
    `key_value`, stride 2. When the TP size exceeds the key/value heads, every rank holds the
    full (small) `key_value` weight and uses its own group's heads, as Megatron replicates them;
    the weight enters through megatron's copy-to-TP-region, so its gradient is the sum over ranks
    and stays identical on all of them.

    `recompute_core` (train.activation_checkpoint=selective, set by `recompute_attention_cores`) is
    Megatron's selective recomputation (Korthikanti et al. 2022, sec. 4.3): in training the core,
    softmax(QK^T·scale + mask)V (`_core`), runs under a non-reentrant checkpoint, so backward recomputes
    it from the q, k, v and mask it keeps, while every linear layer keeps its input as before. That core
    holds the activations that grow as s² (the math kernel's softmax, its dropout mask and output; ring
    attention's per-block probabilities; a fused kernel's additive mask) at a cost of its own forward,
    4·s·d_attn FLOPs per token, no GEMM of the weights and no TP communication. Under a fused kernel
    (flash, or the memory-efficient kernel with a mask) only the fp32 logsumexp and the additive mask are
    freed: the output is the output projection's input, which keeps it anyway, and q, k, v stay as the
    checkpoint's inputs. Recomputing more (the QKV or output projection with it) would free s·b·h-sized
    tensors at a GEMM's cost, the trade full recomputation already makes with more memory freed per FLOP,
    so selective stops at the core (planner/activations.py counts what each mode keeps).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mp_config: ModelParallelConfig,
        init: PartInit,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        rotary: RotaryEmbedding | None = None,
        cross: bool = False,
        layer_index: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        tp = mp_config.tensor_model_parallel_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.heads_per_rank = num_heads // tp
        self.sequence_parallel = mp_config.sequence_parallel  # hidden arrives as a 1/tp slice of the sequence
        self.causal, self.dropout, self.scale, self.rotary = causal, dropout, scale, rotary
        self.sliding_window = sliding_window  # causal only: query i sees keys i - W < j <= i (attention_masks.py)
        self.layer_index = layer_index  # its slot in a KVCache
        self.recompute_core = False  # selective recomputation of the attention core (class docstring)
        inner, kv_inner = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.fused = not cross and self.num_kv_heads == num_heads
        if self.fused:
            self.qkv = tensor_parallel.ColumnParallelLinear(
                hidden_size, 3 * inner, config=mp_config, init_method=init("qkv"),
                bias=bias, gather_output=False, stride=3,
            )
        else:
            self.query = tensor_parallel.ColumnParallelLinear(
                hidden_size, inner, config=mp_config, init_method=init("query"), bias=bias, gather_output=False,
            )
            self.replicated_kv = self.num_kv_heads % tp != 0
            if self.replicated_kv:
                self.key_value = _ReplicatedLinear(
                    hidden_size, 2 * kv_inner, init("key_value"), bias, mp_config.sequence_parallel
                )
                group_heads = num_heads // self.num_kv_heads
                self.kv_head = parallel_state.get_tensor_model_parallel_rank() * self.heads_per_rank // group_heads
            else:
                self.key_value = tensor_parallel.ColumnParallelLinear(
                    hidden_size, 2 * kv_inner, config=mp_config, init_method=init("key_value"),
                    bias=bias, gather_output=False, stride=2,
                )
        self.output = tensor_parallel.RowParallelLinear(
            inner, hidden_size, config=mp_config, init_method=init("output"),
            bias=bias, input_is_parallel=True, skip_bias_add=False,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
        *,
        encoder_output: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        ring: RingMask | None = None,
    ) -> torch.Tensor:
        """hidden [seq, batch, hidden]; mask: SDPA's boolean (True: may attend) or additive float
        mask, broadcastable to [batch, heads, seq, keys] (for a causal layer it replaces the causal
        mask, and the sliding window still applies), or a FlexAttention BlockMask that holds every limit,
        the window too (attention_masks.decoder_block_mask); positions [seq] or [batch, seq] for rotary
        (default 0..seq-1, offset by the cache length). With `ring` hidden is this rank's chunks of a
        context-parallel sequence: ring attention over the context-parallel ranks replaces SDPA, masked
        by `ring.visible` (which holds the window), and the rotary positions default to its global ones."""
        query, key, value = self._project(hidden, encoder_output)
        if ring is not None and positions is None:
            positions = ring.positions
        if self.rotary is not None:
            if positions is None:  # the query's length: under sequence parallelism hidden is a slice
                start = cache.length if cache is not None else 0
                positions = torch.arange(start, start + query.shape[2], device=hidden.device)
            query, key = self.rotary(query, key, positions)
        if cache is not None:
            keep = None if self.sliding_window is None else self.sliding_window - 1
            key, value = cache.extend(self.layer_index, key, value, keep)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            context = checkpoint(self._core, query, key, value, mask, ring, use_reentrant=False)
        else:
            context = self._core(query, key, value, mask, ring)
        return self._output(context)

    def _core(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | BlockMask | None,
        ring: RingMask | None,
    ) -> torch.Tensor:
        """softmax(QK^T·scale + mask)V over this rank's heads, [batch, local heads, seq, head_dim]: SDPA,
        FlexAttention with a BlockMask (which has no dropout: model/decoder.py refuses the two together), or ring
        attention round the context-parallel ranks."""
        dropout = self.dropout if self.training else 0.0
        if ring is not None:
            return ring_attention(query, key, value, ring.positions, ring.visible, self.scale, dropout)
        if isinstance(mask, BlockMask):
            return _flex_attention(query, key, value, mask, self.scale)
        mask, causal = self._causal_limits(mask, query.shape[2], key.shape[2], query.device)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.scale,
            enable_gqa=key.shape[1] != query.shape[1],
        )

    def _output(self, context: torch.Tensor) -> torch.Tensor:
        """The row-parallel output projection of context [batch, local heads, seq, head_dim]."""
        batch_size, _, seq_length, _ = context.shape  # the whole sequence, also under sequence parallelism
        output, _ = self.output(context.permute(2, 0, 1, 3).reshape(seq_length, batch_size, -1))
        return output

    def _causal_limits(
        self, mask: torch.Tensor | None, query_length: int, key_length: int, device: torch.device
    ) -> tuple[torch.Tensor | None, bool]:
        """SDPA's (attn_mask, is_causal). A causal layer without a mask of its own uses SDPA's
        is_causal where it can (no window, or one no query reaches past); behind a KV cache the new
        queries are the last positions of the keys (bottom-right aligned)."""
        if not self.causal:
            return mask, False
        window = self.sliding_window if self.sliding_window is not None and self.sliding_window < key_length else None
        if mask is not None:
            if window is None:
                return mask, False
            return mask & sliding_window_mask(query_length, key_length, device, window), False
        if window is None and query_length == key_length:
            return None, True
        return causal_mask(query_length, key_length, device, window), False

    def _project(self, hidden: torch.Tensor, encoder_output: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Query, key, value as [batch, local heads, seq, head_dim]."""
        if self.fused:
            qkv, _ = self.qkv(hidden)
            return tuple(self._heads(part) for part in qkv.chunk(3, dim=-1))
        query, _ = self.query(hidden)
        source = hidden if encoder_output is None else encoder_output
        if self.replicated_kv:
            key_value = self.key_value(source, self.kv_head, self.head_dim)
        else:
            key_value, _ = self.key_value(source)
        key, value = key_value.chunk(2, dim=-1)
        return self._heads(query), self._heads(key), self._heads(value)

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        seq_length, batch_size, _ = projected.shape
        return projected.reshape(seq_length, batch_size, -1, self.head_dim).permute(1, 2, 0, 3)


def _flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask,
                    scale: float | None) -> torch.Tensor:
    """FlexAttention over the block mask; grouped-query heads share their key/value head as in SDPA."""
    if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
        raise ConfigError(f"model.attention_backend=flex cannot train on CPU: FlexAttention has no backward there "
                          f"(torch {torch.__version__}); use model.attention_backend=auto or sdpa")
    return _compiled_flex_attention()(query, key, value, block_mask=block_mask, scale=scale,
                                      enable_gqa=key.shape[1] != query.shape[1])


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process, the documented way to run it: eager, it is an unfused
    reference that materialises the scores."""
    return torch.compile(flex_attention)


class _ReplicatedLinear(nn.Module):
    """A [K; V] projection held whole on every TP rank, of which each rank uses one head's K and V
    rows. Weight and input pass megatron's copy-to-TP-region (identity forward, all-reduce backward),
    so both gradients are summed over the ranks that used different rows."""

    def __init__(
        self, hidden_size: int, out_features: int, init_method: InitMethod, bias: bool, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(init_method(torch.empty(out_features, hidden_size)))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, kv_head: int, head_dim: int) -> torch.Tensor:
        half = self.weight.shape[0] // 2
        rows = torch.cat([torch.arange(kv_head * head_dim, (kv_head + 1) * head_dim)] * 2)
        rows[head_dim:] += half
        weight = tensor_parallel.copy_to_tensor_model_parallel_region(self.weight)[rows.to(hidden.device)]
        bias = None if self.bias is None else tensor_parallel.copy_to_tensor_model_parallel_region(self.bias)[rows]
        if self.sequence_parallel:
            # the whole sequence, as a column-parallel linear gathers it; backward reduce-scatters
            # the per-rank partial input gradients
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        return F.linear(hidden, weight, bias)


def full_sequence_length(hidden: torch.Tensor, sequence_parallel: bool) -> int:
    """Tokens per sequence when `hidden` [seq, batch, h] may be this rank's 1/tp sequence slice."""
    return hidden.shape[0] * (parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1)


def key_padding_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """SDPA boolean mask [batch, 1, 1, seq] (True: may attend) from padding_mask [batch, seq].

    padding_mask is 1 at real tokens and 0 at pads, Megatron's BERT convention and HF's
    `attention_mask`. Only keys are masked: a pad query still sees the real tokens, so no
    softmax row is all -inf (which would make NaNs); pad positions' outputs are never used.
    """
    return padding_mask.bool()[:, None, None, :]


# ---------------------------------------------------------------------------------------------
# MLP and block


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> activation -> h (row-parallel).

    Gated (GLU variants, Shazeer 2020: SwiGLU for Llama, gated GELU for T5 v1.1): the master `fc`
    is [gate; up] with stride 2, so each rank's local output splits into its own columns of both
    and one GEMM serves both projections; the output is act(gate) * up.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        mp_config: ModelParallelConfig,
        init: PartInit,
        *,
        activation: Activation = gelu_tanh,
        gated: bool = False,
        bias: bool = True,
        inner_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.activation, self.gated = activation, gated
        parts = 2 if gated else 1
        self.fc = tensor_parallel.ColumnParallelLinear(
            hidden_size, parts * ffn_hidden_size, config=mp_config, init_method=init("fc"),
            bias=bias, gather_output=False, stride=parts,
        )
        self.proj = tensor_parallel.RowParallelLinear(
            ffn_hidden_size, hidden_size, config=mp_config, init_method=init("proj"),
            bias=bias, input_is_parallel=True, skip_bias_add=False,
        )
        self.inner_dropout = nn.Dropout(inner_dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.fc(hidden)
        if self.gated:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = self.activation(gate) * up
        else:
            intermediate = self.activation(intermediate)
        output, _ = self.proj(self.inner_dropout(intermediate))
        return output


class TransformerBlock(nn.Module):
    """Pre-norm (GPT-2, T5, Llama): x + Attn(N(x)) [+ CrossAttn(N(x), enc)], then x + MLP(N(x));
    post-norm (BERT, BART, the original Transformer, Vaswani et al. 2017 sec. 3.1): x = N(x + Attn(x)),
    [x = N(x + CrossAttn(x, enc))], then x = N(x + MLP(x)). Parameter names are the same in both arrangements."""

    def __init__(
        self,
        attention: ParallelAttention,
        mlp: ParallelMLP,
        norm: Callable[[], nn.Module],
        *,
        pre_norm: bool = True,
        cross_attention: ParallelAttention | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.attention_norm = norm()
        self.attention = attention
        if cross_attention is not None:
            self.cross_attention_norm = norm()
            self.cross_attention = cross_attention
        self.mlp_norm = norm()
        self.mlp = mlp
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
        *,
        encoder_output: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        ring: RingMask | None = None,
    ) -> torch.Tensor:
        """positions: the rotary positions of self-attention, when not 0..seq-1; ring: its context-parallel
        ring attention (ParallelAttention)."""
        if not self.pre_norm:
            attended = self.attention(hidden, mask, cache=cache, positions=positions, ring=ring)
            hidden = self.attention_norm(hidden + self.dropout(attended))
            if encoder_output is not None:  # BART's decoder (Lewis et al. 2020), the Transformer's
                attended = self.cross_attention(hidden, cross_mask, encoder_output=encoder_output)
                hidden = self.cross_attention_norm(hidden + self.dropout(attended))
            return self.mlp_norm(hidden + self.dropout(self.mlp(hidden)))
        attended = self.attention(self.attention_norm(hidden), mask, cache=cache, positions=positions, ring=ring)
        hidden = hidden + self.dropout(attended)
        if encoder_output is not None:
            attended = self.cross_attention(
                self.cross_attention_norm(hidden), cross_mask, encoder_output=encoder_output
            )
            hidden = hidden + self.dropout(attended)
        return hidden + self.dropout(self.mlp(self.mlp_norm(hidden)))


def recompute_attention_cores(module: nn.Module) -> int:
    """Selective recomputation (train.activation_checkpoint=selective) on a built model or pipeline stage:
    every attention layer in it recomputes its core in backward (ParallelAttention). Returns how many."""
    attentions = [layer for layer in module.modules() if isinstance(layer, ParallelAttention)]
    for attention in attentions:
        attention.recompute_core = True
    return len(attentions)


def run_in_chunks(steps: list[Callable[[Any], Any]], value: tuple, interval: int) -> tuple:
    """Apply `steps` (blocks) in order; with interval k > 0 keep only each k-step chunk's input and
    recompute its activations in backward (Chen et al. 2016; Megatron's "uniform" recomputation)."""

    def run(chunk: list[Callable[[Any], Any]], value: Any) -> Any:
        for step in chunk:
            value = step(value)
        return value

    if not interval:
        return run(steps, value)
    for start in range(0, len(steps), interval):
        chunk = steps[start:start + interval]
        # Tensors as direct arguments: checkpoint saves those for backward (a tuple would only be
        # kept alive by its closure, hidden from autograd's saved-tensor bookkeeping).
        value = checkpoint(lambda *tensors, chunk=chunk: run(chunk, tensors), *value, use_reentrant=False)
    return value


# ---------------------------------------------------------------------------------------------
# Output layer and losses


def parallel_lm_logits(
    hidden: torch.Tensor, word_embeddings: torch.Tensor, sequence_parallel: bool = False
) -> torch.Tensor:
    """Logits for this rank's vocabulary shard with the tied input embedding.

    The copy marks the replicated input so its gradient is all-reduced across TP ranks; under
    sequence parallelism the sequence slices are gathered instead (megatron's GPTModel output layer).
    """
    if sequence_parallel:
        return sequence_parallel_lm_logits(hidden, word_embeddings)
    hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    return F.linear(hidden, word_embeddings)


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary argmax of vocab-parallel logits [..., vocab/TP], identical on every TP rank.

    All-reduce the max value, then the smallest global index that holds it: torch.argmax's
    first-occurrence rule, so the answer does not depend on the layout.
    """
    local_max, local_index = logits.max(dim=-1)
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    if world_size == 1:
        return local_index
    group = parallel_state.get_tensor_model_parallel_group()
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    no_candidate = torch.iinfo(local_index.dtype).max
    candidate = torch.where(local_max == global_max, local_index + vocab_start, no_candidate)
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


def masked_vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of vocab-parallel logits [seq, batch, vocab/TP] against labels [batch, seq],
    over the positions whose label is not IGNORE_INDEX (-100, e.g. a prefix LM's prefix or padding)."""
    loss_sum, count = masked_vocab_parallel_loss_sum(logits, labels)
    return loss_sum / count.clamp(min=1)


def masked_vocab_parallel_loss_sum(
    logits: torch.Tensor | DeferredLogits, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, count) over the labels that are not IGNORE_INDEX: masked_vocab_parallel_loss's
    parts, for a mean over tokens spread across ranks (context parallelism). DeferredLogits (the output
    layer under train.loss_chunk_size) are projected and scored a chunk of tokens at a time."""
    labels = labels.transpose(0, 1).contiguous()
    predicted = labels != IGNORE_INDEX
    # megatron's loss has no ignore index: score ignored positions against id 0, then drop them.
    if isinstance(logits, DeferredLogits):
        losses = chunked_vocab_parallel_cross_entropy(logits, labels.clamp(min=0))
    else:
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.clamp(min=0))
    return (losses * predicted).sum(), predicted.sum()
