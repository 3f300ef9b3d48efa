"""Prediction intervals for a new run's loss: what the law's constants, the run's noise, the choice of
form and the extrapolation itself leave uncertain, combined in ln L.

A new run's ln L at (N, D), x decades beyond the largest budget fitted, is modelled as

    ln L = mu + e,   mu ~ the tied forms' bootstrap refits (each form weighing the same),
                     e ~ N(0, s0^2 + (tau x)^2)

- mu: every refit of every form the backtests cannot tell from the chosen one (backtest.Choice.ties):
  parameter uncertainty (Efron & Tibshirani 1993, ch. 6) and the spread between the tied forms;
  a form with too few refits enters with its full-data fit alone;
- s0: the noise a run at the fitted budgets shows around the law: the run-to-run sd from seed repeats
  or the law's own residual scale (1.4826 x median |residual|, robust to outlying runs, scaled by
  sqrt(n / (n - constants)) for the fitted constants), whichever is larger (a law that misfits its own
  runs misses a new one by as much);
- tau: the backtests' own error growing linearly with the extrapolation distance: each counted fold's
  predictions e = ln(predicted / measured) at x decades beyond its training runs are modelled as
  e ~ N(0, s0^2 (I + H) + tau^2 x x'), H the fold's leverage (backtest.prediction_leverage): the
  test runs' noise and the fold's own parameter uncertainty (what a right law's errors would be; the
  bootstrap covers the full fit's), plus a drift of sd tau per decade shared along the fold (a wrong
  law errs the same way as it extrapolates further). tau is the maximum-likelihood drift, kept where
  a likelihood-ratio test finds it; a law extrapolated as far as its backtests is as wrong as they
  were, and the linear growth carries that to the target's distance.

The point prediction under a tie is the median of mu (mixture_median): an equal-weight model average
of the tied forms (Burnham & Anderson 2002, "Model Selection and Multimodel Inference", ch. 4, with
equal weights because the backtests cannot rank them), the median so that one form's skewed refits do
not drag it. It is the law's value; e, symmetric about it, is what a new run adds, so it is left out
(it would pull the median of a lopsided mixture toward the forms' mean). Being the median of mu, it
lies between the quartiles of mu + e, inside any central interval of 50% or more. Without a tie the
point is the chosen form's own fit.

The interval is the mixture's central quantiles, found for each point by bisection on its own
distribution function: no random draws, so a point's interval is a function of the fit and that
point alone, whatever else is predicted beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import ndtr

from scaletrain.scaling.laws import LOG_CLIP, LawFit, effective_tokens

MAD_TO_SD = 1.4826  # 1 / Phi^-1(3/4): the median absolute deviation of a normal sample, in sds
# The likelihood-ratio statistic tau must pass to count: 2.71, the 95% point of the boundary test's
# 1/2 chi2_0 + 1/2 chi2_1 (Self & Liang 1987), so a right law's backtests give tau = 0 19 times in 20.
EXCESS_CRITICAL_VALUE = 2.71
BISECTIONS = 200  # to the last representable bit of ln L in the bracket


@dataclass(frozen=True)
class ExtrapolationError:
    """tau: the sd of ln L's backtest error added per decade of extrapolation beyond the floor s0, how
    many backtest predictions it was fitted on, and how (for fit.json)."""

    per_decade: float
    predictions: int
    how: str


def robust_residual_sd(fit: LawFit, params: np.ndarray, tokens: np.ndarray, losses: np.ndarray,
                       unique_tokens: np.ndarray | None) -> float:
    """1.4826 x the median |ln L_hat - ln L| about its median, x sqrt(n / (n - constants)); 0 without
    residual freedom."""
    residuals = np.log(fit.loss(params, tokens, unique_tokens)) - np.log(losses)
    spare = len(residuals) - len(fit.constants)
    if spare <= 0:
        return 0.0
    scale = MAD_TO_SD * float(np.median(np.abs(residuals - np.median(residuals))))
    return scale * math.sqrt(len(residuals) / spare)


def fit_extrapolation_error(folds: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                            floor: float) -> ExtrapolationError:
    """tau by maximum likelihood over the backtest folds, each (errors e, decades x, leverage H) with
    e ~ N(0, floor^2 (I + H) + tau^2 x x'): the test run's noise, the fold's own parameter uncertainty
    (backtest.prediction_leverage, which the bootstrap already covers for the full fit) and a drift
    per decade common to the fold's predictions (a wrong law errs the same way along one fold). tau is
    kept only where the likelihood ratio against tau = 0 exceeds EXCESS_CRITICAL_VALUE."""
    terms, predictions, distances = [], 0, []
    for errors, decades, leverage in folds:
        errors, decades = np.asarray(errors, dtype=float), np.maximum(np.asarray(decades, dtype=float), 0.0)
        if not len(errors) or not np.all(np.isfinite(errors)) or leverage is None:
            continue
        terms.append(_fold_terms(errors, decades, leverage, max(floor, 1e-9)))
        predictions += len(errors)
        distances.extend(decades.tolist())
    if not terms or max(distances) <= 0:
        return ExtrapolationError(0.0, 0, "no backtest prediction beyond its training runs: no term for the "
                                  "extrapolation")

    def negative_log_likelihood(tau: float) -> float:
        """-2 ln likelihood + const, by the rank-one update of each fold's covariance (see _fold_terms)."""
        t2 = tau * tau
        return float(sum(math.log1p(t2 * a) + c - t2 * b * b / (1.0 + t2 * a) for a, b, c in terms))

    upper = 10.0 * max(abs(b) / a for a, b, _ in terms if a > 0) if any(a > 0 for a, _, _ in terms) else 1.0
    tau = float(minimize_scalar(negative_log_likelihood, bounds=(0.0, upper), method="bounded",
                                options={"xatol": 1e-10}).x)
    ratio = negative_log_likelihood(0.0) - negative_log_likelihood(tau)
    backtests = (f"{len(terms)} folds ({predictions} predictions {min(distances):.2g} to {max(distances):.2g} "
                 f"decades out), beyond what a noise of {floor:.3g} and each fold's parameter uncertainty explain")
    if ratio <= EXCESS_CRITICAL_VALUE:
        return ExtrapolationError(0.0, predictions, f"no drift: the maximum-likelihood {tau:.3g} per decade on "
                                  f"{backtests}, fails the likelihood-ratio test ({ratio:.3g} <= "
                                  f"{EXCESS_CRITICAL_VALUE})")
    return ExtrapolationError(tau, predictions, f"a drift of sd {tau:.3g} in ln L per decade beyond the training "
                              f"runs, the maximum likelihood on {backtests} (likelihood ratio {ratio:.3g})")


def _fold_terms(errors: np.ndarray, decades: np.ndarray, leverage: np.ndarray,
                floor: float) -> tuple[float, float, float]:
    """(x' A^-1 x, x' A^-1 e, e' A^-1 e) for A = floor^2 (I + H): with C = A + tau^2 x x',
    ln det C = ln det A + ln(1 + tau^2 a) and e' C^-1 e = c - tau^2 b^2 / (1 + tau^2 a)."""
    covariance = floor**2 * (np.eye(len(errors)) + np.asarray(leverage, dtype=float))
    factor = np.linalg.cholesky(covariance + 1e-12 * floor**2 * np.eye(len(errors)))
    whitened_x, whitened_e = (np.linalg.solve(factor, v) for v in (decades, errors))
    return float(whitened_x @ whitened_x), float(whitened_x @ whitened_e), float(whitened_e @ whitened_e)


def log_losses(fits: list[LawFit], params: float, tokens: float, unique_tokens: float | None) -> np.ndarray:
    """ln L of every fit (all of one form) at one (N, D), in one vectorised evaluation over the fits."""
    law = fits[0].law
    if law.data_constrained:
        tokens = float(effective_tokens(np.array([tokens]), None if unique_tokens is None
                                        else np.array([unique_tokens]))[0])
    thetas = np.array([law.theta(fit.constants) for fit in fits])
    values = law.log_loss(thetas, np.array([math.log(params)]), np.array([math.log(tokens)]))[:, 0]
    return np.clip(values, -LOG_CLIP, LOG_CLIP)


def mixture_interval(centres: list[np.ndarray], sd: float, confidence: float) -> tuple[float, float]:
    """The central `confidence` interval of L whose ln L is the equal-weight mixture over the groups in
    `centres` (each group an equal-weight mixture of N(centre, sd^2); point masses when sd is 0);
    NaN where nothing spreads it (sd 0 and one distinct centre)."""
    groups = [np.asarray(group, dtype=float) for group in centres if len(group)]
    everything = np.concatenate(groups)
    if sd <= 0 and np.ptp(everything) == 0:
        return math.nan, math.nan
    tail = 0.5 * (1.0 - confidence)
    low, high = (math.exp(_mixture_quantile(groups, sd, p)) for p in (tail, 1.0 - tail))
    return low, high


def mixture_median(centres: list[np.ndarray]) -> float:
    """The median of L whose ln L is mu, the equal-weight mixture of the groups of point masses in
    `centres` (mixture_interval's groups, without its normal term)."""
    groups = [np.asarray(group, dtype=float) for group in centres if len(group)]
    return math.exp(_mixture_quantile(groups, 0.0, 0.5))


def _mixture_quantile(groups: list[np.ndarray], sd: float, probability: float) -> float:
    def cdf(value: float) -> float:
        if sd > 0:
            return float(np.mean([ndtr((value - group) / sd).mean() for group in groups]))
        return float(np.mean([(group <= value).mean() for group in groups]))

    everything = np.concatenate(groups)
    low, high = float(everything.min() - 12 * sd) - 1e-12, float(everything.max() + 12 * sd) + 1e-12
    for _ in range(BISECTIONS):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return high
