"""GPT decoder (Radford et al. 2018/2019, Brown et al. 2020) on tensor-parallel layers."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain.config import ModelConfig
from scaletrain.model.init import normal_init, residual_std
from scaletrain.model.layers import (
    PreLayerNormBlock,
    build_attention_and_mlp,
    masked_vocab_parallel_loss,
    parallel_lm_logits,
)


class GPTEmbedding(nn.Module):
    """Vocab-parallel token embedding + learned absolute positions; output [seq, batch, hidden]."""

    def __init__(self, config: ModelConfig, vocab_size: int, mp_config: ModelParallelConfig, seed: int) -> None:
        super().__init__()
        self.word = tensor_parallel.VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=normal_init(config.init_std, seed, "embedding.word"),
            config=mp_config,
        )
        self.position = nn.Embedding(config.seq_length, config.hidden_size)
        with torch.no_grad():
            normal_init(config.init_std, seed, "embedding.position")(self.position.weight)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        embedded = self.word(tokens) + self.position(positions)
        return self.dropout(embedded.transpose(0, 1).contiguous())


class GPT(nn.Module):
    """Causal LM: embedding, pre-LN blocks, final LayerNorm, tied vocab-parallel output layer."""

    def __init__(
        self,
        config: ModelConfig,
        vocab_size: int,
        mp_config: ModelParallelConfig,
        seed: int,
        checkpoint_interval: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.checkpoint_interval = checkpoint_interval
        self.embedding = GPTEmbedding(config, vocab_size, mp_config, seed)
        self.blocks = nn.ModuleList(
            build_block(config, mp_config, seed, layer) for layer in range(config.num_layers)
        )
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)

    def flat_layer_parameter_name(self, layer_index: int, name_in_layer: str) -> str | None:
        """GPT as a flat layer sequence, the order pipeline stages split it:
            0: embedding   1..L: blocks   L+1: final LayerNorm   L+2: output layer (tied to 0).
        Returns the `GPT` name of a layer's parameter; None for the output layer, whose only
        weight is the embedding's. Block layers wrap the block as `block.`."""
        num_layers = self.config.num_layers
        if layer_index == 0:
            return f"embedding.{name_in_layer}"
        if layer_index <= num_layers:
            return f"blocks.{layer_index - 1}.{name_in_layer.removeprefix('block.')}"
        if layer_index == num_layers + 1:
            return f"final_norm.{name_in_layer}"
        return None

    def borrowed_parameters(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, parameter) pairs where a module uses a weight it does not own: the output layer
        is tied to the word embedding. Sharded-parameter engines (ZeRO-3) must gather it for that module."""
        return [(self, self.embedding.word.weight)]

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, prefix_lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [batch, seq] -> mean next-token loss over labels != -100 if labels are given, else
        vocab-parallel logits. With prefix_lengths [batch] it is a prefix LM (Raffel et al. 2020,
        sec. 3.2.3): each sequence's first prefix_lengths tokens attend to each other bidirectionally."""
        hidden = self.embedding(tokens)
        mask = None if prefix_lengths is None else prefix_lm_attention_mask(prefix_lengths, tokens.shape[1])
        interval = self.checkpoint_interval if self.training else 0
        for start in range(0, len(self.blocks), interval or len(self.blocks)):
            chunk = self.blocks[start:start + (interval or len(self.blocks))]
            if interval:
                # Keep only each chunk's input; recompute its activations in backward
                # (Chen et al. 2016; Megatron's "uniform" recomputation).
                hidden = checkpoint(_run_blocks, chunk, hidden, mask, use_reentrant=False)
            else:
                hidden = _run_blocks(chunk, hidden, mask)
        logits = parallel_lm_logits(self.final_norm(hidden), self.embedding.word.weight)
        if labels is None:
            return logits.transpose(0, 1)  # [batch, seq, vocab / tensor_parallel_size]
        return masked_vocab_parallel_loss(logits, labels)


def prefix_lm_attention_mask(prefix_lengths: torch.Tensor, seq_length: int) -> torch.Tensor:
    """SDPA boolean mask [batch, 1, seq, seq]: query i sees key j if j <= i (causal) or j is in the prefix."""
    positions = torch.arange(seq_length, device=prefix_lengths.device)
    causal = positions[None, :] <= positions[:, None]
    in_prefix = positions[None, None, :] < prefix_lengths[:, None, None]
    return (causal[None] | in_prefix)[:, None]


def _run_blocks(blocks: nn.ModuleList, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    for block in blocks:
        hidden = block(hidden, mask)
    return hidden


def build_block(config: ModelConfig, mp_config: ModelParallelConfig, seed: int, layer: int) -> PreLayerNormBlock:
    output_std = residual_std(config.init_std, config.num_layers)
    attention, mlp = build_attention_and_mlp(config, mp_config, seed, layer, causal=True, output_std=output_std)
    return PreLayerNormBlock(attention, mlp, config.hidden_size, config.layernorm_eps, config.dropout)
