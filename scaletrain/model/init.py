"""Weight initialisation that depends on (seed, parameter name) only.

megatron-core's CPU initialisation builds each full master weight and keeps this rank's
slice. Giving every weight its own generator, seeded from its name, makes the master weight
independent of how many layers, ranks or stages were built before it: every tensor/pipeline
layout starts from the same model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def normal_init(std: float, seed: int, name: str) -> InitMethod:
    generator = torch.Generator().manual_seed(_stream_seed(seed, name))

    def init(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)

    return init


def residual_std(std: float, num_layers: int) -> float:
    """GPT-2 (Radford et al. 2019, sec. 2.3) scales residual-branch output weights by 1/sqrt(N),
    N = 2 residual additions per layer."""
    return std / math.sqrt(2.0 * num_layers)


def _stream_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
