"""Full (unsharded) model weights from a sharded DeepSpeed checkpoint, for generation and export: each
file checked against its CRC-32 as it is read, and the merged weights checked finite (integrity.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from scaletrain.checkpoint.integrity import check_finite
from scaletrain.checkpoint.manager import DEEPSPEED_TAG, CheckpointError, read_meta
from scaletrain.checkpoint.safe_load import CheckedFiles
from scaletrain.parallel.sharding import is_tensor_parallel, merge_shards, split_for_rank


def consolidated_state_dict(checkpoint_dir: Path, reference: nn.Module) -> dict[str, torch.Tensor]:
    """Merge every tensor-parallel rank's weights into the state dict of a TP=1 `reference` model."""
    meta = read_meta(checkpoint_dir)
    tensor_parallel_size = meta.layout["tensor"]
    checked = CheckedFiles(checkpoint_dir, meta.files)
    if meta.layout["pipeline"] > 1:
        per_rank = [_pipeline_rank_weights(checked, rank) for rank in range(tensor_parallel_size)]
    else:
        per_rank = [_rank_weights(checked, rank, meta.layout["zero_stage"]) for rank in range(tensor_parallel_size)]
    merged = {}
    for name, param in reference.named_parameters():
        if name not in per_rank[0]:
            raise CheckpointError(f"checkpoint {checkpoint_dir} has no weight {name}; it holds a different model")
        shards = [weights[name] for weights in per_rank]
        if is_tensor_parallel(param) and tensor_parallel_size > 1:
            merged[name] = merge_shards(shards, param.partition_dim, param.partition_stride)
        else:
            merged[name] = shards[0]
    check_finite(checkpoint_dir, [(f"weight {name}", weight) for name, weight in merged.items()])
    return merged


def _rank_weights(checked: CheckedFiles, tensor_rank: int, zero_stage: int) -> dict[str, torch.Tensor]:
    if zero_stage < 3:
        path = checked.checkpoint / DEEPSPEED_TAG / f"mp_rank_{tensor_rank:02d}_model_states.pt"
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete")
        return _float_tensors(checked.load(path)["module"])
    return _zero3_rank_weights(checked, tensor_rank)


def _pipeline_rank_weights(checked: CheckedFiles, tensor_rank: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's pipeline engine saves one file per layer and tensor rank,
    layer_XX-model_YY-model_states.pt; our pipeline layers keep the model's parameter names
    (parallel/pipeline.py), so the files merge by name."""
    state_dir = checked.checkpoint / DEEPSPEED_TAG
    weights = {}
    for path in sorted(state_dir.glob(f"layer_*-model_{tensor_rank:02d}-model_states.pt")):
        weights.update(_float_tensors(checked.load(path)))
    if not weights:
        raise CheckpointError(f"checkpoint {state_dir} has no pipeline layer files for tensor rank {tensor_rank}")
    return weights


def _zero3_rank_weights(checked: CheckedFiles, tensor_rank: int) -> dict[str, torch.Tensor]:
    """ZeRO-3 keeps fp32 weights only as flat partitions; DeepSpeed's zero_to_fp32 reassembles
    them but reads tensor rank 0's files, so present each rank's files to it under that name."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state_dir = checked.checkpoint / DEEPSPEED_TAG
    suffix = f"mp_rank_{tensor_rank:02d}"
    files = sorted(state_dir.glob(f"*{suffix}_*.pt"))
    if not files:
        raise CheckpointError(f"checkpoint {state_dir} has no ZeRO-3 files for tensor rank {tensor_rank}")
    for file in files:  # DeepSpeed's reader unpickles anything: let the restricted one see (and check) them first
        checked.load(file)
    with tempfile.TemporaryDirectory() as staging:
        tag_dir = Path(staging) / DEEPSPEED_TAG
        tag_dir.mkdir()
        for file in files:
            (tag_dir / file.name.replace(suffix, "mp_rank_00")).symlink_to(file.resolve())
        state = get_fp32_state_dict_from_zero_checkpoint(staging, tag=DEEPSPEED_TAG)
    return _float_tensors(state)


def _float_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Weights as fp32; megatron's `_extra_state` entries (None) are dropped."""
    return {name: value.float() for name, value in state.items() if isinstance(value, torch.Tensor)}


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
