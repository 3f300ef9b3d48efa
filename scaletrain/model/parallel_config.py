"""megatron-core's ModelParallelConfig for a run."""

from __future__ import annotations

import torch
from megatron.core.model_parallel_config import ModelParallelConfig

from scaletrain.config import Config


def model_parallel_config(config: Config) -> ModelParallelConfig:
    """CPU initialisation always: it builds each full master weight, which is what makes the
    initial model identical in every layout (see model/init.py)."""
    return ModelParallelConfig(
        tensor_model_parallel_size=config.parallel.tensor,
        pipeline_model_parallel_size=config.parallel.pipeline,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32 if config.parallel.pipeline > 1 else None,
        sequence_parallel=config.parallel.sequence_parallel,
    )
