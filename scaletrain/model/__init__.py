"""Model families built from one block kit (layers.py) on megatron-core tensor-parallel primitives.

`build_model(config)` asks the family registry (registry.py) for the config's family. The registry
imports a family's module when it is first asked for, so importing this package does not load
torch or megatron.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain.model.registry import get_family

if TYPE_CHECKING:
    from torch import nn

    from scaletrain.config import Config


def build_model(config: Config) -> nn.Module:
    """The config's family on this process's TP rank, recomputing as train.activation_checkpoint says; its
    forward takes the batch keys as keyword arguments."""
    from scaletrain.model.family import apply_recompute

    return apply_recompute(get_family(config.model.family).build(config), config.train)
