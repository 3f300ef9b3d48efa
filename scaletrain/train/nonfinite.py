"""Non-finite losses and gradients: such a step is skipped on every rank and counted, a run that
keeps producing them stops, and no checkpoint is written with non-finite weights (issue 9).

As in Megatron-LM (`skipped_iter` in megatron/training/training.py), a skipped step still
consumes its batch and advances the step counter; only the update is dropped. DeepSpeed's ZeRO-1/2/3
optimizers already skip a step whose gradients overflow; ZeRO-0 and the pipeline engine do not,
and none of them looks at the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from scaletrain import upstream
from scaletrain.parallel.groups import any_rank
from scaletrain.train.flat_adamw import FlatAdamW
from scaletrain.train.spikes import LossSpikes

# A run that stopped because it diverged: not a temporary failure (75 asks a job script to requeue,
# and resubmitting the same command would diverge again), not a config error (2).
EXIT_DIVERGED = 3


class TrainingDiverged(RuntimeError):
    """The run stopped: too many non-finite steps in a row, or non-finite weights before a save."""


class NonFiniteGuard:
    """Decides before each optimizer step, identically on every rank, whether to skip its update.

    Both DeepSpeed engines (plain and pipeline) take every optimizer step through one engine method
    (`upstream.replace_model_step`); the guard runs first there and agrees on one flag over the world
    group: a non-finite micro-batch loss, or a non-finite gradient norm, on any rank. On a skip
    DeepSpeed still does its own bookkeeping (gradients cleared, step counted) but the torch
    optimizer's `step` does nothing, so weights, Adam moments and Adam's step count stay as they
    were. Steps that ZeRO skips itself (`overflow`, agreed over its groups, so `was_step_applied()`
    is False) count as skipped too.
    """

    def __init__(self, engine: Any, device: torch.device, spikes: LossSpikes | None = None) -> None:
        self._engine = engine
        self._device = device
        self.spikes = spikes
        self._nonfinite_loss = torch.zeros((), dtype=torch.bool, device=device)
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._losses_seen = 0
        self._inject = False
        self._inject_spike = 1.0
        self._skip_update = False
        self.skipped = False  # whether the last step's update was skipped
        self.spiked = False  # ... because its loss was a spike (train/spikes.py)
        self._take_model_step = upstream.replace_model_step(engine, self._guarded_model_step)
        self._optimizer_step = upstream.replace_optimizer_step(engine, self._guarded_optimizer_step)
        upstream.watch_pipeline_loss(engine, self.watch_loss)  # the pipeline's last stage computes the loss

    def start_step(self, inject_nonfinite_loss: bool = False, inject_spike: float = 1.0) -> None:
        """Forget losses seen since the last step (evaluation's); with inject_nonfinite_loss, this
        step's first micro-batch loss on this rank becomes NaN (train.inject_nonfinite_loss_at); with
        inject_spike, this step's micro-batch losses on this rank are multiplied by it (train.spike.inject_at)."""
        self._nonfinite_loss = torch.zeros((), dtype=torch.bool, device=self._device)
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self._device)
        self._losses_seen = 0
        self._inject = inject_nonfinite_loss
        self._inject_spike = inject_spike

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch loss on its way to backward: noted if non-finite, and summed for the spike rule
        (no host sync)."""
        if self._inject:
            self._inject = False
            loss = loss * float("nan")
        if self._inject_spike != 1.0:
            loss = loss * self._inject_spike
        self._nonfinite_loss = self._nonfinite_loss | ~torch.isfinite(loss.detach()).all()
        self._loss_sum = self._loss_sum + loss.detach().double().sum()
        self._losses_seen += 1
        return loss

    def _guarded_model_step(self, *args: Any, **kwargs: Any) -> None:
        local = self._nonfinite_loss | ~torch.isfinite(_norm(self._gradients(), self._device))
        self.spiked = False
        if self.spikes is None:
            self._skip_update = any_rank(local, self._device)
        else:
            self._skip_update, self.spiked = self._agree_with_spikes(local)
        try:
            self._take_model_step(*args, **kwargs)
        finally:
            self.skipped = self._skip_update or not self._engine.was_step_applied()
            self._skip_update = False

    def _agree_with_spikes(self, local_nonfinite: torch.Tensor) -> tuple[bool, bool]:
        """(skip, spiked) on every rank from one all-reduce over the world group, as any_rank's: the
        non-finite flags, and the step's loss as the loss records it, the mean over every micro-batch
        loss seen (the last pipeline stage's; TP ranks count theirs alike, so the mean is unchanged)."""
        figures = torch.stack([local_nonfinite.to(torch.float64), self._loss_sum,
                               torch.tensor(float(self._losses_seen), dtype=torch.float64, device=self._device)])
        dist.all_reduce(figures)
        nonfinite, loss_sum, seen = figures.tolist()
        if nonfinite or not seen:
            return bool(nonfinite), False
        spiked = self.spikes.judge(loss_sum / seen)
        return spiked, spiked

    def _gradients(self) -> Iterable[torch.Tensor | None]:
        """This rank's gradients: FlatAdamW's one flat buffer, or each parameter's `.grad`."""
        if isinstance(self._engine.optimizer, FlatAdamW):
            return [self._engine.optimizer.gradients]
        return (p.grad for p in self._engine.module.parameters())

    def _guarded_optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._skip_update:
            if isinstance(self._engine.optimizer, FlatAdamW):
                # DeepSpeed clears the parameters' `.grad`; FlatAdamW's accumulated ones are its own
                self._engine.optimizer.zero_grad()
            return None
        return self._optimizer_step(*args, **kwargs)


def weights_are_finite(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether every rank's weights are finite (under ZeRO-3 a rank holds a partition: `ds_tensor`)."""
    local = _norm((upstream.local_partition(p) for p in module.parameters()), device)
    return not any_rank(not bool(torch.isfinite(local)), device)


def _norm(tensors: Iterable[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The 2-norm of all tensors together: non-finite if any element is (or the sum overflows)."""
    norms = [torch.linalg.vector_norm(t.detach().float()) for t in tensors if t is not None and t.numel()]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=device)
