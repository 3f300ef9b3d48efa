"""The sweep spec (`configs/sweeps/*.yaml`): a typed schema, loaded and validated like run configs.

A sweep is a set of training runs that differ in model size and token count, all derived from
one base run config, so their final losses can be fitted to a scaling law (Kaplan et al. 2020;
Hoffmann et al. 2022). See configs/sweeps/isoflop_english.yaml for an annotated example.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scaletrain.config import ConfigError, build_dataclass, read_yaml
from scaletrain.scaling.fit_arguments import DEFAULT_PARAMS_COLUMN, OBJECTIVES, PARAMS_COLUMNS, parse_exclusion
from scaletrain.scaling.sweep.hyperparams import HyperparameterRules, validate_rules
from scaletrain.scaling.sweep.layout import RESULT_COLUMNS
from scaletrain.scaling.sweep.tune_fit import UNSTABLE_NEIGHBOUR

MODES = ("isoflop", "grid", "ladder")
BUDGET_MODES = ("isoflop", "ladder")  # modes whose runs belong to FLOPs budgets
SHAPE_COUNTS = ("non_embedding", "total")
# laws.LAW_FORMS' names, repeated so that reading a spec needs no scipy (as fit_arguments.py repeats
# laws.OBJECTIVES); tests/scaling/test_sweep_plan.py checks that the two agree.
LAW_FORM_NAMES = ("chinchilla", "kaplan", "kaplan_e", "muennighoff")


@dataclass
class ModelShape:
    """One rung of the model ladder; the FFN is the family's default (4 x hidden) unless set."""

    num_layers: int = 0
    hidden_size: int = 0
    num_heads: int = 0
    ffn_hidden_size: int | None = None


@dataclass
class ShapeRule:
    """Shapes derived from target parameter counts at a fixed aspect ratio and head size.

    Kaplan et al. 2020 (sec. 3.1, fig. 5) find loss depends only weakly on shape at fixed N
    over a wide range of d_model / n_layer, so one aspect ratio serves the whole ladder. With
    `smooth_depth`, the depth of neighbouring sizes never falls and grows by at most one layer
    (shapes.py): a ladder whose depth jumps confounds size with depth.
    """

    params: list[float] = field(default_factory=list)
    count: str = "non_embedding"  # which N the targets mean: non_embedding (Kaplan) or total (Chinchilla)
    aspect_ratio: float = 32.0  # hidden_size / num_layers
    head_dim: int = 32
    smooth_depth: bool = False
    min_layers: int = 1
    max_layers: int = 128


@dataclass
class ModelLadder:
    """The sizes to train: explicit shapes or a rule. In isoflop mode each budget may take only the
    `sizes_per_budget` rungs nearest (in log) to `center_tokens_per_param` tokens per parameter, so a
    long ladder serves budgets far apart while each IsoFLOP profile stays centred on its minimum, as
    Hoffmann et al. 2022 (sec. 3.2, fig. 3) chose a different set of sizes for each budget. The
    default center, 20, is their compute-optimal ratio; the fit does not assume it."""

    shapes: list[ModelShape] = field(default_factory=list)
    rule: ShapeRule | None = None
    sizes_per_budget: int | None = None  # None: every rung at every budget
    center_tokens_per_param: float = 20.0


@dataclass
class LearningRateRule:
    """Peak LR as a function of width: lr x (reference_hidden / hidden_size) ** width_exponent.

    width_exponent 0 keeps one LR for every size; 1 is the 1/width scaling of Adam's LR that
    muP prescribes for hidden weights (Yang et al. 2022, table 3). The cosine schedule decays to
    lr x min_lr_ratio at each run's own last step: Hoffmann et al. 2022 (sec. 3.1, fig. A1) found
    that a schedule longer than the run overestimates its loss, and decay by 10x.
    """

    lr: float = 1e-3
    reference_hidden: int = 128
    width_exponent: float = 0.0
    min_lr_ratio: float = 0.1


@dataclass
class WarmupRule:
    """Warmup steps of a run: max(steps, round(fraction x the run's steps))."""

    steps: int = 0
    fraction: float = 0.0


@dataclass
class Guards:
    """Runs a fit should not see. In a real sweep, runs of 250-800 optimizer steps left residuals of
    0.088 nats rms against 0.020 for runs of >= 1,000 steps and pulled the fit: a run that short has not
    left its warmup-dominated transient. More than one epoch repeats data, which the laws assume away."""

    min_steps: int = 1000
    max_epochs: float = 1.0


@dataclass
class Horizons:
    """How long the runs of `tune:` (and of its check) train: `tokens` per run, or `tokens_per_param`
    times N (total); one number is one horizon, a list several."""

    tokens: float | list[float] | None = None
    tokens_per_param: float | list[float] | None = None

    def horizons(self) -> tuple[str, list[float]]:
        """("tokens" or "tokens_per_param", its values as a list, ascending)."""
        key = "tokens" if self.tokens is not None else "tokens_per_param"
        value = getattr(self, key)
        return key, sorted(value if isinstance(value, list) else [] if value is None else [value])


@dataclass
class LearningRateCheck(Horizons):
    """`tune.check`: the LR rule at 0.5x, 1x and 2x at the largest sizes and longest horizons, trained by
    `sweep tune` after the grid (lr_check.py), so an extrapolated rule is seen to hold before the ladder
    runs. Its verdict needs the run-to-run noise: measured from tune.seeds (two or more), else `sigma`."""

    sizes: list[int] = field(default_factory=list)  # indices into the ladder, smallest first
    multipliers: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    sigma: float | None = None  # run-to-run sd of ln L, where the check trains one seed


@dataclass
class TuneOptions(Horizons):
    """`scaletrain sweep tune`: an LR grid (and optionally a batch grid) around the rule's values at a
    few sizes and horizons, to fit the optimum's power law in N, or in N and D with two horizons or
    more (Porian et al. 2024 tune LR and batch per size; DeepSeek LLM 2024, sec. 3.1, fit them in C)."""

    sizes: list[int] = field(default_factory=list)  # indices into the ladder, smallest first
    shapes: list[ModelShape] = field(default_factory=list)  # or explicit shapes
    lr_multipliers: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])
    batch_multipliers: list[float] = field(default_factory=list)  # empty: the batch rule is not tuned
    seeds: list[int] = field(default_factory=list)  # empty: the spec's first seed
    check: LearningRateCheck | None = None
    # where the LR above the best grid point diverged: refuse (ask for finer multipliers) | best_point (the
    # optimum is the best point, the stability edge; sweep/tune_fit.py)
    unstable_neighbour: str = "refuse"

    def tune_seeds(self, spec_seeds: list[int]) -> list[int]:
        return self.seeds or spec_seeds[:1]


@dataclass
class SeedRepeats:
    """Sizes trained again with more seeds, at every budget (or token count) where they are trained, so
    the fit measures the run-to-run noise that its prediction intervals include (fit.py: seed repeats
    of one (N, D) give sigma of ln L). `sizes` index the ladder, smallest (total parameters) first."""

    sizes: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)


@dataclass
class LadderOptions:
    """mode: ladder (OLMo-core's model ladder, WSD-S): per size one constant-LR run, cooled down at each
    budget over the last `cooldown_fraction` of that budget's steps (scaling/sweep/ladder.py)."""

    cooldown_fraction: float = 0.2  # Hägele et al. 2024: a 20% 1-sqrt cooldown matches cosine
    cooldown_shape: str = "sqrt"  # sqrt | linear (train.cooldown_shape)


@dataclass
class DownstreamOptions:
    """Downstream tasks that every run of the sweep scores at its last step, in the loop (its config's `eval`
    section: eval.tasks, eval.every 0), so results.csv gets their downstream/TASK/METRIC columns and the fit
    predicts them, the OLMo ladder's way (scaling/downstream.py; Bhagia et al. 2024). `sweep tune`'s runs do not
    score them: the LR fit reads the loss only. Found (and lm-eval imported) when the sweep is planned."""

    # lm-eval task names or task YAML files, relative to the working directory like `dir`
    # (e.g. [configs/eval_tasks/english_next_line.yaml]); empty: none
    tasks: list[str] = field(default_factory=list)
    include_path: list[str] = field(default_factory=list)  # directories of task YAMLs the names refer to
    limit: float | None = None  # documents per task (a number, or a fraction below 1); null: every document


@dataclass
class SlurmOptions:
    """Resources of one array task (one run) and the array's concurrency throttle (`%max_concurrent`)."""

    max_concurrent: int = 4
    cpus_per_task: int = 2  # CPUs of one run on a node (with nodes > 1, split over its --nproc ranks there)
    gpus_per_task: int = 0  # GPUs of one run on a node
    # nodes per run: with more than one, each run is a multi-node job, --nproc ranks on each node started
    # by srun (one task per rank, as launch/slurm.sbatch does); TP stays inside a node
    nodes: int = 1
    time: str = "04:00:00"
    partition: str | None = None
    extra_args: list[str] = field(default_factory=list)  # more `#SBATCH` options, e.g. --account=ml


@dataclass
class ThroughputModel:
    """Predicted wall time of one run: startup_s + steps x (step_overhead_s + FLOPs per step / flops_per_s),
    plus its evaluations at the same rates (timing.py).

    The defaults were measured on a 2-core CPU (see experiments/isoflop_english/README.md);
    set them for your hardware, e.g. from the `tokens_per_s` of a short run.
    """

    flops_per_s: float = 2.0e10
    step_overhead_s: float = 0.01
    startup_s: float = 20.0


@dataclass
class FitOptions:
    """How `sweep run` and `sweep finalize` fit the finished runs (the options of `scaletrain fit`)."""

    bootstrap: int = 100
    target_flops: list[float] = field(default_factory=list)  # empty: 10x and 100x the largest run
    # N: active_params (Chinchilla's N, counted as a token meets it: a mixture of experts' routed experts),
    # active_non_embedding_params (Kaplan's), or the totals params, non_embedding_params (fit_arguments.py)
    params_column: str = DEFAULT_PARAMS_COLUMN
    forms: list[str] = field(default_factory=list)  # law forms to fit and backtest; empty: every form
    objective: str = "huber"  # on ln L: huber (robust to a few outlying runs) or least_squares
    huber_delta: float | str = "auto"  # in ln L; auto: 1.345 x the measured run-to-run sigma (laws.py)
    exclude: list[str] = field(default_factory=list)  # runs not fitted, e.g. "num_layers < 2"

    def huber_delta_value(self) -> float | None:
        """The delta as fit_source takes it: None for auto."""
        return None if self.huber_delta == "auto" else float(self.huber_delta)


@dataclass
class SweepSpec:
    name: str = ""
    base: str = ""  # run config (any family), relative to the spec file
    dir: str = ""  # where the sweep lives (relative to the working directory, like run.dir)
    mode: str = "isoflop"  # isoflop: each (budget C, size N) trains D = C / FLOPs-per-token(N); grid: sizes x tokens
    budgets: list[float] = field(default_factory=list)  # training FLOPs per run (isoflop)
    tokens: list[float] = field(default_factory=list)  # tokens per run (grid)
    models: ModelLadder = field(default_factory=ModelLadder)
    learning_rate: LearningRateRule = field(default_factory=LearningRateRule)
    warmup: WarmupRule = field(default_factory=WarmupRule)
    hyperparameters: HyperparameterRules = field(default_factory=HyperparameterRules)
    guards: Guards = field(default_factory=Guards)
    tune: TuneOptions | None = None
    ladder: LadderOptions = field(default_factory=LadderOptions)
    seeds: list[int] = field(default_factory=lambda: [1234])
    repeat_seeds: SeedRepeats = field(default_factory=SeedRepeats)
    overrides: list[str] = field(default_factory=list)  # dotted run-config overrides for every run
    checkpoints_per_run: int = 4  # so an interrupted run resumes with at most 1/4 of it to redo
    downstream: DownstreamOptions = field(default_factory=DownstreamOptions)
    fit: FitOptions = field(default_factory=FitOptions)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    throughput: ThroughputModel = field(default_factory=ThroughputModel)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_sweep_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep spec; `base` becomes a path relative to the working directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"sweep spec {path} does not exist; pass a YAML file such as configs/sweeps/isoflop_shakespeare.yaml"
        )
    try:
        raw = read_yaml(path.read_text(), f"sweep spec {path}") or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"sweep spec {path} is not valid YAML: {error}") from None
    spec = build_dataclass(SweepSpec, raw, prefix="", source=f"sweep spec {path}")
    validate_spec(spec, source=f"sweep spec {path}")
    _refuse_two_rules(raw, source=f"sweep spec {path}")
    base = Path(spec.base)
    if not base.is_absolute():
        base = path.parent / base
    if not base.is_file():
        raise ConfigError(f"sweep spec {path}: base={spec.base!r} does not exist (looked for {base})")
    return dataclasses.replace(spec, base=str(base))


def spec_from_dict(raw: dict[str, Any], source: str) -> SweepSpec:
    """A spec stored by a sweep directory (sweep.json), its base already resolved."""
    spec = build_dataclass(SweepSpec, raw, prefix="", source=source)
    validate_spec(spec, source)
    return spec


def _refuse_two_rules(raw: dict[str, Any], source: str) -> None:
    """The older `learning_rate:` / `warmup:` sections and their `hyperparameters:` rules say the same thing:
    with both, one would silently win."""
    rules = raw.get("hyperparameters") or {}
    for old, new in (("learning_rate", "lr"), ("warmup", "warmup")):
        if old in raw and rules.get(new) is not None:
            raise ConfigError(f"{source}: both `{old}:` and `hyperparameters.{new}:` set the {new}; keep one "
                              f"(hyperparameters.{new} with rule: width is what `{old}:` does)")


def validate_spec(spec: SweepSpec, source: str) -> None:
    for key in ("name", "base", "dir"):
        if not getattr(spec, key):
            raise ConfigError(f"{source}: `{key}` is required")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", spec.name):
        raise ConfigError(f"{source}: name={spec.name!r}; use letters, digits, '.', '_' and '-' (it names W&B groups)")
    if spec.mode not in MODES:
        raise ConfigError(f"{source}: mode={spec.mode!r}; use isoflop, grid or ladder")
    _validate_mode_values(spec, source)
    if spec.mode == "ladder":
        _validate_ladder(spec, source)
    _validate_models(spec.models, source)
    rule = spec.learning_rate
    if rule.lr <= 0 or rule.reference_hidden < 1 or not 0 <= rule.min_lr_ratio <= 1:
        raise ConfigError(
            f"{source}: learning_rate needs lr > 0, reference_hidden >= 1 and 0 <= min_lr_ratio <= 1 "
            f"(got lr={rule.lr}, reference_hidden={rule.reference_hidden}, min_lr_ratio={rule.min_lr_ratio})"
        )
    if spec.warmup.steps < 0 or not 0 <= spec.warmup.fraction < 1:
        raise ConfigError(f"{source}: warmup needs steps >= 0 and 0 <= fraction < 1 (got {spec.warmup})")
    if not spec.seeds or len(set(spec.seeds)) != len(spec.seeds):
        raise ConfigError(f"{source}: seeds={spec.seeds} must list at least one seed, without repeats")
    repeats = spec.repeat_seeds
    if bool(repeats.sizes) != bool(repeats.seeds) or set(repeats.seeds) & set(spec.seeds) or \
            len(set(repeats.seeds)) != len(repeats.seeds) or any(index < 0 for index in repeats.sizes):
        raise ConfigError(f"{source}: repeat_seeds needs both `sizes` (ladder indices >= 0, smallest first) and "
                          f"`seeds` (new seeds, none of seeds={spec.seeds}, without repeats); got {repeats}")
    if spec.checkpoints_per_run < 1:
        raise ConfigError(f"{source}: checkpoints_per_run={spec.checkpoints_per_run} must be >= 1")
    _validate_slurm_and_throughput(spec, source)
    validate_rules(spec.hyperparameters, source)
    _validate_guards_and_tune(spec, source)
    _validate_fit(spec.fit, source)


def _validate_mode_values(spec: SweepSpec, source: str) -> None:
    needed, unused = ("budgets", "tokens") if spec.mode in BUDGET_MODES else ("tokens", "budgets")
    values = getattr(spec, needed)
    if not values or min(values) <= 0:
        raise ConfigError(f"{source}: mode={spec.mode} needs `{needed}`: a list of positive numbers (got {values})")
    if getattr(spec, unused):
        raise ConfigError(f"{source}: `{unused}` is not used in mode={spec.mode}; remove it (or change the mode)")
    if len(set(values)) != len(values):
        raise ConfigError(f"{source}: `{needed}` has repeated values {values}")


def _validate_ladder(spec: SweepSpec, source: str) -> None:
    """A branch shares its stable run's first steps, so nothing before the cooldown may depend on the
    run's length; the plan checks the hyperparameter rules' values (ladder.py)."""
    ladder = spec.ladder
    if not 0 < ladder.cooldown_fraction < 1:
        raise ConfigError(f"{source}: ladder.cooldown_fraction={ladder.cooldown_fraction} must be in (0, 1); "
                          "0.2 is the usual WSD cooldown")
    if ladder.cooldown_shape not in ("sqrt", "linear"):
        raise ConfigError(f"{source}: ladder.cooldown_shape={ladder.cooldown_shape!r}; use sqrt or linear")
    if spec.warmup.fraction > 0:
        raise ConfigError(
            f"{source}: warmup.fraction={spec.warmup.fraction} makes warmup depend on each run's length, but the "
            "branches of a ladder share their stable run's warmup; use warmup.steps (fraction 0) in mode=ladder"
        )


def _validate_models(models: ModelLadder, source: str) -> None:
    if bool(models.shapes) == (models.rule is not None):
        raise ConfigError(f"{source}: models needs exactly one of `shapes` (a list) or `rule` (params + aspect ratio)")
    for index, shape in enumerate(models.shapes):
        if min(shape.num_layers, shape.hidden_size, shape.num_heads) < 1:
            raise ConfigError(
                f"{source}: models.shapes[{index}] needs num_layers, hidden_size and num_heads >= 1 (got {shape})"
            )
    if models.sizes_per_budget is not None and models.sizes_per_budget < 3:
        raise ConfigError(f"{source}: models.sizes_per_budget={models.sizes_per_budget} must be >= 3 "
                          "(an IsoFLOP parabola needs three sizes) or null for every size")
    if models.center_tokens_per_param <= 0:
        raise ConfigError(f"{source}: models.center_tokens_per_param must be > 0")
    rule = models.rule
    if rule is None:
        return
    if not rule.params or min(rule.params) <= 0:
        raise ConfigError(f"{source}: models.rule.params must list positive parameter counts (got {rule.params})")
    if rule.count not in SHAPE_COUNTS:
        raise ConfigError(f"{source}: models.rule.count={rule.count!r}; use non_embedding or total")
    if rule.aspect_ratio <= 0 or rule.head_dim < 1:
        raise ConfigError(f"{source}: models.rule needs aspect_ratio > 0 and head_dim >= 1")
    if not 1 <= rule.min_layers <= rule.max_layers:
        raise ConfigError(f"{source}: models.rule needs 1 <= min_layers <= max_layers (got {rule.min_layers}, "
                          f"{rule.max_layers})")


def _validate_guards_and_tune(spec: SweepSpec, source: str) -> None:
    if spec.guards.min_steps < 1 or spec.guards.max_epochs <= 0:
        raise ConfigError(f"{source}: guards needs min_steps >= 1 and max_epochs > 0 (got {spec.guards})")
    tune = spec.tune
    if tune is None:
        return
    if not 2 <= len(tune.sizes) + len(tune.shapes) <= 4 or (tune.sizes and tune.shapes):
        raise ConfigError(f"{source}: tune needs 2 to 4 sizes, as `sizes` (indices into the ladder, smallest "
                          f"first) or `shapes`, not both (got sizes={tune.sizes}, {len(tune.shapes)} shapes); "
                          "a power law in N needs two sizes at least")
    for name in ("lr_multipliers", "batch_multipliers"):
        values = getattr(tune, name)
        if values and (len(values) < 3 or min(values) <= 0 or len(set(values)) != len(values)):
            raise ConfigError(f"{source}: tune.{name}={values}; list three or more distinct positive "
                              "multipliers (a parabola needs the best point and both neighbours)")
    if not tune.lr_multipliers:
        raise ConfigError(f"{source}: tune.lr_multipliers is empty; use e.g. [0.25, 0.5, 1, 2, 4]")
    _validate_horizons(tune, f"{source}: tune")
    if len(set(tune.seeds)) != len(tune.seeds):
        raise ConfigError(f"{source}: tune.seeds={tune.seeds} repeats a seed; list each once")
    if tune.unstable_neighbour not in UNSTABLE_NEIGHBOUR:
        raise ConfigError(f"{source}: tune.unstable_neighbour={tune.unstable_neighbour!r}; use "
                          f"{' or '.join(UNSTABLE_NEIGHBOUR)}")
    if tune.check is not None:
        _validate_check(tune.check, tune.tune_seeds(spec.seeds), f"{source}: tune.check")


def _validate_horizons(horizons: Horizons, where: str) -> None:
    _, values = horizons.horizons()
    if (horizons.tokens is None) == (horizons.tokens_per_param is None) or not values or min(values) <= 0 \
            or len(set(values)) != len(values):
        raise ConfigError(f"{where} needs exactly one of `tokens` (per run) or `tokens_per_param`: a positive number "
                          f"or a list of distinct ones (several horizons); got tokens={horizons.tokens}, "
                          f"tokens_per_param={horizons.tokens_per_param}")


def _validate_check(check: LearningRateCheck, seeds: list[int], where: str) -> None:
    if not check.sizes or min(check.sizes) < 0:
        raise ConfigError(f"{where} needs `sizes`: indices into the ladder (smallest first), e.g. its largest "
                          f"two; got {check.sizes}")
    _validate_horizons(check, where)
    multipliers = check.multipliers
    if 1.0 not in multipliers or len(multipliers) < 2 or min(multipliers) <= 0 \
            or len(set(multipliers)) != len(multipliers):
        raise ConfigError(f"{where}.multipliers={multipliers}; list distinct positive multipliers of the rule's LR "
                          "that include 1 (the rule itself), e.g. [0.5, 1, 2]")
    if check.sigma is not None and not check.sigma > 0:
        raise ConfigError(f"{where}.sigma={check.sigma} must be a positive sd of ln L (e.g. 0.0018)")
    if check.sigma is None and len(seeds) < 2:
        raise ConfigError(f"{where}: judging the rule needs the run-to-run noise: list two seeds or more in "
                          "tune.seeds (the check measures it), or set tune.check.sigma (the sd of ln L between "
                          "seeds, e.g. 0.0018 as experiments/ladder_english measured)")


def _validate_slurm_and_throughput(spec: SweepSpec, source: str) -> None:
    slurm = spec.slurm
    if slurm.max_concurrent < 1 or slurm.cpus_per_task < 1 or slurm.gpus_per_task < 0 or slurm.nodes < 1:
        raise ConfigError(f"{source}: slurm needs max_concurrent >= 1, cpus_per_task >= 1, gpus_per_task >= 0, "
                          f"nodes >= 1 (got {slurm.max_concurrent}, {slurm.cpus_per_task}, {slurm.gpus_per_task}, "
                          f"{slurm.nodes})")
    if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", slurm.time):
        raise ConfigError(
            f"{source}: slurm.time={slurm.time!r}; use SLURM's [days-]hours:minutes:seconds, e.g. 04:00:00"
        )
    model = spec.throughput
    if model.flops_per_s <= 0 or model.step_overhead_s < 0 or model.startup_s < 0:
        raise ConfigError(f"{source}: throughput needs flops_per_s > 0 and non-negative overheads")


def _validate_fit(fit: FitOptions, source: str) -> None:
    """The fit section, checked here so that a bad option fails before any run trains, not at the end."""
    if fit.bootstrap < 0 or any(flops <= 0 for flops in fit.target_flops):
        raise ConfigError(f"{source}: fit needs bootstrap >= 0 and positive target_flops")
    if fit.params_column not in PARAMS_COLUMNS:
        raise ConfigError(f"{source}: fit.params_column={fit.params_column!r}; use one of {', '.join(PARAMS_COLUMNS)}")
    unknown = [form for form in fit.forms if form not in LAW_FORM_NAMES]
    if unknown or len(set(fit.forms)) != len(fit.forms):
        problem = f"unknown form(s) {', '.join(unknown)}" if unknown else "a form repeated"
        raise ConfigError(f"{source}: fit.forms={fit.forms}: {problem}; list some of {', '.join(LAW_FORM_NAMES)}, "
                          "each once (or none: every form)")
    if fit.objective not in OBJECTIVES:
        raise ConfigError(f"{source}: fit.objective={fit.objective!r}; use {' or '.join(OBJECTIVES)}")
    if fit.huber_delta != "auto":
        delta = _number(fit.huber_delta)
        if not (math.isfinite(delta) and delta > 0):
            raise ConfigError(f"{source}: fit.huber_delta={fit.huber_delta!r}; use a positive number in ln L "
                              "(e.g. 1.0e-3, Hoffmann et al. 2022) or auto")
        if fit.objective != "huber":
            raise ConfigError(f"{source}: fit.huber_delta={fit.huber_delta!r} applies to objective huber only; "
                              "drop it (or set it to auto), or use objective: huber")
    for index, rule in enumerate(fit.exclude):
        _validate_exclusion(rule, f"{source}: fit.exclude[{index}]")


def _validate_exclusion(rule: str, where: str) -> None:
    """The syntax fit_source applies (fit_arguments.parse_exclusion), on a column that results.csv has."""
    try:
        column = parse_exclusion(rule).column
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None
    if column not in RESULT_COLUMNS:
        raise ConfigError(f"{where}={rule!r}: results.csv has no column {column!r}; name one of "
                          f"{', '.join(RESULT_COLUMNS)}")


def _number(text: object) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan
