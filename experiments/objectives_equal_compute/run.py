"""Pretraining objectives at equal training compute: one encoder budget, one encoder-decoder budget.

    python experiments/objectives_equal_compute/run.py [--arms bert,spanbert] [--data-dir data/english_512]
    python experiments/objectives_equal_compute/plot.py

Every arm is an entry of ARMS: a tiny config of its family, the shape overrides its group shares, and
the validation metric it reports. Its step count is the group's FLOPs budget over the arm's own exact
training FLOPs per step (the family's `counts`: ModelFamily.counts(config).flops_per_token x tokens per
step), so an objective with a costlier head (SpanBERT's SBO, ELECTRA's generator, NSP pairs) trains
fewer steps. Every arm reads the same corpus with the same batch, sequence length and LR schedule.

An arm whose family is not registered (or whose config file is missing) on this checkout is skipped
and listed as pending. Each arm trains as
`scaletrain train` in runs/objectives_equal_compute/<arm>, then its metrics.jsonl is read into
results.csv (final metrics, steps, FLOPs, wall time) and curves.json (validation metrics by FLOPs).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.config import Config
from scaletrain.config_loader import load_config
from scaletrain.families import FAMILIES, model_counts

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Shared by every arm: the English corpus at 512 pieces (cheap heads), one CPU rank, 16 x 128 tokens a
# step, cosine LR 1e-3 -> 1e-4 with 10% warmup, no dropout; validation on 64 fixed sequences.
COMMON = [
    "data.vocab_size=512", "data.loader_workers=0", "model.seq_length=128", "model.dropout=0.0",
    "train.micro_batch_size=16", "train.grad_accum=1", "train.lr=1.0e-3", "train.min_lr=1.0e-4",
    "train.warmup_fraction=0.1", "train.eval_samples=64", "checkpoint.every=1000000", "tracking.wandb=disabled",
]
# Model shapes (--shape): each encoder arm's stack, and the encoder-decoder arms' two stacks of it; the
# default budgets (training FLOPs per arm, forward + backward) go with them.
SHAPES = {
    "small": (["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.ffn_hidden_size=256"], 2e12),
    "medium": (["model.num_layers=4", "model.hidden_size=128", "model.num_heads=4", "model.ffn_hidden_size=512"],
               1.6e13),
}
SHAPE = "small"
ENCODER = "encoder"  # stands for the shape's encoder overrides in an arm's overrides
SEQ2SEQ = "seq2seq"  # ... for the encoder-decoder arms' overrides
GROUPS = ("encoder", "seq2seq")
EVALUATIONS = 8  # validation points per run, at equal fractions of its steps


@dataclass(frozen=True)
class Arm:
    """One objective: its family's tiny config, overrides, group (budget) and headline metric."""

    family: str
    config: str  # under configs/
    group: str  # encoder | seq2seq
    overrides: list[str] = field(default_factory=list)
    metric: str = "val_masked_accuracy"  # the final metric the README compares within the group
    note: str = ""


ARMS = {
    # BERT: [CLS] A [SEP] B [SEP] pairs with next-sentence prediction (Devlin et al. 2019). Masking is
    # dynamic in this project for every arm (data/masking.py: noise from (seed, global index)); under
    # one epoch static and dynamic masking do not differ, so NSP pairs are what sets BERT apart here.
    "bert": Arm("bert", "bert_tiny.yaml", "encoder", [ENCODER, "objective.sentence_pairs=nsp"],
                note="MLM + NSP on sentence pairs; val_loss includes the NSP term"),
    # RoBERTa: packed full sentences, no NSP, dynamic masking (Liu et al. 2019, sec. 4.1-4.2).
    "roberta": Arm("bert", "bert_tiny.yaml", "encoder", [ENCODER], note="MLM on packed text"),
    # SpanBERT: geometric spans + the span boundary objective, no NSP (Joshi et al. 2020).
    "spanbert": Arm("bert", "bert_tiny.yaml", "encoder",
                    [ENCODER, "objective.span_masking=true", "objective.span_boundary=true"],
                    note="span MLM + SBO; val_loss includes the SBO term"),
    # ALBERT: factorized embedding + one shared block, MLM + SOP (Lan et al. 2020).
    "albert": Arm("albert", "albert_tiny.yaml", "encoder", [ENCODER, "model.embedding_size={half}"],
                  note="MLM + SOP, shared layers; val_loss includes the SOP term"),
    # ELECTRA: replaced-token detection with a 1/4-width generator (Clark et al. 2020). Its metric is
    # the discriminator's accuracy on replaced tokens: not comparable with masked-token accuracy.
    "electra": Arm("electra", "electra_tiny.yaml", "encoder",
                   [ENCODER, "model.embedding_size={half}", "model.generator_hidden_size={quarter}",
                    "model.generator_num_heads=1"],
                   metric="val_replaced_accuracy", note="generator MLM + 50 x discriminator RTD"),
    # T5: span corruption, 15% in spans of mean 3, sentinels (Raffel et al. 2020, sec. 3.3.4).
    "t5": Arm("t5", "t5_tiny.yaml", "seq2seq", [SEQ2SEQ], metric="val_loss",
              note="predicts the dropped spans only"),
    # BART: text infilling alone, 30% in Poisson(3) spans, one [MASK] each (Lewis et al. 2020, sec. 2.2).
    "bart": Arm("bart", "bart_tiny.yaml", "seq2seq", [SEQ2SEQ, "objective.noising=[text_infilling]"],
                metric="val_loss", note="reconstructs the whole text"),
}


def shape_overrides(overrides: list[str], shape: str) -> list[str]:
    """An arm's overrides with the ENCODER / SEQ2SEQ markers replaced by `shape`'s stack, and {half} /
    {quarter} by that fraction of its hidden size (ALBERT's and ELECTRA's embedding, ELECTRA's generator)."""
    stack = SHAPES[shape][0]
    values = dict(override.split("=") for override in stack)
    hidden, layers = int(values["model.hidden_size"]), values["model.num_layers"]
    expanded = {ENCODER: stack, SEQ2SEQ: [*stack, f"model.num_decoder_layers={layers}"]}
    return [item.format(half=hidden // 2, quarter=hidden // 4)
            for override in overrides for item in expanded.get(override, [override])]


def arm_overrides(name: str, data_dir: Path, run_root: Path, steps: int, shape: str = SHAPE) -> list[str]:
    return [f"data.dir={data_dir}", f"run.dir={run_root / name}", *COMMON,
            *shape_overrides(ARMS[name].overrides, shape), f"train.steps={steps}",
            f"train.eval_every={max(1, steps // EVALUATIONS)}"]


def arm_config(name: str, data_dir: Path, run_root: Path, steps: int = 1, shape: str = SHAPE) -> Config:
    return load_config(REPO / "configs" / ARMS[name].config, arm_overrides(name, data_dir, run_root, steps, shape))


def missing_reason(name: str) -> str | None:
    """Why an arm cannot run on this checkout (its family or config is not here yet), or None."""
    arm = ARMS[name]
    if arm.family not in FAMILIES:
        return f"family {arm.family} is not registered (families/__init__.py)"
    if not (REPO / "configs" / arm.config).exists():
        return f"configs/{arm.config} does not exist"
    return None


def planned_steps(name: str, data_dir: Path, run_root: Path, budget: float, shape: str = SHAPE
                  ) -> tuple[int, float, int]:
    """(steps, FLOPs per step, tokens per step) that spend `budget` training FLOPs."""
    config = arm_config(name, data_dir, run_root, shape=shape)
    tokens_per_step = config.global_batch_size(1) * config.model.seq_length
    flops_per_step = model_counts(config).flops_per_token * tokens_per_step
    return round(budget / flops_per_step), flops_per_step, tokens_per_step


def train(name: str, data_dir: Path, run_root: Path, steps: int, shape: str = SHAPE) -> float:
    """`scaletrain train` for the arm from scratch; its wall time in seconds (start-up included)."""
    run_dir = run_root / name
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists; remove it (or pass another --run-root) to train {name} afresh")
    command = [sys.executable, "-m", "scaletrain", "train", str(REPO / "configs" / ARMS[name].config),
               *arm_overrides(name, data_dir, run_root, steps, shape)]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    return time.perf_counter() - started


def read_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of metrics.jsonl, a later record of a step replacing an earlier."""
    training, validation = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        (validation if "val_loss" in record else training)[record["step"]] = record
    return [training[step] for step in sorted(training)], [validation[step] for step in sorted(validation)]


def summarize(name: str, run_root: Path, steps: int, flops_per_step: float, tokens_per_step: int,
              wall_s: float) -> tuple[dict, dict]:
    """One results.csv row and the arm's validation curve (metrics by training FLOPs)."""
    arm = ARMS[name]
    training, validation = read_run(run_root / name)
    final = validation[-1]
    row = {"arm": name, "family": arm.family, "group": arm.group, "steps": steps,
           "flops": steps * flops_per_step, "tokens": steps * tokens_per_step, "metric": arm.metric,
           "final_metric": final[arm.metric], "final_val_loss": final["val_loss"],
           "final_train_loss": training[-1]["loss"], "train_s": sum(r["step_time_s"] for r in training),
           "wall_s": wall_s, "note": arm.note}
    curve = {"group": arm.group, "metric": arm.metric,
             "points": [{"flops": record["step"] * flops_per_step,
                         **{key: value for key, value in record.items() if key.startswith("val_")}}
                        for record in validation]}
    return row, curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (default: all)")
    parser.add_argument("--data-dir", type=Path, default=REPO / "data" / "english_512")
    parser.add_argument("--run-root", type=Path, default=REPO / "runs" / "objectives_equal_compute")
    parser.add_argument("--shape", choices=list(SHAPES), default=SHAPE,
                        help="model shape; results go to --out, or for `medium` its medium/ subfolder")
    parser.add_argument("--out", type=Path, default=None, help="where results.csv and curves.json go")
    for group in GROUPS:
        parser.add_argument(f"--{group}-flops", type=float, default=None,
                            help=f"{group} arms' training FLOPs (default: the shape's budget)")
    args = parser.parse_args()
    args.out = args.out or (HERE if args.shape == SHAPE else HERE / args.shape)
    budgets = {group: getattr(args, f"{group}_flops") or SHAPES[args.shape][1] for group in GROUPS}
    rows, curves = read_results(args.out)  # arms not run now keep their earlier results
    for name in args.arms.split(","):
        reason = missing_reason(name)
        if reason:
            print(f"{name}: pending, {reason}", file=sys.stderr)
            continue
        steps, flops_per_step, tokens_per_step = planned_steps(name, args.data_dir, args.run_root,
                                                               budgets[ARMS[name].group], args.shape)
        print(f"{name}: {steps} steps x {flops_per_step:.4g} FLOPs = {steps * flops_per_step:.4g}", file=sys.stderr)
        wall_s = train(name, args.data_dir, args.run_root, steps, args.shape)
        rows[name], curves[name] = summarize(name, args.run_root, steps, flops_per_step, tokens_per_step, wall_s)
        write_results(args.out, rows, curves)


def read_results(out: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    if not (out / "results.csv").exists():
        return {}, {}
    rows = {row["arm"]: row for row in csv.DictReader((out / "results.csv").open())}
    return rows, json.loads((out / "curves.json").read_text())


def write_results(out: Path, rows: dict[str, dict], curves: dict[str, dict]) -> None:
    """results.csv and curves.json in ARMS order."""
    out.mkdir(parents=True, exist_ok=True)
    ordered = [name for name in ARMS if name in rows]
    with (out / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[ordered[0]]))
        writer.writeheader()
        writer.writerows(rows[name] for name in ordered)
    (out / "curves.json").write_text(json.dumps({name: curves[name] for name in ordered}, indent=1) + "\n")


if __name__ == "__main__":
    main()
