"""The `scaletrain fit` arguments, apart from the fitting code (scipy, matplotlib: 2 s to import),
so every other command's start stays fast; fit_source.fit_from_args consumes them."""

from __future__ import annotations

import argparse
from pathlib import Path

PARAMS_COLUMNS = ("params", "non_embedding_params")
DEFAULT_BOOTSTRAP = 100


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The `scaletrain fit` arguments; `fit_from_args` consumes them."""
    parser.add_argument("source", type=Path, help="a sweep directory, or a CSV with columns params,tokens,loss")
    parser.add_argument("--target-flops", type=float, nargs="+", metavar="C",
                        help="budgets to predict the compute-optimal N, D for (default: 10x and 100x the largest run)")
    parser.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP,
                        help="bootstrap resamples for the 95%% intervals (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    parser.add_argument("--out", type=Path,
                        help="output directory (default: SWEEP/fit, or CSV_STEM_fit beside the CSV)")
    parser.add_argument("--params-column", choices=PARAMS_COLUMNS, default="params",
                        help="N: all parameters (Chinchilla) or without embeddings (Kaplan et al. 2020)")
