"""The ladder's downstream prediction: a task metric at a target budget from the runs' task metrics, in the
two steps of Bhagia et al. 2024 ("Establishing Task Scaling Laws via Compute-Efficient Model Ladders", sec. 3).

Step 1, per task: the task loss (the gold continuation's loss, or bits per byte: TASK_LOSS_METRICS, the first a
task records) is a law of N and D, L(N, D) = E + A / N^alpha + B / D^beta, Hoffmann et al. 2022's form, which
laws.py fits on ln L as "chinchilla".
Step 2: the metric is a sigmoid of the task loss, Acc(L) = a / (1 + exp(-k (L - L0))) + b, fitted by least
squares within the bounds of OLMo's step 2 (allenai/OLMo scripts/scaling/step2.py, fit_step2, and
olmo/scaling/scaling_laws/fitting_functions.py, sigmoid): a in [-1, 0], L0 >= 0, k >= 0, b in [0, 1], so b is the
metric as L falls (a perfect model) and a + b where L is high (chance).
A metric that is itself a loss (LOSS_METRICS: bits per byte, perplexities) is predicted by step 1 alone.

Where this differs from OLMo's scripts, and why: step 2 is fitted on each run's final values (OLMo adds every
intermediate checkpoint, and two anchor points, (0, task maximum) and (max L, task minimum), which need a task's
chance level that lm-eval's results do not state); the interval is a bootstrap over runs of both steps with each
step's residual noise added, a prediction interval for one new run (OLMo propagates the sigmoid's covariance
alone, its step2.py noting the approximation may be bad).

A metric that does not move with the task loss (accuracy at chance at every size) is reported, not fitted: no
sigmoid beats a constant by the F-test at SIGMOID_SIGNIFICANCE (approximate for a nonlinear fit). Its task loss
is still predicted, as it stays predictive where accuracy sits at chance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from scipy.optimize import least_squares
from scipy.special import expit
from scipy.stats import f as f_distribution

from scaletrain.scaling.fit import PREDICTION_CONFIDENCE, Point, bootstrap_samples, percentile_interval
from scaletrain.scaling.fit_inputs import Runs
from scaletrain.scaling.laws import LAW_FORMS, LawFit, fit_law, refit_law

CITATION = ("Bhagia et al. 2024, Establishing Task Scaling Laws via Compute-Efficient Model Ladders, sec. 3; "
            "bounds of allenai/OLMo scripts/scaling/step2.py")
TASK_LOSS_FORM = "chinchilla"
TASK_LOSS_METRICS = ("gold_loss", "bits_per_byte")  # a task's loss for step 1: the first of these it records
LOSS_METRICS = ("gold_loss", "bits_per_byte", "byte_perplexity", "word_perplexity", "perplexity")
SIGMOID_FORMULA = "a / (1 + exp(-k (L - L0))) + b"
SIGMOID_CONSTANTS = ("a", "L0", "k", "b")
SIGMOID_BOUNDS = ((-1.0, 0.0, 0.0, 0.0), (0.0, math.inf, math.inf, 1.0))
START_MARGIN = 1e-6  # least_squares starts strictly inside its bounds
MIN_LAW_RUNS = 5  # the law's 5 constants
MIN_SIGMOID_RUNS = 6  # the sigmoid's 4 constants and 2 degrees of freedom for the F-test
SIGMOID_SIGNIFICANCE = 0.05
NOISE_DRAWS = 50  # residual-noise draws per bootstrap refit in a prediction interval
STDERR_SUFFIX = "_stderr"


@dataclass(frozen=True)
class Sigmoid:
    """Acc(L) = a / (1 + exp(-k (L - L0))) + b (Bhagia et al. 2024, sec. 3, step 2)."""

    a: float
    midpoint: float  # L0
    k: float
    b: float

    def __call__(self, loss: np.ndarray | float) -> np.ndarray:
        return self.a * expit(self.k * (np.asarray(loss, dtype=float) - self.midpoint)) + self.b

    def constants(self) -> dict[str, float]:
        return dict(zip(SIGMOID_CONSTANTS, (self.a, self.midpoint, self.k, self.b), strict=True))


def fit_sigmoid(losses: np.ndarray, values: np.ndarray, start: Sigmoid | None = None) -> Sigmoid:
    """The least-squares sigmoid within SIGMOID_BOUNDS, from `start` (a bootstrap refit) or a grid of starts
    spanning the losses seen; ValueError when no start converges."""
    losses, values = np.asarray(losses, dtype=float), np.asarray(values, dtype=float)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return Sigmoid(*theta)(losses) - values

    def jacobian(theta: np.ndarray) -> np.ndarray:
        a, midpoint, k, _ = theta
        s = expit(k * (losses - midpoint))
        slope = a * s * (1 - s)
        return np.column_stack([s, -k * slope, (losses - midpoint) * slope, np.ones_like(s)])

    lower, upper = np.array(SIGMOID_BOUNDS[0]) + START_MARGIN, np.array(SIGMOID_BOUNDS[1]) - START_MARGIN
    best = None
    for theta in _sigmoid_starts(losses, values) if start is None else [list(start.constants().values())]:
        result = least_squares(residuals, np.clip(theta, lower, upper), jac=jacobian, bounds=SIGMOID_BOUNDS,
                               method="trf")
        if np.all(np.isfinite(result.x)) and (best is None or result.cost < best.cost):
            best = result
    if best is None:
        raise ValueError("no start of the sigmoid's least-squares fit converged")
    return Sigmoid(*(float(value) for value in best.x))


def _sigmoid_starts(losses: np.ndarray, values: np.ndarray) -> list[list[float]]:
    """Midpoints across the losses seen and slopes from a tenth of their span to 10x it, each from the
    metric's own range (a = min - max, b = max)."""
    spread = max(float(np.ptp(losses)), 1e-6)
    a, b = min(float(values.min() - values.max()), 0.0), float(values.max())
    return [[a, midpoint, k / spread, b] for midpoint in np.quantile(losses, [0.1, 0.3, 0.5, 0.7, 0.9])
            for k in (1.0, 4.0, 16.0, 64.0)]


def sigmoid_p_value(losses: np.ndarray, values: np.ndarray, sigmoid: Sigmoid) -> float:
    """The F-test's p-value of the sigmoid (4 constants) against a constant metric (1): small where the metric
    moves with the task loss; 1 where it does not move at all."""
    values = np.asarray(values, dtype=float)
    constant = float(((values - values.mean()) ** 2).sum())
    fitted = float(((sigmoid(losses) - values) ** 2).sum())
    if constant <= 0:
        return 1.0
    if fitted <= 0:
        return 0.0
    spare = len(values) - len(SIGMOID_CONSTANTS)
    statistic = max(constant - fitted, 0.0) / (len(SIGMOID_CONSTANTS) - 1) / (fitted / spare)
    return float(f_distribution.sf(statistic, len(SIGMOID_CONSTANTS) - 1, spare))


@dataclass(frozen=True)
class TaskFit:
    """Both steps for one task metric: the task-loss law and, unless the metric is that loss or does not move
    with it (`sigmoid_skipped`), the sigmoid; their residual sds (ln L; the metric's units), and the bootstrap
    refits of both (law, sigmoid) on resampled runs."""

    name: str
    loss_metric: str
    runs: int
    law: LawFit
    law_sd: float
    sigmoid: Sigmoid | None = None
    metric_sd: float = 0.0
    p_value: float | None = None
    sigmoid_skipped: str | None = None
    refits: tuple[tuple[LawFit, Sigmoid | None], ...] = ()
    failures: int = 0

    @property
    def predicts_loss_only(self) -> bool:
        return self.name.split("/", 1)[1] == self.loss_metric

    def predict(self, params: float, tokens: float, confidence: float, seed: int) -> dict[str, Any]:
        """The task loss and the metric at (N, D) with `confidence` prediction intervals: every refit (the full
        fit without refits), its task loss drawn with step 1's residual noise (in ln L), passed through its
        sigmoid, plus step 2's residual noise. Seeded per call, so one point's interval ignores the others."""
        pairs = self.refits or ((self.law, self.sigmoid),)
        rng = np.random.default_rng(seed)
        centres = np.array([float(law.loss(params, tokens)) for law, _ in pairs])
        losses = centres[:, None] * np.exp(rng.normal(0.0, self.law_sd, (len(pairs), NOISE_DRAWS)))
        loss = float(self.law.loss(params, tokens))
        row = {"task_loss": loss, "task_loss_interval": _central(losses, confidence), "value": None, "interval": None}
        if self.predicts_loss_only:
            row.update(value=loss, interval=row["task_loss_interval"])
        elif self.sigmoid is not None:
            values = np.stack([sigmoid(draws) for (_, sigmoid), draws in zip(pairs, losses, strict=True)])
            values = values + rng.normal(0.0, self.metric_sd, values.shape)
            row.update(value=float(self.sigmoid(loss)), interval=_central(values, confidence))
        return row


def _central(values: np.ndarray, confidence: float) -> list[float] | None:
    finite = values[np.isfinite(values)]
    if not len(finite) or np.ptp(finite) == 0:
        return None
    tail = 0.5 * (1.0 - confidence)
    return [float(v) for v in np.quantile(finite, [tail, 1.0 - tail])]


def fit_task(name: str, loss_metric: str, points: list[Point], values: list[dict[str, float]], bootstrap: int,
             seed: int) -> TaskFit | str:
    """Both steps on the runs recording the metric and its task loss, and `bootstrap` refits on resamples of
    them (fit.bootstrap_samples); or why step 1 cannot be fitted."""
    loss_name = f"{name.split('/', 1)[0]}/{loss_metric}"
    kept = [i for i, recorded in enumerate(values) if name in recorded and loss_name in recorded]
    if len(kept) < MIN_LAW_RUNS:
        return (f"{len(kept)} runs record both {name} and its task loss {loss_name}; the task-loss law needs "
                f">= {MIN_LAW_RUNS}")
    runs = [points[i] for i in kept]
    params, tokens = np.array([p.params for p in runs]), np.array([p.tokens for p in runs])
    losses, metric = (np.array([values[i][key] for i in kept]) for key in (loss_name, name))
    try:
        law = fit_law(TASK_LOSS_FORM, params, tokens, losses)
    except ValueError as error:
        return f"step 1 (the task loss {loss_name} as a law of N and D) failed: {error}"
    law_sd = _law_residual_sd(law, params, tokens, losses)
    task = TaskFit(name, loss_metric, len(kept), law, law_sd)
    if not task.predicts_loss_only:
        task = _with_sigmoid(task, losses, metric)
    return _with_refits(task, runs, losses, metric, bootstrap, seed)


def _law_residual_sd(law: LawFit, params: np.ndarray, tokens: np.ndarray, losses: np.ndarray) -> float:
    residuals = np.log(law.loss(params, tokens)) - np.log(losses)
    return float(np.sqrt((residuals**2).sum() / max(len(residuals) - len(law.constants), 1)))


def _with_sigmoid(task: TaskFit, losses: np.ndarray, metric: np.ndarray) -> TaskFit:
    """Step 2, or the reason it is not fitted (too few runs, a metric outside [0, 1], one that does not move)."""
    if len(metric) < MIN_SIGMOID_RUNS:
        return replace(task, sigmoid_skipped=f"{len(metric)} runs; the sigmoid needs >= {MIN_SIGMOID_RUNS}")
    if np.any((metric < 0) | (metric > 1)):
        return replace(task, sigmoid_skipped=f"values from {metric.min():.4g} to {metric.max():.4g} leave [0, 1], "
                        "the sigmoid's range (an accuracy); name a loss metric or an accuracy")
    try:
        sigmoid = fit_sigmoid(losses, metric)
    except ValueError as error:
        return replace(task, sigmoid_skipped=str(error))
    p_value = sigmoid_p_value(losses, metric, sigmoid)
    if p_value > SIGMOID_SIGNIFICANCE:
        return replace(task, p_value=p_value, sigmoid_skipped=(
            f"the metric does not move with the task loss (from {metric.min():.4g} to {metric.max():.4g}; a sigmoid "
            f"beats a constant with F-test p {p_value:.2g} > {SIGMOID_SIGNIFICANCE}), e.g. accuracy at chance at "
            "every size: no sigmoid fitted; the task loss is predicted"))
    metric_sd = math.sqrt(float(((sigmoid(losses) - metric) ** 2).sum()) / (len(metric) - len(SIGMOID_CONSTANTS)))
    return replace(task, sigmoid=sigmoid, metric_sd=metric_sd, p_value=p_value)


def _with_refits(task: TaskFit, runs: list[Point], losses: np.ndarray, metric: np.ndarray, bootstrap: int,
                 seed: int) -> TaskFit:
    """Both steps refitted on each resample of the runs, from the full fits' optima; a refit that fails
    (a resample with too few distinct runs, no convergence) is counted."""
    refits, failures = [], 0
    for sample in bootstrap_samples(runs, bootstrap, seed):
        params, tokens = np.array([runs[i].params for i in sample]), np.array([runs[i].tokens for i in sample])
        try:
            law = refit_law(task.law, params, tokens, losses[sample])
            sigmoid = None if task.sigmoid is None else fit_sigmoid(losses[sample], metric[sample], task.sigmoid)
        except ValueError:
            failures += 1
            continue
        refits.append((law, sigmoid))
    return replace(task, refits=tuple(refits), failures=failures)


# ---------------------------------------------------------------------------------------------
# Which metrics, and the document


def recorded_metrics(runs: Runs) -> list[str]:
    """Every TASK/METRIC[/FILTER] a run records (train/hooks/downstream.py's names; not the evaluation's time_s,
    which names no task), stderr columns aside, sorted."""
    return sorted({name for values in runs.task_values for name in values
                   if "/" in name and not name.endswith(STDERR_SUFFIX)})


def parse_task_metrics(requested: Sequence[str], runs: Runs) -> list[str]:
    """--task-metric's TASK/METRIC names, checked against what the runs record; ValueError naming the fix."""
    recorded = recorded_metrics(runs)
    for name in requested:
        if name.count("/") < 1 or not all(name.split("/")):
            raise ValueError(f"--task-metric {name!r} is not TASK/METRIC, e.g. english_next_line/acc")
        if name not in recorded:
            hint = f"recorded: {', '.join(recorded)}" if recorded else "no run records a downstream metric"
            raise ValueError(f"--task-metric {name}: no fitted run records downstream/{name} ({hint})")
    return list(dict.fromkeys(requested))


def task_loss_metric(name: str, runs: Runs, task_loss: str | None) -> str | None:
    """The loss step 1 fits for a task metric: the metric itself if it is a loss, else --task-loss, else the
    first of TASK_LOSS_METRICS the task records; None when it records none. A task name holds no "/" (lm-eval's
    do not); what follows the first is the metric, with its lm-eval filter after a second."""
    task, metric = name.split("/", 1)
    if metric.split("/")[0] in LOSS_METRICS:
        return metric
    recorded = set(recorded_metrics(runs))
    candidates = (task_loss,) if task_loss else TASK_LOSS_METRICS
    return next((loss for loss in candidates if f"{task}/{loss}" in recorded), None)


def fit_downstream(runs: Runs, requested: Sequence[str] | None, task_loss: str | None,
                   allocations: list[tuple[float, float | None, float | None]], held_out: Runs | None,
                   bootstrap: int, seed: int) -> dict[str, Any] | None:
    """fit.json's `downstream`: per task metric (--task-metric's, else every one the runs record) both steps,
    the predictions at the target budgets' compute-optimal (C, N*, D*) and the held-out check; None where
    nothing is requested and no run records a downstream metric."""
    names = recorded_metrics(runs) if requested is None else parse_task_metrics(requested, runs)
    if not names:
        return None
    tasks: dict[str, Any] = {}
    for name in names:
        loss_metric = task_loss_metric(name, runs, task_loss)
        if loss_metric is None:
            tasks[name] = {"skipped": f"the task records no task loss ({' or '.join(TASK_LOSS_METRICS)}); pass "
                           "--task-loss METRIC"}
            continue
        fitted = fit_task(name, loss_metric, runs.data.points, runs.task_values, bootstrap, seed)
        tasks[name] = ({"skipped": fitted} if isinstance(fitted, str) else
                       task_document(fitted, allocations, held_out, seed))
    return {"citation": CITATION, "task_loss_formula": LAW_FORMS[TASK_LOSS_FORM].formula,
            "sigmoid_formula": SIGMOID_FORMULA, "confidence": PREDICTION_CONFIDENCE,
            "interval": "bootstrap over runs of both steps, each refit with its steps' residual noise drawn",
            "tasks": tasks}


def task_document(task: TaskFit, allocations: list[tuple[float, float | None, float | None]],
                  held_out: Runs | None, seed: int) -> dict[str, Any]:
    laws = [law for law, _ in task.refits]
    sigmoids = [sigmoid for _, sigmoid in task.refits if sigmoid is not None]
    document: dict[str, Any] = {
        "task_loss_metric": task.loss_metric, "runs": task.runs, "bootstrap_fits": len(task.refits),
        "bootstrap_failures": task.failures,
        "law": {"constants": dict(task.law.constants), "residual_sd": task.law_sd, "constants_ci": {
            name: percentile_interval([law.constants[name] for law in laws]) for name in task.law.constants}},
        "sigmoid": None if task.sigmoid is None else {
            **task.sigmoid.constants(), "residual_sd": task.metric_sd, "p_value": task.p_value,
            **{f"{name}_ci": percentile_interval([s.constants()[name] for s in sigmoids]) for name in
               SIGMOID_CONSTANTS}},
        "sigmoid_skipped": task.sigmoid_skipped,
        "predictions": [{"flops": flops, "n_opt": n_opt, "d_opt": d_opt,
                         **(task.predict(n_opt, d_opt, PREDICTION_CONFIDENCE, seed) if n_opt and d_opt else {})}
                        for flops, n_opt, d_opt in allocations],
    }
    if held_out is not None:
        document["check"] = check_task(task, held_out, seed)
    return document


def check_task(task: TaskFit, held_out: Runs, seed: int) -> dict[str, Any]:
    """The prediction for each held-out run recording the metric, against its measurement: error = predicted -
    measured (in the metric's units, and in % of it), and whether the prediction interval holds it."""
    if task.sigmoid is None and not task.predicts_loss_only:
        return {"skipped": f"the metric is not predicted: {task.sigmoid_skipped}"}
    points = []
    for point, values in zip(held_out.data.points, held_out.task_values, strict=True):
        if task.name not in values:
            continue
        row = task.predict(point.params, point.tokens, PREDICTION_CONFIDENCE, seed)
        measured, interval = values[task.name], row["interval"]
        points.append({"params": point.params, "tokens": point.tokens, "flops": point.flops, "measured": measured,
                       "predicted": row["value"], "lower": interval[0] if interval else None,
                       "upper": interval[1] if interval else None, "error": row["value"] - measured,
                       "error_pct": 100.0 * (row["value"] - measured) / measured if measured else None,
                       "inside": None if interval is None else interval[0] <= measured <= interval[1]})
    if not points:
        return {"skipped": f"no held-out run records {task.name}"}
    judged = [p["inside"] for p in points if p["inside"] is not None]
    percents = [p["error_pct"] for p in points if p["error_pct"] is not None]  # none where the measurement is 0
    return {"points": points, "mean_abs_error": float(np.mean([abs(p["error"]) for p in points])),
            "mean_signed_error": float(np.mean([p["error"] for p in points])),
            "mean_abs_error_pct": float(np.mean(np.abs(percents))) if percents else None,
            "mean_signed_error_pct": float(np.mean(percents)) if percents else None,
            "max_abs_error_pct": float(np.max(np.abs(percents))) if percents else None,
            "coverage": {"inside": sum(judged), "with_interval": len(judged), "runs": len(points)}}


def downstream_lines(document: dict[str, Any]) -> list[str]:
    """The printed part: per task metric its two steps, its predictions and its held-out check."""
    lines = [f"downstream ({document['citation']}): task loss L = {document['task_loss_formula']} per task, then "
             f"metric = {document['sigmoid_formula']}; {document['confidence']:.0%} prediction intervals:"]
    for name, task in document["tasks"].items():
        if "skipped" in task:
            lines.append(f"  {name}: skipped: {task['skipped']}")
            continue
        law = "  ".join(f"{key} {value:.4g}" for key, value in task["law"]["constants"].items())
        lines.append(f"  {name}: step 1 on {task['runs']} runs, task loss {task['task_loss_metric']}: {law}")
        sigmoid = task["sigmoid"]
        if sigmoid is not None:
            lines.append("    step 2: " + "  ".join(f"{key} {sigmoid[key]:.4g}" for key in SIGMOID_CONSTANTS)
                         + f" (residual sd {sigmoid['residual_sd']:.3g}, F-test p {sigmoid['p_value']:.2g})")
        elif task["sigmoid_skipped"]:
            lines.append(f"    step 2 not fitted: {task['sigmoid_skipped']}")
        lines += [_prediction_line(row) for row in task["predictions"]]
        lines += _check_lines(task.get("check"))
    return lines


def _prediction_line(row: dict[str, Any]) -> str:
    if row.get("task_loss") is None:
        return f"    at C {row['flops']:.3g}: no compute-optimal N*, D* from the chosen law, so no prediction"
    text = (f"    at C {row['flops']:.3g} (N* {row['n_opt']:.3g}, D* {row['d_opt']:.3g}): task loss "
            f"{_value(row['task_loss'], row['task_loss_interval'])}")
    return text + (f", metric {_value(row['value'], row['interval'])}" if row["value"] is not None else "")


def _check_lines(check: dict[str, Any] | None) -> list[str]:
    if check is None:
        return []
    if "skipped" in check:
        return [f"    held-out check skipped: {check['skipped']}"]
    coverage = check["coverage"]
    percent = ("" if check.get("mean_abs_error_pct") is None else
               f" ({check['mean_abs_error_pct']:.2f}%, signed {check['mean_signed_error_pct']:+.2f}%, largest "
               f"|error| {check['max_abs_error_pct']:.2f}%)")
    return [f"    held-out check of {coverage['runs']} runs: mean |error| {check['mean_abs_error']:.4g}, mean signed "
            f"error {check['mean_signed_error']:+.4g} (predicted - measured){percent}; {coverage['inside']} of "
            f"{coverage['with_interval']} inside their interval"]


def _value(value: float, interval: list[float] | None) -> str:
    return f"{value:.4g}" + (f" [{interval[0]:.4g}, {interval[1]:.4g}]" if interval else "")
