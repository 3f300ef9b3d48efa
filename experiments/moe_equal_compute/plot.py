"""moe_equal_compute.png from results.csv and curves.json (written by run.py): validation loss against
training FLOPs for the dense and MoE arms, with parameter counts (left), and training speed (right).

    python experiments/moe_equal_compute/plot.py [--out experiments/moe_equal_compute]

Left: each run's validation curve (thin; a run's own cosine schedule, so only its last point is that
budget's result) and the final losses joined across budgets (thick), labelled with total / active
parameters; second seeds hollow, document masking a triangle. Right: tokens/s (median step) of every
run with the first seed, by budget.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)

HERE = Path(__file__).resolve().parent
COLORS = {"dense": "tab:blue", "moe": "tab:red", "dense-docmask": "tab:green"}
LABELS = {"dense": "dense llama", "moe": "MoE: 8 experts of FFN/2, top-2",
          "dense-docmask": "dense + document masking"}
FIRST_SEED = "1234"


def params_label(row: dict) -> str:
    total, active = int(row["total_params"]), int(row["active_params"])
    return f"{total / 1e3:.0f}K" if total == active else f"{total / 1e3:.0f}K ({active / 1e3:.0f}K active)"


def plot_losses(axes, rows: list[dict], curves: dict[str, dict]) -> None:
    for curve in curves.values():
        points = [point for point in curve["points"] if point["flops"] > 0]  # step 0 has no place on a log axis
        if curve["arm"] != "dense-docmask":
            axes.plot([p["flops"] for p in points], [p["val_loss"] for p in points],
                      color=COLORS[curve["arm"]], alpha=0.3, linewidth=1)
    for arm in ("dense", "moe"):
        finals = [row for row in rows if row["arm"] == arm and row["seed"] == FIRST_SEED]
        axes.plot([float(r["flops"]) for r in finals], [float(r["final_val_loss"]) for r in finals], "o-",
                  color=COLORS[arm], linewidth=2, label=LABELS[arm])
        for row in finals:
            axes.annotate(params_label(row), (float(row["flops"]), float(row["final_val_loss"])),
                          textcoords="offset points", xytext=(-30, -14) if arm == "moe" else (-20, 7), fontsize=7,
                          color=COLORS[arm])
    for row in rows:
        if row["seed"] != FIRST_SEED:
            axes.plot(float(row["flops"]), float(row["final_val_loss"]), "o", markerfacecolor="none",
                      color=COLORS[row["arm"]], label=f"{LABELS[row['arm']]}, seed {row['seed']}")
        elif row["arm"] == "dense-docmask":
            axes.plot(float(row["flops"]), float(row["final_val_loss"]), "^", color=COLORS[row["arm"]],
                      label=LABELS[row["arm"]])
    axes.set(xscale="log", xlabel="training FLOPs (model/counts.py: active experts + router)",
             ylabel="validation loss (256 x 128 tokens)", title="Validation loss at equal training compute",
             ylim=(2.6, 4.0))


def plot_speed(axes, rows: list[dict]) -> None:
    budgets = list(dict.fromkeys(row["budget"] for row in rows))
    arms = [arm for arm in COLORS if any(row["arm"] == arm for row in rows)]
    width = 0.8 / len(arms)
    for index, arm in enumerate(arms):
        for position, budget in enumerate(budgets):
            row = next((r for r in rows if (r["arm"], r["budget"], r["seed"]) == (arm, budget, FIRST_SEED)), None)
            if row is not None:
                axes.bar(position + (index - (len(arms) - 1) / 2) * width, float(row["tokens_per_s"]), width,
                         color=COLORS[arm], label=LABELS[arm] if position == budgets.index(row["budget"]) else None)
    axes.set_xticks(range(len(budgets)),
                    [f"{b} ({next(r['shape'] for r in rows if r['budget'] == b)})" for b in budgets])
    axes.set(xlabel="budget (training FLOPs) and shape", ylabel="tokens/s (median step; 1 process, 1 thread)",
             title="Training speed")
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes.legend(unique.values(), unique.keys(), fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="the folder of results.csv; the PNG goes there")
    args = parser.parse_args()
    rows = list(csv.DictReader((args.out / "results.csv").open()))
    curves = json.loads((args.out / "curves.json").read_text())
    figure, (losses, speed) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    plot_losses(losses, rows, curves)
    plot_speed(speed, rows)
    losses.grid(alpha=0.3)
    losses.legend(fontsize=8)
    speed.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(args.out / "moe_equal_compute.png", dpi=120)


if __name__ == "__main__":
    main()
