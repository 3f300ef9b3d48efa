"""Every use of a private or undocumented DeepSpeed or megatron-core internal, in one place (issue 24).

Each function names the internal it replaces or reads, why no public API does the job, and what
breaks if the internal goes away; all were checked on CHECKED_ON. tests/test_upstream_contracts.py
has one contract test per use: it fails, naming the internal and CHECKED_ON, when an upgrade
removes it, changes the call we rely on, or stops calling it. An internal that is missing when a
patch is applied raises `UpstreamChanged` instead of letting the run go on unpatched.

The model files import this module (through parallel/sequence_parallel.py) and commands without an
engine never load DeepSpeed, so DeepSpeed is imported inside the functions that need it.
The checkpoint package's own uses (checkpoint/safe_load.py, reshard.py) are not here yet.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch
from megatron.core import utils
from megatron.core.tensor_parallel import layers, mappings

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


def keep_clipping_norm(engine: Any) -> None:
    """Keep the global gradient norm that DeepSpeed's clipping computes, for `get_global_grad_norm()`.

    Replaces: `DeepSpeedEngine.clip_fp32_gradients()`, which `_take_model_step` calls without ZeRO,
    fp16 or bf16 and which drops the return of `deepspeed.runtime.utils.clip_grad_norm_`; writes
    `engine._global_grad_norm`, what `get_global_grad_norm()` returns (the ZeRO and bf16 optimizers
    set it themselves). The replacement clips exactly as DeepSpeed's does and keeps the norm.
    If it goes away (renamed, or no longer called): `get_global_grad_norm()` says None and the
    step's `grad_norm` silently vanishes from the metrics of ZeRO-0 fp32 runs.
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    internal(engine, "clip_fp32_gradients", "grad_norm would be None in ZeRO-0 fp32 runs")
    internal(engine, "_global_grad_norm", "grad_norm would be None in ZeRO-0 fp32 runs")

    def clip_and_keep_norm() -> None:
        engine._global_grad_norm = clip_grad_norm_(
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)

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
    """The elements of a parameter that this rank holds: under ZeRO-3 its partition, else itself.

    Reads: `param.ds_tensor`, the ZeRO-3 partition DeepSpeed attaches to each parameter (whose own
    data is then an empty placeholder outside a gathered forward). The public
    `safe_get_local_fp32_param` reads the optimizer's fp32 copy instead, not the weights the model uses.
    If it goes away: under ZeRO-3 the empty placeholders are checked instead, so
    `weights_are_finite` (train/nonfinite.py) would pass non-finite weights into a checkpoint.
    """
    return getattr(parameter, "ds_tensor", parameter)


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
