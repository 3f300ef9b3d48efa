"""Run `scaletrain train` as a user does (a subprocess, under torchrun for several ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "gpt_tiny.yaml"


def tiny_overrides(data_dir: Path, run_dir: Path) -> list[str]:
    """A 2-layer GPT on the small test dataset (see tests/conftest.py), global batch 8."""
    return [
        f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", "data.loader_workers=1",
        f"run.dir={run_dir}",
        "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=32",
        "train.micro_batch_size=4", "train.global_batch_size=8", "train.grad_accum=1",
        "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=2", "train.eval_samples=16",
        "tracking.wandb=disabled",
    ]


def run_scaletrain(command: str, args: list[str], nproc: int = 1, timeout: int = 600) -> str:
    """Run a scaletrain command; fail the test with the tail of its output if it fails."""
    if nproc == 1:
        launcher = [sys.executable, "-m", "scaletrain"]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "-m", "scaletrain"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    result = subprocess.run(
        [*launcher, command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise AssertionError(f"scaletrain {command} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def read_metrics(run_dir: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """(training records by step, val_loss by step); a later record of a step replaces an earlier one."""
    training, validation = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val_loss" in record:
            validation[record["step"]] = record["val_loss"]
        else:
            training[record["step"]] = record
    return training, validation
