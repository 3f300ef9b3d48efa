"""Where each run of a sweep stands, and the sweep's results table (SWEEP_DIR/results.csv).

A run's state comes from its directory, so any process (the local executor, a SLURM array
task, `sweep status` on a login node) reads the same answer:
- done: RUN/summary.json exists (train/loop.py writes it once every step is trained);
- failed: RUN/status.json says so (the executor that ran it recorded the exit code);
- running: RUN/status.json says running and its process is alive on this host, or its SLURM
  array task is still in the queue (queued);
- pending: anything else, including a run interrupted mid-way, which resumes from its checkpoint.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.config import EVAL_ALL, Config
from scaletrain.config_loader import load_config
from scaletrain.data.errors import DataError
from scaletrain.data.manifest import MANIFEST_NAME, SplitInfo, parse_manifest
from scaletrain.data.storage import dataset_location
from scaletrain.scaling.sweep.layout import (
    DOWNSTREAM_PREFIX,
    METRIC_PREFIX,
    PLAN_FILE,
    RESULT_COLUMNS,
    RESULTS_FILE,
    RUN_CONFIG_FILE,
    RUNS_DIR,
    STATUS_FILE,
    TRAIN_LOG,
)
from scaletrain.train.loop import RUN_SUMMARY_FILE

# The final training loss is the mean over the last 5% of steps (at least one): the cosine
# schedule has nearly flattened the curve there, and it averages out batch-to-batch noise.
TRAIN_LOSS_TAIL = 0.05
# How train/evaluation.py computes val_loss: a train.eval_seed sample of train.eval_samples validation
# sequences (or all of them), the loss averaged over every target token read. A new rule gets a new name,
# so that the fingerprint keeps runs evaluated one way out of a fit of runs evaluated another.
EVALUATION_RULE = "seeded_sample_token_weighted_v1"


@dataclass(frozen=True)
class RunStatus:
    state: str  # pending | queued | running | done | failed
    detail: str = ""


def read_status_file(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATUS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_status_file(run_dir: Path, status: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = run_dir / f".{STATUS_FILE}.tmp"
    staging.write_text(json.dumps(status, indent=2) + "\n")
    os.replace(staging, run_dir / STATUS_FILE)


def run_status(run_dir: Path) -> RunStatus:
    if (run_dir / RUN_SUMMARY_FILE).is_file():
        return RunStatus("done")
    status = read_status_file(run_dir)
    state = status.get("state")
    if state == "failed":
        return RunStatus("failed", status.get("reason") or
                         f"exit code {status.get('returncode')}; log: {run_dir / TRAIN_LOG}")
    if state == "running" and _process_alive(status):
        return RunStatus("running", f"pid {status['pid']} on {status['host']}")
    if state in ("queued", "running") and status.get("slurm_job") and _slurm_task_active(status["slurm_job"]):
        return RunStatus("queued" if state == "queued" else "running", f"SLURM job {status['slurm_job']}")
    return RunStatus("pending", "interrupted; resumes from its checkpoint" if state == "running" else "")


def result_row(planned: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One results.csv row: the planned numbers, and the measured ones for a finished run (with its
    downstream task metrics, downstream_metrics, as DOWNSTREAM_PREFIX + TASK/METRIC columns)."""
    status = run_status(run_dir)
    row = {column: planned.get(column) for column in RESULT_COLUMNS}
    row["status"] = status.state
    # run (isoflop, grid), or in a ladder branch (a point of the fit) or stable (no budget: not a point)
    row["role"] = planned.get("role") or "run"
    row["wall_s"] = read_status_file(run_dir).get("wall_s")
    row["val_loss"] = row["train_loss"] = None
    row["data_fingerprint"] = read_status_file(run_dir).get("data_fingerprint") if status.state == "done" else None
    if status.state == "done":
        summary = json.loads((run_dir / RUN_SUMMARY_FILE).read_text())
        row.update(val_loss=summary.get("val_loss"), steps=summary["step"], tokens=summary["tokens"],
                   flops=summary["flops"], train_loss=smoothed_train_loss(run_dir / "metrics.jsonl"))
        row.update({DOWNSTREAM_PREFIX + name: value
                    for name, value in downstream_metrics(summary, run_dir / "metrics.jsonl").items()})
    return row


def downstream_metrics(summary: dict[str, Any], metrics_path: Path) -> dict[str, float]:
    """{TASK/METRIC: value} of a finished run's downstream evaluation at its final step: summary.json's
    METRIC_PREFIX keys, else those metrics.jsonl logged at the summary's step. A value from an earlier step
    is not taken: it belongs to another (N, D) than the row's."""
    recorded = {key: value for key, value in summary.items() if key.startswith(METRIC_PREFIX)}
    if not recorded and metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and record.get("step") == summary["step"]:
                recorded.update({key: value for key, value in record.items() if key.startswith(METRIC_PREFIX)})
    return {key.removeprefix(METRIC_PREFIX): float(value) for key, value in sorted(recorded.items())
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def data_fingerprint(config: Config) -> str:
    """16 hex digits of what makes two runs' losses comparable: per dataset of the blend (with its weight)
    the tokenizer's sha256 and the identity of its train and val splits as the manifest records them (the
    index's and every shard's sha256), model.seq_length, and how the validation loss is computed
    (`evaluation`: train/evaluation.py's rule, train.eval_samples and train.eval_seed, the seed omitted
    where the whole split is read). A corpus re-prepared in any way changes it, and so does the rule: the
    first-N-sequences-in-file-order loss that runs before the seeded sample recorded (as a bare
    `eval_samples`) is another number than the sample's, and its runs get another fingerprint."""
    datasets = []
    for source in config.data.sources():
        location = dataset_location(config.data, source.dir)
        manifest = parse_manifest(location.read_manifest_text(), location.describe(MANIFEST_NAME), location.describe())
        datasets.append({"weight": source.weight, "tokenizer_sha256": manifest.tokenizer_sha256,
                         **{name: _split_identity(split) for name, split in sorted(manifest.splits.items())}})
    samples = config.train.eval_samples
    evaluation = {"rule": EVALUATION_RULE, "eval_samples": samples,
                  "eval_seed": None if samples == EVAL_ALL else config.train.eval_seed}
    identity = {"datasets": datasets, "evaluation": evaluation, "seq_length": config.model.seq_length}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def run_data_fingerprint(run_dir: Path) -> str | None:
    """The fingerprint of the data a run's own config (RUN/run.yaml) names, as it is now: the executor
    records it when the run finishes; None where that data can no longer be read."""
    try:
        return data_fingerprint(load_config(run_dir / RUN_CONFIG_FILE))
    except (DataError, OSError):
        return None


def _split_identity(split: SplitInfo) -> dict[str, Any]:
    return {"index_sha256": split.index_sha256, "num_tokens": split.num_tokens,
            "shards": [shard.sha256 for shard in split.shards]}


def smoothed_train_loss(metrics_path: Path) -> float | None:
    losses = [record["loss"] for _, record in sorted(training_records(metrics_path).items())]
    if not losses:
        return None
    tail = losses[-max(1, math.ceil(TRAIN_LOSS_TAIL * len(losses))):]
    return sum(tail) / len(tail)


def latest_logged_step(metrics_path: Path) -> int:
    """The last step a run logged a training record for (0 before its first): how far a running or
    interrupted run has got, read from its metrics.jsonl while it is being written."""
    return max(training_records(metrics_path), default=0)


def training_records(metrics_path: Path) -> dict[int, dict[str, Any]]:
    """Training records by step; a step logged again after a resume replaces the earlier record."""
    records: dict[int, dict[str, Any]] = {}
    if not metrics_path.is_file():
        return records
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill; the step is logged again on resume
        if "loss" in record:
            records[record["step"]] = record
    return records


def result_columns(rows: list[dict[str, Any]]) -> list[str]:
    """RESULT_COLUMNS, then the downstream columns any row has, sorted: a run that failed, or scored no task,
    has none of them, so no single row's keys are the table's."""
    return [*RESULT_COLUMNS, *sorted({key for row in rows for key in row if key.startswith(DOWNSTREAM_PREFIX)})]


def planned_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """A results.csv row (result_row) for every run of SWEEP/plan.json, read from its run directory now."""
    planned = json.loads((sweep_dir / PLAN_FILE).read_text())["runs"]
    return [result_row(row, sweep_dir / RUNS_DIR / row["name"]) for row in planned]


def write_results_csv(sweep_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """SWEEP_DIR/results.csv, written to a temporary name and renamed, so readers never see half a file:
    result_columns (empty where a run lacks one)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=result_columns(rows), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if value is None else value for key, value in row.items()})
    staging = sweep_dir / f".{RESULTS_FILE}.tmp"
    staging.write_text(buffer.getvalue())
    os.replace(staging, sweep_dir / RESULTS_FILE)
    return sweep_dir / RESULTS_FILE


def _process_alive(status: dict[str, Any]) -> bool:
    if status.get("host") != socket.gethostname() or not status.get("pid"):
        return False
    try:
        os.kill(int(status["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _slurm_task_active(job: str) -> bool:
    """Whether SLURM still lists the array task (pending or running); False where squeue is absent."""
    try:
        result = subprocess.run(["squeue", "--noheader", "--jobs", job, "--format=%T"],
                                capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and bool(result.stdout.strip())
