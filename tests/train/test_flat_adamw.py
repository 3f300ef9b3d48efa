"""FlatAdamW (train/flat_adamw.py): the optimizer step of layouts without ZeRO or pipeline stages.

It must step exactly as torch's AdamW with clip_grad_norm_ does over the same gradients, accumulate
bf16 micro-batch gradients in fp32, and cost the same number of operators whatever the number of
parameter tensors, with no per-tensor host reads (issue 36: DeepSpeed's bf16 wrapper it replaces
converted, clipped and copied one tensor at a time).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.train.flat_adamw import FlatAdamW
from tests.distributed.harness import run_on_ranks

BETAS, EPS, LR, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 1e-2, 0.1


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def flat_adamw(model: nn.Module, max_grad_norm: float, dtype: torch.dtype = torch.float32) -> FlatAdamW:
    return FlatAdamW(list(model.parameters()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                     max_grad_norm=max_grad_norm, working_dtype=dtype, is_tensor_parallel=lambda _: False,
                     tensor_parallel_group=None, data_parallel_group=None)


def reference_adamw(model: nn.Module) -> torch.optim.AdamW:
    """What scaletrain stepped before: decay on matrices only (engine.build_optimizer), per-tensor tensors."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)


def micro_batch_loss(model: nn.Module, step: int, micro: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    inputs = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + micro)).to(dtype)
    return model(inputs).float().pow(2).mean() * 50  # large enough gradients that clipping acts


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_steps_as_torch_adamw_with_clip_grad_norm_over_accumulated_micro_batches(max_grad_norm: float):
    flat_model, reference_model = small_model(), small_model()
    optimizer, reference = flat_adamw(flat_model, max_grad_norm), reference_adamw(reference_model)
    norms = []
    for step in range(4):
        for micro in range(2):
            micro_batch_loss(flat_model, step, micro).div(2).backward()
            micro_batch_loss(reference_model, step, micro).div(2).backward()
        if max_grad_norm:
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference_model.parameters(), max_grad_norm)))
        reference.step()
        reference.zero_grad()
        optimizer.step()
        if max_grad_norm:
            assert float(optimizer._global_grad_norm) == pytest.approx(norms[-1], rel=1e-5)
    assert not max_grad_norm or max(norms) > max_grad_norm  # clipping acted
    for (name, flat), reference_parameter in zip(flat_model.named_parameters(), reference_model.parameters(),
                                                 strict=True):
        torch.testing.assert_close(flat, reference_parameter, rtol=1e-5, atol=1e-6, msg=name)
        assert flat.grad is None  # the flat buffer holds the gradients, not .grad


def test_bf16_weights_follow_fp32_masters_and_micro_batches_accumulate_in_fp32():
    model = small_model().to(torch.bfloat16)
    optimizer = flat_adamw(model, max_grad_norm=0.0, dtype=torch.bfloat16)
    expected = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in model.named_parameters()}
    probe = copy.deepcopy(model)
    for micro in range(3):
        micro_batch_loss(model, 0, micro, torch.bfloat16).backward()
        micro_batch_loss(probe, 0, micro, torch.bfloat16).backward()
        for name, p in probe.named_parameters():
            expected[name] += p.grad.float()  # the sum of the bf16 micro-batch gradients, in fp32
            p.grad = None
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(optimizer.gradient_of(p), expected[name], rtol=0, atol=0, msg=name)
    optimizer.step()
    for name, p in model.named_parameters():
        master = optimizer.parameter_state(p)["weight"]
        assert master.dtype == torch.float32
        assert torch.equal(p, master.to(torch.bfloat16)), name  # the forward pass uses the rounded master
    assert float(optimizer.gradients.abs().max()) == 0.0  # cleared for the next step


def test_slices_are_aligned_views_of_one_buffer_and_state_views_write_through():
    model = small_model()
    optimizer = flat_adamw(model, max_grad_norm=1.0)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1
    for p in model.parameters():
        assert (p.data_ptr() - optimizer._working.data_ptr()) // p.element_size() % 64 == 0
    weight = model[0].weight
    state = optimizer.parameter_state(weight)
    state["exp_avg"].fill_(0.5)
    assert float(optimizer.parameter_state(weight)["exp_avg"].min()) == 0.5


# --- the optimizer step's operators, through the engine the training loop builds ---


def _profiled_optimizer_step(rank: int, world_size: int, num_layers: int, precision: str) -> dict[str, Any]:
    from scaletrain.parallel.groups import init_distributed
    from scaletrain.parallel.layout import resolve_for_world
    from scaletrain.train.engine import build_engine
    from scaletrain.train.nonfinite import NonFiniteGuard
    from scaletrain.train.parallelize import build_training_model

    config = config_from_dict({
        "model": {"num_layers": num_layers, "hidden_size": 32, "num_heads": 4, "seq_length": 16},
        "data": {"vocab_size": 512, "num_sentinels": 4},
        "parallel": {"zero_stage": 0},
        "train": {"micro_batch_size": 2, "precision": precision, "grad_clip": 1.0, "seed": 3},
    })
    validate(config)
    config = resolve_for_world(config, world_size)
    topology = init_distributed(config)
    engine = build_engine(build_training_model(config, topology), config, topology)
    guard = NonFiniteGuard(engine, topology.device)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    counts: list[Counter[str]] = []
    for _ in range(2):  # the second step is the steady state: Adam's state exists
        guard.start_step()
        engine.backward(guard.watch_loss(engine(tokens, tokens.roll(-1, dims=1))))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            engine.step()
        counts.append(Counter(event.name for event in profile.events() if event.name.startswith("aten::")))
    return {"optimizer": type(engine.optimizer).__name__, "tensors": sum(1 for _ in engine.module.parameters()),
            "segments": len(engine.optimizer.param_groups), "operators": counts[-1]}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_optimizer_step_dispatches_as_many_operators_for_8_layers_as_for_2(precision: str):
    """Per step: a fixed set of operators (norms, clip, fused AdamW per segment, the copy back) for 2 and 8
    layers alike; DeepSpeed's per-tensor clip alone added a norm per parameter tensor. Host reads: one
    (the non-finite guard's agreement over ranks), plus one per segment that torch's fused AdamW makes
    on CPU only (its CPU kernel reads each tensor's step count; on CUDA the count stays on the device)."""
    two, eight = (run_on_ranks(_profiled_optimizer_step, 1, layers, precision)[0] for layers in (2, 8))
    assert two["optimizer"] == eight["optimizer"] == "FlatAdamW"
    assert eight["tensors"] > two["tensors"] + 20
    assert sum(two["operators"].values()) == sum(eight["operators"].values()), (
        f"{precision}: {sum(two['operators'].values())} operators at 2 layers, {sum(eight['operators'].values())} "
        f"at 8: {eight['operators'] - two['operators']} more")
    host_reads = eight["operators"]["aten::_local_scalar_dense"]
    assert host_reads == two["operators"]["aten::_local_scalar_dense"]
    assert host_reads <= 1 + eight["segments"], f"{host_reads} host reads in one optimizer step"


def test_a_parameter_without_gradient_this_step_reads_zero_not_the_last_steps():
    """The first gradient of a step is copied over its slice instead of the buffer being zeroed between steps
    (module docstring); a parameter that no gradient reaches in a step must still read zero then."""
    model = small_model()
    optimizer = flat_adamw(model, max_grad_norm=1.0)
    micro_batch_loss(model, 0, 0).backward()
    optimizer.step()
    last_layer = model[3]
    hidden = model[2](model[1](model[0](torch.randn(5, 6))))
    (hidden.pow(2).mean() * 50).backward()  # no gradient reaches the last layer
    optimizer.gradients  # noqa: B018 (what the guard and step read: it zeroes the slices no gradient reached)
    for parameter in model.parameters():
        expected_zero = parameter is last_layer.weight or parameter is last_layer.bias
        assert bool(optimizer.gradient_of(parameter).eq(0).all()) == expected_zero
