"""Model and hardware FLOPs per token, from the family's own count (model/counts.py `model_counts`).

Model FLOPs (what MFU counts) are `model_counts(config).flops_per_token`: each family's exact
forward + backward matmul FLOPs per token (for GPT, Narayanan et al. 2021's
72*l*h^2*(1 + s/6h) + 6hV for ffn = 4h, equal to PaLM's 6N + 12*l*h*s). The step-time model
splits them into the output layer, 6hV (one h x V matmul per token, forward and backward: every
registered family has one; for BERT, whose MLM head runs on the masked tokens only, it is an
upper bound), and the blocks, the rest. Full activation recomputation runs the blocks' forward
a second time, so the hardware does one more forward of the blocks, not of the logits
(Narayanan et al. 2021's 96*B*s*l*h^2*(1 + s/6h + V/16lh) per step of B sequences for GPT).
Selective recomputation runs each block's attention core forward a second time: its scores QK^T and
their weighted sum of values, 4*s*d_attn per token (Korthikanti et al. 2022, sec. 4.3; Kaplan et al.
2020, table 1), over the full s x s square as model/counts.py counts it; like the memory model it charges
every block a decoder block's self-attention (T5's cross-attention is not counted).
"""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.families import model_counts
from scaletrain.planner.activations import Recompute
from scaletrain.planner.params import num_blocks


def model_flops_per_token(config: Config) -> float:
    """Forward + backward model FLOPs of one token: the family's own count."""
    return model_counts(config).flops_per_token


def logits_flops_per_token(config: Config) -> float:
    """Forward + backward FLOPs of the output layer for one token, 6hV."""
    return 6 * config.model.hidden_size * config.padded_vocab_size


def blocks_forward_flops_per_token(config: Config) -> float:
    """Forward FLOPs of all transformer blocks for one token (a third of their forward + backward)."""
    return max(model_flops_per_token(config) - logits_flops_per_token(config), 0.0) / 3


def attention_core_forward_flops_per_token(config: Config) -> float:
    """Forward FLOPs of every block's attention core for one token, 4*s*d_attn per block."""
    model = config.model
    return 4 * model.seq_length * model.num_heads * model.attention_head_dim * num_blocks(config)


def recomputed_flops_per_token(config: Config, recompute: Recompute) -> float:
    """Forward FLOPs backward runs again per token: the blocks' (full) or their attention cores' (selective)."""
    if recompute == Recompute.FULL:
        return blocks_forward_flops_per_token(config)
    if recompute == Recompute.SELECTIVE:
        return attention_core_forward_flops_per_token(config)
    return 0.0


def hardware_flops_per_token(config: Config, recompute: Recompute) -> float:
    """FLOPs the GPUs execute per token: model FLOPs plus what recomputation runs again."""
    return model_flops_per_token(config) + recomputed_flops_per_token(config, recompute)
