"""Scaling-law fits: the three approaches of Hoffmann et al. 2022 ("Training Compute-Optimal Large
Language Models", sec. 3) and the law forms of laws.py, chosen by backtest (backtest.py), with
compute-optimal allocations on the sweep's exact FLOPs line, bootstrap intervals and prediction
intervals (intervals.py: bootstrap, noise, the tied forms' spread and the backtests' error).

- Approach 1 (sec. 3.1): the lower envelope of loss against FLOPs over every run's final,
  decayed point (not mid-schedule training losses); the runs on it give N_opt(C) and D_opt(C).
- Approach 2 (sec. 3.2): per FLOP budget a parabola of loss in log N (and one in log D) whose
  vertex is that budget's N_opt (D_opt); power laws across budgets.
- Approach 3 (sec. 3.3, app. D.2): L(N, D) = E + A / N^alpha + B / D^beta, fitted by minimising
  the Huber loss of log L (the paper's delta = 1e-3 unless given) with L-BFGS (lbfgs.py) from a grid.
N_opt ∝ C^a and D_opt ∝ C^b throughout (sec. 3, Table 2). Reading runs is in fit_inputs.py,
writing fit.json in fit_source.py, the figures in fit_plots.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import minimize

from scaletrain.scaling.backtest import Backtest, Choice, choose_form, rolling_backtest
from scaletrain.scaling.intervals import (
    ExtrapolationError,
    fit_extrapolation_error,
    log_losses,
    mixture_interval,
    mixture_median,
    robust_residual_sd,
)
from scaletrain.scaling.laws import (
    BUDGET_TOLERANCE,
    LAW_FORMS,
    FlopsPerToken,
    LawFit,
    Noise,
    Point,
    fit_law,
    flops_per_token_model,
    group_by_budget,
    line_allocation,
    refit_law,
    run_to_run_noise,
)
from scaletrain.scaling.lbfgs import batched_lbfgs, in_chunks

APPROACHES = ("approach1", "approach2", "approach3")
HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, sec. 3.3
# App. D.2's grid, as (a, b, e, alpha, beta): alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1},
# a, b in {0, 5, ..., 25}: 5 * 5 * 5 * 6 * 6 = 4,500 starts.
CHINCHILLA_GRID = np.array(
    [(a, b, e, alpha, beta) for alpha, beta, e, a, b in itertools.product(
        np.arange(0, 2.01, 0.5), np.arange(0, 2.01, 0.5), np.arange(-1, 1.01, 0.5), range(0, 26, 5), range(0, 26, 5))],
    dtype=float,
)
SCREEN_ITERATIONS = 20  # see fit_parametric
CONTINUED_STARTS = 300
BOOTSTRAP_GRID_STARTS = 8  # see refit_parametric
# scipy's default ftol (2.2e-9, absolute below f = 1) stops L-BFGS early on this objective, whose
# values are ~1e-3 (a sum of Huber losses with delta = 1e-3): the polish runs to these tolerances.
POLISHED_STARTS = 5
POLISH_OPTIONS = {"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12}
FRONTIER_BINS = 40
MIN_FRONTIER_POINTS = 3  # Approach 1: a power law through >= 3 envelope bins ...
MIN_FRONTIER_SIZES = 2  # ... reached by >= 2 model sizes
MIN_SIZES_PER_BUDGET = 3  # Approach 2: a parabola needs 3 sizes ...
MIN_BUDGETS = 2  # ... and a power law across budgets needs 2 of them
MIN_POINTS_PARAMETRIC = 5  # Approach 3: as many distinct (N, D) as constants
MIN_BOOTSTRAP_FITS = 10  # fewer successful refits give no interval
SMOOTHING_FRACTION = 0.05
LOG_MAX = math.log(np.finfo(float).max)  # ~709.8: exp overflows beyond
PREDICTION_CONFIDENCE = 0.9


# ---------------------------------------------------------------------------------------------
# Inputs and power laws


@dataclass(frozen=True)
class Curve:
    """A run's training curve for Approach 1: FLOPs, tokens and (smoothed) loss along the run."""

    params: float
    flops: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray


@dataclass(frozen=True)
class FitData:
    """The runs to fit; curves[i] is run i's training curve, or None where only its final point is known."""

    points: list[Point]
    curves: list[Curve | None]

    def envelope_curves(self) -> list[Curve]:
        """Approach 1's input: each run's final point (a sweep's val_loss, a CSV's loss), not its training
        curve: mid-schedule losses of a run with a decaying schedule lie above what a run stopped there
        (with its own full decay) reaches, so their envelope is biased (Hoffmann et al. 2022, sec. 3.1
        and app. A match the schedule to each budget). The curves stay in `curves` for plotting."""
        return [final_point_curve(point) for point in self.points]

    def subset(self, indices: ArrayLike) -> FitData:
        return FitData([self.points[i] for i in indices], [self.curves[i] for i in indices])


def final_point_curve(point: Point) -> Curve:
    return Curve(point.params, np.array([point.flops]), np.array([point.tokens]), np.array([point.loss]))


@dataclass(frozen=True)
class PowerLaw:
    """y = coefficient * C ** exponent, fitted by least squares in log-log."""

    exponent: float
    coefficient: float

    def __call__(self, flops: ArrayLike) -> np.ndarray:
        return self.coefficient * np.asarray(flops, dtype=float) ** self.exponent


def fit_power_law(flops: ArrayLike, values: ArrayLike) -> PowerLaw:
    """Least squares of ln y on ln C; ValueError when the points do not determine a finite law."""
    with np.errstate(all="ignore"):
        slope, intercept = np.polyfit(np.log(flops), np.log(values), 1)
        coefficient = float(np.exp(intercept))
    if not (math.isfinite(slope) and math.isfinite(coefficient) and coefficient > 0):
        raise ValueError(f"the optima do not follow a finite power law in C (exponent {slope:.3g})")
    return PowerLaw(float(slope), coefficient)


def smooth_training_curve(tokens: ArrayLike, losses: ArrayLike,
                          fraction: float = SMOOTHING_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """A centred rolling mean of the loss over an odd window of `fraction` of the records (at least 1).

    Hoffmann et al. 2022 (sec. 3.1) smooth the training loss before taking the envelope; a centred
    window, unlike a trailing one or an EMA, does not lag a falling curve (its bias is second order).
    The first and last half-windows are dropped rather than averaged over fewer records.
    """
    tokens, losses = np.asarray(tokens, dtype=float), np.asarray(losses, dtype=float)
    half = int(fraction * len(losses)) // 2
    window = 2 * half + 1
    smoothed = np.convolve(losses, np.ones(window) / window, mode="valid")
    return tokens[half:len(tokens) - half], smoothed


# ---------------------------------------------------------------------------------------------
# Approach 1: the envelope of training curves (sec. 3.1)


@dataclass(frozen=True)
class FrontierPoint:
    flops: float
    params: float
    tokens: float
    loss: float


@dataclass(frozen=True)
class EnvelopeFit:
    n_law: PowerLaw
    d_law: PowerLaw
    frontier: list[FrontierPoint]

    def allocation(self, flops: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        return self.n_law(flops), self.d_law(flops)

    def constants(self) -> dict[str, float]:
        return {"a": self.n_law.exponent, "b": self.d_law.exponent}


def loss_frontier(curves: list[Curve], bins: int = FRONTIER_BINS) -> list[FrontierPoint]:
    """The lowest loss in each of `bins` log-spaced FLOP bins over all curves, and the run reaching it
    (Hoffmann et al. 2022, sec. 3.1 and fig. 2 left)."""
    flops = np.concatenate([c.flops for c in curves])
    losses = np.concatenate([c.loss for c in curves])
    run = np.concatenate([np.full(len(c.flops), i) for i, c in enumerate(curves)])
    offset = np.concatenate([np.arange(len(c.flops)) for c in curves])
    keep = (flops > 0) & np.isfinite(losses)
    flops, losses, run, offset = flops[keep], losses[keep], run[keep], offset[keep]
    if not len(flops):
        return []
    edges = np.geomspace(flops.min(), flops.max() * (1 + 1e-9), bins + 1)
    which = np.searchsorted(edges, flops, side="right") - 1
    frontier = []
    for b in np.unique(which):
        members = np.flatnonzero(which == b)
        best = members[np.argmin(losses[members])]
        curve = curves[run[best]]
        frontier.append(FrontierPoint(float(flops[best]), float(curve.params), float(curve.tokens[offset[best]]),
                                      float(losses[best])))
    return frontier


def fit_envelope(curves: list[Curve], bins: int = FRONTIER_BINS) -> EnvelopeFit:
    """Approach 1: N_opt ∝ C^a and D_opt ∝ C^b through the frontier's runs (sec. 3.1)."""
    frontier = loss_frontier(curves, bins)
    sizes = len({point.params for point in frontier})
    if len(frontier) < MIN_FRONTIER_POINTS or sizes < MIN_FRONTIER_SIZES:
        raise ValueError(f"Approach 1 needs a loss-vs-FLOPs frontier of >= {MIN_FRONTIER_POINTS} bins reached by "
                         f">= {MIN_FRONTIER_SIZES} model sizes; got {len(frontier)} bins from {sizes} size(s)")
    flops = [p.flops for p in frontier]
    return EnvelopeFit(fit_power_law(flops, [p.params for p in frontier]),
                       fit_power_law(flops, [p.tokens for p in frontier]), frontier)


# ---------------------------------------------------------------------------------------------
# Approach 2: IsoFLOP profiles (sec. 3.2)


@dataclass(frozen=True)
class IsoFlopMinimum:
    """One budget's profile: C (geometric mean of its runs' FLOPs), its recorded budget, the vertices.

    `parabola` is loss = c2 x^2 + c1 x + c0 in x = ln N, `parabola_tokens` the same in x = ln D.
    """

    flops: float
    budget: float | None
    sizes: int
    n_opt: float
    d_opt: float
    loss_min: float
    parabola: tuple[float, float, float]
    parabola_tokens: tuple[float, float, float]
    bracketed: bool  # whether N_opt lies within the sizes trained, rather than extrapolated


@dataclass(frozen=True)
class IsoFlopFit:
    n_law: PowerLaw
    d_law: PowerLaw
    minima: list[IsoFlopMinimum]
    excluded: list[tuple[float, str]] = field(default_factory=list)  # (C, why) of profiles not used

    def allocation(self, flops: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        return self.n_law(flops), self.d_law(flops)

    def constants(self) -> dict[str, float]:
        return {"a": self.n_law.exponent, "b": self.d_law.exponent}


def isoflop_minimum(group: list[Point]) -> IsoFlopMinimum:
    """The vertex of the parabola of loss in ln N (sec. 3.2, fig. 3), and of the one in ln D.

    D_opt comes from its own parabola rather than C / (6 N_opt): a sweep's runs count exact FLOPs
    (attention included), so C = 6ND holds only approximately; with C = 6ND exactly both agree.
    """
    sizes = len({p.params for p in group})
    if sizes < MIN_SIZES_PER_BUDGET:
        raise ValueError(f"{sizes} model size(s); a parabola needs >= {MIN_SIZES_PER_BUDGET}")
    log_n, log_d = np.log([p.params for p in group]), np.log([p.tokens for p in group])
    losses = np.array([p.loss for p in group])
    in_n, in_d = np.polyfit(log_n, losses, 2), np.polyfit(log_d, losses, 2)
    if in_n[0] <= 0 or in_d[0] <= 0:
        raise ValueError("the losses do not curve upward in log N, so the profile has no minimum; "
                         "train sizes on both sides of the optimum")
    x_n, x_d = -in_n[1] / (2 * in_n[0]), -in_d[1] / (2 * in_d[0])
    span = log_n.max() - log_n.min()
    if not log_n.min() - span <= x_n <= log_n.max() + span:
        raise ValueError(f"the parabola's minimum, N = {math.exp(min(x_n, 700)):.3g}, lies far outside the sizes "
                         f"trained ({math.exp(log_n.min()):.3g} to {math.exp(log_n.max()):.3g})")
    flops = float(np.exp(np.mean(np.log([p.flops for p in group]))))
    return IsoFlopMinimum(flops, group[0].budget, sizes, float(math.exp(x_n)), float(math.exp(x_d)),
                          float(np.polyval(in_n, x_n)), tuple(float(c) for c in in_n),
                          tuple(float(c) for c in in_d), bool(log_n.min() <= x_n <= log_n.max()))


def unbracketed_end(points: list[Point], tolerance: float = BUDGET_TOLERANCE) -> str | None:
    """"smallest" ("largest") when every profile of >= MIN_SIZES_PER_BUDGET sizes has its best run at its
    smallest (largest) size: no profile has a minimum to find, and the fix is to extend the sizes."""
    ends = set()
    for group in group_by_budget(points, tolerance):
        profile = [points[i] for i in group]
        if len({p.params for p in profile}) >= MIN_SIZES_PER_BUDGET:
            best = min(profile, key=lambda p: p.loss).params
            ends.add("smallest" if best == min(p.params for p in profile) else
                     "largest" if best == max(p.params for p in profile) else "inside")
    return next(iter(ends)) if len(ends) == 1 and ends != {"inside"} else None


def fit_isoflop(points: list[Point], tolerance: float = BUDGET_TOLERANCE) -> IsoFlopFit:
    """Approach 2: each budget's N_opt and D_opt, then power laws across budgets (sec. 3.2)."""
    minima, excluded = [], []
    for indices in group_by_budget(points, tolerance):
        group = [points[i] for i in indices]
        try:
            minima.append(isoflop_minimum(group))
        except ValueError as reason:
            if len(group) > 1:
                excluded.append((float(np.exp(np.mean(np.log([p.flops for p in group])))), str(reason)))
    if len(minima) < MIN_BUDGETS:
        reason = (f"Approach 2 needs >= {MIN_SIZES_PER_BUDGET} model sizes in each of >= {MIN_BUDGETS} FLOP budgets "
                  f"(runs share a budget through the budget column, or FLOPs within {tolerance:.0%}); "
                  f"{len(minima)} usable budget(s) found" + (f", {len(excluded)} excluded" if excluded else ""))
        end = unbracketed_end(points, tolerance)
        if end is not None:
            fix = "add smaller sizes" if end == "smallest" else "add larger sizes"
            reason = f"no IsoFLOP profile is bracketed: the {end} size is best at every budget; {fix} ({reason})"
        raise ValueError(reason)
    flops = [m.flops for m in minima]
    return IsoFlopFit(fit_power_law(flops, [m.n_opt for m in minima]),
                      fit_power_law(flops, [m.d_opt for m in minima]), minima, excluded)


# ---------------------------------------------------------------------------------------------
# Approach 3: the parametric loss (sec. 3.3, app. D.2)


@dataclass(frozen=True)
class ParametricFit:
    """L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, eq. 2), and the fit's objective."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float = math.nan
    starts: int = 0

    @property
    def a(self) -> float:
        """N_opt ∝ C^a with a = beta / (alpha + beta) (eq. 4)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def loss(self, params: ArrayLike, tokens: ArrayLike) -> np.ndarray:
        params, tokens = np.asarray(params, dtype=float), np.asarray(tokens, dtype=float)
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    def allocation(self, flops: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(N*, D*) minimising L subject to C = 6ND (eq. 4, app. D.2):
        N* = G (C/6)^a, D* = G^-1 (C/6)^b, G = (alpha A / (beta B))^(1 / (alpha + beta)).
        Without positive exponents and coefficients there is no optimum (with A = 0 the loss does not
        depend on N, and G is 0): NaN."""
        flops = np.asarray(flops, dtype=float)
        if min(self.alpha, self.beta, self.A, self.B) <= 0:
            return np.full_like(flops, math.nan), np.full_like(flops, math.nan)
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        return g * (flops / 6.0) ** self.a, (flops / 6.0) ** self.b / g

    def constants(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta, "a": self.a,
                "b": self.b}

    def theta(self) -> np.ndarray:
        """The optimiser's coordinates (a, b, e, alpha, beta) = (ln A, ln B, ln E, alpha, beta). A constant
        that is 0 (a fit whose E underflowed: the data have no irreducible term) maps to ln of the
        smallest positive double rather than to log(0)."""
        tiny = np.finfo(float).tiny
        return np.array([math.log(max(self.A, tiny)), math.log(max(self.B, tiny)), math.log(max(self.E, tiny)),
                         self.alpha, self.beta])


ApproachFit = EnvelopeFit | IsoFlopFit | ParametricFit


def huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                    delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Sum over runs of Huber_delta(LSE(a - alpha ln N, b - beta ln D, e) - ln L) and its gradient in
    (a, b, e, alpha, beta) (app. D.2, eq. 10), for K parameter vectors at once.

    theta is (K, 5); the data are (n,), shared by all K, or (K, n), one resample per row. The LSE is
    ln(A/N^alpha + B/D^beta + E) summed directly, in place: in double precision the terms overflow
    only for a diverging start, whose value is then inf or NaN and which the optimiser drops.
    Huber(r) = m (|r| - m/2) with m = min(|r|, delta); its derivative is sign(r) m.
    """
    a, b, e, alpha, beta = (column[:, None] for column in theta.T)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        term_n = np.multiply(alpha, log_n)
        np.exp(np.subtract(a, term_n, out=term_n), out=term_n)
        term_d = np.multiply(beta, log_d)
        np.exp(np.subtract(b, term_d, out=term_d), out=term_d)
        irreducible = np.exp(e)
        predicted = term_n + term_d
        predicted += irreducible
        residual = np.log(predicted)
        residual -= log_l
        size = np.abs(residual)
        capped = np.minimum(size, delta)
        value = (capped * (size - 0.5 * capped)).sum(axis=1)
        slope = np.copysign(capped, residual, out=capped)
        slope /= predicted  # d ln(prediction) / d term = term / prediction
        term_n *= slope
        term_d *= slope
        gradient = np.stack([term_n.sum(axis=1), term_d.sum(axis=1), irreducible[:, 0] * slope.sum(axis=1),
                             -(term_n * log_n).sum(axis=1), -(term_d * log_d).sum(axis=1)], axis=1)
    return value, gradient


def _scalar_objective(theta: np.ndarray, *data: np.ndarray | float) -> tuple[float, np.ndarray]:
    value, gradient = huber_objective(theta[None], *data)
    return float(value[0]), gradient[0]


def _parametric_data(params: ArrayLike, tokens: ArrayLike, losses: ArrayLike) -> tuple[np.ndarray, ...]:
    log_n, log_d, log_l = (np.log(np.asarray(x, dtype=float)) for x in (params, tokens, losses))
    distinct = len(set(zip(log_n.tolist(), log_d.tolist(), strict=True)))
    if distinct < MIN_POINTS_PARAMETRIC:
        raise ValueError(f"Approach 3 needs >= {MIN_POINTS_PARAMETRIC} runs with distinct (N, D) to fit its "
                         f"5 constants; got {distinct}")
    return log_n, log_d, log_l


def _parametric_fit(theta: np.ndarray, objective: float, starts: int) -> ParametricFit:
    """ValueError (not a raw OverflowError) when an end point's ln A, ln B or ln E is beyond exp's range:
    a start that ran off to a degenerate law, which a bootstrap counts as a failed refit."""
    a, b, e, alpha, beta = (float(v) for v in theta)
    if not all(math.isfinite(v) for v in theta) or max(a, b, e) > LOG_MAX:
        raise ValueError(f"Approach 3's optimum is degenerate (ln A {a:.3g}, ln B {b:.3g}, ln E {e:.3g}, "
                         f"alpha {alpha:.3g}, beta {beta:.3g}): exp overflows")
    return ParametricFit(math.exp(e), math.exp(a), math.exp(b), alpha, beta, float(objective), starts)


def fit_parametric(params: ArrayLike, tokens: ArrayLike, losses: ArrayLike, starts: np.ndarray = CHINCHILLA_GRID,
                   continued_starts: int | None = CONTINUED_STARTS, delta: float = HUBER_DELTA) -> ParametricFit:
    """Approach 3 (sec. 3.3, app. D.2): L-BFGS from every start of the grid, the lowest objective kept.

    The starts run at once in `batched_lbfgs` (numpy, analytic gradient). Every one of the 4,500
    gets SCREEN_ITERATIONS (20) iterations; the `continued_starts` (300) lowest then run to
    convergence (None: all of them, as the paper does). On 240 Chinchilla-like runs the best start
    after 20 iterations is among the best 300 with hundreds to spare, and the final optimum is the
    same as with all starts run out, in ~1-2 s instead of ~3-5 s on one core; a loop of scipy
    L-BFGS-B calls takes 8 s with one BLAS thread and over a minute with threaded BLAS, whose
    overhead its 5-variable steps pay. The POLISHED_STARTS best end points are then refined by
    scipy.optimize.minimize(method="L-BFGS-B", jac=True) with tight tolerances.
    """
    log_n, log_d, log_l = _parametric_data(params, tokens, losses)
    data = (log_n, log_d, log_l, delta)
    objective = in_chunks(lambda theta, _: huber_objective(theta, *data), len(log_n))
    ends, values = batched_lbfgs(objective, starts, max_iterations=SCREEN_ITERATIONS)
    ranked = np.argsort(np.where(np.isfinite(values), values, np.inf), kind="stable")
    ends, values = batched_lbfgs(objective, ends[ranked[:continued_starts]])
    order = np.argsort(np.where(np.isfinite(values), values, np.inf), kind="stable")[:POLISHED_STARTS]
    best_theta, best_value = ends[order[0]], values[order[0]]
    for theta in ends[order]:
        result = minimize(_scalar_objective, theta, args=data, jac=True, method="L-BFGS-B", options=POLISH_OPTIONS)
        if np.all(np.isfinite(result.x)) and result.fun < best_value:
            best_theta, best_value = result.x, result.fun
    if not np.isfinite(best_value):
        raise ValueError("Approach 3 found no finite fit from any start; check the losses")
    return _parametric_fit(best_theta, best_value, len(starts))


def refit_parametric(data: FitData, samples: list[np.ndarray], full: ParametricFit,
                     delta: float = HUBER_DELTA) -> list[ParametricFit | str]:
    """Approach 3 on every bootstrap resample, all in one batched L-BFGS run.

    Each resample starts from the full-data optimum and the BOOTSTRAP_GRID_STARTS (8) grid starts
    with the lowest full-data objective, not from all 4,500: its optimum lies near the full-data one,
    and 100 refits then take about a second. No scipy polish here; batched_lbfgs' tolerances suffice
    for intervals. A resample that fails gets the reason instead of a fit: fewer than
    MIN_POINTS_PARAMETRIC distinct runs, no finite end, or an end that overflows exp.
    """
    log_n, log_d, log_l = (np.log([getattr(p, key) for p in data.points]) for key in ("params", "tokens", "loss"))
    ranked = np.argsort(huber_objective(CHINCHILLA_GRID, log_n, log_d, log_l, delta)[0], kind="stable")
    starts = np.vstack([full.theta(), CHINCHILLA_GRID[ranked[:BOOTSTRAP_GRID_STARTS]]])
    usable = [i for i, chosen in enumerate(samples)
              if len(set(zip(log_n[chosen].tolist(), log_d[chosen].tolist(), strict=True))) >= MIN_POINTS_PARAMETRIC]
    too_few = f"fewer than {MIN_POINTS_PARAMETRIC} distinct (N, D) in the resample"
    if not usable:
        return [too_few] * len(samples)
    rows = np.array([samples[i] for i in usable])  # (resamples, runs): every resample has as many runs as data
    resample_of = np.repeat(np.arange(len(usable)), len(starts))

    def objective(theta: np.ndarray, problems: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        chosen = rows[resample_of[problems]]
        return huber_objective(theta, log_n[chosen], log_d[chosen], log_l[chosen], delta)

    ends, values = batched_lbfgs(in_chunks(objective, len(log_n)), np.tile(starts, (len(usable), 1)))
    fits: list[ParametricFit | str] = [too_few] * len(samples)
    for position, sample in enumerate(usable):
        block = slice(position * len(starts), (position + 1) * len(starts))
        best = np.argmin(np.where(np.isfinite(values[block]), values[block], np.inf))
        fits[sample] = "no start reached a finite objective"
        if np.isfinite(values[block][best]):
            try:
                fits[sample] = _parametric_fit(ends[block][best], values[block][best], len(starts))
            except ValueError as reason:
                fits[sample] = str(reason)
    return fits


def compute_optimal(fit: ApproachFit, flops: float, fpt: FlopsPerToken | None = None) -> dict[str, float]:
    """N*, D* and D*/N* at budget C from an approach (Approach 3 adds its loss L(N*, D*)); NaN where
    undefined. With `fpt`, on the exact line fpt(N) D = C: Approaches 1 and 2 take N* from their power
    law and D* = C / fpt(N*); Approach 3 minimises its L along the line. Without, each approach's own
    allocation (Approach 3: eq. 4 on C = 6ND), kept for the closed form."""
    if fpt is None:
        n_opt, d_opt = (float(value) for value in fit.allocation(flops))
        loss = float(fit.loss(n_opt, d_opt)) if isinstance(fit, ParametricFit) else math.nan
    elif isinstance(fit, ParametricFit):
        n_opt, d_opt, loss = line_allocation(fit.loss, flops, fpt)
    else:
        n_opt = float(fit.n_law(flops))
        d_opt = float(flops / fpt(n_opt)) if math.isfinite(n_opt) and n_opt > 0 else math.nan
    prediction = {"n_opt": n_opt, "d_opt": d_opt, "tokens_per_param": d_opt / n_opt if n_opt > 0 else math.nan}
    if isinstance(fit, ParametricFit):
        prediction["loss"] = loss
    return prediction


# ---------------------------------------------------------------------------------------------
# Law forms: fit, bootstrap, backtest


@dataclass
class LawResult:
    """One law form on these runs: the full-data fit, its successful bootstrap refits (failures are
    counted in ScalingFit.bootstrap_failures), its rolling backtest, what leave-one-out refits need (the
    runs, the FLOPs line), and its prediction interval's floor and extrapolation term (intervals.py):
    noise_sd (s0) and how it was obtained, and `extrapolation` (tau). `corpus_tokens`: the largest
    unique_tokens recorded, the corpus a data-constrained prediction assumes."""

    fit: LawFit
    refits: list[LawFit]
    backtest: Backtest
    points: list[Point] = field(repr=False)
    fpt: FlopsPerToken = field(repr=False)
    noise_sd: float = 0.0
    noise_how: str = ""
    extrapolation: ExtrapolationError = field(default_factory=lambda: ExtrapolationError(0.0, 0, "not fitted"))
    _leave_one_out: list[LawFit] | None = field(default=None, repr=False)

    @property
    def corpus_tokens(self) -> float | None:
        recorded = [p.unique_tokens for p in self.points if p.unique_tokens is not None]
        return max(recorded) if recorded else None

    def loss_function(self, fit: LawFit) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        return lambda params, tokens: fit.loss(params, tokens, self.corpus_tokens)

    def allocation(self, flops: float, fit: LawFit | None = None) -> tuple[float, float, float]:
        """(N*, D*, L*) of `fit` (default: the full-data fit) on the exact FLOPs line."""
        return line_allocation(self.loss_function(fit or self.fit), flops, self.fpt)

    def interval_fits(self) -> list[LawFit]:
        """The fits whose spread is this form's parameter uncertainty: the refits, or the full-data fit
        alone with fewer than MIN_BOOTSTRAP_FITS of them."""
        return self.refits if len(self.refits) >= MIN_BOOTSTRAP_FITS else [self.fit]

    def loo_shift_pct(self, flops: float) -> float:
        """max over runs of |L*_-i - L*| / L* in %: how far leaving one run out of the fit moves the
        predicted optimal loss at `flops` (a run that alone decides the prediction shows here). NaN
        when L* is undefined or no leave-one-out refit succeeds. The refits are made once, then kept."""
        optimum = self.allocation(flops)[2]
        if not math.isfinite(optimum):
            return math.nan
        shifts = [abs(self.allocation(flops, refit)[2] - optimum) for refit in self._leave_one_out_fits()]
        shifts = [shift for shift in shifts if math.isfinite(shift)]
        return 100.0 * max(shifts) / optimum if shifts else math.nan

    def _leave_one_out_fits(self) -> list[LawFit]:
        if self._leave_one_out is None:
            self._leave_one_out = []
            for index in range(len(self.points)):
                refit = _refit_law(self.fit, self.points[:index] + self.points[index + 1:])
                if isinstance(refit, LawFit):
                    self._leave_one_out.append(refit)
        return self._leave_one_out


def _law_columns(points: list[Point]) -> tuple[np.ndarray, ...]:
    unique = [math.nan if p.unique_tokens is None else p.unique_tokens for p in points]
    return (np.array([p.params for p in points]), np.array([p.tokens for p in points]),
            np.array([p.loss for p in points]), np.array(unique, dtype=float))


def _refit_law(full: LawFit, points: list[Point]) -> LawFit | str:
    """laws.refit_law on other runs (a resample, all but one). Any failure, an exception or non-finite
    constants, is returned as its reason, never raised."""
    try:
        refit = refit_law(full, *_law_columns(points))
    except Exception as error:  # noqa: BLE001 - a refit that fails for any reason is counted, not fatal
        return f"{type(error).__name__}: {error}"
    if not all(math.isfinite(value) for value in refit.constants.values()):
        return "non-finite constants"
    return refit


def interval_floor(fit: LawFit, points: list[Point], noise: Noise) -> tuple[float, str]:
    """s0 of intervals.py: the run-to-run sd or the law's robust residual sd, whichever is larger."""
    residual = robust_residual_sd(fit, *_law_columns(points))
    if noise.sigma is not None and noise.sigma >= residual:
        return noise.sigma, f"the run-to-run sd of ln L from seed repeats; the law's residual sd is {residual:.3g}"
    seeds = "no seed repeats" if noise.sigma is None else f"above the run-to-run sd {noise.sigma:.3g}"
    return residual, f"the law's robust residual sd of ln L, {seeds}"


def fit_laws(points: list[Point], forms: tuple[str, ...], objective: str, huber_delta: float | None,
             samples: list[np.ndarray], fpt: FlopsPerToken) -> tuple[dict[str, LawResult], dict[str, str],
                                                                     dict[str, dict[str, int]]]:
    """Each form on every run, its bootstrap refits, its rolling backtest (with the full fit's delta)
    and its interval terms; the forms that cannot be fitted with their reasons; each form's refit
    failures by reason."""
    laws, skipped, failures = {}, {}, {}
    noise = run_to_run_noise(points)
    for form in forms:
        try:
            full = fit_law(form, *_law_columns(points), objective, huber_delta)
        except Exception as error:  # noqa: BLE001 - one form failing must not stop the others
            skipped[form] = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            continue
        refits, failures[form] = [], {}
        for chosen in samples:
            refit = _refit_law(full, [points[i] for i in chosen])
            if isinstance(refit, LawFit):
                refits.append(refit)
            else:
                failures[form][refit] = failures[form].get(refit, 0) + 1
        backtest = rolling_backtest(form, points, objective, full.huber_delta)
        floor, how = interval_floor(full, points, noise)
        extrapolation = fit_extrapolation_error([(fold.log_errors, fold.decades, fold.leverage)
                                                 for fold in backtest.scored], floor)
        laws[form] = LawResult(full, refits, backtest, points, fpt, floor, how, extrapolation)
    return laws, skipped, failures


# ---------------------------------------------------------------------------------------------
# All approaches and forms, and the bootstrap


def _assumed_line() -> FlopsPerToken:
    return FlopsPerToken("6N", "C = 6ND (assumed)")


@dataclass
class ScalingFit:
    """The fits on all runs, the reasons for the approaches that could not run, and the bootstrap refits
    (one dict approach -> fit per resample; an approach missing from a resample failed on it); the law
    forms (LawResult each), the choice of form by backtest (with its ties), run-to-run noise, the FLOPs
    line, every failed refit counted by reason (approach or form -> {reason: count}) and the largest
    FLOPs fitted (where a prediction's extrapolation distance starts)."""

    fits: dict[str, ApproachFit]
    skipped: dict[str, str]
    replicates: list[dict[str, ApproachFit]] = field(default_factory=list)
    seed: int = 0
    laws: dict[str, LawResult] = field(default_factory=dict)
    law_skipped: dict[str, str] = field(default_factory=dict)
    choice: Choice | None = None
    noise: Noise = field(default_factory=lambda: Noise(None, "not measured", 0))
    fpt: FlopsPerToken = field(default_factory=_assumed_line)
    bootstrap_failures: dict[str, dict[str, int]] = field(default_factory=dict)
    fitted_max_flops: float = math.nan

    @property
    def chosen(self) -> str | None:
        return None if self.choice is None else self.choice.form

    @property
    def chosen_reason(self) -> str:
        return "no form was fitted" if self.choice is None else self.choice.reason

    @property
    def ties(self) -> tuple[str, ...]:
        return () if self.choice is None else self.choice.ties

    def samples(self, approach: str) -> list[ApproachFit]:
        return [replicate[approach] for replicate in self.replicates if approach in replicate]

    def interval_forms(self, form: str | None = None) -> tuple[str, ...]:
        """The forms a prediction's interval spans: the chosen form's ties, or `form` alone."""
        name = self._law_result(form).fit.form
        return tuple(f for f in self.ties if f in self.laws) if name == self.chosen and self.ties else (name,)

    def averages_ties(self, form: str | None = None) -> bool:
        """Whether predict's loss (for `form`, default the chosen) is the tied forms' mixture median rather
        than the form's own: where its interval spans more than one form."""
        return len(self.interval_forms(form)) > 1

    def extrapolation_decades(self, params: ArrayLike, tokens: ArrayLike) -> np.ndarray:
        """log10(C / the largest C fitted), C = fpt(N) D, and 0 within the fitted budgets."""
        flops = self.fpt(params) * np.asarray(tokens, dtype=float)
        return np.maximum(np.log10(flops / self.fitted_max_flops), 0.0)

    def predict(self, params: ArrayLike, tokens: ArrayLike, unique_tokens: ArrayLike | None = None,
                confidence: float = PREDICTION_CONFIDENCE,
                form: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(L, lower, upper): the predicted loss and a `confidence` prediction interval for a new run's
        loss (intervals.py: the bootstrap refits of the forms in interval_forms, the noise floor s0 and
        the backtests' error tau per decade beyond the fitted budgets, all of the form predicted). L is
        the chosen form's (or `form`'s) own fit, except where the interval spans tied forms: then the
        median of the tied forms' refits, each form weighing the same (averages_ties; the interval's
        mixture without its noise term, intervals.mixture_median). Each point is computed
        alone and without random draws, so it and its interval do not depend on the other points. NaN
        bounds where nothing spreads the prediction."""
        result = self._law_result(form)
        forms = self.interval_forms(form)
        fits = {name: self.laws[name].interval_fits() for name in forms}
        unique = result.corpus_tokens if unique_tokens is None else unique_tokens
        params, tokens = np.broadcast_arrays(np.asarray(params, dtype=float), np.asarray(tokens, dtype=float))
        unique = np.broadcast_to(np.asarray(np.nan if unique is None else unique, dtype=float), params.shape)
        decades = self.extrapolation_decades(params, tokens)
        point, lower, upper = (np.full(params.shape, math.nan) for _ in range(3))
        for index in np.ndindex(params.shape):
            n, d = float(params[index]), float(tokens[index])
            u = None if math.isnan(unique[index]) else float(unique[index])
            sd = math.hypot(result.noise_sd, result.extrapolation.per_decade * float(decades[index]))
            centres = [log_losses(fits[name], n, d, u) for name in forms]
            lower[index], upper[index] = mixture_interval(centres, sd, confidence)
            point[index] = (mixture_median(centres) if len(forms) > 1 else
                            math.exp(log_losses([result.fit], n, d, u)[0]))
        return point, lower, upper

    def _law_result(self, form: str | None) -> LawResult:
        name = form or self.chosen
        if name is None or name not in self.laws:
            fitted = ", ".join(self.laws) or "none (" + "; ".join(self.law_skipped.values()) + ")"
            raise ValueError(f"law form {name!r} was not fitted; fitted: {fitted}")
        return self.laws[name]

    def compute_optimal(self, flops: float) -> dict[str, dict]:
        """{approach or form: {n_opt, d_opt, tokens_per_param, loss (Approach 3 and the forms), each with
        _ci, its 95% bootstrap percentile interval or None}}, every allocation on the exact FLOPs line
        fpt(N*) D* = C (see compute_optimal and LawResult.allocation). Forms add loss_interval, the
        predict() interval at (N*, D*)."""
        table: dict[str, dict] = {}
        for approach, fit in self.fits.items():
            table[approach] = with_intervals(compute_optimal(fit, flops, self.fpt),
                                              [compute_optimal(s, flops, self.fpt) for s in self.samples(approach)])
        for form, result in self.laws.items():
            rows = [_allocation_row(*result.allocation(flops, refit)) for refit in result.refits]
            table[form] = with_intervals(_allocation_row(*result.allocation(flops)), rows)
            n_opt, d_opt = table[form]["n_opt"], table[form]["d_opt"]
            table[form]["loss_interval"] = (None if not math.isfinite(n_opt) else
                                            [float(v) for v in self.predict(n_opt, d_opt, form=form)[1:]])
        return table


def _allocation_row(n_opt: float, d_opt: float, loss: float) -> dict[str, float]:
    return {"n_opt": n_opt, "d_opt": d_opt, "tokens_per_param": d_opt / n_opt if n_opt > 0 else math.nan,
            "loss": loss}


def with_intervals(values: dict[str, float], samples: list[dict[str, float]]) -> dict:
    """Each value, and beside it as KEY_ci its 95% bootstrap percentile interval over the samples."""
    table: dict = {}
    for key, value in values.items():
        table[key] = value
        table[f"{key}_ci"] = percentile_interval([sample[key] for sample in samples])
    return table


def _attempt(run: Callable[[], ApproachFit]) -> ApproachFit | str:
    """The fit, or the reason it failed: ValueError's message as it is (it names the minimum), any
    other exception with its type (a refit must never kill the whole fit)."""
    try:
        return run()
    except ValueError as reason:
        return str(reason)
    except Exception as error:  # noqa: BLE001 - see the docstring
        return f"{type(error).__name__}: {error}"


def fit_approaches(data: FitData, approaches: tuple[str, ...] = APPROACHES,
                   huber_delta: float = HUBER_DELTA) -> tuple[dict[str, ApproachFit], dict[str, str]]:
    """Every approach that can run on these runs, and why the others cannot."""
    runs = {
        "approach1": lambda: fit_envelope(data.envelope_curves()),
        "approach2": lambda: fit_isoflop(data.points),
        "approach3": lambda: fit_parametric([p.params for p in data.points], [p.tokens for p in data.points],
                                            [p.loss for p in data.points], delta=huber_delta),
    }
    fits, skipped = {}, {}
    for name in approaches:
        outcome = _attempt(runs[name])
        if isinstance(outcome, str):
            skipped[name] = outcome
        else:
            fits[name] = outcome
    return fits, skipped


def fit_scaling_laws(data: FitData, bootstrap: int = 100, seed: int = 0, objective: str = "huber",
                     huber_delta: float | None = None, forms: tuple[str, ...] | None = None,
                     approaches: tuple[str, ...] = APPROACHES) -> ScalingFit:
    """The `approaches` (default all three) and the law forms (`forms`, default all of LAW_FORMS) on every
    run, then `bootstrap` refits of each on resampled runs (bootstrap_samples), the forms' rolling
    backtests and the choice of form (backtest.choose_form) with its ties. `objective` and `huber_delta`
    are the forms' (None: "auto", see laws.huber_delta_auto); Approach 3 keeps the paper's Huber
    objective, with huber_delta or else HUBER_DELTA. No failure of one approach, form or refit is fatal:
    it is recorded in skipped, law_skipped or bootstrap_failures. ValueError only when nothing at all
    can be fitted."""
    fits, skipped = fit_approaches(data, approaches, HUBER_DELTA if huber_delta is None else huber_delta)
    samples = bootstrap_samples(data.points, bootstrap, seed)
    fpt = flops_per_token_model(data.points)
    laws, law_skipped, failures = fit_laws(data.points, tuple(LAW_FORMS) if forms is None else forms, objective,
                                           huber_delta, samples, fpt)
    if not fits and not laws:
        raise ValueError(f"{len(data.points)} runs are too few for any fit: "
                         + "; ".join([*skipped.values(), *law_skipped.values()]))
    replicates, approach_failures = _replicate_approaches(data, samples, fits, huber_delta)
    choice = choose_form({form: r.backtest for form, r in laws.items()}, {form: r.fit for form, r in laws.items()},
                         min(r.noise_sd for r in laws.values())) if laws else None
    return ScalingFit(fits, skipped, replicates, seed, laws, law_skipped, choice, run_to_run_noise(data.points), fpt,
                      approach_failures | failures, max(point.flops for point in data.points))


def _replicate_approaches(data: FitData, samples: list[np.ndarray], fits: dict[str, ApproachFit],
                          huber_delta: float | None) -> tuple[list[dict[str, ApproachFit]], dict[str, dict[str, int]]]:
    """The approaches fitted on all runs, refitted on every resample (Approach 3 as in refit_parametric);
    the failed refits counted by approach and reason."""
    failures: dict[str, dict[str, int]] = {name: {} for name in fits}
    replicates = []
    for chosen in samples:
        replicate, reasons = fit_approaches(data.subset(chosen), tuple(a for a in ("approach1", "approach2")
                                                                       if a in fits))
        for name, reason in reasons.items():
            failures[name][reason] = failures[name].get(reason, 0) + 1
        replicates.append(replicate)
    if "approach3" in fits and samples:
        delta = HUBER_DELTA if huber_delta is None else huber_delta
        refits = _attempt(lambda: refit_parametric(data, samples, fits["approach3"], delta))
        refits = [refits] * len(samples) if isinstance(refits, str) else refits
        for replicate, refit in zip(replicates, refits, strict=True):
            if isinstance(refit, str):
                failures["approach3"][refit] = failures["approach3"].get(refit, 0) + 1
            else:
                replicate["approach3"] = refit
    return replicates, failures


def bootstrap_samples(points: list[Point], count: int, seed: int) -> list[np.ndarray]:
    """`count` resamples of run indices, with replacement within each IsoFLOP profile that has enough
    sizes for a parabola (so it keeps its count of runs) and across the other runs pooled."""
    strata, rest = [], []
    for group in group_by_budget(points):
        if len({points[i].params for i in group}) >= MIN_SIZES_PER_BUDGET:
            strata.append(np.array(group))
        else:
            rest.extend(group)
    strata += [np.array(rest)] if rest else []
    rng = np.random.default_rng(seed)
    return [np.concatenate([rng.choice(stratum, size=len(stratum)) for stratum in strata]) for _ in range(count)]


def percentile_interval(values: ArrayLike, confidence: float = 0.95) -> list[float] | None:
    """The bootstrap percentile interval of the finite values; None with fewer than MIN_BOOTSTRAP_FITS."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if len(values) < MIN_BOOTSTRAP_FITS:
        return None
    tail = 50 * (1 - confidence)
    low, high = np.percentile(values, [tail, 100 - tail])
    return [float(low), float(high)]
