"""`scaletrain sweep tune` through the CLI on tiny shapes: 2 sizes x 2 horizons x 3 LRs of 80 and 160 steps, then
the LR check (the largest size at the longer horizon, 0.5x/1x/2x the fitted rule); tuned.json with the law in
N and D, check.json with its verdict, the plot, a re-run that trains nothing, and a spec whose LR rule is
`tuned` planning with the fitted law at each run's own tokens."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import matplotlib.image
import pytest

from scaletrain.scaling.sweep.commands import format_plan
from scaletrain.scaling.sweep.plan import plan_sweep
from scaletrain.scaling.sweep.spec import load_sweep_spec
from scaletrain.scaling.sweep.tune_fit import fit_power_law
from tests.scaling.sweeps import in_process_loading, tiny_spec, write_spec
from tests.train.runs import run_scaletrain

LR_MULTIPLIERS = [0.1, 1.0, 10.0]  # around 1e-2: at 80-160 steps the tiny models do best near 3e-3 to 3e-2
HORIZONS = [80 * 256, 160 * 256]


def tuned_spec(data_dir: Path, sweep_dir: Path) -> dict:
    spec = in_process_loading(tiny_spec(data_dir, sweep_dir))  # the grid's losses as with a loader worker
    del spec["learning_rate"]
    spec["hyperparameters"] = {"lr": {"rule": "tuned", "value": 1e-2, "reference_params": 1e5, "exponent": 0.0}}
    spec["tune"] = {"sizes": [0, 2], "lr_multipliers": LR_MULTIPLIERS, "tokens": HORIZONS,
                    "check": {"sizes": [2], "tokens": HORIZONS[-1], "sigma": 0.002}}
    return spec


@pytest.mark.slow
def test_sweep_tune_fits_the_lr_in_n_and_d_checks_it_and_a_tuned_spec_plans_with_it(
    small_dataset: Path, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    spec_path = write_spec(tmp_path / "spec.yaml", tuned_spec(small_dataset, sweep_dir))
    output = run_scaletrain("sweep", ["tune", str(spec_path)], timeout=1200)
    assert "trained 12 runs, skipped 0 already done, 0 failed" in output
    assert "LR check: trained 3 runs, 0 failed" in output
    assert "rule: tuned" in output and "now plans with this LR" in output

    tuned = json.loads((sweep_dir / "tune" / "tuned.json").read_text())
    law = tuned["lr"]
    assert set(law) == {"value", "reference_params", "exponent", "reference_tokens", "tokens_exponent", "count"}
    assert law["tokens_exponent"] is not None and tuned["horizons"] == {"tokens": HORIZONS} and tuned["seeds"] == [7]
    assert len(tuned["optima"]) == 4 and len(tuned["grid"]) == 12
    assert {point["lr_multiplier"] for point in tuned["grid"]} == set(LR_MULTIPLIERS)
    assert {point["tokens"] for point in tuned["optima"]} == set(HORIZONS)
    for optimum in tuned["optima"]:  # each vertex lies inside its grid
        assert 1e-3 < optimum["lr"] < 1e-1
    refit = fit_power_law([o["params"] for o in tuned["optima"]], [o["lr"] for o in tuned["optima"]],
                          [o["tokens"] for o in tuned["optima"]])  # the law is the one through these optima
    assert (refit.value, refit.exponent, refit.tokens_exponent) == pytest.approx(
        (law["value"], law["exponent"], law["tokens_exponent"]), rel=1e-9)
    height, width, _ = matplotlib.image.imread(sweep_dir / "tune" / "lr_tuning.png").shape
    assert height > 200 and width > 200

    check = json.loads((sweep_dir / "tune" / "check.json").read_text())
    (point,) = check["points"]
    assert point["tokens"] == HORIZONS[-1] and set(point["losses"]) == {"0.5", "1", "2"}
    losses = {float(key): value for key, value in point["losses"].items()}
    gap = math.log(losses[1.0]) - math.log(min(losses.values()))
    assert point["gap_pct"] == pytest.approx(100 * gap) and point["best_multiplier"] == min(losses, key=losses.get)
    assert point["threshold_pct"] == pytest.approx(100 * 2 * 0.002 * math.sqrt(2))
    assert check["holds"] == point["holds"] == (gap <= 2 * 0.002 * math.sqrt(2))
    expected_rule_lr = law["value"] * (point["params"] / law["reference_params"]) ** law["exponent"] * (
        HORIZONS[-1] / law["reference_tokens"]) ** law["tokens_exponent"]
    assert point["rule_lr"] == pytest.approx(expected_rule_lr, rel=1e-9)
    with (sweep_dir / "tune" / "results.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 15 and all(row["status"] == "done" for row in rows)
    assert len({row["data_fingerprint"] for row in rows}) == 1 and rows[0]["data_fingerprint"]

    again = run_scaletrain("sweep", ["tune", str(spec_path)])
    assert "trained 0 runs, skipped 12 already done" in again and "LR check: trained 0 runs" in again
    plan = plan_sweep(load_sweep_spec(spec_path))
    for run in plan.runs:  # isoflop: D = C / FLOPs per token, the tokens the rule reads
        tokens = run.budget / run.counts.flops_per_token
        expected = law["value"] * (run.counts.total_params / law["reference_params"]) ** law["exponent"] * (
            tokens / law["reference_tokens"]) ** law["tokens_exponent"]
        assert math.isclose(run.lr, expected, rel_tol=1e-9)
    assert f"LR check ({sweep_dir / 'tune' / 'check.json'}): the rule " in format_plan(plan)
