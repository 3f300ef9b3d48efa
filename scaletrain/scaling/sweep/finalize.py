"""The end of a sweep: fit the finished runs (scaling/fit_source.py) and log one W&B summary run in
the sweep's group with the results table, the fitted constants and the plots."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from scaletrain.config import load_config
from scaletrain.scaling.sweep.layout import FIT_DIR
from scaletrain.scaling.sweep.spec import SweepSpec


def fit_and_log(sweep_dir: Path, spec: SweepSpec, rows: list[dict[str, Any]]) -> str:
    """Fit into SWEEP/fit/ where the finished runs allow it, then log the summary run; returns the report."""
    from scaletrain.scaling.fit_source import fit_sweep_directory

    done = sum(row["status"] == "done" for row in rows)
    try:
        report, fit_json, plots = fit_sweep_directory(
            sweep_dir, out_dir=sweep_dir / FIT_DIR, target_flops=spec.fit.target_flops or None,
            bootstrap=spec.fit.bootstrap, params_column=spec.fit.params_column,
        )
    except ValueError as error:
        report, fit_json, plots = f"fit skipped ({done} of {len(rows)} runs done): {error}\n", None, []
    return report + log_summary_run(sweep_dir, spec, rows, fit_json, plots)


def log_summary_run(
    sweep_dir: Path, spec: SweepSpec, rows: list[dict[str, Any]], fit_json: dict[str, Any] | None, plots: list[Path]
) -> str:
    base = load_config(spec.base, spec.overrides)
    if base.tracking.wandb == "disabled":
        return "W&B summary run skipped (tracking.wandb=disabled)\n"
    import wandb  # deferred: importing wandb costs seconds

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=base.tracking.project, group=spec.name, job_type="sweep-summary", name=f"{spec.name}-summary",
        tags=[spec.name, spec.mode, "summary"], dir=str(sweep_dir), mode=base.tracking.wandb,
        id=hashlib.sha1(f"{sweep_dir.resolve()}/summary".encode()).hexdigest()[:16], resume="allow",
        config={"sweep": spec.to_dict()},
    )
    columns = list(rows[0]) if rows else []
    values: dict[str, Any] = {"results": wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])}
    values.update({f"plots/{path.stem}": wandb.Image(str(path)) for path in plots})
    run.log(values)
    if fit_json is not None:
        run.summary.update(flatten_scalars(fit_json))
    run.finish()
    return f"logged W&B summary run {spec.name}-summary (group {spec.name}, mode {base.tracking.wandb})\n"


def flatten_scalars(tree: Any, prefix: str = "") -> dict[str, float]:
    """{'approach3/alpha': 0.34, ...}: the numbers of fit.json, for the W&B summary (lists of points skipped)."""
    flat: dict[str, float] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            flat.update(flatten_scalars(value, f"{prefix}{key}/"))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        flat[prefix.rstrip("/")] = tree
    elif isinstance(tree, list) and len(tree) == 2 and all(isinstance(v, (int, float)) for v in tree):
        flat[f"{prefix.rstrip('/')}_low"], flat[f"{prefix.rstrip('/')}_high"] = tree
    return flat


def read_fit_json(sweep_dir: Path) -> dict[str, Any] | None:
    path = sweep_dir / FIT_DIR / "fit.json"
    return json.loads(path.read_text()) if path.is_file() else None
