"""The throughput cost of document masking (and of a sliding window): one model shape trained on the same
packed batches with plain causal attention and within documents, measured side by side.

    python benchmarks/document_masking.py configs/gpt_tiny.yaml [key=value ...] [--mean-document 64]
        [--window 32] [--steps 3] [--pairs 5]

Causal attention runs SDPA with is_causal (no mask tensor); document masking hands it a boolean
[batch, 1, seq, seq] mask built in every block from the document ids (model/attention_masks.py), which
the kernel turns into an additive one; `--window W` adds a third trainer with model.sliding_window=W
(a [seq, seq] mask) on the same batches. The trainers take turns as in gpt_throughput.py: each pair times
`--steps` steps of each, the order rotating from pair to pair, and the figures are medians over pairs.
Batches are random tokens with an eos at each position with probability 1 / --mean-document, so the
documents' lengths are geometric with that mean, as in a packed corpus of short texts.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpt_throughput import time_steps  # noqa: E402
from scaletrain.config import Config  # noqa: E402
from scaletrain.config_loader import load_config  # noqa: E402
from scaletrain.data.objectives import document_ids  # noqa: E402
from scaletrain.data.tokenizer import SPECIAL_IDS  # noqa: E402
from scaletrain.model.decoder import attention_backend  # noqa: E402
from scaletrain.parallel.groups import Topology, destroy_distributed, init_distributed  # noqa: E402
from scaletrain.parallel.layout import resolve_for_world  # noqa: E402
from scaletrain.planner.recompute import device_memory, resolve_recompute  # noqa: E402
from scaletrain.train.engine import build_engine  # noqa: E402
from scaletrain.train.nonfinite import NonFiniteGuard  # noqa: E402
from scaletrain.train.parallelize import build_training_model  # noqa: E402
from scaletrain.train.step import train_step  # noqa: E402


def packed_batches(config: Config, device: torch.device, mean_document: float, with_documents: bool,
                   seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Random ordinary tokens with eos separators; the same sequence of batches for every trainer."""
    generator = torch.Generator().manual_seed(seed)
    shape = (config.train.micro_batch_size, config.model.seq_length + 1)
    eos = SPECIAL_IDS["eos"]
    while True:
        sample = torch.randint(len(SPECIAL_IDS), config.data.vocab_size, shape, generator=generator)
        sample[torch.rand(shape, generator=generator) < 1 / mean_document] = eos
        batch = {"tokens": sample[:, :-1], "labels": sample[:, 1:]}
        if with_documents:
            batch["document_ids"] = document_ids(batch["tokens"], eos)
        yield {key: value.to(device) for key, value in batch.items()}


def step_fn(config: Config, topology: Topology, mean_document: float) -> Callable[[], None]:
    engine = build_engine(build_training_model(config, topology), config, topology)
    batches = packed_batches(config, topology.device, mean_document, config.model.document_masking)
    guard = NonFiniteGuard(engine, topology.device)

    def step() -> None:
        train_step(engine, guard, batches, config.train.grad_accum, config.train.lr)

    return step


def with_model(config: Config, **changes: object) -> Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **changes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--mean-document", type=float, default=64.0, help="mean document length in tokens")
    parser.add_argument("--window", type=int, default=None, help="also time model.sliding_window=W")
    parser.add_argument("--steps", type=int, default=3, help="steps per timing (each trainer's turn in a pair)")
    parser.add_argument("--pairs", type=int, default=5, help="rounds of turns; the figures are their medians")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    config = resolve_for_world(load_config(args.config, [*args.overrides, "tracking.wandb=disabled"]), 1)
    config = with_model(config, document_masking=False, sliding_window=None)
    topology = init_distributed(config)
    config, _ = resolve_recompute(config, device_memory(topology.device))  # as train decides auto
    variants = {"causal": config, "document masking": with_model(config, document_masking=True)}
    if args.window:
        variants[f"sliding window {args.window}"] = with_model(config, sliding_window=args.window)
    trainers = {name: step_fn(variant, topology, args.mean_document) for name, variant in variants.items()}
    for step in trainers.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for pair in range(args.pairs):
        for name in names[pair % len(names):] + names[:pair % len(names)]:
            times[name].append(time_steps(trainers[name], args.steps, topology.device))
    # what runs the attention: a variant without a mask runs SDPA's is_causal whatever the backend
    backends = {name: attention_backend(variant) if variant.model.document_masking or variant.model.sliding_window
                else "sdpa is_causal" for name, variant in variants.items()}
    _report(config, times, args, backends)
    destroy_distributed()


def _report(config: Config, times: dict[str, list[float]], args: argparse.Namespace,
            backends: dict[str, str]) -> None:
    tokens = config.train.micro_batch_size * config.train.grad_accum * config.model.seq_length
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{config.model.family}: {config.model.num_layers} layers, hidden {config.model.hidden_size}, "
          f"seq {config.model.seq_length}, {tokens} tokens/step, documents of mean {args.mean_document:g} tokens; "
          f"device {device}, {torch.get_num_threads()} threads; {args.pairs} rounds of {args.steps} steps")
    causal = statistics.median(times["causal"])
    for name, measured in times.items():
        step_time = statistics.median(measured)
        ratios = sorted(ours / plain for ours, plain in zip(measured, times["causal"], strict=True))
        print(f"{name:>20} ({backends[name]}): {step_time * 1000:8.1f} ms/step (median), "
              f"{tokens / step_time:9.0f} tokens/s "
              f"({causal / step_time:.3f} x causal's); step time / causal's per round: median "
              f"{statistics.median(ratios):.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
