"""Compare the extrapolation check's measured losses with the sweep's predictions.

    python experiments/isoflop_english/compare_check.py \
        experiments/isoflop_english/fit/fit.json experiments/isoflop_english/check/results.csv 19454203

For each run of the check (configs/sweeps/isoflop_english_check.yaml): Approach 3's predicted loss
L(N, D) = E + A/N^α + B/D^β, and the same with D replaced by the effective data of a corpus of
U unique tokens seen D/U times, D' = U + U R* (1 - exp(-R/R*)) with R = D/U - 1 repetitions and
R* = 15.4 (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models", eq. 5 and
table 2): the fit assumes fresh data, the check's runs repeat the corpus 1.3 to 4.8 times.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

REPETITION_HALF_LIFE = 15.4  # R*_D of Muennighoff et al. 2023


def effective_tokens(tokens: float, unique: float) -> float:
    if tokens <= unique:
        return tokens
    repetitions = tokens / unique - 1
    return unique + unique * REPETITION_HALF_LIFE * (1 - math.exp(-repetitions / REPETITION_HALF_LIFE))


def main(fit_path: str, results_path: str, unique_tokens: str) -> None:
    law = json.loads(Path(fit_path).read_text())["approach3"]
    unique = float(unique_tokens)

    def predict(params: float, tokens: float) -> float:
        return law["E"] + law["A"] / params ** law["alpha"] + law["B"] / tokens ** law["beta"]

    rows = list(csv.DictReader(Path(results_path).read_text().splitlines()))
    print("| model | N | D | epochs | predicted | predicted, repeated data | measured |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        params, tokens = float(row["params"]), float(row["tokens"])
        name = f"l{row['num_layers']}-h{row['hidden_size']}"
        print(f"| {name} | {params / 1e3:.0f}K | {tokens / 1e6:.1f}M | {tokens / unique:.2f} | "
              f"{predict(params, tokens):.3f} | {predict(params, effective_tokens(tokens, unique)):.3f} | "
              f"{float(row['val_loss']):.3f} |")
    best = min(rows, key=lambda row: float(row["val_loss"]))
    print(f"best measured: l{best['num_layers']}-h{best['hidden_size']}")


if __name__ == "__main__":
    main(*sys.argv[1:])
