"""One contract test per private DeepSpeed or megatron-core internal that scaletrain/upstream.py uses.

Each fails, naming the internal and the versions it was checked on, when an upgrade removes it,
changes the call we rely on, or stops calling it (a patch that is never called fails silently: a
grad_norm that vanishes, a NaN step that is applied). The engines are real DeepSpeed engines, tiny,
on a gloo world of one: one forked process builds them all once for the module (`observed`) and
each test reads what its contract saw there.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import utils
from megatron.core.tensor_parallel import layers, mappings

from scaletrain import upstream
from scaletrain.upstream import CHECKED_ON, MODULES_ALLOCATING_ON_CURRENT_DEVICE
from tests.distributed.harness import run_on_ranks

ZERO_STAGES = (0, 1, 3)
# checkpoint/optimizer_state.py through each optimizer DeepSpeed wraps ours in: (ZeRO stage, bf16)
STATE_KINDS = {"fp32_zero0": (0, False), "fp32_zero1": (1, False), "fp32_zero3": (3, False),
               "bf16_zero1": (1, True)}
MICRO_BATCHES = 2  # per pipeline step
BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1 << 62,
}


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    return run_on_ranks(_observe, 1)[0]


def _observe(rank: int, world_size: int) -> dict[str, Any]:
    """What each contract saw, by name; a probe that raised (an UpstreamChanged...) leaves its message."""
    probes: dict[str, Callable[[], Any]] = {
        **{f"zero{stage}": (lambda stage=stage: _plain_engine(stage)) for stage in ZERO_STAGES},
        "pipeline": _pipeline_engine,
        "megatron_buffers": _megatron_buffers,
        **{f"state_{kind}": (lambda kind=kind: _optimizer_state(*STATE_KINDS[kind])) for kind in STATE_KINDS},
    }
    observations: dict[str, Any] = {}
    for name, probe in probes.items():
        try:
            observations[name] = probe()
        except Exception as error:  # recorded for the test that reads it; the other probes go on
            observations[name] = f"{type(error).__name__}: {error}"
    return observations


def _plain_engine(zero_stage: int) -> dict[str, Any]:
    """Three steps of a tiny engine with our replacements: a normal one, one whose torch optimizer
    step is dropped (as the non-finite guard does), and one without the backward all-reduce."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    # ZeRO-3 keeps parameters below the persistence threshold whole: partition all of them here
    zero = {"stage": zero_stage, **({"stage3_param_persistence_threshold": 0} if zero_stage == 3 else {})}
    config = {**BASE_CONFIG, "gradient_clipping": 1.0, "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    calls: Counter[str] = Counter()
    seen: dict[str, Any] = {"gone": {}, "grad_norms": []}
    drop_update = False

    def model_step(*args: Any, **kwargs: Any) -> None:
        calls["model_step"] += 1
        grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
        seen["grad_norms"].append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
                                  if grads else None)
        deepspeed_model_step(*args, **kwargs)

    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        calls["optimizer_step"] += 1
        return None if drop_update else torch_step(*args, **kwargs)

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        calls["allreduce"] += 1
        return deepspeed_allreduce(*args, **kwargs)

    deepspeed_model_step = _patch(seen, "model_step", upstream.replace_model_step, engine, model_step)
    torch_step = _patch(seen, "optimizer_step", upstream.replace_optimizer_step, engine, optimizer_step)
    if zero_stage == 0:  # the only stage whose clipping drops the norm
        _patch(seen, "clipping_norm", upstream.keep_clipping_norm, engine)
    deepspeed_allreduce = engine.allreduce_gradients
    engine.allreduce_gradients = allreduce_gradients
    inputs = torch.randn(2, 4)

    def train_step() -> list[torch.Tensor]:
        engine.backward(engine(inputs).pow(2).mean())
        engine.step()
        return [upstream.local_partition(p).detach().clone() for p in engine.module.parameters()]

    before = [upstream.local_partition(p).detach().clone() for p in engine.module.parameters()]
    after_update = train_step()
    seen["allreduce_with_default"] = calls["allreduce"]
    seen["grad_norm"] = engine.get_global_grad_norm()
    drop_update = True
    after_dropped = train_step()
    drop_update = False
    if zero_stage == 0:  # ZeRO-1/2 move gradients into their partitions on that path
        _patch(seen, "backward_allreduce", upstream.turn_off_backward_allreduce, engine)
    allreduce_before = calls["allreduce"]
    train_step()
    seen["allreduce_turned_off"] = calls["allreduce"] - allreduce_before
    seen["calls"] = dict(calls)
    seen["update_moved_weights"] = any(not torch.equal(a, b) for a, b in zip(before, after_update, strict=True))
    seen["dropped_update_kept_weights"] = all(
        torch.equal(a, b) for a, b in zip(after_update, after_dropped, strict=True))
    seen["sizes"] = [(p.numel(), upstream.local_partition(p).numel()) for p in engine.module.parameters()]
    return seen


def _pipeline_engine() -> dict[str, Any]:
    """A pipeline of three layers whose stage boundaries say only the first two are built, trained
    one step of MICRO_BATCHES micro-batches with the loss watched."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    boundaries_asked = []
    seen: dict[str, Any] = {"gone": {}}

    class FirstTwoLayers(PipelineModule):
        def stage_boundaries(self) -> list[int]:
            boundaries_asked.append(True)
            return [0, 2]

    _patch(seen, "partition", upstream.partition_by_stage_boundaries, FirstTwoLayers)
    torch.manual_seed(0)
    module = FirstTwoLayers(layers=[LayerSpec(torch.nn.Linear, 4, 4) for _ in range(3)], num_stages=1,
                            loss_fn=lambda outputs, labels: (outputs - labels).pow(2).mean(),
                            partition_method="uniform")
    seen.update(parts=list(module.parts), built_layers=len(module.forward_funcs),
                boundaries_asked=len(boundaries_asked))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    config = {**BASE_CONFIG, "gradient_accumulation_steps": MICRO_BATCHES, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    calls: Counter[str] = Counter()

    def watch(loss: torch.Tensor) -> torch.Tensor:
        calls["loss"] += 1
        return loss

    def model_step(*args: Any, **kwargs: Any) -> None:
        calls["model_step"] += 1
        deepspeed_model_step(*args, **kwargs)

    _patch(seen, "pipeline_loss", upstream.watch_pipeline_loss, engine, watch)
    deepspeed_model_step = _patch(seen, "model_step", upstream.replace_model_step, engine, model_step)
    engine.train_batch(data_iter=iter([(torch.randn(2, 4), torch.randn(2, 4))] * MICRO_BATCHES))
    seen["calls"] = dict(calls)
    return seen


def _megatron_buffers() -> dict[str, Any]:
    """The device of a buffer from megatron's global memory buffer after the patch (no CUDA here)."""
    seen: dict[str, Any] = {"gone": {}}
    _patch(seen, "megatron_buffers", upstream.allocate_megatron_buffers_on_cpu)
    seen["device"] = str(utils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "contract").device)
    return seen


def _optimizer_state(zero_stage: int, bf16: bool) -> dict[str, Any]:
    """Two AdamW steps of a tiny model with our two parameter groups (matrices, vectors), then each
    parameter's state as checkpoint/optimizer_state.py reads it; then new values written and read back
    (and the working copy the forward pass uses, bf16 under bf16)."""
    import deepspeed

    from scaletrain.checkpoint.optimizer_state import (
        STATE_KEYS,
        is_partitioned,
        read_local_part,
        read_parameter_state,
        write_parameter_state,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    zero = {"stage": zero_stage, **({"stage3_param_persistence_threshold": 0} if zero_stage == 3 else {})}
    config = {**BASE_CONFIG, "zero_optimization": zero, "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=0.01), config=config)
    inputs = torch.randn(2, 4, dtype=torch.bfloat16 if bf16 else torch.float32)
    for _ in range(2):
        engine.backward(engine(inputs).float().pow(2).mean())
        engine.step()
    seen: dict[str, Any] = {"optimizer": type(engine.optimizer).__name__, "read": {}, "roundtrip": {}, "gone": {}}
    inner = engine.optimizer if isinstance(engine.optimizer, torch.optim.Optimizer) else engine.optimizer.optimizer
    seen["owners"] = [owner in inner.state for owner in upstream.adam_state_owners(engine.optimizer)]
    from scaletrain.checkpoint.optimizer_state import link_optimizer_state

    link_optimizer_state(engine)
    seen["master_is_working"], seen["local_part"] = {}, {}
    for name, parameter in engine.module.named_parameters():
        seen["read"][name] = {key: value.detach().float().clone()
                              for key, value in read_parameter_state(engine, parameter).items()}
        working = upstream.local_partition(parameter).detach().reshape(-1)
        master = seen["read"][name]["weight"].reshape(-1)[:working.numel()].to(working.dtype)
        seen["master_is_working"][name] = torch.equal(master, working[:master.numel()])
        if is_partitioned(parameter):  # a world of one: this rank's part is the whole parameter
            start, part = read_local_part(parameter)
            seen["local_part"][name] = start == 0 and all(
                torch.equal(part[key].float(), seen["read"][name][key].reshape(-1)) for key in part)
    for index, (name, parameter) in enumerate(engine.module.named_parameters()):
        new = {key: torch.full_like(seen["read"][name][key], 0.25 * (index + 1) + position)
               for position, key in enumerate(STATE_KEYS)}
        write_parameter_state(engine, parameter, new)
        back = read_parameter_state(engine, parameter)
        working = upstream.local_partition(parameter).detach().float()
        seen["roundtrip"][name] = {
            "state": all(torch.equal(back[key].float(), new[key]) for key in STATE_KEYS),
            "working": bool((working[:min(working.numel(), new["weight"].numel())]
                             == new["weight"].reshape(-1)[0]).all()),
        }
    return seen


def _patch(seen: dict[str, Any], contract: str, patch: Callable[..., Any], *args: Any) -> Any:
    """Apply one of upstream's patches; if its internal is gone, note why under `contract` and go on,
    so that only that contract's test fails."""
    try:
        return patch(*args)
    except upstream.UpstreamChanged as error:
        seen["gone"][contract] = str(error)
        return None


def _observation(observed: dict[str, Any], probe: str, internal: str, contract: str | None = None) -> Any:
    """What `probe` saw; fails at once if it raised, or if the internal behind `contract` is gone."""
    value = observed[probe]
    if isinstance(value, str):
        pytest.fail(_broken(internal, f"the {probe} probe raised {value}"))
    if contract in value["gone"]:
        pytest.fail(f"upstream contract broken: {value['gone'][contract]}")
    return value


def _broken(internal: str, problem: str) -> str:
    return f"upstream contract broken: {internal} (checked on {CHECKED_ON}): {problem}"


def test_take_model_step_is_called_once_per_optimizer_step(observed):
    internal = "DeepSpeedEngine._take_model_step"
    for probe, steps in [*((f"zero{stage}", 3) for stage in ZERO_STAGES), ("pipeline", 1)]:
        calls = _observation(observed, probe, internal, "model_step")["calls"].get("model_step", 0)
        assert calls == steps, _broken(internal, f"{probe}: our replacement ran {calls} times in {steps} steps, "
                                                 "so the non-finite guard would not see every step")


def test_the_client_optimizer_is_what_deepspeed_steps(observed):
    internal = "DeepSpeedEngine.client_optimizer (its .step)"
    for stage in ZERO_STAGES:
        seen = _observation(observed, f"zero{stage}", internal, "optimizer_step")
        assert seen["calls"].get("optimizer_step", 0) == 3, _broken(
            internal, f"ZeRO-{stage}: DeepSpeed called the client optimizer's step {seen['calls']} times in 3 steps")
        assert seen["update_moved_weights"], _broken(internal, f"ZeRO-{stage}: the weights did not move in a step")
        assert seen["dropped_update_kept_weights"], _broken(
            internal, f"ZeRO-{stage}: dropping the client optimizer's step did not keep the weights; "
            "DeepSpeed updates them through something else, so a skipped step would still apply")


def test_pipeline_loss_fn_is_looked_up_for_every_micro_batch(observed):
    internal = "PipelineModule.loss_fn as called by PipelineEngine._exec_forward_pass"
    calls = _observation(observed, "pipeline", internal, "pipeline_loss")["calls"].get("loss", 0)
    assert calls == MICRO_BATCHES, _broken(
        internal, f"the replaced loss_fn saw {calls} of {MICRO_BATCHES} micro-batch losses")


def test_clip_fp32_gradients_norm_reaches_get_global_grad_norm(observed):
    internal = "DeepSpeedEngine.clip_fp32_gradients / _global_grad_norm"
    seen = _observation(observed, "zero0", internal, "clipping_norm")
    assert seen["grad_norm"] is not None, _broken(
        internal, "get_global_grad_norm() is None after a clipped ZeRO-0 fp32 step: grad_norm would vanish")
    assert float(seen["grad_norm"]) == pytest.approx(seen["grad_norms"][0], rel=1e-5), _broken(
        internal, f"the kept norm {float(seen['grad_norm'])} is not the gradients' norm {seen['grad_norms'][0]}")


def test_enable_backward_allreduce_gates_the_allreduce(observed):
    internal = "DeepSpeedEngine.enable_backward_allreduce"
    seen = _observation(observed, "zero0", internal, "backward_allreduce")
    assert seen["allreduce_with_default"] == 1, _broken(
        internal, f"ZeRO-0 backward called allreduce_gradients {seen['allreduce_with_default']} times, not once")
    assert seen["allreduce_turned_off"] == 0, _broken(internal, "setting it False no longer skips allreduce_gradients")


def test_partition_layers_override_sets_the_stage_bounds(observed):
    internal = "PipelineModule._partition_layers / _set_bounds"
    seen = _observation(observed, "pipeline", internal, "partition")
    assert seen["boundaries_asked"] == 1, _broken(internal, "PipelineModule.__init__ did not call our partition")
    assert seen["parts"] == [0, 2], _broken(internal, f"parts is {seen['parts']}, not the boundaries [0, 2]")
    assert seen["built_layers"] == 2, _broken(internal, f"the stage built {seen['built_layers']} layers, not 2")


def test_ds_tensor_is_the_zero3_partition(observed):
    internal = "ZeRO-3 parameter .ds_tensor"
    sizes = _observation(observed, "zero3", internal)["sizes"]
    assert all(placeholder == 0 and local > 0 for placeholder, local in sizes), _broken(
        internal, f"(parameter, local_partition) sizes {sizes}: local_partition is not this rank's partition, "
        "so weights_are_finite would check empty placeholders")


def test_megatron_allocates_sequence_parallel_buffers_through_its_torch_global(observed):
    """Fails when a megatron-core upgrade moves the buffers or collectives allocate_megatron_buffers_on_cpu handles."""
    internal = "megatron.core tensor_parallel.mappings/layers, utils: torch.cuda.current_device()"
    assert mappings.dist_all_gather_func is dist.all_gather_into_tensor, _broken(internal, "all-gather changed")
    assert mappings.dist_reduce_scatter_func is dist.reduce_scatter_tensor, _broken(internal, "reduce-scatter changed")
    assert layers.dist_all_gather_func is dist.all_gather_into_tensor, _broken(internal, "all-gather changed")
    assert layers.dist_reduce_scatter_func is dist.reduce_scatter_tensor, _broken(internal, "reduce-scatter changed")
    allocating = [
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
        layers.LinearWithGradAccumulationAndAsyncCommunication.backward,
        utils.GlobalMemoryBuffer.get_tensor,
    ]
    for function in allocating:
        assert "device=torch.cuda.current_device()" in inspect.getsource(function), _broken(
            internal, f"{function.__qualname__} no longer allocates on torch.cuda.current_device()")
        assert inspect.getmodule(function) in MODULES_ALLOCATING_ON_CURRENT_DEVICE, _broken(
            internal, f"{function.__qualname__} moved out of the patched modules")
    forward = inspect.getsource(layers.LinearWithGradAccumulationAndAsyncCommunication.forward)
    assert "get_global_memory_buffer().get_tensor" in forward, _broken(internal, "the linear's input buffer moved")
    # the un-gathered shard is what backward keeps (scaling/activations.py counts it)
    assert "ctx.save_for_backward(input, weight)" in forward, _broken(internal, "the linear saves another input")
    device = _observation(observed, "megatron_buffers", internal, "megatron_buffers")["device"]
    assert device == "cpu", _broken(internal, f"after the patch a GlobalMemoryBuffer tensor is on {device}")


def test_each_deepspeed_optimizer_wrapper_gives_up_its_adam_state(observed):
    """checkpoint/optimizer_state.py reads the fp32 master and both moments of every parameter under
    each wrapper (the public fragment API for ZeRO-1/3; `adam_state_owners` for all). The same two steps
    give the same state under ZeRO-0/1/3 in fp32, and bf16 ZeRO-1's is fp32's within 10% (bf16 rounds the
    activations to 8 bits: a few per cent on the smallest gradients; a swapped or zeroed moment is off
    by 100%). Layouts without ZeRO step scaletrain's own FlatAdamW in both precisions (its state: its own
    tests), so DeepSpeed's bf16 wrapper without ZeRO is not read any more."""
    internal = ("the optimizer wrappers' fp32 master attributes (upstream.adam_state_owners), "
                "_lazy_init_hp_params_optimizer_state")
    seen = {kind: _observation(observed, f"state_{kind}", internal) for kind in STATE_KINDS}
    for kind, state in seen.items():
        assert state["owners"] and all(state["owners"]), _broken(
            internal, f"{kind} ({state['optimizer']}): Adam's state is not keyed by the tensors adam_state_owners "
                      "names, so a resume would create state DeepSpeed never reads")
        mismatched = [name for name, same in state["master_is_working"].items() if not same]
        assert not mismatched, _broken(internal, f"{kind} ({state['optimizer']}): the master weights read for "
                                                 f"{mismatched} are not the parameters': another parameter's state")
        zeros = [name for name, read in state["read"].items() if not read["exp_avg_sq"].abs().max() > 0]
        assert not zeros, _broken(internal, f"{kind}: the moments of {zeros} read as zeros")
    reference = seen["fp32_zero0"]["read"]
    for kind, tolerance in (("fp32_zero1", 1e-5), ("fp32_zero3", 1e-5), ("bf16_zero1", 0.1)):
        for name, state in seen[kind]["read"].items():
            for key, value in state.items():
                scale = reference[name][key].abs().max().clamp_min(1e-12)
                assert value.shape == reference[name][key].shape, _broken(internal, f"{kind} {name} {key}: shape")
                assert (value - reference[name][key]).abs().max() <= tolerance * scale, _broken(
                    internal, f"{kind} ({seen[kind]['optimizer']}): {name} {key} differs from fp32 ZeRO-0's: the "
                              "state read is not the state trained")


def test_written_adam_state_and_working_weights_read_back(observed):
    """write_parameter_state reaches the master, both moments and the working copy (ZeRO-3's ds_tensor,
    the bf16 parameter): what a resume writes is what the next step uses."""
    internal = "safe_set_full_* and upstream.set_working_weight"
    for kind in STATE_KINDS:
        state = _observation(observed, f"state_{kind}", internal)
        for name, roundtrip in state["roundtrip"].items():
            assert roundtrip["state"], _broken(internal, f"{kind}: {name}'s written state does not read back")
            assert roundtrip["working"], _broken(internal, f"{kind}: {name}'s working weight was not set")


def test_megatron_tensor_parallel_rank_can_be_overridden_and_restored():
    """The planner builds models on the meta device as TP rank 0 of 1 without torch.distributed."""
    from megatron.core import parallel_state

    internal = "parallel_state._MPU_TENSOR_MODEL_PARALLEL_RANK / _WORLD_SIZE"
    before = (parallel_state._MPU_TENSOR_MODEL_PARALLEL_RANK, parallel_state._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE)
    try:
        with upstream.tensor_parallel_rank_override(3, 4):
            seen = (parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_tensor_model_parallel_world_size())
    except upstream.UpstreamChanged as error:
        pytest.fail(f"upstream contract broken: {error}")
    assert seen == (3, 4), _broken(internal, f"the override answered {seen}, not (3, 4)")
    after = (parallel_state._MPU_TENSOR_MODEL_PARALLEL_RANK, parallel_state._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE)
    assert after == before, _broken(internal, f"not restored: {after} after, {before} before")


def test_each_rank_s_part_of_the_zero_state_is_where_deepspeed_keeps_it(observed):
    """A checkpoint's ZeRO parts come from each rank's own partition (upstream.zero_fragment:
    `_hp_mapping.lp_fragment_address` / `get_hp_fragment`; ZeRO-3: safe_get_local_* placed by
    upstream.zero3_partition_range): on one rank they are the whole state the public API gathers."""
    internal = "_hp_mapping.lp_fragment_address / get_hp_fragment, ZeRO-3's ds_tensor partition range"
    for kind in ("fp32_zero1", "fp32_zero3", "bf16_zero1"):
        state = _observation(observed, f"state_{kind}", internal)
        assert state["local_part"], _broken(internal, f"{kind}: no parameter is partitioned")
        wrong = [name for name, same in state["local_part"].items() if not same]
        assert not wrong, _broken(internal, f"{kind}: this rank's part of {wrong} is not the state DeepSpeed holds")


class _Experts(torch.nn.Module):
    """Stands for our MoE layer: this rank's experts (a different weight on each rank) and `num_experts`."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.num_experts = 2
        self.weight = torch.nn.Parameter(torch.full((4,), float(rank + 1)))


def _expert_parallel_engines(rank: int, world_size: int) -> dict[str, Any]:
    """Under expert_parallel_engine, on two ranks of one expert-parallel group: a dense weight and a
    per-rank expert weight, each given the gradient rank+1 ones; ZeRO-0 and ZeRO-1 engines."""
    import deepspeed
    from deepspeed.runtime import engine as engine_module
    from megatron.core import parallel_state

    from scaletrain.parallel.expert_parallel import mark_expert_parameters

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    seen: dict[str, Any] = {}
    for stage in (0, 1):
        model = torch.nn.Module()
        model.dense, model.experts = torch.nn.Linear(4, 1, bias=False), _Experts(rank)
        mark_expert_parameters(model.experts)
        with upstream.expert_parallel_engine(list(model.experts.parameters()), _Experts,
                                             parallel_state.get_expert_model_parallel_group(),
                                             parallel_state.get_expert_data_parallel_group(), 2):
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            groups = split_params_into_different_moe_groups_for_optimizer([{"name": "all",
                                                                             "params": list(model.parameters())}])
            optimizer = torch.optim.SGD(groups, lr=1.0)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
                **BASE_CONFIG, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage}})
        seen[f"zero{stage}_moe_layers"] = engine.has_moe_layers
        seen["moe_restored"] = not isinstance(engine_module.MoE, tuple)
        before = [p.detach().clone() for p in (model.dense.weight, model.experts.weight)]
        loss = (rank + 1) * (model.dense.weight.sum() + model.experts.weight.sum())
        engine.backward(loss)
        engine.step()
        seen[f"zero{stage}_steps"] = [(b - p.detach()).tolist() for b, p in zip(
            before, (model.dense.weight, model.experts.weight), strict=True)]
    return seen


def test_expert_parameters_are_reduced_over_their_own_ranks():
    internal = "deepspeed.runtime.engine.MoE / deepspeed.utils.groups._EXPERT_*_GROUP*"
    seen = run_on_ranks(_expert_parallel_engines, 2)
    for rank, observed_here in enumerate(seen):
        assert observed_here["moe_restored"], _broken(internal, "engine.MoE was not restored after initialize")
        for stage in (0, 1):
            assert observed_here[f"zero{stage}_moe_layers"], _broken(
                internal, f"ZeRO-{stage}: the engine did not see our layer as a MoE layer")
            dense_step, expert_step = observed_here[f"zero{stage}_steps"]
            # SGD at lr 1 steps by the gradient: the dense one averaged over both ranks ((1 + 2) / 2), the
            # expert's this rank's own divided by the data-parallel size (DeepSpeed's _reduce_expert_gradients)
            assert dense_step[0] == pytest.approx([1.5] * 4), _broken(internal, f"dense step {dense_step}")
            assert expert_step == pytest.approx([(rank + 1) / 2] * 4), _broken(
                internal, f"ZeRO-{stage}: rank {rank}'s expert stepped {expert_step}, not its own gradient / 2")


def _default_tensor_parallel_groups(rank: int, world_size: int) -> dict[str, Any]:
    """Whether megatron's default-group lookup and ours give the same group (or None), before and after
    megatron's groups exist; whether the patch replaced the lookup layers uses."""
    from megatron.core import parallel_state

    def same_answers() -> list[bool]:
        return [utils.get_tensor_model_parallel_group_if_none(*arguments) is upstream.tensor_parallel_group_if_none(
            *arguments) for arguments in [(None,), (None, True), (dist.group.WORLD,)]]

    before = same_answers()
    parallel_state.initialize_model_parallel()
    after = same_answers()
    resolved = upstream.tensor_parallel_group_if_none(None) is parallel_state.get_tensor_model_parallel_group()
    upstream.let_dynamo_trace_megatron_linears()
    return {"before": before, "after": after, "resolved": resolved,
            "patched": layers.get_tensor_model_parallel_group_if_none is upstream.tensor_parallel_group_if_none}


def test_megatron_linears_find_the_default_group_through_the_lookup_we_replace():
    """Fails when megatron-core stops resolving RowParallelLinear's `tp_group=None` through the module global of
    layers that let_dynamo_trace_megatron_linears replaces, or when megatron's answer differs from ours."""
    internal = "megatron.core.tensor_parallel.layers.get_tensor_model_parallel_group_if_none"
    assert "tp_group=None" in inspect.getsource(layers.RowParallelLinear.forward), _broken(
        internal, "RowParallelLinear passes its group now: the patch may be dropped")
    assert "get_tensor_model_parallel_group_if_none(tp_group)" in inspect.getsource(
        layers.linear_with_grad_accumulation_and_async_allreduce), _broken(internal, "the linear resolves it elsewhere")
    seen = run_on_ranks(_default_tensor_parallel_groups, 1)[0]
    for when in ("before", "after"):
        assert all(seen[when]), _broken(internal, f"{when} megatron's groups exist, its answers differ from ours "
                                                  f"(same for None, None as expert, a group: {seen[when]})")
    assert seen["resolved"], _broken(internal, "tp_group=None no longer means the tensor-parallel group")
    assert seen["patched"], _broken(internal, "the patch did not replace layers' lookup")
