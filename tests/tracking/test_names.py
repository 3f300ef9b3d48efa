"""Trackers get namespaced names; metrics.jsonl's flat names map onto them one to one."""

from __future__ import annotations

from scaletrain.tracking.names import TRACKER_NAMES, tracker_values


def test_training_and_speed_metrics_go_under_train_and_perf():
    record = {"step": 7, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.9, "skipped_steps": 0, "tokens": 1792,
              "tokens_per_s": 900.0, "step_time_s": 0.25, "mfu": 0.4, "data_wait_fraction": 0.01}
    assert tracker_values(record) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.9, "train/skipped_steps": 0, "train/tokens": 1792,
        "perf/tokens_per_s": 900.0, "perf/step_time_s": 0.25, "perf/mfu": 0.4, "perf/data_wait_fraction": 0.01}


def test_validation_metrics_go_under_eval_with_a_blends_datasets_last():
    record = {"step": 10, "val_loss": 3.0, "val_masked_accuracy": 0.2, "val_loss/wiki": 2.8, "val_loss/web": 3.1}
    assert tracker_values(record) == {
        "eval/loss": 3.0, "eval/masked_accuracy": 0.2, "eval/loss/wiki": 2.8, "eval/loss/web": 3.1}


def test_no_two_flat_names_share_a_tracker_name():
    assert len(set(TRACKER_NAMES.values())) == len(TRACKER_NAMES)
