"""Model FLOPs per token, for throughput and MFU reporting."""

from __future__ import annotations

from scaletrain.config import ModelConfig
from scaletrain.scaling.counts import transformer_block_flops

# Dense bf16 peak per device (vendor datasheets, SXM parts, no sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def model_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Forward + backward FLOPs per token, without recomputation (model FLOPs, as MFU uses).

    Per layer and token the forward pass does 2 FLOPs per weight, 8h^2 (QKV + output) +
    4h*ffn (MLP), plus 4hs for attention scores and values; the logits add 2hV. Backward
    doubles it. With ffn=4h this is Narayanan et al. 2021's 72*l*h^2*(1 + s/6h) + 6hV, and
    equals PaLM's 6N + 12*l*h*s (Chowdhery et al. 2022, app. B) with N the matmul weights.
    """
    per_layer = transformer_block_flops(model.hidden_size, model.ffn_size, model.seq_length)
    return 3.0 * (model.num_layers * per_layer + 2 * model.hidden_size * vocab_size)


def device_peak_flops(device_name: str, configured_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device: the configured value, else a known GPU's bf16 peak, else None."""
    if configured_tflops:
        return configured_tflops * 1e12
    for marker, tflops in PEAK_BF16_TFLOPS.items():
        if marker in device_name:
            return tflops * 1e12
    return None
