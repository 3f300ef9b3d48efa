"""The `scaletrain fit` arguments, apart from the fitting code (scipy, matplotlib: 2 s to import),
so every other command's start stays fast; fit_source.fit_from_args consumes them. The exclusion
rules' parser (parse_exclusion) is here too, so a sweep spec can check its rules without scipy."""

from __future__ import annotations

import argparse
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Which N: a mixture of experts' active parameters (what a token meets) or its total, each with or without
# embeddings; a dense model's active and total are equal. An active column a CSV lacks (results written
# before it existed) falls back to its total (fit_inputs.py).
PARAMS_COLUMNS = ("active_params", "active_non_embedding_params", "params", "non_embedding_params")
DEFAULT_PARAMS_COLUMN = "active_params"
DEFAULT_BOOTSTRAP = 100
OBJECTIVES = ("huber", "least_squares")  # laws.OBJECTIVES, repeated so `--help` needs no scipy
EXCLUSION_OPERATORS: dict[str, Callable[[object, object], bool]] = {
    "<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<": operator.lt, ">": operator.gt}
EXCLUSION_RULE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|==|!=|<|>)\s*(\S+)\s*")
EXCLUSION_HINT = ('write COLUMN OP VALUE, e.g. "num_layers < 2", OP one of < <= > >= == != (a text VALUE with == or '
                  '!= only)')


@dataclass(frozen=True)
class Exclusion:
    """A rule removing the runs whose COLUMN compares to VALUE by OP (numbers as numbers; text with == and
    != only), e.g. "num_layers < 2" drops the one-layer shapes."""

    rule: str
    column: str
    operator: str
    value: float | str

    def excludes(self, cell: str | None) -> bool:
        """Whether a run whose column holds `cell` is removed; ValueError where the rule compares numbers
        and the cell is not one."""
        if isinstance(self.value, str):
            return EXCLUSION_OPERATORS[self.operator]((cell or "").strip(), self.value)
        try:
            number = float(cell)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            number = math.nan
        if math.isnan(number):
            raise ValueError(f"{cell!r} is not a number, which the rule compares it as; fix the row or the rule")
        return EXCLUSION_OPERATORS[self.operator](number, self.value)


def parse_exclusion(rule: str) -> Exclusion:
    """An exclusion rule "COLUMN OP VALUE" (--exclude, a sweep spec's fit.exclude); ValueError naming the
    rule and the fix when it is not one. Whether the column exists is checked against the runs read."""
    match = EXCLUSION_RULE.fullmatch(rule) if isinstance(rule, str) else None
    if match is None:
        raise ValueError(f"exclusion {rule!r} is not a rule; {EXCLUSION_HINT}")
    column, comparison, text = match.groups()
    try:
        value: float | str = float(text)
    except ValueError:
        value = text
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"exclusion {rule!r} compares with nan, which no value equals; {EXCLUSION_HINT}")
    if isinstance(value, str) and comparison not in ("==", "!="):
        raise ValueError(f"exclusion {rule!r}: {comparison} compares numbers and {text!r} is not one; "
                         f"{EXCLUSION_HINT}")
    return Exclusion(rule, column, comparison, value)


def huber_delta(text: str) -> float | str:
    """--huber-delta: a positive number, or "auto" (laws.huber_delta_auto picks it from the noise)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number (in ln L, e.g. 1e-3) nor auto")
    return value


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The `scaletrain fit` arguments; `fit_from_args` consumes them."""
    parser.add_argument("source", type=Path, help="a sweep directory, or a CSV with columns params,tokens,loss "
                        "(a sweep's results.csv too: its done rows, val_loss as the loss)")
    parser.add_argument("--target-flops", type=float, nargs="+", metavar="C",
                        help="budgets to predict the compute-optimal N, D for (default: 10x and 100x the largest run)")
    parser.add_argument("--bootstrap", type=int, default=None,
                        help="bootstrap resamples for the 95%% intervals and the prediction intervals (0: none; "
                        f"default: a sweep directory's fit.bootstrap from its sweep.json, else {DEFAULT_BOOTSTRAP})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    parser.add_argument("--out", type=Path,
                        help="output directory (default: SWEEP/fit, or CSV_STEM_fit beside the CSV)")
    parser.add_argument("--params-column", choices=PARAMS_COLUMNS, default=DEFAULT_PARAMS_COLUMN,
                        help="N: the active parameters (a mixture of experts' routed experts only; a dense model's "
                        "all) with embeddings (Chinchilla) or without (Kaplan et al. 2020), or the totals params, "
                        f"non_embedding_params (default: {DEFAULT_PARAMS_COLUMN})")
    parser.add_argument("--objective", choices=OBJECTIVES, default=None,
                        help="the laws' fitting objective on ln L (default: a sweep directory's fit.objective, else "
                        "huber: robust to a few outlying runs)")
    parser.add_argument("--huber-delta", type=huber_delta, default=None, metavar="X|auto",
                        help="the Huber delta in ln L (default: a sweep directory's fit.huber_delta, else auto: "
                        "1.345 x the run-to-run sigma, or the residual sd of a least-squares fit without seed "
                        "repeats; Hoffmann et al. 2022 used 1e-3)")
    parser.add_argument("--forms", nargs="+", metavar="NAME",
                        help="the law forms to fit and backtest (default: a sweep directory's fit.forms, else all: "
                        "chinchilla kaplan kaplan_e muennighoff)")
    parser.add_argument("--exclude", nargs="+", metavar="RULE", default=None,
                        help='runs not to fit, by rules "COLUMN OP VALUE" on the source\'s columns, OP one of '
                        '< <= > >= == != (e.g. "num_layers < 2"; quote each rule; default: a sweep directory\'s '
                        'fit.exclude, else none)')
    parser.add_argument("--check", type=Path, metavar="HELDOUT",
                        help="runs NOT fitted (a CSV params,tokens,loss or a sweep directory): compare their losses "
                        "with the predictions (the chosen law's; under a tie the median of the tied forms' "
                        "mixture); writes check.csv and check.png")
    parser.add_argument("--task-metric", nargs="+", metavar="TASK/METRIC", default=None,
                        help="downstream task metrics to predict at the target budgets (and for --check's runs), as "
                        "results.csv's downstream/TASK/METRIC columns name them (e.g. english_next_line/acc; "
                        "several, or comma-separated): a loss by its law, an accuracy by a sigmoid of the task's "
                        "loss (Bhagia et al. 2024; default: every metric the runs record)")
    parser.add_argument("--task-loss", metavar="METRIC", default=None,
                        help="the task loss an accuracy is a sigmoid of (default: gold_loss, else bits_per_byte, "
                        "the first the task records)")
