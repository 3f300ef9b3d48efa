"""Expand a sweep spec into its runs: shapes, token counts, steps, hyperparameters, FLOPs, predicted time.

IsoFLOP mode (Hoffmann et al. 2022, sec. 3.2): for each budget C and each model size, a run
trains D = C / (FLOPs per token) tokens, rounded to whole optimizer steps, so the run's actual
FLOPs are within half a step of C (the actual value is what gets recorded and fitted). FLOPs
per token are the project's exact count (model/counts.py: 6N plus attention and the LM
head, not 6N alone), and N is reported with and without embeddings. A mixture of experts (model.moe.*
in the base or the spec's overrides) records its total N and its active N, the parameters a token
meets (its routed experts, not all of them): FLOPs per token, and so C = fpt(N) D, follow the active
ones, which is the N the fit uses (Clark et al. 2022, "Unified Scaling Laws for Routed Language
Models", likewise index a routed model by the dense model of equal FLOPs per token, not by its total);
for a dense model the two are equal.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import load_config
from scaletrain.data.storage import dataset_location
from scaletrain.model.counts import ModelCounts
from scaletrain.parallel.layout import requested_global_batch
from scaletrain.scaling.sweep.hyperparams import (
    HyperparameterRules,
    LearningRateSetting,
    RunHyperparameters,
    RunScale,
    batch_sequences,
    resolve_after_batch,
    rules_to_show,
    with_tuned,
)
from scaletrain.scaling.sweep.ladder import ladder_runs
from scaletrain.scaling.sweep.layout import RUNS_DIR
from scaletrain.scaling.sweep.shapes import rule_shapes, shape_counts
from scaletrain.scaling.sweep.spec import BUDGET_MODES, DownstreamOptions, ModelShape, SweepSpec
from scaletrain.scaling.sweep.timing import RunTime, run_time, validation_sequences


@dataclass(frozen=True)
class PlannedRun:
    name: str
    budget: float | None  # the IsoFLOP budget it belongs to; None in grid mode
    seed: int
    shape: ModelShape
    counts: ModelCounts
    steps: int
    tokens: int
    flops: float
    lr: float
    warmup_steps: int
    batch_size: int  # global batch in sequences
    beta2: float
    weight_decay: float
    epochs: float | None  # passes over the training split; None where data.dir is not prepared yet
    predicted_s: float  # startup, steps and evaluations at the spec's throughput model (timing.py)
    overrides: tuple[str, ...]  # dotted overrides on top of the base config and the spec's overrides
    role: str = "run"  # run (isoflop, grid) | stable, branch (ladder: scaling/sweep/ladder.py)
    stable_run: str | None = None  # a branch's stable run, whose checkpoint at branch_step it starts from
    branch_step: int | None = None
    # the D its rules read (C = D x FLOPs per token): its planned tokens before rounding to whole steps, in
    # a ladder its size's longest branch's (_rule_horizons)
    rule_tokens: float | None = None
    timing: RunTime | None = None  # its prices per step and per evaluation, from which predicted_s is summed

    def to_row(self) -> dict[str, object]:
        return {
            "name": self.name, "budget": self.budget, "seed": self.seed, **dataclasses.asdict(self.shape),
            "params": self.counts.total_params, "non_embedding_params": self.counts.non_embedding_params,
            "active_params": self.counts.active_params,
            "active_non_embedding_params": self.counts.active_non_embedding_params,
            "flops_per_token": self.counts.flops_per_token, "tokens": self.tokens, "flops": self.flops,
            "steps": self.steps, "lr": self.lr, "batch_size": self.batch_size, "beta2": self.beta2,
            "warmup_steps": self.warmup_steps, "weight_decay": self.weight_decay, "epochs": self.epochs,
            "predicted_s": self.predicted_s, "role": self.role, "stable_run": self.stable_run,
            "branch_step": self.branch_step, "rule_tokens": self.rule_tokens,
        }


@dataclass(frozen=True)
class SweepPlan:
    spec: SweepSpec
    runs: list[PlannedRun]
    tokens_per_step: int
    train_tokens: int | None  # tokens in the training split, where data.dir is prepared
    warnings: list[str]

    @property
    def directory(self) -> Path:
        return Path(self.spec.dir)

    def run_dir(self, run: PlannedRun) -> Path:
        return self.directory / RUNS_DIR / run.name


def plan_sweep(spec: SweepSpec, label: str = "", spec_path: str = "SPEC", to_show: bool = False) -> SweepPlan:
    """Every run of the sweep, validated as a full run config; raises ConfigError naming the culprit.

    `label` ends every run name (`sweep tune` names its grid points so); `spec_path` names the spec in
    the message that asks for `sweep tune` when a `tuned` rule has no tuned.json yet. `to_show`: a plan
    to print, not to train, which before `sweep tune` shows a `tuned` rule's prior (rules_to_show).
    """
    base = load_config(spec.base, spec.overrides)
    if to_show:
        rules, untuned = rules_to_show(spec.hyperparameters, spec.dir, spec_path)
    else:
        rules, untuned = with_tuned(spec.hyperparameters, spec.dir, spec_path), None
    tokens_per_step = _global_batch_size(base) * base.model.seq_length
    shapes = spec.models.shapes or rule_shapes(base, spec.models.rule)
    corpus = (_train_tokens(base), validation_sequences(base))
    train_tokens = corpus[0]
    runs, warnings = [], [] if untuned is None else [untuned]
    if train_tokens is None:
        unprepared = " / ".join(source.dir for source in base.data.sources())
        warnings.append(f"{unprepared} is not prepared, so epochs are unknown: run `scaletrain prepare {spec.base}`")
    amounts = spec.budgets if spec.mode in BUDGET_MODES else spec.tokens
    repeated = _repeated_shapes(spec, base)
    points = [(amount, shape) for amount in sorted(amounts) for shape in _shapes_for_amount(spec, base, shapes, amount)]
    horizons = _rule_horizons(spec, points)
    for amount, shape in points:
        for seed in spec.seeds + (spec.repeat_seeds.seeds if shape in repeated else []):
            runs.append(_plan_run(spec, rules, base, shape, amount, seed, corpus, label,
                                  rule_amount=horizons.get(shape_label(shape), amount)))
    _check_unique_names(runs, spec)
    _check_min_steps(runs, spec)
    _check_downstream(spec, runs)
    if spec.mode == "ladder":
        runs = ladder_runs(spec, runs)
    for run in runs:
        if run.epochs is not None and run.epochs > spec.guards.max_epochs:
            warnings.append(f"{run.name} trains {run.epochs:.2f} epochs (more than guards.max_epochs="
                            f"{spec.guards.max_epochs:g}): it repeats data, which a scaling-law fit assumes it "
                            "does not; lower the budget/tokens or use a larger corpus")
    return SweepPlan(spec, runs, tokens_per_step, train_tokens, warnings)


def _repeated_shapes(spec: SweepSpec, base: Config) -> list[ModelShape]:
    """The rungs that repeat_seeds names."""
    return ladder_rungs(spec, base, spec.repeat_seeds.sizes, "repeat_seeds.sizes")


def ladder_rungs(spec: SweepSpec, base: Config, indices: list[int], key: str) -> list[ModelShape]:
    """The rungs of the ladder at `indices` (smallest first), refused naming the spec's `key` when one is outside."""
    ladder = ladder_shapes(spec, base)
    outside = [index for index in indices if not 0 <= index < len(ladder)]
    if outside:
        raise ConfigError(f"sweep {spec.name}: {key} {outside} are not indices of the ladder of {len(ladder)} "
                          f"sizes; use 0 to {len(ladder) - 1} (smallest first)")
    return [ladder[index] for index in indices]


def ladder_shapes(spec: SweepSpec, base: Config) -> list[ModelShape]:
    """Every rung of the spec's ladder, smallest (total parameters) first."""
    shapes = spec.models.shapes or rule_shapes(base, spec.models.rule)
    return sorted(shapes, key=lambda shape: shape_counts(base, shape).total_params)


def _shapes_for_amount(spec: SweepSpec, base: Config, shapes: list[ModelShape], amount: float) -> list[ModelShape]:
    """The ladder, smallest first; in isoflop mode with sizes_per_budget, the rungs nearest the center ratio."""
    by_size = sorted(shapes, key=lambda shape: shape_counts(base, shape).total_params)
    keep = spec.models.sizes_per_budget
    if spec.mode not in BUDGET_MODES or keep is None or keep >= len(by_size):
        return by_size

    def distance_from_center(shape: ModelShape) -> float:
        counts = shape_counts(base, shape)
        tokens_per_param = amount / counts.flops_per_token / counts.active_params
        return abs(math.log(tokens_per_param / spec.models.center_tokens_per_param))

    nearest = sorted(by_size, key=distance_from_center)[:keep]
    return [shape for shape in by_size if shape in nearest]


def _rule_horizons(spec: SweepSpec, points: list[tuple[float, ModelShape]]) -> dict[str, float]:
    """In a ladder, per size (shape_label) the budget whose C and D its rules read: its largest, so the
    tokens of its stable run's horizon (its longest branch). Hägele et al. 2024 (sec. 3-4): a WSD run's
    constant LR is chosen for the run it is, and each cooldown decays from that LR, so the branches of one
    size share one LR and batch, evaluated once at the stable run's tokens; a shorter branch is not the
    fresh run that a rule in D would tune for its own length. Elsewhere each run reads its own (empty)."""
    if spec.mode != "ladder":
        return {}
    horizons: dict[str, float] = {}
    for amount, shape in points:
        horizons[shape_label(shape)] = max(amount, horizons.get(shape_label(shape), amount))
    return horizons


def _plan_run(
    spec: SweepSpec, rules: HyperparameterRules, base: Config, shape: ModelShape, amount: float, seed: int,
    corpus: tuple[int | None, int | None], name_label: str = "", rule_amount: float | None = None,
) -> PlannedRun:
    """The run of `shape` at `amount` (its budget, or its tokens in grid mode); its rules read the C and D of
    `rule_amount` (default `amount`; in a ladder its size's longest branch's: _rule_horizons). `corpus`:
    (training tokens, validation sequences), None where unknown."""
    counts = shape_counts(base, shape)
    target_tokens, rule_tokens = (value / counts.flops_per_token if spec.mode in BUDGET_MODES else value
                                  for value in (amount, amount if rule_amount is None else rule_amount))
    label = f"{shape_label(shape)} ({counts.total_params:,} parameters)"
    scale = RunScale(counts.total_params, counts.non_embedding_params, shape.hidden_size,
                     flops=rule_tokens * counts.flops_per_token, tokens=rule_tokens)
    batch_size = _batch_size(spec, rules, base, scale, label)
    tokens_per_step = batch_size * base.model.seq_length
    steps = round(target_tokens / tokens_per_step)
    budget = amount if spec.mode in BUDGET_MODES else None
    if steps < 1:
        what = f"budget {amount:.3g} FLOPs" if budget else f"{amount:.3g} tokens"
        raise ConfigError(
            f"sweep {spec.name}: {what} is less than one optimizer step of {label}, which takes "
            f"{tokens_per_step * counts.flops_per_token:.3g} FLOPs ({tokens_per_step} tokens); raise it or "
            "drop that model from the ladder"
        )
    hyper = resolve_after_batch(
        rules, lr_setting(spec, rules), scale, batch_size, base.model.seq_length, steps,
        defaults=(base.train.beta2, base.train.weight_decay),
        legacy_warmup_steps=max(spec.warmup.steps, round(spec.warmup.fraction * steps)))
    warmup_steps = hyper.warmup_steps
    name = _run_name(budget, amount, shape, seed) + (f"-{name_label}" if name_label else "")
    if warmup_steps >= steps:
        raise ConfigError(
            f"sweep {spec.name}: run {name} ({label}) trains {steps} steps, no more than its warmup of "
            f"{warmup_steps} steps; raise its budget/tokens, lower warmup.steps, or use warmup.fraction"
        )
    tokens = steps * tokens_per_step
    overrides = _run_overrides(spec, rules, shape, steps, hyper, seed, name, budget, base)
    try:
        load_config(spec.base, [*spec.overrides, *overrides])
    except ConfigError as error:
        raise ConfigError(f"sweep {spec.name}: run {name} ({label}): {error}") from None
    timing = run_time(spec.throughput, base, counts, tokens_per_step, corpus[1])
    return PlannedRun(
        name=name, budget=budget, seed=seed, shape=shape, counts=counts, steps=steps, tokens=tokens,
        flops=tokens * counts.flops_per_token, lr=hyper.lr, warmup_steps=warmup_steps,
        batch_size=batch_size, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
        epochs=tokens / corpus[0] if corpus[0] else None,
        predicted_s=timing.predicted_s(0, steps, _eval_every(base, steps)), overrides=tuple(overrides),
        rule_tokens=rule_tokens, timing=timing,
    )


def _run_overrides(
    spec: SweepSpec, rules: HyperparameterRules, shape: ModelShape, steps: int, hyper: RunHyperparameters,
    seed: int, name: str, budget: float | None, base: Config,
) -> list[str]:
    ffn = "" if shape.ffn_hidden_size is None else shape.ffn_hidden_size
    tags = [spec.name, spec.mode] + ([f"budget={budget:.3g}"] if budget else [])
    return [
        f"model.num_layers={shape.num_layers}", f"model.hidden_size={shape.hidden_size}",
        f"model.num_heads={shape.num_heads}", f"model.ffn_hidden_size={ffn}",
        f"train.steps={steps}", f"train.lr={hyper.lr!r}", f"train.min_lr={hyper.min_lr!r}",
        f"train.warmup_steps={hyper.warmup_steps}", f"train.seed={seed}",
        f"train.global_batch_size={hyper.batch_size}", "train.grad_accum=1",
        *([f"train.beta2={hyper.beta2!r}"] if rules.beta2 is not None else []),
        *([f"train.weight_decay={hyper.weight_decay!r}"] if rules.weight_decay is not None else []),
        "train.resume=auto", "train.exit_after=", f"train.eval_every={_eval_every(base, steps)}",
        f"checkpoint.every={math.ceil(steps / spec.checkpoints_per_run)}",
        f"run.dir={Path(spec.dir) / RUNS_DIR / name}",
        f"tracking.group={spec.name}", "tracking.job_type=sweep-run", f"tracking.name={name}",
        f"tracking.tags=[{', '.join(tags)}]", *_downstream_overrides(spec.downstream),
    ]


def _downstream_overrides(downstream: DownstreamOptions) -> list[str]:
    """The run's eval section: the spec's downstream tasks, scored at the last step only."""
    if not downstream.tasks:
        return []
    return [f"eval.tasks=[{', '.join(downstream.tasks)}]", f"eval.include_path=[{', '.join(downstream.include_path)}]",
            "eval.every=0", f"eval.limit={'' if downstream.limit is None else repr(downstream.limit)}"]


def _check_downstream(spec: SweepSpec, runs: list[PlannedRun]) -> None:
    """downstream.tasks found (lm-eval installed, each task and its data there) once, before any run trains, rather
    than refused by every run at its start."""
    if not spec.downstream.tasks or not runs:
        return
    from scaletrain.train.hooks.downstream import harness_for_training, selected_tasks  # lm-eval's only when used

    config = load_config(spec.base, [*spec.overrides, *runs[0].overrides])
    try:
        selected_tasks(harness_for_training(config), config)
    except ConfigError as error:
        raise ConfigError(f"sweep {spec.name}: {str(error).replace('eval.', 'downstream.')}") from None


def lr_setting(spec: SweepSpec, rules: HyperparameterRules) -> LearningRateSetting:
    """hyperparameters.lr, or the older `learning_rate:` section, which is the `width` rule."""
    if rules.lr is not None:
        return rules.lr
    old = spec.learning_rate
    return LearningRateSetting(rule="width", value=old.lr, reference_hidden=old.reference_hidden,
                               width_exponent=old.width_exponent, min_lr_ratio=old.min_lr_ratio)


def _batch_size(spec: SweepSpec, rules: HyperparameterRules, base: Config, scale: RunScale, label: str) -> int:
    """The base config's global batch, or hyperparameters.batch_size's at this size, in whole micro-batches."""
    if rules.batch_size is None:
        return _global_batch_size(base)
    granule = base.train.micro_batch_size * (base.parallel.data or 1)
    return batch_sequences(rules.batch_size, scale, base.model.seq_length, granule, f"sweep {spec.name}: {label}")


def _check_min_steps(runs: list[PlannedRun], spec: SweepSpec) -> None:
    """guards.min_steps: a short run's loss is still in the warmup-dominated transient and pulls the fit."""
    short = [run for run in runs if run.steps < spec.guards.min_steps]
    if not short:
        return
    listed = ", ".join(f"{run.name} ({run.steps} steps)" for run in short)
    raise ConfigError(
        f"sweep {spec.name}: {len(short)} runs train fewer than guards.min_steps={spec.guards.min_steps} optimizer "
        f"steps: {listed}. Such runs fit badly (residuals ~4x those of runs of >= 1,000 steps). Raise the "
        "budget/tokens, lower the batch (train.global_batch_size or hyperparameters.batch_size), drop the largest "
        "sizes at the smallest budget (models.sizes_per_budget or the ladder), or lower guards.min_steps knowingly"
    )


def _eval_every(base: Config, steps: int) -> int:
    """The base's interval, or once at the end: every run ends with an evaluation (train/loop.py)."""
    return base.train.eval_every if 0 < base.train.eval_every <= steps else steps


def _global_batch_size(config: Config) -> int:
    """The base's global batch, with one data-parallel rank where it leaves DP to the world size."""
    return requested_global_batch(config, data_parallel=1)


def _train_tokens(base: Config) -> int | None:
    """Training tokens a run reads before it repeats any: the train split's, or for a blend the fewest
    tokens after which one of its datasets starts a second epoch (its tokens / its weight)."""
    sources = base.data.sources()
    total_weight = sum(source.weight for source in sources)
    locations = [dataset_location(base.data, source.dir) for source in sources]
    if not all(location.is_prepared() for location in locations):
        return None
    return min(int(location.load_manifest().splits["train"].num_tokens * total_weight / source.weight)
               for location, source in zip(locations, sources, strict=True))


def shape_label(shape: ModelShape) -> str:
    ffn = f"-f{shape.ffn_hidden_size}" if shape.ffn_hidden_size else ""
    return f"l{shape.num_layers}-h{shape.hidden_size}-a{shape.num_heads}{ffn}"


def _run_name(budget: float | None, amount: float, shape: ModelShape, seed: int) -> str:
    scale = f"c{budget:.3g}" if budget else f"d{amount:.3g}"
    return f"{scale.replace('+', '')}-{shape_label(shape)}-s{seed}"


def _check_unique_names(runs: list[PlannedRun], spec: SweepSpec) -> None:
    seen: set[str] = set()
    for run in runs:
        if run.name in seen:
            raise ConfigError(f"sweep {spec.name}: two runs are both named {run.name}; remove the repeated "
                              "shape or budget (shapes from models.rule can coincide for close targets)")
        seen.add(run.name)
