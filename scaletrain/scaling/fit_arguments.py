"""The `scaletrain fit` arguments, apart from the fitting code (scipy, matplotlib: 2 s to import),
so every other command's start stays fast; fit_source.fit_from_args consumes them."""

from __future__ import annotations

import argparse
from pathlib import Path

# Which N: a mixture of experts' active parameters (what a token meets) or its total, each with or without
# embeddings; a dense model's active and total are equal. An active column a CSV lacks (results written
# before it existed) falls back to its total (fit_inputs.py).
PARAMS_COLUMNS = ("active_params", "active_non_embedding_params", "params", "non_embedding_params")
DEFAULT_PARAMS_COLUMN = "active_params"
DEFAULT_BOOTSTRAP = 100
OBJECTIVES = ("huber", "least_squares")  # laws.OBJECTIVES, repeated so `--help` needs no scipy


def huber_delta(text: str) -> float | None:
    """--huber-delta: a positive number, or `auto` (None: laws.huber_delta_auto picks it from the noise)."""
    if text == "auto":
        return None
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
    parser.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP,
                        help="bootstrap resamples for the 95%% intervals (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    parser.add_argument("--out", type=Path,
                        help="output directory (default: SWEEP/fit, or CSV_STEM_fit beside the CSV)")
    parser.add_argument("--params-column", choices=PARAMS_COLUMNS, default=DEFAULT_PARAMS_COLUMN,
                        help="N: the active parameters (a mixture of experts' routed experts only; a dense model's "
                        "all) with embeddings (Chinchilla) or without (Kaplan et al. 2020), or the totals params, "
                        f"non_embedding_params (default: {DEFAULT_PARAMS_COLUMN})")
    parser.add_argument("--objective", choices=OBJECTIVES, default="huber",
                        help="the laws' fitting objective on ln L (default huber: robust to a few outlying runs)")
    parser.add_argument("--huber-delta", type=huber_delta, default=None, metavar="X|auto",
                        help="the Huber delta in ln L (default auto: 1.345 x the run-to-run sigma, or the "
                        "residual sd of a least-squares fit without seed repeats)")
    parser.add_argument("--forms", nargs="+", metavar="NAME",
                        help="the law forms to fit and backtest (default: all, e.g. chinchilla kaplan kaplan_e "
                        "muennighoff)")
    parser.add_argument("--check", type=Path, metavar="HELDOUT",
                        help="runs NOT fitted (a CSV params,tokens,loss or a sweep directory): compare their losses "
                        "with the chosen law's predictions; writes check.csv and check.png")
