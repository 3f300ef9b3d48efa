"""The held-out check of a fit: its predictions on runs it never saw, against their measured losses.

A scaling law is used to extrapolate (to the big run's budget), and its bootstrap intervals measure
the spread of the constants, not whether the law's form holds further out. The one test of that is
runs held out of the fit, ideally at larger budgets (Hoffmann et al. 2022, sec. 4; Besiroglu et al.
2024, "Chinchilla Scaling: A replication attempt", sec. 4): per run the signed error of the
predicted loss, whether the 90% prediction interval holds the measurement, and per held-out budget
whether the predicted order of the sizes is the measured one (the decision a sweep exists for: which
size to train), and where a budget has three sizes or more, the measured optimum against the predicted
N*. `scaletrain fit SOURCE --check HELDOUT` (fit_source.py) prints and records it.

Seed repeats: a size trained with several seeds counts once, at its seed-mean loss, in the ranking and
the optimum. With the run-to-run sd sigma of ln L known, a pair of sizes is ranked only where their
losses differ by more than TIE_SIGMAS sigma in ln L (two sd of the difference of two runs, each of sd
sigma); closer pairs are ties, which no law can be asked to order. The measured optimum is the vertex
of a parabola in ln N through the seed-mean losses (Hoffmann et al. 2022, sec. 3.2, as Approach 2 finds
each profile's minimum: fit.isoflop_minimum).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scaletrain.scaling.fit import MIN_SIZES_PER_BUDGET, Point, group_by_budget, isoflop_minimum

CHECK_CONFIDENCE = 0.9
TIE_SIGMAS = 2 * math.sqrt(2)
CHECK_COLUMNS = ("params", "tokens", "loss", "predicted", "lower", "upper")
Predictor = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
OptimalSize = Callable[[float], float]  # the predicted compute-optimal N* at a budget C


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
    """The distinct sizes at one held-out budget, best first, as measured (seed-mean loss) and as
    predicted; `margin`: the tie margin in ln L (TIE_SIGMAS sigma; None: sigma unknown, every pair is
    ranked), `pairs` the pairs of sizes, `judged` those whose seed-mean losses differ by more than the
    margin, `agreeing` the judged pairs the prediction orders as measured."""

    flops: float
    budget: float | None
    measured: list[float]
    predicted: list[float]
    margin: float | None = None
    pairs: int = 0
    judged: int = 0
    agreeing: int = 0

    @property
    def correct(self) -> bool:
        """The whole predicted order is the measured one (ties included)."""
        return self.measured == self.predicted

    @property
    def judged_correct(self) -> bool:
        """Every pair beyond the tie margin is in the predicted order."""
        return self.agreeing == self.judged


@dataclass(frozen=True)
class MeasuredOptimum:
    """At one held-out budget of >= MIN_SIZES_PER_BUDGET sizes: the vertex of the parabola in ln N through
    the seed-mean losses (None, with the reason, where the losses do not curve upward or the vertex lies
    far outside the sizes) against the predicted N*."""

    flops: float
    budget: float | None
    sizes: int
    predicted_n: float
    measured_n: float | None
    bracketed: bool  # the vertex lies within the sizes trained
    reason: str | None = None

    @property
    def ratio(self) -> float | None:
        """How far apart, as a factor >= 1 (1.25: one is 25% above the other)."""
        if self.measured_n is None or not (self.predicted_n > 0 and math.isfinite(self.predicted_n)):
            return None
        return max(self.measured_n / self.predicted_n, self.predicted_n / self.measured_n)


@dataclass(frozen=True)
class CheckResult:
    points: list[CheckedPoint]
    rankings: list[Ranking]
    optima: list[MeasuredOptimum] = field(default_factory=list)

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


def check_predictions(points: Sequence[Point], predict: Predictor, noise_sd: float | None = None,
                      optimal_size: OptimalSize | None = None) -> CheckResult:
    """Each held-out run against predict(params, tokens) -> (loss, lower, upper) arrays; rankings at
    every budget (grouped as fit.group_by_budget groups IsoFLOP profiles) of >= 2 distinct sizes, pairs
    closer than TIE_SIGMAS `noise_sd` (the run-to-run sd of ln L) tied; with `optimal_size` (C -> the
    predicted N*), the measured optimum at every budget of >= MIN_SIZES_PER_BUDGET sizes."""
    if not points:
        raise ValueError("the held-out check got no runs; pass a CSV or sweep with >= 1 finished run")
    params = np.array([p.params for p in points], dtype=float)
    tokens = np.array([p.tokens for p in points], dtype=float)
    predicted, lower, upper = (np.broadcast_to(np.asarray(v, dtype=float), params.shape)
                               for v in predict(params, tokens))
    checked = [CheckedPoint(point, float(predicted[i]), float(lower[i]), float(upper[i]))
               for i, point in enumerate(points)]
    margin = None if noise_sd is None else TIE_SIGMAS * noise_sd
    rankings, optima = [], []
    for group in group_by_budget(list(points)):
        sizes = _seed_means(group, points, predicted)
        if len(sizes) < 2:
            continue
        flops = float(np.exp(np.mean(np.log([points[i].flops for i in group]))))
        budget = points[group[0]].budget
        rankings.append(_ranking(flops, budget, sizes, margin))
        if optimal_size is not None and len(sizes) >= MIN_SIZES_PER_BUDGET:
            optima.append(_measured_optimum(flops, budget, sizes, group, points, optimal_size))
    return CheckResult(checked, rankings, optima)


def _seed_means(group: list[int], points: Sequence[Point], predicted: np.ndarray) -> dict[float, tuple[float, float]]:
    """{N: (seed-mean measured loss, predicted loss)} over the group's distinct sizes (a size's runs share
    N and D, so one prediction)."""
    runs: dict[float, list[int]] = {}
    for i in group:
        runs.setdefault(points[i].params, []).append(i)
    return {n: (float(np.mean([points[i].loss for i in members])), float(predicted[members[0]]))
            for n, members in runs.items()}


def _ranking(flops: float, budget: float | None, sizes: dict[float, tuple[float, float]],
             margin: float | None) -> Ranking:
    measured = sorted(sizes, key=lambda n: sizes[n][0])
    predicted = sorted(sizes, key=lambda n: sizes[n][1])
    pairs = judged = agreeing = 0
    for first, second in itertools.combinations(sizes, 2):
        pairs += 1
        (loss_a, predicted_a), (loss_b, predicted_b) = sizes[first], sizes[second]
        if margin is not None and abs(math.log(loss_a) - math.log(loss_b)) <= margin:
            continue
        judged += 1
        agreeing += (loss_a < loss_b) == (predicted_a < predicted_b)
    return Ranking(flops, budget, measured, predicted, margin, pairs, judged, agreeing)


def _measured_optimum(flops: float, budget: float | None, sizes: dict[float, tuple[float, float]], group: list[int],
                      points: Sequence[Point], optimal_size: OptimalSize) -> MeasuredOptimum:
    """The parabola in ln N through the seed-mean losses (fit.isoflop_minimum on one point per size)."""
    tokens = {points[i].params: points[i].tokens for i in group}
    means = [Point(n, tokens[n], flops, loss) for n, (loss, _) in sizes.items()]
    predicted_n = float(optimal_size(budget if budget is not None else flops))
    try:
        vertex = isoflop_minimum(means)
    except ValueError as reason:
        return MeasuredOptimum(flops, budget, len(sizes), predicted_n, None, False, str(reason))
    return MeasuredOptimum(flops, budget, len(sizes), predicted_n, vertex.n_opt, vertex.bracketed)


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
                      "correct": r.correct, "tie_margin_log": r.margin, "pairs": r.pairs, "judged": r.judged,
                      "agreeing": r.agreeing} for r in result.rankings],
        "optima": [{"flops": o.flops, "budget": o.budget, "sizes": o.sizes, "predicted_n": o.predicted_n,
                    "measured_n": o.measured_n, "ratio": o.ratio, "bracketed": o.bracketed, "reason": o.reason}
                   for o in result.optima],
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
        lines.append(f"  sizes at C {ranking.flops:.3g}, best first (seed means): predicted "
                     f"{_sizes(ranking.predicted)}, measured {_sizes(ranking.measured)}: {verdict}"
                     + ("" if ranking.margin is None else f"; {_pair_verdict(ranking)}"))
    if not result.rankings:
        lines.append("  no held-out budget has >= 2 sizes, so no ranking is checked")
    for optimum in result.optima:
        where = f"  optimum at C {optimum.flops:.3g} ({optimum.sizes} sizes): predicted N* {optimum.predicted_n:.3g}, "
        if optimum.measured_n is None:
            lines.append(where + f"no measured optimum: {optimum.reason}")
        else:
            outside = "" if optimum.bracketed else ", outside the sizes trained"
            lines.append(where + f"measured {optimum.measured_n:.3g} (parabola in ln N through the seed-mean "
                         f"losses{outside}): {optimum.ratio:.2f}x apart")
    return lines


def _pair_verdict(ranking: Ranking) -> str:
    ties = ranking.pairs - ranking.judged
    return (f"{ranking.agreeing} of {ranking.judged} pairs beyond the tie margin ({TIE_SIGMAS:.2f} sigma = "
            f"{ranking.margin:.3g} in ln L) in the predicted order, {ties} tied")


def _sizes(params: list[float]) -> str:
    return ", ".join(f"{n:.3g}" for n in params)
