"""The law forms (laws.py), their backtests (backtest.py) and ScalingFit's predictions and exact-line
allocations (fit.py), on synthetic data drawn from known laws with seeded noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from scaletrain.scaling.backtest import choose_form, rolling_backtest
from scaletrain.scaling.fit import FitData, ParametricFit, Point, fit_scaling_laws, refit_parametric
from scaletrain.scaling.laws import LAW_FORMS, LawFit, fit_law, flops_per_token_model, line_allocation, run_to_run_noise

TRUE = {
    "chinchilla": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28},  # Hoffmann et al. 2022
    "kaplan": {"N_c": 8.8e13, "D_c": 5.4e13, "alpha_N": 0.076, "alpha_D": 0.095},  # Kaplan et al. 2020, eq. 1.5
    "kaplan_e": {"E": 1.2, "N_c": 1e10, "D_c": 5e10, "alpha_N": 0.3, "alpha_D": 0.35},
    "muennighoff": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28},
}
CORPUS = 2e10  # unique tokens: D above it repeats data (muennighoff)
BUDGETS = np.geomspace(1e16, 1e18, 5)


def ladder_fpt(params: np.ndarray) -> np.ndarray:
    """FLOPs per token of a model ladder: 6N plus attention's 12 l s d (s = 2048, l d ~ (N/12)^(2/3)),
    so C / (6ND) runs from ~4.5 at 1e6 parameters to ~1.1 at 1e9: not 6N."""
    params = np.asarray(params, dtype=float)
    return 6 * params + 12 * 2048 * (params / 12) ** (2 / 3)


def isoflop_points(form: str, noise: float, seed: int, budgets: np.ndarray = BUDGETS,
                   sizes: int = 6) -> list[Point]:
    """Per budget, `sizes` sizes from N*/4 to 4 N* (N* the true optimum on the ladder's exact line),
    D = C / fpt(N), loss from the true law times exp(N(0, noise^2))."""
    truth = LawFit(form, TRUE[form], 0.0)
    fpt = flops_per_token_model([Point(n, 1.0, float(ladder_fpt(n)), 1.0) for n in (1e5, 1e7, 1e9, 1e11)])
    rng = np.random.default_rng(seed)
    points = []
    for flops in budgets:
        n_opt = line_allocation(truth.loss, flops, fpt)[0]
        for n in np.geomspace(n_opt / 4, n_opt * 4, sizes):
            d = flops / float(ladder_fpt(n))
            loss = float(truth.loss(n, d)) * math.exp(rng.normal(0.0, noise))
            points.append(Point(float(n), d, float(flops), loss, float(flops)))
    return points


@pytest.mark.parametrize("form", list(LAW_FORMS))
def test_each_form_recovers_its_own_constants(form: str) -> None:
    params, tokens = (x.ravel() for x in np.meshgrid(np.geomspace(1e7, 3e9, 8), np.geomspace(1e8, 3e11, 8)))
    unique = np.full(params.shape, CORPUS) if LAW_FORMS[form].data_constrained else None
    losses = LawFit(form, TRUE[form], 0.0).loss(params, tokens, unique)
    for objective in ("least_squares", "huber"):
        fitted = fit_law(form, params, tokens, losses, unique, objective=objective)
        for name, truth in TRUE[form].items():
            assert fitted.constants[name] == pytest.approx(truth, rel=1e-3), (objective, name)
    assert "residual sd" in fitted.delta_how  # no seed repeats: delta from the least-squares residuals


def test_muennighoff_is_skipped_without_repeated_data() -> None:
    params, tokens = (x.ravel() for x in np.meshgrid(np.geomspace(1e7, 3e9, 4), np.geomspace(1e8, 1e10, 4)))
    losses = LawFit("chinchilla", TRUE["chinchilla"], 0.0).loss(params, tokens)
    with pytest.raises(ValueError, match="no run records unique_tokens"):
        fit_law("muennighoff", params, tokens, losses)
    with pytest.raises(ValueError, match="no run repeats data"):
        fit_law("muennighoff", params, tokens, losses, np.full(params.shape, CORPUS))


@pytest.mark.parametrize(("truth", "ties"), [("chinchilla", ("chinchilla",)), ("kaplan", ("kaplan", "kaplan_e"))])
def test_backtest_chooses_the_true_form(truth: str, ties: tuple[str, ...]) -> None:
    """5 budgets x 6 sizes with 0.3% noise. On Kaplan data kaplan and kaplan_e tie (kaplan_e with E -> 0
    is kaplan, so both are the true law and their backtests differ by noise only): the prior takes the
    one with fewer constants. The other forms miss by 4-5%, far beyond the folds' noise."""
    points = isoflop_points(truth, noise=0.003, seed=1)
    arrays = [np.array([getattr(p, key) for p in points]) for key in ("params", "tokens", "loss")]
    fits = {form: fit_law(form, *arrays) for form in ("chinchilla", "kaplan", "kaplan_e")}
    backtests = {form: rolling_backtest(form, points, "huber", fit.huber_delta) for form, fit in fits.items()}
    choice = choose_form(backtests, fits)
    assert choice.form == truth and choice.ties == ties, choice.reason
    assert all(len(b.scored) == 3 and len(b.folds) == 4 for b in backtests.values())  # the first fold: 6 runs
    assert choice.decision_folds == pytest.approx(BUDGETS[2:])
    assert f"{truth}: " in choice.reason and ("the prior decides" in choice.reason) == (len(ties) > 1)


@pytest.fixture(scope="module")
def ladder_fit() -> tuple[list[Point], object]:
    points = isoflop_points("chinchilla", noise=0.003, seed=2)
    return points, fit_scaling_laws(FitData(points, [None] * len(points)), bootstrap=12, seed=0)


def test_every_allocation_lies_on_the_exact_flops_line(ladder_fit: tuple) -> None:
    points, result = ladder_fit
    assert result.fpt.source == "measured" and "measured" in result.fpt.description
    assert set(result.fits) == {"approach1", "approach2", "approach3"}
    assert set(result.laws) == {"chinchilla", "kaplan", "kaplan_e"} and "muennighoff" in result.law_skipped
    assert result.chosen == "chinchilla", result.chosen_reason
    for flops in (3e18, 1e20):
        table = result.compute_optimal(flops)
        assert set(table) == {"approach1", "approach2", "approach3", "chinchilla", "kaplan", "kaplan_e"}
        for name, row in table.items():
            if math.isfinite(row["n_opt"]):
                assert row["d_opt"] * float(result.fpt(row["n_opt"])) == pytest.approx(flops, rel=1e-6), name
        assert table["chinchilla"]["n_opt_ci"] is not None
        lower, upper = table["chinchilla"]["loss_interval"]
        assert lower < table["chinchilla"]["loss"] < upper
    assert math.isfinite(result.laws["chinchilla"].loo_shift_pct(1e19))


def test_run_to_run_noise_measures_a_known_sigma() -> None:
    """20 (N, D) x 10 seeds with sigma = 0.02: the pooled sd has 180 degrees of freedom, so its relative
    standard error is 1 / sqrt(2 * 180) = 5.3%; the check allows 4 of those."""
    rng = np.random.default_rng(0)
    points = [Point(n, d, 6 * n * d, 3.0 * math.exp(rng.normal(0, 0.02)), seed=s)
              for n in np.geomspace(1e7, 1e9, 5) for d in np.geomspace(1e9, 1e10, 4) for s in range(10)]
    noise = run_to_run_noise(points)
    assert noise.groups == 20 and "20 (N, D)" in noise.how
    assert noise.sigma == pytest.approx(0.02, rel=4 / math.sqrt(2 * 180))
    unrepeated = run_to_run_noise(points[::10])
    assert unrepeated.sigma is None and unrepeated.how.startswith("not measured")


def test_prediction_interval_covers_fresh_runs() -> None:
    """24 (N, D) x 8 seeds, sigma = 1% on ln L. The 90% interval should hold ~90% of fresh runs. The
    count of 4,800 fresh draws has a binomial sd of sqrt(0.9 0.1 / 4800) = 0.43%; the estimated sigma
    (168 degrees of freedom, relative sd 5.5%) moves the coverage by 2 phi(1.645) 1.645 x 5.5% = 1.9%.
    The check allows 3 of their combined sd (5.9%)."""
    rng = np.random.default_rng(3)
    truth = LawFit("chinchilla", TRUE["chinchilla"], 0.0)
    configs = [(n, d) for n in np.geomspace(1e8, 3e9, 6) for d in np.geomspace(3e9, 1e11, 4)]
    points = [Point(n, d, 6 * n * d, float(truth.loss(n, d)) * math.exp(rng.normal(0, 0.01)), seed=s)
              for n, d in configs for s in range(8)]
    result = fit_scaling_laws(FitData(points, [None] * len(points)), bootstrap=30, seed=0, forms=("chinchilla",))
    params, tokens = np.array(configs).T
    _, lower, upper = result.predict(params, tokens)
    fresh = truth.loss(params, tokens) * np.exp(rng.normal(0, 0.01, (200, len(configs))))
    coverage = float(((lower <= fresh) & (fresh <= upper)).mean())
    spread = math.sqrt(0.9 * 0.1 / fresh.size + (2 * norm.pdf(1.645) * 1.645 / math.sqrt(2 * 168)) ** 2)
    assert abs(coverage - 0.9) <= 3 * spread, coverage
    assert result.noise.groups == 24


def test_prediction_without_refits_uses_the_noise_floor_alone() -> None:
    """No refits and a point inside the fitted budgets (no extrapolation term): L exp(+-z s0), s0 the
    larger of the seed repeats' sigma and the law's robust residual sd (intervals.py)."""
    rng = np.random.default_rng(4)
    truth = LawFit("chinchilla", TRUE["chinchilla"], 0.0)
    points = [Point(n, d, 6 * n * d, float(truth.loss(n, d)) * math.exp(rng.normal(0, 0.01)), seed=s)
              for n in np.geomspace(1e8, 3e9, 4) for d in np.geomspace(3e9, 1e11, 3) for s in range(3)]
    result = fit_scaling_laws(FitData(points, [None] * len(points)), bootstrap=0, forms=("chinchilla",))
    point, lower, upper = result.predict(np.array([1e9]), np.array([1e10]))
    floor = result.laws["chinchilla"].noise_sd
    assert floor >= result.noise.sigma > 0 and result.extrapolation_decades(1e9, 1e10) == 0
    z = norm.ppf(0.95)
    assert lower[0] == pytest.approx(point[0] * math.exp(-z * floor), rel=1e-12)
    assert upper[0] == pytest.approx(point[0] * math.exp(z * floor), rel=1e-12)
    assert result.fpt.source == "6N" and "6ND" in result.fpt.description


def test_fit_never_crashes_without_an_irreducible_loss() -> None:
    """L = A/N^alpha + B/D^beta (E = 0): ParametricFit.theta() used to take log(0) and kill even
    --bootstrap 0; now E = 0 maps to ln of the smallest double and the fits go on."""
    assert np.all(np.isfinite(ParametricFit(0.0, 406.4, 410.7, 0.34, 0.28).theta()))
    params, tokens = (x.ravel() for x in np.meshgrid(np.geomspace(1e7, 3e9, 5), np.geomspace(1e8, 3e11, 5)))
    losses = 406.4 / params**0.34 + 410.7 / tokens**0.28
    points = [Point(n, d, 6 * n * d, loss) for n, d, loss in zip(params, tokens, losses, strict=True)]
    for bootstrap in (0, 10):
        result = fit_scaling_laws(FitData(points, [None] * len(points)), bootstrap=bootstrap, forms=("chinchilla",))
        assert "approach3" in result.fits and "chinchilla" in result.laws
        assert result.laws["chinchilla"].fit.constants["E"] < 1e-3
        assert len(result.laws["chinchilla"].refits) + sum(result.bootstrap_failures["chinchilla"].values()) \
            == bootstrap


def step_points(ratio: float = 1.3) -> list[Point]:
    """A loss that drops 2.5x between the two smallest sizes (ratio apart) and is flat beyond: Approach 3
    fits it with alpha -> infinity, and its ln A runs past exp's range."""
    params = np.repeat([1e7, ratio * 1e7, 1e8, 3e8, 1e9], 4)
    tokens = np.tile(np.geomspace(1e9, 1e11, 4), 5)
    losses = np.where(params < 1.02e7, 5.0, 2.0) * (1 + 0.01 * np.log(1e11 / tokens))
    return [Point(n, d, 6 * n * d, loss) for n, d, loss in zip(params, tokens, losses, strict=True)]


def test_fit_never_crashes_when_approach3_overflows() -> None:
    points = step_points()
    data = FitData(points, [None] * len(points))
    result = fit_scaling_laws(data, bootstrap=10, forms=("chinchilla",))
    assert "exp overflows" in result.skipped["approach3"]  # was a raw OverflowError
    assert "chinchilla" in result.laws and "approach1" in result.fits
    samples = [np.random.default_rng(i).choice(len(points), len(points)) for i in range(5)]
    degenerate = ParametricFit(2.0, 1e250, 1.0, 35.0, 0.01)  # a start beyond which ln A overflows
    refits = refit_parametric(data, samples, degenerate)
    assert len(refits) == 5 and all(isinstance(r, (str, ParametricFit)) for r in refits)


def test_failed_refits_are_counted() -> None:
    """6 runs with 5 distinct (N, D): most resamples hold fewer than 5 and cannot be refitted."""
    truth = LawFit("chinchilla", TRUE["chinchilla"], 0.0)
    sizes = [(1e8, 1e10), (2e8, 1e10), (4e8, 2e10), (8e8, 5e10), (1.6e9, 1e11), (1.6e9, 1e11)]
    points = [Point(n, d, 6 * n * d, float(truth.loss(n, d)), seed=i) for i, (n, d) in enumerate(sizes)]
    result = fit_scaling_laws(FitData(points, [None] * len(points)), bootstrap=20, forms=("chinchilla",))
    failures = result.bootstrap_failures["chinchilla"]
    assert sum(failures.values()) > 0 and any("distinct (N, D)" in reason for reason in failures)
    assert len(result.laws["chinchilla"].refits) + sum(failures.values()) == 20
    assert sum(result.bootstrap_failures["approach3"].values()) + len(result.samples("approach3")) == 20
    assert "only form" in result.chosen_reason
