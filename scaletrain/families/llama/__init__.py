"""Llama, Mistral (sliding window) and Mixtral (MoE) decoders: RMSNorm, RoPE, SwiGLU, GQA.
Its spec, naming model.py's model and hf.py's adapter."""

from __future__ import annotations

from scaletrain.families.llama.hf import ADAPTER
from scaletrain.families.llama.model import LlamaConfig, build, counts, pipeline_layers, validate
from scaletrain.model.decoder import decoder_batch, lm_loss
from scaletrain.model.family import ModelFamily

FAMILY = ModelFamily(
    name="llama",
    config_class=LlamaConfig,
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
