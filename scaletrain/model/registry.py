"""Model families by name: one line per family, the module that defines its `FAMILY` spec.

Modules are imported on first use, so a command that touches one family imports only that one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.model.family import ModelFamily

FAMILY_MODULES = {
    "gpt": "scaletrain.model.gpt",
    "bert": "scaletrain.model.bert",
    "t5": "scaletrain.model.t5",
    "llama": "scaletrain.model.llama",
}


def get_family(name: str) -> ModelFamily:
    """The spec of family `name`; an unknown name is a ValueError listing the known ones."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"model family {name!r} is not known; use one of {', '.join(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY
