"""The held-out check on a hand-computed case: a fixed law, six held-out runs at three budgets."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from scaletrain.scaling.check import CHECK_COLUMNS, check_csv, check_document, check_lines, check_predictions
from scaletrain.scaling.fit import Point


def law(params: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """L = 3 - 0.1 log10 N, interval +-0.05 (no interval for N = 1e6 at budget 1e17: NaN bounds)."""
    predicted = 3.0 - 0.1 * np.log10(params)
    lower, upper = predicted - 0.05, predicted + 0.05
    no_interval = (params == 1e6) & (tokens == 1e17 / 6e6)
    return predicted, np.where(no_interval, np.nan, lower), np.where(no_interval, np.nan, upper)


def held_out(params: float, budget: float, loss: float) -> Point:
    return Point(params, budget / (6 * params), budget, loss, budget)


# (N, budget, measured): predictions 2.4, 2.3, 2.2 for N = 1e6, 1e7, 1e8
RUNS = [held_out(1e6, 1e15, 2.5), held_out(1e7, 1e15, 2.32), held_out(1e8, 1e15, 2.4),
        held_out(1e7, 1e16, 2.26), held_out(1e8, 1e16, 2.1), held_out(1e6, 1e17, 2.4)]
# (predicted - measured) / measured, by hand: -0.1/2.5, -0.02/2.32, -0.2/2.4, 0.04/2.26, 0.1/2.1, 0
ERRORS_PCT = [-4.0, -0.862069, -8.333333, 1.769912, 4.761905, 0.0]


def test_errors_coverage_and_rankings_by_hand() -> None:
    result = check_predictions(RUNS, law)
    assert [c.predicted for c in result.points] == pytest.approx([2.4, 2.3, 2.2, 2.3, 2.2, 2.4])
    assert [c.error for c in result.points] == pytest.approx([-0.1, -0.02, -0.2, 0.04, 0.1, 0.0], abs=1e-12)
    assert [c.error_pct for c in result.points] == pytest.approx(ERRORS_PCT, abs=1e-5)
    assert result.mean_abs_error_pct == pytest.approx(19.727219 / 6, abs=1e-5)
    assert result.mean_signed_error_pct == pytest.approx(-6.663585 / 6, abs=1e-5)
    # inside [p - 0.05, p + 0.05]: 2.32 in [2.25, 2.35] and 2.26 in [2.25, 2.35]; the last has no interval
    assert [c.inside for c in result.points] == [False, True, False, True, False, None]
    assert result.coverage == (2, 5)
    at_1e15, at_1e16 = result.rankings  # the single run at 1e17 ranks nothing
    assert (at_1e15.budget, at_1e15.measured, at_1e15.predicted, at_1e15.correct) == (
        1e15, [1e7, 1e8, 1e6], [1e8, 1e7, 1e6], False)
    assert (at_1e16.budget, at_1e16.measured, at_1e16.predicted, at_1e16.correct) == (
        1e16, [1e8, 1e7], [1e8, 1e7], True)


def test_csv_document_and_lines() -> None:
    result = check_predictions(RUNS, law)
    rows = list(csv.DictReader(io.StringIO(check_csv(result))))
    assert tuple(rows[0]) == CHECK_COLUMNS and len(rows) == len(RUNS)
    assert float(rows[1]["loss"]) == 2.32 and float(rows[1]["predicted"]) == pytest.approx(2.3)
    assert float(rows[1]["lower"]) == pytest.approx(2.25) and float(rows[1]["upper"]) == pytest.approx(2.35)
    assert (rows[5]["lower"], rows[5]["upper"]) == ("", "")
    document = check_document(result, "chinchilla")
    assert document["coverage"] == {"inside": 2, "with_interval": 5, "runs": 6}
    assert [r["correct"] for r in document["rankings"]] == [False, True]
    assert document["points"][0]["error_pct"] == pytest.approx(-4.0)
    text = "\n".join(check_lines(result, "chinchilla"))
    assert "mean |error| 3.29%, mean signed error -1.11%; 2 of 5 inside their interval (1 without one)" in text
    assert "-0.1000   -4.00" in text
    assert "predicted 1e+08, 1e+07, 1e+06, measured 1e+07, 1e+08, 1e+06: ranking differs" in text
    assert "predicted 1e+08, 1e+07, measured 1e+08, 1e+07: same ranking" in text


def test_no_runs_is_refused() -> None:
    with pytest.raises(ValueError, match="got no runs"):
        check_predictions([], law)
