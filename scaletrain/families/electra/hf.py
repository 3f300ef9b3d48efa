"""ELECTRA weights to and from Hugging Face: the generator as `ElectraForMaskedLM` in OUT/generator,
the discriminator as `ElectraForPreTraining` in OUT/discriminator (google's releases are two such
models too, e.g. google/electra-base-generator and -discriminator).

Both HF models hold a copy of the shared `ElectraEmbeddings` (our `embedding.*`); an import takes
them from the discriminator and refuses a pair whose copies differ. HF splits our fused [Q; K; V] in
three; the generator's decoder is tied to the word embedding as ours. The vocabulary is our padded
one (conversion.py explains why).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from scaletrain.checkpoint.hf.conversion import (
    StateDict,
    check_all_taken,
    check_vocabulary_rows,
    fp32,
    hf_model,
    take,
    weights_only,
)
from scaletrain.checkpoint.hf.reading import load_checked
from scaletrain.config import Config
from scaletrain.data.tokenizer import SPECIAL_IDS
from scaletrain.families.electra.model import ElectraConfig as OurElectraConfig
from scaletrain.families.electra.model import EncoderShape
from scaletrain.model.family import HFAdapter

if TYPE_CHECKING:  # transformers is imported by the functions that convert (1.6 s)
    from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

FAMILY = "electra"
GENERATOR_DIR, DISCRIMINATOR_DIR = "generator", "discriminator"
EMBEDDINGS = (  # (ours, HF's under electra.embeddings), shared by both models
    ("embedding.word.weight", "word_embeddings.weight"),
    ("embedding.position.weight", "position_embeddings.weight"),
    ("embedding.token_type.weight", "token_type_embeddings.weight"),
    ("embedding.norm.weight", "LayerNorm.weight"),
    ("embedding.norm.bias", "LayerNorm.bias"),
)
HEADS = {
    GENERATOR_DIR: (("generator.lm_head.dense", "generator_predictions.dense"),
                    ("generator.lm_head.norm", "generator_predictions.LayerNorm")),
    DISCRIMINATOR_DIR: (("discriminator.head.dense", "discriminator_predictions.dense"),
                        ("discriminator.head.prediction", "discriminator_predictions.dense_prediction")),
}
BLOCK = (
    ("attention.output", "attention.output.dense"), ("attention_norm", "attention.output.LayerNorm"),
    ("mlp.fc", "intermediate.dense"), ("mlp.proj", "output.dense"), ("mlp_norm", "output.LayerNorm"),
)


def hf_config(model: OurElectraConfig, shape: EncoderShape, vocab_size: int, type_vocab_size: int) -> ElectraConfig:
    """HF's config of one of the two encoders (`shape`: model.generator or model.discriminator)."""
    from transformers import ElectraConfig

    return ElectraConfig(
        vocab_size=vocab_size, embedding_size=model.embedding_width, hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads, intermediate_size=shape.ffn_size,
        hidden_act="gelu",  # exact erf GELU, as our blocks and heads
        hidden_dropout_prob=model.dropout, attention_probs_dropout_prob=model.dropout,
        max_position_embeddings=model.seq_length, type_vocab_size=type_vocab_size,
        initializer_range=model.init_std, layer_norm_eps=model.layernorm_eps, pad_token_id=SPECIAL_IDS["pad"],
    )


def export_hf(state: StateDict, config: OurElectraConfig, vocab_size: int, out_dir: str | Path) -> Path:
    """Write out_dir/generator and out_dir/discriminator, each loadable with `from_pretrained`."""
    weights = weights_only(state)
    check_vocabulary_rows(weights, "embedding.word.weight", vocab_size)
    generator, discriminator = to_hf(weights, config, vocab_size)
    generator.save_pretrained(Path(out_dir) / GENERATOR_DIR)
    discriminator.save_pretrained(Path(out_dir) / DISCRIMINATOR_DIR)
    return Path(out_dir)


def to_hf(weights: StateDict, config: OurElectraConfig, vocab_size: int
          ) -> tuple[ElectraForMaskedLM, ElectraForPreTraining]:
    """HF's generator and discriminator holding `weights`, every one of which must have its place."""
    from transformers import ElectraForMaskedLM, ElectraForPreTraining

    weights = dict(weights)
    type_vocab_size = take(weights, "embedding.token_type.weight", FAMILY, keep=True).shape[0]
    embeddings = {f"electra.embeddings.{hf_name}": take(weights, ours, FAMILY) for ours, hf_name in EMBEDDINGS}
    models = []
    for stack, shape, model_class in ((GENERATOR_DIR, config.generator, ElectraForMaskedLM),
                                      (DISCRIMINATOR_DIR, config.discriminator, ElectraForPreTraining)):
        hf_state = dict(embeddings)
        for ours, hf_name in _encoder_names(stack, shape, config.embedding_width):
            hf_state[hf_name] = take(weights, ours, FAMILY)
        for layer in range(shape.num_layers):
            for kind in ("weight", "bias"):
                query, key, value = take(weights, f"{stack}.blocks.{layer}.attention.qkv.{kind}", FAMILY).chunk(3)
                prefix = f"electra.encoder.layer.{layer}.attention.self"
                hf_state |= {f"{prefix}.query.{kind}": query, f"{prefix}.key.{kind}": key,
                             f"{prefix}.value.{kind}": value}
        if stack == GENERATOR_DIR:  # the decoder is the word embedding; its bias is ours
            hf_state["generator_lm_head.weight"] = embeddings["electra.embeddings.word_embeddings.weight"]
            hf_state["generator_lm_head.bias"] = take(weights, "generator.lm_head.bias", FAMILY)
        models.append(hf_model(model_class, hf_config(config, shape, vocab_size, type_vocab_size), hf_state))
    check_all_taken(weights, FAMILY)
    return models[0], models[1]


def import_hf(hf_dir: str | Path) -> StateDict:
    """Our TP=1 state dict from a directory holding generator/ (ElectraForMaskedLM) and
    discriminator/ (ElectraForPreTraining), as `export_hf` writes it."""
    from transformers import ElectraForMaskedLM, ElectraForPreTraining

    hf_dir = Path(hf_dir)
    for name, model_class in ((GENERATOR_DIR, "ElectraForMaskedLM"), (DISCRIMINATOR_DIR, "ElectraForPreTraining")):
        if not (hf_dir / name / "config.json").is_file():
            raise ValueError(f"{hf_dir} has no {name}/config.json; an ELECTRA import reads {hf_dir}/{GENERATOR_DIR} "
                             f"and {hf_dir}/{DISCRIMINATOR_DIR}, a {model_class} each (as `scaletrain export` "
                             "writes them): put the two models there")
    generator = load_checked(ElectraForMaskedLM, hf_dir / GENERATOR_DIR).state_dict()
    discriminator = load_checked(ElectraForPreTraining, hf_dir / DISCRIMINATOR_DIR).state_dict()
    weights = {}
    for ours, hf_name in EMBEDDINGS:
        shared = discriminator[f"electra.embeddings.{hf_name}"]
        if not torch.equal(shared, generator[f"electra.embeddings.{hf_name}"]):
            raise ValueError(f"electra.embeddings.{hf_name} differs between {hf_dir}/{GENERATOR_DIR} and "
                             f"{hf_dir}/{DISCRIMINATOR_DIR}; ELECTRA shares its embeddings, so import a pair "
                             "trained together")
        weights[ours] = fp32(shared)
    for stack, hf_state in ((GENERATOR_DIR, generator), (DISCRIMINATOR_DIR, discriminator)):
        num_layers = 1 + max(int(name.split(".")[3]) for name in hf_state if name.startswith("electra.encoder.layer."))
        weights |= {ours: fp32(hf_state[hf_name]) for ours, hf_name in _encoder_names(stack, None, None, num_layers)
                    if hf_name in hf_state}
        for layer in range(num_layers):
            prefix = f"electra.encoder.layer.{layer}.attention.self"
            for kind in ("weight", "bias"):
                parts = [hf_state[f"{prefix}.{projection}.{kind}"] for projection in ("query", "key", "value")]
                weights[f"{stack}.blocks.{layer}.attention.qkv.{kind}"] = fp32(torch.cat(parts, dim=0))
    weights["generator.lm_head.bias"] = fp32(generator["generator_lm_head.bias"])
    return weights


def _encoder_names(stack: str, shape: EncoderShape | None, embedding_width: int | None,
                   num_layers: int | None = None) -> list[tuple[str, str]]:
    """(our name, HF's name) of one encoder's projection, blocks (but the fused QKV) and head. The
    projection is listed if the widths differ; with no shape (an import) it is listed always, and
    taken if HF's model has it."""
    modules = list(HEADS[stack])
    if shape is None or embedding_width != shape.hidden_size:
        modules.append((f"{stack}.embedding_project", "electra.embeddings_project"))
    for layer in range(num_layers if shape is None else shape.num_layers):
        modules += [(f"{stack}.blocks.{layer}.{ours}", f"electra.encoder.layer.{layer}.{hf_name}")
                    for ours, hf_name in BLOCK]
    return [(f"{ours}.{kind}", f"{hf_name}.{kind}") for ours, hf_name in modules for kind in ("weight", "bias")]


def _export(state: StateDict, config: Config, out_dir: Path) -> None:
    export_hf(state, config.model, config.padded_vocab_size, out_dir)


ADAPTER = HFAdapter(
    model_class="ElectraForMaskedLM + ElectraForPreTraining",
    export=_export,
    import_=import_hf,
    # data/masking.py: packed [CLS] text [SEP], as BERT's
    text_framing=("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    token_types=True,
    model_dirs=(GENERATOR_DIR, DISCRIMINATOR_DIR),
)
