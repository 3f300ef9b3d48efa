"""`scaletrain sweep tune` through the CLI on tiny shapes: 2 sizes x 3 LRs of 40 steps, tuned.json, the plot,
a re-run that trains nothing, and a spec whose LR rule is `tuned` planning with the fitted law."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import matplotlib.image
import pytest

from scaletrain.scaling.sweep.plan import plan_sweep
from scaletrain.scaling.sweep.spec import load_sweep_spec
from tests.scaling.sweeps import tiny_spec, write_spec
from tests.train.runs import run_scaletrain

LR_MULTIPLIERS = [0.1, 1.0, 10.0]  # around 3e-3: at 40 steps the tiny models do best near 5e-3 to 1e-2


def tuned_spec(data_dir: Path, sweep_dir: Path) -> dict:
    spec = tiny_spec(data_dir, sweep_dir)
    del spec["learning_rate"]
    spec["hyperparameters"] = {"lr": {"rule": "tuned", "value": 3e-3, "reference_params": 1e5, "exponent": 0.0}}
    spec["tune"] = {"sizes": [0, 2], "lr_multipliers": LR_MULTIPLIERS, "tokens": 40 * 256}
    return spec


@pytest.mark.slow
def test_sweep_tune_fits_the_lr_and_a_tuned_spec_plans_with_it(small_dataset: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    spec_path = write_spec(tmp_path / "spec.yaml", tuned_spec(small_dataset, sweep_dir))
    output = run_scaletrain("sweep", ["tune", str(spec_path)], timeout=1200)
    assert "trained 6 runs, skipped 0 already done, 0 failed" in output
    assert "rule: tuned" in output and "now plans with this LR" in output

    tuned = json.loads((sweep_dir / "tune" / "tuned.json").read_text())
    assert set(tuned["lr"]) == {"value", "reference_params", "exponent", "count"}
    assert len(tuned["optima"]) == 2 and len(tuned["grid"]) == 6
    assert {point["lr_multiplier"] for point in tuned["grid"]} == set(LR_MULTIPLIERS)
    for optimum in tuned["optima"]:  # each vertex lies inside its grid, near the fitted law
        assert 3e-4 < optimum["lr"] < 3e-2
        law = tuned["lr"]["value"] * (optimum["params"] / tuned["lr"]["reference_params"]) ** tuned["lr"]["exponent"]
        assert law == pytest.approx(optimum["lr"], rel=1e-6)  # two sizes: the line passes through both
    height, width, _ = matplotlib.image.imread(sweep_dir / "tune" / "lr_tuning.png").shape
    assert height > 200 and width > 200
    with (sweep_dir / "tune" / "results.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 6 and all(row["status"] == "done" for row in rows)
    assert len({row["data_fingerprint"] for row in rows}) == 1 and rows[0]["data_fingerprint"]

    assert "trained 0 runs, skipped 6 already done" in run_scaletrain("sweep", ["tune", str(spec_path)])
    plan = plan_sweep(load_sweep_spec(spec_path))
    law = tuned["lr"]
    for run in plan.runs:
        expected = law["value"] * (run.counts.total_params / law["reference_params"]) ** law["exponent"]
        assert math.isclose(run.lr, expected, rel_tol=1e-9)
