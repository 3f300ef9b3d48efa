"""The fitting step of `sweep tune` (tune_fit.py) on synthetic loss surfaces with known optima: in N at one
horizon, in N and D at two, seeds averaged in ln L; and the LR check's verdicts (lr_check.py)."""

from __future__ import annotations

import dataclasses
import math

import matplotlib.pyplot as plt
import numpy as np
import pytest

from scaletrain.config import ConfigError
from scaletrain.scaling.sweep.lr_check import judge_point, summary
from scaletrain.scaling.sweep.tune_fit import GridResult, fit_tuning, seed_means, seed_sigma
from scaletrain.scaling.sweep.tune_plot import draw_tuning

A, B = -0.35, -0.2  # the true exponents of eta*(N, D) = 0.01 (N/1e7)^A (D/1e9)^B


def seed_noise(x: float, seed: int) -> float:
    """ln L of seed 1 and 2 differ by +/- this: it depends on the LR, so averaging L itself (not ln L) would
    move the optimum; the mean in ln L cancels it exactly."""
    return (0.01 * math.sin(3 * x)) * (1 if seed == 1 else -1)


def synthetic_grid(sizes: list[float], multipliers: list[float], curvature: float, wiggle: float,
                   horizons: tuple[float, ...] = (1e9,), seeds: tuple[int, ...] = (1,)) -> list[GridResult]:
    """L(N, D, lr) = a(N) + b (ln lr - ln eta*(N, D))^2 + wiggle sin(7 ln lr + ln N), times exp(seed noise)
    where there are two seeds, on a multiplicative grid around a centre rule that is off on purpose
    (0.008 (N/1e7)^-0.25 (D/1e9)^-0.1)."""
    results = []
    for n in sizes:
        for d in horizons:
            optimum, centre = 0.01 * (n / 1e7) ** A * (d / 1e9) ** B, 0.008 * (n / 1e7) ** -0.25 * (d / 1e9) ** -0.1
            for multiplier in multipliers:
                lr = centre * multiplier
                x = math.log(lr)
                loss = 3.0 + 5 * n ** -0.3 + curvature * (x - math.log(optimum)) ** 2
                loss += wiggle * math.sin(7 * x + math.log(n))
                for seed in seeds:
                    noise = seed_noise(x, seed) if len(seeds) > 1 else 0.0
                    results.append(GridResult(params=int(n), tokens=d, lr=lr, batch_size=8, loss=loss * math.exp(noise),
                                              seed=seed))
    return results


def vertex_error_bound(curvature: float, wiggle: float, step: float = math.log(2)) -> float:
    """The parabola through y at x0 - h, x0, x0 + h has its vertex at x0 - h D1 / (2 D2) with D1 = y+ - y-,
    D2 = y+ - 2 y0 + y- = 2 b h^2. A wiggle of at most w moves D1 by <= 2w and D2 by <= 4w; with the true
    optimum within h of x0 (|D1| <= 4 b h^2) the vertex moves by at most
    E = (h/2) (2w D2 + 4w |D1|) / (D2 (D2 - 4w)) = 5 w h / (2 b h^2 - 4 w) in ln(lr)."""
    return 5 * wiggle * step / (2 * curvature * step * step - 4 * wiggle)


def slope_bound(error: float, values: list[float]) -> float:
    """Least squares moves a coefficient by <= E sum|u| / sum u^2 (u: its regressor, centred) when every
    response moves by <= E and the regressors are orthogonal (a full grid of sizes x horizons)."""
    u = np.log(values) - np.log(values).mean()
    return error * np.abs(u).sum() / (u * u).sum()


def test_the_tuning_step_recovers_a_known_optimum_on_a_synthetic_loss_surface() -> None:
    sizes, multipliers, curvature, wiggle = [1e6, 8e6, 6.4e7], [0.25, 0.5, 1.0, 2.0, 4.0], 0.05, 1e-4
    fit = fit_tuning(synthetic_grid(sizes, multipliers, curvature, wiggle), tune_batch=False)
    error = vertex_error_bound(curvature, wiggle)
    assert fit.lr.tokens_exponent is None and fit.horizons == [1e9]  # one horizon: a law in N alone
    assert abs(fit.lr.exponent - A) <= slope_bound(error, sizes)
    truth_at_reference = 0.01 * (fit.lr.reference_params / 1e7) ** A
    assert abs(math.log(fit.lr.value / truth_at_reference)) <= error  # at the geometric mean of N
    for optimum in fit.optima:
        assert abs(math.log(optimum.lr / (0.01 * (optimum.params / 1e7) ** A))) <= error
    assert error < 0.01  # the bound is tight enough to mean something: 1% in LR


def test_two_horizons_fit_the_rule_in_n_and_d_with_seeds_averaged_in_ln_loss() -> None:
    sizes, horizons, curvature, wiggle = [1e6, 8e6, 6.4e7], (1e9, 8e9), 0.05, 1e-4
    results = synthetic_grid(sizes, [0.25, 0.5, 1.0, 2.0, 4.0], curvature, wiggle, horizons, seeds=(1, 2))
    fit = fit_tuning(results, tune_batch=False)
    error = vertex_error_bound(curvature, wiggle)
    assert fit.horizons == list(horizons) and fit.seeds == [1, 2] and len(fit.optima) == 6
    every_n = [optimum.params for optimum in fit.optima]
    every_d = [optimum.tokens for optimum in fit.optima]
    assert abs(fit.lr.exponent - A) <= slope_bound(error, every_n)
    assert abs(fit.lr.tokens_exponent - B) <= slope_bound(error, every_d)
    assert fit.lr.reference_tokens == pytest.approx(math.sqrt(1e9 * 8e9))
    truth = 0.01 * (fit.lr.reference_params / 1e7) ** A * (fit.lr.reference_tokens / 1e9) ** B
    assert abs(math.log(fit.lr.value / truth)) <= error
    for optimum in fit.optima:
        assert fit.lr(optimum.params, optimum.tokens) == pytest.approx(optimum.lr, rel=3 * error)
    # the seed noise cancels in ln L: the same optima as one noiseless seed
    one_seed = fit_tuning(synthetic_grid(sizes, [0.25, 0.5, 1.0, 2.0, 4.0], curvature, wiggle, horizons),
                          tune_batch=False)
    assert [o.lr for o in fit.optima] == pytest.approx([o.lr for o in one_seed.optima], rel=1e-9)


def test_seed_means_and_sigma_are_taken_in_ln_loss() -> None:
    results = synthetic_grid([1e6, 8e6], [0.5, 1.0, 2.0], 0.05, 0.0, seeds=(1, 2))
    means = seed_means(results)
    assert len(means) == len(results) // 2
    for mean in means:
        pair = [r.loss for r in results if (r.params, r.lr) == (mean.params, mean.lr)]
        assert mean.loss == pytest.approx(math.sqrt(pair[0] * pair[1]), rel=1e-12)
    sigma, freedom = seed_sigma(results)
    # two seeds whose ln L differ by 2 eps: each group's sd^2 is 2 eps^2, with one degree of freedom
    expected = math.sqrt(np.mean([2 * seed_noise(math.log(m.lr), 1) ** 2 for m in means]))
    assert freedom == len(means) and sigma == pytest.approx(expected, rel=1e-9)
    assert seed_sigma(synthetic_grid([1e6], [0.5, 1.0, 2.0], 0.05, 0.0)) == (None, 0)


@pytest.mark.parametrize(("multipliers", "edge", "side"), [([0.03, 0.06, 0.125], "highest", "above"),
                                                           ([30.0, 60.0, 120.0], "lowest", "below")])
def test_an_optimum_at_the_edge_of_the_grid_is_refused(multipliers: list[float], edge: str, side: str) -> None:
    results = synthetic_grid([1e6, 8e6], multipliers, 0.05, 0.0)  # all far below (above) eta*
    with pytest.raises(ConfigError, match=f"at the {edge} grid point .*widen lr_multipliers .*{side}$"):
        fit_tuning(results, tune_batch=False)


def diverged_above(results: list[GridResult], limit: float, seed: int) -> list[GridResult]:
    """`results` with one seed's runs above `limit` x eta*(N) diverged (loss inf), as a run past its stability
    edge is: the grid point just above the optimum fails for that seed."""
    return [dataclasses.replace(r, loss=math.inf) if r.seed == seed and r.lr > limit * 0.01 * (r.params / 1e7) ** A
            else r for r in results]


def test_a_best_point_whose_upper_neighbour_diverged_is_refused_or_taken_as_the_optimum() -> None:
    """By default the fit asks for finer multipliers; tune.unstable_neighbour: best_point takes the best grid
    point (seed means in ln L) as the optimum, marked stability_limited, while the other sizes keep their
    parabola vertex. A diverged lower neighbour is refused either way."""
    sizes, multipliers = [1e6, 8e6, 6.4e7], [0.25, 0.5, 1.0, 2.0, 4.0]
    results = synthetic_grid(sizes, multipliers, 0.05, 0.0, seeds=(1, 2))
    # the optimum's LR of the largest size sits between two grid points; seed 2 diverges above 1.2 eta* there
    largest = [r for r in results if r.params == int(6.4e7)]
    unstable = diverged_above(largest, 1.2, seed=2) + [r for r in results if r.params != int(6.4e7)]
    with pytest.raises(ConfigError, match="a neighbour of the best grid point failed or diverged; use finer "
                                          "multipliers .*tune.unstable_neighbour: best_point"):
        fit_tuning(unstable, tune_batch=False)
    fit = fit_tuning(unstable, tune_batch=False, unstable_neighbour="best_point")
    stable = fit_tuning(results, tune_batch=False)
    means = {(r.params, r.lr): r.loss for r in seed_means(unstable)}
    for optimum, reference in zip(fit.optima, stable.optima, strict=True):
        if optimum.params != int(6.4e7):
            assert not optimum.stability_limited and optimum == reference
            continue
        best_lr = min((lr for params, lr in means if params == optimum.params),
                      key=lambda lr: means[optimum.params, lr])
        assert optimum.stability_limited and optimum.parabola is None
        assert (optimum.lr, optimum.loss) == pytest.approx((best_lr, means[optimum.params, best_lr]), rel=1e-12)
        assert math.isfinite(means[optimum.params, best_lr])
        assert abs(math.log(optimum.lr / reference.lr)) <= math.log(2)  # within the grid's step of the vertex
    lower_failed = [dataclasses.replace(r, loss=math.inf) if r.params == int(1e6) and r.seed == 2 and
                    r.lr < 0.01 * (1e6 / 1e7) ** A and r.lr > 0.5 * 0.01 * (1e6 / 1e7) ** A else r for r in results]
    with pytest.raises(ConfigError, match="a neighbour of the best grid point failed or diverged"):
        fit_tuning(lower_failed, tune_batch=False, unstable_neighbour="best_point")


def test_the_tuning_plot_marks_the_failed_lrs_and_the_stability_limited_optimum() -> None:
    """lr_tuning.png shows every finite seed mean as a point (the legend beside the axes hides none), each LR
    where a seed failed as an x on the top edge, and names the optimum that is a stability edge."""
    sizes, multipliers = [1e6, 8e6, 6.4e7], [0.25, 0.5, 1.0, 2.0, 4.0]
    results = synthetic_grid(sizes, multipliers, 0.05, 0.0, seeds=(1, 2))
    largest = [r for r in results if r.params == int(6.4e7)]
    unstable = diverged_above(largest, 1.2, seed=2) + [r for r in results if r.params != int(6.4e7)]
    fit = fit_tuning(unstable, tune_batch=False, unstable_neighbour="best_point")
    figure = draw_tuning(unstable, fit)
    try:
        (axes,) = figure.axes
        means = seed_means(unstable)
        failed = sorted(r.lr for r in means if not math.isfinite(r.loss))
        assert failed and all(r.params == int(6.4e7) for r in means if not math.isfinite(r.loss))
        crosses = [line for line in axes.get_lines() if line.get_marker() == "x"]
        assert sorted(x for line in crosses for x in line.get_xdata()) == pytest.approx(failed)
        dots = [line for line in axes.get_lines() if line.get_marker() == "o"]
        assert sorted(x for line in dots for x in line.get_xdata()) == pytest.approx(
            sorted(r.lr for r in means if math.isfinite(r.loss)))
        labels = [text.get_text() for text in axes.get_legend().get_texts()]
        edges = [label for label in labels if label.endswith("(stability edge)")]
        assert len(edges) == 1 and edges[0].startswith(f"N={6.4e7:.3g}")
        assert labels[-1] == "a seed failed at this LR"
        legend_box = axes.get_legend().get_window_extent()
        assert legend_box.x0 >= axes.get_window_extent().x1  # beside the axes, over no point
    finally:
        plt.close(figure)


def test_the_lr_check_says_whether_the_rule_holds_and_by_how_much() -> None:
    sigma = 0.002  # one seed: 1x holds when ln L(1x) - ln L(best) <= 2 sigma sqrt(2) = 0.566%
    holds = judge_point(1_000_000, 2e7, "l6-h96-a12", 1e-3, {0.5: [3.01], 1.0: [3.0], 2.0: [3.005]}, sigma)
    assert holds.holds and holds.best == 1.0 and holds.gap == 0.0
    assert holds.threshold == pytest.approx(2 * sigma * math.sqrt(2))
    assert "within noise" in holds.verdict()

    losses = {0.5: [3.10], 1.0: [3.05], 2.0: [3.00], 4.0: [3.04]}
    off = judge_point(1_000_000, 2e7, "l6-h96-a12", 1e-3, losses, sigma)
    assert not off.holds and off.best == 2.0 and off.gap == pytest.approx(math.log(3.05 / 3.00))
    c2, c1, _ = np.polyfit(np.log([1.0, 2.0, 4.0]), [3.05, 3.00, 3.04], 2)
    assert off.optimum == pytest.approx(math.exp(-c1 / (2 * c2)))
    assert "2x beat the rule's 1x by 1.65%" in off.verdict() and "the parabola puts the optimum at" in off.verdict()

    edge = judge_point(1_000_000, 2e7, "l6-h96-a12", 1e-3, {0.5: [3.1], 1.0: [3.05], 2.0: [3.0]}, sigma)
    assert not edge.holds and edge.optimum is None and "the optimum may lie beyond 2x" in edge.verdict()
    # two seeds per multiplier: the means' difference has sd sigma, the threshold is 2 sigma
    two_seeds = judge_point(1_000_000, 2e7, "l6-h96-a12", 1e-3, {0.5: [3.1, 3.1], 1.0: [3.0, 3.0], 2.0: [3.0, 3.0]},
                            sigma)
    assert two_seeds.threshold == pytest.approx(2 * sigma)
    assert summary([holds, off]).startswith("the rule is off at 1 of 2 checked (size, horizon)")
    assert summary([holds]).startswith("the rule holds at all 1 checked")
