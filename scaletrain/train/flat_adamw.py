"""AdamW over flat buffers for layouts without ZeRO or pipeline stages: per optimizer step one
gradient all-reduce, one norm, one clip, one fused Adam kernel per segment and one copy back,
whatever the number of parameter tensors (issue 36).

Why not DeepSpeed's: under bf16 without ZeRO, DeepSpeed 0.19 wraps a client optimizer in
FP16_UnfusedOptimizer (it counts only its own or apex's FusedAdam as fused, since 0.17.6), which
keeps an fp32 copy per parameter and converts, clips and copies back one tensor at a time: about
75 ms a step at GPT-3 350M on an H200, where a plain PyTorch loop's clip + fused AdamW takes 7.5 ms.
Its clipping norm and the fp32 ZeRO-0 one (`deepspeed.runtime.utils.clip_grad_norm_`) are a norm
kernel per tensor. Megatron's optimizer keeps flat fp32 main weights and main gradients
(megatron/core/optimizer, `main_grad`); this is that, for one data-parallel group without ZeRO.

Each trainable parameter gets a slice of three flat buffers: the model's working weights (the
parameter's storage from then on; bf16 or fp32), the fp32 master weights (the same buffer in fp32),
and fp32 gradients. They are laid out in up to four segments, tensor-parallel ones first:

    tensor-parallel & decayed | tensor-parallel & not decayed | replicated & decayed | replicated & not

so the gradient norm counts replicated parameters (norms, row-parallel biases: the same on every TP
rank) on TP rank 0 only, as DeepSpeed's and Megatron's clipping do, with two reductions; and each
segment is one parameter of torch's fused AdamW with its own weight decay (none on biases and
gains, GPT-3). A post-accumulate-grad hook adds each parameter's gradient into its fp32 slice during
backward and frees it (Megatron's fp32 main_grad accumulation: micro-batches accumulate in fp32,
where DeepSpeed's bf16 ZeRO-0 path accumulated in bf16). The first gradient of a step is copied into
its slice rather than added, so the buffer is never zeroed between steps (a pass over every gradient
that the plain loop's `zero_grad(set_to_none=True)` does not pay); the slices of parameters that got
no gradient in a step are zeroed at its end, and the padding stays zero. The master weights start as the working
weights (rounded to bf16 under bf16, as DeepSpeed's wrappers start them), so every layout trains
from the same initial weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

# Every slice starts on a multiple of 64 elements (128 bytes in bf16): cuBLAS and the fused
# kernels take their vectorised paths only on aligned operands.
ALIGNMENT = 64


@dataclass(frozen=True)
class Slice:
    """Where one parameter lives: its segment (an index into param_groups), its offset in the segment
    and its start in the flat buffers."""

    segment: int
    offset: int
    start: int
    numel: int
    shape: torch.Size


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


class FlatAdamW(torch.optim.AdamW):
    """torch's fused AdamW stepping flat fp32 segments; `step()` also reduces the gradients over the
    data-parallel group, computes the global norm (kept as `_global_grad_norm`, where DeepSpeed's
    engine reads it) and clips by it; the working weights follow the master weights after it."""

    def __init__(
        self, parameters: list[nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float,
        weight_decay: float, max_grad_norm: float, working_dtype: torch.dtype,
        is_tensor_parallel: Callable[[nn.Parameter], bool], tensor_parallel_group: dist.ProcessGroup | None,
        data_parallel_group: dist.ProcessGroup | None,
    ) -> None:
        by_segment: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for parameter in parameters:
            key = (not is_tensor_parallel(parameter), parameter.dim() < 2)  # (replicated, not decayed)
            by_segment.setdefault(key, []).append(parameter)
        keys = sorted(by_segment)  # tensor-parallel segments first, decayed before not decayed
        device = parameters[0].device
        self._slices: dict[int, Slice] = {}
        bounds, size = [], 0
        for index, key in enumerate(keys):
            start = size
            for parameter in by_segment[key]:
                self._slices[id(parameter)] = Slice(index, size - start, size, parameter.numel(), parameter.shape)
                size += _aligned(parameter.numel())
            bounds.append((start, size))
        # the first replicated element: the norm counts [0, split) on every TP rank, [split, size) on rank 0
        self._split = next((start for (start, _), key in zip(bounds, keys, strict=True) if key[0]), size)
        self._working = torch.zeros(size, dtype=working_dtype, device=device)
        for parameter in parameters:
            view = self._flat_view(self._working, parameter)
            view.copy_(parameter.detach())
            parameter.data = view
        self._master = self._working if working_dtype == torch.float32 else self._working.float()
        self._gradients = torch.zeros(size, dtype=torch.float32, device=device)
        segments = []
        for start, end in bounds:
            segment = self._master[start:end]
            segment.grad = self._gradients[start:end]
            segments.append(segment)
        groups = [{"params": [segment], "weight_decay": 0.0 if key[1] else weight_decay, "segment": key}
                  for segment, key in zip(segments, keys, strict=True)]
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=True)
        self.max_grad_norm = max_grad_norm
        self._tensor_parallel_group = tensor_parallel_group
        self._data_parallel_group = data_parallel_group
        self._global_grad_norm: torch.Tensor | None = None
        self._parameters = parameters
        self._written: set[int] = set()  # the parameters whose slice holds this step's gradient so far
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, parameter: nn.Parameter) -> None:
        if id(parameter) in self._written:
            self.gradient_of(parameter).add_(parameter.grad)
        else:
            self.gradient_of(parameter).copy_(parameter.grad)
            self._written.add(id(parameter))
        parameter.grad = None

    def _zero_unwritten(self) -> None:
        """Zero the slices no gradient reached this step (they hold an earlier step's), before they are read."""
        if len(self._written) != len(self._slices):
            for parameter in self._parameters:
                if id(parameter) not in self._written:
                    self.gradient_of(parameter).zero_()
                    self._written.add(id(parameter))

    @property
    def padding(self) -> int:
        """Elements of each flat buffer that belong to no parameter (alignment); at most 63 a tensor."""
        return self._gradients.numel() - sum(place.numel for place in self._slices.values())

    @property
    def gradients(self) -> torch.Tensor:
        """All gradients, flat fp32 (with zero padding between slices), accumulated since the last step."""
        self._zero_unwritten()
        return self._gradients

    def gradient_of(self, parameter: nn.Parameter) -> torch.Tensor:
        return self._flat_view(self._gradients, parameter)

    def parameter_state(self, parameter: nn.Parameter) -> dict[str, torch.Tensor]:
        """Views of `parameter`'s fp32 master weight and Adam moments ("weight", "exp_avg", "exp_avg_sq")
        at its shape, for checkpoints; the moments are created (zeros) if no step has made them yet."""
        segment = self.param_groups[self._slices[id(parameter)].segment]["params"][0]
        state = self.state[segment]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(segment)
        return {"weight": self._view(segment, parameter),
                **{key: self._view(state[key], parameter) for key in ("exp_avg", "exp_avg_sq")}}

    def _view(self, segment: torch.Tensor, parameter: nn.Parameter) -> torch.Tensor:
        place = self._slices[id(parameter)]
        return segment[place.offset:place.offset + place.numel].view(place.shape)

    def _flat_view(self, flat: torch.Tensor, parameter: nn.Parameter) -> torch.Tensor:
        place = self._slices[id(parameter)]
        return flat[place.start:place.start + place.numel].view(place.shape)

    def load_working_weights(self) -> None:
        """The working weights from the master weights (after a checkpoint wrote the masters)."""
        if self._master is not self._working:
            self._working.copy_(self._master)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise NotImplementedError("FlatAdamW takes no closure")
        self._zero_unwritten()
        if self._data_parallel_group is not None and dist.get_world_size(self._data_parallel_group) > 1:
            # DeepSpeed's ZeRO-0 reduction: sum, then divide by the group size (engine.allreduce_bucket)
            dist.all_reduce(self._gradients, group=self._data_parallel_group)
            self._gradients.mul_(1.0 / dist.get_world_size(self._data_parallel_group))
        norm = self.gradient_norm()
        self._global_grad_norm = norm
        if self.max_grad_norm > 0:
            # DeepSpeed's and torch's clip coefficient, min(1, max_norm / (norm + 1e-6)), kept on the device
            self._gradients.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0))
        super().step()
        self.load_working_weights()
        self._written.clear()  # the next gradients are copied in, not added

    def gradient_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients: tensor-parallel slices on every TP rank, replicated ones once."""
        squared = torch.linalg.vector_norm(self._gradients[:self._split]).square()
        group = self._tensor_parallel_group
        if group is None or dist.get_rank(group) == 0:
            squared = squared + torch.linalg.vector_norm(self._gradients[self._split:]).square()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(squared, group=group)
        return squared.sqrt()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (a skipped step's): the next ones are copied over them."""
        self._written.clear()
        self._global_grad_norm = None
