"""Model families by name: one line per family, each a folder here whose `FAMILY` is its spec.

A family is one folder, `families/<name>/`: `model.py` (its typed `model:` section, validation, model
and counts), `hf.py` (its Hugging Face adapter) and `__init__.py` (the `ModelFamily` spec naming both;
model/family.py says what a spec holds). Families are built from the block kit in model/; adding one is
a folder, a line in FAMILIES and its configs (the pattern of torchtitan's `models/<name>/` and
`ModelSpec`).

A folder is imported on first use, so a command that touches one family imports only that one. The
registry is also how families reach config.py, which imports no family: MODEL_SECTIONS hands it each
family's typed `model:` section, and `validate_for_family` holds the rules that depend on which family
a config trains (config_loader.py runs both). `build_model` and `model_counts` are what the trainer,
planner and sweeps ask of the config's family.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from scaletrain.config import Config, ConfigError, ModelConfig, ModelSections

if TYPE_CHECKING:
    from torch import nn

    from scaletrain.model.counts import ModelCounts
    from scaletrain.model.family import ModelFamily

FAMILIES = ("gpt", "bert", "t5", "llama", "albert", "electra", "bart")  # folder names, in listing order


def get_family(name: str) -> ModelFamily:
    """The spec of family `name`; an unknown name is a ValueError listing the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not known; use one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{name}").FAMILY


def build_model(config: Config) -> nn.Module:
    """The config's family on this process's TP rank, recomputing as train.activation_checkpoint says; its
    forward takes the batch keys as keyword arguments."""
    from scaletrain.model.family import apply_recompute

    return apply_recompute(get_family(config.model.family).build(config), config.train)


def model_counts(config: Config) -> ModelCounts:
    """Parameters (TP=1 totals) and training FLOPs per token of the model `config` builds: the
    family's own `counts` (its spec; model/counts.py says what they mean)."""
    return get_family(config.model.family).counts(config)


class _ModelSections(Mapping[str, type[ModelConfig]]):
    """Each family's `model:` section class by family name, for config.read_config; a family's
    module is imported when its section is first asked for, not when a name is checked."""

    def __getitem__(self, name: str) -> type[ModelConfig]:
        if name not in FAMILIES:
            raise KeyError(name)
        return get_family(name).config_class

    def __contains__(self, name: object) -> bool:
        return name in FAMILIES

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


MODEL_SECTIONS: ModelSections = _ModelSections()


def objective_kind(config: Config) -> str:
    """The objective a run trains: objective.kind, or for `auto` its family's own (the first it lists)."""
    kind = config.objective.kind
    return get_family(config.model.family).objectives[0] if kind == "auto" else kind


def validate_for_family(config: Config) -> None:
    """The rules that depend on the config's family: its own keys (the spec's `validate`), the
    objectives it trains, pipelined or not, and whether its layers implement sequence and context parallelism."""
    family, name = get_family(config.model.family), config.model.family
    family.validate(config)
    objective, kind = config.objective, objective_kind(config)
    if objective.kind != "auto" and objective.kind not in family.objectives:
        raise ConfigError(
            f"objective.kind={objective.kind!r} does not train a {name}; use auto or {' / '.join(family.objectives)}"
        )
    if config.parallel.pipeline > 1 and kind not in family.pipeline_objectives:
        raise ConfigError(
            f"parallel.pipeline={config.parallel.pipeline}: pipeline stages are not available for {name} ({kind}); "
            "train it with tensor and data parallelism (parallel.pipeline=1)"
        )
    if config.parallel.context > 1 and not family.context_parallel:
        supported = [other for other in FAMILIES if get_family(other).context_parallel]
        raise ConfigError(
            f"parallel.context={config.parallel.context}: context parallelism is not available for {name} (it is "
            f"for {', '.join(supported)}); set parallel.context=1"
        )
    if config.parallel.sequence_parallel and not family.sequence_parallel:
        supported = [other for other in FAMILIES if get_family(other).sequence_parallel]
        raise ConfigError(
            f"parallel.sequence_parallel is not available for {name} yet (it is for "
            f"{', '.join(supported)}); set it to false"
        )
