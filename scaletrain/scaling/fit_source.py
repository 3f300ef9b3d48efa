"""`scaletrain fit SOURCE`: read runs from a sweep directory or a CSV, fit the three approaches of
Hoffmann et al. 2022 and the law forms (fit.py, laws.py, backtest.py), check held-out runs
(check.py), write fit.json and the plots (fit_plots.py), and return the summary.

SOURCE is a sweep directory or a CSV of runs, read by fit_inputs.py (its docstring lists the
columns) so published data can be refitted too. Runs whose data fingerprints
differ are refused. The output goes to a temporary directory beside --out, renamed onto it at the
end: a bad input raises one ValueError and leaves nothing on disk. A failure of one approach, law
form or bootstrap refit is recorded, never raised; only a source that nothing can be fitted to is.

fit.json (strict JSON; null for a number that is undefined, an interval with too few refits, or a
skipped approach; every interval [low, high] is the 95% bootstrap percentile interval unless named
otherwise):
    source, params_column, num_points, num_curves, bootstrap (the resamples used), seed, target_flops
    objective ("huber" | "least_squares", the law forms'), huber_delta (the option: "auto" or a number)
    exclusions: [{rule, removed}]: each exclusion rule in order and how many runs it removed
    from_spec: {file, options: {name: value}} | null: the options (of bootstrap, forms, objective, huber_delta,
               exclude) not given on the command line and taken from a sweep directory's recorded spec
               (sweep.json's fit section); the others not given are the defaults
    fingerprints: the runs' data fingerprint, or "not recorded"
    flops_per_token: {source ("measured" | "6N"), description}: the FLOPs line D = C / fpt(N) that
                     every allocation lies on
    noise: {sigma, how, groups}: run-to-run sd of ln L from seed repeats (null when not measured)
    approach1: {a, a_ci, b, b_ci, n_coefficient, d_coefficient, bootstrap_fits, smoothing,
                frontier: [{flops, params, tokens, loss}]}
    approach2: {a, a_ci, b, b_ci, n_coefficient, d_coefficient, bootstrap_fits,
                budgets: [{flops, budget, sizes, n_opt, d_opt, loss_min, parabola: [c2, c1, c0] in ln N,
                           parabola_tokens: [c2, c1, c0] in ln D, bracketed}],
                excluded_budgets: [{flops, reason}]}
    approach3: {E, A, B, alpha, beta, a, b and each one's _ci, huber_delta, objective, starts,
                bootstrap_starts, bootstrap_fits}
    laws: {form: {formula, citation, constants: {name: value}, constants_ci: {name: [low, high]},
                  objective, objective_value, huber_delta, huber_delta_how, bootstrap_fits: [{name: value}],
                  bootstrap_failures: {reason: count},
                  backtest: {mean_abs_error_pct, mean_signed_error_pct, rankings_correct, rankings (over the
                             counted folds), loo_abs_error_pct,
                             folds: [{budget_flops (the origin: the first budget predicted), train_budgets,
                                      train_configurations (distinct (N, D) fitted), train_max_flops, counted,
                                      skipped (why the fold cannot tell, or null), failed (why the fit failed, or
                                      null), ranking_correct (the origin budget's sizes),
                                      points: [{params, tokens, flops, decades (log10 C / train_max_flops),
                                                measured, predicted, error_pct}]}]},
                  interval_terms: {noise_sd, noise_how, extrapolation_sd_per_decade, extrapolation_how}}}
    law_skipped: {form: reason}
    chosen: {form (null when no form was fitted), reason, ties (the forms the decision folds cannot tell
             apart, the chosen among them), decision_folds (their origins' C), scores ({form: mean |error| %}
             on them), prior (what decides among ties), loss_prediction: {forms, how} (what a predicted loss is:
             under a tie the median of the tied forms' equal-weight mixture, else the chosen form's own fit),
             huber_delta, huber_delta_how}
    interval: {confidence, forms, bootstrap_fits: {form: count}, noise_sd, noise_how,
               extrapolation_sd_per_decade, extrapolation_how, distance_from_flops, model} | null: how the
              chosen form's prediction intervals are built (intervals.py)
    bootstrap_failures: {approach or form: {reason: count}} (refits that failed, by reason)
    predictions: [{flops, approach1|approach2|approach3: {n_opt, d_opt, tokens_per_param (approach3: and
                   loss), each with _ci}, laws: {form: {n_opt, d_opt, tokens_per_param, loss, each with _ci,
                   loss_interval (the form's own 90% prediction interval; the chosen form's spans its ties)}},
                   chosen: {form, n_opt, d_opt, tokens_per_param (the chosen form's), loss (at them, as
                   chosen.loss_prediction says: under a tie the tied forms' mixture median), loss_interval (90%
                   prediction interval), form_loss (the chosen form's own), loo_shift_pct (of form_loss)} |
                   null}]; every N*, D* on the FLOPs line
    skipped: {approach: reason}
    published: {name: {a, b}}, the exponents the summary compares with
    check (with --check): check.check_document's {form, confidence, points: [{params, tokens, flops, budget,
           loss, predicted, lower, upper, error, error_pct, inside}], mean_abs_error_pct, mean_signed_error_pct,
           coverage: {inside, with_interval, runs}, rankings: [{flops, budget, measured, predicted (distinct
           sizes best first, seed means), correct, tie_margin_log, pairs, judged, agreeing}], optima: [{flops,
           budget, sizes, predicted_n, measured_n, ratio, bracketed, reason}], predicted_by (chosen.loss_prediction's
           how)} (or {skipped: reason} when no law form was fitted)
    downstream (only where --task-metric names metrics or the runs record any; downstream.py): {citation,
           task_loss_formula, sigmoid_formula, confidence, interval (how it is built), tasks: {TASK/METRIC:
           {skipped: reason} | {task_loss_metric, runs, bootstrap_fits, bootstrap_failures,
           law: {constants, constants_ci, residual_sd (ln L)}, sigmoid: {a, L0, k, b, each _ci, residual_sd,
           p_value} | null, sigmoid_skipped (why no sigmoid: the metric is the loss, or does not move with it)
           | null, predictions: [{flops, n_opt, d_opt (the chosen law's), task_loss, task_loss_interval, value,
           interval}], check (with --check): {points: [{params, tokens, flops, measured, predicted, lower, upper,
           error, error_pct, inside}], mean_abs_error, mean_signed_error, mean_abs_error_pct,
           mean_signed_error_pct, max_abs_error_pct (null where every measurement is 0), coverage: {inside,
           with_interval, runs}} | {skipped: reason}}}}
N_opt ∝ C^a = n_coefficient C^a and D_opt ∝ C^b = d_coefficient C^b.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.config import build_dataclass
from scaletrain.scaling.backtest import SIMPLER_PRIOR, Fold
from scaletrain.scaling.check import CHECK_CONFIDENCE, CheckResult, check_csv, check_document, check_lines
from scaletrain.scaling.check import check_predictions as check_held_out
from scaletrain.scaling.downstream import downstream_lines, fit_downstream, parse_task_metrics
from scaletrain.scaling.fit import (
    APPROACHES,
    BOOTSTRAP_GRID_STARTS,
    HUBER_DELTA,
    MIN_BOOTSTRAP_FITS,
    PREDICTION_CONFIDENCE,
    SMOOTHING_FRACTION,
    EnvelopeFit,
    FitData,
    IsoFlopFit,
    LawResult,
    ParametricFit,
    ScalingFit,
    fit_scaling_laws,
    percentile_interval,
    with_intervals,
)
from scaletrain.scaling.fit_arguments import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_PARAMS_COLUMN,
    OBJECTIVES,
    PARAMS_COLUMNS,
    parse_exclusion,
)
from scaletrain.scaling.fit_inputs import Runs, check_fingerprints, read_runs
from scaletrain.scaling.fit_plots import write_plots
from scaletrain.scaling.laws import LAW_FORMS
from scaletrain.scaling.sweep.layout import SWEEP_FILE
from scaletrain.scaling.sweep.spec import FitOptions as SpecFitOptions

FIT_FILE = "fit.json"
CHECK_FILE = "check.csv"
# N_opt ∝ C^a, D_opt ∝ C^b: Hoffmann et al. 2022, Table 2; Kaplan et al. 2020, sec. 6.1 (N ∝ C^0.73).
PUBLISHED = {
    "Chinchilla approach 1": {"a": 0.50, "b": 0.50}, "Chinchilla approach 2": {"a": 0.49, "b": 0.51},
    "Chinchilla approach 3": {"a": 0.46, "b": 0.54}, "Kaplan et al. 2020": {"a": 0.73, "b": 0.27},
}
APPROACH_TITLES = {"approach1": "1 envelope (sec. 3.1)", "approach2": "2 IsoFLOP (sec. 3.2)",
                   "approach3": "3 parametric (sec. 3.3)"}
INTERVAL_MODEL = ("ln L = mu + e: mu over the bootstrap refits of the forms listed (each form weighing the same), "
                  "e ~ N(0, noise_sd^2 + (extrapolation_sd_per_decade x decades beyond distance_from_flops)^2)")
# Messages of numerical failures that say nothing to a user; fit.json and the summary give the
# approach's own explanation instead where the data allow (see _explain_skip).
# The options a sweep directory's recorded spec supplies where `scaletrain fit` is not given them, with
# the defaults otherwise (forms (): every form; huber_delta "auto": laws.huber_delta_auto).
SPEC_OPTIONS: dict[str, Any] = {"bootstrap": DEFAULT_BOOTSTRAP, "forms": (), "objective": "huber",
                                "huber_delta": "auto", "exclude": ()}
RAW_NUMERIC_ERRORS = ("math domain error", "math range error", "OverflowError", "FloatingPointError",
                      "LinAlgError", "ZeroDivisionError", "did not converge")


@dataclass(frozen=True)
class FitOptions:
    """`scaletrain fit`'s options (fit_arguments.py). The SPEC_OPTIONS left None are resolved by run_fit
    (with_spec_defaults): a sweep directory's recorded spec, else SPEC_OPTIONS' defaults; `from_spec`
    then names those taken from the spec. Resolved, forms () is every law form and huber_delta "auto"
    is laws.huber_delta_auto's."""

    target_flops: list[float] | None = None
    bootstrap: int | None = None
    params_column: str = DEFAULT_PARAMS_COLUMN
    seed: int = 0
    objective: str | None = None
    huber_delta: float | str | None = None
    forms: tuple[str, ...] | None = None
    check: Path | None = field(default=None)
    exclude: tuple[str, ...] | None = None  # exclusion rules, fit_arguments.parse_exclusion
    from_spec: tuple[str, ...] = ()
    task_metrics: tuple[str, ...] | None = None  # downstream TASK/METRIC names; None: every one recorded
    task_loss: str | None = None  # the task loss of step 1; None: downstream.TASK_LOSS_METRICS' first

    def huber_delta_value(self) -> float | None:
        """The resolved delta as the fits take it: None for auto."""
        return None if self.huber_delta in (None, "auto") else float(self.huber_delta)


def fit_from_args(args: argparse.Namespace) -> str:
    """The command line's options; those not given stay None (a sweep's spec, else the default)."""
    task_metrics = None if args.task_metric is None else tuple(
        name.strip() for text in args.task_metric for name in text.split(",") if name.strip())
    options = FitOptions(args.target_flops, args.bootstrap, args.params_column, args.seed, args.objective,
                         args.huber_delta, tuple(dict.fromkeys(args.forms)) if args.forms else None, args.check,
                         None if args.exclude is None else tuple(args.exclude), task_metrics=task_metrics,
                         task_loss=args.task_loss)
    report, _, _ = run_fit(args.source, args.out, options)
    return report


def fit_sweep_directory(sweep_dir: Path, out_dir: Path, target_flops: list[float] | None, bootstrap: int,
                        params_column: str, objective: str = "huber", huber_delta: float | None = None,
                        forms: tuple[str, ...] | list[str] | None = None,
                        exclude: tuple[str, ...] | list[str] = ()) -> tuple[str, dict[str, Any], list[Path]]:
    """The end of `scaletrain sweep run` and `sweep finalize` (sweep/finalize.py): fit SWEEP into out_dir
    with the spec's fit section, every option given (huber_delta None: auto; forms None or empty: every
    form)."""
    options = FitOptions(target_flops, bootstrap, params_column, objective=objective,
                         huber_delta="auto" if huber_delta is None else huber_delta,
                         forms=tuple(dict.fromkeys(forms or ())), exclude=tuple(exclude))
    return run_fit(sweep_dir, out_dir, options)


def run_fit(source: Path, out_dir: Path | None = None,
            options: FitOptions = FitOptions()) -> tuple[str, dict[str, Any], list[Path]]:
    """Read, fit, check, write fit.json, check.csv and the plots; returns (summary, fit.json's content,
    the plot paths). Every input is read and checked before the fit, so a bad one costs nothing."""
    source = Path(source)
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(source)
    options = with_spec_defaults(source, options)
    _check_options(out_dir, options)
    runs = read_runs(source, options.params_column, options.exclude)
    held_out = _read_held_out(options.check, options.params_column, runs) if options.check else None
    if options.task_metrics is not None:
        parse_task_metrics(options.task_metrics, runs)
    targets = sorted(options.target_flops or default_targets(runs.data))
    result = fit_scaling_laws(runs.data, options.bootstrap, options.seed, options.objective,
                              options.huber_delta_value(), options.forms or None)
    check = _check(result, held_out) if held_out is not None else None
    document = fit_document(result, runs, targets, str(source), options, check)
    downstream = fit_downstream(runs, options.task_metrics, options.task_loss, _allocations(document), held_out,
                                options.bootstrap, options.seed)
    if downstream is not None:
        document["downstream"] = _strict(downstream)
    checked = check if isinstance(check, CheckResult) else None
    plots = publish(out_dir, document, result, runs.data, targets, checked)
    written = f"{out_dir / FIT_FILE}" + (f", {out_dir / CHECK_FILE}" if checked else "")
    report = format_summary(document, checked) + f"wrote {written} and {len(plots)} plots\n"
    return report, document, plots


def _allocations(document: dict[str, Any]) -> list[tuple[float, float | None, float | None]]:
    """(C, N*, D*) of the chosen law at each target budget, where the downstream metrics are predicted."""
    return [(row["flops"], *((row["chosen"]["n_opt"], row["chosen"]["d_opt"]) if row["chosen"] else (None, None)))
            for row in document["predictions"]]


def with_spec_defaults(source: Path, options: FitOptions) -> FitOptions:
    """The options with every SPEC_OPTIONS one set: as given, else a sweep directory's recorded spec's
    (sweep.json's fit section, the options `sweep finalize` fitted with: `fit SWEEP` then refits as the
    sweep did, `--check` with as many refits), else the default. The spec's huber_delta is taken only
    with objective huber (a --objective least_squares drops it). `from_spec` names the ones taken."""
    unset = [name for name in SPEC_OPTIONS if getattr(options, name) is None]
    recorded = spec_fit_options(source) if unset else {}
    objective = options.objective or recorded.get("objective") or SPEC_OPTIONS["objective"]
    if objective != "huber":
        recorded.pop("huber_delta", None)
    taken = tuple(name for name in unset if name in recorded)
    values = {name: recorded[name] if name in taken else SPEC_OPTIONS[name] for name in unset}
    return replace(options, **values, from_spec=taken)


def spec_fit_options(source: Path) -> dict[str, Any]:
    """The SPEC_OPTIONS a sweep directory's sweep.json records in its spec's fit section (only the keys
    it holds; forms and exclude as tuples), typed and checked as the spec itself is; {} for a CSV or a
    directory without sweep.json. ValueError naming the file when it cannot be read or holds a bad value."""
    stored = source / SWEEP_FILE
    if not (source.is_dir() and stored.is_file()):
        return {}
    where = f"{stored} (the sweep's recorded spec)"
    try:
        raw = json.loads(stored.read_text())["spec"].get("fit") or {}
        section = build_dataclass(SpecFitOptions, raw, prefix="fit.", source=where)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{where} cannot be read ({type(error).__name__}: {error}); restore it, or fit "
                         f"{source / 'results.csv'}, which reads no spec") from None
    values = {name: getattr(section, name) for name in SPEC_OPTIONS if name in raw}
    values.update({name: tuple(values[name]) for name in ("forms", "exclude") if name in values})
    try:
        _check_law_options(replace(FitOptions(), **(SPEC_OPTIONS | values)))
        if values.get("bootstrap", 0) < 0:
            raise ValueError(f"bootstrap {values['bootstrap']} must be >= 0")
    except ValueError as error:
        raise ValueError(f"{where}: fit section: {error}") from None
    return values


def default_out_dir(source: Path) -> Path:
    return source / "fit" if source.is_dir() else source.with_name(f"{source.stem}_fit")


def default_targets(data: FitData) -> list[float]:
    largest = max(point.flops for point in data.points)
    return [10 * largest, 100 * largest]


def _check_options(out_dir: Path, options: FitOptions) -> None:
    target_flops = options.target_flops
    if options.bootstrap < 0:
        raise ValueError(f"--bootstrap {options.bootstrap} must be >= 0 (0 skips the intervals)")
    if target_flops is not None and not all(math.isfinite(c) and c > 0 for c in target_flops):
        raise ValueError(f"--target-flops {' '.join(map(str, target_flops))}: every budget must be a positive "
                         "number of FLOPs, e.g. 1e23")
    if options.params_column not in PARAMS_COLUMNS:
        raise ValueError(f"--params-column {options.params_column!r} is unknown; use one of "
                         f"{', '.join(PARAMS_COLUMNS)}")
    _check_law_options(options)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file; pass a directory (it is replaced as a whole)")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / FIT_FILE).is_file():
        raise ValueError(f"--out {out_dir} holds files but no {FIT_FILE}, and the output replaces the directory as "
                         "a whole; pass a new directory or an earlier fit's")


def _check_law_options(options: FitOptions) -> None:
    if options.objective not in OBJECTIVES:
        raise ValueError(f"--objective {options.objective!r} is unknown; use one of {', '.join(OBJECTIVES)}")
    delta = options.huber_delta
    if delta != "auto" and not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta > 0):
        raise ValueError(f"--huber-delta {delta} must be a positive number (in ln L) or auto")
    if delta != "auto" and options.objective != "huber":
        raise ValueError(f"--huber-delta {delta:g} applies to --objective huber only; drop it, or "
                         "use --objective huber")
    unknown = [form for form in options.forms or () if form not in LAW_FORMS]
    if unknown:
        raise ValueError(f"--forms {' '.join(unknown)}: unknown law form(s); use some of {', '.join(LAW_FORMS)}")
    for rule in options.exclude:
        parse_exclusion(rule)


# ---------------------------------------------------------------------------------------------
# The held-out check


def _read_held_out(path: Path, params_column: str, runs: Runs) -> Runs:
    """--check's runs, read as a source is; refused when trained on other data than the fitted runs."""
    try:
        held_out = read_runs(path, params_column)
    except ValueError as error:
        raise ValueError(f"--check: {error}") from None
    if held_out.fingerprint and runs.fingerprint and held_out.fingerprint != runs.fingerprint:
        check_fingerprints([*runs.labels, *(f"held-out {label}" for label in held_out.labels)],
                           [*runs.fingerprints, *held_out.fingerprints], f"--check {path}")
    return held_out


def _check(result: ScalingFit, held_out: Runs) -> CheckResult | str:
    """The chosen form's predictions for the held-out runs (check.check_predictions), or why there are
    none. A held-out run's own unique_tokens is used where every run records one, else the corpus's. Sizes
    are ranked with the fitted runs' seed-to-seed sd of ln L as the tie scale, and each held-out budget's
    measured optimum is set against the chosen form's N* there (the N* its predictions report)."""
    if result.chosen is None:
        return f"no law form was fitted ({'; '.join(result.law_skipped.values())}), so nothing predicts the runs"
    points = held_out.data.points
    unique = None
    if all(point.unique_tokens is not None for point in points):
        unique = np.array([point.unique_tokens for point in points], dtype=float)
    chosen = result.laws[result.chosen]
    return check_held_out(points, lambda params, tokens: result.predict(params, tokens, unique, CHECK_CONFIDENCE),
                          result.noise.sigma, lambda flops: chosen.allocation(flops)[0])


# ---------------------------------------------------------------------------------------------
# fit.json


def fit_document(result: ScalingFit, runs: Runs, targets: list[float], source: str, options: FitOptions,
                 check: CheckResult | str | None = None) -> dict[str, Any]:
    """fit.json's content (the structure is in the module docstring)."""
    data = runs.data
    document: dict[str, Any] = {
        "source": source, "params_column": options.params_column, "num_points": len(data.points),
        "num_curves": sum(curve is not None for curve in data.curves), "bootstrap": options.bootstrap,
        "seed": result.seed, "target_flops": list(targets), "objective": options.objective,
        "huber_delta": options.huber_delta,
        "exclusions": [{"rule": rule, "removed": removed} for rule, removed in runs.exclusions],
        "from_spec": None if not options.from_spec else {
            "file": str(Path(source) / SWEEP_FILE),
            "options": {name: getattr(options, name) for name in options.from_spec}},
        "fingerprints": runs.fingerprint or "not recorded",
        "flops_per_token": {"source": result.fpt.source, "description": result.fpt.description},
        "noise": {"sigma": result.noise.sigma, "how": result.noise.how, "groups": result.noise.groups},
    }
    for approach in APPROACHES:
        document[approach] = _approach_document(result, approach, options) if approach in result.fits else None
    document["laws"] = {form: _law_document(law, result) for form, law in result.laws.items()}
    document["law_skipped"] = dict(result.law_skipped)
    document["chosen"] = _chosen_document(result)
    document["interval"] = _interval_document(result)
    document["bootstrap_failures"] = {name: reasons for name, reasons in result.bootstrap_failures.items() if reasons}
    document["predictions"] = [_prediction_document(result, flops) for flops in targets]
    document["skipped"] = {approach: _explain_skip(approach, reason)
                           for approach, reason in result.skipped.items()}
    document["published"] = PUBLISHED
    if check is not None:
        document["check"] = check_document(check, result.chosen) if isinstance(check, CheckResult) else {
            "skipped": check}
        if isinstance(check, CheckResult):
            document["check"]["predicted_by"] = document["chosen"]["loss_prediction"]["how"]
    return _strict(document)


def _approach_document(result: ScalingFit, approach: str, options: FitOptions) -> dict[str, Any]:
    fit, samples = result.fits[approach], result.samples(approach)
    document = with_intervals(fit.constants(), [sample.constants() for sample in samples])
    document["bootstrap_fits"] = len(samples)
    if isinstance(fit, EnvelopeFit):
        document.update(n_coefficient=fit.n_law.coefficient, d_coefficient=fit.d_law.coefficient,
                        smoothing=f"centred rolling mean over {SMOOTHING_FRACTION:.0%} of each run's records",
                        frontier=[vars(point) for point in fit.frontier])
    elif isinstance(fit, IsoFlopFit):
        document.update(n_coefficient=fit.n_law.coefficient, d_coefficient=fit.d_law.coefficient,
                        budgets=[vars(minimum) for minimum in fit.minima],
                        excluded_budgets=[{"flops": flops, "reason": reason} for flops, reason in fit.excluded])
    elif isinstance(fit, ParametricFit):
        delta = options.huber_delta_value() or HUBER_DELTA
        document.update(huber_delta=delta, objective=fit.objective, starts=fit.starts,
                        bootstrap_starts=1 + BOOTSTRAP_GRID_STARTS)
    return document


def _law_document(law: LawResult, result: ScalingFit) -> dict[str, Any]:
    """One form: constants with 95% intervals, every bootstrap refit, its failures and its backtest."""
    fit, form = law.fit, law.fit.form
    backtest = law.backtest
    return {
        "formula": fit.law.formula, "citation": fit.law.citation, "constants": dict(fit.constants),
        "constants_ci": {name: percentile_interval([refit.constants[name] for refit in law.refits])
                         for name in fit.constants},
        "objective": "huber" if fit.huber_delta is not None else "least_squares", "objective_value": fit.objective,
        "huber_delta": fit.huber_delta, "huber_delta_how": fit.delta_how,
        "bootstrap_fits": [dict(refit.constants) for refit in law.refits],
        "bootstrap_failures": dict(result.bootstrap_failures.get(form, {})),
        "backtest": {
            "mean_abs_error_pct": backtest.mean_abs_error_pct, "mean_signed_error_pct": backtest.mean_signed_error_pct,
            "rankings_correct": backtest.rankings_correct, "rankings": backtest.rankings,
            "loo_abs_error_pct": backtest.loo_abs_error_pct,
            "folds": [_fold_document(fold) for fold in backtest.folds],
        },
        "interval_terms": {"noise_sd": law.noise_sd, "noise_how": law.noise_how,
                           "extrapolation_sd_per_decade": law.extrapolation.per_decade,
                           "extrapolation_how": law.extrapolation.how},
    }


def _fold_document(fold: Fold) -> dict[str, Any]:
    return {"budget_flops": fold.budget_flops, "train_budgets": fold.train_budgets,
            "train_configurations": fold.train_configurations, "train_max_flops": fold.train_max_flops,
            "counted": fold.counted, "skipped": fold.skipped, "failed": fold.failed,
            "ranking_correct": fold.ranking_correct,
            "points": [{"params": n, "tokens": d, "flops": c, "decades": decades, "measured": measured,
                        "predicted": predicted, "error_pct": error}
                       for n, d, c, decades, measured, predicted, error in zip(
                           fold.params, fold.tokens, fold.flops, fold.decades, fold.measured, fold.predicted,
                           fold.errors_pct, strict=True)]}


def _chosen_document(result: ScalingFit) -> dict[str, Any]:
    fit = result.laws[result.chosen].fit if result.chosen in result.laws else None
    choice = result.choice
    return {"form": result.chosen, "reason": result.chosen_reason, "ties": list(result.ties),
            "decision_folds": [] if choice is None else list(choice.decision_folds),
            "scores": {} if choice is None else dict(choice.scores), "prior": SIMPLER_PRIOR,
            "loss_prediction": None if fit is None else _loss_prediction(result),
            "huber_delta": None if fit is None else fit.huber_delta, "huber_delta_how": None if fit is None else
            fit.delta_how}


def _loss_prediction(result: ScalingFit) -> dict[str, Any]:
    """What a predicted loss (predictions[].chosen.loss, the check's predicted) is: under a tie the
    median of the tied forms' equal-weight mixture (ScalingFit.predict), else the chosen form's own."""
    forms = result.interval_forms()
    if not result.averages_ties():
        return {"forms": list(forms), "how": f"{result.chosen}'s own fit"}
    return {"forms": list(forms), "how": (
        f"the median of the tied forms' equal-weight mixture ({', '.join(forms)}: their bootstrap refits, each form "
        f"weighing the same, as in the prediction interval), not {result.chosen}'s alone; N*, D*, the constants "
        f"and the plots are {result.chosen}'s, the prior's choice")}


def _interval_document(result: ScalingFit) -> dict[str, Any] | None:
    """How the chosen form's prediction intervals are built (intervals.py), with the numbers."""
    if result.chosen is None:
        return None
    law = result.laws[result.chosen]
    forms = result.interval_forms()
    return {"confidence": PREDICTION_CONFIDENCE, "forms": list(forms),
            "bootstrap_fits": {form: len(result.laws[form].refits) for form in forms},
            "noise_sd": law.noise_sd, "noise_how": law.noise_how,
            "extrapolation_sd_per_decade": law.extrapolation.per_decade,
            "extrapolation_how": law.extrapolation.how, "distance_from_flops": result.fitted_max_flops,
            "model": INTERVAL_MODEL}


def _prediction_document(result: ScalingFit, flops: float) -> dict[str, Any]:
    """Every approach's and form's allocation at C (ScalingFit.compute_optimal), and at the chosen form's
    (N*, D*) the predicted loss (under a tie the tied forms' mixture median, ScalingFit.predict) with its
    90% prediction interval, the form's own loss and how far leaving one run out moves that."""
    table = result.compute_optimal(flops)
    document: dict[str, Any] = {"flops": flops}
    for approach in APPROACHES:
        document[approach] = table.get(approach)
    document["laws"] = {form: table[form] for form in result.laws}
    document["chosen"] = None
    if result.chosen is not None:
        values = table[result.chosen]
        loss = values["loss"]
        if result.averages_ties() and math.isfinite(values["n_opt"]):
            loss = float(result.predict(values["n_opt"], values["d_opt"])[0])
        document["chosen"] = {"form": result.chosen, **{key: values[key] for key in (
            "n_opt", "d_opt", "tokens_per_param")}, "loss": loss, "loss_interval": values["loss_interval"],
            "form_loss": values["loss"], "loo_shift_pct": result.laws[result.chosen].loo_shift_pct(flops)}
    return document


def _explain_skip(approach: str, reason: str) -> str:
    """The reason an approach could not run; a raw numerical error (which says nothing to a user) is
    wrapped in what to check. fit.fit_isoflop itself says when no profile is bracketed."""
    if any(raw in reason for raw in RAW_NUMERIC_ERRORS):
        return (f"{APPROACH_TITLES[approach]} failed numerically on these runs ({reason}); check for runs with "
                "equal (N, D) or losses that do not fall with N and D")
    return reason


def _strict(tree: Any) -> Any:
    """Plain JSON types; non-finite numbers become null (fit.json is strict JSON)."""
    if isinstance(tree, dict):
        return {str(key): _strict(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple, np.ndarray)):
        return [_strict(value) for value in tree]
    if isinstance(tree, (bool, np.bool_)):
        return bool(tree)
    if tree is None or isinstance(tree, str):
        return tree
    if isinstance(tree, (int, np.integer)):
        return int(tree)
    value = float(tree)
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------
# Writing


def publish(out_dir: Path, document: dict[str, Any], result: ScalingFit, data: FitData,
            targets: list[float], check: CheckResult | None = None) -> list[Path]:
    """fit.json, check.csv (with a check) and the plots into a temporary directory beside out_dir, then
    renamed onto it (an existing out_dir is replaced). Returns the plots' final paths."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        (staging / FIT_FILE).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
        if check is not None:
            (staging / CHECK_FILE).write_text(check_csv(check))
        names = [path.name for path in write_plots(result, data, targets, staging, check=check)]
        staging.chmod(0o755)
        if out_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, retired / out_dir.name)
            os.replace(staging, out_dir)
            shutil.rmtree(retired)
        else:
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out_dir / name for name in names]


# ---------------------------------------------------------------------------------------------
# The printed summary


def format_summary(document: dict[str, Any], check: CheckResult | None = None) -> str:
    """The approaches' exponents against the published ones, the law forms and their backtests, every
    failure, then the predictions and the held-out check (its lines: check.check_lines)."""
    excluded = "".join(f"; excluded by {e['rule']!r}: {e['removed']} runs" for e in document["exclusions"])
    lines = [f"scaling-law fit of {document['num_points']} runs from {document['source']} "
             f"(N = {document['params_column']}; {document['bootstrap']} bootstrap resamples, seed "
             f"{document['seed']}; [95% percentile intervals]; data fingerprint: {document['fingerprints']}"
             f"{excluded})", *_spec_lines(document),
             f"{'approach':<26}{'a: N_opt ∝ C^a':<30}{'b: D_opt ∝ C^b':<30}bootstrap refits that succeeded"]
    for approach in APPROACHES:
        values = document[approach]
        if values is None:
            lines.append(f"{APPROACH_TITLES[approach]:<26}skipped: {document['skipped'][approach]}")
        else:
            lines.append(f"{APPROACH_TITLES[approach]:<26}{_number(values, 'a'):<30}{_number(values, 'b'):<30}"
                         f"{values['bootstrap_fits']} of {document['bootstrap']}")
    if document["bootstrap"]:
        lines.append(f"(an interval needs >= {MIN_BOOTSTRAP_FITS} successful refits; a refit fails where a resample "
                     "repeats runs until an approach's minimum is not met)")
    lines.append("published: " + "; ".join(f"{name} a={v['a']:.2f} b={v['b']:.2f}" for name, v in PUBLISHED.items()))
    if document["approach3"] is not None:
        lines += _parametric_lines(document["approach3"])
    lines += _law_lines(document) + _failure_lines(document)
    lines += _prediction_lines(document)
    if check is not None:
        lines += check_lines(check, _predictor_label(document["chosen"]))
    elif "check" in document:
        lines.append(f"held-out check skipped: {document['check']['skipped']}")
    if "downstream" in document:
        lines += downstream_lines(document["downstream"])
    return "\n".join(lines) + "\n"


def _spec_lines(document: dict[str, Any]) -> list[str]:
    """Where the options not given on the command line came from, when a sweep's spec supplied them."""
    recorded = document["from_spec"]
    if recorded is None:
        return []
    values = "; ".join(f"{name} {_option_text(name, value)}" for name, value in recorded["options"].items())
    return [f"from the sweep's recorded spec ({recorded['file']}, fit section; options given on the command line "
            f"override it): {values}"]


def _option_text(name: str, value: Any) -> str:
    if isinstance(value, list):
        empty = "(every form)" if name == "forms" else "(none)"
        return ", ".join(repr(item) if name == "exclude" else item for item in value) if value else empty
    return f"{value:g}" if isinstance(value, float) else str(value)


def _predictor_label(chosen: dict[str, Any]) -> str | None:
    """Who predicts the losses: the chosen form, or under a tie the tied forms' mixture median."""
    prediction = chosen["loss_prediction"]
    if prediction is None or len(prediction["forms"]) < 2:
        return chosen["form"]
    return f"the median of the tied forms' mixture: {', '.join(prediction['forms'])}"


def _parametric_lines(values: dict[str, Any]) -> list[str]:
    constants = "  ".join(f"{key} {_number(values, key)}" for key in ("E", "A", "B", "alpha", "beta"))
    return [
        f"approach 3: L(N, D) = E + A / N^alpha + B / D^beta; Huber (delta {values['huber_delta']:g}) on ln L, "
        f"L-BFGS from {values['starts']:,} grid starts, objective {values['objective']:.4g}",
        f"  {constants}",
        "  (Chinchilla: E 1.69  A 406.4  B 410.7  alpha 0.34  beta 0.28); bootstrap refits start from the "
        f"full-data optimum and the {values['bootstrap_starts'] - 1} grid starts best on all runs",
    ]


def _law_lines(document: dict[str, Any]) -> list[str]:
    """Each law form's constants and rolling backtest (fit on smaller budgets, predict the next)."""
    lines = [f"law forms ({document['objective']} on ln L; rolling backtest: fit on the budgets below an origin, "
             "predict every budget from it on; error = predicted - measured):"]
    for form, law in document["laws"].items():
        constants = "  ".join(f"{name} {_constant(value, law['constants_ci'].get(name))}"
                              for name, value in law["constants"].items())
        backtest = law["backtest"]
        tested = (f"backtest mean |error| {_percent(backtest['mean_abs_error_pct'])}, mean signed error "
                  f"{_percent(backtest['mean_signed_error_pct'], signed=True)}, rankings {backtest['rankings_correct']}"
                  f"/{backtest['rankings']}" if backtest["rankings"] else
                  f"no backtest fold counted (leave-one-out |error| {_percent(backtest['loo_abs_error_pct'])})")
        delta = f"; delta {law['huber_delta']:.3g} ({law['huber_delta_how']})" if law["huber_delta"] else ""
        lines += [f"  {form}: {law['formula']}  ({law['citation']}){delta}", f"    {constants}", f"    {tested}"]
        lines += [f"    fold from C {fold['budget_flops']:.3g} (fitted on {fold['train_budgets']} budget(s)) not "
                  f"counted: {fold['skipped'] or fold['failed']}" for fold in backtest["folds"] if not fold["counted"]]
    chosen = document["chosen"]
    lines.append(f"chosen form: {chosen['form'] or 'none'}: {chosen['reason']}")
    if chosen["loss_prediction"] is not None and len(chosen["loss_prediction"]["forms"]) > 1:
        lines.append(f"predicted losses (at the target budgets and of --check): {chosen['loss_prediction']['how']}")
    noise = document["noise"]
    sigma = f"sigma {noise['sigma']:.3g} in ln L, " if noise["sigma"] is not None else ""
    lines.append(f"run-to-run noise: {sigma}{noise['how']}")
    interval = document["interval"]
    if interval is not None:
        lines.append(f"prediction intervals ({interval['confidence']:.0%}): the bootstrap refits of "
                     f"{', '.join(interval['forms'])}; a noise floor of {interval['noise_sd']:.3g} in ln L "
                     f"({interval['noise_how']}); {interval['extrapolation_sd_per_decade']:.3g} more per decade "
                     f"beyond C {interval['distance_from_flops']:.3g}: {interval['extrapolation_how']}")
    return lines


def _failure_lines(document: dict[str, Any]) -> list[str]:
    """One line per law form that could not be fitted and per approach or form whose refits failed."""
    lines = [f"law form {form} skipped: {reason}" for form, reason in document["law_skipped"].items()]
    for name, reasons in document["bootstrap_failures"].items():
        count = sum(reasons.values())
        causes = "; ".join(f"{number} x {reason}" for reason, number in sorted(reasons.items(), key=lambda r: -r[1]))
        lines.append(f"bootstrap: {count} of {document['bootstrap']} refits of {name} failed ({causes})")
    return lines


def _prediction_lines(document: dict[str, Any]) -> list[str]:
    lines = [f"compute-optimal allocation at the target budgets, on the FLOPs line "
             f"{document['flops_per_token']['description']}:",
             f"  {'C':<10}{'fit':<13}{'N*':<31}{'D*':<31}{'D*/N*':<31}loss"]
    for prediction in document["predictions"]:
        rows = [(approach[-1], prediction[approach]) for approach in APPROACHES if prediction[approach] is not None]
        rows += list(prediction["laws"].items())
        for name, values in rows:
            loss = _number(values, "loss") if "loss" in values else ""
            lines.append(f"  {prediction['flops']:<10.3g}{name:<13}{_number(values, 'n_opt'):<31}"
                         f"{_number(values, 'd_opt'):<31}{_number(values, 'tokens_per_param'):<31}{loss}")
        chosen = prediction["chosen"]
        if chosen is not None:
            interval = chosen["loss_interval"]
            band = f" [{interval[0]:.4g}, {interval[1]:.4g}] (90% prediction interval)" if interval and None not in \
                interval else " (no prediction interval: too few refits and no seed repeats)"
            lines.append(_chosen_prediction_line(prediction["flops"], chosen, document["chosen"], band))
    return lines


def _chosen_prediction_line(flops: float, chosen: dict[str, Any], choice: dict[str, Any], band: str) -> str:
    loo = f"leaving one run out moves {chosen['form']}'s by up to {_percent(chosen['loo_shift_pct'])}"
    forms = choice["loss_prediction"]["forms"]
    if len(forms) < 2:
        return (f"  at C {flops:.3g} the chosen {chosen['form']} predicts loss {_constant(chosen['loss'])}{band}; "
                f"leaving one run out moves it by up to {_percent(chosen['loo_shift_pct'])}")
    return (f"  at C {flops:.3g}, at {chosen['form']}'s N* and D*, the tied forms' mixture median "
            f"({', '.join(forms)}) predicts loss {_constant(chosen['loss'])}{band}; {chosen['form']} alone "
            f"{_constant(chosen['form_loss'])}; {loo}")


def _number(values: dict[str, Any], key: str) -> str:
    value, interval = values.get(key), values.get(f"{key}_ci")
    text = "n/a" if value is None else f"{value:.3g}"
    return f"{text} [{interval[0]:.3g}, {interval[1]:.3g}]" if interval else text


def _constant(value: float | None, interval: list[float] | None = None) -> str:
    text = "n/a" if value is None else f"{value:.4g}"
    return f"{text} [{interval[0]:.3g}, {interval[1]:.3g}]" if interval else text


def _percent(value: float | None, signed: bool = False) -> str:
    return "n/a" if value is None else f"{value:+.2f}%" if signed else f"{value:.2f}%"
