"""A batched L-BFGS: thousands of small, independent minimisations (the starts of Approach 3's grid,
the bootstrap refits) in one numpy pass, each with its own curvature pairs and step (Nocedal &
Wright 2006, alg. 7.4-7.5, Armijo backtracking). scipy's L-BFGS-B, called once per start, spends
its time in Python overhead on these 5-variable problems; see fit.fit_parametric."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _two_loop(gradient: np.ndarray, steps: np.ndarray, changes: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """The L-BFGS direction -H g for each problem (Nocedal & Wright 2006, alg. 7.4), newest pair first;
    an empty memory slot has rho = 0 and changes nothing."""
    q = gradient.copy()
    alphas = np.zeros(rho.shape)
    for i in range(len(rho)):
        alphas[i] = rho[i] * (steps[i] * q).sum(axis=1)
        q -= alphas[i][:, None] * changes[i]
    sy, yy = (steps[0] * changes[0]).sum(axis=1), (changes[0] ** 2).sum(axis=1)
    first = np.linalg.norm(gradient, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        gamma = np.where(rho[0] > 0, sy / yy, 1.0 / np.where(first > 0, first, 1.0))
    r = gamma[:, None] * q
    for i in reversed(range(len(rho))):
        r += (alphas[i] - rho[i] * (changes[i] * r).sum(axis=1))[:, None] * steps[i]
    return -r


def _backtrack(objective: Callable, x: np.ndarray, f: np.ndarray, g: np.ndarray, direction: np.ndarray,
               problems: np.ndarray, halvings: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Armijo backtracking (c1 = 1e-4) from a unit step, for every problem at once. Where no step
    lowers f, f stays infinite: that problem has converged or stalled. Returns (step, f, gradient)."""
    slope = (direction * g).sum(axis=1)
    step = np.ones(len(x))
    new_f, new_g = np.full(len(x), np.inf), np.zeros_like(x)
    todo = np.arange(len(x))
    for _ in range(halvings):
        trial_f, trial_g = objective(x[todo] + step[todo, None] * direction[todo], problems[todo])
        accepted = np.isfinite(trial_f) & (trial_f <= f[todo] + 1e-4 * step[todo] * slope[todo])
        new_f[todo[accepted]], new_g[todo[accepted]] = trial_f[accepted], trial_g[accepted]
        todo = todo[~accepted]
        if not len(todo):
            break
        step[todo] *= 0.5
    return step, new_f, new_g


def batched_lbfgs(objective: Callable, starts: np.ndarray, memory: int = 10, max_iterations: int = 1000,
                  ftol: float = 1e-12, gtol: float = 1e-9) -> tuple[np.ndarray, np.ndarray]:
    """L-BFGS from every start at once: each problem keeps its own curvature pairs and step, and numpy
    evaluates all of them in one pass (Nocedal & Wright 2006, alg. 7.5, with Armijo backtracking and
    pairs kept only where s.y > 0). objective(x[k], problems[k]) -> (f, gradient); a problem stops when
    an iteration lowers f by <= ftol * max(|f|, 1) (scipy's test) or its largest |gradient| <= gtol.
    Returns the final points and values."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # diverging starts: inf, then dropped
        return _batched_lbfgs(objective, starts.astype(float), memory, max_iterations, ftol, gtol)


def _batched_lbfgs(objective: Callable, x: np.ndarray, memory: int, max_iterations: int, ftol: float,
                   gtol: float) -> tuple[np.ndarray, np.ndarray]:
    f, g = objective(x, np.arange(len(x)))
    steps, changes = np.zeros((memory, *x.shape)), np.zeros((memory, *x.shape))
    rho = np.zeros((memory, len(x)))
    active = np.flatnonzero(np.isfinite(f) & np.all(np.isfinite(g), axis=1))
    for _ in range(max_iterations):
        if not len(active):
            break
        direction = _two_loop(g[active], steps[:, active], changes[:, active], rho[:, active])
        uphill = ~((direction * g[active]).sum(axis=1) < 0)
        direction[uphill] = -g[active][uphill]
        step, new_f, new_g = _backtrack(objective, x[active], f[active], g[active], direction, active)
        moved = np.isfinite(new_f)
        s, y = np.where(moved[:, None], step[:, None] * direction, 0.0), new_g - g[active]
        _remember(steps, changes, rho, active, s, y)
        previous = f[active]
        updated = active[moved]
        x[updated], f[updated], g[updated] = x[updated] + s[moved], new_f[moved], new_g[moved]
        small_change = previous - f[active] <= ftol * np.maximum(np.maximum(np.abs(previous), np.abs(f[active])), 1)
        active = active[moved & ~small_change & (np.abs(g[active]).max(axis=1) > gtol)]
    return x, f


def _remember(steps: np.ndarray, changes: np.ndarray, rho: np.ndarray, active: np.ndarray, s: np.ndarray,
              y: np.ndarray) -> None:
    """Push each active problem's newest pair (s, y); one without positive curvature s.y is stored empty."""
    sy = (s * y).sum(axis=1)
    keep = sy > 1e-12 * np.linalg.norm(s, axis=1) * np.linalg.norm(y, axis=1)
    for history in (steps, changes, rho):
        history[:, active] = np.roll(history[:, active], 1, axis=0)
    steps[0, active], changes[0, active] = s * keep[:, None], y * keep[:, None]
    rho[0, active] = np.where(keep, 1.0 / np.where(keep, sy, 1.0), 0.0)


def in_chunks(objective: Callable, runs: int, elements: int = 2_000_000) -> Callable:
    """The objective evaluated over at most `elements` (problem, run) pairs at a time, bounding memory."""
    size = max(1, elements // max(runs, 1))

    def chunked(theta: np.ndarray, problems: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(theta) <= size:
            return objective(theta, problems)
        parts = [objective(theta[i:i + size], problems[i:i + size]) for i in range(0, len(theta), size)]
        return np.concatenate([value for value, _ in parts]), np.concatenate([gradient for _, gradient in parts])

    return chunked
