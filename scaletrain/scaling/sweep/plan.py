"""Expand a sweep spec into its runs: shapes, token counts, steps, LR and warmup, FLOPs, predicted time.

IsoFLOP mode (Hoffmann et al. 2022, sec. 3.2): for each budget C and each model size, a run
trains D = C / (FLOPs per token) tokens, rounded to whole optimizer steps, so the run's actual
FLOPs are within half a step of C (the actual value is what gets recorded and fitted). FLOPs
per token are the project's exact count (scaling/counts.py: 6N plus attention and the LM
head, not 6N alone), and N is reported with and without embeddings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import Config, ConfigError, load_config
from scaletrain.data.storage import dataset_location
from scaletrain.scaling.counts import ModelCounts, model_counts
from scaletrain.scaling.sweep.layout import RUNS_DIR
from scaletrain.scaling.sweep.spec import ModelShape, ShapeRule, SweepSpec

MAX_RULE_LAYERS = 128


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
    epochs: float | None  # passes over the training split; None where data.dir is not prepared yet
    predicted_s: float
    overrides: tuple[str, ...]  # dotted overrides on top of the base config and the spec's overrides

    def to_row(self) -> dict[str, object]:
        return {
            "name": self.name, "budget": self.budget, "seed": self.seed, **dataclasses.asdict(self.shape),
            "params": self.counts.total_params, "non_embedding_params": self.counts.non_embedding_params,
            "flops_per_token": self.counts.flops_per_token, "tokens": self.tokens, "flops": self.flops,
            "steps": self.steps, "lr": self.lr, "warmup_steps": self.warmup_steps, "epochs": self.epochs,
            "predicted_s": self.predicted_s,
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


def plan_sweep(spec: SweepSpec) -> SweepPlan:
    """Every run of the sweep, validated as a full run config; raises ConfigError naming the culprit."""
    base = load_config(spec.base, spec.overrides)
    tokens_per_step = _global_batch_size(base) * base.model.seq_length
    shapes = spec.models.shapes or [_shape_for(base, spec.models.rule, target) for target in spec.models.rule.params]
    train_tokens = _train_tokens(base)
    runs, warnings = [], []
    if train_tokens is None:
        unprepared = " / ".join(source.dir for source in base.data.sources())
        warnings.append(f"{unprepared} is not prepared, so epochs are unknown: run `scaletrain prepare {spec.base}`")
    amounts = spec.budgets if spec.mode == "isoflop" else spec.tokens
    for amount in sorted(amounts):
        for shape in _shapes_for_amount(spec, base, shapes, amount):
            for seed in spec.seeds:
                runs.append(_plan_run(spec, base, shape, amount, seed, tokens_per_step, train_tokens))
    _check_unique_names(runs, spec)
    for run in runs:
        if run.epochs is not None and run.epochs > 1:
            warnings.append(f"{run.name} trains {run.epochs:.2f} epochs: it repeats data, which a scaling-law "
                            "fit assumes it does not; lower the budget/tokens or use a larger corpus")
    return SweepPlan(spec, runs, tokens_per_step, train_tokens, warnings)


def _shapes_for_amount(spec: SweepSpec, base: Config, shapes: list[ModelShape], amount: float) -> list[ModelShape]:
    """The ladder, smallest first; in isoflop mode with sizes_per_budget, the rungs nearest the center ratio."""
    by_size = sorted(shapes, key=lambda shape: _counts(base, shape).total_params)
    keep = spec.models.sizes_per_budget
    if spec.mode != "isoflop" or keep is None or keep >= len(by_size):
        return by_size

    def distance_from_center(shape: ModelShape) -> float:
        counts = _counts(base, shape)
        tokens_per_param = amount / counts.flops_per_token / counts.total_params
        return abs(math.log(tokens_per_param / spec.models.center_tokens_per_param))

    nearest = sorted(by_size, key=distance_from_center)[:keep]
    return [shape for shape in by_size if shape in nearest]


def _plan_run(
    spec: SweepSpec, base: Config, shape: ModelShape, amount: float, seed: int, tokens_per_step: int,
    train_tokens: int | None,
) -> PlannedRun:
    counts = _counts(base, shape)
    target_tokens = amount / counts.flops_per_token if spec.mode == "isoflop" else amount
    steps = round(target_tokens / tokens_per_step)
    label = f"{_shape_label(shape)} ({counts.total_params:,} parameters)"
    budget = amount if spec.mode == "isoflop" else None
    if steps < 1:
        what = f"budget {amount:.3g} FLOPs" if budget else f"{amount:.3g} tokens"
        raise ConfigError(
            f"sweep {spec.name}: {what} is less than one optimizer step of {label}, which takes "
            f"{tokens_per_step * counts.flops_per_token:.3g} FLOPs ({tokens_per_step} tokens); raise it or "
            "drop that model from the ladder"
        )
    lr = spec.learning_rate.lr * (spec.learning_rate.reference_hidden / shape.hidden_size) ** (
        spec.learning_rate.width_exponent)
    warmup_steps = max(spec.warmup.steps, round(spec.warmup.fraction * steps))
    name = _run_name(budget, amount, shape, seed)
    if warmup_steps >= steps:
        raise ConfigError(
            f"sweep {spec.name}: run {name} ({label}) trains {steps} steps, no more than its warmup of "
            f"{warmup_steps} steps; raise its budget/tokens, lower warmup.steps, or use warmup.fraction"
        )
    tokens = steps * tokens_per_step
    overrides = _run_overrides(spec, shape, steps, lr, warmup_steps, seed, name, budget, base)
    try:
        load_config(spec.base, [*spec.overrides, *overrides])
    except ConfigError as error:
        raise ConfigError(f"sweep {spec.name}: run {name} ({label}): {error}") from None
    throughput = spec.throughput
    step_s = throughput.step_overhead_s + tokens_per_step * counts.flops_per_token / throughput.flops_per_s
    return PlannedRun(
        name=name, budget=budget, seed=seed, shape=shape, counts=counts, steps=steps, tokens=tokens,
        flops=tokens * counts.flops_per_token, lr=lr, warmup_steps=warmup_steps,
        epochs=tokens / train_tokens if train_tokens else None,
        predicted_s=throughput.startup_s + steps * step_s, overrides=tuple(overrides),
    )


def _run_overrides(
    spec: SweepSpec, shape: ModelShape, steps: int, lr: float, warmup_steps: int, seed: int, name: str,
    budget: float | None, base: Config,
) -> list[str]:
    ffn = "" if shape.ffn_hidden_size is None else shape.ffn_hidden_size
    tags = [spec.name, spec.mode] + ([f"budget={budget:.3g}"] if budget else [])
    return [
        f"model.num_layers={shape.num_layers}", f"model.hidden_size={shape.hidden_size}",
        f"model.num_heads={shape.num_heads}", f"model.ffn_hidden_size={ffn}",
        f"train.steps={steps}", f"train.lr={lr!r}", f"train.min_lr={lr * spec.learning_rate.min_lr_ratio!r}",
        f"train.warmup_steps={warmup_steps}", f"train.seed={seed}",
        f"train.global_batch_size={_global_batch_size(base)}", "train.grad_accum=1",
        "train.resume=auto", "train.exit_after=", f"train.eval_every={_eval_every(base, steps)}",
        f"checkpoint.every={math.ceil(steps / spec.checkpoints_per_run)}",
        f"run.dir={Path(spec.dir) / RUNS_DIR / name}",
        f"tracking.group={spec.name}", "tracking.job_type=sweep-run", f"tracking.name={name}",
        f"tracking.tags=[{', '.join(tags)}]",
    ]


def _eval_every(base: Config, steps: int) -> int:
    """The base's interval, or once at the end: every run ends with an evaluation (train/loop.py)."""
    return base.train.eval_every if 0 < base.train.eval_every <= steps else steps


def _global_batch_size(config: Config) -> int:
    return config.train.global_batch_size or config.global_batch_size(config.parallel.data or 1)


def _counts(base: Config, shape: ModelShape) -> ModelCounts:
    return model_counts(_with_shape(base, shape))


def _with_shape(base: Config, shape: ModelShape) -> Config:
    return dataclasses.replace(base, model=dataclasses.replace(base.model, **dataclasses.asdict(shape)))


def _shape_for(base: Config, rule: ShapeRule, target: float) -> ModelShape:
    """The shape whose exact count is closest to `target` (in log) at the rule's aspect ratio and head size."""
    best, best_error = None, math.inf
    for num_layers in range(1, MAX_RULE_LAYERS + 1):
        heads = max(1, round(rule.aspect_ratio * num_layers / rule.head_dim))
        if heads % base.parallel.tensor:
            heads += base.parallel.tensor - heads % base.parallel.tensor
        shape = ModelShape(num_layers=num_layers, hidden_size=heads * rule.head_dim, num_heads=heads)
        counts = _counts(base, shape)
        count = counts.non_embedding_params if rule.count == "non_embedding" else counts.total_params
        error = abs(math.log(max(count, 1) / target))
        if error < best_error:
            best, best_error = shape, error
    return best


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


def _shape_label(shape: ModelShape) -> str:
    ffn = f"-f{shape.ffn_hidden_size}" if shape.ffn_hidden_size else ""
    return f"l{shape.num_layers}-h{shape.hidden_size}-a{shape.num_heads}{ffn}"


def _run_name(budget: float | None, amount: float, shape: ModelShape, seed: int) -> str:
    scale = f"c{budget:.3g}" if budget else f"d{amount:.3g}"
    return f"{scale.replace('+', '')}-{_shape_label(shape)}-s{seed}"


def _check_unique_names(runs: list[PlannedRun], spec: SweepSpec) -> None:
    seen: set[str] = set()
    for run in runs:
        if run.name in seen:
            raise ConfigError(f"sweep {spec.name}: two runs are both named {run.name}; remove the repeated "
                              "shape or budget (shapes from models.rule can coincide for close targets)")
        seen.add(run.name)
