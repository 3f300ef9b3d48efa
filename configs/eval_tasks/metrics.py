"""The per-document metrics of the local next-line and cloze tasks (their YAMLs' `process_results`): lm-eval's own,
and gold_loss, the task loss of the OLMo ladder.

gold_loss is the gold (correct) continuation's negative log-likelihood in bits per UTF-8 byte of its text,
-ln p(gold | context) / (ln 2 * bytes(gold)), averaged over the documents: the task loss that step 1 of Bhagia et
al. 2024 ("Establishing Task Scaling Laws via Compute-Efficient Model Ladders") predicts from N and D, normalised
as the ladder's code computes it: the `bpb` metric of allenai/OLMo olmo/eval/downstream.py (ICLMetric: the correct
continuation's summed log-probability over its UTF-8 bytes, times log2 e), which olmo/scaling/scaling_laws/utils.py
names as each task's `task_loss_key`.
Normalised by bytes, not tokens, so models with other tokenizers compare; it keeps falling with scale where
accuracy sits at chance, which is why the ladder fits it (scaletrain/scaling/downstream.py, TASK_LOSS_METRICS).

This file sits beside the YAMLs that name it (`!function metrics.next_line_results`), so plain lm-eval on an
export runs the tasks with nothing of scaletrain installed.
"""

from __future__ import annotations

import math

import numpy as np


def gold_bits_per_byte(loglikelihood: float, gold: str) -> float:
    return -loglikelihood / (math.log(2) * len(gold.encode("utf-8")))


def next_line_results(doc: dict, results: list[tuple[float, bool]]) -> dict[str, float]:
    """acc and acc_norm as lm-eval 0.4.13 computes them for multiple_choice (ConfigurableTask.process_results: the
    choice of the highest log-likelihood, and of the highest per character), and the gold choice's gold_loss."""
    loglikelihoods = np.array([loglikelihood for loglikelihood, _ in results])
    choices, gold = doc["choices"], doc["label"]
    characters = np.array([float(len(choice)) for choice in choices])
    return {"acc": 1.0 if np.argmax(loglikelihoods) == gold else 0.0,
            "acc_norm": 1.0 if np.argmax(loglikelihoods / characters) == gold else 0.0,
            "gold_loss": gold_bits_per_byte(float(loglikelihoods[gold]), choices[gold])}


def cloze_results(doc: dict, results: list[tuple[float, bool]]) -> dict[str, float]:
    """perplexity and acc as lm-eval 0.4.13 computes them for loglikelihood (the word's log-likelihood, which the
    perplexity aggregation exponentiates, and whether it is the greedy continuation), and the word's gold_loss."""
    ((loglikelihood, is_greedy),) = results
    return {"perplexity": loglikelihood, "acc": int(is_greedy),
            "gold_loss": gold_bits_per_byte(loglikelihood, doc["target"])}
