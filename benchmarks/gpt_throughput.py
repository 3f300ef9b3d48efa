"""Throughput of a scaletrain GPT (megatron-core layers + DeepSpeed engine) against a plain
PyTorch loop over the same model shapes (same SDPA, torch AdamW), in one process.

    python benchmarks/gpt_throughput.py configs/gpt_tiny.yaml [key=value ...] [--steps 20]
    torchrun --nproc_per_node=2 benchmarks/gpt_throughput.py CONFIG parallel.tensor=2   # scaletrain side only

Prints tokens/s, step time and MFU (where the device's peak is known) for both, and the ratio.
Batches are random tokens, so the loader is not part of the measurement.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reference_gpt import ReferenceGPT  # noqa: E402
from scaletrain.config import Config, load_config, resolve_for_world  # noqa: E402
from scaletrain.model import build_model  # noqa: E402
from scaletrain.parallel.groups import destroy_distributed, init_distributed, world_size_from_environment  # noqa: E402
from scaletrain.tracking.flops import device_peak_flops, model_flops_per_token  # noqa: E402
from scaletrain.train.engine import build_engine, resolve_precision  # noqa: E402
from scaletrain.train.nonfinite import NonFiniteGuard  # noqa: E402
from scaletrain.train.step import train_step  # noqa: E402


def random_batches(config: Config, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    shape = (config.train.micro_batch_size, config.model.seq_length + 1)
    while True:
        sample = torch.randint(0, config.data.vocab_size, shape, generator=generator).to(device)
        yield {"tokens": sample[:, :-1], "labels": sample[:, 1:]}


def time_steps(step, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(device)
    return (time.perf_counter() - started) / steps


def reference_step_fn(config: Config, device: torch.device, precision: str):
    model = ReferenceGPT(config.model, config.padded_vocab_size).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.train.lr, betas=(config.train.beta1, config.train.beta2),
        weight_decay=config.train.weight_decay, fused=device.type == "cuda",
    )
    batches = random_batches(config, device, seed=0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step() -> None:
        for _ in range(config.train.grad_accum):
            batch = next(batches)
            with torch.autocast(device.type, dtype=dtype, enabled=precision == "bf16"):
                loss = model(batch["tokens"], batch["labels"])
            (loss / config.train.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    config = resolve_for_world(load_config(args.config, [*args.overrides, "tracking.wandb=disabled"]),
                               world_size_from_environment())
    topology = init_distributed(config)
    precision = resolve_precision(config, topology.device)
    engine = build_engine(build_model(config), config, topology)
    batches = random_batches(config, topology.device, seed=topology.data_parallel_rank)
    guard = NonFiniteGuard(engine, topology.device)
    ours = time_steps(lambda: train_step(engine, guard, batches, config.train.grad_accum, config.train.lr),
                      args.steps, args.warmup, topology.device)
    tokens = config.global_batch_size(topology.data_parallel_size) * config.model.seq_length
    flops = model_flops_per_token(config.model, config.padded_vocab_size) * tokens
    device_name = torch.cuda.get_device_name() if topology.device.type == "cuda" else "cpu"
    peak = device_peak_flops(device_name, config.tracking.peak_tflops)
    params = sum(p.numel() for p in engine.module.parameters()) * topology.tensor_parallel_size
    if topology.rank == 0:
        print(f"model: {params / 1e6:.1f}M parameters, {precision}, device {device_name}, "
              f"layout TP{topology.tensor_parallel_size} DP{topology.data_parallel_size} "
              f"ZeRO-{config.parallel.zero_stage}, {tokens} tokens/step")
        _report("scaletrain", ours, tokens, flops, peak, topology.world_size)
    if topology.world_size == 1:
        del engine
        reference = time_steps(reference_step_fn(config, topology.device, precision), args.steps, args.warmup,
                               topology.device)
        _report("plain PyTorch", reference, tokens, flops, peak, 1)
        print(f"step time ratio scaletrain / plain PyTorch: {ours / reference:.3f}")
    destroy_distributed()


def _report(name: str, step_time: float, tokens: int, flops: float, peak: float | None, devices: int) -> None:
    mfu = f", MFU {flops / step_time / (peak * devices):.1%}" if peak else ""
    print(f"{name:>14}: {step_time * 1000:8.1f} ms/step, {tokens / step_time:10.0f} tokens/s{mfu}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
