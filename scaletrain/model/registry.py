"""Model families by name: one line per family, the module that defines its `FAMILY` spec.

Modules are imported on first use, so a command that touches one family imports only that one.
The registry is also how families reach config.py, which imports no family: MODEL_SECTIONS hands
it each family's typed `model:` section, and `validate_for_family` holds the rules that depend on
which family a config trains (config_loader.py runs both).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from scaletrain.config import Config, ConfigError, ModelConfig, ModelSections

if TYPE_CHECKING:
    from scaletrain.model.family import ModelFamily

FAMILY_MODULES = {
    "gpt": "scaletrain.model.gpt",
    "bert": "scaletrain.model.bert",
    "t5": "scaletrain.model.t5",
    "llama": "scaletrain.model.llama",
    "albert": "scaletrain.model.albert",
    "electra": "scaletrain.model.electra",
    "bart": "scaletrain.model.bart",
}


def get_family(name: str) -> ModelFamily:
    """The spec of family `name`; an unknown name is a ValueError listing the known ones."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"model family {name!r} is not known; use one of {', '.join(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY


class _ModelSections(Mapping[str, type[ModelConfig]]):
    """Each family's `model:` section class by family name, for config.read_config; a family's
    module is imported when its section is first asked for, not when a name is checked."""

    def __getitem__(self, name: str) -> type[ModelConfig]:
        if name not in FAMILY_MODULES:
            raise KeyError(name)
        return get_family(name).config_class

    def __contains__(self, name: object) -> bool:
        return name in FAMILY_MODULES

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILY_MODULES)

    def __len__(self) -> int:
        return len(FAMILY_MODULES)


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
    if objective.sentence_pairs != "none" and kind != "mlm":
        raise ConfigError("objective.sentence_pairs (NSP/SOP) goes with BERT's masked LM; set it to none")
    if objective.span_boundary and kind != "mlm":
        raise ConfigError("objective.span_boundary (SpanBERT's span boundary objective) goes with BERT's masked LM; "
                          "set it to false")
    if config.parallel.pipeline > 1 and kind not in family.pipeline_objectives:
        raise ConfigError(
            f"parallel.pipeline={config.parallel.pipeline}: pipeline stages are not available for {name} ({kind}); "
            "train it with tensor and data parallelism (parallel.pipeline=1)"
        )
    if config.parallel.context > 1 and not family.context_parallel:
        supported = [other for other in FAMILY_MODULES if get_family(other).context_parallel]
        raise ConfigError(
            f"parallel.context={config.parallel.context}: context parallelism is not available for {name} (it is "
            f"for {', '.join(supported)}); set parallel.context=1"
        )
    if config.parallel.sequence_parallel and not family.sequence_parallel:
        supported = [other for other in FAMILY_MODULES if get_family(other).sequence_parallel]
        raise ConfigError(
            f"parallel.sequence_parallel is not available for {name} yet (it is for "
            f"{', '.join(supported)}); set it to false"
        )
