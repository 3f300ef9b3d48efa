"""The plain progress line `scaletrain train` writes to a log (SLURM, CI): loss, LR, speed, elapsed time, ETA."""

from __future__ import annotations

from scaletrain.config import Config, TrainConfig
from scaletrain.train.hooks.console import log_line as _log_line
from scaletrain.train.hooks.console import log_line_due as _log_line_due


def test_the_line_has_elapsed_time_and_an_eta_from_the_mean_step_time():
    record = {"step": 120, "loss": 5.12344, "lr": 1.2e-3, "grad_norm": 0.4567, "tokens_per_s": 8123.4}
    # a run resumed at step 100 has trained 20 steps in 65 s: 3.25 s a step, 180 steps left
    assert _log_line(record, 300, elapsed_s=65.0, steps_this_run=20) == (
        "train: step 120/300, loss 5.1234, lr 1.200e-03, grad_norm 0.457, 8,123 tok/s, elapsed 1m05s, eta 9m45s")
    first = {"step": 1, "loss": 9.0, "lr": 1e-5, "tokens_per_s": 500.0}
    assert _log_line(first, 1000, elapsed_s=7.2, steps_this_run=1).endswith(
        "500 tok/s, elapsed 0m07s, eta 1h59m")  # 7.2 s x 999 steps


def test_a_line_every_log_every_steps_and_at_the_first_and_last_step():
    config = Config(train=TrainConfig(steps=35))
    assert config.train.log_every == 10
    due = [step for step in range(1, 36) if _log_line_due(step, steps_this_run=step, config=config)]
    assert due == [1, 10, 20, 30, 35]
    resumed = [step for step in range(13, 36) if _log_line_due(step, steps_this_run=step - 12, config=config)]
    assert resumed == [13, 20, 30, 35]
