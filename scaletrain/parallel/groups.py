"""Process-group setup: torch.distributed, then megatron-core's TP/DP/PP groups."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from scaletrain.config import Config, ConfigError
from scaletrain.parallel.layout import Layout


@dataclass(frozen=True)
class Topology:
    """This process's place in its run's layout, the TP x CP x DP x PP grid (TP fastest, then CP, then DP, then PP:
    Megatron's tp-cp-dp-pp): the Layout and this rank's coordinates in it. Data-parallel coordinates are the pure
    DP ones (which samples a rank reads); the context-parallel ranks of one DP rank read the same samples and each
    keeps its chunks of the sequence."""

    layout: Layout
    rank: int
    tensor_parallel_rank: int
    data_parallel_rank: int
    pipeline_parallel_rank: int
    device: torch.device
    context_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.tensor

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data

    @property
    def pipeline_parallel_size(self) -> int:
        return self.layout.pipeline

    @property
    def expert_parallel_size(self) -> int:
        """Expert parallelism is carved out of the data-parallel ranks (it does not add a grid dimension):
        data-parallel ranks k·EP .. k·EP+EP-1 of one TP rank and stage split each MoE layer's experts."""
        return self.layout.expert

    @property
    def context_parallel_size(self) -> int:
        return self.layout.context

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    @property
    def replica_size(self) -> int:
        """Ranks holding the same weights (DP x CP): what DeepSpeed averages gradients over."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def replica_rank(self) -> int:
        """This rank's place among them (DP rank x CP + CP rank, megatron's DP-with-CP group rank)."""
        return self.data_parallel_rank * self.context_parallel_size + self.context_parallel_rank

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts (one per expert-parallel group): what their gradients average over."""
        return self.data_parallel_size // self.expert_parallel_size

    @property
    def expert_data_parallel_rank(self) -> int:
        return self.data_parallel_rank // self.expert_parallel_size


def init_distributed(config: Config) -> Topology:
    """Start torch.distributed (alone or under torchrun/SLURM) and build megatron's groups.

    `config` must already be resolved for the world size (parallel.layout.resolve_for_world).
    """
    _default_single_process_environment()
    device = _select_device()
    if not dist.is_initialized():
        # Plain torch.distributed: deepspeed.initialize adopts the existing group later, and
        # commands that need no engine (generate, export) never import DeepSpeed.
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=config.parallel.timeout_s))
    world_size = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.parallel.tensor,
            pipeline_model_parallel_size=config.parallel.pipeline,
            expert_model_parallel_size=config.parallel.expert,
            context_parallel_size=config.parallel.context,
            distributed_timeout_minutes=config.parallel.timeout_s / 60,  # a timedelta's minutes: fractions do
        )
    if config.parallel.sequence_parallel:
        from scaletrain.parallel.sequence_parallel import enable_cpu_sequence_parallel

        enable_cpu_sequence_parallel()  # megatron's SP buffers on the CPU when there is no GPU
    layout = Layout.of(config)
    if (world_size, parallel_state.get_data_parallel_world_size()) != (layout.world_size, layout.data):
        raise ConfigError(f"the launcher started {world_size} processes, but the config was resolved for "
                          f"{layout.world_size} (parallel.layout.resolve_for_world with the launcher's world size)")
    return Topology(
        layout=layout,
        rank=dist.get_rank(),
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        pipeline_parallel_rank=parallel_state.get_pipeline_model_parallel_rank(),
        device=device,
        context_parallel_rank=parallel_state.get_context_parallel_rank(),
    )


def any_rank(flag: bool | torch.Tensor, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank of the world group. A flag still on the device
    (a boolean tensor) is agreed on before it is read: one host read in all."""
    value = (flag.reshape(1).to(device, torch.int32) if isinstance(flag, torch.Tensor)
             else torch.tensor([int(flag)], dtype=torch.int32, device=device))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size_from_environment() -> int:
    """The launcher's world size: torchrun's WORLD_SIZE, else the srun step's SLURM_NTASKS; 1 when run directly."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if _started_by_srun():
        return int(os.environ["SLURM_NTASKS"])
    return 1


def _select_device() -> torch.device:
    """The local rank's GPU. A launcher that binds one GPU per task (srun --gpus-per-task=1 or
    --gpu-bind) leaves each rank a single visible device, which is then its own whatever its local rank."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = 0 if torch.cuda.device_count() == 1 else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _default_single_process_environment() -> None:
    """Fill in torch.distributed's variables where torchrun did not: from the srun step's tasks
    (launch/slurm.sbatch starts one per rank), else a world of one whose store binds any free local port
    (MASTER_PORT 0: no other process needs to find it; probing for a free port and binding it later left a
    window in which another process could take it)."""
    if "RANK" in os.environ:  # torchrun set the world up
        return
    if _started_by_srun() and int(os.environ["SLURM_NTASKS"]) > 1:
        if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            raise ConfigError(
                f"srun started {os.environ['SLURM_NTASKS']} tasks but MASTER_ADDR and MASTER_PORT are not both "
                "set; export them before srun (the first node of $SLURM_JOB_NODELIST and a free port, as "
                "launch/slurm.sbatch does)"
            )
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                          WORLD_SIZE=os.environ["SLURM_NTASKS"])
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")


def _started_by_srun() -> bool:
    """A task of an srun step; the batch script itself also has SLURM_PROCID and the job's
    SLURM_NTASKS, but no SLURM_STEP_ID, and is a world of one."""
    return {"SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"} <= os.environ.keys()


def resolve_precision(config: Config, device: torch.device) -> str:
    """train.precision as it runs on `device` (`auto`: bf16 on GPU, fp32 on CPU); the engine and the
    checkpoint's recorded layout both ask here."""
    if config.train.precision != "auto":
        return config.train.precision
    return "bf16" if device.type == "cuda" else "fp32"
