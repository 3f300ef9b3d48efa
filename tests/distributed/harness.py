"""The one helper that runs a test function on several real gloo processes, and gathers TP shards.

`run_on_ranks(worker, world_size, *args)` starts `world_size` processes, initialises
torch.distributed on gloo, calls `worker(rank, world_size, *args)` in each and returns the
per-rank results (anything torch.save can write). Workers must be module-level functions.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletrain.train.jit_ops import pin_build_root
from tests.warm import fork_server


def run_on_ranks(worker: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Ranks are forks of the tests' warm fork server (tests/warm.py), which has imported torch,
    megatron-core and DeepSpeed once; spawned ranks imported them each time, ~5 s of CPU per rank.

    This process holds the ranks' rendezvous store, listening on a port the kernel picked, until they
    have joined: a port probed free and bound later by rank 0 could be taken meanwhile (CI failed once
    with EADDRINUSE, an outgoing connection's ephemeral port landing on it)."""
    fork_server()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as results_dir:
        mp.start_processes(
            _entry, args=(worker, world_size, store.port, results_dir, args), nprocs=world_size, join=True,
            start_method="forkserver",
        )
        return [torch.load(Path(results_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _entry(rank: int, worker: Callable[..., Any], world_size: int, port: int, results_dir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    # DeepSpeed's CPU comm op from this environment's own build root, with its ninja, as a training run
    # loads it (scaletrain/train/jit_ops.py): torch's shared default root is rebuilt (~30 s) whenever another
    # environment or ninja built it last, and the first engine a test builds would wait on that
    pin_build_root()
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = worker(rank, world_size, *args)
        torch.save(result, Path(results_dir) / f"rank{rank}.pt")
    finally:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def gather_vocab_shards(local: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from each TP rank's shard (megatron's own gather allocates on CUDA)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    return torch.cat(shards, dim=-1)


def gather_full_parameters(
    model: torch.nn.Module, select: Callable[[torch.Tensor], torch.Tensor] = lambda param: param.detach()
) -> dict[str, torch.Tensor]:
    """TP=1 tensors (weights, or whatever `select` takes of each parameter) merged from every TP rank."""
    from megatron.core import parallel_state

    from scaletrain.parallel.sharding import is_tensor_parallel, merge_shards

    group = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, param in model.named_parameters():
        local = select(param).contiguous()
        if is_tensor_parallel(param) and dist.get_world_size(group) > 1:
            shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, local, group=group)
            full[name] = merge_shards(shards, param.partition_dim, param.partition_stride)
        else:
            full[name] = local.clone()
    return full
