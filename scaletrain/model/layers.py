"""Tensor-parallel transformer layers on megatron-core primitives.

Activations are [sequence, batch, hidden], megatron's layout, so sequence parallelism can
split dimension 0. Attention heads and FFN columns are split across tensor-parallel ranks:
column-parallel in, row-parallel out, one all-reduce per sub-layer (Shoeybi et al. 2019, sec. 3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.data.objectives import IGNORE_INDEX
from scaletrain.model.init import InitMethod, normal_init

Activation = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh(hidden: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU (Hendrycks & Gimpel 2016), HF's "gelu_new"."""
    return F.gelu(hidden, approximate="tanh")


def gelu_erf(hidden: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU, as BERT uses (Devlin et al. 2019; HF's "gelu")."""
    return F.gelu(hidden, approximate="none")


def key_padding_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """SDPA boolean mask [batch, 1, 1, seq] (True: may attend) from padding_mask [batch, seq].

    padding_mask is 1 at real tokens and 0 at pads, Megatron's BERT convention and HF's
    `attention_mask`. Only keys are masked: a pad query still sees the real tokens, so no
    softmax row is all -inf (which would make NaNs); pad positions' outputs are never used.
    """
    return padding_mask.bool()[:, None, None, :]


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with heads split across tensor-parallel ranks."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mp_config: ModelParallelConfig,
        init_method: InitMethod,
        output_init_method: InitMethod,
        causal: bool,
        attention_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        tensor_parallel_size = mp_config.tensor_model_parallel_size
        self.heads_per_rank = num_heads // tensor_parallel_size
        self.head_dim = hidden_size // num_heads
        self.causal = causal
        self.attention_dropout = attention_dropout
        # The master weight is [Q; K; V] (GPT-2's c_attn layout); stride=3 hands each rank its
        # own heads' rows of all three, so the local output splits cleanly into q, k, v.
        self.qkv = tensor_parallel.ColumnParallelLinear(
            hidden_size, 3 * hidden_size, config=mp_config, init_method=init_method,
            bias=True, gather_output=False, stride=3,
        )
        self.output = tensor_parallel.RowParallelLinear(
            hidden_size, hidden_size, config=mp_config, init_method=output_init_method,
            bias=True, input_is_parallel=True, skip_bias_add=False,
        )

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        seq_length, batch_size, _ = hidden.shape
        qkv, _ = self.qkv(hidden)
        query, key, value = (
            part.reshape(seq_length, batch_size, self.heads_per_rank, self.head_dim).permute(1, 2, 0, 3)
            for part in qkv.chunk(3, dim=-1)
        )
        # SDPA dispatches to flash / memory-efficient kernels on GPU and a fused CPU kernel here.
        context = F.scaled_dot_product_attention(
            query, key, value,
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=self.causal and attention_mask is None,
        )
        context = context.permute(2, 0, 1, 3).reshape(seq_length, batch_size, -1)
        output, _ = self.output(context)
        return output


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GELU -> h (row-parallel)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        mp_config: ModelParallelConfig,
        init_method: InitMethod,
        output_init_method: InitMethod,
        activation: Activation = gelu_tanh,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.fc = tensor_parallel.ColumnParallelLinear(
            hidden_size, ffn_hidden_size, config=mp_config, init_method=init_method,
            bias=True, gather_output=False,
        )
        self.proj = tensor_parallel.RowParallelLinear(
            ffn_hidden_size, hidden_size, config=mp_config, init_method=output_init_method,
            bias=True, input_is_parallel=True, skip_bias_add=False,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.fc(hidden)
        output, _ = self.proj(self.activation(intermediate))
        return output


class PreLayerNormBlock(nn.Module):
    """GPT-2/3 block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(
        self,
        attention: ParallelSelfAttention,
        mlp: ParallelMLP,
        hidden_size: int,
        layernorm_eps: float,
        hidden_dropout: float,
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.attention = attention
        self.mlp_norm = nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = mlp
        self.dropout = nn.Dropout(hidden_dropout)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden + self.dropout(self.attention(self.attention_norm(hidden), attention_mask))
        return hidden + self.dropout(self.mlp(self.mlp_norm(hidden)))


class PostLayerNormBlock(nn.Module):
    """BERT block, as the original Transformer (Vaswani et al. 2017, sec. 3.1):
    x = LN(x + Attn(x)), then x = LN(x + MLP(x)). Same parameter names as PreLayerNormBlock."""

    def __init__(
        self,
        attention: ParallelSelfAttention,
        mlp: ParallelMLP,
        hidden_size: int,
        layernorm_eps: float,
        hidden_dropout: float,
    ) -> None:
        super().__init__()
        self.attention = attention
        self.attention_norm = nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = mlp
        self.mlp_norm = nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.dropout = nn.Dropout(hidden_dropout)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.attention_norm(hidden + self.dropout(self.attention(hidden, attention_mask)))
        return self.mlp_norm(hidden + self.dropout(self.mlp(hidden)))


def build_attention_and_mlp(
    config: ModelConfig,
    mp_config: ModelParallelConfig,
    seed: int,
    layer: int,
    *,
    causal: bool,
    output_std: float,
    activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh,
) -> tuple[ParallelSelfAttention, ParallelMLP]:
    """Block `layer`'s two sub-layers, each weight initialised from its name (`blocks.{layer}...`);
    `output_std` is for the residual-branch output projections."""
    prefix = f"blocks.{layer}"
    attention = ParallelSelfAttention(
        config.hidden_size, config.num_heads, mp_config,
        init_method=normal_init(config.init_std, seed, f"{prefix}.attention.qkv"),
        output_init_method=normal_init(output_std, seed, f"{prefix}.attention.output"),
        causal=causal, attention_dropout=config.dropout,
    )
    mlp = ParallelMLP(
        config.hidden_size, config.ffn_size, mp_config,
        init_method=normal_init(config.init_std, seed, f"{prefix}.mlp.fc"),
        output_init_method=normal_init(output_std, seed, f"{prefix}.mlp.proj"),
        activation=activation,
    )
    return attention, mlp


def parallel_lm_logits(hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
    """Logits for this rank's vocabulary shard with the tied input embedding.

    The copy marks the replicated input so its gradient is all-reduced across TP ranks.
    """
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
    over the positions whose label is not IGNORE_INDEX (-100, e.g. a prefix LM's prefix)."""
    labels = labels.transpose(0, 1).contiguous()
    predicted = labels != IGNORE_INDEX
    # megatron's loss has no ignore index: score ignored positions against id 0, then drop them.
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.clamp(min=0))
    return (losses * predicted).sum() / predicted.sum()
