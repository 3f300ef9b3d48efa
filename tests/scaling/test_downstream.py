"""The ladder's downstream prediction (downstream.py): on synthetic runs from a known task-loss law and a known
sigmoid with noise, the two steps recover the sigmoid and predict held-out runs within their intervals; a metric at
chance is reported, not fitted; sweeps record the runs' task metrics in results.csv and `fit` reads them."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from scaletrain.scaling import fit_inputs
from scaletrain.scaling.downstream import Sigmoid, fit_task, recorded_metrics, task_loss_metric
from scaletrain.scaling.fit import ParametricFit, Point
from scaletrain.scaling.fit_source import FitOptions, run_fit
from scaletrain.scaling.sweep.results import result_row, write_results_csv

VAL_LAW = ParametricFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
TASK_LAW = ParametricFit(E=0.5, A=20.0, B=50.0, alpha=0.3, beta=0.3)  # the task's gold-continuation loss
ACCURACY = Sigmoid(a=-0.7, midpoint=0.9, k=12.0, b=0.95)  # from 0.95 (a perfect model) to 0.25 (chance)
SIZES = (1e6, 2.5e6, 6e6, 1.5e7, 4e7)
TOKENS_PER_PARAM = (10, 20, 40, 80)
HELD_OUT = ((8e7, 20), (1.5e8, 10), (1e8, 40))
LOSS_NOISE, ACCURACY_NOISE = 0.01, 0.01  # sd of ln L and of the accuracy


def synthetic_runs(rng: np.random.Generator, shapes: list[tuple[float, float]],
                   accuracy: Sigmoid | None = ACCURACY) -> tuple[list[Point], list[dict[str, float]]]:
    """Runs of (N, tokens per parameter) with the task loss from TASK_LAW and the accuracy from `accuracy` (None:
    chance, 0.25), each with noise; the loss on the validation set from Chinchilla's law."""
    points, values = [], []
    for params, ratio in shapes:
        tokens = params * ratio
        task_loss = float(TASK_LAW.loss(params, tokens)) * math.exp(rng.normal(0, LOSS_NOISE))
        mean = 0.25 if accuracy is None else float(accuracy(task_loss))
        points.append(Point(params, tokens, 6 * params * tokens, float(VAL_LAW.loss(params, tokens))))
        values.append({"next/gold_loss": task_loss, "next/acc": mean + rng.normal(0, ACCURACY_NOISE)})
    return points, values


def ladder() -> list[tuple[float, float]]:
    return [(params, ratio) for params in SIZES for ratio in TOKENS_PER_PARAM]


def test_the_ladder_recovers_a_known_sigmoid_and_predicts_held_out_runs() -> None:
    points, values = synthetic_runs(np.random.default_rng(0), ladder())
    task = fit_task("next/acc", "gold_loss", points, values, bootstrap=50, seed=0)
    assert not isinstance(task, str) and task.sigmoid is not None
    fitted = task.sigmoid
    assert fitted.a == pytest.approx(ACCURACY.a, abs=0.1) and fitted.b == pytest.approx(ACCURACY.b, abs=0.05)
    assert fitted.midpoint == pytest.approx(ACCURACY.midpoint, abs=0.05)
    assert fitted.k == pytest.approx(ACCURACY.k, rel=0.35)
    assert task.law.constants["alpha"] == pytest.approx(TASK_LAW.alpha, abs=0.1)
    assert task.p_value < 1e-6 and task.metric_sd == pytest.approx(ACCURACY_NOISE, rel=0.6)
    assert len(task.refits) + task.failures == 50 and len(task.refits) >= 40

    held_points, held_values = synthetic_runs(np.random.default_rng(1), list(HELD_OUT))
    for point, measured in zip(held_points, held_values, strict=True):
        row = task.predict(point.params, point.tokens, 0.9, seed=0)
        low, high = row["interval"]
        assert low <= measured["next/acc"] <= high
        assert row["value"] == pytest.approx(float(ACCURACY(TASK_LAW.loss(point.params, point.tokens))), abs=0.03)
        assert row["task_loss"] == pytest.approx(float(TASK_LAW.loss(point.params, point.tokens)), rel=0.03)


def test_accuracy_at_chance_is_reported_and_the_task_loss_still_predicted() -> None:
    points, values = synthetic_runs(np.random.default_rng(2), ladder(), accuracy=None)
    task = fit_task("next/acc", "gold_loss", points, values, bootstrap=20, seed=0)
    assert not isinstance(task, str) and task.sigmoid is None
    assert "does not move with the task loss" in task.sigmoid_skipped and task.p_value > 0.05
    row = task.predict(1e8, 2e9, 0.9, seed=0)
    assert row["value"] is None and row["interval"] is None
    assert row["task_loss"] == pytest.approx(float(TASK_LAW.loss(1e8, 2e9)), rel=0.03)
    low, high = row["task_loss_interval"]
    assert low < row["task_loss"] < high


def test_too_few_runs_are_a_reason_not_a_crash() -> None:
    points, values = synthetic_runs(np.random.default_rng(3), ladder()[:4])
    assert "needs >= 5" in fit_task("next/acc", "gold_loss", points, values, bootstrap=0, seed=0)


def write_runs_csv(path: Path, points: list[Point], values: list[dict[str, float]]) -> Path:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["params", "tokens", "loss", "downstream/next/acc", "downstream/next/gold_loss"])
        for point, recorded in zip(points, values, strict=True):
            writer.writerow([point.params, point.tokens, point.loss, recorded["next/acc"],
                             recorded["next/gold_loss"]])
    return path


def test_fit_predicts_the_task_metrics_and_checks_them_on_held_out_runs(tmp_path: Path) -> None:
    """`scaletrain fit RUNS --check HELDOUT`: every recorded task metric (the accuracy by both steps, the gold loss
    by its law alone) predicted at the target budgets' N*, D* and at the held-out runs, in fit.json's
    `downstream` and the summary."""
    points, values = synthetic_runs(np.random.default_rng(0), ladder())
    source = write_runs_csv(tmp_path / "runs.csv", points, values)
    held = write_runs_csv(tmp_path / "held.csv", *synthetic_runs(np.random.default_rng(1), list(HELD_OUT)))
    report, document, _ = run_fit(source, tmp_path / "fit", FitOptions(bootstrap=20, forms=("chinchilla",),
                                                                        check=held))
    stored = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert stored["downstream"] == document["downstream"]
    tasks = document["downstream"]["tasks"]
    assert set(tasks) == {"next/acc", "next/gold_loss"}
    accuracy, gold = tasks["next/acc"], tasks["next/gold_loss"]
    assert accuracy["task_loss_metric"] == "gold_loss" and accuracy["sigmoid"]["p_value"] < 1e-6
    assert gold["sigmoid"] is None and gold["sigmoid_skipped"] is None
    for prediction in accuracy["predictions"]:
        assert 0.25 < prediction["value"] < 0.95 and prediction["interval"][0] < prediction["value"]
    assert accuracy["check"]["coverage"] == {"inside": 3, "with_interval": 3, "runs": 3}
    assert accuracy["check"]["mean_abs_error"] < 0.03
    assert gold["check"]["coverage"]["runs"] == 3
    percents = [point["error_pct"] for point in gold["check"]["points"]]
    assert [point["error_pct"] for point in gold["check"]["points"]] == pytest.approx(
        [100 * (point["predicted"] - point["measured"]) / point["measured"] for point in gold["check"]["points"]])
    assert gold["check"]["mean_abs_error_pct"] == pytest.approx(np.mean(np.abs(percents)))
    assert gold["check"]["mean_signed_error_pct"] == pytest.approx(np.mean(percents))
    assert gold["check"]["max_abs_error_pct"] == pytest.approx(np.max(np.abs(percents)))
    assert "next/acc: step 1 on 20 runs" in report and "held-out check of 3 runs" in report
    assert (f"({gold['check']['mean_abs_error_pct']:.2f}%, signed {gold['check']['mean_signed_error_pct']:+.2f}%, "
            f"largest |error| {gold['check']['max_abs_error_pct']:.2f}%)") in report


def test_the_local_tasks_accuracies_are_fitted_on_their_gold_loss(tmp_path: Path) -> None:
    """The metrics the local tasks record (configs/eval_tasks/): the next-line and cloze tasks' accuracies are a
    sigmoid of their gold_loss (metrics.py), and a loss is its own task loss."""
    local = {"shakespeare_next_line": ("acc", "acc_norm", "gold_loss"),
             "shakespeare_cloze": ("acc", "perplexity", "gold_loss"),
             "shakespeare_passages": ("bits_per_byte", "byte_perplexity", "word_perplexity")}
    columns = [f"downstream/{task}/{metric}" for task, metrics in local.items() for metric in metrics]
    path = tmp_path / "runs.csv"
    path.write_text(",".join(["params", "tokens", "loss", *columns]) + "\n" + ",".join(
        ["1e6", "2e7", "3.5", *["0.5"] * len(columns)]) + "\n")
    runs = fit_inputs.read_runs(path)
    assert {name: task_loss_metric(name, runs, None) for name in recorded_metrics(runs)} == {
        "shakespeare_next_line/acc": "gold_loss", "shakespeare_next_line/acc_norm": "gold_loss",
        "shakespeare_next_line/gold_loss": "gold_loss", "shakespeare_cloze/acc": "gold_loss",
        "shakespeare_cloze/perplexity": "perplexity", "shakespeare_cloze/gold_loss": "gold_loss",
        "shakespeare_passages/bits_per_byte": "bits_per_byte", "shakespeare_passages/byte_perplexity":
            "byte_perplexity", "shakespeare_passages/word_perplexity": "word_perplexity"}


def test_an_unrecorded_task_metric_is_refused_before_the_fit(tmp_path: Path) -> None:
    points, values = synthetic_runs(np.random.default_rng(0), ladder())
    source = write_runs_csv(tmp_path / "runs.csv", points, values)
    with pytest.raises(ValueError, match=r"next/acc_norm: no fitted run records .*recorded: next/acc, next/gold_loss"):
        run_fit(source, tmp_path / "fit", FitOptions(bootstrap=0, task_metrics=("next/acc_norm",)))
    assert not (tmp_path / "fit").exists()


def test_results_csv_records_the_final_downstream_metrics(tmp_path: Path) -> None:
    """A finished run's eval/downstream/TASK/METRIC from summary.json, else from metrics.jsonl at its final step
    (never an earlier step's), become downstream/TASK/METRIC columns that `fit` reads."""
    runs = tmp_path / "runs"
    summaries = {"a": {"step": 10, "tokens": 100, "flops": 6e8, "val_loss": 3.0, "eval/downstream/next/acc": 0.4},
                 "b": {"step": 10, "tokens": 100, "flops": 6e8, "val_loss": 3.0},
                 "c": {"step": 10, "tokens": 100, "flops": 6e8, "val_loss": 3.0}}
    logs = {"b": [{"step": 10, "loss": 3.1}, {"step": 10, "eval/downstream/next/acc": 0.3,
                                                "eval/downstream/time_s": 2.5}],
            "c": [{"step": 5, "eval/downstream/next/acc": 0.2}, {"step": 10, "loss": 3.1}]}
    for name, summary in summaries.items():
        (runs / name).mkdir(parents=True)
        (runs / name / "summary.json").write_text(json.dumps(summary))
        (runs / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in logs.get(name, [])) + "\n")
    rows = [result_row({"name": name, "params": 1e6, "active_params": 1e6}, runs / name) for name in summaries]
    assert [row.get("downstream/next/acc") for row in rows] == [0.4, 0.3, None]
    path = write_results_csv(tmp_path, rows)
    with path.open() as file:
        header = next(csv.reader(file))
    assert header[-2:] == ["downstream/next/acc", "downstream/time_s"]
    read = fit_inputs.read_runs(path)
    assert read.task_values == [{"next/acc": 0.4}, {"next/acc": 0.3, "time_s": 2.5}, {}]
    assert recorded_metrics(read) == ["next/acc"]
