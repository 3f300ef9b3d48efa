"""Model and hardware FLOPs per token and per step, built on tracking.flops.model_flops_per_token.

Model FLOPs (what MFU counts) are Narayanan et al. 2021's 72*l*h^2*(1 + s/6h) + 6hV per token
for ffn = 4h, equal to PaLM's 6N + 12*l*h*s (see tracking/flops.py). Full activation
recomputation runs the blocks' forward a second time, so the hardware does one more forward of
the blocks, not of the logits: Narayanan et al. 2021's 96*B*s*l*h^2*(1 + s/6h + V/16lh) per
step of B sequences. Both are split out of model_flops_per_token rather than re-derived:
with a vocabulary of 0 it counts the blocks alone.
"""

from __future__ import annotations

from scaletrain.config import ModelConfig
from scaletrain.tracking.flops import model_flops_per_token


def blocks_forward_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs of all transformer blocks for one token (a third of their forward + backward)."""
    return model_flops_per_token(model, vocab_size=0) / 3


def logits_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Forward + backward FLOPs of the output layer for one token, 6hV."""
    return model_flops_per_token(model, vocab_size) - model_flops_per_token(model, vocab_size=0)


def hardware_flops_per_token(model: ModelConfig, vocab_size: int, recompute: bool) -> float:
    """FLOPs the GPUs execute per token: model FLOPs plus the recomputed forward of the blocks."""
    recomputed = blocks_forward_flops_per_token(model) if recompute else 0.0
    return model_flops_per_token(model, vocab_size) + recomputed
