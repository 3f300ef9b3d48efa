"""ALBERT: BERT with a factorised embedding and blocks shared across layers.
Its spec, naming model.py's model and hf.py's adapter."""

from __future__ import annotations

from scaletrain.families.albert.hf import ADAPTER
from scaletrain.families.albert.model import AlbertConfig, batch_schema, build, counts, pipeline_layers, validate
from scaletrain.model.encoder import evaluation_counts, mlm_loss, pipeline_evaluation_counts
from scaletrain.model.family import ModelFamily

FAMILY = ModelFamily(
    name="albert",
    config_class=AlbertConfig,
    build=build,
    pipeline_layers=pipeline_layers,
    loss=mlm_loss,
    objectives=("mlm",),
    pipeline_objectives=("mlm",),
    batch_schema=batch_schema,
    counts=counts,
    validate=validate,
    hf=ADAPTER,
    evaluation_counts=evaluation_counts,
    pipeline_evaluation_counts=pipeline_evaluation_counts,
    generation=None,
    not_generating_reason="ALBERT is a masked LM, not a left-to-right generator; fill masks with the exported "
                          "AlbertForMaskedLM (`scaletrain export`) or train a gpt, llama or t5 run to generate",
)
