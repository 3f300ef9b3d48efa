"""The checkpoint's training state in a form that no parallel layout owns.

Under `model/` of a checkpoint:
    rank_00003.pt   the parts rank 3 wrote: for each, a parameter's model name, which tensor-parallel
                    piece it is part of, where in the flattened piece it starts, and its fp32 master
                    weight, exp_avg and exp_avg_sq there (flat)
    index.json      every parameter: full shape, tensor-parallel split (dim, stride, pieces) and the
                    parts (file, offset, length) that tile each piece; Adam's step count

Every parameter is named as in the plain, unpipelined model (model/pipeline.py keeps the names) at
its full shape over data parallelism and ZeRO; a tensor-parallel weight is kept as its TP pieces with
the partition attributes that merge them (parallel/sharding.py), so any layout reads any other's: TP,
PP, DP, ZeRO-0/1/2/3, fp32 and bf16 (the master weights are fp32 in both). This is the idea of
Megatron-Core's dist_checkpointing and torchtitan's DCP checkpoints (tensors by model name at full
shape), in a format of our own because a merged QKV or GLU weight (partition_stride > 1) is not a
contiguous block of the full tensor, which DCP's shard metadata needs.

Every rank writes its own share, with no collective: under ZeRO (and DeepSpeed's bf16 pipeline
optimizer) the part of each parameter's fp32 state its partition holds, as DeepSpeed's universal
checkpoint does; without, the data-parallel ranks holding the same whole parameters take turns by
parameter. Only tensor rank 0 writes a parameter that tensor parallelism does not split, and a
pipeline's tied copies are written by the first stage that holds them. Reading, each rank loads
the files that hold its parameters' parts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.integrity import check_finite
from scaletrain.checkpoint.optimizer_state import (
    STATE_KEYS,
    adam_step,
    is_partitioned,
    link_optimizer_state,
    prepare_optimizer_state,
    read_local_part,
    read_parameter_state,
    write_parameter_state,
)
from scaletrain.checkpoint.safe_load import CheckedFiles
from scaletrain.parallel.expert_parallel import is_expert_parameter
from scaletrain.parallel.groups import Topology
from scaletrain.parallel.sharding import is_tensor_parallel, merge_shards, split_for_rank

STATE_DIR = "model"
INDEX_FILE = f"{STATE_DIR}/index.json"
FORMAT_VERSION = 1


def rank_file(rank: int) -> str:
    return f"{STATE_DIR}/rank_{rank:05d}.pt"


@dataclass
class RankPieces:
    """What one rank holds to write: its pieces (tensors copied off the training state) and their index
    entries, and Adam's step count."""

    pieces: list[dict[str, Any]] = field(default_factory=list)
    adam_step: int = 0

    def manifest(self) -> list[dict[str, Any]]:
        return [{key: value for key, value in piece.items() if key != "tensors"} for piece in self.pieces]


def pipeline_to_model_name(name: str) -> str:
    """`3.blocks.2.mlp.fc.bias` or `tied_modules.embedding.embedding.word.weight` (a PipelineModule's
    names: layer index or tied key, then the layer's own names, which are the model's; see
    model/pipeline.py) as the plain model's name."""
    if name.startswith("tied_modules."):
        return name.removeprefix("tied_modules.").partition(".")[2]
    return name.partition(".")[2]


def local_parameters(module: nn.Module, topology: Topology) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters by model name (a pipeline stage's only; tied copies each), sorted."""
    named = ((name if topology.pipeline_parallel_size == 1 else pipeline_to_model_name(name), parameter)
             for name, parameter in module.named_parameters())
    return sorted(named, key=lambda item: item[0])


def _first_holders(names: list[str], topology: Topology) -> dict[str, int]:
    """For each name, the first pipeline stage that holds it (tied copies live on two)."""
    if topology.pipeline_parallel_size == 1:
        return dict.fromkeys(names, 0)
    per_rank: list[Any] = [None] * topology.world_size
    dist.all_gather_object(per_rank, (topology.pipeline_parallel_rank, names))
    holders: dict[str, int] = {}
    for stage, stage_names in per_rank:
        for name in stage_names:
            holders[name] = min(stage, holders.get(name, stage))
    return holders


def collect_pieces(engine: Any, topology: Topology) -> RankPieces:
    """This rank's share of the layout-free state, copied off the training state (so training may go
    on while it is written). Under ZeRO each rank takes its own part of every parameter (no
    collective); a parameter whole on every data-parallel (and context-parallel) rank is taken by one of
    them, in turns."""
    parameters = local_parameters(engine.module, topology)
    holders = _first_holders([name for name, _ in parameters], topology)
    collected = RankPieces(adam_step=adam_step(engine))
    link_optimizer_state(engine)
    # turns among the ranks holding the same whole parameters: every data- and context-parallel rank for
    # dense ones, the expert-data-parallel ranks for experts split by EP
    turns = {False: _Turns(topology.replica_size, topology.replica_rank),
             True: _Turns(topology.expert_data_parallel_size, topology.expert_data_parallel_rank)}
    for name, parameter in parameters:
        if holders[name] != topology.pipeline_parallel_rank:
            continue  # a tied copy: the first stage holding it writes it
        split = is_tensor_parallel(parameter) and topology.tensor_parallel_size > 1
        if not split and topology.tensor_parallel_rank != 0:
            continue  # the same on every tensor rank: tensor rank 0's data-parallel ranks write it
        if is_partitioned(parameter):
            part = read_local_part(parameter)
        else:
            if not turns[is_expert_parameter(parameter)].mine():
                continue
            part = 0, {key: tensor.reshape(-1) for key, tensor in read_parameter_state(engine, parameter).items()}
        if part is None or not part[1]["weight"].numel():
            continue
        start, tensors = part
        collected.pieces.append({
            "name": name, "piece": topology.tensor_parallel_rank if split else 0,
            "pieces": topology.tensor_parallel_size if split else 1,
            "dim": parameter.partition_dim if split else None, "stride": parameter.partition_stride if split else 1,
            "shape": list(getattr(parameter, "ds_shape", parameter.shape)), "start": start,
            "numel": tensors["weight"].numel(),
            "tensors": {key: tensors[key].detach().to("cpu", torch.float32, copy=True) for key in STATE_KEYS},
        })
    return collected


class _Turns:
    """Whose turn it is to write the next whole parameter, among `size` ranks holding it."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank, self.count = size, rank, 0

    def mine(self) -> bool:
        self.count += 1
        return (self.count - 1) % self.size == self.rank


def write_rank_file(collected: RankPieces, checkpoint: Path, rank: int, save: Any) -> None:
    """`save(state, path)` of this rank's pieces (a checksumming torch.save)."""
    save({"pieces": [{**meta, "tensors": piece["tensors"]} for meta, piece in zip(collected.manifest(),
                                                                                    collected.pieces, strict=True)]},
         checkpoint / rank_file(rank))


def build_index(manifests: list[list[dict[str, Any]]], steps: list[int]) -> dict[str, Any]:
    """index.json from every rank's manifest (rank order): per parameter its full shape, split, and for
    each tensor-parallel piece the parts (file, offset, length) that tile it."""
    parameters: dict[str, Any] = {}
    for rank, manifest in enumerate(manifests):
        for piece in manifest:
            shape = list(piece["shape"])
            if piece["dim"] is not None:
                shape[piece["dim"]] *= piece["pieces"]
            entry = parameters.setdefault(piece["name"], {
                "shape": shape, "piece_shape": piece["shape"], "dim": piece["dim"], "stride": piece["stride"],
                "pieces": [[] for _ in range(piece["pieces"])]})
            entry["pieces"][piece["piece"]].append(
                {"file": rank_file(rank), "start": piece["start"], "numel": piece["numel"]})
    for entry in parameters.values():
        for parts in entry["pieces"]:
            parts.sort(key=lambda part: part["start"])
    return {"format": FORMAT_VERSION, "adam_step": max(steps) if steps else 0, "parameters": parameters}


def load_into_engine(engine: Any, checkpoint: Path, files: CheckedFiles, topology: Topology) -> None:
    """Set every local parameter's master weight, working copy and Adam moments, and Adam's step, from
    the layout-free state of `checkpoint`, cut for this rank's layout and checked finite (locally: the
    caller agrees on a failure over all ranks). No collectives."""
    index = read_index(checkpoint)
    reader = _PieceReader(checkpoint, files)
    cut = {}
    for name, parameter in local_parameters(engine.module, topology):
        entry = index["parameters"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {checkpoint} has no state for {name}; it holds a different model")
        cut[name] = (parameter, _cut_for_rank(name, entry, parameter, reader, topology, checkpoint))
    # A checksum vouches for the bytes, not that they are weights to resume (integrity.py): nothing is
    # written into the engine before all of this rank's state is known finite.
    check_finite(checkpoint, [(f"weight {name}" if key == "weight" else f"Adam {key} of {name}", tensor)
                              for name, (_, state) in cut.items() for key, tensor in state.items()])
    prepare_optimizer_state(engine, int(index["adam_step"]))
    for parameter, state in cut.values():
        write_parameter_state(engine, parameter, state)


def load_weights(module: nn.Module, checkpoint: Path, files: CheckedFiles, topology: Topology) -> None:
    """Set every parameter of `module` (a whole model, or a pipeline stage: its parameters by the model's names) to
    its weight in `checkpoint`, cut for this rank's tensor-parallel layout and checked finite; no optimizer state:
    a model to evaluate in a layout of its own (evaluation/). A whole model must use every weight of the checkpoint
    (a stage holds some). No collectives: the caller agrees on a failure over all ranks."""
    index = read_index(checkpoint)
    reader = _PieceReader(checkpoint, files)
    parameters = dict(local_parameters(module, topology))
    extra = sorted(set(index["parameters"]) - set(parameters)) if topology.pipeline_parallel_size == 1 else []
    if extra:
        raise CheckpointError(f"checkpoint {checkpoint} has weights the model has not, e.g. {extra[0]}; it holds a "
                              "different model")
    cut = {}
    for name, parameter in parameters.items():
        entry = index["parameters"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {checkpoint} has no weight {name}; it holds a different model")
        weight = _cut_for_rank(name, entry, parameter, reader, topology, checkpoint, keys=("weight",))["weight"]
        cut[name] = (parameter, weight)
    check_finite(checkpoint, [(f"weight {name}", weight) for name, (_, weight) in cut.items()])
    with torch.no_grad():
        for parameter, weight in cut.values():
            parameter.copy_(weight)


def read_index(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {checkpoint}: {INDEX_FILE} could not be read ({error}); resume from "
                              "another checkpoint (train.resume=auto takes the one before)") from None
    if index.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {checkpoint}: {INDEX_FILE} has format {index.get('format')!r}, this "
                              f"scaletrain reads format {FORMAT_VERSION}")
    return index


def full_weights(checkpoint: Path, files: CheckedFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full fp32 weight) of every parameter, one at a time: for export and generation, which
    need no model to merge them (the index says how)."""
    reader = _PieceReader(checkpoint, files)
    for name, entry in read_index(checkpoint)["parameters"].items():
        yield name, _full_tensors(name, entry, reader, ("weight",), checkpoint)["weight"]


class _PieceReader:
    """Each rank file loaded once (checked against its CRC-32); a tensor-parallel piece assembled from
    the parts that tile it."""

    def __init__(self, checkpoint: Path, files: CheckedFiles) -> None:
        self.checkpoint, self.files = checkpoint, files
        self.loaded: dict[str, dict[tuple[str, int, int], dict[str, torch.Tensor]]] = {}

    def piece(self, name: str, entry: dict[str, Any], index: int,
              keys: tuple[str, ...] = STATE_KEYS) -> dict[str, torch.Tensor]:
        shape = entry["piece_shape"]
        numel = math.prod(shape)
        flat = {key: torch.empty(numel, dtype=torch.float32) for key in keys}
        covered = 0
        for part in entry["pieces"][index]:
            if part["start"] != covered:
                raise CheckpointError(f"checkpoint {self.checkpoint}: {INDEX_FILE} leaves elements {covered}-"
                                      f"{part['start']} of {name} (piece {index}) unwritten; the checkpoint is corrupt")
            tensors = self._part(part["file"], name, index, part["start"])
            for key in keys:
                flat[key][covered:covered + part["numel"]] = tensors[key].reshape(-1)
            covered += part["numel"]
        if covered != numel:
            raise CheckpointError(f"checkpoint {self.checkpoint}: {name} (piece {index}) has {covered} of its {numel} "
                                  "elements; the checkpoint is corrupt")
        return {key: tensor.view(shape) for key, tensor in flat.items()}

    def _part(self, file: str, name: str, index: int, start: int) -> dict[str, torch.Tensor]:
        if file not in self.loaded:
            content = self.files.load(self.checkpoint / file)
            self.loaded[file] = {(piece["name"], piece["piece"], piece["start"]): piece["tensors"]
                                 for piece in content["pieces"]}
        try:
            return self.loaded[file][(name, index, start)]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.checkpoint}: {file} lacks the part of {name} at {start} (piece "
                                  f"{index}), which {INDEX_FILE} places there; the checkpoint is corrupt") from None


def _full_tensors(
    name: str, entry: dict[str, Any], reader: _PieceReader, keys: tuple[str, ...], checkpoint: Path
) -> dict[str, torch.Tensor]:
    """`keys` of parameter `name` at full shape: each tensor-parallel piece assembled once, then merged."""
    pieces = [reader.piece(name, entry, index, keys) for index in range(len(entry["pieces"]))]
    merged = {}
    for key in keys:
        parts = [piece[key] for piece in pieces]
        full = parts[0] if entry["dim"] is None else merge_shards(parts, entry["dim"], entry["stride"])
        if list(full.shape) != entry["shape"]:
            raise CheckpointError(f"checkpoint {checkpoint}: {name} merges to shape {list(full.shape)}, "
                                  f"{INDEX_FILE} says {entry['shape']}; the checkpoint is corrupt")
        merged[key] = full
    return merged


def _cut_for_rank(
    name: str, entry: dict[str, Any], parameter: nn.Parameter, reader: _PieceReader, topology: Topology,
    checkpoint: Path, keys: tuple[str, ...] = STATE_KEYS,
) -> dict[str, torch.Tensor]:
    """This rank's tensor-parallel shard of `name`'s state (`keys` of it): its own piece when the checkpoint
    was cut the same way, else the merged full tensor split again."""
    split = is_tensor_parallel(parameter) and topology.tensor_parallel_size > 1
    shape = tuple(getattr(parameter, "ds_shape", parameter.shape))
    same_cut = (len(entry["pieces"]) == topology.tensor_parallel_size and split
                and (entry["dim"], entry["stride"]) == (parameter.partition_dim, parameter.partition_stride))
    source = (reader.piece(name, entry, topology.tensor_parallel_rank, keys) if same_cut
              else _full_tensors(name, entry, reader, keys, checkpoint))
    state = {}
    for key in keys:
        tensor = source[key]
        if split and not same_cut:
            tensor = split_for_rank(tensor, parameter.partition_dim, parameter.partition_stride,
                                    topology.tensor_parallel_rank, topology.tensor_parallel_size)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"checkpoint {checkpoint}: {name} has shape {tuple(tensor.shape)} for this rank, "
                                  f"the model {shape}; it holds a different model")
        state[key] = tensor
    return state
