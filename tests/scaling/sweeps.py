"""A tiny IsoFLOP sweep spec on the small test dataset, for the sweep tests (seconds per run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.train.runs import DEMO_CONFIG, tiny_overrides

# Three sizes around 10^5 parameters (most of them the 1024 x d word table) and two budgets a
# factor 2 apart: 25 to 90 steps of 256 tokens per run.
TINY_SHAPES = [
    {"num_layers": 1, "hidden_size": 32, "num_heads": 2},
    {"num_layers": 2, "hidden_size": 48, "num_heads": 2},
    {"num_layers": 2, "hidden_size": 64, "num_heads": 4},
]
TINY_BUDGETS = [1.2e10, 2.4e10]


def tiny_spec(data_dir: Path, sweep_dir: Path, wandb: str = "disabled", **changes: Any) -> dict[str, Any]:
    overrides = [o for o in tiny_overrides(data_dir, sweep_dir / "unused") if not o.startswith("run.dir")]
    spec = {
        "name": "tiny-isoflop",
        "base": str(DEMO_CONFIG),
        "dir": str(sweep_dir),
        "mode": "isoflop",
        "budgets": TINY_BUDGETS,
        "models": {"shapes": TINY_SHAPES},
        "learning_rate": {"lr": 3e-3, "reference_hidden": 64, "width_exponent": 0.5, "min_lr_ratio": 0.1},
        "warmup": {"steps": 2, "fraction": 0.05},
        "seeds": [7],
        "guards": {"min_steps": 1},  # tiny runs of 25-90 steps; a real sweep keeps the default 1,000
        "overrides": [*overrides, f"tracking.wandb={wandb}", "train.eval_samples=32", "tracking.project=tests"],
        "fit": {"bootstrap": 10},
    }
    spec.update(changes)
    return spec


def in_process_loading(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with its runs loading batches in the trainer's own process (no loader worker to start) and
    saving only their last checkpoint: the same batches in the same order, so the same losses, bit for
    bit; for sweeps whose runs are never interrupted (an interrupted run resumes from its checkpoints)."""
    overrides = [o for o in spec["overrides"] if not o.startswith("data.loader_workers=")]
    return {**spec, "overrides": [*overrides, "data.loader_workers=0"], "checkpoints_per_run": 1}


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
