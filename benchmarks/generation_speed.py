"""Greedy generation speed on CPU with and without the KV cache (tiny llama and gpt, random weights)."""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from scaletrain.config_loader import load_config  # noqa: E402
from scaletrain.families import build_model
from scaletrain.model.sampling import sample_tokens
from scaletrain.parallel.layout import resolve_for_world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokens_per_second(model: torch.nn.Module, config, new_tokens: int, use_cache: bool) -> float:
    prompt = [3, *range(10, 26)]
    start = time.perf_counter()
    generated = sample_tokens(model, prompt, new_tokens, config.model.seq_length, config.data.vocab_size, 0.0, None,
                              torch.Generator(), use_cache=use_cache)
    return len(generated) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256, help="new tokens to generate (default: 256)")
    parser.add_argument("--configs", nargs="+", default=["configs/llama_tiny.yaml", "configs/gpt_tiny.yaml"],
                        help="model shapes to time (default: the tiny llama and gpt)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="context length (model.seq_length) to build the models with (default: the config's); "
                             "generation past it slides the window, where the cache saves nothing")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        for path in args.configs:
            overrides = [f"model.seq_length={args.seq_length}"] if args.seq_length else []
            config = resolve_for_world(load_config(os.path.join(REPO, path), overrides), world_size=1)
            model = build_model(config).eval()
            cached = tokens_per_second(model, config, args.tokens, use_cache=True)
            recomputed = tokens_per_second(model, config, args.tokens, use_cache=False)
            print(f"{config.model.family} ({path}, context {config.model.seq_length}), {args.tokens} tokens: "
                  f"KV cache {cached:.1f} tokens/s, recomputation {recomputed:.1f} tokens/s, "
                  f"speedup {cached / recomputed:.2f}x")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
