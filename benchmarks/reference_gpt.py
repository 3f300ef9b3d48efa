"""A plain-PyTorch GPT (nanoGPT-style: no megatron, no DeepSpeed) with scaletrain's shapes.

It is the baseline the throughput benchmark compares against, and it can load a TP=1
scaletrain GPT's weights, which makes it a numerical reference as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ModelConfig


class ReferenceBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layernorm_eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attention_output = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=config.layernorm_eps)
        self.fc = nn.Linear(hidden, config.ffn_size)
        self.proj = nn.Linear(config.ffn_size, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, width = hidden.shape
        query, key, value = (
            part.view(batch, seq, self.num_heads, -1).transpose(1, 2)
            for part in self.qkv(self.attention_norm(hidden)).chunk(3, dim=-1)
        )
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        hidden = hidden + self.attention_output(context.transpose(1, 2).reshape(batch, seq, width))
        return hidden + self.proj(F.gelu(self.fc(self.mlp_norm(hidden)), approximate="tanh"))


class ReferenceGPT(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.seq_length, config.hidden_size)
        self.blocks = nn.ModuleList(ReferenceBlock(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=config.init_std)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.word(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            hidden = block(hidden)
        logits = F.linear(self.final_norm(hidden), self.word.weight)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def load_scaletrain_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a TP=1 (or consolidated) scaletrain GPT state dict into this module."""
        renames = {
            "embedding.word.weight": "word.weight",
            "embedding.position.weight": "position.weight",
            ".attention.qkv.": ".qkv.",
            ".attention.output.": ".attention_output.",
            ".mlp.fc.": ".fc.",
            ".mlp.proj.": ".proj.",
        }
        mapped = {}
        for name, tensor in state.items():
            if name.endswith("_extra_state"):  # megatron's linear layers carry an (empty) extra state
                continue
            for old, new in renames.items():
                name = name.replace(old, new)
            mapped[name] = tensor
        self.load_state_dict(mapped)
