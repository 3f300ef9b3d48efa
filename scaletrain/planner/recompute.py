"""train.activation_checkpoint=auto: the least recomputation whose memory fits the GPU, decided once at start.

`plan`'s memory model (memory.py, activations.py) gives the peak per-GPU memory of the run's own layout
(its TP, CP, PP, DP, EP, ZeRO stage, micro-batch and micro-batches per step, bf16 unless the config asks
for fp32, a fused attention kernel) with each recomputation. Auto takes the first of none, selective and
full (activations.RECOMPUTE_BY_COST: the cheapest in time first) that fits the GPU's memory less plan's
reserve (search.DEFAULT_MEMORY_RESERVE) and that the config accepts (ALBERT's shared block in pipeline
stages refuses full); if none fits, the accepted one that keeps the least. Full is modelled in chunks of
one block whatever train.activation_checkpoint_interval says. On a CPU there is no device memory to fit,
and auto is none. Every rank decides alike, since a job's ranks run the same GPU model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import validate
from scaletrain.parallel.layout import Layout
from scaletrain.planner.activations import RECOMPUTE_BY_COST, ActivationSettings, Recompute
from scaletrain.planner.layouts import Candidate
from scaletrain.planner.memory import peak_memory
from scaletrain.planner.search import DEFAULT_MEMORY_RESERVE, planning_precision

GIB = 2**30


@dataclass(frozen=True)
class RecomputeDecision:
    """What a run recomputes, and for auto why: the line `train` starts with and `check` prints."""

    recompute: Recompute
    reason: str = ""  # empty when the config names the mode itself

    def describe(self) -> str:
        return f"recompute {self.recompute.setting}" + (f" ({self.reason})" if self.reason else "")


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of the GPU `device`; None for a CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def resolve_recompute(config: Config, gpu_memory: int | None) -> tuple[Config, RecomputeDecision]:
    """The config with train.activation_checkpoint=auto replaced by the decision (other configs as they
    are), and the decision. `config` is resolved for its world size (parallel.layout.resolve_for_world)."""
    decision = decide_recompute(config, gpu_memory)
    if config.train.recompute != "auto":
        return config, decision
    return with_recompute(config, decision.recompute), decision


def decide_recompute(
    config: Config, gpu_memory: int | None, memory_reserve: float = DEFAULT_MEMORY_RESERVE
) -> RecomputeDecision:
    """What the config recomputes on a GPU of `gpu_memory` bytes (None: a CPU); auto as the module says."""
    asked = config.train.recompute
    if asked != "auto":
        return RecomputeDecision(Recompute[asked.upper()])
    if gpu_memory is None:
        return RecomputeDecision(Recompute.NONE, "auto: no GPU memory to fit on a CPU")
    budget = gpu_memory * (1 - memory_reserve)
    refusals = {mode: _refusal(config, mode) for mode in RECOMPUTE_BY_COST}
    accepted = [mode for mode, refusal in refusals.items() if refusal is None]
    if not accepted:
        raise ConfigError(f"train.activation_checkpoint=auto: this config runs none of "
                          f"{', '.join(mode.setting for mode in refusals)}: {refusals[Recompute.NONE]}")
    peaks = {mode: run_peak_memory(config, mode) for mode in accepted}
    fitting = [mode for mode in accepted if peaks[mode] <= budget]
    estimates = ", ".join(f"{mode.setting} {peaks[mode] / GIB:.1f}" for mode in accepted)
    usable = f"{budget / GIB:.1f} GiB usable of {gpu_memory / GIB:.1f}"
    if not fitting:
        return RecomputeDecision(accepted[-1], f"auto: none fits, plan's estimate {estimates} GiB against {usable}")
    return RecomputeDecision(fitting[0], f"auto: plan's estimate {estimates} GiB against {usable}")


def run_peak_memory(config: Config, recompute: Recompute) -> float:
    """plan's peak per-GPU memory (bytes, the fullest pipeline stage) of the config's own layout (Layout.of
    refuses a config not resolved for its world size)."""
    layout = Candidate(**dataclasses.asdict(Layout.of(config)), recompute=recompute)
    precision = planning_precision(config)
    settings = ActivationSettings(activation_bytes=precision.activation_bytes,
                                  sequence_parallel=config.parallel.sequence_parallel)
    return peak_memory(config, layout, layout.grad_accum, precision, settings)[1].total


def with_recompute(config: Config, recompute: Recompute) -> Config:
    """The config running `recompute`: the interval, full recomputation's chunk size, kept for full only."""
    interval = config.train.activation_checkpoint_interval if recompute == Recompute.FULL else 0
    return dataclasses.replace(config, train=dataclasses.replace(
        config.train, activation_checkpoint=recompute.setting, activation_checkpoint_interval=interval))


def _refusal(config: Config, recompute: Recompute) -> str | None:
    """None if every config rule accepts the config running `recompute`, else the rule's message."""
    try:
        validate(with_recompute(config, recompute))
    except ConfigError as error:
        return str(error)
    return None
