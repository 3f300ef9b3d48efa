"""ELECTRA: a small masked-LM generator and a discriminator trained to spot its replacements.
Its spec, naming model.py's model and hf.py's adapter."""

from __future__ import annotations

from scaletrain.families.electra.hf import ADAPTER
from scaletrain.families.electra.model import (
    OBJECTIVE,
    ElectraConfig,
    batch_schema,
    build,
    counts,
    electra_loss,
    evaluation_counts,
    evaluation_values,
    pipeline_layers,
    validate,
)
from scaletrain.families.electra.replaced_tokens import REPLACED_TOKEN_DETECTION
from scaletrain.model.family import ModelFamily

FAMILY = ModelFamily(
    name="electra",
    config_class=ElectraConfig,
    build=build,
    pipeline_layers=pipeline_layers,
    loss=electra_loss,
    objectives=(OBJECTIVE,),
    own_objectives=(REPLACED_TOKEN_DETECTION,),
    batch_schema=batch_schema,
    counts=counts,
    validate=validate,
    hf=ADAPTER,
    evaluation_counts=evaluation_counts,
    evaluation_values=evaluation_values,
    generation=None,
    not_generating_reason="ELECTRA is a discriminator with a masked-LM generator, not a left-to-right generator; "
                          "fill masks with the exported generator (ElectraForMaskedLM, `scaletrain export`) or "
                          "train a gpt, llama or t5 run to generate",
)
