"""Rolling-origin backtests of the law forms (fit on the budgets below an origin, predict every budget
from it on) and the choice of form on the folds that can tell the forms apart.

A law is only as good as its extrapolation: a form that fits the data it has seen (every form with
more constants does) can still mispredict the next budget, which is what a sweep's prediction does.
Rolling-origin evaluation with every lead time from each origin is Tashman 2000 ("Out-of-sample tests
of forecasting accuracy", sec. 3); the data-constrained and Kaplan forms are compared this way by
Muennighoff et al. 2023 (sec. 5) and Besiroglu et al. 2024 ("Chinchilla Scaling: A replication
attempt"). The rules that make a fold count, and the choice:

- A fold counts only where its fit has freedom to spare: more distinct (N, D) in its training runs
  than the form's constants + SPARE_DEGREES_OF_FREEDOM, on at least two budgets (runs of one budget
  lie on one FLOPs line, where N and D change together and the form's N and D terms are not
  separately identified). Other folds are listed as skipped, with the reason; none is dropped silently.
- The form is chosen on the DECISION_FOLDS counted folds with the most training budgets (the
  longest-horizon fits, nearest to the prediction the sweep exists for), by mean |error|.
- A form whose mean |error| there exceeds the best by no more than TIE_STANDARD_ERRORS standard errors
  of the paired difference (across the decision folds; across the runs of the one fold when there is
  one), or of a mean |error| that the runs' noise alone gives (100 sigma sqrt(1 - 2/pi) / sqrt(runs),
  the sd of |e| for e ~ N(0, sigma^2)), ties with the best: the folds cannot tell them apart. Among
  tied forms a stated prior decides, the form with the fewest constants (the simpler law), and the
  prediction interval spans the tied forms (intervals.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from scaletrain.scaling.laws import (
    LAW_FORMS,
    LawFit,
    Point,
    configuration_groups,
    effective_tokens,
    fit_law,
    group_by_budget,
)

MAX_FOLDS = 6  # the origins nearest the largest budget; a CSV without budgets has one "budget" per FLOPs cluster
FOLD_SPACING_DECADES = 0.2  # origins at least this far apart in log10 C (Chinchilla's budgets are 0.2-0.5 apart)
SPARE_DEGREES_OF_FREEDOM = 2  # a fold counts with > constants + 2 distinct (N, D) to fit them on
MIN_TRAIN_BUDGETS = 2  # ... on >= 2 budgets
DECISION_FOLDS = 3
TIE_STANDARD_ERRORS = 2.0
SIMPLER_PRIOR = "the fewest constants (the simpler law)"
WARM_SCREENED_STARTS = 4  # grid starts beside the previous fold's optimum
LEVERAGE_RCOND = 1e-10  # see prediction_leverage


@dataclass(frozen=True)
class Fold:
    """The runs of every budget from `budget_flops` (the origin) on, predicted by the form fitted on the
    `train_budgets` budgets below it; error % = 100 (predicted - measured) / measured. `skipped`: why the
    fold cannot tell (too few runs for the constants, one budget), so it was not fitted; `failed`: why
    the fit did not succeed. Either leaves `predicted` NaN and the fold out of every summary.
    `leverage`: the covariance of the predictions' ln L from the fold's constants per unit noise variance
    (prediction_leverage; None for a fold not counted), so that under a right law the errors have
    covariance noise^2 (I + leverage)."""

    budget_flops: float
    train_budgets: int
    train_configurations: int
    train_max_flops: float
    params: list[float]
    tokens: list[float]
    flops: list[float]
    measured: list[float]
    predicted: list[float]
    ranking_correct: bool
    failed: str | None = None
    skipped: str | None = None
    leverage: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def counted(self) -> bool:
        return self.failed is None and self.skipped is None

    @property
    def errors_pct(self) -> np.ndarray:
        return 100.0 * (np.array(self.predicted) - np.array(self.measured)) / np.array(self.measured)

    @property
    def log_errors(self) -> np.ndarray:
        """ln(predicted / measured) per run: the error the prediction intervals are built in."""
        return np.log(np.array(self.predicted) / np.array(self.measured))

    @property
    def decades(self) -> np.ndarray:
        """How far each run lies beyond the training runs: log10(C / the largest training C)."""
        return np.log10(np.array(self.flops) / self.train_max_flops)


@dataclass(frozen=True)
class Backtest:
    """A form's folds and their summary over the counted folds (each fold's mean error over its runs,
    averaged over folds so every fold weighs the same; rankings: the origin budget's sizes).
    loo_abs_error_pct: the leave-one-out mean |error| %, computed only when no fold counts (the
    fallback of choose_form)."""

    form: str
    folds: list[Fold]
    mean_abs_error_pct: float
    mean_signed_error_pct: float
    rankings_correct: int
    rankings: int
    loo_abs_error_pct: float = math.nan

    @property
    def scored(self) -> list[Fold]:
        """The counted folds: fitted, with freedom to spare."""
        return [fold for fold in self.folds if fold.counted]


@dataclass(frozen=True)
class Choice:
    """The form chosen and why; `ties`: the forms the decision folds cannot tell from the best (the
    chosen one among them), whose spread the prediction interval includes; `decision_folds`: the
    origins (C) the choice was made on; `scores`: each form's mean |error| % on them."""

    form: str
    reason: str
    ties: tuple[str, ...]
    decision_folds: tuple[float, ...] = ()
    scores: dict[str, float] = field(default_factory=dict)
    prior: str = SIMPLER_PRIOR


def _arrays(points: list[Point]) -> tuple[np.ndarray, ...]:
    unique = [math.nan if p.unique_tokens is None else p.unique_tokens for p in points]
    return tuple(np.array(column, dtype=float) for column in zip(
        *[(p.params, p.tokens, p.loss) for p in points], strict=True)) + (np.array(unique, dtype=float),)


def fold_origins(groups: list[list[int]], points: list[Point]) -> list[int]:
    """The budgets (indices into `groups`, sorted by FLOPs) that folds start at: walking down from the
    largest, each at least FOLD_SPACING_DECADES below the last one kept, MAX_FOLDS at most, ascending."""
    flops = [float(np.exp(np.mean(np.log([points[i].flops for i in group])))) for group in groups]
    origins: list[int] = []
    for k in range(len(groups) - 1, 0, -1):
        if not origins or math.log10(flops[origins[-1]] / flops[k]) >= FOLD_SPACING_DECADES - 1e-9:
            origins.append(k)
        if len(origins) == MAX_FOLDS:
            break
    return origins[::-1]


def degenerate_reason(form: str, train: list[Point], train_budgets: int) -> str | None:
    """Why a fold with these training runs cannot tell (None: it can; see the module docstring)."""
    constants = len(LAW_FORMS[form].constants)
    distinct = len(configuration_groups([p.params for p in train], [p.tokens for p in train]))
    if distinct <= constants + SPARE_DEGREES_OF_FREEDOM:
        return (f"{distinct} distinct (N, D) to fit {constants} constants: a fold counts with more than "
                f"{constants + SPARE_DEGREES_OF_FREEDOM} (residual degrees of freedom to spare)")
    if train_budgets < MIN_TRAIN_BUDGETS:
        return ("one training budget: its runs lie on one FLOPs line, where N and D change together, so the "
                "form's N and D terms are not separately identified")
    return None


def rolling_backtest(form: str, points: list[Point], objective: str = "huber",
                     huber_delta: float | None = None) -> Backtest:
    """Budgets sorted by FLOPs (laws.group_by_budget); from each origin (fold_origins) the form is
    fitted on the budgets below it and predicts every run from the origin on. A degenerate fold is
    skipped with its reason, a fold the form cannot fit is recorded as failed, with its reason."""
    groups = sorted(group_by_budget(points), key=lambda g: min(points[i].flops for i in g))
    folds, warm = [], None
    for k in fold_origins(groups, points):
        train = [points[i] for g in groups[:k] for i in g]
        test = [[points[i] for i in g] for g in groups[k:]]
        fold, fitted = _fold(form, train, k, test, objective, huber_delta, warm)
        folds.append(fold)
        warm = fitted if fitted is not None else warm
    loo = math.nan if any(fold.counted for fold in folds) else leave_one_out_error(form, points, objective,
                                                                                   huber_delta)
    return _summary(form, folds, loo)


def _fold(form: str, train: list[Point], train_budgets: int, test_budgets: list[list[Point]], objective: str,
          huber_delta: float | None, warm: LawFit | None) -> tuple[Fold, LawFit | None]:
    test = [point for budget in test_budgets for point in budget]
    params, tokens, losses, unique = _arrays(test)
    origin = float(np.exp(np.mean(np.log([p.flops for p in test_budgets[0]]))))
    distinct = len(configuration_groups([p.params for p in train], [p.tokens for p in train]))
    head = (origin, train_budgets, distinct, max(p.flops for p in train), params.tolist(), tokens.tolist(),
            [p.flops for p in test], losses.tolist())
    unpredicted = [math.nan] * len(test)
    skipped = degenerate_reason(form, train, train_budgets)
    if skipped is not None:
        return Fold(*head, unpredicted, False, skipped=skipped), None
    try:
        fitted = _fit(form, train, objective, huber_delta, warm)
        predicted = fitted.loss(params, tokens, unique)
        if not np.all(np.isfinite(predicted)):
            raise ValueError("the fitted law predicts a non-finite loss")
    except (ValueError, FloatingPointError, OverflowError) as reason:
        return Fold(*head, unpredicted, False, failed=str(reason)), None
    first = len(test_budgets[0])
    ranking = bool(np.array_equal(np.argsort(predicted[:first], kind="stable"),
                                  np.argsort(losses[:first], kind="stable")))
    leverage = prediction_leverage(fitted, _arrays(train), (params, tokens, losses, unique))
    return Fold(*head, predicted.tolist(), ranking, leverage=leverage), fitted


def prediction_leverage(fitted: LawFit, train: tuple[np.ndarray, ...], test: tuple[np.ndarray, ...]) -> np.ndarray:
    """G (J'J)^+ G': the delta-method covariance of the predicted ln L per unit noise variance (Seber &
    Wild 1989, "Nonlinear Regression", sec. 5.1), J and G the form's d ln L / d theta at the training
    and test runs. J's columns are scaled to unit norm first and singular values below LEVERAGE_RCOND of
    the largest dropped, so a constant pinned at a bound (E -> 0) counts as fixed."""
    law = fitted.law
    theta = law.theta(fitted.constants)

    def jacobian(params: np.ndarray, tokens: np.ndarray, unique: np.ndarray) -> np.ndarray:
        tokens = effective_tokens(tokens, unique) if law.data_constrained else tokens
        return law.jacobian(theta, np.log(params), np.log(tokens))

    train_j, test_j = jacobian(train[0], train[1], train[3]), jacobian(test[0], test[1], test[3])
    norms = np.linalg.norm(train_j, axis=0)
    scale = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1.0), 0.0)
    inverse = np.linalg.pinv((train_j * scale).T @ (train_j * scale), rcond=LEVERAGE_RCOND, hermitian=True)
    scaled = test_j * scale
    return scaled @ inverse @ scaled.T


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
    scored = [fold for fold in folds if fold.counted]
    if not scored:
        return Backtest(form, folds, math.nan, math.nan, 0, 0, loo)
    return Backtest(form, folds, float(np.mean([np.abs(f.errors_pct).mean() for f in scored])),
                    float(np.mean([f.errors_pct.mean() for f in scored])),
                    sum(f.ranking_correct for f in scored), len(scored), loo)


# ---------------------------------------------------------------------------------------------
# The choice


def choose_form(backtests: dict[str, Backtest], fits: dict[str, LawFit], noise_sd: float = 0.0) -> Choice:
    """The form chosen on the decision folds, with the forms tied with the best and the reason (see the
    module docstring; `noise_sd`, the runs' noise in ln L, bounds the tie margin from below). Without
    any counted fold: the lowest leave-one-out error. ValueError when no form was fitted."""
    if not fits:
        raise ValueError("no law form could be fitted, so none can be chosen")
    if len(fits) == 1:
        (form,) = fits
        return Choice(form, f"{form}: the only form that could be fitted", (form,))
    tested = {form: backtests[form] for form in fits if form in backtests and backtests[form].scored}
    if not tested:
        return _choose_by_leave_one_out(backtests, fits)
    candidates, dropped = _sharing_folds(tested)
    common = sorted(set.intersection(*({f.budget_flops for f in tested[form].scored} for form in candidates)))
    decision = common[-DECISION_FOLDS:]
    per_fold = {form: {f.budget_flops: f for f in tested[form].scored} for form in candidates}
    scores = {form: float(np.mean([np.abs(per_fold[form][c].errors_pct).mean() for c in decision]))
              for form in candidates}
    best = min(candidates, key=lambda form: (scores[form], len(LAW_FORMS[form].constants)))
    runs = sum(len(per_fold[best][c].params) for c in decision)
    noise_margin = TIE_STANDARD_ERRORS * 100.0 * noise_sd * math.sqrt((1.0 - 2.0 / math.pi) / runs)
    margins = {form: max(_tie_margin(per_fold[form], per_fold[best], decision), noise_margin) for form in candidates}
    ties = tuple(form for form in sorted(candidates, key=lambda f: scores[f])
                 if scores[form] - scores[best] <= margins[form])
    chosen = min(ties, key=lambda form: (len(LAW_FORMS[form].constants), scores[form]))
    reason = _reason(chosen, best, ties, decision, scores, margins, tested, fits, dropped)
    return Choice(chosen, reason, ties, tuple(decision), scores)


def _sharing_folds(tested: dict[str, Backtest]) -> tuple[list[str], list[str]]:
    """The forms to compare: all, unless they share no counted fold; then the forms with the fewest
    counted folds are left out until the rest share one (returned second)."""
    candidates, dropped = list(tested), []
    while len(candidates) > 1 and not set.intersection(*({f.budget_flops for f in tested[form].scored}
                                                        for form in candidates)):
        weakest = min(candidates, key=lambda form: len(tested[form].scored))
        candidates.remove(weakest)
        dropped.append(weakest)
    return candidates, dropped


def _tie_margin(form_folds: dict[float, Fold], best_folds: dict[float, Fold], decision: list[float]) -> float:
    """TIE_STANDARD_ERRORS standard errors of the form's mean |error| minus the best's: over the
    decision folds' paired differences, or over the runs of the one decision fold."""
    if len(decision) > 1:
        differences = np.array([np.abs(form_folds[c].errors_pct).mean() - np.abs(best_folds[c].errors_pct).mean()
                                for c in decision])
    else:
        (origin,) = decision
        differences = np.abs(form_folds[origin].errors_pct) - np.abs(best_folds[origin].errors_pct)
    if len(differences) < 2:
        return 0.0
    return float(TIE_STANDARD_ERRORS * differences.std(ddof=1) / math.sqrt(len(differences)))


def _reason(chosen: str, best: str, ties: tuple[str, ...], decision: list[float], scores: dict[str, float],
            margins: dict[str, float], tested: dict[str, Backtest], fits: dict[str, LawFit],
            dropped: list[str]) -> str:
    folds = ", ".join(f"{c:.3g}" for c in decision)
    parts = [f"{form}: {scores[form]:.3g}%" + ("" if form == best else f" (+{scores[form] - scores[best]:.3g}, tie "
                                                 f"margin {margins[form]:.3g})")
             for form in sorted(scores, key=lambda f: scores[f])]
    parts += [f"{form}: shares no counted fold with the others" for form in dropped]
    parts += [f"{form}: no backtest fold counted" for form in fits if form not in tested]
    text = (f"mean |error| on the {len(decision)} counted fold(s) with the most training budgets (origins C "
            f"{folds}): " + "; ".join(parts))
    if len(ties) == 1:
        return f"{text}; {chosen} is best beyond the folds' noise"
    return (f"{text}; {', '.join(ties)} tie (within {TIE_STANDARD_ERRORS:g} standard errors of the best), so the "
            f"prior decides, {SIMPLER_PRIOR}: {chosen}; the interval spans the tied forms")


def _choose_by_leave_one_out(backtests: dict[str, Backtest], fits: dict[str, LawFit]) -> Choice:
    """choose_form's fallback where no fold counts: the leave-one-out error of each run."""
    errors = {form: backtests[form].loo_abs_error_pct if form in backtests else math.nan for form in fits}
    ranked = sorted(fits, key=lambda form: (errors[form] if math.isfinite(errors[form]) else math.inf,
                                            len(LAW_FORMS[form].constants)))
    parts = [f"{form}: {errors[form]:.3g}% mean leave-one-out |error|" for form in ranked]
    skipped = {fold.skipped or fold.failed for b in backtests.values() for fold in b.folds} - {None}
    why = "; ".join(sorted(skipped)) or "fewer than 2 budgets"
    return Choice(ranked[0], f"no backtest fold counted ({why}); lowest leave-one-out error instead: "
                  + "; ".join(parts), (ranked[0],), scores={form: errors[form] for form in ranked})
