"""Every use of a private or undocumented DeepSpeed or megatron-core internal, in one place (issue 24).

Each function names the internal it replaces or reads, why no public API does the job, and what
breaks if the internal goes away; all were checked on CHECKED_ON. tests/test_upstream_contracts.py
has one contract test per use: it fails, naming the internal and CHECKED_ON, when an upgrade
removes it, changes the call we rely on, or stops calling it. An internal that is missing when a
patch is applied raises `UpstreamChanged` instead of letting the run go on unpatched.

The model files import this module (through parallel/sequence_parallel.py) and commands without an
engine never load DeepSpeed, so DeepSpeed is imported inside the functions that need it.
The checkpoint package's uses (reaching Adam's state in DeepSpeed's optimizer wrappers) are at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state, utils
from megatron.core.tensor_parallel import layers, mappings
from torch import nn

CHECKED_ON = "deepspeed 0.19.8, megatron-core 0.16.1, torch 2.13"

PipelineClass = TypeVar("PipelineClass", bound=type)


class UpstreamChanged(RuntimeError):
    """A DeepSpeed or megatron-core internal that scaletrain patches or reads is not where it was."""


def internal(owner: object, name: str, consequence: str) -> Any:
    """`owner.name`, or UpstreamChanged naming it, the versions it was checked on and what it is for."""
    try:
        return getattr(owner, name)
    except AttributeError:
        owner_name = owner.__name__ if isinstance(owner, (type, ModuleType)) else type(owner).__name__
        raise UpstreamChanged(
            f"{owner_name}.{name} is gone (scaletrain/upstream.py relies on it; checked on {CHECKED_ON}): "
            f"without it {consequence}. Install the versions pyproject.toml pins, or port the patch"
        ) from None


def replace_model_step(engine: Any, model_step: Callable[..., None]) -> Callable[..., None]:
    """Make `model_step` the engine's optimizer step; returns DeepSpeed's own, for `model_step` to call.

    Replaces: `DeepSpeedEngine._take_model_step(lr_kwargs)` on this engine instance. `step()` and
    the pipeline engine's `_exec_optimizer_step` call it through `self`, so the instance attribute wins.
    Why: it is the one place both engines pass once per optimizer step, with the gradients final
    and the update not yet made; DeepSpeed has no public hook there.
    If it goes away: the non-finite guard (train/nonfinite.py) never runs, so a NaN step updates the
    weights under ZeRO-0 and the pipeline engine and is not counted as skipped.
    """
    deepspeed_step = internal(engine, "_take_model_step", "non-finite steps would be applied, not skipped")
    engine._take_model_step = model_step
    return deepspeed_step


def replace_optimizer_step(engine: Any, optimizer_step: Callable[..., Any]) -> Callable[..., Any]:
    """Make `optimizer_step` the `step` of the torch optimizer DeepSpeed updates with; returns its own.

    Reads: `engine.client_optimizer`, the optimizer given to `deepspeed.initialize` (undocumented).
    DeepSpeed calls that object's `step` itself: ZeRO-0 steps it directly, ZeRO-1/2 as
    `self.optimizer.step()` (stage_1_and_2.py), ZeRO-3 in `_optimizer_step`, BF16_Optimizer in `step`.
    Why: to drop one update while DeepSpeed still does its bookkeeping (gradients cleared, step
    counted); torch's optimizer step pre-hooks can change a step's arguments but not skip it.
    If it goes away (or DeepSpeed steps a copy): a skipped step still moves weights and Adam moments.
    """
    optimizer = internal(engine, "client_optimizer", "a skipped step's update could not be dropped")
    torch_step = optimizer.step
    optimizer.step = optimizer_step
    return torch_step


def watch_pipeline_loss(engine: Any, watch: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """On a pipeline engine, pass each micro-batch loss of the last stage through `watch` on its way
    to backward; a plain engine (whose module has no `loss_fn`) is left alone.

    Replaces: `PipelineModule.loss_fn` (the public constructor argument) after construction. This
    relies on `PipelineEngine._exec_forward_pass` looking up `self.module.loss_fn` for every
    micro-batch rather than keeping the function it was built with.
    Why: the pipeline engine computes the loss inside its schedule; `train_batch` returns only the mean.
    If it goes away: a non-finite loss on the pipeline goes unseen (non-finite gradients still count).
    """
    loss_fn = getattr(engine.module, "loss_fn", None)
    if loss_fn is None:
        return

    def watched_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        return watch(loss_fn(*args, **kwargs))

    engine.module.loss_fn = watched_loss


def keep_clipping_norm(engine: Any, norm_of: Callable[[list[nn.Parameter]], torch.Tensor] | None = None) -> None:
    """Keep the global gradient norm that DeepSpeed's clipping computes, for `get_global_grad_norm()`.

    Replaces: `DeepSpeedEngine.clip_fp32_gradients()`, which `_take_model_step` calls without ZeRO,
    fp16 or bf16 and which drops the return of `deepspeed.runtime.utils.clip_grad_norm_`; writes
    `engine._global_grad_norm`, what `get_global_grad_norm()` returns (the ZeRO and bf16 optimizers
    set it themselves). The replacement clips exactly as DeepSpeed's does and keeps the norm.
    `norm_of` (the parameters -> their global gradient norm) replaces DeepSpeed's norm, which under
    expert parallelism averages the norms of the data-parallel ranks' different experts; the clip
    coefficient is then DeepSpeed's, min(1, max_norm / (norm + 1e-6)).
    If it goes away (renamed, or no longer called): `get_global_grad_norm()` says None and the
    step's `grad_norm` silently vanishes from the metrics of ZeRO-0 fp32 runs.
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    internal(engine, "clip_fp32_gradients", "grad_norm would be None in ZeRO-0 fp32 runs")
    internal(engine, "_global_grad_norm", "grad_norm would be None in ZeRO-0 fp32 runs")

    def clip_and_keep_norm() -> None:
        if norm_of is None:
            engine._global_grad_norm = clip_grad_norm_(
                parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
            return
        parameters = [parameter for parameter in engine.module.parameters() if parameter.grad is not None]
        norm = norm_of(parameters)
        coefficient = torch.clamp(engine.gradient_clipping() / (norm + 1e-6), max=1.0)
        for parameter in parameters:
            parameter.grad.mul_(coefficient)
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_keep_norm


def turn_off_backward_allreduce(engine: Any) -> None:
    """Stop the engine from all-reducing gradients after backward (for a data-parallel group of one).

    Writes: `DeepSpeedEngine.enable_backward_allreduce` (undocumented), read by `_backward_epilogue`
    and `step()` to decide whether to call `allreduce_gradients`. The public `no_sync()` context
    also stops counting gradient-accumulation steps and forbids `step()` inside it, so it is no
    substitute. The attribute is checked first: setting a renamed one would silently do nothing.
    If it goes away: each step flattens, "all-reduces" over one rank and copies back every gradient
    again; results stay the same, only slower.
    """
    internal(engine, "enable_backward_allreduce", "every step would all-reduce over a group of one")
    engine.enable_backward_allreduce = False


EXPERT_GROUPS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS")


@contextmanager
def expert_parallel_engine(expert_parameters: list[nn.Parameter], moe_layer_class: type, expert_group: Any,
                           expert_data_group: Any, expert_parallel_size: int) -> Iterator[None]:
    """Around `deepspeed.initialize`: make DeepSpeed average the gradients of the experts that expert
    parallelism splits over their expert-data-parallel group, as it does for its own MoE layers.

    DeepSpeed handles expert parameters (`allreduce = False`, the mark megatron's MoE layers also
    use; parallel/expert_parallel.py sets it) only when `engine.has_moe_layers`, which
    `_configure_distributed_model` sets from `isinstance(module, deepspeed.moe.layer.MoE)`; then it
    reduces them over the groups in `deepspeed.utils.groups` named by the parameter's `group_name`
    (`ep_size_P`), dividing by the whole data-parallel size (engine `_reduce_expert_gradients`;
    ZeRO-1/2 partition their state over that group: stage_1_and_2 `_configure_moe_settings`).
    Replaces, for the duration: the module global `MoE` of deepspeed.runtime.engine by the tuple
    (MoE, moe_layer_class), so that isinstance check also accepts our layers (which carry
    `num_experts`, the one attribute it reads). Writes: `group_name` on each of `expert_parameters`, and
    megatron's expert groups into groups' private dicts (EXPERT_GROUPS) under `ep_size_P`, so
    DeepSpeed reduces over the very groups the model exchanges tokens in instead of building its own.
    Why: DeepSpeed offers expert-gradient handling only to its own MoE class; our layers are the
    model's (no DeepSpeed in model files). If it goes away: expert gradients would be averaged over
    the whole data-parallel group with other ranks' different experts (wrong weights), or, with
    `allreduce = False` and no MoE layers seen, not reduced at all. A contract test checks both.
    """
    from deepspeed.runtime import engine as engine_module
    from deepspeed.utils import groups

    name = f"ep_size_{expert_parallel_size}"
    for parameter in expert_parameters:
        parameter.group_name = name
    tables = [internal(groups, table, "expert gradients would be reduced over the wrong ranks")
              for table in EXPERT_GROUPS]
    for table, value in zip(tables, (expert_group, dist.get_process_group_ranks(expert_group), expert_data_group,
                                     dist.get_process_group_ranks(expert_data_group)), strict=True):
        table[name] = value
    deepspeed_moe = internal(engine_module, "MoE", "expert gradients would not be reduced at all")
    engine_module.MoE = (deepspeed_moe, moe_layer_class)
    try:
        yield
    finally:
        engine_module.MoE = deepspeed_moe


IGNORED_PARTITION = "an explicit parallel.pipeline_partition (3,1) would not reach DeepSpeed's PipelineModule"


def partition_by_stage_boundaries(pipeline_class: PipelineClass) -> PipelineClass:
    """Class decorator for a `PipelineModule` subclass with a `stage_boundaries()` method: when it
    returns a list (the first layer of each stage, then the number of layers), stage i builds layers
    [boundaries[i], boundaries[i + 1]); when it returns None, DeepSpeed's `partition_method` applies.

    Replaces: `PipelineModule._partition_layers(method)`, which `PipelineModule.__init__` calls to
    set `parts` and, through `_set_bounds(start, stop)`, the layers this stage builds; reads the
    public `stage_id`, set before it. Why: DeepSpeed's methods (uniform, parameters, type:regex)
    balance stages; none takes explicit sizes such as `parallel.pipeline_partition=3,1`.
    If it goes away: an explicit partition is silently replaced by DeepSpeed's uniform one.
    """
    deepspeed_partition = internal(pipeline_class, "_partition_layers", IGNORED_PARTITION)
    internal(pipeline_class, "_set_bounds", IGNORED_PARTITION)

    def _partition_layers(self: Any, method: str = "uniform") -> None:
        boundaries = self.stage_boundaries()
        if boundaries is None:
            deepspeed_partition(self, method)
            return
        self.parts = boundaries
        self._set_bounds(start=boundaries[self.stage_id], stop=boundaries[self.stage_id + 1])

    pipeline_class._partition_layers = _partition_layers
    return pipeline_class


def local_partition(parameter: torch.Tensor) -> torch.Tensor:
    """The elements of a parameter that this rank holds: under ZeRO-3 the real elements of its partition,
    else the parameter itself.

    Reads: `param.ds_tensor`, the ZeRO-3 partition DeepSpeed attaches to each parameter (whose own
    data is then an empty placeholder outside a gathered forward). The public
    `safe_get_local_fp32_param` reads the optimizer's fp32 copy instead, not the weights the model uses.
    A partition of a parameter the ranks do not divide ends in padding that DeepSpeed allocates with
    torch.empty and never writes (zero/partition_parameters.py `_partition_param`): uninitialised
    memory, sometimes NaN, so only the first `zero3_partition_range` elements are returned (an ELECTRA
    run under DP2 ZeRO-3 was stopped as diverged by garbage there).
    If it goes away: under ZeRO-3 the empty placeholders are checked instead, so
    `weights_are_finite` (train/nonfinite.py) would pass non-finite weights into a checkpoint.
    """
    if not hasattr(parameter, "ds_tensor"):
        return parameter
    _, length = zero3_partition_range(parameter)
    return parameter.ds_tensor.narrow(0, 0, length)


# Where megatron allocates sequence-parallel buffers with device=torch.cuda.current_device():
# mappings._gather_along_first_dim / _reduce_scatter_along_first_dim (the scatter/gather
# regions), layers.LinearWithGradAccumulationAndAsyncCommunication.backward (the reduce-scattered
# input gradient) and utils.GlobalMemoryBuffer.get_tensor (the all-gathered linear input).
MODULES_ALLOCATING_ON_CURRENT_DEVICE = (mappings, layers, utils)


class _CudaOnHost:
    """`torch.cuda` as seen by a patched megatron module: `current_device()` names the CPU."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")


class _TorchOnHost:
    """`torch` as seen by a patched megatron module: everything is torch's except `cuda`."""

    cuda = _CudaOnHost()

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def allocate_megatron_buffers_on_cpu() -> None:
    """Make megatron's sequence-parallel buffers on the CPU. Idempotent.

    Replaces: the module global `torch` of each of MODULES_ALLOCATING_ON_CURRENT_DEVICE by a view
    of torch whose `cuda.current_device()` is the CPU; every line of megatron's forward and
    backward then runs unchanged. Why: megatron allocates those buffers with
    `device=torch.cuda.current_device()`, which raises without CUDA, and offers no device setting;
    its collectives (`all_gather_into_tensor`, `reduce_scatter_tensor`) gloo implements in torch 2.13.
    If it goes away (the allocation moves to another module or helper): sequence parallelism on
    CPU fails loudly in its first forward, with "Torch not compiled with CUDA enabled".
    """
    for module in MODULES_ALLOCATING_ON_CURRENT_DEVICE:
        current = internal(module, "torch", "sequence parallelism could not run on CPU")
        if not isinstance(current, _TorchOnHost):
            module.torch = _TorchOnHost()


def tensor_parallel_group_if_none(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
    """megatron's `utils.get_tensor_model_parallel_group_if_none`, the same answer without its warning."""
    if not dist.is_initialized():
        return None
    if tp_group is not None or not parallel_state.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def let_dynamo_trace_megatron_linears() -> None:
    """Let torch.compile trace megatron's column- and row-parallel linears without a graph break. Idempotent.

    Replaces: the module global `get_tensor_model_parallel_group_if_none` of megatron.core.tensor_parallel.layers
    (imported there from megatron.core.utils) by `tensor_parallel_group_if_none`. Why: RowParallelLinear.forward
    passes `tp_group=None` to `linear_with_grad_accumulation_and_async_allreduce` on every call, whose lookup of
    the default group issues a DeprecationWarning on global rank 0 (Python hides it by default); dynamo cannot
    trace `warnings.warn`, so every block broke its graph at every row-parallel linear, on rank 0 alone, and
    `fullgraph=True` failed (train/compile.py). megatron offers no way to pass the group there.
    If it goes away (megatron resolves the group elsewhere): compiled blocks fail with fullgraph=True at
    parallel.tensor=1 at their first step, naming `warnings.warn`; the contract test names the internal.
    """
    current = internal(layers, "get_tensor_model_parallel_group_if_none", "compiled blocks break at every linear")
    if current is not tensor_parallel_group_if_none:
        layers.get_tensor_model_parallel_group_if_none = tensor_parallel_group_if_none


# --- Checkpoints: Adam's state inside DeepSpeed's optimizer wrappers (checkpoint/optimizer_state.py) ---


def zero_fragment(parameter: nn.Parameter) -> tuple[int, dict[str, torch.Tensor]] | None:
    """This rank's part of a ZeRO-1/2 (or BF16_Optimizer) parameter's fp32 state, as (offset in the
    flattened parameter, {"weight", "exp_avg", "exp_avg_sq"}: flat fp32 views), or None if the rank's
    partition holds none of it. deepspeed.utils' safe_get_full_* return the whole tensor by an
    all-reduce over the data-parallel group, per parameter and key; a checkpoint that each rank writes
    its own part of needs the part: `_hp_mapping.lp_fragment_address` and `get_hp_fragment` (what
    DeepSpeed's own universal checkpoint reads). The moments are linked by
    link_fragments_to_optimizer_state first. Checked on deepspeed 0.19.8 (utils/tensor_fragment.py)."""
    mapping = internal(parameter, "_hp_mapping", "each rank could not save its own part of the ZeRO state")
    if mapping is None:
        return None
    address = mapping.lp_fragment_address
    state = {"weight": mapping.get_hp_fragment()}
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = mapping.get_hp_fragment(optim_state_key=key)
    return int(address.start), {key: tensor.reshape(-1)[:address.numel] for key, tensor in state.items()}


def zero3_partition_range(parameter: nn.Parameter) -> tuple[int, int]:
    """(offset, length) in the flattened parameter of this rank's ZeRO-3 partition: rank r of the
    parameter's group holds [r*n, (r+1)*n) of it, padded at the end with unwritten elements (n =
    `ds_tensor.numel()`, zero/partition_parameters.py); a tail rank may hold only padding (length 0).
    Checked on deepspeed 0.19.8."""
    group = internal(parameter, "ds_process_group", "ZeRO-3 partitions could not be placed")
    size = parameter.ds_tensor.numel()
    start = dist.get_rank(group=group) * size
    return start, max(0, min(size, parameter.ds_numel - start))


def set_working_weight(parameter: nn.Parameter, weight: torch.Tensor) -> None:
    """The copy the forward pass uses (bf16 under bf16) from the fp32 master `weight`. DeepSpeed's
    safe_set_full_fp32_param sets the master only. Under ZeRO-3 the working copy is this rank's flat
    partition `ds_tensor` (rank r holds elements [r*n, (r+1)*n) of the flattened parameter, padded at
    the end, which this zeroes: zero/partition_parameters.py); elsewhere the parameter itself. Checked
    on deepspeed 0.19.8."""
    with torch.no_grad():
        if not hasattr(parameter, "ds_tensor"):
            parameter.copy_(weight.to(parameter.device, parameter.dtype))
            return
        partition = parameter.ds_tensor
        start, length = zero3_partition_range(parameter)
        partition.zero_()
        partition[:length].copy_(weight.reshape(-1)[start:start + length].to(partition.device, partition.dtype))


# Where each of DeepSpeed's optimizer wrappers keeps the flat fp32 tensors that Adam's state is keyed
# by (deepspeed 0.19.8): ZeRO-3, ZeRO-1/2, BF16_Optimizer. (Layouts without ZeRO step FlatAdamW, a torch
# optimizer, so DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer wrappers are never built.)
_MASTER_FLATS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def adam_state_owners(optimizer: Any) -> list[torch.Tensor]:
    """The tensors whose entries in the torch optimizer's `state` hold Adam's moments: our AdamW's own
    parameters, or a DeepSpeed wrapper's flat fp32 master partitions. The wrappers put those into the
    torch optimizer's param_groups only while they step (ZeRO-1/2 one group at a time, ZeRO-3 one
    sub-group at a time), so param_groups cannot say. Checked on deepspeed 0.19.8."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for attribute in _MASTER_FLATS:
        flats = getattr(optimizer, attribute, None)
        if flats is not None:
            return [tensor for entry in flats for tensor in (entry if isinstance(entry, list) else [entry])]
    raise RuntimeError(f"{type(optimizer).__name__}: none of {_MASTER_FLATS} found; scaletrain knows DeepSpeed "
                       "0.19's optimizer wrappers only")


def link_fragments_to_optimizer_state(optimizer: Any) -> None:
    """ZeRO-1/2 and BF16_Optimizer point each parameter's `_hp_mapping.optim_fragment` into Adam's state
    (`_lazy_init_hp_params_optimizer_state`), which deepspeed.utils' safe_get/set_full_optimizer_state
    go through. They link once, after the first step of the first parameter group, when the second
    group has no state yet (ZeRO-1/2 step one group at a time), so its parameters' fragments stay
    empty; and a resume before the first step has nothing linked. Relink now that every group has
    state. No public call does it. Checked on deepspeed 0.19.8 (zero/stage_1_and_2.py, bf16_optimizer.py)."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        optimizer._hp_optimizer_states_linked = False
        link()


# --- The planner: megatron's tensor-parallel rank without torch.distributed (planner/params.py) ---


@contextmanager
def tensor_parallel_rank_override(rank: int, world_size: int) -> Iterator[None]:
    """megatron's parallel_state answering TP rank `rank` of `world_size` while the block runs, as it
    does when its public set_tensor_model_parallel_rank/world_size overrides are set; what was set
    before (`_MPU_TENSOR_MODEL_PARALLEL_RANK` / `_WORLD_SIZE`, usually None) comes back after. No public
    getter returns the override itself (get_tensor_model_parallel_rank falls through to the process
    group, which the planner does not have). Checked on megatron-core 0.16.1 (core/parallel_state.py)."""
    from megatron.core import parallel_state

    saved = (internal(parallel_state, "_MPU_TENSOR_MODEL_PARALLEL_RANK", "the planner could not restore the TP rank"),
             internal(parallel_state, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "the planner could not restore it"))
    parallel_state.set_tensor_model_parallel_rank(rank)
    parallel_state.set_tensor_model_parallel_world_size(world_size)
    try:
        yield
    finally:
        parallel_state.set_tensor_model_parallel_rank(saved[0])
        parallel_state.set_tensor_model_parallel_world_size(saved[1])
