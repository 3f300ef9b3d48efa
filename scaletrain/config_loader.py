"""Loading a run config: config.py's schema and rules, with every package's own section and rules.

config.py sits below every package and imports none of them, so it does not know which model
families exist, how many ids the tokenizer reserves, what DeepSpeed's pipeline engine allows or what
a `pipe:` location must hold. Each of those facts lives in its package, which imports config:
  families/__init__.py    each family's typed `model:` section (MODEL_SECTIONS) and the family's rules
  parallel/layout_rules.py   pipeline stages vs ZeRO, depth and partition; sequence parallelism
  data/tokenizer.py    the reserved ids a vocabulary must leave room beyond
  data/storage.py      the `pipe:` location syntax
This module sits above them all: it hands the families' sections to config's reader and runs every
package's rules after config's own, so a bad config is still refused at load time, with one message,
before anything is written. Everything that loads a run config goes through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.config import Config, parse_config, read_config, validate_keys, warn_if_warmup_cut
from scaletrain.families import MODEL_SECTIONS, validate_for_family
from scaletrain.parallel.layout_rules import validate_layout


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, to_train: bool = True) -> Config:
    """Read a YAML config (following `base:` includes), apply `a.b=value` overrides, validate.

    An error about a key names where its value came from: the override that set it, else the file.
    to_train=False for a run's saved config read to use its checkpoints (generate, export, eval): the
    warning about a warmup cut to fit the run was the training command's to give, not theirs.
    """
    config = read_config(path, overrides, MODEL_SECTIONS)
    validate(config)
    if to_train:
        warn_if_warmup_cut(config.train)
    return config


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    """A Config from a mapping as YAML would hold it, with its family's model section; not validated."""
    return parse_config(raw, MODEL_SECTIONS, source)


def validate(config: Config) -> None:
    """Every rule, config's own first: the rules after it may rely on its ranges (sizes >= 1)."""
    # Imported here, not at the top: sentencepiece and webdataset are slow to import, and
    # `scaletrain --help` and the planner, which import this module, need neither.
    from scaletrain.data.storage import validate_locations
    from scaletrain.data.tokenizer import validate_vocab_size

    validate_keys(config)
    validate_for_family(config)
    validate_layout(config)
    validate_vocab_size(config.data)
    validate_locations(config.data)
