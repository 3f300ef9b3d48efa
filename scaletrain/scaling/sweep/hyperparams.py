"""Hyperparameters that follow a run's size and length: the `hyperparameters:` section of a sweep spec.

Porian et al. 2024 ("Resolving Discrepancies in Compute-Optimal Scaling of Language Models") traced
the Kaplan/Chinchilla disagreement to hyperparameters held fixed across sizes: LR, batch size and
AdamW's beta2 must be tuned per size (beta2 = 0.99 at small batches), and a warmup fixed in steps
is too long for small models (they warm up for N tokens). The rules here state those choices:

- lr and batch_size: `power` in N, and optionally in the run's tokens D: value (N/N0)^exponent
  (D/D0)^tokens_exponent (Porian et al. 2024's fitted optima, as OLMo-core's ladder applies them:
  lr = 0.0047 (N/108M)^(-1/3), batch = 160 (N/108M)^(2/3) sequences of 2,048 tokens, i.e. 327,680
  (N/108M)^(2/3) tokens), `compute` in C (DeepSeek LLM 2024, eq. 1: lr = 0.3118 C^-0.125, batch =
  0.2920 C^0.3271 tokens, their C counting non-embedding FLOPs per token where ours counts all), `width`
  (muP-style, Yang et al. 2022), `fixed`, or `tuned` (the power law `scaletrain sweep tune` fitted,
  read from SWEEP/tune/tuned.json: in N, or in N and D when it tuned at several horizons). A batch rule
  rounds to whole micro-batches (or to a power of two) and clips to [min_batch, max_batch];
- beta2: `fixed`, or `by_batch` (Porian et al. 2024: 0.99 below a batch of `small_batch_tokens`);
- warmup: `tokens_per_param` (Porian et al. 2024: N tokens), or `steps`;
- weight_decay: `fixed`, or `timescale` (Wang & Aitchison 2024, "How to set AdamW's weight decay as
  you scale model and dataset size": the EMA timescale 1/(lr wd) in iterations is a fixed fraction of
  the run, so wd = 1 / (lr x timescale_fraction x steps)).

A rule that reads C, D or the run's steps depends on the run's length (`depends_on_length`). The branches
of one size in a ladder share their hyperparameters: there a rule in C or D is read once per size, at the
C and D of its stable run's horizon (its longest branch; plan.py _rule_horizons: the stable phase's LR is
chosen for the run it is and its cooldowns decay from it, Hägele et al. 2024), and a rule that reads the
steps (weight_decay `timescale`) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import ConfigError

TUNE_DIR = "tune"
TUNED_FILE = "tuned.json"
SIZE_RULES = ("power", "compute", "width", "fixed", "tuned")
PARAM_COUNTS = ("total", "non_embedding")
BATCH_UNITS = ("sequences", "tokens")
BATCH_ROUNDINGS = ("micro_batch", "power_of_two")
# OLMo-core's ladder reference size (108M parameters), the default `reference_params`.
OLMO_REFERENCE_PARAMS = 1.08e8


@dataclass
class SizeRule:
    """value x (N / reference_params)^exponent x (D / reference_tokens)^tokens_exponent (power, D the
    run's planned tokens), value x (C / reference_flops)^exponent (compute), value x (reference_hidden /
    hidden_size)^width_exponent (width), value (fixed), or tuned: the power law in tuned.json, with this
    rule's constants as the grid centre of `sweep tune`."""

    rule: str = ""
    value: float | None = None
    count: str = "total"  # which N: total (Chinchilla) or non_embedding (Kaplan)
    reference_params: float = OLMO_REFERENCE_PARAMS
    reference_flops: float = 1.0  # 1: `value` is DeepSeek's coefficient of C^exponent
    exponent: float = 0.0
    reference_tokens: float = 1.0
    tokens_exponent: float = 0.0  # 0: the power law is in N alone
    reference_hidden: int = 128
    width_exponent: float = 0.0


@dataclass
class LearningRateSetting(SizeRule):
    min_lr_ratio: float = 0.1  # cosine to lr x min_lr_ratio at the run's last step (Hoffmann et al. 2022)


@dataclass
class BatchSetting(SizeRule):
    """The global batch; sequences (OLMo-core) or tokens (DeepSeek), clipped to [min_batch, max_batch] (in
    `unit`; none: no bound) and rounded to whole micro-batches or to a power of two (batch_sequences)."""

    unit: str = "sequences"
    rounding: str = "micro_batch"  # micro_batch: the nearest multiple | power_of_two: the nearest in log
    min_batch: float | None = None
    max_batch: float | None = None


@dataclass
class Beta2Setting:
    rule: str = "fixed"  # fixed | by_batch
    value: float = 0.95
    small_batch_tokens: float = 262_144.0  # by_batch: below this many tokens per step, small_value
    small_value: float = 0.99
    large_value: float = 0.95


@dataclass
class WarmupSetting:
    rule: str = "tokens_per_param"  # tokens_per_param (x N tokens) | steps
    tokens_per_param: float = 1.0
    count: str = "total"
    steps: int = 0


@dataclass
class WeightDecaySetting:
    rule: str = "fixed"  # fixed | timescale
    value: float = 0.1
    timescale_fraction: float = 0.2  # tau_iter = 1/(lr wd) as a fraction of the run's steps


@dataclass
class HyperparameterRules:
    """The `hyperparameters:` section; an unset rule leaves the older section (learning_rate, warmup)
    or the base config's value (train.global_batch_size, beta2, weight_decay) in force."""

    lr: LearningRateSetting | None = None
    batch_size: BatchSetting | None = None
    beta2: Beta2Setting | None = None
    warmup: WarmupSetting | None = None
    weight_decay: WeightDecaySetting | None = None


@dataclass(frozen=True)
class RunScale:
    """What a rule may read about a run: its size, its planned compute and tokens (C / FLOPs per token in
    a budget mode, the spec's tokens in grid mode: known before the batch is; in a ladder its size's
    longest branch's), its width."""

    params: int
    non_embedding_params: int
    hidden_size: int
    flops: float
    tokens: float

    def count(self, which: str) -> int:
        return self.non_embedding_params if which == "non_embedding" else self.params


def validate_rules(rules: HyperparameterRules, source: str) -> None:
    for name in ("lr", "batch_size"):
        setting = getattr(rules, name)
        if setting is not None:
            _validate_size_rule(setting, f"{source}: hyperparameters.{name}")
    if rules.lr is not None and not 0 <= rules.lr.min_lr_ratio <= 1:
        raise ConfigError(f"{source}: hyperparameters.lr.min_lr_ratio={rules.lr.min_lr_ratio}; use 0 to 1")
    if rules.batch_size is not None:
        _validate_batch_bounds(rules.batch_size, f"{source}: hyperparameters.batch_size")
    _validate_beta2(rules.beta2, source)
    _validate_warmup(rules.warmup, source)
    decay = rules.weight_decay
    if decay is not None and (decay.rule not in ("fixed", "timescale") or decay.value < 0
                              or decay.timescale_fraction <= 0):
        raise ConfigError(f"{source}: hyperparameters.weight_decay needs rule fixed (value >= 0) or timescale "
                          f"(timescale_fraction > 0, e.g. 0.2); got {decay}")


def _validate_size_rule(setting: SizeRule, where: str) -> None:
    if setting.rule not in SIZE_RULES:
        raise ConfigError(f"{where}.rule={setting.rule!r}; use one of {', '.join(SIZE_RULES)}")
    if setting.rule != "tuned" and (setting.value is None or setting.value <= 0):
        raise ConfigError(f"{where}: rule {setting.rule} needs a positive `value` (got {setting.value})")
    if setting.value is not None and setting.value <= 0:
        raise ConfigError(f"{where}.value={setting.value} must be positive")
    if setting.count not in PARAM_COUNTS:
        raise ConfigError(f"{where}.count={setting.count!r}; use total or non_embedding")
    if setting.reference_params <= 0 or setting.reference_flops <= 0 or setting.reference_tokens <= 0 \
            or setting.reference_hidden < 1:
        raise ConfigError(f"{where} needs reference_params > 0, reference_flops > 0, reference_tokens > 0 and "
                          "reference_hidden >= 1")
    if setting.tokens_exponent and setting.rule not in ("power", "tuned"):
        raise ConfigError(f"{where}: tokens_exponent={setting.tokens_exponent} belongs to rule power (a law in N "
                          f"and D); rule {setting.rule} does not read it: remove it")


def _validate_batch_bounds(setting: BatchSetting, where: str) -> None:
    if setting.unit not in BATCH_UNITS:
        raise ConfigError(f"{where}.unit={setting.unit!r}; use sequences or tokens")
    if setting.rounding not in BATCH_ROUNDINGS:
        raise ConfigError(f"{where}.rounding={setting.rounding!r}; use micro_batch or power_of_two")
    low, high = setting.min_batch, setting.max_batch
    if (low is not None and low <= 0) or (high is not None and high <= 0) or \
            (low is not None and high is not None and low > high):
        raise ConfigError(f"{where} needs 0 < min_batch <= max_batch (in {setting.unit}; either may be unset), "
                          f"got min_batch={low}, max_batch={high}")


def _validate_beta2(beta2: Beta2Setting | None, source: str) -> None:
    if beta2 is None:
        return
    values = (beta2.value, beta2.small_value, beta2.large_value)
    if beta2.rule not in ("fixed", "by_batch") or not all(0 <= value < 1 for value in values) \
            or beta2.small_batch_tokens <= 0:
        raise ConfigError(f"{source}: hyperparameters.beta2 needs rule fixed or by_batch, values in [0, 1) and "
                          f"small_batch_tokens > 0; got {beta2}")


def _validate_warmup(warmup: WarmupSetting | None, source: str) -> None:
    if warmup is None:
        return
    if warmup.rule not in ("tokens_per_param", "steps"):
        raise ConfigError(f"{source}: hyperparameters.warmup.rule={warmup.rule!r}; use tokens_per_param or steps")
    if warmup.tokens_per_param < 0 or warmup.steps < 0 or warmup.count not in PARAM_COUNTS:
        raise ConfigError(f"{source}: hyperparameters.warmup needs tokens_per_param >= 0, steps >= 0 and count "
                          f"total or non_embedding; got {warmup}")


def size_rule_value(setting: SizeRule, scale: RunScale) -> float:
    """The rule's value at this run (a `tuned` rule must have been replaced by `with_tuned` first)."""
    if setting.rule == "power":
        return setting.value * (scale.count(setting.count) / setting.reference_params) ** setting.exponent \
            * (scale.tokens / setting.reference_tokens) ** setting.tokens_exponent
    if setting.rule == "compute":
        return setting.value * (scale.flops / setting.reference_flops) ** setting.exponent
    if setting.rule == "width":
        return setting.value * (setting.reference_hidden / scale.hidden_size) ** setting.width_exponent
    if setting.rule == "fixed":
        return setting.value
    raise ConfigError(f"a `tuned` rule reached planning unresolved ({setting}); this is a bug in the planner")


def depends_on_length(setting: object, rules: HyperparameterRules | None = None) -> bool:
    """Whether the rule reads the run's compute C, its tokens D or its steps: such a value differs between two
    runs of one size that train for different lengths. beta2 by batch follows the batch rule's dependence."""
    if isinstance(setting, SizeRule):
        return setting.rule == "compute" or (setting.rule == "power" and setting.tokens_exponent != 0)
    if isinstance(setting, WeightDecaySetting):
        return setting.rule == "timescale"
    if isinstance(setting, Beta2Setting):
        return setting.rule == "by_batch" and rules is not None and rules.batch_size is not None \
            and depends_on_length(rules.batch_size)
    return False


def length_dependent(rules: HyperparameterRules) -> list[str]:
    """The names of the hyperparameters whose rules depend on the run's length."""
    return [field.name for field in dataclasses.fields(rules)
            if getattr(rules, field.name) is not None and depends_on_length(getattr(rules, field.name), rules)]


def batch_sequences(setting: BatchSetting, scale: RunScale, seq_length: int, granule: int, where: str) -> int:
    """The rule's global batch in sequences: clipped to [min_batch, max_batch], then rounded to a whole
    number of micro-batches across the data-parallel ranks (`granule` = micro_batch_size x data-parallel
    size, so every rank steps alike), or to the nearest power of two in log (a multiple of the granule,
    which must be a power of two too); a rounding that leaves the bounds steps back inside them."""
    per_unit = seq_length if setting.unit == "tokens" else 1
    low, high = (None if bound is None else bound / per_unit for bound in (setting.min_batch, setting.max_batch))
    wanted = size_rule_value(setting, scale) / per_unit
    wanted = wanted if low is None else max(wanted, low)
    wanted = wanted if high is None else min(wanted, high)
    if setting.rounding == "power_of_two":
        if granule & (granule - 1):
            raise ConfigError(f"{where}: hyperparameters.batch_size.rounding=power_of_two needs micro_batch_size x "
                              f"data-parallel size to be a power of two (it is {granule}); change "
                              "train.micro_batch_size or use rounding: micro_batch")
        rounded = max(granule, 2 ** round(math.log2(wanted)))
        rounded = rounded // 2 if high is not None and rounded > high else rounded
        rounded = rounded * 2 if low is not None and rounded < low else rounded
    else:
        rounded = max(granule, granule * round(wanted / granule))
        rounded = rounded - granule if high is not None and rounded > high else rounded
        rounded = rounded + granule if low is not None and rounded < low else rounded
    if rounded < granule or (high is not None and rounded > high) or (low is not None and rounded < low):
        raise ConfigError(f"{where}: hyperparameters.batch_size has no batch of whole micro-batches ({granule} "
                          f"sequences{', a power of two' if setting.rounding == 'power_of_two' else ''}) between "
                          f"min_batch={setting.min_batch} and max_batch={setting.max_batch} {setting.unit}; widen them")
    if setting.rounding == "micro_batch" and not 2 / 3 <= rounded / wanted <= 3 / 2:
        raise ConfigError(
            f"{where}: hyperparameters.batch_size gives {wanted:.3g} sequences, which is far from a multiple of "
            f"micro_batch_size x data-parallel size = {granule} (nearest {rounded}); lower train.micro_batch_size "
            "(a value dividing the batch), or raise the rule's value"
        )
    return int(rounded)


def beta2_value(setting: Beta2Setting, batch_tokens: int) -> float:
    """Porian et al. 2024: at small batches beta2 = 0.99 instead of 0.95 (the second-moment estimate
    averages over too few tokens otherwise); `small_batch_tokens` is where the switch happens."""
    if setting.rule == "fixed":
        return setting.value
    return setting.small_value if batch_tokens < setting.small_batch_tokens else setting.large_value


def warmup_steps_value(setting: WarmupSetting, scale: RunScale, tokens_per_step: int) -> int:
    """Porian et al. 2024 warm up for N tokens (tokens_per_param 1); rounded to steps, at least one."""
    if setting.rule == "steps":
        return setting.steps
    return max(1, round(setting.tokens_per_param * scale.count(setting.count) / tokens_per_step))


def weight_decay_value(setting: WeightDecaySetting, lr: float, steps: int) -> float:
    """Wang & Aitchison 2024: AdamW's weights are an EMA of updates with timescale tau_iter = 1/(lr wd)
    iterations; the optimum keeps tau a fixed fraction of the run, hence wd = 1/(lr x fraction x steps)."""
    if setting.rule == "fixed":
        return setting.value
    return 1.0 / (lr * setting.timescale_fraction * steps)


def tuned_path(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / TUNE_DIR / TUNED_FILE


def with_tuned(rules: HyperparameterRules, sweep_dir: str | Path, spec_path: str = "SPEC") -> HyperparameterRules:
    """The rules with each `tuned` rule replaced by the power law `sweep tune` wrote to tuned.json."""
    tuned_names = [name for name in ("lr", "batch_size")
                   if getattr(rules, name) is not None and getattr(rules, name).rule == "tuned"]
    if not tuned_names:
        return rules
    path = tuned_path(sweep_dir)
    if not path.is_file():
        raise ConfigError(f"hyperparameters.{tuned_names[0]} has rule `tuned`, but {path} does not exist; run "
                          f"`scaletrain sweep tune {spec_path}` first")
    tuned = json.loads(path.read_text())
    changes = {}
    for name in tuned_names:
        if name not in tuned:
            raise ConfigError(f"{path} holds no `{name}` fit (it has {sorted(tuned)}); add "
                              f"{'batch_multipliers' if name == 'batch_size' else 'lr_multipliers'} to the spec's "
                              f"`tune:` section and re-run `scaletrain sweep tune {spec_path}`")
        changes[name] = dataclasses.replace(getattr(rules, name), **tuned_power_law(tuned[name]),
                                            **({"unit": "sequences"} if name == "batch_size" else {}))
    return dataclasses.replace(rules, **changes)


def rules_to_show(rules: HyperparameterRules, sweep_dir: str | Path,
                  spec_path: str = "SPEC") -> tuple[HyperparameterRules, str | None]:
    """What a plan that trains nothing (`sweep plan`, `sweep tune --plan`) shows: the tuned rules, or before
    `sweep tune` has written tuned.json each `tuned` rule's prior (as_prior: the tuning grid's centre), with
    the warning that says so. Training never plans with a prior: with_tuned refuses there."""
    tuned = [name for name in ("lr", "batch_size") if getattr(rules, name) is not None
             and getattr(rules, name).rule == "tuned"]
    if not tuned or tuned_path(sweep_dir).is_file():
        return with_tuned(rules, sweep_dir, spec_path), None
    return as_prior(rules), (
        f"{tuned_path(sweep_dir)} does not exist yet: the values of {' and '.join(tuned)} shown follow the "
        f"`tuned` rule's prior (its value, reference_params, exponent: the tuning grid's centre), not a fit; "
        f"`scaletrain sweep tune {spec_path}` fits the rule, and `sweep run` refuses to train until it has")


def tuned_power_law(law: dict) -> dict:
    """A `power` rule's constants from one law of tuned.json. A law fitted at one horizon (and every
    tuned.json written before horizons existed) has no tokens exponent: it is the law in N alone."""
    in_tokens = law.get("tokens_exponent") is not None
    return {"rule": "power", "value": law["value"], "reference_params": law["reference_params"],
            "exponent": law["exponent"], "count": law.get("count", "total"),
            "reference_tokens": law["reference_tokens"] if in_tokens else 1.0,
            "tokens_exponent": law["tokens_exponent"] if in_tokens else 0.0}


def as_prior(rules: HyperparameterRules) -> HyperparameterRules:
    """The rules with each `tuned` rule read as the power law of its own constants: the grid centre that
    `sweep tune` searches around; it needs a `value`."""
    changes = {}
    for name in ("lr", "batch_size"):
        setting = getattr(rules, name)
        if setting is not None and setting.rule == "tuned":
            if setting.value is None:
                raise ConfigError(f"hyperparameters.{name} (rule tuned) needs `value` (with reference_params and "
                                  "exponent) as the centre of the tuning grid, e.g. value: 3.0e-3")
            changes[name] = dataclasses.replace(setting, rule="power")
    return dataclasses.replace(rules, **changes)



@dataclass(frozen=True)
class RunHyperparameters:
    """One run's resolved values, as plan.json and the plan's table show them."""

    lr: float
    min_lr: float
    batch_size: int  # global batch, sequences
    beta2: float
    warmup_steps: int
    weight_decay: float

    def to_row(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def resolve_after_batch(
    rules: HyperparameterRules, lr_setting: LearningRateSetting, scale: RunScale, batch_size: int, seq_length: int,
    steps: int, defaults: tuple[float, float], legacy_warmup_steps: int,
) -> RunHyperparameters:
    """LR, beta2, warmup and weight decay of a run whose batch and steps are known; `defaults` are the base
    config's (beta2, weight_decay), kept where no rule is set, and `legacy_warmup_steps` the `warmup:`
    section's value, kept where hyperparameters.warmup is not set."""
    lr = size_rule_value(lr_setting, scale)
    tokens_per_step = batch_size * seq_length
    beta2 = defaults[0] if rules.beta2 is None else beta2_value(rules.beta2, tokens_per_step)
    warmup = legacy_warmup_steps if rules.warmup is None else warmup_steps_value(rules.warmup, scale, tokens_per_step)
    decay = defaults[1] if rules.weight_decay is None else weight_decay_value(rules.weight_decay, lr, steps)
    return RunHyperparameters(lr=lr, min_lr=lr * lr_setting.min_lr_ratio, batch_size=batch_size, beta2=beta2,
                              warmup_steps=warmup, weight_decay=decay)
