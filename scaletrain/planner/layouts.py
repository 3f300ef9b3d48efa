"""Candidate parallel layouts (TP, CP, PP, DP, EP, ZeRO stage, micro-batch, recomputation: none, selective
or full) for a GPU count.

The rules are the ones our stack imposes, not preferences:
- TP divides the heads, the FFN size and model.vocab_divisible_by (config validation), and stays
  within a node: TP all-reduces sit on the critical path twice per block and direction
  (Shoeybi et al. 2019, sec. 3), which only NVLink bandwidth makes affordable;
- PP divides the layers (stages hold equal numbers of blocks);
- TP * CP * PP * DP = GPUs, and the global batch is a whole number of micro-batches per DP rank;
- DeepSpeed's pipeline engine supports ZeRO-0/1 only, so PP > 1 excludes ZeRO-2/3;
- CP (context parallelism, parallel/layout_rules.py) splits the sequence into 2*CP equal chunks, for a
  family whose layers run it, without pipeline stages or experts; TP*CP stays within a node, since the
  ring passes keys and values every layer (a choice, as for TP, that also bounds the search);
- for a mixture of experts, EP (parallel.expert) is carved out of the DP ranks: it divides DP and
  model.moe.num_experts, and excludes ZeRO-3 (DeepSpeed refuses ZeRO-3 with expert parallelism) and, in
  bf16, ZeRO-0 (DeepSpeed's bf16 wrapper would clip without the experts); a dense model has EP = 1 only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from scaletrain.config import Config, ConfigError
from scaletrain.families import get_family
from scaletrain.parallel.layout import Layout, requested_global_batch
from scaletrain.planner.activations import RECOMPUTE_BY_COST, Recompute

# DeepSpeed refuses ZeRO-3 with its native MoE layers ("Native DeepSpeed MoE is not supported with ZeRO
# Stage 3", deepspeed/runtime/engine.py, 0.19), and so does our EP; the pipeline's ZeRO-0/1 rule applies on top.
# In bf16 (what plan assumes unless train.precision is fp32) ZeRO-0 is refused too: DeepSpeed's bf16 wrapper
# without ZeRO leaves split experts out of the clipping norm (train/engine.py).
EXPERT_ZERO_STAGES = {"fp32": (0, 1, 2), "bf16": (1, 2)}


@dataclass(frozen=True)
class Candidate(Layout):
    """A layout the planner weighs: a run's parallel Layout (parallel/layout.py; its grad_accum, the micro-batches
    each pipeline runs per step, the m in the bubble (p-1)/m, makes the global batch the layouts are compared at)
    with the recomputation it would run."""

    recompute: Recompute = Recompute.NONE  # none, selective or full (a bool still reads as none or full)


def planning_global_batch(config: Config) -> int:
    """The global batch (sequences per step) all layouts are compared at."""
    global_batch = requested_global_batch(config)
    if global_batch is not None:
        return global_batch
    raise ConfigError(
        "planning needs a fixed global batch, but train.global_batch_size is not set (and neither is "
        "parallel.data); pass e.g. train.global_batch_size=512"
    )


def layout_settings(config: Config, layout: Candidate) -> dict[str, int | str]:
    """The dotted config keys (`key=value` overrides) that make `scaletrain train` run `layout`.

    The global batch stays the one the layouts were compared at: train.global_batch_size where the
    config sets it (grad_accum is then derived at launch; setting both is refused), else grad_accum
    for this DP. Pipelines get parallel.pipeline_partition=blocks, the equal block counts per stage
    that the memory and time models assume (the config's default balances parameters instead)."""
    global_batch = planning_global_batch(config)
    settings: dict[str, int | str] = {
        "parallel.tensor": layout.tensor, "parallel.pipeline": layout.pipeline, "parallel.data": layout.data,
        "parallel.zero_stage": layout.zero_stage,
    }
    if num_experts(config) or config.parallel.expert != 1:
        settings["parallel.expert"] = layout.expert
    if layout.context > 1:
        settings["parallel.context"] = layout.context
    if layout.pipeline > 1:
        settings["parallel.pipeline_partition"] = "blocks"
    settings["train.micro_batch_size"] = layout.micro_batch
    if config.train.global_batch_size is not None:
        settings["train.global_batch_size"] = global_batch
    else:
        settings["train.grad_accum"] = layout.grad_accum
    recompute = Recompute(layout.recompute)
    settings["train.activation_checkpoint"] = recompute.setting
    # full recomputation is modelled in chunks of one block (interval 0 or 1); any other interval the config
    # sets would recompute longer chunks, or be refused beside none or selective
    chunk = 1 if recompute == Recompute.FULL else 0
    if config.train.activation_checkpoint_interval not in (0, chunk):
        settings["train.activation_checkpoint_interval"] = chunk
    return settings


def num_experts(config: Config) -> int:
    """Experts per MoE layer of the causal decoders' `model.moe` (model/moe.py); 0 for a dense model."""
    moe = getattr(config.model, "moe", None)
    return moe.num_experts if moe is not None and moe.enabled else 0


def expert_parallel_sizes(config: Config, data_parallel: int) -> list[int]:
    """EP sizes for `data_parallel` DP ranks: the divisors of DP that divide the experts; [1] if dense."""
    experts = num_experts(config)
    if not experts:
        return [1]
    return [ep for ep in range(1, data_parallel + 1) if data_parallel % ep == 0 and experts % ep == 0]


def tensor_parallel_sizes(config: Config, gpus_per_node: int) -> list[int]:
    model = config.model
    return [
        tp for tp in range(1, gpus_per_node + 1)
        if model.num_heads % tp == 0 and model.ffn_size % tp == 0 and model.vocab_divisible_by % tp == 0
    ]


def context_parallel_sizes(config: Config, gpus: int, most: int) -> list[int]:
    """CP sizes to offer: 1, and for a family that runs context parallelism every size up to `most` that
    divides the GPUs and cuts the sequence into 2*CP equal chunks."""
    if not get_family(config.model.family).context_parallel or num_experts(config):
        return [1]  # a family without it, or MoE layers (refused under CP: layout_rules.py)
    return [cp for cp in range(1, most + 1) if gpus % cp == 0 and config.model.seq_length % (2 * cp) == 0]


def enumerate_layouts(config: Config, gpus: int, gpus_per_node: int, max_micro_batch: int) -> Iterator[Candidate]:
    """Every layout that satisfies the rules in the module docstring."""
    global_batch = planning_global_batch(config)
    expert_zero_stages = EXPERT_ZERO_STAGES["fp32" if config.train.precision == "fp32" else "bf16"]
    for tp in tensor_parallel_sizes(config, gpus_per_node):
        for cp in context_parallel_sizes(config, gpus, gpus_per_node // tp):
            for pp in range(1, config.model.num_layers + 1 if cp == 1 else 2):
                if config.model.num_layers % pp or gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                zero_stages = (0, 1) if pp > 1 else (0, 1, 2, 3)
                for micro_batch in range(1, max_micro_batch + 1):
                    if global_batch % (micro_batch * dp):
                        continue
                    for ep in expert_parallel_sizes(config, dp):
                        for zero_stage in (z for z in zero_stages if ep == 1 or z in expert_zero_stages):
                            for recompute in RECOMPUTE_BY_COST:
                                yield Candidate(tensor=tp, context=cp, pipeline=pp, data=dp, expert=ep,
                                                zero_stage=zero_stage, micro_batch=micro_batch,
                                                grad_accum=global_batch // (micro_batch * dp), recompute=recompute)
