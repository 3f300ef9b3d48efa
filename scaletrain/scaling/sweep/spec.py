"""The sweep spec (`configs/sweeps/*.yaml`): a typed schema, loaded and validated like run configs.

A sweep is a set of training runs that differ in model size and token count, all derived from
one base run config, so their final losses can be fitted to a scaling law (Kaplan et al. 2020;
Hoffmann et al. 2022). See configs/sweeps/isoflop_english.yaml for an annotated example.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scaletrain.config import ConfigError, build_dataclass, read_yaml
from scaletrain.scaling.fit_arguments import DEFAULT_PARAMS_COLUMN, PARAMS_COLUMNS
from scaletrain.scaling.sweep.hyperparams import HyperparameterRules, validate_rules

MODES = ("isoflop", "grid", "ladder")
BUDGET_MODES = ("isoflop", "ladder")  # modes whose runs belong to FLOPs budgets
SHAPE_COUNTS = ("non_embedding", "total")


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
    over a wide range of d_model / n_layer, so one aspect ratio serves the whole ladder.
    """

    params: list[float] = field(default_factory=list)
    count: str = "non_embedding"  # which N the targets mean: non_embedding (Kaplan) or total (Chinchilla)
    aspect_ratio: float = 32.0  # hidden_size / num_layers
    head_dim: int = 32


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
class TuneOptions:
    """`scaletrain sweep tune`: an LR grid (and optionally a batch grid) around the rule's values at a
    few sizes, to fit the optimum's power law in N (Porian et al. 2024 tune LR and batch per size)."""

    sizes: list[int] = field(default_factory=list)  # indices into the ladder, smallest first
    shapes: list[ModelShape] = field(default_factory=list)  # or explicit shapes
    lr_multipliers: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])
    batch_multipliers: list[float] = field(default_factory=list)  # empty: the batch rule is not tuned
    tokens: float | None = None  # tokens per run, or
    tokens_per_param: float | None = None  # tokens per run as a multiple of N (total)


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
    """Predicted wall time of one run: startup_s + steps x (step_overhead_s + FLOPs per step / flops_per_s).

    The defaults were measured on a 2-core CPU (see experiments/isoflop_english/README.md);
    set them for your hardware, e.g. from the `tokens_per_s` of a short run.
    """

    flops_per_s: float = 2.0e10
    step_overhead_s: float = 0.01
    startup_s: float = 20.0


@dataclass
class FitOptions:
    """How `sweep run` fits the finished runs (the same options as `scaletrain fit`)."""

    bootstrap: int = 100
    target_flops: list[float] = field(default_factory=list)  # empty: 10x and 100x the largest run
    # N: active_params (Chinchilla's N, counted as a token meets it: a mixture of experts' routed experts),
    # active_non_embedding_params (Kaplan's), or the totals params, non_embedding_params (fit_arguments.py)
    params_column: str = DEFAULT_PARAMS_COLUMN


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
    if spec.fit.bootstrap < 0 or any(flops <= 0 for flops in spec.fit.target_flops):
        raise ConfigError(f"{source}: fit needs bootstrap >= 0 and positive target_flops")
    if spec.fit.params_column not in PARAMS_COLUMNS:
        raise ConfigError(f"{source}: fit.params_column={spec.fit.params_column!r}; use one of "
                          f"{', '.join(PARAMS_COLUMNS)}")


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
    if (tune.tokens is None) == (tune.tokens_per_param is None) or (tune.tokens or tune.tokens_per_param) <= 0:
        raise ConfigError(f"{source}: tune needs exactly one of `tokens` (per run) or `tokens_per_param` (> 0), "
                          f"got tokens={tune.tokens}, tokens_per_param={tune.tokens_per_param}")


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
