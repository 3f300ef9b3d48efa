"""What a parallel layout may combine: DeepSpeed's pipeline engine, megatron's sequence parallelism,
our context parallelism and compiled blocks (train.compile).

config.py checks each parallel key's range; these rules are the engines' facts, stated here in
parallel/ beside the code that wraps them (pipeline.py, sequence_parallel.py, context_parallel.py), and run on every
config at load time by config_loader.validate. The planner's layout search (scaling/layouts.py)
offers only layouts that pass them.
"""

from __future__ import annotations

from scaletrain.config import Config, ConfigError

# DeepSpeed's PipelineEngine refuses ZeRO-2/3: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
# parallelism" (an assert in deepspeed/runtime/pipe/engine.py, DeepSpeed 0.19).
PIPELINE_ZERO_STAGES = (0, 1)
# DeepSpeed's own partition methods, and ours: equal transformer-block counts (pipeline.py PipelineBlock).
PARTITION_METHODS = ("parameters", "uniform", "blocks")


def validate_layout(config: Config) -> None:
    """Pipeline stages, sequence parallelism and compiled blocks against ZeRO, the model's depth, sequence and
    dropout."""
    parallel = config.parallel
    if parallel.pipeline > 1 and parallel.zero_stage not in PIPELINE_ZERO_STAGES:
        raise ConfigError(
            f"parallel.pipeline={parallel.pipeline} with parallel.zero_stage={parallel.zero_stage}: DeepSpeed "
            "pipelines support ZeRO-0/1 only; use parallel.zero_stage=1 or parallel.pipeline=1"
        )
    if parallel.pipeline > config.model.num_layers:
        raise ConfigError(
            f"parallel.pipeline={parallel.pipeline} exceeds model.num_layers={config.model.num_layers}; "
            "every stage needs at least one block"
        )
    _validate_pipeline_partition(config)
    if parallel.context > 1:
        _validate_context_parallel(config)
    if parallel.expert > 1:
        _validate_expert_parallel(config)
    if parallel.sequence_parallel:
        _validate_sequence_parallel(config)
    if config.train.compile and parallel.zero_stage == 3:
        # ZeRO-3 gathers each layer's weights in forward hooks DeepSpeed marks torch.compiler.disable
        # (parameter_offload.py, DeepSpeed 0.19): a compiled block breaks its graph at every layer
        raise ConfigError("train.compile=true with parallel.zero_stage=3: ZeRO-3 gathers every layer's weights in "
                          "hooks torch.compile cannot trace, so a block would compile in pieces of one layer; use "
                          "parallel.zero_stage=1 or 2 with train.compile=true, or train.compile=false with ZeRO-3")


def _validate_pipeline_partition(config: Config) -> None:
    """A partition method, or blocks per stage ("5,7": the embedding joins the first stage, the head the last)."""
    partition = config.parallel.pipeline_partition
    if partition in PARTITION_METHODS:
        return
    try:
        blocks = [int(part) for part in partition.split(",")]
    except ValueError:
        blocks = []
    if (
        len(blocks) != config.parallel.pipeline
        or sum(blocks) != config.model.num_layers
        or min(blocks, default=0) < 1
    ):
        raise ConfigError(
            f"parallel.pipeline_partition={partition!r}; use parameters, uniform, blocks, or "
            f"{config.parallel.pipeline} comma-separated block counts (each >= 1) summing to "
            f"model.num_layers={config.model.num_layers}"
        )


def _validate_expert_parallel(config: Config) -> None:
    """Expert parallelism (expert_parallel.py) splits MoE experts over data-parallel ranks, with
    DeepSpeed's expert-gradient path, which refuses ZeRO-3 ("Native DeepSpeed MoE is not supported
    with ZeRO Stage 3", engine._validate_zero3_moe_compatibility, DeepSpeed 0.19)."""
    parallel = config.parallel
    moe = getattr(config.model, "moe", None)
    if moe is None or not moe.enabled:
        raise ConfigError(f"parallel.expert={parallel.expert} splits MoE experts over ranks, but the model has no "
                          "experts; set model.moe.num_experts (gpt, llama) or parallel.expert=1")
    if moe.num_experts % parallel.expert:
        raise ConfigError(f"parallel.expert={parallel.expert} must divide model.moe.num_experts={moe.num_experts}: "
                          "each rank holds the same number of experts")
    if parallel.zero_stage == 3:
        raise ConfigError(f"parallel.expert={parallel.expert} with parallel.zero_stage=3: DeepSpeed reduces split "
                          "experts' gradients with ZeRO-0/1/2 only; use parallel.zero_stage=1 or 2")
    if parallel.data is not None and parallel.data % parallel.expert:
        raise ConfigError(f"parallel.expert={parallel.expert} must divide parallel.data={parallel.data}: experts are "
                          "split over data-parallel ranks")


def _validate_context_parallel(config: Config) -> None:
    """Context parallelism (context_parallel.py) cuts each sequence into 2 x parallel.context equal chunks;
    which families run it is the family registry's rule (families/__init__.py)."""
    parallel, seq_length = config.parallel, config.model.seq_length
    if seq_length % (2 * parallel.context):
        raise ConfigError(
            f"parallel.context={parallel.context} needs model.seq_length={seq_length} to split into "
            f"2 x {parallel.context} equal chunks (zigzag load balancing); use a model.seq_length divisible by "
            f"{2 * parallel.context}, or another parallel.context")
    if parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel with parallel.context > 1 is not implemented (the ring would "
                          "need the sequence-parallel slices gathered first); set parallel.sequence_parallel=false "
                          "or parallel.context=1")
    if parallel.pipeline > 1:
        raise ConfigError(f"parallel.pipeline={parallel.pipeline} with parallel.context={parallel.context}: context "
                          "parallelism is not implemented for DeepSpeed's pipeline engine; use parallel.pipeline=1 "
                          "(TP, CP and DP combine) or parallel.context=1")


def _validate_sequence_parallel(config: Config) -> None:
    """Sequence parallelism (sequence_parallel.py) splits the sequence over the tensor-parallel ranks,
    and has no per-rank dropout stream on CPU."""
    parallel, model = config.parallel, config.model
    if parallel.tensor < 2:
        raise ConfigError("parallel.sequence_parallel splits the sequence over tensor-parallel ranks; "
                          "set parallel.tensor >= 2 or parallel.sequence_parallel=false")
    if model.seq_length % parallel.tensor:
        raise ConfigError(f"parallel.tensor={parallel.tensor} must divide model.seq_length={model.seq_length} "
                          "under sequence parallelism")
    if model.dropout:
        raise ConfigError(
            f"model.dropout={model.dropout} with parallel.sequence_parallel: each TP rank would need its own "
            "dropout stream (megatron's CUDA RNG tracker), which is not implemented; set model.dropout=0"
        )
