"""T5 (v1.0 and v1.1) encoder-decoders: relative position buckets, span corruption or prefix LM.
Its spec, naming model.py's model and hf.py's adapter."""

from __future__ import annotations

from scaletrain.batch import BatchSchema
from scaletrain.families.t5.hf import ADAPTER
from scaletrain.families.t5.model import T5Config, build, counts, pipeline_layers, validate
from scaletrain.families.t5.span_corruption import SPAN_CORRUPTION
from scaletrain.model.family import ModelFamily
from scaletrain.model.layers import masked_vocab_parallel_loss

FAMILY = ModelFamily(
    name="t5",
    config_class=T5Config,
    build=build,
    pipeline_layers=pipeline_layers,
    loss=lambda outputs, labels: masked_vocab_parallel_loss(outputs[0], labels[0]),
    objectives=("span_corruption", "prefix_lm"),
    pipeline_objectives=("span_corruption", "prefix_lm"),
    own_objectives=(SPAN_CORRUPTION,),
    batch_schema=lambda config: BatchSchema(
        inputs=("encoder_tokens", "decoder_tokens", "encoder_padding_mask", "decoder_padding_mask"), labels=("labels",)
    ),
    counts=counts,
    validate=validate,
    hf=ADAPTER,
    encoder_decoder=True,
    generation="seq2seq",
)
