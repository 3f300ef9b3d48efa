"""Throughput of a scaletrain GPT (megatron-core layers + DeepSpeed engine) against a plain PyTorch
loop over the same model shapes (same SDPA, torch's fused AdamW), measured side by side.

    python benchmarks/gpt_throughput.py configs/gpt_tiny.yaml [key=value ...] [--steps 5] [--pairs 7]
    torchrun --nproc_per_node=2 benchmarks/gpt_throughput.py CONFIG                    # DP2 vs plain DDP
    torchrun --nproc_per_node=2 benchmarks/gpt_throughput.py CONFIG parallel.tensor=2  # TP2: scaletrain only

Both trainers live in one process and take turns: each pair times `--steps` steps of one and then
of the other (the order alternating from pair to pair), so a noisy machine slows both alike and one
unlucky run cannot decide the ratio: the figure is the median of the pairs' ratios. With several
ranks and only data parallelism the plain side is torch's DistributedDataParallel over the same
process group; tensor and pipeline parallelism have no plain counterpart, so only scaletrain is
timed there. Batches are random tokens, so the loader is not part of the measurement (the training
loop reports its own wait for data as `data_wait_fraction` in metrics.jsonl).

MFU = model FLOPs per token (scaletrain.families.gpt.model: 6N plus attention, Kaplan et al. 2020 /
Narayanan et al. 2021) x tokens per step / step time / (peak FLOP/s per device x devices).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reference_gpt import ReferenceGPT  # noqa: E402
from scaletrain.config import Config  # noqa: E402
from scaletrain.config_loader import load_config  # noqa: E402
from scaletrain.families import model_counts  # noqa: E402
from scaletrain.families.gpt.model import model_flops_per_token  # noqa: E402
from scaletrain.parallel.groups import (  # noqa: E402
    Topology,
    destroy_distributed,
    init_distributed,
    resolve_precision,
    world_size_from_environment,
)
from scaletrain.parallel.layout import resolve_for_world  # noqa: E402
from scaletrain.planner.recompute import device_memory, resolve_recompute  # noqa: E402
from scaletrain.tracking.flops import device_peak_flops  # noqa: E402
from scaletrain.train.engine import build_engine  # noqa: E402
from scaletrain.train.nonfinite import NonFiniteGuard  # noqa: E402
from scaletrain.train.parallelize import build_training_model  # noqa: E402
from scaletrain.train.step import train_step  # noqa: E402


def random_batches(config: Config, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    shape = (config.train.micro_batch_size, config.model.seq_length + 1)
    while True:
        sample = torch.randint(0, config.data.vocab_size, shape, generator=generator).to(device)
        yield {"tokens": sample[:, :-1], "labels": sample[:, 1:]}


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(device)
    return (time.perf_counter() - started) / steps


def scaletrain_step_fn(config: Config, topology: Topology) -> Callable[[], None]:
    engine = build_engine(build_training_model(config, topology), config, topology)
    batches = random_batches(config, topology.device, seed=topology.data_parallel_rank)
    guard = NonFiniteGuard(engine, topology.device)

    def step() -> None:
        train_step(engine, guard, batches, config.train.grad_accum, config.train.lr)

    return step


def reference_step_fn(config: Config, device: torch.device, precision: str, data_parallel: bool,
                      seed: int) -> Callable[[], None]:
    """A nanoGPT-style loop: autocast, backward per micro-batch, clip, AdamW; DDP when data-parallel."""
    model: torch.nn.Module = ReferenceGPT(config.model, config.padded_vocab_size).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.train.lr, betas=(config.train.beta1, config.train.beta2),
        weight_decay=config.train.weight_decay, fused=True,
    )
    if data_parallel:
        model = torch.nn.parallel.DistributedDataParallel(model)
    batches = random_batches(config, device, seed=seed)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step() -> None:
        for micro in range(config.train.grad_accum):
            batch = next(batches)
            last = micro == config.train.grad_accum - 1
            sync = model.no_sync() if data_parallel and not last else contextlib.nullcontext()
            with sync, torch.autocast(device.type, dtype=dtype, enabled=precision == "bf16"):
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
    parser.add_argument("--steps", type=int, default=5, help="steps per timing (each half of a pair)")
    parser.add_argument("--pairs", type=int, default=7, help="alternating pairs; the ratio is their median")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--scaletrain-only", action="store_true", help="time scaletrain alone (no plain loop)")
    args = parser.parse_args()
    config = resolve_for_world(load_config(args.config, [*args.overrides, "tracking.wandb=disabled"]),
                               world_size_from_environment())
    topology = init_distributed(config)
    config, _ = resolve_recompute(config, device_memory(topology.device))  # as train decides auto
    precision = resolve_precision(config, topology.device)
    # Each trainer is built and warmed up alone, so its peak memory is its own (the other not yet resident).
    peaks: dict[str, float] = {}
    trainers = {"scaletrain": _warmed_up(lambda: scaletrain_step_fn(config, topology), args.warmup,
                                         topology.device, peaks, "scaletrain")}
    only_data_parallel = topology.tensor_parallel_size == 1 and topology.pipeline_parallel_size == 1
    if only_data_parallel and not args.scaletrain_only:
        plain = "plain PyTorch" if topology.world_size == 1 else "plain DDP"
        data_parallel, seed = topology.world_size > 1, topology.data_parallel_rank
        trainers[plain] = _warmed_up(lambda: reference_step_fn(config, topology.device, precision, data_parallel, seed),
                                     args.warmup, topology.device, peaks, plain)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for pair in range(args.pairs):
        order = list(trainers) if pair % 2 == 0 else list(reversed(trainers))
        for name in order:
            times[name].append(time_steps(trainers[name], args.steps, topology.device))
    if topology.rank == 0:
        _report(config, topology, precision, times, peaks, args)
    destroy_distributed()


def _warmed_up(build: Callable[[], Callable[[], None]], warmup: int, device: torch.device,
               peaks: dict[str, float], name: str) -> Callable[[], None]:
    """The step `build` makes, after `warmup` steps; on a GPU, peaks[name] is the most memory allocated
    while it was built and warmed up, above what was allocated before (a trainer built earlier stays
    resident and is not counted): its weights, optimizer state, gradients and activations."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    step = build()
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return step


def _report(config: Config, topology: Topology, precision: str, times: dict[str, list[float]],
            peaks: dict[str, float], args: argparse.Namespace) -> None:
    tokens = topology.layout.global_batch * config.model.seq_length
    flops_per_token = model_flops_per_token(config.model, config.padded_vocab_size)
    device_name = torch.cuda.get_device_name() if topology.device.type == "cuda" else "cpu"
    peak = device_peak_flops(device_name, config.tracking.peak_tflops)
    num_params = model_counts(config).total_params
    print(f"model: {num_params / 1e6:.1f}M parameters, {precision}, device {device_name}, layout "
          f"TP{topology.tensor_parallel_size} DP{topology.data_parallel_size} PP{topology.pipeline_parallel_size} "
          f"ZeRO-{config.parallel.zero_stage}, recompute {config.train.recompute}, {tokens} tokens/step, "
          f"{torch.get_num_threads()} threads per rank; "
          f"{args.pairs} alternating pairs of {args.steps} steps")
    if peak:
        print(f"MFU = {flops_per_token:,.0f} FLOPs/token x {tokens} tokens / step time / "
              f"({peak / 1e12:.0f} TFLOP/s x {topology.world_size} devices)")
    for name, measured in times.items():
        step_time = statistics.median(measured)
        mfu = f", MFU {flops_per_token * tokens / step_time / (peak * topology.world_size):.1%}" if peak else ""
        print(f"{name:>14}: {step_time * 1000:8.1f} ms/step (median), {tokens / step_time:10.0f} tokens/s{mfu}")
    for name, peak_gib in peaks.items():
        print(f"{name:>14}: peak memory {peak_gib:.2f} GiB allocated on rank 0 (its warm-up steps, alone)")
    if len(times) == 2:
        ours_name, plain_name = times
        ratios = sorted(a / b for a, b in zip(times[ours_name], times[plain_name], strict=True))
        print(f"step time ratio scaletrain / {plain_name}: {statistics.median(ratios):.3f} "
              f"(median of {len(ratios)} pairs; range {ratios[0]:.3f}-{ratios[-1]:.3f})")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
