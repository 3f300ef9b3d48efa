"""Recomputation (train.activation_checkpoint): selective and full give none's loss and gradients in every
family and at TP=2, and keep less for backward: none > selective > full, by what the planner's activation
model says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from torch import nn

from scaletrain.config import ConfigError
from scaletrain.config_loader import config_from_dict, load_config, validate
from scaletrain.families import build_model
from scaletrain.planner.activations import ActivationSettings, Recompute, block_activations, selective_block_activations
from scaletrain.train.objective import build_objective
from scaletrain.train.step import model_inputs
from tests.distributed.harness import run_on_ranks
from tests.train.runs import REPO

MODES = ("none", "selective", "full")
DATA = {"vocab_size": 400, "num_sentinels": 4}
# dropout > 0: SDPA's math kernel on CPU (its s x s softmax kept), and recomputation must replay the masks
GPT = {"model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 16, "dropout": 0.1}, "data": DATA}
T5 = {"model": {"family": "t5", "num_layers": 2, "num_decoder_layers": 2, "hidden_size": 64, "num_heads": 4,
                "ffn_hidden_size": 128, "seq_length": 12},
      "objective": {"kind": "span_corruption"}, "data": DATA}
# every family that recomputes, on its own objective's batch (llama with grouped-query attention and rotary)
FAMILY_CONFIGS = {"gpt": "gpt_tiny", "llama": "llama_tiny", "bert": "bert_tiny", "albert": "albert_tiny",
                  "electra": "electra_tiny", "t5": "t5_tiny", "bart": "bart_tiny"}
TOLERANCE = 1e-6


def _config(raw: dict, mode: str, tensor_parallel: int = 1, **model: object):
    config = config_from_dict({**raw, "model": {**raw["model"], **model}, "parallel": {"tensor": tensor_parallel},
                               "train": {"seed": 3, "activation_checkpoint": mode}})
    validate(config)
    return config


def _family_config(family: str, data_dir: Path, mode: str):
    return load_config(REPO / "configs" / f"{FAMILY_CONFIGS[family]}.yaml", [
        f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", "data.loader_workers=0",
        "model.num_layers=2", "model.seq_length=32", "model.dropout=0.1", "train.micro_batch_size=2",
        f"train.activation_checkpoint={mode}",
    ])


def _gpt_batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(1))
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}


def _loss_and_grads(build, batch: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """(loss, gradients) by mode of the model `build(mode)` returns, from the same dropout masks."""
    results = {}
    for mode in MODES:
        model = build_model(build(mode)).train()
        torch.manual_seed(0)
        loss = model(**batch)
        loss.backward()
        results[mode] = (loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()})
    return results


def _every_family_and_tensor_parallel(rank: int, world_size: int, data_dir: Path) -> dict[str, dict]:
    """Every family at TP=1 (on the first rank), then gpt at TP=2, in one pair of processes."""
    results = {}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    if rank == 0:
        for family in FAMILY_CONFIGS:
            batch = next(iter(build_objective(_family_config(family, data_dir, "none")).train_loader(0, 1, 0)))
            results[family] = _loss_and_grads(lambda mode, family=family: _family_config(family, data_dir, mode),
                                              model_inputs(batch))
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    results["gpt_tp2"] = _loss_and_grads(lambda mode: _config(GPT, mode, 2), _gpt_batch())
    return results


@pytest.fixture(scope="module")
def recomputed(small_dataset: Path) -> list[dict[str, dict]]:
    return run_on_ranks(_every_family_and_tensor_parallel, 2, small_dataset)


@pytest.mark.parametrize("model", [*FAMILY_CONFIGS, "gpt_tp2"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_same_loss_and_gradients(recomputed, model: str, mode: str):
    for rank in recomputed:
        if model not in rank:
            continue  # the families ran on the first rank only
        baseline_loss, baseline_grads = rank[model]["none"]
        loss, grads = rank[model][mode]
        assert abs(loss.item() - baseline_loss.item()) <= TOLERANCE
        for name, grad in baseline_grads.items():
            difference = (grads[name] - grad).abs().max().item()
            assert difference <= TOLERANCE, f"{name} differs by {difference} with {mode} recomputation"


def _saved_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**batch)
    return sum(storages.values())


def _single_rank(rank: int, world_size: int) -> dict:
    """A one-block gpt's saved bytes by mode, with SDPA's math kernel (dropout) and its fused CPU kernel; the
    attention layers a selective T5 recomputes; what building an undecided auto says."""
    parallel_state.initialize_model_parallel()
    saved = {}
    for kernel, dropout in (("math", 0.1), ("flash", 0.0)):
        saved[kernel] = {mode: _saved_bytes(build_model(_config(GPT, mode, num_layers=1, dropout=dropout)).train(),
                                            _gpt_batch()) for mode in MODES}
    t5 = build_model(_config(T5, "selective"))
    try:
        build_model(_config(GPT, "auto"))
        undecided = ""
    except ConfigError as error:
        undecided = str(error)
    return {"saved": saved, "undecided": undecided,
            "marked": [name for name, module in t5.named_modules() if getattr(module, "recompute_core", False)]}


@pytest.fixture(scope="module")
def single_rank() -> dict:
    return run_on_ranks(_single_rank, 1)[0]


@pytest.fixture(scope="module")
def one_block_saved(single_rank: dict) -> dict[str, dict[str, int]]:
    return single_rank["saved"]


@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_selective_keeps_less_than_none_and_more_than_full(one_block_saved, kernel: str):
    saved = one_block_saved[kernel]
    assert saved["none"] > saved["selective"] > saved["full"]


@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_selective_frees_what_the_activation_model_says(one_block_saved, kernel: str):
    """The block's attention term (the math kernel's softmax, dropout mask and dropped probabilities; the fused
    kernel's logsumexp), byte for byte, in fp32 with the CPU's fp32 dropout masks."""
    config = _config(GPT, "selective", dropout=0.1 if kernel == "math" else 0.0)
    block = block_activations(config.model, 2, 1, ActivationSettings(4, 4, kernel))
    kept = selective_block_activations(config.model, 2, block, ActivationSettings(4, 4, kernel))
    saved = one_block_saved[kernel]
    assert saved["none"] - saved["selective"] == block.total - kept.total


def test_selective_marks_every_attention_core_of_an_encoder_decoder(single_rank: dict):
    """T5's encoder self-attention and its decoder's self- and cross-attention."""
    marked = single_rank["marked"]
    assert len(marked) == 2 + 2 * 2 and any(name.endswith("cross_attention") for name in marked)


def test_an_undecided_auto_is_not_built(single_rank: dict):
    assert "train.activation_checkpoint=auto is decided from the GPU's memory" in single_rank["undecided"]


@pytest.mark.parametrize(("train", "fragment"), [
    ({"activation_checkpoint": "none", "activation_checkpoint_interval": 2},
     "set train.activation_checkpoint_interval=0, or train.activation_checkpoint=full to recompute chunks of 2"),
    ({"activation_checkpoint": "selective", "activation_checkpoint_interval": 1},
     "the interval is the chunk size of full recomputation"),
    ({"activation_checkpoint": "some"}, "train.activation_checkpoint='some'; use none, selective, full or auto"),
    ({"activation_checkpoint": "full", "activation_checkpoint_interval": 3}, "must be in [0, model.num_layers=2]"),
])
def test_bad_combinations_are_refused_with_the_fix(train: dict, fragment: str):
    with pytest.raises(ConfigError) as error:
        validate(config_from_dict({**GPT, "train": train}))
    assert fragment in str(error.value)


@pytest.mark.parametrize(("train", "recompute", "interval"), [
    ({}, "none", 0),
    ({"activation_checkpoint_interval": 2}, "full", 2),  # a config from before the key: full
    ({"activation_checkpoint": "full"}, "full", 1),
    ({"activation_checkpoint": "selective"}, "selective", 0),
    ({"activation_checkpoint": "auto", "activation_checkpoint_interval": 2}, "auto", 0),  # 2 if auto picks full
])
def test_what_the_keys_mean(train: dict, recompute: str, interval: int):
    config = config_from_dict({**GPT, "train": train})
    validate(config)
    assert (config.train.recompute, config.train.full_recompute_interval) == (recompute, interval)


def test_recompute_values_keep_the_old_bool_meaning():
    """Layout.recompute was a bool: False is none and True full, in comparisons and hashes."""
    assert (Recompute.NONE, Recompute.FULL) == (False, True) and not Recompute.NONE and Recompute.SELECTIVE
    assert hash(Recompute.FULL) == hash(True)
