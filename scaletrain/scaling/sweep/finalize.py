"""The end of a sweep: fit the finished runs (scaling/fit_source.py) as the spec's `fit:` section says
(forms, objective, Huber delta, exclusions) and log one W&B summary run in the sweep's group with the
results table, the fitted constants and the plots."""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.config_loader import load_config
from scaletrain.scaling.sweep.ladder_plot import write_ladder_plot
from scaletrain.scaling.sweep.layout import FIT_DIR, RESULTS_FILE
from scaletrain.scaling.sweep.results import result_columns
from scaletrain.scaling.sweep.spec import SweepSpec


@dataclass(frozen=True)
class Finalized:
    """What the end of a sweep did (report), and why its fit failed entirely (None: it did not)."""

    report: str
    fit_failure: str | None = None


def fit_and_log(sweep_dir: Path, spec: SweepSpec, rows: list[dict[str, Any]]) -> Finalized:
    """Fit into SWEEP/fit/ where the finished runs allow it, then log the summary run. A fit that fails
    entirely (no approach or form could run, bad rows) is reported, not raised: the summary run is
    still logged, and the caller exits non-zero (fail_on_fit)."""
    from scaletrain.scaling.fit_source import fit_sweep_directory  # on use for speed: scipy and matplotlib

    done = sum(row["status"] == "done" for row in rows)
    failure = None
    try:
        report, fit_json, plots = fit_sweep_directory(
            sweep_dir, out_dir=sweep_dir / FIT_DIR, target_flops=spec.fit.target_flops or None,
            bootstrap=spec.fit.bootstrap, params_column=spec.fit.params_column, objective=spec.fit.objective,
            huber_delta=spec.fit.huber_delta_value(), forms=tuple(spec.fit.forms) or None,
            exclude=list(spec.fit.exclude),
        )
    except ValueError as error:
        failure = (f"the fit failed ({done} of {len(rows)} runs done): {error}; the training results stay in "
                   f"{sweep_dir / RESULTS_FILE}")
        report, fit_json, plots = f"fit failed: {error}\n", None, []
    if spec.mode == "ladder":
        ladder_plot = write_ladder_plot(sweep_dir)
        if ladder_plot is not None:
            report += f"wrote {ladder_plot}\n"
            plots = [*plots, ladder_plot]
    return Finalized(report + log_summary_run(sweep_dir, spec, rows, fit_json, plots), failure)


def fail_on_fit(output: str, finalized: Finalized) -> str:
    """The command's output, or, when the fit failed entirely, that output printed, the reason as one
    line on stderr (as cli.py prints user errors) and exit code 1: a sweep whose fit failed must not
    look successful to a script or a SLURM dependency."""
    if finalized.fit_failure is None:
        return output
    print(output, end="" if output.endswith("\n") else "\n", flush=True)
    print(f"scaletrain sweep: error: {' '.join(finalized.fit_failure.split())}", file=sys.stderr, flush=True)
    raise SystemExit(1)


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
    columns = result_columns(rows)
    values: dict[str, Any] = {"results": wandb.Table(columns=columns, data=[[row.get(c) for c in columns]
                                                                           for row in rows])}
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
