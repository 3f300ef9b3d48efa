"""Full (unsharded) model weights from a layout-free checkpoint, for generation and export: each file
checked against its CRC-32 as it is read, and the merged weights checked finite (integrity.py). No
model is built to merge them: the checkpoint's index says each weight's full shape and split."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import read_meta
from scaletrain.checkpoint.integrity import check_finite
from scaletrain.checkpoint.layout_free import full_weights
from scaletrain.checkpoint.safe_load import CheckedFiles
from scaletrain.parallel.sharding import is_tensor_parallel, split_for_rank


def consolidated_state_dict(checkpoint_dir: Path, expected: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 weight by model name (the state dict of a TP=1 model); with
    `expected`, a model whose parameters must all be there."""
    meta = read_meta(checkpoint_dir)
    merged = dict(full_weights(checkpoint_dir, CheckedFiles(checkpoint_dir, meta.files)))
    if expected is not None:
        missing = [name for name, _ in expected.named_parameters() if name not in merged]
        if missing:
            raise CheckpointError(f"checkpoint {checkpoint_dir} has no weight {missing[0]}; it holds a different model")
    check_finite(checkpoint_dir, [(f"weight {name}", weight) for name, weight in merged.items()])
    return merged


def load_full_state_dict(
    model: nn.Module, full_state: dict[str, torch.Tensor], tensor_rank: int, tensor_size: int
) -> None:
    """Load a TP=1 state dict (an import, or another run's consolidated weights) into this rank's shards."""
    missing = [name for name, _ in model.named_parameters() if name not in full_state]
    if missing:
        raise CheckpointError(f"the weights lack {len(missing)} of the model's parameters, e.g. {missing[0]}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = full_state[name]
            if is_tensor_parallel(param) and tensor_size > 1:
                full = split_for_rank(full, param.partition_dim, param.partition_stride, tensor_rank, tensor_size)
            if full.shape != param.shape:
                raise CheckpointError(f"weight {name} has shape {tuple(full.shape)}, the model {tuple(param.shape)}")
            param.copy_(full)
