"""A run's parallel layout as one value: the ranks that split the model (TP, CP, PP) and the data (DP, with EP
carved out of it), the ZeRO stage, the micro-batch and the gradient accumulation, hence the global batch.

Resolved once per run from its config and world size (resolve_for_world: the config, with parallel.data,
parallel.zero_stage and train.grad_accum as this world runs them, of which Layout.of reads the value); the
runtime's Topology (groups.py) is a Layout plus this rank's coordinates; a checkpoint records it
(checkpoint/format.py layout_of) and resume policy compares the global batch of the layout that wrote it
(Layout.stored) with today's. The global batch (micro-batch x grad_accum x DP) is computed here only.
torchtitan passes one ParallelDims the same way (torchtitan/distributed/parallel_dims.py). What a layout may
combine (pipelines and ZeRO, SP, CP, EP) is checked at load, by layout_rules.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scaletrain.config import Config, ConfigError


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    context: int = 1  # context-parallel ranks each sequence is split over
    pipeline: int = 1
    data: int = 1  # pure data-parallel ranks (which samples a rank reads)
    expert: int = 1  # EP: ranks among the DP ones that split each MoE layer's experts
    zero_stage: int = 0
    micro_batch: int = 1  # sequences per rank per forward
    grad_accum: int = 1  # micro-batches per DP rank per optimizer step

    @property
    def model_parallel(self) -> int:
        """Ranks one copy of the weights spans: TP x CP x PP."""
        return self.tensor * self.context * self.pipeline

    @property
    def world_size(self) -> int:
        return self.model_parallel * self.data

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch x grad_accum x DP (context-parallel ranks share sequences)."""
        return self.micro_batch * self.grad_accum * self.data

    @classmethod
    def of(cls, config: Config) -> Layout:
        """The layout of a config resolved for its world (resolve_for_world), or of one that sets parallel.data."""
        parallel = config.parallel
        if parallel.data is None:
            raise ConfigError("the layout of a config needs parallel.data: resolve it for its world size first "
                              "(parallel.layout.resolve_for_world)")
        return cls(tensor=parallel.tensor, context=parallel.context, pipeline=parallel.pipeline, data=parallel.data,
                   expert=parallel.expert, zero_stage=parallel.zero_stage,
                   micro_batch=config.train.micro_batch_size, grad_accum=config.train.grad_accum)

    @classmethod
    def stored(cls, config: Mapping[str, Any]) -> Layout | None:
        """The layout of a run's saved config (its config.yaml, nested, or flattened to `section.key`), resolved for
        its world as every saved config is; None when it lacks a key (a config saved before it was recorded)."""
        def value(section: str, key: str, default: Any = None) -> Any:
            flat = config.get(f"{section}.{key}", default)
            nested = config.get(section)
            return nested.get(key, flat) if isinstance(nested, Mapping) else flat

        try:
            return cls(tensor=int(value("parallel", "tensor", 1)), context=int(value("parallel", "context", 1)),
                       pipeline=int(value("parallel", "pipeline", 1)), data=int(value("parallel", "data") or 1),
                       expert=int(value("parallel", "expert", 1)), zero_stage=int(value("parallel", "zero_stage", 0)),
                       micro_batch=int(value("train", "micro_batch_size")),
                       grad_accum=int(value("train", "grad_accum")))
        except (TypeError, ValueError):
            return None


def resolve_for_world(config: Config, world_size: int) -> Config:
    """The config with parallel.data, parallel.zero_stage and train.grad_accum fixed for this world size, so that
    Layout.of(config) is the layout it runs.

    DP is derived from the world size, or checked against it when the config sets it. ZeRO-1/2
    with one data-parallel rank and no pipeline have nothing to partition and run as stage 0:
    DeepSpeed would still keep an fp32 master copy of every parameter behind the optimizer step
    and the copies back each step (a 30M GPT on CPU: 1.24x a plain PyTorch loop as ZeRO-1, 0.99x as
    stage 0). Pipelines keep their stage: DeepSpeed's pipelined ZeRO-0 checkpoints do not reshard.
    """
    parallel = config.parallel
    model_parallel = parallel.tensor * parallel.context * parallel.pipeline
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor x parallel.context x parallel.pipeline = "
            f"{parallel.tensor} x {parallel.context} x {parallel.pipeline}; launch a multiple of {model_parallel} "
            "processes"
        )
    data_parallel = world_size // model_parallel
    if parallel.data is not None and parallel.data != data_parallel:
        raise ConfigError(
            f"world size {world_size} != parallel.tensor x parallel.context x parallel.pipeline x parallel.data = "
            f"{parallel.tensor} x {parallel.context} x {parallel.pipeline} x {parallel.data}; "
            f"launch {model_parallel * parallel.data} processes or set parallel.data={data_parallel}"
        )
    if data_parallel % parallel.expert:
        raise ConfigError(
            f"parallel.expert={parallel.expert} must divide the data-parallel size {data_parallel} (world size "
            f"{world_size} / (parallel.tensor x parallel.context x parallel.pipeline)): experts are split over "
            f"data-parallel ranks; launch a multiple of {model_parallel * parallel.expert} processes or lower "
            "parallel.expert"
        )
    grad_accum = config.train.grad_accum
    if config.train.global_batch_size is not None:
        per_step = Layout(data=data_parallel, micro_batch=config.train.micro_batch_size).global_batch
        if config.train.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={config.train.global_batch_size} is not divisible by "
                f"train.micro_batch_size x data-parallel size = {config.train.micro_batch_size} x {data_parallel}; "
                "change the micro-batch size or the number of processes"
            )
        grad_accum = config.train.global_batch_size // per_step
    zero_stage = config.parallel.zero_stage
    # context-parallel ranks hold the same weights: DeepSpeed reduces (and ZeRO partitions) over DP x CP
    if data_parallel * parallel.context == 1 and parallel.pipeline == 1 and zero_stage in (1, 2):
        zero_stage = 0
    return dataclasses.replace(
        config,
        parallel=dataclasses.replace(config.parallel, data=data_parallel, zero_stage=zero_stage),
        train=dataclasses.replace(config.train, grad_accum=grad_accum, global_batch_size=None),
    )


def requested_global_batch(config: Config, data_parallel: int | None = None) -> int | None:
    """The global batch a config asks for before it meets a world: train.global_batch_size, or its layout's with
    parallel.data ranks (`data_parallel` where the config leaves DP to the world size); None when that is unknown."""
    if config.train.global_batch_size is not None:
        return config.train.global_batch_size
    data = config.parallel.data or data_parallel
    if data is None:
        return None
    return Layout(data=data, micro_batch=config.train.micro_batch_size, grad_accum=config.train.grad_accum).global_batch
