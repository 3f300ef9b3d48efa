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

from scaletrain.scaling import fit_source
from scaletrain.scaling.fit import ParametricFit, fit_isoflop
from scaletrain.scaling.fit_arguments import add_fit_arguments
from scaletrain.scaling.fit_plots import PLOT_FILES
from scaletrain.scaling.fit_source import fit_from_args, fit_sweep_directory
from scaletrain.scaling.sweep.results import RESULT_COLUMNS

CHINCHILLA = ParametricFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
TRUE_A = CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta)
TOP_KEYS = {"source", "params_column", "num_points", "num_curves", "bootstrap", "seed", "target_flops", "approach1",
            "approach2", "approach3", "predictions", "skipped", "published"}
APPROACH_KEYS = {
    "approach1": {"a", "a_ci", "b", "b_ci", "n_coefficient", "d_coefficient", "bootstrap_fits", "smoothing",
                  "frontier"},
    "approach2": {"a", "a_ci", "b", "b_ci", "n_coefficient", "d_coefficient", "bootstrap_fits", "budgets",
                  "excluded_budgets"},
    "approach3": {"E", "A", "B", "alpha", "beta", "a", "b", "E_ci", "A_ci", "B_ci", "alpha_ci", "beta_ci", "a_ci",
                  "b_ci", "huber_delta", "objective", "starts", "bootstrap_starts", "bootstrap_fits"},
}
PREDICTION_KEYS = {"n_opt", "n_opt_ci", "d_opt", "d_opt_ci", "tokens_per_param", "tokens_per_param_ci"}
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
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20, f"{path} is nearly blank"


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
    assert (fit["num_points"], fit["num_curves"], fit["bootstrap"], fit["params_column"]) == (20, 0, 20, "params")
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
    for prediction in fit["predictions"]:
        assert set(prediction) == {"flops", *APPROACH_KEYS}
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
    assert "3 parametric (sec. 3.3)" in report and f"wrote {out / 'fit.json'} and 4 plots" in report


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
    data = fit_source.read_source(path)
    assert [p.budget for p in data.points] == [1e19] * 5 + [1e20] * 5
    assert [p.flops for p in data.points] == pytest.approx([row[3] for row in with_budget])
    assert [m.sizes for m in fit_isoflop(data.points).minima] == [5, 5]
    path = write_csv(tmp_path / "flops.csv", ["params", "tokens", "loss", "flops"], [r[:4] for r in with_budget])
    minima = fit_isoflop(fit_source.read_source(path).points).minima
    assert [m.sizes for m in minima] == [4, 4]  # the 20%-off runs form profiles of one run each, left out


def test_failure_while_writing_leaves_the_previous_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss"], isoflop_rows(budgets=(1e19, 1e20)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "fit.json").write_text("{}\n")

    def fail_midway(result, data, targets, directory: Path) -> list[Path]:
        (directory / "isoflop.png").write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(fit_source, "write_plots", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        fit_from_args(parse(str(source), "--bootstrap", "0", "--out", str(out)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "runs.csv"]
    assert [p.name for p in out.iterdir()] == ["fit.json"] and (out / "fit.json").read_text() == "{}\n"


def write_sweep(sweep: Path, rows: list[dict], curves: dict[str, list[dict]]) -> Path:
    sweep.mkdir(parents=True, exist_ok=True)
    with (sweep / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=RESULT_COLUMNS)
        writer.writeheader()
        writer.writerows({column: row.get(column, "") for column in RESULT_COLUMNS} for row in rows)
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


def tiny_sweep(sweep: Path) -> Path:
    rng = np.random.default_rng(0)
    rows, curves = [], {}
    for budget in (1e13, 4e13):
        for size in (1.5e5, 5e5, 1.5e6):
            row, records = fake_run(f"c{budget:.0e}-n{size:.0e}", size, budget, rng)
            rows.append(row)
            curves[row["name"]] = records
    rows += [{"name": "broken", "status": "failed", "budget": 1e13},
             {"name": "later", "status": "pending", "budget": 4e13, "params": 1e6}]
    return write_sweep(sweep, rows, curves)


def test_sweep_directory(tmp_path: Path) -> None:
    sweep = tiny_sweep(tmp_path / "sweep")
    report = fit_from_args(parse(str(sweep), "--bootstrap", "10", "--params-column", "non_embedding_params"))
    fit = strict_json(sweep / "fit" / "fit.json")
    assert (fit["num_points"], fit["num_curves"], fit["params_column"]) == (6, 6, "non_embedding_params")
    assert fit["target_flops"] == pytest.approx([4e14, 4e15]) and fit["skipped"] == {}
    frontier = fit["approach1"]["frontier"]
    assert len(frontier) > 6  # the training curves' points, not only the 6 final ones
    for point in frontier:
        assert point["params"] in (1.5e5, 5e5, 1.5e6)
        assert point["flops"] == pytest.approx(point["tokens"] * 6 * point["params"])
    budgets = fit["approach2"]["budgets"]
    assert [b["budget"] for b in budgets] == [1e13, 4e13] and all(b["sizes"] == 3 for b in budgets)
    for budget in budgets:
        losses = [float(CHINCHILLA.loss(n, budget["budget"] / (6 * n))) for n in (1.5e5, 5e5, 1.5e6)]
        assert budget["loss_min"] <= min(losses) + 1e-6  # val_loss, whose parabola dips below the sampled points
    assert "fit of 6 runs" in report
    for name in PLOT_FILES:
        assert_valid_png(sweep / "fit" / name)


def test_sweep_directory_for_the_sweep_runner(tmp_path: Path) -> None:
    """fit_sweep_directory is what `scaletrain sweep run` calls at the end (sweep/finalize.py)."""
    sweep = tiny_sweep(tmp_path / "sweep")
    report, document, plots = fit_sweep_directory(sweep, tmp_path / "elsewhere", [1e15], 0, "params")
    assert [p.name for p in plots] == list(PLOT_FILES) and all(p.parent == tmp_path / "elsewhere" for p in plots)
    assert document["target_flops"] == [1e15] and document["params_column"] == "params"
    assert json.loads((tmp_path / "elsewhere" / "fit.json").read_text()) == document
    assert "at the target budgets" in report


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
