"""A step-time model for ranking layouts: compute, pipeline bubble, TP/PP/DP communication.

Assumptions (the ranking is the product; the absolute time is checked against measured steps,
measured_steps.json, within 15% by tests/planner/test_step_time.py):
- Compute: per micro-batch, the last stage's work (step_work.py: every block's GEMMs, flash attention and
  memory-bound passes, then the output layer and the fp32 loss), its forward, its backward (two GEMMs per
  forward one, flash attention's 2.5x) and what backward recomputes (full: the blocks' forward; selective:
  their attention cores' forward, Korthikanti et al. 2022, sec. 4.3), each timed on the
  device (kernel_time.py: a GEMM by its shape, from the device's measured table where it has one, else a
  roofline fallback). A family whose blocks hold more than a decoder block (T5's cross-attention) has them
  timed as decoder blocks scaled to its counted FLOPs (step_work.blocks_flops_scale). Kernels do not
  overlap, and launch overheads are not counted. Then, once per step, the optimizer step on the rank's
  (ZeRO-partitioned) parameters, memory-bound: `OPTIMIZER_BYTES_PER_PARAMETER`.
- Pipeline: 1F1B with m micro-batches per pipeline and p equal stages takes (m + p - 1) times
  the slowest stage's time per micro-batch, i.e. a bubble fraction (p - 1)/m (Narayanan et al.
  2021, sec. 2.2). The last stage is the slowest: it also computes the logits.
- TP: per block and micro-batch (T5's decoder blocks' third, cross-attention all-reduce is not
  counted), 2 all-reduces of s*b*h activations forward (attention and MLP
  outputs) and 2 backward (Shoeybi et al. 2019, sec. 3), 2 more with full recomputation; ring
  all-reduce time 2(t-1)/t * bytes / bandwidth over NVLink (TP never leaves a node). Not
  overlapped with compute. The embedding and logits all-reduces (2 per step, not per block) are
  ignored.
- PP: per micro-batch each stage boundary sends the s*b*h activation forward and its gradient
  backward, over the inter-node network unless the whole job fits in one node (ranks are
  ordered TP, then DP, then PP, so neighbouring stages are TP*DP ranks apart). The
  tied-embedding gradient all-reduce between the first and last stage (once per step) is ignored.
- EP: per MoE layer and micro-batch, two all-to-alls forward (dispatch the tokens to their experts'
  ranks, combine the results back) and two backward (Lepikhin et al. 2021, GShard, sec. 2.2;
  Rajbhandari et al. 2022, DeepSpeed-MoE, sec. 5), 2 more with full recomputation; each moves a token's
  k copies, k*s*b*h activations per rank, of which (e-1)/e leave the rank. Every TP rank moves its own
  (no sequence parallelism with MoE). The EP group is e consecutive DP ranks, TP*e global ranks apart
  at most, so over NVLink when TP*e fits in a node, else the inter-node network. Not overlapped with
  compute; routing imbalance (an expert's rank waiting for the busiest) is not modelled.
- CP: a rank computes 1/CP of each sequence's tokens (and its TP all-reduces carry them), and the
  gradients are reduced over DP x CP ranks; per block and micro-batch the ring passes CP - 1 blocks of
  the rank's keys and values (counted at h wide; grouped-query heads send less) forward, their
  gradients backward and, recomputing (full or selective), the keys and values again, over NVLink (TP*CP stays in a
  node), not overlapped with compute. The cost of its unfused block attention is not counted.
- DP: once per step, gradients are all-reduced (ZeRO-0) or reduce-scattered with the updated
  weights all-gathered (ZeRO-1/2): 2(d-1)/d of the gradient bytes; ZeRO-3 also all-gathers the
  weights in backward, 3(d-1)/d (Rajbhandari et al. 2020, sec. 7). Over NVLink when the DP group
  fits in a node, else the inter-node network; not overlapped with backward (DeepSpeed's
  overlap_comm is off by default for ZeRO-1/2), which is pessimistic. Under EP the dense gradients
  go over the d DP ranks and a rank's experts' (1/e of them) over the d/e ranks holding the same experts.
- Bandwidths are per GPU and per direction, achievable rather than nominal: NVLink 4 is
  450 GB/s per direction on H100 SXM (NVIDIA datasheet, 900 GB/s bidirectional), 360 GB/s
  assumed; one 400 Gb/s NDR InfiniBand port per GPU (DGX H100) is 50 GB/s, 40 GB/s assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.planner.activations import Recompute
from scaletrain.planner.kernel_time import DEVICES, KernelTimes, kernel_times
from scaletrain.planner.layouts import Candidate
from scaletrain.planner.memory import expert_data_parallel, rank_parameters
from scaletrain.planner.params import num_blocks
from scaletrain.planner.step_work import blocks_flops_scale, loss_bytes, output_layer_gemm, stage_blocks

# AdamW on fp32 masters: the gradient read for the clipping norm and again for the update (2 x 4, fp32
# accumulation), the master weight read and written (8), two moments read and written (16), the bf16 weight
# written (2)
OPTIMIZER_BYTES_PER_PARAMETER = 34
DEFAULT_DEVICE = "h100"  # the default peak, 989 TFLOP/s, is an H100 SXM's
DEFAULT_INTRA_NODE_BANDWIDTH = 360e9  # bytes/s per GPU per direction, NVLink
DEFAULT_INTER_NODE_BANDWIDTH = 40e9  # bytes/s per GPU per direction, InfiniBand
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Hardware:
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    memory_bandwidth: float = DEVICES[DEFAULT_DEVICE].memory_bandwidth  # HBM bytes/s of one GPU
    device: str | None = None  # names its measured tables (kernel_time.py), e.g. "h200"; None: the fallback
    intra_node_bandwidth: float = DEFAULT_INTRA_NODE_BANDWIDTH
    inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE

    def kernel_times(self) -> KernelTimes:
        return kernel_times(self.peak_flops, self.memory_bandwidth, self.device)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by cause."""

    compute: float  # the micro-batches' forward and backward
    bubble: float
    tensor_parallel: float
    pipeline_parallel: float
    data_parallel: float
    expert_parallel: float = 0.0  # the MoE layers' token all-to-alls
    context_parallel: float = 0.0  # the ring's keys and values
    optimizer: float = 0.0  # the optimizer step
    measured_gemms: bool = False  # every GEMM timed from the device's measured table, none by the fallback

    @property
    def total(self) -> float:
        return self.compute + self.optimizer + self.bubble + self.communication

    @property
    def communication(self) -> float:
        return (self.tensor_parallel + self.pipeline_parallel + self.data_parallel + self.expert_parallel
                + self.context_parallel)


def ring_all_reduce_seconds(num_bytes: float, ranks: int, bandwidth: float) -> float:
    """Each rank sends and receives 2(n-1)/n of the buffer in a ring all-reduce."""
    return 2 * (ranks - 1) / ranks * num_bytes / bandwidth if ranks > 1 else 0.0


def all_to_all_seconds(num_bytes: float, ranks: int, bandwidth: float) -> float:
    """Each rank keeps 1/n of its buffer and sends (n-1)/n of it (receiving as much) in an all-to-all."""
    return (ranks - 1) / ranks * num_bytes / bandwidth if ranks > 1 else 0.0


def predict_step_time(
    config: Config, layout: Candidate, hardware: Hardware, activation_bytes: int, grad_bytes: int
) -> StepTime:
    model = config.model
    micro_batches = layout.grad_accum
    tokens = model.seq_length * layout.micro_batch
    blocks_per_stage = num_blocks(config) // layout.pipeline
    compute, measured_gemms = micro_batch_compute_seconds(config, layout, hardware.kernel_times(), activation_bytes)

    activation = tokens * model.hidden_size * activation_bytes / layout.context  # a CP rank's tokens
    all_reduces = blocks_per_stage * (6 if layout.recompute == Recompute.FULL else 4)
    tensor_parallel = all_reduces * ring_all_reduce_seconds(activation, layout.tensor, hardware.intra_node_bandwidth)
    pipeline_parallel = 0.0
    if layout.pipeline > 1:
        in_node = layout.tensor * layout.data * layout.pipeline <= hardware.gpus_per_node
        bandwidth = hardware.intra_node_bandwidth if in_node else hardware.inter_node_bandwidth
        pipeline_parallel = 2 * activation / bandwidth

    expert_parallel = _expert_parallel_seconds(config, layout, hardware, activation_bytes)
    ring_passes = (3 if layout.recompute else 2) * (layout.context - 1)  # K/V forward, gradients back, recomputed
    context_parallel = blocks_per_stage * ring_passes * 2 * activation / layout.tensor / hardware.intra_node_bandwidth
    per_micro_batch = compute + tensor_parallel + pipeline_parallel + expert_parallel + context_parallel
    return StepTime(
        compute=micro_batches * compute,
        bubble=(layout.pipeline - 1) * per_micro_batch,
        tensor_parallel=micro_batches * tensor_parallel,
        pipeline_parallel=micro_batches * pipeline_parallel,
        data_parallel=_data_parallel_seconds(config, layout, hardware, grad_bytes),
        expert_parallel=micro_batches * expert_parallel,
        context_parallel=micro_batches * context_parallel,
        optimizer=_optimizer_seconds(config, layout, hardware.kernel_times()),
        measured_gemms=measured_gemms,
    )


def micro_batch_compute_seconds(
    config: Config, layout: Candidate, times: KernelTimes, activation_bytes: int
) -> tuple[float, bool]:
    """One micro-batch's forward and backward on the last stage (module docstring), and whether every GEMM
    in it was timed from measurements."""
    blocks = num_blocks(config)
    stage = range(blocks - blocks // layout.pipeline, blocks)
    works = stage_blocks(config, stage, layout.micro_batch, layout.tensor, layout.expert, layout.context,
                         activation_bytes)
    seconds = 0.0
    for work, count in works:
        forward = (sum(map(times.gemm_seconds, work.gemms)) + times.attention_seconds(work.attention, "forward")
                   + times.memory_seconds(work.elementwise_bytes))
        backward = (sum(times.gemm_seconds(gradient) for gemm in work.gemms for gradient in gemm.backward())
                    + times.attention_seconds(work.attention, "backward")
                    + times.memory_seconds(2 * work.elementwise_bytes))
        recomputed = {Recompute.FULL: forward, Recompute.SELECTIVE: times.attention_seconds(work.attention, "forward")}
        seconds += count * (forward + backward + recomputed.get(layout.recompute, 0.0))
    seconds *= blocks_flops_scale(config)
    logits = output_layer_gemm(config, layout.micro_batch, layout.tensor, layout.context)
    seconds += sum(map(times.gemm_seconds, (logits, *logits.backward())))
    seconds += times.memory_seconds(loss_bytes(config, layout.micro_batch, layout.tensor, layout.context))
    forward_gemms = [logits, *(gemm for work, _ in works for gemm in work.gemms)]
    measured = all(times.measured_gemm_rate(g.m, g.n, g.k) is not None
                   for gemm in forward_gemms for g in (gemm, *gemm.backward()))
    return seconds, measured


def _optimizer_seconds(config: Config, layout: Candidate, times: KernelTimes) -> float:
    """The slowest stage's optimizer step over its rank's partition: ZeRO-1/2/3 split it over DP (experts over
    the DP / EP ranks holding them), which then all-gather the weights (the DP term)."""
    def stage_parameters(stage: int) -> float:
        params = rank_parameters(config, layout, stage)
        if layout.zero_stage == 0:
            return params.total
        return params.dense.total / layout.data + params.experts.total / expert_data_parallel(layout)

    parameters = max(stage_parameters(stage) for stage in {0, layout.pipeline - 1})
    return times.memory_seconds(OPTIMIZER_BYTES_PER_PARAMETER * parameters)


def _expert_parallel_seconds(config: Config, layout: Candidate, hardware: Hardware, activation_bytes: int) -> float:
    """The all-to-alls of one micro-batch on the last stage (the one the compute term times)."""
    if layout.expert == 1:
        return 0.0
    moe, blocks = config.model.moe, num_blocks(config)
    per_stage = blocks // layout.pipeline
    moe_layers = sum(moe.is_moe_layer(block) for block in range(blocks - per_stage, blocks))
    dispatched = moe.top_k * config.model.seq_length * layout.micro_batch * config.model.hidden_size * activation_bytes
    in_node = layout.tensor * layout.expert <= hardware.gpus_per_node
    bandwidth = hardware.intra_node_bandwidth if in_node else hardware.inter_node_bandwidth
    all_to_alls = moe_layers * (6 if layout.recompute == Recompute.FULL else 4)
    return all_to_alls * all_to_all_seconds(dispatched, layout.expert, bandwidth)


def _data_parallel_seconds(config: Config, layout: Candidate, hardware: Hardware, grad_bytes: int) -> float:
    """Gradients are reduced over the DP x CP ranks (context-parallel ranks hold the same weights)."""
    replicas = layout.data * layout.context
    if replicas == 1:
        return 0.0
    in_node = layout.tensor * replicas <= hardware.gpus_per_node
    bandwidth = hardware.intra_node_bandwidth if in_node else hardware.inter_node_bandwidth

    def stage_seconds(stage: int) -> float:
        params = rank_parameters(config, layout, stage)
        return (ring_all_reduce_seconds(params.dense.total * grad_bytes, replicas, bandwidth)
                + ring_all_reduce_seconds(params.experts.total * grad_bytes, expert_data_parallel(layout), bandwidth))

    seconds = max(stage_seconds(stage) for stage in {0, layout.pipeline - 1})
    return seconds * 1.5 if layout.zero_stage == 3 else seconds
