"""`scaletrain plan`: which parallel layouts fit a model on N GPUs, ranked by predicted step time.

The pieces: params.py (exact parameter counts), memory.py + activations.py (per-GPU memory),
flops.py + step_time.py (time), layouts.py (the candidates), search.py (evaluate them all),
report.py (the printed report, ending with the chosen layout as `key=value` overrides and the
command that launches it). This module is the command-line surface.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.planner.activations import ATTENTION_KERNELS
from scaletrain.planner.kernel_time import DEVICES
from scaletrain.planner.report import format_plan
from scaletrain.planner.search import DEFAULT_MAX_MICRO_BATCH, DEFAULT_MEMORY_RESERVE, plan
from scaletrain.planner.step_time import (
    DEFAULT_DEVICE,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_INTER_NODE_BANDWIDTH,
    DEFAULT_INTRA_NODE_BANDWIDTH,
    Hardware,
)

DEFAULT_PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 (tracking/flops.py)
DEFAULT_TOP = 20
MEMORY_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_memory_size(text: str) -> int:
    """'80GiB' -> bytes; KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB powers of 10. A bare number is
    refused rather than read as bytes: `--gpu-memory 80` meant 80 GB, and as 80 bytes nothing fits."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match and not match.group(2):
        number = match.group(1)
        raise ConfigError(f"--gpu-memory {text!r} has no unit; use {number}GB or {number}GiB (or B, KB, MB, TB, "
                          "KiB, MiB, TiB)")
    unit = match.group(2).upper() if match else ""
    if not match or unit not in MEMORY_UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--gpu-memory {text!r} is not a memory size; write e.g. 80GiB, 40GB or 141GB")
    return int(float(match.group(1)) * MEMORY_UNITS[unit])


def run_plan(
    config_path: Path,
    overrides: list[str],
    gpus: int,
    gpu_memory: str,
    gpu_peak_tflops: float = DEFAULT_PEAK_TFLOPS,
    device: str = DEFAULT_DEVICE,
    hbm_gbps: float | None = None,
    intra_node_gbps: float = DEFAULT_INTRA_NODE_BANDWIDTH / 1e9,
    inter_node_gbps: float = DEFAULT_INTER_NODE_BANDWIDTH / 1e9,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    memory_reserve: float = DEFAULT_MEMORY_RESERVE,
    attention: str = "flash",
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    top: int = DEFAULT_TOP,
) -> str:
    """Load the config, evaluate every layout, and return the report to print."""
    if device not in DEVICES:
        raise ConfigError(f"--device {device!r} is unknown; use one of {', '.join(DEVICES)}")
    hbm_gbps = DEVICES[device].memory_bandwidth / 1e9 if hbm_gbps is None else hbm_gbps
    for name, value in (("--gpu-peak-tflops", gpu_peak_tflops), ("--intra-node-gbps", intra_node_gbps),
                        ("--inter-node-gbps", inter_node_gbps), ("--hbm-gbps", hbm_gbps)):
        if value <= 0:
            raise ConfigError(f"{name} {value} must be > 0")
    for name, value in (("--gpus-per-node", gpus_per_node), ("--max-micro-batch", max_micro_batch), ("--top", top)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be >= 1")
    if attention not in ATTENTION_KERNELS:
        raise ConfigError(f"--attention {attention!r} is unknown; use one of {', '.join(ATTENTION_KERNELS)}")
    config = load_config(config_path, overrides)
    hardware = Hardware(
        peak_flops=gpu_peak_tflops * 1e12, memory_bandwidth=hbm_gbps * 1e9, device=device,
        intra_node_bandwidth=intra_node_gbps * 1e9, inter_node_bandwidth=inter_node_gbps * 1e9,
        gpus_per_node=gpus_per_node,
    )
    result = plan(config, gpus, parse_memory_size(gpu_memory), hardware, memory_reserve, attention, max_micro_batch)
    return format_plan(result, config_path=str(config_path), top=top, overrides=overrides)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The `scaletrain plan` arguments; `plan_from_args` consumes them."""
    parser.add_argument("config", type=Path, help="the model's YAML config, e.g. configs/gpt3_175b.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.global_batch_size=512")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GiB")
    parser.add_argument("--gpu-peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS,
                        help=f"dense bf16 peak per GPU, e.g. H100 SXM 989, A100 312 (default: {DEFAULT_PEAK_TFLOPS:g})")
    parser.add_argument("--device", choices=DEVICES, default=DEFAULT_DEVICE,
                        help="the GPU, for its HBM bandwidth and its measured GEMM table where one exists "
                             f"(scaletrain/planner/gemm_DEVICE.json) (default: {DEFAULT_DEVICE})")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="HBM GB/s per GPU, for memory-bound kernels and small GEMMs; unset: the device's, "
                             + ", ".join(f"{name} {spec.memory_bandwidth / 1e9:g}" for name, spec in DEVICES.items()))
    parser.add_argument("--intra-node-gbps", type=float, default=DEFAULT_INTRA_NODE_BANDWIDTH / 1e9,
                        help=f"NVLink GB/s per GPU and direction (default: {DEFAULT_INTRA_NODE_BANDWIDTH / 1e9:g})")
    parser.add_argument("--inter-node-gbps", type=float, default=DEFAULT_INTER_NODE_BANDWIDTH / 1e9,
                        help=f"network GB/s per GPU and direction (default: {DEFAULT_INTER_NODE_BANDWIDTH / 1e9:g})")
    parser.add_argument("--gpus-per-node", type=int, default=DEFAULT_GPUS_PER_NODE,
                        help=f"GPUs joined by NVLink in one node (default: {DEFAULT_GPUS_PER_NODE})")
    parser.add_argument("--memory-reserve", type=float, default=DEFAULT_MEMORY_RESERVE,
                        help="fraction of GPU memory kept free for what is not modelled "
                             f"(default: {DEFAULT_MEMORY_RESERVE:g})")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash",
                        help="flash: SDPA flash kernels, no s x s tensors; math: keeps them (default: flash)")
    parser.add_argument("--max-micro-batch", type=int, default=DEFAULT_MAX_MICRO_BATCH,
                        help=f"largest micro-batch to consider (default: {DEFAULT_MAX_MICRO_BATCH})")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP,
                        help=f"how many layouts to list (default: {DEFAULT_TOP})")


def plan_from_args(args: argparse.Namespace) -> str:
    return run_plan(
        args.config, args.overrides, args.gpus, args.gpu_memory, args.gpu_peak_tflops,
        device=args.device, hbm_gbps=args.hbm_gbps, intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps, gpus_per_node=args.gpus_per_node,
        memory_reserve=args.memory_reserve, attention=args.attention,
        max_micro_batch=args.max_micro_batch, top=args.top,
    )
