"""Learning-rate schedule: linear warmup, then cosine decay to min_lr (GPT-3, Brown et al. 2020, app. B)."""

from __future__ import annotations

import math

from scaletrain.config import TrainConfig


def learning_rate(step: int, train: TrainConfig) -> float:
    """LR used for the optimizer update that completes step `step + 1` (steps count from 0)."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * cosine
