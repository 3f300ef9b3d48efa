"""Evaluate every candidate layout: peak per-GPU memory, predicted step time, whether it fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import validate
from scaletrain.planner.activations import RECOMPUTE_BY_COST, ActivationSettings
from scaletrain.planner.flops import model_flops_per_token
from scaletrain.planner.layouts import Candidate, enumerate_layouts, layout_settings, planning_global_batch
from scaletrain.planner.measured_steps import has_measured_step
from scaletrain.planner.memory import FP32, MIXED_BF16, MemoryBreakdown, Precision, peak_memory
from scaletrain.planner.step_time import Hardware, StepTime, predict_step_time

# CUDA context, NCCL buffers, DeepSpeed's buckets and allocator fragmentation are not modelled;
# keep this fraction of each GPU's memory free for them.
DEFAULT_MEMORY_RESERVE = 0.1
DEFAULT_MAX_MICRO_BATCH = 8


@dataclass(frozen=True)
class PlannedLayout:
    layout: Candidate
    peak_stage: int  # the pipeline stage whose memory is reported (the fullest one)
    memory: MemoryBreakdown
    step_time: StepTime
    mfu: float  # model FLOPs per step / (step time * GPUs * peak)
    fits: bool
    # its step time rests on measurements: every GEMM from the device's table, and this model's whole step
    # measured on the device (measured_steps.py); else it is modelled (kernel_time.py's fallback)
    calibrated: bool = False


@dataclass(frozen=True)
class Plan:
    config: Config
    gpus: int
    gpu_memory: int
    memory_budget: float  # usable bytes per GPU after the reserve
    hardware: Hardware
    precision: Precision
    activations: ActivationSettings
    global_batch: int
    layouts: list[PlannedLayout]  # fitting layouts first, fastest first; then the rest by memory

    @property
    def feasible(self) -> list[PlannedLayout]:
        return [planned for planned in self.layouts if planned.fits]

    @property
    def chosen(self) -> PlannedLayout | None:
        """The fastest layout that fits and that this release's config accepts: the one to run."""
        return next((planned for planned in self.feasible if runnable_now(self.config, planned.layout) is None), None)


def planning_precision(config: Config) -> Precision:
    """fp32 if the config asks for it, else bf16 mixed precision (what engine.py picks on GPUs)."""
    return FP32 if config.train.precision == "fp32" else MIXED_BF16


def plan(
    config: Config,
    gpus: int,
    gpu_memory: int,
    hardware: Hardware,
    memory_reserve: float = DEFAULT_MEMORY_RESERVE,
    attention: str = "flash",
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
) -> Plan:
    """Evaluate every valid layout's peak per-GPU memory and step time."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be >= 1")
    if not 0 <= memory_reserve < 1:
        raise ConfigError(f"--memory-reserve {memory_reserve} must be a fraction in [0, 1), e.g. 0.1")
    precision = planning_precision(config)
    settings = ActivationSettings(activation_bytes=precision.activation_bytes, attention=attention)
    global_batch = planning_global_batch(config)
    budget = gpu_memory * (1 - memory_reserve)
    step_flops = model_flops_per_token(config) * global_batch * config.model.seq_length
    measured_model = has_measured_step(config, hardware.device)
    planned = []
    for layout in enumerate_layouts(config, gpus, hardware.gpus_per_node, max_micro_batch):
        stage, memory = peak_memory(config, layout, layout.grad_accum, precision, settings)
        time = predict_step_time(config, layout, hardware, precision.activation_bytes, precision.grad_bytes)
        mfu = step_flops / (time.total * gpus * hardware.peak_flops)
        planned.append(PlannedLayout(layout, stage, memory, time, mfu, memory.total <= budget,
                                     calibrated=measured_model and time.measured_gemms))
    if not planned:
        raise ConfigError(_no_layout_message(config, gpus, global_batch, hardware.gpus_per_node))
    # at equal predicted step time, the layout that recomputes less first
    planned.sort(key=lambda p: (not p.fits, p.step_time.total if p.fits else 0.0,
                                RECOMPUTE_BY_COST.index(p.layout.recompute) if p.fits else 0, p.memory.total))
    return Plan(config, gpus, gpu_memory, budget, hardware, precision, settings, global_batch, planned)


def runnable_now(config: Config, layout: Candidate) -> str | None:
    """None if this release's config validation accepts the layout's settings (the overrides the
    report prints, layouts.layout_settings), else its message."""
    sections: dict[str, dict[str, int | str]] = {}
    for key, value in layout_settings(config, layout).items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    changed = {section: dataclasses.replace(getattr(config, section), **values) for section, values in sections.items()}
    try:
        validate(dataclasses.replace(config, **changed))
    except ConfigError as error:
        return str(error)
    return None


def _no_layout_message(config: Config, gpus: int, global_batch: int, gpus_per_node: int) -> str:
    return (
        f"no layout of {gpus} GPUs satisfies TP | {config.model.num_heads} heads with TP <= {gpus_per_node}, "
        f"PP | {config.model.num_layers} layers and a global batch of {global_batch} divisible by "
        "micro-batch x DP; use a GPU count that is a multiple of a valid TP x PP, or change "
        "train.global_batch_size"
    )
