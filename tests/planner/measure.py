"""Measurements of the real model and DeepSpeed engine (CPU, fp32, gloo) for the planner's tests.

Each run builds the real GPT and `train/engine.py`'s DeepSpeed engine, takes one training step
and counts bytes: parameters, gradients after backward, optimizer-owned tensors after the step
(Adam moments, step counters and DeepSpeed's fp32 master partitions), and the activations saved
for backward during the forward pass (via saved-tensor hooks, deduplicated by storage,
parameters excluded). Workers run under tests.distributed.harness.run_on_ranks.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from megatron.core import parallel_state
from torch import nn

from scaletrain.config import Config
from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model, get_family
from scaletrain.parallel.groups import init_distributed
from scaletrain.parallel.layout import resolve_for_world
from scaletrain.train.engine import build_engine
from scaletrain.train.parallelize import build_training_model

MICRO_BATCH = 3

# Odd sizes (hidden 50, 5 heads) so DeepSpeed's ZeRO padding of the vector group shows at DP=2.
ZERO_MODEL = {"num_layers": 1, "hidden_size": 50, "num_heads": 5, "seq_length": 16}
ACTIVATION_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 32}
PIPELINE_MODEL = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 16}
DATA = {"vocab_size": 600, "num_sentinels": 4}  # padded to 640 rows
# Parameter-count configs: padded vocabularies (600 -> 640, 500 -> 512) and an explicit FFN size.
PARAMETER_CONFIGS = {
    "tiny": {"model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 16},
             "data": DATA},
    "odd_ffn": {"model": {"num_layers": 3, "hidden_size": 48, "num_heads": 6, "seq_length": 24,
                          "ffn_hidden_size": 100, "vocab_divisible_by": 64},
                "data": {"vocab_size": 500, "num_sentinels": 4}},
}

# case -> (model, parallel, train) overrides, per world size
SINGLE_RANK_CASES = {
    "zero0": (ZERO_MODEL, {"zero_stage": 0}, {}),
    "zero1": (ZERO_MODEL, {"zero_stage": 1}, {}),
    "flash": (ACTIVATION_MODEL, {}, {}),
    "math": ({**ACTIVATION_MODEL, "dropout": 0.1}, {}, {}),
    "recompute": (ACTIVATION_MODEL, {}, {"activation_checkpoint_interval": 1}),
    "selective": ({**ACTIVATION_MODEL, "dropout": 0.1}, {}, {"activation_checkpoint": "selective"}),
    "documents_selective": ({**ACTIVATION_MODEL, "document_masking": True}, {}, {"activation_checkpoint": "selective"}),
    "documents": ({**ACTIVATION_MODEL, "document_masking": True}, {}, {}),
    "window": ({**ACTIVATION_MODEL, "sliding_window": 8}, {}, {}),
}
TWO_RANK_CASES = {
    "dp2_zero1": (ZERO_MODEL, {"zero_stage": 1}, {}),
    "dp2_zero2": (ZERO_MODEL, {"zero_stage": 2}, {}),
    "tp2": (ACTIVATION_MODEL, {"tensor": 2}, {}),
}


def case_config(model: dict, parallel: dict, train: dict, world_size: int = 1) -> Config:
    config = config_from_dict({
        "model": model,
        "data": DATA,
        "parallel": parallel,
        "train": {"micro_batch_size": MICRO_BATCH, "precision": "fp32", "seed": 3, **train},
    })
    validate(config)
    return resolve_for_world(config, world_size)


def measure_single_rank(rank: int, world_size: int) -> dict[str, Any]:
    results = {name: _measure_case(case_config(*case), world_size) for name, case in SINGLE_RANK_CASES.items()}
    results["parameters"] = {name: _parameter_count(_build_plain(raw)) for name, raw in PARAMETER_CONFIGS.items()}
    return results


def measure_two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # the harness started torch.distributed already
    results = {name: _measure_case(case_config(*case, world_size), world_size) for name, case in TWO_RANK_CASES.items()}
    try:
        results["pp2"] = _pipeline_stage_parameters(world_size)
    except Exception:  # reported by the pipeline test only, so the other cases still run
        results["pp2"] = {"error": traceback.format_exc()}
    return results


def _measure_case(config: Config, world_size: int) -> dict[str, int]:
    _reset_model_parallel()
    topology = init_distributed(config)  # megatron's groups first: the layers capture them when built
    engine = build_engine(build_training_model(config, topology), config, topology)
    tokens = torch.randint(0, config.data.vocab_size, (MICRO_BATCH, config.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    # three documents per sequence when the model masks by them
    documents = {"document_ids": torch.arange(config.model.seq_length).expand_as(tokens) * 3 // config.model.seq_length}
    with _SavedActivations(engine.module) as activations:
        loss = engine(tokens, torch.roll(tokens, -1, dims=1),
                      **(documents if getattr(config.model, "document_masking", False) else {}))
    engine.backward(loss)
    gradients = sum(_nbytes(p.grad) for p in engine.module.parameters() if p.grad is not None)
    padding = getattr(engine.optimizer, "padding", 0)  # FlatAdamW's alignment: not in the planner's model
    if hasattr(engine.optimizer, "gradients"):  # FlatAdamW accumulates them in its own flat fp32 buffer
        gradients = _nbytes(engine.optimizer.gradients) - 4 * padding
    engine.step()
    return {
        "weights": sum(_nbytes(p) for p in engine.module.parameters()),
        "gradients_after_backward": gradients,
        # both moments, and the fp32 master where it is not the working weights, are padded alike
        "optimizer": _optimizer_bytes(engine) - 4 * padding * (2 + (engine.optimizer.param_groups[0]["params"][0].dtype
                                                                     != next(engine.module.parameters()).dtype)),
        "activations": activations.total,
    }


def _optimizer_bytes(engine: Any) -> int:
    """Optimizer state tensors, plus optimizer parameters that are not the model's (fp32 master copies)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the torch optimizer
    model_storages = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    owned = {}
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                owned[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    for group in inner.param_groups:
        for param in group["params"]:
            if param.untyped_storage().data_ptr() not in model_storages:
                owned[param.untyped_storage().data_ptr()] = param.untyped_storage().nbytes()
    return sum(owned.values())


class _SavedActivations:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded."""

    def __init__(self, module: nn.Module) -> None:
        self._parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> _SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _pipeline_stage_parameters(world_size: int) -> dict[str, int]:
    from scaletrain.model.pipeline import build_pipeline

    config = case_config(PIPELINE_MODEL, {"pipeline": 2, "pipeline_partition": "blocks"}, {}, world_size)
    _reset_model_parallel()
    topology = init_distributed(config)
    model = build_pipeline(config, topology, get_family(config.model.family))
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(),
            "parameters": sum(p.numel() for p in model.parameters())}


def _build_plain(raw: dict) -> nn.Module:
    config = config_from_dict(raw)
    validate(config)
    _reset_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return build_model(config)


def _parameter_count(model: nn.Module) -> dict[str, int]:
    params = list(model.parameters())
    return {
        "total": sum(p.numel() for p in params),
        "matrices": sum(p.numel() for p in params if p.dim() >= 2),
        "vectors": sum(p.numel() for p in params if p.dim() < 2),
        "tensors": len(params),
    }


def _reset_model_parallel() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
