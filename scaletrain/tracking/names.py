"""The names metrics go by in W&B and TensorBoard: namespaced, where metrics.jsonl's stay flat.

Trackers group a chart section by the part of a name before its first slash, so the ecosystem's
names (OLMo-core's `train/`, torchtitan's `loss_metrics/`...) put training, evaluation and speed
in sections of their own. metrics.jsonl keeps the flat names because scripts, sweep results and
scaling-law fits read them.
"""

from __future__ import annotations

from typing import Any

# metrics.jsonl name -> tracker name (changed in issue 21; README "What a run writes").
TRACKER_NAMES = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "skipped_steps": "train/skipped_steps",
    "tokens": "train/tokens",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "train_time_s": "perf/train_time_s",
    "mfu": "perf/mfu",
    "data_wait_fraction": "perf/data_wait_fraction",
}
VALIDATION_PREFIX = "val_"


def tracker_name(key: str) -> str:
    """A metric's tracker name. Validation metrics move from `val_` to `eval/` whatever they are
    (a family's own, e.g. BERT's val_masked_accuracy -> eval/masked_accuracy), and a blend's
    per-dataset ones keep their dataset last (val_loss/wiki -> eval/loss/wiki), so one prefix
    gathers a metric's curves for every dataset. A name not listed is passed on unchanged."""
    if key in TRACKER_NAMES:
        return TRACKER_NAMES[key]
    if key.startswith(VALIDATION_PREFIX):
        return "eval/" + key.removeprefix(VALIDATION_PREFIX)
    return key


def tracker_values(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl record's values under their tracker names; the step is the trackers' own axis."""
    return {tracker_name(key): value for key, value in record.items() if key != "step"}
