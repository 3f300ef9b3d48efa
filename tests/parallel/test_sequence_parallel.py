"""Sequence parallelism computes what plain tensor parallelism computes (TP=2, gloo, CPU).

The same megatron-built stack (tests/parallel/megatron_stack.py) runs with
ModelParallelConfig(sequence_parallel=False) and True from identical weights: loss, every full
gradient and a few optimizer steps must agree, with plain torch Adam and under DeepSpeed ZeRO-0/1/2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from scaletrain.parallel.sequence_parallel import enable_cpu_sequence_parallel
from tests.distributed.harness import gather_full_parameters, run_on_ranks
from tests.parallel.megatron_stack import StackShape, batch, build_stack

SHAPE = StackShape()
STEPS = 3
RELATIVE = 1e-5


def _setup() -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    enable_cpu_sequence_parallel()


def _losses_and_gradients(rank: int, world_size: int) -> dict[str, Any]:
    """Per layout: first-step loss and full gradients, norm-region shapes, Adam-step losses."""
    _setup()
    results = {}
    for name, sequence_parallel, grad_hooks in (("tp", False, True), ("sp", True, True), ("sp_unsummed", True, False)):
        torch.manual_seed(0)
        model = build_stack(SHAPE, 2, sequence_parallel, grad_hooks)
        shapes = _record_norm_input_shapes(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, gradients = [], None
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = model(*batch(SHAPE, step))
            loss.backward()
            gradients = gradients or gather_full_parameters(model, lambda param: param.grad)
            losses.append(loss.item())
            optimizer.step()
        results[name] = {"losses": losses, "gradients": gradients, "shapes": shapes}
    return results


def _record_norm_input_shapes(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.Size]]:
    """(input, output) shapes of every LayerNorm and qkv linear in the first forward."""
    shapes = {}

    def record(name: str, inputs: tuple, output: Any) -> None:
        output = output[0] if isinstance(output, tuple) else output
        shapes.setdefault(name, (inputs[0].shape, output.shape))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or name.endswith("qkv"):
            module.register_forward_hook(lambda _, inputs, output, name=name: record(name, inputs, output))
    return shapes


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_on_ranks(_losses_and_gradients, 2)


def test_loss_and_every_full_gradient_match_tensor_parallel(runs):
    for rank in runs:
        tp, sp = rank["tp"], rank["sp"]
        assert sp["losses"][0] == pytest.approx(tp["losses"][0], rel=RELATIVE)
        assert sp["gradients"].keys() == tp["gradients"].keys()
        for name, grad in tp["gradients"].items():
            difference = (sp["gradients"][name] - grad).abs().max().item()
            assert difference <= RELATIVE * max(1.0, grad.abs().max().item()), (name, difference)


def test_optimizer_steps_keep_losses_equal(runs):
    for rank in runs:
        assert rank["sp"]["losses"] == pytest.approx(rank["tp"]["losses"], rel=RELATIVE)
        assert rank["sp"]["losses"][-1] < rank["sp"]["losses"][0]


def test_replicated_gradients_need_the_tensor_parallel_sum(runs):
    """Without the hooks a norm's gradient is one rank's share of tokens: the sum is what makes it right."""
    tp, unsummed = runs[0]["tp"]["gradients"], runs[0]["sp_unsummed"]["gradients"]
    assert not torch.allclose(unsummed["final_norm.weight"], tp["final_norm.weight"], atol=1e-3)
    assert torch.allclose(unsummed["word.weight"], tp["word.weight"], atol=1e-5)  # TP-sharded: complete


def test_norm_regions_hold_a_sequence_shard(runs):
    s, b, h, tp = SHAPE.seq_length, SHAPE.batch, SHAPE.hidden, 2
    for rank in runs:
        sp, plain = rank["sp"]["shapes"], rank["tp"]["shapes"]
        for name in ("blocks.0.attention_norm", "blocks.1.mlp_norm", "final_norm"):
            assert sp[name] == (torch.Size([s // tp, b, h]),) * 2, name
            assert plain[name] == (torch.Size([s, b, h]),) * 2, name
        # qkv: gathers the shard, returns the whole sequence for this rank's heads
        assert sp["blocks.0.qkv"] == (torch.Size([s // tp, b, h]), torch.Size([s, b, 3 * h // tp]))


def _deepspeed_losses(rank: int, world_size: int, zero_stage: int) -> dict[str, Any]:
    import deepspeed

    from scaletrain.parallel.mpu import MegatronMPU

    deepspeed.init_distributed(dist_backend="gloo")
    _setup()
    results = {}
    for name, sequence_parallel in (("tp", False), ("sp", True)):
        model = build_stack(SHAPE, 2, sequence_parallel)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mpu=MegatronMPU,
            config={"train_micro_batch_size_per_gpu": SHAPE.batch, "gradient_accumulation_steps": 1,
                    "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
                    "gradient_clipping": 1.0, "steps_per_print": 1 << 62},
        )
        losses = []
        for step in range(STEPS):
            loss = engine(*batch(SHAPE, step))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[name] = {"losses": losses, "weights": gather_full_parameters(engine.module)}
    dist.barrier()
    return results


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_deepspeed_zero_steps_match_tensor_parallel(zero_stage):
    """ZeRO-2 moves each gradient into its partition from a post-accumulate hook during backward:
    the SP sum must already have happened by then (gradient clipping also sees the summed norm).
    SGD, not Adam, so the weights can be compared: the key bias has an exactly zero gradient
    (softmax ignores a shift shared by all keys), whose rounding noise Adam would scale to lr."""
    for rank in run_on_ranks(_deepspeed_losses, 2, zero_stage):
        assert rank["sp"]["losses"] == pytest.approx(rank["tp"]["losses"], rel=RELATIVE)
        for name, weight in rank["tp"]["weights"].items():
            assert torch.allclose(rank["sp"]["weights"][name], weight, atol=1e-5), name
