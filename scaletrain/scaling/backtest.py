"""Rolling backtests of the law forms (fit on the smaller IsoFLOP budgets, predict the next one) and
the choice of form by backtest error.

A law is only as good as its extrapolation: a form that fits the data it has seen (every form with
more constants does) can still mispredict the next budget, which is what a sweep's prediction does.
Rolling-origin evaluation is Tashman 2000 ("Out-of-sample tests of forecasting accuracy", sec. 3);
the data-constrained and Kaplan forms are compared this way by Muennighoff et al. 2023 (sec. 5) and
Besiroglu et al. 2024 ("Chinchilla Scaling: A replication attempt").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scaletrain.scaling.laws import LAW_FORMS, LawFit, Point, fit_law, group_by_budget

MAX_FOLDS = 6  # the largest budgets' folds only: a CSV without budgets can have one "budget" per run
WARM_SCREENED_STARTS = 4  # grid starts beside the previous fold's optimum


@dataclass(frozen=True)
class Fold:
    """One budget predicted from the budgets below it; error % = 100 (predicted - measured) / measured.
    `failed` is the reason the form could not be fitted on the training budgets (predicted NaN)."""

    budget_flops: float
    train_budgets: int
    params: list[float]
    tokens: list[float]
    measured: list[float]
    predicted: list[float]
    ranking_correct: bool
    failed: str | None = None

    @property
    def errors_pct(self) -> np.ndarray:
        return 100.0 * (np.array(self.predicted) - np.array(self.measured)) / np.array(self.measured)


@dataclass(frozen=True)
class Backtest:
    """A form's folds and their summary over the folds that could be fitted (each fold's mean error,
    averaged over folds so every budget weighs the same). loo_abs_error_pct: the leave-one-out mean
    |error| %, computed only when no fold exists (the fallback of choose_form)."""

    form: str
    folds: list[Fold]
    mean_abs_error_pct: float
    mean_signed_error_pct: float
    rankings_correct: int
    rankings: int
    loo_abs_error_pct: float = math.nan

    @property
    def scored(self) -> list[Fold]:
        return [fold for fold in self.folds if fold.failed is None]


def _arrays(points: list[Point]) -> tuple[np.ndarray, ...]:
    unique = [math.nan if p.unique_tokens is None else p.unique_tokens for p in points]
    return tuple(np.array(column, dtype=float) for column in zip(
        *[(p.params, p.tokens, p.loss) for p in points], strict=True)) + (np.array(unique, dtype=float),)


def rolling_backtest(form: str, points: list[Point], objective: str = "huber",
                     huber_delta: float | None = None) -> Backtest:
    """Budgets sorted by FLOPs (fit.group_by_budget); for each budget k whose predecessors 1..k-1 hold
    enough distinct (N, D) for the form, fit on them and predict every run of budget k (the last
    MAX_FOLDS such budgets). A fold the form cannot fit is recorded as failed, with its reason."""
    groups = sorted(group_by_budget(points), key=lambda g: min(points[i].flops for i in g))
    needed = len(LAW_FORMS[form].constants)
    eligible = [k for k in range(1, len(groups))
                if len({(points[i].params, points[i].tokens) for g in groups[:k] for i in g}) >= needed]
    folds, warm = [], None
    for k in eligible[-MAX_FOLDS:]:
        train = [points[i] for g in groups[:k] for i in g]
        fold, fitted = _fold(form, train, [points[i] for i in groups[k]], k, objective, huber_delta, warm)
        folds.append(fold)
        warm = fitted if fitted is not None else warm
    loo = math.nan if folds else leave_one_out_error(form, points, objective, huber_delta)
    return _summary(form, folds, loo)


def _fold(form: str, train: list[Point], test: list[Point], train_budgets: int, objective: str,
          huber_delta: float | None, warm: LawFit | None) -> tuple[Fold, LawFit | None]:
    params, tokens, losses, unique = _arrays(test)
    flops = float(np.exp(np.mean(np.log([p.flops for p in test]))))
    try:
        fitted = _fit(form, train, objective, huber_delta, warm)
        predicted = fitted.loss(params, tokens, unique)
        if not np.all(np.isfinite(predicted)):
            raise ValueError("the fitted law predicts a non-finite loss")
    except (ValueError, FloatingPointError, OverflowError) as reason:
        return Fold(flops, train_budgets, params.tolist(), tokens.tolist(), losses.tolist(),
                    [math.nan] * len(test), False, str(reason)), None
    ranking = bool(np.array_equal(np.argsort(predicted, kind="stable"), np.argsort(losses, kind="stable")))
    return Fold(flops, train_budgets, params.tolist(), tokens.tolist(), losses.tolist(), predicted.tolist(),
                ranking), fitted


def _fit(form: str, train: list[Point], objective: str, huber_delta: float | None,
         warm: LawFit | None) -> LawFit:
    """The form on `train`; warm-started from a neighbouring fit with fewer grid starts when there is one."""
    params, tokens, losses, unique = _arrays(train)
    if warm is None:
        return fit_law(form, params, tokens, losses, unique, objective, huber_delta)
    return fit_law(form, params, tokens, losses, unique, objective, huber_delta,
                   starts=LAW_FORMS[form].theta(warm.constants), screened=WARM_SCREENED_STARTS)


def leave_one_out_error(form: str, points: list[Point], objective: str = "huber",
                        huber_delta: float | None = None) -> float:
    """Mean |error| % of each run predicted by the form fitted without it (NaN if no refit succeeds)."""
    try:
        full = _fit(form, points, objective, huber_delta, None)
    except ValueError:
        return math.nan
    errors = []
    for index, point in enumerate(points):
        try:
            fitted = _fit(form, points[:index] + points[index + 1:], objective, huber_delta, full)
        except ValueError:
            continue
        predicted = float(fitted.loss(point.params, point.tokens, point.unique_tokens))
        errors.append(abs(100.0 * (predicted - point.loss) / point.loss))
    return float(np.mean(errors)) if errors else math.nan


def _summary(form: str, folds: list[Fold], loo: float) -> Backtest:
    scored = [fold for fold in folds if fold.failed is None]
    if not scored:
        return Backtest(form, folds, math.nan, math.nan, 0, 0, loo)
    return Backtest(form, folds, float(np.mean([np.abs(f.errors_pct).mean() for f in scored])),
                    float(np.mean([f.errors_pct.mean() for f in scored])),
                    sum(f.ranking_correct for f in scored), len(scored), loo)


def choose_form(backtests: dict[str, Backtest], fits: dict[str, LawFit]) -> tuple[str, str]:
    """The fitted form with the lowest mean |error| on the budgets every backtested form predicted
    (ties: more rankings correct, then fewer constants), and the reason with every form's numbers.
    Without any fold: the lowest leave-one-out error. ValueError when no form was fitted."""
    if not fits:
        raise ValueError("no law form could be fitted, so none can be chosen")
    if len(fits) == 1:
        (form,) = fits
        return form, f"{form}: the only form that could be fitted"
    tested = {form: backtests[form] for form in fits if form in backtests and backtests[form].scored}
    if not tested:
        return _choose_by_leave_one_out(backtests, fits)
    common = set.intersection(*({f.budget_flops for f in b.scored} for b in tested.values()))
    scores = {}
    for form, backtest in tested.items():
        folds = [f for f in backtest.scored if f.budget_flops in common]
        scores[form] = (float(np.mean([np.abs(f.errors_pct).mean() for f in folds])),
                        -sum(f.ranking_correct for f in folds), len(LAW_FORMS[form].constants), len(folds))
    ranked = sorted(scores, key=lambda form: scores[form][:3])
    parts = [f"{form}: {scores[form][0]:.3g}% mean |error| over {scores[form][3]} fold(s), "
             f"{-scores[form][1]}/{scores[form][3]} rankings" for form in ranked]
    parts += [f"{form}: no backtest fold could be fitted" for form in fits if form not in tested]
    return ranked[0], "lowest rolling-backtest error on the budgets all forms predicted: " + "; ".join(parts)


def _choose_by_leave_one_out(backtests: dict[str, Backtest], fits: dict[str, LawFit]) -> tuple[str, str]:
    """choose_form's fallback with fewer than 3 budgets: the leave-one-out error of each run."""
    errors = {form: backtests[form].loo_abs_error_pct if form in backtests else math.nan for form in fits}
    ranked = sorted(fits, key=lambda form: (errors[form] if math.isfinite(errors[form]) else math.inf,
                                            len(LAW_FORMS[form].constants)))
    parts = [f"{form}: {errors[form]:.3g}% mean leave-one-out |error|" for form in ranked]
    return ranked[0], ("no rolling backtest (fewer than 3 IsoFLOP budgets, or too few runs below the largest); "
                       "lowest leave-one-out error instead: " + "; ".join(parts))
