"""What a checkpoint costs the training: the stall per save, the write time and the size.

    python benchmarks/checkpoint_save.py configs/gpt_tiny.yaml [key=value ...] [--saves 4] [--every 5]
    torchrun --nproc_per_node=2 benchmarks/checkpoint_save.py CONFIG parallel.zero_stage=1

Training steps on random tokens take turns in blocks of `--every` steps: a block without a save and a
block that ends in one (`checkpoint/manager.save_checkpoint`, as the loop calls it), `--saves` of
each. Reported per save, as medians:
- call: the time save_checkpoint holds the training thread (with checkpoint.async_save, copying the
  state off; without it, the whole write);
- stall: how much longer a block with a save took than one without: the call, plus what the write
  in the background slowed the steps after it (it shares the cores), plus any wait for the previous
  write at the next save. This is what a save costs a run.
- write: from the call to the checkpoint being published (all ranks' files in, renamed into place);
- size: the checkpoint's bytes on disk.
Also runs against checkpoint modules without `finish_pending_save` (the synchronous DeepSpeed saves
before layout-free checkpoints), for before/after figures from the same script.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpt_throughput import random_batches  # noqa: E402
from scaletrain.checkpoint import manager  # noqa: E402

try:  # their homes since checkpoint/ was split by concern; before, manager.py (this script runs on older checkouts)
    from scaletrain.checkpoint.format import complete_checkpoints
    from scaletrain.checkpoint.publishing import last_save
except ImportError:
    complete_checkpoints = manager.complete_checkpoints
    last_save = getattr(manager, "last_save", None)
try:  # its home since the parallel layout became one value (parallel/layout.py); before, config.py
    from scaletrain.parallel.layout import resolve_for_world
except ImportError:
    from scaletrain.config import resolve_for_world
from scaletrain.config_loader import load_config  # noqa: E402
from scaletrain.parallel.groups import destroy_distributed, init_distributed, world_size_from_environment  # noqa: E402
from scaletrain.planner.recompute import device_memory, resolve_recompute  # noqa: E402
from scaletrain.train.engine import build_engine  # noqa: E402

try:  # its home since parallelism is applied in one place (train/parallelize.py); before, engine.py
    from scaletrain.train.parallelize import build_training_model
except ImportError:
    from scaletrain.train.engine import build_training_model
from scaletrain.train.nonfinite import NonFiniteGuard  # noqa: E402
from scaletrain.train.step import train_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--saves", type=int, default=4, help="blocks with a save (and as many without)")
    parser.add_argument("--every", type=int, default=5, help="steps per block")
    args = parser.parse_args()
    config = resolve_for_world(load_config(args.config, [*args.overrides, "tracking.wandb=disabled"]),
                               world_size_from_environment())
    topology = init_distributed(config)
    config, _ = resolve_recompute(config, device_memory(topology.device))  # as train decides auto
    shared = [tempfile.mkdtemp(prefix="checkpoint_save.") if topology.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)  # one run directory for all ranks
    run_dir = shared[0]
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=run_dir))
    try:
        engine = build_engine(build_training_model(config, topology), config, topology)
        batches = random_batches(config, topology.device, seed=topology.data_parallel_rank)
        guard = NonFiniteGuard(engine, topology.device)
        finish = getattr(manager, "finish_pending_save", lambda: None)
        step = 0

        def block(save: bool) -> tuple[float, float]:
            nonlocal step
            started = time.perf_counter()
            for _ in range(args.every):
                train_step(engine, guard, batches, config.train.grad_accum, config.train.lr)
                step += 1
            call = 0.0
            if save:
                call_started = time.perf_counter()
                manager.save_checkpoint(engine, config, topology, step, step * 8)
                call = time.perf_counter() - call_started
            if topology.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - started, call

        block(False)  # warm-up: the first steps and the first save's one-time costs
        block(True)
        finish()
        plain, saving, calls, writes = [], [], [], []
        for _ in range(args.saves):
            plain.append(block(False)[0])
            took, call = block(True)
            saving.append(took)
            calls.append(call)
            finish_started = time.perf_counter()
            finish()  # measure the write; the next blocks start with nothing in flight
            writes.append(call + time.perf_counter() - finish_started
                          if last_save is None else last_save.write_s)
        newest = complete_checkpoints(Path(run_dir))[-1]
        size = sum(path.stat().st_size for path in newest.rglob("*") if path.is_file())
        if topology.rank == 0:
            stall = statistics.median(s - p for s, p in zip(saving, plain, strict=True))
            asynchronous = hasattr(manager, "finish_pending_save") and config.checkpoint.async_save
            print(f"{config.model.family} {config.model.num_layers}x{config.model.hidden_size}, world "
                  f"{topology.world_size} (TP{topology.tensor_parallel_size} DP{topology.data_parallel_size}), "
                  f"ZeRO-{config.parallel.zero_stage}, {'async' if asynchronous else 'synchronous'} save: "
                  f"step {statistics.median(plain) / args.every * 1000:.0f} ms; per save: call "
                  f"{statistics.median(calls) * 1000:.0f} ms, stall {stall * 1000:.0f} ms, write "
                  f"{statistics.median(writes) * 1000:.0f} ms, size {size / 2**20:.1f} MiB")
    finally:
        dist.barrier()
        if topology.rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        destroy_distributed()


if __name__ == "__main__":
    main()
