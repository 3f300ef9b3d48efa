"""Pick the extrapolation check from the sweep's fit: at a budget above the sweep, the predicted
compute-optimal model and models about 2x smaller and 2x larger, with Approach 3's predicted losses.

    python experiments/isoflop_english/choose_check.py sweeps/isoflop_english/fit/fit.json 6e13

The candidates are the shapes of the sweep's own rule (hidden = 16 x layers, 16-wide heads); each
trains D = C / FLOPs-per-token(N) tokens with the project's exact count, as the sweep did, and its
loss is predicted by the fitted L(N, D). The optimum is the candidate with the lowest prediction
(the closed form N* = G (C/6)^a assumes C = 6ND, which undercounts attention and the LM head).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from scaletrain.config_loader import load_config
from scaletrain.families import model_counts

REPO = Path(__file__).resolve().parents[2]


def candidates(base_config: Path, budget: float, max_layers: int = 16) -> list[dict]:
    base = load_config(base_config)
    rows = []
    for layers in range(1, max_layers + 1):
        model = dataclasses.replace(base.model, num_layers=layers, hidden_size=16 * layers, num_heads=layers)
        counts = model_counts(dataclasses.replace(base, model=model))
        tokens_per_step = base.train.global_batch_size * base.model.seq_length
        steps = round(budget / counts.flops_per_token / tokens_per_step)
        rows.append({"num_layers": layers, "hidden_size": 16 * layers, "num_heads": layers,
                     "params": counts.total_params, "tokens": steps * tokens_per_step, "steps": steps})
    return rows


def main(fit_path: str, budget: str) -> None:
    fit = json.loads(Path(fit_path).read_text())
    law = fit["approach3"]
    budget_flops = float(budget)
    rows = candidates(REPO / "configs" / "gpt_english.yaml", budget_flops)
    for row in rows:
        row["predicted_loss"] = law["E"] + law["A"] / row["params"] ** law["alpha"] + law["B"] / row["tokens"] ** law[
            "beta"]
    best = min(rows, key=lambda row: row["predicted_loss"])
    smaller = min(rows, key=lambda row: abs(row["params"] / best["params"] - 0.5))
    larger = min(rows, key=lambda row: abs(row["params"] / best["params"] - 2.0))
    for row in rows:
        mark = " <- optimum" if row is best else (" <- ~2x smaller" if row is smaller else
                                                    (" <- ~2x larger" if row is larger else ""))
        print(f"l{row['num_layers']:>2} h{row['hidden_size']:>3}  N {row['params']:>9,}  D {row['tokens']:>11,}  "
              f"predicted loss {row['predicted_loss']:.4f}{mark}")
    print(json.dumps({"budget": budget_flops, "shapes": [
        {key: row[key] for key in ("num_layers", "hidden_size", "num_heads")} for row in (smaller, best, larger)],
        "predicted_loss": {f"l{row['num_layers']}": row["predicted_loss"] for row in (smaller, best, larger)}}))


if __name__ == "__main__":
    main(*sys.argv[1:])
