"""Parametric scaling-law forms L(N, D): their registry, their fits, the FLOPs-per-token model of a
sweep, compute-optimal allocation on the exact FLOPs line, and run-to-run noise.

Forms (LAW_FORMS): Hoffmann et al. 2022 eq. 2 ("chinchilla"), Kaplan et al. 2020 eq. 1.5
("kaplan", and "kaplan_e" with an irreducible loss added) and Muennighoff et al. 2023 eq. 5
("muennighoff": chinchilla on the effective data of a repeated corpus). Every form is written as
ln L(theta; ln N, ln D) with log-sum-exp, so no constant can reach log(0) and nothing overflows,
and fitted by scipy.optimize.least_squares on r = ln L_hat - ln L from a screened grid of starts.
The backtests that choose between forms are in backtest.py; the integration in fit.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import least_squares, minimize_scalar

BUDGET_TOLERANCE = 0.05  # runs whose FLOPs differ by less than this share an IsoFLOP budget
R_STAR = 15.4  # Muennighoff et al. 2023, eq. 5: the fitted R_D* (repetitions' half-life of value)
HUBER_EFFICIENCY = 1.345  # Huber 1964: delta = 1.345 sigma is 95% efficient under Gaussian noise
MIN_HUBER_DELTA = 1e-6  # a noiseless fit's residual sd is ~0; least_squares needs f_scale > 0
SCREENED_STARTS = 16  # starts run to convergence, of the grid's best by objective at the start
HUBER_STARTS = 3  # least-squares optima from which the Huber fit starts
LOG_CLIP = 700.0  # |ln x| beyond this overflows exp in double precision
SAME_RUN_TOLERANCE = 1e-9  # (N, D) equal to this relative tolerance are one configuration
SEARCH_DECADES_BELOW = 4.0  # compute_optimal searches N from 1e-4 x the smallest size trained ...
SEARCH_MIN_TOKENS_PER_FLOP = 1e3  # ... up to where D = 1e3 tokens
SEARCH_GRID = 4001
LEAST_SQUARES_OPTIONS = {"ftol": 1e-12, "xtol": 1e-12, "gtol": 1e-12, "max_nfev": 1000}
OBJECTIVES = ("huber", "least_squares")


# ---------------------------------------------------------------------------------------------
# Runs


@dataclass(frozen=True)
class Point:
    """One finished run: parameters N, tokens D, FLOPs C, final loss, its IsoFLOP budget if recorded, the
    unique tokens of the corpus's training split (for the data-constrained law; None when unknown) and
    the run's seed (repeats of one (N, D) with different seeds measure run-to-run noise)."""

    params: float
    tokens: float
    flops: float
    loss: float
    budget: float | None = None
    unique_tokens: float | None = None
    seed: int | None = None


def group_by_budget(points: list[Point], tolerance: float = BUDGET_TOLERANCE) -> list[list[int]]:
    """Indices of the points on each IsoFLOP profile: the recorded budget where there is one, else
    runs whose FLOPs lie within `tolerance` (relative) of the smallest FLOPs of their group."""
    recorded: dict[float, list[int]] = {}
    clusters: list[list[int]] = []
    for index in sorted(range(len(points)), key=lambda i: points[i].flops):
        point = points[index]
        if point.budget is not None:
            recorded.setdefault(point.budget, []).append(index)
        elif clusters and point.flops <= points[clusters[-1][0]].flops * (1 + tolerance):
            clusters[-1].append(index)
        else:
            clusters.append([index])
    return list(recorded.values()) + clusters


def configuration_groups(params: ArrayLike, tokens: ArrayLike) -> list[np.ndarray]:
    """Indices of the runs sharing one (N, D) to SAME_RUN_TOLERANCE (relative): seed repeats."""
    keys = np.round(np.stack([np.log(np.asarray(params, dtype=float)), np.log(np.asarray(tokens, dtype=float))],
                             axis=1) / SAME_RUN_TOLERANCE)
    _, which = np.unique(keys, axis=0, return_inverse=True)
    return [np.flatnonzero(which.ravel() == g) for g in range(which.max() + 1)] if len(keys) else []


# ---------------------------------------------------------------------------------------------
# Forms


def _columns(theta: np.ndarray) -> list[np.ndarray]:
    """theta's constants as (K, 1) columns for K parameter vectors ((p,) is one vector)."""
    theta = np.atleast_2d(np.asarray(theta, dtype=float))
    return [theta[:, i, None] for i in range(theta.shape[1])]


def _chinchilla(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """ln(E + A/N^alpha + B/D^beta) (Hoffmann et al. 2022, eq. 2) from (ln E, ln A, ln B, alpha, beta)."""
    log_e, log_a, log_b, alpha, beta = _columns(theta)
    return np.logaddexp(np.logaddexp(log_a - alpha * log_n, log_b - beta * log_d), log_e + 0 * log_n)


def _chinchilla_jacobian(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """d ln L / d theta: each term's share of L (a softmax), times -ln N or -ln D for the exponents."""
    log_e, log_a, log_b, alpha, beta = theta
    terms = np.stack([log_e + 0 * log_n, log_a - alpha * log_n, log_b - beta * log_d], axis=1)
    share = np.exp(terms - np.logaddexp.reduce(terms, axis=1, keepdims=True))
    return np.column_stack([share, -share[:, 1] * log_n, -share[:, 2] * log_d])


def _kaplan_bracket(log_nc: np.ndarray, log_dc: np.ndarray, alpha_n: np.ndarray, alpha_d: np.ndarray,
                    log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """ln [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D (Kaplan et al. 2020, eq. 1.5)."""
    return alpha_d * np.logaddexp(alpha_n / alpha_d * (log_nc - log_n), log_dc - log_d)


def _kaplan(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    return _kaplan_bracket(*_columns(theta), log_n, log_d)


def _kaplan_jacobian(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """d/d(ln N_c, ln D_c, alpha_N, alpha_D) of alpha_D ln(e^u + e^v), u = alpha_N/alpha_D (ln N_c - ln N),
    v = ln D_c - ln D; w is e^u's share of the sum."""
    log_nc, log_dc, alpha_n, alpha_d = theta
    u, v = alpha_n / alpha_d * (log_nc - log_n), log_dc - log_d
    bracket = np.logaddexp(u, v)
    w = np.exp(u - bracket)
    return np.column_stack([alpha_n * w, alpha_d * (1 - w), w * (log_nc - log_n), bracket - w * u])


def _kaplan_e(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """ln(E + Kaplan's eq. 1.5): the irreducible loss that eq. 1.5 lacks (Henighan et al. 2020, eq. 1.1)."""
    log_e, *kaplan = _columns(theta)
    return np.logaddexp(log_e + 0 * log_n, _kaplan_bracket(*kaplan, log_n, log_d))


def _kaplan_e_jacobian(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    bracket = _kaplan(theta[1:], log_n, log_d)[0]
    share_e = np.exp(theta[0] - np.logaddexp(theta[0], bracket))
    return np.column_stack([share_e, (1 - share_e)[:, None] * _kaplan_jacobian(theta[1:], log_n, log_d)])


@dataclass(frozen=True)
class LawForm:
    """One law: ln L = log_loss(theta, ln N, ln D) for theta (p,) or (K, p), giving (K, runs), and
    jacobian(theta (p,), ln N, ln D), d ln L / d theta as (runs, p).

    theta holds the constants in `constants` order, those in `logged` as their logarithm (so they
    stay positive). `lower`/`upper` bound theta; `starts` is the grid of initial thetas. A
    data-constrained form reads ln D' (effective_tokens) for ln D.
    """

    name: str
    formula: str
    citation: str
    constants: tuple[str, ...]
    logged: tuple[str, ...]
    log_loss: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    jacobian: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    starts: np.ndarray = field(repr=False)
    data_constrained: bool = False

    def loss(self, theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
        return np.exp(np.clip(self.log_loss(theta, log_n, log_d), -LOG_CLIP, LOG_CLIP))

    def theta(self, constants: dict[str, float]) -> np.ndarray:
        with np.errstate(divide="ignore"):
            values = [math.log(constants[k]) if k in self.logged and constants[k] > 0 else
                      (-LOG_CLIP if k in self.logged else constants[k]) for k in self.constants]
        return np.array(values, dtype=float)

    def named(self, theta: np.ndarray) -> dict[str, float]:
        return {k: float(math.exp(min(v, LOG_CLIP))) if k in self.logged else float(v)
                for k, v in zip(self.constants, theta, strict=True)}


def _grid(*axes: Iterable[float]) -> np.ndarray:
    return np.array(list(itertools.product(*axes)), dtype=float)


# Hoffmann et al. 2022, app. D.2's grid, in (ln E, ln A, ln B, alpha, beta) order: 4,500 starts.
_CHINCHILLA_STARTS = _grid(np.arange(-1, 1.01, 0.5), range(0, 26, 5), range(0, 26, 5), np.arange(0, 2.01, 0.5),
                           np.arange(0, 2.01, 0.5))
_CHINCHILLA_BOUNDS = ((-30.0, -20.0, -20.0, 0.0, 0.0), (5.0, 80.0, 80.0, 4.0, 4.0))
_KAPLAN_AXES = (np.linspace(10, 40, 7), np.linspace(10, 40, 7), (0.05, 0.1, 0.2, 0.4, 0.8), (0.05, 0.1, 0.2, 0.4, 0.8))
_KAPLAN_BOUNDS = ((-20.0, -20.0, 1e-3, 1e-3), (100.0, 100.0, 5.0, 5.0))
_CHINCHILLA_TEXT = "L = E + A / N^alpha + B / D^beta"

LAW_FORMS: dict[str, LawForm] = {
    "chinchilla": LawForm(
        "chinchilla", _CHINCHILLA_TEXT, "Hoffmann et al. 2022, eq. 2", ("E", "A", "B", "alpha", "beta"),
        ("E", "A", "B"), _chinchilla, _chinchilla_jacobian, *_CHINCHILLA_BOUNDS, _CHINCHILLA_STARTS),
    "kaplan": LawForm(
        "kaplan", "L = [(N_c / N)^(alpha_N / alpha_D) + D_c / D]^alpha_D", "Kaplan et al. 2020, eq. 1.5",
        ("N_c", "D_c", "alpha_N", "alpha_D"), ("N_c", "D_c"), _kaplan, _kaplan_jacobian, *_KAPLAN_BOUNDS,
        _grid(*_KAPLAN_AXES)),
    "kaplan_e": LawForm(
        "kaplan_e", "L = E + [(N_c / N)^(alpha_N / alpha_D) + D_c / D]^alpha_D",
        "Kaplan et al. 2020, eq. 1.5, plus an irreducible loss E", ("E", "N_c", "D_c", "alpha_N", "alpha_D"),
        ("E", "N_c", "D_c"), _kaplan_e, _kaplan_e_jacobian, (-30.0, *_KAPLAN_BOUNDS[0]), (5.0, *_KAPLAN_BOUNDS[1]),
        _grid(np.arange(-1, 1.01, 0.5), *_KAPLAN_AXES)),
    "muennighoff": LawForm(
        "muennighoff", _CHINCHILLA_TEXT + "', D' = U + U R* (1 - exp(-R / R*)), R = D / U - 1, "
        f"R* = {R_STAR}", "Muennighoff et al. 2023, eq. 5 (data side only)", ("E", "A", "B", "alpha", "beta"),
        ("E", "A", "B"), _chinchilla, _chinchilla_jacobian, *_CHINCHILLA_BOUNDS, _CHINCHILLA_STARTS,
        data_constrained=True),
}


def effective_tokens(tokens: ArrayLike, unique_tokens: ArrayLike | None) -> np.ndarray:
    """D' = U_D + U_D R* (1 - exp(-R_D / R*)), U_D = min(D, U), R_D = D / U_D - 1 (Muennighoff et al.
    2023, eq. 5): repeated tokens are worth less with each epoch. Unknown U (None, NaN): D' = D."""
    tokens = np.asarray(tokens, dtype=float)
    if unique_tokens is None:
        return tokens
    unique = np.broadcast_to(np.asarray(unique_tokens, dtype=float), tokens.shape)
    seen = np.where(np.isfinite(unique) & (unique > 0), np.minimum(tokens, unique), tokens)
    repeats = tokens / seen - 1.0
    return seen + seen * R_STAR * (1.0 - np.exp(-repeats / R_STAR))


# ---------------------------------------------------------------------------------------------
# Fits


@dataclass(frozen=True)
class LawFit:
    """A fitted form: its constants, the objective at the optimum (scipy's cost: 1/2 sum rho(r^2)),
    and the Huber delta used (None for least squares) with how it was obtained."""

    form: str
    constants: dict[str, float]
    objective: float
    huber_delta: float | None = None
    delta_how: str = ""

    @property
    def law(self) -> LawForm:
        return LAW_FORMS[self.form]

    def loss(self, params: ArrayLike, tokens: ArrayLike, unique_tokens: ArrayLike | None = None) -> np.ndarray:
        tokens = effective_tokens(tokens, unique_tokens) if self.law.data_constrained else tokens
        log_n, log_d = np.log(np.asarray(params, dtype=float)), np.log(np.asarray(tokens, dtype=float))
        log_n, log_d = np.broadcast_arrays(log_n, log_d)
        values = self.law.loss(self.law.theta(self.constants), log_n.ravel(), log_d.ravel())[0]
        return values.reshape(log_n.shape)


def fit_law(form: str, params: ArrayLike, tokens: ArrayLike, losses: ArrayLike,
            unique_tokens: ArrayLike | None = None, objective: str = "huber", huber_delta: float | None = None,
            starts: np.ndarray | None = None, screened: int = SCREENED_STARTS) -> LawFit:
    """Fit `form` to the runs by least_squares on r = ln L_hat - ln L (see least_squares_ends), then for
    the Huber objective (f_scale = delta) from the HUBER_STARTS best least-squares ends: M-estimation
    started from least squares, as a Huber objective with a small delta is nearly L1 and slow to descend
    from a far start. huber_delta None: delta = 1.345 sigma (huber_delta_auto). ValueError when the runs
    cannot determine the form's constants or no start gives a finite fit."""
    law = _law(form)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is unknown; use one of {', '.join(OBJECTIVES)}")
    data = _law_data(law, params, tokens, losses, unique_tokens)
    ends = least_squares_ends(law, *data, starts, screened)
    if objective == "least_squares":
        return LawFit(form, law.named(ends[0][0]), ends[0][1], None, "least squares")
    delta, how = (huber_delta, "given") if huber_delta is not None else huber_delta_auto(law, *data, ends[0][0])
    polished = [end for end in (_least_squares(law, theta, *data, delta) for theta, _ in ends[:HUBER_STARTS])
                if end is not None]
    if not polished:
        raise ValueError(f"{law.name}: the Huber fit (delta {delta:.3g}) diverged from every least-squares optimum")
    theta, cost = min(polished, key=lambda end: end[1])
    return LawFit(form, law.named(theta), cost, delta, how)


def refit_law(fit: LawFit, params: ArrayLike, tokens: ArrayLike, losses: ArrayLike,
              unique_tokens: ArrayLike | None = None) -> LawFit:
    """`fit`'s form on other runs (a bootstrap resample, all runs but one), by one least_squares from
    `fit`'s optimum with its objective and Huber delta (the delta is part of the estimator, so it stays
    fixed): a resample's optimum lies near the full-data one. ValueError when it does not converge."""
    law = LAW_FORMS[fit.form]
    data = _law_data(law, params, tokens, losses, unique_tokens)
    end = _least_squares(law, law.theta(fit.constants), *data, fit.huber_delta)
    if end is None:
        raise ValueError(f"{law.name}: the refit from the full-data optimum diverged")
    return LawFit(fit.form, law.named(end[0]), end[1], fit.huber_delta, fit.delta_how)


def _law(form: str) -> LawForm:
    if form not in LAW_FORMS:
        raise ValueError(f"law form {form!r} is unknown; use one of {', '.join(LAW_FORMS)}")
    return LAW_FORMS[form]


def _law_data(law: LawForm, params: ArrayLike, tokens: ArrayLike, losses: ArrayLike,
              unique_tokens: ArrayLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ln N, ln D (D' for a data-constrained form), ln L), checked to determine the form's constants."""
    params, tokens, losses = (np.asarray(x, dtype=float).ravel() for x in (params, tokens, losses))
    if not (len(params) == len(tokens) == len(losses)) or not np.all(np.isfinite(np.log(
            np.concatenate([params, tokens, losses])))):
        raise ValueError(f"{law.name}: params, tokens and losses must be equally long and all positive")
    if law.data_constrained:
        unique = (np.full(len(tokens), np.nan) if unique_tokens is None
                  else np.asarray(unique_tokens, dtype=float).ravel())
        if not np.any(np.isfinite(unique)):
            raise ValueError(f"{law.name}: no run records unique_tokens (the corpus's training tokens), so the "
                             "effective data D' is unknown; record it to fit the data-constrained law")
        if not np.any(tokens > unique * (1 + SAME_RUN_TOLERANCE)):
            raise ValueError(f"{law.name}: no run repeats data (D <= unique_tokens everywhere), where the law "
                             "equals chinchilla; it needs runs of more than one epoch")
        tokens = effective_tokens(tokens, unique)
    distinct = len(configuration_groups(params, tokens))
    if distinct < len(law.constants):
        raise ValueError(f"{law.name} needs >= {len(law.constants)} runs with distinct (N, D) to fit its "
                         f"{len(law.constants)} constants; got {distinct}")
    return np.log(params), np.log(tokens), np.log(losses)


def huber_delta_auto(law: LawForm, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                     least_squares_theta: np.ndarray) -> tuple[float, str]:
    """delta = 1.345 sigma (Huber 1964's 95%-efficiency constant for Gaussian noise), sigma the
    run-to-run noise of ln L from seed repeats if the runs have any, else the residual sd (ddof = the
    form's constants) of the least-squares fit of the same form. Floored at MIN_HUBER_DELTA."""
    sigma = pooled_log_sd(log_n, log_d, log_l)
    how = "1.345 x run-to-run sigma of ln L from seed repeats"
    if sigma is None or sigma <= 0:
        residual = law.log_loss(least_squares_theta, log_n, log_d)[0] - log_l
        sigma = float(np.sqrt((residual**2).sum() / max(len(residual) - len(law.constants), 1)))
        how = "1.345 x residual sd of ln L in a least-squares fit (no seed repeats)"
    delta = HUBER_EFFICIENCY * sigma
    if delta < MIN_HUBER_DELTA:
        return MIN_HUBER_DELTA, how + f", floored at {MIN_HUBER_DELTA:g}"
    return float(delta), how


def objective_values(law: LawForm, thetas: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                     huber_delta: float | None) -> np.ndarray:
    """scipy least_squares' cost at each theta: 1/2 sum r^2, or 1/2 delta^2 sum rho((r/delta)^2) with
    Huber's rho(z) = z for z <= 1 else 2 sqrt(z) - 1. Non-finite where a theta diverges."""
    with np.errstate(all="ignore"):
        residual = law.log_loss(thetas, log_n, log_d) - log_l
        if huber_delta is None:
            return 0.5 * (residual**2).sum(axis=1)
        z = (residual / huber_delta) ** 2
        return 0.5 * huber_delta**2 * np.where(z <= 1, z, 2 * np.sqrt(z) - 1).sum(axis=1)


def least_squares_ends(law: LawForm, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                       starts: np.ndarray | None = None,
                       screened: int = SCREENED_STARTS) -> list[tuple[np.ndarray, float]]:
    """Least-squares fits from `starts` and from the `screened` grid starts with the lowest cost at the
    start (screening all of the grid costs one vectorised evaluation), lowest cost first. A start that
    fails (an exception, a non-finite end) is dropped; ValueError when all do."""
    lower, upper = np.array(law.lower), np.array(law.upper)
    grid = np.clip(law.starts, lower, upper)
    ranked = grid[:0]
    if screened > 0:
        costs = objective_values(law, grid, log_n, log_d, log_l, None)
        ranked = grid[np.argsort(np.where(np.isfinite(costs), costs, np.inf), kind="stable")[:screened]]
    candidates = ranked if starts is None else np.vstack([np.clip(np.atleast_2d(starts), lower, upper), ranked])
    ends = [end for end in (_least_squares(law, start, log_n, log_d, log_l, None) for start in candidates)
            if end is not None]
    if not ends:
        raise ValueError(f"{law.name}: no start of {len(candidates)} reached a finite fit; check the losses")
    return sorted(ends, key=lambda end: end[1])


def _least_squares(law: LawForm, start: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                   huber_delta: float | None) -> tuple[np.ndarray, float] | None:
    def residuals(theta: np.ndarray) -> np.ndarray:
        return law.log_loss(theta, log_n, log_d)[0] - log_l

    def jacobian(theta: np.ndarray) -> np.ndarray:
        return law.jacobian(theta, log_n, log_d)

    try:
        with np.errstate(over="raise", divide="raise", invalid="raise", under="ignore"):
            result = least_squares(residuals, start, jac=jacobian, bounds=(law.lower, law.upper), method="trf",
                                   loss="linear" if huber_delta is None else "huber",
                                   f_scale=1.0 if huber_delta is None else huber_delta, **LEAST_SQUARES_OPTIONS)
    except (FloatingPointError, OverflowError, ValueError, np.linalg.LinAlgError):
        return None
    if not (np.all(np.isfinite(result.x)) and math.isfinite(result.cost)):
        return None
    return result.x, float(result.cost)


# ---------------------------------------------------------------------------------------------
# Run-to-run noise


@dataclass(frozen=True)
class Noise:
    """The run-to-run standard deviation of ln L (None when not measured), how, and from how many
    (N, D) trained with more than one seed."""

    sigma: float | None
    how: str
    groups: int


def pooled_log_sd(log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray) -> float | None:
    """The pooled within-configuration sd (ddof = 1 per group) of ln L; None without repeats."""
    groups = [g for g in configuration_groups(np.exp(log_n), np.exp(log_d)) if len(g) > 1]
    if not groups:
        return None
    squares = sum(float(((log_l[g] - log_l[g].mean()) ** 2).sum()) for g in groups)
    return math.sqrt(squares / sum(len(g) - 1 for g in groups))


def run_to_run_noise(points: list[Point]) -> Noise:
    """sigma of ln L from seed repeats: runs with equal (N, D) differ only by the seed (and its data
    order), so their spread is the noise that no law can fit and every prediction inherits."""
    groups = [g for g in configuration_groups([p.params for p in points], [p.tokens for p in points]) if len(g) > 1]
    if not groups:
        return Noise(None, "not measured: no (N, D) was trained with more than one seed", 0)
    log_l = np.log([p.loss for p in points])
    sigma = pooled_log_sd(np.log([p.params for p in points]), np.log([p.tokens for p in points]), log_l)
    runs = sum(len(g) for g in groups)
    return Noise(sigma, f"pooled sd of ln L over {len(groups)} (N, D) trained with several seeds ({runs} runs)",
                 len(groups))


# ---------------------------------------------------------------------------------------------
# FLOPs per token, and the compute-optimal allocation on its line


@dataclass(frozen=True)
class FlopsPerToken:
    """fpt(N): training FLOPs per token of a model of N parameters, so a run costs C = fpt(N) D.

    "measured": ln(fpt / N) is a polynomial (degree <= 2) in ln N through the sizes' C / D, extended
    linearly in ln N beyond the sizes trained (so far extrapolation stays tame); "6N": C = 6ND
    (Kaplan et al. 2020, sec. 2.1), when every run's FLOPs equal 6ND.
    """

    source: str
    description: str
    coefficients: tuple[float, ...] = (math.log(6.0),)
    log_n_range: tuple[float, float] = (0.0, 0.0)

    def __call__(self, params: ArrayLike) -> np.ndarray:
        log_n = np.log(np.asarray(params, dtype=float))
        low, high = self.log_n_range
        inside = np.clip(log_n, low, high)
        slope = np.polyval(np.polyder(self.coefficients), inside) if len(self.coefficients) > 1 else 0.0
        return np.exp(log_n + np.polyval(self.coefficients, inside) + slope * (log_n - inside))


def flops_per_token_model(points: list[Point]) -> FlopsPerToken:
    """The sweep's own FLOPs count per token (see FlopsPerToken), from each run's C / D."""
    params = np.array([p.params for p in points], dtype=float)
    ratio = np.array([p.flops / p.tokens for p in points], dtype=float) / params
    log_n = np.log(params)
    span = (float(log_n.min()), float(log_n.max()))
    if np.allclose(ratio, 6.0, rtol=1e-9, atol=0.0):
        return FlopsPerToken("6N", "C = 6ND (every run's FLOPs equal 6ND, e.g. a CSV without a flops column)",
                             (math.log(6.0),), span)
    sizes = np.unique(log_n)
    per_size = np.array([np.log(ratio[log_n == s]).mean() for s in sizes])
    degree = min(2, len(sizes) - 1)
    coefficients = np.polyfit(sizes, per_size, degree) if degree > 0 else per_size[:1]
    misfit = float(np.abs(np.polyval(coefficients, sizes) - per_size).max())
    return FlopsPerToken("measured", f"C = fpt(N) D with fpt measured from {len(sizes)} size(s)' C / D "
                         f"(ln(fpt/N) of degree {degree} in ln N, max misfit {100 * misfit:.2g}%)",
                         tuple(float(c) for c in coefficients), span)


def optimal_size(log_loss_along_line: Callable[[np.ndarray], np.ndarray], low: float, high: float) -> float:
    """ln N* minimising ln L(N, C / fpt(N)) over ln N in [low, high]: a dense grid, then a bounded
    Brent search between the best grid point's neighbours. NaN where the minimum sits at a bound (the
    law has no interior optimum there) or the loss is not finite."""
    grid = np.linspace(low, high, SEARCH_GRID)
    with np.errstate(all="ignore"):
        values = log_loss_along_line(grid)
    if not np.any(np.isfinite(values)):
        return math.nan
    best = int(np.argmin(np.where(np.isfinite(values), values, np.inf)))
    if best in (0, len(grid) - 1):
        return math.nan
    result = minimize_scalar(lambda x: float(log_loss_along_line(np.array([x]))[0]),
                             bounds=(grid[best - 1], grid[best + 1]), method="bounded",
                             options={"xatol": 1e-10})
    return float(result.x)


def search_range(flops: float, fpt: FlopsPerToken) -> tuple[float, float]:
    """compute_optimal's bounds in ln N: from SEARCH_DECADES_BELOW decades under the smallest size
    trained up to where D = C / fpt(N) falls to SEARCH_MIN_TOKENS_PER_FLOP tokens (~ 6N D = C)."""
    low = fpt.log_n_range[0] - SEARCH_DECADES_BELOW * math.log(10)
    high = math.log(flops / (6.0 * SEARCH_MIN_TOKENS_PER_FLOP))
    return low, max(high, low + 1.0)


def line_allocation(loss: Callable[[np.ndarray, np.ndarray], np.ndarray], flops: float,
                    fpt: FlopsPerToken) -> tuple[float, float, float]:
    """(N*, D*, L(N*, D*)) minimising loss(N, D) on the exact line D = C / fpt(N), so fpt(N*) D* = C
    holds to rounding (not C = 6ND, Hoffmann et al. 2022 eq. 4's line); NaN where no optimum."""
    def along_line(log_n: np.ndarray) -> np.ndarray:
        params = np.exp(log_n)
        return np.log(loss(params, flops / fpt(params)))

    log_n = optimal_size(along_line, *search_range(flops, fpt))
    if not math.isfinite(log_n):
        return math.nan, math.nan, math.nan
    n_opt = math.exp(log_n)
    d_opt = float(flops / fpt(n_opt))
    return n_opt, d_opt, float(loss(np.array(n_opt), np.array(d_opt)))
