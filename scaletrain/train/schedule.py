"""Learning-rate schedules: linear warmup, then cosine decay (GPT-3) or warmup-stable-decay (WSD)."""

from __future__ import annotations

import math

from scaletrain.config import TrainConfig


def learning_rate(step: int, train: TrainConfig) -> float:
    """LR used for the optimizer update that completes step `step + 1` (steps count from 0).

    A function of the step and the config alone, the warmup included (TrainConfig.resolved_warmup_steps:
    warmup_steps or warmup_fraction x steps, cut to fit the run), so a run resumed with another
    train.steps follows the schedule of its new length from the resumed step.
    """
    warmup_steps = train.resolved_warmup_steps
    if step < warmup_steps:
        return train.lr * (step + 1) / warmup_steps
    if train.lr_schedule == "wsd":
        return _warmup_stable_decay(step, train)
    return _cosine(step, train)


def _cosine(step: int, train: TrainConfig) -> float:
    """Cosine decay from lr to min_lr over the steps after warmup (GPT-3, Brown et al. 2020, app. B)."""
    warmup_steps = train.resolved_warmup_steps
    decay_steps = max(1, train.steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * cosine


def _warmup_stable_decay(step: int, train: TrainConfig) -> float:
    """Constant lr, then a cooldown to min_lr over the last train.cooldown_steps updates.

    WSD (Hu et al. 2024, MiniCPM, sec. 4; Hägele et al. 2024, "Scaling Laws and Compute-Optimal
    Training Beyond Fixed Training Durations", sec. 3): the LR before the cooldown does not depend
    on the run's length, so one run at constant LR, checkpointed, can be cooled down at several
    lengths, each equal to a fresh run of that length. Hägele et al. (fig. 4) find the "1-sqrt"
    shape, lr = min + (peak - min)(1 - sqrt(progress)), over 20% of the steps matches cosine.
    Progress counts like warmup, (updates into the cooldown + 1) / cooldown steps, so the first
    cooldown update is already below peak and the last one uses min_lr exactly.
    """
    decay_steps = train.cooldown_steps
    decay_start = train.steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return train.lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    remaining = 1.0 - math.sqrt(progress) if train.cooldown_shape == "sqrt" else 1.0 - progress
    return train.min_lr + (train.lr - train.min_lr) * remaining
