"""The held-out check of a fit: its predictions on runs it never saw, against their measured losses.

A scaling law is used to extrapolate (to the big run's budget), and its bootstrap intervals measure
the spread of the constants, not whether the law's form holds further out. The one test of that is
runs held out of the fit, ideally at larger budgets (Hoffmann et al. 2022, sec. 4; Besiroglu et al.
2024, "Chinchilla Scaling: A replication attempt", sec. 4): per run the signed error of the
predicted loss, whether the 90% prediction interval holds the measurement, and per held-out budget
whether the predicted order of the sizes is the measured one (the decision a sweep exists for: which
size to train). `scaletrain fit SOURCE --check HELDOUT` (fit_source.py) prints and records it.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaletrain.scaling.fit import Point, group_by_budget

CHECK_CONFIDENCE = 0.9
CHECK_COLUMNS = ("params", "tokens", "loss", "predicted", "lower", "upper")
Predictor = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class CheckedPoint:
    """One held-out run: measured loss, the predicted one and its interval (NaN bounds: no interval)."""

    point: Point
    predicted: float
    lower: float
    upper: float

    @property
    def error(self) -> float:
        """predicted - measured, in nats: positive where the law is pessimistic."""
        return self.predicted - self.point.loss

    @property
    def error_pct(self) -> float:
        return 100.0 * self.error / self.point.loss

    @property
    def inside(self) -> bool | None:
        """Whether the interval holds the measured loss; None without an interval."""
        if not (math.isfinite(self.lower) and math.isfinite(self.upper)):
            return None
        return self.lower <= self.point.loss <= self.upper


@dataclass(frozen=True)
class Ranking:
    """The sizes at one held-out budget, best first, as measured and as predicted."""

    flops: float
    budget: float | None
    measured: list[float]
    predicted: list[float]

    @property
    def correct(self) -> bool:
        return self.measured == self.predicted


@dataclass(frozen=True)
class CheckResult:
    points: list[CheckedPoint]
    rankings: list[Ranking]

    @property
    def mean_abs_error_pct(self) -> float:
        return float(np.mean([abs(p.error_pct) for p in self.points]))

    @property
    def mean_signed_error_pct(self) -> float:
        return float(np.mean([p.error_pct for p in self.points]))

    @property
    def coverage(self) -> tuple[int, int]:
        """(held-out runs inside their interval, runs that have an interval)."""
        judged = [p.inside for p in self.points if p.inside is not None]
        return sum(judged), len(judged)


def check_predictions(points: Sequence[Point], predict: Predictor) -> CheckResult:
    """Each held-out run against predict(params, tokens) -> (loss, lower, upper) arrays; rankings at
    every budget (grouped as fit.group_by_budget groups IsoFLOP profiles) of >= 2 distinct sizes."""
    if not points:
        raise ValueError("the held-out check got no runs; pass a CSV or sweep with >= 1 finished run")
    params = np.array([p.params for p in points], dtype=float)
    tokens = np.array([p.tokens for p in points], dtype=float)
    predicted, lower, upper = (np.broadcast_to(np.asarray(v, dtype=float), params.shape)
                               for v in predict(params, tokens))
    checked = [CheckedPoint(point, float(predicted[i]), float(lower[i]), float(upper[i]))
               for i, point in enumerate(points)]
    rankings = []
    for group in group_by_budget(list(points)):
        if len({points[i].params for i in group}) < 2:
            continue
        by_measured = sorted(group, key=lambda i: points[i].loss)
        by_predicted = sorted(group, key=lambda i: predicted[i])
        flops = float(np.exp(np.mean(np.log([points[i].flops for i in group]))))
        rankings.append(Ranking(flops, points[group[0]].budget, [points[i].params for i in by_measured],
                                [points[i].params for i in by_predicted]))
    return CheckResult(checked, rankings)


def check_document(result: CheckResult, form: str | None) -> dict[str, Any]:
    """fit.json's `check`: every number the printed check shows."""
    inside, judged = result.coverage
    return {
        "form": form, "confidence": CHECK_CONFIDENCE,
        "points": [{"params": c.point.params, "tokens": c.point.tokens, "flops": c.point.flops,
                    "budget": c.point.budget, "loss": c.point.loss, "predicted": c.predicted, "lower": c.lower,
                    "upper": c.upper, "error": c.error, "error_pct": c.error_pct, "inside": c.inside}
                   for c in result.points],
        "mean_abs_error_pct": result.mean_abs_error_pct, "mean_signed_error_pct": result.mean_signed_error_pct,
        "coverage": {"inside": inside, "with_interval": judged, "runs": len(result.points)},
        "rankings": [{"flops": r.flops, "budget": r.budget, "measured": r.measured, "predicted": r.predicted,
                      "correct": r.correct} for r in result.rankings],
    }


def check_csv(result: CheckResult) -> str:
    """check.csv: one row per held-out run (CHECK_COLUMNS; empty bounds where there is no interval)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CHECK_COLUMNS)
    for c in result.points:
        writer.writerow([repr(c.point.params), repr(c.point.tokens), repr(c.point.loss), repr(c.predicted),
                         *(repr(bound) if math.isfinite(bound) else "" for bound in (c.lower, c.upper))])
    return buffer.getvalue()


def check_lines(result: CheckResult, form: str | None) -> list[str]:
    """The printed check: each run's signed error, the means, the coverage and the rankings."""
    lines = [f"held-out check of {len(result.points)} runs ({form or 'the chosen law'}; "
             f"error = predicted - measured; {CHECK_CONFIDENCE:.0%} prediction intervals):",
             f"  {'N':<11}{'D':<11}{'C':<11}{'measured':<10}{'predicted':<24}{'error':<10}{'error %':<9}inside"]
    for c in result.points:
        interval = f" [{c.lower:.4f}, {c.upper:.4f}]" if c.inside is not None else ""
        inside = {True: "yes", False: "no", None: "-"}[c.inside]
        lines.append(f"  {c.point.params:<11.3g}{c.point.tokens:<11.3g}{c.point.flops:<11.3g}{c.point.loss:<10.4f}"
                     f"{f'{c.predicted:.4f}{interval}':<24}{c.error:<+10.4f}{c.error_pct:<+9.2f}{inside}")
    inside, judged = result.coverage
    lines.append(f"  mean |error| {result.mean_abs_error_pct:.2f}%, mean signed error "
                 f"{result.mean_signed_error_pct:+.2f}%; {inside} of {judged} inside their interval"
                 + ("" if judged == len(result.points) else f" ({len(result.points) - judged} without one)"))
    for ranking in result.rankings:
        verdict = "same ranking" if ranking.correct else "ranking differs"
        lines.append(f"  sizes at C {ranking.flops:.3g}, best first: predicted {_sizes(ranking.predicted)}, "
                     f"measured {_sizes(ranking.measured)}: {verdict}")
    if not result.rankings:
        lines.append("  no held-out budget has >= 2 sizes, so no ranking is checked")
    return lines


def _sizes(params: list[float]) -> str:
    return ", ".join(f"{n:.3g}" for n in params)
