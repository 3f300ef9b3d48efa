"""Dense vs mixture-of-experts decoders at equal training compute, and document masking on vs off.

    python experiments/moe_equal_compute/run.py [--runs dense-2e12,moe-2e12] [--data-dir data/english_512]
    python experiments/moe_equal_compute/run.py --plan   # steps, parameters and FLOPs of every run; trains nothing
    python experiments/moe_equal_compute/plot.py

Every budget (BUDGETS) has its own llama shape, and every arm (ARMS) trains at it: `dense` is
configs/llama_tiny.yaml at that shape; `moe` is configs/mixtral_tiny.yaml (8 SwiGLU experts, top-2,
dropless, Switch load balancing 0.01 + router z-loss 0.001) at the same shape with experts of half the
dense FFN width, so the two experts a token runs cost what the dense MLP does and the active
parameters differ by the router alone. A run's step count is its budget over its own exact training
FLOPs per step (`model_counts(config).flops_per_token` x tokens per step: active experts and router
included), so each run spends its budget to within one step. `dense-docmask` is the dense arm with
document masking and per-document positions, at one budget; `-seed2` runs repeat an arm with
another seed (weights and data order) for the seed noise.

Each run trains as `scaletrain train` in runs/moe_equal_compute/<run>, then its metrics.jsonl is read
into results.csv (parameters, FLOPs, tokens, steps, final validation loss, tokens/s, wall time) and
curves.json (validation loss by training FLOPs).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.config import Config
from scaletrain.config_loader import load_config
from scaletrain.families import model_counts

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Shared by every run: the English corpus at 512 pieces, one CPU rank, 16 x 128 tokens a step, cosine LR
# 3e-3 -> 3e-4 with 10% warmup (the ladder's tuned rule, experiments/ladder_english, gives 2.8e-3 to
# 3.7e-3 for dense models of these sizes), no dropout; validation on the same 256 sequences for every run.
COMMON = [
    "data.vocab_size=512", "data.loader_workers=0", "model.seq_length=128", "model.dropout=0.0",
    "train.micro_batch_size=16", "train.grad_accum=1", "train.lr=3.0e-3", "train.min_lr=3.0e-4",
    "train.warmup_fraction=0.1", "train.eval_samples=256", "checkpoint.every=1000000", "tracking.wandb=disabled",
]
EVALUATIONS = 8  # validation points per run, at equal fractions of its steps
# The runs at the document-masking budget are also evaluated on the whole validation split (6,816 sequences):
# the 256-sequence prefix holds no document boundary, so masking changes nothing in its forward pass.
FULL_VALIDATION_BUDGET = "5e12"
WHOLE_SPLIT = 10**9  # more sequences than the split holds: evaluation_samples reads all of it
# One intra-op thread per run: beside the other sessions' test suites on this shared 2-core machine a
# two-thread process waits for its descheduled thread at every parallel op (probe: 1-50K tokens/s swinging
# step to step with two threads, a steady 40K with one).
THREADS = 1


@dataclass(frozen=True)
class Budget:
    """Training FLOPs per run and the llama shape that spends them: 13-22 tokens per dense parameter, near
    the compute-optimal sizes of the ladder (experiments/ladder_english: 141K at 5.6e12, 241K at 1e13)."""

    flops: float
    layers: int
    hidden: int
    ffn: int  # the dense SwiGLU width, 8h/3 rounded up to a multiple of 16 (llama_tiny's rule)

    def shape(self) -> list[str]:
        return [f"model.num_layers={self.layers}", f"model.hidden_size={self.hidden}", "model.num_heads=4",
                "model.num_kv_heads=2", f"model.ffn_hidden_size={self.ffn}"]


BUDGETS = {
    "2e12": Budget(2e12, layers=2, hidden=64, ffn=176),
    "5e12": Budget(5e12, layers=2, hidden=80, ffn=224),
    "1.25e13": Budget(1.25e13, layers=3, hidden=80, ffn=224),
}
HALF_FFN = "{half_ffn}"  # an expert's width: half the budget's dense FFN


@dataclass(frozen=True)
class Arm:
    """One model variant: its config under configs/ and its overrides on top of the budget's shape."""

    config: str
    overrides: list[str] = field(default_factory=list)
    note: str = ""


ARMS = {
    "dense": Arm("llama_tiny.yaml", note="llama, SwiGLU FFN"),
    # Mixtral-style (Jiang et al. 2024): 8 experts, top-2, dropless; experts of half width keep the active
    # FLOPs at the dense model's plus the router's 2·h·8 per token and layer.
    "moe": Arm("mixtral_tiny.yaml", [f"model.moe.ffn_hidden_size={HALF_FFN}"],
               note="8 experts of half the dense FFN, top-2, dropless"),
    # Document masking (Megatron's reset_attention_mask; Llama 3 sec. 3.2) with positions restarting at each
    # document; for llama's rotary positions the restart changes nothing once masking is on (README).
    "dense-docmask": Arm("llama_tiny.yaml", ["model.document_masking=true", "model.document_positions=true"],
                         note="dense with document masking and per-document positions"),
}


@dataclass(frozen=True)
class Run:
    arm: str
    budget: str
    seed: int = 1234

    @property
    def name(self) -> str:
        return f"{self.arm}-{self.budget}" + ("" if self.seed == 1234 else f"-seed{self.seed}")


RUNS = {run.name: run for run in [
    *(Run(arm, budget) for budget in BUDGETS for arm in ("dense", "moe")),
    Run("dense-docmask", "5e12"),
    Run("dense", "2e12", seed=2), Run("moe", "2e12", seed=2),
]}


def run_overrides(run: Run, data_dir: Path, run_root: Path, steps: int) -> list[str]:
    budget = BUDGETS[run.budget]
    arm = [item.format(half_ffn=budget.ffn // 2) for item in ARMS[run.arm].overrides]
    return [f"data.dir={data_dir}", f"run.dir={run_root / run.name}", *COMMON, *budget.shape(), *arm,
            f"train.seed={run.seed}", f"train.steps={steps}", f"train.eval_every={max(1, steps // EVALUATIONS)}"]


def run_config(run: Run, data_dir: Path, run_root: Path, steps: int = 1) -> Config:
    return load_config(REPO / "configs" / ARMS[run.arm].config, run_overrides(run, data_dir, run_root, steps))


def planned_steps(run: Run, data_dir: Path, run_root: Path) -> tuple[int, float, int]:
    """(steps, FLOPs per step, tokens per step) that spend the run's budget of training FLOPs."""
    config = run_config(run, data_dir, run_root)
    tokens_per_step = config.global_batch_size(1) * config.model.seq_length
    flops_per_step = model_counts(config).flops_per_token * tokens_per_step
    return round(BUDGETS[run.budget].flops / flops_per_step), flops_per_step, tokens_per_step


def train(run: Run, data_dir: Path, run_root: Path, steps: int, threads: int = THREADS) -> float:
    """`scaletrain train` for the run from scratch; its wall time in seconds (start-up included)."""
    run_dir = run_root / run.name
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists; remove it (or pass another --run-root) to train {run.name} afresh")
    command = [sys.executable, "-m", "scaletrain", "train", str(REPO / "configs" / ARMS[run.arm].config),
               *run_overrides(run, data_dir, run_root, steps)]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - started


def read_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of metrics.jsonl, a later record of a step replacing an earlier."""
    training, validation = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        (validation if "val_loss" in record else training)[record["step"]] = record
    return [training[step] for step in sorted(training)], [validation[step] for step in sorted(validation)]


def summarize(run: Run, data_dir: Path, run_root: Path, steps: int, flops_per_step: float,
              tokens_per_step: int, wall_s: float, threads: int = THREADS) -> tuple[dict, dict]:
    """One results.csv row and the run's validation curve (loss by training FLOPs).

    tokens/s is tokens per step over the median step time: the other sessions' test suites on this shared
    machine stretch some steps many-fold, and the median is the speed of the steps they left alone."""
    counts = model_counts(run_config(run, data_dir, run_root))
    training, validation = read_run(run_root / run.name)
    step_times = [record["step_time_s"] for record in training]
    row = {"run": run.name, "arm": run.arm, "budget": run.budget, "seed": run.seed,
           "shape": f"l{BUDGETS[run.budget].layers}-h{BUDGETS[run.budget].hidden}",
           "total_params": counts.total_params, "active_params": counts.active_params,
           "flops_per_token": counts.flops_per_token, "steps": steps, "tokens": steps * tokens_per_step,
           "flops": steps * flops_per_step, "final_val_loss": validation[-1]["val_loss"],
           "final_train_loss": training[-1]["loss"], "tokens_per_s": tokens_per_step / statistics.median(step_times),
           "train_s": sum(step_times), "wall_s": wall_s, "final_aux_loss": training[-1].get("moe/aux_loss", ""),
           "full_val_loss": full_validation_loss(run, run_root, threads), "note": ARMS[run.arm].note}
    curve = {"arm": run.arm, "budget": run.budget, "seed": run.seed,
             "points": [{"flops": record["step"] * flops_per_step, "val_loss": record["val_loss"]}
                        for record in validation]}
    return row, curve


def full_validation_loss(run: Run, run_root: Path, threads: int = THREADS) -> float | str:
    """The final checkpoint's val_loss over the whole validation split (`scaletrain eval`, in its own process
    as training is), for runs at FULL_VALIDATION_BUDGET; '' for the others."""
    if run.budget != FULL_VALIDATION_BUDGET:
        return ""
    command = [sys.executable, "-m", "scaletrain", "eval", str(run_root / run.name), "--samples", str(WHOLE_SPLIT)]
    output = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return float(next(line.split()[1] for line in output.splitlines() if line.startswith("val_loss ")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated runs (default: all)")
    parser.add_argument("--data-dir", type=Path, default=REPO / "data" / "english_512")
    parser.add_argument("--run-root", type=Path, default=REPO / "runs" / "moe_equal_compute")
    parser.add_argument("--out", type=Path, default=HERE, help="where results.csv and curves.json go")
    parser.add_argument("--threads", type=int, default=THREADS, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--plan", action="store_true", help="print each run's steps and counts, train nothing")
    args = parser.parse_args()
    rows, curves = read_results(args.out)  # runs not made now keep their earlier results
    for name in args.runs.split(","):
        run = RUNS[name]
        steps, flops_per_step, tokens_per_step = planned_steps(run, args.data_dir, args.run_root)
        counts = model_counts(run_config(run, args.data_dir, args.run_root))
        print(f"{name}: {counts.total_params:,} parameters ({counts.active_params:,} active), {steps} steps x "
              f"{flops_per_step:.4g} FLOPs = {steps * flops_per_step:.4g}", file=sys.stderr)
        if args.plan:
            continue
        wall_s = train(run, args.data_dir, args.run_root, steps, args.threads)
        rows[name], curves[name] = summarize(run, args.data_dir, args.run_root, steps, flops_per_step,
                                             tokens_per_step, wall_s, args.threads)
        write_results(args.out, rows, curves)


def read_results(out: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    if not (out / "results.csv").exists():
        return {}, {}
    rows = {row["run"]: row for row in csv.DictReader((out / "results.csv").open())}
    return rows, json.loads((out / "curves.json").read_text())


def write_results(out: Path, rows: dict[str, dict], curves: dict[str, dict]) -> None:
    """results.csv and curves.json in RUNS order."""
    out.mkdir(parents=True, exist_ok=True)
    ordered = [name for name in RUNS if name in rows]
    with (out / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[ordered[0]]))
        writer.writeheader()
        writer.writerows(rows[name] for name in ordered)
    (out / "curves.json").write_text(json.dumps({name: curves[name] for name in ordered}, indent=1) + "\n")


if __name__ == "__main__":
    main()
