"""GPT-2/GPT-3 decoders: causal or prefix LM, learned positions, tied output layer, optional MoE.
Its spec, naming model.py's model and hf.py's adapter."""

from __future__ import annotations

from scaletrain.families.gpt.hf import ADAPTER
from scaletrain.families.gpt.model import GPTConfig, build, counts, pipeline_layers, validate
from scaletrain.model.decoder import decoder_batch, lm_loss
from scaletrain.model.family import ModelFamily

FAMILY = ModelFamily(
    name="gpt",
    config_class=GPTConfig,
    build=build,
    pipeline_layers=pipeline_layers,
    loss=lm_loss,
    objectives=("causal_lm", "prefix_lm"),
    pipeline_objectives=("causal_lm", "prefix_lm"),
    sequence_parallel=True,
    context_parallel=True,
    batch_schema=decoder_batch,
    counts=counts,
    validate=validate,
    hf=ADAPTER,
    generation="causal",
)
