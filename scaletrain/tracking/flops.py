"""Peak FLOP/s of a device, the denominator of MFU (the model FLOPs are the family's own count, model/counts.py)."""

from __future__ import annotations

# Dense bf16 peak per device (vendor datasheets, SXM parts, no sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def device_peak_flops(device_name: str, configured_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device: the configured value, else a known GPU's bf16 peak, else None."""
    if configured_tflops:
        return configured_tflops * 1e12
    for marker, tflops in PEAK_BF16_TFLOPS.items():
        if marker in device_name:
            return tflops * 1e12
    return None
