"""BART encoder-decoders: learned positions, denoising (text infilling, sentence permutation).
Its spec, naming model.py's model and hf.py's adapter."""

from __future__ import annotations

from scaletrain.batch import BatchSchema
from scaletrain.families.bart.hf import ADAPTER
from scaletrain.families.bart.model import BartConfig, build, counts, pipeline_layers, validate
from scaletrain.families.bart.noising import DENOISING
from scaletrain.model.family import ModelFamily
from scaletrain.model.layers import masked_vocab_parallel_loss

FAMILY = ModelFamily(
    name="bart",
    config_class=BartConfig,
    build=build,
    pipeline_layers=pipeline_layers,
    loss=lambda outputs, labels: masked_vocab_parallel_loss(outputs[0], labels[0]),
    objectives=("denoising",),
    pipeline_objectives=("denoising",),
    own_objectives=(DENOISING,),
    batch_schema=lambda config: BatchSchema(
        inputs=("encoder_tokens", "decoder_tokens", "encoder_padding_mask", "decoder_padding_mask"), labels=("labels",)
    ),
    counts=counts,
    validate=validate,
    hf=ADAPTER,
    encoder_decoder=True,
    generation="seq2seq_eos_start",
)
