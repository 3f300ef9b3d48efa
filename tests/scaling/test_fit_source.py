"""`scaletrain fit` end to end: a CSV and a sweep directory in, fit.json + four plots + the summary out;
each bad input fails with one message naming it and leaves nothing on disk."""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Callable
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from scaletrain.scaling import fit_inputs, fit_source
from scaletrain.scaling.fit import ParametricFit, fit_isoflop, fit_parametric
from scaletrain.scaling.fit_arguments import add_fit_arguments, parse_exclusion
from scaletrain.scaling.fit_plots import PLOT_FILES
from scaletrain.scaling.fit_source import fit_from_args, fit_sweep_directory
from scaletrain.scaling.laws import LawFit
from scaletrain.scaling.sweep.results import RESULT_COLUMNS

CHINCHILLA = ParametricFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
TRUE_A = CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta)
TOP_KEYS = {"source", "params_column", "num_points", "num_curves", "bootstrap", "seed", "target_flops", "approach1",
            "approach2", "approach3", "predictions", "skipped", "published", "objective", "huber_delta", "fingerprints",
            "flops_per_token", "noise", "laws", "law_skipped", "chosen", "bootstrap_failures", "exclusions", "interval",
            "from_spec"}
LAW_KEYS = {"formula", "citation", "constants", "constants_ci", "objective", "objective_value", "huber_delta",
            "huber_delta_how", "bootstrap_fits", "bootstrap_failures", "backtest", "interval_terms"}
FOLD_KEYS = {"budget_flops", "train_budgets", "train_configurations", "train_max_flops", "counted", "skipped", "failed",
             "ranking_correct", "points"}
CHOSEN_KEYS = {"form", "reason", "ties", "decision_folds", "scores", "prior", "loss_prediction", "huber_delta",
               "huber_delta_how"}
FORMS = {"chinchilla", "kaplan", "kaplan_e", "muennighoff"}
APPROACH_KEYS = {
    "approach1": {"a", "a_ci", "b", "b_ci", "n_coefficient", "d_coefficient", "bootstrap_fits", "smoothing",
                  "frontier"},
    "approach2": {"a", "a_ci", "b", "b_ci", "n_coefficient", "d_coefficient", "bootstrap_fits", "budgets",
                  "excluded_budgets"},
    "approach3": {"E", "A", "B", "alpha", "beta", "a", "b", "E_ci", "A_ci", "B_ci", "alpha_ci", "beta_ci", "a_ci",
                  "b_ci", "huber_delta", "objective", "starts", "bootstrap_starts", "bootstrap_fits"},
}
PREDICTION_KEYS = {"n_opt", "n_opt_ci", "d_opt", "d_opt_ci", "tokens_per_param", "tokens_per_param_ci"}
LADDER = Path(__file__).resolve().parents[2] / "experiments" / "ladder_english"
BUDGET_KEYS = {"flops", "budget", "sizes", "n_opt", "d_opt", "loss_min", "parabola", "parabola_tokens", "bracketed"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_fit_arguments(parser)
    return parser.parse_args(list(argv))


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def isoflop_rows(budgets: tuple[float, ...] = (1e19, 1e20, 1e21, 1e22), noise: float = 0.005) -> list[list[float]]:
    """Five sizes per budget, 1/4x to 4x the true optimum, on Chinchilla's law with 0.5% noise."""
    rng = np.random.default_rng(0)
    rows = []
    for flops in budgets:
        for factor in np.geomspace(0.25, 4, 5):
            n = float(CHINCHILLA.allocation(flops)[0]) * factor
            d = flops / (6 * n)
            rows.append([n, d, float(CHINCHILLA.loss(n, d)) * math.exp(rng.normal(0.0, noise))])
    return rows


def strict_json(path: Path) -> dict:
    def reject(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which strict JSON forbids")

    return json.loads(path.read_text(), parse_constant=reject)


def assert_valid_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert height > 300 and width > 400, path
    # Distinct colours: each 8-bit pixel packed into one integer (np.unique over rows of floats costs ~0.5 s a plot).
    channels = np.rint(image.reshape(-1, image.shape[-1]) * 255).astype(np.uint32)
    packed = sum(channels[:, channel] << (8 * channel) for channel in range(channels.shape[1]))
    assert len(np.unique(packed)) > 20, f"{path} is nearly blank"


def assert_interval(values: dict, key: str) -> None:
    interval = values[f"{key}_ci"]
    assert interval is not None and len(interval) == 2 and interval[0] <= interval[1], (key, interval)


def test_csv_round_trip(tmp_path: Path) -> None:
    rows = isoflop_rows()
    source = write_csv(tmp_path / "chinchilla.csv", ["params", "tokens", "loss"], rows)
    report = fit_from_args(parse(str(source), "--bootstrap", "20"))
    out = tmp_path / "chinchilla_fit"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chinchilla.csv", "chinchilla_fit"]  # no staging left
    assert sorted(p.name for p in out.iterdir()) == sorted(["fit.json", *PLOT_FILES])
    fit = strict_json(out / "fit.json")
    assert set(fit) == TOP_KEYS and fit["skipped"] == {}
    assert (fit["num_points"], fit["num_curves"], fit["bootstrap"]) == (20, 0, 20)
    assert fit["params_column"] == "active_params"  # the default N; a CSV without it reads params
    largest = max(6 * n * d for n, d, _ in rows)
    assert fit["target_flops"] == pytest.approx([10 * largest, 100 * largest])
    for approach, keys in APPROACH_KEYS.items():
        assert set(fit[approach]) == keys, approach
        for key in ("a", "b") if approach != "approach3" else ("E", "A", "B", "alpha", "beta", "a", "b"):
            assert_interval(fit[approach], key)
    assert all(set(budget) == BUDGET_KEYS for budget in fit["approach2"]["budgets"])
    assert len(fit["approach2"]["budgets"]) == 4 and fit["approach3"]["starts"] == 4500
    for approach in ("approach2", "approach3"):
        assert fit[approach]["a"] == pytest.approx(TRUE_A, abs=0.03)
    assert set(fit["laws"]) | set(fit["law_skipped"]) == FORMS and "muennighoff" in fit["law_skipped"]
    assert fit["fingerprints"] == "not recorded" and fit["flops_per_token"]["source"] == "6N"
    assert "C = 6ND" in fit["flops_per_token"]["description"] and fit["chosen"]["form"] in fit["laws"]
    assert set(fit["chosen"]) == CHOSEN_KEYS and fit["chosen"]["form"] in fit["chosen"]["ties"]
    assert fit["chosen"]["decision_folds"] == pytest.approx([1e21, 1e22]) and fit["exclusions"] == []
    assert fit["interval"]["forms"] == fit["chosen"]["ties"] and fit["interval"]["confidence"] == 0.9
    assert fit["interval"]["distance_from_flops"] == pytest.approx(1e22) and fit["interval"]["noise_sd"] > 0
    for law in fit["laws"].values():
        assert set(law) == LAW_KEYS and len(law["bootstrap_fits"]) + sum(law["bootstrap_failures"].values()) == 20
        # every fold predicts every budget from its origin on; the first (5 runs of one budget) cannot tell
        folds = law["backtest"]["folds"]
        assert [fold["budget_flops"] for fold in folds] == pytest.approx([1e20, 1e21, 1e22])
        assert [len(fold["points"]) for fold in folds] == [15, 10, 5] and all(set(f) == FOLD_KEYS for f in folds)
        assert set(folds[0]["points"][0]) == {"params", "tokens", "flops", "decades", "measured", "predicted",
                                              "error_pct"}
        assert [fold["counted"] for fold in folds] == [False, True, True]
        assert folds[0]["skipped"].startswith("5 distinct (N, D) to fit") and folds[0]["points"][0]["predicted"] is None
        assert [p["decades"] for p in folds[1]["points"]] == pytest.approx([1.0] * 5 + [2.0] * 5)
    chinchilla = fit["laws"]["chinchilla"]
    assert chinchilla["constants"]["alpha"] == pytest.approx(CHINCHILLA.alpha, abs=0.05)
    assert 0 < chinchilla["backtest"]["mean_abs_error_pct"] < 10 and chinchilla["huber_delta"] > 0
    assert fit["chosen"]["ties"] == ["chinchilla"] == fit["chosen"]["loss_prediction"]["forms"]
    assert fit["chosen"]["loss_prediction"]["how"] == "chinchilla's own fit" and "predicted losses" not in report
    for prediction in fit["predictions"]:
        assert set(prediction) == {"flops", *APPROACH_KEYS, "laws", "chosen"}
        chosen = prediction["chosen"]
        assert chosen["loss_interval"][0] < chosen["loss"] < chosen["loss_interval"][1]
        assert chosen["form_loss"] == prediction["laws"][chosen["form"]]["loss"]
        assert chosen["loss"] == chosen["form_loss"]  # no tie: the chosen form's own prediction
        assert chosen["loo_shift_pct"] >= 0 and chosen["form"] == fit["chosen"]["form"]
        for approach in APPROACH_KEYS:
            expected = PREDICTION_KEYS | ({"loss", "loss_ci"} if approach == "approach3" else set())
            assert set(prediction[approach]) == expected
            for key in ("n_opt", "d_opt", "tokens_per_param"):
                assert_interval(prediction[approach], key)
        n_opt, d_opt = (float(v) for v in CHINCHILLA.allocation(prediction["flops"]))
        assert prediction["approach3"]["n_opt"] == pytest.approx(n_opt, rel=0.3)
        assert prediction["approach3"]["n_opt"] * prediction["approach3"]["d_opt"] * 6 == pytest.approx(
            prediction["flops"])
    for name in PLOT_FILES:
        assert_valid_png(out / name)
    assert "Chinchilla approach 3 a=0.46 b=0.54" in report and "Kaplan et al. 2020 a=0.73" in report
    assert "3 parametric (sec. 3.3)" in report and f"wrote {out / 'fit.json'} and 5 plots" in report
    assert "on the FLOPs line C = 6ND" in report and f"chosen form: {fit['chosen']['form']}" in report
    assert "law form muennighoff skipped: muennighoff: no run records unique_tokens" in report
    assert "(90% prediction interval); leaving one run out moves it by up to" in report
    assert "prediction intervals (90%): the bootstrap refits of " in report
    assert "fold from C 1e+20 (fitted on 1 budget(s)) not counted: 5 distinct (N, D) to fit" in report


def test_same_seed_same_fit_and_out_replaced(tmp_path: Path) -> None:
    source = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss"], isoflop_rows(budgets=(1e19, 1e20, 1e21)))
    first, second = tmp_path / "first", tmp_path / "second"
    second.mkdir()
    (second / "fit.json").write_text("{}\n")  # an earlier fit's output, replaced as a whole
    (second / "stale.txt").write_text("from an earlier fit")
    for out, seed in ((first, "3"), (second, "3")):
        fit_from_args(parse(str(source), "--bootstrap", "12", "--seed", seed, "--out", str(out),
                            "--target-flops", "1e23"))
    assert (first / "fit.json").read_text() == (second / "fit.json").read_text()
    assert not (second / "stale.txt").exists()
    fit_from_args(parse(str(source), "--bootstrap", "12", "--seed", "4", "--out", str(second), "--target-flops",
                        "1e23"))
    assert strict_json(second / "fit.json")["approach3"]["alpha_ci"] != strict_json(first / "fit.json")[
        "approach3"]["alpha_ci"]


def test_approach_that_cannot_run_is_skipped_with_its_reason(tmp_path: Path) -> None:
    """A grid of 9 runs whose FLOPs never repeat: no IsoFLOP profile, but Approaches 1 and 3 run."""
    rows = [[n, d, float(CHINCHILLA.loss(n, d))] for n in (1e8, 3.3e8, 1.1e9) for d in (2e9, 1.3e10, 9e10)]
    source = write_csv(tmp_path / "grid.csv", ["params", "tokens", "loss"], rows)
    report = fit_from_args(parse(str(source), "--bootstrap", "0"))
    fit = strict_json(tmp_path / "grid_fit" / "fit.json")
    assert fit["approach2"] is None and fit["approach1"] is not None and fit["approach3"] is not None
    assert fit["skipped"]["approach2"].startswith("Approach 2 needs >= 3 model sizes in each of >= 2 FLOP budgets")
    assert all(p["approach2"] is None for p in fit["predictions"])
    assert fit["approach3"]["alpha_ci"] is None  # no bootstrap, no intervals
    assert "2 IsoFLOP (sec. 3.2)      skipped: Approach 2 needs" in report
    for name in PLOT_FILES:
        assert_valid_png(tmp_path / "grid_fit" / name)


def test_csv_budgets_from_the_budget_column_or_from_equal_flops(tmp_path: Path) -> None:
    """The budget column groups runs whatever their FLOPs; without it, runs share a budget when their FLOPs lie
    within 5% of the smallest FLOPs among them."""
    rows = [[n, d, float(CHINCHILLA.loss(n, d))] for n, d, _ in isoflop_rows(budgets=(1e19, 1e20), noise=0.0)]
    jitter = [1.0, 1.03, 0.99, 1.02, 1.2]  # within 5% of the smallest, but the last run is 20% off
    with_budget = [[n, d, loss, 6 * n * d * jitter[i % 5], 1e19 if i < 5 else 1e20]
                   for i, (n, d, loss) in enumerate(rows)]
    path = write_csv(tmp_path / "budget.csv", ["params", "tokens", "loss", "flops", "budget"], with_budget)
    data = fit_inputs.read_source(path)
    assert [p.budget for p in data.points] == [1e19] * 5 + [1e20] * 5
    assert [p.flops for p in data.points] == pytest.approx([row[3] for row in with_budget])
    assert [m.sizes for m in fit_isoflop(data.points).minima] == [5, 5]
    path = write_csv(tmp_path / "flops.csv", ["params", "tokens", "loss", "flops"], [r[:4] for r in with_budget])
    minima = fit_isoflop(fit_inputs.read_source(path).points).minima
    assert [m.sizes for m in minima] == [4, 4]  # the 20%-off runs form profiles of one run each, left out


def test_failure_while_writing_leaves_the_previous_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss"], isoflop_rows(budgets=(1e19, 1e20)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "fit.json").write_text("{}\n")

    def fail_midway(result, data, targets, directory: Path, check=None) -> list[Path]:
        (directory / "isoflop.png").write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(fit_source, "write_plots", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        fit_from_args(parse(str(source), "--bootstrap", "0", "--out", str(out)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "runs.csv"]
    assert [p.name for p in out.iterdir()] == ["fit.json"] and (out / "fit.json").read_text() == "{}\n"


def write_sweep(sweep: Path, rows: list[dict], curves: dict[str, list[dict]], fingerprints: bool = False) -> Path:
    """A sweep directory as `sweep run` leaves it; fingerprints: with the data_fingerprint column."""
    sweep.mkdir(parents=True, exist_ok=True)
    columns = [*RESULT_COLUMNS] + (["data_fingerprint"] if fingerprints and "data_fingerprint" not in RESULT_COLUMNS
                                   else [])
    with (sweep / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows({column: row.get(column, "") for column in columns} for row in rows)
    (sweep / "plan.json").write_text(json.dumps({"tokens_per_step": 256, "train_tokens": 2_000_000, "runs": []}))
    for name, records in curves.items():
        (sweep / "runs" / name).mkdir(parents=True)
        lines = [json.dumps(record) for record in records]
        (sweep / "runs" / name / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 9999, "lo')
    return sweep


def fake_run(name: str, non_embedding: float, budget: float, rng: np.random.Generator) -> tuple[dict, list[dict]]:
    """A finished run on Chinchilla's law: 200 logged steps (train loss with noise, an evaluation every
    50 steps), one step logged twice as after a resume, and a final line cut short by a kill."""
    tokens = budget / (6 * non_embedding)
    row = {"name": name, "status": "done", "budget": budget, "params": non_embedding + 65_536,
           "non_embedding_params": non_embedding, "tokens": tokens, "flops": budget,
           "flops_per_token": 6 * non_embedding, "val_loss": float(CHINCHILLA.loss(non_embedding, tokens)),
           "train_loss": float(CHINCHILLA.loss(non_embedding, tokens)), "steps": 200, "wall_s": 10.0}
    records = []
    for step in range(1, 201):
        seen = tokens * step / 200
        records.append({"step": step, "loss": float(CHINCHILLA.loss(non_embedding, seen)) + rng.normal(0, 0.02),
                        "tokens": seen, "lr": 1e-3})
        if step % 50 == 0:
            records.append({"step": step, "val_loss": float(CHINCHILLA.loss(non_embedding, seen))})
    records.insert(100, dict(records[99]))
    return row, records


def tiny_sweep(sweep: Path, fingerprints: dict[str, str] | None = None) -> Path:
    """Six finished runs (two budgets x three sizes, seed 7), a failed and a pending one; fingerprints:
    the data_fingerprint of each run (by name; the others get "f00d")."""
    rng = np.random.default_rng(0)
    rows, curves = [], {}
    for budget in (1e13, 4e13):
        for size in (1.5e5, 5e5, 1.5e6):
            row, records = fake_run(f"c{budget:.0e}-n{size:.0e}", size, budget, rng)
            row["seed"] = 7
            if fingerprints is not None:
                row["data_fingerprint"] = fingerprints.get(row["name"], "f00d")
            rows.append(row)
            curves[row["name"]] = records
    rows += [{"name": "broken", "status": "failed", "budget": 1e13},
             {"name": "later", "status": "pending", "budget": 4e13, "params": 1e6}]
    return write_sweep(sweep, rows, curves, fingerprints is not None)


def test_sweep_results_csv_read_directly(tmp_path: Path) -> None:
    """`scaletrain fit SWEEP/results.csv`: the done rows, val_loss as the loss, budget, FLOPs and seed from the
    row, and the sweep's train_tokens (plan.json beside it) as each run's unique tokens."""
    sweep = tiny_sweep(tmp_path / "sweep")
    runs = fit_inputs.read_runs(sweep / "results.csv")
    from_directory = fit_inputs.read_runs(sweep)
    assert runs.data.points == from_directory.data.points and len(runs.data.points) == 6
    assert runs.labels == [f"c{budget:.0e}-n{size:.0e}" for budget in (1e13, 4e13) for size in (1.5e5, 5e5, 1.5e6)]
    first = runs.data.points[0]
    assert (first.budget, first.flops, first.seed, first.unique_tokens) == (1e13, 1e13, 7, 2_000_000)
    assert first.loss == pytest.approx(float(CHINCHILLA.loss(1.5e5, 1e13 / (6 * 1.5e5))))  # the val_loss
    assert runs.fingerprint is None and all(curve is None for curve in runs.data.curves)
    report = fit_from_args(parse(str(sweep / "results.csv"), "--bootstrap", "0"))
    fit = strict_json(sweep / "results_fit" / "fit.json")
    assert fit["num_points"] == 6 and "fit of 6 runs" in report


def test_csv_seed_unique_tokens_and_fingerprint_columns(tmp_path: Path) -> None:
    rows = [[n, d, loss, 3, 5e9, "abc123"] for n, d, loss in isoflop_rows(budgets=(1e19,))]
    path = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss", "seed", "unique_tokens", "data_fingerprint"],
                     rows)
    runs = fit_inputs.read_runs(path)
    assert {(p.seed, p.unique_tokens) for p in runs.data.points} == {(3, 5e9)}
    assert runs.fingerprint == "abc123" and runs.labels[0] == "line 2"


def test_mixed_fingerprints_are_refused_naming_the_rows(tmp_path: Path) -> None:
    sweep = tiny_sweep(tmp_path / "sweep", {"c1e+13-n2e+05": "0ld5", "c4e+13-n2e+05": "0ld5"})
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError) as error:
        fit_from_args(parse(str(sweep), "--bootstrap", "0"))
    message = str(error.value)
    assert message == (
        f"{sweep / 'results.csv'}: these runs were trained on different data (tokenizer/manifest/validation set): "
        "rows c1e+13-n2e+05, c4e+13-n2e+05 have 0ld5, rows c1e+13-n5e+05, c1e+13-n2e+06, c4e+13-n5e+05, "
        "c4e+13-n2e+06 have f00d; refit each group separately or re-run the stale runs")
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_sweep_directory(tmp_path: Path) -> None:
    """Without --bootstrap a sweep directory is refitted with its own spec's resample count (sweep.json's
    fit.bootstrap), so `fit SWEEP --check` builds its intervals from as many refits as the sweep's fit."""
    sweep = tiny_sweep(tmp_path / "sweep")
    (sweep / "sweep.json").write_text(json.dumps({"spec": {"fit": {"bootstrap": 10}}, "working_dir": "."}))
    report = fit_from_args(parse(str(sweep), "--params-column", "non_embedding_params"))
    fit = strict_json(sweep / "fit" / "fit.json")
    assert fit["bootstrap"] == 10 and "10 bootstrap resamples" in report
    assert all(len(law["bootstrap_fits"]) + sum(law["bootstrap_failures"].values()) == 10
               for law in fit["laws"].values())
    assert (fit["num_points"], fit["num_curves"], fit["params_column"]) == (6, 6, "non_embedding_params")
    assert fit["target_flops"] == pytest.approx([4e14, 4e15])
    # Approach 1 reads final points only (fit.FitData.envelope_curves): two budgets give too few bins
    assert set(fit["skipped"]) == {"approach1"} and "got 2 bins" in fit["skipped"]["approach1"]
    assert fit["flops_per_token"]["source"] == "6N" and fit["fingerprints"] == "not recorded"  # C = 6ND here
    budgets = fit["approach2"]["budgets"]
    assert [b["budget"] for b in budgets] == [1e13, 4e13] and all(b["sizes"] == 3 for b in budgets)
    for budget in budgets:
        losses = [float(CHINCHILLA.loss(n, budget["budget"] / (6 * n))) for n in (1.5e5, 5e5, 1.5e6)]
        assert budget["loss_min"] <= min(losses) + 1e-6  # val_loss, whose parabola dips below the sampled points
    assert "fit of 6 runs" in report
    for name in PLOT_FILES:
        assert_valid_png(sweep / "fit" / name)


def test_sweep_directory_for_the_sweep_runner(tmp_path: Path) -> None:
    """fit_sweep_directory is what `scaletrain sweep run` and `sweep finalize` call at the end
    (sweep/finalize.py), with the spec's fit section: forms, objective, delta and exclusions."""
    sweep = tiny_sweep(tmp_path / "sweep")
    report, document, plots = fit_sweep_directory(sweep, tmp_path / "elsewhere", [1e15], 0, "params",
                                                  objective="huber", huber_delta=0.01, forms=["kaplan"],
                                                  exclude=["non_embedding_params > 1e6"])
    assert [p.name for p in plots] == list(PLOT_FILES) and all(p.parent == tmp_path / "elsewhere" for p in plots)
    assert document["target_flops"] == [1e15] and document["params_column"] == "params"
    assert json.loads((tmp_path / "elsewhere" / "fit.json").read_text()) == document
    assert document["exclusions"] == [{"rule": "non_embedding_params > 1e6", "removed": 2}]
    assert document["num_points"] == 4 and set(document["laws"]) == {"kaplan"} and document["huber_delta"] == 0.01
    assert document["laws"]["kaplan"]["huber_delta"] == 0.01 and document["objective"] == "huber"
    assert "at the target budgets" in report and "excluded by 'non_embedding_params > 1e6': 2 runs" in report


def test_a_sweep_directory_fits_with_its_recorded_spec_unless_overridden(tmp_path: Path) -> None:
    """`fit SWEEP` takes forms, objective, huber_delta, exclude (and bootstrap) from sweep.json's fit section
    where the command line does not give them, and says so; a least-squares override drops the spec's delta."""
    sweep = tiny_sweep(tmp_path / "sweep")
    recorded = {"bootstrap": 0, "forms": ["kaplan", "chinchilla"], "objective": "huber", "huber_delta": 0.01,
                "exclude": ["non_embedding_params > 1e6"], "params_column": "params"}
    (sweep / "sweep.json").write_text(json.dumps({"spec": {"fit": recorded}, "working_dir": "."}))
    report = fit_from_args(parse(str(sweep), "--out", str(tmp_path / "spec")))
    fit = strict_json(tmp_path / "spec" / "fit.json")
    assert fit["from_spec"] == {"file": str(sweep / "sweep.json"), "options": {
        "bootstrap": 0, "forms": ["kaplan", "chinchilla"], "objective": "huber", "huber_delta": 0.01,
        "exclude": ["non_embedding_params > 1e6"]}}
    assert set(fit["laws"]) | set(fit["law_skipped"]) == {"kaplan", "chinchilla"}  # chinchilla: 5 constants, 4 runs
    assert fit["huber_delta"] == 0.01 and fit["laws"]["kaplan"]["huber_delta"] == 0.01 and fit["num_points"] == 4
    assert fit["exclusions"] == [{"rule": "non_embedding_params > 1e6", "removed": 2}]
    assert (f"from the sweep's recorded spec ({sweep / 'sweep.json'}, fit section; options given on the command line "
            "override it): bootstrap 0; forms kaplan, chinchilla; objective huber; huber_delta 0.01; exclude "
            "'non_embedding_params > 1e6'") in report
    report = fit_from_args(parse(str(sweep), "--out", str(tmp_path / "given"), "--forms", "kaplan", "--objective",
                                 "least_squares", "--exclude", "non_embedding_params < 2e5", "--bootstrap", "0"))
    fit = strict_json(tmp_path / "given" / "fit.json")
    assert fit["from_spec"] is None and "recorded spec" not in report
    assert set(fit["laws"]) == {"kaplan"} and (fit["objective"], fit["huber_delta"]) == ("least_squares", "auto")
    assert fit["exclusions"] == [{"rule": "non_embedding_params < 2e5", "removed": 2}]
    fit_from_args(parse(str(sweep), "--out", str(tmp_path / "some"), "--huber-delta", "auto"))
    fit = strict_json(tmp_path / "some" / "fit.json")
    assert fit["huber_delta"] == "auto" and set(fit["from_spec"]["options"]) == {"bootstrap", "forms", "objective",
                                                                                  "exclude"}
    (sweep / "sweep.json").write_text(json.dumps({"spec": {"fit": {**recorded, "forms": ["kaplan", "hill"]}}}))
    with pytest.raises(ValueError) as error:
        fit_from_args(parse(str(sweep), "--out", str(tmp_path / "bad")))
    assert str(error.value).startswith(f"{sweep / 'sweep.json'} (the sweep's recorded spec): fit section: ")
    assert "hill: unknown law form" in str(error.value) and not (tmp_path / "bad").exists()
    fit_from_args(parse(str(sweep), "--out", str(tmp_path / "bad"), "--forms", "kaplan", "--bootstrap", "0",
                        "--objective", "huber", "--huber-delta", "auto", "--exclude", "non_embedding_params < 0"))
    assert strict_json(tmp_path / "bad" / "fit.json")["from_spec"] is None  # everything given: no spec read


def test_exclusions_remove_runs_and_are_recorded(tmp_path: Path) -> None:
    """--exclude "num_layers < 2" drops the one-layer shapes (here the smallest size at each budget);
    fit.json records each rule and the runs it removed, in order."""
    rows = isoflop_rows(budgets=(1e19, 1e20, 1e21))
    layers = [1, 2, 3, 4, 5] * 3
    source = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss", "num_layers"],
                       [[*row, depth] for row, depth in zip(rows, layers, strict=True)])
    report = fit_from_args(parse(str(source), "--bootstrap", "0", "--forms", "kaplan", "--exclude", "num_layers < 2",
                                 "num_layers == 5"))
    fit = strict_json(tmp_path / "runs_fit" / "fit.json")
    assert fit["exclusions"] == [{"rule": "num_layers < 2", "removed": 3}, {"rule": "num_layers == 5", "removed": 3}]
    assert fit["num_points"] == 9 and "excluded by 'num_layers < 2': 3 runs" in report
    kept = fit_inputs.read_runs(source, exclude=["num_layers < 2", "num_layers == 5"]).data.points
    assert sorted(p.params for p in kept) == sorted(row[0] for row, depth in zip(rows, layers, strict=True)
                                                    if 2 <= depth <= 4)


def test_exclusion_rules_parse() -> None:
    """parse_exclusion is what a sweep spec's fit.exclude is checked with: numbers with every operator,
    text with == and != only, and one ValueError naming the rule and the fix otherwise."""
    rule = parse_exclusion(" num_layers<=2 ")
    assert (rule.column, rule.operator, rule.value) == ("num_layers", "<=", 2.0)
    assert rule.excludes("2") and not rule.excludes("3")
    assert parse_exclusion("role != branch").excludes("stable") and not parse_exclusion("role != branch").excludes(
        "branch")
    with pytest.raises(ValueError, match="'abc' is not a number, which the rule compares it as"):
        rule.excludes("abc")
    for bad, fragment in (("num_layers ~ 2", "is not a rule; write COLUMN OP VALUE"),
                          ("num_layers <", "is not a rule"), ("name < abc", "< compares numbers and 'abc' is not one"),
                          ("loss == nan", "compares with nan")):
        with pytest.raises(ValueError) as error:
            parse_exclusion(bad)
        assert f"exclusion {bad!r}" in str(error.value) and fragment in str(error.value)


def test_held_out_check_writes_check_csv_and_the_numbers(tmp_path: Path) -> None:
    """--check: the chosen law's prediction for every held-out run, in check.csv, fit.json and the summary."""
    rows = isoflop_rows(budgets=(1e19, 1e20, 1e21, 1e22))
    source = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss"], rows[:15])
    held_out = write_csv(tmp_path / "held_out.csv", ["params", "tokens", "loss"], rows[15:])
    report = fit_from_args(parse(str(source), "--bootstrap", "12", "--forms", "chinchilla", "--check", str(held_out)))
    out = tmp_path / "runs_fit"
    with (out / "check.csv").open() as file:
        table = list(csv.DictReader(file))
    assert tuple(table[0]) == ("params", "tokens", "loss", "predicted", "lower", "upper") and len(table) == 5
    assert [float(row["loss"]) for row in table] == pytest.approx([row[2] for row in rows[15:]])
    fit = strict_json(out / "fit.json")
    check = fit["check"]
    assert check["form"] == "chinchilla" == fit["chosen"]["form"] and set(fit["laws"]) == {"chinchilla"}
    for row, point in zip(table, check["points"], strict=True):
        assert float(row["predicted"]) == pytest.approx(point["predicted"])
        assert float(row["lower"]) <= float(row["predicted"]) <= float(row["upper"])
        assert point["error_pct"] == pytest.approx(100 * (point["predicted"] - point["loss"]) / point["loss"])
    inside = sum(float(r["lower"]) <= float(r["loss"]) <= float(r["upper"]) for r in table)
    assert check["coverage"] == {"inside": inside, "with_interval": 5, "runs": 5}
    assert check["mean_abs_error_pct"] == pytest.approx(np.mean([abs(p["error_pct"]) for p in check["points"]]))
    assert check["mean_abs_error_pct"] < 5  # 0.5% noise on the true law, one budget beyond the fitted ones
    assert len(check["rankings"]) == 1 and check["rankings"][0]["budget"] is None
    assert check["rankings"][0]["tie_margin_log"] is None  # no seed repeats, no noise estimate: no ties
    (optimum,) = check["optima"]  # the five held-out sizes' parabola against the chosen law's N* at 1e22
    true_n = float(CHINCHILLA.allocation(1e22)[0])
    assert optimum["sizes"] == 5 and optimum["bracketed"] and optimum["flops"] == pytest.approx(1e22)
    assert optimum["measured_n"] == pytest.approx(true_n, rel=0.25) and optimum["predicted_n"] == pytest.approx(
        true_n, rel=0.25)
    ratio = optimum["measured_n"] / optimum["predicted_n"]
    assert optimum["ratio"] == pytest.approx(max(ratio, 1 / ratio))
    assert f"{inside} of 5 inside their interval" in report and "sizes at C 1e+22, best first" in report
    assert f"optimum at C 1e+22 (5 sizes): predicted N* {optimum['predicted_n']:.3g}, measured " in report
    assert f"{out / 'check.csv'}" in report
    for name in (*PLOT_FILES, "check.png"):
        assert_valid_png(out / name)


def test_under_a_tie_the_losses_are_the_tied_forms_mixture_median(tmp_path: Path) -> None:
    """The ladder experiment's forms tie (test_intervals.py); its 10x check runs are predicted by the median
    of the tied forms' mixture (each form's refits, read back from fit.json, weighing 1/3 in all), while N*,
    D* stay the chosen kaplan's; fit.json and the summary say so, naming the forms."""
    check = LADDER / "check" / "results_10x.csv"
    report = fit_from_args(parse(str(LADDER), "--bootstrap", "12", "--forms", "chinchilla", "kaplan", "kaplan_e",
                                 "--target-flops", "1e14", "--check", str(check), "--out", str(tmp_path / "fit")))
    fit = strict_json(tmp_path / "fit" / "fit.json")
    chosen, ties = fit["chosen"], ["chinchilla", "kaplan", "kaplan_e"]
    assert chosen["form"] == "kaplan" and sorted(chosen["ties"]) == ties == sorted(chosen["loss_prediction"]["forms"])
    assert chosen["loss_prediction"]["how"].startswith("the median of the tied forms' equal-weight mixture (")
    refits = {form: [LawFit(form, constants, 0.0) for constants in fit["laws"][form]["bootstrap_fits"]]
              for form in ties}

    def middle(params: float, tokens: float) -> float:
        """The median of the equal-weight mixture of the forms' refits."""
        values = np.concatenate([[refit.loss(params, tokens) for refit in group] for group in refits.values()])
        weights = np.concatenate([np.full(len(group), 1.0 / (3 * len(group))) for group in refits.values()])
        order = np.argsort(values)
        return float(values[order][np.searchsorted(np.cumsum(weights[order]), 0.5 - 1e-12)])

    (prediction,) = fit["predictions"]
    optimum = prediction["chosen"]
    assert (optimum["n_opt"], optimum["form_loss"]) == (prediction["laws"]["kaplan"]["n_opt"],
                                                        prediction["laws"]["kaplan"]["loss"])
    assert optimum["loss"] == pytest.approx(middle(optimum["n_opt"], optimum["d_opt"]), rel=1e-9)
    assert optimum["loss"] != pytest.approx(optimum["form_loss"], rel=1e-3)
    points = fit["check"]["points"]
    assert [p["predicted"] for p in points] == pytest.approx([middle(p["params"], p["tokens"]) for p in points])
    assert fit["check"]["predicted_by"] == chosen["loss_prediction"]["how"]
    forms = ", ".join(chosen["loss_prediction"]["forms"])
    assert f"held-out check of {len(points)} runs (the median of the tied forms' mixture: {forms};" in report
    assert "predicted losses (at the target budgets and of --check): the median of the tied forms'" in report
    assert f"at kaplan's N* and D*, the tied forms' mixture median ({forms}) predicts loss" in report


def test_held_out_runs_on_other_data_are_refused(tmp_path: Path) -> None:
    sweep = tiny_sweep(tmp_path / "sweep", {})
    held_out = write_csv(tmp_path / "held_out.csv", ["params", "tokens", "loss", "data_fingerprint"],
                         [[1e6, 1e8, 3.0, "beef"]])
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError) as error:
        fit_from_args(parse(str(sweep), "--bootstrap", "0", "--check", str(held_out)))
    assert str(error.value).startswith(f"--check {held_out}: these runs were trained on different data")
    assert "have f00d, rows held-out line 2 have beef; refit each group separately" in str(error.value)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_unbracketed_profiles_skip_approach_2_with_the_reason(tmp_path: Path) -> None:
    """The smallest size best at every budget, losses concave in ln N: no profile has a minimum. Approach 2
    is skipped with a reason that says what to train; the rest, fit.json and every plot are written."""
    rows = []
    for flops in (1e19, 1e20, 1e21):
        for n in np.geomspace(1e8, 1.6e9, 5):
            x = math.log(n / 1e8)
            rows.append([n, flops / (6 * n), 3.2 - 0.15 * math.log10(flops / 1e19) + 0.08 * x - 0.01 * x * x])
    source = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss"], rows)
    report = fit_from_args(parse(str(source), "--bootstrap", "0", "--forms", "chinchilla"))
    fit = strict_json(tmp_path / "runs_fit" / "fit.json")
    reason = fit["skipped"]["approach2"]
    assert reason.startswith("no IsoFLOP profile is bracketed: the smallest size is best at every budget; add "
                             "smaller sizes (Approach 2 needs >= 3 model sizes")
    assert fit["approach2"] is None and f"skipped: {reason}" in report and "math domain" not in report
    for name in PLOT_FILES:
        assert_valid_png(tmp_path / "runs_fit" / name)


def sweep_without_done(tmp_path: Path) -> list[str]:
    write_sweep(tmp_path / "sweep", [{"name": "a", "status": "failed"}, {"name": "b", "status": "pending"}], {})
    return [str(tmp_path / "sweep")]


def sweep_without_column(tmp_path: Path) -> list[str]:
    (tmp_path / "sweep").mkdir()
    write_csv(tmp_path / "sweep" / "results.csv", ["name", "status", "budget", "params", "tokens", "flops", "val_loss"],
              [["a", "done", "", 1e6, 1e8, 6e14, 3.0]])
    return [str(tmp_path / "sweep")]


def csv_source(header: list[str], rows: list[list]) -> Callable[[Path], list[str]]:
    return lambda tmp_path: [str(write_csv(tmp_path / "runs.csv", header, rows))]


GOOD = csv_source(["params", "tokens", "loss"], isoflop_rows(budgets=(1e19, 1e20)))
BAD_INPUTS = {
    "missing file": (lambda tmp_path: [str(tmp_path / "nope.csv")],
                     ["nope.csv does not exist", "sweep directory", "params,tokens,loss"]),
    "missing columns": (csv_source(["params", "loss"], [[1e8, 3.0]]),
                        ["lacks column(s) tokens", "found: params, loss", "needs columns params,tokens,loss"]),
    "non-numeric": (csv_source(["params", "tokens", "loss"], [[1e8, 1e9, 3.0], [2e8, 1e9, "abc"]]),
                    ["row at line 3: loss='abc' is not a positive number", "fix or remove the row"]),
    "non-positive": (csv_source(["params", "tokens", "loss"], [[1e8, -5, 3.0]]), ["line 2: tokens='-5'"]),
    "no rows": (csv_source(["params", "tokens", "loss"], []), ["has a header but no rows"]),
    "too few points": (csv_source(["params", "tokens", "loss"], [[1e8, 1e9, 3.0], [2e8, 1e9, 2.9]]),
                       ["2 runs are too few for any fit", "Approach 1 needs", ">= 3 bins",
                        "Approach 2 needs >= 3 model sizes in each of >= 2 FLOP budgets",
                        "Approach 3 needs >= 5 runs with distinct (N, D)"]),
    "no such params column": (lambda tmp_path: [*GOOD(tmp_path), "--params-column", "non_embedding_params"],
                              ["lacks column(s) non_embedding_params"]),
    "sweep without results": (lambda tmp_path: [str(tmp_path)], ["has no results.csv", "scaletrain sweep status"]),
    "sweep without done runs": (sweep_without_done, ["has no finished run (status done; found failed, pending)"]),
    "sweep without a column": (sweep_without_column, ["lacks column(s) flops_per_token"]),
    "negative bootstrap": (lambda tmp_path: [*GOOD(tmp_path), "--bootstrap", "-1"], ["--bootstrap -1 must be >= 0"]),
    "zero target": (lambda tmp_path: [*GOOD(tmp_path), "--target-flops", "1e23", "0"],
                    ["--target-flops 1e+23 0.0: every budget must be a positive number"]),
    "out is a file": (lambda tmp_path: [*GOOD(tmp_path), "--out", str(tmp_path / "runs.csv")],
                      ["--out", "runs.csv is a file; pass a directory"]),
    "out is not a fit": (lambda tmp_path: [*GOOD(tmp_path), "--out", str(tmp_path)],
                         ["holds files but no fit.json", "pass a new directory"]),
    "unknown form": (lambda tmp_path: [*GOOD(tmp_path), "--forms", "chinchilla", "hoffmann"],
                     ["--forms hoffmann: unknown law form(s); use some of chinchilla, kaplan"]),
    "delta without huber": (lambda tmp_path: [*GOOD(tmp_path), "--objective", "least_squares", "--huber-delta",
                                              "0.01"], ["--huber-delta 0.01 applies to --objective huber only"]),
    "missing held-out": (lambda tmp_path: [*GOOD(tmp_path), "--check", str(tmp_path / "nope.csv")],
                         ["--check: ", "nope.csv does not exist"]),
    "held-out without loss": (lambda tmp_path: [*GOOD(tmp_path), "--check", str(write_csv(
        tmp_path / "held.csv", ["params", "tokens"], [[1e8, 1e9]]))], ["--check: ", "held.csv lacks column(s) loss"]),
    "bad exclusion": (lambda tmp_path: [*GOOD(tmp_path), "--exclude", "num_layers => 2"],
                      ["exclusion 'num_layers => 2' is not a rule; write COLUMN OP VALUE"]),
    "exclusion on a missing column": (lambda tmp_path: [*GOOD(tmp_path), "--exclude", "num_layers < 2"],
                                      ["exclusion 'num_layers < 2': ", "has no column 'num_layers' (found: params, "
                                       "tokens, loss); name one of those"]),
    "exclusion of every run": (lambda tmp_path: [*GOOD(tmp_path), "--exclude", "params > 0"],
                               ["the exclusions params > 0 remove every run of", "loosen them"]),
    "exclusion on a blank cell": (lambda tmp_path: [*csv_source(["params", "tokens", "loss", "num_layers"], [
        [1e8, 1e9, 3.0, ""]])(tmp_path), "--exclude", "num_layers < 2"],
        ["exclusion 'num_layers < 2', ", "row at line 2: '' is not a number"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_the_culprit_and_writes_nothing(case: str, tmp_path: Path) -> None:
    make_args, fragments = BAD_INPUTS[case]
    argv = make_args(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError) as error:
        fit_from_args(parse(*argv))
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_the_fit_counts_a_mixture_of_experts_by_its_active_parameters(tmp_path: Path) -> None:
    """A MoE sweep's rows record the total (params, here 8x) and the active count: N is the active one, C
    defaults to 6 N_active D, and the compute-optimal N is active (Chinchilla's law holds in the active N
    here); --params-column params reads the totals instead."""
    rows = isoflop_rows()
    sparse = write_csv(tmp_path / "moe.csv", ["params", "active_params", "tokens", "loss"],
                       [[8 * n, n, d, loss] for n, d, loss in rows])
    points = fit_inputs.read_runs(sparse).data.points
    assert [(p.params, p.flops) for p in points] == [(n, pytest.approx(6 * n * d)) for n, d, _ in rows]
    assert [p.params for p in fit_inputs.read_runs(sparse, "params").data.points] == [8 * n for n, _, _ in rows]
    law = fit_parametric(*zip(*[(p.params, p.tokens, p.loss) for p in points], strict=True))
    assert law.allocation(1e23)[0] == pytest.approx(CHINCHILLA.allocation(1e23)[0], rel=0.2)


def test_results_written_before_active_counts_still_load(tmp_path: Path) -> None:
    """An old results.csv (no active columns) and a row whose active count is blank read N as the total:
    exact for the dense models they hold. The committed experiments' results load unchanged."""
    old_columns = [column for column in RESULT_COLUMNS if not column.startswith("active_")]
    sweep = tmp_path / "old"
    sweep.mkdir()
    with (sweep / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=old_columns)
        writer.writeheader()
        for budget in (1e13, 4e13):
            for size in (1.5e5, 5e5, 1.5e6):
                row, _ = fake_run(f"c{budget:.0e}-n{size:.0e}", size, budget, np.random.default_rng(0))
                writer.writerow({column: row.get(column, "") for column in old_columns})
    for column, total in (("active_params", "params"), ("active_non_embedding_params", "non_embedding_params")):
        runs = fit_inputs.read_runs(sweep / "results.csv", column)
        assert [p.params for p in runs.data.points] == \
            [p.params for p in fit_inputs.read_runs(sweep / "results.csv", total).data.points]
    blank = write_csv(tmp_path / "blank.csv", ["params", "active_params", "tokens", "loss"], [[1e6, "", 2e7, 3.0]])
    assert fit_inputs.read_runs(blank).data.points[0].params == 1e6
    committed = Path(__file__).resolve().parents[2] / "experiments" / "isoflop_english" / "results.csv"
    assert [p.params for p in fit_inputs.read_runs(committed).data.points] == \
        [p.params for p in fit_inputs.read_runs(committed, "params").data.points]
