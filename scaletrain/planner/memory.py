"""Per-GPU training memory of a layout: weights, gradients, optimizer state, activations, pipeline buffers.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, sec. 3.1 and 5): mixed-precision
Adam keeps 2 bytes of bf16 weights, 2 of bf16 gradients and K = 12 of fp32 master weights and
Adam moments per parameter; stage 1 partitions the K bytes over the DP ranks, stage 2 also the
gradients, stage 3 also the weights. The byte counts are made exact for our DeepSpeed setup
(train/engine.py), which the CPU tests check tensor by tensor:
- DeepSpeed's ZeRO-1/2 flattens each AdamW group (matrices, vectors) and pads it to a multiple of
  2 * DP elements before partitioning (`nccl_start_alignment_factor` in stage_1_and_2.py);
- its fp32 master partition exists even for fp32 weights; only fp32 without ZeRO lets torch's
  AdamW update the model's weights in place, with no master copy (K = 8);
- without ZeRO, pipeline stages or expert parallelism the engine steps scaletrain's FlatAdamW
  (train/flat_adamw.py): fp32 gradients accumulated in one flat buffer (4 bytes per parameter, the
  bf16 gradient of one tensor at a time on its way there), fp32 master weights under bf16 (none in
  fp32: the master is the weight), both moments, and one step counter per flat segment (at most
  FLAT_SEGMENTS); its alignment padding (under 64 elements a tensor) is not counted;
- torch's AdamW keeps a 4-byte `step` scalar per tensor it updates: per parameter for fp32 pipeline
  stages without ZeRO, per flat group otherwise;
- with pipeline stages and no ZeRO, DeepSpeed wraps a bf16 model in its BF16_Optimizer
  (`_do_optimizer_sanity_check` in runtime/engine.py), which partitions the master weights and
  moments over DP as ZeRO-1 does but keeps full fp32 gradients (4 bytes per parameter) to
  accumulate micro-batches in.
Expert parallelism (EP, carved out of the DP ranks as in DeepSpeed-MoE, Rajbhandari et al. 2022, and
Megatron): each rank holds num_experts / EP experts of every MoE layer (each still split over TP like a
dense MLP) and all dense weights and routers. Expert gradients are reduced over the DP / EP ranks that
hold the same experts (the expert-data-parallel group), so ZeRO-1/2 partition the dense groups over DP
and the expert groups, AdamW's matrices and vectors again, padded the same way, over DP / EP (DeepSpeed's
`split_params_into_different_moe_groups_for_optimizer`); ZeRO-2's expert gradients likewise. ZeRO-3 with
EP is refused (layouts.py), as DeepSpeed refuses it. At EP = 1 the experts stay in the dense groups.
Not modelled: the MoE layers' activations beyond a dense MLP's (a token's k experts and the dispatched
copies); DeepSpeed's communication buckets, the transient fp32 gradient partition it builds
at the optimizer step (after activations are freed, so it does not raise the peak when
activations are larger), and ZeRO-3's per-parameter partition padding; the planner's memory
reserve covers these, the CUDA context and allocator fragmentation.

Parameters come from params.py (counted from the family's own modules). Activations come from
activations.py, whose per-block formula is Korthikanti et al.'s for a GPT decoder block; every
family's blocks (for T5 its encoder and decoder blocks together, whose cross-attention is not
modelled) are charged that formula, an approximation outside GPT. Under the 1F1B schedule (Narayanan et al. 2021, sec.
2.2.1) stage i holds min(PP - i, m) micro-batches in flight, so the first stage holds the
most; the extra in-flight micro-batches, and the stage outputs kept for their backward (all
but the last stage), are reported as pipeline buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from scaletrain.config import Config
from scaletrain.planner.activations import ActivationSettings, flex_attention_planned, stage_activations
from scaletrain.planner.layouts import Candidate
from scaletrain.planner.params import ParameterCount, largest_gathered_module, num_blocks, stage_parameters

ADAM_MOMENT_BYTES = 8  # fp32 exp_avg + exp_avg_sq
MASTER_WEIGHT_BYTES = 4
STEP_COUNTER_BYTES = 4
FLAT_SEGMENTS = 4  # FlatAdamW's segments: tensor-parallel or replicated x decayed or not
ZERO_ALIGNMENT = 2  # DeepSpeed pads each flat group to a multiple of 2 * DP elements


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the bf16/fp32 model states and activations."""

    name: str
    weight_bytes: int
    grad_bytes: int
    activation_bytes: int


MIXED_BF16 = Precision("bf16", weight_bytes=2, grad_bytes=2, activation_bytes=2)
FP32 = Precision("fp32", weight_bytes=4, grad_bytes=4, activation_bytes=4)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    pipeline_buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.pipeline_buffers


def zero_partition_numel(group_numel: int, data_parallel: int) -> int:
    """Elements of one DP rank's partition of a flat group, padding included (DeepSpeed ZeRO-1/2)."""
    alignment = ZERO_ALIGNMENT * data_parallel
    return math.ceil(group_numel / alignment) * alignment // data_parallel


def uses_flat_optimizer(layout: Candidate) -> bool:
    """train/engine.py's `uses_flat_optimizer`: FlatAdamW steps layouts without ZeRO, stages or EP."""
    return layout.zero_stage == 0 and layout.pipeline == 1 and layout.expert == 1


def flat_optimizer_bytes(params: ParameterCount, precision: Precision) -> int:
    """FlatAdamW's state: both moments, the fp32 master under bf16, a step counter per segment."""
    master = MASTER_WEIGHT_BYTES if precision.weight_bytes < MASTER_WEIGHT_BYTES else 0
    return (ADAM_MOMENT_BYTES + master) * params.total + STEP_COUNTER_BYTES * FLAT_SEGMENTS


def optimizer_state_bytes(params: ParameterCount, zero_stage: int, data_parallel: int, precision: Precision) -> int:
    """fp32 master weights (if any), Adam moments and step counters held by one GPU (DeepSpeed's optimizers)."""
    if zero_stage == 0 and precision.weight_bytes == MASTER_WEIGHT_BYTES:
        return ADAM_MOMENT_BYTES * params.total + STEP_COUNTER_BYTES * params.tensors
    per_element = MASTER_WEIGHT_BYTES + ADAM_MOMENT_BYTES
    groups = [n for n in (params.matrices, params.vectors) if n]
    if zero_stage == 0:
        return per_element * params.total + STEP_COUNTER_BYTES * len(groups)
    return sum(per_element * zero_partition_numel(n, data_parallel) + STEP_COUNTER_BYTES for n in groups)


def uses_pipeline_bf16_optimizer(layout: Candidate, precision: Precision) -> bool:
    return layout.pipeline > 1 and layout.zero_stage == 0 and precision.weight_bytes < MASTER_WEIGHT_BYTES


@dataclass(frozen=True)
class RankParameters:
    """Parameters on one GPU: the dense ones (ZeRO partitions them over DP) and this rank's experts
    (num_experts / EP per MoE layer; ZeRO partitions them over the DP / EP expert-data-parallel ranks)."""

    dense: ParameterCount
    experts: ParameterCount

    @property
    def total(self) -> int:
        return self.dense.total + self.experts.total


def rank_parameters(config: Config, layout: Candidate, stage: int) -> RankParameters:
    """One GPU's parameters on stage `stage`; at EP = 1 the experts count as dense (module docstring)."""
    params = stage_parameters(config, layout.tensor, layout.pipeline, stage)
    if layout.expert == 1:
        return RankParameters(params, ParameterCount())
    experts = stage_parameters(config, layout.tensor, layout.pipeline, stage, experts_only=True)
    return RankParameters(params - experts, experts.share(layout.expert))


def expert_data_parallel(layout: Candidate) -> int:
    """The ranks holding the same experts, over which their gradients and ZeRO's partitions go."""
    return layout.data // layout.expert


def weight_bytes(config: Config, params: RankParameters, layout: Candidate, precision: Precision) -> float:
    """Weights on one GPU; ZeRO-3 (never with EP) adds the gathered weights of the module computing and the
    one prefetched."""
    if layout.zero_stage < 3:
        return precision.weight_bytes * params.total
    largest_module = largest_gathered_module(config, layout.tensor).total
    return precision.weight_bytes * (math.ceil(params.total / layout.data) + 2 * largest_module)


def gradient_bytes(params: RankParameters, layout: Candidate, precision: Precision) -> float:
    if uses_flat_optimizer(layout):
        return MASTER_WEIGHT_BYTES * params.total
    if layout.zero_stage < 2:
        return precision.grad_bytes * params.total
    partitioned = math.ceil(params.dense.total / layout.data)
    partitioned += math.ceil(params.experts.total / expert_data_parallel(layout))
    return precision.grad_bytes * partitioned


def rank_optimizer_bytes(params: RankParameters, zero_stage: int, layout: Candidate, precision: Precision) -> int:
    """Optimizer state of the dense groups partitioned over DP plus the expert groups over DP / EP."""
    return (optimizer_state_bytes(params.dense, zero_stage, layout.data, precision)
            + optimizer_state_bytes(params.experts, zero_stage, expert_data_parallel(layout), precision))


def stage_memory(
    config: Config, layout: Candidate, stage: int, micro_batches: int, precision: Precision,
    settings: ActivationSettings,
) -> MemoryBreakdown:
    """Memory of one GPU of pipeline stage `stage` when each pipeline runs `micro_batches` per step."""
    model, pp = config.model, layout.pipeline
    settings = replace(settings, block_mask=flex_attention_planned(model, layout.context))
    params = rank_parameters(config, layout, stage)
    last = stage == pp - 1
    activations = stage_activations(
        model, config.padded_vocab_size, layout.micro_batch, layout.tensor, num_blocks(config) // pp,
        first_stage=stage == 0, last_stage=last, recompute=layout.recompute, settings=settings,
    )
    in_flight = min(pp - stage, micro_batches)
    sent_output = 0 if last else model.seq_length * layout.micro_batch * model.hidden_size * settings.activation_bytes
    bf16_optimizer = uses_pipeline_bf16_optimizer(layout, precision)
    fp32_gradients = MASTER_WEIGHT_BYTES * params.total if bf16_optimizer else 0
    return MemoryBreakdown(
        weights=weight_bytes(config, params, layout, precision),
        gradients=gradient_bytes(params, layout, precision) + fp32_gradients,
        optimizer=(flat_optimizer_bytes(params.dense, precision) if uses_flat_optimizer(layout)
                   else rank_optimizer_bytes(params, 1 if bf16_optimizer else layout.zero_stage, layout, precision)),
        # context parallelism: each rank keeps its 1/CP of the tokens' activations, and its rows of attention
        activations=activations.peak / layout.context,
        pipeline_buffers=(in_flight - 1) * activations.stored + in_flight * sent_output,
    )


def peak_memory(
    config: Config, layout: Candidate, micro_batches: int, precision: Precision, settings: ActivationSettings
) -> tuple[int, MemoryBreakdown]:
    """The stage with the most memory, and its breakdown: every stage must fit."""
    stages = [
        (stage, stage_memory(config, layout, stage, micro_batches, precision, settings))
        for stage in range(layout.pipeline)
    ]
    return max(stages, key=lambda item: item[1].total)
