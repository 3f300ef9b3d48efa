"""The fitting step of `scaletrain sweep tune`: the optimal LR (and batch) of each size and horizon, and
the power law through those optima.

Per (size N, horizon D) the seeds' final losses are averaged in ln L (a geometric mean: seed noise is
multiplicative in L, and one seed's loss is its own average), then the loss is fitted in ln(lr) by the
parabola through the best grid point and its two neighbours, whose vertex is eta*(N, D) (DeepSeek LLM
2024, sec. 3.1, fit their optima on such grids). With one horizon the law is eta*(N) = eta0 (N/N0)^a
(Porian et al. 2024 fit LR and batch per size); with two horizons or more it is eta*(N, D) = eta0
(N/N0)^a (D/D0)^b, by least squares in ln eta on ln N and ln D: the optimal LR moves with the horizon too
(Bjorck et al. 2024, "Scaling Optimal LR Across Token Horizons", find it falling as a power of D at fixed N;
Li et al. 2025, "Predictable Scale: Part I", fit eta* as a power law in both N and D). N0 and D0 are the
geometric means of the optima's N and D, where value and exponents are least correlated.

A best grid point whose next LR up diverged (with any seed) has no parabola: by default the fit refuses it and
asks for finer multipliers; with tune.unstable_neighbour: best_point the optimum is the best point itself
(stability_limited): the grid's best LR that trained with every seed, the next one up being past the LR where
training becomes unstable (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", measure this sensitivity of the final loss to the LR). Its error is at most the grid's step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from scaletrain.config import ConfigError


@dataclass(frozen=True)
class GridResult:
    """One trained grid point: its size, planned tokens, LR, batch, seed and final validation loss (inf where
    it failed or diverged); `horizon` is the spec's value it trains at (tokens, or tokens per parameter: then
    the tokens differ between sizes), None: its tokens."""

    params: int
    tokens: float
    lr: float
    batch_size: int
    loss: float
    seed: int = 0
    name: str = ""
    horizon: float | None = None

    @property
    def horizon_key(self) -> float:
        return self.tokens if self.horizon is None else self.horizon


@dataclass(frozen=True)
class PowerLaw:
    """value x (N / reference_params)^exponent x (D / reference_tokens)^tokens_exponent: the form `power` rules
    take (hyperparams.py); tokens_exponent None: a law in N alone, fitted at one horizon."""

    value: float
    reference_params: float
    exponent: float
    reference_tokens: float | None = None
    tokens_exponent: float | None = None

    def __call__(self, params: float, tokens: float | None = None) -> float:
        value = self.value * (params / self.reference_params) ** self.exponent
        if self.tokens_exponent is None:
            return value
        return value * (tokens / self.reference_tokens) ** self.tokens_exponent

    def formula(self, what: str, unit: str = "") -> str:
        law = f"{what}(N{'' if self.tokens_exponent is None else ', D'}) = {self.value:.4g} x " \
              f"(N / {self.reference_params:.4g})^{self.exponent:.4f}"
        if self.tokens_exponent is not None:
            law += f" x (D / {self.reference_tokens:.4g})^{self.tokens_exponent:.4f}"
        return law + (f" {unit}" if unit else "")


@dataclass(frozen=True)
class Optimum:
    """The optimum of one (size, horizon): the parabola's vertex and minimum, at its best batch; or, where the
    next LR up diverged and tune.unstable_neighbour is best_point, the best grid point (stability_limited)."""

    params: int
    tokens: float
    lr: float  # the parabola's vertex
    loss: float  # the parabola's minimum
    batch_size: int
    # loss = a ln(lr)^2 + b ln(lr) + c, through the best point's neighbours; None where stability_limited
    parabola: tuple[float, float, float] | None
    stability_limited: bool = False


@dataclass(frozen=True)
class TuningFit:
    lr: PowerLaw
    batch_size: PowerLaw | None
    optima: list[Optimum]
    horizons: list[float]  # the spec's horizon values the grid trained, ascending
    seeds: list[int]


UNSTABLE_NEIGHBOUR = ("refuse", "best_point")  # tune.unstable_neighbour's choices


def parabola_vertex(xs: list[float], losses: list[float], what: str,
                    unstable_neighbour: str = "refuse") -> tuple[float, float, tuple | None]:
    """The vertex (x*, loss*) of the parabola through the lowest loss and its two neighbours on the grid `xs`
    (ascending), and the parabola's coefficients; refuses a best point at the grid's edge, where the optimum
    may lie outside it, and a neighbour that diverged, unless it is the upper one and `unstable_neighbour` is
    best_point: then the best point itself, without a parabola (None)."""
    best = int(np.argmin(losses))
    if best in (0, len(xs) - 1):
        edge, side = ("lowest", "below") if best == 0 else ("highest", "above")
        raise ConfigError(f"{what}: the lowest loss is at the {edge} grid point ({math.exp(xs[best]):.3g}); "
                          f"the optimum may lie {side} the grid: widen lr_multipliers (or batch_multipliers) {side}")
    window = slice(best - 1, best + 2)
    if not all(math.isfinite(loss) for loss in losses[window]):
        if unstable_neighbour == "best_point" and math.isfinite(losses[best - 1]):
            return float(xs[best]), float(losses[best]), None
        raise ConfigError(f"{what}: a neighbour of the best grid point failed or diverged; use finer multipliers "
                          "around the best one (or, where the LR above it diverged, tune.unstable_neighbour: "
                          "best_point takes the best point as the optimum)")
    a, b, c = np.polyfit(xs[window], losses[window], 2)
    vertex = -b / (2 * a)
    return float(vertex), float(c - b * b / (4 * a)), (float(a), float(b), float(c))


def fit_power_law(params: list[float], values: list[float], tokens: list[float] | None = None) -> PowerLaw:
    """ln value = ln c + a ln N (+ b ln D) by least squares, stated at the geometric means of N (and D)."""
    log_n, log_v = np.log(params), np.log(values)
    if tokens is None:
        exponent, intercept = np.polyfit(log_n, log_v, 1)
        reference = float(np.exp(log_n.mean()))
        return PowerLaw(value=float(np.exp(intercept) * reference ** exponent), reference_params=reference,
                        exponent=float(exponent))
    log_d = np.log(tokens)
    design = np.column_stack([np.ones_like(log_n), log_n - log_n.mean(), log_d - log_d.mean()])
    coefficients, _, rank, _ = np.linalg.lstsq(design, log_v, rcond=None)
    if rank < 3:
        raise ConfigError("a power law in N and D needs optima at two sizes and two horizons at least that do not "
                          "move together; add sizes or horizons to `tune:`")
    return PowerLaw(value=float(np.exp(coefficients[0])), reference_params=float(np.exp(log_n.mean())),
                    exponent=float(coefficients[1]), reference_tokens=float(np.exp(log_d.mean())),
                    tokens_exponent=float(coefficients[2]))


def seed_means(results: list[GridResult]) -> list[GridResult]:
    """One result per (size, horizon, batch, LR): the seeds' losses averaged in ln L (inf if any failed)."""
    groups: dict[tuple, list[GridResult]] = {}
    for result in results:
        groups.setdefault((result.params, result.horizon_key, result.batch_size, result.lr), []).append(result)
    means = []
    for group in groups.values():
        losses = [result.loss for result in group]
        loss = math.exp(sum(map(math.log, losses)) / len(losses)) if all(map(math.isfinite, losses)) else math.inf
        means.append(dataclasses.replace(group[0], loss=loss, seed=min(result.seed for result in group)))
    return means


def seed_sigma(results: list[GridResult]) -> tuple[float | None, int]:
    """The pooled run-to-run sd of ln L over the grid points trained with several seeds, and its degrees of
    freedom (None, 0: no point has two finite seeds)."""
    groups: dict[tuple, list[float]] = {}
    for result in results:
        if math.isfinite(result.loss):
            groups.setdefault((result.params, result.horizon_key, result.batch_size, result.lr), []).append(
                math.log(result.loss))
    squares = sum(float(np.sum((np.array(logs) - np.mean(logs)) ** 2)) for logs in groups.values())
    freedom = sum(len(logs) - 1 for logs in groups.values())
    return (math.sqrt(squares / freedom), freedom) if freedom else (None, 0)


def fit_tuning(results: list[GridResult], tune_batch: bool, unstable_neighbour: str = "refuse") -> TuningFit:
    """Per (size, horizon) the LR optimum (at each batch, then the batch optimum in ln B over those minima)
    of the seed means, and the power laws through them: in N, or in N and D with two horizons or more.
    `unstable_neighbour`: tune.unstable_neighbour (parabola_vertex)."""
    means = seed_means(results)
    keys = sorted({(r.params, r.horizon_key) for r in means})
    optima = [_optimum([r for r in means if (r.params, r.horizon_key) == key], tune_batch, unstable_neighbour)
              for key in keys]
    if len({params for params, _ in keys}) < 2:
        raise ConfigError("a power law in N needs grid results at two sizes at least; add sizes to `tune:`")
    horizons = sorted({horizon for _, horizon in keys})
    params = [optimum.params for optimum in optima]
    tokens = [optimum.tokens for optimum in optima] if len(horizons) > 1 else None
    batch = fit_power_law(params, [o.batch_size for o in optima], tokens) if tune_batch else None
    return TuningFit(lr=fit_power_law(params, [o.lr for o in optima], tokens), batch_size=batch, optima=optima,
                     horizons=horizons, seeds=sorted({r.seed for r in results}))


def _optimum(results: list[GridResult], tune_batch: bool, unstable_neighbour: str) -> Optimum:
    per_batch = []
    first = results[0]
    where = f"{first.params:,} parameters, {first.tokens:.3g} tokens"
    for batch_size in sorted({r.batch_size for r in results}):
        grid = sorted((r for r in results if r.batch_size == batch_size), key=lambda r: r.lr)
        x, loss, parabola = parabola_vertex([math.log(r.lr) for r in grid], [r.loss for r in grid],
                                            f"{where}, batch {batch_size}", unstable_neighbour)
        per_batch.append(Optimum(first.params, first.tokens, math.exp(x), loss, batch_size, parabola,
                                 stability_limited=parabola is None))
    if not tune_batch:
        return per_batch[0]
    batch_x, _, _ = parabola_vertex([math.log(o.batch_size) for o in per_batch], [o.loss for o in per_batch],
                                    f"{where}, batch")
    nearest = min(per_batch, key=lambda o: abs(math.log(o.batch_size) - batch_x))
    return dataclasses.replace(nearest, batch_size=round(math.exp(batch_x)))
