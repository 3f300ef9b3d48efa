"""A tiny pre-LN GPT built straight from megatron-core primitives, with or without sequence parallelism.

Used by the SP numerics tests and the planner's SP activation-memory test. Weights are seeded
per name (scaletrain.model.init) and built on CPU as full master weights, so both layouts start
from the same model. Activations are [seq, batch, hidden]; dropout is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from scaletrain.model.init import normal_init
from scaletrain.parallel.sequence_parallel import (
    mark_sequence_parallel,
    register_sequence_parallel_grad_hooks,
    scatter_to_sequence_parallel,
    sequence_parallel_lm_logits,
)

SEED = 11


@dataclass(frozen=True)
class StackShape:
    seq_length: int = 8
    batch: int = 2
    hidden: int = 16
    heads: int = 4
    ffn: int = 32
    vocab: int = 64
    layers: int = 2


class Block(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)); qkv and fc column-parallel, out and proj row-parallel."""

    def __init__(self, shape: StackShape, config: ModelParallelConfig, layer: int) -> None:
        super().__init__()
        h, tp = shape.hidden, config.tensor_model_parallel_size
        self.heads_per_rank, self.head_dim = shape.heads // tp, h // shape.heads

        def init(name: str) -> object:
            return normal_init(0.2, SEED, f"blocks.{layer}.{name}")

        self.attention_norm = nn.LayerNorm(h)
        self.qkv = tensor_parallel.ColumnParallelLinear(
            h, 3 * h, config=config, init_method=init("qkv"), bias=True, gather_output=False, stride=3)
        self.out = tensor_parallel.RowParallelLinear(
            h, h, config=config, init_method=init("out"), bias=True, input_is_parallel=True, skip_bias_add=False)
        self.mlp_norm = nn.LayerNorm(h)
        self.fc = tensor_parallel.ColumnParallelLinear(
            h, shape.ffn, config=config, init_method=init("fc"), bias=True, gather_output=False)
        self.proj = tensor_parallel.RowParallelLinear(
            shape.ffn, h, config=config, init_method=init("proj"), bias=True, input_is_parallel=True,
            skip_bias_add=False)
        with torch.no_grad():  # non-trivial norm parameters, so their gradients are tested too
            for name in ("attention_norm", "mlp_norm"):
                norm = getattr(self, name)
                normal_init(0.2, SEED, f"blocks.{layer}.{name}.weight")(norm.weight).add_(1.0)
                normal_init(0.2, SEED, f"blocks.{layer}.{name}.bias")(norm.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(self.attention_norm(hidden))
        seq, batch = qkv.shape[:2]  # the full sequence: the column-parallel linear gathered it
        query, key, value = (
            part.reshape(seq, batch, self.heads_per_rank, self.head_dim).permute(1, 2, 0, 3)
            for part in qkv.chunk(3, dim=-1)
        )
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        attention, _ = self.out(context.permute(2, 0, 1, 3).reshape(seq, batch, -1))
        hidden = hidden + attention
        intermediate, _ = self.fc(self.mlp_norm(hidden))
        mlp, _ = self.proj(F.gelu(intermediate, approximate="tanh"))
        return hidden + mlp


class Stack(nn.Module):
    """Vocab-parallel embedding + positions, pre-LN blocks, final norm, tied logits, vocab-parallel loss."""

    def __init__(self, shape: StackShape, config: ModelParallelConfig) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.word = tensor_parallel.VocabParallelEmbedding(
            shape.vocab, shape.hidden, init_method=normal_init(0.2, SEED, "word"), config=config)
        self.position = nn.Embedding(shape.seq_length, shape.hidden)
        with torch.no_grad():
            normal_init(0.2, SEED, "position")(self.position.weight)
        self.blocks = nn.ModuleList(Block(shape, config, layer) for layer in range(shape.layers))
        self.final_norm = nn.LayerNorm(shape.hidden)
        if self.sequence_parallel:
            for module in (*self.blocks, self.final_norm):
                mark_sequence_parallel(module)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; tokens and labels are [batch, seq]."""
        positions = torch.arange(tokens.shape[1])
        hidden = (self.word(tokens) + self.position(positions)).transpose(0, 1).contiguous()
        if self.sequence_parallel:
            hidden = scatter_to_sequence_parallel(hidden)
        for block in self.blocks:
            hidden = block(hidden)
        hidden = self.final_norm(hidden)
        if self.sequence_parallel:
            logits = sequence_parallel_lm_logits(hidden, self.word.weight)
        else:
            logits = F.linear(tensor_parallel.copy_to_tensor_model_parallel_region(hidden), self.word.weight)
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        return losses.mean()


def build_stack(
    shape: StackShape, tensor_parallel_size: int, sequence_parallel: bool, grad_hooks: bool = True
) -> Stack:
    """`grad_hooks=False` leaves out the SP gradient all-reduce, to show that it is needed."""
    config = ModelParallelConfig(
        tensor_model_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, perform_initialization=True, params_dtype=torch.float32,
    )
    stack = Stack(shape, config)
    if sequence_parallel and grad_hooks:
        register_sequence_parallel_grad_hooks(stack)
    return stack


def batch(shape: StackShape, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq_length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
