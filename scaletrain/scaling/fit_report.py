"""Run the three scaling-law approaches on a set of runs, bootstrap them, and report: the fit.json
structure and the printed summary. Numerics live in fit.py, reading sources in fit_source.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaletrain.scaling.fit import (
    CHINCHILLA_GRID,
    HUBER_DELTA,
    Curve,
    ParametricFit,
    Point,
    fit_envelope,
    fit_isoflop,
    fit_parametric,
    group_by_budget,
    parametric_theta,
)

# Bootstrap refits of Approach 3 start from the full-data optimum and from the grid starts with the
# lowest initial objective on the resample, not from all 4,500 (see fit_parametric).
BOOTSTRAP_GRID_STARTS = 20
PUBLISHED = {  # N_opt ∝ C^a, D_opt ∝ C^b
    "Chinchilla approach 1": (0.50, 0.50), "Chinchilla approach 2": (0.49, 0.51),
    "Chinchilla approach 3": (0.46, 0.54), "Kaplan et al. 2020": (0.73, 0.27),
}


@dataclass
class FitInputs:
    points: list[Point]
    curves: list[Curve | None]  # aligned with points; None where only the final point is known
    source: str
    params_column: str


def approach_values(inputs: FitInputs, targets: list[float], parametric_starts: Any) -> dict[str, Any]:
    """Every approach's constants and its predictions at `targets`; an approach that cannot run on
    these points is recorded under "skipped" with the reason."""
    values: dict[str, Any] = {"skipped": {}}
    for name, run in (("approach1", _approach1), ("approach2", _approach2), ("approach3", _approach3)):
        try:
            values[name] = run(inputs, targets, parametric_starts)
        except ValueError as error:
            values["skipped"][name] = str(error)
    return values


def _approach1(inputs: FitInputs, targets: list[float], _: Any) -> dict[str, Any]:
    curves = [c if c is not None else _final_point_curve(p) for c, p in zip(inputs.curves, inputs.points, strict=True)]
    n_law, d_law, frontier = fit_envelope(curves)
    return {"a": n_law.exponent, "b": d_law.exponent, "n_coefficient": n_law.coefficient,
            "d_coefficient": d_law.coefficient, "predictions": _power_law_predictions(n_law, d_law, targets),
            "frontier": [vars(point) for point in frontier]}


def _approach2(inputs: FitInputs, targets: list[float], _: Any) -> dict[str, Any]:
    n_law, d_law, minima = fit_isoflop(inputs.points)
    return {"a": n_law.exponent, "b": d_law.exponent, "n_coefficient": n_law.coefficient,
            "d_coefficient": d_law.coefficient, "predictions": _power_law_predictions(n_law, d_law, targets),
            "budgets": [{"flops": m.flops, "n_opt": m.params_opt, "d_opt": m.tokens_opt, "loss_min": m.loss_min,
                         "parabola": list(m.parabola)} for m in minima]}


def _approach3(inputs: FitInputs, targets: list[float], starts: Any) -> dict[str, Any]:
    fit = fit_parametric(inputs.points, **starts)
    predictions = []
    for flops in targets:
        n_opt, d_opt = fit.compute_optimal(flops)
        predictions.append({"n_opt": n_opt, "d_opt": d_opt, "loss": float(fit.loss(n_opt, d_opt)),
                            "tokens_per_param": d_opt / n_opt})
    return {"E": fit.E, "A": fit.A, "B": fit.B, "alpha": fit.alpha, "beta": fit.beta, "a": fit.a, "b": fit.b,
            "objective": fit.objective, "huber_delta": HUBER_DELTA, "predictions": predictions}


def _power_law_predictions(n_law: Callable, d_law: Callable, targets: list[float]) -> list[dict[str, float]]:
    return [{"n_opt": float(n_law(c)), "d_opt": float(d_law(c)), "tokens_per_param": float(d_law(c) / n_law(c))}
            for c in targets]


def _final_point_curve(point: Point) -> Curve:
    return Curve(point.params, np.array([point.flops]), np.array([point.tokens]), np.array([point.loss]))


def fit_with_intervals(inputs: FitInputs, targets: list[float], bootstrap: int, seed: int) -> dict[str, Any]:
    """The fits on all points, then `bootstrap` refits on resampled runs (with replacement, within each
    FLOP budget so every IsoFLOP profile keeps its size), and 95% percentile intervals."""
    full = approach_values(inputs, targets, {"starts": CHINCHILLA_GRID})
    replicates = []
    rng = np.random.default_rng(seed)
    starts = _bootstrap_starts(full)
    groups = list(group_by_budget(inputs.points).values())
    index_of = {id(point): index for index, point in enumerate(inputs.points)}
    for _ in range(bootstrap):
        chosen = [index_of[id(group[i])] for group in groups for i in rng.integers(0, len(group), len(group))]
        sample = FitInputs([inputs.points[i] for i in chosen], [inputs.curves[i] for i in chosen], inputs.source,
                           inputs.params_column)
        replicates.append(approach_values(sample, targets, starts))
    return _with_intervals(full, replicates, targets) | {"bootstrap": bootstrap, "bootstrap_seed": seed}


def _bootstrap_starts(full: dict[str, Any]) -> dict[str, Any]:
    if "approach3" not in full:
        return {"starts": CHINCHILLA_GRID, "best_starts": BOOTSTRAP_GRID_STARTS}
    fitted = full["approach3"]
    optimum = parametric_theta(ParametricFit(fitted["E"], fitted["A"], fitted["B"], fitted["alpha"], fitted["beta"], 0))
    return {"starts": np.vstack([optimum, CHINCHILLA_GRID]), "best_starts": BOOTSTRAP_GRID_STARTS + 1}


SCALARS = {"approach1": ("a", "b"), "approach2": ("a", "b"), "approach3": ("E", "A", "B", "alpha", "beta", "a", "b")}


def _with_intervals(full: dict[str, Any], replicates: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    for approach, keys in SCALARS.items():
        if approach not in full:
            continue
        samples = [r[approach] for r in replicates if approach in r]
        for key in keys:
            full[approach][f"{key}_ci"] = _interval([s[key] for s in samples])
        for index, prediction in enumerate(full[approach]["predictions"]):
            for key in list(prediction):
                prediction[f"{key}_ci"] = _interval([s["predictions"][index][key] for s in samples])
        full[approach]["bootstrap_fits"] = len(samples)
    _add_bands(full, replicates, targets)
    full["predictions"] = [
        {"flops": flops, **{approach: full[approach]["predictions"][index] for approach in SCALARS if approach in full}}
        for index, flops in enumerate(targets)
    ]
    for approach in SCALARS:
        if approach in full:
            del full[approach]["predictions"]
    return full


def _add_bands(full: dict[str, Any], replicates: list[dict[str, Any]], targets: list[float]) -> None:
    """N_opt(C) and D_opt(C) on a grid of budgets up to the largest target, with 95% bootstrap bands."""
    low = min(point["flops"] for point in full["approach1"]["frontier"]) if "approach1" in full else targets[0] / 100
    flops = np.geomspace(low, max(targets), 40)
    for approach in SCALARS:
        if approach not in full:
            continue
        curves = [_optimal_curve(r[approach], approach, flops) for r in replicates if approach in r]
        n_opt, d_opt = _optimal_curve(full[approach], approach, flops)
        band = {"flops": flops.tolist(), "n_opt": n_opt.tolist(), "d_opt": d_opt.tolist()}
        for index, key in enumerate(("n_opt", "d_opt")):
            if len(curves) >= 10:
                stacked = np.array([curve[index] for curve in curves])
                band[f"{key}_ci"] = np.percentile(stacked, [2.5, 97.5], axis=0).T.tolist()
        full[approach]["band"] = band


def _optimal_curve(values: dict[str, Any], approach: str, flops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if approach == "approach3":
        law = ParametricFit(values["E"], values["A"], values["B"], values["alpha"], values["beta"], 0)
        optimal = np.array([law.compute_optimal(c) for c in flops])
        return optimal[:, 0], optimal[:, 1]
    return values["n_coefficient"] * flops ** values["a"], values["d_coefficient"] * flops ** values["b"]


def _interval(values: list[float]) -> list[float] | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 10:
        return None  # too few successful refits to call it an interval
    low, high = np.percentile(finite, [2.5, 97.5])
    return [float(low), float(high)]


def format_summary(fit: dict[str, Any]) -> str:
    """The printed report: exponents with intervals against the published ones, then the predictions."""
    lines = [f"scaling-law fit of {fit['num_points']} runs from {fit['source']} (N = {fit['params_column']}, "
             f"{fit['bootstrap']} bootstrap refits, 95% intervals)"]
    for approach in SCALARS:
        if approach in fit:
            values = fit[approach]
            lines.append(f"  {approach}: N_opt ∝ C^{_with_ci(values, 'a')}, D_opt ∝ C^{_with_ci(values, 'b')}")
        else:
            lines.append(f"  {approach}: skipped: {fit['skipped'][approach]}")
    if "approach3" in fit:
        values = fit["approach3"]
        lines.append("  approach3: L(N, D) = " + " + ".join(
            [f"E {_with_ci(values, 'E')}", f"A {_with_ci(values, 'A')} / N^{_with_ci(values, 'alpha')}",
             f"B {_with_ci(values, 'B')} / D^{_with_ci(values, 'beta')}"]))
    lines.append("  published: " + "; ".join(f"{name} a={a}, b={b}" for name, (a, b) in PUBLISHED.items()))
    for prediction in fit["predictions"]:
        lines.append(f"  at C = {prediction['flops']:.3g} FLOPs:")
        for approach in SCALARS:
            if approach in prediction:
                p = prediction[approach]
                loss = f", loss {_with_ci(p, 'loss')}" if "loss" in p else ""
                lines.append(f"    {approach}: N* {_with_ci(p, 'n_opt')}, D* {_with_ci(p, 'd_opt')}, "
                             f"D*/N* {_with_ci(p, 'tokens_per_param')}{loss}")
    return "\n".join(lines) + "\n"


def _with_ci(values: dict[str, Any], key: str) -> str:
    interval = values.get(f"{key}_ci")
    text = f"{values[key]:.3g}"
    return f"{text} [{interval[0]:.3g}, {interval[1]:.3g}]" if interval else text
