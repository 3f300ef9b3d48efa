"""Scaling-law fits: the three approaches of Hoffmann et al. 2022 ("Training Compute-Optimal Large
Language Models", sec. 3), their compute-optimal allocations and bootstrap intervals.

- Approach 1 (sec. 3.1): the lower envelope of training loss against FLOPs over every run's curve;
  the runs on the envelope give N_opt(C) and D_opt(C), fitted as power laws.
- Approach 2 (sec. 3.2): per FLOP budget, a parabola of loss in log N (and in log D) whose minimum
  is that budget's N_opt (D_opt); power laws across budgets.
- Approach 3 (sec. 3.3, app. D.2): L(N, D) = E + A / N^alpha + B / D^beta, fitted by minimising
  the Huber loss (delta = 1e-3) of log L with L-BFGS from a grid of initialisations.
All numbers are plain floats so the caller can write strict JSON.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp, softmax

HUBER_DELTA = 1e-3
# Hoffmann et al. 2022, app. D.2: alpha, beta in {0, 0.5, ..., 2}, e in {-1, -.5, ..., 1}, a, b in {0, 5, ..., 25}.
CHINCHILLA_GRID = np.array([
    (a, b, e, alpha, beta)
    for alpha, beta, e, a, b in itertools.product(
        np.arange(0, 2.01, 0.5), np.arange(0, 2.01, 0.5), np.arange(-1, 1.01, 0.5), range(0, 26, 5), range(0, 26, 5)
    )
], dtype=float)
MIN_POINTS_PARAMETRIC = 6  # five constants, and one point to spare
MIN_SIZES_PER_BUDGET = 3  # a parabola
MIN_BUDGETS = 2  # a power law across budgets


@dataclass(frozen=True)
class Point:
    """One finished run: parameters N, tokens D, FLOPs C, final loss, and its IsoFLOP budget if any."""

    params: float
    tokens: float
    flops: float
    loss: float
    budget: float | None = None


@dataclass(frozen=True)
class Curve:
    """A run's training curve: (FLOPs, tokens, smoothed loss) along the run, for Approach 1."""

    params: float
    flops: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray


@dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * C ** exponent, fitted by least squares in log-log."""

    exponent: float
    coefficient: float

    def __call__(self, flops: float | np.ndarray) -> float | np.ndarray:
        return self.coefficient * np.asarray(flops, dtype=float) ** self.exponent


def fit_power_law(flops: np.ndarray, values: np.ndarray) -> PowerLaw:
    slope, intercept = np.polyfit(np.log(flops), np.log(values), 1)
    return PowerLaw(float(slope), float(math.exp(intercept)))


# ---------------------------------------------------------------------------------------------
# Approach 3: the parametric loss


@dataclass(frozen=True)
class ParametricFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float

    @property
    def a(self) -> float:
        """N_opt ∝ C^a with a = beta / (alpha + beta) (Hoffmann et al. 2022, eq. 4)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def loss(self, params: float | np.ndarray, tokens: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A / np.asarray(params, dtype=float) ** self.alpha + self.B / np.asarray(
            tokens, dtype=float) ** self.beta

    def compute_optimal(self, flops: float) -> tuple[float, float]:
        """(N*, D*) minimising L on C = 6ND: N* = G (C/6)^a, D* = (C/6)^b / G, G = (alpha A / (beta B))^(1/(alpha+beta))
        (Hoffmann et al. 2022, eq. 4 and app. D.2)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        return g * (flops / 6.0) ** self.a, (flops / 6.0) ** self.b / g


def _huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                     delta: float) -> tuple[float, np.ndarray]:
    """Sum of Huber(LSE(a - alpha log N, b - beta log D, e) - log L) and its gradient in (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    residual = logsumexp(terms, axis=0) - log_l
    small = np.abs(residual) <= delta
    value = np.where(small, 0.5 * residual**2, delta * (np.abs(residual) - 0.5 * delta)).sum()
    slope = np.where(small, residual, delta * np.sign(residual))
    weights = softmax(terms, axis=0) * slope
    gradient = np.array([weights[0].sum(), weights[1].sum(), weights[2].sum(),
                         -(weights[0] * log_n).sum(), -(weights[1] * log_d).sum()])
    return float(value), gradient


def fit_parametric(
    points: list[Point], starts: np.ndarray = CHINCHILLA_GRID, best_starts: int | None = None,
    delta: float = HUBER_DELTA,
) -> ParametricFit:
    """Approach 3: L-BFGS from every start, the lowest objective kept (Hoffmann et al. 2022, app. D.2).

    All 4,500 grid starts take ~10 ms each (45 s for 240 points). `best_starts` runs L-BFGS only
    from that many starts with the lowest initial objective, which bootstrap refits use.
    """
    if len(points) < MIN_POINTS_PARAMETRIC:
        raise ValueError(f"Approach 3 needs at least {MIN_POINTS_PARAMETRIC} runs (it fits 5 constants); "
                         f"got {len(points)}")
    log_n = np.log([p.params for p in points])
    log_d = np.log([p.tokens for p in points])
    log_l = np.log([p.loss for p in points])
    if best_starts is not None and best_starts < len(starts):
        initial = [_huber_objective(start, log_n, log_d, log_l, delta)[0] for start in starts]
        starts = starts[np.argsort(initial)[:best_starts]]
    best = None
    for start in starts:
        result = minimize(_huber_objective, start, args=(log_n, log_d, log_l, delta), jac=True, method="L-BFGS-B",
                          options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
        if np.all(np.isfinite(result.x)) and (best is None or result.fun < best.fun):
            best = result
    a, b, e, alpha, beta = best.x
    return ParametricFit(float(math.exp(e)), float(math.exp(a)), float(math.exp(b)), float(alpha), float(beta),
                         float(best.fun))


def parametric_theta(fit: ParametricFit) -> np.ndarray:
    return np.array([math.log(fit.A), math.log(fit.B), math.log(fit.E), fit.alpha, fit.beta])


# ---------------------------------------------------------------------------------------------
# Approach 2: IsoFLOP profiles


@dataclass(frozen=True)
class IsoFlopMinimum:
    flops: float
    params_opt: float
    tokens_opt: float
    loss_min: float
    parabola: tuple[float, float, float]  # loss = c2 x^2 + c1 x + c0 with x = log N


def group_by_budget(points: list[Point], tolerance: float = 0.05) -> dict[float, list[Point]]:
    """Points by IsoFLOP budget: the recorded budget, else FLOPs within `tolerance` of each other."""
    groups: dict[float, list[Point]] = {}
    for point in sorted(points, key=lambda p: p.budget or p.flops):
        key = point.budget or next((k for k in groups if abs(point.flops / k - 1) <= tolerance), point.flops)
        groups.setdefault(key, []).append(point)
    return groups


def isoflop_minima(points: list[Point]) -> list[IsoFlopMinimum]:
    """Per budget with >= 3 distinct sizes and an upward parabola, its minimum in log N and in log D."""
    minima = []
    for budget, group in group_by_budget(points).items():
        if len({p.params for p in group}) < MIN_SIZES_PER_BUDGET:
            continue
        log_n, log_d = np.log([p.params for p in group]), np.log([p.tokens for p in group])
        losses = np.array([p.loss for p in group])
        in_n, in_d = np.polyfit(log_n, losses, 2), np.polyfit(log_d, losses, 2)
        if in_n[0] <= 0 or in_d[0] <= 0:
            continue  # no minimum: the sizes do not bracket this budget's optimum
        x_n, x_d = -in_n[1] / (2 * in_n[0]), -in_d[1] / (2 * in_d[0])
        minima.append(IsoFlopMinimum(float(budget), float(math.exp(x_n)), float(math.exp(x_d)),
                                     float(np.polyval(in_n, x_n)), tuple(float(c) for c in in_n)))
    return minima


def fit_isoflop(points: list[Point]) -> tuple[PowerLaw, PowerLaw, list[IsoFlopMinimum]]:
    minima = isoflop_minima(points)
    if len(minima) < MIN_BUDGETS:
        raise ValueError(f"Approach 2 needs at least {MIN_BUDGETS} FLOP budgets with >= {MIN_SIZES_PER_BUDGET} "
                         f"model sizes each whose losses bracket a minimum; got {len(minima)}")
    flops = np.array([m.flops for m in minima])
    return (fit_power_law(flops, np.array([m.params_opt for m in minima])),
            fit_power_law(flops, np.array([m.tokens_opt for m in minima])), minima)


# ---------------------------------------------------------------------------------------------
# Approach 1: the envelope of training curves


@dataclass(frozen=True)
class FrontierPoint:
    flops: float
    params: float
    tokens: float
    loss: float


def loss_frontier(curves: list[Curve], bins: int = 40) -> list[FrontierPoint]:
    """The lowest loss in each of `bins` log-spaced FLOP bins over all curves, and the run that reached it."""
    low = min(float(c.flops[c.flops > 0].min()) for c in curves)
    high = max(float(c.flops.max()) for c in curves)
    edges = np.geomspace(low, high * (1 + 1e-9), bins + 1)
    frontier = []
    for lower, upper in itertools.pairwise(edges):
        best = None
        for curve in curves:
            inside = (curve.flops >= lower) & (curve.flops < upper)
            if inside.any():
                index = np.flatnonzero(inside)[np.argmin(curve.loss[inside])]
                if best is None or curve.loss[index] < best.loss:
                    best = FrontierPoint(float(curve.flops[index]), curve.params, float(curve.tokens[index]),
                                         float(curve.loss[index]))
        if best is not None:
            frontier.append(best)
    return frontier


def fit_envelope(curves: list[Curve], bins: int = 40) -> tuple[PowerLaw, PowerLaw, list[FrontierPoint]]:
    frontier = loss_frontier(curves, bins)
    if len({point.params for point in frontier}) < 2:
        raise ValueError("Approach 1 needs runs of at least 2 sizes on the loss-vs-FLOPs frontier; "
                         f"got {len({point.params for point in frontier})}")
    flops = np.array([p.flops for p in frontier])
    return (fit_power_law(flops, np.array([p.params for p in frontier])),
            fit_power_law(flops, np.array([p.tokens for p in frontier])), frontier)
