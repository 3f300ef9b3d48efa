"""The text report of `scaletrain plan`: model size, FLOPs, the formulas used, and the ranked layouts."""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Sequence

from scaletrain.config import Config
from scaletrain.families import model_counts
from scaletrain.planner.activations import Recompute, attention_mask_bytes, flex_attention_planned
from scaletrain.planner.flops import (
    attention_core_forward_flops_per_token,
    hardware_flops_per_token,
    logits_flops_per_token,
    model_flops_per_token,
)
from scaletrain.planner.layouts import Candidate, layout_settings, num_experts
from scaletrain.planner.memory import rank_parameters
from scaletrain.planner.params import (
    LayerParameters,
    expert_parameters,
    model_parameters,
    stage_layers,
    stage_parameters,
)
from scaletrain.planner.search import Plan, PlannedLayout, runnable_now

GIB = 2**30
SBATCH_GPUS_PER_NODE = 8  # launch/slurm.sbatch's #SBATCH --gpus-per-node and --ntasks-per-node


def format_plan(plan: Plan, config_path: str, top: int, overrides: Sequence[str] = ()) -> str:
    """The report of `scaletrain plan CONFIG_PATH OVERRIDES`; it ends with the chosen layout as overrides."""
    sections = [_header(plan, config_path), _parameters(plan), _flops(plan), _memory_model(plan), _table(plan, top),
                _chosen(plan, config_path, overrides)]
    return "\n\n".join(sections) + "\n"


def _header(plan: Plan, title: str) -> str:
    config, hw = plan.config, plan.hardware
    model, counted = config.model, model_parameters(config)
    blocks = f" ({counted.num_blocks} transformer blocks in all)" if counted.num_blocks != model.num_layers else ""
    kv_heads = f" ({model.num_query_groups} kv heads)" if model.num_query_groups != model.num_heads else ""
    return "\n".join([
        f"scaletrain plan: {title}",
        f"model: {counted.family}, {model.num_layers} layers{blocks}, hidden {model.hidden_size}, "
        f"{model.num_heads} heads{kv_heads}, ffn {model.ffn_size}, seq {model.seq_length}, "
        f"vocab {config.data.vocab_size} (padded to {config.padded_vocab_size})",
        f"cluster: {plan.gpus} GPUs x {plan.gpu_memory / GIB:.2f} GiB ({plan.memory_budget / GIB:.2f} GiB usable; "
        "the rest is kept for the CUDA context, NCCL and DeepSpeed buffers and fragmentation), "
        f"{hw.peak_flops / 1e12:.0f} TFLOP/s peak, HBM {hw.memory_bandwidth / 1e9:.0f} GB/s "
        f"({hw.device or 'no device'}), "
        f"NVLink {hw.intra_node_bandwidth / 1e9:.0f} GB/s within {hw.gpus_per_node}-GPU nodes, "
        f"{hw.inter_node_bandwidth / 1e9:.0f} GB/s between nodes",
        f"global batch: {plan.global_batch} sequences = {plan.global_batch * model.seq_length:,} tokens per step",
    ])


def _parameters(plan: Plan) -> str:
    config = plan.config
    counts, counted = model_counts(config), model_parameters(config)
    lines = [
        f"parameters: {counts.total_params:,} ({counts.total_params / 1e9:.2f} B; "
        f"{counts.embedding_params:,} in embedding tables)",
        f"  {_layer_summary(counted.layers)}",
    ]
    if counts.sparse:  # a mixture of experts: a token meets its routed experts only
        lines[1:1] = [
            f"active parameters per token: {counts.active_params:,} ({counts.active_params / 1e9:.2f} B; "
            "the routed experts of each MoE layer, not all of them)",
            f"  experts: {expert_parameters(config):,} of the total, {num_experts(config)} per MoE layer; "
            "expert parallelism (EP) holds 1/EP of them on each GPU",
        ]
    shown = plan.chosen or (plan.feasible[0] if plan.feasible else None)
    if shown is not None:
        layout = shown.layout
        which = "chosen" if shown is plan.chosen else "fastest fitting"
        experts = f", EP={layout.expert}" if num_experts(config) else ""
        lines.append(f"  per stage at the {which} layout's PP={layout.pipeline} (whole stage; per GPU at "
                     f"TP={layout.tensor}{experts}):")
        lines.extend(f"    {line}" for line in stage_lines(config, layout))
    return "\n".join(lines)


def stage_lines(config: Config, layout: Candidate) -> list[str]:
    """One line per pipeline stage, every stage listed: consecutive stages that hold the same layers
    share a line that names them all ("stages 1-14, each: ..."), so PP=64 stays readable."""
    described = []
    for stage in range(layout.pipeline):
        whole = stage_parameters(config, 1, layout.pipeline, stage).total
        per_gpu = rank_parameters(config, layout, stage).total
        contents = _stage_contents(stage_layers(config, layout.pipeline, stage), layout)
        described.append(f"{whole:,} ({per_gpu:,} per GPU)  [{contents}]")
    lines = []
    for text, group in itertools.groupby(range(layout.pipeline), key=described.__getitem__):
        stages = list(group)
        name = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}, each"
        lines.append(f"{name}: {text}")
    return lines


def _layer_summary(layers: tuple[LayerParameters, ...]) -> str:
    """'embedding 1,234 + 32 blocks x 5,678 + final_norm 90 + output tied to embedding'."""
    parts: list[str] = []
    blocks: list[int] = []
    shared_by_blocks: set[str] = set()  # an owner the blocks run (ALBERT's shared block)

    def flush() -> None:
        if blocks and shared_by_blocks:
            parts.append(f"{len(blocks)} blocks running {', '.join(sorted(shared_by_blocks))} (counted once)")
        elif blocks:
            sizes = sorted(set(blocks))
            size = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,} to {sizes[-1]:,}"
            parts.append(f"{len(blocks)} blocks x {size}")
        blocks.clear()
        shared_by_blocks.clear()

    for layer in layers:
        if layer.is_block:
            blocks.append(layer.count(1).total)
            if layer.tied_to is not None:
                shared_by_blocks.add(layer.tied_to)
            continue
        flush()
        if not layer.tensors:
            continue  # e.g. BERT's final_norm slot: post-LN blocks end normalised
        name = layer.name or "top-level"
        if layer.tied_to is not None:
            parts.append(f"{name} tied to {layer.tied_to} (counted once)")
        elif len(layers) == 1:
            parts.append(f"whole model {layer.count(1).total:,}")
        else:
            parts.append(f"{name} {layer.count(1).total:,}")
    flush()
    return "layers: " + " + ".join(parts)


def _stage_contents(layers: list[LayerParameters], layout: Candidate) -> str:
    parts: list[str] = []
    blocks = sum(layer.is_block for layer in layers)
    for layer in layers:
        if layer.is_block:
            if blocks:
                parts.append(f"{blocks} blocks")
                blocks = 0
        elif not layer.tensors:
            continue
        elif layer.tied_to is not None:
            parts.append(f"{layer.name}'s copy of {layer.tied_to} (weight tied)")
        elif len(layers) == 1 and not layer.name:
            parts.append("the whole model")
        else:
            parts.append(layer.name or "top-level")
    return " + ".join(parts)


def _flops(plan: Plan) -> str:
    config = plan.config
    tokens = plan.global_batch * config.model.seq_length
    per_token = model_flops_per_token(config)
    recomputed = hardware_flops_per_token(config, Recompute.FULL)
    selective = hardware_flops_per_token(config, Recompute.SELECTIVE)
    counts = model_counts(config)
    active = (f" (from the {counts.active_params / 1e9:.2f} B active parameters: each token's routed experts "
              "and the router, not all experts)" if counts.sparse else "")
    return "\n".join([
        f"FLOPs per token (model FLOPs, what MFU counts): {per_token / 1e12:.4f} TFLOP{active}",
        f"  = {counts.flops_formula}",
        f"FLOPs per token with full recomputation (hardware FLOPs): {recomputed / 1e12:.4f} TFLOP",
        f"  = model FLOPs + one more forward of the blocks (model FLOPs less the output layer's 6hV = "
        f"{logits_flops_per_token(config) / 1e12:.4f} TFLOP, divided by 3)",
        f"FLOPs per token with selective recomputation: {selective / 1e12:.4f} TFLOP",
        f"  = model FLOPs + one more forward of the attention cores, 4*s*d_attn per block = "
        f"{attention_core_forward_flops_per_token(config) / 1e12:.4f} TFLOP",
        f"FLOPs per step ({tokens:,} tokens): model {per_token * tokens:.4g}, with selective recomputation "
        f"{selective * tokens:.4g}, with full {recomputed * tokens:.4g}; the step-time model uses the hardware "
        "FLOPs of each layout",
    ])


def _memory_model(plan: Plan) -> str:
    attention = {
        "flash": "SDPA flash variant (our model on GPU): no s x s softmax/dropout tensors, only a fp32 "
                 "logsumexp per head and row: Korthikanti's s*b*h*(10 + 24/t + 5as/(ht)) without the 5as/(ht) term "
                 "(and 10 -> 8 without dropout masks)",
        "math": "Korthikanti et al. 2022's s*b*h*(10 + 24/t + 5as/(ht)) with the s x s softmax/dropout tensors",
    }[plan.activations.attention]
    states = {
        "bf16": "bf16 weights and gradients, fp32 master weights + Adam moments (K = 12, ZeRO paper)",
        "fp32": "fp32 weights and gradients, Adam moments (K = 8) plus DeepSpeed's fp32 master copy under ZeRO",
    }[plan.precision.name]
    return "\n".join([
        f"memory: {states}; ZeRO stage 1 partitions the optimizer state over DP, 2 also the gradients, "
        "3 also the weights; ZeRO-0 with PP > 1 is DeepSpeed's BF16_Optimizer (optimizer state partitioned "
        "as in ZeRO-1, plus full fp32 gradients)",
        f"activations per block and micro-batch, modelled for decoder blocks (GPT formula, charged to every "
        f"family's blocks), ranked with the {attention}; dropout masks only when model.dropout > 0"
        f"{_attention_mask_note(plan)}",
        "recomp (train.activation_checkpoint): none = every block keeps the above; selective = each block's "
        "attention core (softmax(QK^T)V) recomputed from its kept q, k, v: the attention term and the additive mask "
        "are not kept, one core's rebuilt at a time in backward (its forward again: the FLOPs above); full = 2sbh "
        "per block kept, one block's activations rebuilt at a time in backward (the blocks' forward again)",
        "pipeline buffers: 1F1B keeps min(PP - stage, m) micro-batches in flight (Narayanan et al. 2021), plus "
        "the outputs sent downstream; stages hold equal block counts (parallel.pipeline_partition=blocks); "
        "the fullest stage is reported",
        *_expert_note(plan),
    ])


def _expert_note(plan: Plan) -> list[str]:
    """How expert parallelism enters memory and time, for a mixture of experts."""
    if not num_experts(plan.config):
        return []
    return [
        "EP = parallel.expert, carved out of the DP ranks: each GPU holds num_experts/EP experts of every MoE "
        "layer (split over TP like a dense MLP) and all dense weights; ZeRO-1/2 partition the dense optimizer "
        "state (ZeRO-2 also the gradients) over DP and the experts' over the DP/EP ranks holding the same "
        "experts; no ZeRO-3 with EP (DeepSpeed refuses it); MoE activations are charged as a dense MLP's",
        "a2a = the MoE layers' token all-to-alls: 2 forward (dispatch, combine) and 2 backward per MoE layer and "
        "micro-batch (2 more with recomputation), each top_k*s*b*h activations per GPU, (EP-1)/EP of them "
        "leaving it; included in comm",
    ]


def _attention_mask_note(plan: Plan) -> str:
    """The explicit mask's share, when the model attends through one (planner/activations.py)."""
    if not attention_mask_bytes(plan.config.model, 1, plan.activations):
        return ""
    if flex_attention_planned(plan.config.model):
        return ("; the mask is FlexAttention's block mask (model.attention_backend), built once per micro-batch "
                "and counted as none (layouts with context parallelism attend through SDPA and keep SDPA's mask)")
    shape = "b*s*s (document masking)" if getattr(plan.config.model, "document_masking", False) else \
        "s*s (sliding window)"
    return f"; plus the additive attention mask the fused kernel keeps, {shape} in the activation dtype"


def _table(plan: Plan, top: int) -> str:
    feasible = plan.feasible
    shown = feasible[:top] if feasible else plan.layouts[:top]
    heading = "feasible layouts, fastest first" if feasible else "no layout fits; the smallest ones"
    experts = bool(num_experts(plan.config))
    header = (
        f"{'#':>3} {'TP':>3} {'CP':>3} {'PP':>3} {'DP':>5}{' EP' if experts else ''} {'ZeRO':>4} {'mb':>3} "
        f"{'recomp':>9} | {'weights':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'pipe':>6} {'total':>6} GiB "
        f"{'stage':>5} | {'step s':>7} {'compute':>7} {'bubble':>6} {'comm':>6}{'    a2a' if experts else ''} "
        f"{'MFU':>4} {'time':>5}"
    )
    reasons: list[str] = []
    rows = []
    for rank, planned in enumerate(shown, 1):
        reason = runnable_now(plan.config, planned.layout)
        if reason is not None and reason not in reasons:
            reasons.append(reason)
        mark = f" [{reasons.index(reason) + 1}]" if reason is not None else ""
        rows.append(_row(rank, planned, experts) + mark)
    notes = [f"[{number}] this release's config rejects it: {reason}" for number, reason in enumerate(reasons, 1)]
    notes.append("time: cal(ibrated) = every GEMM timed from the device's measured table and this model's step "
                 "measured on it (scaletrain/planner/measured_steps.json); model(led) = a roofline for what was not "
                 "measured (planner/kernel_time.py); compute includes the optimizer step")
    summary = (
        f"{len(plan.layouts)} layouts satisfy the constraints (TP divides the heads and is <= "
        f"{plan.hardware.gpus_per_node}, PP divides the layers, TP*CP*PP*DP = {plan.gpus}, "
        f"the global batch divides into micro-batches x DP, only ZeRO-0/1 with PP > 1"
        f"{', EP divides DP and the experts, no ZeRO-3 with EP > 1 (nor ZeRO-0 in bf16)' if experts else ''}); "
        f"{len(feasible)} fit in "
        f"{plan.memory_budget / GIB:.1f} GiB; {len(plan.layouts) - len(feasible)} are infeasible by memory"
    )
    return "\n".join([f"{heading}:", header, *rows, *notes, summary])


def _row(rank: int, planned: PlannedLayout, experts: bool) -> str:
    layout, memory, time = planned.layout, planned.memory, planned.step_time
    expert_parallel = f" {layout.expert:>2}" if experts else ""
    all_to_all = f" {time.expert_parallel:>6.2f}" if experts else ""
    return (
        f"{rank:>3} {layout.tensor:>3} {layout.context:>3} {layout.pipeline:>3} {layout.data:>5}{expert_parallel} "
        f"{layout.zero_stage:>4} {layout.micro_batch:>3} {Recompute(layout.recompute).setting:>9} | "
        f"{memory.weights / GIB:>7.2f} {memory.gradients / GIB:>6.2f} {memory.optimizer / GIB:>6.2f} "
        f"{memory.activations / GIB:>6.2f} {memory.pipeline_buffers / GIB:>6.2f} {memory.total / GIB:>6.2f}     "
        f"{planned.peak_stage:>5} | {time.total:>7.2f} {time.compute + time.optimizer:>7.2f} {time.bubble:>6.2f} "
        f"{time.communication:>6.2f}{all_to_all} {planned.mfu:>4.0%} {'cal' if planned.calibrated else 'model':>5}"
    )


def _chosen(plan: Plan, config_path: str, overrides: Sequence[str]) -> str:
    """The chosen layout as `key=value` overrides to paste after `scaletrain train CONFIG`, and the
    command that launches it; the plan's own overrides ride along unless the layout sets the key."""
    chosen = plan.chosen
    if chosen is None:
        why = "no layout fits" if not plan.feasible else "this release's config rejects every layout that fits"
        return f"chosen layout: none ({why}), so no overrides to paste"
    settings = layout_settings(plan.config, chosen.layout)
    pasted = [f"{key}={value}" for key, value in settings.items()]
    kept = [override for override in overrides if override.partition("=")[0] not in settings]
    arguments = " ".join(shlex.quote(item) for item in [config_path, *kept, *pasted])
    lines = [
        f"chosen layout: #{plan.feasible.index(chosen) + 1}, the fastest that fits and that this release's config "
        "accepts; as overrides:",
        f"  {' '.join(pasted)}",
    ]
    gpus, per_node = plan.gpus, plan.hardware.gpus_per_node
    if gpus == 1:
        lines += ["run it:", f"  scaletrain train {arguments}"]
    elif gpus <= per_node:
        lines += [f"run it on one node ({gpus} GPUs):", f"  launch/torchrun.sh {gpus} {arguments}"]
    elif gpus % per_node == 0:
        tasks = "" if per_node == SBATCH_GPUS_PER_NODE else f" --ntasks-per-node={per_node} --gpus-per-node={per_node}"
        lines += [f"run it on SLURM ({gpus // per_node} nodes x {per_node} GPUs):",
                  f"  sbatch --nodes={gpus // per_node}{tasks} launch/slurm.sbatch {arguments}"]
    else:
        lines.append(f"no launch line: {gpus} GPUs are not whole {per_node}-GPU nodes (--gpus-per-node)")
    return "\n".join(lines)
