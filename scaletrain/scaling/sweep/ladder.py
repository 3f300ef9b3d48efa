"""Ladder sweeps: per model size one constant-LR run, cooled down at every budget (WSD-S).

OLMo-core's model ladder trains each size once with a warmup-stable-decay schedule and branches a
cooldown off the stable run at each budget (Hägele et al. 2024, sec. 3-4; Hu et al. 2024, MiniCPM,
sec. 4: a cooldown of a constant-LR run equals a fresh WSD run of that length). For size N and
budget C the branch trains the same steps_k as an IsoFLOP run of C, cooling down over the last
round(f x steps_k) of them from s_k = steps_k - round(f x steps_k); the stable run trains
max_k s_k steps at constant LR and keeps a checkpoint at every s_k (checkpoint.keep_steps). The
ladder costs the stable run plus the cooldowns instead of every run's full length.

The branches of one size share their LR, batch and every other hyperparameter but the length. A rule
that reads the run's compute C or tokens D is evaluated once per size, at its stable run's horizon (the
longest branch, plan.py _rule_horizons): the stable phase's LR is chosen for the run it is, and the
cooldowns decay from it (Hägele et al. 2024). A rule that reads the run's steps is refused.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.config import Config, ConfigError, cooldown_steps
from scaletrain.config_loader import load_config
from scaletrain.scaling.sweep.layout import RUNS_DIR
from scaletrain.scaling.sweep.spec import SweepSpec

if TYPE_CHECKING:
    from scaletrain.scaling.sweep.plan import PlannedRun

# Overrides that differ between the branches of one size because their lengths differ; everything
# else (batch, LR, beta2, warmup, weight decay, ...) must be the same, since they share a stable run.
LENGTH_KEYS = ("train.steps", "train.eval_every", "checkpoint.every", "run.dir", "tracking.name", "tracking.tags")
# Where a spec sets each shared hyperparameter, to name the rule that made two branches differ.
RULE_OF_KEY = {
    "train.lr": "hyperparameters.lr (or learning_rate)", "train.min_lr": "hyperparameters.lr (or learning_rate)",
    "train.global_batch_size": "hyperparameters.batch_size", "train.beta2": "hyperparameters.beta2",
    "train.warmup_steps": "hyperparameters.warmup (or warmup)", "train.weight_decay": "hyperparameters.weight_decay",
}


def ladder_runs(spec: SweepSpec, runs: list[PlannedRun]) -> list[PlannedRun]:
    """The IsoFLOP runs of a spec (one per budget and size) as branches, after one stable run per size."""
    stables, branches = [], []
    for group in _by_size(runs):
        _check_shared_hyperparameters(spec, group)
        points = {run.name: run.steps - cooldown_steps(run.steps, spec.ladder.cooldown_fraction) for run in group}
        short = [name for name, point in points.items() if point < 1]
        if short:
            raise ConfigError(f"sweep {spec.name}: {short[0]} is too short to branch: its cooldown of "
                              f"ladder.cooldown_fraction={spec.ladder.cooldown_fraction} takes every step; raise "
                              "its budget or lower the fraction")
        stable = _stable_run(spec, group, sorted(set(points.values())))
        stables.append(stable)
        branches.extend(_branch_run(spec, run, stable, points[run.name]) for run in group)
    order = {run.name: index for index, run in enumerate(runs)}
    return stables + sorted(branches, key=lambda branch: order[branch.name])


def stable_run_name(branch_name: str) -> str:
    """c1.2e10-l2-h64-a4-s7 -> stable-l2-h64-a4-s7: one stable run per size and seed."""
    return "stable-" + branch_name.split("-", 1)[1]


def _by_size(runs: list[PlannedRun]) -> list[list[PlannedRun]]:
    groups: dict[str, list[PlannedRun]] = {}
    for run in runs:
        groups.setdefault(stable_run_name(run.name), []).append(run)
    return list(groups.values())


def _check_shared_hyperparameters(spec: SweepSpec, group: list[PlannedRun]) -> None:
    first = _shared_overrides(group[0])
    for run in group[1:]:
        other = _shared_overrides(run)
        differing = sorted(key for key in set(first) | set(other) if first.get(key) != other.get(key))
        if differing:
            key = differing[0]
            raise ConfigError(
                f"sweep {spec.name}: in mode=ladder the branches {group[0].name} and {run.name} share a stable run, "
                f"but {key} differs ({first.get(key)} vs {other.get(key)}): {RULE_OF_KEY.get(key, key)} depends on "
                "the run's length (its steps; a rule in C or D reads the stable run's horizon, the same for every "
                "branch). Use a rule that does not read the steps (e.g. weight_decay `fixed`, warmup `steps` or "
                "`tokens_per_param`), or mode=isoflop"
            )


def _shared_overrides(run: PlannedRun) -> dict[str, str]:
    pairs = (override.partition("=") for override in run.overrides)
    return {key: value for key, _, value in pairs if key not in LENGTH_KEYS}


def _stable_run(spec: SweepSpec, group: list[PlannedRun], points: list[int]) -> PlannedRun:
    """The longest branch's run, cut to the last branch point at constant LR, checkpointed at every point."""
    longest = max(group, key=lambda run: run.steps)
    steps, name = points[-1], stable_run_name(longest.name)
    eval_every = min(int(_override(longest, "train.eval_every")), steps)
    overrides = _with_overrides(longest.overrides, {
        "train.steps": steps, "train.eval_every": eval_every, "train.lr_schedule": "wsd",
        "train.cooldown_fraction": 0, "checkpoint.every": math.ceil(steps / spec.checkpoints_per_run),
        "checkpoint.keep_steps": f"[{', '.join(map(str, points))}]", "run.dir": Path(spec.dir) / RUNS_DIR / name,
        "tracking.name": name,
    })
    train = _validate(spec, name, overrides, to_train=False).train
    if train.resolved_warmup_steps != train.requested_warmup_steps:
        raise ConfigError(
            f"sweep {spec.name}: run {name}: the warmup of {train.requested_warmup_steps} steps does not fit the "
            f"stable run's {steps} steps (its last branch point), and its branches must continue the stable "
            "run's schedule: lower warmup.steps or raise the budgets")
    fraction = steps / longest.steps
    return dataclasses.replace(
        longest, name=name, budget=None, steps=steps, tokens=round(longest.tokens * fraction),
        flops=longest.flops * fraction, epochs=None if longest.epochs is None else longest.epochs * fraction,
        predicted_s=longest.timing.predicted_s(0, steps, eval_every), overrides=overrides, role="stable",
    )


def _branch_run(spec: SweepSpec, run: PlannedRun, stable: PlannedRun, point: int) -> PlannedRun:
    """The run as a cooldown from its stable run's checkpoint at `point`; it keeps its full length's
    tokens and FLOPs (what its summary reports and the fit reads) but trains only the cooldown."""
    checkpoint = Path(spec.dir) / RUNS_DIR / stable.name / "checkpoints" / f"step_{point:08d}"
    overrides = _with_overrides(run.overrides, {
        "train.lr_schedule": "wsd", "train.cooldown_fraction": spec.ladder.cooldown_fraction,
        "train.cooldown_shape": spec.ladder.cooldown_shape, "train.branch_from": checkpoint,
    })
    _validate(spec, run.name, overrides)
    predicted_s = run.timing.predicted_s(point, run.steps, int(_override(run, "train.eval_every")))
    return dataclasses.replace(run, predicted_s=predicted_s, overrides=overrides,
                               role="branch", stable_run=stable.name, branch_step=point)


def ladder_flops(runs: list[PlannedRun]) -> tuple[float, float]:
    """(FLOPs the ladder trains: stable runs + cooldowns, FLOPs of the independent runs it replaces)."""
    stable = sum(run.flops for run in runs if run.role == "stable")
    cooldowns = sum(run.flops * (run.steps - run.branch_step) / run.steps for run in runs if run.role == "branch")
    return stable + cooldowns, sum(run.flops for run in runs if run.role == "branch")


def ladder_lines(spec: SweepSpec, runs: list[PlannedRun]) -> list[str]:
    """The plan's ladder: per size its stable run and the branches off it, and the FLOPs it saves."""
    ladder = spec.ladder
    lines = [f"ladder: WSD with a {ladder.cooldown_fraction:g} {ladder.cooldown_shape} cooldown per budget"]
    for stable in (run for run in runs if run.role == "stable"):
        branches = [run for run in runs if run.stable_run == stable.name]
        points = ", ".join(str(step) for step in sorted({run.branch_step for run in branches}))
        lines.append(f"  {stable.name}: {stable.steps:,} steps at constant LR {stable.lr:.3g} (batch "
                     f"{stable.batch_size}, the rules at its horizon D={stable.rule_tokens:.3g} tokens: its longest "
                     f"branch's), keeps steps {points}")
        lines.extend(f"    {run.name}: from step {run.branch_step:,}, cools down {run.steps - run.branch_step:,} "
                     f"of {run.steps:,} steps" for run in branches)
    trained, independent = ladder_flops(runs)
    lines.append(f"ladder FLOPs: {trained:.3g} (stable runs + cooldowns) against {independent:.3g} for independent "
                 f"runs of every branch's length: saves {independent - trained:.3g} "
                 f"({1 - trained / independent:.0%})")
    return lines


def _override(run: PlannedRun, key: str) -> str:
    return next(value for name, _, value in (o.partition("=") for o in run.overrides) if name == key)


def _with_overrides(overrides: tuple[str, ...], changes: dict[str, object]) -> tuple[str, ...]:
    kept = [override for override in overrides if override.partition("=")[0] not in changes]
    return (*kept, *(f"{key}={value}" for key, value in changes.items()))


def _validate(spec: SweepSpec, name: str, overrides: tuple[str, ...], to_train: bool = True) -> Config:
    try:
        return load_config(spec.base, [*spec.overrides, *overrides], to_train=to_train)
    except ConfigError as error:
        raise ConfigError(f"sweep {spec.name}: run {name}: {error}") from None
