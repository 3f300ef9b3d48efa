"""How a model is parallelised, in one place: what this rank trains, given the run's layout.

A family builds its model from megatron-core's tensor-parallel layers (model/layers.py), which split
their own weights and all-reduce their own activations. What those layers do not do is applied here,
after the model is built and before DeepSpeed wraps it (torchtitan's order: build, then
`parallelize_llama`, torchtitan/models/llama3/infra/parallelize.py):

- pipeline stages: the family's pipeline layers cut into DeepSpeed stages (model/pipeline.py);
- sequence parallelism: norms see one sequence slice per TP rank, so their gradients are summed over
  TP before ZeRO sees them (parallel/sequence_parallel.py);
- ZeRO-3: a tied weight used outside the module that owns it is announced, or the borrowing module
  sees an empty partition;
- expert parallelism: the layouts DeepSpeed's optimizers cannot clip right are refused.

Two axes are applied elsewhere, by what runs them: context parallelism runs inside each block's
attention round the ring (parallel/context_parallel.py, from the families' blocks), and data
parallelism, ZeRO and the split experts' gradient groups are DeepSpeed's, when train/engine.py wraps
the model this module returns.
"""

from __future__ import annotations

from torch import nn

from scaletrain.config import Config, ConfigError
from scaletrain.families import build_model, get_family
from scaletrain.parallel.expert_parallel import expert_parallel_group
from scaletrain.parallel.groups import Topology, resolve_precision


def build_training_model(config: Config, topology: Topology) -> nn.Module:
    """The plain model, or its DeepSpeed pipeline form when the layout has pipeline stages, parallelised."""
    if topology.pipeline_parallel_size > 1:
        from scaletrain.model.pipeline import build_pipeline  # starts DeepSpeed's comm layer

        return parallelize(build_pipeline(config, topology, get_family(config.model.family)), config, topology)
    return parallelize(build_model(config), config, topology)


def parallelize(model: nn.Module, config: Config, topology: Topology) -> nn.Module:
    """`model` on this rank's device with what megatron's layers leave to the layout (the module docstring)."""
    model.to(topology.device)
    if config.parallel.sequence_parallel:
        from scaletrain.parallel.sequence_parallel import register_sequence_parallel_grad_hooks

        register_sequence_parallel_grad_hooks(model)
    if config.parallel.zero_stage == 3:
        import deepspeed

        # ZeRO-3 gathers a module's own parameters around its forward; tied weights used elsewhere
        # must be announced, or the borrowing module sees an empty partition.
        for module, parameter in model.borrowed_parameters():  # every family model has it; no ZeRO-3 with stages
            deepspeed.zero.register_external_parameter(module, parameter)
    expert_parallel = expert_parallel_group().size
    if expert_parallel > 1 and config.parallel.zero_stage == 0 and resolve_precision(config, topology.device) == "bf16":
        # DeepSpeed's bf16 wrappers without ZeRO (FP16_UnfusedOptimizer in bf16 mode, BF16_Optimizer) clip
        # with the dense parameters' norm alone (unfused_optimizer.py step, DeepSpeed 0.19): the experts would
        # be clipped by another norm than the single rank's
        raise ConfigError(f"parallel.expert={expert_parallel} with parallel.zero_stage=0 in bf16: DeepSpeed's bf16 "
                          "optimizer leaves split experts out of the clipping norm; use parallel.zero_stage=1 or 2 "
                          "(or train.precision=fp32)")
    return model
