"""Loss spikes with finite numbers (issue 37): a step whose loss stands far above its recent past is
skipped, and a run that keeps spiking has diverged.

Non-finite losses are caught by train/nonfinite.py; a learning rate too high for the model blows the
loss up by orders of magnitude while every number stays finite (9 -> 1e8 at train.lr=30 on the tiny
GPT), and large runs meet milder spikes of the same kind (PaLM, Chowdhery et al. 2022, sec. 5.1: about
20 in a 540B run; OLMo 2, Team OLMo 2025, sec. 3: spikes are the main failure of long runs). OLMo-core
skips an update whose loss or gradient norm is more than 6 standard deviations above its trailing
window of 128 steps (`SkipStepOptimizer`, `sigma_factor=6`, `rolling_interval_length=128`). We do the
same with the loss, with two differences:

- Robust statistics: the window's median and its median absolute deviation (x 1.4826, a normal
  distribution's sigma), so one spike in the window does not widen the band that should catch the next;
  and a skipped loss never enters the window.
- Warm-up aware: the band's width is at least `min_deviation` x the median, and the rule applies from
  the second step on. A fresh model's loss barely moves over its first steps, so a window of a few
  steps already says what a normal loss is; the floor keeps a nearly flat window (a few steps, or a
  loss on a plateau) from calling noise a spike. OLMo-core's rule waits for half a window (64 steps),
  by when a learning rate that blows the model up has long done so.

Why the loss alone decides the skip: it is known on every rank before the update in every layout (the
guard agrees on it with the non-finite flag in one all-reduce: train/nonfinite.py), where the global
gradient norm is computed inside DeepSpeed's ZeRO optimizers' step, after the point of no return. The
gradient norm's z-score against its own window is logged (`spike/grad_norm_z`) for the record.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from scaletrain.config import SpikeConfig
from scaletrain.train.state import TrainState

# a normal distribution's standard deviation is 1.4826 median absolute deviations
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class SpikeRule:
    """train.spike's detection settings (config.py SpikeConfig)."""

    skip_sigma: float = 6.0
    window: int = 128
    min_deviation: float = 0.05


class TrailingWindow:
    """The last `rule.window` accepted values, and a new value's robust z-score against them."""

    def __init__(self, rule: SpikeRule, values: Iterable[float] = ()) -> None:
        self.rule = rule
        self.values: deque[float] = deque(values, maxlen=rule.window)

    def z_score(self, value: float) -> float:
        """(value - median) / max(1.4826 MAD, min_deviation x |median|); nan while the window is empty."""
        if not self.values:
            return math.nan
        ordered = sorted(self.values)
        median = _median(ordered)
        deviation = _median(sorted(abs(item - median) for item in ordered)) * MAD_TO_SIGMA
        deviation = max(deviation, self.rule.min_deviation * abs(median), 1e-12)
        return (value - median) / deviation

    def is_spike(self, value: float) -> bool:
        """Above the band, or not finite; a value below the window is progress, never a spike."""
        return not math.isfinite(value) or self.z_score(value) > self.rule.skip_sigma

    def accept(self, value: float) -> None:
        self.values.append(value)


class LossSpikes:
    """The loop's detector: judges each step's loss, agreed over the world group before the update
    (train/nonfinite.py NonFiniteGuard), and keeps the two trailing windows in the run's TrainState, which
    checkpoints carry, so a resumed run judges as the uninterrupted one."""

    def __init__(self, rule: SpikeRule, state: TrainState) -> None:
        self.rule, self._state = rule, state
        self.loss_z = math.nan

    @classmethod
    def for_run(cls, config: SpikeConfig, state: TrainState) -> LossSpikes | None:
        """The rule train.spike asks for; None when skip_sigma is null (off)."""
        if config.skip_sigma is None:
            return None
        return cls(SpikeRule(config.skip_sigma, config.window, config.min_deviation), state)

    def judge(self, loss: float) -> bool:
        """Whether this step's update is to be skipped as a spike; an accepted loss joins the window."""
        window = TrailingWindow(self.rule, self._state.loss_window)
        self.loss_z = window.z_score(loss)
        if window.is_spike(loss):
            return True
        window.accept(loss)
        self._state.loss_window = list(window.values)
        return False

    def record(self, record: dict[str, float], skipped: bool) -> None:
        """The step's z-scores into its metrics record (spike/loss_z, spike/grad_norm_z); an applied step's
        gradient norm joins its window."""
        if math.isfinite(self.loss_z):
            record["spike/loss_z"] = self.loss_z
        norm = record.get("grad_norm")
        if norm is None:
            return
        window = TrailingWindow(self.rule, self._state.grad_norm_window)
        z = window.z_score(norm)
        if math.isfinite(z):
            record["spike/grad_norm_z"] = z
        if not skipped and math.isfinite(norm):
            window.accept(norm)
            self._state.grad_norm_window = list(window.values)


class Rewind(Exception):  # noqa: N818 (a request to the loop, not an error)
    """A divergence the run rewinds from (train.spike.rewind): raised by DivergenceStop at the end of the
    streak's last step, handled by the loop (train/loop.py _rewind)."""

    def __init__(self, first_spike: int, last_spike: int) -> None:
        super().__init__(f"steps {first_spike}-{last_spike} spiked")
        self.first_spike, self.last_spike = first_spike, last_spike


def spike_steps(losses: Iterable[float], rule: SpikeRule = SpikeRule()) -> list[int]:
    """The indices of `losses` (one per step, in order) that the loop would have skipped: the replay of a
    finished run's curve (metrics.jsonl) under `rule`, for false positives."""
    window, skipped = TrailingWindow(rule), []
    for index, loss in enumerate(losses):
        if window.is_spike(loss):
            skipped.append(index)
        else:
            window.accept(loss)
    return skipped


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
