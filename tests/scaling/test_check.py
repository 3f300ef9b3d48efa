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


def parabola(vertex: float):
    """L = 2 + 0.05 (ln N - ln vertex)^2."""
    return lambda params: 2.0 + 0.05 * np.log(np.asarray(params) / vertex) ** 2


# Seed-mean losses on a parabola with its vertex at 3e6: 1e6 2.06035, 2e6 2.00822, 4e6 2.00414, 8e6 2.04810
MEASURED = parabola(3e6)
PREDICTED = parabola(1.5e6)  # 1e6 2.00822, 2e6 2.00414, 4e6 2.04810, 8e6 2.14013
SEEDED = [held_out(n, 1e18, float(MEASURED(n)) + offset) for n in (1e6, 2e6, 4e6, 8e6) for offset in (0.01, -0.01)]
CONCAVE = [held_out(n, 1e19, loss) for n, loss in ((1e6, 2.0), (4e6, 2.1), (1.6e7, 2.05))]


def predict_parabola(params: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    loss = PREDICTED(params)
    return loss, loss - 0.1, loss + 0.1


def test_seed_repeats_rank_once_close_pairs_tie_and_the_optimum_is_the_seed_means_parabola() -> None:
    """Two seeds per size count once, at their mean. Tie margin 2√2 x 0.005 = 0.0141 in ln L: 2e6 vs 4e6
    (0.0020) and 1e6 vs 8e6 (0.0060) tie; of the 4 other pairs the prediction orders 3 as measured (it puts
    1e6 before 4e6). The parabola through the seed means has its vertex at 3e6, 2x the predicted 1.5e6; the
    concave profile has none."""
    result = check_predictions(SEEDED + CONCAVE, predict_parabola, noise_sd=0.005, optimal_size=lambda flops: 1.5e6)
    seeded, concave = result.rankings
    assert (seeded.measured, seeded.predicted) == ([4e6, 2e6, 8e6, 1e6], [2e6, 1e6, 4e6, 8e6])
    assert seeded.margin == pytest.approx(2 * np.sqrt(2) * 0.005)
    assert (seeded.pairs, seeded.judged, seeded.agreeing, seeded.correct, seeded.judged_correct) == (
        6, 4, 3, False, False)
    optimum, no_optimum = result.optima
    assert (optimum.budget, optimum.sizes, optimum.predicted_n, optimum.bracketed) == (1e18, 4, 1.5e6, True)
    assert optimum.measured_n == pytest.approx(3e6, rel=1e-9) and optimum.ratio == pytest.approx(2.0, rel=1e-9)
    assert (no_optimum.budget, no_optimum.measured_n, no_optimum.ratio) == (1e19, None, None)
    assert no_optimum.reason.startswith("the losses do not curve upward in log N")
    assert concave.measured == [1e6, 1.6e7, 4e6] and concave.judged == 3  # 0.024 and more apart in ln L
    text = "\n".join(check_lines(result, "chinchilla"))
    assert ("predicted 2e+06, 1e+06, 4e+06, 8e+06, measured 4e+06, 2e+06, 8e+06, 1e+06: ranking differs; "
            "3 of 4 pairs beyond the tie margin (2.83 sigma = 0.0141 in ln L) in the predicted order, 2 tied") in text
    assert ("optimum at C 1e+18 (4 sizes): predicted N* 1.5e+06, measured 3e+06 (parabola in ln N through the "
            "seed-mean losses): 2.00x apart") in text
    assert "optimum at C 1e+19 (3 sizes): predicted N* 1.5e+06, no measured optimum: the losses do not curve" in text
    document = check_document(result, "chinchilla")
    assert document["rankings"][0] | {"flops": None} == {
        "flops": None, "budget": 1e18, "measured": [4e6, 2e6, 8e6, 1e6], "predicted": [2e6, 1e6, 4e6, 8e6],
        "correct": False, "tie_margin_log": pytest.approx(0.0141421, rel=1e-5), "pairs": 6, "judged": 4, "agreeing": 3}
    assert document["optima"][0]["ratio"] == pytest.approx(2.0) and document["optima"][1]["reason"] is not None


def test_without_a_noise_estimate_every_pair_is_ranked() -> None:
    seeded = check_predictions(SEEDED, predict_parabola).rankings[0]
    assert (seeded.margin, seeded.pairs, seeded.judged, seeded.agreeing) == (None, 6, 6, 3)
    assert check_predictions(SEEDED, predict_parabola).optima == []  # no predicted N* to set against
