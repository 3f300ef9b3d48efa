"""A pipelined evaluation reports the family's own metrics, as one rank does: BERT's masked-token
accuracy, counted on the last stage from what its loss function receives (train/step.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.families import FAMILIES, get_family
from tests.train.runs import REPO, run_scaletrain, tiny_overrides

BERT_CONFIG = REPO / "configs" / "bert_tiny.yaml"


def test_every_family_with_its_own_metrics_counts_them_in_pipeline_stages_too():
    for name in FAMILIES:
        family = get_family(name)
        if family.evaluation_counts is not None and family.pipeline_objectives:
            assert family.pipeline_evaluation_counts is not None, name


def evaluations(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record for record in records if "val_loss" in record}


@pytest.mark.slow
def test_a_pp2_bert_logs_the_masked_accuracy_of_one_rank(small_dataset: Path, tmp_path: Path):
    steps = ["train.steps=4", "train.eval_every=4", "model.num_layers=2", "model.hidden_size=64",
             "model.seq_length=32", "train.lr=3e-3"]
    single, pipelined = tmp_path / "pp1", tmp_path / "pp2"
    run_scaletrain("train", [str(BERT_CONFIG), *tiny_overrides(small_dataset, single), *steps], nproc=1)
    run_scaletrain("train", [str(BERT_CONFIG), *tiny_overrides(small_dataset, pipelined), *steps,
                             "parallel.pipeline=2"], nproc=2)
    ours, reference = evaluations(pipelined), evaluations(single)
    assert sorted(ours) == sorted(reference) == [0, 4]
    assert reference[4]["val_masked_accuracy"] > 0  # a count that can differ, not 0 == 0
    for step in (0, 4):
        assert ours[step]["val_masked_accuracy"] == reference[step]["val_masked_accuracy"]
        assert ours[step]["val_loss"] == pytest.approx(reference[step]["val_loss"], rel=1e-4)
