"""objectives.png from curves.json (written by run.py): validation loss against training FLOPs for every
arm that ran (left), and each encoder arm's headline accuracy against the same FLOPs (right).

    python experiments/objectives_equal_compute/plot.py [--out experiments/objectives_equal_compute]

The losses are each objective's own training loss on validation data (MLM + NSP for BERT, + SBO for
SpanBERT, T5's loss over its dropped spans, BART's over the whole text), so the left panel shows how
each objective falls, not which model is better; masked-token accuracy compares the MLM arms, and
ELECTRA's replaced-token accuracy (drawn dashed) is a different quantity on the same axis.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)

HERE = Path(__file__).resolve().parent


def plot(curves: dict[str, dict], path: Path) -> None:
    figure, (losses, accuracies) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, curve in curves.items():
        flops = [point["flops"] for point in curve["points"]]
        style = "-" if curve["group"] == "encoder" else "--"
        losses.plot(flops, [point["val_loss"] for point in curve["points"]], style, marker="o", markersize=3,
                    label=f"{name} ({curve['group']})")
        if curve["metric"] != "val_loss":
            dashed = curve["metric"] != "val_masked_accuracy"
            accuracies.plot(flops, [point[curve["metric"]] for point in curve["points"]], "--" if dashed else "-",
                            marker="o", markersize=3, label=f"{name}: {curve['metric'].removeprefix('val_')}")
    losses.set(xlabel="training FLOPs", ylabel="validation loss (each objective's own; log scale)",
               title="Validation loss at equal training compute", yscale="log")  # ELECTRA's is ~25
    accuracies.set(xlabel="training FLOPs", ylabel="accuracy",
                   title="Encoders: final-metric accuracy (dashed: not masked-token)")
    for axes in (losses, accuracies):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="the folder of curves.json; objectives.png goes there")
    args = parser.parse_args()
    plot(json.loads((args.out / "curves.json").read_text()), args.out / "objectives.png")


if __name__ == "__main__":
    main()
