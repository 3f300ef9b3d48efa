"""The loss-spike rule (train/spikes.py) on curves: what it skips, what it must not."""

from __future__ import annotations

import math
import random

import pytest

from scaletrain.train.spikes import SpikeRule, TrailingWindow, spike_steps


def noisy_curve(seed: int, steps: int = 600, start: float = 7.0, end: float = 3.0, noise: float = 0.03) -> list[float]:
    """A power-law-ish falling loss with multiplicative noise, as small runs log it."""
    rng = random.Random(seed)
    return [(end + (start - end) / math.sqrt(1 + step / 10)) * (1 + rng.gauss(0, noise)) for step in range(steps)]


def test_a_robust_z_score_is_median_and_scaled_mad():
    window = TrailingWindow(SpikeRule(min_deviation=0.0), [1.0, 2.0, 3.0, 4.0, 100.0])
    # median 3, absolute deviations 2 1 0 1 97 -> MAD 1 -> sigma 1.4826: one outlier does not widen the band
    assert window.z_score(3.0 + 1.4826 * 6) == pytest.approx(6.0)
    assert window.z_score(0.0) < 0


def test_the_band_is_at_least_min_deviation_of_the_median():
    window = TrailingWindow(SpikeRule(skip_sigma=6.0, min_deviation=0.05), [5.0] * 10)
    assert not window.is_spike(5.0 * (1 + 6 * 0.05) - 1e-9)
    assert window.is_spike(5.0 * (1 + 6 * 0.05) + 1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_no_false_positives_on_noisy_falling_curves(seed: int):
    """5% noise (a small batch's) on a falling curve: nothing is skipped over 600 steps."""
    assert spike_steps(noisy_curve(seed, noise=0.05)) == []


def test_a_spike_is_skipped_and_stays_out_of_the_window():
    curve = noisy_curve(0)
    curve[300] *= 3
    curve[301] *= 2.5
    assert spike_steps(curve) == [300, 301]


def test_a_blow_up_from_the_second_step_is_caught():
    """train.lr=30 on the tiny GPT: 9 -> 1e8 with every number finite; a window of one step already says so."""
    assert spike_steps([9.1, 9.0, 3.2e3, 9.6e7, 4.0e7]) == [2, 3, 4]


def test_non_finite_losses_are_spikes_and_falling_losses_never_are():
    assert spike_steps([5.0, 4.9, math.nan, math.inf, 4.8]) == [2, 3]
    assert spike_steps([10.0, 5.0, 1.0, 0.1, 0.001]) == []
