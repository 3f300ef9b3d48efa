"""Model families built from one block kit (layers.py) on megatron-core tensor-parallel primitives.

`build_model(config)` asks the family registry (registry.py) for the config's family. Nothing is
imported here at package import, so reading the registry does not load torch or megatron.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from scaletrain.config import Config


def build_model(config: Config) -> nn.Module:
    """The config's family on this process's TP rank; its forward takes the batch keys as keyword arguments."""
    from scaletrain.model.registry import get_family

    return get_family(config.model.family).build(config)
